"""Tests of vgrpo.py, the method. CPU only, offline; the other files' tests are in tests/ (`python -m pytest -q` runs all).

Every check compares against an independent reference (a NumPy loop, finite differences, a
closed form, a statistical test or a second code path) or asserts a behaviour that a broken
implementation would not show.
"""

import copy
import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import parallel
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



def gaussian_flow(m: float, s: float):
    """The exact velocity of the flow z_t = (1 - t) x + t eps for data x ~ N(m, s^2): v = (z - E[x | z_t]) / t."""
    def velocity(z, t, c):
        t, z = t[:, None].double(), z.double()
        x0 = m + (1 - t) * s**2 * (z - (1 - t) * m) / ((1 - t) ** 2 * s**2 + t**2)
        return ((z - x0) / t).float()
    return velocity


def dpm_solver_pp_2m(velocity, z: float, grid: list[float]) -> float:
    """DPM-Solver++(2M), Lu et al. 2022, Algorithm 2, written out in float64 for alpha_t = 1 - t, sigma_t = t: data
    prediction D = z - t v; lambda = log(alpha / sigma); the first step, and the final one to sigma = 0, first order."""
    alpha, lam = (lambda t: 1 - t), (lambda t: math.log((1 - t) / t) if 0 < t < 1 else (-math.inf if t >= 1 else math.inf))
    previous = None
    for i in range(len(grid) - 1):
        s, t = grid[i], grid[i + 1]
        D = z - s * velocity(torch.tensor([[z]]), torch.tensor([s]), None).item()
        if previous is None or t == 0:
            z = z + (t - s) * (z - D) / s  # first order: z_t = (sigma_t / sigma_s) z_s + (alpha_t - alpha_s sigma_t / sigma_s) D
        else:
            h, h_last = lam(t) - lam(s), lam(s) - lam(grid[i - 1])
            r = h_last / h
            z = t / s * z - alpha(t) * (math.exp(-h) - 1) * ((1 + 1 / (2 * r)) * D - 1 / (2 * r) * previous)
        previous = D
    return z


def test_dpm2_is_the_published_dpm_solver_pp_2m_and_approaches_the_flows_endpoint():
    """solver dpm2 against Algorithm 2 of the DPM-Solver++ paper written out, on the exact flow of Gaussian data (its
    endpoint m + s z_1 is known), on SD3's shifted grid and a uniform one: equal to float32 rounding, and closer to
    the endpoint as the steps double (first order at the final step to t = 0, so not at a clean order 2)."""
    velocity, z1 = gaussian_flow(0.5, 0.3), 0.7
    for grid in (partial(vgrpo.flow_timesteps, shift=3.0), vgrpo.flow_timesteps):
        errors = []
        for n in (8, 16, 32, 64):
            ours = vgrpo.sample_ode(velocity, torch.tensor([[z1]]), None, grid(n), solver="dpm2").item()
            assert ours == pytest.approx(dpm_solver_pp_2m(velocity, z1, grid(n).tolist()), abs=2e-6), n
            errors.append(abs(ours - (0.5 + 0.3 * z1)))
        assert errors[-1] < errors[0] / 4 and errors[-1] < 2e-3, errors

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
    assert proc.returncode == 0 or (finished and parallel.gloo_teardown_abort(output)), output
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
