"""models.py: the model families train.py drives, behind one adapter contract; the offline test models; the memory plan.

V-GRPO needs five things from a text-to-image (or text-to-video) flow model, and nothing else (FlowAdapter's docstring
is the contract). Each diffusers pipeline family is one class here (SD3, Flux, QwenImage, Flux2, Wan); train.py never
looks past the contract.

Offline models (no hub access needed, random or briefly fitted weights, the real diffusers/transformers classes):
- tiny_pipeline: toy widths, used by `python train.py` and most tests (tiny_wan_pipeline: the video one);
- reduced_pipeline: the REAL widths of SD3-Medium, SD3.5-Medium/Large, FLUX.1-dev/schnell, Qwen-Image and FLUX.2
  [klein] 4B, Wan2.1-T2V-1.3B / 14B and Wan2.2-TI2V-5B (hidden sizes, heads, dual attention, qk norm, rope axes,
  guidance embedding, text-encoder widths, VAE latent channels and scaling), with 1-2 transformer blocks and one
  text-encoder layer, so that CPU tests see the layouts, sizes and dtypes a GPU run sees.

Memory plan (memory_plan, plan_memory): what each GPU holds in each phase of an iteration, from the configs on the
meta device and activations measured on a real-width twin, before any weight is loaded."""

import copy
import dataclasses
import json
import os
import re
from pathlib import Path
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

import rewards
import runs
import vgrpo

PIPELINE_FAMILIES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux", "QwenImagePipeline": "qwenimage",
                     "Flux2KleinPipeline": "flux2", "WanPipeline": "wan"}


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
    - latent_shape() -> shape of one sample's latent as the transformer sees it (2x2-packed tokens for the
      PackedLatents families); to_vae_latents / from_vae_latents map it to and from the VAE's grid.
    - timesteps() -> (sampling_steps + 1,) sigma grid from 1 to 0: exactly the grid the pipeline's own
      __call__ uses at this resolution and step count, so Euler rollouts equal `pipe(...)`.
    - decode(x) -> images (B, 3, H, W) in [0, 1], or videos (B, F, 3, H, W) where the class sets `video`;
      encode_images(images) -> x, its inverse through the VAE's encoder (fits the tiny models).
    - guided(velocity, uncond, scale) -> the rollout velocity under classifier-free guidance exactly as the pipeline
      combines the two predictions; uncond = encode([negative_prompt]), the negative the pipeline's docs use.
    For the memory plan (no weights needed): text_tokens() (the length of cond["embeds"]), cond_like(), and
    reduced_depth(config): transformer config changes that keep every block type, and each stack's first block's type
    twice where that first block saves a different amount than later ones of its type (with LoRA the model's first
    block saves less; FLUX.2's first single block more).
    A new family is one subclass plus an entry in PIPELINE_FAMILIES and ADAPTERS (and a tiny builder for its tests).
    """

    pipeline_class = ""
    block_lists = ("transformer_blocks",)  # the transformer's ModuleLists of blocks: FSDP units, planned per block
    negative_prompt = ""
    vae_frames = False  # the VAE takes video-shaped (B, C, frames, H, W) input (Qwen-Image's)
    video = False  # samples are videos of num_frames frames (B, F, 3, H, W); the rewards then score videos
    default_frames = 1  # --num_frames 0 means this
    frame_stride = 1
    min_sampling_steps = 1  # fewer and the pipeline's own sigma grid is undefined
    text_token_limit = None  # the most max_sequence_length the pipeline's check_inputs accepts (None: no limit)
    # --lora_targets auto: the attention projections of both streams (the text stream's add_* in joint attention)
    lora_targets = "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out"

    def __init__(self, pipe, dtype: torch.dtype = torch.float32, *, resolution: int, sampling_steps: int,
                 max_sequence_length: int, guidance: float = 3.5, num_frames: int = 1, width: int = 0):
        self.pipe, self.transformer, self.dtype = pipe, pipe.transformer, dtype
        # resolution is the height; width 0 = square (the image families are square)
        self.resolution, self.width, self.sampling_steps = resolution, width or resolution, sampling_steps
        self.num_frames = num_frames
        self.max_sequence_length, self.guidance = max_sequence_length, guidance
        self._grid = None

    def timesteps(self) -> torch.Tensor:
        """The scheduler as the pipeline sets it (shift, dynamic shifting, terminal settings), on a copy."""
        if self._grid is None:
            self._grid = self.scheduler().sigmas.float()
        return self._grid

    def schedule_kwargs(self) -> dict:
        return {}

    def scheduler(self, device="cpu"):
        """A copy of the pipeline's scheduler, set as its __call__ sets it (steps, shift, mu), at the first step."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(self.sampling_steps, device=device, **self.schedule_kwargs())
        scheduler.set_begin_index(0)
        return scheduler

    def sample(self, velocity, noise: torch.Tensor, cond: dict, solver: str) -> torch.Tensor:
        """A rollout noise -> x0 (B, ...). solver "scheduler" steps a copy of the pipeline's own scheduler exactly as
        its __call__ does (UniPC, DPM-Solver++, Euler: whatever the checkpoint ships), so rollouts equal `pipe()`
        with any one-evaluation-per-step scheduler; the others integrate vgrpo.sample_ode on the pipeline's grid."""
        if solver != "scheduler":
            return vgrpo.sample_ode(velocity, noise, cond, self.timesteps(), solver=solver)
        scheduler = self.scheduler(noise.device)
        z, scale = noise.float(), scheduler.config.num_train_timesteps
        for t in scheduler.timesteps:  # the model's timestep t is sigma * scale (UniPC rounds it to an integer)
            v = velocity(z, (t.float() / scale).expand(len(z)), cond)
            z = scheduler.step(v, t, z, return_dict=False)[0].float()
        return z

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

    @staticmethod
    def vae_scale(vae) -> int:
        """Pixels per latent cell, as the pipelines compute their vae_scale_factor."""
        return 2 ** (len(vae.config.block_out_channels) - 1)

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

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the transformer's scale (SD3/FLUX.1: shift and scaling factor)."""
        vae = self.pipe.vae
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        return latents / vae.config.scaling_factor + vae.config.shift_factor

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = self.denormalize(self.to_vae_latents(x)).to(vae.dtype)
        if self.vae_frames:
            latents = latents.unsqueeze(2)
        images = vae.decode(latents, return_dict=False)[0].float()
        return ((images[:, :, 0] if self.vae_frames else images) / 2 + 0.5).clamp(0, 1)

    @classmethod
    def to_vae_pixels(cls, images: torch.Tensor) -> torch.Tensor:
        """images (B, 3, H, W) in [0, 1] -> the VAE's input in [-1, 1] ((B, 3, 1, H, W) for a video VAE)."""
        return (images * 2 - 1).unsqueeze(2) if cls.vae_frames else images * 2 - 1

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """images (or videos) in [0, 1] -> x: the posterior mode, normalised and packed as the transformer sees it."""
        vae = self.pipe.vae
        latents = vae.encode(self.to_vae_pixels(images).to(vae.dtype)).latent_dist.mode().float()
        return self.from_vae_latents(self.normalize(latents[:, :, 0] if self.vae_frames else latents))

    def guided(self, velocity, uncond: dict, scale: float):
        """Classifier-free guidance v_u + scale (v_c - v_u), both predictions in one batched forward (SD3's way)."""

        def v(z, t, cond):
            both = {k: torch.cat([uncond[k].expand_as(cond[k]), cond[k]]) for k in cond}
            v_u, v_c = velocity(torch.cat([z, z]), torch.cat([t, t]), both).chunk(2)
            return v_u + scale * (v_c - v_u)

        return v


class SD3(FlowAdapter):
    """StableDiffusion3Pipeline (SD3, SD3.5): latents (B, C, H/8, W/8); timestep in [0, 1000]."""

    pipeline_class = "StableDiffusion3Pipeline"
    text_token_limit = 512

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


class PackedLatents(FlowAdapter):
    """The families whose pipelines pack the latents' 2x2 patches into tokens before the transformer (FLUX.1,
    Qwen-Image, FLUX.2): latents (B, H/16 * W/16, 4C)."""

    def _side(self) -> int:
        return self.resolution // self.pipe.vae_scale_factor // 2

    def image_tokens(self) -> int:
        return self._side() ** 2

    def latent_shape(self) -> tuple[int, ...]:
        return self._side() ** 2, self.transformer.config.in_channels

    def to_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h*w, C*4) -> (B, C, 2h, 2w): undo the 2x2 patch packing."""
        B, g, c = x.shape[0], self._side(), x.shape[-1] // 4
        return x.view(B, g, g, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, c, 2 * g, 2 * g)

    def from_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, 2h, 2w) -> (B, h*w, C*4): FLUX's 2x2 patch packing."""
        B, c, g = x.shape[0], x.shape[1], x.shape[-1] // 2
        return x.view(B, c, g, 2, g, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, g * g, c * 4)


class Flux(PackedLatents):
    """FluxPipeline (FLUX.1-dev/schnell): latents packed in 2x2 patches (B, H/16 * W/16, 4C), position ids,
    a guidance embedding where the transformer has one (dev, not schnell); timestep in [0, 1]."""

    pipeline_class = "FluxPipeline"
    text_token_limit = 512
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

    def schedule_kwargs(self) -> dict:
        # FluxPipeline.__call__: sigmas linspace(1, 1/N, N) unless the scheduler makes its own, mu always given
        # (the scheduler ignores it without dynamic shifting, as schnell's does).
        n = self.sampling_steps
        sigmas = None if self.pipe.scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / n, n)
        return {"sigmas": sigmas, "mu": self.mu()}


class ChannelStandardised:
    """VAE latents standardised per channel by the VAE config's latents_mean / latents_std (Qwen-Image's and Wan's
    VAEs), images (B, C, H, W) and videos (B, C, F, H, W) alike."""

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return (latents - mean) / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(latents)
        return latents * std + mean

    def _stats(self, like: torch.Tensor):
        config = self.pipe.vae.config
        shape = (1, config.z_dim) + (1,) * (like.dim() - 2)
        return (torch.tensor(config.latents_mean).view(shape).to(like), torch.tensor(config.latents_std).view(shape).to(like))


class QwenImage(ChannelStandardised, PackedLatents):
    """QwenImagePipeline (Qwen-Image): the last hidden states of Qwen2.5-VL over the prompt in Qwen-Image's system
    template (template tokens dropped; prompts of one batch padded to the longest, with a mask), latents packed in 2x2
    patches as FLUX.1's (B, H/16 * W/16, 4C) from a video VAE (one frame) normalised per channel; timestep in [0, 1];
    true CFG against a negative prompt, rescaled to the conditional prediction's norm."""

    pipeline_class = "QwenImagePipeline"
    text_token_limit = 1024
    negative_prompt = " "  # the model card's "recommended if you don't use a negative prompt"
    vae_frames = True
    # The scheduler stretches the grid so that its last sigma is shift_terminal, dividing by (1 - that sigma): with
    # one step that sigma is 1 and the grid 0 / 0 (QwenImagePipeline's own too).
    min_sampling_steps = 2

    @staticmethod
    def reduced_depth(config) -> dict:
        return {"num_layers": 2}  # one block type

    @staticmethod
    def vae_scale(vae) -> int:
        return 2 ** len(vae.config.temperal_downsample)

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict:
        embeds, mask = self.pipe.encode_prompt(texts, device=self.pipe.text_encoder.device,
                                               max_sequence_length=self.max_sequence_length)
        mask = torch.ones(embeds.shape[:2]) if mask is None else mask  # the pipeline drops an all-ones mask
        return {"embeds": embeds.float(), "mask": mask.float().to(embeds.device)}

    def velocity(self, z: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        mask = cond["mask"]
        # As the pipeline: no mask where no row is padded (SDPA then runs unmasked kernels, as in pipe(...)).
        mask = None if bool(mask.all()) else mask.bool()
        side = self._side()
        with autocast(z.device, self.dtype):
            return self.transformer(hidden_states=z, timestep=t, encoder_hidden_states=cond["embeds"],
                                    encoder_hidden_states_mask=mask, img_shapes=[[(1, side, side)]] * z.shape[0],
                                    return_dict=False)[0].float()

    def guided(self, velocity, uncond: dict, scale: float):
        """QwenImagePipeline's true CFG: two forwards (the prompts' and the negative's lengths differ), combined,
        then rescaled per token to the norm of the conditional prediction."""

        def v(z, t, cond):
            v_c = velocity(z, t, cond)
            v_u = velocity(z, t, {k: u.expand(len(z), *u.shape[1:]) for k, u in uncond.items()})
            combined = v_u + scale * (v_c - v_u)
            return combined * (v_c.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

        return v

    def cond_like(self, batch: int, device="cpu") -> dict:
        tokens, width = self.text_tokens(), self.transformer.config.joint_attention_dim
        return {"embeds": torch.zeros(batch, tokens, width, device=device), "mask": torch.ones(batch, tokens, device=device)}

    def schedule_kwargs(self) -> dict:
        # QwenImagePipeline.__call__: sigmas linspace(1, 1/N, N), mu from the image tokens (the scheduler then applies
        # its exponential shift and shift_terminal).
        n = self.sampling_steps
        return {"sigmas": np.linspace(1.0, 1 / n, n), "mu": self.mu()}



class Flux2(PackedLatents):
    """Flux2KleinPipeline (FLUX.2 [klein] 4B / 9B and their base models): Qwen3 hidden states of layers 9, 18 and 27
    side by side over the chat-templated prompt padded to max_sequence_length; latents of 2x2-patchified VAE channels
    (B, H/16 * W/16, 4C) normalised by the VAE's batch-norm statistics; 4-D (t, h, w, l) position ids; no guidance
    embedding; the base models take standard CFG against an empty prompt (the distilled ones none)."""

    pipeline_class = "Flux2KleinPipeline"
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    text_encoder_out_layers = (9, 18, 27)  # Flux2KleinPipeline's default

    @staticmethod
    def reduced_depth(config) -> dict:
        return {"num_layers": 2, "num_single_layers": 2}

    def text_layers(self) -> tuple[int, ...]:
        """The pipeline's layers; a text encoder shallower than 27 layers (the offline test models, one layer at real
        width) gives its last layer in place of the deeper ones. The real Qwen3-4B / 8B have 36."""
        depth = self.pipe.text_encoder.config.num_hidden_layers
        return tuple(min(k, depth) for k in self.text_encoder_out_layers)

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict:
        embeds, _ = self.pipe.encode_prompt(texts, device=self.pipe.text_encoder.device,
                                            max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=self.text_layers())
        return {"embeds": embeds.float()}

    def velocity(self, z: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        side = self._side()
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        zeros = torch.zeros_like(rows)
        img_ids = torch.stack([zeros, rows, cols, zeros], dim=-1).view(-1, 4)  # (t, h, w, l) = (0, row, col, 0)
        tokens = torch.arange(cond["embeds"].shape[1])
        txt_ids = torch.stack([torch.zeros_like(tokens)] * 3 + [tokens], dim=-1)  # (0, 0, 0, token)
        with autocast(z.device, self.dtype):
            return self.transformer(hidden_states=z, timestep=t, guidance=None, encoder_hidden_states=cond["embeds"],
                                    img_ids=img_ids.to(z.device), txt_ids=txt_ids.to(z.device),
                                    return_dict=False)[0].float()

    def cond_like(self, batch: int, device="cpu") -> dict:
        width = self.transformer.config.joint_attention_dim
        return {"embeds": torch.zeros(batch, self.text_tokens(), width, device=device)}

    def schedule_kwargs(self) -> dict:
        # Flux2KleinPipeline.__call__: sigmas linspace(1, 1/N, N) unless the scheduler makes its own, and mu from
        # its empirical fit in the image tokens and the step count.
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        n = self.sampling_steps
        sigmas = None if self.pipe.scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / n, n)
        return {"sigmas": sigmas, "mu": compute_empirical_mu(image_seq_len=self.image_tokens(), num_steps=n)}

    def to_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h*w, 4C) -> (B, 4C, h, w): tokens back on the grid (still 2x2-patchified; denormalize unpatchifies)."""
        g = self._side()
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], g, g)

    def from_vae_latents(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, 2h, 2w) VAE latents -> (B, 4C, h, w), standardised by the VAE's batch-norm running statistics."""
        from diffusers import Flux2KleinPipeline

        mean, std = self._stats(latents)
        return (Flux2KleinPipeline._patchify_latents(latents) - mean) / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        from diffusers import Flux2KleinPipeline

        mean, std = self._stats(latents)
        return Flux2KleinPipeline._unpatchify_latents(latents * std + mean)

    def _stats(self, like: torch.Tensor):
        vae = self.pipe.vae
        std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps)
        return vae.bn.running_mean.view(1, -1, 1, 1).to(like), std.view(1, -1, 1, 1).to(like)


class Wan(ChannelStandardised, FlowAdapter):
    """WanPipeline (Wan2.1 T2V, Wan2.2 TI2V-5B with one transformer): latents (B, C, 1 + (F-1)/4, H/8, W/8) on the
    VAE's grid, standardised per channel; UMT5 embeddings zero-padded past each prompt; timestep in [0, 1000], one
    per latent token where the pipeline sets expand_timesteps (Wan2.2-TI2V-5B). The published checkpoints ship a
    UniPC scheduler, so rollouts that equal `pipe()` use --solver scheduler; decode gives videos (B, F, 3, H, W).
    Wan2.2-A14B (two experts switched at a boundary timestep: which one a surrogate timestep trains, and whether the
    other is frozen, would change the method) is refused."""

    pipeline_class = "WanPipeline"
    block_lists = ("blocks",)
    lora_targets = "to_q,to_k,to_v,to_out.0"  # self-attention (attn1) and cross-attention to the text (attn2)
    video = True
    default_frames = 81  # WanPipeline's default num_frames
    frame_stride = 4  # the Wan VAEs' temporal compression: num_frames = 1 + a multiple of it

    def __init__(self, pipe, dtype: torch.dtype = torch.float32, **settings):
        if getattr(pipe, "transformer_2", None) is not None:
            raise runs.ConfigError("Wan2.2-A14B's two experts (switched at a boundary timestep) are not supported; use "
                                   "Wan2.1-T2V or Wan2.2-TI2V-5B (one transformer)")
        super().__init__(pipe, dtype, **settings)

    @staticmethod
    def to_vae_pixels(videos: torch.Tensor) -> torch.Tensor:
        """videos (B, F, 3, H, W) in [0, 1] -> (B, 3, F, H, W) in [-1, 1]."""
        return videos.transpose(1, 2) * 2 - 1

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict:
        embeds, _ = self.pipe.encode_prompt(texts, do_classifier_free_guidance=False, device=self.pipe.text_encoder.device,
                                            max_sequence_length=self.max_sequence_length)
        return {"embeds": embeds.float()}

    def velocity(self, z: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        timestep = t * 1000
        if getattr(self.pipe.config, "expand_timesteps", False):  # WanPipeline: one per token, (B, F' * H'/2 * W'/2)
            timestep = timestep[:, None].expand(-1, z[0, 0, :, ::2, ::2].numel())
        with autocast(z.device, self.dtype):
            return self.transformer(hidden_states=z, timestep=timestep, encoder_hidden_states=cond["embeds"],
                                    return_dict=False)[0].float()

    def latent_shape(self) -> tuple[int, ...]:
        vae = self.pipe.vae.config  # WanPipeline's vae_scale_factor_spatial / _temporal are these
        frames = 1 + (self.num_frames - 1) // vae.scale_factor_temporal
        return vae.z_dim, frames, self.resolution // vae.scale_factor_spatial, self.width // vae.scale_factor_spatial

    def cond_like(self, batch: int, device="cpu") -> dict:
        return {"embeds": torch.zeros(batch, self.text_tokens(), self.transformer.config.text_dim, device=device)}

    @staticmethod
    def reduced_depth(config) -> dict:
        return {"num_layers": 2}  # one block type; the first (which saves less with LoRA) and a later one

    @staticmethod
    def vae_scale(vae) -> int:
        return vae.config.scale_factor_spatial

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, F', h, w) -> videos (B, F, 3, H, W) in [0, 1], as WanPipeline's postprocess_video gives them."""
        vae = self.pipe.vae
        video = vae.decode(self.denormalize(x).to(vae.dtype), return_dict=False)[0].float()
        return (video / 2 + 0.5).clamp(0, 1).transpose(1, 2)


ADAPTERS = {"sd3": SD3, "flux": Flux, "qwenimage": QwenImage, "flux2": Flux2, "wan": Wan}


# ----------------------------------------------------------------------------------------------
# Tiny offline models: the real diffusers / transformers classes at toy sizes, random weights,
# tokenizers built in memory. Used by the default run and by the tests.

TINY_MODELS = {"tiny": "sd3", "tiny-flux": "flux", "tiny-qwenimage": "qwenimage", "tiny-flux2": "flux2", "tiny-wan": "wan"}
TINY_PROMPTS = [f"a {color} {thing}" for color in rewards.COLORS for thing in ("square", "circle", "car", "flower")]
TINY_VIDEO_PROMPTS = [f"a {color} square moving {way}" for color in rewards.COLORS for way in rewards.DIRECTIONS]
TINY_FRAMES = 5  # tiny-wan's default --num_frames: 2 latent frames (the first frame, then 4 per latent frame)
_TINY_WORDS = sorted({w for p in TINY_PROMPTS for w in p.split()} | {"photo", "of", "the"})


_TINY_VIDEO_WORDS = sorted(set(_TINY_WORDS) | {w for p in TINY_VIDEO_PROMPTS for w in p.split()})


def tiny_prompts(family: str) -> list[str]:
    """The built-in prompts of a tiny model: the toy videos' for a video family, the toy images' else."""
    return TINY_VIDEO_PROMPTS if ADAPTERS[family].video else TINY_PROMPTS


def in_eval_mode(pipe):
    """pipe with every module in eval mode: fresh models are in train mode, and T5's dropout would make the text
    embeddings random."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


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


def tiny_t5_tokenizer(words: list[str] = _TINY_WORDS):
    """A unigram T5 tokenizer: the tiny prompts' words as single pieces, letters as fallback."""
    from transformers import T5Tokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in letters] + [("▁" + c, -3.0) for c in letters] + [("▁" + w, -1.0) for w in words]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


# The words of Qwen-Image's system template: as single tokens its prefix is the 34 tokens the pipeline drops, as in
# the real tokenizer (QwenImagePipeline.prompt_template_encode_start_idx).
_QWEN_TEMPLATE_WORDS = ("Describe the image by detailing color shape size texture quantity text spatial relationships of "
                        "objects and background").split()
# Qwen3's chat template for one user message (Flux2KleinPipeline: add_generation_prompt, enable_thinking=False).
_QWEN3_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                        "{% if enable_thinking is defined and enable_thinking is false %}"
                        "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


def tiny_qwen_tokenizer():
    """A byte-level BPE Qwen2 tokenizer (the class of Qwen2.5-VL's and Qwen3's) whose merges make each word of the
    tiny prompts and of Qwen-Image's template one token, with the chat special tokens and Qwen3's chat template."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(byte.values())}
    merges = []
    words = {*_TINY_WORDS, *_QWEN_TEMPLATE_WORDS, "system", "user", "assistant"}
    for word in sorted(words | {" " + w for w in words}):
        pieces = [byte[b] for b in word.encode()]
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            vocab.setdefault(pieces[0], len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(dict.fromkeys(merges)), unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    return tokenizer


def qwen_text_encoder(family: str, *, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                      kv_heads: int, head_dim: int, vision: dict | None = None, tokenizer=None):
    """Qwen2.5-VL (Qwen-Image; its vision tower, never run on text, is built small unless given) or Qwen3 (FLUX.2
    [klein]) of these sizes, random weights, eval mode; special-token ids from `tokenizer` when given."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    ids = dict(bos_token_id=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id) if tokenizer else {}
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, **ids)
    if family == "flux2":
        return Qwen3ForCausalLM(Qwen3Config(**text, head_dim=head_dim, tie_word_embeddings=True)).eval()
    half = head_dim // 2  # mrope splits each head's rotary frequencies over (time, height, width): 16/24/24 of 64
    mrope = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    vision = vision or dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, fullatt_block_indexes=[0])
    rope = {"rope_type": "default", "mrope_section": mrope, "rope_theta": 1e6}
    config = Qwen2_5_VLConfig(text_config={**text, "rope_parameters": rope}, vision_config={**vision, "out_hidden_size": hidden})
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_pipeline(family: str, seed: int = 0, fit_steps: int = 0, progress: bool = False):
    """A StableDiffusion3Pipeline or FluxPipeline at toy sizes (32 px images, 16 x 16 x 4 latents),
    random, or briefly fitted to toy images (fit_tiny_pipeline, with a progress bar on a terminal if progress) when
    fit_steps > 0; QwenImagePipeline and Flux2KleinPipeline likewise (tiny_qwen_pipeline)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextConfig, T5Config

    torch.manual_seed(seed)
    if family == "wan":
        pipe = tiny_wan_pipeline(seed)
        if fit_steps:
            fit_tiny_pipeline(pipe, Wan, steps=fit_steps, seed=seed, progress=progress)
        return pipe
    if family in ("qwenimage", "flux2"):
        pipe = tiny_qwen_pipeline(family)
        if fit_steps:
            fit_tiny_pipeline(pipe, ADAPTERS[family], steps=fit_steps, seed=seed, progress=progress)
        return pipe
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
        fit_tiny_pipeline(pipe, ADAPTERS[family], steps=fit_steps, seed=seed, progress=progress)
    return pipe


def tiny_wan_pipeline(seed: int = 0, expand_timesteps: bool = False):
    """A WanPipeline at toy sizes: 32 px, frames 1 + 4n -> latents (4, 1 + n, 8, 8) (the real VAE's x4 in time, x4
    in space here instead of x8); UMT5 with the tiny T5 tokenizer; the Wan checkpoints' UniPC scheduler (flow
    prediction, flow sigmas, flow_shift 3 as at 480p)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = tiny_t5_tokenizer(_TINY_VIDEO_WORDS)
    umt5 = UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1, temperal_downsample=[True, True],
                           latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0],
                           scale_factor_spatial=4, scale_factor_temporal=4)
    # attention_head_dim 12: Wan's 3-axis RoPE splits a head into frames 4, height 4, width 4
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=UMT5EncoderModel(umt5), vae=vae, scheduler=scheduler,
                       transformer=transformer, expand_timesteps=expand_timesteps)
    return in_eval_mode(pipe)


def tiny_qwen_pipeline(family: str):
    """QwenImagePipeline or Flux2KleinPipeline at toy sizes: 32 px images, 16 x 16 x 4 VAE latents (8 x 8 tokens of
    16 channels), a Qwen2.5-VL / Qwen3 text encoder of width 32 / 16 (Qwen3 27 layers deep, the least that has the
    pipeline's layers 9, 18 and 27)."""
    from diffusers import (AutoencoderKLFlux2, AutoencoderKLQwenImage, Flux2Transformer2DModel,
                           FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel)

    tokenizer = tiny_qwen_tokenizer()
    if family == "qwenimage":
        text = qwen_text_encoder(family, vocab=len(tokenizer), hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1,
                                 head_dim=16, tokenizer=tokenizer)
        transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                  axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                     latents_mean=QWEN_LATENTS[0][:4], latents_std=QWEN_LATENTS[1][:4])
        return assemble_qwen_pipeline(family, transformer, FlowMatchEulerDiscreteScheduler(**_QWEN_SCHEDULER), vae,
                                      text, tokenizer)
    text = qwen_text_encoder(family, vocab=len(tokenizer), hidden=16, intermediate=32, layers=27, heads=2, kv_heads=1,
                             head_dim=8, tokenizer=tokenizer)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
                             norm_num_groups=4, mid_block_add_attention=False, use_quant_conv=False,
                             use_post_quant_conv=False)
    return assemble_qwen_pipeline(family, transformer, FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER), vae, text,
                                  tokenizer)


def assemble_qwen_pipeline(family: str, transformer, scheduler, vae, text_encoder, tokenizer):
    """A QwenImagePipeline or a Flux2KleinPipeline (a base model: is_distilled False, so CFG applies) in eval mode."""
    from diffusers import Flux2KleinPipeline, QwenImagePipeline

    cls = QwenImagePipeline if family == "qwenimage" else Flux2KleinPipeline
    pipe = cls(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
    return in_eval_mode(pipe)


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
    return in_eval_mode(pipe)


# ----------------------------------------------------------------------------------------------
# Real-width, reduced-depth models: the published architectures with fewer blocks. Sources: diffusers'
# scripts/convert_sd3_to_diffusers.py and SD3Transformer2DModel defaults (SD3 family), Black Forest Labs' flux
# src/flux/util.py (FLUX.1), Stability's sd3_infer.py (text encoders), each model's scheduler_config.json; Qwen-Image:
# Qwen/Qwen-Image's transformer/config.json, scheduler_config.json and text_encoder/config.json (Qwen2.5-VL-7B), its
# VAE's = AutoencoderKLQwenImage's defaults; FLUX.2 [klein] 4B: black-forest-labs/FLUX.2-klein-4B's transformer/config.json
# (the base-4B one is the same; diffusers' convert_flux2_to_diffusers.py "klein-4b"), text_encoder/config.json
# (Qwen3-4B), its VAE's = AutoencoderKLFlux2's defaults.

_SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
            pos_embed_max_size=192, dual_attention_layers=(), qk_norm=None)
_FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56))
_FLUX_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                       max_image_seq_len=4096)
_QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
_QWEN_SCHEDULER = dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                       max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
QWEN_LATENTS = ([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632,
                 -0.1922, -0.9497, 0.2503, -0.2921],
                [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382,
                 1.1253, 2.8251, 1.916])  # the Qwen-Image VAE's per-channel latent mean and std
_FLUX2_KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                       axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False)
# Wan (the Wan-AI/*-Diffusers configs): transformer, UniPC scheduler (flow_shift 3 as Wan2.1-1.3B ships it, 5 for the
# 720p models as their cards use), VAE (Wan2.1's: z 16, x8 / x4; Wan2.2's: z 48, x16 with its 2x2 patchify; its 48
# latent statistics are not reproduced here: 0 and 1), UMT5-XXL.
_WAN = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
_WAN_SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
_WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
_WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                  patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48,
                  latents_std=[1.0] * 48)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
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
    "qwen-image": dict(family="qwenimage", transformer=_QWEN_IMAGE, scheduler=_QWEN_SCHEDULER,
                       text=dict(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, head_dim=128,
                                 vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                             fullatt_block_indexes=[7, 15, 23, 31]))),
    # FLUX.2's scheduler_config is FLUX.1's; Flux2KleinPipeline computes mu itself, so of these only
    # use_dynamic_shifting acts.
    "flux.2-klein-4b": dict(family="flux2", transformer=_FLUX2_KLEIN_4B, scheduler=_FLUX_SCHEDULER,
                            text=dict(vocab=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8,
                                      head_dim=128)),
    "wan2.1-t2v-1.3b": dict(family="wan", transformer={**_WAN, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
                            scheduler=_WAN_SCHEDULER, vae=_WAN21_VAE, text=UMT5_XXL, pipeline=dict(expand_timesteps=False)),
    "wan2.1-t2v-14b": dict(family="wan", transformer={**_WAN, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
                           scheduler={**_WAN_SCHEDULER, "flow_shift": 5.0}, vae=_WAN21_VAE, text=UMT5_XXL,
                           pipeline=dict(expand_timesteps=False)),
    "wan2.2-ti2v-5b": dict(family="wan", transformer={**_WAN, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30,
                                                      "in_channels": 48, "out_channels": 48},
                           scheduler={**_WAN_SCHEDULER, "flow_shift": 5.0}, vae=_WAN22_VAE, text=UMT5_XXL,
                           pipeline=dict(expand_timesteps=True)),
}
TRANSFORMER_CLASSES = {"sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel",
                       "qwenimage": "QwenImageTransformer2DModel", "flux2": "Flux2Transformer2DModel",
                       "wan": "WanTransformer3DModel"}


def reduced_pipeline(name: str, seed: int = 0):
    """The pipeline of REAL_CONFIGS[name] at real width and reduced depth, random weights: SD3 family 2 blocks
    (block 0 dual-attention where the real model has any, block 1 context_pre_only like the real last block), FLUX
    1 double + 1 single block; CLIP-L, CLIP-G and T5-XXL at their real widths with one layer each (vocabularies
    and CLIP's padded length are the tiny tokenizers', which is no width); a VAE of 32 channels per block with the
    real 4 blocks (x8), 16 latent channels and real scaling/shift. Every block keeps its real shape and dtype
    behaviour; only the number of blocks shrinks. Qwen-Image and FLUX.2: reduced_qwen_pipeline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, T5Config

    spec = REAL_CONFIGS[name]
    torch.manual_seed(seed)
    if spec["family"] in ("qwenimage", "flux2"):
        return reduced_qwen_pipeline(name)
    if spec["family"] == "wan":
        return reduced_wan_pipeline(name)
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


def reduced_qwen_pipeline(name: str):
    """Qwen-Image: 1 block, Qwen2.5-VL-7B's text width with one layer (vision tower 1 block at real width); FLUX.2
    [klein]: 1 double + 1 single block, Qwen3-4B's width with one layer (Flux2.text_layers then reads layer 1 three
    times: the same 3 x 2560 features). VAEs of the real depth and latent channels at 16 / 32 channels per block."""
    from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    spec = REAL_CONFIGS[name]
    tokenizer = tiny_qwen_tokenizer()
    text = {**spec["text"], "vocab": len(tokenizer), "layers": 1}
    if "vision" in text:
        text["vision"] = {**text["vision"], "depth": 1, "fullatt_block_indexes": [0]}
    encoder = qwen_text_encoder(spec["family"], **text, tokenizer=tokenizer)
    if spec["family"] == "qwenimage":
        vae = AutoencoderKLQwenImage(base_dim=16, num_res_blocks=1)  # real z_dim 16, x8, latent statistics
    else:
        vae = AutoencoderKLFlux2(block_out_channels=(32,) * 4, layers_per_block=1)  # real 32 latent channels, x8
    return assemble_qwen_pipeline(spec["family"], reduced_transformer(name), FlowMatchEulerDiscreteScheduler(**spec["scheduler"]),
                                  vae, encoder, tokenizer)


def reduced_wan_pipeline(name: str, text_encoder=None, tokenizer=None):
    """A WanPipeline: 1 transformer block at real width, UMT5-XXL's width with one layer (the tiny T5 vocabulary), a
    VAE of the real structure (z channels, x8 / x4, Wan2.2's x16 with its 2x2 patchify and residual blocks) at 16
    channels per block, the UniPC scheduler, expand_timesteps as the checkpoint sets it. text_encoder / tokenizer:
    reuse these (same widths in every Wan)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    spec = REAL_CONFIGS[name]
    tokenizer = tokenizer or tiny_t5_tokenizer(_TINY_VIDEO_WORDS)
    if text_encoder is None:
        text = {**spec["text"], "vocab_size": len(tokenizer), "num_layers": 1, "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id, "decoder_start_token_id": 0}
        text_encoder = UMT5EncoderModel(UMT5Config(**text))
    narrow = {"base_dim": 16, "num_res_blocks": 1, **({"decoder_base_dim": 16} if "decoder_base_dim" in spec["vae"] else {})}
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=AutoencoderKLWan(**{**spec["vae"], **narrow}),
                       transformer=reduced_transformer(name), scheduler=UniPCMultistepScheduler(**spec["scheduler"]),
                       **spec["pipeline"])
    return in_eval_mode(pipe)


def reduced_transformer(name: str, full: bool = False):
    """The transformer of REAL_CONFIGS[name] at real width, 2 blocks (SD3 family), 1 + 1 (FLUX.1, FLUX.2) or 1
    (Qwen-Image), random weights; full: at its real depth (build it on the meta device)."""
    import diffusers

    spec = REAL_CONFIGS[name]
    cls = getattr(diffusers, TRANSFORMER_CLASSES[spec["family"]])
    if full:
        return cls(**spec["transformer"])
    if spec["family"] == "sd3":
        dual = (0,) if spec["transformer"]["dual_attention_layers"] else ()
        return cls(**{**spec["transformer"], "num_layers": 2, "dual_attention_layers": dual})
    single = {"num_single_layers": 1} if "num_single_layers" in spec["transformer"] else {}
    return cls(**{**spec["transformer"], "num_layers": 1, **single})


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


def toy_videos(n: int, generator: torch.Generator, frames: int = TINY_FRAMES) -> tuple[torch.Tensor, list[str]]:
    """n 32 x 32 videos (n, frames, 3, 32, 32) in [0, 1]: a square of one of the 8 colours on grey moving 12 px from
    the first frame to the last in one of the 4 directions of the motion reward, inside the frame throughout.
    Captions name the colour (right 3 times in 4) and the direction (right 3 times in 5, else a random one): a
    generator fitted to them follows the words imperfectly, leaving RL something to fix."""
    colors, ways = list(rewards.COLORS), list(rewards.DIRECTIONS)
    true_color, true_way = torch.randint(len(colors), (n,), generator=generator), torch.randint(len(ways), (n,), generator=generator)
    color = torch.tensor(list(rewards.COLORS.values()))[true_color]
    step = torch.tensor(list(rewards.DIRECTIONS.values()))[true_way] * (12 // (frames - 1))  # (dx, dy) per frame
    radius = torch.randint(7, 10, (n,), generator=generator)  # sides of 13 to 17 px
    # The square starts near the edge it moves away from (within 2 px) and anywhere across the other axis, inside
    # the frame throughout: r <= centre <= 32 - r on both axes at every frame.
    low = radius[:, None] - torch.where(step < 0, step * (frames - 1), 0)
    high = 32 - radius[:, None] - torch.where(step > 0, step * (frames - 1), 0)
    spread = torch.where(step != 0, torch.minimum(high - low, torch.full_like(low, 2)), high - low)
    offset = (torch.rand(n, 2, generator=generator) * (spread + 1)).long().clamp(max=spread)
    start = torch.where(step < 0, high - offset, low + offset)
    t = torch.arange(frames)
    centre = start[:, None, :] + t[None, :, None] * step[:, None, :]  # (n, frames, 2) as (x, y)
    yy, xx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    inside = ((xx - centre[..., 0, None, None]).abs() < radius[:, None, None, None]) & \
             ((yy - centre[..., 1, None, None]).abs() < radius[:, None, None, None])
    mask = inside[:, :, None].float()
    videos = mask * color[:, None, :, None, None] + (1 - mask) * 0.5
    said_color = torch.where(torch.rand(n, generator=generator) < 0.75, true_color,
                             torch.randint(len(colors), (n,), generator=generator))
    said_way = torch.where(torch.rand(n, generator=generator) < 0.6, true_way,
                           torch.randint(len(ways), (n,), generator=generator))
    return videos, [f"a {colors[c]} square moving {ways[w]}" for c, w in zip(said_color, said_way)]


def fit_tiny_pipeline(pipe, adapter: type, *, steps: int, seed: int, batch_size: int = 32, progress: bool = False) -> None:
    """Fit the tiny VAE as an autoencoder of toy_images (toy_videos for a video family) (steps), then the
    transformer with the rectified-flow loss on the latents of a fixed set of them (4 * steps): a small pretrained
    generator. Latents and text embeddings are computed once."""
    import torch.nn.functional as F

    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    vae, transformer = pipe.vae.train().requires_grad_(True), pipe.transformer.train().requires_grad_(True)
    toy = toy_videos if adapter.video else toy_images
    # One bar for both stages (5 x steps optimizer steps), shown on a terminal only and by one process only.
    bar = tqdm(total=5 * steps, desc=f"fitting the tiny model to toy {'videos' if adapter.video else 'images'}",
               disable=None if progress else True, leave=False, dynamic_ncols=True)
    # A video VAE learns from short clips (5 frames: its first frame alone and one chunk of 4), a quarter of the
    # batch: its causal 3-D convolutions cost 0.6 s per step for 16 clips of 9 frames on 2 cores.
    vae_batch = partial(toy, batch_size // 4, frames=5) if adapter.video else partial(toy, batch_size // 2)
    opt = torch.optim.Adam(vae.parameters(), lr=3e-3)
    for _ in range(steps):
        x = adapter.to_vae_pixels(vae_batch(generator=g)[0])
        posterior = vae.encode(x).latent_dist
        loss = F.mse_loss(vae.decode(posterior.sample(generator=g)).sample, x) + 1e-6 * posterior.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.update()
    vae.eval().requires_grad_(False)
    model = adapter(pipe, resolution=32, sampling_steps=1, max_sequence_length=8,
                    num_frames=TINY_FRAMES if adapter.video else 1)
    images, captions = toy(512, g)
    data = model.encode_images(images)
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
        bar.update()
    bar.close()
    transformer.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# Memory plan: what each GPU holds, counted before any weight is loaded. Parameters come from the configs on the
# meta device (exact, instant); activations from one real-width block of each block type run on the CPU with the
# training path's own autocast and LoRA (exact for that block), scaled by the number of such blocks and rows.

GiB = 2**30
HUB_IDS = {"stabilityai/stable-diffusion-3-medium-diffusers": "sd3-medium",
           "stabilityai/stable-diffusion-3.5-medium": "sd3.5-medium", "stabilityai/stable-diffusion-3.5-large": "sd3.5-large",
           "black-forest-labs/FLUX.1-dev": "flux.1-dev", "black-forest-labs/FLUX.1-schnell": "flux.1-schnell",
           "Qwen/Qwen-Image": "qwen-image", "black-forest-labs/FLUX.2-klein-base-4B": "flux.2-klein-4b",
           "black-forest-labs/FLUX.2-klein-4B": "flux.2-klein-4b", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "wan2.1-t2v-1.3b",
           "Wan-AI/Wan2.1-T2V-14B-Diffusers": "wan2.1-t2v-14b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers": "wan2.2-ti2v-5b"}
DISTILLED_HUB_IDS = {"black-forest-labs/FLUX.2-klein-4B"}  # is_distilled in its model_index.json: no CFG
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
        if model in HUB_IDS and REAL_CONFIGS[HUB_IDS[model]]["family"] == "wan":
            from diffusers import AutoencoderKLWan
            from transformers import UMT5Config, UMT5EncoderModel

            spec = REAL_CONFIGS[HUB_IDS[model]]
            return "wan", {"transformer": reduced_transformer(HUB_IDS[model], full=True),
                           "vae": AutoencoderKLWan(**spec["vae"]), "text_encoder": UMT5EncoderModel(UMT5Config(**spec["text"])),
                           "pipeline_config": spec["pipeline"]}
        if model in HUB_IDS and REAL_CONFIGS[HUB_IDS[model]]["family"] in ("qwenimage", "flux2"):
            from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage

            spec = REAL_CONFIGS[HUB_IDS[model]]
            vae = AutoencoderKLQwenImage() if spec["family"] == "qwenimage" else AutoencoderKLFlux2()  # the real ones
            return spec["family"], {"transformer": reduced_transformer(HUB_IDS[model], full=True), "vae": vae,
                                    "text_encoder": qwen_text_encoder(spec["family"], **spec["text"])}
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
        # the pipeline's own settings beside its components (Wan2.2-TI2V's expand_timesteps)
        components["pipeline_config"] = {k: v for k, v in index.items() if not k.startswith("_") and not isinstance(v, list)}
        return PIPELINE_FAMILIES[index["_class_name"]], components


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


def blocks_of(transformer, adapter: type) -> list[torch.nn.Module]:
    return [b for name in adapter.block_lists for b in getattr(transformer, name, [])]


def transformer_blocks(transformer) -> list[torch.nn.Module]:
    """The blocks of a transformer of any family (the FSDP2 units, the regions compiled)."""
    names = dict.fromkeys(name for adapter in ADAPTERS.values() for name in adapter.block_lists)
    return [b for name in names for b in getattr(transformer, name, [])]


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
    """A meta-device module on `device` in `dtype` with N(0, 0.02) weights: what is saved for backward and what a
    step costs depend on shapes and dtypes only, and this is several times faster than the layers' own
    initialisers. Cast before allocating: never a float32 copy of a bf16 model."""
    module = module.to(dtype).to_empty(device=device)
    g = torch.Generator(device).manual_seed(seed)
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
        raise runs.ConfigError("--plan: no GPU is visible here; say what to plan for with --plan_world_size N --plan_gpu_gb G")
    return world, gpu_gb


def plan_memory(cfg, family: str, world: int, gpu_gb: float, prepare) -> tuple[MemoryPlan, str]:
    """The per-GPU memory plan of a train.Config on `world` GPUs of gpu_gb GiB and, when it does not fit, the flags
    that make it fit: levers taken cheapest first and cumulatively (a smaller micro-batch costs nothing at all; then
    smaller rollout batches, gathering per ODE step, activation checkpointing: one more forward). When it fits and a
    larger rollout batch would too, the largest one (sampling calls of more rows use a GPU better). prepare(transformer)
    makes it trainable as the run will (train.make_trainable)."""
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    try:
        _, components = meta_components(cfg.model)
    except (ValueError, OSError) as error:
        raise runs.ConfigError(f"--plan: {error}") from None
    adapter, transformer = ADAPTERS[family], components["transformer"]
    settings = dict(resolution=cfg.resolution, max_sequence_length=cfg.max_sequence_length, width=cfg.width,
                    num_frames=frames_of(cfg.num_frames, cfg.model, family))
    activations = activation_profile(transformer, adapter, dtype, prepare, settings=settings, vae=components["vae"],
                                     pipeline_config=components.get("pipeline_config"))
    lora = lora_parameters(transformer, cfg.lora_rank, lora_targets(cfg.lora_targets, family)) if cfg.lora_rank else 0
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
        except runs.ConfigError as error:  # e.g. a hub id whose configs are not known offline: plan nothing, say so
            print(f"warning: no memory plan ({error})", flush=True)
            plan = None
        if plan is not None and not plan.fits():
            problem = (f"the memory plan needs {plan.peak:.1f} GiB per GPU of {gpu_gb:.0f} GiB (10% headroom kept): "
                       f"{advice}; see python train.py --plan with the same flags")
    problem = runs.broadcast_from_rank0(problem)
    if problem:
        raise runs.ConfigError(problem)


# ----------------------------------------------------------------------------------------------
# Which family a --model is, and the checks a loaded model gets before training


def frames_of(num_frames: int, model: str, family: str) -> int:
    """--num_frames, 0 resolved: the tiny video model's short default, else its family's (WanPipeline's 81)."""
    adapter = ADAPTERS[family]
    if num_frames:
        return num_frames
    return TINY_FRAMES if adapter.video and model in TINY_MODELS else adapter.default_frames


def step_distilled(model: str) -> bool:
    """A FLUX.2 [klein] checkpoint distilled to few steps (its pipeline config says is_distilled): its pipeline
    applies no CFG."""
    if model in TINY_MODELS or model in HUB_IDS:  # known offline
        return model in DISTILLED_HUB_IDS
    return bool(model_index(model).get("is_distilled"))


def model_family(model: str) -> str:
    if model in TINY_MODELS:
        return TINY_MODELS[model]
    if model in HUB_IDS:  # the presets' checkpoints: known offline
        return REAL_CONFIGS[HUB_IDS[model]]["family"]
    class_name = model_index(model)["_class_name"]
    if class_name not in PIPELINE_FAMILIES:
        raise runs.ConfigError(f"--model {model}: {class_name} is not supported; use {' or '.join(PIPELINE_FAMILIES)}")
    return PIPELINE_FAMILIES[class_name]


def model_index(model: str) -> dict:
    """The pipeline's model_index.json, from a directory or the hub (diffusers caches it)."""
    if os.path.isdir(model):
        where = Path(model) / "model_index.json"
        if not where.is_file():
            raise runs.ConfigError(f"--model {model}: no model_index.json there; pass a diffusers pipeline directory")
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
            raise runs.ConfigError(f"--model {model}: cannot read its model_index.json from the hub ({type(error).__name__})") from None
    else:
        raise runs.ConfigError(f"--model {model!r} is neither a directory, a hub id (org/name) nor one of {', '.join(TINY_MODELS)}")
    if not isinstance(index, dict) or "_class_name" not in index:
        raise runs.ConfigError(f"--model {model}: {where} is not a diffusers model_index.json (no '_class_name' in a JSON "
                          "object); re-save the pipeline with save_pretrained")
    return index


def check_sampling_grid(model: FlowAdapter, solver: str = "euler") -> None:
    """A scheduler configuration whose sigma grid is not finite (shift 0, say) would make every rollout NaN, which
    would read as a diverged run. Solver "scheduler" counts one model evaluation per timestep: a scheduler of
    order 2 (FlowMatchHeun) repeats timesteps, which would miscount the rollout cost."""
    if solver == "scheduler" and model.pipe.scheduler.order != 1:
        raise runs.ConfigError(f"--solver scheduler steps schedulers that evaluate the model once per step; this model's "
                               f"{type(model.pipe.scheduler).__name__} is of order {model.pipe.scheduler.order}: use "
                               "--solver heun (Heun's method on the pipeline's sigma grid)")
    grid = model.timesteps()
    if not torch.isfinite(grid).all():
        raise runs.ConfigError(f"{model.pipeline_class}'s scheduler gives a sigma grid that is not finite for --sampling_steps "
                          f"{model.sampling_steps} at --resolution {model.resolution}: {grid.tolist()}; check the "
                          "model's scheduler/scheduler_config.json (shift, shift_terminal) or use more steps")


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
        raise runs.ConfigError(f"--lora_targets: {', '.join(missing)} match no Linear layer of the "
                          f"{type(transformer).__name__}; its Linear layers end in {', '.join(short)}")


def frozen_base_velocity(model: FlowAdapter, frozen_copy, lora: bool):
    """The base model's velocity for the reference KL: under LoRA the trained transformer with its adapters
    switched off for the call (exactly the base; no second copy), under full fine-tuning the frozen copy's; None
    without one (full fine-tuning at ref_kl_coef 0: a copy only to log ref_kl would double the weights)."""
    if lora:
        def velocity(*args):
            model.transformer.disable_adapters()
            try:
                return model.velocity(*args)
            finally:
                model.transformer.enable_adapters()  # also makes the LoRA weights require grad again
        return velocity
    if frozen_copy is None:
        return None
    base = copy.copy(model)
    base.transformer = frozen_copy
    return base.velocity
