"""V-GRPO: online RL for flow-matching generative models with an ELBO surrogate.

Reference implementation of Tang et al., "Online Reinforcement Learning for Denoising Generative
Models Is Easier than You Think" (V-GRPO, arXiv 2604.23380). Importable with torch alone.

The whole multi-step generation of a sample o given a prompt c is ONE action. Its log-likelihood
log pi_theta(o|c) is intractable, so GRPO is run on an ELBO surrogate instead (Eq. 14):

    s_i(theta) = -(1/K) sum_j l_ij,   l_ij = mean(e_ij^2) / sg(mean|e_ij|),
    e_ij = x_theta(z_tj) - o_i,       z_t = (1 - t) o_i + t eps_j,   x_theta = z_t - t v_theta

SIGN CONVENTION: s is a log-likelihood stand-in, so HIGHER = MORE LIKELY everywhere in this file.
Rectified-flow convention as in SD3/FLUX: t = 1 is pure noise, the network predicts the velocity
v = eps - x0, and every `velocity(z_t, t, cond)` callable takes float32 t in [0, 1] of shape (N,).

Call order for one iteration (train.py and `train_toy` below do exactly this):

    x0 = sample_ode(velocity, noise, cond, timesteps)          # 2. rollouts, any ODE sampler
    t, eps = draw_mc_pairs(P, G, K, x0.shape[1:], generator=g) # 3. drawn ONCE per iteration
    adv = soft_clip(group_advantages(rewards.view(P, G)), eta=3.0).flatten()    # 4.
    metrics = vgrpo_update(surrogate, optimizer, Rollouts(x0, cond, adv, t, eps))  # 5. + 6.

where `surrogate = functools.partial(elbo_surrogate, velocity, param="x", ...)`, so the old and
the new policy are scored by the same function on the same Monte-Carlo pairs. vgrpo_update computes
the old-policy surrogate (step 5) only where it differs from the first gradient pass.

Choices this implementation makes where the paper leaves them open:
- Timesteps for the surrogate are uniform in [t_min, t_max] of the flow time t itself (no
  resolution shift, no logit-normal), stratified into K equal-width strata.
- The self-normalising denominator is clamped at `norm_floor` = 1e-5 (tiny errors at t -> 0
  would otherwise divide by ~0).
- Advantages use the population std (G = 1 is defined) plus delta = 1e-4; a group whose rewards
  are all equal gets exactly 0, not (0 / delta) rounding noise.
- `clipfrac` counts samples with |rho - 1| > clip_eps (the cleanrl definition); `approx_kl` is
  the k3 estimator mean((rho - 1) - log rho).
- The non-finite guard decides on the global gradient norm, which is identical on every rank
  (also under FSDP), so all ranks skip or step together.
- Beyond the paper: policy_loss can add the same x-space distance to a frozen reference (base) model,
  ref_kl_coef * D(x_theta, x_ref), a guard against reward hacking over many iterations.
"""

import math
import time
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Velocity = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
PARAMETERISATIONS = ("x", "v", "eps")


# ----------------------------------------------------------------------------------------------
# Rollouts: a plain ODE sampler (the method needs no SDE and no per-step log-probs)


def flow_timesteps(num_steps: int, *, shift: float = 1.0) -> torch.Tensor:
    """Sampling grid from t = 1 (noise) to t = 0 (data), shape (num_steps + 1,).

    `shift` > 1 spends more steps at high noise: t' = shift t / (1 + (shift - 1) t), the
    resolution shift of SD3 (shift 3) and FLUX (shift depends on image size).
    """
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


SOLVERS = ("euler", "heun", "ab2", "dpm2")


@torch.no_grad()
def sample_ode(
    velocity: Velocity, noise: torch.Tensor, cond: Any, timesteps: torch.Tensor, *, solver: str = "euler"
) -> torch.Tensor:
    """Integrate dz/dt = v(z, t, cond) from timesteps[0] down to timesteps[-1]. (B, ...) -> (B, ...).

    solver: "euler" (1 NFE/step), "heun" (2nd order, 2 NFE/step), "ab2" (2nd-order Adams-Bashforth multistep for
    non-uniform steps, 1 NFE/step after the first) or "dpm2": DPM-Solver++(2M) (Lu et al. 2022, data prediction,
    midpoint form) on the flow, where the data prediction is x0 = z - t v and the log-SNR lambda = log((1 - t) / t);
    1 NFE/step, first order (= Euler) on the first step, on the one after a step from t = 1 (lambda = -inf there) and
    on the last to t = 0: the deterministic sampler of DiffusionNFT and MixGRPO-Flash. V-GRPO scores only the final
    sample, so any deterministic solver is a valid policy.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    z, v_prev, h_prev, x0_prev = noise.float(), None, None, None
    grid = timesteps.tolist()
    for i, (t_cur, t_next) in enumerate(zip(grid[:-1], grid[1:])):
        h = t_next - t_cur  # negative: time runs from noise to data
        v = velocity(z, torch.full((z.shape[0],), t_cur, device=z.device), cond).float()
        x0 = z - t_cur * v if solver == "dpm2" else None
        if solver == "heun":
            v_end = velocity(z + h * v, torch.full((z.shape[0],), t_next, device=z.device), cond).float()
            z = z + h * (v + v_end) / 2
        elif solver == "ab2" and v_prev is not None:
            r = h / (2 * h_prev)  # variable-step AB2 weights
            z = z + h * ((1 + r) * v - r * v_prev)
        elif solver == "dpm2" and x0_prev is not None and t_next > 0:
            z = dpm_solver_step(z, x0, x0_prev, grid[i - 1], t_cur, t_next)
        else:
            z = z + h * v
        v_prev, h_prev, x0_prev = v, h, x0
    return z


def dpm_solver_step(z: torch.Tensor, x0: torch.Tensor, x0_prev: torch.Tensor, t_prev: float, t_cur: float,
                    t_next: float) -> torch.Tensor:
    """One DPM-Solver++(2M) step from t_cur to t_next > 0 on the flow (the midpoint form): the data predictions x0 at
    t_cur and x0_prev at t_prev, h = lambda(t_next) - lambda(t_cur), r = (lambda(t_cur) - lambda(t_prev)) / h,
        z' = (t_next / t_cur) z - (1 - t_next) (e^-h - 1) (x0 + (x0 - x0_prev) / (2 r)),
    first order (r infinite) after a step from t = 1."""
    step = log_snr(t_next) - log_snr(t_cur)
    ratio = (log_snr(t_cur) - log_snr(t_prev)) / step
    return t_next / t_cur * z - (1 - t_next) * math.expm1(-step) * (x0 + 0.5 * (x0 - x0_prev) / ratio)


def log_snr(t: float) -> float:
    """lambda(t) = log((1 - t) / t) of the flow z_t = (1 - t) x0 + t eps: -inf at t = 1, +inf at t = 0."""
    return -math.inf if t >= 1 else math.inf if t <= 0 else math.log((1 - t) / t)


# ----------------------------------------------------------------------------------------------
# The ELBO surrogate


def draw_mc_pairs(
    num_groups: int,
    group_size: int,
    num_mc: int,
    sample_shape: tuple[int, ...],
    *,
    generator: torch.Generator,
    t_min: float = 0.0,
    t_max: float = 1.0,
    stratified: bool = True,
    group_shared: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte-Carlo pairs (t, eps) for the surrogate (variance-reduction tricks 1 and 2).

    Returns t (B, K) and eps (B, K, *sample_shape) on the generator's device, float32, with
    B = num_groups * group_size in group-major order (row b belongs to group b // group_size).
    - group_shared: the G samples of a group share one set of K pairs (common random numbers,
      so within-group surrogate differences are not drowned in pair noise). Off: every sample
      draws its own pairs.
    - stratified: [t_min, t_max] is split into K equal strata with one uniform t in each. Off:
      K independent uniform draws.
    Draw once per iteration and pass the SAME pairs to the old and the new policy.
    """
    if num_mc < 1 or not 0.0 <= t_min < t_max <= 1.0:
        raise ValueError(f"need num_mc >= 1 and 0 <= t_min < t_max <= 1, got {num_mc=}, {t_min=}, {t_max=}")
    device = generator.device
    draws = 1 if group_shared else group_size  # independent pair sets per group
    u = torch.rand(num_groups, draws, num_mc, generator=generator, device=device)
    if stratified:
        u = (torch.arange(num_mc, device=device) + u) / num_mc  # one draw inside each stratum
    t = t_min + (t_max - t_min) * u
    eps = torch.randn(num_groups, draws, num_mc, *sample_shape, generator=generator, device=device)
    # (P, 1 or G, K, ...) -> (P, G, K, ...) -> (B, K, ...)
    t = t.expand(num_groups, group_size, num_mc).reshape(-1, num_mc)
    eps = eps.expand(num_groups, group_size, num_mc, *sample_shape).reshape(-1, num_mc, *sample_shape)
    return t, eps


def elbo_surrogate(
    velocity: Velocity,
    x0: torch.Tensor,
    cond: Any,
    t: torch.Tensor,
    eps: torch.Tensor,
    *,
    param: str = "x",
    self_normalize: bool = True,
    norm_floor: float = 1e-5,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair ELBO surrogate s_ij (Eq. 14 with adaptive weighting = trick 3); higher = more likely.

    x0 (B, ...) clean samples; cond: a pytree (tensor / dict / list / tuple / None) of batch-first
    tensors for the B samples; t (B, K); eps (B, K, ...).
    Returns s (B, K) and the x-predictions x_theta (B, K, ...) that the KL term (Eq. 16) needs.

    param picks the error e whose mean square is the loss: "x" (x_theta - x0, the paper's
    choice), "v" (v_theta - (eps - x0), the flow-matching loss) or "eps" (eps_theta - eps).
    self_normalize divides by the stop-gradient mean |e| (clamped at norm_floor). Everything is
    computed in (at least) float32 whatever dtype the model runs in. The B*K model evaluations
    are made in calls of at most chunk_size rows (default: one call).
    """
    if param not in PARAMETERISATIONS:
        raise ValueError(f"param must be one of {PARAMETERISATIONS}, got {param!r}")
    B, K = t.shape
    if x0.shape[0] != B or eps.shape != (B, K, *x0.shape[1:]):
        raise ValueError(f"shapes disagree: x0 {tuple(x0.shape)}, t {tuple(t.shape)}, eps {tuple(eps.shape)}; "
                         "expected t (B, K) and eps (B, K, *x0.shape[1:])")
    dtype = torch.promote_types(x0.dtype, torch.float32)
    rows = torch.arange(B * K, device=x0.device)  # row r = (sample r // K, pair r % K)
    s, x_pred = [], []
    for r in rows.split(chunk_size or B * K):
        i = r // K
        x = x0[i].to(dtype)
        e = eps.flatten(0, 1)[r].to(dtype)
        tr = t.flatten()[r].to(dtype)
        tb = tr.view(-1, *[1] * (x.dim() - 1))  # broadcast over the sample dims
        z = (1 - tb) * x + tb * e
        v = velocity(z, tr, _take(cond, i)).to(dtype)
        xp = z - tb * v
        if param == "x":
            err = xp - x
        elif param == "v":
            err = v - (e - x)
        else:
            err = z + (1 - tb) * v - e  # eps-prediction from the velocity
        loss = err.pow(2).flatten(1).mean(1)
        if self_normalize:
            loss = loss / err.detach().abs().flatten(1).mean(1).clamp_min(norm_floor)
        s.append(-loss)
        x_pred.append(xp)
    return torch.cat(s).view(B, K), torch.cat(x_pred).view(B, K, *x0.shape[1:])


def surrogate_cv(s: torch.Tensor) -> dict[str, float]:
    """Coefficient of variation of per-sample surrogates s (P, G) (the paper's diagnostic).

    cv: std / |mean| over all samples; cv_within: the same inside each group, averaged over
    groups. Variance reduction should lower both (paper, FLUX: 0.230 -> 0.128, 0.170 -> 0.038).
    """
    s = s.double()
    cv = s.std(correction=0) / s.mean().abs()
    cv_within = (s.std(dim=1, correction=0) / s.mean(dim=1).abs()).mean()
    return {"cv": cv.item(), "cv_within": cv_within.item()}


# ----------------------------------------------------------------------------------------------
# Advantages


def group_advantages(rewards: torch.Tensor, *, delta: float = 1e-4, global_std: bool = False) -> torch.Tensor:
    """GRPO advantages A = (R - mean_group R) / (std R + delta), (P, G) -> (P, G).

    Group g is row g. std is per group, or over the whole batch with global_std (pass the
    GLOBAL batch under data parallelism). Groups whose rewards are all equal get exactly 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be shaped (num_prompts, group_size), got {tuple(rewards.shape)}")
    rewards = rewards.float()
    std = rewards.std(correction=0) if global_std else rewards.std(dim=1, keepdim=True, correction=0)
    adv = (rewards - rewards.mean(dim=1, keepdim=True)) / (std + delta)
    spread = rewards.amax(dim=1, keepdim=True) - rewards.amin(dim=1, keepdim=True)
    return torch.where(spread > 0, adv, torch.zeros_like(adv))


def multi_reward_advantages(
    rewards: dict[str, torch.Tensor],
    weights: dict[str, float],
    *,
    aggregation: str = "advantage",
    delta: float = 1e-4,
    global_std: bool = False,
) -> torch.Tensor:
    """Advantages (P, G) from several rewards, each (P, G).

    aggregation "reward": A = adv(sum_k w_k R_k), one advantage of the weighted reward sum.
    aggregation "advantage": A = sum_k w_k adv(R_k), MixGRPO's advantage aggregation: each reward
    is normalised in its own group first, so no reward dominates by its scale.
    """
    if aggregation == "reward":
        return group_advantages(sum(w * rewards[k] for k, w in weights.items()), delta=delta, global_std=global_std)
    if aggregation == "advantage":
        return sum(w * group_advantages(rewards[k], delta=delta, global_std=global_std) for k, w in weights.items())
    raise ValueError(f"aggregation must be 'reward' or 'advantage', got {aggregation!r}")


def soft_clip(adv: torch.Tensor, *, eta: float | None) -> torch.Tensor:
    """Advantage soft-clipping A <- eta tanh(A / eta) (Eq. 17); eta None disables. Any shape.

    The only control that still acts fully on-policy (one gradient step per rollout batch).
    """
    return adv if eta is None else eta * torch.tanh(adv / eta)


# ----------------------------------------------------------------------------------------------
# Policy loss and update


def policy_loss(
    s_new: torch.Tensor,
    s_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float | None = None,
    kl_coef: float = 0.0,
    x_new: torch.Tensor | None = None,
    x_old: torch.Tensor | None = None,
    ref_kl_coef: float = 0.0,
    x_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO loss on the surrogate ratio, plus the x-space KL (Eq. 16) to the behaviour policy and to the
    reference (base) model. Minimise it.

    s_new, s_old (B, K) per-pair surrogates on the same pairs; advantages (B,).
    rho_i = exp(mean_K s_new - mean_K s_old)   (one whole-image ratio per sample)
    D(a, b) = mean_i mean_{K, elements} (a - b)^2   (Eq. 16's x-space KL between two models' x-predictions)
    loss  = mean_i max(-A_i rho_i, -A_i clip(rho_i, 1 - clip_eps, 1 + clip_eps))
            + kl_coef * D(x_new, x_old) + ref_kl_coef * D(x_new, x_ref)
    D(x_new, x_old) bounds each iteration's step (it is 0 at a batch's first gradient step); D(x_new, x_ref), with
    x_ref the frozen base model's x-predictions on the same pairs, bounds the distance from the base over the whole
    run (a guard against reward hacking; not in the paper). clip_eps None disables clipping; x_new / x_old (B, K, ...)
    are needed when kl_coef > 0, x_ref when ref_kl_coef > 0; given x_ref, ref_kl is logged whatever its weight.
    Returns the scalar loss and detached scalar metrics.
    """
    log_ratio = s_new.mean(dim=1) - s_old.mean(dim=1)
    ratio = log_ratio.exp()
    pg_loss = -advantages * ratio
    if clip_eps is not None:
        pg_loss = torch.max(pg_loss, -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    policy = pg_loss.mean()
    if (kl_coef > 0 and (x_new is None or x_old is None)) or (ref_kl_coef > 0 and (x_new is None or x_ref is None)):
        raise ValueError("kl_coef > 0 needs x_new and x_old, ref_kl_coef > 0 needs x_new and x_ref (the x-predictions "
                         "from elbo_surrogate)")
    zero = torch.zeros((), device=s_new.device)
    kl = x_space_kl(x_new, x_old) if kl_coef > 0 else zero
    ref_kl = x_space_kl(x_new, x_ref) if x_ref is not None else zero
    loss = policy + kl_coef * kl + ref_kl_coef * ref_kl
    with torch.no_grad():
        clipped = (ratio - 1).abs() > clip_eps if clip_eps is not None else torch.zeros_like(ratio, dtype=torch.bool)
        metrics = {
            "loss": loss.detach(),
            "policy_loss": policy.detach(),
            "kl": kl.detach(),
            "ratio_mean": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
            "clipfrac": clipped.float().mean(),
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
        }
        if x_ref is not None:
            metrics["ref_kl"] = ref_kl.detach()
    return loss, metrics


def x_space_kl(x_a: torch.Tensor, x_b: torch.Tensor) -> torch.Tensor:
    """D(a, b) = mean_i mean_{K, elements} (x_a - x_b)^2 for x-predictions (B, K, ...) of two models on the same pairs
    (Eq. 16: for Gaussian policies of equal variance the KL is this squared distance, up to a constant factor)."""
    return (x_a - x_b).pow(2).flatten(1).mean(1).mean()


@dataclass
class Rollouts:
    """One iteration's training batch, B samples in group-major order (shapes in brackets)."""

    x0: torch.Tensor  # (B, ...) final clean latents of the rollouts
    cond: Any  # pytree of batch-first conditioning tensors, (B, ...) each
    advantages: torch.Tensor  # (B,)
    t: torch.Tensor  # (B, K) the pairs drawn for this iteration ...
    eps: torch.Tensor  # (B, K, ...) ... and reused for theta_old and every theta
    s_old: torch.Tensor | None = None  # (B, K) surrogate under theta_old; None: vgrpo_update fills it in
    x_old: torch.Tensor | None = None  # (B, K, ...) x-predictions under theta_old (KL only)

    def __len__(self) -> int:
        return self.x0.shape[0]

    def __getitem__(self, idx: torch.Tensor) -> "Rollouts":
        return Rollouts(**{f.name: _take(getattr(self, f.name), idx) for f in fields(self)})


def vgrpo_update(
    surrogate: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    rollouts: Rollouts,
    *,
    num_grad_steps: int = 1,
    micro_batch_size: int | None = None,
    clip_eps: float | None = None,
    kl_coef: float = 0.0,
    max_grad_norm: float | None = 1.0,
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ref_kl_coef: float = 0.0,
) -> dict[str, float]:
    """Algorithm 1, steps 5 and 6: the old-policy surrogate, then num_grad_steps optimizer steps on one rollout batch.

    surrogate(x0, cond, t, eps) -> (s, x_pred): one callable for theta_old and theta. reference: the same callable
    for the frozen base model (policy_loss's D(x_new, x_ref)); its x-predictions on a micro-batch's stored pairs are
    computed without gradients just before that micro-batch is trained, for every sample when ref_kl_coef > 0, else
    for the first micro-batch only (ref_kl, the drift from the base, is then logged from micro_batch_size samples).
    The B samples are split in order into num_grad_steps mini-batches; each is processed in
    micro-batches of micro_batch_size samples with gradient accumulation (the loss is the
    mini-batch mean). A step whose gradient norm is not finite is skipped (grads dropped, the
    optimizer untouched) and counted in `skipped_steps`. Only the parameters in the optimizer
    are touched, through their .grad, so plain, peft-wrapped and FSDP2-sharded modules all work.

    rollouts.s_old None (recommended): the old-policy pass costs only what it must. The first mini-batch is
    trained before any optimizer step, at theta_old itself, so its s_old (and x_old) is the detached result of
    the same forward; only the samples of later mini-batches get a separate no-grad pass, made before the first
    step. With num_grad_steps = 1 there is no old-policy pass at all. rollouts.s_old (and x_old when kl_coef > 0)
    is filled in place for logging. Given s_old, it is used as is.
    Returns metrics averaged over samples (min/max for ratio_min/ratio_max).
    """
    B = len(rollouts)
    if num_grad_steps < 1 or B % num_grad_steps:
        raise ValueError(f"num_grad_steps={num_grad_steps} must be >= 1 and divide the batch of {B} samples")
    mini = B // num_grad_steps
    micro = micro_batch_size or mini
    if mini % micro:
        raise ValueError(f"micro_batch_size={micro} must divide the mini-batch of {mini} samples "
                         f"({B} samples / {num_grad_steps} gradient steps)")
    fill_old = rollouts.s_old is None
    if fill_old:
        _old_policy_pass(surrogate, rollouts, first=mini, micro=micro, keep_x=kl_coef > 0)
    elif kl_coef > 0 and rollouts.x_old is None:
        raise ValueError("kl_coef > 0 needs rollouts.x_old (keep the x-predictions of the old-policy pass)")
    if ref_kl_coef > 0 and reference is None:
        raise ValueError("ref_kl_coef > 0 needs reference, the surrogate of the frozen base model")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    totals: dict[str, torch.Tensor] = {}
    ref_kls = []
    grad_norms, skipped = [], 0
    for step in range(num_grad_steps):
        optimizer.zero_grad(set_to_none=True)
        for start in range(step * mini, (step + 1) * mini, micro):
            batch = rollouts[torch.arange(start, start + micro, device=rollouts.x0.device)]
            x_ref = None
            if reference is not None and (ref_kl_coef > 0 or start == 0):
                with torch.no_grad():
                    x_ref = reference(batch.x0, batch.cond, batch.t, batch.eps)[1]  # the base, on the same pairs
            # The stored (t, eps) of the old pass: reusing them is what makes rho a ratio.
            s_new, x_new = surrogate(batch.x0, batch.cond, batch.t, batch.eps)
            if fill_old and step == 0:  # still theta_old: the old-policy values are this forward's, detached
                rows = slice(start, start + micro)
                batch.s_old = rollouts.s_old[rows] = s_new.detach()
                if kl_coef > 0:
                    batch.x_old = rollouts.x_old[rows] = x_new.detach()
            loss, metrics = policy_loss(s_new, batch.s_old, batch.advantages, clip_eps=clip_eps, kl_coef=kl_coef,
                                        x_new=x_new, x_old=batch.x_old, ref_kl_coef=ref_kl_coef, x_ref=x_ref)
            (loss * (micro / mini)).backward()
            if "ref_kl" in metrics:
                ref_kls.append(metrics.pop("ref_kl"))
            _accumulate(totals, metrics, weight=micro / B)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2 DTensor
        if torch.isfinite(grad_norm):
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    finite = [g for g in grad_norms if math.isfinite(g)]
    return {
        **{k: v.item() for k, v in totals.items()},
        **({"ref_kl": torch.stack(ref_kls).mean().item()} if ref_kls else {}),  # micro-batches of equal size
        "grad_norm": sum(finite) / len(finite) if finite else math.nan,
        "skipped_steps": float(skipped),
    }


@torch.no_grad()
def _old_policy_pass(surrogate, rollouts: Rollouts, *, first: int, micro: int, keep_x: bool) -> None:
    """Allocate rollouts.s_old (and x_old) and fill rows first.. with theta_old's surrogate, micro rows per call;
    rows :first are left for the first gradient pass to fill."""
    B, K = rollouts.t.shape
    like = dict(device=rollouts.x0.device, dtype=torch.promote_types(rollouts.x0.dtype, torch.float32))  # as s, x_pred
    rollouts.s_old = torch.empty(B, K, **like)
    rollouts.x_old = torch.empty(B, K, *rollouts.x0.shape[1:], **like) if keep_x else None
    for start in range(first, B, micro):
        rows = slice(start, start + micro)
        batch = rollouts[torch.arange(start, start + micro, device=rollouts.x0.device)]
        s, x = surrogate(batch.x0, batch.cond, batch.t, batch.eps)  # the stored (t, eps), as for theta
        rollouts.s_old[rows] = s
        if keep_x:
            rollouts.x_old[rows] = x


def _accumulate(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], *, weight: float) -> None:
    """Running sample-weighted mean of metrics; running min/max for keys ending _min/_max."""
    for k, v in metrics.items():
        if k not in totals:
            totals[k] = v if k.endswith(("_min", "_max")) else v * weight
        elif k.endswith("_min"):
            totals[k] = torch.minimum(totals[k], v)
        elif k.endswith("_max"):
            totals[k] = torch.maximum(totals[k], v)
        else:
            totals[k] = totals[k] + v * weight


def _take(tree: Any, idx: torch.Tensor) -> Any:
    """Select rows idx of every batch-first tensor in a pytree of tensors / dicts / lists / tuples."""
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return tree[idx]
    if isinstance(tree, dict):
        return {k: _take(v, idx) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_take(v, idx) for v in tree)
    raise TypeError(f"conditioning must be a tensor or a dict/list/tuple of tensors, got {type(tree).__name__}")


# ----------------------------------------------------------------------------------------------
# Toy problem with a known answer: a 2-D flow model learns to put its samples in the mode that
# the "prompt" (a class id) asks for. Used by `python vgrpo.py`, the tests and bench.py.

TOY_MODES = torch.tensor([[1.5, 1.5], [-1.5, 1.5], [-1.5, -1.5], [1.5, -1.5]])
TOY_MODE_STD = 0.2


class ToyFlow(nn.Module):
    """Velocity MLP v(z_t, t, c) for 2-D points, conditioned on a class id c (the 'prompt')."""

    def __init__(self, num_classes: int = len(TOY_MODES), hidden: int = 128):
        super().__init__()
        self.register_buffer("freqs", torch.arange(1, 9).float() * math.pi)  # Fourier features of t
        self.inp = nn.Linear(2 + 16, hidden)
        self.embed = nn.Embedding(num_classes, hidden)
        self.net = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                 nn.SiLU(), nn.Linear(hidden, 2))

    def forward(self, z: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        tf = t[:, None] * self.freqs
        return self.net(self.inp(torch.cat([z, tf.sin(), tf.cos()], dim=1)) + self.embed(c))


def toy_data(n: int, *, generator: torch.Generator) -> torch.Tensor:
    """n points from the equal-weight mixture of 4 Gaussians at TOY_MODES, shape (n, 2)."""
    mode = torch.randint(len(TOY_MODES), (n,), generator=generator)
    return TOY_MODES[mode] + TOY_MODE_STD * torch.randn(n, 2, generator=generator)


def pretrain_toy_flow(*, steps: int = 1500, batch_size: int = 512, lr: float = 2e-3, seed: int = 0) -> ToyFlow:
    """Fit ToyFlow to the mixture with the rectified-flow loss; the class id is ignored by the
    data, so the pretrained model samples all four modes for every 'prompt'."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = ToyFlow()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        x = toy_data(batch_size, generator=g)
        c = torch.randint(len(TOY_MODES), (batch_size,), generator=g)
        eps, t = torch.randn(x.shape, generator=g), torch.rand(batch_size, generator=g)
        z = (1 - t[:, None]) * x + t[:, None] * eps
        loss = F.mse_loss(model(z, t, c), eps - x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model


def toy_reward(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Higher is better: minus the distance of each point (B, 2) to the mode its prompt c names."""
    return -(x - TOY_MODES[c]).norm(dim=1)


def toy_mode_stats(x: torch.Tensor, c: torch.Tensor) -> tuple[float, float]:
    """(fraction of points whose nearest mode is the one asked for, mean distance to nearest mode)."""
    dist = torch.cdist(x, TOY_MODES)
    return (dist.argmin(1) == c).float().mean().item(), dist.min(1).values.mean().item()


@dataclass
class ToyConfig:
    """V-GRPO hyperparameters for the toy; names as in train.py."""

    iterations: int = 40
    num_prompts: int = 8  # P prompts (class ids) per iteration
    group_size: int = 16  # G samples per prompt
    num_mc: int = 4  # K (t, eps) pairs per sample
    t_min: float = 0.0  # the surrogate's timestep range
    t_max: float = 1.0
    sampling_steps: int = 16
    solver: str = "euler"
    # lr 3e-3 with the x-space KL (bench.py section 8, 10 seeds each): success in 12 iterations against 22 at 1e-3, and
    # at 3e-3 no run diverged with the KL (1 of 10 without); at 1e-2 the KL cut divergence from 3 of 10 to 1 of 10, at
    # no cost in speed at 1e-3 or 3e-3.
    lr: float = 3e-3
    param: str = "x"
    self_normalize: bool = True
    stratified: bool = True
    group_shared: bool = True
    soft_clip_eta: float | None = 3.0
    clip_eps: float | None = 0.01
    kl_coef: float = 0.3  # x-space KL to the behaviour policy: acts from the second gradient step of a batch on
    num_grad_steps: int = 4  # reuse each rollout batch for 4 steps; the ratio clip then acts
    seed: int = 0


def train_toy(model: ToyFlow, cfg: ToyConfig) -> list[dict[str, float]]:
    """Algorithm 1 on the toy; returns one metrics dict per iteration (reward before the update,
    seconds since the start after it)."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    surrogate = partial(elbo_surrogate, model, param=cfg.param, self_normalize=cfg.self_normalize)
    timesteps = flow_timesteps(cfg.sampling_steps)
    history = []
    for _ in range(cfg.iterations):
        P, G = cfg.num_prompts, cfg.group_size
        c = torch.randint(len(TOY_MODES), (P,), generator=g).repeat_interleave(G)  # (B,) group-major
        x0 = sample_ode(model, torch.randn(P * G, 2, generator=g), c, timesteps, solver=cfg.solver)
        t, eps = draw_mc_pairs(P, G, cfg.num_mc, (2,), generator=g, t_min=cfg.t_min, t_max=cfg.t_max,
                               stratified=cfg.stratified, group_shared=cfg.group_shared)
        rewards = toy_reward(x0, c)
        adv = soft_clip(group_advantages(rewards.view(P, G)), eta=cfg.soft_clip_eta).flatten()
        rollouts = Rollouts(x0, c, adv, t, eps)  # the same (t, eps) score theta_old and theta
        metrics = vgrpo_update(surrogate, optimizer, rollouts, num_grad_steps=cfg.num_grad_steps, clip_eps=cfg.clip_eps,
                               kl_coef=cfg.kl_coef)
        frac, dist = toy_mode_stats(x0, c)
        history.append({"reward_mean": rewards.mean().item(), "frac_target_mode": frac, "mode_dist": dist,
                        **surrogate_cv(rollouts.s_old.mean(1).view(P, G)), **metrics, "seconds": time.perf_counter() - start})
    return history


def main() -> None:
    model = pretrain_toy_flow()
    history = train_toy(model, ToyConfig())
    print("iter  reward_mean  frac_target_mode  mode_dist  cv_within")
    for i, h in enumerate(history):
        print(f"{i:4d}  {h['reward_mean']:11.3f}  {h['frac_target_mode']:16.3f}  {h['mode_dist']:9.3f}"
              f"  {h['cv_within']:9.3f}")


if __name__ == "__main__":
    main()
