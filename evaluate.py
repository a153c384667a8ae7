"""evaluate.py: a base model, trained runs and exported LoRAs scored side by side on a fixed benchmark.

    python evaluate.py --runs runs/NAME                        # a run against its base, on its own settings
    python evaluate.py --preset sd35m --runs runs/A --prompts drawbench --rewards pickscore,hpsv21,imagereward,clipscore
    torchrun --nproc_per_node=8 evaluate.py --preset sd35m --runs runs/B --prompts geneval --rewards geneval \
        --samples_per_prompt 4                                  # GenEval's protocol (a server: rewards.py serve geneval)
    python evaluate.py --model stabilityai/stable-diffusion-3.5-medium --loras runs/A/final --prompts ocr

On the paper's sets (ocr, geneval, pickscore, drawbench) the default protocol is DiffusionNFT's evaluation script, the
paper's (PAPER_PROTOCOL, PAPER_REWARDS: 40 Euler steps, no CFG, 512 px, one image per prompt, its rewards per set),
and the table ends with the paper's published Table 3 rows for the columns it shares.

Rows: the base model (unless --no-base), each run directory's last checkpoint (exactly as training left it), each
exported LoRA loaded with pipe.load_lora_weights. Every row samples the same prompts from the same noise (sample j
of prompt i: a pure function of (seed, i, j)) with one sampler: the first run's (its config.json), else the preset's,
each setting overridable by its flag. Under torchrun every rank holds a whole model and samples its share of the
prompts (no FSDP: nothing is trained); the scores are gathered on rank 0.

Metrics: each reward's mean over prompts of its per-prompt mean, with a 95% confidence interval over prompts
(mean +- 1.96 std / sqrt(prompts)); `geneval` adds GenEval's accuracy (its summary_scores.py: the mean over the six
tasks of the fraction of correct images) and the per-task accuracies; `ocr` is the OCR accuracy Flow-GRPO reports
(1 - normalised edit distance). Writes OUT/eval.json (settings; per row: metrics and every sample's scores),
OUT/table.md (also printed) and OUT/grid.png (one row per model, the first prompts as columns).
"""

import failures  # isort: split  (first: it imports no torch, and catches a Ctrl-C during the imports below)

if __name__ == "__main__":
    failures.quiet_ctrl_c_while_importing()

import argparse
import dataclasses
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import adapters
import builders
import models
import parallel
import prompts as prompt_sets
import rewards
import rollouts
import runs
import train
from failures import ConfigError

# train.Config settings a row samples with; each is also a flag here.
SAMPLER = ("model", "resolution", "width", "num_frames", "max_sequence_length", "sampling_steps", "solver", "cfg_scale",
           "flux_guidance", "dtype", "rollout_batch_size", "offload_text_encoders", "tiny_fit_steps", "seed")
GRID_PROMPTS = 8  # prompts shown per model in grid.png

# The paper's evaluation (its Table 3) is DiffusionNFT's scripts/evaluation.py (NVlabs/DiffusionNFT@24af555), read from
# its code: each set's test split sampled by the pipeline's own call (SD3's FlowMatchEuler grid), 40 steps, guidance
# 1.0 (no CFG), 512 px, one image per prompt, scored by these rewards per set (its hpsv2 is HPSv2.1). A run
# evaluated on one of these sets samples so unless a flag says otherwise.
PAPER_PROTOCOL = dict(sampling_steps=40, solver="euler", cfg_scale=1.0, resolution=512)
PREFERENCE = "imagereward,pickscore,aesthetic,unifiedreward,clipscore,hpsv21"
PAPER_REWARDS = {"geneval": "geneval", "ocr": "ocr", "pickscore": PREFERENCE, "drawbench": PREFERENCE}
# The paper's Table 3 (SD3.5-M, the five-stage curriculum) by this file's column names: printed under a table with
# those columns, for reference (published numbers, not measured here; its CLIPScore column was not recovered).
PAPER_TABLE3 = {
    "SD3.5-M, no CFG (paper)": (0.24, 0.12, 0.2051, 0.204, 5.13, -0.58, 2.02),
    "SD3.5-M + CFG (paper)": (0.63, 0.59, 0.2234, 0.279, 5.36, 0.85, 3.03),
    "+ Flow-GRPO, >5K steps (paper)": (0.95, 0.66, 0.2251, 0.274, 5.32, 1.06, 3.18),
    "+ DiffusionNFT, ~1.7K steps (paper)": (0.94, 0.91, 0.2380, 0.331, 6.01, 1.49, 3.49),
    "+ V-GRPO, 580 steps (paper)": (0.91, 0.91, 0.2350, 0.341, 6.02, 1.52, 3.43),
}
PAPER_COLUMNS = ("geneval accuracy", "ocr", "pickscore", "hpsv21", "aesthetic", "imagereward", "unifiedreward")


@dataclass
class Row:
    name: str  # "base", "run:DIR" or "lora:DIR"
    scores: dict[str, list[float]]  # reward -> one score per sample, in sample order
    extras: dict[str, dict[str, list]]  # reward -> per-sample lists its server sent (geneval: accuracy, reasons)
    shown: list[int]  # global sample indices whose images come with the row (the grid's)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, train.Config]:
    """Evaluation flags, and the train.Config the rows sample with: defaults < preset < the first run's config.json <
    the sampler flags given here."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="", help="run directories, comma-separated: each one's last checkpoint")
    parser.add_argument("--loras", default="", help="exported LoRA directories (pipe.load_lora_weights), comma-separated")
    parser.add_argument("--base", action=argparse.BooleanOptionalAction, default=True, help="include the base model")
    parser.add_argument("--preset", default=None, help="train.py preset giving the base model and sampler")
    parser.add_argument("--prompts", default="", help="a named set (its test split; prompts.py) or a .txt / .jsonl "
                                                      "file; default: the first run's evaluation prompts")
    parser.add_argument("--max_prompts", type=int, default=0, help="the first N prompts only (0: all)")
    parser.add_argument("--samples_per_prompt", type=int, default=1, help="samples per prompt (GenEval reports 4)")
    parser.add_argument("--rewards", default="", help="reward names, comma-separated (weights are ignored); default: "
                                                      "the first run's")
    parser.add_argument("--reward_options", default=None, help="as train.py's")
    parser.add_argument("--out", default="", help="output directory; default: eval/<prompts>-<time>")
    defaults = train.Config()
    for name in SAMPLER:
        kind = type(getattr(defaults, name))
        if kind is bool:
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(f"--{name}", type=kind, default=None, help="default: the first run's, else the preset's")
    args = parser.parse_args(argv)
    for path in filter(None, args.runs.split(",")):
        if not (Path(path) / "checkpoints" / "latest").is_file():
            raise ConfigError(f"--runs {path}: no checkpoint there (checkpoints/latest is missing)")
    for path in filter(None, args.loras.split(",")):
        if not (Path(path) / "pytorch_lora_weights.safetensors").is_file():
            raise ConfigError(f"--loras {path}: no pytorch_lora_weights.safetensors there; pass a run's final/ directory")
    first_run = args.runs.split(",")[0] if args.runs else ""
    argv_cfg = ["--resume", first_run] if first_run else ["--preset", args.preset or "tiny"]
    cfg = train.parse_config(argv_cfg)
    given = {k: getattr(args, k) for k in (*SAMPLER, "reward_options") if getattr(args, k) is not None}
    if args.rewards:
        given["rewards"] = args.rewards
    if args.preset and first_run:  # the preset's base model and sampler, not the run's
        given = {**{k: v for k, v in train.PRESETS[args.preset].items() if k in (*SAMPLER, "rewards")}, **given}
    paper_set = args.prompts.partition(":")[0]
    if paper_set in PAPER_REWARDS:  # the paper's protocol for its sets, under the flags given here
        given = {**PAPER_PROTOCOL, "rewards": PAPER_REWARDS[paper_set], **given}
    # Evaluation scores exactly its rewards: a run's monitors are not trained on, so they can be among them.
    cfg = dataclasses.replace(cfg, **given, run_dir="", resume="", monitor_rewards="")
    if args.samples_per_prompt < 1 or args.max_prompts < 0:
        raise ConfigError("--samples_per_prompt must be >= 1 and --max_prompts >= 0")
    if not (args.base or args.runs or args.loras):
        raise ConfigError("nothing to evaluate: --no-base without --runs or --loras")
    return args, cfg


def evaluation_prompts(args: argparse.Namespace, cfg: train.Config, say) -> tuple[str, list[prompt_sets.Prompt]]:
    """--prompts (a named set's test split by default), else the evaluation prompts of the first run."""
    spec = args.prompts or cfg.eval_prompts or prompt_sets.test_split(cfg.prompts) or cfg.prompts
    listed = (prompt_sets.load(spec, split="test", say=say) if spec
              else [prompt_sets.Prompt(p, {}) for p in builders.tiny_prompts(models.model_family(cfg.model))])
    listed = listed[:args.max_prompts or None]
    prompt_sets.check_for_rewards(listed, rewards.parse_reward_spec(cfg.rewards), spec or "the built-in prompts")
    return spec or "tiny", listed


class Collected:
    """A reward that also keeps, call after call, the per-image lists its server sent with the scores."""

    def __init__(self, fn):
        self.fn, self.extras = fn, defaultdict(list)

    def __call__(self, images, texts, metadata):
        scores = self.fn(images, texts, metadata)
        for key, values in getattr(self.fn, "extras", {}).items():
            self.extras[key] += values
        return scores


def load_row(name: str, cfg: train.Config, family: str, device, dtype) -> adapters.FlowAdapter:
    """The model of one row, frozen, sampling as cfg says."""
    kind, _, path = name.partition(":")
    if kind == "run":
        return train.load_trained(Path(path), device, dtype, {k: getattr(cfg, k) for k in SAMPLER if k != "model"})
    model = models.load_pipeline(cfg, family, device, dtype)
    if kind == "lora":
        model.pipe.load_lora_weights(path)
    return model


def sample_row(name: str, cfg: train.Config, family: str, listed: list, samples: int, reward_fns: dict, device,
               rank: int, world: int) -> tuple[Row, torch.Tensor]:
    """This rank's samples (global sample k = prompt k // samples, noise k) of one row, scored; and the images of
    the first GRID_PROMPTS prompts' first samples when they are this rank's (rank 0 holds k = 0, world, ...)."""
    model = load_row(name, cfg, family, device, models.compute_dtype(cfg.dtype, device))
    mine = range(rank, len(listed) * samples, world)
    batch = [listed[k // samples] for k in mine]
    cond = rollouts.encode(model, [p.text for p in batch], device, cfg.offload_text_encoders)
    noise = rollouts.initial_noise(cfg, model, "evaluate", 0, mine, device)
    collected = {n: Collected(fn) for n, fn in reward_fns.items()}
    x0, scores = rollouts.rollout(cfg, model, rollouts.guided_velocity(cfg, model, device), batch, cond, noise, collected,
                                  progress=name if rank == 0 else "")
    shown = [i for i, k in enumerate(mine) if k % samples == 0 and k // samples < GRID_PROMPTS]
    with torch.no_grad():
        images = model.decode(x0[shown]).float().cpu() if shown else torch.empty(0)
    row = Row(name, {n: s.tolist() for n, s in scores.items()}, {n: dict(c.extras) for n, c in collected.items()},
              [mine[i] for i in shown])
    return row, images


def gather_row(row: Row, images: torch.Tensor, rank: int, world: int, total: int) -> tuple[Row, torch.Tensor]:
    """Rank 0 gets every sample in global order (sample k was made by rank k % world) and the grid's images."""
    if world == 1:
        return row, images
    parts = [None] * world
    dist.all_gather_object(parts, (row, images))
    if rank != 0:
        return row, images
    order = lambda per_rank: [per_rank[k % world][k // world] for k in range(total)]  # noqa: E731
    scores = {n: order([r.scores[n] for r, _ in parts]) for n in row.scores}
    extras = {n: {key: order([r.extras[n][key] for r, _ in parts]) for key in row.extras[n]} for n in row.extras}
    shown = sorted((k, image) for r, imgs in parts for k, image in zip(r.shown, imgs))
    return Row(row.name, scores, extras, [k for k, _ in shown]), torch.stack([image for _, image in shown])


def summarise(row: Row, listed: list, samples: int) -> dict[str, dict]:
    """metric -> {mean, ci95, n} over prompts (each prompt's mean over its samples); GenEval: accuracy overall (mean
    of the task accuracies) and per task, over images as its summary_scores.py counts them."""
    metrics = {}
    for name, values in row.scores.items():
        per_prompt = np.asarray(values, dtype=float).reshape(len(listed), samples).mean(1)
        ci = 1.96 * per_prompt.std(ddof=1) / math.sqrt(len(per_prompt)) if len(per_prompt) > 1 else math.nan
        metrics[name] = {"mean": float(per_prompt.mean()), "ci95": float(ci), "prompts": len(per_prompt)}
        if "accuracy" in row.extras.get(name, {}):
            tags = [p.metadata.get("tag", "all") for p in listed for _ in range(samples)]
            correct = defaultdict(list)
            for tag, ok in zip(tags, row.extras[name]["accuracy"]):
                correct[tag].append(float(ok))
            tasks = {tag: float(np.mean(v)) for tag, v in correct.items()}
            metrics[f"{name} accuracy"] = {"mean": float(np.mean(list(tasks.values()))), "tasks": tasks}
    return metrics


def markdown_table(summaries: dict[str, dict]) -> str:
    first = next(iter(summaries.values()))
    columns = list(first)
    lines = ["| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, metrics in summaries.items():
        cells = [f"{m['mean']:.4f}" + (f" ± {m['ci95']:.4f}" if math.isfinite(m.get("ci95", math.nan)) else "")
                 for m in (metrics[c] for c in columns)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    published = [c for c in columns if c in PAPER_COLUMNS]
    if published:
        lines += ["", "Published in the paper's Table 3 (SD3.5-M; DiffusionNFT's protocol), for reference:", "",
                  "| model | " + " | ".join(published) + " |", "|---|" + "---:|" * len(published)]
        lines += [f"| {model} | " + " | ".join(f"{values[PAPER_COLUMNS.index(c)]:g}" for c in published) + " |"
                  for model, values in PAPER_TABLE3.items()]
    tasks = {c: sorted(first[c]["tasks"]) for c in columns if "tasks" in first[c]}
    for column, names in tasks.items():
        lines += ["", f"{column} per task:", "", "| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        lines += [f"| {model} | " + " | ".join(f"{m[column]['tasks'][t]:.3f}" for t in names) + " |"
                  for model, m in summaries.items()]
    return "\n".join(lines)


def evaluate(argv: list[str] | None = None) -> dict:
    args, cfg = parse_args(argv)
    rank, world, device = parallel.setup_distributed()
    adapters.avoid_cudnn_attention()
    say = print if rank == 0 else (lambda *a, **k: None)
    family = train.validate(cfg, 1)
    spec, listed = evaluation_prompts(args, cfg, say)
    names = rewards.parse_reward_spec(cfg.rewards)
    reward_fns = rollouts.load_rewards(cfg, names, family, device)
    rows = (["base"] if args.base else []) + [f"run:{p}" for p in filter(None, args.runs.split(","))] + \
        [f"lora:{p}" for p in filter(None, args.loras.split(","))]
    out = Path(args.out or f"eval/{spec.replace(':', '-').replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}")
    say(f"evaluating {', '.join(rows)} on {len(listed)} prompts x {args.samples_per_prompt} samples ({spec}), "
        f"{cfg.sampling_steps} {cfg.solver} steps at {cfg.resolution} px, rewards {', '.join(names)} -> {out}")
    summaries, records, grid, captions = {}, {}, [], []
    total = len(listed) * args.samples_per_prompt
    for name in rows:
        row, images = sample_row(name, cfg, family, listed, args.samples_per_prompt, reward_fns, device, rank, world)
        row, images = gather_row(row, images, rank, world, total)
        if rank != 0:
            continue
        summaries[name] = summarise(row, listed, args.samples_per_prompt)
        records[name] = {"metrics": summaries[name], "scores": row.scores, "extras": row.extras}
        say(f"{name}: " + ", ".join(f"{k} {v['mean']:.4f}" for k, v in summaries[name].items()))
        grid.append(images)
        shown = range(0, min(GRID_PROMPTS, len(listed)) * args.samples_per_prompt, args.samples_per_prompt)
        captions += [f"{name} | {listed[k // args.samples_per_prompt].text} | " +
                     " ".join(f"{n} {row.scores[n][k]:.3f}" for n in names) for k in shown]
    if rank == 0:
        table = markdown_table(summaries)
        settings = {"prompts": spec, "num_prompts": len(listed), "samples_per_prompt": args.samples_per_prompt,
                    "rewards": list(names), **{k: getattr(cfg, k) for k in SAMPLER}}
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps({"settings": settings, "rows": records}, indent=1))
        (out / "table.md").write_text(table + "\n")
        grid_file = runs.save_samples(torch.cat(grid), captions, None, out / "grid.png", columns=min(GRID_PROMPTS, len(listed)))
        say(table)
        say(f"written: {out}/table.md, {out}/eval.json, {grid_file}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summaries


def main(argv: list[str] | None = None) -> None:
    failures.quiet_known_noise()
    with failures.one_line_errors():
        evaluate(argv)


if __name__ == "__main__":
    main()
