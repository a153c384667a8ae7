"""Tests of baselines.py: Flow-GRPO's step log-prob, update, KL and SDE against their published definitions.
"""

import copy
import math
import types

import numpy as np
import pytest
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


# ----------------------------------------------------------------------------------------------
# DiffusionNFT


def nft_loss_written_out(v, v_old, v_ref, x_t, x0, t, adv, *, beta=1.0, kl=1e-4, adv_clip_max=5.0):
    """train_nft_sd3.py's loss lines for one timestep of a micro-batch, transcribed one by one in NumPy (float64)."""
    v, v_old, v_ref, x_t, x0, t, adv = (np.asarray(a.detach(), dtype=np.float64) for a in (v, v_old, v_ref, x_t, x0, t, adv))
    t = t.reshape(-1, *[1] * (x0.ndim - 1))
    axes = tuple(range(1, x0.ndim))
    advantages_clip = np.clip(adv, -adv_clip_max, adv_clip_max)
    r = np.clip(advantages_clip / adv_clip_max / 2.0 + 0.5, 0, 1)
    positive_prediction = beta * v + (1 - beta) * v_old
    implicit_negative_prediction = (1.0 + beta) * v_old - beta * v
    x0_prediction = x_t - t * positive_prediction
    weight_factor = np.clip(np.abs(x0_prediction - x0).mean(axis=axes, keepdims=True), 0.00001, None)
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(axis=axes)
    negative_x0_prediction = x_t - t * implicit_negative_prediction
    negative_weight_factor = np.clip(np.abs(negative_x0_prediction - x0).mean(axis=axes, keepdims=True), 0.00001, None)
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(axis=axes)
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    return policy_loss + kl * ((v - v_ref) ** 2).mean(axis=axes).mean()


def test_diffusion_nft_loss_is_its_published_training_step_written_out():
    """nft_loss against train_nft_sd3.py's lines transcribed in NumPy, for beta 1 (its SD3 tasks) and 0.1 (its OCR and
    multi-reward tasks), advantages beyond the clip and a sample whose error is below the weight's floor; and its
    gradient where the policy is the old one: with r = 1 (the best sample) it pulls x0 = x_t - t v towards the sample."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(6, 4, 3, 3, generator=g), torch.randn(6, 4, 3, 3, generator=g)
    t = torch.rand(6, generator=g)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v, v_old, v_ref = (eps - x0 + 0.3 * torch.randn(6, 4, 3, 3, generator=g) for _ in range(3))
    v_old[0] = v[0] = eps[0] - x0[0]  # an exact prediction: the floor 1e-5 acts
    adv = torch.tensor([7.0, -9.0, 0.5, -0.5, 0.0, 2.0])
    for beta, kl in ((1.0, 1e-4), (0.1, 1e-4), (1.0, 0.3)):
        nft = baselines.DiffusionNFT(beta=beta, kl=kl)
        assert baselines.nft_loss(v, v_old, v_ref, x_t, x0, t, adv, nft).item() == pytest.approx(
            nft_loss_written_out(v, v_old, v_ref, x_t, x0, t, adv, beta=beta, kl=kl), rel=1e-6)
    v_new = v_old.clone().requires_grad_(True)
    nft = baselines.DiffusionNFT(kl=0.0)
    baselines.nft_loss(v_new, v_old, v_ref, x_t, x0, t, torch.full((6,), 5.0), nft).backward()
    step = -v_new.grad  # gradient descent on v; x0_hat = x_t - t v moves by -t step
    towards = ((x_t - t.view(-1, 1, 1, 1) * v_old) - x0)  # the x0 error of the old policy
    assert (((-t.view(-1, 1, 1, 1) * step) * towards).flatten(1).sum(1)[1:] < 0).all()  # the error shrinks


def test_old_policy_decay_ema_decay_and_per_prompt_advantages_are_diffusion_nfts():
    """return_decay (decay_type 1: min(0.001 step, 0.5); 2: 0 for 75 steps then 0.0075 a step up to 0.999), the EMA's
    min((1 + step) / (10 + step), 0.9), and PerPromptStatTracker(global_std=True) written out in NumPy."""
    assert [baselines.old_policy_decay(s, 1) for s in (0, 1, 100, 500, 5000)] == [0.0, 0.001, 0.1, 0.5, 0.5]
    assert [baselines.old_policy_decay(s, 2) for s in (0, 74, 75, 76, 300)] == [0.0, 0.0, 0.0, 0.0075, 0.999]
    assert baselines.old_policy_decay(7, 0) == 0.0
    assert [baselines.nft_ema_decay(s, 0.9) for s in (1, 8, 1000)] == [2 / 11, 9 / 18, 0.9]
    rewards = torch.tensor([0.2, 0.4, 0.9, 0.1, 0.3, 0.5])
    prompts = ["a", "a", "b", "b", "a", "c"]
    r = rewards.numpy().astype(np.float64)
    expected = [(r[i] - r[[j for j, p in enumerate(prompts) if p == prompts[i]]].mean()) / (np.std(r) + 1e-4)
                for i in range(6)]
    torch.testing.assert_close(baselines.per_prompt_advantages(rewards, prompts), torch.tensor(expected).float())


def test_diffusion_nft_update_is_one_optimizer_step_on_the_mean_over_samples_and_timesteps(toy_flow):
    """The loss of every sample and timestep accumulates into one optimizer step per gradient step, whatever the
    micro-batch: with SGD the step taken from micro-batches of 1 equals the step from one micro-batch of all."""
    model, cond, x0, adv = toy_flow
    grid = vgrpo.flow_timesteps(10, shift=3.0).tolist()
    nft = baselines.DiffusionNFT()
    after = []
    for micro in (1, len(x0)):
        m = copy.deepcopy(model)
        params = list(m.parameters())
        old = [p.detach().clone() * 0.9 for p in params]
        adapter = types.SimpleNamespace(velocity=m)
        trained = baselines.diffusion_nft_update(adapter, m, old, params, torch.optim.SGD(params, lr=0.5), x0, cond, adv,
                                                 grid, nft, micro_batch_size=micro, max_grad_norm=1e9,
                                                 generator=torch.Generator().manual_seed(0), ema=[], steps_done=0)
        assert trained == len(x0) * 9  # int(0.99 x 10) timesteps per sample
        after.append(torch.cat([p.detach().flatten() for p in params]))
    torch.testing.assert_close(after[0], after[1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after[0], torch.cat([p.detach().flatten() for p in model.parameters()]))


def test_diffusion_nft_steps_its_ema_after_every_optimizer_step(toy_flow):
    """train_nft_sd3.py steps the EMA after each optimizer step, with the decay of the step count so far: with 2
    gradient steps per batch (its OCR setting) the EMA is lerped twice, towards the weights after each step. (It was
    lerped once per batch, towards the last weights: half as often.)"""
    model, cond, x0, adv = toy_flow
    grid = vgrpo.flow_timesteps(10, shift=3.0).tolist()
    nft = baselines.DiffusionNFT(gradient_steps=2, ema_decay=0.9)
    params = list(model.parameters())
    ema, start = [p.detach().clone() for p in params], [p.detach().clone() for p in params]
    optimizer, after_each = torch.optim.SGD(params, lr=0.5), []
    optimizer.register_step_post_hook(lambda *_: after_each.append([p.detach().clone() for p in params]))
    baselines.diffusion_nft_update(types.SimpleNamespace(velocity=model), model, [p.detach() * 0.9 for p in params],
                                   params, optimizer, x0, cond, adv, grid, nft, micro_batch_size=4, max_grad_norm=1e9,
                                   generator=torch.Generator().manual_seed(0), ema=ema, steps_done=7)
    assert len(after_each) == 2
    expected = start
    for step, weights in zip((8, 9), after_each):  # decay min((1 + s) / (10 + s), 0.9) after s optimizer steps
        decay = min((1 + step) / (10 + step), 0.9)
        expected = [decay * e + (1 - decay) * w for e, w in zip(expected, weights)]
    for got, want in zip(ema, expected):
        torch.testing.assert_close(got, want)


@pytest.fixture
def toy_flow():
    """A 2-D toy flow (vgrpo.ToyFlow) with 8 samples of 2 prompts and advantages."""
    torch.manual_seed(0)
    model = vgrpo.ToyFlow()
    g = torch.Generator().manual_seed(1)
    return model, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.randn(8, 2, generator=g), torch.randn(8, generator=g)


# ----------------------------------------------------------------------------------------------
# MixGRPO


def test_mixgrpo_window_slides_one_step_per_period_to_its_end_and_rolls_back():
    """GRPOTrainingStates (progressive, prog_overlap_step 1, roll_back) with 10 steps and a window of 4: max_timesteps
    = 8, the window range(start, min(start + 4, 8)), empty at start 8, then back to 0."""
    mix = baselines.MixGRPO(sampling_steps=10, window=4)
    windows = [baselines.mixgrpo_window(it, mix, iters_per_window=2) for it in range(0, 20, 2)]
    assert windows == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7], [6, 7], [7], [],
                       [0, 1, 2, 3]]
    assert baselines.mixgrpo_window(1, mix, 2) == baselines.mixgrpo_window(0, mix, 2)


def test_mixgrpo_flash_grid_compresses_the_steps_after_the_window():
    """dpm_apply_strategy post: after the window's last step (5 of 10), int(max(5 x 0.4, 1)) = 2 points of a new
    shifted grid from linspace(1, 0, 11)[6] = 0.4 to 0: the first is where the window's last step lands."""
    plain = baselines.mixgrpo_schedule(10, 3.0)
    assert plain[0] == 1.0 and plain[-1] == 0.0 and plain[5] == pytest.approx(3 * 0.5 / 2)
    flash = baselines.mixgrpo_grid([2, 3, 4, 5], baselines.MixGRPO(flash=True))
    assert flash[:7] == pytest.approx(plain[:7]) and flash[6:] == pytest.approx([1.2 / 1.8, 0.0]) and len(flash) == 8
    assert baselines.mixgrpo_grid([2, 3, 4, 5], baselines.MixGRPO()) == plain


def test_mixgrpo_rollout_is_euler_outside_the_window_sde_inside_and_dpm_after_it_with_flash():
    velocity = lambda z, t, c: 0.4 * z - t[:, None]  # noqa: E731
    z1 = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    mix = baselines.MixGRPO(sampling_steps=10)
    grid = baselines.mixgrpo_grid([], mix)
    x, path = baselines.mixgrpo_rollout(velocity, z1, None, grid, [], mix, torch.Generator())
    assert path == [] and torch.allclose(x, vgrpo.sample_ode(velocity, z1, None, torch.tensor(grid, dtype=torch.float64)))  # the ODE
    x, path = baselines.mixgrpo_rollout(velocity, z1, None, grid, [2, 3], mix, torch.Generator().manual_seed(1))
    assert [(t, t_next) for _, t, t_next, _, _ in path] == [(grid[2], grid[3]), (grid[3], grid[4])]
    x_t, t, t_next, x_next, log_prob = path[0]
    mean, _, std = baselines.sde_mean_std(velocity, x_t, t, t_next, None, noise_level=0.7, t_cap=grid[1])
    torch.testing.assert_close(log_prob, torch.distributions.Normal(mean, std).log_prob(x_next).mean(1))
    # Flash: the steps after the window are DPM-Solver++(2M), continuing from the data predictions before them
    flash = baselines.MixGRPO(sampling_steps=10, flash=True)
    fgrid = baselines.mixgrpo_grid([2, 3], flash)
    x, path = baselines.mixgrpo_rollout(velocity, z1, None, fgrid, [2, 3], flash, torch.Generator().manual_seed(1))
    z, x0_prev = path[-1][3], None
    x0_prev = path[-1][0] - fgrid[3] * velocity(path[-1][0], torch.full((3,), fgrid[3]), None)
    for i in range(4, len(fgrid) - 1):
        x0 = z - fgrid[i] * velocity(z, torch.full((3,), fgrid[i]), None)
        z = (vgrpo.dpm_solver_step(z, x0, x0_prev, fgrid[i - 1], fgrid[i], fgrid[i + 1]) if fgrid[i + 1] > 0
             else z + (fgrid[i + 1] - fgrid[i]) * velocity(z, torch.full((3,), fgrid[i]), None))
        x0_prev = x0
    torch.testing.assert_close(x, z)


def test_mixgrpo_aggregates_each_rewards_group_advantages_as_its_scripts_do(tiny_dirs, monkeypatch):
    """multi_reward_mix "advantage_aggr" (MixGRPO's published scripts; train_grpo_flux.py's loop written out below):
    per reward and group (r - mean) / (unbiased std + 1e-8), summed with the weights normalised to sum 1; and
    mixgrpo_sd3 trains on it. It trained on the group advantages of the weighted reward sum (MixGRPO's other mode,
    reward_aggr): another weighting of the two rewards in every group."""
    g = torch.Generator().manual_seed(0)
    scores = {"color": torch.rand(2, 4, generator=g), "jpeg": 10 * torch.rand(2, 4, generator=g)}
    weights = {"color": 1.0, "jpeg": 3.0}
    expected = torch.zeros(8)
    for name, rewards in scores.items():
        flat = rewards.flatten()
        for i in range(2):
            group = flat[4 * i:4 * (i + 1)]
            expected[4 * i:4 * (i + 1)] += (group - group.mean()) / (group.std() + 1e-8) * weights[name] / 4.0
    torch.testing.assert_close(baselines.mixgrpo_advantages(scores, weights).flatten(), expected)
    summed = baselines.group_advantages_unbiased(sum(w * scores[n] for n, w in weights.items()))
    assert not torch.allclose(summed.flatten(), expected, atol=1e-2)  # the two modes differ here
    # mixgrpo_sd3 trains on these advantages, one per reward the run scores
    calls, trained = [], []
    advantages = baselines.mixgrpo_advantages
    monkeypatch.setattr(baselines, "mixgrpo_advantages", lambda s, w: calls.append((set(s), w)) or advantages(s, w))
    monkeypatch.setattr(baselines, "mixgrpo_update", lambda *a, **k: trained.append(a[3]) or 0)
    flags = ("--rewards", "color:1,jpeg_compressibility:2",
             "--num_prompts", "2", "--group_size", "4", "--eval_samples", "4", "--tiny_fit_steps", "0")
    baselines.mixgrpo_sd3(tiny_dirs / "sd3", 0, 1, 1, flags=flags)
    assert calls == [({"color", "jpeg_compressibility"}, {"color": 1.0, "jpeg_compressibility": 2.0})]
    assert len(trained) == 1 and trained[0].shape == (8,)


def test_mixgrpo_update_steps_once_per_part_of_every_group_with_ratio_one_first():
    """updates_per_batch optimizer steps, step j on the j-th part of every group (as MixGRPO's GPUs step through their
    generations three at a time); the first step recomputes exactly the sampling log-probs (ratio 1)."""
    model = torch.nn.Linear(2, 2)
    velocity = lambda z, t, c: model(z)  # noqa: E731
    mix = baselines.MixGRPO(sampling_steps=6, updates_per_batch=2)
    grid = baselines.mixgrpo_schedule(6, 3.0)
    z1 = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    _, path = baselines.mixgrpo_rollout(velocity, z1, None, grid, [1, 2], mix, torch.Generator().manual_seed(1))
    seen, ratios = [], []
    real_log_prob = baselines.gaussian_log_prob

    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(len(ratios))
            return super().step(closure)

    def recording(x, mean, std):
        out = real_log_prob(x, mean, std)
        ratios.append(out.detach())
        return out

    baselines.gaussian_log_prob = recording
    try:
        params = list(model.parameters())
        trained = baselines.mixgrpo_update(velocity, path, torch.zeros(8), torch.randn(8), Counting(params, lr=0.1),
                                           params, mix, group_size=4, t_cap=grid[1], max_grad_norm=1.0)
    finally:
        baselines.gaussian_log_prob = real_log_prob
    assert trained == 8 and seen == [2, 4]  # two steps, each after the window's two steps
    torch.testing.assert_close(ratios[0], path[0][4][[0, 1, 4, 5]])  # part 0 of both groups, before any step
