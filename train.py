"""train.py: V-GRPO for diffusers flow-matching models, one process or torchrun + FSDP2.

Algorithm 1 of Tang et al., "Online Reinforcement Learning for Denoising Generative Models Is
Easier than You Think" (arXiv 2604.23380); every equation lives in vgrpo.py, this file is the driver.
Models: SD3 / SD3.5, FLUX.1, Qwen-Image, FLUX.2 [klein] and Wan (text to video) (one adapter each in models.py).

    python train.py                                   # tiny SD3 built from configs: CPU, offline, minutes
    python train.py --model DIR_OR_HUB_ID --prompts prompts.txt --rewards pickscore:1,hpsv21:1
    torchrun --nproc_per_node=8 train.py --preset sd35m --prompts pickapic      # paper: SD3.5-M stage 1
    torchrun --nproc_per_node=8 train.py --preset flux --prompts hpdv2          # paper: FLUX.1-dev
    torchrun --nproc_per_node=8 train.py --preset wan21 --prompts ocr           # video: Wan2.1-1.3B, Flow-GRPO's
    torchrun --nproc_per_node=8 train.py --resume runs/NAME                    # continue from the last checkpoint
    python train.py --preset flux --plan --plan_world_size 8 --plan_gpu_gb 80  # memory per GPU, before loading anything
    python evaluate.py --runs runs/NAME --prompts drawbench                     # base vs trained on a benchmark
    python train.py --help                            # every option, with its default

Where things live: vgrpo.py the method; models.py the model families (which one a --model is, the checks a loaded
model gets) and the memory plan; rewards.py the rewards; prompts.py the prompt files and named sets; runs.py the run
directory (config.json, checkpoints, export, metrics, samples, the closing summary), the errors a user can fix and the
hacking rule; evaluate.py the evaluation command. This file: the config, Algorithm 1 and main.

Beyond the paper, against reward hacking (off by default): --ref_kl_coef (the x-space KL to the frozen base model),
--ema_decay, --monitor_rewards with the hacking rule (docs/training.md).

Data parallelism: the num_prompts groups of an iteration are split over the ranks as WHOLE groups, so
a group's G samples and its shared (t, eps) pairs live on one rank. Rewards are all-gathered before
the advantages, which are computed for the global batch on every rank (global std, logging).

Choices beyond vgrpo.py's: rollouts integrate the ODE with vgrpo.sample_ode on the sigma grid the
pipeline's own __call__ uses (its scheduler, shift and resolution-dependent mu), so solver "euler" is
exactly `pipe(prompt, num_inference_steps=N)` from the same noise where the pipeline ships an Euler scheduler;
solver "scheduler" steps a copy of whatever scheduler it ships (Wan's UniPC) and equals `pipe()` there. Trainable weights are float32 master
weights whatever --dtype the compute runs in. The transformer stays in eval mode (no dropout), so the
old-policy pass and the first gradient pass agree exactly.
"""

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
import warnings
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import adapters
import builders
import checkpoint
import failures
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
from parallel import all_gather, barrier, reduce_metrics
from prompts import Prompt

# torch.distributed.checkpoint warns on every save/load without a process group; one process is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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
                           "(ocr, geneval, pickapic, hpdv2: its train split; prompts.py); tiny models have built-ins")
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
    solver: str = arg("euler", "euler | heun (2 NFE/step) | ab2 (2nd-order multistep, 1 NFE/step) | scheduler (the "
                                 "pipeline's own scheduler, e.g. Wan's UniPC, stepped as pipe() does)")
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
    run_dir: str = arg("", "output directory; default runs/<preset>-<time>")
    resume: str = arg("", "run directory to continue from its last checkpoint (its config.json is the base)")
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


def parse_config(argv: list[str] | None = None) -> Config:
    """Defaults < preset < the resumed run's config.json < flags given on the command line."""
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
    if given.get("resume"):
        saved = Path(given["resume"]) / "config.json"
        if not saved.is_file():
            raise ConfigError(f"--resume {given['resume']}: no config.json there; pass the directory of an earlier run")
        values.update(runs.read_run_config(saved, Config))
        values["run_dir"] = given["resume"]
        for name in FIXED_ON_RESUME:
            if name in given and given[name] != values[name]:
                raise ConfigError(f"--{name} {given[name]} differs from the resumed run's {values[name]}: its checkpoint "
                                  f"holds that model, adapter and EMA; drop --{name} or start a new run")
    values.update(given)
    return Config(**values)


# What a checkpoint's tensors are shaped by: a resumed run keeps them.
FIXED_ON_RESUME = ("model", "lora_rank", "lora_alpha", "lora_targets", "ema_decay")


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
    choices = dict(solver=("euler", "heun", "ab2", "scheduler"), param=vgrpo.PARAMETERISATIONS, tracker=("none", "tensorboard", "wandb"),
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
    family = models.model_family(cfg.model)
    if family == "flux" and cfg.cfg_scale != 1.0:
        raise ConfigError("--cfg_scale does not apply to FLUX.1 (guidance-distilled); FLUX.1-dev uses --flux_guidance")
    if family == "flux2" and cfg.cfg_scale != 1.0 and models.step_distilled(cfg.model):
        raise ConfigError(f"--cfg_scale {cfg.cfg_scale}: {cfg.model} is step-distilled (is_distilled in its "
                          "model_index.json) and Flux2KleinPipeline applies no CFG to it; use --cfg_scale 1, or train the "
                          "base model (e.g. black-forest-labs/FLUX.2-klein-base-4B) with CFG")
    adapter = adapters.ADAPTERS[family]
    check_video_settings(cfg, adapter, {**weights, **monitored})
    if cfg.sampling_steps < adapter.min_sampling_steps:
        raise ConfigError(f"--sampling_steps {cfg.sampling_steps}: {adapter.pipeline_class} needs at least "
                          f"{adapter.min_sampling_steps} (its scheduler's sigma grid is undefined for fewer, the "
                          "pipeline's own too)")
    if adapter.text_token_limit and cfg.max_sequence_length > adapter.text_token_limit:
        raise ConfigError(f"--max_sequence_length {cfg.max_sequence_length}: {adapter.pipeline_class} accepts at most "
                          f"{adapter.text_token_limit} (pipe(...) refuses longer text too)")
    return family


def check_video_settings(cfg: Config, adapter: type, reward_names) -> None:
    """Frames, width and video rewards only where the model makes videos, and frames its VAE can code."""
    if adapter.video:
        if cfg.num_frames and (cfg.num_frames - 1) % adapter.frame_stride:
            raise ConfigError(f"--num_frames {cfg.num_frames}: {adapter.pipeline_class} needs 1 + a multiple of "
                              f"{adapter.frame_stride} (e.g. 33 or 81); its pipeline would round it")
        return
    wrong = {"num_frames": cfg.num_frames > 1, "width": cfg.width not in (0, cfg.resolution)}
    for name, bad in wrong.items():
        if bad:
            raise ConfigError(f"--{name} {getattr(cfg, name)}: {adapter.pipeline_class} makes square images; --{name} "
                              "is for video models (Wan)")
    videos_only = sorted(set(reward_names) & rewards.VIDEO_REWARDS)
    if videos_only:
        raise ConfigError(f"reward {', '.join(videos_only)} scores videos; {adapter.pipeline_class} makes images")


# ----------------------------------------------------------------------------------------------
# Models: loading, trainable parameters, FSDP2 (family details live in models.py)


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


# ----------------------------------------------------------------------------------------------
# Training: Algorithm 1


def train(cfg: Config, family: str, prompts: list[Prompt], eval_prompts: list[Prompt]) -> None:
    # ---------------- setup
    rank, world, device = parallel.setup_distributed()
    adapters.avoid_cudnn_attention()
    master = rank == 0
    dtype = models.compute_dtype(cfg.dtype, device)
    run_dir = Path(cfg.run_dir or f"runs/{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({**asdict(cfg), "run_dir": str(run_dir)}, indent=2))
    print0 = print if master else (lambda *a, **k: None)

    # Seeding rules. Identical on every rank: every weight initialisation (tiny models, LoRA adapters: FSDP2
    # shards each rank's own copy and never broadcasts), prompt order, and the (t, eps) pairs of group g
    # (seeded by (seed, iteration, g)). Different for every sample: rollout noise (seeded by (seed, iteration,
    # global sample index)). None of these depends on the world size, so 1 and N processes train on the same
    # data. After setup the global torch RNG, which the algorithm does not use, is seeded seed + rank.
    torch.manual_seed(cfg.seed)

    gpu_gb = torch.cuda.get_device_properties(device).total_memory / memory.GiB if device.type == "cuda" else None
    memory.check_memory_plan(cfg, family, world, gpu_gb, rank, partial(models.make_trainable, cfg=cfg))
    weights = rewards.parse_reward_spec(cfg.rewards)
    reward_fns = rollouts.load_rewards(cfg, weights, family, device)
    monitor_fns = rollouts.load_rewards(cfg, rewards.parse_reward_spec(cfg.monitor_rewards) if cfg.monitor_rewards else {}, family,
                               device)
    model = models.load_pipeline(cfg, family, device, dtype, sharded=world > 1)
    models.check_sampling_grid(model, cfg.solver)
    transformer = model.transformer
    # The reference KL's base model under full fine-tuning: a frozen copy, taken before training casts the weights.
    frozen_base = copy.deepcopy(transformer) if cfg.ref_kl_coef > 0 and not cfg.lora_rank else None
    models.make_trainable(transformer, cfg)
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
    start = checkpoint.load_checkpoint(run_dir, transformer, optimizer, rank, ema=ema) if cfg.resume else 0
    print0(f"{family} model, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable parameters, world size {world}"
           + (f" (HSDP: {replicas} replicas x {world // replicas} shards)" if replicas > 1 else "") + ", "
           f"{dtype}, run dir {run_dir}" + (f", resuming at iteration {start}" if start else ""))

    P, G, K = cfg.num_prompts, cfg.group_size, cfg.num_mc
    P_local = P // world
    groups = range(rank * P_local, (rank + 1) * P_local)  # this rank's groups, in global numbering
    rollout_velocity = rollouts.guided_velocity(cfg, model, device)
    # One surrogate function for theta_old and theta: same parameterisation, same weighting. The base model's for
    # the reference KL is the same function of the frozen base's velocity.
    surrogate_of = partial(partial, vgrpo.elbo_surrogate, param=cfg.param, self_normalize=cfg.self_normalize,
                           chunk_size=cfg.micro_batch_size * K)
    surrogate = surrogate_of(model.velocity)
    base_velocity = guards.frozen_base_velocity(model, frozen_base, lora=cfg.lora_rank > 0)
    reference = surrogate_of(base_velocity) if base_velocity else None
    nfe_rollout = cfg.sampling_steps * (2 if cfg.solver == "heun" else 1) * (2 if cfg.cfg_scale != 1.0 else 1)
    nfe_old = K * (cfg.num_grad_steps - 1) / cfg.num_grad_steps  # only samples trained after an optimizer step
    # the base model's no-grad pass: every sample when the reference KL is trained on, else one micro-batch (to log it)
    nfe_ref = 0 if reference is None else K if cfg.ref_kl_coef > 0 else K * cfg.micro_batch_size / (P_local * G)
    # The hacking rule's history on resume: the evaluations and the first latent RMS of the iterations already done.
    earlier = [m for m in runs.read_metrics(run_dir) if m["iteration"] < start] if start else []
    evals = [m for m in earlier if "eval/reward_mean" in m]
    first_x0_rms = next((m["x0_rms"] for m in earlier if "x0_rms" in m), None)
    tracker = runs.Tracker(run_dir, cfg, master, start)
    stop = {"requested": False}
    failures.stop_if_ctrl_c()  # one pressed during setup that a library swallowed
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C stops like a scheduler's SIGTERM: finish, save, exit 0
        signal.signal(sig, lambda *_: stop.update(requested=True))
    history, skipped_run = [], 0

    # Progress on a terminal, from rank 0 (disable=None: off when stderr is not a terminal, as in a batch job's log).
    bar = tqdm(range(start, cfg.iterations), disable=None if master else True, desc="V-GRPO", dynamic_ncols=True)
    for it in bar:
        timer = {"start": time.perf_counter()}
        # ---------------- 1. theta_old <- theta: the weights as they are now; nothing to copy.
        # ---------------- 2. rollouts: G samples of each of this rank's prompts, distinct noise each
        chosen = rollouts.prompts_for_iteration(len(prompts), P, cfg.seed, it)
        batch = [prompts[chosen[g]] for g in groups for _ in range(G)]  # (P_local * G,) group-major
        # The frozen text encoders run once per prompt; rollouts and every training pass reuse the result.
        texts = [prompts[chosen[g]].text for g in groups]
        cond = {k: v.repeat_interleave(G, dim=0) for k, v in rollouts.encode(model, texts, device, cfg.offload_text_encoders).items()}
        noise = rollouts.initial_noise(cfg, model, "rollout", it, range(groups[0] * G, (groups[-1] + 1) * G), device)
        x0, scores = rollouts.rollout(cfg, model, rollout_velocity, batch, cond, noise, reward_fns)
        timer["rollout"] = time.perf_counter()
        # ---------------- 3. group-shared, stratified (t, eps) pairs: drawn once, reused below
        pairs = [vgrpo.draw_mc_pairs(1, G, K, x0.shape[1:], generator=rollouts.generator(cfg.seed, "pairs", it, g), t_min=cfg.t_min,
                                     t_max=cfg.t_max, stratified=cfg.stratified, group_shared=cfg.group_shared)
                 for g in groups]
        t, eps = torch.cat([p[0] for p in pairs]).to(device), torch.cat([p[1] for p in pairs]).to(device)
        # ---------------- 4. advantages over the global batch: rewards gathered to (P, G) on every rank
        global_scores = {name: all_gather(s.view(P_local, G)) for name, s in scores.items()}
        adv = vgrpo.multi_reward_advantages(global_scores, weights, aggregation=cfg.reward_aggregation,
                                            global_std=cfg.global_std)
        adv = vgrpo.soft_clip(adv, eta=cfg.soft_clip_eta)  # (P, G)
        local_adv = adv[groups[0]:groups[-1] + 1].flatten()
        timer["reward"] = time.perf_counter()
        # ---------------- 5 + 6. old-policy surrogate and gradient steps, all on the same stored pairs. s_old is
        # computed inside vgrpo_update only where it differs from the first gradient pass (samples trained after an
        # optimizer step); with one gradient step per iteration there is no separate old-policy pass.
        ro = vgrpo.Rollouts(x0, cond, local_adv, t, eps)
        update = vgrpo.vgrpo_update(surrogate, optimizer, ro, num_grad_steps=cfg.num_grad_steps,
                                    micro_batch_size=cfg.micro_batch_size, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                                    max_grad_norm=cfg.max_grad_norm, reference=reference, ref_kl_coef=cfg.ref_kl_coef)
        if ema:
            guards.ema_update(list(ema.values()), trainable, cfg.ema_decay)
        timer["update"] = time.perf_counter()

        # ---------------- 7. log
        weighted = sum(w * global_scores[name] for name, w in weights.items())
        cv = vgrpo.surrogate_cv(all_gather(ro.s_old.mean(1).view(P_local, G)))
        metrics = {
            "reward_mean": weighted.mean().item(), "reward_std": weighted.std().item(),
            **{f"reward/{n}_mean": s.mean().item() for n, s in global_scores.items()},
            **{f"reward/{n}_std": s.std().item() for n, s in global_scores.items()},
            "frac_zero_std_groups": (adv == 0).all(dim=1).float().mean().item(),
            # x0_rms: the rollouts' mean latent RMS, for the hacking rule's drift bound
            **reduce_metrics({**update, "x0_rms": x0.float().pow(2).flatten(1).mean(1).sqrt().mean().item()}, device),
            "surrogate_cv": cv["cv"], "surrogate_cv_within": cv["cv_within"],
            "nfe_rollout": nfe_rollout, "nfe_old": nfe_old, "nfe_ref": nfe_ref, "nfe_grad": K,  # per sample; nfe_grad:
            # forward+backward
            "time_rollout": timer["rollout"] - timer["start"], "time_reward": timer["reward"] - timer["rollout"],
            "time_update": timer["update"] - timer["reward"],
            "images_per_s": P * G / (timer["update"] - timer["start"]),
            "peak_memory_gb": reduce_metrics({"m_max": runs.peak_memory_gb(device)}, device)["m_max"],
            "prompt_indices": chosen,
        }
        if cfg.eval_every and (it % cfg.eval_every == 0 or it == cfg.iterations - 1):
            with guards.ema_weights(trainable, list(ema.values())) if cfg.eval_with_ema else contextlib.nullcontext():
                metrics.update(rollouts.evaluate(cfg, model, rollout_velocity, eval_prompts, {**reward_fns, **monitor_fns},
                                        weights, rank, world, device,
                                        run_dir / "samples" / f"iter-{it:06d}.png" if master else None))
            evals.append({"iteration": it, **metrics})
        tracker.log(it, metrics)
        if master and "eval/reward_mean" in metrics:
            runs.draw_curves(run_dir)
        if master and (it % cfg.log_every == 0 or it == cfg.iterations - 1):
            bar.write(f"iter {it}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k in STDOUT_METRICS))
        history.append((it, metrics["reward_mean"], metrics.get("eval/reward_mean")))
        bar.set_postfix(reward=f"{metrics['reward_mean']:.4f}", ratio=f"{metrics['ratio_mean']:.3f}",
                        skipped=int(metrics["skipped_steps"]))

        # ---------------- 8. checkpoint: periodically, at the end, and when SIGTERM / SIGINT asked to stop. A
        # diverged run writes nothing more: the last good checkpoint stays the one --resume uses.
        skipped_run = guards.consecutive_skips(skipped_run, int(update["skipped_steps"]), cfg.num_grad_steps)
        reason = guards.divergence(x0, scores, skipped_run, transformer, cfg, device)
        if reason:
            guards.stop_run(run_dir, f"training diverged at iteration {it}: {reason}", "Lower --lr or --max_grad_norm, or "
                     "raise --num_mc, and start again")
        first_x0_rms = first_x0_rms or metrics["x0_rms"]
        hacked = guards.hacking(evals, list(monitor_fns), window=cfg.hacking_window, z=cfg.hacking_z,
                              samples=len(eval_prompts)) if "eval/reward_mean" in metrics else ""
        hacked = hacked or guards.x0_drift(metrics["x0_rms"], first_x0_rms, cfg.max_x0_drift)
        if hacked and cfg.stop_on_hacking:
            guards.stop_run(run_dir, f"possible reward hacking at iteration {it}: {hacked}", "Inspect the sample grids; "
                     "raise --ref_kl_coef or lower --lr, or --resume without --stop_on_hacking to go on")
        elif hacked:
            bar.write(f"warning: possible reward hacking at iteration {it}: {hacked} (--stop_on_hacking stops here)")
        stopping = reduce_metrics({"stop_max": float(stop["requested"])}, device)["stop_max"] > 0  # all ranks agree
        if stopping or (it + 1) % cfg.save_every == 0 or it == cfg.iterations - 1:
            checkpoint.save_checkpoint(run_dir, it, transformer, optimizer, rank, ema=ema)
        if stopping:
            print0(f"stop requested (SIGTERM/SIGINT): checkpoint of iteration {it} saved; continue with --resume {run_dir}")
            break
    else:
        with guards.ema_weights(trainable, list(ema.values())) if cfg.export_ema else contextlib.nullcontext():
            checkpoint.export_final(run_dir / "final", model, lora=cfg.lora_rank > 0, rank=rank,
                              info={"weights": "ema" if cfg.export_ema else "trained", "ema_decay": cfg.ema_decay,
                                    "iteration": cfg.iterations - 1})
        print0(runs.summary_table(history))
        print0(runs.closing_summary(run_dir, cfg, model, curves=master and runs.draw_curves(run_dir)))
    if dist.is_initialized():
        barrier()  # rank 0 may still be writing the export: nobody tears gloo/nccl down under it
        dist.destroy_process_group()


STDOUT_METRICS = ("reward_mean", "reward_std", "eval/reward_mean", "ratio_mean", "clipfrac", "approx_kl", "kl", "ref_kl",
                  "grad_norm", "surrogate_cv_within", "frac_zero_std_groups", "images_per_s", "skipped_steps")


def training_prompts(cfg: Config) -> tuple[list[Prompt], list[Prompt]]:
    """The training prompts and the eval_samples evaluation prompts (position i gets fixed noise i): --prompts (a file
    or a named set's train split; tiny models have built-ins) and --eval_prompts, by default the named set's test
    split or else the first training prompts, cycled. Checked against what the rewards need from each prompt."""
    if not cfg.prompts and cfg.model not in builders.TINY_MODELS:
        raise ConfigError(f"--prompts is required for a real model: a .txt (one prompt per line) or .jsonl file, or a "
                          f"named set ({', '.join(prompt_sets.SETS)})")
    say = print if os.environ.get("RANK", "0") == "0" else (lambda _: None)
    prompts = (prompt_sets.load(cfg.prompts, split="train", say=say) if cfg.prompts
               else [Prompt(p, {}) for p in builders.tiny_prompts(models.model_family(cfg.model))])
    eval_spec = cfg.eval_prompts or prompt_sets.test_split(cfg.prompts)
    listed = prompt_sets.load(eval_spec, split="test", say=say) if eval_spec else prompts[:cfg.eval_samples]
    eval_prompts = [listed[i % len(listed)] for i in range(cfg.eval_samples)]
    names = rewards.parse_reward_spec(cfg.rewards)
    prompt_sets.check_for_rewards(prompts, names, cfg.prompts or "the built-in prompts")
    if eval_spec:
        prompt_sets.check_for_rewards(eval_prompts, names, eval_spec)
    return prompts, eval_prompts


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
        failures.check_sizes(cfg, int(os.environ.get("WORLD_SIZE", 1)), failures.machine_memory_gb())
        runs.check_run_dir(cfg.run_dir or "runs")
        prompts, eval_prompts = training_prompts(cfg)
        train(cfg, family, prompts, eval_prompts)


if __name__ == "__main__":
    main()
