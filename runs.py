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
import math
import os
import resource
import textwrap
import types
import typing
from dataclasses import asdict
from pathlib import Path

import torch

import failures
import rewards


# ----------------------------------------------------------------------------------------------
# Checks before a run starts, and what it says at its end


def check_run_dir(path: str) -> None:
    """The run directory can be made and written, checked with a probe file before anything is loaded (a read-only
    file system or a path under /proc failed only at the first save, after the model was built)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".write-test-{os.getpid()}"  # one per process: torchrun's ranks check at once
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise failures.ConfigError(f"--run_dir {path}: cannot write there ({error.strerror or error}); pass a writable "
                          "directory") from None


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
# config.json


def read_run_config(path: Path, config_class) -> dict:
    """A run's config.json, refused in one line if it is not the one train.py wrote (truncated, hand-edited)."""
    try:
        saved = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise failures.ConfigError(f"{path} is not valid JSON ({error}); restore it or start a new run") from None
    names = {f.name for f in dataclasses.fields(config_class)}
    if not isinstance(saved, dict) or not set(saved) <= names:
        unknown = sorted(set(saved) - names) if isinstance(saved, dict) else saved
        raise failures.ConfigError(f"{path} is not a train.py config (unknown entries {unknown}); restore it or start a new run")
    hints = typing.get_type_hints(config_class)
    for name, value in saved.items():
        if not of_type(value, hints[name]):
            raise failures.ConfigError(f"{path}: {name} is {value!r}, not a {getattr(hints[name], '__name__', hints[name])}; "
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


