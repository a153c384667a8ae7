"""baselines.py: the peers V-GRPO is compared with, each written from its published algorithm and defaults.

No code is taken from the peers: each method is written here from its paper and its public training script's
algorithm and settings, for the 2-D toy and for the tiny SD3 pipeline alike, and validated against the peer's own code
run the same way (docs/benchmarks.md says how, with the numbers). bench.py runs them against train.py.

Flow-GRPO (Liu et al. 2025, arXiv 2505.05470; github.com/yifan123/flow_grpo), as its scripts/train_sd3.py runs it with
the defaults of config/base.py and config/grpo.py's SD3.5 tasks: SDE rollouts, per-step Gaussian log-probs and clipped
ratios, the KL to the reference, two optimizer steps per batch. Validated against Flow-GRPO's own rollout pipeline,
SDE step and stat tracker on the tiny SD3 pipeline (docs/benchmarks.md, "The Flow-GRPO baseline").

DiffusionNFT and MixGRPO / MixGRPO-Flash: their dataclasses below name the script each setting comes from; each is
validated against the peer's own modules, driven on the same tiny SD3, base, reward and seeds (docs/benchmarks.md,
"Validated against DiffusionNFT's own code" and "... MixGRPO's own code").
"""

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

import builders
import guards
import models
import rewards
import rollouts
import train
import vgrpo
from prompts import Prompt

# ----------------------------------------------------------------------------------------------
# Flow-GRPO


@dataclass(frozen=True)
class FlowGRPO:
    noise_level: float = 0.7  # sample.noise_level: the SDE's sigma_t = a sqrt(t / (1 - t))
    clip_range: float = 1e-4  # train.clip_range: the per-step ratio clip
    adv_clip_max: float = 5.0  # train.adv_clip_max
    beta: float = 0.04  # train.beta: KL to the reference policy (the GenEval and OCR configs; PickScore 0.01)
    timestep_fraction: float = 0.99  # train.timestep_fraction: the first int(0.99 T) denoising steps are trained
    # num_batches_per_epoch rollout batches, gradient_accumulation_steps = num_batches_per_epoch // 2: two optimizer
    # steps per epoch, each over half the (shuffled) samples and all trained steps.
    updates_per_batch: int = 2
    weight_decay: float = 1e-4  # train.adam_weight_decay


def sde_mean_std(velocity, x, t: float, t_next: float, cond, *, noise_level: float, t_cap: float):
    """One Euler-Maruyama step of the reverse SDE with the marginals of the flow (Flow-GRPO's sampler), the velocity
    evaluated at (x, t): sde_kernel's mean, sigma and std."""
    v = velocity(x, torch.full((x.shape[0],), t, device=x.device), cond)
    return sde_kernel(v, x, t, t_next, noise_level=noise_level, t_cap=t_cap)


def sde_kernel(v: torch.Tensor, x: torch.Tensor, t: float, t_next: float, *, noise_level: float, t_cap: float):
    """Flow-GRPO's SDE step from the velocity v at (x, t):
        x' = x + (v + sigma^2 / (2t) (x + (1 - t) v)) dt + sigma sqrt(-dt) z,   sigma = a sqrt(t / (1 - t)),
    dt = t_next - t < 0; (x + (1 - t) v) / t is minus the score; t_cap keeps sigma finite at t = 1 (sigma's t = 1 is
    replaced by the grid's second point). Returns the mean of x', sigma and the step's std sigma sqrt(-dt)."""
    dt = t_next - t
    sigma = noise_level * math.sqrt(t / (1 - min(t, t_cap)))
    return x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt, sigma, sigma * math.sqrt(-dt)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Per-sample log-density of x under N(mean, std^2 I), averaged over dimensions (Flow-GRPO's convention)."""
    return (-((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


def flow_grpo_kl(mean: torch.Tensor, ref_mean: torch.Tensor, sigma: float) -> torch.Tensor:
    """Flow-GRPO's per-step KL to the reference, per sample: ||mu - mu_ref||^2 averaged over dimensions, over 2 sigma^2.
    It divides by the SDE's sigma^2, not by the step's variance sigma^2 |dt| that the exact KL between the two
    Gaussian kernels has (smaller by |dt|: x10 at 10 steps)."""
    return ((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * sigma**2)


def sample_sde(velocity, x, grid: list[float], cond, fg: FlowGRPO, generator) -> tuple[torch.Tensor, list]:
    """An SDE rollout over the grid (noise on every step, the last included): the final sample and the path
    [(x_t, t, t_next, x_next, log_prob)] the update replays."""
    path = []
    with torch.no_grad():
        for t, t_next in zip(grid[:-1], grid[1:]):
            mean, _, std = sde_mean_std(velocity, x, t, t_next, cond, noise_level=fg.noise_level, t_cap=grid[1])
            x_next = mean + std * torch.randn(x.shape, generator=generator).to(x.device)
            path.append((x, t, t_next, x_next, gaussian_log_prob(x_next, mean, std)))
            x = x_next
    return x, path


def rows_of(cond, index: torch.Tensor):
    return {k: v[index] for k, v in cond.items()} if isinstance(cond, dict) else cond[index]


def flow_grpo_update(velocity, reference, path: list, cond, adv: torch.Tensor, optimizer, params: list, fg: FlowGRPO,
                     *, t_cap: float, max_grad_norm: float, generator) -> int:
    """Flow-GRPO's training phase on one rollout batch: samples with a zero advantage dropped (a random few kept
    so that the rest splits evenly), the others shuffled and split into updates_per_batch optimizer steps; each step
    averages over its samples and the first int(timestep_fraction T) denoising steps
        max(-A r_t, -A clip(r_t, 1 -+ clip_range)) + beta KL_t,   r_t = p_theta(x_next | x_t) / p_old(x_next | x_t),
    A clipped to +-adv_clip_max; reference(x, t, cond) is the reference policy's velocity; t_cap as sample_sde's
    (the grid's second point). Returns how many samples
    were trained (each costs a forward and a backward of the policy and a forward of the reference per step)."""
    updates, trained = fg.updates_per_batch, int(len(path) * fg.timestep_fraction)
    keep = adv != 0
    dropped = torch.where(~keep)[0]
    short = (updates - int(keep.sum()) % updates) % updates
    if short and len(dropped) >= short:
        keep[dropped[torch.randperm(len(dropped), generator=generator)[:short]]] = True
    index = torch.where(keep)[0]
    index = index[torch.randperm(len(index), generator=generator)]
    adv = adv.clamp(-fg.adv_clip_max, fg.adv_clip_max)
    for rows in index.chunk(updates):
        for x_t, t, t_next, x_next, old in path[:trained]:
            c = rows_of(cond, rows)
            kernel = partial(sde_mean_std, x=x_t[rows], t=t, t_next=t_next, cond=c, noise_level=fg.noise_level,
                             t_cap=t_cap)
            mean, sigma, std = kernel(velocity)
            with torch.no_grad():
                ref_mean, _, _ = kernel(reference)
            ratio = (gaussian_log_prob(x_next[rows], mean, std) - old[rows]).exp()
            a = adv[rows]
            policy = torch.max(-a * ratio, -a * ratio.clamp(1 - fg.clip_range, 1 + fg.clip_range)).mean()
            ((policy + fg.beta * flow_grpo_kl(mean, ref_mean, sigma).mean()) / trained).backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    return len(index)


def flow_grpo_toy(model, cfg: vgrpo.ToyConfig, fg: FlowGRPO = FlowGRPO()) -> list[dict]:
    """Flow-GRPO on the toy: cfg's prompts, group size, sampling steps, lr, seed and iterations; the reference is the
    pretrained model (frozen); advantages per group over the batch's std (PerPromptStatTracker with global_std, each
    group its own prompt)."""
    g = torch.Generator().manual_seed(cfg.seed)
    reference = copy.deepcopy(model).requires_grad_(False)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=fg.weight_decay)
    grid = vgrpo.flow_timesteps(cfg.sampling_steps).tolist()
    P, G, T = cfg.num_prompts, cfg.group_size, cfg.sampling_steps
    history, fwd, bwd, start = [], 0, 0, time.perf_counter()
    for _ in range(cfg.iterations):
        c = torch.randint(len(vgrpo.TOY_MODES), (P,), generator=g).repeat_interleave(G)
        x, path = sample_sde(model, torch.randn(P * G, 2, generator=g), grid, c, fg, g)
        rewards = vgrpo.toy_reward(x, c)
        adv = vgrpo.group_advantages(rewards.view(P, G), global_std=True).flatten()
        n = flow_grpo_update(model, reference, path, c, adv, optimizer, params, fg, t_cap=grid[1], max_grad_norm=1.0,
                             generator=g)
        steps = int(T * fg.timestep_fraction)
        fwd, bwd = fwd + P * G * T + 2 * n * steps, bwd + n * steps  # rollout; policy and reference forwards; backwards
        frac, dist = vgrpo.toy_mode_stats(x, c)
        history.append({"reward_mean": rewards.mean().item(), "frac_target_mode": frac, "mode_dist": dist,
                        "nfe_fwd": fwd, "nfe_bwd": bwd, "seconds": time.perf_counter() - start})
    return history


@contextlib.contextmanager
def adapters_disabled(transformer):
    """The reference policy: the transformer with its LoRA switched off."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def tiny_sd3_setup(model_dir: Path, seed: int, flags) -> tuple:
    """What every peer's run on a saved tiny SD3 shares with train.py: its config (train.py's flags), the pipeline
    with train.py's LoRA seeded as train.py seeds it, the LoRA's parameters, the rewards, the built-in prompts and the
    evaluation (train.py's: eval_samples prompts, position i with fixed noise i; evaluate() -> its eval reward).
    Returns (cfg, device, model, params, weights, reward_fns, prompts, evaluate)."""
    cfg = train.parse_config(["--model", str(model_dir), "--seed", str(seed), *flags])
    device = torch.device("cpu")
    torch.manual_seed(cfg.seed)  # train.py's LoRA initialisation
    model = models.load_pipeline(cfg, "sd3", device, torch.float32)
    models.make_trainable(model.transformer, cfg)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    weights = rewards.parse_reward_spec(cfg.rewards)
    reward_fns = {name: rewards.load_reward(name, device=device) for name in weights}
    prompts = [Prompt(p, {}) for p in builders.TINY_PROMPTS]
    eval_prompts = [prompts[i % len(prompts)] for i in range(cfg.eval_samples)]

    def evaluate() -> float:
        return rollouts.evaluate(cfg, model, model.velocity, eval_prompts, reward_fns, weights, 0, 1, device,
                                 None)["eval/reward_mean"]
    return cfg, device, model, params, weights, reward_fns, prompts, evaluate


def history_entry(it: int, iterations: int, eval_every: int, reward: torch.Tensor, seconds: float, counts: dict,
                  evaluate) -> dict:
    """One iteration of a peer's history, as vgrpo_sd3's: the batch's mean reward, the seconds and counts so far, and
    on the evaluation schedule evaluate()'s eval reward (else None)."""
    scheduled = it % eval_every == 0 or it == iterations - 1
    return dict(reward_mean=reward.mean().item(), eval=evaluate() if scheduled else None, seconds=seconds, **counts,
                nfe=counts["nfe_fwd"] + counts["nfe_bwd"])


def iteration_batch(cfg, model, prompts: list[Prompt], it: int) -> tuple[list[Prompt], dict]:
    """Iteration it's num_prompts prompts as train.py chooses them, each group_size times in a row, and their text
    encodings repeated alike."""
    G = cfg.group_size
    batch = [prompts[i] for i in rollouts.prompts_for_iteration(len(prompts), cfg.num_prompts, cfg.seed, it)
             for _ in range(G)]
    return batch, {k: v.repeat_interleave(G, 0) for k, v in model.encode([p.text for p in batch[::G]]).items()}


def base_velocity(model):
    """The reference policy: the base model's velocity, the LoRA switched off."""
    def reference(x, t, cond):
        with adapters_disabled(model.transformer):
            return model.velocity(x, t, cond)
    return reference


def flow_grpo_sd3(model_dir: Path, seed: int, iterations: int, eval_every: int, *, steps: int = 10,
                  fg: FlowGRPO = FlowGRPO(), flags=()) -> list[dict]:
    """Flow-GRPO (FlowGRPO's settings, flow_grpo_update) on train.py's adapter, prompts, rewards, LoRA (r 32, alpha 64,
    Gaussian init, the attention projections: Flow-GRPO's), AdamW, rollout noise and evaluation: SDE rollouts of
    `steps` steps, advantages per prompt over the batch's std, the reference the LoRA switched off. History as
    vgrpo_sd3's; flags: train.py flags for both (--lr sets this one's too)."""
    cfg, device, model, params, weights, reward_fns, prompts, evaluate = tiny_sd3_setup(model_dir, seed, flags)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=fg.weight_decay)
    grid = type(model)(model.pipe, torch.float32, resolution=cfg.resolution, sampling_steps=steps,
                       max_sequence_length=cfg.max_sequence_length).timesteps().tolist()

    reference = base_velocity(model)

    P, G, trained_steps = cfg.num_prompts, cfg.group_size, int(steps * fg.timestep_fraction)
    g = torch.Generator().manual_seed(seed)
    history, counts, seconds = [], dict(grad_steps=0, nfe_fwd=0, nfe_bwd=0), 0.0
    for it in range(iterations):
        start = time.perf_counter()
        batch, cond = iteration_batch(cfg, model, prompts, it)
        noise = rollouts.initial_noise(cfg, model, "rollout", it, range(P * G), device)
        x, path = sample_sde(model.velocity, noise, grid, cond, fg, g)
        images = model.decode(x)
        scores = {n: fn(images, [p.text for p in batch], [p.metadata for p in batch]).float() for n, fn in reward_fns.items()}
        reward = sum(w * scores[n] for n, w in weights.items())
        adv = vgrpo.group_advantages(reward.view(P, G), global_std=True).flatten()
        n = flow_grpo_update(model.velocity, reference, path, cond, adv, optimizer, params, fg, t_cap=grid[1],
                             max_grad_norm=cfg.max_grad_norm, generator=g)
        seconds += time.perf_counter() - start
        counts["grad_steps"] += fg.updates_per_batch if n else 0
        counts["nfe_fwd"] += P * G * steps + 2 * n * trained_steps  # rollout; per trained step the policy's and the
        counts["nfe_bwd"] += n * trained_steps  # reference's forwards, and the policy's backward
        history.append(history_entry(it, iterations, eval_every, reward, seconds, counts, evaluate))
    return history


# ----------------------------------------------------------------------------------------------
# DiffusionNFT


@dataclass(frozen=True)
class DiffusionNFT:
    """DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117; github.com/NVlabs/DiffusionNFT) as its
    scripts/train_nft_sd3.py runs config/nft.py's SD3 tasks on config/base.py's defaults."""

    beta: float = 1.0  # config.beta: how far the implicit positive and negative policies step from the old one
    kl: float = 1e-4  # train.beta: the squared velocity distance to the reference (the LoRA switched off)
    adv_clip_max: float = 5.0  # train.adv_clip_max: advantages clipped to +-5, then mapped to r in [0, 1]
    sampling_steps: int = 10  # sample.num_steps: deterministic DPM-Solver++(2M) rollouts (solver dpm2), no CFG
    timestep_fraction: float = 0.99  # train.timestep_fraction: int(0.99 x 10) = 9 of the grid's timesteps trained
    decay_type: int = 1  # the old policy's soft update after each epoch: decay min(0.001 x step, 0.5)
    ema_decay: float = 0.9  # the EMA of the LoRA that is evaluated, warmed up as (1 + step) / (10 + step)
    weight_decay: float = 1e-4  # train.adam_weight_decay
    gradient_steps: int = 1  # gradient_step_per_epoch: optimizer steps per rollout batch (2 for its OCR task)


def old_policy_decay(step: int, decay_type: int) -> float:
    """return_decay of train_nft_sd3.py: the old policy's share in its soft update after `step` optimizer steps,
    old <- decay old + (1 - decay) current."""
    flat, rate, cap = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * rate, cap)


def nft_ema_decay(step: int, decay: float) -> float:
    """The EMA's decay after `step` optimizer steps: (1 + step) / (10 + step), at most `decay`."""
    return min((1 + step) / (10 + step), decay)


def per_prompt_advantages(rewards: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """PerPromptStatTracker(global_std=True) of Flow-GRPO and DiffusionNFT: each reward minus the mean of the
    batch's rewards for the same prompt text, over the whole batch's population std + 1e-4. (N,) -> (N,)."""
    std = rewards.double().std(unbiased=False) + 1e-4
    adv = torch.empty_like(rewards, dtype=torch.float64)
    for text in set(prompts):
        rows = torch.tensor([p == text for p in prompts])
        adv[rows] = (rewards[rows].double() - rewards[rows].double().mean()) / std
    return adv.float()


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, v_ref: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor,
             t: torch.Tensor, adv: torch.Tensor, nft: DiffusionNFT) -> torch.Tensor:
    """DiffusionNFT's loss on B noised samples x_t = (1 - t) x0 + t eps: the advantage, clipped, maps to r in [0, 1];
    the implicit positive policy v+ = beta v + (1 - beta) v_old and negative v- = (1 + beta) v_old - beta v each
    predict x0 = x_t - t v, their squared errors weighted by the detached mean absolute error (floor 1e-5), so
        L = adv_clip_max / beta * mean_B[r L(v+) + (1 - r) L(v-)] + kl * mean_B mean((v - v_ref)^2).
    v (with gradient), v_old, v_ref, x_t, x0: (B, ...); t, adv: (B,)."""
    dims, tb = tuple(range(1, x0.dim())), t.view(-1, *[1] * (x0.dim() - 1))
    r = (adv.clamp(-nft.adv_clip_max, nft.adv_clip_max) / nft.adv_clip_max / 2 + 0.5).clamp(0, 1)

    def weighted_error(v_implicit):
        error = x_t - tb * v_implicit - x0
        with torch.no_grad():
            weight = error.double().abs().mean(dims, keepdim=True).clip(min=1e-5)
        return (error**2 / weight).mean(dims)

    positive = weighted_error(nft.beta * v + (1 - nft.beta) * v_old.detach())
    negative = weighted_error((1 + nft.beta) * v_old.detach() - nft.beta * v)
    policy = (r * positive + (1 - r) * negative).mean() / nft.beta * nft.adv_clip_max
    return policy + nft.kl * (v - v_ref.detach()).pow(2).mean(dims).mean()


def diffusion_nft_update(model, reference, old: list, params: list, optimizer, x0, cond, adv, grid: list[float],
                         nft: DiffusionNFT, *, micro_batch_size: int, max_grad_norm: float, generator, ema: list,
                         steps_done: int) -> int:
    """DiffusionNFT's training phase on one rollout batch: every sample trained at int(timestep_fraction x steps) of
    the sampling grid's timesteps (a random choice per sample), each with fresh noise, in `gradient_steps` optimizer
    steps over the (shuffled) batch, the loss averaged over samples and timesteps, the EMA (ema: its weights) stepped
    after each optimizer step as DiffusionNFT steps it (steps_done: optimizer steps before this batch). old: the old
    policy's LoRA weights (swapped in for its forwards), reference(x, t, cond) the reference's velocity. Returns the
    timesteps trained (each a forward and a backward of the policy and forwards of the old policy and the reference)."""
    trained = int(nft.sampling_steps * nft.timestep_fraction)
    timesteps = torch.tensor(grid[:-1])  # where the rollouts evaluated the model
    order = torch.randperm(len(x0), generator=generator)
    chosen = torch.stack([timesteps[torch.randperm(len(timesteps), generator=generator)[:trained]] for _ in x0])
    noise = torch.randn((len(x0), trained, *x0.shape[1:]), generator=generator).to(x0.device)  # drawn once, up front
    for step_rows in order.chunk(nft.gradient_steps):
        micro = step_rows.split(micro_batch_size)
        for rows in micro:
            c = rows_of(cond, rows)
            for j in range(trained):
                t = chosen[rows, j].to(x0.device)
                tb = t.view(-1, *[1] * (x0.dim() - 1))
                x_t = (1 - tb) * x0[rows] + tb * noise[rows, j]
                with torch.no_grad(), guards.swapped_weights(params, old):
                    v_old = model.velocity(x_t, t, c)
                with torch.no_grad():
                    v_ref = reference(x_t, t, c)
                loss = nft_loss(model.velocity(x_t, t, c), v_old, v_ref, x_t, x0[rows], t, adv[rows], nft)
                (loss / (len(micro) * trained)).backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        steps_done += 1
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 1 - nft_ema_decay(steps_done, nft.ema_decay))
    return len(x0) * trained


def diffusion_nft_sd3(model_dir: Path, seed: int, iterations: int, eval_every: int, *, nft: DiffusionNFT = DiffusionNFT(),
                      flags=()) -> list[dict]:
    """DiffusionNFT (DiffusionNFT's settings, diffusion_nft_update) on train.py's adapter, prompts, rewards, LoRA (r 32,
    alpha 64, Gaussian init, the attention projections: DiffusionNFT's too), AdamW, rollout noise and evaluation:
    rollouts by the old policy (deterministic DPM-Solver++(2M), nft.sampling_steps steps, no CFG), advantages per
    prompt over the batch's std, one optimizer step, the EMA, then the old policy's soft update; evaluated with the
    EMA weights, as DiffusionNFT evaluates. History as vgrpo_sd3's; flags: train.py flags (--lr sets this one's)."""
    cfg, device, model, params, weights, reward_fns, prompts, evaluate = tiny_sd3_setup(model_dir, seed, flags)
    old = [p.detach().clone() for p in params]  # the old policy starts as the initial LoRA
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=nft.weight_decay)

    def evaluate_ema() -> float:  # DiffusionNFT evaluates its EMA
        with guards.swapped_weights(params, ema):
            return evaluate()
    sampler = type(model)(model.pipe, torch.float32, resolution=cfg.resolution, sampling_steps=nft.sampling_steps,
                          max_sequence_length=cfg.max_sequence_length)

    reference = base_velocity(model)

    P, G = cfg.num_prompts, cfg.group_size
    g = torch.Generator().manual_seed(seed)
    history, counts, seconds = [], dict(grad_steps=0, nfe_fwd=0, nfe_bwd=0), 0.0
    for it in range(iterations):
        start = time.perf_counter()
        batch, cond = iteration_batch(cfg, model, prompts, it)
        noise = rollouts.initial_noise(cfg, model, "rollout", it, range(P * G), device)
        with guards.swapped_weights(params, old):  # the old policy samples
            x0 = sampler.sample(model.velocity, noise, cond, "dpm2")
        images = model.decode(x0)
        scores = {n: fn(images, [p.text for p in batch], [p.metadata for p in batch]).float() for n, fn in reward_fns.items()}
        reward = sum(w * scores[n] for n, w in weights.items())
        adv = per_prompt_advantages(reward, [p.text for p in batch])
        trained = diffusion_nft_update(model, reference, old, params, optimizer, x0, cond, adv,
                                       sampler.timesteps().tolist(), nft, micro_batch_size=cfg.micro_batch_size,
                                       max_grad_norm=cfg.max_grad_norm, generator=g, ema=ema,
                                       steps_done=counts["grad_steps"])
        counts["grad_steps"] += nft.gradient_steps
        with torch.no_grad():  # the old policy's soft update, once per batch (after the epoch in DiffusionNFT)
            decay = old_policy_decay(counts["grad_steps"], nft.decay_type)
            for o, p in zip(old, params):
                o.copy_(decay * o + (1 - decay) * p)
        seconds += time.perf_counter() - start
        # rollout forwards; per trained timestep the policy's forward and backward, the old policy's and the
        # reference's forwards
        counts["nfe_fwd"] += P * G * nft.sampling_steps + 3 * trained
        counts["nfe_bwd"] += trained
        history.append(history_entry(it, iterations, eval_every, reward, seconds, counts, evaluate_ema))
    return history


# ----------------------------------------------------------------------------------------------
# MixGRPO and MixGRPO-Flash


@dataclass(frozen=True)
class MixGRPO:
    """MixGRPO (Li et al. 2025, arXiv 2507.21802; github.com/Tencent-Hunyuan/MixGRPO) as its
    scripts/finetune/finetune_flux_grpo_MixGRPO.sh runs fastvideo/train_grpo_flux.py (training_strategy part,
    sample_strategy progressive, --init_same_noise, --flow_grpo_sampling, --prog_overlap, --roll_back), and
    MixGRPO-Flash (finetune_flux_grpo_MixGRPO_Flash.sh: DPM-Solver++(2M) after the window, steps compressed)."""

    noise_level: float = 0.7  # eta: Flow-GRPO's SDE inside the window
    window: int = 4  # group_size: the SDE steps trained; ODE (Euler) steps outside
    sampling_steps: int = 10  # 25 in the FLUX script; 10 here as the tiny runs sample (the "4 of 10")
    shift: float = 3.0  # the sigma schedule: sd3_time_shift(3, linspace(1, 0, steps + 1))
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    kl: float = 0.0  # kl_coeff: 0.5 (log p - log p_old)^2, off in the published scripts
    updates_per_batch: int = 4  # 12 generations per GPU / gradient_accumulation_steps 3: four optimizer steps
    weight_decay: float = 1e-4
    iters_per_window: int = 25  # iters_per_group (20 for Flash); mixgrpo_sd3 scales it to the run (25 of 300)
    flash: bool = False  # dpm_apply_strategy post: DPM-Solver++(2M) after the window ...
    post_compress_ratio: float = 0.4  # ... on int(max(0.4 x the steps left, 1)) points of a new shifted grid


def mixgrpo_schedule(steps: int, shift: float) -> list[float]:
    """sd3_time_shift(shift, linspace(1, 0, steps + 1)): MixGRPO's sigma schedule (its own, not the pipeline's)."""
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).tolist()


def mixgrpo_window(iteration: int, mix: MixGRPO, iters_per_window: int) -> list[int]:
    """GRPOTrainingStates (progressive, overlap step 1, roll back): the window starts at step 0 and moves one step
    every iters_per_window iterations up to max_timesteps = steps - 2, then rolls back to 0; it trains the steps
    range(start, min(start + window, max_timesteps)), which is empty at start = max_timesteps, as in MixGRPO."""
    last = mix.sampling_steps - 2
    start = (iteration // iters_per_window) % (last + 1)
    return list(range(start, min(start + mix.window, last)))


def mixgrpo_grid(window: list[int], mix: MixGRPO) -> list[float]:
    """The rollout's sigmas: MixGRPO's schedule; for Flash the steps after the window replaced by a shifted grid of
    int(max((steps - last) x post_compress_ratio, 1)) points from the step after the window to 0."""
    grid = mixgrpo_schedule(mix.sampling_steps, mix.shift)
    if not mix.flash or not window:
        return grid
    last = window[-1]
    points = int(max((mix.sampling_steps - last) * mix.post_compress_ratio, 1))
    start = 1 - (last + 1) / mix.sampling_steps  # linspace(1, 0, steps + 1)[last + 1]
    post = torch.linspace(start, 0, points, dtype=torch.float64)
    return grid[:last + 1] + (mix.shift * post / (1 + (mix.shift - 1) * post)).tolist()


def mixgrpo_rollout(velocity, z: torch.Tensor, cond, grid: list[float], window: list[int], mix: MixGRPO,
                    generator) -> tuple[torch.Tensor, list]:
    """One MixGRPO rollout: Flow-GRPO's SDE step (noise level eta, sigma capped at the grid's second point) on the
    window's steps, Euler elsewhere; with Flash, DPM-Solver++(2M) after the window, continuing from the data
    predictions of the steps before it (as MixGRPO's DPM state does). Returns the sample and the window's path
    [(x_t, t, t_next, x_next, log p)]."""
    path, x0_prev = [], None
    with torch.no_grad():
        for i, (t, t_next) in enumerate(zip(grid[:-1], grid[1:])):
            v = velocity(z, torch.full((z.shape[0],), t, device=z.device), cond)
            x0 = z - t * v
            if i in window:
                mean, _, std = sde_kernel(v, z, t, t_next, noise_level=mix.noise_level, t_cap=grid[1])
                z_next = mean + std * torch.randn(z.shape, generator=generator).to(z.device)
                path.append((z, t, t_next, z_next, gaussian_log_prob(z_next, mean, std)))
            elif mix.flash and window and i > window[-1] and t_next > 0:
                z_next = vgrpo.dpm_solver_step(z, x0, x0_prev, grid[i - 1], t, t_next)
            else:
                z_next = z + (t_next - t) * v
            z, x0_prev = z_next, x0
    return z, path


def group_advantages_unbiased(rewards: torch.Tensor) -> torch.Tensor:
    """MixGRPO's advantages (use_group): each group's rewards minus their mean over their std (torch.std, unbiased)
    + 1e-8. (P, G) -> (P, G)."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-8)


def mixgrpo_advantages(scores: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """MixGRPO's multi_reward_mix "advantage_aggr" (its published scripts' setting): each reward's group advantages
    (group_advantages_unbiased), summed with the weights normalised to sum 1. With one reward: that reward's group
    advantages. scores: name -> (P, G); -> (P, G)."""
    total = sum(weights.values())
    return sum(w / total * group_advantages_unbiased(scores[name]) for name, w in weights.items())


def mixgrpo_update(velocity, path: list, cond, adv: torch.Tensor, optimizer, params: list, mix: MixGRPO, *,
                   group_size: int, t_cap: float, max_grad_norm: float) -> int:
    """MixGRPO's training phase on one rollout batch (G samples per group, group-major): updates_per_batch optimizer
    steps, step j on the j-th part of every group's samples (its GPUs train their generations in order, three per
    step); each averages over its samples and the window's steps max(-A r, -A clip(r, 1 -+ clip_range)) with
    r = p_theta(x_next | x_t) / p_old and A clipped to +-adv_clip_max (+ kl 0.5 (log r)^2). Returns how many samples
    were trained (each a forward and a backward per window step)."""
    if not path:
        return 0
    adv = adv.clamp(-mix.adv_clip_max, mix.adv_clip_max)
    groups = len(adv) // group_size
    for part in torch.arange(group_size).chunk(mix.updates_per_batch):
        rows = (torch.arange(groups)[:, None] * group_size + part[None]).flatten()
        for x_t, t, t_next, x_next, old in path:
            mean, _, std = sde_mean_std(velocity, x_t[rows], t, t_next, rows_of(cond, rows), noise_level=mix.noise_level,
                                        t_cap=t_cap)
            log_ratio = gaussian_log_prob(x_next[rows], mean, std) - old[rows]
            ratio, a = log_ratio.exp(), adv[rows]
            policy = torch.max(-a * ratio, -a * ratio.clamp(1 - mix.clip_range, 1 + mix.clip_range)).mean()
            ((policy + mix.kl * 0.5 * log_ratio.pow(2).mean()) / len(path)).backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    return len(adv)


def mixgrpo_sd3(model_dir: Path, seed: int, iterations: int, eval_every: int, *, mix: MixGRPO = MixGRPO(),
                flags=()) -> list[dict]:
    """MixGRPO (mix.flash: MixGRPO-Flash) on train.py's adapter, prompts, rewards, LoRA, AdamW and evaluation: every
    sample of a group from the same initial noise (--init_same_noise), SDE steps only in the sliding window,
    advantages per group and per reward (mixgrpo_advantages), updates_per_batch optimizer steps. The model sees the
    timestep int(1000 sigma) / 1000, as MixGRPO passes it. The window moves every mix.iters_per_window x iterations /
    300 iterations (the published 25 of max_train_steps 300: the same number of moves over a shorter run). History as
    vgrpo_sd3's."""
    cfg, device, model, params, weights, reward_fns, prompts, evaluate = tiny_sd3_setup(model_dir, seed, flags)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=mix.weight_decay)
    iters_per_window = max(1, round(mix.iters_per_window * iterations / 300))

    def velocity(x, t, cond):  # int(sigma * 1000) / 1000, as MixGRPO's transformer calls receive it
        return model.velocity(x, torch.floor(t * 1000) / 1000, cond)

    P, G = cfg.num_prompts, cfg.group_size
    g = torch.Generator().manual_seed(seed)
    history, counts, seconds = [], dict(grad_steps=0, nfe_fwd=0, nfe_bwd=0), 0.0
    for it in range(iterations):
        start = time.perf_counter()
        batch, cond = iteration_batch(cfg, model, prompts, it)
        noise = rollouts.initial_noise(cfg, model, "rollout", it, range(0, P * G, G), device).repeat_interleave(G, 0)
        window = mixgrpo_window(it, mix, iters_per_window)
        grid = mixgrpo_grid(window, mix)
        x0, path = mixgrpo_rollout(velocity, noise, cond, grid, window, mix, g)
        images = model.decode(x0)
        scores = {n: fn(images, [p.text for p in batch], [p.metadata for p in batch]).float() for n, fn in reward_fns.items()}
        reward = sum(w * scores[n] for n, w in weights.items())
        adv = mixgrpo_advantages({n: scores[n].view(P, G) for n in weights}, weights).flatten()
        trained = mixgrpo_update(velocity, path, cond, adv, optimizer, params, mix, group_size=G, t_cap=grid[1],
                                 max_grad_norm=cfg.max_grad_norm)
        seconds += time.perf_counter() - start
        counts["grad_steps"] += mix.updates_per_batch if trained else 0
        counts["nfe_fwd"] += P * G * (len(grid) - 1) + trained * len(path)  # rollout; per window step a forward ...
        counts["nfe_bwd"] += trained * len(path)  # ... and a backward
        history.append(history_entry(it, iterations, eval_every, reward, seconds, counts, evaluate))
    return history
