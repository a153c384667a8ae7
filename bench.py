"""bench.py: the V-GRPO paper's claims in miniature, measured on this machine.

    python bench.py                      # sections 1-4 on CPU (about 3.5 minutes on 2 cores); 5 too if CUDA is present
    python bench.py --sections 2,3       # a subset (8, 9, 10: the stability and reward-hacking sections, 6-25 min each)
    python bench.py --out results        # where results.md, results.json and the PNG plots go (default)

1. Surrogate statistics: coefficient of variation (CV) of the surrogate, overall and within groups, for the
   naive surrogate, each variance-reduction trick alone and all three (paper, FLUX: 0.230 -> 0.128 and
   0.170 -> 0.038), on the 2-D toy flow and on the tiny SD3 transformer fitted to toy images.
2. Ablations on the 2-D toy (vgrpo.train_toy): each trick off, K = 2 / 4 / 8, parameterisation x / v / eps,
   and the gradient-step controls (ratio clip, soft clip, KL, none). Several seeds, mean and spread.
3. V-GRPO against the MDP approach: Flow-GRPO written from its published algorithm and settings (FlowGRPO: SDE
   rollouts, per-step Gaussian log-probs and clipped ratios, KL to the reference, two optimizer steps per batch),
   validated against Flow-GRPO's own code on the tiny SD3 pipeline; on the same toy, reward and model, at each of
   three learning rates. Model evaluations (forward and backward counted) and wall time to the same reward, at the
   same learning rate and each method at its best.
4. Overhead: one V-GRPO update against the bare forward + backward of the same model on the same
   tensors; seconds per phase and peak memory from train.py; 1 against 2 processes (torchrun, gloo).
5. GPU (CUDA only; bench_gpu.py, as 6): images/s and step time at the real transformer sizes of each preset's model (SD3.5-Medium,
   FLUX.1-dev, Qwen-Image, FLUX.2 [klein] 4B; random weights), bf16, LoRA, activation checkpointing off and on;
   rollout images/s and model FLOP utilisation at the preset's micro-batch and rollout batch, eager and with each
   block compiled (parallel.compile_blocks); a row that runs out of memory says so.
6. Real checkpoints (CUDA and the hub; `--sections 6`): the real-model-path checks the tests make at reduced
   depth on CPU, on each preset's checkpoint itself (SD3.5-Medium, FLUX.1-dev, Qwen-Image, FLUX.2 [klein] base 4B):
   Euler rollouts with the preset's guidance against `pipe(...)` called the plain way, one preset iteration,
   float32 master weights in the checkpoint, the exported LoRA against training, the iteration's peak memory
   against the memory plan. `--sections 6 --reduced`: the same on real-width, reduced-depth
   pipelines with random weights built in place (no hub), as the tests build them.
7. Scale: surrogate rows and interleaved wall time of the old-policy pass before/after computing s_old only where it
   differs from the first gradient pass; FSDP2 all-gathers of a rollout with and without parallel.gathered_once.
8. Stability on the 2-D toy: learning rate 1e-3 .. 3e-2 against each gradient-step control (x-space KL, one gradient
   step, K, the timestep range) and the MDP baseline: divergence rate, runs reaching success, iterations and model
   evaluations to it, and how far the reward falls back after its best (`--sections 8`, 10 seeds: 6 minutes on 2 cores).
9. Stability on the tiny SD3 pipeline of the README (`--sections 9`, about 30 minutes on 2 cores): train.py's tiny
   preset against section 3's Flow-GRPO on the pipeline, each at a small sweep of learning rates, 5 seeds, the same
   fixed evaluation: model evaluations and training time to an eval threshold, seeds reaching it, fall-back.
10. Reward hacking on the same pipeline (`--sections 10`, 5 seeds x 5 settings): train.py trained on a reward that can
   be gamed (JPEG incompressibility) with a held-out one monitored (the colour the prompt names), without a guard,
   with the reference KL at two weights, with EMA and with both: trained against held-out reward, drift from the
   base, and whether the hacking rule warned.
11. Against the paper's peers (`--sections 11 [--jobs 2]`, hours on 2 cores; an interrupted run continues from its
   cache): train.py's tiny preset, DiffusionNFT, MixGRPO, MixGRPO-Flash and Flow-GRPO (baselines.py, each validated
   against its own code) on the committed tiny SD3 bases, two tasks (colour; colour and JPEG size at once), each method
   at its best learning rate of a sweep: optimizer steps, forward and backward model evaluations and seconds to each
   eval gain, median and range over bases x seeds, and each peer against V-GRPO run by run.

Plots need matplotlib (`pip install matplotlib`); without it the tables are still written.
The toy settings are vgrpo.ToyConfig's defaults, chosen in section 8 for stability and speed (lr 3e-3, x-space KL 0.3).
"""

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

import adapters
import baselines
import builders
import models
import parallel
import runs
import train
import vgrpo

SEEDS = (0, 1, 2, 3, 4)
SUCCESS = 0.9  # a run succeeds once this fraction of its rollouts lands in the requested mode
MDP = "Flow-GRPO (MDP)"  # the baseline of sections 3, 8 and 9


def mean_std(values) -> str:
    values = np.asarray(values, dtype=float)
    return f"{values.mean():.3f} ± {values.std():.3f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def plot(path: Path, curves: dict[str, list[float]], *, title: str, ylabel: str, every: int = 1) -> None:
    """One line per curve; point i is iteration i * every."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in curves.items():
        ax.plot([i * every for i in range(len(ys))], ys, label=name)
    ax.set(title=title, xlabel="iteration", ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# 1. Surrogate statistics

VARIANTS = {  # the surrogate with each variance-reduction trick switched on alone, and all together
    "naive (v-loss, iid pairs)": dict(param="v", self_normalize=False, stratified=False, group_shared=False),
    "+ group-shared pairs": dict(param="v", self_normalize=False, stratified=False, group_shared=True),
    "+ stratified t": dict(param="v", self_normalize=False, stratified=True, group_shared=False),
    "+ adaptive weighting": dict(param="x", self_normalize=True, stratified=False, group_shared=False),
    "all three (V-GRPO)": dict(param="x", self_normalize=True, stratified=True, group_shared=True),
}


def surrogate_cv(velocity, x0, cond, P, G, K, *, variant: dict, seed: int, draws: int) -> dict[str, float]:
    """CV of the per-sample surrogate (P, G), averaged over `draws` fresh sets of pairs."""
    g = torch.Generator().manual_seed(seed)
    cvs = []
    for _ in range(draws):
        t, eps = vgrpo.draw_mc_pairs(P, G, K, x0.shape[1:], generator=g, stratified=variant["stratified"],
                                     group_shared=variant["group_shared"])
        with torch.no_grad():
            s, _ = vgrpo.elbo_surrogate(velocity, x0, cond, t, eps, param=variant["param"],
                                        self_normalize=variant["self_normalize"])
        cvs.append(vgrpo.surrogate_cv(s.mean(1).view(P, G)))
    return {k: float(np.mean([c[k] for c in cvs])) for k in cvs[0]}


def toy_samples(model, P, G, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(len(vgrpo.TOY_MODES), (P,), generator=g).repeat_interleave(G)
    return vgrpo.sample_ode(model, torch.randn(P * G, 2, generator=g), c, vgrpo.flow_timesteps(16)), c


def tiny_sd3_samples(model, P, G, seed):
    order = torch.randperm(len(builders.TINY_PROMPTS), generator=torch.Generator().manual_seed(seed))
    prompts = [builders.TINY_PROMPTS[i] for i in order[:P]]
    cond = {k: v.repeat_interleave(G, 0) for k, v in model.encode(prompts).items()}
    noise = torch.randn(P * G, *model.latent_shape(), generator=torch.Generator().manual_seed(seed))
    return vgrpo.sample_ode(model.velocity, noise, cond, model.timesteps()), cond


def section_surrogate(toy_model, sd3_model) -> tuple[str, dict]:
    P, G, K = 8, 16, 4
    results = {}
    for name, velocity, samples, draws in (("2-D toy", toy_model, partial(toy_samples, toy_model), 20),
                                           ("tiny SD3 (fitted)", sd3_model.velocity, partial(tiny_sd3_samples, sd3_model), 5)):
        per_seed = {v: [] for v in VARIANTS}
        for seed in SEEDS:
            x0, cond = samples(P, G, seed)
            for v, variant in VARIANTS.items():
                per_seed[v].append(surrogate_cv(velocity, x0, cond, P, G, K, variant=variant, seed=seed, draws=draws))
        results[name] = per_seed
    rows = [[v] + [mean_std([r[k] for r in results[m][v]]) for m in results for k in ("cv", "cv_within")] for v in VARIANTS]
    header = ["surrogate"] + [f"{m}: {k}" for m in results for k in ("CV", "within-group CV")]
    text = (f"P = {P} prompts x G = {G} samples, K = {K}; mean ± std over seeds {SEEDS} (each the average of "
            f"several pair draws). Paper (FLUX.1-dev): naive 0.230 / 0.170 -> V-GRPO 0.128 / 0.038.\n\n"
            + table(header, rows))
    return text, {m: {v: r for v, r in per.items()} for m, per in results.items()}


# ----------------------------------------------------------------------------------------------
# 2. Ablations on the 2-D toy

ABLATIONS = {
    "V-GRPO (defaults)": {},
    "no group-shared pairs": dict(group_shared=False),
    "no stratified t": dict(stratified=False),
    "no adaptive weighting (v-loss)": dict(param="v", self_normalize=False),
    "K = 2": dict(num_mc=2),
    "K = 8": dict(num_mc=8),
    "v-prediction, self-normalised": dict(param="v"),
    "eps-prediction, self-normalised": dict(param="eps"),
    "x-prediction, not normalised": dict(self_normalize=False),
    "ratio clip only": dict(soft_clip_eta=None, kl_coef=0.0),
    "soft clip only": dict(clip_eps=None, kl_coef=0.0),
    "KL only (beta 0.3)": dict(clip_eps=None, soft_clip_eta=None, kl_coef=0.3),
    "no control": dict(clip_eps=None, soft_clip_eta=None, kl_coef=0.0),
    "no KL (clip and soft clip; the default before section 8)": dict(kl_coef=0.0),
}


def first_success(history: list[dict]) -> int | None:
    return next((i for i, h in enumerate(history) if h["frac_target_mode"] >= SUCCESS), None)


def section_ablations(toy_model, out: Path) -> tuple[str, dict]:
    iterations = 60
    runs = {name: [vgrpo.train_toy(copy.deepcopy(toy_model), vgrpo.ToyConfig(iterations=iterations, seed=s, **over))
                   for s in SEEDS] for name, over in ABLATIONS.items()}
    rows = []
    for name, hs in runs.items():
        hits = [first_success(h) for h in hs]
        reached = [i for i in hits if i is not None]
        rows.append([name, mean_std([h[-1]["reward_mean"] for h in hs]), mean_std([h[-1]["frac_target_mode"] for h in hs]),
                     mean_std([h[-1]["mode_dist"] for h in hs]),
                     (mean_std(reached) if reached else "-") + f" ({len(reached)}/{len(hs)})"])
    groups = {"tricks": list(ABLATIONS)[:4], "K": ["V-GRPO (defaults)", "K = 2", "K = 8"],
              "parameterisation": ["V-GRPO (defaults)"] + list(ABLATIONS)[6:9],
              "controls": ["V-GRPO (defaults)"] + list(ABLATIONS)[9:]}
    for group, names in groups.items():
        plot(out / f"ablation_{group}.png", {n: np.mean([[h["reward_mean"] for h in run] for run in runs[n]], 0) for n in names},
             title=f"2-D toy, {group} (mean of {len(SEEDS)} seeds)", ylabel="reward (minus distance to the asked mode)")
    text = (f"{iterations} iterations of vgrpo.train_toy (ToyConfig defaults: 8 prompts x 16 samples, 16 Euler steps, "
            f"K = 4, 4 gradient steps per batch, ratio clip 0.01, soft clip 3, x-space KL 0.3, Adam 3e-3) from one "
            "pretrained model; "
            f"seeds {SEEDS}. Success = at least {SUCCESS:.0%} of an iteration's rollouts in the requested mode; "
            "mode distance = mean distance to the nearest mode (the data's is about 0.25: larger means smeared).\n\n"
            + table(["variant", "final reward", "final fraction in mode", "final mode distance",
                     "iterations to success (runs reaching it)"], rows))
    return text, {n: [[h["reward_mean"] for h in run] for run in hs] for n, hs in runs.items()}


# ----------------------------------------------------------------------------------------------
# 3. Against the MDP approach: Flow-GRPO written from its published algorithm
#
# Flow-GRPO (Liu et al. 2025, arXiv 2505.05470; github.com/yifan123/flow_grpo) as its scripts/train_sd3.py runs it
# with the defaults of config/base.py and config/grpo.py's SD3.5 tasks, written here from the algorithm (no code
# taken) for the 2-D toy and the tiny SD3 pipeline alike. Validated against Flow-GRPO's own rollout pipeline, SDE step
# and stat tracker on the tiny SD3 pipeline (docs/benchmarks.md, "The Flow-GRPO baseline").


def counted_vgrpo_toy(model, cfg: vgrpo.ToyConfig) -> list[dict]:
    """vgrpo.train_toy with cumulative model evaluations added to its history."""
    history = vgrpo.train_toy(model, cfg)
    per_iteration = cfg.num_prompts * cfg.group_size
    for i, h in enumerate(history, 1):
        # Per sample: rollout (sampling_steps) forwards, K forwards and K backwards in the one mini-batch that holds
        # it, and K old-policy forwards for the samples of every mini-batch but the first (vgrpo_update's saving).
        old_pass = cfg.num_mc * (cfg.num_grad_steps - 1) / cfg.num_grad_steps
        h.update(nfe_fwd=i * per_iteration * (cfg.sampling_steps + cfg.num_mc + old_pass), nfe_bwd=i * per_iteration * cfg.num_mc)
    return history


def toy_cost(history: list[dict]) -> dict | None:
    """Iterations (the one reaching it included), model evaluations and seconds to the first success."""
    hit = first_success(history)
    return None if hit is None else dict(iterations=hit + 1, nfe=history[hit]["nfe_fwd"] + history[hit]["nfe_bwd"],
                                         seconds=history[hit]["seconds"])


def best_lr(costs: dict[float, list]) -> float | None:
    """The learning rate whose runs all reach the target, at the lowest median model evaluations."""
    full = {lr: np.median([c["nfe"] for c in cs]) for lr, cs in costs.items() if all(c is not None for c in cs)}
    return min(full, key=full.get) if full else None


def cost_ratio(ours: list, theirs: list) -> str:
    """Per seed (both reaching the target), theirs / ours in model evaluations and seconds: mean ± std."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    if not pairs:
        return "not comparable (no seed where both reach it)"
    return (f"model evaluations x{mean_std([b['nfe'] / a['nfe'] for a, b in pairs])}, seconds "
            f"x{mean_std([b['seconds'] / a['seconds'] for a, b in pairs])} ({len(pairs)} of {len(ours)} seeds)")


def comparison(costs: dict[str, dict[float, list]], same_lr: float) -> str:
    """The MDP baseline against V-GRPO at one learning rate and each at its own best (best_lr)."""
    best = {name: best_lr(by_lr) for name, by_lr in costs.items()}
    lines = [f"at the same lr {same_lr:g}: " + cost_ratio(costs["V-GRPO"][same_lr], costs[MDP][same_lr])]
    if None in best.values():
        lines.append("best against best: not comparable (" + ", ".join(n for n, lr in best.items() if lr is None)
                     + " reached it at no learning rate in every seed)")
    else:
        lines.append(f"each at its best lr (V-GRPO {best['V-GRPO']:g}, {MDP} {best[MDP]:g}): "
                     + cost_ratio(costs["V-GRPO"][best["V-GRPO"]], costs[MDP][best[MDP]]))
    return "\n".join(f"- {MDP} / V-GRPO {line}" for line in lines)


def cost_cells(cs: list) -> list[str]:
    hit = [c for c in cs if c is not None]
    medians = [np.median([c[k] for c in hit]) if hit else None for k in ("iterations", "nfe", "seconds")]
    # Seconds to one decimal: the toy's V-GRPO runs reach success in under a second.
    return [f"{len(hit)} of {len(cs)}", *("-" if m is None else f"{m:.{digits}f}" for m, digits in zip(medians, (0, 0, 1)))]


MDP_TOY_LRS = (1e-3, 3e-3, 1e-2)


def section_mdp(toy_model, out: Path, lrs=MDP_TOY_LRS, seeds=SEEDS, iterations: int = 100) -> tuple[str, dict]:
    methods = {"V-GRPO": counted_vgrpo_toy, MDP: baselines.flow_grpo_toy}
    runs = {name: {lr: [run(copy.deepcopy(toy_model), vgrpo.ToyConfig(iterations=iterations, lr=lr, seed=seed))
                        for seed in seeds] for lr in lrs} for name, run in methods.items()}
    costs = {name: {lr: [toy_cost(h) for h in hs] for lr, hs in by_lr.items()} for name, by_lr in runs.items()}
    rows = [[name, f"{lr:g}", *cost_cells(costs[name][lr]),
             f"{np.median([h[-1]['reward_mean'] for h in runs[name][lr]]):.2f}"] for name in methods for lr in lrs]
    same_lr = vgrpo.ToyConfig().lr
    plot(out / "mdp_baseline.png", {f"{n} @ {same_lr:g}": np.mean([[x["reward_mean"] for x in h]
                                                                   for h in runs[n][same_lr]], 0) for n in methods},
         title="2-D toy: V-GRPO vs Flow-GRPO (mean of seeds)", ylabel="reward")
    text = ("Same pretrained toy model, reward, prompts per iteration (8 x 16), 16 sampling steps and seeds "
            f"{seeds[0]}-{seeds[-1]}; AdamW at each learning rate, up to {iterations} iterations. V-GRPO: ToyConfig's "
            "defaults (ODE rollouts, K = 4, 4 gradient steps per batch, ratio clip 0.01, x-space KL 0.3). " + MDP + ": "
            "baselines.flow_grpo_toy with Flow-GRPO's published settings (FlowGRPO: SDE rollouts of noise level 0.7, "
            "per-step ratio clip 1e-4, advantages per group over the batch's std and clipped at 5, KL 0.04 to the "
            "pretrained model, 15 of 16 steps trained, two optimizer steps per batch, weight decay 1e-4). Success: at "
            f"least {SUCCESS:.0%} of an iteration's rollouts in the requested mode; NFE = forward + backward model "
            "evaluations to it (the reference's forwards included); medians over the seeds that reach it.\n\n"
            + table(["method", "lr", "seeds reaching success", "median iterations", "median NFE", "median seconds",
                     "median final reward"], rows) + "\n\n" + comparison(costs, same_lr))
    return text, {"costs": costs, "curves": {n: {str(lr): [[x["reward_mean"] for x in h] for h in hs]
                                                 for lr, hs in by_lr.items()} for n, by_lr in runs.items()}}


# ----------------------------------------------------------------------------------------------
# 8. Stability: learning rate against the gradient-step controls, and the MDP baseline

STABILITY_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
STABILITY_SEEDS = tuple(range(10))
STABILITY_VARIANTS = {  # ToyConfig overrides; the first row is ToyConfig's defaults before this section existed
    "V-GRPO, no KL (clip 0.01 x 4 steps, soft clip 3)": dict(kl_coef=0.0),
    "+ x-space KL 0.3": dict(kl_coef=0.3),
    "1 gradient step per batch, no KL": dict(kl_coef=0.0, num_grad_steps=1),
    "K = 8, no KL": dict(kl_coef=0.0, num_mc=8),
    "t in [0.05, 0.95], no KL": dict(kl_coef=0.0, t_min=0.05, t_max=0.95),
}
DIVERGED_REWARD = -10.0  # the pretrained toy scores about -2.6; below -10 most samples are far off every mode


def diverged_at(history: list[dict]) -> int | None:
    """First iteration with a non-finite or runaway reward (rollouts far off every mode) or a skipped step."""
    return next((i for i, h in enumerate(history) if not h["reward_mean"] >= DIVERGED_REWARD
                 or h.get("skipped_steps", 0) > 0), None)


def stability_row(name: str, lr: float, histories: list[list[dict]]) -> list:
    runs = [(first_success(h), diverged_at(h), h) for h in histories]
    reached = [(i, h) for i, d, h in runs if i is not None and (d is None or d > i)]
    falls = [max(x["reward_mean"] for x in h) - h[-1]["reward_mean"] for _, d, h in runs if d is None]
    n = len(histories)
    return [name, f"{lr:g}", f"{sum(d is not None for _, d, _ in runs)}/{n}", f"{len(reached)}/{n}",
            f"{np.median([i for i, _ in reached]):.0f}" if reached else "-",
            f"{np.median([h[i]['nfe_fwd'] + h[i]['nfe_bwd'] for i, h in reached]) / 1e3:.0f}k" if reached else "-",
            f"{np.median(falls):.3f}" if falls else "-"]


def section_stability(toy_model, out: Path, iterations: int = 40) -> tuple[str, dict]:
    rows, curves = [], {}
    for lr in STABILITY_LRS:
        for name, over in {**STABILITY_VARIANTS, MDP: None}.items():
            histories = []
            for seed in STABILITY_SEEDS:
                cfg = vgrpo.ToyConfig(iterations=iterations, seed=seed, lr=lr, **(over or {}))
                run = counted_vgrpo_toy if over is not None else baselines.flow_grpo_toy
                histories.append(run(copy.deepcopy(toy_model), cfg))
            rows.append(stability_row(name, lr, histories))
            curves[f"{name} @ {lr:g}"] = [[x["reward_mean"] for x in h] for h in histories]
    for lr in STABILITY_LRS:
        plot(out / f"stability_lr{lr:g}.png",
             {n: np.median(np.nan_to_num(curves[f"{n} @ {lr:g}"], nan=-np.inf), 0)  # a non-finite run counts as lowest
              for n in [*STABILITY_VARIANTS, MDP]},
             title=f"2-D toy at lr {lr:g}: median reward of {len(STABILITY_SEEDS)} seeds", ylabel="reward")
    text = (f"{iterations} iterations of vgrpo.train_toy per run (8 prompts x 16 samples, 16 Euler steps, Adam), seeds "
            f"{STABILITY_SEEDS[0]}-{STABILITY_SEEDS[-1]}, from one pretrained model; the MDP baseline is section 3's. Diverged = "
            f"a non-finite reward, a skipped step or a mean reward below {DIVERGED_REWARD:g} at any iteration. Success as "
            "in section 2, counted only before a divergence; NFE = forward + backward model evaluations to it; fall-back = "
            "best minus final mean reward of the runs that did not diverge (how far the reward falls back after its best).\n\n"
            + table(["variant", "lr", "diverged", "reached success", "median iterations to success", "median NFE to success",
                     "median fall-back"], rows))
    return text, {"rows": rows, "curves": curves}


# ----------------------------------------------------------------------------------------------
# 9. Stability on the tiny SD3 pipeline of the README: train.py against Flow-GRPO written for the pipeline

SD3_THRESHOLDS = (0.60, 0.61, 0.62)  # eval reward (color) on 32 prompts x 4 fixed noises; the fitted model starts near 0.575


def vgrpo_sd3(model_dir: Path, run_dir: Path, seed: int, iterations: int, eval_every: int, flags=()) -> list[dict]:
    """train.py itself (tiny preset) on a saved pipeline; per iteration the eval reward where evaluated, and so far:
    optimizer steps, model evaluations without gradient (rollout steps, the old-policy pass, the reference's and the
    gradient passes' forwards) and with (backwards), and training seconds (evaluations excluded)."""
    subprocess.run([sys.executable, str(Path(__file__).with_name("train.py")), "--model", str(model_dir), "--seed",
                    str(seed), "--prompts", str(model_dir / "prompts.txt"), "--iterations", str(iterations),
                    "--eval_every", str(eval_every), "--run_dir", str(run_dir), *flags],
                   check=True, capture_output=True)
    cfg = json.loads((run_dir / "config.json").read_text())
    samples = cfg["num_prompts"] * cfg["group_size"]
    history, counts, seconds = [], dict(grad_steps=0, nfe_fwd=0.0, nfe_bwd=0.0), 0.0
    for m in runs.read_metrics(run_dir):
        counts["grad_steps"] += cfg["num_grad_steps"] - int(m["skipped_steps"])
        counts["nfe_fwd"] += samples * (m["nfe_rollout"] + m["nfe_old"] + m["nfe_ref"] + m["nfe_grad"])
        counts["nfe_bwd"] += samples * m["nfe_grad"]
        seconds += m["time_rollout"] + m["time_reward"] + m["time_update"]
        history.append(dict(reward_mean=m["reward_mean"], eval=m.get("eval/reward_mean"), seconds=seconds, **counts,
                            nfe=counts["nfe_fwd"] + counts["nfe_bwd"]))
    return history


def threshold_cost(history: list[dict], threshold: float) -> dict | None:
    """The first evaluated iteration at or above threshold: iterations, model evaluations and seconds to it."""
    return next((dict(iterations=i + 1, nfe=h["nfe"], seconds=h["seconds"]) for i, h in enumerate(history)
                 if h["eval"] is not None and h["eval"] >= threshold), None)


def fall_back(history: list[dict]) -> float:
    """How far the eval reward falls after its best: best minus the lowest evaluation after it."""
    evals = [h["eval"] for h in history if h["eval"] is not None]
    best = int(np.argmax(evals))
    return evals[best] - min(evals[best:])


SD3_LRS = {"V-GRPO": (1e-3, 3e-3), MDP: (1e-3, 3e-3, 1e-2)}  # the small sweep: each method's best lr is inside it
SD3_ITERATIONS = {"V-GRPO": 40, MDP: 50}


def section_sd3_stability(out: Path, seeds=SEEDS, lrs: dict = SD3_LRS, iterations: dict = SD3_ITERATIONS,
                          eval_every: int = 5, fit_steps: int | None = None, flags=()) -> tuple[str, dict]:
    """train.py's tiny preset and flow_grpo_sd3 at each learning rate of lrs, from one fitted pipeline."""
    root = Path(tempfile.mkdtemp())
    fit_steps = train.Config().tiny_fit_steps if fit_steps is None else fit_steps
    builders.tiny_pipeline("sd3", seed=0, fit_steps=fit_steps).save_pretrained(root / "tiny-sd3")
    (root / "tiny-sd3" / "prompts.txt").write_text("\n".join(builders.TINY_PROMPTS) + "\n")  # train.py's built-in ones
    runs = {"V-GRPO": {lr: [vgrpo_sd3(root / "tiny-sd3", root / f"{lr:g}-{seed}", seed, iterations["V-GRPO"], eval_every,
                                      (*flags, "--lr", f"{lr:g}")) for seed in seeds] for lr in lrs["V-GRPO"]},
            MDP: {lr: [baselines.flow_grpo_sd3(root / "tiny-sd3", seed, iterations[MDP], eval_every, flags=(*flags, "--lr", f"{lr:g}"))
                       for seed in seeds] for lr in lrs[MDP]}}
    return sd3_stability_report(runs, out, seeds=seeds, iterations=iterations, eval_every=eval_every,
                                fit_steps=fit_steps)


def sd3_stability_report(runs: dict, out: Path, *, seeds, iterations: dict, eval_every: int,
                         fit_steps: int) -> tuple[str, dict]:
    """Section 9's table, comparisons and plot from the runs' histories ({method: {lr: [history per seed]}})."""
    rows, summary = [], []
    for threshold in SD3_THRESHOLDS:
        costs = {name: {lr: [threshold_cost(h, threshold) for h in hs] for lr, hs in by_lr.items()}
                 for name, by_lr in runs.items()}
        for name, by_lr in runs.items():
            for lr, hs in by_lr.items():
                falls = [fall_back(h) for h in hs]
                rows.append([name, f"{lr:g}", threshold, *cost_cells(costs[name][lr]),
                             f"{np.median(falls):.3f} / {max(falls):.3f}", sum(f > 0.01 for f in falls)])
        summary.append(f"Eval {threshold:g}:\n" + comparison(costs, train.Config().lr))
    curves = {f"{name} @ {lr:g}": [[h["eval"] for h in run if h["eval"] is not None] for run in hs]
              for name, by_lr in runs.items() for lr, hs in by_lr.items()}
    plot(out / "sd3_stability.png", {n: np.mean(c, 0) for n, c in curves.items()}, every=eval_every,
         title=f"tiny SD3, color reward: mean eval reward of {len(seeds)} seeds", ylabel="eval reward")
    text = (f"Tiny SD3 fitted to toy images (the README's setting, {fit_steps} fitting steps), color reward, 8 prompts x 8 "
            f"samples per iteration, AdamW, LoRA r 32 alpha 64 (train.py's), seeds {seeds[0]}-{seeds[-1]}, each learning "
            f"rate as named. V-GRPO: train.py's tiny preset (8 Euler ODE steps, K = 8, 2 gradient steps per batch, ratio "
            f"clip 0.01, x-space KL {train.PRESETS['tiny']['kl_coef']:g}), {iterations['V-GRPO']} iterations. {MDP}: "
            f"flow_grpo_sd3 with Flow-GRPO's published settings (10 SDE steps of noise level 0.7, 9 trained, ratio clip 1e-4, advantages per prompt "
            f"over the batch's std, clipped at 5, KL 0.04 to the LoRA switched off, two optimizer steps per batch, "
            f"weight decay 1e-4), {iterations[MDP]} iterations. All evaluated by rollouts.evaluate every {eval_every} "
            "iterations on 32 prompts x 4 fixed noises with the 8-step Euler ODE. NFE = forward + backward model "
            "evaluations of training (rollouts included, evaluations not); seconds likewise; fall-back = best eval minus "
            "the lowest eval after it (median / largest over seeds; the last column: seeds falling back more than 0.01)."
            "\n\n" + table(["method", "lr", "eval threshold", "seeds reaching it", "median iterations", "median NFE",
                            "median seconds", "fall-back median / max", "seeds falling back > 0.01"], rows)
            + "\n\n" + "\n\n".join(summary))
    return text, {"curves": curves, "histories": {n: {str(lr): hs for lr, hs in by_lr.items()} for n, by_lr in runs.items()}}


# ----------------------------------------------------------------------------------------------
# 11. Against the paper's peers, on tiny bases every machine shares

PEER_METHODS = {  # name -> (runner, its options): each peer as baselines.py writes it from its published algorithm
    "V-GRPO": ("vgrpo", {}),  # train.py's tiny preset
    "DiffusionNFT": ("nft", {}),
    "MixGRPO": ("mix", {}),
    "MixGRPO-Flash": ("mix", {"flash": True, "iters_per_window": 20}),
    MDP: ("flow", {}),
}
# Fixed before any run (issue 37): the colour reward, and the colour with the JPEG size at once (advantages per reward
# summed, as the paper's multi-reward stages and MixGRPO aggregate) as the task with headroom.
PEER_TASKS = {"color": "color:1", "color+jpeg": "color:1,jpeg_compressibility:1"}
PEER_GAINS = {"color": (0.02, 0.04, 0.06), "color+jpeg": (0.05, 0.1, 0.2)}  # eval gains over each base's first eval
PEER_BASES = tuple(sorted(seed for family, seed, _ in builders.FITTED if family == "sd3"))  # the committed fits
PEER_LRS = (1e-3, 3e-3)  # the sweep: each method's best on base 0, sweep seeds
PEER_SWEEP_SEEDS = (0, 1, 2)
PEER_ITERATIONS = 40


def peer_base(root: Path, base: int) -> Path:
    """The committed tiny SD3 base of fit seed `base`, saved with its built-in prompts (train.py's)."""
    path = root / f"base-{base}"
    if not (path / "prompts.txt").is_file():
        builders.tiny_pipeline("sd3", seed=base, fit_steps=250).save_pretrained(path)
        (path / "prompts.txt").write_text("\n".join(builders.TINY_PROMPTS) + "\n")
    return path


def base_eval(root: Path, base: int, task: str) -> float:
    """The committed base's evaluation before any update, by the evaluation every peer's run uses (train.py's fixed
    prompts, noises and sampler; the LoRA's B is zero): every method's gains are measured from it. A history's first
    evaluation follows its first update, and DiffusionNFT's first step alone moved it by +0.011 to +0.026 where
    V-GRPO's moved -0.002 to +0.007 (colour, base 0, lr 3e-3, 3 seeds): gains over each run's own first evaluation
    handicapped the method that learns in one step."""
    *_, evaluate = baselines.tiny_sd3_setup(peer_base(root, base), 0, ("--rewards", PEER_TASKS[task]))
    return evaluate()


def peer_history(method: str, task: str, base: int, seed: int, lr: float, *, iterations: int, eval_every: int,
                 root: Path) -> list[dict]:
    """One run of `method` on the base, task, seed and learning rate, in this process (V-GRPO: train.py's)."""
    model_dir, (kind, options) = peer_base(root, base), PEER_METHODS[method]
    flags = ("--rewards", PEER_TASKS[task], "--lr", f"{lr:g}")
    if kind == "vgrpo":
        with tempfile.TemporaryDirectory() as run_dir:
            return vgrpo_sd3(model_dir, Path(run_dir) / "run", seed, iterations, eval_every, flags)
    if kind == "nft":
        return baselines.diffusion_nft_sd3(model_dir, seed, iterations, eval_every, flags=flags,
                                           nft=baselines.DiffusionNFT(**options))
    if kind == "mix":
        return baselines.mixgrpo_sd3(model_dir, seed, iterations, eval_every, flags=flags, mix=baselines.MixGRPO(**options))
    return baselines.flow_grpo_sd3(model_dir, seed, iterations, eval_every, flags=flags)


def peer_runs(keys: list[tuple], *, cache: Path, root: Path, jobs: int, iterations: int, eval_every: int) -> dict:
    """{key: history} for keys (method, task, base, seed, lr): each run in a subprocess of its own, `jobs` at a time
    with the cores shared out (OMP_NUM_THREADS), its history kept in cache as JSON so that an interrupted section
    continues where it stopped."""
    def path(key):
        return cache / ("_".join(str(k) for k in key).replace(" ", "") + f"_{iterations}.json")

    missing = [k for k in dict.fromkeys(keys) if not path(k).is_file()]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}
    running: list[tuple[tuple, subprocess.Popen]] = []
    while missing or running:
        while missing and len(running) < jobs:
            key = missing.pop(0)
            command = [sys.executable, __file__, "--peer-run", json.dumps([*key, iterations, eval_every, str(root),
                                                                           str(path(key))])]
            running.append((key, subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                  text=True)))
        time.sleep(1)
        for key, proc in list(running):
            if proc.poll() is not None:
                running.remove((key, proc))
                if proc.returncode:
                    raise RuntimeError(f"{key} failed: {proc.stderr.read()[-3000:]}")
                print(f"peer run {key}: done", flush=True)
    return {k: json.loads(path(k).read_text()) for k in keys}


def gain_cost(history: list[dict], gain: float, start: float) -> dict | None:
    """The first evaluated iteration whose eval is `gain` above `start` (the base's evaluation, base_eval):
    iterations, optimizer steps, forward and backward model evaluations and seconds to it (None: never)."""
    return next((dict(iterations=i + 1, grad_steps=h["grad_steps"], nfe_fwd=h["nfe_fwd"], nfe_bwd=h["nfe_bwd"],
                      nfe=h["nfe"], seconds=h["seconds"])
                 for i, h in enumerate(history) if h["eval"] is not None and h["eval"] >= start + gain), None)


def section_peers(out: Path, *, tasks=tuple(PEER_TASKS), methods=tuple(PEER_METHODS), bases=PEER_BASES, seeds=SEEDS,
                  lrs=PEER_LRS, sweep_seeds=PEER_SWEEP_SEEDS, iterations: int = PEER_ITERATIONS, eval_every: int = 5,
                  jobs: int = 2, cache: Path | None = None) -> tuple[str, dict]:
    """Every method on the committed bases: a learning-rate sweep on base 0 (sweep_seeds) picks each method's best lr
    per task (fewest median optimizer steps to the middle gain among the lrs every sweep seed reaches it at), then
    every base x seed at that lr."""
    root = Path(tempfile.mkdtemp())
    cache = cache or Path(tempfile.gettempdir()) / "vgrpo-bench-peers"
    cache.mkdir(parents=True, exist_ok=True)
    run = partial(peer_runs, cache=cache, root=root, jobs=jobs, iterations=iterations, eval_every=eval_every)
    starts = {(b, task): base_eval(root, b, task) for b in bases for task in tasks}
    sweep = run([(m, task, bases[0], s, lr) for task in tasks for m in methods for lr in lrs for s in sweep_seeds])
    best = {}
    for task in tasks:
        middle = PEER_GAINS[task][1]
        for m in methods:
            costs = {lr: [gain_cost(sweep[m, task, bases[0], s, lr], middle, starts[bases[0], task]) for s in sweep_seeds]
                     for lr in lrs}
            full = {lr: np.median([c["grad_steps"] for c in cs]) for lr, cs in costs.items() if None not in cs}
            best[m, task] = min(full, key=full.get) if full else max(lrs, key=lambda lr: sum(c is not None for c in costs[lr]))
    main = run([(m, task, b, s, best[m, task]) for task in tasks for m in methods for b in bases for s in seeds])
    return peers_report(main, best, starts, out, tasks=tasks, methods=methods, bases=bases, seeds=seeds, lrs=lrs,
                        iterations=iterations, eval_every=eval_every), {
        "base_eval": {f"base {b} / {task}": e for (b, task), e in starts.items()},
        "best_lr": {f"{m} / {task}": lr for (m, task), lr in best.items()},
        "sweep": {" / ".join(map(str, k)): h for k, h in sweep.items()},
        "runs": {" / ".join(map(str, k)): h for k, h in main.items()}}


def spread(values) -> str:
    """Median with the range: 'median (min-max)'."""
    values = np.asarray(values, dtype=float)
    return f"{np.median(values):.3g} ({values.min():.3g}-{values.max():.3g})"


def peers_report(main: dict, best: dict, starts: dict, out: Path, *, tasks, methods, bases, seeds, lrs,
                 iterations: int, eval_every: int) -> str:
    """Section 11's tables: per task, each method at its best lr over bases x seeds: runs reaching each gain, median
    optimizer steps, forward and backward model evaluations and seconds to it; then each peer against V-GRPO per
    (base, seed) where both reach the gain (peer / V-GRPO), and the fall-back after the best evaluation."""
    parts = []
    for task in tasks:
        rows, ratios = [], []
        for m in methods:
            per_run = [(b, main[m, task, b, s, best[m, task]]) for b in bases for s in seeds]
            histories = [h for _, h in per_run]
            falls = [fall_back(h) for h in histories]
            for gain in PEER_GAINS[task]:
                costs = [c for c in (gain_cost(h, gain, starts[b, task]) for b, h in per_run) if c is not None]
                cells = ([spread([c[k] for c in costs]) for k in ("grad_steps", "nfe_fwd", "nfe_bwd", "seconds")]
                         if costs else ["-"] * 4)
                rows.append([m, f"{best[m, task]:g}", f"+{gain:g}", f"{len(costs)} of {len(histories)}", *cells,
                             f"{np.median(falls):.3f} / {max(falls):.3f} ({sum(f > 0.01 for f in falls)})"])
        for m in methods[1:]:
            for gain in PEER_GAINS[task]:
                pairs = [(gain_cost(main[methods[0], task, b, s, best[methods[0], task]], gain, starts[b, task]),
                          gain_cost(main[m, task, b, s, best[m, task]], gain, starts[b, task])) for b in bases for s in seeds]
                pairs = [(ours, theirs) for ours, theirs in pairs if ours and theirs]
                cells = ([spread([theirs[k] / ours[k] for ours, theirs in pairs])
                          for k in ("grad_steps", "nfe", "seconds")] if pairs else ["-"] * 3)
                ratios.append([f"{m} / {methods[0]}", f"+{gain:g}", f"{len(pairs)} of {len(bases) * len(seeds)}", *cells])
        curves = {m: np.mean([[h["eval"] - starts[b, task] for h in main[m, task, b, s, best[m, task]]
                               if h["eval"] is not None] for b in bases for s in seeds], 0) for m in methods}
        plot(out / f"peers_{task.replace('+', '_')}.png", curves, every=eval_every,
             title=f"tiny SD3, {task}: mean eval gain over {len(bases)} bases x {len(seeds)} seeds", ylabel="eval gain")
        parts.append(f"### Task {task} (--rewards {PEER_TASKS[task]})\n\n"
                     + table(["method", "best lr", "eval gain", "runs reaching it", "optimizer steps", "forward NFE",
                              "backward NFE", "seconds", "fall-back median / max (> 0.01)"], rows)
                     + "\n\nAgainst V-GRPO, per base and seed where both reach the gain (peer / V-GRPO; median and range):"
                     + "\n\n" + table(["methods", "eval gain", "pairs", "optimizer steps", "model evaluations",
                                         "seconds"], ratios))
    return (f"The committed tiny SD3 bases {', '.join(map(str, bases))} (builders.FITTED: the same on every machine), "
            f"8 prompts x 8 samples per iteration, {iterations} iterations, LoRA r 32 alpha 64, AdamW; seeds "
            f"{seeds[0]}-{seeds[-1]} on every base; each method at its best lr of {', '.join(f'{lr:g}' for lr in lrs)} "
            f"(a sweep on base {bases[0]}). Evaluated by rollouts.evaluate every {eval_every} iterations on 32 prompts x 4 "
            "fixed noises (8-step Euler); DiffusionNFT evaluates its EMA, as it does. Gains are over the base's own "
            "evaluation before any update (bench.base_eval). Cells: median (range) over the runs reaching the gain. Forward NFE: rollout steps, old-policy, "
            "reference and gradient passes' forwards; backward NFE: the backwards. V-GRPO: train.py's tiny preset; "
            "DiffusionNFT, MixGRPO (-Flash) and Flow-GRPO: baselines.py, written from their published algorithms; "
            "Flow-GRPO's validated against its own code, the others against their definitions only so far "
            "(docs/benchmarks.md).\n\n" + "\n\n".join(parts))


# ----------------------------------------------------------------------------------------------
# 10. Reward hacking and the guards against it

HACKED, HELD_OUT = "jpeg_incompressibility", "color"  # trained on / monitored: JPEG size grows with noise and texture
HACKING_VARIANTS = {
    "no guard (tiny preset)": (),
    "reference KL 0.3": ("--ref_kl_coef", "0.3"),
    "reference KL 3": ("--ref_kl_coef", "3"),
    "EMA 0.8, evaluated": ("--ema_decay", "0.8", "--eval_with_ema"),
    "reference KL 0.3 + EMA 0.8": ("--ref_kl_coef", "0.3", "--ema_decay", "0.8", "--eval_with_ema"),
}


def hacking_run(model_dir: Path, run_dir: Path, seed: int, iterations: int, eval_every: int, flags=()) -> dict:
    """train.py (tiny preset) trained on HACKED with HELD_OUT as a monitor; its evaluations, the drift from the base
    (ref_kl, logged every iteration) and whether the hacking rule warned."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("train.py")), "--model", str(model_dir),
                           "--seed", str(seed), "--prompts", str(model_dir / "prompts.txt"), "--iterations",
                           str(iterations), "--eval_every", str(eval_every), "--run_dir", str(run_dir), "--rewards",
                           HACKED, "--monitor_rewards", HELD_OUT, *flags], check=True, capture_output=True, text=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/reward_mean" in m]
    return {"iteration": [m["iteration"] for m in evals], "trained": [m[f"eval/{HACKED}_mean"] for m in evals],
            "held_out": [m[f"eval/{HELD_OUT}_mean"] for m in evals], "ref_kl": [m["ref_kl"] for m in metrics],
            "x0_rms": [m["x0_rms"] for m in metrics],
            "warned": [int(w) for w in re.findall(r"possible reward hacking at iteration (\d+)", proc.stdout)]}


def section_hacking(out: Path, seeds=SEEDS, iterations: int = 40, eval_every: int = 5, fit_steps: int | None = None,
                    variants: dict = HACKING_VARIANTS) -> tuple[str, dict]:
    root = Path(tempfile.mkdtemp())
    fit_steps = train.Config().tiny_fit_steps if fit_steps is None else fit_steps
    builders.tiny_pipeline("sd3", seed=0, fit_steps=fit_steps).save_pretrained(root / "tiny-sd3")
    (root / "tiny-sd3" / "prompts.txt").write_text("\n".join(builders.TINY_PROMPTS) + "\n")
    runs = {name: [hacking_run(root / "tiny-sd3", root / f"{i}-{seed}", seed, iterations, eval_every, flags)
                   for seed in seeds] for i, (name, flags) in enumerate(variants.items())}
    return hacking_report(runs, out, seeds=seeds, iterations=iterations, eval_every=eval_every, fit_steps=fit_steps)


def hacking_report(runs: dict, out: Path, *, seeds, iterations: int, eval_every: int, fit_steps: int) -> tuple[str, dict]:
    """Section 10's table and plot from {variant: [run per seed]}: the change of the trained and of the held-out
    evaluation reward from the first evaluation to the last, the final drift from the base, and the hacking rule."""
    rows = []
    for name, rs in runs.items():
        gain = [r["trained"][-1] - r["trained"][0] for r in rs]
        held = [r["held_out"][-1] - r["held_out"][0] for r in rs]
        hacked = sum(g > 0 and h < 0 for g, h in zip(gain, held))
        rows.append([name, mean_std(gain), mean_std(held), f"{hacked} of {len(rs)}", mean_std([r["ref_kl"][-1] for r in rs]),
                     mean_std([r["x0_rms"][-1] / r["x0_rms"][0] - 1 for r in rs]),
                     f"{sum(bool(r['warned']) for r in rs)} of {len(rs)}"
                     + (f" (first at {int(np.median([r['warned'][0] for r in rs if r['warned']]))})"
                        if any(r["warned"] for r in rs) else "")])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rs in runs.items():
            ax.plot(np.mean([r["trained"] for r in rs], 0), np.mean([r["held_out"] for r in rs], 0), marker="o",
                    markersize=3, label=name)
        ax.set(title=f"trained {HACKED} against held-out {HELD_OUT} (mean of {len(seeds)} seeds, one point per evaluation)",
               xlabel=f"eval {HACKED} (trained)", ylabel=f"eval {HELD_OUT} (held out)")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "reward_hacking.png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    text = (f"Tiny SD3 fitted to toy images ({fit_steps} fitting steps), train.py's tiny preset trained for {iterations} "
            f"iterations on {HACKED} (the JPEG size: grown by noise and texture, whatever the prompt asks) with "
            f"{HELD_OUT} (does the image have the colour the prompt names) monitored on the 128 evaluation samples, "
            f"evaluated every {eval_every} iterations; seeds {seeds[0]}-{seeds[-1]}, mean ± std. Changes are last "
            "evaluation minus first; hacked = the trained reward rose while the held-out one fell; ref_kl = the x-space "
            "distance of the model's x-predictions from the base model's on the iteration's pairs (the reference KL's "
            "term, logged at weight 0 too); x0 drift = relative change of the rollouts' latent RMS; the rule = "
            "train.py's hacking rule (defaults: z 3 over 3 evaluations) warned. Plot: reward_hacking.png.\n\n"
            + table(["setting", f"trained {HACKED}", f"held-out {HELD_OUT}", "hacked", "final ref_kl", "x0 drift",
                     "hacking rule warned"], rows))
    return text, {"runs": runs}


# ----------------------------------------------------------------------------------------------
# 4. Overhead


def median_seconds(*fns, repeats: int = 10) -> list[float]:
    """Median wall time of each function, calls interleaved so that drift (clock, caches, other load)
    affects all of them alike. Each is called once first as a warm-up."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [float(np.median(ts)) for ts in times]


def update_vs_floor(model, cond: dict, *, samples: int, num_mc: int, lora_rank: int, grad_checkpointing: bool,
                    device, repeats: int = 5) -> dict:
    """Seconds for one vgrpo_update on `samples` rollouts against the bare forward + backward of the same
    model on the same (samples * K) noised inputs. `model` is a train.py adapter (velocity, latent_shape,
    transformer, which gets the LoRA adapter); cond is one prompt's conditioning, shared by all samples."""
    transformer = model.transformer
    if lora_rank:
        transformer.add_adapter(models.lora_config(train.Config(lora_rank=lora_rank, lora_alpha=2 * lora_rank)))
    else:
        transformer.requires_grad_(True)
    if grad_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(samples, *model.latent_shape(), generator=g).to(device)
    cond = {k: v.repeat_interleave(samples, 0).to(device) for k, v in cond.items()}
    t, eps = vgrpo.draw_mc_pairs(1, samples, num_mc, x0.shape[1:], generator=g)
    t, eps = t.to(device), eps.to(device)
    surrogate = partial(vgrpo.elbo_surrogate, model.velocity)
    with torch.no_grad():
        s_old, _ = surrogate(x0, cond, t, eps)
    rollouts = vgrpo.Rollouts(x0, cond, torch.randn(samples, generator=g).to(device), t, eps, s_old)
    rows = torch.arange(samples).repeat_interleave(num_mc).to(device)
    tb = t.flatten().view(-1, *[1] * (x0.dim() - 1))
    z = (1 - tb) * x0[rows] + tb * eps.flatten(0, 1)
    cond_rows = {k: v[rows] for k, v in cond.items()}

    def floor():
        model.velocity(z, t.flatten(), cond_rows).square().mean().backward()
        transformer.zero_grad(set_to_none=True)

    def step():
        vgrpo.vgrpo_update(surrogate, optimizer, rollouts, micro_batch_size=samples)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    floor_s, step_s = median_seconds(lambda: (floor(), sync()), lambda: (step(), sync()), repeats=repeats)
    return {"floor_s": floor_s, "step_s": step_s, "ratio": step_s / floor_s}


def tiny_model(fit_steps: int = 0) -> adapters.SD3:
    """The tiny SD3 pipeline of train.py behind its adapter."""
    cfg = train.Config()
    return adapters.SD3(builders.tiny_pipeline("sd3", seed=0, fit_steps=fit_steps), resolution=cfg.resolution,
                        sampling_steps=cfg.sampling_steps, max_sequence_length=cfg.max_sequence_length)


def run_train(args: list[str], nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as run_dir:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
        subprocess.run([sys.executable, *launcher, str(Path(__file__).with_name("train.py")), "--run_dir", run_dir, *args],
                       check=True, capture_output=True, env=env)
        return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def section_overhead() -> tuple[str, dict]:
    model = tiny_model()
    ratio = update_vs_floor(model, model.encode(["a red car"]), samples=16, num_mc=4, lora_rank=32,
                            grad_checkpointing=False, device=torch.device("cpu"), repeats=41)
    args = ["--tiny_fit_steps", "0", "--iterations", "6", "--eval_every", "0", "--save_every", "1000",
            "--num_prompts", "4", "--group_size", "8", "--micro_batch_size", "8", "--rollout_batch_size", "16"]
    phases = {n: run_train(args, n)[1:] for n in (1, 2)}  # iteration 0 includes warm-up
    keys = ["time_rollout", "time_reward", "time_update", "images_per_s", "peak_memory_gb"]
    rows = [[f"{n} process{'es' if n > 1 else ''}"] + [f"{np.mean([m[k] for m in ms]):.3f}" for k in keys]
            for n, ms in phases.items()]
    text = (f"One vgrpo_update (16 samples x K = 4, LoRA r 32, AdamW; median of 41) on the tiny SD3 transformer: "
            f"{ratio['step_s'] * 1e3:.1f} ms "
            f"against {ratio['floor_s'] * 1e3:.1f} ms for the bare forward + backward of the same model on the same 64 "
            f"noised inputs: x{ratio['ratio']:.2f}.\n\n"
            "train.py on the tiny SD3 model (random weights, 4 prompts x 8 samples, 8 Euler steps, K = 4), mean of "
            "iterations 1-5; peak memory is the peak resident set of rank 0 on CPU.\n\n"
            + table(["run"] + keys, rows))
    return text, {"update_vs_floor": ratio, "phases": {n: ms for n, ms in phases.items()}}


# ----------------------------------------------------------------------------------------------
# 4b. Scale: model evaluations of the old-policy pass, FSDP2 all-gathers of the rollouts


def old_pass_saving(model, cond: dict, *, samples: int = 32, num_mc: int = 4, num_grad_steps: int, repeats: int = 11) -> dict:
    """One iteration's steps 5 + 6 on the tiny SD3 transformer with LoRA, before (a separate old-policy pass over
    every sample, then vgrpo_update) and after (vgrpo_update computing s_old only where it differs): surrogate rows
    evaluated with and without gradient, and interleaved median seconds."""
    transformer = model.transformer
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0)  # the weights stay put, so every repeat does the same work
    rows = {"grad": 0, "no_grad": 0}

    def counting(z, t, c):
        rows["grad" if torch.is_grad_enabled() else "no_grad"] += z.shape[0]
        return model.velocity(z, t, c)

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(samples, *model.latent_shape(), generator=g)
    cond = {k: v.repeat_interleave(samples, 0) for k, v in cond.items()}
    t, eps = vgrpo.draw_mc_pairs(1, samples, num_mc, x0.shape[1:], generator=g)
    adv = torch.randn(samples, generator=g)
    surrogate = partial(vgrpo.elbo_surrogate, counting)
    update = partial(vgrpo.vgrpo_update, surrogate, optimizer, num_grad_steps=num_grad_steps,
                     micro_batch_size=samples // num_grad_steps)

    def before():
        with torch.no_grad():
            s_old, _ = surrogate(x0, cond, t, eps)
        update(vgrpo.Rollouts(x0, cond, adv, t, eps, s_old))

    def after():
        update(vgrpo.Rollouts(x0, cond, adv, t, eps))

    counts = {}
    for name, fn in (("before", before), ("after", after)):
        rows.update(grad=0, no_grad=0)
        fn()
        counts[name] = {k: v / samples for k, v in rows.items()}  # per sample
    before_s, after_s = median_seconds(before, after, repeats=repeats)
    return {"rows_per_sample": counts, "before_s": before_s, "after_s": after_s, "ratio": after_s / before_s}


GATHER_WORKER = """
import json, sys, torch, torch.distributed as dist
import adapters, builders, parallel, vgrpo
dist.init_process_group("gloo")
calls = {"n": 0, "bytes": 0}
all_gather_single = dist.all_gather_single
def counted(output, *args, **kwargs):  # FSDP2's one all-gather per unit
    calls["n"] += 1
    calls["bytes"] += output.numel() * output.element_size()
    return all_gather_single(output, *args, **kwargs)
dist.all_gather_single = counted
torch.manual_seed(0)
model = adapters.SD3(builders.tiny_pipeline("sd3"), resolution=32, sampling_steps=int(sys.argv[2]), max_sequence_length=8)
parallel.apply_fsdp(model.transformer, torch.device("cpu"), torch.float32)
noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(dist.get_rank()))
cond = model.encode(["a red car", "a blue flower"])
out = {}
for once in (True, False):  # once first: FSDP2 leaves the root unsharded after the per-step pass
    calls.update(n=0, bytes=0)
    with parallel.gathered_once(model.transformer) if once else torch.no_grad():
        x = vgrpo.sample_ode(model.velocity, noise, cond, model.timesteps())
    out[str(once)] = dict(calls), x.tolist()
    if once:  # every unit, the root included, is sharded again after the block
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.transformer.parameters())
if dist.get_rank() == 0:
    json.dump(out, open(sys.argv[1], "w"))
dist.barrier()
dist.destroy_process_group()
"""


def rollout_all_gathers(steps: int = 6) -> dict:
    """FSDP2 all-gather calls and bytes of one Euler rollout of `steps` steps on the tiny SD3 transformer sharded
    over 2 gloo ranks, per ODE step ("False") and with parallel.gathered_once ("True"), and the samples of each."""
    with tempfile.TemporaryDirectory() as tmp:
        worker, out = Path(tmp) / "worker.py", Path(tmp) / "out.json"
        worker.write_text(GATHER_WORKER)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(worker), str(out), str(steps)], env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode and not (out.is_file() and parallel.gloo_teardown_abort(proc.stdout + proc.stderr)):
            raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
        return json.loads(out.read_text())


def section_scale() -> tuple[str, dict]:
    model = tiny_model()
    model.transformer.add_adapter(models.lora_config(train.Config()))
    cond = model.encode(["a red car"])
    saving = {n: old_pass_saving(model, cond, num_grad_steps=n) for n in (1, 2)}
    gathers = rollout_all_gathers(steps=8)
    rows = [[n, f"{s['rows_per_sample']['before']['no_grad']:g} + {s['rows_per_sample']['before']['grad']:g}",
             f"{s['rows_per_sample']['after']['no_grad']:g} + {s['rows_per_sample']['after']['grad']:g}",
             f"{s['before_s'] * 1e3:.0f}", f"{s['after_s'] * 1e3:.0f}", f"x{s['ratio']:.2f}"] for n, s in saving.items()]
    per_step, once = gathers["False"][0], gathers["True"][0]
    text = ("Old-policy pass (tiny SD3, LoRA r 32, 32 samples, K = 4; interleaved medians of 11): surrogate rows "
            "per sample without + with gradient (a row with gradient costs a forward and a backward).\n\n"
            + table(["gradient steps", "rows before", "rows after", "ms before", "ms after", "after / before"], rows)
            + f"\n\nFSDP2 rollouts (tiny SD3: 2 blocks + root, 2 gloo ranks, 8 Euler steps): {per_step['n']} all-gathers, "
            f"{per_step['bytes'] / 1e6:.2f} MB gathered per rank when every step re-gathers; {once['n']} all-gathers, "
            f"{once['bytes'] / 1e6:.2f} MB with parallel.gathered_once (samples identical: "
            f"{gathers['False'][1] == gathers['True'][1]}).")
    return text, {"old_pass": saving, "all_gathers": {"per_step": per_step, "once": once}}


# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="1,2,3,4,5,7",
                        help="comma-separated section numbers (6: real checkpoints, 8 and 9: stability, 10: "
                             "reward hacking)")
    parser.add_argument("--out", default="results", help="output directory")
    parser.add_argument("--reduced", action="store_true",
                        help="section 6 on real-width, reduced-depth pipelines with random weights (no hub)")
    parser.add_argument("--jobs", type=int, default=2, help="section 11: runs at a time (each with its share of the cores)")
    parser.add_argument("--peer-run", help=argparse.SUPPRESS)  # section 11's worker: one run, its history to a file
    args = parser.parse_args()
    if args.peer_run:
        method, task, base, seed, lr, iterations, eval_every, root, path = json.loads(args.peer_run)
        history = peer_history(method, task, base, seed, lr, iterations=iterations, eval_every=eval_every, root=Path(root))
        Path(path).write_text(json.dumps(history))
        return
    sections = {int(s) for s in args.sections.split(",") if s.strip().isdigit()}
    if not sections or len(sections) != len(args.sections.split(",")) or not sections <= set(range(1, 12)):
        parser.error(f"--sections {args.sections!r}: comma-separated section numbers from 1 to 11")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report = earlier_sections(out / "results.md")  # a run of some sections keeps the others' figures
    data = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    toy_model = vgrpo.pretrain_toy_flow() if sections & {1, 2, 3, 8} else None
    import bench_gpu  # sections 5 and 6; it imports this module's helpers, so not at the top
    jobs = {
        1: ("1. Surrogate statistics", lambda: section_surrogate(toy_model, tiny_model(fit_steps=250))),
        2: ("2. Ablations on the 2-D toy", lambda: section_ablations(toy_model, out)),
        3: ("3. V-GRPO against Flow-GRPO on the 2-D toy", lambda: section_mdp(toy_model, out)),
        4: ("4. Overhead", section_overhead),
        7: ("7. Scale: the old-policy pass and FSDP2 rollout all-gathers", section_scale),
        8: ("8. Stability: learning rate against the gradient-step controls", lambda: section_stability(toy_model, out)),
        9: ("9. Stability on the tiny SD3 pipeline: V-GRPO against Flow-GRPO", lambda: section_sd3_stability(out)),
        10: ("10. Reward hacking and the guards against it", lambda: section_hacking(out)),
        11: ("11. V-GRPO against DiffusionNFT, MixGRPO and Flow-GRPO on shared bases",
             lambda: section_peers(out, jobs=args.jobs)),
        5: ("5. GPU throughput at the paper's model sizes", bench_gpu.section_gpu),
        6: ("6. The real-model path on real checkpoints", lambda: bench_gpu.section_real_models(
            bench_gpu.reduced_checkpoints(Path(tempfile.mkdtemp())) if args.reduced else bench_gpu.REAL_MODELS)),
    }
    machine = f"{os.cpu_count()} CPU cores" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    for number in sorted(sections):
        title, job = jobs[number]
        if number in (5, 6) and not torch.cuda.is_available():
            print(f"## {title}: skipped, no CUDA device (results.md keeps an earlier run's figures)")
            continue
        start = time.perf_counter()
        data = {key: value for key, value in data.items() if not key.startswith(f"{number}. ")}  # a renamed section
        text, data[title] = job()
        report[number] = (f"## {title}\n\n{text}\n\n({time.perf_counter() - start:.0f} s; {time.strftime('%Y-%m-%d')}, "
                          f"{machine}, torch {torch.__version__})")
        print(report[number], flush=True)
    (out / "results.md").write_text("\n\n".join(["# bench.py results", *(report[n] for n in sorted(report))]) + "\n")
    (out / "results.json").write_text(json.dumps(data, indent=1, default=float))


def earlier_sections(path: Path) -> dict[int, str]:
    """The sections of an earlier results.md by number (each ends with its own date and machine)."""
    if not path.is_file():
        return {}
    return {int(part.split(".")[0]): "## " + part.strip() for part in path.read_text().split("\n\n## ")[1:]}


if __name__ == "__main__":
    main()
