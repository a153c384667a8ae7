"""Tests for V-GRPO. CPU only, offline: `python -m pytest -q`.

Every check compares against an independent reference (a NumPy loop, finite differences, a
closed form, a statistical test or a second code path) or asserts a behaviour that a broken
implementation would not show.
"""

import base64
import collections
import contextlib
import copy
import functools
import hashlib
import io
import json
import math
import os
import pickle
import re
import shlex
import subprocess
import types
import sys
import urllib.error
import urllib.request
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import vgrpo

ROOT = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# Helpers


class LinearVelocity(nn.Module):
    """v(z, t, c) = A z + t b + c w on flattened samples: the surrogate has a closed form."""

    def __init__(self, dim: int, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.A = nn.Parameter(0.3 * torch.randn(dim, dim, generator=g, dtype=dtype))
        self.b = nn.Parameter(torch.randn(dim, generator=g, dtype=dtype))
        self.w = nn.Parameter(torch.randn(dim, generator=g, dtype=dtype))

    def forward(self, z, t, c):
        flat = z.flatten(1) @ self.A.T + t[:, None] * self.b + c[:, None] * self.w
        return flat.view_as(z)


def reference_surrogate(model, x0, c, t, eps, *, param, self_normalize, floor=1e-5, denominators=None):
    """Plain NumPy loop over samples and pairs. denominators: freeze the self-normalisation."""
    A, b, w = (p.detach().numpy() for p in (model.A, model.b, model.w))
    B, K = t.shape
    s, dens = np.zeros((B, K)), np.zeros((B, K))
    for i in range(B):
        x = x0[i].numpy().ravel()
        for j in range(K):
            tt, e = t[i, j].item(), eps[i, j].numpy().ravel()
            z = (1 - tt) * x + tt * e
            v = A @ z + tt * b + c[i].item() * w
            err = {"x": z - tt * v - x, "v": v - (e - x), "eps": z + (1 - tt) * v - e}[param]
            dens[i, j] = max(np.abs(err).mean(), floor) if denominators is None else denominators[i, j]
            s[i, j] = -np.mean(err**2) / (dens[i, j] if self_normalize else 1.0)
    return s, dens


def linear_problem(B=3, K=4, shape=(2, 3)):
    g = torch.Generator().manual_seed(1)
    model = LinearVelocity(int(np.prod(shape)))
    x0 = torch.randn(B, *shape, generator=g, dtype=torch.float64)
    c = torch.randn(B, generator=g, dtype=torch.float64)
    t = torch.rand(B, K, generator=g, dtype=torch.float64)
    eps = torch.randn(B, K, *shape, generator=g, dtype=torch.float64)
    return model, x0, c, t, eps


@pytest.fixture(scope="module")
def toy_model():
    return vgrpo.pretrain_toy_flow()


def toy_rollouts(model, *, P=4, G=8, K=4, seed=0, clip=None):
    """A rollout batch from the toy model with old-policy surrogates, as Algorithm 1 builds it."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(4, (P,), generator=g).repeat_interleave(G)
    x0 = vgrpo.sample_ode(model, torch.randn(P * G, 2, generator=g), c, vgrpo.flow_timesteps(8))
    t, eps = vgrpo.draw_mc_pairs(P, G, K, (2,), generator=g)
    adv = vgrpo.group_advantages(vgrpo.toy_reward(x0, c).view(P, G)).flatten()
    surrogate = partial(vgrpo.elbo_surrogate, model)
    with torch.no_grad():
        s_old, x_old = surrogate(x0, c, t, eps)
    return surrogate, vgrpo.Rollouts(x0, c, adv, t, eps, s_old, x_old)


# ----------------------------------------------------------------------------------------------
# The surrogate


@pytest.mark.parametrize("param", vgrpo.PARAMETERISATIONS)
@pytest.mark.parametrize("self_normalize", [True, False])
def test_surrogate_matches_closed_form_on_linear_velocity(param, self_normalize):
    model, x0, c, t, eps = linear_problem()
    s, x_pred = vgrpo.elbo_surrogate(model, x0, c, t, eps, param=param, self_normalize=self_normalize)
    ref, _ = reference_surrogate(model, x0, c, t, eps, param=param, self_normalize=self_normalize)
    assert s.shape == t.shape and x_pred.shape == eps.shape
    np.testing.assert_allclose(s.detach().numpy(), ref, rtol=1e-10)
    # The returned x-prediction is x_theta = z_t - t v whatever the loss parameterisation.
    z = (1 - t[..., None, None]) * x0[:, None] + t[..., None, None] * eps
    v = model(z.flatten(0, 1), t.flatten(), c.repeat_interleave(t.shape[1])).view_as(z)
    torch.testing.assert_close(x_pred, z - t[..., None, None] * v)


@pytest.mark.parametrize("param", vgrpo.PARAMETERISATIONS)
@pytest.mark.parametrize("self_normalize", [True, False])
def test_surrogate_gradient_matches_finite_differences(param, self_normalize):
    """The self-normalising denominator is a stop-gradient: it is frozen in the reference."""
    model, x0, c, t, eps = linear_problem()
    weights = np.random.default_rng(0).normal(size=t.shape)
    s, _ = vgrpo.elbo_surrogate(model, x0, c, t, eps, param=param, self_normalize=self_normalize)
    (s * torch.from_numpy(weights)).sum().backward()
    _, dens = reference_surrogate(model, x0, c, t, eps, param=param, self_normalize=self_normalize)
    h = 1e-6
    for p in model.parameters():
        fd = np.zeros(p.numel())
        for k in range(p.numel()):
            values = []
            for sign in (1, -1):
                with torch.no_grad():
                    p.view(-1)[k] += sign * h
                ref, _ = reference_surrogate(model, x0, c, t, eps, param=param,
                                             self_normalize=self_normalize, denominators=dens)
                values.append((ref * weights).sum())
                with torch.no_grad():
                    p.view(-1)[k] -= sign * h
            fd[k] = (values[0] - values[1]) / (2 * h)
        np.testing.assert_allclose(p.grad.view(-1).numpy(), fd, rtol=1e-6, atol=1e-8)


def test_surrogate_chunking_and_dict_conditioning_give_identical_values():
    model, x0, c, t, eps = linear_problem(B=5, K=3)
    velocity = lambda z, tt, cond: model(z, tt, cond["scale"][:, 0])  # noqa: E731
    cond = {"scale": torch.stack([c, 2 * c], dim=1)}  # a (B, 2) tensor inside a dict
    full, xf = vgrpo.elbo_surrogate(velocity, x0, cond, t, eps)
    for chunk in (1, 4, 7):
        part, xp = vgrpo.elbo_surrogate(velocity, x0, cond, t, eps, chunk_size=chunk)
        # float64; only the matmul's batch-size-dependent rounding may differ
        torch.testing.assert_close(part, full, rtol=1e-14, atol=0)
        torch.testing.assert_close(xp, xf, rtol=1e-14, atol=1e-15)


def test_surrogate_is_float32_for_a_bf16_model():
    model = LinearVelocity(6, dtype=torch.bfloat16)
    seen = []

    def velocity(z, t, c):
        seen.append(z.dtype)
        return model(z.bfloat16(), t.bfloat16(), c.bfloat16())

    _, x0, c, t, eps = linear_problem()
    s, x_pred = vgrpo.elbo_surrogate(velocity, x0.bfloat16(), c, t.float(), eps.bfloat16())
    assert seen == [torch.float32] and s.dtype == torch.float32 and x_pred.dtype == torch.float32


def test_surrogate_rejects_mismatched_shapes_and_unknown_parameterisation():
    model, x0, c, t, eps = linear_problem()
    with pytest.raises(ValueError, match="expected t"):
        vgrpo.elbo_surrogate(model, x0, c, t, eps[:, :2])
    with pytest.raises(ValueError, match="param must be one of"):
        vgrpo.elbo_surrogate(model, x0, c, t, eps, param="score")


# ----------------------------------------------------------------------------------------------
# Policy loss: on-policy behaviour, clipping, KL


def test_ratio_is_one_before_any_update_and_gradient_is_reinforce(toy_model):
    model = copy.deepcopy(toy_model)
    surrogate, ro = toy_rollouts(model)
    s_new, x_new = surrogate(ro.x0, ro.cond, ro.t, ro.eps)
    loss, m = vgrpo.policy_loss(s_new, ro.s_old, ro.advantages, clip_eps=0.01, kl_coef=0.3,
                                x_new=x_new, x_old=ro.x_old)
    assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0
    assert m["kl"].item() == 0.0 and m["approx_kl"].item() == 0.0 and m["clipfrac"].item() == 0.0
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    # REINFORCE with the group baseline: -mean_i A_i grad s_i, with s_i = mean_K s_ij.
    reinforce = torch.autograd.grad(-(ro.advantages * s_new.mean(1)).mean(), params, retain_graph=True)
    kl = (x_new - ro.x_old).pow(2).flatten(1).mean(1).mean()
    kl_grads = torch.autograd.grad(kl, params)
    for g, r, k in zip(grads, reinforce, kl_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-9)
        assert k.abs().max().item() == 0.0


def test_clipping_zeroes_gradient_only_where_the_advantage_sign_makes_it_irrelevant():
    B, K, clip = 6, 3, 0.1
    # (advantage, target ratio): the first two lie outside the trust region on the side where
    # PPO stops the gradient; the rest keep the unclipped gradient -A rho / (B K) per pair.
    cases = [(1.0, 1.3), (-1.0, 0.7), (1.0, 0.7), (-1.0, 1.3), (0.5, 1.05), (-2.0, 0.95)]
    adv = torch.tensor([a for a, _ in cases], dtype=torch.float64)
    rho = torch.tensor([r for _, r in cases], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    s_old = torch.randn(B, K, dtype=torch.float64, generator=g)
    wobble = torch.randn(B, K, dtype=torch.float64, generator=g)
    wobble -= wobble.mean(1, keepdim=True)  # per-pair differences that average out: rho = exp(mean_K)
    s_new = (s_old + rho.log()[:, None] + wobble).requires_grad_()
    loss, m = vgrpo.policy_loss(s_new, s_old, adv, clip_eps=clip)
    loss.backward()
    expected = (-adv * rho / (B * K))[:, None].expand(B, K).clone()
    expected[:2] = 0
    torch.testing.assert_close(s_new.grad, expected)
    assert m["clipfrac"].item() == pytest.approx(4 / 6)
    # clip_eps=None: every sample keeps the plain policy-gradient term.
    s_new.grad = None
    vgrpo.policy_loss(s_new, s_old, adv, clip_eps=None)[0].backward()
    torch.testing.assert_close(s_new.grad, (-adv * rho / (B * K))[:, None].expand(B, K))


def test_kl_term_matches_closed_form_and_requires_predictions():
    g = torch.Generator().manual_seed(0)
    x_new, x_old = torch.randn(4, 2, 3, generator=g), torch.randn(4, 2, 3, generator=g)
    s = torch.zeros(4, 2)
    loss, m = vgrpo.policy_loss(s, s, torch.zeros(4), kl_coef=0.3, x_new=x_new, x_old=x_old)
    expected = np.mean([((x_new[i] - x_old[i]) ** 2).mean().item() for i in range(4)])
    assert m["kl"].item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx(0.3 * expected, rel=1e-6)
    with pytest.raises(ValueError, match="needs x_new and x_old"):
        vgrpo.policy_loss(s, s, torch.zeros(4), kl_coef=0.3)


# ----------------------------------------------------------------------------------------------
# Monte-Carlo pairs


def test_pairs_are_shared_inside_a_group_and_differ_across_groups():
    P, G, K = 3, 4, 5
    t, eps = vgrpo.draw_mc_pairs(P, G, K, (2, 3), generator=torch.Generator().manual_seed(0))
    assert t.shape == (P * G, K) and eps.shape == (P * G, K, 2, 3)
    t, eps = t.view(P, G, K), eps.view(P, G, K, 2, 3)
    assert (t == t[:, :1]).all() and (eps == eps[:, :1]).all()
    assert not torch.isclose(t[0, 0], t[1, 0]).any() and not torch.isclose(eps[0, 0], eps[1, 0]).any()
    t, eps = vgrpo.draw_mc_pairs(P, G, K, (2, 3), generator=torch.Generator().manual_seed(0), group_shared=False)
    t = t.view(P, G, K)
    assert not torch.isclose(t[:, 0], t[:, 1]).any()


@pytest.mark.parametrize("t_min,t_max", [(0.0, 1.0), (0.2, 0.9)])
def test_stratified_pairs_have_exactly_one_timestep_per_stratum(t_min, t_max):
    K = 6
    t, _ = vgrpo.draw_mc_pairs(50, 2, K, (1,), generator=torch.Generator().manual_seed(0), t_min=t_min, t_max=t_max)
    stratum = ((t - t_min) / (t_max - t_min) * K).floor()
    assert (stratum == torch.arange(K)).all()


@pytest.mark.parametrize("stratified", [True, False])
def test_timestep_marginal_is_uniform(stratified):
    """Kolmogorov-Smirnov against U(0.1, 0.8); 1.63 / sqrt(n) is the 1% critical value."""
    t, _ = vgrpo.draw_mc_pairs(5000, 1, 4, (1,), generator=torch.Generator().manual_seed(0),
                               t_min=0.1, t_max=0.8, stratified=stratified)
    x = np.sort((t.flatten().numpy() - 0.1) / 0.7)
    n = len(x)
    ks = max((np.arange(1, n + 1) / n - x).max(), (x - np.arange(n) / n).max())
    assert ks < 1.63 / np.sqrt(n)


def test_same_generator_seed_gives_same_pairs_and_rejects_bad_ranges():
    a = vgrpo.draw_mc_pairs(2, 3, 4, (5,), generator=torch.Generator().manual_seed(7))
    b = vgrpo.draw_mc_pairs(2, 3, 4, (5,), generator=torch.Generator().manual_seed(7))
    c = vgrpo.draw_mc_pairs(2, 3, 4, (5,), generator=torch.Generator().manual_seed(8))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="t_min < t_max"):
        vgrpo.draw_mc_pairs(2, 3, 4, (5,), generator=torch.Generator(), t_min=0.5, t_max=0.5)


# ----------------------------------------------------------------------------------------------
# Advantages


def test_group_advantages_are_standardised_per_group_and_zero_for_constant_groups():
    rewards = torch.tensor([[1.0, 2.0, 4.0, 7.0], [0.1, 0.1, 0.1, 0.1], [3.0, -1.0, 0.5, 2.0]])
    adv = vgrpo.group_advantages(rewards, delta=0.0)
    ref = np.array([(r - r.mean()) / r.std() if r.std() > 0 else 0 * r for r in rewards.numpy()])
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(adv[[0, 2]].mean(1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[[0, 2]].std(1, correction=0), torch.ones(2))
    assert (vgrpo.group_advantages(rewards)[1] == 0).all()  # exactly, with the default delta too


def test_group_advantages_global_std_uses_the_whole_batch():
    rewards = torch.tensor([[1.0, 3.0], [10.0, 30.0]])
    adv = vgrpo.group_advantages(rewards, global_std=True, delta=0.0)
    centred = rewards.numpy() - rewards.numpy().mean(1, keepdims=True)
    np.testing.assert_allclose(adv.numpy(), centred / rewards.numpy().std(), rtol=1e-6)
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        vgrpo.group_advantages(rewards.flatten())


def test_soft_clip_is_bounded_by_eta_and_identity_near_zero():
    a = torch.linspace(-50, 50, 1001, dtype=torch.float64)
    clipped = vgrpo.soft_clip(a, eta=3.0)
    assert clipped.abs().max() < 3.0 and (clipped.diff() > 0).all()
    small = torch.tensor([-1e-2, 1e-3, 1e-2], dtype=torch.float64)
    torch.testing.assert_close(vgrpo.soft_clip(small, eta=3.0), small, rtol=2e-5, atol=0)
    assert vgrpo.soft_clip(a, eta=None) is a


# ----------------------------------------------------------------------------------------------
# Sampler


def uneven_timesteps(n: int) -> torch.Tensor:
    """A grid of n steps from 1 to 0 whose step sizes alternate 1:2 (tests variable-step solvers)."""
    h = torch.tensor([1.0, 2.0]).repeat(n // 2)
    return 1 - torch.cat([torch.zeros(1), h.cumsum(0) / h.sum()])


@pytest.mark.parametrize("grid", [partial(vgrpo.flow_timesteps, shift=2.0), uneven_timesteps])
def test_ode_solvers_converge_at_their_order(grid):
    """dz/dt = a z + t has a closed-form solution; doubling the steps divides the error by 2^order."""
    a = 1.3
    velocity = lambda z, t, c: a * z + t[:, None]  # noqa: E731
    z1 = torch.tensor([[0.7]])
    # z(t) = C e^{a t} - t/a - 1/a^2 with C fixed by z(1) = z1.
    C = (z1 + 1 / a + 1 / a**2) / np.exp(a)
    exact = C - 1 / a**2
    for solver, order in (("euler", 1), ("heun", 2), ("ab2", 2)):
        err = [(vgrpo.sample_ode(velocity, z1, None, grid(n), solver=solver) - exact)
               .abs().item() for n in (16, 32, 64)]
        for coarse, fine in zip(err, err[1:]):
            assert 2**order * 0.8 < coarse / fine < 2**order * 1.25, (solver, err)


def test_flow_timesteps_run_from_noise_to_data_and_shift_spends_steps_at_high_noise():
    plain, shifted = vgrpo.flow_timesteps(10), vgrpo.flow_timesteps(10, shift=3.0)
    for ts in (plain, shifted):
        assert ts[0] == 1 and ts[-1] == 0 and (ts.diff() < 0).all()
    assert (shifted[1:-1] > plain[1:-1]).all()
    with pytest.raises(ValueError, match="solver must be"):
        vgrpo.sample_ode(lambda z, t, c: z, torch.zeros(1, 1), None, plain, solver="rk4")


# ----------------------------------------------------------------------------------------------
# The update step


def test_micro_batching_accumulates_to_the_full_batch_step(toy_model):
    results = []
    for micro in (None, 4):
        model = copy.deepcopy(toy_model)
        surrogate, ro = toy_rollouts(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m = vgrpo.vgrpo_update(partial(vgrpo.elbo_surrogate, model), opt, ro, micro_batch_size=micro,
                               max_grad_norm=None)
        results.append((m, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (m_full, p_full), (m_micro, p_micro) = results
    torch.testing.assert_close(p_micro, p_full, rtol=1e-5, atol=1e-6)
    assert m_micro["loss"] == pytest.approx(m_full["loss"], rel=1e-5, abs=1e-7)
    assert m_micro["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5)


def test_later_gradient_steps_move_the_ratio_and_get_clipped(toy_model):
    model = copy.deepcopy(toy_model)
    surrogate, ro = toy_rollouts(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    m = vgrpo.vgrpo_update(surrogate, opt, ro, num_grad_steps=4, clip_eps=1e-3)
    assert m["ratio_max"] > 1 + 1e-3 or m["ratio_min"] < 1 - 1e-3
    assert 0 < m["clipfrac"] < 1 and m["approx_kl"] > 0 and m["skipped_steps"] == 0


@pytest.mark.parametrize("num_grad_steps,kl_coef", [(1, 0.0), (2, 0.3), (4, 0.0)])
def test_old_policy_values_from_the_first_gradient_pass_give_the_same_update_with_fewer_evaluations(
        toy_model, num_grad_steps, kl_coef):
    """s_old = None: the first mini-batch reuses its own forward (still theta_old), later mini-batches get a no-grad
    pass before any step. Same parameters, metrics and s_old as the separate old-policy pass, and exactly the minimum
    number of surrogate rows: B * K forwards with gradient + (B - B / num_grad_steps) * K without."""
    results = {}
    for precomputed in (True, False):
        model = copy.deepcopy(toy_model)
        rows = {"grad": 0, "no_grad": 0}

        def counting(z, t, c, model=model, rows=rows):
            rows["grad" if torch.is_grad_enabled() else "no_grad"] += z.shape[0]
            return model(z, t, c)

        surrogate, ro = toy_rollouts(model, P=4, G=8)
        surrogate = partial(vgrpo.elbo_surrogate, counting)
        s_old, x_old = ro.s_old, ro.x_old
        if not precomputed:
            ro.s_old = ro.x_old = None
        rows.update(grad=0, no_grad=0)
        metrics = vgrpo.vgrpo_update(surrogate, torch.optim.Adam(model.parameters(), lr=1e-2), ro,
                                     num_grad_steps=num_grad_steps, micro_batch_size=4, clip_eps=0.01, kl_coef=kl_coef)
        results[precomputed] = (model.state_dict(), metrics, ro, dict(rows))
        if not precomputed:
            torch.testing.assert_close(ro.s_old, s_old, rtol=0, atol=0)
            if kl_coef:
                torch.testing.assert_close(ro.x_old, x_old, rtol=0, atol=0)
    (p_ref, m_ref, _, _), (p_new, m_new, _, rows) = results[True], results[False]
    for k in p_ref:
        torch.testing.assert_close(p_new[k], p_ref[k], rtol=0, atol=0)
    assert m_new == m_ref
    B, K = 32, 4
    assert rows == {"grad": B * K, "no_grad": (B - B // num_grad_steps) * K}


def test_update_rejects_batch_sizes_that_do_not_divide(toy_model):
    surrogate, ro = toy_rollouts(copy.deepcopy(toy_model), P=3, G=3)
    opt = torch.optim.SGD(toy_model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="must be >= 1 and divide the batch of 9"):
        vgrpo.vgrpo_update(surrogate, opt, ro, num_grad_steps=2)
    with pytest.raises(ValueError, match="micro_batch_size=2 must divide the mini-batch of 9"):
        vgrpo.vgrpo_update(surrogate, opt, ro, micro_batch_size=2)
    with pytest.raises(ValueError, match="needs rollouts.x_old"):
        vgrpo.vgrpo_update(surrogate, opt, vgrpo.Rollouts(**{**ro.__dict__, "x_old": None}), kl_coef=0.1)


def test_nonfinite_guard_skips_a_poisoned_step_and_reports_it(toy_model):
    model = copy.deepcopy(toy_model)
    surrogate, ro = toy_rollouts(model)
    ro.x0[-1, 0] = float("nan")  # poisons only the second of two mini-batches
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = copy.deepcopy(model.state_dict())
    m = vgrpo.vgrpo_update(surrogate, opt, ro, num_grad_steps=2)
    assert m["skipped_steps"] == 1
    after_first = copy.deepcopy(model.state_dict())
    assert any(not torch.equal(before[k], after_first[k]) for k in before)  # the clean step landed
    steps_taken = opt.state[next(iter(model.parameters()))]["step"].item()
    # A batch that is poisoned throughout changes nothing, Adam's moments included.
    m = vgrpo.vgrpo_update(surrogate, opt, ro[torch.arange(len(ro) // 2, len(ro))])
    assert m["skipped_steps"] == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.equal(after_first[k], v) for k, v in model.state_dict().items())
    assert opt.state[next(iter(model.parameters()))]["step"].item() == steps_taken


def test_update_trains_only_lora_parameters_of_a_peft_model(toy_model):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(copy.deepcopy(toy_model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["inp", "net.1", "net.3"]))
    _, ro = toy_rollouts(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    vgrpo.vgrpo_update(partial(vgrpo.elbo_surrogate, model), opt, ro, num_grad_steps=2)
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and changed <= trainable and all("lora" in n for n in trainable)


FSDP_WORKER = """
import sys, torch, torch.distributed as dist
from dataclasses import asdict
from functools import partial
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
import vgrpo
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = vgrpo.ToyFlow()
model.load_state_dict(torch.load(sys.argv[1]))
ro = torch.load(sys.argv[2], weights_only=False)
for layer in model.net:  # the FSDP2 recipe: shard the blocks, then the root
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
half = len(ro) // world  # data parallel: each rank holds its own half of the groups
local = ro[torch.arange(rank * half, (rank + 1) * half)]
m = vgrpo.vgrpo_update(partial(vgrpo.elbo_surrogate, model), opt, local)
if rank == 1:
    local.x0[0, 0] = float("nan")  # poisons rank 1 only: both ranks must skip
m_bad = vgrpo.vgrpo_update(partial(vgrpo.elbo_surrogate, model), opt, local)
state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    torch.save({"state": state, "grad_norm": m["grad_norm"], "skipped": m_bad["skipped_steps"]}, sys.argv[3])
skipped = torch.tensor([m_bad["skipped_steps"]])
dist.all_reduce(skipped)
assert skipped.item() == world, skipped
dist.barrier()  # no rank tears gloo down while the other still talks to it (seen once: a C++ abort at exit)
open(sys.argv[3] + f".rank{rank}-done", "w").close()
dist.destroy_process_group()
"""



def test_update_on_fsdp2_sharded_model_matches_single_process(toy_model, tmp_path):
    """torchrun, 2 CPU processes (gloo): the sharded data-parallel step equals the full-batch step."""
    model = copy.deepcopy(toy_model)
    surrogate, ro = toy_rollouts(model)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(ro, tmp_path / "rollouts.pt")
    (tmp_path / "worker.py").write_text(FSDP_WORKER)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = vgrpo.vgrpo_update(surrogate, opt, ro)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(tmp_path / "worker.py"), str(tmp_path / "model.pt"), str(tmp_path / "rollouts.pt"), str(tmp_path / "out.pt")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finished = all((tmp_path / f"out.pt.rank{r}-done").is_file() for r in range(2))  # past every collective
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 or (finished and bench.gloo_teardown_abort(output)), output
    out = torch.load(tmp_path / "out.pt")
    assert out["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-4) and out["skipped"] == 1
    for k, v in model.state_dict().items():
        torch.testing.assert_close(out["state"][k], v, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Behaviour on the toy problem


def test_variance_reduction_lowers_surrogate_cv(toy_model):
    """The paper's direction (FLUX: CV 0.230 -> 0.128, within-group 0.170 -> 0.038)."""
    P, G, K, draws = 8, 16, 4, 20
    g = torch.Generator().manual_seed(1)
    c = torch.randint(4, (P,), generator=g).repeat_interleave(G)
    x0 = vgrpo.sample_ode(toy_model, torch.randn(P * G, 2, generator=g), c, vgrpo.flow_timesteps(16))

    def mean_cv(*, param, self_normalize, stratified, group_shared):
        cvs = []
        for _ in range(draws):
            t, eps = vgrpo.draw_mc_pairs(P, G, K, (2,), generator=g, stratified=stratified, group_shared=group_shared)
            with torch.no_grad():
                s, _ = vgrpo.elbo_surrogate(toy_model, x0, c, t, eps, param=param, self_normalize=self_normalize)
            cvs.append(vgrpo.surrogate_cv(s.mean(1).view(P, G)))
        return {k: np.mean([cv[k] for cv in cvs]) for k in cvs[0]}

    naive = mean_cv(param="v", self_normalize=False, stratified=False, group_shared=False)
    full = mean_cv(param="x", self_normalize=True, stratified=True, group_shared=True)
    assert full["cv"] < 0.75 * naive["cv"] and full["cv_within"] < 0.75 * naive["cv_within"], (naive, full)


def test_toy_vgrpo_moves_samples_into_the_preferred_mode_and_keeps_support(toy_model):
    prior_frac, prior_dist = toy_mode_prior(toy_model)
    assert 0.15 < prior_frac < 0.35  # about 1/4: the pretrained model ignores the prompt
    history = vgrpo.train_toy(copy.deepcopy(toy_model), vgrpo.ToyConfig(iterations=40, seed=0))
    final = history[-1]
    assert final["frac_target_mode"] >= 0.9, [h["frac_target_mode"] for h in history]
    assert final["mode_dist"] < 0.4, final  # samples stay on a mode, not smeared between them
    assert final["reward_mean"] > history[0]["reward_mean"] + 1.0
    assert all(h["skipped_steps"] == 0 for h in history)


def test_toy_defaults_stay_in_range_at_ten_times_the_learning_rate(toy_model):
    """Before (no KL): at lr 1e-2, seed 3, one update put 38 of 128 rollouts beyond every mode (|x0| up to 11); their
    unlikelihood gradient, scaled by their input magnitude, then set each clipped Adam step (13x the rest's norm at
    iteration 2, 1e3x at 4) and enlarged the velocity field where they lie, so the next rollouts went further: |x0| 1e3
    at iteration 4, non-finite at 11, every later step skipped. The x-space KL to the behaviour policy (kl_coef 0.3, in
    gradient steps 2-4) pulls those x-predictions back within the iteration."""
    history = vgrpo.train_toy(copy.deepcopy(toy_model), vgrpo.ToyConfig(iterations=16, seed=3, lr=1e-2))
    rewards = [h["reward_mean"] for h in history]  # measured: -2.57, a dip to -3.58, then up to -0.40 (without KL: -inf)
    assert all(r > -5 for r in rewards) and all(h["skipped_steps"] == 0 for h in history), rewards
    assert history[-1]["frac_target_mode"] >= 0.9, rewards


def toy_mode_prior(model):
    g = torch.Generator().manual_seed(123)
    c = torch.randint(4, (512,), generator=g)
    x0 = vgrpo.sample_ode(model, torch.randn(512, 2, generator=g), c, vgrpo.flow_timesteps(16))
    return vgrpo.toy_mode_stats(x0, c)


# ----------------------------------------------------------------------------------------------
# rewards.py

import http.server  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch.nn.functional as F  # noqa: E402

import models  # noqa: E402
import prompts as prompt_sets  # noqa: E402
import rewards  # noqa: E402
import runs  # noqa: E402
import evaluate  # noqa: E402
import train  # noqa: E402


def smooth_images(n, h=40, w=56, seed=0):
    """Low-frequency images quantised to uint8 levels (PNG and PIL round trips are then lossless)."""
    g = torch.Generator().manual_seed(seed)
    img = F.interpolate(torch.rand(n, 3, 5, 7, generator=g), size=(h, w), mode="bilinear", align_corners=False)
    return (img * 255).round() / 255


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random CLIPModel + CLIP processor (tokenizer built offline), saved like a hub checkpoint."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    tok = models.tiny_clip_tokenizer()
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=24)
    path = tmp_path_factory.mktemp("clip")
    CLIPModel(config).save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(path)
    return str(path)


PROMPTS4 = ["a red car", "a blue flower", "the green square", "a photo of a white circle"]


def clip_reference(clip_dir, images, prompts):
    """Embeddings straight from CLIPModel.forward (which normalises them), independent of ClipScorer."""
    from transformers import AutoProcessor, CLIPModel

    model, proc = CLIPModel.from_pretrained(clip_dir).eval(), AutoProcessor.from_pretrained(clip_dir)
    inputs = proc(text=prompts, images=rewards.to_pil(images), return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**inputs), model


@pytest.mark.parametrize("name", ["pickscore", "clipscore"])
def test_clip_rewards_match_the_model_and_are_deterministic_and_order_invariant(name, tiny_clip_dir):
    reward = rewards.load_reward(name, model=tiny_clip_dir, processor=tiny_clip_dir)
    images = smooth_images(4, h=40, w=56)  # resized and cropped by the processor, as the model card does
    scores = reward(images, PROMPTS4)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    torch.testing.assert_close(reward(images, PROMPTS4), scores, rtol=0, atol=0)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(reward(images[perm], [PROMPTS4[i] for i in perm]), scores[perm], rtol=1e-5, atol=1e-6)
    out, model = clip_reference(tiny_clip_dir, images, PROMPTS4)
    expected = out.logits_per_image.diagonal() if name == "pickscore" else (out.image_embeds * out.text_embeds).sum(-1)
    # Same pixels as the model card's processor(images=PIL) call (before: 0.019 apart on PickScore's logit scale, from
    # resizing floats); what remains is float32 summation order between the batched and the joint forward.
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def hps_reference_pixels(images, size, mean, std):
    """HPSv2's published evaluation transform (hpsv2/src/open_clip/transform.py, image_transform with
    resize_longest_max) written out in its order: _convert_to_rgb_or_rgba, ToTensor (the uint8 image / 255), then
    ResizeMaxSize ON THE FLOAT TENSOR (scale = size / longest side, new (h, w) = round(dim * scale), torchvision's
    tensor resize: bicubic, align_corners False, antialias True, no clamp for floats), F.pad [pad_w // 2, pad_h // 2,
    rest, rest] with 0, Normalize."""
    out = []
    for a in (images.clamp(0, 1) * 255).round().to(torch.uint8):
        x = a.float() / 255  # ToTensor
        height, width = x.shape[1:]
        scale = size / float(max(height, width))
        if scale != 1.0:
            new_h, new_w = (round(dim * scale) for dim in (height, width))
            x = F.interpolate(x[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[0]
            pad_h, pad_w = size - new_h, size - new_w
            x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
        out.append((x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))
    return torch.stack(out)


@pytest.mark.parametrize("h,w", [(40, 56), (56, 40), (45, 31), (300, 200), (24, 24)])
def test_hpsv21_preprocessing_is_hpsv2s_resize_longest_and_pad(h, w):
    """Before: centre crop on the floats, clamped: score differences up to 0.0135 on non-square images (the spread of
    the scores was 0.017); then a PIL resize of the uint8 image, which rounds the pixels twice (up to 2.8e-4 in the
    HPSv2 score on smooth images). Now the published order: the float tensor is resized, to float rounding."""
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    images = smooth_images(3, h, w)
    ours = rewards.resize_longest_and_pad(images, processor)
    ref = hps_reference_pixels(images, 32, processor.image_mean, processor.image_std)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)  # both are float32 bicubic of the same floats
    if h != w:  # black bars where the image does not reach: the normalised value of 0
        black = (0 - torch.tensor(processor.image_mean)) / torch.tensor(processor.image_std)
        torch.testing.assert_close(ours[:, :, 0, 0], black.expand(3, 3), rtol=0, atol=1e-6)  # a padded corner


def test_aesthetic_reward_is_the_mlp_on_the_normalised_image_embedding(tiny_clip_dir, tmp_path):
    torch.manual_seed(1)
    head = rewards.MLPHead(24)
    torch.save(head.state_dict(), tmp_path / "head.pth")
    reward = rewards.load_reward("aesthetic", clip=tiny_clip_dir, head=str(tmp_path / "head.pth"))
    images = smooth_images(3, h=32, w=32)
    out, _ = clip_reference(tiny_clip_dir, images, PROMPTS4[:3])
    with torch.no_grad():
        expected = head.eval()(out.image_embeds).squeeze(-1)
    torch.testing.assert_close(reward(images, PROMPTS4[:3]), expected, rtol=1e-4, atol=1e-4)


def openclip_state_dict(*, width_v=32, width_t=24, layers=2, patch=8, grid=4, vocab=600, ctx=16, embed=20, seed=0):
    """Random weights in open_clip's exact key layout and shapes (ViT-H-14's layout at toy sizes)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    sd = {"logit_scale": torch.tensor(4.6), "visual.class_embedding": r(width_v),
          "visual.positional_embedding": r(grid * grid + 1, width_v), "visual.proj": r(width_v, embed),
          "visual.conv1.weight": r(width_v, 3, patch, patch), "token_embedding.weight": r(vocab, width_t),
          "positional_embedding": r(ctx, width_t), "text_projection": r(width_t, embed),
          "attn_mask": torch.full((ctx, ctx), float("-inf")).triu(1)}
    for prefix, w in (("visual.ln_pre", width_v), ("visual.ln_post", width_v), ("ln_final", width_t)):
        sd[f"{prefix}.weight"], sd[f"{prefix}.bias"] = 1 + r(w), r(w)
    for tower, w in (("visual.transformer", width_v), ("transformer", width_t)):
        for i in range(layers):
            p = f"{tower}.resblocks.{i}."
            for ln in ("ln_1", "ln_2"):
                sd[p + ln + ".weight"], sd[p + ln + ".bias"] = 1 + r(w), r(w)
            sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"] = r(3 * w, w), r(3 * w)
            sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"] = r(w, w), r(w)
            sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = r(4 * w, w), r(4 * w)
            sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = r(w, 4 * w), r(w)
    return sd


def openclip_forward(sd, pixels, tokens, *, heads):
    """open_clip's CLIP forward written out by hand: pre-LN residual blocks with fused qkv attention,
    class-token pooling for images, EOT (= highest id) pooling for text, then the projections."""

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"])

    def blocks(x, tower, mask):
        n = sum(1 for k in sd if k.startswith(tower) and k.endswith("attn.in_proj_weight"))
        B, L, W = x.shape
        for i in range(n):
            p = f"{tower}.resblocks.{i}."
            q, k, v = (ln(x, p + "ln_1") @ sd[p + "attn.in_proj_weight"].T + sd[p + "attn.in_proj_bias"]).chunk(3, -1)
            q, k, v = (y.view(B, L, heads, W // heads).transpose(1, 2) for y in (q, k, v))
            att = (q @ k.transpose(-1, -2) / math.sqrt(W // heads) + mask).softmax(-1)
            x = x + (att @ v).transpose(1, 2).reshape(B, L, W) @ sd[p + "attn.out_proj.weight"].T + sd[p + "attn.out_proj.bias"]
            h = F.gelu(ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"].T + sd[p + "mlp.c_fc.bias"])
            x = x + h @ sd[p + "mlp.c_proj.weight"].T + sd[p + "mlp.c_proj.bias"]
        return x

    patch = sd["visual.conv1.weight"].shape[-1]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=patch).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(len(x), 1, -1), x], 1) + sd["visual.positional_embedding"]
    x = blocks(ln(x, "visual.ln_pre"), "visual.transformer", 0.0)
    image = ln(x[:, 0], "visual.ln_post") @ sd["visual.proj"]
    L = tokens.shape[1]
    t = sd["token_embedding.weight"][tokens] + sd["positional_embedding"][:L]
    t = ln(blocks(t, "transformer", torch.full((L, L), float("-inf")).triu(1)), "ln_final")
    text = t[torch.arange(len(t)), tokens.argmax(-1)] @ sd["text_projection"]
    return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


def test_hpsv21_open_clip_weights_convert_exactly(tiny_clip_dir, tmp_path):
    sd = openclip_state_dict()
    model = rewards.openclip_to_transformers(sd, vision_heads=4, text_heads=4, bos_token_id=0, eos_token_id=1)
    assert set(model.state_dict()) == set(rewards.convert_openclip_state_dict(sd))  # nothing missing or extra
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, tmp_path / "HPS_v2.1_compressed.pt")
    reward = rewards.load_reward("hpsv21", checkpoint=str(tmp_path / "HPS_v2.1_compressed.pt"),
                                 processor=tiny_clip_dir, vision_heads=4, text_heads=4)
    images = smooth_images(4, h=40, w=56)  # non-square: HPSv2 pads where CLIP processors crop
    tok = reward.processor.tokenizer(PROMPTS4, padding="max_length", max_length=16, return_tensors="pt").input_ids
    tok = torch.where(torch.arange(16) > tok.argmax(-1, keepdim=True), 0, tok)  # open_clip pads with 0 after EOT
    image_processor = reward.processor.image_processor
    pixels = hps_reference_pixels(images, 32, image_processor.image_mean, image_processor.image_std)
    image_ref, text_ref = openclip_forward(sd, pixels, tok, heads=4)
    torch.testing.assert_close(reward.embed_images(images), image_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward.embed_texts(PROMPTS4), text_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward(images, PROMPTS4), (image_ref * text_ref).sum(-1), rtol=1e-4, atol=1e-5)


# What open_clip's tokenizer encodes (ftfy.fix_text's documented fixes, then html.unescape twice, whitespace collapse),
# written out per probe: the prompts real sets are full of.
OPENCLIP_CLEANED = {
    "It\u2019s a \u201ccat\u201d &amp; a dog": "It's a \"cat\" & a dog",  # curly quotes, an HTML entity
    "\ufb01ne \ufb02owers": "fine flowers",  # Latin ligatures
    "\uff21\uff22\uff23\u3000\uff44\uff4f\uff47\uff01": "ABC dog!",  # fullwidth letters, ideographic space
    "&amp;amp;amp; &lt;b&gt;": "& <b>",  # unescaped three times: ftfy once (no '<' yet), open_clip twice
    "a <b> &amp;amp;amp; c": "a <b> &amp; c",  # ftfy leaves text with '<' alone; open_clip's two passes apply
    "  two \t  spaces\n": "two spaces",
}


def test_hpsv21_tokenises_the_text_open_clip_tokenises(tiny_clip_dir, tmp_path):
    """Before: 4 of 23 probes got other token ids than open_clip's (score differences up to 0.034 on random weights)."""
    for raw, cleaned in OPENCLIP_CLEANED.items():
        assert rewards.openclip_clean(raw) == cleaned, raw
    torch.save(openclip_state_dict(), tmp_path / "hps.pt")
    reward = rewards.load_reward("hpsv21", checkpoint=str(tmp_path / "hps.pt"), processor=tiny_clip_dir,
                                 vision_heads=4, text_heads=4)
    raw, cleaned = list(OPENCLIP_CLEANED), list(OPENCLIP_CLEANED.values())
    plain = rewards.ClipScorer(reward.model, reward.processor, use_logit_scale=False, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(reward.embed_texts(raw), plain.embed_texts(cleaned), rtol=0, atol=0)
    tokenizer = reward.processor.tokenizer
    assert tokenizer(raw[0]).input_ids != tokenizer(cleaned[0]).input_ids  # what the plain tokenizer path got wrong


def test_hpsv21_conversion_rejects_a_checkpoint_of_another_architecture():
    sd = openclip_state_dict()
    sd["visual.attnpool.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="unexpected.*visual.attnpool"):
        rewards.openclip_to_transformers(sd, vision_heads=4, text_heads=4)


def imagereward_state_dict(*, width_v=32, width_t=24, layers=2, patch=8, grid=4, vocab=40, positions=40, seed=0):
    """Random weights in ImageReward.pt's exact key layout (ImageReward.py's ImageReward: blip = BLIP_Pretrain with
    vit.py's VisionTransformer, med.py's BertModel without pooler, vision_proj / text_proj; mlp = MLP), toy sizes."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    sd = {v + "cls_token": r(1, 1, width_v), v + "pos_embed": r(1, grid * grid + 1, width_v),
          v + "patch_embed.proj.weight": r(width_v, 3, patch, patch), v + "patch_embed.proj.bias": r(width_v),
          t + "embeddings.word_embeddings.weight": r(vocab, width_t),
          t + "embeddings.position_embeddings.weight": r(positions, width_t),
          t + "embeddings.position_ids": torch.arange(positions).unsqueeze(0),  # a persistent buffer in med.py
          "blip.vision_proj.weight": r(16, width_v), "blip.vision_proj.bias": r(16),
          "blip.text_proj.weight": r(16, width_t), "blip.text_proj.bias": r(16)}

    def linear(name, n_out, n_in):
        sd[name + ".weight"], sd[name + ".bias"] = r(n_out, n_in), r(n_out)

    def norm(name, n):
        sd[name + ".weight"], sd[name + ".bias"] = 1 + r(n), r(n)

    norm(v + "norm", width_v)
    norm(t + "embeddings.LayerNorm", width_t)
    for i in range(layers):
        b = f"{v}blocks.{i}."
        norm(b + "norm1", width_v), norm(b + "norm2", width_v)
        linear(b + "attn.qkv", 3 * width_v, width_v), linear(b + "attn.proj", width_v, width_v)
        linear(b + "mlp.fc1", 4 * width_v, width_v), linear(b + "mlp.fc2", width_v, 4 * width_v)
        b = f"{t}encoder.layer.{i}."
        for kind, kv_width in (("attention", width_t), ("crossattention", width_v)):
            linear(b + kind + ".self.query", width_t, width_t)
            linear(b + kind + ".self.key", width_t, kv_width), linear(b + kind + ".self.value", width_t, kv_width)
            linear(b + kind + ".output.dense", width_t, width_t), norm(b + kind + ".output.LayerNorm", width_t)
        linear(b + "intermediate.dense", 4 * width_t, width_t), linear(b + "output.dense", width_t, 4 * width_t)
        norm(b + "output.LayerNorm", width_t)
    for i, (n_in, n_out) in zip((0, 2, 4, 6, 7), ((width_t, 1024), (1024, 128), (128, 64), (64, 16), (16, 1))):
        linear(f"mlp.layers.{i}", n_out, n_in)
    return sd


def imagereward_forward(sd, pixels, ids, mask, *, vision_heads, text_heads):
    """ImageReward.score written out by hand from the published modules: vit.py (pre-LN blocks, fused qkv, LayerNorm
    eps 1e-6, exact GELU, final norm over every token), med.py's BertModel in multimodal mode (post-LN, eps 1e-12, padding
    masked with -10000, cross-attention to all image tokens after self-attention), the [CLS] feature, MLP, (r - mean) / std."""
    v, t = "blip.visual_encoder.", "blip.text_encoder."

    def ln(x, name, eps):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)

    def lin(x, name):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]

    def attend(q, k, v_, heads, bias=0.0):
        B, Lq, W = q.shape
        q, k, v_ = (y.view(B, -1, heads, W // heads).transpose(1, 2) for y in (q, k, v_))
        return ((q @ k.transpose(-1, -2) / math.sqrt(W // heads) + bias).softmax(-1) @ v_).transpose(1, 2).reshape(B, Lq, W)

    patch = sd[v + "patch_embed.proj.weight"].shape[-1]
    x = F.conv2d(pixels, sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"], stride=patch)
    x = torch.cat([sd[v + "cls_token"].expand(len(pixels), -1, -1), x.flatten(2).transpose(1, 2)], 1)
    x = x + sd[v + "pos_embed"][:, : x.shape[1]]
    for i in range(sum(1 for k in sd if k.startswith(v) and k.endswith("attn.qkv.weight"))):
        b = f"{v}blocks.{i}."
        q, k, v_ = lin(ln(x, b + "norm1", 1e-6), b + "attn.qkv").chunk(3, -1)
        x = x + lin(attend(q, k, v_, vision_heads), b + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, b + "norm2", 1e-6), b + "mlp.fc1")), b + "mlp.fc2")
    image = ln(x, v + "norm", 1e-6)
    h = sd[t + "embeddings.word_embeddings.weight"][ids] + sd[t + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    h = ln(h, t + "embeddings.LayerNorm", 1e-12)
    pad = (1.0 - mask[:, None, None, :].float()) * -10000.0
    for i in range(sum(1 for k in sd if k.startswith(t) and k.endswith("crossattention.self.query.weight"))):
        b = f"{t}encoder.layer.{i}."
        for kind, source, bias in (("attention", None, pad), ("crossattention", image, 0.0)):
            kv = h if source is None else source
            a = attend(lin(h, b + kind + ".self.query"), lin(kv, b + kind + ".self.key"), lin(kv, b + kind + ".self.value"),
                       text_heads, bias)
            h = ln(lin(a, b + kind + ".output.dense") + h, b + kind + ".output.LayerNorm", 1e-12)
        h = ln(lin(F.gelu(lin(h, b + "intermediate.dense")), b + "output.dense") + h, b + "output.LayerNorm", 1e-12)
    r = h[:, 0]
    for i in (0, 2, 4, 6, 7):  # dropout in between is the identity at eval time; no activations, as published
        r = lin(r, f"mlp.layers.{i}")
    return (r.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


def imagereward_reference_pixels(images, size):
    """ImageReward's _transform on a PIL image, from torchvision's published functional code: Resize(size) with an int
    (shorter side -> size, longer -> int(size * long / short), nothing when the shorter side is already size, PIL bicubic),
    CenterCrop(size) (top = int(round((h - size) / 2.0)), left likewise), ToTensor, Normalize(CLIP mean, std)."""
    from PIL import Image

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    out = []
    for a in (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy():
        img = Image.fromarray(a)
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_w, new_h = (size, int(size * long / short)) if w <= h else (int(size * long / short), size)
        if (new_w, new_h) != (w, h):
            img = img.resize((new_w, new_h), Image.BICUBIC)
        x = np.asarray(img)
        top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
        x = torch.from_numpy(x[top: top + size, left: left + size].copy()).permute(2, 0, 1).float() / 255
        out.append((x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))
    return torch.stack(out)


@pytest.mark.parametrize("h,w", [(40, 54), (54, 40), (45, 31), (32, 32), (32, 70), (300, 200)])
def test_imagereward_preprocessing_is_its_torchvision_transform(h, w):
    """(40, 54): the crop offset is round(5.5) = 6, where a CLIP processor's (dim - size) // 2 takes 5."""
    images = smooth_images(3, h, w)
    torch.testing.assert_close(rewards.resize_shorter_and_center_crop(images, 32), imagereward_reference_pixels(images, 32),
                               rtol=0, atol=0)


@pytest.fixture(scope="module")
def imagereward_files(tmp_path_factory):
    """A toy ImageReward.pt in the official key layout and a BERT WordPiece tokenizer (built offline) saved beside it."""
    from transformers import BertTokenizer

    words = sorted({w for p in PROMPTS4 for w in p.split()} | {"##s", ".", ","})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
    path = tmp_path_factory.mktemp("imagereward")
    BertTokenizer(vocab=vocab).save_pretrained(path / "tokenizer")
    sd = imagereward_state_dict(vocab=len(vocab) + 2)  # + [DEC] and [ENC], as BLIP's init_tokenizer adds them
    torch.save(sd, path / "ImageReward.pt")
    return sd, str(path / "ImageReward.pt"), str(path / "tokenizer")


def test_imagereward_loads_the_official_checkpoint_layout_and_scores_as_the_published_forward(imagereward_files):
    sd, checkpoint, tokenizer = imagereward_files
    reward = rewards.load_reward("imagereward", checkpoint=checkpoint, tokenizer=tokenizer, vision_heads=4, text_heads=4)
    prompts = PROMPTS4 + ["a red car, " * 20]  # the last one is truncated at 35 tokens
    images = smooth_images(5, h=40, w=54)
    scores = reward(images, prompts)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    tok = rewards.imagereward_tokenizer(tokenizer)
    expected = []
    for image, prompt in zip(images, prompts):  # ImageReward.score: one (prompt, image) at a time
        ids = tok(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        pixels = imagereward_reference_pixels(image[None], 32)
        expected.append(imagereward_forward(sd, pixels, ids.input_ids, ids.attention_mask, vision_heads=4, text_heads=4))
    # float32 summation order between transformers' modules and the hand-written forward, through 4 layers: ~1e-6
    torch.testing.assert_close(scores, torch.cat(expected), rtol=1e-4, atol=1e-5)
    assert scores.std() > 0.05  # the scores differ between images: a constant would not pass for a match


def test_imagereward_conversion_accepts_exactly_the_official_keys():
    sd = imagereward_state_dict()
    model = rewards.imagereward_from_state_dict(sd, vision_heads=4, text_heads=4)
    converted = rewards.convert_imagereward_state_dict(sd)
    assert set(model.state_dict()) == set(converted)  # nothing missing, nothing extra
    assert len(sd) - len(converted) == 5  # vision_proj, text_proj (weight, bias) and the position-id buffer
    with pytest.raises(ValueError, match="unexpected.*itm_head"):
        rewards.imagereward_from_state_dict({**sd, "blip.itm_head.weight": torch.zeros(2, 24)}, vision_heads=4, text_heads=4)
    with pytest.raises(ValueError, match="missing.*crossattention"):
        rewards.imagereward_from_state_dict({k: v for k, v in sd.items() if "layer.1.crossattention.self.key.weight" not in k},
                                            vision_heads=4, text_heads=4)
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        rewards.imagereward_from_state_dict(openclip_state_dict(), vision_heads=4, text_heads=4)


def test_jpeg_rewards_are_the_encoded_size_and_rank_smooth_above_noise():
    from PIL import Image

    images = torch.cat([smooth_images(1, 64, 64), torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))])
    size = rewards.load_reward("jpeg_incompressibility")(images, ["", ""])
    for image, kb in zip(images, size):
        buffer = io.BytesIO()
        Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()).save(buffer, "JPEG", quality=95)
        assert kb.item() == pytest.approx(len(buffer.getvalue()) / 1000)
    compress = rewards.load_reward("jpeg_compressibility")(images, ["", ""])
    torch.testing.assert_close(compress, -size)
    assert compress[0] > compress[1]  # the smooth image is more compressible than noise


def test_color_reward_follows_the_prompt_and_metadata():
    images = torch.zeros(3, 3, 8, 8)
    images[0, 0] = 1.0  # pure red
    images[1] = 0.5  # grey
    images[2, 2] = 1.0  # pure blue
    reward = rewards.load_reward("color")
    scores = reward(images, ["a red car", "a RED car", "a photo"], [None, None, {"color": "blue"}])
    expected = [1.0, 1 - math.sqrt(0.25 + 0.25 + 0.25) / math.sqrt(3), 1.0]
    torch.testing.assert_close(scores, torch.tensor(expected))
    with pytest.raises(ValueError, match="needs a colour word"):
        reward(images[:1], ["a photo"])


def moving_squares(starts, moves, *, frames=5, size=(24, 40), side=6, color=(1.0, 0.0, 0.0)):
    """Videos (B, frames, 3, H, W): a square of `side` px on grey, its top-left corner moving in a straight line from
    starts[b] (x, y) by moves[b] (dx, dy) in total, in whole pixels per frame."""
    H, W = size
    videos = torch.full((len(starts), frames, 3, H, W), 0.5)
    for b, ((x, y), (dx, dy)) in enumerate(zip(starts, moves)):
        for f in range(frames):
            fx, fy = x + dx * f // (frames - 1), y + dy * f // (frames - 1)
            videos[b, f, :, fy:fy + side, fx:fx + side] = torch.tensor(color)[:, None, None]
    return videos


def test_motion_reward_is_the_travel_in_the_named_direction_per_frame_size():
    """Closed form: a square moved by (dx, dy) px over the video scores dx / W for "right", -dx / W for "left",
    dy / H for "down" (y points down the image), -dy / H for "up"; still videos and background-only frames score 0;
    metadata names the direction where the prompt does not. Frames 24 x 40, so a swapped axis would show."""
    reward = rewards.load_reward("motion")
    videos = moving_squares([(2, 9), (30, 9), (17, 1), (17, 15), (17, 9)], [(20, 0), (-20, 0), (0, 12), (0, -8), (0, 0)])
    prompts = ["a red square moving right", "moving left", "a square moving down", "up it goes", "a square moving left"]
    torch.testing.assert_close(reward(videos, prompts), torch.tensor([20 / 40, 20 / 40, 12 / 24, 8 / 24, 0.0]))
    crossed = ["moving left", "moving right", "moving up", "moving down", "moving up"]
    torch.testing.assert_close(reward(videos, crossed), torch.tensor([-20 / 40, -20 / 40, -12 / 24, -8 / 24, 0.0]))
    sideways = reward(videos[:2], ["moving up", "moving down"])
    torch.testing.assert_close(sideways, torch.zeros(2))
    torch.testing.assert_close(reward(videos[:1], ["a square"], [{"direction": "left"}]), torch.tensor([-0.5]))
    torch.testing.assert_close(reward(torch.full((1, 3, 3, 8, 8), 0.5), ["moving right"]), torch.zeros(1))
    with pytest.raises(ValueError, match="needs a direction word"):
        reward(videos[:1], ["a red square"])


def test_image_rewards_score_videos_on_every_nth_frame_as_flow_grpo_and_flow_factory_do(monkeypatch):
    """An image reward scores a video as the mean over frames 0, n, 2n, ...: n = 4 for OCR (Flow-GRPO's video OCR
    scorer), 1 for the others (Flow-Factory's video PickScore), --frame_interval overriding both; a video reward
    (motion) gets the video itself. Frames are scored with their video's prompt and metadata, in calls of at most
    FRAMES_PER_CALL images, and the result equals scoring each chosen frame alone."""
    videos = torch.rand(3, 9, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    videos[:, :, 0, 0, 0] = torch.arange(9) / 8  # frame f marks itself with f / 8 in one pixel
    prompts, metadata = ["a red car", "a blue car", "a green car"], [{"k": 0}, {"k": 1}, {"k": 2}]
    monkeypatch.setattr(rewards, "FRAMES_PER_CALL", 5)  # calls that split videos
    seen = []

    def recording(images, texts, extra):
        seen.append((images[:, 0, 0, 0].mul(8).round().int().tolist(), list(texts), [m["k"] for m in extra]))
        return rewards.color()(images, texts)

    for name, interval, frames in (("ocr", 0, [0, 4, 8]), ("pickscore", 0, list(range(9))), ("pickscore", 3, [0, 3, 6])):
        seen.clear()
        scores = rewards.for_samples(name, recording, video=True, frame_interval=interval)(videos, prompts, metadata)
        alone = torch.stack([torch.stack([rewards.color()(videos[b, f][None], [prompts[b]])[0] for f in frames]).mean()
                             for b in range(3)])
        torch.testing.assert_close(scores, alone)
        assert [f for call in seen for f in call[0]] == frames * 3
        assert [t for call in seen for t in call[1]] == [p for p in prompts for _ in frames]
        assert [k for call in seen for k in call[2]] == [k for k in range(3) for _ in frames]
        assert max(len(call[0]) for call in seen) <= rewards.FRAMES_PER_CALL
    assert rewards.for_samples("motion", recording, video=True) is recording
    assert rewards.for_samples("pickscore", recording, video=False) is recording


def test_video_samples_are_written_as_an_animated_grid_frame_by_frame(tmp_path):
    """Videos (B, F, 3, H, W) give an animated WebP of F grids, frame f of each cell showing the video's frame f
    (lossless, enlarged nearest); images still give a PNG."""
    from PIL import Image

    colours = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(0))  # (video, frame, rgb)
    videos = colours[:, :, :, None, None].expand(2, 3, 3, 8, 8)
    written = runs.save_samples(videos, ["a red car | color 0.5", "a blue car"], [{"prompt": "a red car"}],
                                tmp_path / "iter-000001.png")
    assert written == tmp_path / "iter-000001.webp" and (tmp_path / "iter-000001.json").is_file()
    animation = Image.open(written)
    assert animation.n_frames == 3
    for f in range(3):
        animation.seek(f)
        frame = np.asarray(animation.convert("RGB")).astype(int)
        for b in range(2):
            want = (colours[b, f] * 255).round().int().numpy()
            assert np.abs(frame[64, 128 * b + 64] - want).max() <= 1, (f, b)  # the centre of cell b
    assert runs.save_samples(videos[:, 0], ["a", "b"], None, tmp_path / "still.png") == tmp_path / "still.png"
    assert Image.open(tmp_path / "still.png").format == "PNG"


def test_toy_videos_move_a_square_12_px_and_their_captions_name_the_direction_7_times_in_10():
    """models.toy_videos, checked through the motion reward's closed form: in every video the square travels 12 px
    (of 32) along one axis, so the four directions score 0.375, 0, 0 and -0.375; the caption names the true
    direction 3 times in 5, else a random one (right in 1 of 4 of those): 0.7 of the captions."""
    videos, captions = models.toy_videos(400, torch.Generator().manual_seed(0))
    assert videos.shape == (400, models.TINY_FRAMES, 3, 32, 32) and 0 <= videos.min() and videos.max() <= 1
    reward = rewards.motion()
    scores = torch.stack([reward(videos, [f"moving {way}"] * len(videos)) for way in rewards.DIRECTIONS], dim=1)
    torch.testing.assert_close(scores.sort(dim=1).values, torch.tensor([-0.375, 0, 0, 0.375]).expand(400, 4))
    named = torch.tensor([list(rewards.DIRECTIONS).index(c.split()[-1]) for c in captions])
    right = (named == scores.argmax(dim=1)).float().mean().item()
    assert abs(right - 0.7) < 3 * math.sqrt(0.7 * 0.3 / 400), right


def test_reward_spec_parsing_and_unknown_names():
    assert rewards.parse_reward_spec("pickscore:2, hpsv21,clipscore:0.5") == {"pickscore": 2.0, "hpsv21": 1.0, "clipscore": 0.5}
    for bad, message in (("pickscor", "unknown reward 'pickscor'"), ("color:x", "not a number"), (",", "no reward named")):
        with pytest.raises(ValueError, match=message):
            rewards.parse_reward_spec(bad)
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.load_reward("nope")


def test_multi_reward_aggregation_matches_hand_computation():
    a = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    b = torch.tensor([[10.0, 0.0, 20.0], [1.0, 3.0, 2.0]])
    w = {"a": 1.0, "b": 0.5}

    def standardise(r):  # population std, no delta
        r = r.numpy()
        s = r.std(1, keepdims=True)
        return np.where(s > 0, (r - r.mean(1, keepdims=True)) / np.where(s > 0, s, 1), 0)

    summed = vgrpo.multi_reward_advantages({"a": a, "b": b}, w, aggregation="reward", delta=0.0)
    np.testing.assert_allclose(summed.numpy(), standardise(a + 0.5 * b), rtol=1e-6, atol=1e-6)
    per_reward = vgrpo.multi_reward_advantages({"a": a, "b": b}, w, aggregation="advantage", delta=0.0)
    np.testing.assert_allclose(per_reward.numpy(), standardise(a) + 0.5 * standardise(b), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="aggregation must be"):
        vgrpo.multi_reward_advantages({"a": a}, {"a": 1.0}, aggregation="mean")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def color_server():
    """`python rewards.py serve color` as a real subprocess on 127.0.0.1."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "rewards.py"), "serve", "color", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                assert json.loads(response.read()) == {"status": "ok", "reward": "color"}
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("reward server did not start: " + proc.stdout.read())
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_http_reward_round_trips_a_batch_with_identical_scores(color_server):
    images = smooth_images(5, 24, 24)
    prompts = [f"a {c} thing" for c in ("red", "green", "blue", "white", "black")]
    remote = rewards.load_reward("http", url=color_server)(images, prompts, [{}] * 5)
    torch.testing.assert_close(remote, rewards.load_reward("color")(images, prompts), rtol=0, atol=0)


def test_http_reward_reports_a_rejected_request_with_the_server_message(color_server):
    with pytest.raises(rewards.RewardServerError, match="rejected the request \\(400\\).*needs a colour word"):
        rewards.load_reward("http", url=color_server)(smooth_images(1, 8, 8), ["no colour here"])


def test_http_reward_gives_a_clear_error_after_bounded_retries_when_the_server_is_down():
    client = rewards.HttpReward(f"http://127.0.0.1:{free_port()}", retries=3, backoff=0.05, timeout=2)
    start = time.perf_counter()
    with pytest.raises(rewards.RewardServerError, match="no answer after 3 attempts.*python rewards.py serve"):
        client(smooth_images(1, 8, 8), ["a red car"])
    assert 0.05 + 0.1 <= time.perf_counter() - start < 10  # two backoff waits, then it gives up


@pytest.mark.parametrize("status", [302, 307, 400, 404])
def test_http_reward_stops_on_a_redirect_or_a_refusal_without_following_it(status):
    def send(handler):
        body = b'{"error": "nope"}'
        handler.send_response(status)
        handler.send_header("Location", "http://127.0.0.1:1/elsewhere")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    url, server = one_shot_server(send)
    try:
        with pytest.raises(rewards.RewardServerError, match=f"rejected the request \\({status}\\)"):
            rewards.HttpReward(url, retries=1)(smooth_images(1, 8, 8), ["a red car"])
    finally:
        server.shutdown()


@pytest.mark.parametrize("body", [b"not json", b'{"score": [1.0]}', b'{"scores": [1.0, 2.0]}', b'{"scores": ["x"]}',
                                  b'{"scores": [NaN]}', b'{"scores": [true]}', b'{"scores": [null]}',
                                  b'{"scores": [[0.5]]}', b'{"scores": {"a": 1}}', b"[" * 100_000 + b"]" * 100_000])
def test_http_reward_rejects_a_malformed_response(body):
    class Bad(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Bad)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(rewards.RewardServerError, match="malformed response from reward server"):
            rewards.HttpReward(f"http://127.0.0.1:{server.server_port}")(smooth_images(1, 8, 8), ["a red car"])
    finally:
        server.shutdown()


def one_shot_server(handler_body):
    """A local server whose POST answer is handler_body(handler); returns (url, server)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            handler_body(self)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", server


def answer(body: bytes):
    def send(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return send


@pytest.mark.parametrize("body", [b'{"scores": [1e39]}', b'{"scores": [-4e38]}', b'{"scores": [1' + b"0" * 400 + b"]}"])
def test_http_reward_rejects_scores_that_are_not_finite_in_float32(body):
    """1e39 is a finite Python float but inf as float32 (before: every step skipped, exit 0); a 400-digit JSON integer
    raised an uncaught OverflowError."""
    url, server = one_shot_server(answer(body))
    try:
        with pytest.raises(rewards.RewardServerError, match="malformed response.*finite in float32"):
            rewards.HttpReward(url)(smooth_images(1, 8, 8), ["a red car"])
    finally:
        server.shutdown()


def test_http_reward_deadline_covers_the_whole_request_not_each_read():
    """A server that trickles its answer one byte every 0.2 s never trips a per-read timeout of 1 s (before: held 144 s
    with timeout 1); the whole-request deadline ends each attempt after 1 s."""
    def trickle(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(1000):
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.2)

    url, server = one_shot_server(trickle)
    try:
        start = time.perf_counter()
        with pytest.raises(rewards.RewardServerError, match="no answer after 2 attempts.*within the 1 s timeout"):
            rewards.HttpReward(url, timeout=1, retries=2, backoff=0.01)(smooth_images(1, 8, 8), ["a red car"])
        assert time.perf_counter() - start < 6  # 2 x 1 s, plus slack for a loaded machine
    finally:
        server.shutdown()


def test_http_reward_refuses_other_url_schemes_and_bounds_echoed_bodies(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2")
    with pytest.raises(ValueError, match="must be http://HOST"):
        rewards.HttpReward(f"file://{secret}")  # before: urllib read the file and printed it in the error
    url, server = one_shot_server(answer(b'{"scores": "' + b"x" * 100_000 + b'"}'))
    try:
        with pytest.raises(rewards.RewardServerError) as error:
            rewards.HttpReward(url)(smooth_images(1, 8, 8), ["a red car"])
        assert len(str(error.value)) < 500
    finally:
        server.shutdown()


def post(url, payload: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=payload, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_reward_server_answers_every_bad_request_with_400_and_the_reason(color_server):
    """Before: an image that is not a PNG (PIL's OSError) dropped the connection unanswered, as did 50 MB of garbage;
    one image with two prompts was scored twice."""
    png = rewards.encode_png(rewards.to_uint8(smooth_images(1, 16, 16))[0])
    jpeg = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")
    cases = {
        "a JPEG": ({"images": [base64.b64encode(jpeg.getvalue()).decode()], "prompts": ["a red car"]}, "not a base64 PNG"),
        "50 MB of garbage": ({"images": [base64.b64encode(os.urandom(50 << 20)).decode()], "prompts": ["a red car"]},
                             "not a base64 PNG"),
        "one image, two prompts": ({"images": [png], "prompts": ["a red car", "a blue car"]}, "1 images, 2 prompts"),
        "metadata of another length": ({"images": [png], "prompts": ["a red car"], "metadata": [{}, {}]}, "2 metadata"),
        "prompts that are not strings": ({"images": [png], "prompts": [3]}, "prompts a list of strings"),
        "a prompt the reward cannot score": ({"images": [png], "prompts": ["a cat"]}, "needs a colour word"),
    }
    for name, (request, reason) in cases.items():
        status, answer = post(color_server, json.dumps(request).encode())
        assert status == 400 and reason in answer["error"], (name, status, answer)
    status, answer = post(color_server, json.dumps({"images": [png], "prompts": ["a red car"]}).encode())
    assert status == 200 and len(answer["scores"]) == 1  # and it still serves


@pytest.mark.parametrize("argv,message", [
    (["serve", "color", "--port", "99999"], "--port 99999 must be 0-65535"),
    (["serve", "color", "--timeout", "-1"], "--timeout -1.0 a number of seconds > 0"),
    (["serve", "color", "--option", "quality=3"], "'color' has no option 'quality'"),
    (["serve", "pickscore", "--option", "model=7"], "option 'model' of 'pickscore' must be str"),
    (["serve", "geneval"], "serve geneval needs --option detector_config=PATH"),
    (["serve", "unifiedreward"], "unifiedreward is an HTTP client here"),
])
def test_serve_refuses_bad_flags_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        rewards.serve(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.splitlines() == [err] and message in err, err


def test_serve_on_a_port_in_use_is_one_line(capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(SystemExit) as exit_info:
            rewards.serve(["serve", "color", "--port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("error: cannot listen on 127.0.0.1:") and "\n" not in err


def test_reward_server_serves_others_while_a_client_stalls_and_refuses_oversized_bodies():
    """One client announces 1000 bytes and sends 10: the server keeps answering everyone else at once (before: one
    thread, no socket timeout, blocked for all), drops the stalled client after its timeout, and a body above the
    limit gets 413 without being read."""
    server = rewards.reward_server(rewards.load_reward("color"), "color", port=0, timeout=5, max_request_bytes=1 << 20)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        stalled = socket.create_connection(("127.0.0.1", server.server_port))
        stalled.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
        start = time.perf_counter()
        images, prompts = smooth_images(2, 16, 16), ["a red car", "a blue car"]
        remote = rewards.HttpReward(url, timeout=10, retries=1)(images, prompts)
        assert time.perf_counter() - start < 3  # not after the stalled client's 5 s: served concurrently
        torch.testing.assert_close(remote, rewards.load_reward("color")(images, prompts), rtol=0, atol=0)
        stalled.settimeout(20)
        assert stalled.recv(1024) == b""  # the server closed it after its 5 s socket timeout
        big = socket.create_connection(("127.0.0.1", server.server_port), timeout=10)
        big.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 << 20))  # answered unread
        assert big.recv(1024).split(b"\r\n")[0].endswith(b"413 Request Entity Too Large")
        big.close()
    finally:
        server.shutdown()
        server.server_close()



# ----------------------------------------------------------------------------------------------
# OCR reward (PP-OCRv4 through onnxruntime, the models shipped in the rapidocr_onnxruntime wheel)


def ocr_fonts():
    """PIL's bundled FreeType font (Aileron), and matplotlib's DejaVu faces where matplotlib is installed."""
    from PIL import ImageFont

    fonts = [lambda size: ImageFont.load_default(size=size)]
    try:
        import matplotlib

        ttf = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
        fonts += [partial(ImageFont.truetype, str(ttf / name)) for name in ("DejaVuSerif-Bold.ttf", "DejaVuSansMono.ttf")]
    except ImportError:
        pass
    return fonts


def render_text(text, font, fg, bg, size=(512, 384)):
    """The text centred on a plain background, as a (1, 3, H, W) image in [0, 1]."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(picture)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - right + left) // 2, (size[1] - bottom + top) // 2), text, font=font, fill=fg)
    return torch.from_numpy(np.asarray(picture).copy()).permute(2, 0, 1)[None].float() / 255


OCR_CASES = [  # (prompt, text drawn, font index, size, foreground, background)
    ('a storefront sign that reads "OPEN 24 HOURS"', "OPEN 24 HOURS", 0, 48, "black", "white"),
    ('a neon sign saying "Hello World"', "Hello World", 1, 40, "white", (20, 30, 90)),
    ('a poster that reads "Don\'t panic, 42!"', "Don't panic, 42!", 2, 36, (200, 20, 20), (250, 240, 200)),
    ('a mug printed with "v-grpo"', "V-GRPO", 0, 64, "white", "black"),
    ('a card with the words "see you soon" on it', "See you soon", 1, 30, (10, 90, 10), (230, 230, 230)),
]


@pytest.fixture(scope="module")
def ocr_reward():
    return rewards.load_reward("ocr")


@pytest.mark.parametrize("prompt,drawn,font,size,fg,bg", OCR_CASES)
def test_ocr_reward_reads_the_quoted_text_rendered_in_an_image(prompt, drawn, font, size, fg, bg, ocr_reward):
    """Real PP-OCRv4 weights: the quoted text drawn in several fonts, sizes, colours (case and spacing may differ from
    the prompt, as the rule ignores them) scores >= 0.9; the same image scored against another text scores low."""
    fonts = ocr_fonts()
    image = render_text(drawn, fonts[font % len(fonts)](size), fg, bg)
    score = ocr_reward(image, [prompt]).item()
    assert 0.9 <= score <= 1.0, (prompt, score)
    assert ocr_reward(image, ['a sign that says "Quantum zebra marmalade"']).item() < 0.5


def test_ocr_reward_is_zero_on_noise_and_blank_images_and_refuses_a_prompt_without_quotes(ocr_reward):
    g = torch.Generator().manual_seed(0)
    images = torch.cat([torch.rand(1, 3, 256, 256, generator=g), torch.zeros(1, 3, 256, 256), torch.ones(1, 3, 256, 256)])
    scores = ocr_reward(images, ['a sign that says "Hello"'] * 3)
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.zeros(3))
    assert ocr_reward(torch.rand(2, 3, 24, 40, generator=g), ['a sign that says "Hello"'] * 2).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="between double quotes"):
        ocr_reward(images[:1], ["a sign that says hello"])
    with pytest.raises(ValueError, match="non-empty text"):
        ocr_reward(images[:1], ['a sign that says "  "'])
    assert ocr_reward(images[1:2], ["no quotes here"], [{"text": "Hello"}]).item() == 0.0  # metadata["text"] wins


def test_ocr_paddleocr_engine_reads_paddleocrs_published_output_format(monkeypatch):
    """engine="paddleocr" builds PaddleOCR as Flow-GRPO does and joins the lines of its 2.x result format
    ([[box, (text, confidence)], ...] per image; [None] when nothing is read). PaddleOCR itself is not installed
    here: a stand-in with that interface checks the call and the parsing; without the package, a one-line hint."""
    made = {}

    class FakePaddleOCR:
        def __init__(self, **kwargs):
            made.update(kwargs)

        def ocr(self, image, cls):
            assert image.dtype == np.uint8 and image.shape[-1] == 3 and cls is False
            if image.mean() > 127:
                return [None]
            return [[[[[0, 0], [9, 0], [9, 9], [0, 9]], ("HELLO", 0.93)], [[[0, 20], [9, 20], [9, 29], [0, 29]], ("wor1d", 0.71)]]]

    monkeypatch.setitem(sys.modules, "paddleocr", types.SimpleNamespace(PaddleOCR=FakePaddleOCR))
    reward = rewards.load_reward("ocr", engine="paddleocr")
    assert made == {"use_angle_cls": False, "lang": "en", "use_gpu": False, "show_log": False}
    scores = reward(torch.stack([torch.zeros(3, 16, 16), torch.ones(3, 16, 16)]), ['a sign "Hello World"'] * 2)
    assert scores.tolist() == [pytest.approx(1 - 1 / 10), 0.0]  # "hellowor1d" is one substitution away
    monkeypatch.setitem(sys.modules, "paddleocr", None)
    with pytest.raises(ImportError, match="pip install paddleocr paddlepaddle"):
        rewards.load_reward("ocr", engine="paddleocr")
    with pytest.raises(ValueError, match="not rapidocr or paddleocr"):
        rewards.load_reward("ocr", engine="tesseract")


def brute_levenshtein(a, b):
    """Edit distance by its recursive definition."""
    @functools.lru_cache(maxsize=None)
    def d(i, j):
        if not i or not j:
            return i or j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_ocr_accuracy_is_flow_grpos_rule():
    """Flow-GRPO's flow_grpo/ocr.py, case by case: lower-case, spaces removed, 0 if the target is inside what was read,
    else the edit distance clipped to the target's length, reward 1 - d / len."""
    cases = {("Hello World", "hello world"): 1.0,  # case and spaces do not count
             ("a big HELLOWORLD sign", "Hello World"): 1.0,  # the target inside more text
             ("helo world", "Hello World"): 1 - 1 / 10,  # one deletion
             ("hellp world", "Hello World"): 1 - 1 / 10,  # one substitution
             ("", "Hello"): 0.0, ("zzzzzzzzzzzz", "ab"): 0.0,  # distance clipped at the target's length
             ("abx", "abc"): 1 - 1 / 3}
    for (read, target), expected in cases.items():
        assert rewards.ocr_accuracy(read, target) == pytest.approx(expected, abs=1e-12), (read, target)
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = ("".join(rng.choice(list("abc "), size=rng.integers(0, 9))) for _ in range(2))
        assert rewards.levenshtein(a, b) == brute_levenshtein(a, b)
    assert rewards.ocr_target('A sign "one" and "two"') == "one"  # Flow-GRPO: prompt.split('"')[1]


# ----------------------------------------------------------------------------------------------
# GenEval: its rules on hand-built detections (evaluate_images.py's evaluate, Flow-GRPO's evaluate_reward)


def det(x1, y1, x2, y2, score=0.95, color=None):
    return rewards.Detection((x1, y1, x2, y2), score, None, color)


def test_geneval_keep_thresholds_sorts_limits_and_suppresses_as_the_published_script():
    raw = {"dog": [det(0, 0, 10, 10, 0.3), det(0, 0, 10, 10, 0.31), det(50, 50, 60, 60, 0.8)], "cat": [det(0, 0, 5, 5, 0.2)]}
    kept = rewards.geneval_keep(raw, "single_object")
    assert [d.score for d in kept["dog"]] == [0.8, 0.31] and "cat" not in kept  # strictly above 0.3, most confident first
    assert "dog" not in rewards.geneval_keep(raw, "counting")  # counting prompts: 0.9
    many = {"cup": [det(i, 0, i + 5, 5, 0.5 + i / 1000) for i in range(20)]}
    assert len(rewards.geneval_keep(many, "two_object")["cup"]) == 16  # max_objects
    overlapping = {"cup": [det(0, 0, 10, 10, 0.9), det(1, 0, 11, 10, 0.8), det(30, 30, 40, 40, 0.7)]}
    assert len(rewards.geneval_keep(overlapping, "two_object")["cup"]) == 3  # max_overlap 1: no suppression
    assert [d.score for d in rewards.geneval_keep(overlapping, "two_object", max_overlap=0.5)["cup"]] == [0.9, 0.7]
    # compute_iou counts pixels inclusively: boxes 0..10 and 1..11 share 10 of 11 columns
    assert rewards.geneval_iou((0, 0, 10, 10), (1, 0, 11, 10)) == pytest.approx(110 / 132)


def test_geneval_positions_shrink_the_offset_by_the_object_sizes():
    a, b = det(0, 40, 20, 60), det(90, 40, 110, 60)  # centres 100 apart horizontally, sizes 20
    assert rewards.geneval_relations(a, b) == {"left of"} and rewards.geneval_relations(b, a) == {"right of"}
    assert rewards.geneval_relations(det(40, 0, 60, 20), det(40, 90, 60, 110)) == {"above"}  # y grows downwards
    # diagonal: shrunk offset (-96, -96) over the raw length 141: both components beyond 0.5 in size
    assert rewards.geneval_relations(det(0, 0, 20, 20), det(100, 100, 120, 120)) == {"left of", "above"}
    # overlapping large boxes: the margin 0.1 x (100 + 100) swallows a centre offset of 10: no relation at all
    assert rewards.geneval_relations(det(0, 0, 100, 100), det(10, 0, 110, 100)) == set()
    # mostly vertical offset: dx = -6/60.3 is not a relation, dy is
    assert rewards.geneval_relations(det(0, 0, 10, 10), det(6, 60, 16, 70)) == {"above"}


GENEVAL_RULE_CASES = [
    # (metadata, objects, correct, Flow-GRPO's partial score)
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {"dog": [det(0, 0, 9, 9)]}, True, 1.0),
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {"cat": [det(0, 0, 9, 9)]}, False, 0.0),
    # two dogs for "a dog": GenEval counts at least 1 (correct); Flow-GRPO's score wants exactly 1: 1 - 1/1 = 0
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {"dog": [det(0, 0, 9, 9), det(20, 0, 29, 9)]},
     True, 0.0),
    ({"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]},
     {"dog": [det(0, 0, 9, 9)]}, False, 0.5),
    ({"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]},
     {"cup": [det(10 * i, 0, 10 * i + 5, 5) for i in range(3)]}, True, 1.0),
    ({"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]},
     {"cup": [det(10 * i, 0, 10 * i + 5, 5) for i in range(4)]}, False, 1 - 1 / 3),  # the exclude clause fails it
    ({"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]},
     {"cup": [det(10 * i, 0, 10 * i + 5, 5) for i in range(5)]}, False, 1 - 3 / 2),  # negative, as Flow-GRPO's
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
     {"car": [det(0, 0, 9, 9, 0.9, "red"), det(20, 0, 29, 9, 0.8, "blue")]}, True, 0.0),  # 2nd car: not checked by GenEval
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
     {"car": [det(0, 0, 9, 9, 0.9, "blue"), det(20, 0, 29, 9, 0.8, "red")]}, False, 0.0),  # the most confident decides
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
     {"car": [det(0, 0, 9, 9, 0.9, "red")]}, True, 1.0),
    ({"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
     {"cat": [det(90, 40, 110, 60)], "dog": [det(0, 40, 20, 60)]}, True, 1.0),
    # relation fails: GenEval says no; Flow-GRPO's terms are [1, 1, 0, 1] (its failed check adds 0 and then 1)
    ({"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}]},
     {"cat": [det(90, 40, 110, 60)], "dog": [det(0, 40, 20, 60)]}, False, 0.75),
    # no target object: the position clause cannot be checked: [0 (cat), 1 (dog), 0 (no target)]
    ({"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
     {"dog": [det(0, 40, 20, 60)]}, False, 1 / 3),
    ({"tag": "color_attr", "include": [{"class": "bus", "count": 1, "color": "yellow"}, {"class": "tie", "count": 1, "color": "green"}]},
     {"bus": [det(0, 0, 50, 50, 0.9, "yellow")], "tie": [det(60, 0, 70, 30, 0.9, "yellow")]}, False, 0.75),
]


@pytest.mark.parametrize("metadata,objects,correct,partial_score", GENEVAL_RULE_CASES)
def test_geneval_rules_on_hand_built_detections(metadata, objects, correct, partial_score):
    verdict, reasons = rewards.geneval_correct(objects, metadata)
    assert verdict == correct and bool(reasons) == (not correct)
    assert rewards.geneval_partial(objects, metadata) == pytest.approx(partial_score, abs=1e-12)


def test_geneval_metadata_is_checked_before_training():
    rewards.check_prompt("geneval", "a photo of a dog", {"tag": "single_object", "include": [{"class": "dog", "count": 1}]})
    for bad in ({}, {"tag": "single_object"}, {"tag": "nonsense", "include": []},
                {"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]},
                {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "teal"}]},
                {"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]}):
        with pytest.raises(ValueError, match="geneval|GenEval"):
            rewards.check_prompt("geneval", "a photo", bad)


def stub_geneval_scorer():
    """GenEvalScorer with a stand-in detector (a 'dog' box on the left half whose confidence is the image's mean red,
    a 'cat' box on the right half with the mean blue) and colours named by the crop's strongest channel."""
    def detect(images):
        return [{"dog": [rewards.Detection((0, 0, image.shape[1] / 2 - 1, image.shape[0] - 1), float(image[..., 0].mean() / 255))],
                 "cat": [rewards.Detection((image.shape[1] / 2, 0, image.shape[1] - 1, image.shape[0] - 1),
                                           float(image[..., 2].mean() / 255))]} for image in images]

    def colors(image, objects, name):
        crops = [rewards.geneval_crop(image, d)[0].mean((1, 2)) for d in objects]
        return [("red", "green", "blue")[int(c.argmax())] for c in crops]

    return rewards.GenEvalScorer(detect, colors, threshold=0.2)


def test_geneval_scorer_served_over_http_returns_scores_and_accuracy():
    scorer = stub_geneval_scorer()
    server = rewards.reward_server(scorer, "geneval", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = rewards.load_reward("geneval", url=f"http://127.0.0.1:{server.server_port}")
        images = torch.zeros(3, 3, 32, 32)
        images[0, 0] = 1.0  # red: a red dog on the left, no cat
        images[1, 2] = 1.0  # blue: a cat only
        images[2, 0], images[2, 2] = 0.8, 0.8  # both, magenta-ish: left dog red (ties go to red), right cat red
        meta = [{"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]},
                {"tag": "single_object", "include": [{"class": "dog", "count": 1}]},
                {"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]}]
        scores = client(images, [m["tag"] for m in meta], meta)
        assert scores.tolist() == [1.0, 0.0, 1.0] and client.extras["accuracy"] == [1.0, 0.0, 1.0]
        assert len(client.extras["reasons"]) == 3 and "expected dog>=1" in client.extras["reasons"][1]
        direct = scorer(images, ["x"] * 3, meta)
        assert direct["scores"].tolist() == scores.tolist()
        with pytest.raises(rewards.RewardServerError, match="400"):  # no metadata: the server says so
            client(images, ["x"] * 3)
    finally:
        server.shutdown()
        server.server_close()


def test_mmdet_results_become_detections_per_class():
    boxes = [np.zeros((0, 5)) for _ in rewards.GENEVAL_CLASSES]
    boxes[rewards.GENEVAL_CLASSES.index("dog")] = np.array([[1, 2, 3, 4, 0.9], [5, 6, 7, 8, 0.4]])
    masks = [[] for _ in rewards.GENEVAL_CLASSES]
    masks[rewards.GENEVAL_CLASSES.index("dog")] = [np.ones((10, 10), bool), np.zeros((10, 10), bool)]
    found = rewards.mmdet_detections((boxes, masks))
    assert list(found) == ["dog"] and [d.box for d in found["dog"]] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert [d.score for d in found["dog"]] == [0.9, 0.4] and found["dog"][0].mask.all()
    assert rewards.mmdet_detections(boxes)["dog"][1].mask is None


def test_geneval_crop_greys_out_what_the_mask_leaves_out_and_crops_to_the_box():
    image = np.full((8, 8, 3), 200, np.uint8)
    mask = np.zeros((8, 8), bool)
    mask[2:4, 2:4] = True
    crop = rewards.geneval_crop(image, rewards.Detection((1, 1, 5, 5), 0.9, mask))
    assert crop.shape == (1, 3, 4, 4)
    expected = torch.full((3, 4, 4), 0x99 / 255)
    expected[:, 1:3, 1:3] = 200 / 255
    torch.testing.assert_close(crop[0], expected)


def test_clip_colour_classifier_is_zero_shot_over_the_templates(tiny_clip_dir, monkeypatch):
    """The colour of a crop is the argmax of its CLIP image embedding against each colour's averaged, normalised
    template embeddings (clip_benchmark's zero_shot_classifier), computed here by hand from the same model."""
    colors = rewards.ClipColors(str(tiny_clip_dir))
    image = (smooth_images(1, 40, 40, seed=3)[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    objects = [rewards.Detection((0, 0, 20, 40), 0.9), rewards.Detection((10, 5, 40, 30), 0.9)]
    got = colors(image, objects, "dog")
    scorer = colors.scorer
    for obj, name in zip(objects, got):
        crop = rewards.geneval_crop(image, obj)
        weights = []
        for c in rewards.GENEVAL_COLORS:
            texts = [t.format(c=c, name="dog") for t in rewards.ClipColors.TEMPLATES]
            weights.append(F.normalize(scorer.embed_texts(texts).mean(0), dim=-1))
        logits = scorer.embed_images(crop) @ torch.stack(weights).T
        assert name == rewards.GENEVAL_COLORS[int(logits.argmax())]


# ----------------------------------------------------------------------------------------------
# train.py

import shutil  # noqa: E402
import signal  # noqa: E402

# One gradient step per batch (the tiny preset takes 2): iteration 0 then measures the initial model itself, which the
# 1-against-N-process comparisons rely on, and every step is taken at ratio 1.
SMALL_RUN = ["--iterations", "2", "--num_prompts", "2", "--group_size", "4", "--micro_batch_size", "4",
             "--sampling_steps", "4", "--eval_every", "1", "--eval_samples", "6", "--tiny_fit_steps", "0",
             "--num_grad_steps", "1"]


def run_train(*args, nproc=0, timeout=600):
    """train.py as a subprocess (under torchrun with nproc processes if nproc)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if nproc else None  # 2 processes on 2 cores
    proc = subprocess.run([sys.executable, *launcher, str(ROOT / "train.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    # "done:" is printed by rank 0 after the export, whose collectives need every rank: the run is complete.
    aborted_after_done = "done: " in proc.stdout and bench.gloo_teardown_abort(proc.stdout + proc.stderr)
    complete = proc.returncode == 0 or (nproc and aborted_after_done)
    assert complete, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def one_line_stop(main, argv, capsys, code=2) -> str:
    """main(argv) (train.main or evaluate.main) stops with exit code `code` (2: bad input, 1: a stopped run) and one
    line on stderr starting "error: ", which is returned."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    lines = err.replace("\r", "\n").splitlines()  # model loading draws progress bars on stderr before it
    assert exit_info.value.code == code and lines[-1].startswith("error: "), (exit_info.value.code, err)
    assert "Traceback" not in err and sum(line.startswith("error") for line in lines) == 1, err
    return lines[-1]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Random tiny pipelines of every family saved with save_pretrained, and a jsonl prompt file."""
    root = tmp_path_factory.mktemp("pipelines")
    for family in models.ADAPTERS:
        models.tiny_pipeline(family, seed=0).save_pretrained(root / family)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"a {c} {t}", "color": c})
                                                  for c in ("red", "green", "blue") for t in ("car", "flower")))
    return root


@pytest.fixture(scope="module")
def sd3_run(tiny_dirs, tmp_path_factory):
    """Two LoRA iterations on the saved tiny SD3 pipeline, one process."""
    run_dir = tmp_path_factory.mktemp("runs") / "sd3"
    run_train("--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", run_dir, *SMALL_RUN)
    return run_dir


def lora_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(Path(run_dir) / "final" / "pytorch_lora_weights.safetensors")


def adapter_for(pipe, family, dtype=torch.float32, **settings):
    settings = {"resolution": 32, "sampling_steps": 5, "max_sequence_length": 8, **settings}
    return models.ADAPTERS[family](pipe, dtype, **settings)


# Guidance as each pipeline applies it when called the plain way, and the scale our rollouts then use: SD3 without CFG
# (the paper's rollouts), FLUX.1 through its distilled-guidance embedding (FlowAdapter.guidance), Qwen-Image with true
# CFG against its recommended negative prompt " ", FLUX.2 [klein] base with CFG against "" (both at the pipelines'
# default scale 4).
PLAIN_GUIDANCE = {"sd3": (1.0, dict(guidance_scale=1.0)), "flux": (1.0, dict(guidance_scale=3.5)),
                  "qwenimage": (4.0, dict(negative_prompt=" ", true_cfg_scale=4.0)), "flux2": (4.0, dict(guidance_scale=4.0))}


def flux2_layers(pipe, family) -> dict:
    """The plain call needs Qwen3 layers 9, 18 and 27: the tiny encoder (27 layers) has them; the one-layer encoder at
    real width gives its only layer three times (what Flux2.text_layers reads there)."""
    depth = pipe.text_encoder.config.num_hidden_layers if family == "flux2" else 27
    return {"text_encoder_out_layers": (depth,) * 3} if depth < 27 else {}


def assert_rollouts_equal_the_plain_pipeline_call(pipe, family, *, resolution, steps, latent_atol=1e-5):
    """Our encoding + velocity (guided as the pipeline guides) + Euler on our grid + decoding == `pipe(prompt=...,
    num_inference_steps=N)` called the plain way (the pipeline's own default sigmas, shift and mu), from the same
    initial noise."""
    # Prompts of different lengths and room for both: Qwen-Image then pads one and masks the padding.
    model = adapter_for(pipe, family, resolution=resolution, sampling_steps=steps, max_sequence_length=16)
    prompts = ["a red car", "a photo of the blue flower"]
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    scale, guidance = PLAIN_GUIDANCE[family]
    velocity = model.velocity if scale == 1 else model.guided(model.velocity, model.encode([model.negative_prompt]), scale)
    x0 = vgrpo.sample_ode(velocity, noise, model.encode(prompts), model.timesteps())
    # FLUX.2's pipeline takes and returns latents on the VAE's grid (its noise unpacked, its output unnormalised).
    flux2 = family == "flux2"
    call = partial(pipe, prompt=prompts, height=resolution, width=resolution, num_inference_steps=steps,
                   latents=model.to_vae_latents(noise) if flux2 else noise, max_sequence_length=16, **guidance,
                   **flux2_layers(pipe, family))
    ours = model.denormalize(model.to_vae_latents(x0)) if flux2 else x0
    torch.testing.assert_close(ours, call(output_type="latent").images, rtol=1e-5, atol=latent_atol)
    torch.testing.assert_close(model.decode(x0), call(output_type="pt").images, rtol=1e-4, atol=1e-4)
    return model


IMAGE_FAMILIES = [family for family, adapter in models.ADAPTERS.items() if not adapter.video]


@pytest.mark.parametrize("family", IMAGE_FAMILIES)  # Wan: its own test below (UniPC, CFG, frames)
def test_adapters_reproduce_the_diffusers_pipeline(family):
    assert_rollouts_equal_the_plain_pipeline_call(models.tiny_pipeline(family, seed=0), family, resolution=32, steps=5)


def test_scheduler_solver_steps_the_pipelines_own_scheduler_as_its_call_does():
    """--solver scheduler == `pipe()` with the scheduler the checkpoint ships: UniPC with flow sigmas (the Wan
    checkpoints') swapped into tiny SD3, where Euler on the same sigma grid is a different sampler; and with the
    default FlowMatchEuler it is the euler solver. A second-order scheduler is refused before any rollout."""
    from diffusers import FlowMatchHeunDiscreteScheduler, UniPCMultistepScheduler

    pipe = models.tiny_pipeline("sd3", seed=0)
    prompts = ["a red car", "a photo of the blue flower"]
    model = adapter_for(pipe, "sd3", sampling_steps=6)
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    call = partial(pipe, prompt=prompts, height=32, width=32, num_inference_steps=6, latents=noise, guidance_scale=1.0,
                   max_sequence_length=8, output_type="latent")
    cond = model.encode(prompts)
    with torch.no_grad():
        euler = model.sample(model.velocity, noise, cond, "euler")
        torch.testing.assert_close(model.sample(model.velocity, noise, cond, "scheduler"), euler, rtol=1e-5, atol=1e-5)
        pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        model = adapter_for(pipe, "sd3", sampling_steps=6)
        unipc = model.sample(model.velocity, noise, cond, "scheduler")
        torch.testing.assert_close(unipc, call().images, rtol=1e-5, atol=1e-5)
        assert (model.sample(model.velocity, noise, cond, "euler") - unipc).abs().max() > 1e-2  # the test can tell
    models.check_sampling_grid(model, "scheduler")
    pipe.scheduler = FlowMatchHeunDiscreteScheduler(shift=3.0)
    with pytest.raises(runs.ConfigError, match="order 2: use --solver heun"):
        models.check_sampling_grid(adapter_for(pipe, "sd3"), "scheduler")


@pytest.mark.parametrize("expand_timesteps", [False, True], ids=["wan2.1", "wan2.2-ti2v"])
def test_wan_rollouts_equal_the_plain_pipeline_call_with_its_unipc_scheduler_and_cfg(expand_timesteps):
    """Wan rollouts (UMT5 encoding, CFG 4 against the pipeline's default negative "", --solver scheduler on the
    checkpoints' UniPC) and decoding == `pipe(prompt, num_frames=5, num_inference_steps=4, latents=noise)`, and the
    transformer receives the timestep in the pipeline's form: (B,), or one per latent token under expand_timesteps."""
    pipe = models.tiny_wan_pipeline(seed=0, expand_timesteps=expand_timesteps)
    model = models.Wan(pipe, resolution=32, sampling_steps=4, max_sequence_length=16, num_frames=5)
    prompts = ["a red square moving left", "a photo of the blue square moving up"]
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    assert noise.shape == (2, 4, 2, 8, 8)  # 5 frames: the first alone, then 4 per latent frame
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["timestep"]), with_kwargs=True)
    call = partial(pipe, prompt=prompts, height=32, width=32, num_frames=5, num_inference_steps=4, latents=noise,
                   guidance_scale=4.0, max_sequence_length=16)
    with torch.no_grad():
        velocity = model.guided(model.velocity, model.encode([model.negative_prompt]), 4.0)
        x0 = model.sample(velocity, noise, model.encode(prompts), "scheduler")
    ours, seen[:] = seen[:], []
    torch.testing.assert_close(x0, call(output_type="latent").frames, rtol=1e-5, atol=1e-5)
    theirs = seen[::2]  # the pipeline's conditional pass of each step (ours: one batched CFG pass)
    assert [t.shape for t in ours] == [(4, *t.shape[1:]) for t in theirs] and len(ours) == 4
    assert theirs[0].shape == ((2, 2 * 4 * 4) if expand_timesteps else (2,))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a[:2].float(), b.float(), rtol=0, atol=1e-3)  # ours t * 1000 in float32
    video = model.decode(x0)
    assert video.shape == (2, 5, 3, 32, 32)
    torch.testing.assert_close(video, call(output_type="pt").frames, rtol=1e-4, atol=1e-4)
    pipe.transformer_2 = pipe.transformer
    with pytest.raises(ValueError, match="A14B"):
        models.Wan(pipe, resolution=32, sampling_steps=4, max_sequence_length=16)


def test_train_sd3_lora_from_a_saved_pipeline_writes_metrics_checkpoint_and_samples(sd3_run):
    metrics = read_metrics(sd3_run)
    assert [m["iteration"] for m in metrics] == [0, 1]
    for m in metrics:
        assert all(math.isfinite(m[k]) for k in ("loss", "reward_mean", "grad_norm", "surrogate_cv", "eval/reward_mean"))
        assert m["ratio_mean"] == pytest.approx(1.0) and m["skipped_steps"] == 0 and m["nfe_rollout"] == 4
    checkpoints = sd3_run / "checkpoints"
    assert (checkpoints / "latest").read_text() == "iter-000001"
    assert json.loads((checkpoints / "iter-000001" / "state.json").read_text()) == {"iteration": 1}
    assert json.loads((sd3_run / "config.json").read_text())["group_size"] == 4
    from PIL import Image

    grid = np.asarray(Image.open(sd3_run / "samples" / "iter-000001.png").convert("L"))
    records = json.loads((sd3_run / "samples" / "iter-000001.json").read_text())
    assert [r["noise_index"] for r in records] == list(range(6)) and all(r["seed"] == 0 for r in records)
    assert [r["prompt"] for r in records] == [f"a {c} {t}" for c in ("red", "green", "blue") for t in ("car", "flower")]
    assert all(0 <= r["rewards"]["color"] <= 1 for r in records)
    assert grid.shape[1] == 6 * 128 and grid.shape[0] > 128  # 6 cells of 128 px, a caption strip under them
    captions = grid[128:]
    assert (captions < 128).mean() > 0.01  # dark text on the white strip
    assert lora_weights(sd3_run) and all("lora" in k for k in lora_weights(sd3_run))


def assert_same_training(one, many):
    """Runs `one` (1 process) and `many` (several) trained on the same data to the same model."""
    one, many = Path(one), Path(many)
    a_metrics, b_metrics = read_metrics(one), read_metrics(many)
    for a, b in zip(a_metrics, b_metrics, strict=True):
        assert a["prompt_indices"] == b["prompt_indices"]
        # Same data: rollouts, rewards and advantages are world-size independent.
        for key in ("reward_mean", "reward_std", "frac_zero_std_groups", "surrogate_cv", "eval/reward_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # Iteration 0 runs on the initial weights, before any optimizer step, so it compares the model itself.
    # Rounding differs with batch sizes (the text encoder sees 1 vs 2 prompts), so rewards differ by an ULP and
    # advantages divide that by a within-group std of ~0.002: loss and gradient agree to ~1e-5 relative. A model
    # that differs across ranks (e.g. LoRA initialised per rank: FSDP2 then shards a mix of two models) is off
    # by percents.
    assert b_metrics[0]["loss"] == pytest.approx(a_metrics[0]["loss"], abs=1e-4)
    assert b_metrics[0]["grad_norm"] == pytest.approx(a_metrics[0]["grad_norm"], rel=1e-3)
    # After a step no element-wise tolerance is safe: Adam moves each weight by ~lr whatever its gradient's size,
    # so where a gradient component is near 0, ULP-level noise flips the sign of an lr-sized step (seen: 1 element
    # in 1024 off by 1.03e-4). Compare the whole update instead. lora_B starts at 0 in both runs, so it IS the
    # update: sign flips of a few near-zero components move its norm by sqrt(flipped fraction), a per-rank model
    # mismatch decorrelates it (relative difference ~1). Measured: 7.8e-4 for 2 processes.
    for kind in ("lora_B", "lora_A"):
        w_one = torch.cat([v.flatten() for k, v in sorted(lora_weights(one).items()) if kind in k])
        w_many = torch.cat([v.flatten() for k, v in sorted(lora_weights(many).items()) if kind in k])
        assert w_one.norm() > 0 and ((w_many - w_one).norm() / w_one.norm()).item() < 0.05, kind


def test_torchrun_fsdp2_two_processes_match_one_process(tiny_dirs, sd3_run, tmp_path):
    run_train("--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", tmp_path,
              *SMALL_RUN, nproc=2)
    assert_same_training(sd3_run, tmp_path)


def test_rollout_scores_each_chunk_while_the_next_one_samples():
    """train.rollout decodes and scores chunk i in a second thread while chunk i + 1 samples (chunk 0's reward waits
    for chunk 1's first velocity: one after the other it would time out), without gradients, and returns what
    decoding and scoring the final latents directly returns."""
    model = bench.tiny_model()
    cfg, steps = train.Config(rollout_batch_size=2), len(model.timesteps()) - 1
    second_chunk, calls, waited, grad_mode = threading.Event(), [], [], []

    def velocity(z, t, cond):
        calls.append(1)
        if len(calls) == steps + 1:
            second_chunk.set()
        return model.velocity(z, t, cond)

    def reward(images, texts, metadata):
        waited.append(second_chunk.wait(timeout=20))
        grad_mode.append(torch.is_grad_enabled())
        return rewards.load_reward("color")(images, texts, metadata)

    batch = [train.Prompt(t, {}) for t in ("a red car", "a blue car", "a green car", "a red cat")]
    cond = model.encode([p.text for p in batch])
    noise = torch.randn(4, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    x0, scores = train.rollout(cfg, model, velocity, batch, cond, noise, {"color": reward})
    assert waited == [True, True] and grad_mode == [False, False]
    torch.testing.assert_close(x0, vgrpo.sample_ode(model.velocity, noise, cond, model.timesteps(), solver="euler"))
    want = rewards.load_reward("color")(model.decode(x0), [p.text for p in batch], [{}] * 4)
    torch.testing.assert_close(scores["color"], want)


def test_compiled_blocks_sample_and_train_as_eager_ones_under_their_own_names():
    """--compile: each transformer block compiled in place (here with aot_eager: the same graphs and autograd as
    inductor, without generating kernels, so the CPU suite stays fast); the LoRA model samples and takes surrogate
    gradients as the eager one does, and its parameter names (checkpoints, the LoRA export) are unchanged."""
    import torch._dynamo

    eager, compiled = bench.tiny_model(), bench.tiny_model()
    for model in (eager, compiled):
        torch.manual_seed(0)
        train.make_trainable(model.transformer, train.Config())
    names = [n for n, _ in compiled.transformer.named_parameters()]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        train.compile_blocks(compiled.transformer, "aot_eager")
        assert [n for n, _ in compiled.transformer.named_parameters()] == names
        cond = eager.encode(["a red car", "a blue car"])
        noise = torch.randn(2, *eager.latent_shape(), generator=torch.Generator().manual_seed(0))
        x0 = [vgrpo.sample_ode(m.velocity, noise, cond, m.timesteps(), solver="euler") for m in (eager, compiled)]
        t, eps = vgrpo.draw_mc_pairs(1, 2, 2, tuple(noise.shape[1:]), generator=torch.Generator().manual_seed(1))
        grads = []
        for model in (eager, compiled):
            s, _ = vgrpo.elbo_surrogate(model.velocity, x0[0], cond, t, eps)
            s.sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.transformer.parameters() if p.requires_grad]))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled blocks did run
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(x0[1], x0[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_fsdp2_rollouts_gather_the_model_once_per_rollout_batch(tmp_path):
    """6 Euler steps on the tiny SD3 transformer sharded over 2 gloo ranks: one all-gather per FSDP unit (2 blocks +
    root) instead of one per block and step, the same samples, and the parameters sharded again afterwards."""
    out = bench.rollout_all_gathers()
    (per_step, x_per_step), (once, x_once) = out["False"], out["True"]
    blocks, steps = 2, 6
    # Per step: every block at every step, the root once (FSDP2 keeps the root unsharded after a forward).
    assert per_step["n"] == blocks * steps + 1 and once["n"] == blocks + 1
    assert per_step["bytes"] > 3 * once["bytes"]
    assert x_once == x_per_step


def test_torchrun_hsdp_2x2_matches_one_process(tiny_dirs, tmp_path):
    """4 processes as 2 replica groups x 2 shards (a 2-D device mesh) train the same model as 1 process."""
    common = ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--num_prompts", "4"]
    run_train(*common, "--run_dir", tmp_path / "one")
    proc = run_train(*common, "--run_dir", tmp_path / "hsdp", "--hsdp", "2", nproc=4)
    assert "world size 4 (HSDP: 2 replicas x 2 shards)" in proc.stdout
    assert_same_training(tmp_path / "one", tmp_path / "hsdp")


@pytest.fixture(scope="module")
def sd3_straight(tiny_dirs, tmp_path_factory):
    """sd3_run's settings for 4 iterations straight: what a resumed run must equal."""
    run_dir = tmp_path_factory.mktemp("runs") / "straight"
    run_train("--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--iterations", "4",
              "--run_dir", run_dir)
    return run_dir


def test_resume_gives_the_same_parameters_and_prompts_as_a_straight_run(tiny_dirs, sd3_run, sd3_straight, tmp_path):
    shutil.copytree(sd3_straight, tmp_path / "straight")
    shutil.copytree(sd3_run, tmp_path / "resumed")  # its 2 iterations, checkpoint at iteration 1
    metrics_file = tmp_path / "resumed" / "metrics.jsonl"
    logged_not_saved = {**read_metrics(tmp_path / "resumed")[-1], "iteration": 2}  # a stop after logging iteration 2
    metrics_file.write_text(metrics_file.read_text() + json.dumps(logged_not_saved) + "\n")
    proc = run_train("--resume", tmp_path / "resumed", "--iterations", "4")
    assert "resuming at iteration 2" in proc.stdout
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [m["iteration"] for m in resumed] == [0, 1, 2, 3]
    assert [m["prompt_indices"] for m in resumed] == [m["prompt_indices"] for m in straight]
    for k, v in lora_weights(tmp_path / "straight").items():
        torch.testing.assert_close(lora_weights(tmp_path / "resumed")[k], v, rtol=1e-6, atol=1e-8)


def test_resume_on_another_number_of_processes_reshards_and_trains_on(tiny_dirs, sd3_run, sd3_straight, tmp_path):
    """Before: FileNotFoundError for rng-rank1.pt. A checkpoint of 1 process resumes under 2 (DCP reshards the LoRA
    weights and AdamW state; rank 1 has no RNG file of its own and keeps its fresh seed, which nothing draws from),
    and theirs back in 1: the prompts are a straight run's and the weights agree to what 1 and 2 processes agree to."""
    shutil.copytree(sd3_straight, tmp_path / "straight")
    shutil.copytree(sd3_run, tmp_path / "mixed")  # 1 process, checkpoint at iteration 1
    assert "resuming at iteration 2" in run_train("--resume", tmp_path / "mixed", "--iterations", "3", nproc=2).stdout
    assert len(list((tmp_path / "mixed" / "checkpoints" / "iter-000002").glob("rng-rank*.pt"))) == 2
    assert "resuming at iteration 3" in run_train("--resume", tmp_path / "mixed", "--iterations", "4").stdout
    straight, mixed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "mixed")
    assert [m["prompt_indices"] for m in mixed] == [m["prompt_indices"] for m in straight]
    for kind in ("lora_B", "lora_A"):
        a = torch.cat([v.flatten() for k, v in sorted(lora_weights(tmp_path / "straight").items()) if kind in k])
        b = torch.cat([v.flatten() for k, v in sorted(lora_weights(tmp_path / "mixed").items()) if kind in k])
        assert ((b - a).norm() / a.norm()).item() < 0.05, kind


@pytest.mark.parametrize("family", ["qwenimage", "flux2", "wan"])
def test_new_family_trains_with_cfg_under_fsdp2_resumes_and_exports_exactly(family, tiny_dirs, tmp_path):
    """Qwen-Image, FLUX.2 [klein] and Wan through train.py with their pipelines' CFG (the presets' rollouts; Wan's on
    its own UniPC scheduler, 5-frame videos scored frame by frame): 2 processes train the model 1 process trains, the
    LoRA gathered from the shards loads into diffusers with the trained output, and a run resumed from iteration 1
    continues exactly as a straight one. With the reference KL (the adapters switched off on the sharded transformer)
    and an EMA (sharded, in the checkpoint)."""
    guards = ("--ref_kl_coef", "0.3", "--ema_decay", "0.5") if family == "flux2" else ()  # one family is enough
    video = ("--num_frames", "5", "--solver", "scheduler") if family == "wan" else ()
    common = ["--model", tiny_dirs / family, "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--cfg_scale", "4",
              *guards, *video]
    run_train(*common, "--run_dir", tmp_path / "one")
    run_train(*common, "--run_dir", tmp_path / "two", nproc=2)
    assert_same_training(tmp_path / "one", tmp_path / "two")
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert one[0]["ref_kl"] == two[0]["ref_kl"] == 0.0
    if guards:  # trained on, ref_kl covers every sample; only logged, one micro-batch per rank (other samples)
        assert two[1]["ref_kl"] == pytest.approx(one[1]["ref_kl"], rel=0.05)
    assert_export_reproduces_training(tmp_path / "two", tiny_dirs / family, family, lora=True)
    if family == "wan":  # evaluation samples: an animated grid of the 5 frames
        from PIL import Image

        assert Image.open(tmp_path / "one" / "samples" / "iter-000001.webp").n_frames == 5
    run_train(*common, "--run_dir", tmp_path / "straight", "--iterations", "3")
    shutil.copytree(tmp_path / "one", tmp_path / "resumed")  # checkpoint at iteration 1
    assert "resuming at iteration 2" in run_train("--resume", tmp_path / "resumed", "--iterations", "3").stdout
    assert [m["prompt_indices"] for m in read_metrics(tmp_path / "resumed")] == [
        m["prompt_indices"] for m in read_metrics(tmp_path / "straight")]
    for k, v in lora_weights(tmp_path / "straight").items():
        torch.testing.assert_close(lora_weights(tmp_path / "resumed")[k], v, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_checkpoints_the_current_iteration_and_exits_cleanly(sig, tiny_dirs, tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
           "--run_dir", tmp_path, *SMALL_RUN, "--iterations", "1000", "--save_every", "1000", "--eval_every", "0"]
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((tmp_path / "metrics.jsonl").is_file() and len(read_metrics(tmp_path)) >= 2):
        assert proc.poll() is None and time.time() < deadline, "training did not get going"
        time.sleep(0.2)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-2000:]
    last = read_metrics(tmp_path)[-1]["iteration"]
    assert f"stop requested (SIGTERM/SIGINT): checkpoint of iteration {last} saved" in output and last < 999
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # no half-written checkpoint left behind
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"iter-{last:06d}"
    assert not (tmp_path / "final").exists()  # stopped early: no final export


def test_ctrl_c_before_the_first_iteration_stops_quietly(tmp_path):
    """Before: a KeyboardInterrupt traceback from inside the tiny model's fit. Nothing has been trained, so there is
    nothing to save: one line, exit 130."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--run_dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not run_dir.is_dir():  # main() has checked the run directory: past the imports, before the model
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    time.sleep(1)  # building and fitting the tiny model (about 30 s)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "stopped (Ctrl-C) before the first iteration: nothing to save"


def test_a_ctrl_c_that_a_library_swallows_during_setup_still_stops_before_training(tiny_dirs, tmp_path, monkeypatch,
                                                                                  capsys):
    """Seen once in CI: Ctrl-C one second into the tiny model's setup, and the run trained on for a minute (something
    during setup caught the KeyboardInterrupt). Here the model loading catches it on purpose: the run still stops
    before the first iteration, in one line, exit 130, nothing trained."""
    real_load = train.load_pipeline

    def swallowing_load(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except BaseException:  # what a library did
            pass
        return real_load(*args, **kwargs)

    monkeypatch.setattr(train, "load_pipeline", swallowing_load)
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training started after Ctrl-C"))
    try:
        with pytest.raises(SystemExit) as exit_info:
            train.main([str(a) for a in ("--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
                                         "--run_dir", tmp_path, *SMALL_RUN)])
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "stopped (Ctrl-C) before the first iteration: nothing to save"


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


class FaultyRewardServer:
    """Scores like the color reward for the first `good` requests, then fails as `fault` says."""

    def __init__(self, fault: str, good: int):
        self.fault, self.good, self.count = fault, good, 0
        color = rewards.load_reward("color")
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.count += 1
                scores = color(torch.stack([rewards.decode_png(d) for d in request["images"]]), request["prompts"],
                               request["metadata"]).tolist()
                status, body = 200, {"scores": scores}
                if outer.count > outer.good:
                    status, body = {"500": (500, {"error": "CUDA out of memory"}),
                                    "nan": (200, {"scores": [float("nan")] * len(scores)}),
                                    "count": (200, {"scores": scores[:-1]})}[outer.fault]
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("fault,reason", [("down", "gave no answer after 2 attempts"),
                                          ("500", "HTTP 500: {\"error\": \"CUDA out of memory\"}"),
                                          ("nan", "malformed response")])
def test_a_reward_server_failing_mid_run_stops_in_one_line_and_the_run_resumes(fault, reason, tiny_dirs, tmp_path,
                                                                                capsys):
    """Before: the right message under a traceback. Now one line, exit 1, nothing saved from the failed iteration,
    and --resume carries on once the server answers again (one case resumes; the others stop the same way)."""
    server = FaultyRewardServer("500" if fault == "down" else fault, good=2)  # iteration 0: 2 requests of 4
    options = json.dumps({"http": {"url": server.url, "retries": 2, "timeout": 20.0}})
    argv = ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", tmp_path, *SMALL_RUN,
            "--rewards", "http", "--reward_options", options, "--eval_every", "0", "--save_every", "1",
            "--rollout_batch_size", "4"]
    if fault == "down":
        real = rewards.HttpReward._request

        def gone(self, body):
            if server.count >= 2:
                raise ConnectionRefusedError(111, "Connection refused")
            return real(self, body)
        rewards.HttpReward._request, restore = gone, real
    try:
        message = one_line_stop(train.main, argv, capsys, code=1)
    finally:
        if fault == "down":
            rewards.HttpReward._request = restore
        server.close()
    assert message.startswith("error: reward http: ") and reason in message and "--resume" in message
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter-000000" and not (tmp_path / "final").exists()
    assert [m["iteration"] for m in read_metrics(tmp_path)] == [0]
    if fault == "500":
        healthy = FaultyRewardServer("500", good=10**6)
        options = json.dumps({"http": {"url": healthy.url, "retries": 2, "timeout": 20.0}})
        try:
            train.main(["--resume", str(tmp_path), "--reward_options", options])
        finally:
            healthy.close()
        assert [m["iteration"] for m in read_metrics(tmp_path)] == [0, 1] and (tmp_path / "final").exists()


def test_missing_tracker_package_is_one_clear_error(monkeypatch, capsys):
    real = train.importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name))
    monkeypatch.setattr(train, "load_pipeline", lambda *a: pytest.fail("a model was loaded"))
    assert "--tracker tensorboard: the package is not installed" in one_line_stop(train.main, ["--tracker", "tensorboard"],
                                                                                  capsys)


def test_a_sigma_grid_that_is_not_finite_stops_before_training(tiny_dirs, tmp_path, monkeypatch, capsys):
    """A saved pipeline whose scheduler has shift 0 (sigma(1) = 0 / 0) is refused with one clear error after loading,
    instead of NaN rollouts that read as a diverged run."""
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training started"))
    model = tmp_path / "sd3"
    shutil.copytree(tiny_dirs / "sd3", model)
    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "shift": 0.0}))
    message = one_line_stop(train.main, ["--model", model, "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir",
                                         tmp_path / "run", *SMALL_RUN], capsys)
    assert message.startswith("error: StableDiffusion3Pipeline's scheduler gives a sigma grid that is not finite for "
                              "--sampling_steps 4")


def test_cfg_on_a_step_distilled_hub_checkpoint_is_refused_from_its_model_index(monkeypatch, tmp_path, capsys):
    """A FLUX.2 [klein] hub id the project does not list (the distilled 9B, say) is read from its model_index.json:
    is_distilled there refuses --cfg_scale, as Flux2KleinPipeline would ignore it; the base model trains with it."""
    from diffusers import DiffusionPipeline

    indexes = {"black-forest-labs/FLUX.2-klein-9B": {"_class_name": "Flux2KleinPipeline", "is_distilled": True},
               "black-forest-labs/FLUX.2-klein-base-9B": {"_class_name": "Flux2KleinPipeline", "is_distilled": False}}
    monkeypatch.setattr(DiffusionPipeline, "load_config", lambda model, **kw: indexes[model])
    monkeypatch.setattr(train, "train", lambda cfg, family, *a: pytest.fail(f"{cfg.model} reached training"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red car\n")
    assert "klein-9B is step-distilled" in one_line_stop(train.main, ["--model", "black-forest-labs/FLUX.2-klein-9B",
                                                                     "--cfg_scale", "4", "--prompts", prompts], capsys)
    base = train.parse_config(["--model", "black-forest-labs/FLUX.2-klein-base-9B", "--cfg_scale", "4", "--prompts",
                               str(prompts)])
    assert train.validate(base, 1) == "flux2"


def test_lora_targets_that_match_no_layer_stop_before_training(tiny_dirs, tmp_path, monkeypatch, capsys):
    """peft raises when no target matches and silently drops a target when another one does; both are refused."""
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training started"))
    for targets in ("nope", "to_q,to_qq"):
        message = one_line_stop(train.main, ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
                                             "--run_dir", tmp_path, *SMALL_RUN, "--lora_targets", targets], capsys)
        bad = targets.split(",")[-1]
        assert message.startswith(f"error: --lora_targets: {bad} match no Linear layer of the SD3Transformer2DModel; "
                                  "its Linear layers end in ") and "to_out.0" in message


def plant_pickle(checkpoint, marker):
    """Replace .metadata by a pickle that creates `marker` when unpickled, and re-sign the manifest as an attacker
    who can write the directory would."""
    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (checkpoint / ".metadata").write_bytes(pickle.dumps(Exploit()))
    (checkpoint / runs.MANIFEST).write_text(json.dumps(runs.manifest(checkpoint)))


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 8])
    path.write_bytes(bytes(data))


TAMPERING = {
    "flipped bytes": (lambda ckpt, marker: flip_bytes(next(ckpt.glob("*.distcp"))), "differ from"),
    "truncated shard": (lambda ckpt, marker: os.truncate(next(ckpt.glob("*.distcp")), 100), "differ from"),
    "removed rng file": (lambda ckpt, marker: (ckpt / "rng-rank0.pt").unlink(), "rng-rank0.pt differ from"),
    "no manifest": (lambda ckpt, marker: (ckpt / runs.MANIFEST).unlink(), "manifest.json is missing"),
    "planted pickle": (plant_pickle, "system is not part of a checkpoint's metadata"),
    "latest outside": (lambda ckpt, marker: (ckpt.parent / "latest").write_text("../../elsewhere"), "not an iter-NNNNNN"),
}


@pytest.mark.parametrize("how", TAMPERING)
def test_resume_refuses_a_tampered_checkpoint_in_one_line(how, sd3_run, tmp_path, capsys):
    """Before: flipped bytes resumed silently (final |w| 8.5e12 instead of 0.135), truncated files gave tracebacks and
    a planted pickle ran. Now each is refused before any tensor is loaded, and nothing planted runs."""
    run = tmp_path / "run"
    shutil.copytree(sd3_run, run)
    marker = tmp_path / "pwned"
    tamper, message = TAMPERING[how]
    tamper(run / "checkpoints" / "iter-000001", marker)
    text = one_line_stop(train.main, ["--resume", run, "--iterations", "3"], capsys)
    assert text.startswith(f"error: --resume {run}: refusing the checkpoint: ") and message in text
    assert not marker.exists()


def resign(checkpoint):
    """Rewrite the manifest to match the damaged files, as a crash-free tool that copied them would."""
    (checkpoint / runs.MANIFEST).write_text(json.dumps(runs.manifest(checkpoint)))


def rewrite_tensors(checkpoint, change):
    """Load the checkpoint's tensors, change(state) them, write them back as DCP, re-sign the manifest."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    flat = checkpoint.parent / "flat.pt"
    dcp_to_torch_save(checkpoint, flat)
    state = torch.load(flat, weights_only=False)
    change(state)
    torch.save(state, flat)
    for shard in checkpoint.glob("*.distcp"):
        shard.unlink()
    torch_save_to_dcp(flat, checkpoint)
    flat.unlink()
    resign(checkpoint)


def nan_weight(state):
    name = next(k for k in state["model"] if "lora_B" in k)
    state["model"][name] = torch.full_like(state["model"][name], float("nan"))


def metadata_pointing_outside(checkpoint):
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    shard = next(checkpoint.glob("*.distcp"))
    shutil.copy(shard, checkpoint.parent.parent.parent / "outside.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../../../outside.distcp"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    resign(checkpoint)


def edit_config(run, **changes):
    config = run / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


DAMAGE = {  # the manifest re-signed each time: these get past it
    "truncated shard": (lambda run, ckpt: (os.truncate(next(ckpt.glob("*.distcp")), 100), resign(ckpt)),
                        "is truncated"),
    "NaN weights": (lambda run, ckpt: rewrite_tensors(ckpt, nan_weight), "holds values that are not finite (weight "),
    "torn rng file": (lambda run, ckpt: (os.truncate(ckpt / "rng-rank0.pt", 50), resign(ckpt)), "rng-rank0.pt cannot be read"),
    "garbage state.json": (lambda run, ckpt: ((ckpt / "state.json").write_text("{iteration"), resign(ckpt)),
                           "state.json cannot be read"),
    "metadata pointing outside": (lambda run, ckpt: metadata_pointing_outside(ckpt), "outside the checkpoint folder"),
    "config.json lr edited": (lambda run, ckpt: edit_config(run, lr="fast"), "lr is 'fast', not a float"),
    "config.json lora_rank edited": (lambda run, ckpt: edit_config(run, lora_rank=16), "does not fit the model and adapter"),
    "config.json model edited": (lambda run, ckpt: edit_config(run, model="tiny-flux"), "does not fit the model and adapter"),
}


@pytest.mark.parametrize("how", DAMAGE)
def test_resume_refuses_a_damaged_checkpoint_or_edited_config_in_one_line(how, sd3_run, tmp_path, capsys, monkeypatch):
    """Before: PytorchStreamReader / JSONDecodeError / size-mismatch tracebacks, a TypeError for "lr": "fast", and a
    .metadata of allowed classes could make --resume read a file outside the checkpoint and train on it."""
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training resumed"))
    run = tmp_path / "runs" / "run"
    shutil.copytree(sd3_run, run)
    damage, message = DAMAGE[how]
    damage(run, run / "checkpoints" / "iter-000001")
    text = one_line_stop(train.main, ["--resume", run, "--iterations", "3"], capsys)
    assert message in text, text


def test_checkpoint_unpickler_reads_what_dcp_writes(sd3_run):
    """The allow-list is complete for real checkpoints (model + AdamW state): the metadata loads and equals plain
    pickle's reading of it."""
    path = sd3_run / "checkpoints" / "iter-000001" / ".metadata"
    with open(path, "rb") as file:
        safe = runs.CheckpointUnpickler(file).load()
    assert safe.state_dict_metadata.keys() == pickle.loads(path.read_bytes()).state_dict_metadata.keys()
    assert any(k.startswith("optim.state.") for k in safe.state_dict_metadata)


def test_export_replaces_final_only_when_the_new_one_is_whole(tiny_dirs, tmp_path, monkeypatch):
    """A crash in the middle of writing the export leaves the previous final/ as it was (before: a truncated
    final/*.safetensors until a resume rewrote it)."""
    model = train.load_pipeline(train.Config(model=str(tiny_dirs / "sd3")), "sd3", torch.device("cpu"), torch.float32)
    train.make_trainable(model.transformer, train.Config())
    runs.export_final(tmp_path / "final", model, lora=True, rank=0)
    before = (tmp_path / "final" / "pytorch_lora_weights.safetensors").read_bytes()
    real_write = runs.write_export

    def crash_midway(out, *args):
        real_write(out, *args)
        os.truncate(out / "pytorch_lora_weights.safetensors", 100)
        raise KeyboardInterrupt  # killed before the rename

    monkeypatch.setattr(runs, "write_export", crash_midway)
    with torch.no_grad():
        next(p for p in model.transformer.parameters() if p.requires_grad).add_(1)
    with pytest.raises(KeyboardInterrupt):
        runs.export_final(tmp_path / "final", model, lora=True, rank=0)
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").read_bytes() == before


def test_a_full_disk_at_a_save_stops_in_one_line_and_keeps_the_previous_checkpoint(tiny_dirs, tmp_path, monkeypatch):
    """Before: OSError 28 as a traceback and a .tmp-* directory left behind."""
    cfg = train.Config(model=str(tiny_dirs / "sd3"))
    model = train.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    train.make_trainable(model.transformer, cfg)
    optimizer = torch.optim.AdamW([p for p in model.transformer.parameters() if p.requires_grad])
    runs.save_checkpoint(tmp_path, 0, model.transformer, optimizer, rank=0)
    real_save = runs.dcp.save

    def fill_the_disk(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # some shards written, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runs.dcp, "save", fill_the_disk)
    with pytest.raises(runs.RunStopped) as error:
        runs.save_checkpoint(tmp_path, 1, model.transformer, optimizer, rank=0)
    assert "could not write checkpoint" in str(error.value) and "No space left on device" in str(error.value)
    assert "latest still names iter-000000" in str(error.value) and "\n" not in str(error.value)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "iter-000000" and sorted(p.name for p in root.iterdir()) == ["iter-000000", "latest"]
    assert runs.checkpoint_problem(root / "iter-000000") == ""  # intact, resumable


REDUCE_WORKER = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import runs
dist.init_process_group("gloo")
rank = dist.get_rank()
out = runs.reduce_metrics({"x_max": float(rank), "x_min": float(rank), "x": float(rank), "nan_max": float(rank == 1)},
                          torch.device("cpu"))
out["failure"] = runs.first_failure("" if rank == 0 else "rank 1 failed")
open(f"{sys.argv[2]}/rank{rank}.json", "w").write(json.dumps(out))  # one file each: torchrun interleaves stdout
dist.destroy_process_group()
"""


def test_ranks_that_disagree_reduce_to_max_min_mean_and_the_first_failure(tmp_path):
    """A NaN or a stop request seen by one rank only must stop every rank: _max keys take the largest value (before,
    MIN for _max survived every test: all ranks agreed in all of them); a failure message reaches all ranks."""
    worker = tmp_path / "worker.py"
    worker.write_text(REDUCE_WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(worker), str(ROOT), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"x_max": 1.0, "x_min": 0.0, "x": 0.5, "nan_max": 1.0, "failure": "rank 1 failed"}


def test_divergence_counts_consecutive_skipped_steps(monkeypatch):
    cfg = train.Config(max_skipped_steps=3)
    layer = torch.nn.Linear(2, 2)
    ok = partial(train.divergence, torch.zeros(2), {"color": torch.zeros(2)}, transformer=layer, cfg=cfg,
                 device=torch.device("cpu"))
    assert ok(skipped_run=2) == "" and "3 consecutive gradient steps were skipped" in ok(skipped_run=3)
    # one reward of several going NaN (an HTTP reward next to pickscore) is enough
    nan_beside = train.divergence(torch.zeros(2), {"color": torch.zeros(2), "http": torch.tensor([0.0, math.nan])}, 0,
                                  layer, cfg, torch.device("cpu"))
    assert nan_beside == "the rewards are not finite"
    # skips scattered over iterations of 2 gradient steps are not a run of skips; whole iterations skipped are
    run = 0
    for skipped in (1, 1, 1, 1, 1, 1):
        run = train.consecutive_skips(run, skipped, num_grad_steps=2)
        assert run == 0
    for skipped, expected in ((2, 2), (2, 4), (1, 0), (2, 2)):
        run = train.consecutive_skips(run, skipped, num_grad_steps=2)
        assert run == expected
    with torch.no_grad():
        layer.weight[0, 0] = float("inf")
    assert ok(skipped_run=0) == "the trainable weights are not finite"


def run_on_a_terminal(cmd, timeout=600) -> str:
    """cmd with stdout and stderr on a pseudo-terminal of 160 columns (tqdm draws bars only on a terminal); its output."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, cwd=ROOT)
    os.close(follower)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once the process has closed its end
        while chunk := os.read(leader, 65536):
            seen += chunk
    os.close(leader)
    output = seen.decode(errors="replace")
    assert proc.wait(timeout=timeout) == 0, output[-3000:]
    return output


def test_default_run_from_the_readme_raises_the_reward(tmp_path):
    """`python train.py`: the tiny SD3 model fitted to toy images learns to paint the colour its prompt names.
    Another CPU's float rounding makes it another run, so the bounds come from the spread over RL seeds (one fitted
    model, 128 evaluation samples): the eval gain (last 3 evaluations against the first) was 0.037-0.055 over 5 seeds
    with the tiny preset's 2 gradient steps and KL (bench.py section 9, mean 0.044), 0.031-0.054 over 4 seeds with the
    former single step; the bound sits below both. With the former 8 evaluation samples one CPU's run ended at +0.019
    after +0.040 at iteration 10: the eval noise of 8 samples."""
    output = run_on_a_terminal([sys.executable, str(ROOT / "train.py"), "--run_dir", str(tmp_path)])
    assert "iteration | reward_mean" in output
    # The first minute and the last screen, as on a terminal: a progress bar for the tiny fit, the iterations and each
    # evaluation, no warning a user cannot act on, and a closing summary naming the files to open next.
    for bar in ("fitting the tiny model to toy images", "V-GRPO", "evaluating"):
        assert bar in output, output[-2000:]
    assert not re.search(r"warn|deprecat", output, re.IGNORECASE), output[-3000:]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    for line in (f"done: {tmp_path}", "samples  ", "curves   ", "export   ", f"python evaluate.py --runs {tmp_path}"):
        assert line in output, output[-2000:]
    metrics = read_metrics(tmp_path)
    evals = [m["eval/reward_mean"] for m in metrics if "eval/reward_mean" in m]
    assert len(evals) == 5 and np.mean(evals[-3:]) > evals[0] + 0.015, evals  # 2.3 std below the mean gain
    records = json.loads((tmp_path / "samples" / "iter-000000.json").read_text())  # the bounds hold for 128 samples only
    assert len(records) == 128 and len({(r["prompt"], r["noise_index"]) for r in records}) == 128
    first, last = np.mean([m["reward_mean"] for m in metrics[:5]]), np.mean([m["reward_mean"] for m in metrics[-10:]])
    assert last > first, (first, last)



def test_curves_are_drawn_from_metrics_and_a_missing_matplotlib_is_a_hint(tmp_path, monkeypatch):
    lines = [{"iteration": i, "reward/color_mean": 0.5 + i / 100, "kl": 0.01, "approx_kl": 0.0, "clipfrac": 0.1,
              **({"eval/color_mean": 0.5, "eval/reward_mean": 0.5} if i % 2 == 0 else {})} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"iteration": 6, "rew')
    assert runs.draw_curves(tmp_path)  # the torn last line is left out
    from PIL import Image

    assert Image.open(tmp_path / "curves.png").size[0] > 4 * Image.open(tmp_path / "curves.png").size[1] / 2
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert not runs.plot_curves(lines, tmp_path / "none.png") and not (tmp_path / "none.png").exists()


# ----------------------------------------------------------------------------------------------
# prompts.py: named sets


def test_geneval_test_split_is_genevals_own_evaluation_set():
    """GenEval's create_prompts.py written out gives its published prompts/evaluation_metadata.jsonl byte for byte:
    the sha256 below is that file's (djghosh13/geneval), 553 records."""
    records = [p.metadata for p in prompt_sets.load("geneval:test")]
    text = "".join(json.dumps(r) + "\n" for r in records)
    assert len(records) == 553
    assert hashlib.sha256(text.encode()).hexdigest() == "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13"


def test_geneval_train_split_has_every_task_and_no_test_prompt_beyond_single_objects():
    train_set = prompt_sets.load("geneval")
    test_texts = {p.text for p in prompt_sets.load("geneval:test") if p.metadata["tag"] != "single_object"}
    tags = collections.Counter(p.metadata["tag"] for p in train_set)
    assert set(tags) == set(rewards.GENEVAL_TASKS) and min(tags.values()) > 1000
    assert not test_texts & {p.text for p in train_set}
    for p in train_set[::97]:
        rewards.check_prompt("geneval", p.text, p.metadata)


def test_ocr_sets_quote_a_text_and_share_none_between_train_and_test():
    train_set, test_set = prompt_sets.load("ocr"), prompt_sets.load("ocr:test")
    assert (len(train_set), len(test_set)) == (20_000, 1000)
    for p in train_set[::50] + test_set[::10]:
        assert rewards.ocr_target(p.text) == rewards.ocr_target(p.text, p.metadata) == p.metadata["text"]
    norm = lambda ps: {p.metadata["text"].lower() for p in ps}  # noqa: E731
    assert not norm(train_set) & norm(test_set)


def fake_hub_cache(root, repo, revision, files: dict):
    """The layout huggingface_hub's cache has after a download (datasets--ORG--NAME/snapshots/REVISION/FILE)."""
    snapshot = root / f"datasets--{repo.replace('/', '--')}" / "snapshots" / revision
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    return root


@pytest.fixture
def hub_mirror(tmp_path, monkeypatch):
    """A local mirror of the hub files the named sets read, served through huggingface_hub's own cache lookup (no
    network: HF_HUB_OFFLINE), in the format each dataset publishes."""
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(captions):
        buffer = io.BytesIO()
        pq.write_table(pa.table({"caption": captions, "other": list(range(len(captions)))}), buffer)
        return buffer.getvalue()

    repo, revision = prompt_sets.HPDV2
    fake_hub_cache(tmp_path, repo, revision, {
        "train.json": json.dumps([{"prompt": "a cat", "image_path": ["1.jpg"]}, {"prompt": " a cat "},
                                  {"prompt": "a dog on a hill"}]).encode(),
        "test.json": json.dumps([{"prompt": f"test prompt {i}", "rank": [0, 1]} for i in range(4)]).encode(),
        "benchmark/drawbench.json": json.dumps(["A red colored car.", "A bird scaring a scarecrow."]).encode()})
    repo, revision = prompt_sets.PICKAPIC
    fake_hub_cache(tmp_path, repo, revision, {
        "data/test_unique-00000-of-00001-73a51cbb6488571d.parquet": parquet(["a castle", "a boat", "a castle"]),
        "data/train-00000-of-00001-b138676ed2d1f52a.parquet": parquet(["a castle", "a wizard", "", "a wizard", "a moon"])})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_hub_sets_are_read_from_the_hub_cache_and_converted_to_prompts(hub_mirror):
    said = []
    texts = lambda spec: [p.text for p in prompt_sets.load(spec, say=said.append)]  # noqa: E731
    assert texts("hpdv2") == ["a cat", "a dog on a hill"]  # stripped, first occurrence of each
    assert texts("hpdv2:test") == [f"test prompt {i}" for i in range(4)]
    assert texts("drawbench:test") == ["A red colored car.", "A bird scaring a scarecrow."]
    assert texts("pickapic:test") == ["a castle", "a boat"]
    assert texts("pickapic") == ["a wizard", "a moon"]  # train minus test, no empty caption
    assert all("licence" in line and "prompts from hub dataset" in line for line in said)


@pytest.mark.parametrize("spec,message", [
    ("nonsense", "neither a prompt file .* nor a named set"),
    ("drawbench:train", "has no 'train' split; it has test"),
    ("ocr:validation", "has no 'validation' split"),
])
def test_bad_prompt_set_names_are_one_line(spec, message):
    with pytest.raises(runs.ConfigError, match=message):
        prompt_sets.load(spec)


def test_offline_without_the_file_or_with_a_corrupt_one_is_one_line(hub_mirror):
    repo, revision = prompt_sets.HPDV2
    test_file = hub_mirror / f"datasets--{repo.replace('/', '--')}" / "snapshots" / revision / "test.json"
    test_file.write_text('[{"prompt": "trunc')
    with pytest.raises(runs.ConfigError, match="cannot be read .*delete it and run again"):
        prompt_sets.load("hpdv2:test")
    test_file.unlink()
    with pytest.raises(runs.ConfigError, match=r"needs test.json of the hub dataset ymhao/HPDv2 .*python prompts.py hpdv2:test"):
        prompt_sets.load("hpdv2:test")


def test_train_runs_ocr_on_the_ocr_set_and_logs_finite_ocr_rewards(tiny_dirs, tmp_path, capsys):
    """The done-when of the OCR task on a fresh clone: it runs and evaluates offline (a 32 px model writes nothing
    legible, so the rewards are near 0, but finite)."""
    run_dir = tmp_path / "ocr"
    train.main(["--model", str(tiny_dirs / "sd3"), "--prompts", "ocr", "--rewards", "ocr", "--iterations", "1",
                "--num_prompts", "2", "--group_size", "2", "--micro_batch_size", "2", "--eval_samples", "4",
                "--eval_every", "1", "--run_dir", str(run_dir)])
    out = capsys.readouterr().out
    assert "prompts: ocr:train, 20000 prompts" in out and "prompts: ocr:test, 1000 prompts" in out
    line = read_metrics(run_dir)[0]
    assert 0 <= line["reward/ocr_mean"] <= 1 and 0 <= line["eval/ocr_mean"] <= 1
    samples = json.loads((run_dir / "samples" / "iter-000000.json").read_text())
    assert all('"' in s["prompt"] for s in samples)  # evaluated on the test split's quoted texts


def test_train_runs_geneval_through_a_detector_server(tiny_dirs, tmp_path):
    server = rewards.reward_server(stub_geneval_scorer(), "geneval", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run_dir = tmp_path / "geneval"
        options = json.dumps({"geneval": {"url": f"http://127.0.0.1:{server.server_port}"}})
        train.main(["--model", str(tiny_dirs / "sd3"), "--prompts", "geneval", "--rewards", "geneval",
                    "--reward_options", options, "--iterations", "1", "--num_prompts", "2", "--group_size", "2",
                    "--micro_batch_size", "2", "--eval_samples", "4", "--eval_every", "1", "--run_dir", str(run_dir)])
    finally:
        server.shutdown()
        server.server_close()
    line = read_metrics(run_dir)[0]
    assert math.isfinite(line["reward/geneval_mean"]) and math.isfinite(line["eval/geneval_mean"])


# ----------------------------------------------------------------------------------------------
# evaluate.py


def run_evaluate(*args, nproc=0, timeout=600):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc \
        else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "evaluate.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_evaluate_takes_a_video_runs_prompts_and_may_score_its_monitors(tmp_path):
    """evaluate.py on a tiny-wan run: the built-in prompts are the video ones (the motion reward needs their direction
    words), and --rewards may name the run's monitor (before: "already trained on", as validation met the run's
    --monitor_rewards beside the evaluated rewards). Checked without a model: the configuration evaluate.py builds."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("iter-000000")
    config = train.Config(preset="tiny-wan", **train.PRESETS["tiny-wan"])
    (run / "config.json").write_text(json.dumps(asdict(config)))
    args, cfg = evaluate.parse_args(["--runs", str(run), "--rewards", "color,motion"])
    assert train.validate(cfg, 1) == "wan" and cfg.num_frames == config.num_frames
    spec, listed = evaluate.evaluation_prompts(args, cfg, say=lambda *_: None)
    assert [p.text for p in listed] == models.TINY_VIDEO_PROMPTS


def test_evaluate_scores_base_run_and_export_side_by_side(sd3_run, tmp_path):
    """The same prompts and noise for every row: the exported LoRA scores exactly as the run's checkpoint, the base
    differently; the table has a 95% interval per reward; two processes give the same scores as one."""
    args = ["--runs", str(sd3_run), "--loras", str(sd3_run / "final"), "--rewards", "color,jpeg_compressibility",
            "--max_prompts", "6", "--samples_per_prompt", "2"]
    one = run_evaluate(*args, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    result = json.loads((tmp_path / "one" / "eval.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["base", f"run:{sd3_run}", f"lora:{sd3_run / 'final'}"]
    run, lora, base = rows[f"run:{sd3_run}"], rows[f"lora:{sd3_run / 'final'}"], rows["base"]
    assert len(run["scores"]["color"]) == 12 and run["scores"] == lora["scores"]
    assert base["scores"]["color"] != run["scores"]["color"]
    per_prompt = np.asarray(run["scores"]["color"]).reshape(6, 2).mean(1)
    assert run["metrics"]["color"]["mean"] == pytest.approx(per_prompt.mean())
    assert run["metrics"]["color"]["ci95"] == pytest.approx(1.96 * per_prompt.std(ddof=1) / math.sqrt(6))
    table = (tmp_path / "one" / "table.md").read_text()
    assert table.count("\n| ") == 3 and "±" in table and table.splitlines()[0] in one.stdout
    assert (tmp_path / "one" / "grid.png").stat().st_size > 0
    two = run_evaluate(*args, "--out", str(tmp_path / "two"), nproc=2)
    assert two.returncode == 0, two.stderr[-2000:]
    rows_two = json.loads((tmp_path / "two" / "eval.json").read_text())["rows"]
    for name in rows:
        for reward in ("color", "jpeg_compressibility"):
            np.testing.assert_allclose(rows_two[name]["scores"][reward], rows[name]["scores"][reward], atol=1e-5)


def test_evaluate_reports_genevals_accuracy_per_task(sd3_run, tmp_path):
    server = rewards.reward_server(stub_geneval_scorer(), "geneval", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        options = json.dumps({"geneval": {"url": f"http://127.0.0.1:{server.server_port}"}})
        result = run_evaluate("--runs", str(sd3_run), "--no-base", "--prompts", "geneval", "--rewards", "geneval",
                              "--reward_options", options, "--max_prompts", "200", "--out", str(tmp_path / "g"))
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "g" / "eval.json").read_text())["rows"]
    row = rows[f"run:{sd3_run}"]
    accuracy, tags = row["extras"]["geneval"]["accuracy"], [p.metadata["tag"] for p in prompt_sets.load("geneval:test")[:200]]
    tasks = {t: np.mean([a for a, tag in zip(accuracy, tags) if tag == t]) for t in set(tags)}
    assert row["metrics"]["geneval accuracy"]["tasks"] == pytest.approx(tasks)
    assert row["metrics"]["geneval accuracy"]["mean"] == pytest.approx(np.mean(list(tasks.values())))
    assert "geneval accuracy per task" in (tmp_path / "g" / "table.md").read_text()


def test_evaluate_at_real_width_in_bf16_scores_base_against_a_lora(real_dirs, tmp_path):
    """SD3.5-Medium's real widths, 2 blocks, bf16 compute: one prompt, the base and an exported LoRA whose B
    matrices were moved away from zero, so their samples must differ."""
    model = train.load_pipeline(train.Config(model=str(real_dirs / "sd3.5-medium"), lora_alpha=64),
                                "sd3", torch.device("cpu"), torch.float32)
    train.make_trainable(model.transformer, train.Config())
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    runs.write_export(tmp_path / "lora", model, {k: v for k, v in model.transformer.state_dict().items()}, lora=True)
    (tmp_path / "one.txt").write_text("a red car\n")
    result = run_evaluate("--model", str(real_dirs / "sd3.5-medium"), "--loras", str(tmp_path / "lora"), "--prompts",
                          str(tmp_path / "one.txt"), "--rewards", "color,jpeg_compressibility", "--dtype", "bfloat16",
                          "--resolution", "32", "--max_sequence_length", "4", "--sampling_steps", "2",
                          "--out", str(tmp_path / "e"))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "e" / "eval.json").read_text())["rows"]
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["settings"]["dtype"] == "bfloat16"
    base, lora = rows["base"]["scores"], rows[f"lora:{tmp_path / 'lora'}"]["scores"]
    assert all(math.isfinite(v) for s in (base, lora) for vs in s.values() for v in vs)
    assert base["jpeg_compressibility"] != lora["jpeg_compressibility"]


@pytest.mark.parametrize("argv,message", [
    (["--runs", "/nonexistent"], "no checkpoint there"),
    (["--loras", "/nonexistent"], "no pytorch_lora_weights.safetensors"),
    (["--no-base"], "nothing to evaluate"),
    (["--samples_per_prompt", "0"], "must be >= 1"),
    (["--prompts", "drawbench:train"], "no 'train' split"),
    (["--rewards", "nonsense"], "unknown reward"),
])
def test_evaluate_bad_input_is_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(train, "load_pipeline", lambda *a: pytest.fail("a model was loaded"))
    assert message in one_line_stop(evaluate.main, argv, capsys)


def test_evaluate_error_is_one_line_on_stderr_without_traceback():
    result = run_evaluate("--runs", "/nonexistent")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["error: --runs /nonexistent: no checkpoint there (checkpoints/latest is missing)"]



# ----------------------------------------------------------------------------------------------
# Guards against reward hacking: the reference KL, EMA, monitors


def test_policy_loss_adds_the_reference_kl_computed_by_hand():
    g = torch.Generator().manual_seed(0)
    s_new, s_old, adv = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, generator=g)
    x_new, x_old, x_ref = (torch.randn(4, 3, 2, 5, generator=g) for _ in range(3))
    base, _ = vgrpo.policy_loss(s_new, s_old, adv, clip_eps=0.2)
    loss, metrics = vgrpo.policy_loss(s_new, s_old, adv, clip_eps=0.2, kl_coef=0.3, x_new=x_new, x_old=x_old,
                                      ref_kl_coef=0.7, x_ref=x_ref)
    d = lambda a, b: np.mean([np.mean((a[i] - b[i]).numpy() ** 2) for i in range(4)])  # noqa: E731
    assert metrics["ref_kl"].item() == pytest.approx(d(x_new, x_ref), rel=1e-6)
    assert loss.item() == pytest.approx(base.item() + 0.3 * d(x_new, x_old) + 0.7 * d(x_new, x_ref), rel=1e-6)
    assert "ref_kl" not in vgrpo.policy_loss(s_new, s_old, adv)[1]  # logged only with a reference
    with pytest.raises(ValueError, match="ref_kl_coef > 0 needs"):
        vgrpo.policy_loss(s_new, s_old, adv, ref_kl_coef=0.1, x_new=x_new)


def tiny_lora_model(tiny_dirs, **settings):
    cfg = train.Config(model=str(tiny_dirs / "sd3"), **settings)
    model = train.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
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
    train.make_trainable(model.transformer, cfg)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:  # a trained adapter: not the identity
                p.normal_(0, 0.05, generator=g)
        v_lora = model.velocity(z, t, cond)
        base_velocity = models.frozen_base_velocity(model, None, lora=True)
        assert torch.equal(base_velocity(z, t, cond), v_base) and not torch.equal(v_lora, v_base)
        assert torch.equal(model.velocity(z, t, cond), v_lora)  # adapters back on
    trainable = [p for p in model.transformer.parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n, p in model.transformer.named_parameters() if p.requires_grad)
    # the update: ref_kl at 0 before any step of a fresh adapter, then the hand-computed drift
    cfg, model = tiny_lora_model(tiny_dirs)
    train.make_trainable(model.transformer, cfg)
    optimizer = torch.optim.AdamW([p for p in model.transformer.parameters() if p.requires_grad], lr=1e-2)
    surrogate = partial(vgrpo.elbo_surrogate, model.velocity)
    reference = partial(vgrpo.elbo_surrogate, models.frozen_base_velocity(model, None, lora=True))
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
        train.ema_update(ema, [param], 0.8)
    n = len(weights) - 1
    closed = 0.8 ** n * weights[0] + sum(0.2 * 0.8 ** (n - k) * weights[k] for k in range(1, n + 1))
    torch.testing.assert_close(ema[0], closed, rtol=1e-6, atol=1e-7)
    before, ema_before = param.clone(), ema[0].clone()
    with train.ema_weights([param], ema):  # evaluation / export with the EMA, then the trained weights back
        assert torch.equal(param, ema_before)
    assert torch.equal(param, before) and torch.equal(ema[0], ema_before)


def ema_state(run_dir, tiny_dirs):
    """The EMA tensors of a run's last checkpoint, read back through load_checkpoint."""
    cfg = train.parse_config(["--resume", str(run_dir)])
    model = train.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    train.make_trainable(model.transformer, cfg)
    named = [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad]
    ema = {n: torch.zeros_like(p) for n, p in named}
    runs.load_checkpoint(Path(run_dir), model.transformer, torch.optim.AdamW([p for _, p in named]), 0, ema=ema)
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
    fired = runs.hacking(evals_history(rise, fall), ["aesthetic"], window=3, z=3.0, samples=128)
    assert "the monitored aesthetic fell from 0.59 to 0.52" in fired and "iterations 10 -> 40" in fired
    assert not runs.hacking(evals_history(rise, fall[::-1]), ["aesthetic"], window=3, z=3.0, samples=128)  # both rise
    assert not runs.hacking(evals_history(rise[::-1], fall), ["aesthetic"], window=3, z=3.0, samples=128)  # both fall
    assert not runs.hacking(evals_history(rise[:3], fall[:3]), ["aesthetic"], window=3, z=3.0, samples=128)  # too short
    # noise: means of 128 samples of std 0.05 around constant values fire in well under 1% of windows at z = 3
    rng = np.random.default_rng(0)
    noise = lambda: list(0.5 + rng.normal(0, 0.05 / math.sqrt(128), 5))  # noqa: E731
    fires = sum(bool(runs.hacking(evals_history(noise(), noise()), ["aesthetic"], window=3, z=3.0, samples=128))
                for _ in range(2000))
    assert fires <= 10, fires  # expected about 2000 x 0.5 x 0.00135 = 1.4
    assert runs.x0_drift(1.6, 1.0, 0.5) and not runs.x0_drift(1.4, 1.0, 0.5) and not runs.x0_drift(9.0, 1.0, 0.0)


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


# ----------------------------------------------------------------------------------------------
# train.py on real-width, reduced-depth models (models.REAL_CONFIGS): the layouts, sizes and dtypes of a GPU run

REAL_SMALL_RUN = ["--resolution", "64", "--max_sequence_length", "8", "--rewards", "color:1", "--num_prompts", "1",
                  "--group_size", "2", "--rollout_batch_size", "2", "--sampling_steps", "2", "--iterations", "1",
                  "--eval_every", "0", "--tiny_fit_steps", "0"]


SAVED_REAL = {"sd3": "sd3.5-medium", "flux": "flux.1-dev", "qwenimage": "qwen-image", "flux2": "flux.2-klein-4b",
              "wan": "wan2.1-t2v-1.3b"}
REAL_IMAGE = [name for name, spec in models.REAL_CONFIGS.items() if spec["family"] != "wan"]
REAL_WAN = [name for name, spec in models.REAL_CONFIGS.items() if spec["family"] == "wan"]


@pytest.fixture(scope="module")
def real_dirs(tmp_path_factory):
    """One member of each family at real width, saved with save_pretrained: SD3.5-Medium (2 blocks), FLUX.1-dev and
    FLUX.2 [klein] 4B (1 double + 1 single block), Qwen-Image and Wan2.1-T2V-1.3B (1 block)."""
    root = tmp_path_factory.mktemp("real")
    for name in SAVED_REAL.values():
        models.reduced_pipeline(name).save_pretrained(root / name)
    (root / "prompts.txt").write_text("a red car\na blue flower\n")
    return root


@pytest.fixture(scope="module")
def real_pipes(real_dirs):
    """name -> pipeline for every REAL_CONFIGS entry, loaded through from_pretrained where saved; the other
    members of a family share the saved one's text encoders and VAE (same widths) with their own transformer and
    scheduler."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    loaded = {name: DiffusionPipeline.from_pretrained(real_dirs / name) for name in SAVED_REAL.values()}

    def get(name):
        if name in loaded:
            return loaded[name]
        spec = models.REAL_CONFIGS[name]
        base = loaded[SAVED_REAL[spec["family"]]]
        if spec["family"] == "wan":  # its own VAE (Wan2.2's differs), the saved UMT5
            return models.reduced_wan_pipeline(name, text_encoder=base.text_encoder, tokenizer=base.tokenizer)
        return type(base)(**{**base.components, "transformer": models.reduced_transformer(name).eval(),
                             "scheduler": FlowMatchEulerDiscreteScheduler(**spec["scheduler"])})

    return get


# The pipelines' own __call__ grids at the step counts their model cards use: the last sigma before 0.
GRID_ANCHORS = {"sd3-medium": (40, 1024, 0.0089), "sd3.5-medium": (40, 512, 0.0089), "sd3.5-large": (40, 1024, 0.0089),
                "flux.1-dev": (16, 720, None), "flux.1-schnell": (4, 1024, 0.25), "qwen-image": (50, 1328, 0.02),
                "flux.2-klein-4b": (50, 1024, None)}


@pytest.mark.parametrize("name", REAL_IMAGE)
def test_real_width_rollouts_and_grids_equal_the_plain_pipeline_call(name, real_pipes, monkeypatch):
    """Every StableDiffusion3Pipeline / FluxPipeline checkpoint family: Euler rollouts + decoding equal
    `pipe(prompt, num_inference_steps=N)` called the plain way (schnell: no guidance embedding, shift 1), and the
    rollout grid is the pipeline's own at the model's default resolution and step count (SD3.5 at 40 steps ends
    at 0.0089, not at 1/40 shifted = 0.0714; FLUX's mu follows the resolution)."""
    pipe, family = real_pipes(name), models.REAL_CONFIGS[name]["family"]
    model = assert_rollouts_equal_the_plain_pipeline_call(pipe, family, resolution=64, steps=3, latent_atol=1e-4)
    heun = vgrpo.sample_ode(model.velocity, torch.randn(1, *model.latent_shape()), model.encode(["a red car"]),
                            model.timesteps(), solver="heun")
    assert torch.isfinite(heun).all()  # the second-order solvers run on the same grid
    steps, resolution, last = GRID_ANCHORS[name]
    # The pipeline's grid at full resolution, without paying for the transformer: a zero velocity leaves the grid as is.
    monkeypatch.setattr(pipe.transformer, "forward", lambda hidden_states, **_: (torch.zeros_like(hidden_states),))
    pipe(prompt="a red car", height=resolution, width=resolution, num_inference_steps=steps, max_sequence_length=8,
         guidance_scale=1.0, output_type="latent", **flux2_layers(pipe, family))
    ours = adapter_for(pipe, family, resolution=resolution, sampling_steps=steps).timesteps()
    assert torch.equal(ours, pipe.scheduler.sigmas.cpu()) and ours[0] == 1 and ours[-1] == 0 and len(ours) == steps + 1
    if last is not None:
        assert ours[-2].item() == pytest.approx(last, abs=1e-4)


@pytest.mark.parametrize("name", REAL_WAN)
def test_wan_real_width_rollouts_equal_the_plain_pipeline_call(name, real_pipes):
    """Wan2.1-T2V-1.3B / 14B and Wan2.2-TI2V-5B at real width (1 block; Wan2.2's x16 VAE, 48 latent channels and
    per-token timesteps): rollouts on the checkpoint's UniPC with CFG 5 against "" == `pipe(prompt, num_frames=5,
    num_inference_steps=3, latents=noise)`, latents and decoded videos."""
    pipe = real_pipes(name)
    model = models.Wan(pipe, resolution=64, sampling_steps=3, max_sequence_length=16, num_frames=5)
    prompts = ["a red square moving left", "a photo of the blue square moving up"]
    noise = torch.randn(2, *model.latent_shape(), generator=torch.Generator().manual_seed(0))
    call = partial(pipe, prompt=prompts, height=64, width=64, num_frames=5, num_inference_steps=3, latents=noise,
                   guidance_scale=5.0, max_sequence_length=16)
    with torch.no_grad():
        x0 = model.sample(model.guided(model.velocity, model.encode([""]), 5.0), noise, model.encode(prompts), "scheduler")
        videos = model.decode(x0)
    torch.testing.assert_close(x0, call(output_type="latent").frames, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(videos, call(output_type="pt").frames, rtol=1e-4, atol=1e-4)
    assert videos.shape == (2, 5, 3, 64, 64)


def assert_export_reproduces_training(run_dir, base_dir, family, *, lora):
    """`final/` loaded with the ordinary diffusers calls gives the trained transformer's output to float rounding."""
    from diffusers import DiffusionPipeline

    trained = train.load_trained(run_dir, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, *trained.latent_shape(), generator=g)
    t, cond = torch.tensor([0.3, 0.8]), trained.encode(["a red car", "a blue flower"])
    pipe = DiffusionPipeline.from_pretrained(base_dir)
    loaded = adapter_for(pipe, family, resolution=trained.resolution, num_frames=trained.num_frames)
    with torch.no_grad():
        want, before = trained.velocity(z, t, cond), loaded.velocity(z, t, cond)
        if lora:
            pipe.load_lora_weights(run_dir / "final")
        else:
            loaded.transformer = type(pipe.transformer).from_pretrained(run_dir / "final" / "transformer")
        got = loaded.velocity(z, t, cond)
    assert (want - before).abs().max() > 1e-4  # training moved the model, so the check below can fail
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset,name,extra", [
    ("sd35m", "sd3.5-medium", ["--micro_batch_size", "2"]),
    ("flux", "flux.1-dev", ["--micro_batch_size", "1"]),  # 2 gradient steps on 2 samples
    ("qwenimage", "qwen-image", ["--micro_batch_size", "2"]),  # true CFG rollouts
    ("flux2", "flux.2-klein-4b", ["--micro_batch_size", "1"]),  # CFG, 2 gradient steps, LoRA r 64
    ("wan21", "wan2.1-t2v-1.3b", ["--micro_batch_size", "2", "--num_frames", "5", "--width", "0"]),  # UniPC, CFG 4.5
])
def test_preset_iteration_at_real_width_exports_a_lora_that_diffusers_loads_exactly(preset, name, extra, real_dirs,
                                                                                    tmp_path):
    """One iteration of each preset (LoRA alpha = 2 x rank: scale 2) at a small batch; the exported LoRA
    loaded with pipe.load_lora_weights reproduces the trained transformer (it loaded at half strength before)."""
    run_train("--preset", preset, "--model", real_dirs / name, "--prompts", real_dirs / "prompts.txt",
              "--run_dir", tmp_path, "--lr", "1e-2", *REAL_SMALL_RUN, *extra)
    metrics = read_metrics(tmp_path)[0]
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "reward_mean")) and metrics["skipped_steps"] == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["lora_rank"], config["lora_alpha"]) == (train.PRESETS[preset]["lora_rank"], train.PRESETS[preset]["lora_alpha"])
    assert_export_reproduces_training(tmp_path, real_dirs / name, models.REAL_CONFIGS[name]["family"], lora=True)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_full_finetune_export_reproduces_training(family, tiny_dirs, tmp_path):
    run_train("--model", tiny_dirs / family, "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", tmp_path,
              "--lora_rank", "0", *SMALL_RUN)
    assert_export_reproduces_training(tmp_path, tiny_dirs / family, family, lora=False)


def test_lora_export_reproduces_training_when_alpha_is_not_twice_the_rank(tiny_dirs, tmp_path):
    run_train("--model", tiny_dirs / "flux", "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", tmp_path,
              "--lora_rank", "4", "--lora_alpha", "3", "--lr", "1e-2", *SMALL_RUN)
    assert_export_reproduces_training(tmp_path, tiny_dirs / "flux", "flux", lora=True)


def checkpoint_dtypes(run_dir):
    """{(model | optim, dtype)} of the trainable tensors in the run's latest DCP checkpoint, from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    path = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {(key.split(".")[0], v.properties.dtype) for key, v in metadata.items()
            if hasattr(v, "properties") and ("lora" in key or key.startswith("optim"))}


@pytest.mark.parametrize("name,extra", [("flux.1-dev", ()), ("qwen-image", ("--cfg_scale", "4", "--sampling_steps", "2"))])
def test_torchrun_fsdp2_bf16_at_real_width_stores_float32_and_exports_exactly(name, extra, real_dirs, tmp_path):
    """FLUX.1-dev and Qwen-Image (true CFG in the rollouts, a text mask, rotary tables that are plain tensors, a
    LoRA weight that never gets a gradient) at real width, 2 processes, FSDP2 with bf16 compute: the sharded LoRA
    and AdamW states are float32, and the LoRA gathered from the shards loads into diffusers with the trained
    transformer's output."""
    family = models.REAL_CONFIGS[name]["family"]
    run_train("--model", real_dirs / name, "--prompts", real_dirs / "prompts.txt", "--run_dir", tmp_path,
              *REAL_SMALL_RUN, *BF16_TOKENS, "--num_prompts", "2", "--sampling_steps", "1", "--num_mc", "2",
              "--micro_batch_size", "2", "--num_grad_steps", "1", "--dtype", "bfloat16", "--lr", "1e-2", *extra, nproc=2)
    metrics = read_metrics(tmp_path)[0]
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["skipped_steps"] == 0
    assert checkpoint_dtypes(tmp_path) == {("model", torch.float32), ("optim", torch.float32)}
    assert_export_reproduces_training(tmp_path, real_dirs / name, family, lora=True)


# bf16 runs at real width use 4 image tokens (32 px) and 4 T5 tokens: CPUs without AVX-512 BF16 multiply a bf16 matrix
# by a row-major bf16 weight (the input gradient of every frozen linear) ~50x slower than in float32, linearly in the
# tokens; the widths, dtypes and layouts under test do not depend on the token count.
BF16_TOKENS = ["--resolution", "32", "--max_sequence_length", "4"]


def one_bf16_step(model_dir, family, dtype, *extra, init=None):
    """train.py's model setup in `dtype` and one vgrpo_update (AdamW lr 1e-4, the flux preset's, no weight decay) on a
    fixed rollout batch; returns the adapter, the trainable parameters before the step, the gradients the step
    used and the optimizer. init: trainable weights to start from (by name)."""
    cfg = train.parse_config(["--model", str(model_dir), *BF16_TOKENS, *extra])
    torch.manual_seed(0)  # the same LoRA initialisation in every call
    model = train.load_pipeline(cfg, family, torch.device("cpu"), dtype)
    train.make_trainable(model.transformer, cfg)
    params = {n: p for n, p in model.transformer.named_parameters() if p.requires_grad}
    for n, p in params.items():
        if init is not None:
            p.data.copy_(init[n])
    optimizer = torch.optim.AdamW(params.values(), lr=1e-4, weight_decay=0.0)
    grads = {}
    # Parameters whose output nothing reads get no gradient (Qwen-Image's last to_add_out) and no AdamW step.
    optimizer.register_step_pre_hook(lambda *_: grads.update({n: p.grad.clone() for n, p in params.items()
                                                              if p.grad is not None}))
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, *model.latent_shape(), generator=g)
    cond = {k: v.repeat(2, *[1] * (v.dim() - 1)) for k, v in model.encode(["a red car"]).items()}
    t, eps = vgrpo.draw_mc_pairs(1, 2, 2, x0.shape[1:], generator=g)
    surrogate = partial(vgrpo.elbo_surrogate, model.velocity)
    with torch.no_grad():
        s_old, _ = surrogate(x0, cond, t, eps)
    before = {n: p.detach().clone() for n, p in params.items()}
    vgrpo.vgrpo_update(surrogate, optimizer, vgrpo.Rollouts(x0, cond, torch.tensor([1.0, 0.0]), t, eps, s_old))
    return model, params, before, grads, optimizer


def assert_float32_master_step(params, before, grads, optimizer, frozen_modules, lr=1e-4):
    """Trainable weights, their gradients and both AdamW states are float32; everything frozen is bfloat16; and the
    realised update is AdamW's first step -lr g / (|g| + eps) from the gradient used, to float32 rounding of the
    weight (bf16 storage rounds most of an lr-sized update away)."""
    assert grads and all(params[n].dtype == torch.float32 for n in params)
    for n in grads:
        p, state = params[n], optimizer.state[params[n]]
        assert p.dtype == grads[n].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32, n
        g = grads[n].double()
        intended = -lr * g / (g.abs() + 1e-8)
        realised = p.detach().double() - before[n].double()
        # Half an ULP of the stored float32 result, plus the step's own float32 arithmetic: about 10 roundings of
        # relative size 2^-24 on the lr-sized update (lerp into exp_avg, g*g and its scaling into exp_avg_sq, sqrt,
        # bias corrections, + eps, the quotient, x step size). Measured on this CI's CPU: 3.9 of those 10 beyond the
        # half ULP, which the former bound (|w| + lr) 2^-22 (4 in all near w = 0) failed; it passed on the CPU it was
        # written on. bf16 storage is off by ~|w| 2^-9, a missing bias correction by ~lr.
        bound = (p.detach().double().abs() + 10 * lr) * 2**-24
        assert ((realised - intended).abs() <= bound).all(), n
    # bf16, T5's wo too (transformers 5 keeps it only in fp16); float32 where diffusers keeps a module so in any dtype
    # (Wan's time embedder, norms and modulation tables: WanTransformer3DModel._keep_in_fp32_modules)
    frozen = {(n, p.dtype, any(k in n.split(".") for k in (getattr(m, "_keep_in_fp32_modules", None) or [])
                               if type(m).__module__.startswith("diffusers.")))
              for m in frozen_modules for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen and all(dtype == (torch.float32 if kept else torch.bfloat16) for _, dtype, kept in frozen)


@pytest.mark.parametrize("name,extra", [("flux.1-dev", ()), ("qwen-image", ()), ("flux.2-klein-4b", ()),
                                        ("wan2.1-t2v-1.3b", ("--num_frames", "5"))])
def test_bf16_lora_training_keeps_float32_master_weights_and_matches_an_fp32_step(name, extra, real_dirs):
    """Real width (FLUX.1-dev, Qwen-Image, FLUX.2 [klein] 4B, Wan2.1-1.3B on 5-frame videos), LoRA: bf16 compute,
    fp32 storage; the gradient agrees with an fp32-compute step to bf16 compute error (the realised update, checked
    exactly against AdamW, carries no bf16 storage error)."""
    family = models.REAL_CONFIGS[name]["family"]
    model, params, before, grads, optimizer = one_bf16_step(real_dirs / name, family, torch.bfloat16, *extra)
    assert_float32_master_step(params, before, grads, optimizer,
                               [c for c in model.pipe.components.values() if isinstance(c, torch.nn.Module)])
    # peft initialises the adapter in the base layer's dtype: start the fp32 run from the same (bf16-rounded) values
    _, _, _, grads32, _ = one_bf16_step(real_dirs / name, family, torch.float32, *extra, init=before)
    g16 = torch.cat([grads[n].flatten() for n in sorted(grads)])
    g32 = torch.cat([grads32[n].flatten() for n in sorted(grads32)])
    # Compute error, not storage error: at this width with random weights the bf16 velocity itself is 4% off the
    # fp32 one (text embeddings 0.5%), and the gradient of the surrogate inherits it: measured relative error 0.43,
    # cosine 0.905, the same in every LoRA tensor (Qwen-Image 0.13 / 0.992, FLUX.2 [klein] 0.013 / 0.9999). A broken bf16 path (no gradient, wrong sign, a frozen adapter)
    # gives a cosine near 0 or below.
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0).item() > 0.8
    assert ((g16 - g32).norm() / g32.norm()).item() < 0.6


def test_bf16_full_finetuning_keeps_float32_master_weights(real_dirs):
    """SD3.5-Medium width, every transformer weight trained: fp32 weights, gradients and AdamW states."""
    model, params, before, grads, optimizer = one_bf16_step(real_dirs / "sd3.5-medium", "sd3", torch.bfloat16,
                                                            "--lora_rank", "0")
    assert len(params) == len(list(model.transformer.parameters()))
    assert_float32_master_step(params, before, grads, optimizer, [model.pipe.text_encoder_3, model.pipe.vae])


# ----------------------------------------------------------------------------------------------
# Memory plan


def saved_for_backward(model, rows):
    """Bytes autograd saves in one training forward of `model` (an adapter), measured with real tensors on the CPU."""
    saved = models.SavedBytes(model.transformer, [])
    with saved.hooks():
        model.velocity(torch.zeros(rows, *model.latent_shape()), torch.full((rows,), 0.5), model.cond_like(rows))
    return saved.other


@pytest.mark.parametrize("name,depth", [("sd3.5-medium", {"num_layers": 5, "dual_attention_layers": (0, 1, 2)}),
                                        ("flux.1-dev", {"num_layers": 2, "num_single_layers": 3}),
                                        ("qwen-image", {"num_layers": 3}),
                                        ("flux.2-klein-4b", {"num_layers": 2, "num_single_layers": 3}),
                                        ("wan2.1-t2v-1.3b", {"num_layers": 3})])
def test_memory_plan_matches_a_measured_cpu_run_at_real_width(name, depth, real_dirs):
    """The plan extrapolates activations from a twin holding each block type (the first twice) to the model's depth
    and batch, and counts parameters from configs on the meta device. Checked against what real tensors hold:
    bytes saved for backward by a real-width model of a depth the twin does not have (SD3.5: 3 dual blocks, 1 plain,
    the last; FLUX.1 and FLUX.2: 2 double, 3 single; Qwen-Image and Wan: 3; Wan on 9-frame videos) at 3 rows in bf16
    autocast with LoRA, and the bytes train.load_pipeline holds per component of a saved pipeline (Wan's transformer
    keeps its time embedder, norms and modulation tables in float32 in a bf16 load)."""
    # Wan on 9 frames: 3 latent frames, which the plan extrapolates from 1 and 2
    cfg = train.Config(model=str(real_dirs / name), resolution=64, max_sequence_length=8,
                       num_frames=9 if "wan" in name else 0)
    family, components = models.meta_components(cfg.model)
    pipeline_config = components.pop("pipeline_config", None)
    loaded = train.load_pipeline(cfg, family, torch.device("cpu"), torch.bfloat16)
    for component, module in components.items():
        held = [*loaded.pipe.components[component].parameters(), *loaded.pipe.components[component].buffers()]
        assert models.stored_bytes(module, torch.bfloat16) == sum(t.numel() * t.element_size() for t in held), component

    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # as activation_profile: Qwen-Image's rotary tables stay real
        deeper = type(components["transformer"]).from_config({**dict(components["transformer"].config), **depth})
    adapter = models.ADAPTERS[family]
    settings = dict(resolution=64, max_sequence_length=8, num_frames=loaded.num_frames)
    profile = models.activation_profile(deeper, adapter, torch.bfloat16, partial(train.make_trainable, cfg=cfg),
                                        settings=settings, vae=components["vae"], pipeline_config=pipeline_config)
    real = models.materialize(deeper, torch.bfloat16, seed=1)
    train.make_trainable(real, cfg)
    rows = 3
    pipe = models.planning_pipe(real, components["vae"], adapter, pipeline_config)
    measured = saved_for_backward(adapter(pipe, torch.bfloat16, sampling_steps=1, **settings), rows)
    planned = models.saved_bytes([profile["other"], *profile["blocks"]], rows)
    # Exact up to storages shared differently between blocks; measured: equal to the byte.
    print(f"planned {planned} measured {measured}")
    assert planned == pytest.approx(measured, rel=1e-3), (planned, measured)


def test_plan_cli_says_whether_it_fits_from_a_config_only_directory(real_dirs, tmp_path, capsys):
    """--plan reads configs only (the directory has no weights), prints the table ending in 'per GPU: X GiB of G GiB',
    exits 0 when it fits with 10% headroom (saying how large a rollout batch would fit too), else 1 with flags that
    make it fit (and they do)."""
    root = tmp_path / "configs"
    shutil.copytree(real_dirs / "sd3.5-medium", root, ignore=shutil.ignore_patterns("*.safetensors"))
    argv = ["--plan", "--model", str(root), "--resolution", "128", "--max_sequence_length", "16", "--rewards",
            "color", "--plan_world_size", "2", "--num_prompts", "2", "--group_size", "8", "--micro_batch_size", "8",
            "--num_mc", "4", "--num_grad_steps", "1", "--rollout_batch_size", "2"]

    def plan(*extra):
        code = 0
        try:
            train.main(argv + list(extra))
        except SystemExit as exit_info:
            code = exit_info.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err.strip()

    code, out, _ = plan("--plan_gpu_gb", "80")
    *_, last, note = out.strip().splitlines()
    assert code == 0 and re.fullmatch(r"per GPU: [0-9.]+ GiB of 80 GiB", last)
    assert note.startswith("--rollout_batch_size 8 fits too")  # the 8 samples per rank in one sampling call
    assert "reward models" in out and "activations saved for backward (32 rows" in out
    tight = ["--plan_gpu_gb", last.split()[2]]
    code, _, err = plan(*tight)
    advice = re.fullmatch(r"error: does not fit .* with 10% headroom: (.*) makes it fit \(.*\)", err)
    assert code == 1 and advice, (code, err)
    assert plan(*tight, *shlex.split(advice.group(1)))[0] == 0  # the advice is a configuration that fits


def test_largest_fitting_is_the_brute_force_largest():
    for low, high, limit in [(1, 1, 5), (1, 144, 1), (1, 144, 144), (3, 100, 37), (24, 144, 25), (2, 9, 8)]:
        calls = []
        got = models.largest_fitting(low, high, lambda n: calls.append(n) or n <= limit)
        assert got == max(n for n in range(low, high + 1) if n <= limit or n == low)
        assert len(calls) <= math.ceil(math.log2(high - low + 1)) + 1


@pytest.mark.parametrize("lora_rank", [32, 0])
def test_memory_plan_counts_the_trainable_state_ema_and_reference_copy_as_allocated(lora_rank, tiny_dirs):
    """The plan's rows for the trained weights' float32 state (LoRA: weight + grad + 2 AdamW moments; full
    fine-tuning: grad + 2 moments, the weight itself is the float32 'transformer weights' row), the EMA and the frozen
    base copy of the reference KL, against the bytes a real step allocates. (A LoRA state of 12 bytes per parameter,
    the float32 master weight forgotten, passed every other test.)"""
    cfg = train.Config(model=str(tiny_dirs / "sd3"), lora_rank=lora_rank, ema_decay=0.9, ref_kl_coef=0.1,
                       dtype="float32")
    plan, _ = models.plan_memory(cfg, "sd3", 1, 80.0, partial(train.make_trainable, cfg=cfg))
    planned = {part.split(" ")[0]: gib * models.GiB for part, gib, _ in plan.rows}
    model = train.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    copy_bytes = sum(p.numel() * p.element_size() for p in model.transformer.parameters())
    train.make_trainable(model.transformer, cfg)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    assert planned["trainable"] == state + grads + (weights if lora_rank else 0)
    assert planned["EMA"] == weights
    if lora_rank:
        assert "frozen" not in planned  # under LoRA the reference is the same weights, adapters off
    else:
        assert planned["frozen"] == copy_bytes

@pytest.mark.parametrize("family", list(models.ADAPTERS))
def test_cond_like_is_shaped_like_encode(family):
    """The plan runs the transformer on cond_like(); it must be what encode() gives the transformer in training."""
    model = adapter_for(models.tiny_pipeline(family), family)
    real = model.encode(["a red car", "a blue flower"])
    assert {k: v.shape for k, v in model.cond_like(2).items()} == {k: v.shape for k, v in real.items()}


def test_gpu_launch_refuses_a_plan_that_does_not_fit_before_loading(monkeypatch):
    monkeypatch.setattr(train, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = train.Config(micro_batch_size=4)
    prepare = partial(train.make_trainable, cfg=cfg)
    with pytest.raises(runs.ConfigError, match="the memory plan needs .* GiB per GPU of 0 GiB"):
        models.check_memory_plan(cfg, "sd3", 1, 1e-3, rank=0, prepare=prepare)
    models.check_memory_plan(cfg, "sd3", 1, 80.0, rank=0, prepare=prepare)  # the tiny model fits anything


def test_training_turns_off_cudnn_attention_before_any_model_runs(tmp_path, monkeypatch):
    """cuDNN's fused attention crashed FLUX.1-dev's backward in bf16 on an H200 (illegal memory access; flash and
    memory-efficient attention ran): train() turns it off at setup, before the plan check and every model."""
    class Stop(Exception):
        pass

    monkeypatch.setattr(models, "check_memory_plan", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with pytest.raises(Stop):
            train.train(train.Config(run_dir=str(tmp_path)), "sd3", [], [])
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


def test_sharded_transformer_and_offloaded_text_encoders_are_not_placed_on_the_device_at_load(tiny_dirs):
    """Under FSDP2 the transformer stays on the CPU until fully_shard moves each shard (a whole copy per GPU cost
    24-61 GiB at load time); offloaded text encoders stay on the CPU; the VAE goes to the device (meta stands in for
    a GPU here)."""
    cfg = train.Config(model=str(tiny_dirs / "sd3"))
    model = train.load_pipeline(cfg, "sd3", torch.device("meta"), torch.float32, sharded=True)
    places = {name: next(m.parameters()).device.type for name, m in model.pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    assert places == {"transformer": "cpu", "text_encoder": "cpu", "text_encoder_2": "cpu", "text_encoder_3": "cpu",
                      "vae": "meta"}
    model = train.load_pipeline(train.Config(model=str(tiny_dirs / "sd3"), offload_text_encoders=False), "sd3",
                                torch.device("meta"), torch.float32)
    assert all(next(m.parameters()).is_meta for m in model.pipe.components.values() if isinstance(m, torch.nn.Module))


def test_offloaded_text_encoders_visit_the_device_only_while_encoding(monkeypatch):
    model = adapter_for(models.tiny_pipeline("sd3"), "sd3")
    moves = []
    for name, module in model.pipe.components.items():
        if name.startswith("text_encoder"):
            real_to = module.to
            monkeypatch.setattr(module, "to", lambda d, _to=real_to, _n=name: (moves.append((_n, str(d))), _to(d))[1])
    cond = train.encode(model, ["a red car"], torch.device("cpu"), offload=True)
    assert [d for _, d in moves] == ["cpu"] * 3 + ["cpu"] * 3 and len({n for n, _ in moves}) == 3
    for k, v in model.encode(["a red car"]).items():
        torch.testing.assert_close(cond[k], v, rtol=0, atol=0)


BAD_INPUTS = [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--model", "{tmp}/missing"], "neither a directory, a hub id"),
    (["--model", "{tmp}"], "no model_index.json there"),
    (["--prompts", "{tmp}/missing.txt"], "does not exist"),
    (["--prompts", "{tmp}/empty.txt"], "holds no prompts"),
    (["--prompts", "{tmp}/bad.jsonl"], "bad.jsonl:2: expected a JSON object with a string 'prompt' field"),
    (["--group_size", "6", "--micro_batch_size", "5"], "must split into --num_grad_steps 2 mini-batches"),
    (["--group_size", "1"], "at least 2 samples per prompt"),
    (["--rewards", "pickscor:1"], "unknown reward 'pickscor'"),
    (["--rewards", "color:nan"], "reward weight 'nan' for 'color' must be finite"),
    (["--reward_options", '{"pickscore": {}}'], "must map names from --rewards"),
    (["--solver", "rk4"], "--solver 'rk4' is not one of"),
    (["--resume", "{tmp}"], "no config.json there"),
    (["--model", "tiny-flux", "--cfg_scale", "4"], "does not apply to FLUX.1"),
    (["--model", "black-forest-labs/FLUX.2-klein-4B", "--cfg_scale", "4"], "is step-distilled"),
    (["--model", "tiny-qwenimage", "--sampling_steps", "1"], "--sampling_steps 1: QwenImagePipeline needs at least 2"),
    (["--max_sequence_length", "600"], "--max_sequence_length 600: StableDiffusion3Pipeline accepts at most 512"),
    (["--model", "tiny-qwenimage", "--max_sequence_length", "2000"], "QwenImagePipeline accepts at most 1024"),
    (["--hsdp", "3"], "--hsdp 3 must be 0 (auto), 1 (plain FSDP) or a divisor of the world size 1"),
    (["--prompts", "{tmp}/binary.txt"], "binary.txt is not UTF-8 text (byte 0)"),
    (["--prompts", "{tmp}/prompts.json"], ".json is not read; write one JSON object per line as .jsonl"),
    (["--prompts", "{tmp}/huge.txt"], "huge.txt:2: the prompt is 2000000 characters"),
    (["--prompts", "{tmp}/numbers.jsonl"], "numbers.jsonl:1: expected a JSON object with a string 'prompt' field"),
    (["--prompts", "{tmp}/colourless.txt"], "colourless.txt, prompt 2: the color reward needs a colour word"),
    (["--eval_prompts", "{tmp}/colourless.txt"], "colourless.txt, prompt 2: the color reward needs a colour word"),
    (["--model", "{tmp}/truncated_index"], "model_index.json is not a diffusers model_index.json"),
    (["--model", "{tmp}/classless_index"], "model_index.json is not a diffusers model_index.json"),
    (["--reward_options", '{"color": 1}'], "the options of 'color' must be a JSON object"),
    (["--reward_options", '{"color": {"quality": 3}}'], "'color' has no option 'quality'; its options are none"),
    (["--rewards", "http", "--reward_options", '{"http": {"timeout": "5"}}'], "option 'timeout' of 'http' must be float"),
    (["--rewards", "http", "--reward_options", '{"http": {"url": "file:///etc/passwd"}}'], "must be http://HOST"),
    (["--rewards", "http", "--reward_options", '{"http": {"timeout": 0}}'], "timeout 0 must be a finite number"),
    (["--run_dir", "{tmp}/empty.txt"], "empty.txt is a file; pass a directory"),
    (["--resume", "{tmp}/truncated_run"], "config.json is not valid JSON"),
    (["--resume", "{tmp}/foreign_run"], "config.json is not a train.py config (unknown entries ['steps'])"),
    (["--resume", "{tmp}/run", "--lora_rank", "16"], "--lora_rank 16 differs from the resumed run's 32"),
    (["--resume", "{tmp}/run", "--model", "tiny-flux"], "--model tiny-flux differs from the resumed run's tiny"),
    (["--reward_aggregation", "sum"], "--reward_aggregation 'sum' is not one of advantage, reward"),
    (["--param", "z"], "--param 'z' is not one of"),
    (["--dtype", "float16"], "--dtype 'float16' is not one of auto, bfloat16, float32"),
    (["--tracker", "mlflow"], "--tracker 'mlflow' is not one of none, tensorboard, wandb"),
    (["--compile", "tvm"], "--compile 'tvm' is not one of none, inductor, aot_eager"),
    (["--eval_prompts", "{tmp}/missing.txt"], "does not exist"),
    (["--lora_targets", ""], "--lora_targets: name at least one module"),
    (["--num_frames", "9"], "--num_frames 9: StableDiffusion3Pipeline makes square images; --num_frames is for video"),
    (["--width", "48"], "--width 48: StableDiffusion3Pipeline makes square images"),
    (["--rewards", "motion"], "reward motion scores videos; StableDiffusion3Pipeline makes images"),
    (["--monitor_rewards", "motion"], "reward motion scores videos"),
    (["--model", "tiny-wan", "--num_frames", "8"], "--num_frames 8: WanPipeline needs 1 + a multiple of 4"),
    (["--model", "tiny-wan", "--prompts", "{tmp}/colourless.txt", "--rewards", "motion"],
     "colourless.txt, prompt 1: the motion reward needs a direction word"),
    (["--prompts", "{tmp}/colourless.txt", "--rewards", "ocr"], "colourless.txt, prompt 1: the ocr reward reads the text"),
    (["--prompts", "{tmp}/colourless.txt", "--rewards", "geneval"], "needs each prompt's GenEval metadata"),
    (["--prompts", "drawbench"], "prompt set 'drawbench' has no 'train' split; it has test"),
    (["--prompts", "pickapic_v3"], "is neither a prompt file (.txt or .jsonl) nor a named set"),
    (["--model", "{tmp}/sd3_index"], "--prompts is required for a real model"),
    (["--monitor_rewards", "colour"], "--monitor_rewards: unknown reward 'colour'"),
    (["--run_dir", "/proc/v-grpo-run"], "--run_dir /proc/v-grpo-run: cannot write there"),
    (["--reward_options", "[" * 100_000 + "]" * 100_000], "--reward_options is not valid JSON"),
    (["--prompts", "{tmp}/nested.jsonl"], "nested.jsonl:1: expected a JSON object with a string 'prompt' field"),
    (["--resolution", "1048576"], "--resolution 1048576, 64 samples per rank and --num_mc 8 need at least"),
    (["--group_size", "1000000000"], "8000000000 samples per rank and --num_mc 8 need at least"),
    (["--monitor_rewards", "color"], "--monitor_rewards color: already trained on"),
    (["--export_ema"], "--eval_with_ema / --export_ema need an EMA: set --ema_decay"),
    (["--resume", "{tmp}/run", "--ema_decay", "0.9"], "--ema_decay 0.9 differs from the resumed run's 0.0"),
]


def write_bad_input_files(tmp):
    """The files BAD_INPUTS names, each wrong in one way."""
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "bad.jsonl").write_text('{"prompt": "a red car"}\n["not", "an", "object"]\n')
    (tmp / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)  # an image renamed
    (tmp / "prompts.json").write_text(json.dumps(["a red car", "a blue car"]))
    (tmp / "huge.txt").write_text("a red car\n" + "a" * 2_000_000 + "\n")
    (tmp / "numbers.jsonl").write_text('{"prompt": 42}\n')
    (tmp / "colourless.txt").write_text("a red car\na photo of a cat\n")
    (tmp / "nested.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")  # RecursionError in json before
    for name, text in (("truncated_index", '{"_class_name": "StableDiff'), ("classless_index", '{"a": 1}'),
                       ("sd3_index", '{"_class_name": "StableDiffusion3Pipeline"}')):
        (tmp / name).mkdir()
        (tmp / name / "model_index.json").write_text(text)
    config = json.dumps(asdict(train.Config(lora_rank=32)))
    for name, text in (("truncated_run", config[:len(config) // 2]), ("foreign_run", '{"steps": 3}'), ("run", config)):
        (tmp / name / "checkpoints").mkdir(parents=True)
        (tmp / name / "config.json").write_text(text)
        (tmp / name / "checkpoints" / "latest").write_text("iter-000000")


@pytest.mark.parametrize("argv,message", BAD_INPUTS)
def test_bad_input_is_one_clear_error_before_any_model_is_loaded(argv, message, tmp_path, monkeypatch, capsys):
    write_bad_input_files(tmp_path)
    monkeypatch.setattr(train, "train", lambda *a: pytest.fail("training started despite bad input"))
    monkeypatch.setattr(train, "load_pipeline", lambda *a: pytest.fail("a model was loaded"))
    assert message in one_line_stop(train.main, [a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)


def test_every_flag_has_a_bad_value_in_the_tables():
    """Every non-boolean flag is exercised by BAD_INPUTS or BAD_NUMBERS (booleans cannot be given a bad value)."""
    import typing
    from dataclasses import fields

    hints = typing.get_type_hints(train.Config)
    covered = {a[2:] for argv, _ in BAD_INPUTS for a in argv[:1]} | set(BAD_NUMBERS)
    assert {f.name for f in fields(train.Config) if hints[f.name] is not bool} <= covered


# One value per numeric flag that breaks its rule (non-finite values are checked for every float flag below).
BAD_NUMBERS = {
    "resolution": 40, "max_sequence_length": 0, "tiny_fit_steps": -1, "sampling_steps": 0, "cfg_scale": 0.5,
    "flux_guidance": -1, "num_prompts": 0, "group_size": 1, "num_mc": 0, "t_min": -0.1, "t_max": 1.5,
    "soft_clip_eta": 0, "clip_eps": -1, "kl_coef": -1, "num_grad_steps": 0, "iterations": 0, "lr": 1e30,
    "weight_decay": -0.1, "max_grad_norm": -1, "lora_rank": -1, "lora_alpha": 0, "micro_batch_size": 0,
    "rollout_batch_size": 0, "hsdp": -1, "max_skipped_steps": 0, "seed": -1, "log_every": 0, "eval_every": -1,
    "save_every": 0, "plan_world_size": -1, "plan_gpu_gb": -1, "eval_samples": 0, "ref_kl_coef": -0.1,
    "ema_decay": 1.0, "hacking_z": 0, "hacking_window": 0, "max_x0_drift": -1, "width": 40, "num_frames": -1,
    "frame_interval": -1,
}


def test_every_numeric_flag_is_validated():
    import typing
    from dataclasses import fields

    hints = typing.get_type_hints(train.Config)
    numeric = {f.name for f in fields(train.Config) if hints[f.name] in (int, float, float | None)}
    assert numeric == set(train.NUMERIC_RULES) == set(BAD_NUMBERS)


@pytest.mark.parametrize("name,value", [*BAD_NUMBERS.items(),
                                        *[(n, v) for n in ("lr", "weight_decay", "max_grad_norm", "soft_clip_eta",
                                                           "kl_coef", "t_max") for v in ("nan", "inf")]])
def test_bad_number_is_one_clear_error_before_any_model_is_loaded(name, value, monkeypatch, capsys):
    monkeypatch.setattr(train, "train", lambda *a: pytest.fail("training started despite bad input"))
    monkeypatch.setattr(train, "load_pipeline", lambda *a: pytest.fail("a model was loaded"))
    message = one_line_stop(train.main, [f"--{name}", value], capsys)
    assert message.startswith(f"error: --{name} ") and "must be" in message


def test_weight_decay_that_would_flip_the_weights_is_rejected(monkeypatch, capsys):
    monkeypatch.setattr(train, "train", lambda *a: pytest.fail("training started despite bad input"))
    assert "--lr 0.5 x --weight_decay 3.0 must be < 1" in one_line_stop(train.main, ["--lr", "0.5", "--weight_decay", "3"],
                                                                        capsys)


def test_world_size_that_does_not_divide_the_prompts_is_rejected(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(train, "train", lambda *a: pytest.fail("training started despite bad input"))
    assert "--num_prompts 8 must be divisible by the world size 3" in one_line_stop(train.main, [], capsys)


def test_cli_error_is_one_line_on_stderr_without_traceback():
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--rewards", "nope"], capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[transformers]")]
    assert proc.returncode == 2 and lines == [lines[0]] and lines[0].startswith("error: --rewards: unknown reward")


def test_help_lists_every_flag(capsys):
    """--help prints (a '%' in a help text once made argparse raise TypeError instead)."""
    from dataclasses import fields

    with pytest.raises(SystemExit) as exit_info:
        train.parse_config(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and all(f"--{f.name}" in out for f in fields(train.Config))


def test_config_layers_preset_then_flags_and_every_field_is_documented():
    cfg = train.parse_config(["--preset", "sd35m", "--prompts", "p.txt", "--group_size", "12", "--no-stratified",
                              "--clip_eps", "0.01", "--soft_clip_eta", "none"])
    assert (cfg.num_prompts, cfg.group_size, cfg.sampling_steps, cfg.lora_rank) == (48, 12, 40, 32)
    assert cfg.stratified is False and cfg.clip_eps == 0.01 and cfg.soft_clip_eta is None
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(train.Config))


def test_prompt_order_is_a_pure_function_of_seed_and_iteration_covering_each_epoch():
    picks = [train.prompts_for_iteration(10, 4, 0, it) for it in range(5)]  # 20 picks = 2 epochs of 10
    flat = sum(picks, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert picks == [train.prompts_for_iteration(10, 4, 0, it) for it in range(5)]
    assert picks != [train.prompts_for_iteration(10, 4, 1, it) for it in range(5)]


def test_toy_images_captions_name_the_shape_and_mostly_the_true_colour():
    images, captions = models.toy_images(400, torch.Generator().manual_seed(0))
    assert images.shape == (400, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    palette = torch.tensor(list(rewards.COLORS.values()))
    corner = images[:, :, 0, 0]
    assert torch.allclose(corner, torch.full_like(corner, 0.5))  # grey background
    centre = images[:, :, 16, 16]  # the shape always covers the centre
    named = torch.tensor([list(rewards.COLORS).index(c.split()[1]) for c in captions])
    truthful = (torch.cdist(centre, palette).argmin(1) == named).float().mean().item()
    assert 0.7 < truthful < 0.85  # 75% true + 25% random (a random pick is right 1/8 of the time)


# ----------------------------------------------------------------------------------------------
# bench.py

import bench  # noqa: E402


def test_flow_grpo_baseline_step_log_prob_is_the_gaussian_density():
    velocity = lambda z, t, c: 0.3 * z - 1.0  # noqa: E731
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    grid = [1.0, 0.6, 0.5, 0.0]
    _, path = bench.sample_sde(velocity, x, grid, None, bench.FlowGRPO(), torch.Generator().manual_seed(1))
    x_t, t, t_next, x_next, log_prob = path[1]
    assert (t, t_next) == (0.6, 0.5) and torch.equal(x_t, path[0][3])
    v = velocity(x_t, None, None)
    sigma = 0.7 * math.sqrt(0.6 / 0.4)
    mean = x_t + (v + sigma**2 / 1.2 * (x_t + 0.4 * v)) * -0.1
    normal = torch.distributions.Normal(mean, sigma * math.sqrt(0.1))
    torch.testing.assert_close(log_prob, normal.log_prob(x_next).mean(1))
    # at t = 1 sigma's t is the grid's second point (Flow-GRPO's sigma_max); the last step, to 0, is noisy too
    assert bench.sde_mean_std(velocity, x, 1.0, 0.6, None, noise_level=0.7, t_cap=0.6)[1] == 0.7 * math.sqrt(1 / 0.4)
    assert not torch.allclose(path[-1][3], bench.sde_mean_std(velocity, path[-1][0], 0.5, 0.0, None, noise_level=0.7,
                                                              t_cap=0.6)[0])


def test_flow_grpo_update_is_flow_grpos_training_phase_written_out():
    """flow_grpo_update against Flow-GRPO's training phase written out by hand (torch.distributions for the kernel's
    density and the KL) on a linear velocity: with one update per batch, one SGD step on the mean over the samples with
    a non-zero advantage and over the first int(0.99 T) steps of the clipped objective (advantage clipped to 5) plus
    beta KL; with two, two optimizer steps, each over half the samples (one zero-advantage sample kept to split evenly)."""
    Normal = torch.distributions.Normal
    g = torch.Generator().manual_seed(0)
    policy = torch.nn.Linear(2, 2)
    reference, behaviour = copy.deepcopy(policy), copy.deepcopy(policy)
    with torch.no_grad():  # the policy differs from the reference (the KL acts) and from the sampler (ratios clip)
        policy.weight.add_(0.3 * torch.randn(2, 2, generator=g))
        behaviour.weight.add_(0.3 * torch.randn(2, 2, generator=g))

    def velocity(module):
        return lambda x, t, c: module(x) * (1 + t[:, None])

    grid, c = [1.0, 0.75, 0.5, 0.25, 0.0], torch.zeros(8)
    fg = bench.FlowGRPO(updates_per_batch=1, clip_range=0.05)
    _, path = bench.sample_sde(velocity(behaviour), torch.randn(8, 2, generator=g), grid, c, fg, g)
    adv = torch.tensor([1.0, -0.5, 0.0, 2.0, -7.0, 0.3, -0.3, 0.0])
    keep, a = adv != 0, adv.clamp(-5, 5)
    want, loss, ratios = copy.deepcopy(policy), 0.0, []
    for x_t, t, t_next, x_next, old in path[:3]:  # int(0.99 * 4) steps trained
        sigma = 0.7 * math.sqrt(t / (1 - min(t, 0.75)))
        dt = t_next - t

        def mean(module):
            v = velocity(module)(x_t, torch.full((8,), t), c)
            return x_t + (v + sigma**2 / (2 * t) * (x_t + (1 - t) * v)) * dt

        mu, mu_ref = mean(want), mean(reference).detach()
        ratio = (Normal(mu, sigma * math.sqrt(-dt)).log_prob(x_next).mean(1) - old).exp()
        objective = torch.max(-a * ratio, -a * ratio.clamp(0.95, 1.05))
        kl = torch.distributions.kl_divergence(Normal(mu, sigma), Normal(mu_ref, sigma)).mean(1)
        loss = loss + (objective[keep].mean() + 0.04 * kl[keep].mean()) / 3
        ratios.append(ratio[keep])
    assert ((torch.cat(ratios) - 1).abs() > 0.05).any()  # the clip is exercised
    loss.backward()
    got = copy.deepcopy(policy)
    trained = bench.flow_grpo_update(velocity(got), velocity(reference), path, c, adv, torch.optim.SGD(got.parameters(), lr=0.1),
                                     list(got.parameters()), fg, t_cap=0.75, max_grad_norm=1e9, generator=g)
    assert trained == 6
    for p_got, p_want in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(p_got, p_want - 0.1 * p_want.grad)

    rows, steps = [], []
    optimizer = torch.optim.SGD(got.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: steps.append(len(rows)))
    adv[3] = 0.0  # 5 non-zero: one zero-advantage sample joins them
    trained = bench.flow_grpo_update(lambda x, t, c: rows.append(x.shape[0]) or got(x), velocity(reference), path, c, adv,
                                     optimizer, list(got.parameters()), bench.FlowGRPO(), t_cap=0.75, max_grad_norm=1e9,
                                     generator=g)
    assert trained == 6 and rows == [3] * 6 and steps == [3, 6]


def test_flow_grpo_kl_is_flow_grpos_and_the_reference_is_the_model_without_its_lora():
    """Flow-GRPO's KL is the Gaussian KL with the SDE's sigma as the std (not the step's sigma sqrt(|dt|))."""
    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(4, 3, 2, generator=g), torch.randn(4, 3, 2, generator=g)
    want = torch.distributions.kl_divergence(torch.distributions.Normal(mean, 0.3), torch.distributions.Normal(ref, 0.3))
    torch.testing.assert_close(bench.flow_grpo_kl(mean, ref, 0.3), want.flatten(1).mean(1))
    model = bench.tiny_model()
    base_z, t, cond = torch.randn(2, *model.latent_shape(), generator=g), torch.tensor([0.3, 0.7]), model.encode(["a", "b"])
    with torch.no_grad():
        base = model.velocity(base_z, t, cond)
        train.make_trainable(model.transformer, train.Config())
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(generator=g)  # peft starts B at 0: move the policy away from the reference
        policy = model.velocity(base_z, t, cond)
        with bench.adapters_disabled(model.transformer):
            reference = model.velocity(base_z, t, cond)
        assert (policy - base).abs().max() > 1e-3
        torch.testing.assert_close(reference, base)
        torch.testing.assert_close(model.velocity(base_z, t, cond), policy)  # switched back on


def test_sd3_stability_section_counts_each_methods_evaluations_on_the_same_evaluation(tmp_path):
    """Section 9's code path at 2 iterations, random tiny SD3: train.py and flow_grpo_sd3 start from the same weights
    and evaluation (equal first evaluation up to one update), and each counts its own model evaluations per iteration:
    64 samples x (8 ODE steps + K = 8 forwards and 8 backwards + 4 old-policy forwards: the tiny preset's second
    mini-batch) against 64 x (10 SDE steps + 9 trained steps x (forward, backward, reference forward))."""
    text, data = bench.section_sd3_stability(tmp_path, seeds=(0,), lrs={"V-GRPO": (1e-3,), bench.MDP: (1e-3,)},
                                             iterations={"V-GRPO": 2, bench.MDP: 2}, eval_every=1, fit_steps=0,
                                             flags=("--eval_samples", "8"))
    ours, base = data["histories"]["V-GRPO"]["0.001"][0], data["histories"][bench.MDP]["0.001"][0]
    assert [h["nfe"] for h in ours] == [64 * 28, 2 * 64 * 28] and [h["nfe"] for h in base] == [64 * 37, 2 * 64 * 37]
    assert all(h["eval"] is not None and h["seconds"] > 0 for h in ours + base)
    assert abs(ours[0]["eval"] - base[0]["eval"]) < 1e-3
    assert text.count("\n| V-GRPO | 0.001 |") == len(bench.SD3_THRESHOLDS) == text.count(f"\n| {bench.MDP} | 0.001 |")


def test_comparison_takes_each_methods_best_learning_rate_among_those_every_seed_reaches():
    def cost(nfe):
        return None if nfe is None else dict(iterations=1, nfe=nfe, seconds=nfe / 100)

    costs = {"V-GRPO": {1e-3: [cost(10), cost(30)], 3e-3: [cost(5), None]},  # 3e-3 is cheaper but misses a seed
             bench.MDP: {1e-3: [cost(80), cost(60)], 3e-3: [cost(40), cost(30)]}}
    assert bench.best_lr(costs["V-GRPO"]) == 1e-3 and bench.best_lr(costs[bench.MDP]) == 3e-3
    same, best = bench.comparison(costs, 1e-3).splitlines()
    assert "at the same lr 0.001: model evaluations x5.000 ± 3.000" in same  # 80/10, 60/30
    assert "each at its best lr (V-GRPO 0.001, Flow-GRPO (MDP) 0.003): model evaluations x2.500 ± 1.500" in best
    costs["V-GRPO"][1e-3][1] = None
    assert "best against best: not comparable (V-GRPO" in bench.comparison(costs, 1e-3)


def test_stability_table_counts_success_only_before_a_divergence():
    def run(rewards, fracs):
        return [{"reward_mean": r, "frac_target_mode": f, "nfe_fwd": 100 * i, "nfe_bwd": 50 * i}
                for i, (r, f) in enumerate(zip(rewards, fracs), 1)]

    steady = run([-2.0, -1.0, -0.5, -0.6], [0.3, 0.95, 0.99, 0.99])
    late = run([-2.0, -11.0, -0.5, -0.4], [0.3, 0.4, 0.95, 0.99])  # succeeds only after leaving the range
    broken = run([-2.0, -1.0, float("nan"), float("nan")], [0.3, 0.95, 0.1, 0.1])  # succeeds, then non-finite
    assert [bench.diverged_at(h) for h in (steady, late, broken)] == [None, 1, 2]
    row = bench.stability_row("v", 1e-2, [steady, late, broken])
    # diverged 2/3; success counted for steady and broken (before its divergence), at iteration 1 with 300 evaluations;
    # fall-back only over runs that did not diverge: best -0.5, final -0.6
    assert row == ["v", "0.01", "2/3", "2/3", "1", "0k", "0.100"]


def test_flow_grpo_baseline_sde_keeps_the_marginals_of_the_flow():
    """Data N(m, s^2): the exact velocity is linear in x; the SDE must end at N(m, s^2) like the ODE."""
    m, s = 1.5, 0.5

    def velocity(x, t, c):
        t = t[:, None]
        var = (1 - t) ** 2 * s**2 + t**2
        return (t - (1 - t) * s**2) / var * (x - (1 - t) * m) - m

    g = torch.Generator().manual_seed(0)
    x, _ = bench.sample_sde(velocity, torch.randn(20000, 1, generator=g), vgrpo.flow_timesteps(400).tolist(), None,
                            bench.FlowGRPO(), g)
    assert abs(x.mean().item() - m) < 0.02 and abs(x.std().item() - s) < 0.02


def test_bench_gpu_section_runs_every_family_at_tiny_sizes_on_cpu():
    """The GPU section's code path (random transformers built directly in their dtype, LoRA, activation
    checkpointing, the preset's CFG in the sampling step) for every family, at the tiny pipelines' sizes."""
    tiny = {family: dict(family=family, config=dict(models.tiny_pipeline(family).transformer.config), resolution=32,
                         steps=2, tokens=8, cfg=4.0 if family in ("qwenimage", "flux2") else 1.0, samples=2)
            for family in IMAGE_FAMILIES}  # the families bench.py's GPU section measures
    text, results = bench.section_gpu(tiny, device=torch.device("cpu"), dtype=torch.float32,
                                      rollout_batches={n: (2,) for n in tiny}, backend="eager")
    assert set(results) == {f"{n} ckpt={c}" for n in tiny for c in (False, True)} | {f"{n} rollout-batch=2" for n in tiny}
    training = [r for key, r in results.items() if "ckpt" in key]
    assert all(r["step_s"] > 0 and r["floor_s"] > 0 and math.isfinite(r["ratio"]) for r in training)
    assert all(text.count(f"\n| {n} |") == 3 for n in tiny)
    # FLOPs of a sampling step: at least those of its linear layers, 2 x in x out per row, counted by hooks
    for n, spec in tiny.items():
        model, linear = bench.RandomModel(spec, torch.device("cpu"), torch.float32), []
        for m in model.transformer.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda m, args, out: linear.append(2 * out.numel() * m.in_features))
        cond = {k: v.expand(2, *v.shape[1:]) for k, v in model.cond_template.items()}
        velocity = model.guided(model.velocity, model.cond_template, spec["cfg"]) if spec["cfg"] != 1 else model.velocity
        with torch.no_grad():
            velocity(torch.randn(2, *model.latent_shape()), torch.full((2,), 0.5), cond)
        r = results[f"{n} rollout-batch=2"]
        assert sum(linear) <= r["flops"] and r["eager_mfu"] is None and r["compiled_images_per_s"] > 0
    model = bench.RandomModel({**tiny["qwenimage"], "samples": 2}, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.transformer.parameters()} == {torch.bfloat16}
    assert torch.equal(model.cond_template["mask"], torch.ones_like(model.cond_template["mask"]))
    assert model.cond_template["embeds"].std() > 0.5  # random text features, not cond_like's zeros


def test_bench_real_model_section_runs_the_checks_on_saved_pipelines(tiny_dirs):
    """Section 6's code path, on the tiny pipelines in place of the hub checkpoints."""
    small = ("--resolution", "32", "--max_sequence_length", "8", "--sampling_steps", "3", "--tiny_fit_steps", "0",
             "--lr", "1e-2", "--micro_batch_size", "1")
    presets = {"sd35m": "sd3", "flux": "flux", "qwenimage": "qwenimage", "flux2": "flux2"}
    text, results = bench.section_real_models({p: tiny_dirs / family for p, family in presets.items()},
                                              device=torch.device("cpu"), small_run=small)
    for r in results.values():
        assert r["rollout_vs_pipe"] < 1e-5 and r["export_vs_trained"] < 1e-5 < 1e-4 < r["trained_vs_base"]
        assert r["checkpoint_dtypes"] == ["torch.float32"]
    assert all(text.count(f"\n| {p} |") == 1 for p in presets)


def test_bench_scale_section_counts_the_old_pass_rows_it_saves():
    model = bench.tiny_model()
    model.transformer.add_adapter(train.lora_config(train.Config()))
    saving = bench.old_pass_saving(model, model.encode(["a red car"]), samples=8, num_grad_steps=2, repeats=1)
    assert saving["rows_per_sample"] == {"before": {"grad": 4, "no_grad": 4}, "after": {"grad": 4, "no_grad": 2}}
    assert saving["before_s"] > 0 and saving["after_s"] > 0
