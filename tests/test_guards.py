"""Tests of guards.py: divergence stops a run with its last good checkpoint; the reference KL's base model, the EMA
and the hacking rule.
"""

import json
import math
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import guards
import models
import rewards
import train
import vgrpo
from helpers import ROOT, SMALL_RUN, lora_weights, one_line_stop, read_metrics, run_train


def test_nonfinite_rewards_stop_the_run_with_an_error_and_keep_the_last_good_checkpoint(tiny_dirs, tmp_path,
                                                                                        monkeypatch, capsys):
    """Iteration 1's rewards are NaN: the run stops with one line and a non-zero exit, saves nothing from it, exports
    nothing, and checkpoints/latest is still iteration 0 (before: every step was skipped, NaN metrics, exit 0)."""
    calls = []

    def load_reward(name, **options):
        def nan_after_first(images, prompts, metadata=None):
            calls.append(len(prompts))
            scores = rewards.REWARDS["color"]()(images, prompts, metadata)
            return scores if len(calls) == 1 else scores * float("nan")
        return nan_after_first

    monkeypatch.setattr(rewards, "load_reward", load_reward)
    message = one_line_stop(train.main, ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
                                         "--run_dir", tmp_path, *SMALL_RUN, "--iterations", "5", "--eval_every", "0",
                                         "--save_every", "1"], capsys, code=1)
    assert message.startswith("error: training diverged at iteration 1: the rewards are not finite")
    assert "checkpoint iter-000000 is kept" in message
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter-000000" and not (tmp_path / "final").exists()


def test_divergence_counts_consecutive_skipped_steps(monkeypatch):
    cfg = train.Config(max_skipped_steps=3)
    layer = torch.nn.Linear(2, 2)
    ok = partial(guards.divergence, torch.zeros(2), {"color": torch.zeros(2)}, transformer=layer, cfg=cfg,
                 device=torch.device("cpu"))
    assert ok(skipped_run=2) == "" and "3 consecutive gradient steps were skipped" in ok(skipped_run=3)
    # one reward of several going NaN (an HTTP reward next to pickscore) is enough
    nan_beside = guards.divergence(torch.zeros(2), {"color": torch.zeros(2), "http": torch.tensor([0.0, math.nan])}, 0,
                                   layer, cfg, torch.device("cpu"))
    assert nan_beside == "the rewards are not finite"
    # skips scattered over iterations of 2 gradient steps are not a run of skips; whole iterations skipped are
    run = 0
    for skipped in (1, 1, 1, 1, 1, 1):
        run = guards.consecutive_skips(run, skipped, num_grad_steps=2)
        assert run == 0
    for skipped, expected in ((2, 2), (2, 4), (1, 0), (2, 2)):
        run = guards.consecutive_skips(run, skipped, num_grad_steps=2)
        assert run == expected
    with torch.no_grad():
        layer.weight[0, 0] = float("inf")
    assert ok(skipped_run=0) == "the trainable weights are not finite"


def tiny_lora_model(tiny_dirs, **settings):
    cfg = train.Config(model=str(tiny_dirs / "sd3"), **settings)
    model = models.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    return cfg, model


def test_reference_is_the_base_model_exactly_and_its_kl_is_zero_before_the_first_step(tiny_dirs):
    """Under LoRA the reference is the trained transformer with its adapters off: its velocity equals the base
    model's exactly; switched back on, the LoRA trains again. ref_kl is exactly 0 before any step (LoRA's B starts at
    0) and, after one, the x-space distance of the two models' predictions on the same pairs, computed by hand."""
    cfg, model = tiny_lora_model(tiny_dirs)
    g = torch.Generator().manual_seed(0)
    cond = {k: v.repeat_interleave(4, 0) for k, v in model.encode(["a red car", "a blue flower"]).items()}
    x0, z, t = torch.randn(8, *model.latent_shape(), generator=g), torch.randn(8, *model.latent_shape(), generator=g), torch.rand(8, generator=g)
    with torch.no_grad():
        v_base = model.velocity(z, t, cond)
    models.make_trainable(model.transformer, cfg)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:  # a trained adapter: not the identity
                p.normal_(0, 0.05, generator=g)
        v_lora = model.velocity(z, t, cond)
        base_velocity = guards.frozen_base_velocity(model, None, lora=True)
        assert torch.equal(base_velocity(z, t, cond), v_base) and not torch.equal(v_lora, v_base)
        assert torch.equal(model.velocity(z, t, cond), v_lora)  # adapters back on
    trainable = [p for p in model.transformer.parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n, p in model.transformer.named_parameters() if p.requires_grad)
    # the update: ref_kl at 0 before any step of a fresh adapter, then the hand-computed drift
    cfg, model = tiny_lora_model(tiny_dirs)
    models.make_trainable(model.transformer, cfg)
    optimizer = torch.optim.AdamW([p for p in model.transformer.parameters() if p.requires_grad], lr=1e-2)
    surrogate = partial(vgrpo.elbo_surrogate, model.velocity)
    reference = partial(vgrpo.elbo_surrogate, guards.frozen_base_velocity(model, None, lora=True))
    t_pairs, eps = vgrpo.draw_mc_pairs(2, 4, 2, x0.shape[1:], generator=g)
    adv = torch.randn(8, generator=g)
    first = vgrpo.vgrpo_update(surrogate, optimizer, vgrpo.Rollouts(x0, cond, adv, t_pairs, eps), micro_batch_size=4,
                               reference=reference, ref_kl_coef=0.5)
    assert first["ref_kl"] == 0.0
    with torch.no_grad():  # by hand, after that step: both models' x-predictions on the first micro-batch's pairs
        x_new = surrogate(x0[:4], {k: v[:4] for k, v in cond.items()}, t_pairs[:4], eps[:4])[1]
        x_ref = reference(x0[:4], {k: v[:4] for k, v in cond.items()}, t_pairs[:4], eps[:4])[1]
    expected = ((x_new - x_ref) ** 2).flatten(1).mean(1).mean().item()
    second = vgrpo.vgrpo_update(surrogate, optimizer, vgrpo.Rollouts(x0, cond, adv, t_pairs, eps), micro_batch_size=4,
                                reference=reference)  # at weight 0: logged from the first micro-batch, before its step
    assert expected > 0 and second["ref_kl"] == pytest.approx(expected, rel=1e-5)


def test_ema_after_n_iterations_is_the_closed_form_and_swaps_in_and_back():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3, 4, generator=g) for _ in range(6)]  # w_0 (the start) .. w_5
    param = weights[0].clone()
    ema = [param.clone()]
    for w in weights[1:]:
        param.copy_(w)
        guards.ema_update(ema, [param], 0.8)
    n = len(weights) - 1
    closed = 0.8 ** n * weights[0] + sum(0.2 * 0.8 ** (n - k) * weights[k] for k in range(1, n + 1))
    torch.testing.assert_close(ema[0], closed, rtol=1e-6, atol=1e-7)
    before, ema_before = param.clone(), ema[0].clone()
    with guards.swapped_weights([param], ema):  # evaluation / export with the EMA, then the trained weights back
        assert torch.equal(param, ema_before)
    assert torch.equal(param, before) and torch.equal(ema[0], ema_before)


def ema_state(run_dir, tiny_dirs):
    """The EMA tensors of a run's last checkpoint, read back through load_checkpoint."""
    cfg = train.parse_config(["--resume", str(run_dir)])
    model = models.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    models.make_trainable(model.transformer, cfg)
    named = [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad]
    ema = {n: torch.zeros_like(p) for n, p in named}
    checkpoint.load_checkpoint(Path(run_dir), model.transformer, torch.optim.AdamW([p for _, p in named]), 0, ema=ema)
    return ema, dict(named)


def test_ema_resumes_bit_identically_after_kill_9_and_the_export_says_it_holds_the_ema(tiny_dirs, tmp_path):
    common = ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--iterations", "4",
              "--ema_decay", "0.5", "--export_ema", "--save_every", "1", "--eval_every", "0"]
    run_train(*common, "--run_dir", tmp_path / "straight")
    cmd = [sys.executable, str(ROOT / "train.py"), *map(str, common), "--run_dir", str(tmp_path / "killed")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest, deadline = tmp_path / "killed" / "checkpoints" / "latest", time.time() + 300
    while not (latest.is_file() and latest.read_text() in ("iter-000001", "iter-000002")):
        assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before it could be killed"
        time.sleep(0.02)
    proc.kill()  # SIGKILL: nothing runs after it
    proc.wait()
    run_train("--resume", tmp_path / "killed")
    ema_straight, trained = ema_state(tmp_path / "straight", tiny_dirs)
    ema_resumed, _ = ema_state(tmp_path / "killed", tiny_dirs)
    for name, tensor in ema_straight.items():
        assert torch.equal(ema_resumed[name], tensor), name
    assert json.loads((tmp_path / "straight" / "final" / "export.json").read_text())["weights"] == "ema"
    exported = lora_weights(tmp_path / "straight")
    for name, tensor in ema_straight.items():  # peft "x.lora_A.default.weight" is "transformer.x.lora_A.weight"
        key = "transformer." + name.replace(".default", "")
        assert torch.equal(exported[key], tensor), key
    assert any(not torch.equal(ema_straight[n], trained[n]) for n in ema_straight)  # the EMA is not the weights


def evals_history(reward, monitor, *, std=0.05):
    return [{"iteration": 10 * i, "eval/reward_mean": r, "eval/color_mean": r, "eval/color_std": std,
             "eval/aesthetic_mean": m, "eval/aesthetic_std": std} for i, (r, m) in enumerate(zip(reward, monitor))]


def test_hacking_rule_fires_on_a_rising_reward_with_a_falling_monitor_and_not_on_noise():
    rise, fall = [0.50, 0.52, 0.55, 0.58, 0.61], [0.60, 0.59, 0.57, 0.54, 0.52]
    fired = guards.hacking(evals_history(rise, fall), ["aesthetic"], window=3, z=3.0, samples=128)
    assert "the monitored aesthetic fell from 0.59 to 0.52" in fired and "iterations 10 -> 40" in fired
    assert not guards.hacking(evals_history(rise, fall[::-1]), ["aesthetic"], window=3, z=3.0, samples=128)  # both rise
    assert not guards.hacking(evals_history(rise[::-1], fall), ["aesthetic"], window=3, z=3.0, samples=128)  # both fall
    assert not guards.hacking(evals_history(rise[:3], fall[:3]), ["aesthetic"], window=3, z=3.0, samples=128)  # too short
    # noise: means of 128 samples of std 0.05 around constant values fire in well under 1% of windows at z = 3
    rng = np.random.default_rng(0)
    noise = lambda: list(0.5 + rng.normal(0, 0.05 / math.sqrt(128), 5))  # noqa: E731
    fires = sum(bool(guards.hacking(evals_history(noise(), noise()), ["aesthetic"], window=3, z=3.0, samples=128))
                for _ in range(2000))
    assert fires <= 10, fires  # expected about 2000 x 0.5 x 0.00135 = 1.4
    assert guards.x0_drift(1.6, 1.0, 0.5) and not guards.x0_drift(1.4, 1.0, 0.5) and not guards.x0_drift(9.0, 1.0, 0.0)



def test_the_drift_bound_is_relative_both_ways_and_fires_only_beyond_it_and_a_flat_reward_is_no_hack():
    """x0_drift: images drifting darker (latent RMS down) as well as brighter; exactly at the bound is not beyond it.
    The hacking rule wants the trained reward to rise: flat while a monitor falls is not a hack."""
    assert guards.x0_drift(0.4, 1.0, 0.5) and not guards.x0_drift(0.6, 1.0, 0.5)  # 60% and 40% down
    assert not guards.x0_drift(1.5, 1.0, 0.5) and not guards.x0_drift(0.5, 1.0, 0.5)  # exactly 50%: not beyond
    assert "moved from 1 to 1.6, beyond --max_x0_drift 0.5" in guards.x0_drift(1.6, 1.0, 0.5)
    flat, fall = [0.55] * 5, [0.60, 0.59, 0.57, 0.54, 0.52]
    assert not guards.hacking(evals_history(flat, fall), ["aesthetic"], window=3, z=3.0, samples=128)

def test_monitored_rewards_are_evaluated_not_trained_and_the_rule_warns(tiny_dirs, tmp_path, capsys):
    """A monitor is scored on the evaluation samples only: eval/jpeg_compressibility_mean appears, the training
    metrics have no reward/jpeg_compressibility; the reference KL is logged (weight 0 here) with its NFE."""
    run_dir = tmp_path / "monitored"
    train.main([str(a) for a in ("--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN,
                                 "--monitor_rewards", "jpeg_compressibility", "--max_x0_drift", "1e-9", "--run_dir", run_dir)])
    out = capsys.readouterr().out
    metrics = read_metrics(run_dir)
    assert "eval/jpeg_compressibility_mean" in metrics[0] and "reward/jpeg_compressibility_mean" not in metrics[0]
    assert metrics[0]["ref_kl"] == 0.0 and metrics[1]["ref_kl"] > 0 and metrics[0]["nfe_ref"] == pytest.approx(8 * 4 / 8)
    assert "warning: possible reward hacking at iteration 1: the rollouts' latent RMS moved" in out
