"""bench_gpu.py: bench.py's sections that need a CUDA device, run through `python bench.py --sections 5,6`.

5. Throughput at the paper's model sizes (random weights): images/s, step time against a bare forward + backward, and
   model FLOP utilisation, per preset, eager and with compiled blocks.
6. The real-model path on each preset's real checkpoint (or `--reduced`: real-width, reduced-depth pipelines built in
   place): rollouts against `pipe(...)`, one preset iteration, the checkpoint's dtypes, the export against training,
   the measured peak against the memory plan.

bench.py's docstring describes every section; the tests run both on tiny pipelines on the CPU (tests/test_bench.py).
"""

import json
import subprocess
import sys
import tempfile
import types
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.flop_counter

import adapters
import builders
import memory
import models
import parallel
import rollouts
import train
import vgrpo
from bench import median_seconds, table, update_vs_floor

# ----------------------------------------------------------------------------------------------
# 5. GPU: the paper's model sizes, random weights

# preset -> (builders.REAL_CONFIGS name, rows per forward: the preset's micro-batch, 8 for SD3.5-M as first measured)
GPU_MODELS = {"sd35m": ("sd3.5-medium", 8), "flux": ("flux.1-dev", 2), "qwenimage": ("qwen-image", 2),
              "flux2": ("flux.2-klein-4b", 4)}


def real_sizes(gpu_models: dict = GPU_MODELS) -> dict:
    """Section 5's rows: each preset's transformer at its published size (builders.REAL_CONFIGS) with the preset's
    resolution, sampling steps, text length and CFG scale."""
    sizes = {}
    for preset, (name, samples) in gpu_models.items():
        p, spec = train.PRESETS[preset], builders.REAL_CONFIGS[name]
        sizes[preset] = dict(family=spec["family"], config=spec["transformer"], resolution=p["resolution"],
                             steps=p["sampling_steps"], tokens=p["max_sequence_length"], cfg=p.get("cfg_scale", 1.0),
                             samples=samples)
    return sizes


def gpu_row(spec: dict, ckpt: bool, device, dtype, repeats: int) -> dict:
    """One row of section 5: a sampling step's seconds (both forwards where the preset uses CFG), one LoRA update
    against the bare forward + backward, peak memory."""
    model = RandomModel(spec, device, dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cond = {k: v.expand(spec["samples"], *v.shape[1:]).to(device) for k, v in model.cond_template.items()}
    velocity = model.velocity
    if spec["cfg"] != 1:
        velocity = model.guided(model.velocity, {k: v.to(device) for k, v in model.cond_template.items()}, spec["cfg"])
    noise = torch.randn(spec["samples"], *model.latent_shape(), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        step_s, = median_seconds(lambda: (velocity(noise, torch.full((len(noise),), 0.5, device=device), cond),
                                          sync()), repeats=repeats)
    update = update_vs_floor(model, model.cond_template, samples=spec["samples"], num_mc=4, lora_rank=32,
                             grad_checkpointing=ckpt, device=device, repeats=repeats)
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return dict(sampling_step_s=step_s, memory_gb=memory, **update)


def random_transformer(family: str, config: dict, device, dtype) -> torch.nn.Module:
    """The family's transformer class from `config`, built directly in `dtype` on `device` with N(0, 0.02) weights
    (a float32 build first would need 80 GB for Qwen-Image's 20 B parameters)."""
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # Qwen-Image's rotary tables are plain tensors: keep them real
        meta = getattr(diffusers, builders.TRANSFORMER_CLASSES[family]).from_config(config)
    return memory.materialize(meta, dtype, device=device).eval()


class RandomModel:
    """A train.py adapter around a random transformer, with random text embeddings in place of encoders."""

    def __init__(self, spec: dict, device, dtype):
        self.transformer = random_transformer(spec["family"], spec["config"], device, dtype)
        self.transformer.requires_grad_(False)
        if dist.is_initialized():  # under torchrun: FSDP2 over the visible GPUs, as train.py does
            parallel.apply_fsdp(self.transformer, device, dtype)
        pipe = types.SimpleNamespace(transformer=self.transformer, vae_scale_factor=8)  # all the adapter reads
        adapter = adapters.ADAPTERS[spec["family"]](pipe, dtype, resolution=spec["resolution"], sampling_steps=spec["steps"],
                                                    max_sequence_length=spec["tokens"])
        self.velocity, self.latent_shape, self.guided = adapter.velocity, adapter.latent_shape, adapter.guided
        # encode()'s shapes from the adapter; random values, except a text mask (Qwen-Image's), which stays all ones
        self.cond_template = {k: v if k == "mask" else torch.randn_like(v) for k, v in adapter.cond_like(1).items()}


# Dense bf16 tensor-core peaks (TFLOP/s, SXM parts, no sparsity), by a substring of the device name: what model FLOP
# utilisation is a fraction of.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}


def peak_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def rollout_row(spec: dict, batch: int, device, dtype, repeats: int, backend: str) -> dict:
    """Rollout throughput of one preset at `batch` samples per sampling call: a sampling step's seconds eager and
    with each block compiled (parallel.compile_blocks), its FLOPs (torch's FlopCounterMode, both CFG halves counted),
    images/s over the preset's steps and model FLOP utilisation against the card's bf16 peak."""
    model = RandomModel(spec, device, dtype)
    cond = {k: v.expand(batch, *v.shape[1:]).to(device) for k, v in model.cond_template.items()}
    velocity = model.velocity
    if spec["cfg"] != 1:
        velocity = model.guided(model.velocity, {k: v.to(device) for k, v in model.cond_template.items()}, spec["cfg"])
    noise, t = torch.randn(batch, *model.latent_shape(), device=device), torch.full((batch,), 0.5, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = lambda: (velocity(noise, t, cond), sync())  # noqa: E731
    with torch.no_grad():
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            velocity(noise, t, cond)
        eager_s, = median_seconds(step, repeats=repeats)
        parallel.compile_blocks(model.transformer, backend)
        step()  # compiles; median_seconds warms up once more
        compiled_s, = median_seconds(step, repeats=repeats)
    peak = peak_tflops(device)
    row = dict(batch=batch, flops=counter.get_total_flops(), eager_s=eager_s, compiled_s=compiled_s)
    for kind in ("eager", "compiled"):
        seconds = row[f"{kind}_s"]
        row[f"{kind}_images_per_s"] = batch / (seconds * spec["steps"])
        row[f"{kind}_mfu"] = row["flops"] / seconds / (peak * 1e12) if peak else None
    return row


def section_gpu(sizes: dict | None = None, device=None, dtype=torch.bfloat16, repeats: int = 3,
                rollout_batches: dict | None = None, backend: str = "inductor") -> tuple[str, dict]:
    """rollout_batches: {preset: sampling calls' batch sizes} for the rollout table (default: the training table's
    batch and the preset's rollout_batch_size)."""
    device, sizes = device or torch.device("cuda"), sizes or real_sizes()
    adapters.avoid_cudnn_attention()  # as train.py does
    rows, results = [], {}

    def guarded(key: str, measure, row_of, width: int) -> None:
        try:
            results[key] = measure()
            rows[-1].append(row_of(results[key]))
        except torch.OutOfMemoryError:  # a row that does not fit is a result, not the end of the section
            results[key] = "out of memory"
            rows[-1].append([*key.split(" "), "out of memory", *[""] * (width - 3)])
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
        print("|", " | ".join(str(c) for c in rows[-1][-1]), "|", flush=True)  # a row survives a later timeout

    rows.append([])
    for name, spec in sizes.items():
        for ckpt in (False, True):
            guarded(f"{name} ckpt={ckpt}", partial(gpu_row, spec, ckpt, device, dtype, repeats), lambda r: [
                name, "on" if ckpt else "off", spec["samples"], f"{r['sampling_step_s'] * 1e3:.0f}",
                f"{spec['samples'] / (r['sampling_step_s'] * spec['steps']):.2f}", f"{r['step_s'] * 1e3:.0f}",
                f"{r['ratio']:.2f}", f"{r['memory_gb']:.1f}"], 8)
    rows.append([])
    mfu = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    for name, spec in sizes.items():
        default = (spec["samples"], train.PRESETS.get(name, {}).get("rollout_batch_size", spec["samples"]))
        for batch in sorted(set((rollout_batches or {}).get(name, default))):
            guarded(f"{name} rollout-batch={batch}", partial(rollout_row, spec, batch, device, dtype, repeats, backend),
                    lambda r: [name, r["batch"], f"{r['flops'] / 1e12:.2f}", f"{r['eager_s'] * 1e3:.0f}",
                               f"{r['eager_images_per_s']:.2f}", mfu(r["eager_mfu"]), f"{r['compiled_s'] * 1e3:.0f}",
                               f"{r['compiled_images_per_s']:.2f}", mfu(r["compiled_mfu"]),
                               f"{r['eager_s'] / r['compiled_s']:.2f}"], 10)
    peak = peak_tflops(device)
    text = (f"{torch.cuda.get_device_name() if device.type == 'cuda' else device}, {dtype}, random weights, LoRA r 32, "
            "K = 4, each preset's resolution and text length; a sampling step is one forward, two with the preset's CFG "
            "(Qwen-Image, FLUX.2 [klein] base: 4); rollout images/s = batch / (sampling step x the preset's steps: "
            + ", ".join(f"{n} {spec['steps']}" for n, spec in sizes.items()) + ").\n\n"
            + table(["model", "activation ckpt", "batch", "ms per sampling step", "rollout images/s", "ms per update",
                     "update / (fwd + bwd)", "peak GiB"], rows[0])
            + f"\n\nRollouts, no LoRA, eager and with each transformer block compiled ({backend}, parallel.compile_blocks; "
            f"--compile {backend}): TFLOP per sampling step counted by torch's FlopCounterMode; MFU = FLOP/s against "
            + (f"the card's dense bf16 peak, {peak:g} TFLOP/s" if peak else "a known card's dense bf16 peak (none here)")
            + ".\n\n" + table(["model", "batch", "TFLOP per step", "eager ms", "eager images/s", "eager MFU",
                               "compiled ms", "compiled images/s", "compiled MFU", "speed-up"], rows[1]))
    return text, results


# ----------------------------------------------------------------------------------------------
# 6. The real-model path on real weights (GPU and hub): what the tests check at reduced depth on CPU

REAL_MODELS = {preset: train.PRESETS[preset]["model"] for preset in GPU_MODELS}
REDUCED = {preset: name for preset, (name, _) in GPU_MODELS.items()}  # preset -> builders.REAL_CONFIGS name


def reduced_checkpoints(root: Path) -> dict:
    """Section 6 without the hub: each preset's pipeline at real width and reduced depth (builders.reduced_pipeline,
    random weights), saved under root."""
    for preset, name in REDUCED.items():
        builders.reduced_pipeline(name).save_pretrained(root / name)
    return {preset: root / name for preset, name in REDUCED.items()}


def plain_pipeline_latents(model, cfg, prompt: str, noise: torch.Tensor) -> torch.Tensor:
    """`model.pipe(prompt, ...)` called as its model card calls it, with the run's guidance, from our noise: the
    final latents in our layout. The guidance each pipeline applies: SD3 and FLUX.2 [klein] base batch CFG against
    an empty prompt (guidance_scale), Qwen-Image runs true CFG against a negative prompt (true_cfg_scale), FLUX.1-dev
    embeds its distilled guidance (guidance_scale) and has no CFG in a V-GRPO run."""
    call = dict(height=cfg.resolution, width=cfg.resolution, num_inference_steps=cfg.sampling_steps,
                max_sequence_length=cfg.max_sequence_length, output_type="latent", latents=noise.to(model.dtype))
    name = model.pipeline_class
    if name == "FluxPipeline":
        call["guidance_scale"] = model.guidance
    elif name == "QwenImagePipeline":
        call.update(true_cfg_scale=cfg.cfg_scale, negative_prompt=model.negative_prompt if cfg.cfg_scale > 1 else None)
    else:
        call["guidance_scale"] = cfg.cfg_scale
    if name == "Flux2KleinPipeline":  # latents in and out on the VAE's grid, its output unnormalised
        call.update(latents=model.to_vae_latents(noise).to(model.dtype), text_encoder_out_layers=model.text_layers())
        return model.from_vae_latents(model.normalize(model.pipe(prompt=prompt, **call).images.float()))
    return model.pipe(prompt=prompt, **call).images.float()


def encode_on(model, texts: list[str], device) -> dict:
    """Conditioning on `device`: encode() answers on the text encoders' device, the CPU when they are offloaded."""
    return {k: v.to(device) for k, v in model.encode(texts).items()}


def section_real_models(model_ids: dict = REAL_MODELS, device=None, small_run: tuple = ()) -> tuple[str, dict]:
    """For each paper preset on its real checkpoint, bf16: (1) Euler rollouts on our grid against `pipe(prompt,
    num_inference_steps=N)` called the plain way from the same noise (relative latent difference); (2) one preset
    iteration at a small batch through train.py; (3) the dtypes its checkpoint stores for the trainable weights
    and AdamW states; (4) the exported LoRA loaded with `pipe.load_lora_weights` against the trained transformer
    (largest velocity difference, relative). small_run overrides sizes (the tests pass tiny ones)."""
    from torch.distributed.checkpoint import FileSystemReader

    device = device or torch.device("cuda")
    adapters.avoid_cudnn_attention()  # as train.py does
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, results = [], {}
    for preset, model_id in model_ids.items():
        with tempfile.TemporaryDirectory() as tmp:
            run_dir, prompts = Path(tmp) / "run", Path(tmp) / "prompts.txt"
            prompts.write_text("a red car on a street\na blue flower in a vase\n")
            args = ["--preset", preset, "--model", str(model_id), "--prompts", str(prompts), "--run_dir", str(run_dir),
                    "--rewards", "color:1", "--num_prompts", "1", "--group_size", "2", "--micro_batch_size", "1",
                    "--rollout_batch_size", "2", "--iterations", "1", "--eval_every", "0", *small_run]
            cfg = train.parse_config(args)
            model = models.load_pipeline(cfg, models.model_family(cfg.model), device, dtype)
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(1, *model.latent_shape(), generator=g).to(device)
            ours = vgrpo.sample_ode(rollouts.guided_velocity(cfg, model, device), noise, encode_on(model, ["a red car on a street"], device),
                                    model.timesteps())
            model.pipe.to(device)  # the plain call encodes on the pipeline's device; load_pipeline offloads the encoders
            theirs = plain_pipeline_latents(model, cfg, "a red car on a street", noise)
            rollout_diff = ((ours - theirs).norm() / theirs.norm()).item()
            subprocess.run([sys.executable, str(Path(__file__).with_name("train.py")), *args], check=True)
            measured = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["peak_memory_gb"]
            planned = (memory.plan_memory(cfg, models.model_family(cfg.model), 1, torch.cuda.get_device_properties(device)
                                          .total_memory / memory.GiB, partial(models.make_trainable, cfg=cfg))[0].peak
                       if device.type == "cuda" else float("nan"))
            latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
            metadata = FileSystemReader(str(latest)).read_metadata().state_dict_metadata
            stored = sorted({str(v.properties.dtype) for k, v in metadata.items()
                             if hasattr(v, "properties") and ("lora" in k or k.startswith("optim"))})
            trained = train.load_trained(run_dir, device, dtype)
            t = torch.tensor([0.3, 0.8], device=device)
            z = torch.randn(2, *model.latent_shape(), generator=g).to(device)
            cond = encode_on(trained, ["a red car on a street", "a blue flower in a vase"], device)
            with torch.no_grad():
                want, base = trained.velocity(z, t, cond), model.velocity(z, t, cond)
                model.pipe.load_lora_weights(run_dir / "final")
                got = model.velocity(z, t, cond)
            export_diff = ((want - got).abs().max() / want.abs().max()).item()
            moved = ((want - base).abs().max() / want.abs().max()).item()  # what a missing or half-strength LoRA misses
            del model, trained
        results[preset] = dict(model=str(model_id), rollout_vs_pipe=rollout_diff, checkpoint_dtypes=stored,
                               export_vs_trained=export_diff, trained_vs_base=moved, peak_gb=measured, planned_gb=planned)
        rows.append([preset, Path(model_id).name, f"{rollout_diff:.2e}", ", ".join(stored), f"{export_diff:.2e}",
                     f"{moved:.2e}", f"{measured:.2f}", f"{planned:.2f}"])
        print("|", " | ".join(rows[-1]), "|", flush=True)  # a row survives a later timeout
    text = (f"{dtype} on {device}. Rollout: |euler on our grid - pipe()| / |pipe()| over the final latents "
            "(bf16 rounding differs: the pipeline keeps bf16 latents between steps, vgrpo.sample_ode float32). "
            "Export: max |v(trained) - v(load_lora_weights)| / max |v(trained)|, against the same for the base model "
            "(what the iteration moved). Peak: train.py's measured peak of "
            "allocated memory in the iteration against the memory plan (--plan) of the same flags on one GPU (CUDA only; "
            "on a CPU the peak is the process's resident memory, not comparable).\n\n"
            + table(["preset", "model", "rollout vs pipe()", "checkpoint dtypes (LoRA, AdamW)", "export vs trained",
                     "base vs trained", "peak GiB", "planned GiB"], rows))
    return text, results
