"""failures.py: what can stop a run, and the one line it says then.

Every problem a user can act on is a UserError (ConfigError: bad input, exit 2; RunStopped: a run that cannot go on,
exit 1), reported by one_line_errors as one line from one rank, the traceback only with VGRPO_DEBUG=1. Also here:
Ctrl-C before the training loop, library messages nobody can act on, and sizes no machine holds. What watches a
training run and stops it (divergence, reward hacking) is guards.py's. This file imports nothing of the project's,
and torch only inside functions: train.py and evaluate.py import it first, to catch a Ctrl-C during their imports.
"""

import contextlib
import logging
import os
import signal
import sys

# ----------------------------------------------------------------------------------------------
# Errors a user can fix: one line each, from one rank


DEBUG_VARIABLE = "VGRPO_DEBUG"


class UserError(Exception):
    """A problem the user can act on, reported as one line ending in what to do; exit_code says which kind, from_rank
    which rank says it (every rank finds the same problem, or was told by that rank)."""

    exit_code = 1
    from_rank = 0


class ConfigError(UserError, ValueError):
    """Bad input (flags, files, a checkpoint that is not what it should be), found before or at loading: exit 2."""

    exit_code = 2


class RunStopped(UserError):
    """A run that cannot go on (diverged, a reward server failed, the disk is full): exit 1, the last checkpoint kept."""


@contextlib.contextmanager
def one_line_errors():
    """The top-level handler of train.py and evaluate.py: a UserError becomes `error: ...` on stderr from one rank
    (its from_rank) and its exit code; Ctrl-C before the training loop takes over (model loading, the tiny fit) stops
    quietly. With VGRPO_DEBUG=1 the traceback is shown, for reports."""
    try:
        yield
    except (UserError, KeyboardInterrupt) as error:
        import torch.distributed as dist

        if dist.is_initialized():  # every rank raised it together (or was killed): leave gloo / nccl cleanly
            dist.destroy_process_group()
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        if isinstance(error, KeyboardInterrupt):
            if os.environ.get("RANK", "0") == "0":
                print("stopped (Ctrl-C) before the first iteration: nothing to save", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        if int(os.environ.get("RANK", "0")) == error.from_rank:
            print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(error.exit_code) from None


def quiet_ctrl_c_while_importing() -> None:
    """Ctrl-C during a script's imports (torch and diffusers take seconds): one line and exit 130, not a traceback
    from inside an import. main() installs the handlers of the run itself (remember_ctrl_c)."""
    def handler(signum, frame):
        if os.environ.get("RANK", "0") == "0":
            print("stopped (Ctrl-C) while starting: nothing to save", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, handler)


_ctrl_c = {"pressed": False}


def remember_ctrl_c() -> None:
    """Ctrl-C before the training loop raises KeyboardInterrupt as usual and is also remembered: a library that
    swallows the exception (seen once in CI: a Ctrl-C during the tiny model's setup, and the run trained on for a
    minute) cannot make the run go on, since stop_if_ctrl_c() raises it again before the first iteration."""
    def handler(signum, frame):
        _ctrl_c["pressed"] = True
        raise KeyboardInterrupt

    _ctrl_c["pressed"] = False
    signal.signal(signal.SIGINT, handler)


def stop_if_ctrl_c() -> None:
    if _ctrl_c["pressed"]:
        raise KeyboardInterrupt


# Messages the libraries print on a default run that say nothing a user of this project can act on, matched by
# their text: transformers' "CLIPImageProcessor / SiglipImageProcessor requires torchvision ... falling back to the
# PIL processor" (printed when diffusers imports its IP-adapter classes; every processor here is the PIL one anyway),
# diffusers' "No LoRA keys associated to CLIPTextModelWithProjection" (pipe.load_lora_weights on an export that,
# by design, trains only the transformer), and its "modules ... that should be kept in float32: []" when a cast has an
# empty list of such modules to keep. Every other warning still prints.
KNOWN_NOISE = ("requires torchvision (not installed); falling back to", "No LoRA keys associated to ",
               "that should be kept in float32: []")


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in KNOWN_NOISE)


def quiet_known_noise() -> None:
    """Drop KNOWN_NOISE from transformers' and diffusers' log handlers (their records reach the library's root
    logger's handler, where the filter sits). Call before the first pipeline is imported."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (transformers_logging, diffusers_logging):
        library.get_logger()  # creates the library's handler if it has none yet
        for handler in logging.getLogger(library.__name__.split(".")[0]).handlers:
            handler.addFilter(_KnownNoise())


# ----------------------------------------------------------------------------------------------
# Sizes no machine holds, refused before loading


GiB = 2**30


def check_sizes(cfg, world_size: int, memory_gb: float) -> None:
    """Refuse, before loading, sizes no machine of memory_gb holds: a lower bound of one rank's iteration from the
    sizes alone, float32 final latents and K noises of its samples (at least 4 channels at 1/8 of the resolution, a
    latent frame per 4 video frames) plus one rollout batch of decoded images or videos. (Before: --resolution 1048576
    tried to allocate 4 TB after the model was built; --group_size 1000000000 ran on silently.) The memory plan
    (--plan) is the precise check on GPUs."""
    samples = cfg.num_prompts // world_size * cfg.group_size
    frames, pixels = max(1, cfg.num_frames), cfg.resolution * (cfg.width or cfg.resolution)
    latent = 4 * 4 * pixels // 64 * (1 + (frames - 1) // 4)
    needed = (samples * (cfg.num_mc + 1) * latent + min(cfg.rollout_batch_size, samples) * 4 * 3 * pixels * frames)
    if needed > memory_gb * GiB:
        raise ConfigError(f"--resolution {cfg.resolution}, {samples} samples per rank and --num_mc {cfg.num_mc} need at "
                          f"least {needed / GiB:.3g} GiB per rank (latents, noises and one rollout batch of "
                          f"images), more than the {memory_gb:.3g} GiB here; lower them")


def machine_memory_gb() -> float:
    """What one rank computes in: its GPU's memory, else the machine's RAM."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory / GiB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
