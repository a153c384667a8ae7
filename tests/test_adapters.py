"""Tests of adapters.py: every family's rollouts equal the diffusers pipeline's own call, at toy sizes and at real
width (reduced depth), with CFG and the pipelines' own schedulers; cond_like is shaped like encode.
"""

from functools import lru_cache, partial

import pytest
import torch

import adapters
import builders
import evaluate
import failures
import models
import train
import vgrpo
from helpers import IMAGE_FAMILIES, SAVED_REAL, adapter_for, one_line_stop

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


@pytest.mark.parametrize("family", IMAGE_FAMILIES)  # Wan: its own test below (UniPC, CFG, frames)
def test_adapters_reproduce_the_diffusers_pipeline(family):
    assert_rollouts_equal_the_plain_pipeline_call(builders.tiny_pipeline(family, seed=0), family, resolution=32, steps=5)


def test_scheduler_solver_steps_the_pipelines_own_scheduler_as_its_call_does():
    """--solver scheduler == `pipe()` with the scheduler the checkpoint ships: UniPC with flow sigmas (the Wan
    checkpoints') swapped into tiny SD3, where Euler on the same sigma grid is a different sampler; and with the
    default FlowMatchEuler it is the euler solver. A second-order scheduler is refused before any rollout."""
    from diffusers import FlowMatchHeunDiscreteScheduler, UniPCMultistepScheduler

    pipe = builders.tiny_pipeline("sd3", seed=0)
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
    with pytest.raises(failures.ConfigError, match="order 2: use --solver heun"):
        models.check_sampling_grid(adapter_for(pipe, "sd3"), "scheduler")


@pytest.mark.parametrize("expand_timesteps", [False, True], ids=["wan2.1", "wan2.2-ti2v"])
def test_wan_rollouts_equal_the_plain_pipeline_call_with_its_unipc_scheduler_and_cfg(expand_timesteps):
    """Wan rollouts (UMT5 encoding, CFG 4 against the pipeline's default negative "", --solver scheduler on the
    checkpoints' UniPC) and decoding == `pipe(prompt, num_frames=5, num_inference_steps=4, latents=noise)`, and the
    transformer receives the timestep in the pipeline's form: (B,), or one per latent token under expand_timesteps."""
    pipe = builders.tiny_wan_pipeline(seed=0, expand_timesteps=expand_timesteps)
    model = adapters.Wan(pipe, resolution=32, sampling_steps=4, max_sequence_length=16, num_frames=5)
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
        adapters.Wan(pipe, resolution=32, sampling_steps=4, max_sequence_length=16)


REAL_IMAGE = [name for name, spec in builders.REAL_CONFIGS.items() if spec["family"] != "wan"]


REAL_WAN = [name for name, spec in builders.REAL_CONFIGS.items() if spec["family"] == "wan"]


@pytest.fixture(scope="module")
def real_pipes(real_dirs):
    """name -> pipeline for every REAL_CONFIGS entry, loaded in float32 through from_pretrained where saved (each
    on first use); the other members of a family share the saved one's text encoders and VAE (same widths) with
    their own transformer and scheduler. One family's saved pipeline is kept at a time (the tests come family by
    family): all five in float32 held 16 GB of a worker's memory."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    @lru_cache(maxsize=1)
    def saved(name):
        return DiffusionPipeline.from_pretrained(real_dirs / name, dtype=torch.float32)

    def get(name):
        if name in SAVED_REAL.values():
            return saved(name)
        spec = builders.REAL_CONFIGS[name]
        base = saved(SAVED_REAL[spec["family"]])
        if spec["family"] == "wan":  # its own VAE (Wan2.2's differs), the saved UMT5
            return builders.reduced_wan_pipeline(name, text_encoder=base.text_encoder, tokenizer=base.tokenizer)
        return type(base)(**{**base.components, "transformer": builders.reduced_transformer(name).eval(),
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
    pipe, family = real_pipes(name), builders.REAL_CONFIGS[name]["family"]
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
    model = adapters.Wan(pipe, resolution=64, sampling_steps=3, max_sequence_length=16, num_frames=5)
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


@pytest.mark.parametrize("family", list(adapters.ADAPTERS))
def test_cond_like_is_shaped_like_encode(family):
    """The plan runs the transformer on cond_like(); it must be what encode() gives the transformer in training."""
    model = adapter_for(builders.tiny_pipeline(family), family)
    real = model.encode(["a red car", "a blue flower"])
    assert {k: v.shape for k, v in model.cond_like(2).items()} == {k: v.shape for k, v in real.items()}


@pytest.mark.parametrize("script", ["train", "evaluate"])
def test_a_video_longer_than_the_rotary_table_holds_is_refused_before_the_fit_and_any_sampling(script, monkeypatch,
                                                                                             capsys):
    """Before: --preset tiny-wan --num_frames 129 passed the 1 + 4k check, fitted the tiny model for a minute and died
    in its first forward with "shape '[33, 1, 1, -1]' is invalid" (the rotary table holds 32 latent frames)."""
    monkeypatch.setattr(builders, "fit_tiny_pipeline", lambda *a, **k: pytest.fail("the tiny model was fitted"))
    monkeypatch.setattr(vgrpo, "sample_ode", lambda *a, **k: pytest.fail("sampling started"))
    main = train.main if script == "train" else evaluate.main
    text = one_line_stop(main, ["--preset", "tiny-wan", "--num_frames", "129"], capsys)
    assert ("--num_frames 129 at 32 x 32 px is 33 latent frames of 4 x 4 patches; this WanTransformer3DModel has "
            "rotary positions for at most 32 on each axis: at most 125 frames") in text
    adapters.Wan(builders.tiny_wan_pipeline(), resolution=32, sampling_steps=1, max_sequence_length=8, num_frames=125)  # 32 latent frames fit
