"""models.py: the model of a run: which family a --model is, and loading it behind its adapter.

A --model is a tiny model built offline (builders.py), a diffusers pipeline directory or a hub id; its
model_index.json names the pipeline class, which names the family (adapters.py). load_pipeline returns the pipeline
frozen, in the compute dtype, behind its family's adapter; make_trainable adds LoRA (or unfreezes every weight) as
float32 master weights. The checks a loaded model gets before training (its sigma grid, the LoRA targets) live here.
"""

import json
import os
import re
from functools import partial
from pathlib import Path

import torch

import adapters
import builders
from adapters import ADAPTERS, PIPELINE_FAMILIES, FlowAdapter
from failures import ConfigError

# ----------------------------------------------------------------------------------------------
# Which family a --model is


def model_family(model: str) -> str:
    if model in builders.TINY_MODELS:
        return builders.TINY_MODELS[model]
    if model in builders.HUB_IDS:  # the presets' checkpoints: known offline
        return builders.REAL_CONFIGS[builders.HUB_IDS[model]]["family"]
    class_name = model_index(model)["_class_name"]
    if class_name not in PIPELINE_FAMILIES:
        raise ConfigError(f"--model {model}: {class_name} is not supported; use {' or '.join(PIPELINE_FAMILIES)}")
    return PIPELINE_FAMILIES[class_name]


def model_index(model: str) -> dict:
    """The pipeline's model_index.json, from a directory or the hub (diffusers caches it)."""
    if os.path.isdir(model):
        where = Path(model) / "model_index.json"
        if not where.is_file():
            raise ConfigError(f"--model {model}: no model_index.json there; pass a diffusers pipeline directory")
        try:
            index = json.loads(where.read_text())
        except ValueError:
            index = None
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        from diffusers import DiffusionPipeline

        where = f"{model}'s model_index.json"
        try:
            index = DiffusionPipeline.load_config(model)
        except Exception as error:
            raise ConfigError(f"--model {model}: cannot read its model_index.json from the hub ({type(error).__name__})") from None
    else:
        raise ConfigError(f"--model {model!r} is neither a directory, a hub id (org/name) nor one of {', '.join(builders.TINY_MODELS)}")
    if not isinstance(index, dict) or "_class_name" not in index:
        raise ConfigError(f"--model {model}: {where} is not a diffusers model_index.json (no '_class_name' in a JSON "
                          "object); re-save the pipeline with save_pretrained")
    return index


def step_distilled(model: str) -> bool:
    """A FLUX.2 [klein] checkpoint distilled to few steps (its pipeline config says is_distilled): its pipeline
    applies no CFG."""
    if model in builders.TINY_MODELS or model in builders.HUB_IDS:  # known offline
        return model in builders.DISTILLED_HUB_IDS
    return bool(model_index(model).get("is_distilled"))


def frames_of(num_frames: int, model: str, family: str) -> int:
    """--num_frames, 0 resolved: the tiny video model's short default, else its family's (WanPipeline's 81)."""
    adapter = ADAPTERS[family]
    if num_frames:
        return num_frames
    return builders.TINY_FRAMES if adapter.video and model in builders.TINY_MODELS else adapter.default_frames


# ----------------------------------------------------------------------------------------------
# Loading: the pipeline behind its adapter, frozen, in the compute dtype; what training makes trainable


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """--dtype: auto is bfloat16 on GPU and float32 on CPU (bf16 matrix products are slow on most CPUs)."""
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_pipeline(cfg, family: str, device: torch.device, dtype: torch.dtype,
                  sharded: bool = False) -> adapters.FlowAdapter:
    """The pipeline, frozen and in the compute dtype, behind its family's adapter. sharded: FSDP2 will place the
    transformer (apply_fsdp), so it stays on the CPU here."""
    import diffusers

    adapter = adapters.ADAPTERS[family]
    behind = partial(adapter, dtype=dtype, resolution=cfg.resolution, sampling_steps=cfg.sampling_steps,
                     max_sequence_length=cfg.max_sequence_length, guidance=cfg.flux_guidance,
                     num_frames=frames_of(cfg.num_frames, cfg.model, family), width=cfg.width)
    if cfg.model in builders.TINY_MODELS:  # built in float32; cast only to another dtype (diffusers warns on any cast)
        pipe = builders.tiny_pipeline(family, seed=cfg.seed)
        behind(pipe)  # the adapter's checks (a video its rotary table holds) before the fit's minute, not after
        if cfg.tiny_fit_steps:
            builders.fitted(pipe, family, seed=cfg.seed, steps=cfg.tiny_fit_steps,
                            progress=os.environ.get("RANK", "0") == "0")
        pipe = pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
    else:  # from_pretrained keeps the modules a model marks as float32-only in float32 (none in bf16 since transformers 5)
        pipe = getattr(diffusers, adapter.pipeline_class).from_pretrained(cfg.model, dtype=dtype)
    # Frozen parts (VAE, text encoders) run replicated on every rank: they are not sharded and not trained. Nothing
    # whole goes to the GPU that does not stay whole there: under FSDP2 the transformer stays on the CPU until
    # fully_shard moves each block's shard (a full copy per GPU was 24-61 GiB at load time), and offloaded text
    # encoders visit the GPU only inside encode().
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
            stays = (name == "transformer" and sharded) or (name.startswith("text_encoder") and cfg.offload_text_encoders)
            module.to("cpu" if stays else device)
    return behind(pipe)


def lora_config(cfg):
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights="gaussian",
                      target_modules=lora_targets(cfg.lora_targets, model_family(cfg.model)))


def make_trainable(transformer: torch.nn.Module, cfg) -> None:
    """LoRA adapters (lora_rank > 0) or every weight, as float32 master weights whatever the compute dtype: in
    bfloat16 an AdamW step of lr 1e-4 on a weight of ~0.03 is below half an ULP and rounds away (a third of a
    LoRA matrix never moved). Gradients and AdamW states follow the parameters' dtype; compute stays in the
    pipeline's dtype (autocast in the adapters, MixedPrecisionPolicy under FSDP2)."""
    if cfg.lora_rank:
        check_lora_targets(transformer, lora_targets(cfg.lora_targets, model_family(cfg.model)))
        transformer.add_adapter(lora_config(cfg))
    else:
        transformer.requires_grad_(True)
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def start_from_lora_export(transformer: torch.nn.Module, directory: str, cfg) -> None:
    """The trainable LoRA adapters (make_trainable's, before any sharding) set to a LoRA export (a run's final/, the
    diffusers format): each of the paper's SD3.5-M stages starts from the one before. The export must hold exactly
    these adapters, at the same rank and alpha; anything else is refused in one line."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors import safe_open

    with safe_open(str(Path(directory) / "pytorch_lora_weights.safetensors"), "pt") as f:  # train.validate: it exists
        saved = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
        metadata = json.loads((f.metadata() or {}).get("lora_adapter_metadata", "{}"))
    shape = (metadata.get("transformer.r"), metadata.get("transformer.lora_alpha"))
    if shape != (cfg.lora_rank, cfg.lora_alpha):
        raise ConfigError(f"--init_lora {directory} holds LoRA rank {shape[0]}, alpha {shape[1]}; this run trains rank "
                          f"{cfg.lora_rank}, alpha {cfg.lora_alpha}: pass the export's --lora_rank and --lora_alpha")
    expected = set(get_peft_model_state_dict(transformer))
    if set(saved) != expected:
        extra, missing = sorted(set(saved) - expected), sorted(expected - set(saved))
        raise ConfigError(f"--init_lora {directory} does not hold this run's adapters (--lora_targets, model): "
                          f"{len(missing)} missing ({', '.join(missing[:2])}), {len(extra)} not in this model "
                          f"({', '.join(extra[:2])})")
    # In float32, as make_trainable keeps the adapters; the export holds them as training left them.
    set_peft_model_state_dict(transformer, {k: v.float() for k, v in saved.items()})


def lora_targets(flag: str, family: str) -> list[str]:
    """--lora_targets as a list: its names, or for "auto" the family's attention projections."""
    return (ADAPTERS[family].lora_targets if flag == "auto" else flag).split(",")


def check_lora_targets(transformer: torch.nn.Module, targets: list[str]) -> None:
    """Each target must name some Linear layer (peft matches a suffix of the module path); peft itself drops a
    target that matches nothing silently, as long as another one matches."""
    linear = [name for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in linear)]
    if missing:
        short = sorted({".".join(n.split(".")[-2 if n.split(".")[-1].isdigit() else -1:]) for n in linear})
        raise ConfigError(f"--lora_targets: {', '.join(missing)} match no Linear layer of the "
                          f"{type(transformer).__name__}; its Linear layers end in {', '.join(short)}")


def check_sampling_grid(model: FlowAdapter, solver: str = "euler") -> None:
    """A scheduler configuration whose sigma grid is not finite (shift 0, say) would make every rollout NaN, which
    would read as a diverged run. Solver "scheduler" counts one model evaluation per timestep: a scheduler of
    order 2 (FlowMatchHeun) repeats timesteps, which would miscount the rollout cost."""
    if solver == "scheduler" and model.pipe.scheduler.order != 1:
        raise ConfigError(f"--solver scheduler steps schedulers that evaluate the model once per step; this model's "
                          f"{type(model.pipe.scheduler).__name__} is of order {model.pipe.scheduler.order}: use "
                          "--solver heun (Heun's method on the pipeline's sigma grid)")
    grid = model.timesteps()
    if not torch.isfinite(grid).all():
        raise ConfigError(f"{model.pipeline_class}'s scheduler gives a sigma grid that is not finite for --sampling_steps "
                          f"{model.sampling_steps} at --resolution {model.resolution}: {grid.tolist()}; check the "
                          "model's scheduler/scheduler_config.json (shift, shift_terminal) or use more steps")
