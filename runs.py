"""runs.py: the run directory: what a training run leaves behind, and how the same command continues it.

A run directory (train.py writes it, evaluate.py and `train.load_trained` read it):

    config.json       the resolved Config; a continued run starts from it
    metrics.jsonl     one JSON line per iteration (Tracker); trimmed to the checkpoint when a run continues
    samples/          evaluation grids iter-NNNNNN.png (videos: animated .webp), each with a .json of every
                      sample's prompt, noise, rewards
    curves.png        training and evaluation curves (matplotlib)
    checkpoints/      iter-NNNNNN/ and `latest`, naming the newest whole one (checkpoint.py)
    final/            the export: a diffusers LoRA (pipe.load_lora_weights) or a full transformer (from_pretrained)
    tracker.json      the wandb run id, so a continued run logs to the same wandb run

The same command run again continues its run directory (a Slurm requeue, torchrun --max_restarts, a user pressing
up-arrow): from the last checkpoint, the metrics lines after it replaced once, the tracker's run continued; a finished
run says so and changes nothing. A command whose settings differ is refused, except in what changes no result (how
long the run is, how often it logs, evaluates and saves, how it uses the hardware): --resume continues with changed
settings, --fresh starts the run over (its own files removed, nothing else), another --run_dir starts another.
"""

import contextlib
import dataclasses
import json
import math
import os
import re
import resource
import shutil
import textwrap
import types
import typing
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

import rewards
from failures import ConfigError

# ----------------------------------------------------------------------------------------------
# Continuing a run: the same command again

RUN_FILES = ("config.json", "metrics.jsonl", "samples", "curves.png", "checkpoints", "final", "tracker.json",
             "tensorboard", "wandb")  # what --fresh removes, and what makes a directory hold a run


def holds_run(run_dir: Path) -> bool:
    return (Path(run_dir) / "config.json").is_file()


def checkpoint_iteration(run_dir: Path) -> int | None:
    """The iteration of the checkpoint `latest` names (None: no checkpoint yet)."""
    latest = Path(run_dir) / "checkpoints" / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    return int(name[5:]) if re.fullmatch(r"iter-\d{6}", name) else None


def export_iteration(run_dir: Path) -> int | None:
    """The iteration whose weights final/ holds (None: no export yet)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return int(json.loads((Path(run_dir) / "final" / "export.json").read_text())["iteration"])
    return None


def check_run_dir(path: str, continuing: bool, fresh: bool) -> None:
    """The run directory can be made and written (a probe file, before anything is loaded: a read-only file system
    or a path under /proc failed only at the first save), and holds nothing train.py would overwrite without being
    asked: run files without the config.json of a run are refused unless --fresh."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".write-test-{os.getpid()}"  # one per process: torchrun's ranks check at once
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"--run_dir {path}: cannot write there ({error.strerror or error}); pass a writable "
                          "directory") from None
    found = sorted(name for name in RUN_FILES if (Path(path) / name).exists())
    if found and not continuing and not fresh:
        raise ConfigError(f"--run_dir {path} holds {', '.join(found)} but no config.json of a run: pass --fresh to "
                          "replace them, or another --run_dir")


def start_run_dir(run_dir: Path, config: dict, fresh: bool) -> None:
    """Rank 0, before anything is loaded: with fresh, remove the run's own files (RUN_FILES; nothing else in the
    directory); remove what an interrupted save left (leftovers); write config.json (a temporary file renamed, so a
    kill leaves the old one or the new one whole)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        for name in RUN_FILES:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    for path in leftovers(run_dir):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (run_dir / "config.json.tmp").write_text(json.dumps(config, indent=2))
    os.replace(run_dir / "config.json.tmp", run_dir / "config.json")


def leftovers(run_dir: Path) -> list[Path]:
    """What a save interrupted by a crash or a kill leaves: a checkpoint's temporary directory or its pointer's
    temporary file, a checkpoint complete but not yet (or no longer) named by `latest`, an export's temporary
    directories, a metrics file being rewritten."""
    root = run_dir / "checkpoints"
    latest = root / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    found = [*root.glob(".tmp-*"), *root.glob("latest.tmp"), *(p for p in root.glob("iter-*") if p.name != named),
             *run_dir.glob(".final.tmp"), *run_dir.glob(".final.old"), *run_dir.glob("metrics.tmp"),
             *run_dir.glob("config.json.tmp")]
    return [p for p in found if p.exists()]


def continuation(run_dir: Path, start: int, iterations: int) -> str:
    """The line a continued run prints: from where, and what it redoes."""
    if not start:
        return f"starting {run_dir} again from iteration 0: it holds no checkpoint yet"
    done = export_iteration(run_dir)
    extended = f"; final/ (iteration {done}) is replaced at the end" if done is not None else ""
    return (f"continuing {run_dir} at iteration {start} of {iterations} from its checkpoint of iteration {start - 1}"
            f" (metrics.jsonl lines from {start} on are redone){extended}")


# ----------------------------------------------------------------------------------------------
# What a run says at its end


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


def summary_table(metrics: list[dict]) -> str:
    """About ten rows of the run's metrics.jsonl: the training and evaluation reward against the iteration."""
    every = max(1, len(metrics) // 10)
    rows = [m for i, m in enumerate(metrics) if i % every == 0 or i == len(metrics) - 1]
    lines = ["iteration | reward_mean | eval reward_mean", "--------- | ----------- | ----------------"]
    lines += [f"{m['iteration']:9d} | {m['reward_mean']:11.4f} | "
              + ("" if m.get("eval/reward_mean") is None else f"{m['eval/reward_mean']:16.4f}") for m in rows]
    return "\n".join(lines)


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
            raise ConfigError(f"{path}: {name} is {value!r}, not {described(hints[name])}; restore it or start a new "
                              "run")
    return saved


def described(kind) -> str:
    """A Config field's type in words: float -> "a number", float | None -> "a number or null"."""
    if isinstance(kind, types.UnionType):
        return " or ".join(described(k) for k in kind.__args__)
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}[kind]


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
    """metrics.jsonl always; tensorboard or wandb when asked; rank 0 only (others get a no-op). A continued run
    (start > 0) drops the lines of iterations >= start and continues the tracker's run: tensorboard hides the events
    from start on (purge_step), wandb resumes the run whose id tracker.json keeps."""

    def __init__(self, run_dir: Path, cfg, active: bool, start: int = 0):
        self.active, self.backend = active, None
        if not active:
            return
        trim_metrics(run_dir / "metrics.jsonl", start)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if cfg.tracker == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.backend = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start)
        elif cfg.tracker == "wandb":
            import wandb

            self.backend = wandb.init(project="v-grpo", dir=str(run_dir), config=asdict(cfg), id=wandb_id(run_dir),
                                      resume="allow")

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


def wandb_id(run_dir: Path) -> str:
    """The id of the run directory's wandb run, made at its first start and kept in tracker.json."""
    path = run_dir / "tracker.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads(path.read_text())["wandb_id"])
    run_id = uuid.uuid4().hex[:16]
    path.write_text(json.dumps({"wandb_id": run_id}))
    return run_id


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


CURVE_PANELS = {"training reward": lambda k: k.startswith("reward/") and k.endswith("_mean"),
                "evaluation reward": lambda k: k.startswith("eval/") and k.endswith("_mean"),
                "KL": lambda k: k in ("kl", "approx_kl", "ref_kl"), "clip fraction": lambda k: k == "clipfrac"}


def curve_series(history: list[dict]) -> dict[str, dict[str, list[tuple]]]:
    """{panel: {label: [(iteration, value), ...]}}: the metrics of each panel (CURVE_PANELS), one series per distinct
    curve: metrics with the very same points share one line, labelled with every name ("color = reward": the
    weighted reward of a single reward is that reward)."""
    panels = {}
    for title, wanted in CURVE_PANELS.items():
        by_points = {}
        for key in sorted({k for m in history for k in m if wanted(k)}):
            points = tuple((m["iteration"], m[key]) for m in history if key in m)
            by_points.setdefault(points, []).append(key.removeprefix("reward/").removeprefix("eval/").removesuffix("_mean"))
        panels[title] = {" = ".join(names): list(points) for points, names in by_points.items()}
    return panels


def plot_curves(history: list[dict], path: Path) -> bool:
    """curve_series' four panels against the iteration from per-iteration metric dicts (each with "iteration");
    False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = curve_series(history)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, series) in zip(axes, panels.items()):
        for label, points in series.items():
            ax.plot(*zip(*points), marker="o" if len(points) < 20 else None, markersize=3, label=label)
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


