"""builders.py: pipelines built offline from configs, with the real diffusers / transformers classes.

No hub access and no downloaded weight: random (or briefly fitted) weights, tokenizers built in memory.
- tiny_pipeline: toy widths, fitted for half a minute to toy images (toy videos for Wan) so that RL has a small
  pretrained generator to improve; used by `python train.py` and most tests (tiny_wan_pipeline: the video one);
- reduced_pipeline: the REAL widths of SD3-Medium, SD3.5-Medium/Large, FLUX.1-dev/schnell, Qwen-Image and FLUX.2
  [klein] 4B, Wan2.1-T2V-1.3B / 14B and Wan2.2-TI2V-5B (hidden sizes, heads, dual attention, qk norm, rope axes,
  guidance embedding, text-encoder widths, VAE latent channels and scaling), with 1-2 transformer blocks and one
  text-encoder layer, so that CPU tests see the layouts, sizes and dtypes a GPU run sees;
- REAL_CONFIGS / HUB_IDS: the published architectures of the presets' checkpoints, which the memory plan and the
  model identification read offline.
"""

from functools import partial
from pathlib import Path

import torch

import rewards
from adapters import ADAPTERS
from failures import ConfigError

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
    random, or fitted to toy images (`fitted`, with a progress bar on a terminal if progress) when fit_steps > 0;
    QwenImagePipeline and Flux2KleinPipeline likewise (tiny_qwen_pipeline), WanPipeline (tiny_wan_pipeline)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextConfig, T5Config

    torch.manual_seed(seed)
    if family == "wan":
        pipe = tiny_wan_pipeline(seed)
        if fit_steps:
            fitted(pipe, family, seed=seed, steps=fit_steps, progress=progress)
        return pipe
    if family in ("qwenimage", "flux2"):
        pipe = tiny_qwen_pipeline(family)
        if fit_steps:
            fitted(pipe, family, seed=seed, steps=fit_steps, progress=progress)
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
        fitted(pipe, family, seed=seed, steps=fit_steps, progress=progress)
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
    from diffusers import (AutoencoderKLFlux2, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           Flux2Transformer2DModel, QwenImageTransformer2DModel)

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
# Toy data and the fit that makes a tiny model a small pretrained generator


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


# The fitted tiny bases that the README's run and bench.py start from, committed (this project made them) with their
# sha256: fit_tiny_pipeline sums in an order that depends on the thread count and the CPU (one seed fitted with 1 and
# with 2 threads started RL at a rollout reward of 0.5708 and of 0.5625), so with these files the base, and the first
# numbers a run prints, are the same on every machine. (family, seed, fit steps) -> sha256 of
# assets/tiny-{family}-seed{seed}-fit{steps}.safetensors, made by `python builders.py fit sd3 SEED` (2 threads).
FITTED = {("sd3", 0, 250): "5a8f9e5a5a8a8cf4fb7f589db5e8393347abcfb34a1f59f33148551a33f9257a",
          ("sd3", 1, 250): "ecca02de839e635e71ed0efc9628d3b887ad7cb70b398a36aebd626bdf68f399",
          ("sd3", 2, 250): "b7140ce32aa03164d7afb1305750586a289c3e147a82e2958e2b3767aaa1238a"}
ASSETS = Path(__file__).resolve().with_name("assets")
FITTED_PARTS = ("vae", "transformer")  # what the fit trains; the text encoders stay at their seeded initialisation


def fitted_file(family: str, seed: int, steps: int) -> Path:
    return ASSETS / f"tiny-{family}-seed{seed}-fit{steps}.safetensors"


def fitted(pipe, family: str, *, seed: int, steps: int, progress: bool = False) -> None:
    """The tiny pipeline fitted to the toy data in place: the committed weights of FITTED where it has them (checked
    against their sha256), else fit_tiny_pipeline."""
    import hashlib

    from safetensors.torch import load

    if (family, seed, steps) not in FITTED:
        fit_tiny_pipeline(pipe, ADAPTERS[family], steps=steps, seed=seed, progress=progress)
        return
    path = fitted_file(family, seed, steps)
    data = path.read_bytes() if path.is_file() else b""
    if hashlib.sha256(data).hexdigest() != FITTED[family, seed, steps]:
        raise ConfigError(f"{path} is missing or not the committed file (sha256 {FITTED[family, seed, steps]}): "
                          "restore it from the repository (git checkout -- assets)")
    state = load(data)
    for part in FITTED_PARTS:
        module = getattr(pipe, part)
        module.load_state_dict({k.removeprefix(f"{part}."): v for k, v in state.items() if k.startswith(f"{part}.")})
        module.eval().requires_grad_(False)


def save_fitted(family: str, seed: int, steps: int) -> tuple[Path, str]:
    """Fit a tiny pipeline as FITTED's files were made, save its fitted parts, return the file and its sha256."""
    import hashlib

    from safetensors.torch import save_file

    pipe = tiny_pipeline(family, seed=seed)
    fit_tiny_pipeline(pipe, ADAPTERS[family], steps=steps, seed=seed, progress=True)
    path = fitted_file(family, seed, steps)
    path.parent.mkdir(exist_ok=True)
    save_file({f"{part}.{k}": v.contiguous() for part in FITTED_PARTS
               for k, v in getattr(pipe, part).state_dict().items()}, path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


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
# REAL_CONFIGS


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


# ----------------------------------------------------------------------------------------------
# Real width, reduced depth: the published architectures with fewer blocks


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


if __name__ == "__main__":  # python builders.py fit FAMILY SEED [STEPS]: make a FITTED file, print its entry
    import sys

    if len(sys.argv) not in (4, 5) or sys.argv[1] != "fit":
        sys.exit("usage: python builders.py fit FAMILY SEED [STEPS (default 250)]")
    family, seed, steps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) == 5 else 250
    path, digest = save_fitted(family, seed, steps)
    print(f'{path}: FITTED[("{family}", {seed}, {steps})] = "{digest}"')
