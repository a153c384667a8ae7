"""adapters.py: the contract between train.py and a diffusers pipeline family, and one class per family.

V-GRPO needs five things from a text-to-image (or text-to-video) flow model, and nothing else (FlowAdapter's docstring
is the contract): encode prompts, a velocity, the latent shape, the pipeline's own sigma grid, and decode. Each
diffusers pipeline family is one class here (SD3, Flux, QwenImage, Flux2, Wan); train.py never looks past the
contract. Loading a model behind its adapter is models.py's; building tiny and real-width ones offline, builders.py's.
"""

import copy

import numpy as np
import torch

import vgrpo
from failures import ConfigError

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

    @classmethod
    def check_video_settings(cls, num_frames: int, width: int, resolution: int, video_rewards: list[str]) -> None:
        """Frames, width and video rewards (those asked for) only where the model makes videos, and frames its VAE
        can code; checked before anything is loaded."""
        if cls.video:
            if num_frames and (num_frames - 1) % cls.frame_stride:
                raise ConfigError(f"--num_frames {num_frames}: {cls.pipeline_class} needs 1 + a multiple of "
                                  f"{cls.frame_stride} (e.g. 33 or 81); its pipeline would round it")
            return
        for name, value, bad in (("num_frames", num_frames, num_frames > 1),
                                 ("width", width, width not in (0, resolution))):
            if bad:
                raise ConfigError(f"--{name} {value}: {cls.pipeline_class} makes square images; --{name} is for video "
                                  "models (Wan)")
        if video_rewards:
            raise ConfigError(f"reward {', '.join(video_rewards)} scores videos; {cls.pipeline_class} makes images")

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
            raise ConfigError("Wan2.2-A14B's two experts (switched at a boundary timestep) are not supported; use "
                              "Wan2.1-T2V or Wan2.2-TI2V-5B (one transformer)")
        super().__init__(pipe, dtype, **settings)
        self.check_rotary_table()

    def check_rotary_table(self) -> None:
        """The transformer's rotary table holds rope_max_seq_len positions on each axis (latent frames, rows, columns
        of patches); a longer video failed deep inside its first forward ("shape '[33, 1, 1, -1]' is invalid")."""
        config, vae = self.transformer.config, self.pipe.vae.config
        frames, height, width = self.latent_shape()[1:]
        positions = [n // p for n, p in zip((frames, height, width), config.patch_size)]
        if max(positions) <= config.rope_max_seq_len:
            return
        longest = 1 + (config.rope_max_seq_len * config.patch_size[0] - 1) * vae.scale_factor_temporal
        raise ConfigError(f"--num_frames {self.num_frames} at {self.resolution} x {self.width} px is {positions[0]} "
                          f"latent frames of {positions[1]} x {positions[2]} patches; this {type(self.transformer).__name__} "
                          f"has rotary positions for at most {config.rope_max_seq_len} on each axis: at most "
                          f"{longest} frames, and fewer pixels")

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


def blocks_of(transformer, adapter: type) -> list[torch.nn.Module]:
    return [b for name in adapter.block_lists for b in getattr(transformer, name, [])]


def transformer_blocks(transformer) -> list[torch.nn.Module]:
    """The blocks of a transformer of any family (the FSDP2 units, the regions compiled)."""
    names = dict.fromkeys(name for adapter in ADAPTERS.values() for name in adapter.block_lists)
    return [b for name in names for b in getattr(transformer, name, [])]
