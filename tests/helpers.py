"""Helpers shared by the tests: running train.py and evaluate.py, reading what a run wrote, the checks several
test files make (same training in 1 and N processes, an export that reproduces training).
"""

import contextlib
import gc
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import embeddings
from filelock import FileLock

import adapters
import builders
import parallel
import reward_bridge
import rewards
import train

ROOT = Path(__file__).resolve().parent.parent  # the project root: train.py, evaluate.py, ...


# One gradient step per batch (the tiny preset takes 2): iteration 0 then measures the initial model itself, which the
# 1-against-N-process comparisons rely on, and every step is taken at ratio 1.
SMALL_RUN = ["--iterations", "2", "--num_prompts", "2", "--group_size", "4", "--micro_batch_size", "4",
             "--sampling_steps", "4", "--eval_every", "1", "--eval_samples", "6", "--tiny_fit_steps", "0",
             "--num_grad_steps", "1"]


def run_train(*args, nproc=0, here=True, timeout=600):
    """train.py under torchrun with nproc processes, as a subprocess; with nproc=0 and `here`, `python train.py ARGS`
    as train.main(ARGS) in this process (the same code less a fresh interpreter's ~8 s of imports), stdout captured.
    Real-width runs pass here=False: their gigabytes then leave with their process, not with the worker's allocator
    (two xdist workers and a torchrun test share 24 GB)."""
    if not nproc and here:
        proc = run_here(train.main, *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if nproc else None  # 2 processes on 2 cores
    proc = subprocess.run([sys.executable, *launcher, str(ROOT / "train.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    # "done:" is printed by rank 0 after the export, whose collectives need every rank: the run is complete.
    aborted_after_done = "done: " in proc.stdout and parallel.gloo_teardown_abort(proc.stdout + proc.stderr)
    assert proc.returncode == 0 or aborted_after_done, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_here(main, *args) -> subprocess.CompletedProcess:
    """main(args) (train.main, evaluate.main) in this process, reported as the finished `python SCRIPT ARGS` would
    be: its exit code, stdout and stderr. The signal handlers a run installs (they hold the run, its model included)
    are put back as they were."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as stop:
        code = stop.code or 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        gc.collect()  # a run's model is held in reference cycles: gigabytes at real width until the next collection
    return subprocess.CompletedProcess([main.__module__, *map(str, args)], code, out.getvalue(), err.getvalue())


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def one_line_stop(main, argv, capsys, code=2) -> str:
    """main(argv) (train.main or evaluate.main) stops with exit code `code` (2: bad input, 1: a stopped run) and one
    line on stderr starting "error: ", which is returned."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    lines = err.replace("\r", "\n").splitlines()  # model loading draws progress bars on stderr before it
    assert exit_info.value.code == code and lines[-1].startswith("error: "), (exit_info.value.code, err)
    assert "Traceback" not in err and sum(line.startswith("error") for line in lines) == 1, err
    return lines[-1]


def lora_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(Path(run_dir) / "final" / "pytorch_lora_weights.safetensors")


def adapter_for(pipe, family, dtype=torch.float32, **settings):
    settings = {"resolution": 32, "sampling_steps": 5, "max_sequence_length": 8, **settings}
    return adapters.ADAPTERS[family](pipe, dtype, **settings)


IMAGE_FAMILIES = [family for family, adapter in adapters.ADAPTERS.items() if not adapter.video]


def assert_same_training(one, many):
    """Runs `one` (1 process) and `many` (several) trained on the same data to the same model."""
    one, many = Path(one), Path(many)
    a_metrics, b_metrics = read_metrics(one), read_metrics(many)
    for a, b in zip(a_metrics, b_metrics, strict=True):
        assert a["prompt_indices"] == b["prompt_indices"]
        # Same data: rollouts, rewards and advantages are world-size independent.
        for key in ("reward_mean", "reward_std", "frac_zero_std_groups", "surrogate_cv", "eval/reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # Iteration 0 runs on the initial weights, before any optimizer step, so it compares the model itself.
    # Rounding differs with batch sizes (the text encoder sees 1 vs 2 prompts), so rewards differ by an ULP and
    # advantages divide that by a within-group std of ~0.002: loss and gradient agree to ~1e-5 relative. A model
    # that differs across ranks (e.g. LoRA initialised per rank: FSDP2 then shards a mix of two models) is off
    # by percents.
    assert b_metrics[0]["loss"] == pytest.approx(a_metrics[0]["loss"], abs=1e-4)
    assert b_metrics[0]["grad_norm"] == pytest.approx(a_metrics[0]["grad_norm"], rel=1e-3)
    # After a step no element-wise tolerance is safe: Adam moves each weight by ~lr whatever its gradient's size,
    # so where a gradient component is near 0, ULP-level noise flips the sign of an lr-sized step (seen: 1 element
    # in 1024 off by 1.03e-4). Compare the whole update instead. lora_B starts at 0 in both runs, so it IS the
    # update: sign flips of a few near-zero components move its norm by sqrt(flipped fraction), a per-rank model
    # mismatch decorrelates it (relative difference ~1). Measured: 7.8e-4 for 2 processes.
    for kind in ("lora_B", "lora_A"):
        w_one = torch.cat([v.flatten() for k, v in sorted(lora_weights(one).items()) if kind in k])
        w_many = torch.cat([v.flatten() for k, v in sorted(lora_weights(many).items()) if kind in k])
        assert w_one.norm() > 0 and ((w_many - w_one).norm() / w_one.norm()).item() < 0.05, kind


def assert_export_reproduces_training(run_dir, base_dir, family, *, lora):
    """`final/` loaded with the ordinary diffusers calls gives the trained transformer's output to float rounding."""
    from diffusers import DiffusionPipeline

    trained = train.load_trained(run_dir, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, *trained.latent_shape(), generator=g)
    t, cond = torch.tensor([0.3, 0.8]), trained.encode(["a red car", "a blue flower"])
    # A fresh transformer from base_dir; the frozen text encoders and VAE (the LoRA has no keys for them, and the
    # velocities below take `cond` as given) are the trained model's, not a second load of gigabytes at real width.
    frozen = {k: v for k, v in trained.pipe.components.items() if k not in ("transformer", "scheduler")}
    pipe = DiffusionPipeline.from_pretrained(base_dir, dtype=torch.float32, **frozen)
    loaded = adapter_for(pipe, family, resolution=trained.resolution, num_frames=trained.num_frames)
    with torch.no_grad():
        want, before = trained.velocity(z, t, cond), loaded.velocity(z, t, cond)
        if lora:
            pipe.load_lora_weights(run_dir / "final")
        else:
            loaded.transformer = type(pipe.transformer).from_pretrained(run_dir / "final" / "transformer")
        got = loaded.velocity(z, t, cond)
    assert (want - before).abs().max() > 1e-4  # training moved the model, so the check below can fail
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def assert_preset_iteration(run_dir, base_dir, preset: str, name: str):
    """One iteration of `preset` trained on the saved pipeline of REAL_CONFIGS[name]: finite metrics, no skipped step,
    the preset's LoRA rank and alpha in the run's config, and an export that reproduces training."""
    metrics = read_metrics(run_dir)[0]
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "reward_mean")) and metrics["skipped_steps"] == 0
    config = json.loads((Path(run_dir) / "config.json").read_text())
    assert (config["lora_rank"], config["lora_alpha"]) == (train.PRESETS[preset]["lora_rank"],
                                                           train.PRESETS[preset]["lora_alpha"])
    assert_export_reproduces_training(run_dir, base_dir, builders.REAL_CONFIGS[name]["family"], lora=True)


def smooth_images(n, h=40, w=56, seed=0):
    """Low-frequency images quantised to uint8 levels (PNG and PIL round trips are then lossless)."""
    g = torch.Generator().manual_seed(seed)
    img = F.interpolate(torch.rand(n, 3, 5, 7, generator=g), size=(h, w), mode="bilinear", align_corners=False)
    return (img * 255).round() / 255


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_geneval_scorer():
    """GenEvalScorer with a stand-in detector (a 'dog' box on the left half whose confidence is the image's mean red,
    a 'cat' box on the right half with the mean blue) and colours named by the crop's strongest channel."""
    def detect(images):
        return [{"dog": [rewards.Detection((0, 0, image.shape[1] / 2 - 1, image.shape[0] - 1), float(image[..., 0].mean() / 255))],
                 "cat": [rewards.Detection((image.shape[1] / 2, 0, image.shape[1] - 1, image.shape[0] - 1),
                                           float(image[..., 2].mean() / 255))]} for image in images]

    def colors(image, objects, name):
        crops = [reward_bridge.geneval_crop(image, d)[0].mean((1, 2)) for d in objects]
        return [("red", "green", "blue")[int(c.argmax())] for c in crops]

    return reward_bridge.GenEvalScorer(detect, colors, threshold=0.2)


REAL_SMALL_RUN = ["--resolution", "64", "--max_sequence_length", "8", "--rewards", "color:1", "--num_prompts", "1",
                  "--group_size", "2", "--rollout_batch_size", "2", "--sampling_steps", "2", "--iterations", "1",
                  "--eval_every", "0", "--tiny_fit_steps", "0"]


SAVED_REAL = {"sd3": "sd3.5-medium", "flux": "flux.1-dev", "qwenimage": "qwen-image", "flux2": "flux.2-klein-4b",
              "wan": "wan2.1-t2v-1.3b"}


# bf16 runs at real width use 4 image tokens (32 px) and 4 T5 tokens: the widths, dtypes and layouts under test do not
# depend on the token count, and the time does (with the bf16_matmul_fast fixture too: bf16_matmul.py).
BF16_TOKENS = ["--resolution", "32", "--max_sequence_length", "4"]


DIFFUSERS_FROM_GRID = embeddings.get_2d_sincos_pos_embed_from_grid  # before conftest puts the one below in its place


def sincos_table_from_grid(embed_dim: int, grid: torch.Tensor, output_type: str = "pt") -> torch.Tensor:
    """diffusers' get_2d_sincos_pos_embed_from_grid, the same numbers in float32 (conftest.sd3_position_table_fast
    says why): its first half of the channels is the 1-D table of grid[0], its second of grid[1], and each coordinate
    is constant along one axis of the grid. So diffusers' own 1-D function runs on one line of each, and the lines are
    broadcast into the one table allocated (fresh pages cost the kernel's zeroing: a table of gathered halves and their
    concatenation was 3 times the table's bytes). grid: (2, 1, H, W) -> (H * W, embed_dim)."""
    _, _, height, width = grid.shape
    if grid.is_meta:  # a model built on the meta device (the memory plan): shapes only
        return torch.empty(height * width, embed_dim, device="meta")
    table, half = torch.empty(height, width, embed_dim), embed_dim // 2
    for coords, channels in (grid[0, 0], slice(0, half)), (grid[1, 0], slice(half, embed_dim)):
        line = coords[:1, :] if torch.equal(coords, coords[:1, :].expand_as(coords)) else coords[:, :1]
        assert torch.equal(coords, line.expand_as(coords)), "a coordinate that varies along both axes of the grid"
        rows = embeddings.get_1d_sincos_pos_embed_from_grid(half, line, output_type)  # (line's length, D / 2)
        table[..., channels] = rows.view(*line.shape, half)
    return table.view(height * width, embed_dim)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A directory that build(path) fills, made once per test session: under pytest-xdist the first worker to ask
    builds it in the session's shared temporary directory while the others wait on a lock (the real-width pipelines
    take a minute, and each worker would otherwise build its own). Tests copy it before changing anything in it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    path = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{path}.lock"):
        if not Path(f"{path}.done").is_file():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            Path(f"{path}.done").touch()
    return path
