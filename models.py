"""models.py: the model families train.py drives, behind one adapter contract, and the offline test models.

V-GRPO needs five things from a text-to-image flow model, and nothing else (FlowAdapter's docstring is the
contract). Each diffusers pipeline family is one class here; train.py never looks past the contract.

Offline models (no hub access needed, random or briefly fitted weights, the real diffusers/transformers classes):
- tiny_pipeline: toy widths, used by `python train.py` and most tests;
- reduced_pipeline: the REAL widths of SD3-Medium, SD3.5-Medium/Large and FLUX.1-dev/schnell (hidden sizes,
  heads, dual attention, qk norm, rope axes, guidance embedding, text-encoder widths, VAE latent channels and
  scaling), with 1-2 transformer blocks and one text-encoder layer, so that CPU tests see the layouts, sizes and
  dtypes a GPU run sees.
"""

import copy
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

import rewards

PIPELINE_FAMILIES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}


def autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def avoid_cudnn_attention() -> None:
    """Process-wide: scaled_dot_product_attention may not pick cuDNN's fused attention. Its backward failed with an
    illegal memory access at FLUX.1-dev's real size in bf16 on an H200 (torch 2.11, 2025 image + 512 text tokens, 1
    and 2 samples, activation checkpointing on and off), where flash and memory-efficient attention ran (bench.py
    section 5, results/gpu). Process-wide rather than around velocity(): activation checkpointing recomputes the
    forward inside backward, outside any context a forward could set."""
    torch.backends.cuda.enable_cudnn_sdp(False)


class FlowAdapter:
    """The contract between train.py and a pipeline family.

    - encode(texts) -> cond: frozen text encoders; a dict of batch-first float32 tensors, one row per text.
    - velocity(z, t, cond) -> v: the transformer, float32 t in [0, 1] (1 = noise) of shape (B,), compute in
      `dtype` under autocast, output float32 shaped like z.
    - latent_shape() -> shape of one sample's latent as the transformer sees it (packed for FLUX).
    - timesteps() -> (sampling_steps + 1,) sigma grid from 1 to 0: exactly the grid the pipeline's own
      __call__ uses at this resolution and step count, so Euler rollouts equal `pipe(...)`.
    - decode(x) -> images (B, 3, H, W) in [0, 1].
    For the memory plan (no weights needed): text_tokens() (the length of cond["embeds"]), cond_like(), and
    reduced_depth(config): transformer config changes that keep every block type, the first block's type twice
    (the first block of a stack saves less than later ones of its type).
    A new family is one subclass plus an entry in PIPELINE_FAMILIES and ADAPTERS.
    """

    pipeline_class = ""
    block_lists = ("transformer_blocks",)  # the transformer's ModuleLists of blocks: FSDP units, planned per block

    def __init__(self, pipe, dtype: torch.dtype = torch.float32, *, resolution: int, sampling_steps: int,
                 max_sequence_length: int, guidance: float = 3.5):
        self.pipe, self.transformer, self.dtype = pipe, pipe.transformer, dtype
        self.resolution, self.sampling_steps = resolution, sampling_steps
        self.max_sequence_length, self.guidance = max_sequence_length, guidance
        self._grid = None

    def timesteps(self) -> torch.Tensor:
        """The scheduler as the pipeline sets it (shift, dynamic shifting, terminal settings), on a copy."""
        if self._grid is None:
            scheduler = copy.deepcopy(self.pipe.scheduler)
            scheduler.set_timesteps(self.sampling_steps, device="cpu", **self.schedule_kwargs())
            self._grid = scheduler.sigmas.float()
        return self._grid

    def schedule_kwargs(self) -> dict:
        return {}

    def text_tokens(self) -> int:
        return self.max_sequence_length

    def cond_like(self, batch: int, device="cpu") -> dict:
        """Zero conditioning shaped as encode() returns it, from the transformer's config alone."""
        config = self.transformer.config
        return {"embeds": torch.zeros(batch, self.text_tokens(), config.joint_attention_dim, device=device),
                "pooled": torch.zeros(batch, config.pooled_projection_dim, device=device)}

    @staticmethod
    def reduced_depth(config) -> dict:
        raise NotImplementedError

    def image_tokens(self) -> int:
        """Transformer tokens of one image: what dynamic shifting's mu depends on."""
        patch = self.transformer.config.patch_size
        return (self.resolution // self.pipe.vae_scale_factor // patch) ** 2

    def mu(self) -> float:
        """calculate_shift of the diffusers pipelines: mu linear in the number of image tokens."""
        sc = self.pipe.scheduler.config
        base_len, max_len = sc.get("base_image_seq_len", 256), sc.get("max_image_seq_len", 4096)
        base_shift, max_shift = sc.get("base_shift", 0.5), sc.get("max_shift", 1.15)
        slope = (max_shift - base_shift) / (max_len - base_len)
        return base_shift + slope * (self.image_tokens() - base_len)

    def to_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def from_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = self.to_vae_latents(x) / vae.config.scaling_factor + vae.config.shift_factor
        return (vae.decode(latents.to(vae.dtype), return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)


class SD3(FlowAdapter):
    """StableDiffusion3Pipeline (SD3, SD3.5): latents (B, C, H/8, W/8); timestep in [0, 1000]."""

    pipeline_class = "StableDiffusion3Pipeline"

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict:
        embeds, _, pooled, _ = self.pipe.encode_prompt(texts, texts, texts, device=self.pipe.text_encoder.device,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=self.max_sequence_length)
        return {"embeds": embeds.float(), "pooled": pooled.float()}

    def velocity(self, z: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        with autocast(z.device, self.dtype):
            return self.transformer(hidden_states=z, timestep=t * 1000, encoder_hidden_states=cond["embeds"],
                                    pooled_projections=cond["pooled"], return_dict=False)[0].float()

    def latent_shape(self) -> tuple[int, ...]:
        size = self.resolution // self.pipe.vae_scale_factor
        return self.transformer.config.in_channels, size, size

    def schedule_kwargs(self) -> dict:
        # StableDiffusion3Pipeline.__call__: default sigmas; mu only where the scheduler shifts dynamically.
        return {"mu": self.mu()} if self.pipe.scheduler.config.get("use_dynamic_shifting") else {}

    def text_tokens(self) -> int:
        # CLIP-L/G padded to the tokenizer's length (77 for the real ones; the plan has no tokenizer), then T5's
        return getattr(getattr(self.pipe, "tokenizer", None), "model_max_length", 77) + self.max_sequence_length

    @staticmethod
    def reduced_depth(config) -> dict:
        """Block types in order: dual attention (where the model has any; the first type twice), plain, and the last
        (context_pre_only)."""
        dual = bool(config["dual_attention_layers"])
        plain = config["num_layers"] - 1 > len(config["dual_attention_layers"])
        return {"num_layers": 3 + (dual and plain), "dual_attention_layers": (0, 1) if dual else ()}


class Flux(FlowAdapter):
    """FluxPipeline (FLUX.1-dev/schnell): latents packed in 2x2 patches (B, H/16 * W/16, 4C), position ids,
    a guidance embedding where the transformer has one (dev, not schnell); timestep in [0, 1]."""

    pipeline_class = "FluxPipeline"
    block_lists = ("transformer_blocks", "single_transformer_blocks")

    @staticmethod
    def reduced_depth(config) -> dict:
        return {"num_layers": 2, "num_single_layers": 1}  # the first double block, a later one, a single block

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict:
        embeds, pooled, _ = self.pipe.encode_prompt(texts, texts, device=self.pipe.text_encoder.device,
                                                    max_sequence_length=self.max_sequence_length)
        return {"embeds": embeds.float(), "pooled": pooled.float()}

    def velocity(self, z: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        rows, cols = torch.meshgrid(torch.arange(self._side()), torch.arange(self._side()), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).view(-1, 3).float()  # (0, row, col)
        txt_ids = torch.zeros(cond["embeds"].shape[1], 3)
        guidance = None  # FLUX.1-schnell has no guidance embedding and must not be given one
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((z.shape[0],), self.guidance, device=z.device)
        with autocast(z.device, self.dtype):
            return self.transformer(hidden_states=z, timestep=t, guidance=guidance, encoder_hidden_states=cond["embeds"],
                                    pooled_projections=cond["pooled"], img_ids=img_ids.to(z.device),
                                    txt_ids=txt_ids.to(z.device), return_dict=False)[0].float()

    def _side(self) -> int:
        return self.resolution // self.pipe.vae_scale_factor // 2

    def image_tokens(self) -> int:
        return self._side() ** 2

    def latent_shape(self) -> tuple[int, ...]:
        return self._side() ** 2, self.transformer.config.in_channels

    def schedule_kwargs(self) -> dict:
        # FluxPipeline.__call__: sigmas linspace(1, 1/N, N) unless the scheduler makes its own, mu always given
        # (the scheduler ignores it without dynamic shifting, as schnell's does).
        n = self.sampling_steps
        sigmas = None if self.pipe.scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / n, n)
        return {"sigmas": sigmas, "mu": self.mu()}

    def to_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h*w, C*4) -> (B, C, 2h, 2w): undo the 2x2 patch packing."""
        B, g, c = x.shape[0], self._side(), x.shape[-1] // 4
        return x.view(B, g, g, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, c, 2 * g, 2 * g)

    def from_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, 2h, 2w) -> (B, h*w, C*4): FLUX's 2x2 patch packing."""
        B, c, g = x.shape[0], x.shape[1], x.shape[-1] // 2
        return x.view(B, c, g, 2, g, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, g * g, c * 4)


ADAPTERS = {"sd3": SD3, "flux": Flux}


# ----------------------------------------------------------------------------------------------
# Tiny offline models: the real diffusers / transformers classes at toy sizes, random weights,
# tokenizers built in memory. Used by the default run and by the tests.

TINY_MODELS = {"tiny": "sd3", "tiny-flux": "flux"}
TINY_PROMPTS = [f"a {color} {thing}" for color in rewards.COLORS for thing in ("square", "circle", "car", "flower")]
_TINY_WORDS = sorted({w for p in TINY_PROMPTS for w in p.split()} | {"photo", "of", "the"})


def tiny_clip_tokenizer():
    """CLIP BPE over single bytes, plus merges that make each word of the tiny prompts one token."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    merges = []
    for word in _TINY_WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:  # merge left to right, each intermediate piece a vocabulary entry
            merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            vocab.setdefault(pieces[0], len(vocab))
    merges = list(dict.fromkeys(merges))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=16)  # SD3 pads CLIP prompts to this length


def tiny_t5_tokenizer():
    """A unigram T5 tokenizer: the tiny prompts' words as single pieces, letters as fallback."""
    from transformers import T5Tokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in letters] + [("▁" + c, -3.0) for c in letters] + [("▁" + w, -1.0) for w in _TINY_WORDS]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_pipeline(family: str, seed: int = 0, fit_steps: int = 0):
    """A StableDiffusion3Pipeline or FluxPipeline at toy sizes (32 px images, 16 x 16 x 4 latents),
    random, or briefly fitted to toy images (fit_tiny_pipeline) when fit_steps > 0."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextConfig, T5Config

    torch.manual_seed(seed)
    clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    clip = CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, projection_dim=16, max_position_embeddings=16,
                          bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
                          pad_token_id=clip_tok.pad_token_id)
    t5 = T5Config(vocab_size=len(t5_tok), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                  pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=0)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
                        norm_num_groups=4, mid_block_add_attention=False, use_quant_conv=False,
                        use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609)
    if family == "sd3":
        transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                            caption_projection_dim=32, pooled_projection_dim=32, pos_embed_max_size=16)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    else:
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                    base_image_seq_len=256, max_image_seq_len=4096)
    pipe = assemble_pipeline(family, transformer, scheduler, vae, clip_l=clip, clip_g=clip, t5=t5, clip_tok=clip_tok,
                             t5_tok=t5_tok)
    if fit_steps:
        fit_tiny_pipeline(pipe, ADAPTERS[family], steps=fit_steps, seed=seed)
    return pipe


def assemble_pipeline(family: str, transformer, scheduler, vae, *, clip_l, clip_g, t5, clip_tok, t5_tok):
    """A StableDiffusion3Pipeline (CLIP-L, CLIP-G, T5) or FluxPipeline (CLIP-L, T5) around the given parts, its text
    encoders built from the given transformers configs (random weights) in eval mode."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    if family == "sd3":
        pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                                        text_encoder=CLIPTextModelWithProjection(clip_l), tokenizer=clip_tok,
                                        text_encoder_2=CLIPTextModelWithProjection(clip_g), tokenizer_2=clip_tok,
                                        text_encoder_3=T5EncoderModel(t5), tokenizer_3=t5_tok)
    else:
        pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=CLIPTextModel(clip_l), tokenizer=clip_tok,
                            text_encoder_2=T5EncoderModel(t5), tokenizer_2=t5_tok, transformer=transformer)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()  # fresh models are in train mode: T5 dropout would make the text embeddings random
    return pipe


# ----------------------------------------------------------------------------------------------
# Real-width, reduced-depth models: the published architectures with fewer blocks. Sources: diffusers'
# scripts/convert_sd3_to_diffusers.py and SD3Transformer2DModel defaults (SD3 family), Black Forest Labs' flux
# src/flux/util.py (FLUX.1), Stability's sd3_infer.py (text encoders), each model's scheduler_config.json.

_SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
            pos_embed_max_size=192, dual_attention_layers=(), qk_norm=None)
_FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56))
_FLUX_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                       max_image_seq_len=4096)
REAL_CONFIGS = {
    "sd3-medium": dict(family="sd3", transformer=_SD3, scheduler=dict(shift=3.0), vae=(1.5305, 0.0609)),
    "sd3.5-medium": dict(family="sd3", transformer={**_SD3, "pos_embed_max_size": 384,
                                                    "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"},
                         scheduler=dict(shift=3.0), vae=(1.5305, 0.0609)),
    "sd3.5-large": dict(family="sd3", transformer={**_SD3, "num_layers": 38, "num_attention_heads": 38,
                                                   "caption_projection_dim": 2432, "qk_norm": "rms_norm"},
                        scheduler=dict(shift=3.0), vae=(1.5305, 0.0609)),
    "flux.1-dev": dict(family="flux", transformer=_FLUX, scheduler=_FLUX_SCHEDULER, vae=(0.3611, 0.1159)),
    "flux.1-schnell": dict(family="flux", transformer={**_FLUX, "guidance_embeds": False},
                           scheduler={**_FLUX_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}, vae=(0.3611, 0.1159)),
}


def reduced_pipeline(name: str, seed: int = 0):
    """The pipeline of REAL_CONFIGS[name] at real width and reduced depth, random weights: SD3 family 2 blocks
    (block 0 dual-attention where the real model has any, block 1 context_pre_only like the real last block), FLUX
    1 double + 1 single block; CLIP-L, CLIP-G and T5-XXL at their real widths with one layer each (vocabularies
    and CLIP's padded length are the tiny tokenizers', which is no width); a VAE of 32 channels per block with the
    real 4 blocks (x8), 16 latent channels and real scaling/shift. Every block keeps its real shape and dtype
    behaviour; only the number of blocks shrinks."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, T5Config

    spec = REAL_CONFIGS[name]
    torch.manual_seed(seed)
    clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    ids = dict(bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id)
    clip_l = CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=768, intermediate_size=3072, num_hidden_layers=1,
                            num_attention_heads=12, projection_dim=768, max_position_embeddings=77,
                            hidden_act="quick_gelu", **ids)
    clip_g = CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=1280, intermediate_size=5120, num_hidden_layers=1,
                            num_attention_heads=20, projection_dim=1280, max_position_embeddings=77, hidden_act="gelu",
                            **ids)
    t5 = T5Config(vocab_size=len(t5_tok), d_model=4096, d_ff=10240, d_kv=64, num_layers=1, num_heads=64,
                  feed_forward_proj="gated-gelu", pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
                  decoder_start_token_id=0)
    scaling, shift = spec["vae"]
    vae = AutoencoderKL(block_out_channels=(32,) * 4, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16, layers_per_block=1,
                        norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=scaling,
                        shift_factor=shift)
    transformer, scheduler = reduced_transformer(name), FlowMatchEulerDiscreteScheduler(**spec["scheduler"])
    return assemble_pipeline(spec["family"], transformer, scheduler, vae,
                             clip_l=clip_l, clip_g=clip_g, t5=t5, clip_tok=clip_tok, t5_tok=t5_tok)


def reduced_transformer(name: str, full: bool = False):
    """The transformer of REAL_CONFIGS[name] at real width, 2 blocks (SD3 family) or 1 + 1 (FLUX), random weights;
    full: at its real depth (build it on the meta device)."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    spec = REAL_CONFIGS[name]
    if full:
        return (SD3Transformer2DModel if spec["family"] == "sd3" else FluxTransformer2DModel)(**spec["transformer"])
    if spec["family"] == "sd3":
        dual = (0,) if spec["transformer"]["dual_attention_layers"] else ()
        return SD3Transformer2DModel(**{**spec["transformer"], "num_layers": 2, "dual_attention_layers": dual})
    return FluxTransformer2DModel(**{**spec["transformer"], "num_layers": 1, "num_single_layers": 1})


def toy_images(n: int, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """n 32 x 32 images (n, 3, 32, 32) in [0, 1]: a square or circle in one of the 8 colours of the colour
    reward on grey. Captions name the shape, and the true colour only half of the time (else a random one):
    a generator fitted to them follows the colour word imperfectly, leaving RL something to fix."""
    colors = list(rewards.COLORS)
    true_color = torch.randint(len(colors), (n,), generator=generator)
    color = torch.tensor(list(rewards.COLORS.values()))[true_color]
    centre = torch.randint(10, 22, (2, n, 1, 1), generator=generator)
    radius = torch.randint(6, 11, (n, 1, 1), generator=generator)
    circle = torch.rand(n, generator=generator) < 0.5
    yy, xx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    dy, dx = yy - centre[0], xx - centre[1]
    inside = torch.where(circle[:, None, None], dx**2 + dy**2 < radius**2, (dx.abs() < radius) & (dy.abs() < radius))
    mask = inside[:, None].float()
    images = mask * color[:, :, None, None] + (1 - mask) * 0.5
    words = torch.where(torch.rand(n, generator=generator) < 0.75, true_color,
                        torch.randint(len(colors), (n,), generator=generator))
    return images, [f"a {colors[w]} {'circle' if c else 'square'}" for w, c in zip(words, circle)]


def fit_tiny_pipeline(pipe, adapter: type, *, steps: int, seed: int, batch_size: int = 32) -> None:
    """Fit the tiny VAE as an autoencoder of toy_images (steps), then the transformer with the
    rectified-flow loss on the latents of a fixed set of them (4 * steps): a small pretrained
    generator. Latents and text embeddings are computed once."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    vae, transformer = pipe.vae.train().requires_grad_(True), pipe.transformer.train().requires_grad_(True)
    opt = torch.optim.Adam(vae.parameters(), lr=3e-3)
    for _ in range(steps):
        x = toy_images(batch_size // 2, g)[0] * 2 - 1
        posterior = vae.encode(x).latent_dist
        loss = F.mse_loss(vae.decode(posterior.sample(generator=g)).sample, x) + 1e-6 * posterior.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    vae.eval().requires_grad_(False)
    model = adapter(pipe, resolution=32, sampling_steps=1, max_sequence_length=8)
    images, captions = toy_images(512, g)
    with torch.no_grad():
        latents = (vae.encode(images * 2 - 1).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    data = model.from_vae_latents(latents)
    unique = sorted(set(captions))
    embedded = model.encode(unique)
    cond = {k: v[[unique.index(c) for c in captions]] for k, v in embedded.items()}
    opt = torch.optim.Adam(transformer.parameters(), lr=1e-3)
    for _ in range(4 * steps):
        i = torch.randint(len(data), (batch_size,), generator=g)
        x0, eps, t = data[i], torch.randn((batch_size, *data.shape[1:]), generator=g), torch.rand(batch_size, generator=g)
        tb = t.view(-1, *[1] * (x0.dim() - 1))
        loss = F.mse_loss(model.velocity((1 - tb) * x0 + tb * eps, t, {k: v[i] for k, v in cond.items()}), eps - x0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    transformer.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# Memory plan: what each GPU holds, counted before any weight is loaded. Parameters come from the configs on the
# meta device (exact, instant); activations from one real-width block of each block type run on the CPU with the
# training path's own autocast and LoRA (exact for that block), scaled by the number of such blocks and rows.

GiB = 2**30
HUB_IDS = {"stabilityai/stable-diffusion-3-medium-diffusers": "sd3-medium",
           "stabilityai/stable-diffusion-3.5-medium": "sd3.5-medium", "stabilityai/stable-diffusion-3.5-large": "sd3.5-large",
           "black-forest-labs/FLUX.1-dev": "flux.1-dev", "black-forest-labs/FLUX.1-schnell": "flux.1-schnell"}
# Full-size text encoders and VAE (../shared/REAL-CONFIGS.md: Stability's sd3_infer.py, the published configs).
FULL_TEXT_ENCODERS = {
    "clip_l": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   projection_dim=768, max_position_embeddings=77, hidden_act="quick_gelu"),
    "clip_g": dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                   num_attention_heads=20, projection_dim=1280, max_position_embeddings=77, hidden_act="gelu"),
    "t5": dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu", decoder_start_token_id=0),
}
FULL_VAE = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16, layers_per_block=2, norm_num_groups=32,
                use_quant_conv=False, use_post_quant_conv=False)


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

    if model in TINY_MODELS:
        pipe = tiny_pipeline(TINY_MODELS[model])
        return TINY_MODELS[model], {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
    with torch.device("meta"):
        if model in HUB_IDS:
            spec = REAL_CONFIGS[HUB_IDS[model]]
            transformer = reduced_transformer(HUB_IDS[model], full=True)
            vae = AutoencoderKL(**FULL_VAE, scaling_factor=spec["vae"][0], shift_factor=spec["vae"][1])
            configs = {k: (T5Config if k == "t5" else CLIPTextConfig)(**v) for k, v in FULL_TEXT_ENCODERS.items()}
            pipe = assemble_pipeline(spec["family"], transformer, None, vae, clip_tok=None, t5_tok=None, **configs)
            return spec["family"], {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
        if not os.path.isdir(model):
            raise ValueError(f"{model}: the memory plan needs its configs offline: pass a pipeline directory (configs "
                             f"suffice, no weights) or one of {', '.join(HUB_IDS)}")
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
        return PIPELINE_FAMILIES[index["_class_name"]], components


def stored_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of parameters and buffers once loaded in `dtype` the way from_pretrained loads them: floating tensors
    in dtype except the modules a model keeps in float32 (transformers: _keep_in_fp32_modules_strict always,
    _keep_in_fp32_modules only for float16; so T5's wo is bfloat16 in a bfloat16 load)."""
    keep = list(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep += list(getattr(module, "_keep_in_fp32_modules", None) or [])
    total = 0
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if not t.is_floating_point():
            total += t.numel() * t.element_size()
        elif any(f".{k}." in f".{name}" for k in keep):
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


def blocks_of(transformer, adapter: type) -> list[torch.nn.Module]:
    return [b for name in adapter.block_lists for b in getattr(transformer, name, [])]


def activation_profile(transformer_meta, adapter: type, dtype: torch.dtype, prepare, *, resolution: int,
                       max_sequence_length: int) -> dict:
    """Bytes saved for backward by a training forward of the full-depth transformer, as (fixed, per row) pairs:
    {"other": pair, "blocks": [pair per full-depth block], "inputs": [pair per block: what a checkpointed block
    keeps]}. Measured on the CPU on its real-width twin (adapter.reduced_depth: every block type, the first type
    twice) with `prepare` (LoRA, fp32 master weights) and the adapter's own autocast, at 1 and 2 rows.

    The first block differs from later blocks of its type: with LoRA its input does not require grad yet, so it
    saves less (seen: 8.2 vs 9.4 MB per row). Part of what is saved does not grow with the batch (autocast's bf16
    copies of the fp32 LoRA weights), hence the pairs."""
    import types

    config = dict(transformer_meta.config)
    with torch.device("meta"):
        twin = type(transformer_meta).from_config({**config, **adapter.reduced_depth(config)})
    twin = materialize(twin, dtype)
    prepare(twin)
    model = adapter(types.SimpleNamespace(transformer=twin, vae_scale_factor=8), dtype, resolution=resolution,
                    sampling_steps=1, max_sequence_length=max_sequence_length)
    twin_blocks = blocks_of(twin, adapter)
    runs = []
    for rows in (1, 2):
        saved = SavedBytes(twin, twin_blocks)
        with saved.hooks():
            model.velocity(torch.zeros(rows, *model.latent_shape()), torch.full((rows,), 0.5), model.cond_like(rows))
        runs.append(saved)

    def pair(get) -> tuple[float, float]:  # saved(rows) = fixed + per_row * rows, from rows 1 and 2
        one, two = get(runs[0]), get(runs[1])
        return 2 * one - two, two - one

    later = {block_signature(b): i for i, b in enumerate(twin_blocks) if i > 0}
    index = [0] + [later[block_signature(b)] for b in blocks_of(transformer_meta, adapter)[1:]]
    return {"other": pair(lambda r: r.other), "blocks": [pair(lambda r, i=i: r.per_block[i]) for i in index],
            "inputs": [pair(lambda r, i=i: r.inputs[i]) for i in index]}


def materialize(module: torch.nn.Module, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A meta-device module on the CPU in `dtype` with N(0, 0.02) weights: what is saved for backward depends on
    shapes and dtypes only, and this is several times faster than the layers' own initialisers."""
    module = module.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.normal_(0, 0.02, generator=g)
    return module


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
                offload_text_encoders: bool, activations: dict, decode_bytes: int) -> MemoryPlan:
    """Per-GPU memory of one training iteration under FSDP2 over `world` ranks, by phase.

    always: transformer shard (1/world of its weights, float32 where trained in full), replicated buffers, the
    trainable float32 weights + gradients + AdamW moments (sharded), VAE, reward models; text encoders unless
    offloaded. encode: + text encoders. rollout: + the whole transformer gathered in dtype (gather_once; else two
    blocks at a time) and one block's intermediates for the rollout batch, or the VAE's largest layer. train: + the
    two largest blocks gathered (current + prefetched) and the activations saved for backward of one micro-batch
    (micro_batch_size x K rows), or with checkpointing the blocks' inputs plus one block recomputed."""
    transformer = components["transformer"]
    blocks = blocks_of(transformer, adapter)
    n_params = sum(p.numel() for p in transformer.parameters())
    full_ft = lora_params == 0
    weights = n_params * (4 if full_ft else dtype.itemsize) / world  # FSDP2 shards frozen weights too
    buffers = sum(b.numel() * dtype.itemsize for b in transformer.buffers())
    trained = n_params if full_ft else lora_params
    states = trained * (12 if full_ft else 16) / world  # fp32 grads + 2 moments (+ the fp32 weight itself for LoRA)
    text = sum(stored_bytes(m, dtype) for k, m in components.items() if k.startswith("text_encoder"))
    vae = stored_bytes(components["vae"], dtype)
    gathered = (n_params + lora_params) * dtype.itemsize if world > 1 else 0  # world 1: the weights are whole
    block_bytes = sorted((sum(p.numel() for p in b.parameters()) * dtype.itemsize for b in blocks), reverse=True)
    gathered_train = sum(block_bytes[:2]) if world > 1 else 0
    blocks_saved = [saved_bytes([p], micro_rows) for p in activations["blocks"]]
    train_act = saved_bytes([activations["other"]], micro_rows) + (
        saved_bytes(activations["inputs"], micro_rows) + max(blocks_saved) if grad_checkpointing else sum(blocks_saved))
    rollout_act = max(saved_bytes([p], rollout_rows) for p in activations["blocks"])
    always = weights + buffers + states + vae + reward_bytes + (0 if offload_text_encoders else text)
    g = lambda b: b / GiB  # noqa: E731
    shard = f"1/{world} shard" if world > 1 else "unsharded"
    rows = [
        (f"transformer weights ({shard}, {'float32, trained' if full_ft else str(dtype)[6:]})", g(weights), "always"),
        ("transformer buffers (replicated: position tables)", g(buffers), "always"),
        (f"trainable {trained / 1e6:.1f} M: float32 " + ("grads + AdamW" if full_ft else "weights + grads + AdamW"),
         g(states), "always"),
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
    phases = {"encode": g(always + (text if offload_text_encoders else 0)),
              "rollout": g(always) + rows[6][1] + rows[7][1],
              "train": g(always) + rows[8][1] + rows[9][1]}
    return MemoryPlan(rows, phases, gpu_gb)


def decode_intermediates(vae_meta: torch.nn.Module, latent: tuple[int, ...], rows: int, dtype: torch.dtype) -> int:
    """Largest input + output of one VAE decoder layer for `rows` images, traced where the VAE lives (the meta device
    for real models): what a no-grad decode holds at least at its peak."""
    largest = [0]

    def hook(module, args, out):
        size = sum(t.numel() for t in (*args, out) if isinstance(t, torch.Tensor)) * dtype.itemsize
        largest[0] = max(largest[0], size)

    handles = [m.register_forward_hook(hook) for m in vae_meta.decoder.modules() if not list(m.children())]
    with torch.no_grad():
        vae_meta.decoder(torch.zeros(rows, *latent, device=next(vae_meta.parameters()).device))
    for handle in handles:
        handle.remove()
    return largest[0]


def lora_parameters(transformer: torch.nn.Module, rank: int, targets: list[str]) -> int:
    """Parameters LoRA of `rank` adds on the Linear layers peft matches to `targets` (A: r x in, B: out x r)."""
    return sum(rank * (m.in_features + m.out_features) for name, m in transformer.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))
