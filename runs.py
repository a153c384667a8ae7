"""runs.py: what a training run leaves behind, and what can stop it.

A run directory (train.py writes it, evaluate.py and `train.load_trained` read it):

    config.json       the resolved Config; --resume starts from it
    metrics.jsonl     one JSON line per iteration (Tracker); trimmed to the checkpoint on resume
    samples/          evaluation grids iter-NNNNNN.png (videos: animated .webp), each with a .json of every
                      sample's prompt, noise, rewards
    checkpoints/      iter-NNNNNN/ (torch.distributed.checkpoint shards, rng-rank*.pt, state.json, manifest.json)
                      and `latest`, naming the newest whole checkpoint
    final/            the export: a diffusers LoRA (pipe.load_lora_weights) or a full transformer (from_pretrained)

Every checkpoint and export is written to a temporary directory and renamed, so a crash at any point leaves the
previous one whole; a checkpoint is verified against its manifest (sizes and sha256) before it is read, and its
pickled metadata is read with an allow-list, so resuming a checkpoint from elsewhere cannot run code.
The process helpers below are the identity in one process and collectives under torchrun.
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import pickle
import re
import resource
import shutil
import signal
import sys
import textwrap
import types
import typing
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

import rewards


# ----------------------------------------------------------------------------------------------
# Errors a user can fix: one line each, from one rank; the traceback only when asked for (DEBUG_VARIABLE=1)

DEBUG_VARIABLE = "VGRPO_DEBUG"


class UserError(Exception):
    """A problem the user can act on, reported as one line ending in what to do; exit_code says which kind."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """Bad input (flags, files, a checkpoint that is not what it should be), found before or at loading: exit 2."""

    exit_code = 2


class RunStopped(UserError):
    """A run that cannot go on (diverged, a reward server failed, the disk is full): exit 1, the last checkpoint kept."""


@contextlib.contextmanager
def one_line_errors():
    """The top-level handler of train.py and evaluate.py: a UserError becomes `error: ...` on stderr from rank 0 only
    (every rank finds the same, or was told by rank 0) and its exit code; Ctrl-C before the training loop takes over
    (model loading, the tiny fit) stops quietly. With VGRPO_DEBUG=1 the traceback is shown, for reports."""
    try:
        yield
    except (UserError, KeyboardInterrupt) as error:
        if dist.is_initialized():  # every rank raised it together (or was killed): leave gloo / nccl cleanly
            dist.destroy_process_group()
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        if isinstance(error, KeyboardInterrupt):
            print("stopped (Ctrl-C) before the first iteration: nothing to save", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(error.exit_code) from None


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
# Checks before a run starts, and what it says at its end

GiB = 2**30


def check_run_dir(path: str) -> None:
    """The run directory can be made and written, checked with a probe file before anything is loaded (a read-only
    file system or a path under /proc failed only at the first save, after the model was built)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".write-test-{os.getpid()}"  # one per process: torchrun's ranks check at once
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"--run_dir {path}: cannot write there ({error.strerror or error}); pass a writable "
                          "directory") from None


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
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory / GiB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def closing_summary(run_dir: Path, cfg, model, curves: bool) -> str:
    """The files a user opens next, and how the export loads."""
    grids = sorted(p for p in (run_dir / "samples").glob("iter-*") if p.suffix in (".png", ".webp"))
    if cfg.lora_rank:
        load = f'{model.pipeline_class}.from_pretrained(BASE).load_lora_weights("{run_dir}/final")'
    else:
        load = f'{type(model.transformer).__name__}.from_pretrained("{run_dir}/final/transformer")'
    lines = [f"done: {run_dir}",
             f"  samples  {grids[0]} (before) .. {grids[-1]} (after); prompts and rewards in the .json beside each"
             if grids else "  samples  none (--eval_every 0)",
             f"  curves   {run_dir / 'curves.png'}" if curves else "  curves   pip install matplotlib to draw curves.png",
             f"  metrics  {run_dir / 'metrics.jsonl'}",
             f"  export   {run_dir / 'final'}: {load}",
             f"  compare  python evaluate.py --runs {run_dir}"]
    return "\n".join(lines)


def summary_table(history: list[tuple[int, float, float | None]]) -> str:
    every = max(1, len(history) // 10)
    rows = [h for i, h in enumerate(history) if i % every == 0 or i == len(history) - 1]
    lines = ["iteration | reward_mean | eval reward_mean", "--------- | ----------- | ----------------"]
    lines += [f"{it:9d} | {r:11.4f} | " + ("" if e is None else f"{e:16.4f}") for it, r, e in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Processes: rank 0 decides, every rank agrees


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate x along dim 0 over ranks in rank order (identity in one process)."""
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def reduce_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average over ranks; min/max for keys ending _min/_max."""
    if not dist.is_initialized():
        return metrics
    out = {}
    for key, value in metrics.items():
        x = torch.tensor(value, dtype=torch.float64, device=device)
        op = dist.ReduceOp.MIN if key.endswith("_min") else dist.ReduceOp.MAX if key.endswith("_max") else dist.ReduceOp.SUM
        dist.all_reduce(x, op=op)
        out[key] = x.item() / (dist.get_world_size() if op == dist.ReduceOp.SUM else 1)
    return out


def first_failure(message: str) -> str:
    """The first non-empty message of any rank, on every rank ('' if none): a failure one rank meets stops all."""
    if not dist.is_initialized():
        return message
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m), "")


def broadcast_from_rank0(value: str) -> str:
    """Rank 0's value on every rank (identity in one process)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# config.json


def read_run_config(path: Path, config_class) -> dict:
    """A run's config.json, refused in one line if it is not the one train.py wrote (truncated, hand-edited)."""
    try:
        saved = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); restore it or start a new run") from None
    names = {f.name for f in dataclasses.fields(config_class)}
    if not isinstance(saved, dict) or not set(saved) <= names:
        unknown = sorted(set(saved) - names) if isinstance(saved, dict) else saved
        raise ConfigError(f"{path} is not a train.py config (unknown entries {unknown}); restore it or start a new run")
    hints = typing.get_type_hints(config_class)
    for name, value in saved.items():
        if not of_type(value, hints[name]):
            raise ConfigError(f"{path}: {name} is {value!r}, not a {getattr(hints[name], '__name__', hints[name])}; "
                              "restore it or start a new run")
    return saved


def of_type(value, kind) -> bool:
    """A JSON value as a Config field of type kind holds it (an int where a float goes; a bool is not a number)."""
    if isinstance(kind, types.UnionType):
        return any(of_type(value, k) for k in kind.__args__)
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool) == isinstance(value, bool)


# ----------------------------------------------------------------------------------------------
# Checkpoints: torch.distributed.checkpoint (sharded), written to a temp dir then renamed


def state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: the frozen base is not saved (it is reloaded from --model), so loading cannot be strict;
    # load_checkpoint checks instead that only frozen parameters were missing.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def save_checkpoint(run_dir: Path, iteration: int, transformer, optimizer, rank: int, ema: dict | None = None) -> None:
    """model (trainable weights), optim (AdamW) and, with an EMA, ema {parameter name: float32 tensor, sharded as the
    weights}: one DCP checkpoint, plus each rank's RNG state, state.json and the manifest. Written to a temporary
    directory and renamed; `latest` moves only once the checkpoint is whole. A write that fails (a full disk) removes
    the temporary directory and stops the run in one line, `latest` still naming the previous checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = run_dir / "checkpoints"
    tmp, final = root / f".tmp-{iteration:06d}", root / f"iter-{iteration:06d}"
    add_unstepped_state(optimizer)
    model_state, optim_state = get_state_dict(transformer, optimizer, options=state_options())
    try:
        dcp.save({"model": model_state, "optim": optim_state, **({"ema": ema} if ema else {})}, checkpoint_id=str(tmp))
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   tmp / f"rng-rank{rank}.pt")
        barrier()
        if rank == 0:
            (tmp / "state.json").write_text(json.dumps({"iteration": iteration}))
            (tmp / MANIFEST).write_text(json.dumps(manifest(tmp), indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            (root / "latest.tmp").write_text(final.name)
            os.replace(root / "latest.tmp", root / "latest")  # the pointer moves only once the checkpoint is whole
            for old in root.glob("iter-*"):
                if old != final:
                    shutil.rmtree(old)
    except (OSError, CheckpointException) as error:  # DCP reports a rank's OSError as a CheckpointException
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            (root / "latest.tmp").unlink()
        latest = root / "latest"
        kept = f"{latest} still names {latest.read_text()}" if latest.is_file() else "no checkpoint was written before"
        cause = getattr(error, "strerror", None) or str(error).strip().splitlines()[-1][:200]
        raise RunStopped(f"could not write checkpoint {final} ({cause}): is the disk full? {kept}; free space and "
                         f"--resume {run_dir}") from None
    barrier()


def add_unstepped_state(optimizer: torch.optim.AdamW) -> None:
    """AdamW keeps no state for a parameter that never had a gradient: one whose output nothing reads, as LoRA on
    Qwen-Image's last text-stream output projection (the image tokens alone leave the last block). Loading expects a
    state for every trainable parameter (torch.distributed.checkpoint initialises them all), so such a parameter gets
    the state AdamW itself would create at its first step: step 0, zero moments. That changes no update."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


MANIFEST = "manifest.json"


def manifest(directory: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file of a checkpoint but the manifest itself."""
    import hashlib

    entries = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 24), b""):
                digest.update(block)
        entries[str(path.relative_to(directory))] = [path.stat().st_size, digest.hexdigest()]
    return entries


def checkpoint_problem(path: Path) -> str:
    """'' if the checkpoint is the one save_checkpoint wrote (every file of its manifest present, same size and
    sha256, nothing added), else what differs: resuming flipped bytes silently trained on garbage."""
    try:
        expected = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{path / MANIFEST} is missing or unreadable"
    found = manifest(path)
    if found == expected:
        return ""
    changed = sorted(name for name in set(found) | set(expected) if found.get(name) != expected.get(name))
    return f"{', '.join(changed[:5])} differ from {path / MANIFEST} (size or sha256; files missing, changed or added)"


class CheckpointUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this loads only the classes DCP writes into it, so a planted pickle in a
    checkpoint from elsewhere cannot run code on --resume (plain pickle would call anything it names)."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               *(("torch.distributed.checkpoint.metadata", name) for name in (
                   "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                   "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeCheckpointReader(dcp.FileSystemReader):
    """FileSystemReader with .metadata read by CheckpointUnpickler (tensors are read with weights_only=True by DCP)."""

    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as file:
            metadata = CheckpointUnpickler(file).load()
        # Every file the metadata points at must lie in the checkpoint's own folder: a .metadata of allowed classes
        # could otherwise name ../../elsewhere.distcp and resume from a file nobody checked against the manifest.
        root = Path(self.path).resolve()
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            target = (root / str(info.relative_path)).resolve()
            if target.parent != root:
                raise pickle.UnpicklingError(f"its metadata points at {info.relative_path}, outside the checkpoint folder")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_checkpoint(run_dir: Path, transformer, optimizer, rank: int, ema: dict | None = None) -> int:
    """Restores model, optimizer, EMA (in place into `ema`'s tensors) and RNG states after checking the checkpoint
    against its manifest; returns the iteration to continue from. Refuses, in one line naming the file, a checkpoint
    that is not what save_checkpoint wrote, that does not fit the model of the run's config.json, or whose weights are
    not finite. Any world size resumes any checkpoint: DCP reshards the weights, optimizer and EMA, and a rank without
    an RNG file of its own keeps its fresh seed (the algorithm draws nothing from the global RNG: every draw is a pure
    function of the seed, the iteration and an index)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = run_dir / "checkpoints"
    name = (root / "latest").read_text().strip()
    path = root / name

    def refused(problem: str) -> ConfigError:
        return ConfigError(f"--resume {run_dir}: refusing the checkpoint: {problem}; a run keeps only its latest "
                           "checkpoint: restore the run directory from a copy or start a new run")

    problem = "" if re.fullmatch(r"iter-\d{6}", name) else f"{root / 'latest'} names {name!r}, not an iter-NNNNNN checkpoint"
    problem = broadcast_from_rank0(problem or (checkpoint_problem(path) if rank == 0 else ""))
    if problem:
        raise refused(problem)
    model_state, optim_state = get_state_dict(transformer, optimizer, options=state_options())
    state = {"model": model_state, "optim": optim_state, **({"ema": ema} if ema else {})}
    reader = SafeCheckpointReader(path)
    try:  # here, so a refusal is one line (inside dcp.load it becomes a CheckpointException)
        needed = {}  # shard file -> the bytes its metadata reads from it
        for info in reader.read_metadata().storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        present = {shard: (path / shard).stat().st_size for shard in needed}
        short = [f"{shard} ({present[shard]} bytes, its metadata needs {size})"
                 for shard, size in needed.items() if present[shard] < size]
    except (pickle.UnpicklingError, OSError, AttributeError, EOFError) as error:
        raise refused(f"{path / '.metadata'}: {error}") from None
    if short:
        raise refused(f"{short[0]} is truncated")
    try:
        dcp.load(state, storage_reader=reader)
        keys = set_state_dict(transformer, optimizer, model_state_dict=state["model"],
                              optim_state_dict=state["optim"], options=state_options())
    except (Exception, CheckpointException) as error:  # DCP's (a BaseException) wraps each rank's: a missing key, a
        # size mismatch, a bad shard; its last line is the cause
        reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--resume {run_dir}: checkpoint {path} does not fit the model and adapter of its config.json "
                          f"(model, lora_rank, lora_targets, ema_decay), or a shard is damaged ({reason}); restore "
                          "config.json as the run wrote it, or start a new run") from None
    frozen = {n for n, p in transformer.named_parameters() if not p.requires_grad}
    if keys.unexpected_keys or set(keys.missing_keys) - frozen:
        raise ConfigError(f"checkpoint {path} does not match the model: missing trainable "
                          f"{sorted(set(keys.missing_keys) - frozen)[:5]}, unexpected {keys.unexpected_keys[:5]}")
    tensors = {f"weight {n}": p for n, p in transformer.named_parameters() if p.requires_grad}
    tensors |= {f"EMA {n}": e for n, e in (ema or {}).items()}
    tensors |= {f"AdamW {k}": v for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    bad = [n for n, v in tensors.items() if not torch.isfinite(v.to_local() if hasattr(v, "to_local") else v).all()]
    if reduce_metrics({"bad_max": float(bool(bad))}, _device_of(transformer))["bad_max"]:  # every rank agrees
        raise refused(f"it holds values that are not finite ({bad[0] if bad else 'on another rank'})")
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.is_file():
        try:
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"]:
                torch.cuda.set_rng_state_all(rng["cuda"])
        except Exception as error:  # a torn file: torch's reader raises RuntimeError, pickle's UnpicklingError, ...
            raise refused(f"{rng_file} cannot be read ({type(error).__name__})") from None
    try:
        return int(json.loads((path / "state.json").read_text())["iteration"]) + 1
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise refused(f"{path / 'state.json'} cannot be read ({type(error).__name__})") from None


def _device_of(module: torch.nn.Module) -> torch.device:
    parameter = next(module.parameters())
    return parameter.device if parameter.device.type != "meta" else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Export: what a user loads into diffusers


def export_final(out: Path, model, lora: bool, rank: int, info: dict | None = None) -> None:
    """LoRA in the diffusers LoRA format (pipe.load_lora_weights) or the full transformer
    (from_pretrained), gathered from the shards onto rank 0; export.json beside it says which weights it holds
    (info: trained or EMA, the iteration)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model.transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    # Written whole into a temp dir, then renamed: a kill during the export never leaves a truncated final/.
    tmp, old = out.with_name(f".{out.name}.tmp"), out.with_name(f".{out.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    write_export(tmp, model, full, lora)
    (tmp / "export.json").write_text(json.dumps(info or {"weights": "trained"}, indent=1))
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def write_export(out: Path, model, full: dict, lora: bool) -> None:
    if lora:
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(model.transformer, state_dict=full)
        # The adapter config (rank, lora_alpha, targets) travels in the file's metadata: without it
        # load_lora_weights applies scale 1 instead of lora_alpha / rank.
        type(model.pipe).save_lora_weights(out, transformer_lora_layers=layers,
                                           transformer_lora_adapter_metadata=model.transformer.peft_config["default"].to_dict())
    else:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        model.transformer.save_config(out / "transformer")
        save_file({k: v.contiguous() for k, v in full.items()}, out / "transformer" / "diffusion_pytorch_model.safetensors")


# ----------------------------------------------------------------------------------------------
# Metrics and sample grids


def trim_metrics(path: Path, start: int) -> None:
    """Drop the lines of iterations >= start: after a resume they are redone, and a stop between logging and
    checkpointing would otherwise leave them in metrics.jsonl twice. Rewritten through a temp file."""
    if not path.is_file():
        return
    kept, torn = [], 0
    for line in filter(None, path.read_text().splitlines()):
        try:
            if json.loads(line)["iteration"] < start:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line a crash cut short: say so and drop it
            torn += 1
    if torn:
        print(f"note: {path}: dropped {torn} incomplete line(s) that a crash left", flush=True)
    path.with_suffix(".tmp").write_text("".join(line + "\n" for line in kept))
    os.replace(path.with_suffix(".tmp"), path)


class Tracker:
    """metrics.jsonl always; tensorboard or wandb when asked; rank 0 only (others get a no-op)."""

    def __init__(self, run_dir: Path, cfg, active: bool, start: int = 0):
        self.active, self.backend = active, None
        if not active:
            return
        trim_metrics(run_dir / "metrics.jsonl", start)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if cfg.tracker == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.backend = SummaryWriter(str(run_dir / "tensorboard"))
        elif cfg.tracker == "wandb":
            import wandb

            self.backend = wandb.init(project="v-grpo", dir=str(run_dir), config=asdict(cfg), resume="allow")

    def log(self, iteration: int, metrics: dict) -> None:
        if not self.active:
            return
        self.file.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if hasattr(self.backend, "add_scalar"):
            for k, v in scalars.items():
                self.backend.add_scalar(k, v, iteration)
        elif self.backend is not None:
            self.backend.log(scalars, step=iteration)


GRID_SAMPLES = 16  # evaluation samples drawn in each grid (the JSON beside it lists all of rank 0's)


def save_samples(images: torch.Tensor, captions: list[str], records: list[dict] | None, path: Path,
                 columns: int = 8, fps: int = 8) -> Path:
    """The evaluation samples a person can read: one grid (rows of up to `columns`) with each sample's caption
    (prompt and rewards) under it, cells at least 128 px wide (tiny images are enlarged, nearest), and, given records,
    a JSON file beside it with the prompts, noise indices and rewards of every sample (the grid shows the first
    len(images)). Images (B, 3, H, W) give a PNG; videos (B, F, 3, H, W) an animated WebP of F grids at `fps`
    (lossless, looping; PIL writes it, no video codec needed). Returns the file written."""
    from PIL import Image, ImageDraw

    videos = images if images.dim() == 5 else images[:, None]
    cell = max(128, videos.shape[-1])
    lines = [textwrap.wrap(c, width=cell // 6)[:4] for c in captions]  # the default bitmap font is ~6 px per char
    text_h = 11 * max(len(w) for w in lines) + 4
    cols = min(columns, len(videos))
    rows = math.ceil(len(videos) / cols)
    grids = []
    for frame in videos.unbind(1):
        pictures = [p.resize((cell, round(cell * p.height / p.width)), Image.NEAREST) for p in rewards.to_pil(frame)]
        grid = Image.new("RGB", (cols * cell, rows * (pictures[0].height + text_h)), "white")
        draw = ImageDraw.Draw(grid)
        for i, (picture, wrapped) in enumerate(zip(pictures, lines)):
            x, y = (i % cols) * cell, (i // cols) * (picture.height + text_h)
            grid.paste(picture, (x, y))
            draw.multiline_text((x + 2, y + picture.height + 2), "\n".join(wrapped), fill="black", spacing=1)
        grids.append(grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    if len(grids) > 1:
        path = path.with_suffix(".webp")
        grids[0].save(path, save_all=True, append_images=grids[1:], duration=round(1000 / fps), loop=0, lossless=True)
    else:
        grids[0].save(path)
    if records is not None:
        path.with_suffix(".json").write_text(json.dumps(records, indent=1))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    """The lines of run_dir/metrics.jsonl ([] if there is none); a line torn by a crash is left out."""
    path, history = run_dir / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            history.append(json.loads(line))
    return history


def draw_curves(run_dir: Path) -> bool:
    """run_dir/curves.png from its metrics.jsonl: training reward per reward name, evaluation rewards, the KL terms
    and the clip fraction against the iteration. False (nothing drawn) if matplotlib is not installed."""
    return plot_curves(read_metrics(run_dir), run_dir / "curves.png")


# ----------------------------------------------------------------------------------------------
# Reward hacking: the rules that warn (or stop the run with --stop_on_hacking)


def hacking(evals: list[dict], monitored: list[str], *, window: int, z: float, samples: int) -> str:
    """'' unless the last evaluation against the one `window` evaluations earlier shows the trained reward
    (eval/reward_mean) higher while a monitored reward's mean fell by more than z standard errors of the difference,
    sqrt(se_then^2 + se_now^2) with se = std over the evaluation samples / sqrt(samples): the model scores better on
    what it is trained on and worse on what it does not see. Evaluation noise alone crosses z = 3 about 1 time in
    700 per monitored reward and evaluation."""
    if len(evals) <= window:
        return ""
    then, now = evals[-1 - window], evals[-1]
    if not now["eval/reward_mean"] > then["eval/reward_mean"]:
        return ""
    reasons = []
    for name in monitored:
        before, after = then[f"eval/{name}_mean"], now[f"eval/{name}_mean"]
        se = math.hypot(then[f"eval/{name}_std"], now[f"eval/{name}_std"]) / math.sqrt(samples)
        if before - after > z * se:
            reasons.append(f"the monitored {name} fell from {before:.4g} to {after:.4g} ({(before - after) / se:.1f} "
                           f"standard errors) while the trained reward rose from {then['eval/reward_mean']:.4g} to "
                           f"{now['eval/reward_mean']:.4g} (iterations {then['iteration']} -> {now['iteration']})")
    return "; ".join(reasons)


def x0_drift(x0_rms: float, first: float, bound: float) -> str:
    """'' unless the rollouts' mean latent RMS moved from the first iteration's by more than the relative bound
    (0: not checked): images drifting brighter, more saturated or towards noise move it."""
    if not bound or abs(x0_rms / first - 1) <= bound:
        return ""
    return f"the rollouts' latent RMS moved from {first:.4g} to {x0_rms:.4g}, beyond --max_x0_drift {bound:g}"


def plot_curves(history: list[dict], path: Path) -> bool:
    """Four panels against the iteration from per-iteration metric dicts (each with "iteration"); False if matplotlib
    is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = {"training reward": lambda k: k.startswith("reward/") and k.endswith("_mean"),
              "evaluation reward": lambda k: k.startswith("eval/") and k.endswith("_mean"),
              "KL": lambda k: k in ("kl", "approx_kl"), "clip fraction": lambda k: k == "clipfrac"}
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, wanted) in zip(axes, panels.items()):
        for key in sorted({k for m in history for k in m if wanted(k)}):
            points = [(m["iteration"], m[key]) for m in history if key in m]
            ax.plot(*zip(*points), marker="o" if len(points) < 20 else None, markersize=3,
                    label=key.removeprefix("reward/").removeprefix("eval/").removesuffix("_mean"))
        ax.set(title=title, xlabel="iteration")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


