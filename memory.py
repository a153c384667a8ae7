"""memory.py: the memory plan, what each GPU holds in each phase of an iteration, before any weight is loaded.

Parameters come from the configs on the meta device (exact, instant); activations from one real-width block of each
block type run on the CPU with the training path's own autocast and LoRA (exact for that block), scaled by the number
of such blocks and rows. `python train.py --plan` prints it; every GPU launch checks it before loading.
"""

import dataclasses
import json
import os
from dataclasses import dataclass
from functools import partial

import torch

import adapters
import builders
import models
import parallel
import rewards
from adapters import ADAPTERS, blocks_of
from failures import ConfigError

GiB = 2**30


def meta_components(model: str) -> tuple[str, dict]:
    """(family, {component name: nn.Module on the meta device}) of a pipeline from its configs alone: a hub id of
    HUB_IDS (offline, REAL_CONFIGS), or a pipeline directory whose model_index.json and config.json files are enough
    (weights are not read). Tiny models are built for real (they are small)."""
    import json
    import os

    import diffusers
    import transformers
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, T5Config

    if model in builders.TINY_MODELS:
        pipe = builders.tiny_pipeline(builders.TINY_MODELS[model])
        return builders.TINY_MODELS[model], {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
    with torch.device("meta"):
        if model in builders.HUB_IDS and builders.REAL_CONFIGS[builders.HUB_IDS[model]]["family"] == "wan":
            from diffusers import AutoencoderKLWan
            from transformers import UMT5Config, UMT5EncoderModel

            spec = builders.REAL_CONFIGS[builders.HUB_IDS[model]]
            return "wan", {"transformer": builders.reduced_transformer(builders.HUB_IDS[model], full=True),
                           "vae": AutoencoderKLWan(**spec["vae"]), "text_encoder": UMT5EncoderModel(UMT5Config(**spec["text"])),
                           "pipeline_config": spec["pipeline"]}
        if model in builders.HUB_IDS and builders.REAL_CONFIGS[builders.HUB_IDS[model]]["family"] in ("qwenimage", "flux2"):
            from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage

            spec = builders.REAL_CONFIGS[builders.HUB_IDS[model]]
            vae = AutoencoderKLQwenImage() if spec["family"] == "qwenimage" else AutoencoderKLFlux2()  # the real ones
            return spec["family"], {"transformer": builders.reduced_transformer(builders.HUB_IDS[model], full=True), "vae": vae,
                                    "text_encoder": builders.qwen_text_encoder(spec["family"], **spec["text"])}
        if model in builders.HUB_IDS:
            spec = builders.REAL_CONFIGS[builders.HUB_IDS[model]]
            transformer = builders.reduced_transformer(builders.HUB_IDS[model], full=True)
            vae = AutoencoderKL(**builders.FULL_VAE, scaling_factor=spec["vae"][0], shift_factor=spec["vae"][1])
            configs = {k: (T5Config if k == "t5" else CLIPTextConfig)(**v) for k, v in builders.FULL_TEXT_ENCODERS.items()}
            pipe = builders.assemble_pipeline(spec["family"], transformer, None, vae, clip_tok=None, t5_tok=None, **configs)
            return spec["family"], {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
        if not os.path.isdir(model):
            raise ValueError(f"{model}: the memory plan needs its configs offline: pass a pipeline directory (configs "
                             f"suffice, no weights) or one of {', '.join(builders.HUB_IDS)}")
        index = json.loads(open(os.path.join(model, "model_index.json")).read())
        components = {}
        for name, entry in index.items():
            if not (isinstance(entry, list) and entry[0] in ("diffusers", "transformers") and entry[1]):
                continue
            cls = getattr(diffusers if entry[0] == "diffusers" else transformers, entry[1])
            folder = os.path.join(model, name)
            if not issubclass(cls, torch.nn.Module):
                continue  # schedulers, tokenizers
            if entry[0] == "diffusers":
                components[name] = cls.from_config(cls.load_config(folder))
            else:
                components[name] = cls(transformers.AutoConfig.from_pretrained(folder))
        # the pipeline's own settings beside its components (Wan2.2-TI2V's expand_timesteps)
        components["pipeline_config"] = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
        return adapters.PIPELINE_FAMILIES[index["_class_name"]], components


def stored_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of parameters and buffers once loaded in `dtype` the way from_pretrained loads them: floating tensors
    in dtype except the modules a model keeps in float32 (transformers: _keep_in_fp32_modules_strict always,
    _keep_in_fp32_modules only for float16, so T5's wo is bfloat16 in a bfloat16 load; diffusers:
    _keep_in_fp32_modules in any dtype, so Wan's time embedder, norms and modulation tables stay float32). A
    transformers model's non-persistent buffers keep the dtype they were built in: from_pretrained never casts them
    (Qwen's rotary inv_freq stays float32)."""
    keep = list(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16 or type(module).__module__.startswith("diffusers."):
        keep += list(getattr(module, "_keep_in_fp32_modules", None) or [])
    as_built = set()
    if type(module).__module__.startswith("transformers."):
        as_built = {f"{prefix}.{b}".lstrip(".") for prefix, m in module.named_modules() for b in m._non_persistent_buffers_set}
    total = 0
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if not t.is_floating_point() or name in as_built:
            total += t.numel() * t.element_size()
        elif any(k in name.split(".") for k in keep):  # a module of that name anywhere in the path, as both do
            total += t.numel() * 4
        else:
            total += t.numel() * dtype.itemsize
    return total


class SavedBytes:
    """Bytes autograd saves for backward during a forward, attributed to the block (FSDP unit) that saved them.
    Storages are counted once, parameters not at all (their memory is counted as weights)."""

    def __init__(self, transformer: torch.nn.Module, blocks: list[torch.nn.Module]):
        self.params = {p.untyped_storage().data_ptr() for p in transformer.parameters()}
        self.seen, self.current = set(), None
        self.per_block = [0] * len(blocks)
        self.inputs = [0] * len(blocks)  # what a checkpointed block keeps: its inputs
        self.other = 0
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(partial(self._enter, i), with_kwargs=True)
            block.register_forward_hook(lambda *_: setattr(self, "current", None))

    def _enter(self, i, module, args, kwargs):
        self.current = i
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        tensors += [t for a in (*args, *kwargs.values()) if isinstance(a, tuple) for t in a if isinstance(t, torch.Tensor)]
        self.inputs[i] = sum(t.numel() * t.element_size() for t in tensors)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            size = storage.nbytes()
            if self.current is None:
                self.other += size
            else:
                self.per_block[self.current] += size
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def block_signature(block: torch.nn.Module) -> int:
    """Blocks of one type have the same number of base (non-LoRA) parameters; types differ."""
    return sum(p.numel() for n, p in block.named_parameters() if "lora_" not in n)


def planning_pipe(transformer, vae, adapter: type, pipeline_config: dict | None = None):
    """What an adapter reads of a pipeline, for planning without one: the modules (on the meta device for real
    models), the pipelines' vae_scale_factor and the pipeline's config (Wan2.2-TI2V's expand_timesteps)."""
    import types

    return types.SimpleNamespace(transformer=transformer, vae=vae, vae_scale_factor=adapter.vae_scale(vae) if vae else 8,
                                 config=types.SimpleNamespace(**(pipeline_config or {})))


def activation_profile(transformer_meta, adapter: type, dtype: torch.dtype, prepare, *, settings: dict,
                       vae=None, pipeline_config: dict | None = None) -> dict:
    """Bytes saved for backward by a training forward of the full-depth transformer, as (fixed, per row) pairs:
    {"other": pair, "blocks": [pair per full-depth block], "inputs": [pair per block: what a checkpointed block
    keeps]}. Measured on the CPU on its real-width twin (adapter.reduced_depth: every block type, the first type
    twice) with `prepare` (LoRA, fp32 master weights) and the adapter's own autocast, at 1 and 2 rows.

    The first block of a stack differs from later blocks of its type: with LoRA the model's first block's input does
    not require grad yet, so it saves less (seen: 8.2 vs 9.4 MB per row); FLUX.2's first single block saves 18 kB
    per row more than the later ones. Part of what is saved does not grow with the batch (autocast's bf16
    copies of the fp32 LoRA weights), hence the pairs. settings: the adapter's (resolution, max_sequence_length,
    num_frames, width); vae and pipeline_config where the adapter reads them (Wan).

    Videos of more than 2 latent frames are measured at 1 and 2 latent frames and extrapolated linearly in them:
    what a block saves grows linearly with its tokens (attention keeps no token x token matrix), and a twin run at
    480p x 81 frames (32760 tokens a row) took minutes on 2 cores, at 720p or 14B's width more than 24 GB."""
    config = dict(transformer_meta.config)
    # Parameters on the meta device (materialize fills them), everything else real: Qwen-Image keeps its rotary
    # tables as plain tensors computed at construction, which the meta device would leave without data.
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        twin = type(transformer_meta).from_config({**config, **adapter.reduced_depth(config)})
    twin = materialize(twin, dtype)
    prepare(twin)
    target = settings.get("num_frames", 1)
    stride = adapter.frame_stride
    measured = (1, 1 + stride) if adapter.video and target > 1 + stride else (target,)
    twin_blocks = blocks_of(twin, adapter)
    runs = {}  # (frames, rows) -> SavedBytes
    for frames in measured:
        model = adapter(planning_pipe(twin, vae, adapter, pipeline_config), dtype, sampling_steps=1,
                        **{**settings, "num_frames": frames})
        for rows in (1, 2):
            runs[frames, rows] = saved = SavedBytes(twin, twin_blocks)
            with saved.hooks():
                model.velocity(torch.zeros(rows, *model.latent_shape()), torch.full((rows,), 0.5), model.cond_like(rows))

    def pair(get) -> tuple[float, float]:  # saved(rows) = fixed + per_row * rows, from rows 1 and 2
        fixed, per_row = [], []
        for frames in measured:
            one, two = get(runs[frames, 1]), get(runs[frames, 2])
            fixed.append(2 * one - two)
            per_row.append(two - one)
        if len(measured) == 1:
            return fixed[0], per_row[0]
        later = (target - 1) // stride  # latent frames beyond the first: linear from 0 and 1 of them
        return fixed[0] + (fixed[1] - fixed[0]) * later, per_row[0] + (per_row[1] - per_row[0]) * later

    # Each stack's first block stands for itself; a later one for the twin's last block of its type in that stack.
    index, offset = [], 0
    for name in adapter.block_lists:
        twin_stack, full_stack = getattr(twin, name, []), getattr(transformer_meta, name, [])
        later = {block_signature(b): offset + j for j, b in enumerate(twin_stack)}
        index += [offset] * bool(len(full_stack)) + [later[block_signature(b)] for b in list(full_stack)[1:]]
        offset += len(twin_stack)
    return {"other": pair(lambda r: r.other), "blocks": [pair(lambda r, i=i: r.per_block[i]) for i in index],
            "inputs": [pair(lambda r, i=i: r.inputs[i]) for i in index]}


def materialize(module: torch.nn.Module, dtype: torch.dtype, seed: int = 0, device="cpu") -> torch.nn.Module:
    """A meta-device module on `device` in `dtype`, its weights N(0, 0.02) numbers repeating with a period of 2^20 + 7:
    what is saved for backward and what a step costs depend on shapes and dtypes only. Drawing each number (as the
    layers' own initialisers do) took 9 s for a real-width FLUX of 5 blocks on one core; copying the pattern is
    bound by memory bandwidth. Buffers built real (position tables) keep their values. Cast before allocating:
    never a float32 copy of a bf16 model."""
    module = module.to(dtype)
    built = {name: b for name, b in module.named_buffers() if not b.is_meta}
    module = module.to_empty(device=device)
    period = (1 << 20) + 7  # odd, so that rows of a power-of-two width do not repeat one another
    pattern = torch.randn(period, generator=torch.Generator().manual_seed(seed)).mul_(0.02)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name in built:
                t.copy_(built[name])
            elif t.is_floating_point():
                fill_repeating(t, pattern.to(device=t.device, dtype=t.dtype))
    return module


def fill_repeating(t: torch.Tensor, pattern: torch.Tensor) -> None:
    """t (any shape, contiguous) <- pattern repeated over its elements in memory order."""
    flat, period = t.view(-1), len(pattern)
    whole = flat.numel() // period * period
    flat[:whole].view(-1, period).copy_(pattern.expand(whole // period, period))
    flat[whole:].copy_(pattern[:flat.numel() - whole])


def saved_bytes(pairs, rows: int) -> float:
    return sum(fixed + per_row * rows for fixed, per_row in pairs)


@dataclass
class MemoryPlan:
    rows: list[tuple[str, float, str]]  # (part, GiB per GPU, when it is held)
    phases: dict[str, float]  # phase -> GiB per GPU at its peak
    gpu_gb: float

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    def fits(self, headroom: float = 0.10) -> bool:
        return self.peak <= (1 - headroom) * self.gpu_gb

    def table(self) -> str:
        width = max(len(r[0]) for r in self.rows)
        lines = [f"{'part'.ljust(width)} | GiB/GPU | held", f"{'-' * width} | ------- | ----"]
        lines += [f"{part.ljust(width)} | {gib:7.2f} | {when}" for part, gib, when in self.rows]
        lines.append("phase peaks: " + ", ".join(f"{k} {v:.1f} GiB" for k, v in self.phases.items()))
        lines.append(f"per GPU: {self.peak:.1f} GiB of {self.gpu_gb:g} GiB")
        return "\n".join(lines)


def memory_plan(components: dict, adapter: type, *, dtype: torch.dtype, world: int, gpu_gb: float, lora_params: int,
                micro_rows: int, rollout_rows: int, grad_checkpointing: bool, gather_once: bool, reward_bytes: int,
                offload_text_encoders: bool, activations: dict, decode_bytes: int, ema: bool = False,
                reference_copy: bool = False) -> MemoryPlan:
    """Per-GPU memory of one training iteration under FSDP2 over `world` ranks, by phase.

    always: transformer shard (1/world of its weights, float32 where trained in full), replicated buffers, the
    trainable float32 weights + gradients + AdamW moments (sharded), VAE, reward models; text encoders unless
    offloaded. encode: + text encoders. rollout: + the whole transformer gathered in dtype (gather_once; else two
    blocks at a time) and one block's intermediates for the rollout batch, or the VAE's largest layer. train: + the
    two largest blocks gathered (current + prefetched) and the activations saved for backward of one micro-batch
    (micro_batch_size x K rows), or with checkpointing the blocks' inputs plus one block recomputed. ema: + a
    float32 copy of the trainable weights (sharded); reference_copy: + the frozen base transformer for the reference
    KL under full fine-tuning (sharded, in dtype; under LoRA the reference is the same weights, adapters off)."""
    transformer = components["transformer"]
    blocks = blocks_of(transformer, adapter)
    n_params = sum(p.numel() for p in transformer.parameters())
    full_ft = lora_params == 0
    weights = n_params * (4 if full_ft else dtype.itemsize) / world  # FSDP2 shards frozen weights too
    buffers = sum(b.numel() * dtype.itemsize for b in transformer.buffers())
    trained = n_params if full_ft else lora_params
    states = trained * (12 if full_ft else 16) / world  # fp32 grads + 2 moments (+ the fp32 weight itself for LoRA)
    ema_bytes = trained * 4 / world if ema else 0
    reference = n_params * dtype.itemsize / world if reference_copy else 0
    text = sum(stored_bytes(m, dtype) for k, m in components.items() if k.startswith("text_encoder"))
    vae = stored_bytes(components["vae"], dtype)
    gathered = (n_params + lora_params) * dtype.itemsize if world > 1 else 0  # world 1: the weights are whole
    block_bytes = sorted((sum(p.numel() for p in b.parameters()) * dtype.itemsize for b in blocks), reverse=True)
    gathered_train = sum(block_bytes[:2]) if world > 1 else 0
    blocks_saved = [saved_bytes([p], micro_rows) for p in activations["blocks"]]
    train_act = saved_bytes([activations["other"]], micro_rows) + (
        saved_bytes(activations["inputs"], micro_rows) + max(blocks_saved) if grad_checkpointing else sum(blocks_saved))
    rollout_act = max(saved_bytes([p], rollout_rows) for p in activations["blocks"])
    always = weights + buffers + states + ema_bytes + reference + vae + reward_bytes + (0 if offload_text_encoders else text)
    g = lambda b: b / GiB  # noqa: E731
    shard = f"1/{world} shard" if world > 1 else "unsharded"
    rows = [
        (f"transformer weights ({shard}, {'float32, trained' if full_ft else str(dtype)[6:]})", g(weights), "always"),
        ("transformer buffers (replicated: position tables)", g(buffers), "always"),
        (f"trainable {trained / 1e6:.1f} M: float32 " + ("grads + AdamW" if full_ft else "weights + grads + AdamW"),
         g(states), "always"),
        ("EMA of the trainable weights (float32)", g(ema_bytes), "always"),
        (f"frozen base copy for the reference KL ({str(dtype)[6:]})", g(reference), "always"),
        ("VAE", g(vae), "always"),
        ("reward models", g(reward_bytes), "always"),
        (f"text encoders ({str(dtype)[6:]})", g(text), "encode" if offload_text_encoders else "always"),
        ("transformer gathered whole for rollouts" if gather_once else "two largest blocks gathered (per ODE step)",
         g(gathered if gather_once else gathered_train), "rollout"),
        (f"rollout intermediates ({rollout_rows} rows: one block, or the largest VAE layer)",
         g(max(rollout_act, decode_bytes)), "rollout"),
        ("two largest blocks gathered", g(gathered_train), "train"),
        (f"activations saved for backward ({micro_rows} rows, checkpointing {'on' if grad_checkpointing else 'off'})",
         g(train_act), "train"),
    ]
    held = lambda phase: sum(gib for _, gib, when in rows if when == phase)  # noqa: E731
    phases = {"encode": g(always + (text if offload_text_encoders else 0)),
              "rollout": g(always) + held("rollout"), "train": g(always) + held("train")}
    optional = ("EMA", "frozen base")  # rows of features that are off: not shown
    return MemoryPlan([r for r in rows if r[1] or not r[0].startswith(optional)], phases, gpu_gb)


def decode_intermediates(components: dict, adapter: type, *, settings: dict, rows: int, dtype: torch.dtype) -> int:
    """Largest input + output of one VAE decoder layer for `rows` images (videos), traced through the adapter's own
    decode where the VAE lives (the meta device for real models): what a no-grad decode holds at least at its peak."""
    vae = components["vae"]
    largest = [0]

    def hook(module, args, out):
        size = sum(t.numel() for t in (*args, out) if isinstance(t, torch.Tensor)) * dtype.itemsize
        largest[0] = max(largest[0], size)

    pipe = planning_pipe(components["transformer"], vae, adapter, components.get("pipeline_config"))
    model = adapter(pipe, sampling_steps=1, **{**settings, "max_sequence_length": 1})
    handles = [m.register_forward_hook(hook) for m in vae.decoder.modules() if not list(m.children())]
    model.decode(torch.zeros(rows, *model.latent_shape(), device=next(vae.parameters()).device))
    for handle in handles:
        handle.remove()
    return largest[0]


def lora_parameters(transformer: torch.nn.Module, rank: int, targets: list[str]) -> int:
    """Parameters LoRA of `rank` adds on the Linear layers peft matches to `targets` (A: r x in, B: out x r)."""
    return sum(rank * (m.in_features + m.out_features) for name, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))


# ----------------------------------------------------------------------------------------------
# The plan of a train.py configuration: on --plan and at every GPU launch, before any weight is loaded


def plan_world_and_memory(cfg) -> tuple[int, float]:
    """--plan_world_size / --plan_gpu_gb, else torchrun's world size or the visible GPUs and their memory."""
    world = cfg.plan_world_size or int(os.environ.get("WORLD_SIZE", 0)) or torch.cuda.device_count()
    gpu_gb = cfg.plan_gpu_gb or (torch.cuda.get_device_properties(0).total_memory / GiB
                                 if torch.cuda.is_available() else 0)
    if not world or not gpu_gb:
        raise ConfigError("--plan: no GPU is visible here; say what to plan for with --plan_world_size N --plan_gpu_gb G")
    return world, gpu_gb


def plan_memory(cfg, family: str, world: int, gpu_gb: float, prepare) -> tuple[MemoryPlan, str]:
    """The per-GPU memory plan of a train.Config on `world` GPUs of gpu_gb GiB and, when it does not fit, the flags
    that make it fit: levers taken cheapest first and cumulatively (a smaller micro-batch costs nothing at all; then
    smaller rollout batches, gathering per ODE step, activation checkpointing: one more forward). When it fits and a
    larger rollout batch would too, the largest one (sampling calls of more rows use a GPU better). prepare(transformer)
    makes it trainable as the run will (models.make_trainable)."""
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    try:
        _, components = meta_components(cfg.model)
    except (ValueError, OSError) as error:
        raise ConfigError(f"--plan: {error}") from None
    adapter, transformer = ADAPTERS[family], components["transformer"]
    settings = dict(resolution=cfg.resolution, max_sequence_length=cfg.max_sequence_length, width=cfg.width,
                    num_frames=models.frames_of(cfg.num_frames, cfg.model, family))
    activations = activation_profile(transformer, adapter, dtype, prepare, settings=settings, vae=components["vae"],
                                     pipeline_config=components.get("pipeline_config"))
    lora = lora_parameters(transformer, cfg.lora_rank, models.lora_targets(cfg.lora_targets, family)) if cfg.lora_rank else 0
    local = cfg.num_prompts // world * cfg.group_size

    def plan_of(c) -> MemoryPlan:
        options = json.loads(c.reward_options)
        rollout_rows = min(c.rollout_batch_size, local)
        return memory_plan(
            components, adapter, dtype=dtype, world=world, gpu_gb=gpu_gb, lora_params=lora,
            micro_rows=c.micro_batch_size * c.num_mc, rollout_rows=rollout_rows * (2 if c.cfg_scale != 1.0 else 1),
            grad_checkpointing=c.grad_checkpointing, gather_once=c.rollout_gather_once,
            reward_bytes=sum(rewards.reward_model_bytes(name, options.get(name, {}).get("dtype", "float32"))
                             for name in rewards.parse_reward_spec(c.rewards)),
            offload_text_encoders=c.offload_text_encoders, activations=activations,
            decode_bytes=decode_intermediates(components, adapter, settings=settings, rows=rollout_rows, dtype=dtype),
            ema=c.ema_decay > 0, reference_copy=c.ref_kl_coef > 0 and not c.lora_rank)

    plan = plan_of(cfg)
    if plan.fits():
        largest = largest_fitting(min(cfg.rollout_batch_size, local), local,
                                  lambda rows: plan_of(dataclasses.replace(cfg, rollout_batch_size=rows)).fits())
        return plan, f"--rollout_batch_size {largest} fits too" if largest > cfg.rollout_batch_size else ""
    # Not a lever: reward models in bf16 (their `dtype` option). Scores within 1e-3 of fp32 would need checking on
    # the real weights, which cannot be downloaded here; the plan counts them in the dtype they are given.
    # A rollout batch of 1 last: a video model's sampling step at 720p holds GBs per sample (Wan2.1-14B at 480p x 81
    # frames fits 8 x 80 GB only so).
    levers = [{}, {"rollout_batch_size": max(1, cfg.rollout_batch_size // 4)}, {"rollout_gather_once": False},
              {"grad_checkpointing": True}, {"rollout_batch_size": 1}]
    mini, changes = local // cfg.num_grad_steps, {}
    for lever in levers:
        changes.update(lever)
        for micro in sorted((m for m in range(1, cfg.micro_batch_size + 1) if mini % m == 0), reverse=True):
            other = plan_of(dataclasses.replace(cfg, **changes, micro_batch_size=micro))
            if other.fits():
                changed = {k: v for k, v in {**changes, "micro_batch_size": micro}.items() if getattr(cfg, k) != v}
                return plan, f"{flags_for(changed)} makes it fit ({other.peak:.1f} GiB)"
    return plan, "nothing fits on this many GPUs: add GPUs, or lower --resolution or --lora_rank"


def largest_fitting(low: int, high: int, fits) -> int:
    """The largest n in [low, high] with fits(n), fits(low) given and fits monotone (bisection)."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def flags_for(changes: dict) -> str:
    """Command-line flags that set `changes`."""
    words = []
    for name, value in changes.items():
        if isinstance(value, bool):
            words.append(f"--{'' if value else 'no-'}{name}")
        else:
            words.append(f"--{name} {value}")
    return " ".join(words)


def check_memory_plan(cfg, family: str, world: int, gpu_gb: float | None, rank: int, prepare) -> None:
    """At a GPU launch (gpu_gb: the device's memory; None on CPU): refuse a config whose plan does not fit, in one
    line and before any weight is loaded."""
    if gpu_gb is None:
        return
    problem = ""
    if rank == 0:
        try:
            plan, advice = plan_memory(cfg, family, world, gpu_gb, prepare)
        except ConfigError as error:  # e.g. a hub id whose configs are not known offline: plan nothing, say so
            print(f"warning: no memory plan ({error})", flush=True)
            plan = None
        if plan is not None and not plan.fits():
            problem = (f"the memory plan needs {plan.peak:.1f} GiB per GPU of {gpu_gb:.0f} GiB (10% headroom kept): "
                       f"{advice}; see python train.py --plan with the same flags")
    problem = parallel.broadcast_from_rank0(problem)
    if problem:
        raise ConfigError(problem)
