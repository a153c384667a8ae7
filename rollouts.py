"""rollouts.py: what an iteration (and an evaluation) samples and scores, shared by train.py, evaluate.py and bench.py.

Seeds: every random draw is a pure function of (seed, stream, iteration, index) through `generator`, so nothing depends
on the world size or needs state to resume. Rollouts sample with any ODE solver on the pipeline's own sigma grid,
decode and score in chunks, the scoring of a chunk overlapping the sampling of the next; evaluate() samples the fixed
evaluation prompts from fixed noise.
"""

import contextlib
import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import adapters
import parallel
import reward_bridge
import rewards
import runs
from failures import RunStopped
from prompts import Prompt

# ----------------------------------------------------------------------------------------------
# Seeds: every draw a pure function of (seed, stream, iteration, index)


def generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU generator seeded by (seed, *keys): streams are independent and need no state to resume."""
    words = [seed] + [k if isinstance(k, int) else int.from_bytes(k.encode(), "little") % 2**32 for k in keys]
    return torch.Generator().manual_seed(int(np.random.SeedSequence(words).generate_state(1)[0]))


def prompts_for_iteration(num_available: int, num_prompts: int, seed: int, iteration: int) -> list[int]:
    """Prompt indices of an iteration: consecutive slices of one shuffled epoch after another. A pure
    function of (seed, iteration), so the sampler's position is the iteration number itself."""
    indices = []
    for k in range(iteration * num_prompts, (iteration + 1) * num_prompts):
        epoch, offset = divmod(k, num_available)
        order = torch.randperm(num_available, generator=generator(seed, "prompts", epoch))
        indices.append(order[offset].item())
    return indices


def initial_noise(cfg, model: adapters.FlowAdapter, stream: str, iteration: int, indices: range, device) -> torch.Tensor:
    """Rollout noise: one generator per GLOBAL sample index, so every sample's noise differs and does
    not depend on how samples are spread over ranks."""
    shape = model.latent_shape()
    return torch.stack([torch.randn(shape, generator=generator(cfg.seed, stream, iteration, i)) for i in indices]).to(device)


# ----------------------------------------------------------------------------------------------
# Conditioning and the rollout velocity


def encode(model: adapters.FlowAdapter, texts: list[str], device: torch.device, offload: bool) -> dict:
    """The frozen text encoders on `texts`; offloaded ones are moved to the GPU for the call only (T5-XXL alone is
    10.7 GiB in bf16: kept there it would hold that memory through rollouts and training)."""
    encoders = [m for name, m in model.pipe.components.items() if name.startswith("text_encoder") and m is not None]
    if offload:
        for module in encoders:
            module.to(device)
    try:
        return {k: v.to(device) for k, v in model.encode(texts).items()}
    finally:
        if offload:
            for module in encoders:
                module.to("cpu")


def guided_velocity(cfg, model: adapters.FlowAdapter, device: torch.device):
    """The velocity rollouts sample with: the model's, or under --cfg_scale both predictions combined as the family's
    pipeline combines them, against its negative prompt."""
    if cfg.cfg_scale == 1.0:
        return model.velocity
    uncond = encode(model, [model.negative_prompt], device, cfg.offload_text_encoders)
    return model.guided(model.velocity, uncond, cfg.cfg_scale)


def load_rewards(cfg, names, family: str, device: torch.device) -> dict:
    """The named rewards with their --reward_options, scoring what the model makes: a video model's videos go to image
    rewards frame by frame (rewards.for_samples)."""
    options = json.loads(cfg.reward_options)
    return {name: rewards.for_samples(name, rewards.load_reward(name, device=device, **options.get(name, {})),
                                      video=adapters.ADAPTERS[family].video, frame_interval=cfg.frame_interval)
            for name in names}


# ----------------------------------------------------------------------------------------------
# Sampling, decoding and scoring a batch; the evaluation on fixed prompts


@torch.no_grad()
def rollout(cfg, model: adapters.FlowAdapter, velocity, prompts: list[Prompt], cond: dict, noise: torch.Tensor,
            reward_fns: dict, progress: str = ""):
    """Sample, decode and score B samples (prompts[i] with conditioning row i) in chunks of
    rollout_batch_size; images are dropped after scoring. Returns final latents (B, ...) and rewards
    {name: (B,)}. progress: a bar's title (shown on a terminal), or none. Each chunk is decoded and scored in a
    second thread while the next one samples (rewards on the CPU or behind a server cost no sampling time). A
    reward server that fails stops the run on every rank, after the sampling the other ranks' sharded forwards need."""
    x0, scored = [], []
    chunks = range(0, len(prompts), cfg.rollout_batch_size)
    side = torch.cuda.Stream(noise.device) if noise.is_cuda else None  # the scorer's CUDA stream
    with ThreadPoolExecutor(max_workers=1) as scorer:
        for start in tqdm(chunks, desc=progress, disable=None if progress else True, leave=False, dynamic_ncols=True):
            rows = slice(start, start + cfg.rollout_batch_size)
            with parallel.gathered_once(model.transformer) if cfg.rollout_gather_once else contextlib.nullcontext():
                x = model.sample(velocity, noise[rows], {k: v[rows] for k, v in cond.items()}, cfg.solver)
            # x is ready where the sampling stream is now, not where it will be when the scorer starts
            ready = torch.cuda.current_stream(x.device).record_event() if side else None
            scored.append(scorer.submit(decode_and_score, model, reward_fns, x, prompts[rows], side, ready))
            x0.append(x)
        scored = [chunk.result() for chunk in scored]
    if side:
        torch.cuda.current_stream(noise.device).wait_stream(side)
    failure = parallel.first_failure(next((f for _, f in scored if f), ""))
    if failure:
        raise RunStopped(f"{failure}. Nothing of this iteration was saved; the last checkpoint is kept: --resume "
                         "once the reward answers")
    return torch.cat(x0), {name: torch.cat([s[name] for s, _ in scored]) for name in reward_fns}


@torch.no_grad()  # grad mode is per thread: the scorer's is on by default
def decode_and_score(model: adapters.FlowAdapter, reward_fns: dict, x: torch.Tensor, prompts: list[Prompt],
                     stream=None, ready=None):
    """Decode x and score the images with every reward: ({name: (B,)}, the first reward server failure or "").
    A failed server's scores are NaN, so the ranks can agree to stop after the iteration's sampling. On CUDA it runs
    on `stream` once the event `ready` (x sampled) has passed."""
    scores, failure = {}, ""
    with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
        if ready:
            stream.wait_event(ready)
        images = model.decode(x)
        for name, fn in reward_fns.items():
            try:
                scores[name] = fn(images, [p.text for p in prompts], [p.metadata for p in prompts]).float()
            except reward_bridge.RewardServerError as error:
                failure = failure or f"reward {name}: {error}"
                scores[name] = torch.full((x.shape[0],), math.nan, device=x.device)
    return scores, failure


def evaluate(cfg, model, velocity, eval_prompts, reward_fns, weights, rank, world, device, grid_path) -> dict:
    """Rewards on the fixed evaluation prompts with fixed noise (one sample per prompt). Every rank runs
    the same number of chunks (the sharded model needs all ranks in each forward); padding is dropped."""
    per_rank = math.ceil(len(eval_prompts) / world)
    indices = [(rank * per_rank + i) % len(eval_prompts) for i in range(per_rank)]
    real = torch.tensor([rank * per_rank + i < len(eval_prompts) for i in range(per_rank)], device=device)
    noise = initial_noise(cfg, model, "eval", 0, indices, device)
    chosen = [eval_prompts[i] for i in indices]
    cond = encode(model, [p.text for p in chosen], device, cfg.offload_text_encoders)
    x0, scores = rollout(cfg, model, velocity, chosen, cond, noise, reward_fns, progress="evaluating" if rank == 0 else "")
    totals = {n: torch.stack([(s * real).sum(), (s.pow(2) * real).sum(), real.sum().float()]) for n, s in scores.items()}
    if dist.is_initialized():
        for v in totals.values():
            dist.all_reduce(v)
    means = {f"eval/{n}_mean": (v[0] / v[2]).item() for n, v in totals.items()}
    # the spread over samples, for the hacking rule's standard errors (population std from the two sums)
    means.update({f"eval/{n}_std": (v[1] / v[2] - (v[0] / v[2]) ** 2).clamp_min(0).sqrt().item() for n, v in totals.items()})
    means["eval/reward_mean"] = sum(w * means[f"eval/{n}_mean"] for n, w in weights.items())
    if grid_path is not None:  # rank 0's share of the evaluation prompts
        records = [{"prompt": p.text, "seed": cfg.seed, "noise_index": i,
                    "rewards": {n: s[j].item() for n, s in scores.items()}}
                   for j, (p, i) in enumerate(zip(chosen, indices)) if real[j]]
        shown = records[:runs.GRID_SAMPLES]
        captions = [f"{r['prompt']} | " + " ".join(f"{n} {v:.3f}" for n, v in r["rewards"].items()) for r in shown]
        runs.save_samples(model.decode(x0[:len(shown)]), captions, records, grid_path)
    return means
