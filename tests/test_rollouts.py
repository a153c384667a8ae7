"""Tests of rollouts.py: scoring overlapped with sampling, and the prompt order as a pure function of the seed.
"""

import threading

import torch

import bench
import rewards
import rollouts
import train
import vgrpo


def test_rollout_scores_each_chunk_while_the_next_one_samples():
    """rollouts.rollout decodes and scores chunk i in a second thread while chunk i + 1 samples (chunk 0's reward waits
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
    x0, scores = rollouts.rollout(cfg, model, velocity, batch, cond, noise, {"color": reward})
    assert waited == [True, True] and grad_mode == [False, False]
    torch.testing.assert_close(x0, vgrpo.sample_ode(model.velocity, noise, cond, model.timesteps(), solver="euler"))
    want = rewards.load_reward("color")(model.decode(x0), [p.text for p in batch], [{}] * 4)
    torch.testing.assert_close(scores["color"], want)


def test_prompt_order_is_a_pure_function_of_seed_and_iteration_covering_each_epoch():
    picks = [rollouts.prompts_for_iteration(10, 4, 0, it) for it in range(5)]  # 20 picks = 2 epochs of 10
    flat = sum(picks, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert picks == [rollouts.prompts_for_iteration(10, 4, 0, it) for it in range(5)]
    assert picks != [rollouts.prompts_for_iteration(10, 4, 1, it) for it in range(5)]
