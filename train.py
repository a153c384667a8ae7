"""train.py: V-GRPO for diffusers flow-matching models, one process or torchrun + FSDP2: the config, Algorithm 1, main.

Algorithm 1 of Tang et al., "Online Reinforcement Learning for Denoising Generative Models Is Easier than You Think"
(arXiv 2604.23380); every equation lives in vgrpo.py, this file is the driver. Models: SD3 / SD3.5, FLUX.1,
Qwen-Image, FLUX.2 [klein] and Wan (text to video), one adapter each in adapters.py.

    python train.py                                   # tiny SD3 built from configs: CPU, offline, minutes
    python train.py --model DIR_OR_HUB_ID --prompts prompts.txt --rewards pickscore:1,hpsv21:1
    torchrun --nproc_per_node=8 train.py --preset sd35m --prompts pickscore --run_dir runs/sd35m # the paper, stage 1
    torchrun --nproc_per_node=8 train.py --preset flux --prompts hpdv2          # paper: FLUX.1-dev
    torchrun --nproc_per_node=8 train.py --preset wan21 --prompts ocr           # video: Wan2.1-1.3B, Flow-GRPO's
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --max_restarts=3 \
        train.py --preset sd35m --prompts pickscore --run_dir runs/sd35m      # two nodes, workers restarted on failure
    python train.py --preset flux --plan --plan_world_size 8 --plan_gpu_gb 80  # memory per GPU, before loading anything
    python evaluate.py --runs runs/NAME --prompts drawbench                     # base vs trained on a benchmark
    python train.py --help                            # every option, with its default

The same command run again continues its --run_dir from the last checkpoint (a requeued job, a restart); a finished
run says so; --resume continues with changed flags, --fresh starts over (runs.py says what each keeps).

Beyond the paper, against reward hacking (off by default): --ref_kl_coef (the x-space KL to the frozen base model),
--ema_decay, --monitor_rewards with the hacking rule (guards.py, docs/training.md).

Data parallelism: the num_prompts groups of an iteration are split over the ranks as WHOLE groups, so
a group's G samples and its shared (t, eps) pairs live on one rank. Rewards are all-gathered before
the advantages, which are computed for the global batch on every rank (global std, logging).

Choices beyond vgrpo.py's: rollouts integrate the ODE with vgrpo.sample_ode on the sigma grid the pipeline's own
__call__ uses (its scheduler, shift and resolution-dependent mu), so solver "euler" is exactly
`pipe(prompt, num_inference_steps=N)` from the same noise where the pipeline ships an Euler scheduler; solver
"scheduler" steps a copy of whatever scheduler it ships (Wan's UniPC) and equals `pipe()` there. Trainable weights are
float32 master weights whatever --dtype the compute runs in. The transformer stays in eval mode (no dropout), so the
old-policy pass and the first gradient pass agree exactly.
"""

import failures  # isort: split  (first: it imports no torch, and catches a Ctrl-C during the imports below)

if __name__ == "__main__":
    failures.quiet_ctrl_c_while_importing()

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import signal
import time
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import adapters
import checkpoint
import guards
import memory
import models
import parallel
import prompts as prompt_sets
import rewards
import rollouts
import runs
import vgrpo
from failures import ConfigError
from prompts import Prompt


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # --- model and data
    preset: str = arg("tiny", "tiny | sd35m | flux | qwenimage | flux2 | tiny-wan | wan21 | wan22-5b: settings applied "
                              "before the other flags")
    model: str = arg("tiny", "diffusers pipeline dir or hub id (SD3/SD3.5, FLUX.1, Qwen-Image, FLUX.2 [klein], Wan2.1 / "
                             "Wan2.2-TI2V-5B); tiny | tiny-flux | tiny-qwenimage | tiny-flux2 | tiny-wan build a tiny one "
                             "offline")
    prompts: str = arg("", "training prompts: .txt (one per line), .jsonl ({'prompt': ..., metadata}) or a named set "
                           "(ocr, geneval, pickscore, pickapic, hpdv2, ...: its train split; prompts.py); tiny models "
                           "have built-ins")
    eval_prompts: str = arg("", "fixed evaluation prompts, same forms; default: a named set's test split, else the "
                                "first eval_samples training prompts")
    eval_samples: int = arg(32, "evaluation samples: the eval prompts in order, cycled (each repeat with its own fixed "
                                "noise) to this many")
    resolution: int = arg(32, "image height and width in pixels (video models: the height, see --width)")
    width: int = arg(0, "video models: frame width in pixels (0 = --resolution, square)")
    num_frames: int = arg(0, "video models: frames per video, 1 + a multiple of 4 for Wan (e.g. 33, 81); 0 = the "
                             "model's default (Wan 81, tiny-wan 5; image models 1)")
    max_sequence_length: int = arg(8, "text tokens per prompt (T5's; Qwen-Image: at most, after its template)")
    tiny_fit_steps: int = arg(250, "tiny models only: steps fitting them to toy images (videos) before RL (0 = random "
                                   "weights)")
    # --- rewards
    rewards: str = arg("color", "name:weight,... from rewards.REWARDS, e.g. hpsv21:1,pickscore:1,clipscore:1")
    reward_options: str = arg("{}", "JSON {reward_name: {factory option: value}}, e.g. '{\"pickscore\": {\"model\": \"/ckpt\"}}'")
    reward_aggregation: str = arg("advantage", "advantage: sum of per-reward advantages (MixGRPO) | reward: advantage of the weighted sum")
    frame_interval: int = arg(0, "video models: image rewards score every n-th frame, averaged (0 = each reward's own: "
                                 "ocr 4 as Flow-GRPO, the others 1 as Flow-Factory); video rewards (motion) see all")
    # --- rollouts
    sampling_steps: int = arg(8, "ODE steps per rollout")
    solver: str = arg("euler", "euler | heun (2 NFE/step) | ab2 (2nd-order multistep, 1 NFE/step) | dpm2 "
                               "(DPM-Solver++(2M), 1 NFE/step) | scheduler (the pipeline's own scheduler, e.g. Wan's "
                               "UniPC, stepped as pipe() does)")
    cfg_scale: float = arg(1.0, "classifier-free guidance for rollouts only, combined as the model's pipeline does (SD3, "
                                "Qwen-Image: true CFG with norm rescale, FLUX.2 [klein] base); 1 = off, as in the paper")
    flux_guidance: float = arg(3.5, "FLUX.1-dev distilled-guidance embedding value (unused by models without one, e.g. schnell)")
    # --- V-GRPO (names as in vgrpo.py)
    num_prompts: int = arg(8, "prompts (groups) per iteration, global")
    group_size: int = arg(8, "G: samples per prompt")
    num_mc: int = arg(4, "K: (t, eps) pairs per sample")
    t_min: float = arg(0.0, "lower end of the surrogate's timestep range")
    t_max: float = arg(1.0, "upper end of the surrogate's timestep range")
    stratified: bool = arg(True, "one timestep in each of K equal strata (variance reduction 2)")
    group_shared: bool = arg(True, "one set of pairs per group (variance reduction 1)")
    param: str = arg("x", "surrogate error: x (paper) | v | eps")
    self_normalize: bool = arg(True, "divide by the stop-gradient mean |e| (variance reduction 3)")
    global_std: bool = arg(False, "normalise advantages by the batch std instead of each group's")
    soft_clip_eta: float | None = arg(3.0, "advantage soft clip eta * tanh(A / eta); none = off")
    clip_eps: float | None = arg(None, "PPO ratio clip epsilon (acts when num_grad_steps > 1); none = off")
    kl_coef: float = arg(0.0, "weight of the x-space KL to the behaviour policy (Eq. 16)")
    num_grad_steps: int = arg(1, "optimizer steps per rollout batch (1 = fully on-policy)")
    # --- guards against reward hacking (not in the paper; docs/training.md, "Reward hacking")
    ref_kl_coef: float = arg(0.0, "weight of the x-space KL to the frozen base model (LoRA: the adapters switched off; "
                                  "full fine-tuning: a frozen copy); under LoRA ref_kl is logged at 0 too")
    ema_decay: float = arg(0.0, "EMA of the trainable weights, updated once per iteration, float32 (0 = off)")
    eval_with_ema: bool = arg(False, "evaluate the EMA weights instead of the trained ones")
    export_ema: bool = arg(False, "export the EMA weights instead of the trained ones (final/export.json says which)")
    monitor_rewards: str = arg("", "rewards scored on the evaluation samples but not trained on, comma-separated")
    hacking_z: float = arg(3.0, "the hacking rule: a monitored reward falling by more than this many standard errors "
                                "while the trained reward rises over hacking_window evaluations")
    hacking_window: int = arg(3, "evaluations the hacking rule looks back")
    max_x0_drift: float = arg(0.0, "the hacking rule: a relative change of the rollouts' mean latent RMS from the "
                                   "first iteration's beyond this (0 = not checked)")
    stop_on_hacking: bool = arg(False, "stop when the hacking rule fires (default: warn and go on)")
    # --- optimisation
    iterations: int = arg(40, "training iterations")
    lr: float = arg(1e-3, "AdamW learning rate")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    lora_rank: int = arg(32, "LoRA rank on the attention projections; 0 = full fine-tuning")
    lora_alpha: int = arg(64, "LoRA alpha")
    lora_targets: str = arg("auto", "LoRA target modules, comma-separated; auto = the family's attention projections "
                                    "(to_q,to_k,to_v,to_out.0 and, where the blocks have them, the text stream's "
                                    "add_q_proj,add_k_proj,add_v_proj,to_add_out)")
    init_lora: str = arg("", "a LoRA export (a run's final/) the adapters start from, as each of the paper's SD3.5-M "
                             "stages starts from the one before (--preset sd35m-stageN)")
    # --- systems
    micro_batch_size: int = arg(4, "samples per forward/backward in the gradient steps (per rank)")
    rollout_batch_size: int = arg(32, "samples per sampling / decoding / reward call (per rank)")
    dtype: str = arg("auto", "compute dtype: auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32")
    grad_checkpointing: bool = arg(False, "activation checkpointing in the transformer")
    compile: str = arg("none", "none | inductor | aot_eager: torch.compile each transformer block with this backend "
                               "(regional: LoRA, FSDP2, checkpoints and exports unchanged; the first iterations compile)")
    offload_text_encoders: bool = arg(True, "keep the frozen text encoders on the CPU, on the GPU only while encoding")
    rollout_gather_once: bool = arg(True, "under FSDP2 gather the transformer once per rollout batch, not once per ODE "
                                          "step (fewer all-gathers; holds one unsharded copy during rollouts)")
    hsdp: int = arg(0, "HSDP replica groups: shard within each, replicate across (0 = one per node on several nodes, "
                       "1 = plain FSDP over all ranks)")
    seed: int = arg(0, "base seed; see the seeding rules in train()")
    run_dir: str = arg("", "output directory; default runs/<preset>-<time>. One that holds a run is continued: from its "
                           "last checkpoint when the flags are its own (the same command again), else refused")
    resume: str = arg("", "run directory to continue from its last checkpoint with the flags given here changed (its "
                          "config.json is the base)")
    fresh: bool = arg(False, "start the run in --run_dir over: its config, metrics, samples, checkpoints and export are "
                             "removed first (nothing else there); ignored when torchrun or Slurm restarts the same job")
    log_every: int = arg(10, "iterations between metric lines on stdout (metrics.jsonl gets every iteration)")
    eval_every: int = arg(10, "iterations between evaluations on the fixed prompts (0 = never)")
    max_skipped_steps: int = arg(3, "stop as diverged after this many consecutive skipped (non-finite) gradient steps")
    save_every: int = arg(10, "iterations between checkpoints (also on SIGTERM / SIGINT and at the end)")
    tracker: str = arg("none", "none | tensorboard | wandb (metrics.jsonl is always written)")
    # --- memory plan
    plan: bool = arg(False, "print the per-GPU memory plan from the configs (no weights loaded) and exit: 0 if it fits "
                            "with 10% headroom, else 1 with the flag that would make it fit")
    plan_world_size: int = arg(0, "GPUs to plan for (0: torchrun's WORLD_SIZE, else the visible GPUs)")
    plan_gpu_gb: float = arg(0.0, "GiB per GPU to plan for (0: the visible GPU's memory)")


PRESETS = {
    # K = 8: on the pipeline's own (finer-ending) grid the tiny run with K = 4 learned then fell back (eval 0.573 ->
    # 0.615 at iteration 40 -> 0.554 at 60); K = 8 rose steadily (0.578 -> 0.650 at 40) for 20% more time.
    # 128 evaluation samples (the 32 built-in prompts x 4 noises): 8 samples moved by +-0.02 between evaluations of
    # one run, as much as RL gains here, so the eval curve said little (README, "Stability").
    # Two gradient steps per batch with the ratio clip and the x-space KL (bench.py section 9, 5 seeds): eval 0.60 in
    # a median 6 iterations as with one step, 0.61 in 5 of 5 seeds instead of 3, and no fall-back after the best.
    # KL 1 rather than 0.3: at lr 3e-3, 0.3 let one seed in 5 fall back by 0.018 (rollouts spreading, the toy's
    # pattern: latent RMS 2.7 -> 3.5, within-group surrogate CV 0.07 -> 0.2, gradient norm doubling); with 1 no seed
    # fell back by more than 0.008 at 3e-3, and at lr 1e-3 it reached 0.61 and 0.62 no later than 0.3 did.
    "tiny": dict(num_mc=8, eval_samples=128, num_grad_steps=2, clip_eps=0.01, kl_coef=1.0),
    # The tiny Wan pipeline (builders.tiny_wan_pipeline, 5-frame videos of a square moving in the captioned direction)
    # with tiny's V-GRPO settings, sampled as its pipe() samples (UniPC); trained on the colour reward scored frame by
    # frame, the motion reward monitored: this tiny base does not follow the direction words (README, "Video").
    "tiny-wan": dict(model="tiny-wan", rewards="color:1", monitor_rewards="motion", solver="scheduler", num_mc=8,
                     eval_samples=128, num_grad_steps=2, clip_eps=0.01, kl_coef=1.0),
    # Paper, SD3.5-Medium stage 1 (preference): fully on-policy, soft clip only. micro_batch_size 4 (16 rows of
    # K = 4 per forward): the memory plan (--plan) puts 8 at 87 GiB per GPU, 4 at 49 GiB of 80; same compute.
    "sd35m": dict(model="stabilityai/stable-diffusion-3.5-medium", resolution=512, max_sequence_length=256,
                  rewards="hpsv21:1,pickscore:1,clipscore:1", num_prompts=48, group_size=24, sampling_steps=40,
                  solver="euler", num_mc=4, num_grad_steps=1, soft_clip_eta=3.0, clip_eps=None, lr=3e-4,
                  lora_rank=32, lora_alpha=64, iterations=150, micro_batch_size=4, rollout_batch_size=24),
    # Paper, SD3.5-Medium, the five stages of its Table 3: below, after PRESETS.
    # Paper, FLUX.1-dev: 16-step higher-order ODE, ratio clip (+ soft clip). Group size, batch, the number of
    # gradient steps and the optimiser are not in the paper's text we have: inferred, see README.
    "flux": dict(model="black-forest-labs/FLUX.1-dev", resolution=720, max_sequence_length=512,
                 rewards="hpsv21:1,pickscore:1,imagereward:1", num_prompts=32, group_size=12, sampling_steps=16,
                 solver="ab2", num_mc=4, num_grad_steps=2, clip_eps=0.01, soft_clip_eta=3.0, lr=1e-4,
                 lora_rank=32, lora_alpha=64, iterations=300, micro_batch_size=2, rollout_batch_size=12,
                 grad_checkpointing=True),
    # Qwen-Image with Flow-GRPO's published setting (config/grpo.py, pickscore_qwenimage_8gpu): 512 px, 10 ODE steps,
    # true CFG 4, 16 images per prompt, 32 prompts per epoch, PickScore, LoRA, activation checkpointing; lr and
    # LoRA rank as this project's SD3.5 preset (Flow-GRPO's defaults). V-GRPO's own settings as the sd35m preset.
    "qwenimage": dict(model="Qwen/Qwen-Image", resolution=512, max_sequence_length=256, rewards="pickscore:1",
                      num_prompts=32, group_size=16, sampling_steps=10, cfg_scale=4.0, solver="euler", num_mc=4,
                      num_grad_steps=1, soft_clip_eta=3.0, clip_eps=None, lr=3e-4, lora_rank=32, lora_alpha=64,
                      iterations=150, micro_batch_size=2, rollout_batch_size=16, grad_checkpointing=True),
    # FLUX.2 [klein] base 4B with Flow-Factory's published GRPO LoRA setting (examples/grpo/lora/flux2_klein_base/
    # default.yaml): 384 px, 8 steps, CFG 4, group 16, 48 prompts per epoch, 2 gradient steps per epoch, LoRA r 64 /
    # alpha 128, lr 3e-4, weight decay 1e-4, PickScore. The base model: the distilled 4B ignores CFG.
    "flux2": dict(model="black-forest-labs/FLUX.2-klein-base-4B", resolution=384, max_sequence_length=512,
                  rewards="pickscore:1", num_prompts=48, group_size=16, sampling_steps=8, cfg_scale=4.0, solver="euler",
                  num_mc=4, num_grad_steps=2, clip_eps=0.01, soft_clip_eta=3.0, lr=3e-4, weight_decay=1e-4,
                  lora_rank=64, lora_alpha=128, iterations=300, micro_batch_size=4, rollout_batch_size=16,
                  # 20 of klein 4B's 25 blocks are single blocks, whose q, k, v come from one fused projection
                  # (with the MLP's input): without it LoRA would reach only the 5 double blocks.
                  lora_targets="to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,to_qkv_mlp_proj"),
    # Wan2.1-T2V-1.3B with Flow-GRPO's published video setting (config/grpo.py, general_ocr_wan2_1; reward video_ocr:
    # every 4th frame): 240 x 416 px, 33 frames, 20 sampling steps, CFG 4.5, 4 videos per prompt, 32 prompts per
    # epoch on 8 GPUs, lr 1e-4, LoRA; its UniPC scheduler stepped as pipe() steps it. V-GRPO's own settings as sd35m.
    "wan21": dict(model="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", resolution=240, width=416, num_frames=33,
                  max_sequence_length=512, rewards="ocr:1", num_prompts=32, group_size=4, sampling_steps=20,
                  cfg_scale=4.5, solver="scheduler", num_mc=4, num_grad_steps=1, soft_clip_eta=3.0, clip_eps=None,
                  lr=1e-4, lora_rank=32, lora_alpha=64, iterations=300, micro_batch_size=2, rollout_batch_size=16,
                  grad_checkpointing=True),
    # Wan2.2-TI2V-5B (one transformer) with Flow-Factory's published Wan2.2 GRPO LoRA setting (examples/grpo/lora/
    # wan22/t2v.yaml, written for Wan2.2-A14B, whose two experts this project refuses): 480 px, 5 frames, 10 steps,
    # CFG 4, group 16, 48 prompts per epoch, 2 gradient steps per epoch, LoRA r 64 / alpha 128, lr 1e-4, weight decay
    # 1e-4, PickScore on every frame. V-GRPO's own settings as the flux preset (2 gradient steps: the ratio clip).
    "wan22-5b": dict(model="Wan-AI/Wan2.2-TI2V-5B-Diffusers", resolution=480, num_frames=5, max_sequence_length=512,
                     rewards="pickscore:1", num_prompts=48, group_size=16, sampling_steps=10, cfg_scale=4.0,
                     solver="scheduler", num_mc=4, num_grad_steps=2, clip_eps=0.01, soft_clip_eta=3.0, lr=1e-4,
                     weight_decay=1e-4, lora_rank=64, lora_alpha=128, iterations=300, micro_batch_size=4,
                     rollout_batch_size=16, grad_checkpointing=True),
}

# The paper's SD3.5-M curriculum (Table 3, 580 gradient steps): preference / GenEval / preference / GenEval / OCR for
# 150, 200, 150, 50 and 30 gradient steps, K = 4 in the preference stages and 10 in the others (NFE per step 40 + 2K:
# 48 and 60), on Flow-GRPO's prompt files, each starting from the stage before's LoRA (--init_lora RUN/final). Where the
# paper is silent, the choice made: the GenEval and OCR stages take 2 gradient steps per rollout batch with the ratio
# clip 0.01 and no soft clip (the paper names a ratio clip there and the soft clip for the fully on-policy stages; 2 is
# the least that makes a ratio clip act), so their iterations are half their gradient steps; micro_batch_size 2 there
# (20 rows of K = 10: --plan gives 49.9 GiB per GPU of 80 on 8; 4 gives 98.2); the OCR stage's x-space KL (beta 0.3)
# is Eq. 16's, to the behaviour policy (--kl_coef).
_PREFERENCE = dict(PRESETS["sd35m"], prompts="pickscore")
_GENEVAL = dict(PRESETS["sd35m"], prompts="geneval", rewards="geneval:1", num_mc=10, num_grad_steps=2, clip_eps=0.01,
                soft_clip_eta=None, micro_batch_size=2)
PRESETS.update({
    "sd35m-stage1": dict(_PREFERENCE, iterations=150),
    "sd35m-stage2": dict(_GENEVAL, iterations=100),
    "sd35m-stage3": dict(_PREFERENCE, iterations=150),
    "sd35m-stage4": dict(_GENEVAL, iterations=25),
    "sd35m-stage5": dict(_GENEVAL, prompts="ocr", rewards="ocr:1", kl_coef=0.3, iterations=15),
})


def parse_config(argv: list[str] | None = None) -> Config:
    """Defaults < preset < the continued run's config.json < flags given on the command line. A --run_dir that holds
    a run continues it (--fresh aside): with the flags given its own but for MAY_CHANGE_ON_CONTINUE, or any with
    --resume but for FIXED_ON_RESUME; each refusal is one line naming the choices."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(Config)
    for f in fields(Config):
        kind = hints[f.name]
        help_text = f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")  # argparse %-formats help
        common = dict(default=argparse.SUPPRESS, help=help_text)
        if kind is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **common)
        elif isinstance(kind, types.UnionType):  # float | None: the word "none" turns it off
            base = next(a for a in kind.__args__ if a is not type(None))
            parser.add_argument(f"--{f.name}", type=lambda s, b=base: None if s.lower() == "none" else b(s), **common)
        else:
            parser.add_argument(f"--{f.name}", type=kind, **common)
    given = vars(parser.parse_args(argv))
    preset = given.get("preset", Config.preset)
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    values = dict(PRESETS[preset])
    run_dir = given.get("resume") or given.get("run_dir")
    if given.get("resume") and not runs.holds_run(Path(run_dir)):
        raise ConfigError(f"--resume {run_dir}: no config.json there; pass the directory of an earlier run")
    if run_dir and runs.holds_run(Path(run_dir)) and not (given.get("fresh") and not parallel.restarted()):  # fresh_start
        saved = runs.read_run_config(Path(run_dir) / "config.json", Config)
        check_continuation(run_dir, saved, given)
        values.update(saved, run_dir=run_dir)
    values.update(given)
    return Config(**values)


# What a checkpoint's tensors are shaped by: a resumed run keeps them.
FIXED_ON_RESUME = ("model", "lora_rank", "lora_alpha", "lora_targets", "ema_decay")
# What the same command may change and still continue its run (no --resume): how long it runs, how often it logs,
# evaluates and saves, how it uses the hardware. Any other change would make it another run.
MAY_CHANGE_ON_CONTINUE = ("iterations", "log_every", "eval_every", "save_every", "tracker", "micro_batch_size",
                          "rollout_batch_size", "grad_checkpointing", "compile", "offload_text_encoders",
                          "rollout_gather_once", "hsdp", "run_dir", "resume", "fresh", "plan", "plan_world_size",
                          "plan_gpu_gb")
NOT_SAVED = ("resume", "fresh")  # how this launch began, not settings of the run


def check_continuation(run_dir: str, saved: dict, given: dict) -> None:
    """A run directory is continued only by its own command (or --resume, which keeps its model and adapter)."""
    resumed = bool(given.get("resume"))
    allowed = set(MAY_CHANGE_ON_CONTINUE) | ({f.name for f in fields(Config)} - set(FIXED_ON_RESUME) if resumed else set())
    changed = [name for name, value in given.items() if name not in allowed and value != saved.get(name, value)]
    if not changed:
        return
    name = changed[0]
    if resumed:
        raise ConfigError(f"--{name} {given[name]} differs from the resumed run's {saved[name]}: its checkpoint holds "
                          f"that model, adapter and EMA; drop --{name}, or start a new run (another --run_dir, or --fresh)")
    differ = ", ".join(f"--{n} {given[n]} (the run's: {saved[n]})" for n in changed)
    raise ConfigError(f"--run_dir {run_dir} holds a run with other settings: {differ}. Continue it with these "
                      f"changes (--resume {run_dir}), start it over (--fresh), or choose another --run_dir")


def _at_least(low: float):
    return lambda v: v >= low, f">= {low:g}"


def _positive(high: float = math.inf):
    return lambda v: 0 < v <= high, "> 0" + ("" if high == math.inf else f" and <= {high:g}")


# Every numeric flag: what it must satisfy, checked (after finiteness) before anything is loaded. The upper bounds
# reject values that are never intended and only produce garbage weights: an AdamW lr above 1, a weight decay
# whose step lr * wd would flip the weights' sign.
NUMERIC_RULES = {
    "resolution": (lambda v: v > 0 and v % 16 == 0, "a positive multiple of 16 (VAE x8 and 2x2 patches)"),
    "width": (lambda v: v >= 0 and v % 16 == 0, "0 (square) or a positive multiple of 16"),
    "num_frames": _at_least(0), "frame_interval": _at_least(0),
    "max_sequence_length": _at_least(1), "tiny_fit_steps": _at_least(0), "sampling_steps": _at_least(1),
    "cfg_scale": _at_least(1), "flux_guidance": _at_least(0), "num_prompts": _at_least(1),
    "group_size": (lambda v: v >= 2, ">= 2: GRPO needs at least 2 samples per prompt"),
    "num_mc": _at_least(1), "t_min": _at_least(0), "t_max": _positive(1), "soft_clip_eta": _positive(),
    "clip_eps": _positive(1), "kl_coef": _at_least(0), "num_grad_steps": _at_least(1), "iterations": _at_least(1),
    "lr": _positive(1), "weight_decay": _at_least(0), "max_grad_norm": _positive(), "lora_rank": _at_least(0),
    "lora_alpha": _positive(), "micro_batch_size": _at_least(1), "rollout_batch_size": _at_least(1),
    "hsdp": _at_least(0), "max_skipped_steps": _at_least(1), "seed": _at_least(0), "log_every": _at_least(1),
    "eval_every": _at_least(0), "eval_samples": _at_least(1), "ref_kl_coef": _at_least(0),
    "ema_decay": (lambda v: 0 <= v < 1, ">= 0 and < 1 (0 = off)"), "hacking_z": _positive(),
    "hacking_window": _at_least(1), "max_x0_drift": _at_least(0),
    "save_every": _at_least(1), "plan_world_size": _at_least(0), "plan_gpu_gb": _at_least(0),
}


def validate_numbers(cfg: Config) -> None:
    """One line for the first numeric flag that is not finite or breaks its rule (NUMERIC_RULES)."""
    for name, (ok, rule) in NUMERIC_RULES.items():
        value = getattr(cfg, name)
        if value is None:  # soft_clip_eta / clip_eps "none": the control is off
            continue
        if not math.isfinite(value) or not ok(value):
            raise ConfigError(f"--{name} {value}: must be finite and {rule}")
    if cfg.lr * cfg.weight_decay >= 1:
        raise ConfigError(f"--lr {cfg.lr} x --weight_decay {cfg.weight_decay} must be < 1 (AdamW multiplies the "
                          "weights by 1 - lr * weight_decay each step)")


def validate(cfg: Config, world_size: int) -> str:
    """Checks everything that can be checked without loading a model. Returns the model family."""
    choices = dict(solver=(*vgrpo.SOLVERS, "scheduler"), param=vgrpo.PARAMETERISATIONS, tracker=("none", "tensorboard", "wandb"),
                   reward_aggregation=("advantage", "reward"), dtype=("auto", "bfloat16", "float32"),
                   compile=("none", "inductor", "aot_eager"))
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"--{name} {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")
    validate_numbers(cfg)
    if cfg.num_prompts % world_size:
        raise ConfigError(f"--num_prompts {cfg.num_prompts} must be divisible by the world size {world_size}: "
                          "each rank holds whole groups")
    if cfg.hsdp and world_size % cfg.hsdp:
        raise ConfigError(f"--hsdp {cfg.hsdp} must be 0 (auto), 1 (plain FSDP) or a divisor of the world size {world_size}")
    local = cfg.num_prompts // world_size * cfg.group_size
    if local % cfg.num_grad_steps or (local // cfg.num_grad_steps) % cfg.micro_batch_size:
        raise ConfigError(f"{local} samples per rank (num_prompts {cfg.num_prompts} x group_size {cfg.group_size} / "
                          f"{world_size} ranks) must split into --num_grad_steps {cfg.num_grad_steps} mini-batches "
                          f"of whole --micro_batch_size {cfg.micro_batch_size} micro-batches")
    if cfg.init_lora and not cfg.lora_rank:
        raise ConfigError("--init_lora starts LoRA adapters from an export: it needs --lora_rank > 0")
    if cfg.init_lora and not (Path(cfg.init_lora) / "pytorch_lora_weights.safetensors").is_file():
        raise ConfigError(f"--init_lora {cfg.init_lora}: no pytorch_lora_weights.safetensors there; pass a run's "
                          "final/ directory (a LoRA export)")
    if not all(cfg.lora_targets.split(",")):
        raise ConfigError(f"--lora_targets: name at least one module, comma-separated without empty names "
                          f"(got {cfg.lora_targets!r}); e.g. {adapters.FlowAdapter.lora_targets}")
    if cfg.t_min >= cfg.t_max:
        raise ConfigError(f"--t_min {cfg.t_min} must be below --t_max {cfg.t_max}")
    try:
        weights = rewards.parse_reward_spec(cfg.rewards)
    except ValueError as error:
        raise ConfigError(f"--rewards: {error}") from None
    try:
        monitored = rewards.parse_reward_spec(cfg.monitor_rewards) if cfg.monitor_rewards else {}
    except ValueError as error:
        raise ConfigError(f"--monitor_rewards: {error}") from None
    if set(monitored) & set(weights):
        raise ConfigError(f"--monitor_rewards {', '.join(set(monitored) & set(weights))}: already trained on (--rewards); "
                          "a monitor is a reward the run does not see")
    try:
        options = json.loads(cfg.reward_options)
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"--reward_options is not valid JSON: {error}") from None
    if not isinstance(options, dict) or not set(options) <= set(weights) | set(monitored):
        raise ConfigError(f"--reward_options must map names from --rewards and --monitor_rewards "
                          f"({', '.join([*weights, *monitored])}) to option dicts")
    if (cfg.eval_with_ema or cfg.export_ema) and not cfg.ema_decay:
        raise ConfigError("--eval_with_ema / --export_ema need an EMA: set --ema_decay (e.g. 0.9)")
    for name, given in options.items():
        try:
            rewards.check_options(name, given)
        except ValueError as error:
            raise ConfigError(f"--reward_options: {error}") from None
    if cfg.tracker != "none" and importlib.util.find_spec(cfg.tracker) is None:
        raise ConfigError(f"--tracker {cfg.tracker}: the package is not installed (pip install {cfg.tracker}), "
                          "or use --tracker none: metrics.jsonl is always written")
    if cfg.run_dir and Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
        raise ConfigError(f"--run_dir {cfg.run_dir} is a file; pass a directory (it is created if missing)")
    if cfg.resume and not (Path(cfg.resume) / "checkpoints" / "latest").is_file():
        raise ConfigError(f"--resume {cfg.resume}: no checkpoint there yet (checkpoints/latest is missing)")
    if not cfg.run_dir and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ConfigError("torchrun --max_restarts restarts the workers with the same flags: pass --run_dir, so that "
                          "they continue this run instead of starting another in a new runs/<preset>-<time>")
    family = models.model_family(cfg.model)
    if family == "flux" and cfg.cfg_scale != 1.0:
        raise ConfigError("--cfg_scale does not apply to FLUX.1 (guidance-distilled); FLUX.1-dev uses --flux_guidance")
    if family == "flux2" and cfg.cfg_scale != 1.0 and models.step_distilled(cfg.model):
        raise ConfigError(f"--cfg_scale {cfg.cfg_scale}: {cfg.model} is step-distilled (is_distilled in its "
                          "model_index.json) and Flux2KleinPipeline applies no CFG to it; use --cfg_scale 1, or train the "
                          "base model (e.g. black-forest-labs/FLUX.2-klein-base-4B) with CFG")
    adapter = adapters.ADAPTERS[family]
    adapter.check_video_settings(cfg.num_frames, cfg.width, cfg.resolution,
                                 sorted(set({**weights, **monitored}) & rewards.VIDEO_REWARDS))
    if cfg.sampling_steps < adapter.min_sampling_steps:
        raise ConfigError(f"--sampling_steps {cfg.sampling_steps}: {adapter.pipeline_class} needs at least "
                          f"{adapter.min_sampling_steps} (its scheduler's sigma grid is undefined for fewer, the "
                          "pipeline's own too)")
    if adapter.text_token_limit and cfg.max_sequence_length > adapter.text_token_limit:
        raise ConfigError(f"--max_sequence_length {cfg.max_sequence_length}: {adapter.pipeline_class} accepts at most "
                          f"{adapter.text_token_limit} (pipe(...) refuses longer text too)")
    return family


# ----------------------------------------------------------------------------------------------
# Algorithm 1: setup once, then per iteration rollouts -> pairs -> advantages -> update -> log -> checkpoint


@dataclass
class Run:
    """What setup() builds once and every phase of an iteration reads; one per process."""

    cfg: Config
    rank: int
    world: int
    device: torch.device
    dir: Path
    model: adapters.FlowAdapter
    optimizer: torch.optim.Optimizer
    trainable: list[torch.Tensor]  # the trained weights (LoRA or all): float32 master weights, FSDP2 shards
    ema: dict[str, torch.Tensor]  # their EMA (empty without --ema_decay), sharded like them
    weights: dict[str, float]  # trained reward -> weight
    reward_fns: dict  # the trained rewards: name -> reward
    monitor_fns: dict  # the rewards only evaluated (--monitor_rewards)
    rollout_velocity: Callable  # the model's velocity, under CFG where the run samples with it
    surrogate: Callable  # s(x0, cond, t, eps) of the trained model: the same function for theta_old and theta
    reference: Callable | None  # the same of the frozen base model (reference KL), None without one
    groups: range  # this rank's prompt groups, in global numbering
    start: int  # the first iteration to run: 0, or the one after the checkpoint a continued run resumes
    tracker: runs.Tracker
    bar: tqdm
    stop: dict = field(default_factory=lambda: {"requested": False})  # SIGTERM / SIGINT


@dataclass
class Batch:
    """One iteration's rollouts on this rank, group-major: sample i belongs to group groups[i // G]."""

    chosen: list[int]  # the iteration's prompt indices, all num_prompts groups
    cond: dict  # text conditioning, one row per sample (P_local * G)
    x0: torch.Tensor  # final latents (P_local * G, ...)
    scores: dict  # reward name -> (P_local * G,)


def setup(cfg: Config, family: str) -> Run:
    rank, world, device = parallel.setup_distributed()
    adapters.avoid_cudnn_attention()
    # One run directory for every rank: the default name's clock is read once, on rank 0.
    run_dir = Path(parallel.broadcast_from_rank0(cfg.run_dir or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"))
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    if rank == 0:
        saved = {k: v for k, v in asdict(cfg).items() if k not in NOT_SAVED}
        runs.start_run_dir(run_dir, saved, fresh=fresh_start(cfg))
    parallel.barrier()

    # Seeding rules. Identical on every rank: every weight initialisation (tiny models, LoRA adapters: FSDP2
    # shards each rank's own copy and never broadcasts), prompt order, and the (t, eps) pairs of group g
    # (seeded by (seed, iteration, g)). Different for every sample: rollout noise (seeded by (seed, iteration,
    # global sample index)). None of these depends on the world size, so 1 and N processes train on the same
    # data. After setup the global torch RNG, which the algorithm does not use, is seeded seed + rank.
    torch.manual_seed(cfg.seed)

    dtype = models.compute_dtype(cfg.dtype, device)
    gpu_gb = torch.cuda.get_device_properties(device).total_memory / memory.GiB if device.type == "cuda" else None
    memory.check_memory_plan(cfg, family, world, gpu_gb, rank, partial(models.make_trainable, cfg=cfg))
    weights = rewards.parse_reward_spec(cfg.rewards)
    reward_fns = rollouts.load_rewards(cfg, weights, family, device)
    monitored = rewards.parse_reward_spec(cfg.monitor_rewards) if cfg.monitor_rewards else {}
    monitor_fns = rollouts.load_rewards(cfg, monitored, family, device)
    model = models.load_pipeline(cfg, family, device, dtype, sharded=world > 1)
    models.check_sampling_grid(model, cfg.solver)
    transformer = model.transformer
    # The reference KL's base model under full fine-tuning: a frozen copy, taken before training casts the weights.
    frozen_base = copy.deepcopy(transformer) if cfg.ref_kl_coef > 0 and not cfg.lora_rank else None
    models.make_trainable(transformer, cfg)
    if cfg.init_lora:  # the stage before's LoRA; a checkpoint of this run, if any, replaces it below
        models.start_from_lora_export(transformer, cfg.init_lora, cfg)
    if cfg.grad_checkpointing:
        transformer.enable_gradient_checkpointing()
    if cfg.compile != "none":
        parallel.compile_blocks(transformer, cfg.compile)
    replicas = parallel.hsdp_replicas(cfg.hsdp, world)
    if world > 1:
        for module in filter(None, (transformer, frozen_base)):
            parallel.apply_fsdp(module, device, dtype, replicas=replicas)  # moves each block's shard to the device
    named = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]  # after FSDP2 swapped in shards
    trainable = [p for _, p in named]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ema = {n: p.detach().clone() for n, p in named} if cfg.ema_decay else {}  # float32, sharded like the weights
    torch.manual_seed(cfg.seed + rank)
    # A run directory with a checkpoint continues from it (the same command again, --resume, a restart).
    continued = (run_dir / "checkpoints" / "latest").is_file()  # load_checkpoint refuses a pointer that is not one
    start = checkpoint.load_checkpoint(run_dir, transformer, optimizer, rank, ema=ema) if continued else 0

    print0 = print if rank == 0 else (lambda *a, **k: None)
    print0(f"{family} model, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable parameters, world size {world}"
           + (f" (HSDP: {replicas} replicas x {world // replicas} shards)" if replicas > 1 else "") + ", "
           f"{dtype}, run dir {run_dir}")
    if continued or runs.read_metrics(run_dir):
        print0(runs.continuation(run_dir, start, cfg.iterations))
    # One surrogate function for theta_old and theta: same parameterisation, same weighting. The base model's for
    # the reference KL is the same function of the frozen base's velocity.
    surrogate_of = partial(partial, vgrpo.elbo_surrogate, param=cfg.param, self_normalize=cfg.self_normalize,
                           chunk_size=cfg.micro_batch_size * cfg.num_mc)
    base_velocity = guards.frozen_base_velocity(model, frozen_base, lora=cfg.lora_rank > 0)
    local = cfg.num_prompts // world
    run = Run(cfg=cfg, rank=rank, world=world, device=device, dir=run_dir, model=model, optimizer=optimizer,
              trainable=trainable, ema=ema, weights=weights, reward_fns=reward_fns, monitor_fns=monitor_fns,
              rollout_velocity=rollouts.guided_velocity(cfg, model, device), surrogate=surrogate_of(model.velocity),
              reference=surrogate_of(base_velocity) if base_velocity else None,
              groups=range(rank * local, (rank + 1) * local), start=start,
              tracker=runs.Tracker(run_dir, cfg, rank == 0, start),
              # Progress on a terminal, from rank 0 (disable=None: off when stderr is not a terminal, as in a batch
              # job's log).
              bar=tqdm(range(start, cfg.iterations), disable=None if rank == 0 else True, desc="V-GRPO",
                       dynamic_ncols=True))
    failures.stop_if_ctrl_c()  # one pressed during setup that a library swallowed
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C stops like a scheduler's SIGTERM: finish, save, exit 0
        signal.signal(sig, partial(stop_requested, run))
    return run


def stop_requested(run: Run, *_) -> None:
    """SIGTERM / SIGINT: finish the iteration, save, exit 0. The signal torchrun's agent sends when another rank
    died is different: nothing can be saved without that rank, so this one stops at once (parallel.PeerLost), and
    only once (parallel.PeerLost.raised: the signal may come after a failed collective raised it, as the
    interpreter exits)."""
    if parallel.lost_ranks() and not parallel.PeerLost.raised:
        raise parallel.PeerLost(parallel.lost_ranks(), run.dir)
    run.stop["requested"] = True


def train(cfg: Config, family: str, prompts: list[Prompt], eval_prompts: list[Prompt]) -> None:
    with parallel.stop_if_a_peer_dies(Path(cfg.run_dir)):
        run = setup(cfg, family)
        watch = guards.Watch(run.cfg, run.dir, run.start, list(run.monitor_fns), samples=len(eval_prompts))
        for it in run.bar:
            clock = [time.perf_counter()]
            # 1. theta_old <- theta: the weights as they are now; nothing to copy.
            batch = sample(run, prompts, it)  # 2. G rollouts of each of this rank's prompts, decoded and scored
            t, eps = draw_pairs(run, it, batch.x0)  # 3. group-shared, stratified (t, eps): drawn once, reused below
            clock.append(time.perf_counter())
            scores, adv = advantages(run, batch.scores)  # 4. over the global batch: rewards gathered to (P, G)
            clock.append(time.perf_counter())
            rollouts_, update = optimize(run, batch, adv, t, eps)  # 5 + 6. theta_old's surrogate, gradient steps
            clock.append(time.perf_counter())
            metrics = log(run, it, batch, scores, adv, rollouts_, update, clock, eval_prompts)  # 7. log, evaluate
            warning = watch.check(it, batch.x0, batch.scores, update, metrics, run.model.transformer, run.device)
            if warning:
                run.bar.write(warning)
            if save(run, it):  # 8. checkpoint: periodically, at the end, and when asked to stop
                break
        else:
            finish(run)
    parallel.shutdown()


def sample(run: Run, prompts: list[Prompt], it: int) -> Batch:
    cfg, G = run.cfg, run.cfg.group_size
    chosen = rollouts.prompts_for_iteration(len(prompts), cfg.num_prompts, cfg.seed, it)
    # The frozen text encoders run once per prompt; rollouts and every training pass reuse the result.
    texts = [prompts[chosen[g]].text for g in run.groups]
    encoded = rollouts.encode(run.model, texts, run.device, cfg.offload_text_encoders)
    cond = {k: v.repeat_interleave(G, dim=0) for k, v in encoded.items()}
    noise = rollouts.initial_noise(cfg, run.model, "rollout", it, range(run.groups[0] * G, (run.groups[-1] + 1) * G),
                                   run.device)  # one generator per global sample index: distinct noise each
    batch = [prompts[chosen[g]] for g in run.groups for _ in range(G)]  # (P_local * G,) group-major
    x0, scores = rollouts.rollout(cfg, run.model, run.rollout_velocity, batch, cond, noise, run.reward_fns)
    return Batch(chosen, cond, x0, scores)


def draw_pairs(run: Run, it: int, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, eps) of this rank's samples, (P_local * G, K) and (P_local * G, K, ...): group g's from its own generator
    (seed, iteration, g), so they do not depend on which rank holds the group."""
    cfg = run.cfg
    pairs = [vgrpo.draw_mc_pairs(1, cfg.group_size, cfg.num_mc, x0.shape[1:], t_min=cfg.t_min, t_max=cfg.t_max,
                                 stratified=cfg.stratified, group_shared=cfg.group_shared,
                                 generator=rollouts.generator(cfg.seed, "pairs", it, g)) for g in run.groups]
    return torch.cat([p[0] for p in pairs]).to(run.device), torch.cat([p[1] for p in pairs]).to(run.device)


def advantages(run: Run, scores: dict) -> tuple[dict, torch.Tensor]:
    """Every reward gathered to (P, G) on every rank, and the (soft-clipped) advantages of the global batch (P, G)."""
    P_local, G = len(run.groups), run.cfg.group_size
    gathered = {name: parallel.all_gather(s.view(P_local, G)) for name, s in scores.items()}
    adv = vgrpo.multi_reward_advantages(gathered, run.weights, aggregation=run.cfg.reward_aggregation,
                                        global_std=run.cfg.global_std)
    return gathered, vgrpo.soft_clip(adv, eta=run.cfg.soft_clip_eta)


def optimize(run: Run, batch: Batch, adv: torch.Tensor, t: torch.Tensor, eps: torch.Tensor):
    """num_grad_steps optimizer steps on this rank's samples, all on the same stored pairs. s_old is computed inside
    vgrpo_update only where it differs from the first gradient pass (samples trained after an optimizer step); with
    one gradient step per iteration there is no separate old-policy pass. Then the EMA, if any."""
    cfg = run.cfg
    local_adv = adv[run.groups[0]:run.groups[-1] + 1].flatten()
    ro = vgrpo.Rollouts(batch.x0, batch.cond, local_adv, t, eps)
    update = vgrpo.vgrpo_update(run.surrogate, run.optimizer, ro, num_grad_steps=cfg.num_grad_steps,
                                micro_batch_size=cfg.micro_batch_size, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                                max_grad_norm=cfg.max_grad_norm, reference=run.reference, ref_kl_coef=cfg.ref_kl_coef)
    if run.ema:
        guards.ema_update(list(run.ema.values()), run.trainable, cfg.ema_decay)
    return ro, update


STDOUT_METRICS = ("reward_mean", "reward_std", "eval/reward_mean", "ratio_mean", "clipfrac", "approx_kl", "kl", "ref_kl",
                  "grad_norm", "surrogate_cv_within", "frac_zero_std_groups", "images_per_s", "skipped_steps")


def log(run: Run, it: int, batch: Batch, scores: dict, adv: torch.Tensor, ro: vgrpo.Rollouts, update: dict,
        clock: list[float], eval_prompts: list[Prompt]) -> dict:
    """The iteration's metrics (the same on every rank), the evaluation on its schedule, a line on stdout every
    log_every iterations; metrics.jsonl and the tracker get every iteration. clock: the iteration's start and the
    ends of its rollouts, rewards and update."""
    cfg, device, K = run.cfg, run.device, run.cfg.num_mc
    weighted = sum(w * scores[name] for name, w in run.weights.items())
    cv = vgrpo.surrogate_cv(parallel.all_gather(ro.s_old.mean(1).view(len(run.groups), cfg.group_size)))
    samples = len(run.groups) * cfg.group_size  # on this rank
    metrics = {
        "reward_mean": weighted.mean().item(), "reward_std": weighted.std().item(),
        **{f"reward/{n}_mean": s.mean().item() for n, s in scores.items()},
        **{f"reward/{n}_std": s.std().item() for n, s in scores.items()},
        "frac_zero_std_groups": (adv == 0).all(dim=1).float().mean().item(),
        # x0_rms: the rollouts' mean latent RMS, for the hacking rule's drift bound
        **parallel.reduce_metrics({**update, "x0_rms": batch.x0.float().pow(2).flatten(1).mean(1).sqrt().mean().item()},
                                  device),
        "surrogate_cv": cv["cv"], "surrogate_cv_within": cv["cv_within"],
        # Model evaluations per sample: rollout steps (x2 for heun, x2 under CFG); the old-policy pass only for the
        # samples trained after an optimizer step; the base model's no-grad pass for every sample when the reference
        # KL is trained on, else for one micro-batch (to log it); K forward+backward in the gradient steps.
        "nfe_rollout": cfg.sampling_steps * (2 if cfg.solver == "heun" else 1) * (2 if cfg.cfg_scale != 1.0 else 1),
        "nfe_old": K * (cfg.num_grad_steps - 1) / cfg.num_grad_steps,
        "nfe_ref": 0 if run.reference is None else K if cfg.ref_kl_coef > 0 else K * cfg.micro_batch_size / samples,
        "nfe_grad": K,
        "time_rollout": clock[1] - clock[0], "time_reward": clock[2] - clock[1], "time_update": clock[3] - clock[2],
        "images_per_s": cfg.num_prompts * cfg.group_size / (clock[3] - clock[0]),
        "peak_memory_gb": parallel.reduce_metrics({"m_max": runs.peak_memory_gb(device)}, device)["m_max"],
        "prompt_indices": batch.chosen,
    }
    if cfg.eval_every and (it % cfg.eval_every == 0 or it == cfg.iterations - 1):
        with guards.swapped_weights(run.trainable, list(run.ema.values())) if cfg.eval_with_ema else contextlib.nullcontext():
            metrics.update(rollouts.evaluate(cfg, run.model, run.rollout_velocity, eval_prompts,
                                             {**run.reward_fns, **run.monitor_fns}, run.weights, run.rank, run.world,
                                             device, run.dir / "samples" / f"iter-{it:06d}.png" if run.rank == 0 else None))
    run.tracker.log(it, metrics)
    if run.rank == 0 and (it % cfg.log_every == 0 or it == cfg.iterations - 1):
        run.bar.write(f"iter {it}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k in STDOUT_METRICS))
    run.bar.set_postfix(reward=f"{metrics['reward_mean']:.4f}", ratio=f"{metrics['ratio_mean']:.3f}",
                        skipped=int(metrics["skipped_steps"]))
    return metrics


def save(run: Run, it: int) -> bool:
    """The checkpoint of iteration it, every save_every iterations, at the end, and when SIGTERM / SIGINT asked any
    rank to stop (all ranks agree first), with curves.png redrawn (a second a drawing: once per checkpoint, not per
    evaluation). True when the run stops here."""
    cfg = run.cfg
    stopping = parallel.reduce_metrics({"stop_max": float(run.stop["requested"])}, run.device)["stop_max"] > 0
    if stopping or (it + 1) % cfg.save_every == 0 or it == cfg.iterations - 1:
        checkpoint.save_checkpoint(run.dir, it, run.model.transformer, run.optimizer, run.rank, ema=run.ema)
        if run.rank == 0:
            runs.draw_curves(run.dir)
    if stopping and run.rank == 0:
        print(f"stop requested (SIGTERM/SIGINT): checkpoint of iteration {it} saved; the same command continues it",
              flush=True)
    return stopping


def finish(run: Run) -> None:
    """The export (the EMA's weights with --export_ema), and on rank 0 the summary and what to open next (the curves
    were drawn with the last checkpoint)."""
    cfg = run.cfg
    with guards.swapped_weights(run.trainable, list(run.ema.values())) if cfg.export_ema else contextlib.nullcontext():
        checkpoint.export_final(run.dir / "final", run.model, lora=cfg.lora_rank > 0, rank=run.rank,
                                info={"weights": "ema" if cfg.export_ema else "trained", "ema_decay": cfg.ema_decay,
                                      "iteration": cfg.iterations - 1})
    if run.rank == 0:
        print(runs.summary_table(runs.read_metrics(run.dir)))
        print(runs.closing_summary(run.dir, cfg, run.model, curves=(run.dir / "curves.png").is_file()))


# ----------------------------------------------------------------------------------------------
# main


def load_trained(run_dir: Path, device: torch.device, dtype: torch.dtype, settings: dict | None = None
                 ) -> adapters.FlowAdapter:
    """A run's model exactly as training left it, in one process: its config (with `settings` changed, e.g. the
    sampler evaluate.py uses), its base model, its last checkpoint (whatever world size wrote it)."""
    cfg = dataclasses.replace(parse_config(["--resume", str(run_dir)]), **(settings or {}))
    model = models.load_pipeline(cfg, models.model_family(cfg.model), device, dtype)
    models.make_trainable(model.transformer, cfg)
    optimizer = torch.optim.AdamW([p for p in model.transformer.parameters() if p.requires_grad])
    checkpoint.load_checkpoint(Path(run_dir), model.transformer, optimizer, rank=0)
    return model


def fresh_start(cfg: Config) -> bool:
    """--fresh on the first launch: a restart of the same job (torchrun, a Slurm requeue) continues what it began."""
    return cfg.fresh and not parallel.restarted()


def finished(cfg: Config) -> str:
    """'' unless --run_dir holds a finished run of these iterations: then what to say instead of training."""
    done = runs.export_iteration(Path(cfg.run_dir)) if cfg.run_dir and not fresh_start(cfg) else None
    if done is None or done < cfg.iterations - 1:
        return ""
    return (f"{cfg.run_dir} is finished: it trained {done + 1} iterations and its export is in {cfg.run_dir}/final; "
            "nothing to do (--iterations N continues it to N, --fresh starts it over)")


def main(argv: list[str] | None = None) -> None:
    failures.quiet_known_noise()
    failures.remember_ctrl_c()
    with failures.one_line_errors():
        cfg = parse_config(argv)
        if cfg.plan:
            world, gpu_gb = memory.plan_world_and_memory(cfg)
            plan, advice = memory.plan_memory(cfg, validate(cfg, world), world, gpu_gb, partial(models.make_trainable, cfg=cfg))
            print(plan.table())
            if not plan.fits():
                raise failures.RunStopped(f"does not fit {gpu_gb:g} GiB per GPU with 10% headroom: {advice}")
            if advice:
                print(f"{advice} (rollouts sample in calls of that many samples; bench.py section 5 measures what "
                      "larger calls gain)")
            return
        family = validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        if finished(cfg):
            if os.environ.get("RANK", "0") == "0":
                print(finished(cfg))
            return
        failures.check_sizes(cfg, int(os.environ.get("WORLD_SIZE", 1)), failures.machine_memory_gb())
        runs.check_run_dir(cfg.run_dir or "runs", continuing=runs.holds_run(Path(cfg.run_dir or "runs")),
                           fresh=fresh_start(cfg))
        prompts, eval_prompts = prompt_sets.training_prompts(cfg)
        train(cfg, family, prompts, eval_prompts)


if __name__ == "__main__":
    main()
