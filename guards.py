"""guards.py: what watches a training run and stops it (or warns) when it goes wrong.

- divergence: non-finite rollouts, rewards or trainable weights on any rank, or too many consecutive skipped
  gradient steps, stop every rank before anything of the iteration is saved (the last checkpoint stays good).

Against reward hacking, beyond the paper (off by default; docs/training.md, "Reward hacking"):
- the reference KL's base model (frozen_base_velocity): the x-space KL of vgrpo.policy_loss(ref_kl_coef=...) against
  the frozen base model, under LoRA the same transformer with its adapters switched off;
- an EMA of the trainable weights, evaluated (--eval_with_ema) or exported (--export_ema) in place of them;
- the hacking rule: at each evaluation, the trained reward rising while a monitored one falls by more than z standard
  errors (or the rollouts' latent RMS drifting), which warns or stops the run.
"""

import contextlib
import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist

import adapters
import parallel
import runs
from failures import RunStopped

# ----------------------------------------------------------------------------------------------
# The frozen base model of the reference KL


def frozen_base_velocity(model: adapters.FlowAdapter, frozen_copy, lora: bool):
    """The base model's velocity for the reference KL: under LoRA the trained transformer with its adapters
    switched off for the call (exactly the base; no second copy), under full fine-tuning the frozen copy's; None
    without one (full fine-tuning at ref_kl_coef 0: a copy only to log ref_kl would double the weights)."""
    if lora:
        def velocity(*args):
            model.transformer.disable_adapters()
            try:
                return model.velocity(*args)
            finally:
                model.transformer.enable_adapters()  # also makes the LoRA weights require grad again
        return velocity
    if frozen_copy is None:
        return None
    base = copy.copy(model)
    base.transformer = frozen_copy
    return base.velocity


# ----------------------------------------------------------------------------------------------
# EMA of the trainable weights


@torch.no_grad()
def ema_update(ema: list[torch.Tensor], params: list[torch.Tensor], decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * param, once per iteration, in float32 (the trainable weights' dtype)."""
    for e, p in zip(ema, params):
        e.lerp_(p.detach(), 1 - decay)


@contextlib.contextmanager
def swapped_weights(params: list[torch.Tensor], others: list[torch.Tensor]):
    """Other weights (the EMA's, for an evaluation or the export) in place of the trained ones inside the block,
    swapped back after; one tensor of temporary memory at a time."""
    def swap():
        with torch.no_grad():
            for p, o in zip(params, others):
                kept = p.detach().clone()
                p.copy_(o)
                o.copy_(kept)
    swap()
    try:
        yield
    finally:
        swap()


# ----------------------------------------------------------------------------------------------
# The hacking rule: warn (or stop) when the trained reward rises while a monitored one falls


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


# ----------------------------------------------------------------------------------------------
# Divergence: stop before anything of the iteration is saved


def consecutive_skips(run: int, skipped: int, num_grad_steps: int) -> int:
    """Gradient steps skipped in a row, counted over iterations: an iteration that skipped all its steps adds them,
    one that took any step ends the run of skips (scattered skips are rounding, not divergence)."""
    return run + skipped if skipped == num_grad_steps else 0


def divergence(x0: torch.Tensor, scores: dict, skipped_run: int, transformer, cfg, device) -> str:
    """Why the run must stop, '' if it need not: non-finite rollouts, rewards or trainable weights on any rank, or
    max_skipped_steps consecutive skipped gradient steps. Every rank gets the same answer."""
    checks = {
        "the rollouts are not finite": not torch.isfinite(x0).all(),
        "the rewards are not finite": not all(torch.isfinite(s).all() for s in scores.values()),
        "the trainable weights are not finite": not all(torch.isfinite(p.detach().to_local() if hasattr(p, "to_local")
                                                                       else p.detach()).all()
                                                        for p in transformer.parameters() if p.requires_grad),
        f"{skipped_run} consecutive gradient steps were skipped as non-finite": skipped_run >= cfg.max_skipped_steps,
    }
    flags = parallel.reduce_metrics({f"{i}_max": float(bad) for i, bad in enumerate(checks.values())}, device)
    return "; ".join(reason for i, reason in enumerate(checks) if flags[f"{i}_max"] > 0)


def stop_run(run_dir: Path, what: str, advice: str) -> None:
    """Stop every rank with one line from rank 0 before anything of this iteration is saved: the last checkpoint
    stays the one a continued run starts from."""
    latest = run_dir / "checkpoints" / "latest"
    kept = f"checkpoint {latest.read_text()} is kept" if latest.is_file() else "no checkpoint was written"
    if dist.is_initialized():
        parallel.barrier()
        dist.destroy_process_group()
    raise RunStopped(f"{what}. Nothing was saved from it; {kept}. {advice}")


# ----------------------------------------------------------------------------------------------
# The watch: what train() asks after every iteration


class Watch:
    """What watches a run across iterations: the run of consecutive skipped gradient steps (divergence), the
    evaluations and the first rollouts' latent RMS (the hacking rule). A continued run reads its earlier iterations
    from metrics.jsonl, so it watches as the straight run would have."""

    def __init__(self, cfg, run_dir: Path, start: int, monitored: list[str], samples: int):
        earlier = [m for m in runs.read_metrics(run_dir) if m["iteration"] < start] if start else []
        self.cfg, self.run_dir, self.monitored, self.samples = cfg, run_dir, monitored, samples
        self.evals = [m for m in earlier if "eval/reward_mean" in m]
        self.first_x0_rms = next((m["x0_rms"] for m in earlier if "x0_rms" in m), None)
        self.skipped_run = 0

    def check(self, it: int, x0: torch.Tensor, scores: dict, update: dict, metrics: dict, transformer, device) -> str:
        """Stops every rank (RunStopped, the last checkpoint kept) when iteration `it` diverged or, with
        stop_on_hacking, looks like reward hacking; returns a warning to print ('' if none) otherwise."""
        cfg = self.cfg
        self.skipped_run = consecutive_skips(self.skipped_run, int(update["skipped_steps"]), cfg.num_grad_steps)
        reason = divergence(x0, scores, self.skipped_run, transformer, cfg, device)
        if reason:
            stop_run(self.run_dir, f"training diverged at iteration {it}: {reason}", "Lower --lr or --max_grad_norm, or "
                     f"raise --num_mc: --resume {self.run_dir} with them continues from that checkpoint, --fresh starts over")
        self.first_x0_rms = self.first_x0_rms or metrics["x0_rms"]
        hacked = ""
        if "eval/reward_mean" in metrics:
            self.evals.append({"iteration": it, **metrics})
            hacked = hacking(self.evals, self.monitored, window=cfg.hacking_window, z=cfg.hacking_z, samples=self.samples)
        hacked = hacked or x0_drift(metrics["x0_rms"], self.first_x0_rms, cfg.max_x0_drift)
        if hacked and cfg.stop_on_hacking:
            stop_run(self.run_dir, f"possible reward hacking at iteration {it}: {hacked}", "Inspect the sample grids; "
                     "raise --ref_kl_coef or lower --lr, or --resume without --stop_on_hacking to go on")
        return f"warning: possible reward hacking at iteration {it}: {hacked} (--stop_on_hacking stops here)" if hacked else ""
