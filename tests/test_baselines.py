"""Tests of baselines.py: Flow-GRPO's step log-prob, update, KL and SDE against their published definitions.
"""

import copy
import math

import torch

import baselines
import bench
import models
import train
import vgrpo


def test_flow_grpo_baseline_step_log_prob_is_the_gaussian_density():
    velocity = lambda z, t, c: 0.3 * z - 1.0  # noqa: E731
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    grid = [1.0, 0.6, 0.5, 0.0]
    _, path = baselines.sample_sde(velocity, x, grid, None, baselines.FlowGRPO(), torch.Generator().manual_seed(1))
    x_t, t, t_next, x_next, log_prob = path[1]
    assert (t, t_next) == (0.6, 0.5) and torch.equal(x_t, path[0][3])
    v = velocity(x_t, None, None)
    sigma = 0.7 * math.sqrt(0.6 / 0.4)
    mean = x_t + (v + sigma**2 / 1.2 * (x_t + 0.4 * v)) * -0.1
    normal = torch.distributions.Normal(mean, sigma * math.sqrt(0.1))
    torch.testing.assert_close(log_prob, normal.log_prob(x_next).mean(1))
    # at t = 1 sigma's t is the grid's second point (Flow-GRPO's sigma_max); the last step, to 0, is noisy too
    assert baselines.sde_mean_std(velocity, x, 1.0, 0.6, None, noise_level=0.7, t_cap=0.6)[1] == 0.7 * math.sqrt(1 / 0.4)
    assert not torch.allclose(path[-1][3], baselines.sde_mean_std(velocity, path[-1][0], 0.5, 0.0, None, noise_level=0.7,
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
    fg = baselines.FlowGRPO(updates_per_batch=1, clip_range=0.05)
    _, path = baselines.sample_sde(velocity(behaviour), torch.randn(8, 2, generator=g), grid, c, fg, g)
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
    trained = baselines.flow_grpo_update(velocity(got), velocity(reference), path, c, adv, torch.optim.SGD(got.parameters(), lr=0.1),
                                         list(got.parameters()), fg, t_cap=0.75, max_grad_norm=1e9, generator=g)
    assert trained == 6
    for p_got, p_want in zip(got.parameters(), want.parameters()):
        torch.testing.assert_close(p_got, p_want - 0.1 * p_want.grad)

    rows, steps = [], []
    optimizer = torch.optim.SGD(got.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: steps.append(len(rows)))
    adv[3] = 0.0  # 5 non-zero: one zero-advantage sample joins them
    trained = baselines.flow_grpo_update(lambda x, t, c: rows.append(x.shape[0]) or got(x), velocity(reference), path, c, adv,
                                         optimizer, list(got.parameters()), baselines.FlowGRPO(), t_cap=0.75, max_grad_norm=1e9,
                                         generator=g)
    assert trained == 6 and rows == [3] * 6 and steps == [3, 6]


def test_flow_grpo_kl_is_flow_grpos_and_the_reference_is_the_model_without_its_lora():
    """Flow-GRPO's KL is the Gaussian KL with the SDE's sigma as the std (not the step's sigma sqrt(|dt|))."""
    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(4, 3, 2, generator=g), torch.randn(4, 3, 2, generator=g)
    want = torch.distributions.kl_divergence(torch.distributions.Normal(mean, 0.3), torch.distributions.Normal(ref, 0.3))
    torch.testing.assert_close(baselines.flow_grpo_kl(mean, ref, 0.3), want.flatten(1).mean(1))
    model = bench.tiny_model()
    base_z, t, cond = torch.randn(2, *model.latent_shape(), generator=g), torch.tensor([0.3, 0.7]), model.encode(["a", "b"])
    with torch.no_grad():
        base = model.velocity(base_z, t, cond)
        models.make_trainable(model.transformer, train.Config())
        for n, p in model.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(generator=g)  # peft starts B at 0: move the policy away from the reference
        policy = model.velocity(base_z, t, cond)
        with baselines.adapters_disabled(model.transformer):
            reference = model.velocity(base_z, t, cond)
        assert (policy - base).abs().max() > 1e-3
        torch.testing.assert_close(reference, base)
        torch.testing.assert_close(model.velocity(base_z, t, cond), policy)  # switched back on


def test_flow_grpo_baseline_sde_keeps_the_marginals_of_the_flow():
    """Data N(m, s^2): the exact velocity is linear in x; the SDE must end at N(m, s^2) like the ODE."""
    m, s = 1.5, 0.5

    def velocity(x, t, c):
        t = t[:, None]
        var = (1 - t) ** 2 * s**2 + t**2
        return (t - (1 - t) * s**2) / var * (x - (1 - t) * m) - m

    g = torch.Generator().manual_seed(0)
    x, _ = baselines.sample_sde(velocity, torch.randn(20000, 1, generator=g), vgrpo.flow_timesteps(400).tolist(), None,
                                baselines.FlowGRPO(), g)
    assert abs(x.mean().item() - m) < 0.02 and abs(x.std().item() - s) < 0.02
