"""rewards.py: the rewards V-GRPO trains on and evaluates with, behind one contract, computed in this process.

Contract, for every reward:

    reward(images, prompts, metadata=None) -> float32 tensor (B,), higher is better

images: float tensor (B, 3, H, W) in [0, 1] (the VAE output mapped from [-1, 1]); prompts: B
strings; metadata: B dicts (from a jsonl prompt file) or None. Scores are computed under no_grad,
models in eval mode on the device they were built for; the result is on images.device.

Videos (B, F, 3, H, W) from a video model (Wan): a reward that scores a video as a whole declares it by its
name in VIDEO_REWARDS and takes the videos (`motion`); every other reward stays an image reward and scores
each video through on_frames: every n-th frame as an image, the mean over them (n: FRAME_INTERVALS, 4 for
OCR as Flow-GRPO, else 1 as Flow-Factory; train.py's --frame_interval overrides it).

| name                   | score                                               | typical range      |
| ---------------------- | --------------------------------------------------- | ------------------ |
| color                  | 1 - |mean RGB - colour named in prompt| / sqrt(3)    | [0, 1]             |
| motion (videos)        | object's travel in the direction named in prompt,   | [-1, 1]            |
|                        | first to last frame, per frame size                 |                    |
| jpeg_compressibility   | -(JPEG size in kB at quality 95), as in DDPO        | about -100 .. -1   |
| jpeg_incompressibility | +(JPEG size in kB at quality 95)                    | about 1 .. 100     |
| pickscore              | logit_scale * cos(image, text), raw (some codebases | about 18 .. 24     |
|                        | divide by 26 to get about 0.7 .. 0.9)               |                    |
| clipscore              | cos(image, text), CLIP ViT-L/14 (the CLIPScore      | about 0.15 .. 0.40 |
|                        | paper reports 2.5 * max(cos, 0))                    |                    |
| hpsv21                 | cos(image, text), HPSv2.1 (open_clip ViT-H-14)      | about 0.20 .. 0.40 |
| aesthetic              | LAION improved aesthetic predictor on CLIP L/14     | 1 .. 10            |
| imagereward            | ImageReward v1.0 (BLIP + MLP, in transformers)      | about -2.5 .. 2.5  |
| ocr                    | 1 - normalised edit distance to the quoted text,    | [0, 1]             |
|                        | PP-OCRv4 (Flow-GRPO's rule)                         |                    |
| unifiedreward          | UnifiedReward-7b-v1.5 "Final Score: N" / 5, behind  | [0.2, 1]           |
|                        | an OpenAI-compatible chat server (SGLang, vLLM)     |                    |
| geneval, http          | HTTP clients of a local server (reward_bridge.py)   | server-defined     |

Model weights come from a hub id or a local directory via from_pretrained; the three checkpoints
that exist only as .pt/.pth files are read with torch.load(weights_only=True); nothing uses
trust_remote_code. Heavy imports happen inside the factories.

GenEval's rules (which detections count, the verdict, Flow-GRPO's partial credit) are pure functions here; its
detector and colour classifier run behind a server. reward_bridge.py holds the HTTP client and server:
`python rewards.py serve NAME --port P` serves any reward of this file, so heavy ones can run in another environment.
"""

import html
import inspect
import io
import math
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

Reward = Callable[..., torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Image helpers


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) floats in [0, 1] -> (B, H, W, 3) uint8, rounding like torchvision's to_pil_image."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: torch.Tensor) -> list:
    from PIL import Image

    return [Image.fromarray(a) for a in to_uint8(images)]


def processor_preprocess(images: torch.Tensor, image_processor: Any) -> torch.Tensor:
    """A CLIP image processor's own path, on the uint8 images a model card feeds it: (B, 3, H, W) in [0, 1] ->
    normalised pixels. (Resizing the floats instead moved PickScore by 0.019 on a logit scale of 100.)"""
    return image_processor(images=to_pil(images), return_tensors="pt").pixel_values


def normalised_pixels(pictures: list, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """PIL RGB images of one size -> (B, 3, H, W) floats: ToTensor's / 255, then (x - mean) / std per channel."""
    x = torch.stack([torch.from_numpy(np.asarray(p).copy()).permute(2, 0, 1).float() / 255 for p in pictures])
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def resize_longest_and_pad(images: torch.Tensor, image_processor: Any) -> torch.Tensor:
    """HPSv2's evaluation transform (its open_clip image_transform with resize_longest_max), in its order: the uint8
    image to floats (ToTensor), then ResizeMaxSize on the float tensor: the LONGEST side to the model's size (the
    other round()ed) with torchvision's tensor bicubic (align_corners False, antialias on, no clamp), padded with
    black to a square, the extra column / row going right and bottom; then normalised with the processor's mean and
    std. One deviation: open_clip neither resizes nor pads an image whose longest side already has the size, so a
    non-square one would not reach the model's square input; it is padded here."""
    size = image_processor.crop_size["height"]
    out = []
    for x in torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2).float() / 255:  # the 8-bit image, as ToTensor
        height, width = x.shape[1:]
        scale = size / float(max(height, width))
        if scale != 1.0:
            new_h, new_w = (round(dim * scale) for dim in (height, width))
            x = F.interpolate(x[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[0]
        pad_h, pad_w = size - x.shape[1], size - x.shape[2]
        out.append(F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0))
    mean, std = torch.tensor(image_processor.image_mean), torch.tensor(image_processor.image_std)
    return (torch.stack(out) - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)


# open_clip's tokenizer cleans text before BPE (basic_clean: ftfy.fix_text, html.unescape twice, strip; then
# whitespace collapsed and lower-cased); transformers' CLIP tokenizer only normalises NFC, whitespace and case. ftfy is
# not a dependency here, so the steps of ftfy.fix_text's default configuration that change prompts are written out
# (its mojibake repair, fix_encoding, is not: prompts with mis-decoded UTF-8 may still tokenise differently).
_QUOTES = str.maketrans({**dict.fromkeys("\u02bc\u2018\u2019\u201a\u201b", "'"),
                         **dict.fromkeys("\u201c\u201d\u201e\u201f", '"')})  # ftfy.uncurl_quotes
_LIGATURES = str.maketrans({"\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl",
                            "\ufb05": "\u017ft", "\ufb06": "st", "\u0132": "IJ", "\u0133": "ij", "\u0149": "\u02bcn",
                            "\u01f1": "DZ", "\u01f2": "Dz", "\u01f3": "dz", "\u01c4": "D\u017d", "\u01c5": "D\u017e",
                            "\u01c6": "d\u017e", "\u01c7": "LJ", "\u01c8": "Lj", "\u01c9": "lj", "\u01ca": "NJ",
                            "\u01cb": "Nj", "\u01cc": "nj"})  # ftfy.fix_latin_ligatures
_WIDTH = str.maketrans({**{i: unicodedata.normalize("NFKC", chr(i)) for i in range(0xFF01, 0xFFF0)
                           if len(unicodedata.normalize("NFKC", chr(i))) == 1}, 0x3000: " "})  # ftfy.fix_character_width


def openclip_clean(text: str) -> str:
    """The text open_clip's tokenizer encodes: ftfy's html unescaping (skipped when the text has '<'), ligatures,
    character widths, curly quotes and NFC, then open_clip's own html.unescape twice and whitespace collapse."""
    if "<" not in text:
        text = html.unescape(text)
    text = unicodedata.normalize("NFC", text.translate(_LIGATURES).translate(_WIDTH).translate(_QUOTES))
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def resolve_file(spec: str) -> str:
    """A local file, or 'hub_repo_id:filename' fetched (and cached) with huggingface_hub."""
    if os.path.isfile(spec):
        return spec
    repo, sep, filename = spec.partition(":")
    if not sep or not filename:
        raise FileNotFoundError(f"{spec!r} is neither a local file nor 'hub_repo_id:filename'")
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo, filename)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


# ----------------------------------------------------------------------------------------------
# Verifiable rewards: no model, no download

COLORS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0),
          "cyan": (0.0, 1.0, 1.0), "magenta": (1.0, 0.0, 1.0), "white": (1.0, 1.0, 1.0), "black": (0.0, 0.0, 0.0)}


def word_asked_for(prompt: str, metadata: dict | None, key: str, words, reward: str, noun: str) -> str:
    """metadata[key] if given, else the first of `words` in the prompt (whole words, any case), lower-cased; a
    ValueError naming `reward` and `noun` when there is none or it is not one of them."""
    name = (metadata or {}).get(key)
    if name is None:
        match = re.search(r"\b(" + "|".join(words) + r")\b", prompt, re.IGNORECASE)
        if match is None:
            raise ValueError(f"the {reward} reward needs a {noun} word ({', '.join(words)}) in the prompt or "
                             f"metadata['{key}']; got prompt {prompt!r}")
        name = match.group(1)
    if name.lower() not in words:
        raise ValueError(f"unknown {noun} {name!r}; choose from {', '.join(words)}")
    return name.lower()


def prompt_color(prompt: str, metadata: dict | None = None) -> str:
    """The target colour: metadata["color"] if given, else the first colour word of the prompt."""
    return word_asked_for(prompt, metadata, "color", COLORS, "color", "colour")


def color(*, device: str = "cpu") -> Reward:
    """Text-conditioned and verifiable: how close the mean colour of the image is to the colour the
    prompt names, 1 - |mean RGB - target| / sqrt(3), in [0, 1]. (device: unused, no model.)"""

    def reward(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        metadata = metadata or [None] * len(prompts)
        target = torch.tensor([COLORS[prompt_color(p, m)] for p, m in zip(prompts, metadata)], device=images.device)
        return 1 - (images.float().mean(dim=(2, 3)) - target).norm(dim=1) / math.sqrt(3)

    return reward


DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (x, y), y pointing down the image


def prompt_direction(prompt: str, metadata: dict | None = None) -> str:
    """The direction of motion asked for: metadata["direction"] if given, else the first direction word of the prompt."""
    return word_asked_for(prompt, metadata, "direction", DIRECTIONS, "motion", "direction")


def object_centres(videos: torch.Tensor) -> torch.Tensor:
    """videos (B, F, 3, H, W) -> (B, F, 2): each frame's centroid (x, y) in pixels of what is not background, each
    pixel weighted by its colour distance from the background (the video's per-channel median over all its pixels
    and frames: the most common colour where the object covers under half the frame). A frame of background alone
    has its centre."""
    videos = videos.float()
    background = videos.transpose(1, 2).flatten(2).median(dim=2).values  # (B, 3)
    weight = (videos - background[:, None, :, None, None]).norm(dim=2)  # (B, F, H, W)
    H, W = weight.shape[-2:]
    y, x = torch.arange(H, device=videos.device).float(), torch.arange(W, device=videos.device).float()
    total = weight.sum(dim=(2, 3))
    centre_x = torch.where(total > 0, (weight.sum(2) * x).sum(2) / total.clamp_min(1e-12), (W - 1) / 2)
    centre_y = torch.where(total > 0, (weight.sum(3) * y).sum(2) / total.clamp_min(1e-12), (H - 1) / 2)
    return torch.stack([centre_x, centre_y], dim=-1)


def motion(*, device: str = "cpu") -> Reward:
    """Temporal, text-conditioned and verifiable; scores videos (B, F, 3, H, W): how far the object (object_centres)
    travels from the first frame to the last in the direction the prompt names, as a fraction of the frame's size
    along it: in [-1, 1]; 0.375 for builders.toy_videos (12 px on 32), 0 for a still video. (device: unused, no
    model.)"""

    def reward(videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        metadata = metadata or [None] * len(prompts)
        way = torch.tensor([DIRECTIONS[prompt_direction(p, m)] for p, m in zip(prompts, metadata)],
                           device=videos.device, dtype=torch.float32)
        centres = object_centres(videos)
        size = torch.tensor([videos.shape[-1], videos.shape[-2]], device=videos.device, dtype=torch.float32)
        return ((centres[:, -1] - centres[:, 0]) / size * way).sum(dim=1)

    return reward


# Rewards that score a video as a whole (videos (B, F, 3, H, W)); every other reward scores images, and a video
# frame by frame (on_frames).
VIDEO_REWARDS = {"motion"}
# Frames a video is scored on by an image reward: every FRAME_INTERVAL-th, from the first. OCR every 4th as Flow-GRPO's
# video OCR scorer (flow_grpo/ocr.py, OcrScorer_video_or_image: frame_interval 4); the others every frame as
# Flow-Factory's video PickScore (rewards/pick_score.py: the mean over all frames).
FRAME_INTERVALS = {"ocr": 4}
FRAMES_PER_CALL = 64  # frames scored per call of an image reward: a 480p x 81-frame batch at once would not fit


def on_frames(reward: Reward, every: int = 1) -> Reward:
    """An image reward as a video reward: frames 0, every, 2 * every, ... of each video (B, F, 3, H, W) scored as
    images with their video's prompt and metadata, averaged per video -> (B,)."""

    def video_reward(videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        frames = videos[:, ::every]
        n = frames.shape[1]
        images, texts = frames.flatten(0, 1), [p for p in prompts for _ in range(n)]
        extra = None if metadata is None else [m for m in metadata for _ in range(n)]
        scores = [reward(images[i:i + FRAMES_PER_CALL], texts[i:i + FRAMES_PER_CALL],
                         None if extra is None else extra[i:i + FRAMES_PER_CALL])
                  for i in range(0, len(images), FRAMES_PER_CALL)]
        return torch.cat(scores).float().view(len(videos), n).mean(dim=1)

    return video_reward


def for_samples(name: str, reward: Reward, *, video: bool, frame_interval: int = 0) -> Reward:
    """The reward `name` as it scores the samples of a model: as it is for images, and for videos a VIDEO_REWARDS
    entry as it is, any other on_frames (every frame_interval-th frame; 0: FRAME_INTERVALS' or every frame)."""
    if not video or name in VIDEO_REWARDS:
        return reward
    return on_frames(reward, frame_interval or FRAME_INTERVALS.get(name, 1))


def jpeg_size_kb(images: torch.Tensor, *, quality: int = 95) -> torch.Tensor:
    """Size in kB (1000 bytes) of each image encoded as JPEG, (B,) float32 on images.device."""
    sizes = []
    for image in to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32, device=images.device)


def jpeg_compressibility(*, device: str = "cpu", quality: int = 95) -> Reward:
    """DDPO's compressibility: minus the JPEG size in kB. (device: unused, no model.)"""
    return lambda images, prompts, metadata=None: -jpeg_size_kb(images, quality=quality)


def jpeg_incompressibility(*, device: str = "cpu", quality: int = 95) -> Reward:
    """DDPO's incompressibility: the JPEG size in kB. (device: unused, no model.)"""
    return lambda images, prompts, metadata=None: jpeg_size_kb(images, quality=quality)


# ----------------------------------------------------------------------------------------------
# CLIP-family rewards (transformers CLIPModel)


class ClipScorer:
    """scale * cos(image, text) with a transformers CLIPModel; scale = exp(logit_scale) or 1."""

    def __init__(self, model: nn.Module, processor: Any, *, use_logit_scale: bool, device: str, dtype: torch.dtype,
                 preprocess: Callable = processor_preprocess, clean: Callable[[str], str] = str):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.processor, self.use_logit_scale, self.device, self.dtype = processor, use_logit_scale, device, dtype
        self.preprocess = preprocess  # (images, image_processor) -> normalised pixels
        self.clean = clean  # text -> the text the original model's tokenizer would encode
        self.max_length = model.config.text_config.max_position_embeddings

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [0, 1] -> unit-norm projected embeddings (B, D), float32."""
        pixels = self.preprocess(images, self.processor.image_processor).to(self.device, self.dtype)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return F.normalize(self.model.visual_projection(pooled).float(), dim=-1)

    @torch.no_grad()
    def embed_texts(self, prompts: Sequence[str]) -> torch.Tensor:
        tokens = self.processor.tokenizer([self.clean(p) for p in prompts], padding=True, truncation=True, max_length=self.max_length,
                                          return_tensors="pt").to(self.device)
        pooled = self.model.text_model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).pooler_output
        return F.normalize(self.model.text_projection(pooled).float(), dim=-1)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        cos = (self.embed_images(images) * self.embed_texts(prompts)).sum(dim=-1)
        scale = self.model.logit_scale.exp().float() if self.use_logit_scale else 1.0
        return (scale * cos).to(images.device)


def pickscore(*, device: str = "cpu", dtype: str | torch.dtype = "float32", model: str = "yuvalkirstain/PickScore_v1",
              processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K") -> Reward:
    """PickScore: exp(logit_scale) * cos, raw (about 18 .. 24)."""
    from transformers import AutoProcessor, CLIPModel

    return ClipScorer(CLIPModel.from_pretrained(model), AutoProcessor.from_pretrained(processor),
                      use_logit_scale=True, device=device, dtype=_dtype(dtype))


def clipscore(*, device: str = "cpu", dtype: str | torch.dtype = "float32",
              model: str = "openai/clip-vit-large-patch14", processor: str | None = None) -> Reward:
    """CLIPScore as cos(image, text) with CLIP ViT-L/14."""
    from transformers import AutoProcessor, CLIPModel

    return ClipScorer(CLIPModel.from_pretrained(model), AutoProcessor.from_pretrained(processor or model),
                      use_logit_scale=False, device=device, dtype=_dtype(dtype))


def hpsv21(*, device: str = "cpu", dtype: str | torch.dtype = "float32",
           checkpoint: str = "xswu/HPSv2:HPS_v2.1_compressed.pt",
           processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", vision_heads: int = 16, text_heads: int = 16) -> Reward:
    """HPSv2.1: cos(image, text) of the HPS_v2.1 open_clip ViT-H-14, run as a transformers CLIPModel
    (no open_clip / torchvision needed). Images get HPSv2's own transform (resize_longest_and_pad: longest side
    to 224, black padding, no crop); the processor supplies the CLIP BPE tokenizer, the size and mean / std."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(processor)
    state = torch.load(resolve_file(checkpoint), map_location="cpu", weights_only=True)
    model = openclip_to_transformers(state.get("state_dict", state), vision_heads=vision_heads, text_heads=text_heads,
                                     bos_token_id=proc.tokenizer.bos_token_id, eos_token_id=proc.tokenizer.eos_token_id)
    return ClipScorer(model, proc, use_logit_scale=False, device=device, dtype=_dtype(dtype), preprocess=resize_longest_and_pad,
                      clean=openclip_clean)


_BLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")
_BLOCK_PARTS = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
                "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_NAMES = {
    "logit_scale": "logit_scale",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",  # sic, transformers' name
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
}


def convert_openclip_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip CLIP key names -> transformers CLIPModel key names. Fused qkv projections are split,
    the (in, out) projection matrices transposed into Linear weights; unknown keys are kept as they
    are so that loading reports them."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("module.")  # checkpoints saved from DistributedDataParallel
        if key.endswith("attn_mask"):  # a causal-mask buffer in older open_clip, not a weight
            continue
        block = _BLOCK.match(key)
        if key in ("visual.proj", "text_projection"):
            out[{"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}[key]] = value.T
        elif key in _NAMES:
            out[_NAMES[key]] = value
        elif block:
            tower, i, rest = "vision_model" if block.group(1) else "text_model", block.group(2), block.group(3)
            prefix = f"{tower}.encoder.layers.{i}."
            if rest.startswith("attn.in_proj_"):
                kind = rest.removeprefix("attn.in_proj_")  # weight or bias, (3 * width, ...)
                for name, part in zip("qkv", value.chunk(3, dim=0)):
                    out[f"{prefix}self_attn.{name}_proj.{kind}"] = part
            else:
                module, _, param = rest.rpartition(".")
                out[prefix + f"{_BLOCK_PARTS.get(module, module)}.{param}"] = value
        else:
            out[key] = value
    return out


def openclip_to_transformers(state: dict[str, torch.Tensor], *, vision_heads: int, text_heads: int,
                             bos_token_id: int = 49406, eos_token_id: int = 49407) -> nn.Module:
    """Build a transformers CLIPModel from an open_clip CLIP state dict; sizes are read off the
    weights, head counts (not visible in the shapes) are arguments. Fails on any missing or
    unexpected key."""
    from transformers import CLIPConfig, CLIPModel

    sd = convert_openclip_state_dict(state)

    def layers(tower: str) -> int:
        return 1 + max(int(k.split(".")[3]) for k in sd if k.startswith(f"{tower}.encoder.layers."))

    patch = sd["vision_model.embeddings.patch_embedding.weight"]
    grid = math.isqrt(sd["vision_model.embeddings.position_embedding.weight"].shape[0] - 1)
    text_pos = sd["text_model.embeddings.position_embedding.weight"]
    config = CLIPConfig(
        text_config=dict(vocab_size=sd["text_model.embeddings.token_embedding.weight"].shape[0],
                         hidden_size=text_pos.shape[1], max_position_embeddings=text_pos.shape[0],
                         intermediate_size=sd["text_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
                         num_hidden_layers=layers("text_model"), num_attention_heads=text_heads, hidden_act="gelu",
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id),
        vision_config=dict(hidden_size=patch.shape[0], patch_size=patch.shape[-1], image_size=grid * patch.shape[-1],
                           intermediate_size=sd["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
                           num_hidden_layers=layers("vision_model"), num_attention_heads=vision_heads, hidden_act="gelu"),
        projection_dim=sd["text_projection.weight"].shape[0],
    )
    model = CLIPModel(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"open_clip checkpoint does not match a CLIP model: missing {missing}, unexpected {unexpected}")
    return model


class MLPHead(nn.Module):
    """The linear MLP head of the LAION improved aesthetic predictor and of ImageReward (same layers, same key
    names as in their checkpoints; no activations, as published)."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.layers(embedding).squeeze(-1)


def aesthetic(*, device: str = "cpu", dtype: str | torch.dtype = "float32", clip: str = "openai/clip-vit-large-patch14",
              head: str = "camenduru/improved-aesthetic-predictor:sac+logos+ava1-l14-linearMSE.pth") -> Reward:
    """LAION aesthetic score (1 .. 10): the MLP head on the unit-norm CLIP ViT-L/14 image embedding."""
    from transformers import AutoProcessor, CLIPModel

    scorer = ClipScorer(CLIPModel.from_pretrained(clip), AutoProcessor.from_pretrained(clip),
                        use_logit_scale=False, device=device, dtype=_dtype(dtype))
    mlp = MLPHead(scorer.model.config.projection_dim)
    path = resolve_file(head)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        mlp.load_state_dict(load_file(path))
    else:
        mlp.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    mlp = mlp.to(device).eval().requires_grad_(False)

    @torch.no_grad()
    def reward(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        return mlp(scorer.embed_images(images)).to(images.device)

    return reward


# ImageReward v1.0 (THUDM/ImageReward: ImageReward.py, models/BLIP/{blip,blip_pretrain,vit,med}.py) run in transformers'
# BLIP classes, so that neither its package nor torchvision / timm is needed. Its score of (prompt, image):
#   ids   = BertTokenizer('bert-base-uncased' + [DEC], [ENC]) of the prompt, padded / truncated to 35 tokens
#   image = Resize(224, bicubic) of the shorter side, CenterCrop(224), ToTensor, Normalize(CLIP mean, std)
#   h     = BLIP BERT(ids, cross-attending to every token of the ViT-L/16 output)[:, 0]   ([CLS] feature)
#   score = (MLP(h) - 0.16717362830052426) / 1.0333394966054072
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072
IMAGEREWARD_MAX_TOKENS = 35
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def resize_shorter_and_center_crop(images: torch.Tensor, size: int, mean: Sequence[float] = CLIP_MEAN,
                                   std: Sequence[float] = CLIP_STD) -> torch.Tensor:
    """torchvision's Resize(size, BICUBIC) + CenterCrop(size) + ToTensor + Normalize on the uint8 PIL image, as
    ImageReward's _transform: the SHORTER side to `size` (the longer one int()-truncated; no resize when the shorter side
    already has the size), PIL bicubic, then a crop at offsets round((dim - size) / 2) (Python's round, half to even).
    (B, 3, H, W) in [0, 1] -> (B, 3, size, size) normalised. (CLIP processors crop at (dim - size) // 2 instead.)"""
    from PIL import Image

    pictures = []
    for image in to_pil(images):
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        if short != size:
            new_long = int(size * long / short)  # torchvision's _compute_resized_output_size, to the float
            image = image.resize((size, new_long) if w <= h else (new_long, size), Image.BICUBIC)
        w, h = image.size
        left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
        pictures.append(image.crop((left, top, left + size, top + size)))
    return normalised_pixels(pictures, mean, std)


class ImageRewardModel(nn.Module):
    """ImageReward's scoring path in transformers modules: BLIP's ViT (BlipVisionModel), its BERT with
    cross-attention (BlipTextModel, no pooler) and the MLP head; returns the normalised score (B,), float32."""

    def __init__(self, vision_config: Any, text_config: Any):
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        self.vision_model = BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.mlp = MLPHead(text_config.hidden_size)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        image = self.vision_model(pixel_values=pixels).last_hidden_state  # (B, 1 + patches, vision width)
        text = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                                 encoder_attention_mask=torch.ones(image.shape[:2], dtype=torch.long, device=image.device))
        head_dtype = self.mlp.layers[0].weight.dtype
        return (self.mlp(text.last_hidden_state[:, 0].to(head_dtype)).float() - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


_VIT_BLOCK = re.compile(r"^blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)$")
_VIT_PARTS = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv", "attn.proj": "self_attn.projection",
              "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_VIT_NAMES = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
              "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
              "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
              "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
# In the checkpoint but not on the scoring path: BLIP's contrastive projections (ImageReward.score never calls them)
# and the BERT position-id buffer (transformers rebuilds it).
_IMAGEREWARD_UNUSED = re.compile(r"^blip\.(vision_proj|text_proj)\.(weight|bias)$|^blip\.text_encoder\.embeddings\.position_ids$")


def convert_imagereward_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward.pt key names -> ImageRewardModel key names. The BERT keys are the same in BLIP's med.py and
    transformers' BlipTextModel; the ViT ones are renamed; unknown keys are kept so that loading reports them."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if _IMAGEREWARD_UNUSED.match(key):
            continue
        if key.startswith("blip.visual_encoder."):
            name = key.removeprefix("blip.visual_encoder.")
            block = _VIT_BLOCK.match(name)
            if block:
                name = f"encoder.layers.{block.group(1)}.{_VIT_PARTS[block.group(2)]}.{block.group(3)}"
            out["vision_model." + _VIT_NAMES.get(name, name)] = value
        elif key.startswith("blip.text_encoder."):
            out[key.removeprefix("blip.")] = value
        else:
            out[key] = value  # mlp.layers.* as they are
    return out


def imagereward_from_state_dict(state: dict[str, torch.Tensor], *, vision_heads: int = 16,
                                text_heads: int = 12) -> ImageRewardModel:
    """Build an ImageRewardModel from an ImageReward checkpoint; sizes are read off the weights, head counts (not
    visible in the shapes) are arguments. Fails on any missing or unexpected key."""
    from transformers import BlipTextConfig, BlipVisionConfig

    sd = convert_imagereward_state_dict(state)
    required = ("vision_model.embeddings.patch_embedding.weight", "vision_model.embeddings.position_embedding",
                "text_encoder.embeddings.word_embeddings.weight", "text_encoder.embeddings.position_embeddings.weight")
    if any(k not in sd for k in required):
        raise ValueError(f"not an ImageReward checkpoint: it lacks {[k for k in required if k not in sd]} "
                         f"(after conversion); its keys start {sorted(state)[:5]}")

    def layers(prefix: str) -> int:
        return 1 + max(int(k.removeprefix(prefix).split(".")[0]) for k in sd if k.startswith(prefix))

    patch = sd["vision_model.embeddings.patch_embedding.weight"]
    grid = math.isqrt(sd["vision_model.embeddings.position_embedding"].shape[1] - 1)
    words = sd["text_encoder.embeddings.word_embeddings.weight"]
    positions = sd["text_encoder.embeddings.position_embeddings.weight"]
    vision = BlipVisionConfig(hidden_size=patch.shape[0], patch_size=patch.shape[-1], image_size=grid * patch.shape[-1],
                              intermediate_size=sd["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
                              num_hidden_layers=layers("vision_model.encoder.layers."), num_attention_heads=vision_heads,
                              hidden_act="gelu", layer_norm_eps=1e-6)  # vit.py: nn.LayerNorm(eps=1e-6), nn.GELU()
    text = BlipTextConfig(vocab_size=words.shape[0], hidden_size=words.shape[1], max_position_embeddings=positions.shape[0],
                          intermediate_size=sd["text_encoder.encoder.layer.0.intermediate.dense.weight"].shape[0],
                          num_hidden_layers=layers("text_encoder.encoder.layer."), num_attention_heads=text_heads,
                          encoder_hidden_size=patch.shape[0], hidden_act="gelu", layer_norm_eps=1e-12,
                          is_decoder=True)  # is_decoder builds the cross-attention; forward runs bidirectional
    model = ImageRewardModel(vision, text)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match ImageReward's architecture: missing {missing}, unexpected {unexpected}")
    return model.eval()


def imagereward_tokenizer(name: str) -> Any:
    """BLIP's init_tokenizer: BERT's uncased WordPiece plus [DEC] (bos) and [ENC] (vocabulary 30524, as the checkpoint)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(name)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def imagereward(*, device: str = "cpu", dtype: str | torch.dtype = "float32",
                checkpoint: str = "THUDM/ImageReward:ImageReward.pt", tokenizer: str = "bert-base-uncased",
                vision_heads: int = 16, text_heads: int = 12) -> Reward:
    """ImageReward v1.0 (about -2.5 .. 2.5): the official checkpoint read with weights_only=True into transformers'
    BLIP classes; the image-reward package (and its torchvision / timm) is not needed. The MLP head stays float32."""
    state = torch.load(resolve_file(checkpoint), map_location="cpu", weights_only=True)
    model = imagereward_from_state_dict(state.get("state_dict", state), vision_heads=vision_heads, text_heads=text_heads)
    model = model.to(device).requires_grad_(False)
    for tower in (model.vision_model, model.text_encoder):  # the head stays float32, as ImageReward runs it (.float())
        tower.to(_dtype(dtype))
    tok = imagereward_tokenizer(tokenizer)
    size = model.vision_model.config.image_size

    @torch.no_grad()
    def reward(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        ids = tok(list(prompts), padding="max_length", truncation=True, max_length=IMAGEREWARD_MAX_TOKENS,
                  return_tensors="pt").to(device)
        pixels = resize_shorter_and_center_crop(images, size).to(device, _dtype(dtype))
        return model(pixels, ids.input_ids, ids.attention_mask).to(images.device)

    return reward


# ----------------------------------------------------------------------------------------------
# OCR: does the image show the text the prompt quotes? (Flow-GRPO's OCR reward, read with PP-OCRv4)


def ocr_target(prompt: str, metadata: dict | None = None) -> str:
    """The text the image must show: metadata["text"] if given, else what stands between the prompt's first two
    double quotes (Flow-GRPO: prompt.split('"')[1])."""
    text = (metadata or {}).get("text")
    if text is None:
        parts = prompt.split('"')
        if len(parts) < 3:
            raise ValueError(f'the ocr reward reads the text to write between double quotes in the prompt (or '
                             f'metadata["text"]); got prompt {prompt[:200]!r}')
        text = parts[1]
    if not isinstance(text, str) or not text.replace(" ", ""):
        raise ValueError(f"the ocr reward needs a non-empty text to write; got {text!r} from prompt {prompt[:200]!r}")
    return text


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each), two-row dynamic programme."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_accuracy(recognized: str, target: str) -> float:
    """Flow-GRPO's OCR reward (flow_grpo/ocr.py), in [0, 1]: both texts lower-cased with their spaces removed; the
    distance d is 0 if the target occurs anywhere in the recognised text, else their Levenshtein distance, clipped to
    the target's length (unrelated extra text costs at most that); reward 1 - d / len(target)."""
    recognized, target = recognized.replace(" ", "").lower(), target.replace(" ", "").lower()
    distance = 0 if target in recognized else min(levenshtein(recognized, target), len(target))
    return 1 - distance / len(target)


def ocr(*, device: str = "cpu", engine: str = "rapidocr", threads: int = 0, min_confidence: float = 0.5) -> Reward:
    """OCR accuracy of the quoted text (ocr_accuracy) with PP-OCRv4 detection and recognition, no angle classifier, as
    Flow-GRPO reads. engine "rapidocr" (default): the ONNX models inside the rapidocr_onnxruntime wheel, run by
    onnxruntime on the CPU (nothing downloaded; no torchvision, no paddle; threads: onnxruntime threads per image, 0 =
    its default; about 0.2-0.4 s per 512 px image on one core); lines read with confidence < min_confidence are
    dropped (0.5, PaddleOCR's own drop score). engine "paddleocr": PaddleOCR 2.x itself, as Flow-GRPO builds it (on
    the GPU when device is cuda), if paddleocr and paddlepaddle are installed. The lines are joined in reading order."""
    if engine not in ("rapidocr", "paddleocr"):
        raise ValueError(f"ocr engine {engine!r} is not rapidocr or paddleocr")
    read = _rapidocr(threads, min_confidence) if engine == "rapidocr" else _paddleocr(device)

    def reward(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        targets = [ocr_target(p, m) for p, m in zip(prompts, metadata or [None] * len(prompts))]
        scores = [ocr_accuracy(read(image), target) for image, target in zip(to_uint8(images), targets)]
        return torch.tensor(scores, dtype=torch.float32, device=images.device)

    return reward


def _rapidocr(threads: int, min_confidence: float) -> Callable[[np.ndarray], str]:
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise ImportError("the ocr reward needs rapidocr_onnxruntime: pip install rapidocr_onnxruntime") from None
    engine = RapidOCR(text_score=min_confidence, **({"intra_op_num_threads": threads} if threads else {}))

    def read(image: np.ndarray) -> str:
        # The array goes in as is: RapidOCR and PaddleOCR take (H, W, 3) uint8; Flow-GRPO passes RGB too.
        lines, _ = engine(image, use_cls=False)
        return "".join(text for _, text, _ in lines or [])

    return read


def _paddleocr(device: str) -> Callable[[np.ndarray], str]:
    try:
        from paddleocr import PaddleOCR
    except ImportError:
        raise ImportError("ocr engine paddleocr needs pip install paddleocr paddlepaddle (or use the default engine, "
                          "rapidocr)") from None
    engine = PaddleOCR(use_angle_cls=False, lang="en", use_gpu=str(device).startswith("cuda"), show_log=False)

    def read(image: np.ndarray) -> str:
        result = engine.ocr(image, cls=False)  # [[[box, (text, confidence)], ...]] per image, [None] if nothing
        return "".join(text for _, (text, confidence) in (result[0] or []) if confidence > 0)

    return read


# ----------------------------------------------------------------------------------------------
# GenEval (Ghosh et al., 2023): its rules as pure functions of detections. The detector (Mask2Former, mmdet 2.x) and
# the colour classifier (CLIP ViT-L/14) run behind `python rewards.py serve geneval` (GenEvalScorer); train.py and
# evaluate.py reach them through the `geneval` HTTP client.

GENEVAL_CLASSES = (  # COCO's 80 classes as GenEval names them (evaluation/object_names.txt), in detector order
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant",
    "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
    "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
    "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
    "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster",
    "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush")
GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
GENEVAL_POSITIONS = ("left of", "right of", "above", "below")
GENEVAL_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
GENEVAL_TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# evaluate_images.py's defaults: detector confidence (0.9 for counting prompts), objects kept per class, the IoU
# above which a less confident box of the same class is dropped (1: none is), and the margin of position checks as a
# fraction of the two objects' summed sizes.
GENEVAL_SETTINGS = dict(threshold=0.3, counting_threshold=0.9, max_objects=16, max_overlap=1.0, position_threshold=0.1)


@dataclass
class Detection:
    """One detected object: box (x1, y1, x2, y2) in pixels, detector confidence, optional (H, W) bool mask, and the
    colour the classifier gave its crop (filled in only where a prompt asks for a colour)."""

    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = None
    color: str | None = None


def geneval_iou(a, b) -> float:
    """evaluate_images.compute_iou: boxes as inclusive pixel ranges (+1 on each side length)."""
    area = lambda box: max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)  # noqa: E731
    inter = area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = area(a) + area(b) - inter
    return inter / union if union else 0


def geneval_keep(raw: dict[str, list[Detection]], tag: str, *, threshold: float = 0.3, counting_threshold: float = 0.9,
                 max_objects: int = 16, max_overlap: float = 1.0) -> dict[str, list[Detection]]:
    """evaluate_image's filtering of one image's detections, class by class: confidence strictly above the
    threshold (counting_threshold for a counting prompt), most confident first, at most max_objects, then greedy
    suppression of boxes overlapping a kept one by IoU >= max_overlap (none at the default 1). Classes with nothing
    left are absent."""
    limit = counting_threshold if tag == "counting" else threshold
    kept = {}
    for name, found in raw.items():
        # In float32, as GenEval compares mmdet's float32 scores with its Python threshold: a score of exactly
        # float32(0.3) is 0.30000001 as a double and passed "> 0.3" here where GenEval drops it.
        scores = np.array([d.score for d in found], dtype=np.float32)
        order = np.argsort(scores)[::-1]  # as GenEval sorts, ties included
        order = [i for i in order if scores[i] > np.float32(limit)][:max_objects]
        chosen = []
        while order:
            best = order.pop(0)
            chosen.append(found[best])
            order = [i for i in order if max_overlap == 1 or geneval_iou(found[best].box, found[i].box) < max_overlap]
        if chosen:
            kept[name] = chosen
    return kept


def geneval_relations(a: Detection, b: Detection, *, position_threshold: float = 0.1) -> set[str]:
    """evaluate_images.relative_position: where a is relative to b. The centre offset shrunk towards 0 by
    position_threshold x the two sizes on each axis; no relation if both shrunk offsets are < 1e-3; else the shrunk
    offset over the length of the raw one, each axis beyond 0.5 naming a relation (y grows downwards)."""
    boxes = np.array([a.box, b.box], dtype=float)[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    size_a, size_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    shrunk = np.maximum(np.abs(offset) - position_threshold * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    return {name for name, on in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5),
                                  ("below", dy > 0.5)) if on}


def geneval_correct(objects: dict[str, list[Detection]], metadata: dict, *, position_threshold: float = 0.1
                    ) -> tuple[bool, str]:
    """GenEval's verdict on one image (evaluate_images.evaluate), the number its benchmark reports. objects: the
    kept detections per class, most confident first (geneval_keep, colours filled in). Every "include" clause must
    hold: at least `count` objects of its class; the first `count` of them of its colour; each of them in its
    position relative to every object matched by the clause it names (checked only if the clause is still met).
    Any "exclude" clause fails the image when its class has `count` or more objects. Returns (correct, reasons)."""
    correct, reasons, matched = True, [], []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        found = objects.get(name, [])[:count]
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in req:
                hits = sum(d.color == req["color"] for d in found)
                if hits < count:
                    ok = False
                    reasons.append(f"expected {req['color']} {name}>={count}, found {hits} {req['color']}")
            if "position" in req and ok:
                relation, target = req["position"]
                if matched[target] is None:
                    ok = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    for obj in found:
                        for other in matched[target]:
                            seen = geneval_relations(obj, other, position_threshold=position_threshold)
                            if relation not in seen:
                                ok = False
                                reasons.append(f"expected {name} {relation} target, found {' and '.join(seen)} target")
                                break
                        if not ok:
                            break
        correct &= ok
        matched.append(found if ok else None)
    for req in metadata.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {len(objects[req['class']])}")
    return correct, "; ".join(reasons)


def geneval_partial(objects: dict[str, list[Detection]], metadata: dict, *, position_threshold: float = 0.1) -> float:
    """Flow-GRPO's training reward for GenEval prompts (its reward server's evaluate_reward), written out with its
    quirks: the mean of one term per include clause, 1 - |count - found| / count over ALL kept objects of the class
    (negative once found > 2 x count), then, when found == count, the colour term 1 - |count - right colour| / count
    and for a position clause 0 for each failing pair plus 1 once checked (a failed check thus adds 0 and 1); when
    found != count a colour or position clause adds a 0. Exclude clauses are not used. 0 without include clauses."""
    terms, matched = [], []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        found = objects.get(name, [])
        terms.append(1 - abs(count - len(found)) / count)
        ok = len(found) == count
        if not ok:
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                hits = sum(d.color == req["color"] for d in found)
                terms.append(1 - abs(count - hits) / count)
                ok = hits == count
            if "position" in req and ok:
                relation, target = req["position"]
                if matched[target] is None:
                    ok = False
                    terms.append(0.0)
                else:
                    for obj in found:
                        for other in matched[target]:
                            if relation not in geneval_relations(obj, other, position_threshold=position_threshold):
                                ok = False
                                terms.append(0.0)
                                break
                        if not ok:
                            break
                    terms.append(1.0)
        matched.append(found if ok else None)
    return sum(terms) / len(terms) if terms else 0.0


def check_geneval_metadata(prompt: str, metadata: dict | None) -> None:
    """The shapes GenEval's metadata lines take, and nothing else (a ValueError naming the field): a JSON object with
    a 'tag' of GENEVAL_TASKS and a non-empty 'include' list, an optional 'exclude' list; include clauses
    {class, count[, color][, position]}, exclude clauses {class, count}; a known class, an integer count >= 1, a known
    colour, a position [relation, index of an earlier include clause]. The rules index and iterate these fields
    blindly: a 5 where the object goes raised AttributeError (a 500 from the server), a dict where a list goes was
    iterated by its keys."""
    def refuse(field: str, problem: str) -> None:
        raise ValueError(f"prompt {prompt[:200]!r}: GenEval metadata {field} {problem}")

    if not isinstance(metadata, dict) or metadata.get("tag") not in GENEVAL_TASKS or "include" not in metadata:
        found = sorted(metadata) if isinstance(metadata, dict) else repr(metadata)[:100]
        raise ValueError(f"the geneval reward needs each prompt's GenEval metadata, a JSON object with 'tag' in "
                         f"{', '.join(GENEVAL_TASKS)} and an 'include' list: use --prompts geneval or a .jsonl with "
                         f"those fields; prompt {prompt[:200]!r} has {found or 'none'}")
    for part, keys in (("include", {"class", "count", "color", "position"}), ("exclude", {"class", "count"})):
        clauses = metadata.get(part, [])
        if not isinstance(clauses, list) or (part == "include" and not clauses):
            refuse(f"'{part}'", f"must be a {'non-empty ' if part == 'include' else ''}list of clauses, got {clauses!r:.100}")
        for index, clause in enumerate(clauses):
            where = f"'{part}'[{index}]"
            if not isinstance(clause, dict) or not {"class", "count"} <= set(clause) <= keys:
                refuse(where, f"must be an object with 'class' and 'count'{' (and color, position)' if part == 'include' else ''} "
                              f"and no other field, got {clause!r:.200}")
            count = clause["count"]
            if clause["class"] not in GENEVAL_CLASSES:
                refuse(f"{where}['class']", f"{clause['class']!r:.100} is not one of GenEval's 80 classes")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                refuse(f"{where}['count']", f"must be an integer >= 1, got {count!r:.100}")
            if "color" in clause and clause["color"] not in GENEVAL_COLORS:
                refuse(f"{where}['color']", f"{clause['color']!r:.100} is not one of {', '.join(GENEVAL_COLORS)}")
            position = clause.get("position")
            if "position" in clause and not (isinstance(position, list) and len(position) == 2
                                             and position[0] in GENEVAL_POSITIONS and isinstance(position[1], int)
                                             and not isinstance(position[1], bool) and 0 <= position[1] < index):
                refuse(f"{where}['position']", f"must be [relation, index of an earlier include clause] with a relation "
                                               f"of {', '.join(GENEVAL_POSITIONS)}, got {position!r:.100}")


# ----------------------------------------------------------------------------------------------
# Rewards served by another process (GenEval, UnifiedReward, or any reward here): clients of reward_bridge.py


def http_factory(port: int, what: str) -> Callable[..., Reward]:
    """A registry factory for a reward served over HTTP on 127.0.0.1:port unless `url` says otherwise."""

    def factory(*, device: str = "cpu", url: str = f"http://127.0.0.1:{port}", timeout: float = 300.0,
                retries: int = 3) -> Reward:
        from reward_bridge import HttpReward  # the bridge imports this file: here, not at the top

        return HttpReward(url, timeout=timeout, retries=retries)

    factory.__doc__ = f"{what}, served over HTTP (default http://127.0.0.1:{port}). (device: unused, the server owns the model.)"
    factory.port = port  # `python rewards.py serve NAME` listens here by default
    factory.offline = True  # building it touches nothing: check_options may build one to check the values
    return factory


def unifiedreward(*, device: str = "cpu", url: str = "http://127.0.0.1:17140/v1", model: str = "UnifiedReward-7b-v1.5",
                  api_key: str = "flowgrpo", timeout: float = 300.0, retries: int = 3, concurrency: int = 64) -> Reward:
    """UnifiedReward (a VLM judge) behind an OpenAI-compatible chat server (SGLang or vLLM), scored as Flow-GRPO and
    DiffusionNFT do: "Final Score: N" / 5. (device: unused, the server owns the model.)"""
    from reward_bridge import UnifiedRewardChat

    return UnifiedRewardChat(url, model=model, api_key=api_key, timeout=timeout, retries=retries, concurrency=concurrency)


unifiedreward.offline = True  # building it touches nothing: check_options may build one to check the values
unifiedreward.port = 17140  # the authors' port; `python rewards.py serve` refuses it and says how to start SGLang


# ----------------------------------------------------------------------------------------------
# Registry

REWARDS: dict[str, Callable[..., Reward]] = {
    "color": color,
    "motion": motion,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "pickscore": pickscore,
    "clipscore": clipscore,
    "hpsv21": hpsv21,
    "aesthetic": aesthetic,
    "imagereward": imagereward,
    "ocr": ocr,
    "geneval": http_factory(18082, "GenEval (Flow-GRPO's partial credit in 'scores', GenEval's verdict in 'accuracy'; "
                                   "needs the prompts' metadata; `python rewards.py serve geneval`)"),
    "unifiedreward": unifiedreward,
    "http": http_factory(8000, "Any reward behind the HTTP protocol"),
}


def parse_reward_spec(spec: str) -> dict[str, float]:
    """'pickscore:1,hpsv21:0.5,clipscore' -> {'pickscore': 1.0, 'hpsv21': 0.5, 'clipscore': 1.0}."""
    weights = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, weight = item.partition(":")
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in {spec!r}; choose from {', '.join(REWARDS)}")
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"reward weight {weight!r} for {name!r} is not a number (write name:weight)") from None
        if not math.isfinite(weights[name]):
            raise ValueError(f"reward weight {weight!r} for {name!r} must be finite")
    if not weights:
        raise ValueError(f"no reward named in {spec!r}; write e.g. 'pickscore:1,hpsv21:1'")
    return weights


def load_reward(name: str, *, device: str = "cpu", **options: Any) -> Reward:
    """Build the reward `name` from REWARDS with factory options (model ids, paths, urls...)."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; choose from {', '.join(REWARDS)}")
    return REWARDS[name](device=device, **options)


def check_options(name: str, options: Any, factory: Callable | None = None) -> None:
    """Options for REWARDS[name] (or another factory of it) as the factory declares them: known names, each value
    of its default's type (an int where a float is expected is fine). Factories marked offline are built once to
    check the values."""
    if not isinstance(options, dict):
        raise ValueError(f"the options of {name!r} must be a JSON object {{option: value}}, got {options!r}")
    factory = factory or REWARDS[name]
    params = {p.name: p for p in inspect.signature(factory).parameters.values() if p.name != "device"}
    for key, value in options.items():
        if key not in params:
            raise ValueError(f"{name!r} has no option {key!r}; its options are {', '.join(params) or 'none'}")
        kind = params[key].annotation
        if kind is float:  # JSON writes 300.0 as 300
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:  # bool is an int in Python, never in an option
            ok = isinstance(value, kind) and isinstance(value, bool) == (kind is bool)
        if not ok:
            raise ValueError(f"option {key!r} of {name!r} must be {getattr(kind, '__name__', kind)} (default "
                             f"{params[key].default!r}), got {value!r}")
    if getattr(factory, "offline", False):
        factory(**options)


def reward_model_bytes(name: str, dtype: str = "float32") -> int:
    """Parameter bytes of a reward's model, from its architecture on the meta device (for the memory plan; no
    download): CLIP ViT-H/14 for pickscore and hpsv21, ViT-L/14 for clipscore and aesthetic, BLIP (ViT-L + BERT
    with cross-attention, ImageReward's) for imagereward; 0 for rewards without a model or served over HTTP."""
    from transformers import BlipTextConfig, BlipVisionConfig, CLIPConfig, CLIPModel

    clip = {"h14": (dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
                    dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16), 1024),
            "l14": (dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
                    dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16), 768)}
    kind = {"pickscore": "h14", "hpsv21": "h14", "clipscore": "l14", "aesthetic": "l14", "imagereward": "blip"}.get(name)
    with torch.device("meta"):
        if kind == "blip":
            model = ImageRewardModel(  # ViT-L/16 at 224 px, BERT-base with cross-attention (med_config.json)
                BlipVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                 image_size=224, patch_size=16),
                BlipTextConfig(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                               num_attention_heads=12, encoder_hidden_size=1024, is_decoder=True))
        elif kind:
            text, vision, projection = clip[kind]
            model = CLIPModel(CLIPConfig(text_config={**text, "vocab_size": 49408, "max_position_embeddings": 77},
                                         vision_config={**vision, "patch_size": 14, "image_size": 224},
                                         projection_dim=projection))
        else:
            return 0
    return sum(p.numel() for p in model.parameters()) * _dtype(dtype).itemsize


# What a reward needs from every prompt, checked before training: name -> check(text, metadata), raising ValueError.
PROMPT_CHECKS: dict[str, Callable[[str, dict], Any]] = {"color": prompt_color, "motion": prompt_direction,
                                                        "ocr": ocr_target, "geneval": check_geneval_metadata}


def check_prompt(name: str, text: str, metadata: dict) -> None:
    if name in PROMPT_CHECKS:
        PROMPT_CHECKS[name](text, metadata)


if __name__ == "__main__":  # `python rewards.py serve NAME`: the server lives in reward_bridge.py
    import reward_bridge

    reward_bridge.serve()
