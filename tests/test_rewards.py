"""Tests of rewards.py: each reward against its official code's algorithm written out (CLIP family, HPSv2.1,
ImageReward, OCR, GenEval's rules), the colour, motion and JPEG rewards against closed forms, videos frame by frame.
"""

import functools
import io
import math
import sys
import types
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rewards
from helpers import smooth_images

PROMPTS4 = ["a red car", "a blue flower", "the green square", "a photo of a white circle"]


def clip_reference(clip_dir, images, prompts):
    """Embeddings straight from CLIPModel.forward (which normalises them), independent of ClipScorer."""
    from transformers import AutoProcessor, CLIPModel

    model, proc = CLIPModel.from_pretrained(clip_dir).eval(), AutoProcessor.from_pretrained(clip_dir)
    inputs = proc(text=prompts, images=rewards.to_pil(images), return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**inputs), model


@pytest.mark.parametrize("name", ["pickscore", "clipscore"])
def test_clip_rewards_match_the_model_and_are_deterministic_and_order_invariant(name, tiny_clip_dir):
    reward = rewards.load_reward(name, model=tiny_clip_dir, processor=tiny_clip_dir)
    images = smooth_images(4, h=40, w=56)  # resized and cropped by the processor, as the model card does
    scores = reward(images, PROMPTS4)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    torch.testing.assert_close(reward(images, PROMPTS4), scores, rtol=0, atol=0)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(reward(images[perm], [PROMPTS4[i] for i in perm]), scores[perm], rtol=1e-5, atol=1e-6)
    out, model = clip_reference(tiny_clip_dir, images, PROMPTS4)
    expected = out.logits_per_image.diagonal() if name == "pickscore" else (out.image_embeds * out.text_embeds).sum(-1)
    # Same pixels as the model card's processor(images=PIL) call (before: 0.019 apart on PickScore's logit scale, from
    # resizing floats); what remains is float32 summation order between the batched and the joint forward.
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def hps_reference_pixels(images, size, mean, std):
    """HPSv2's published evaluation transform (hpsv2/src/open_clip/transform.py, image_transform with
    resize_longest_max) written out in its order: _convert_to_rgb_or_rgba, ToTensor (the uint8 image / 255), then
    ResizeMaxSize ON THE FLOAT TENSOR (scale = size / longest side, new (h, w) = round(dim * scale), torchvision's
    tensor resize: bicubic, align_corners False, antialias True, no clamp for floats), F.pad [pad_w // 2, pad_h // 2,
    rest, rest] with 0, Normalize."""
    out = []
    for a in (images.clamp(0, 1) * 255).round().to(torch.uint8):
        x = a.float() / 255  # ToTensor
        height, width = x.shape[1:]
        scale = size / float(max(height, width))
        if scale != 1.0:
            new_h, new_w = (round(dim * scale) for dim in (height, width))
            x = F.interpolate(x[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[0]
            pad_h, pad_w = size - new_h, size - new_w
            x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
        out.append((x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))
    return torch.stack(out)


@pytest.mark.parametrize("h,w", [(40, 56), (56, 40), (45, 31), (300, 200), (24, 24)])
def test_hpsv21_preprocessing_is_hpsv2s_resize_longest_and_pad(h, w):
    """Before: centre crop on the floats, clamped: score differences up to 0.0135 on non-square images (the spread of
    the scores was 0.017); then a PIL resize of the uint8 image, which rounds the pixels twice (up to 2.8e-4 in the
    HPSv2 score on smooth images). Now the published order: the float tensor is resized, to float rounding."""
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    images = smooth_images(3, h, w)
    ours = rewards.resize_longest_and_pad(images, processor)
    ref = hps_reference_pixels(images, 32, processor.image_mean, processor.image_std)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)  # both are float32 bicubic of the same floats
    if h != w:  # black bars where the image does not reach: the normalised value of 0
        black = (0 - torch.tensor(processor.image_mean)) / torch.tensor(processor.image_std)
        torch.testing.assert_close(ours[:, :, 0, 0], black.expand(3, 3), rtol=0, atol=1e-6)  # a padded corner


def test_aesthetic_reward_is_the_mlp_on_the_normalised_image_embedding(tiny_clip_dir, tmp_path):
    torch.manual_seed(1)
    head = rewards.MLPHead(24)
    torch.save(head.state_dict(), tmp_path / "head.pth")
    reward = rewards.load_reward("aesthetic", clip=tiny_clip_dir, head=str(tmp_path / "head.pth"))
    images = smooth_images(3, h=32, w=32)
    out, _ = clip_reference(tiny_clip_dir, images, PROMPTS4[:3])
    with torch.no_grad():
        expected = head.eval()(out.image_embeds).squeeze(-1)
    torch.testing.assert_close(reward(images, PROMPTS4[:3]), expected, rtol=1e-4, atol=1e-4)


def openclip_state_dict(*, width_v=32, width_t=24, layers=2, patch=8, grid=4, vocab=600, ctx=16, embed=20, seed=0):
    """Random weights in open_clip's exact key layout and shapes (ViT-H-14's layout at toy sizes)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    sd = {"logit_scale": torch.tensor(4.6), "visual.class_embedding": r(width_v),
          "visual.positional_embedding": r(grid * grid + 1, width_v), "visual.proj": r(width_v, embed),
          "visual.conv1.weight": r(width_v, 3, patch, patch), "token_embedding.weight": r(vocab, width_t),
          "positional_embedding": r(ctx, width_t), "text_projection": r(width_t, embed),
          "attn_mask": torch.full((ctx, ctx), float("-inf")).triu(1)}
    for prefix, w in (("visual.ln_pre", width_v), ("visual.ln_post", width_v), ("ln_final", width_t)):
        sd[f"{prefix}.weight"], sd[f"{prefix}.bias"] = 1 + r(w), r(w)
    for tower, w in (("visual.transformer", width_v), ("transformer", width_t)):
        for i in range(layers):
            p = f"{tower}.resblocks.{i}."
            for ln in ("ln_1", "ln_2"):
                sd[p + ln + ".weight"], sd[p + ln + ".bias"] = 1 + r(w), r(w)
            sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"] = r(3 * w, w), r(3 * w)
            sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"] = r(w, w), r(w)
            sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = r(4 * w, w), r(4 * w)
            sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = r(w, 4 * w), r(w)
    return sd


def openclip_forward(sd, pixels, tokens, *, heads):
    """open_clip's CLIP forward written out by hand: pre-LN residual blocks with fused qkv attention,
    class-token pooling for images, EOT (= highest id) pooling for text, then the projections."""

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"])

    def blocks(x, tower, mask):
        n = sum(1 for k in sd if k.startswith(tower) and k.endswith("attn.in_proj_weight"))
        B, L, W = x.shape
        for i in range(n):
            p = f"{tower}.resblocks.{i}."
            q, k, v = (ln(x, p + "ln_1") @ sd[p + "attn.in_proj_weight"].T + sd[p + "attn.in_proj_bias"]).chunk(3, -1)
            q, k, v = (y.view(B, L, heads, W // heads).transpose(1, 2) for y in (q, k, v))
            att = (q @ k.transpose(-1, -2) / math.sqrt(W // heads) + mask).softmax(-1)
            x = x + (att @ v).transpose(1, 2).reshape(B, L, W) @ sd[p + "attn.out_proj.weight"].T + sd[p + "attn.out_proj.bias"]
            h = F.gelu(ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"].T + sd[p + "mlp.c_fc.bias"])
            x = x + h @ sd[p + "mlp.c_proj.weight"].T + sd[p + "mlp.c_proj.bias"]
        return x

    patch = sd["visual.conv1.weight"].shape[-1]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=patch).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(len(x), 1, -1), x], 1) + sd["visual.positional_embedding"]
    x = blocks(ln(x, "visual.ln_pre"), "visual.transformer", 0.0)
    image = ln(x[:, 0], "visual.ln_post") @ sd["visual.proj"]
    L = tokens.shape[1]
    t = sd["token_embedding.weight"][tokens] + sd["positional_embedding"][:L]
    t = ln(blocks(t, "transformer", torch.full((L, L), float("-inf")).triu(1)), "ln_final")
    text = t[torch.arange(len(t)), tokens.argmax(-1)] @ sd["text_projection"]
    return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


def test_hpsv21_open_clip_weights_convert_exactly(tiny_clip_dir, tmp_path):
    sd = openclip_state_dict()
    model = rewards.openclip_to_transformers(sd, vision_heads=4, text_heads=4, bos_token_id=0, eos_token_id=1)
    assert set(model.state_dict()) == set(rewards.convert_openclip_state_dict(sd))  # nothing missing or extra
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, tmp_path / "HPS_v2.1_compressed.pt")
    reward = rewards.load_reward("hpsv21", checkpoint=str(tmp_path / "HPS_v2.1_compressed.pt"),
                                 processor=tiny_clip_dir, vision_heads=4, text_heads=4)
    images = smooth_images(4, h=40, w=56)  # non-square: HPSv2 pads where CLIP processors crop
    tok = reward.processor.tokenizer(PROMPTS4, padding="max_length", max_length=16, return_tensors="pt").input_ids
    tok = torch.where(torch.arange(16) > tok.argmax(-1, keepdim=True), 0, tok)  # open_clip pads with 0 after EOT
    image_processor = reward.processor.image_processor
    pixels = hps_reference_pixels(images, 32, image_processor.image_mean, image_processor.image_std)
    image_ref, text_ref = openclip_forward(sd, pixels, tok, heads=4)
    torch.testing.assert_close(reward.embed_images(images), image_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward.embed_texts(PROMPTS4), text_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward(images, PROMPTS4), (image_ref * text_ref).sum(-1), rtol=1e-4, atol=1e-5)


# What open_clip's tokenizer encodes (ftfy.fix_text's documented fixes, then html.unescape twice, whitespace collapse),
# written out per probe: the prompts real sets are full of.
OPENCLIP_CLEANED = {
    "It\u2019s a \u201ccat\u201d &amp; a dog": "It's a \"cat\" & a dog",  # curly quotes, an HTML entity
    "\ufb01ne \ufb02owers": "fine flowers",  # Latin ligatures
    "\uff21\uff22\uff23\u3000\uff44\uff4f\uff47\uff01": "ABC dog!",  # fullwidth letters, ideographic space
    "&amp;amp;amp; &lt;b&gt;": "& <b>",  # unescaped three times: ftfy once (no '<' yet), open_clip twice
    "a <b> &amp;amp;amp; c": "a <b> &amp; c",  # ftfy leaves text with '<' alone; open_clip's two passes apply
    "  two \t  spaces\n": "two spaces",
}


def test_hpsv21_tokenises_the_text_open_clip_tokenises(tiny_clip_dir, tmp_path):
    """Before: 4 of 23 probes got other token ids than open_clip's (score differences up to 0.034 on random weights)."""
    for raw, cleaned in OPENCLIP_CLEANED.items():
        assert rewards.openclip_clean(raw) == cleaned, raw
    torch.save(openclip_state_dict(), tmp_path / "hps.pt")
    reward = rewards.load_reward("hpsv21", checkpoint=str(tmp_path / "hps.pt"), processor=tiny_clip_dir,
                                 vision_heads=4, text_heads=4)
    raw, cleaned = list(OPENCLIP_CLEANED), list(OPENCLIP_CLEANED.values())
    plain = rewards.ClipScorer(reward.model, reward.processor, use_logit_scale=False, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(reward.embed_texts(raw), plain.embed_texts(cleaned), rtol=0, atol=0)
    tokenizer = reward.processor.tokenizer
    assert tokenizer(raw[0]).input_ids != tokenizer(cleaned[0]).input_ids  # what the plain tokenizer path got wrong


def test_hpsv21_conversion_rejects_a_checkpoint_of_another_architecture():
    sd = openclip_state_dict()
    sd["visual.attnpool.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="unexpected.*visual.attnpool"):
        rewards.openclip_to_transformers(sd, vision_heads=4, text_heads=4)


def imagereward_state_dict(*, width_v=32, width_t=24, layers=2, patch=8, grid=4, vocab=40, positions=40, seed=0):
    """Random weights in ImageReward.pt's exact key layout (ImageReward.py's ImageReward: blip = BLIP_Pretrain with
    vit.py's VisionTransformer, med.py's BertModel without pooler, vision_proj / text_proj; mlp = MLP), toy sizes."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    sd = {v + "cls_token": r(1, 1, width_v), v + "pos_embed": r(1, grid * grid + 1, width_v),
          v + "patch_embed.proj.weight": r(width_v, 3, patch, patch), v + "patch_embed.proj.bias": r(width_v),
          t + "embeddings.word_embeddings.weight": r(vocab, width_t),
          t + "embeddings.position_embeddings.weight": r(positions, width_t),
          t + "embeddings.position_ids": torch.arange(positions).unsqueeze(0),  # a persistent buffer in med.py
          "blip.vision_proj.weight": r(16, width_v), "blip.vision_proj.bias": r(16),
          "blip.text_proj.weight": r(16, width_t), "blip.text_proj.bias": r(16)}

    def linear(name, n_out, n_in):
        sd[name + ".weight"], sd[name + ".bias"] = r(n_out, n_in), r(n_out)

    def norm(name, n):
        sd[name + ".weight"], sd[name + ".bias"] = 1 + r(n), r(n)

    norm(v + "norm", width_v)
    norm(t + "embeddings.LayerNorm", width_t)
    for i in range(layers):
        b = f"{v}blocks.{i}."
        norm(b + "norm1", width_v), norm(b + "norm2", width_v)
        linear(b + "attn.qkv", 3 * width_v, width_v), linear(b + "attn.proj", width_v, width_v)
        linear(b + "mlp.fc1", 4 * width_v, width_v), linear(b + "mlp.fc2", width_v, 4 * width_v)
        b = f"{t}encoder.layer.{i}."
        for kind, kv_width in (("attention", width_t), ("crossattention", width_v)):
            linear(b + kind + ".self.query", width_t, width_t)
            linear(b + kind + ".self.key", width_t, kv_width), linear(b + kind + ".self.value", width_t, kv_width)
            linear(b + kind + ".output.dense", width_t, width_t), norm(b + kind + ".output.LayerNorm", width_t)
        linear(b + "intermediate.dense", 4 * width_t, width_t), linear(b + "output.dense", width_t, 4 * width_t)
        norm(b + "output.LayerNorm", width_t)
    for i, (n_in, n_out) in zip((0, 2, 4, 6, 7), ((width_t, 1024), (1024, 128), (128, 64), (64, 16), (16, 1))):
        linear(f"mlp.layers.{i}", n_out, n_in)
    return sd


def imagereward_forward(sd, pixels, ids, mask, *, vision_heads, text_heads):
    """ImageReward.score written out by hand from the published modules: vit.py (pre-LN blocks, fused qkv, LayerNorm
    eps 1e-6, exact GELU, final norm over every token), med.py's BertModel in multimodal mode (post-LN, eps 1e-12, padding
    masked with -10000, cross-attention to all image tokens after self-attention), the [CLS] feature, MLP, (r - mean) / std."""
    v, t = "blip.visual_encoder.", "blip.text_encoder."

    def ln(x, name, eps):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)

    def lin(x, name):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]

    def attend(q, k, v_, heads, bias=0.0):
        B, Lq, W = q.shape
        q, k, v_ = (y.view(B, -1, heads, W // heads).transpose(1, 2) for y in (q, k, v_))
        return ((q @ k.transpose(-1, -2) / math.sqrt(W // heads) + bias).softmax(-1) @ v_).transpose(1, 2).reshape(B, Lq, W)

    patch = sd[v + "patch_embed.proj.weight"].shape[-1]
    x = F.conv2d(pixels, sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"], stride=patch)
    x = torch.cat([sd[v + "cls_token"].expand(len(pixels), -1, -1), x.flatten(2).transpose(1, 2)], 1)
    x = x + sd[v + "pos_embed"][:, : x.shape[1]]
    for i in range(sum(1 for k in sd if k.startswith(v) and k.endswith("attn.qkv.weight"))):
        b = f"{v}blocks.{i}."
        q, k, v_ = lin(ln(x, b + "norm1", 1e-6), b + "attn.qkv").chunk(3, -1)
        x = x + lin(attend(q, k, v_, vision_heads), b + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, b + "norm2", 1e-6), b + "mlp.fc1")), b + "mlp.fc2")
    image = ln(x, v + "norm", 1e-6)
    h = sd[t + "embeddings.word_embeddings.weight"][ids] + sd[t + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    h = ln(h, t + "embeddings.LayerNorm", 1e-12)
    pad = (1.0 - mask[:, None, None, :].float()) * -10000.0
    for i in range(sum(1 for k in sd if k.startswith(t) and k.endswith("crossattention.self.query.weight"))):
        b = f"{t}encoder.layer.{i}."
        for kind, source, bias in (("attention", None, pad), ("crossattention", image, 0.0)):
            kv = h if source is None else source
            a = attend(lin(h, b + kind + ".self.query"), lin(kv, b + kind + ".self.key"), lin(kv, b + kind + ".self.value"),
                       text_heads, bias)
            h = ln(lin(a, b + kind + ".output.dense") + h, b + kind + ".output.LayerNorm", 1e-12)
        h = ln(lin(F.gelu(lin(h, b + "intermediate.dense")), b + "output.dense") + h, b + "output.LayerNorm", 1e-12)
    r = h[:, 0]
    for i in (0, 2, 4, 6, 7):  # dropout in between is the identity at eval time; no activations, as published
        r = lin(r, f"mlp.layers.{i}")
    return (r.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


def imagereward_reference_pixels(images, size):
    """ImageReward's _transform on a PIL image, from torchvision's published functional code: Resize(size) with an int
    (shorter side -> size, longer -> int(size * long / short), nothing when the shorter side is already size, PIL bicubic),
    CenterCrop(size) (top = int(round((h - size) / 2.0)), left likewise), ToTensor, Normalize(CLIP mean, std)."""
    from PIL import Image

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    out = []
    for a in (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy():
        img = Image.fromarray(a)
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_w, new_h = (size, int(size * long / short)) if w <= h else (int(size * long / short), size)
        if (new_w, new_h) != (w, h):
            img = img.resize((new_w, new_h), Image.BICUBIC)
        x = np.asarray(img)
        top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
        x = torch.from_numpy(x[top: top + size, left: left + size].copy()).permute(2, 0, 1).float() / 255
        out.append((x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))
    return torch.stack(out)


@pytest.mark.parametrize("h,w", [(40, 54), (54, 40), (45, 31), (32, 32), (32, 70), (300, 200)])
def test_imagereward_preprocessing_is_its_torchvision_transform(h, w):
    """(40, 54): the crop offset is round(5.5) = 6, where a CLIP processor's (dim - size) // 2 takes 5."""
    images = smooth_images(3, h, w)
    torch.testing.assert_close(rewards.resize_shorter_and_center_crop(images, 32), imagereward_reference_pixels(images, 32),
                               rtol=0, atol=0)


@pytest.fixture(scope="module")
def imagereward_files(tmp_path_factory):
    """A toy ImageReward.pt in the official key layout and a BERT WordPiece tokenizer (built offline) saved beside it."""
    from transformers import BertTokenizer

    words = sorted({w for p in PROMPTS4 for w in p.split()} | {"##s", ".", ","})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
    path = tmp_path_factory.mktemp("imagereward")
    BertTokenizer(vocab=vocab).save_pretrained(path / "tokenizer")
    sd = imagereward_state_dict(vocab=len(vocab) + 2)  # + [DEC] and [ENC], as BLIP's init_tokenizer adds them
    torch.save(sd, path / "ImageReward.pt")
    return sd, str(path / "ImageReward.pt"), str(path / "tokenizer")


def test_imagereward_loads_the_official_checkpoint_layout_and_scores_as_the_published_forward(imagereward_files):
    sd, checkpoint, tokenizer = imagereward_files
    reward = rewards.load_reward("imagereward", checkpoint=checkpoint, tokenizer=tokenizer, vision_heads=4, text_heads=4)
    prompts = PROMPTS4 + ["a red car, " * 20]  # the last one is truncated at 35 tokens
    images = smooth_images(5, h=40, w=54)
    scores = reward(images, prompts)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    tok = rewards.imagereward_tokenizer(tokenizer)
    expected = []
    for image, prompt in zip(images, prompts):  # ImageReward.score: one (prompt, image) at a time
        ids = tok(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        pixels = imagereward_reference_pixels(image[None], 32)
        expected.append(imagereward_forward(sd, pixels, ids.input_ids, ids.attention_mask, vision_heads=4, text_heads=4))
    # float32 summation order between transformers' modules and the hand-written forward, through 4 layers: ~1e-6
    torch.testing.assert_close(scores, torch.cat(expected), rtol=1e-4, atol=1e-5)
    assert scores.std() > 0.05  # the scores differ between images: a constant would not pass for a match


def test_imagereward_conversion_accepts_exactly_the_official_keys():
    sd = imagereward_state_dict()
    model = rewards.imagereward_from_state_dict(sd, vision_heads=4, text_heads=4)
    converted = rewards.convert_imagereward_state_dict(sd)
    assert set(model.state_dict()) == set(converted)  # nothing missing, nothing extra
    assert len(sd) - len(converted) == 5  # vision_proj, text_proj (weight, bias) and the position-id buffer
    with pytest.raises(ValueError, match="unexpected.*itm_head"):
        rewards.imagereward_from_state_dict({**sd, "blip.itm_head.weight": torch.zeros(2, 24)}, vision_heads=4, text_heads=4)
    with pytest.raises(ValueError, match="missing.*crossattention"):
        rewards.imagereward_from_state_dict({k: v for k, v in sd.items() if "layer.1.crossattention.self.key.weight" not in k},
                                            vision_heads=4, text_heads=4)
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        rewards.imagereward_from_state_dict(openclip_state_dict(), vision_heads=4, text_heads=4)


def test_jpeg_rewards_are_the_encoded_size_and_rank_smooth_above_noise():
    from PIL import Image

    images = torch.cat([smooth_images(1, 64, 64), torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))])
    size = rewards.load_reward("jpeg_incompressibility")(images, ["", ""])
    for image, kb in zip(images, size):
        buffer = io.BytesIO()
        Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()).save(buffer, "JPEG", quality=95)
        assert kb.item() == pytest.approx(len(buffer.getvalue()) / 1000)
    compress = rewards.load_reward("jpeg_compressibility")(images, ["", ""])
    torch.testing.assert_close(compress, -size)
    assert compress[0] > compress[1]  # the smooth image is more compressible than noise


def test_color_reward_follows_the_prompt_and_metadata():
    images = torch.zeros(3, 3, 8, 8)
    images[0, 0] = 1.0  # pure red
    images[1] = 0.5  # grey
    images[2, 2] = 1.0  # pure blue
    reward = rewards.load_reward("color")
    scores = reward(images, ["a red car", "a RED car", "a photo"], [None, None, {"color": "blue"}])
    expected = [1.0, 1 - math.sqrt(0.25 + 0.25 + 0.25) / math.sqrt(3), 1.0]
    torch.testing.assert_close(scores, torch.tensor(expected))
    with pytest.raises(ValueError, match="needs a colour word"):
        reward(images[:1], ["a photo"])


def moving_squares(starts, moves, *, frames=5, size=(24, 40), side=6, color=(1.0, 0.0, 0.0)):
    """Videos (B, frames, 3, H, W): a square of `side` px on grey, its top-left corner moving in a straight line from
    starts[b] (x, y) by moves[b] (dx, dy) in total, in whole pixels per frame."""
    H, W = size
    videos = torch.full((len(starts), frames, 3, H, W), 0.5)
    for b, ((x, y), (dx, dy)) in enumerate(zip(starts, moves)):
        for f in range(frames):
            fx, fy = x + dx * f // (frames - 1), y + dy * f // (frames - 1)
            videos[b, f, :, fy:fy + side, fx:fx + side] = torch.tensor(color)[:, None, None]
    return videos


def test_motion_reward_is_the_travel_in_the_named_direction_per_frame_size():
    """Closed form: a square moved by (dx, dy) px over the video scores dx / W for "right", -dx / W for "left",
    dy / H for "down" (y points down the image), -dy / H for "up"; still videos and background-only frames score 0;
    metadata names the direction where the prompt does not. Frames 24 x 40, so a swapped axis would show."""
    reward = rewards.load_reward("motion")
    videos = moving_squares([(2, 9), (30, 9), (17, 1), (17, 15), (17, 9)], [(20, 0), (-20, 0), (0, 12), (0, -8), (0, 0)])
    prompts = ["a red square moving right", "moving left", "a square moving down", "up it goes", "a square moving left"]
    torch.testing.assert_close(reward(videos, prompts), torch.tensor([20 / 40, 20 / 40, 12 / 24, 8 / 24, 0.0]))
    crossed = ["moving left", "moving right", "moving up", "moving down", "moving up"]
    torch.testing.assert_close(reward(videos, crossed), torch.tensor([-20 / 40, -20 / 40, -12 / 24, -8 / 24, 0.0]))
    sideways = reward(videos[:2], ["moving up", "moving down"])
    torch.testing.assert_close(sideways, torch.zeros(2))
    torch.testing.assert_close(reward(videos[:1], ["a square"], [{"direction": "left"}]), torch.tensor([-0.5]))
    torch.testing.assert_close(reward(torch.full((1, 3, 3, 8, 8), 0.5), ["moving right"]), torch.zeros(1))
    with pytest.raises(ValueError, match="needs a direction word"):
        reward(videos[:1], ["a red square"])


def test_image_rewards_score_videos_on_every_nth_frame_as_flow_grpo_and_flow_factory_do(monkeypatch):
    """An image reward scores a video as the mean over frames 0, n, 2n, ...: n = 4 for OCR (Flow-GRPO's video OCR
    scorer), 1 for the others (Flow-Factory's video PickScore), --frame_interval overriding both; a video reward
    (motion) gets the video itself. Frames are scored with their video's prompt and metadata, in calls of at most
    FRAMES_PER_CALL images, and the result equals scoring each chosen frame alone."""
    videos = torch.rand(3, 9, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    videos[:, :, 0, 0, 0] = torch.arange(9) / 8  # frame f marks itself with f / 8 in one pixel
    prompts, metadata = ["a red car", "a blue car", "a green car"], [{"k": 0}, {"k": 1}, {"k": 2}]
    monkeypatch.setattr(rewards, "FRAMES_PER_CALL", 5)  # calls that split videos
    seen = []

    def recording(images, texts, extra):
        seen.append((images[:, 0, 0, 0].mul(8).round().int().tolist(), list(texts), [m["k"] for m in extra]))
        return rewards.color()(images, texts)

    for name, interval, frames in (("ocr", 0, [0, 4, 8]), ("pickscore", 0, list(range(9))), ("pickscore", 3, [0, 3, 6])):
        seen.clear()
        scores = rewards.for_samples(name, recording, video=True, frame_interval=interval)(videos, prompts, metadata)
        alone = torch.stack([torch.stack([rewards.color()(videos[b, f][None], [prompts[b]])[0] for f in frames]).mean()
                             for b in range(3)])
        torch.testing.assert_close(scores, alone)
        assert [f for call in seen for f in call[0]] == frames * 3
        assert [t for call in seen for t in call[1]] == [p for p in prompts for _ in frames]
        assert [k for call in seen for k in call[2]] == [k for k in range(3) for _ in frames]
        assert max(len(call[0]) for call in seen) <= rewards.FRAMES_PER_CALL
    assert rewards.for_samples("motion", recording, video=True) is recording
    assert rewards.for_samples("pickscore", recording, video=False) is recording


def test_reward_spec_parsing_and_unknown_names():
    assert rewards.parse_reward_spec("pickscore:2, hpsv21,clipscore:0.5") == {"pickscore": 2.0, "hpsv21": 1.0, "clipscore": 0.5}
    for bad, message in (("pickscor", "unknown reward 'pickscor'"), ("color:x", "not a number"), (",", "no reward named")):
        with pytest.raises(ValueError, match=message):
            rewards.parse_reward_spec(bad)
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.load_reward("nope")


def ocr_fonts():
    """PIL's bundled FreeType font (Aileron), and matplotlib's DejaVu faces where matplotlib is installed."""
    from PIL import ImageFont

    fonts = [lambda size: ImageFont.load_default(size=size)]
    try:
        import matplotlib

        ttf = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
        fonts += [partial(ImageFont.truetype, str(ttf / name)) for name in ("DejaVuSerif-Bold.ttf", "DejaVuSansMono.ttf")]
    except ImportError:
        pass
    return fonts


def render_text(text, font, fg, bg, size=(512, 384)):
    """The text centred on a plain background, as a (1, 3, H, W) image in [0, 1]."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(picture)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - right + left) // 2, (size[1] - bottom + top) // 2), text, font=font, fill=fg)
    return torch.from_numpy(np.asarray(picture).copy()).permute(2, 0, 1)[None].float() / 255


OCR_CASES = [  # (prompt, text drawn, font index, size, foreground, background)
    ('a storefront sign that reads "OPEN 24 HOURS"', "OPEN 24 HOURS", 0, 48, "black", "white"),
    ('a neon sign saying "Hello World"', "Hello World", 1, 40, "white", (20, 30, 90)),
    ('a poster that reads "Don\'t panic, 42!"', "Don't panic, 42!", 2, 36, (200, 20, 20), (250, 240, 200)),
    ('a mug printed with "v-grpo"', "V-GRPO", 0, 64, "white", "black"),
    ('a card with the words "see you soon" on it', "See you soon", 1, 30, (10, 90, 10), (230, 230, 230)),
]


@pytest.fixture(scope="module")
def ocr_reward():
    return rewards.load_reward("ocr")


@pytest.mark.parametrize("prompt,drawn,font,size,fg,bg", OCR_CASES)
def test_ocr_reward_reads_the_quoted_text_rendered_in_an_image(prompt, drawn, font, size, fg, bg, ocr_reward):
    """Real PP-OCRv4 weights: the quoted text drawn in several fonts, sizes, colours (case and spacing may differ from
    the prompt, as the rule ignores them) scores >= 0.9; the same image scored against another text scores low."""
    fonts = ocr_fonts()
    image = render_text(drawn, fonts[font % len(fonts)](size), fg, bg)
    score = ocr_reward(image, [prompt]).item()
    assert 0.9 <= score <= 1.0, (prompt, score)
    assert ocr_reward(image, ['a sign that says "Quantum zebra marmalade"']).item() < 0.5


def test_ocr_reward_is_zero_on_noise_and_blank_images_and_refuses_a_prompt_without_quotes(ocr_reward):
    g = torch.Generator().manual_seed(0)
    images = torch.cat([torch.rand(1, 3, 256, 256, generator=g), torch.zeros(1, 3, 256, 256), torch.ones(1, 3, 256, 256)])
    scores = ocr_reward(images, ['a sign that says "Hello"'] * 3)
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.zeros(3))
    assert ocr_reward(torch.rand(2, 3, 24, 40, generator=g), ['a sign that says "Hello"'] * 2).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="between double quotes"):
        ocr_reward(images[:1], ["a sign that says hello"])
    with pytest.raises(ValueError, match="non-empty text"):
        ocr_reward(images[:1], ['a sign that says "  "'])
    assert ocr_reward(images[1:2], ["no quotes here"], [{"text": "Hello"}]).item() == 0.0  # metadata["text"] wins


def test_ocr_paddleocr_engine_reads_paddleocrs_published_output_format(monkeypatch):
    """engine="paddleocr" builds PaddleOCR as Flow-GRPO does and joins the lines of its 2.x result format
    ([[box, (text, confidence)], ...] per image; [None] when nothing is read). PaddleOCR itself is not installed
    here: a stand-in with that interface checks the call and the parsing; without the package, a one-line hint."""
    made = {}

    class FakePaddleOCR:
        def __init__(self, **kwargs):
            made.update(kwargs)

        def ocr(self, image, cls):
            assert image.dtype == np.uint8 and image.shape[-1] == 3 and cls is False
            if image.mean() > 127:
                return [None]
            return [[[[[0, 0], [9, 0], [9, 9], [0, 9]], ("HELLO", 0.93)], [[[0, 20], [9, 20], [9, 29], [0, 29]], ("wor1d", 0.71)]]]

    monkeypatch.setitem(sys.modules, "paddleocr", types.SimpleNamespace(PaddleOCR=FakePaddleOCR))
    reward = rewards.load_reward("ocr", engine="paddleocr")
    assert made == {"use_angle_cls": False, "lang": "en", "use_gpu": False, "show_log": False}
    scores = reward(torch.stack([torch.zeros(3, 16, 16), torch.ones(3, 16, 16)]), ['a sign "Hello World"'] * 2)
    assert scores.tolist() == [pytest.approx(1 - 1 / 10), 0.0]  # "hellowor1d" is one substitution away
    monkeypatch.setitem(sys.modules, "paddleocr", None)
    with pytest.raises(ImportError, match="pip install paddleocr paddlepaddle"):
        rewards.load_reward("ocr", engine="paddleocr")
    with pytest.raises(ValueError, match="not rapidocr or paddleocr"):
        rewards.load_reward("ocr", engine="tesseract")


def brute_levenshtein(a, b):
    """Edit distance by its recursive definition."""
    @functools.lru_cache(maxsize=None)
    def d(i, j):
        if not i or not j:
            return i or j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_ocr_accuracy_is_flow_grpos_rule():
    """Flow-GRPO's flow_grpo/ocr.py, case by case: lower-case, spaces removed, 0 if the target is inside what was read,
    else the edit distance clipped to the target's length, reward 1 - d / len."""
    cases = {("Hello World", "hello world"): 1.0,  # case and spaces do not count
             ("a big HELLOWORLD sign", "Hello World"): 1.0,  # the target inside more text
             ("helo world", "Hello World"): 1 - 1 / 10,  # one deletion
             ("hellp world", "Hello World"): 1 - 1 / 10,  # one substitution
             ("", "Hello"): 0.0, ("zzzzzzzzzzzz", "ab"): 0.0,  # distance clipped at the target's length
             ("abx", "abc"): 1 - 1 / 3}
    for (read, target), expected in cases.items():
        assert rewards.ocr_accuracy(read, target) == pytest.approx(expected, abs=1e-12), (read, target)
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = ("".join(rng.choice(list("abc "), size=rng.integers(0, 9))) for _ in range(2))
        assert rewards.levenshtein(a, b) == brute_levenshtein(a, b)
    assert rewards.ocr_target('A sign "one" and "two"') == "one"  # Flow-GRPO: prompt.split('"')[1]
    assert rewards.ocr_target('A sign "one" and "two"', {"text": "three"}) == "three"  # the metadata's text first
    for prompt in ('A sign "with one quote', 'A sign that reads "   "', 'A sign that reads ""'):  # nothing to write
        with pytest.raises(ValueError, match="ocr reward"):
            rewards.ocr_target(prompt)


def det(x1, y1, x2, y2, score=0.95, color=None):
    return rewards.Detection((x1, y1, x2, y2), score, None, color)


def test_geneval_keep_thresholds_sorts_limits_and_suppresses_as_the_published_script():
    raw = {"dog": [det(0, 0, 10, 10, 0.3), det(0, 0, 10, 10, 0.31), det(50, 50, 60, 60, 0.8)], "cat": [det(0, 0, 5, 5, 0.2)]}
    kept = rewards.geneval_keep(raw, "single_object")
    assert [d.score for d in kept["dog"]] == [0.8, 0.31] and "cat" not in kept  # strictly above 0.3, most confident first
    assert "dog" not in rewards.geneval_keep(raw, "counting")  # counting prompts: 0.9
    many = {"cup": [det(i, 0, i + 5, 5, 0.5 + i / 1000) for i in range(20)]}
    assert len(rewards.geneval_keep(many, "two_object")["cup"]) == 16  # max_objects
    overlapping = {"cup": [det(0, 0, 10, 10, 0.9), det(1, 0, 11, 10, 0.8), det(30, 30, 40, 40, 0.7)]}
    assert len(rewards.geneval_keep(overlapping, "two_object")["cup"]) == 3  # max_overlap 1: no suppression
    assert [d.score for d in rewards.geneval_keep(overlapping, "two_object", max_overlap=0.5)["cup"]] == [0.9, 0.7]
    # the overlap rule at its edges: a box overlapping a kept one by exactly max_overlap goes (GenEval keeps
    # iou < max_overlap); at max_overlap 1 nothing goes, even a box identical to a kept one (IoU exactly 1)
    half = {"cup": [det(0, 0, 9, 9, 0.9), det(0, 0, 9, 4, 0.8)]}  # the second is the top half: IoU 50 / 100
    assert [d.score for d in rewards.geneval_keep(half, "two_object", max_overlap=0.5)["cup"]] == [0.9]
    assert [d.score for d in rewards.geneval_keep(half, "two_object", max_overlap=0.51)["cup"]] == [0.9, 0.8]
    twins = {"cup": [det(0, 0, 9, 9, 0.9), det(0, 0, 9, 9, 0.8)]}
    assert [d.score for d in rewards.geneval_keep(twins, "two_object")["cup"]] == [0.9, 0.8]
    # compute_iou counts pixels inclusively: boxes 0..10 and 1..11 share 10 of 11 columns
    assert rewards.geneval_iou((0, 0, 10, 10), (1, 0, 11, 10)) == pytest.approx(110 / 132)


def test_geneval_thresholds_compare_in_float32_as_genevals_detector_arrays_do():
    """GenEval keeps `result[:, 4] > threshold` of mmdet's float32 arrays: numpy compares in float32. A score of
    exactly float32(0.3) is 0.30000001 as a double and was kept here where GenEval drops it."""
    for tag, limit in (("single_object", 0.3), ("counting", 0.9)):
        at = np.float32(limit)
        scores = [at, np.nextafter(at, np.float32(1)), np.nextafter(at, np.float32(0))]
        raw = {"dog": [rewards.Detection((0, 0, 9, 9), float(s)) for s in scores]}
        kept = [d.score for d in rewards.geneval_keep(raw, tag).get("dog", [])]
        genevals = np.array(scores, dtype=np.float32) > limit  # evaluate_images.py's comparison, on its array type
        assert kept == [float(s) for s, keep in zip(scores, genevals) if keep] == [float(scores[1])]


def test_geneval_positions_shrink_the_offset_by_the_object_sizes():
    a, b = det(0, 40, 20, 60), det(90, 40, 110, 60)  # centres 100 apart horizontally, sizes 20
    assert rewards.geneval_relations(a, b) == {"left of"} and rewards.geneval_relations(b, a) == {"right of"}
    assert rewards.geneval_relations(det(40, 0, 60, 20), det(40, 90, 60, 110)) == {"above"}  # y grows downwards
    # diagonal: shrunk offset (-96, -96) over the raw length 141: both components beyond 0.5 in size
    assert rewards.geneval_relations(det(0, 0, 20, 20), det(100, 100, 120, 120)) == {"left of", "above"}
    # overlapping large boxes: the margin 0.1 x (100 + 100) swallows a centre offset of 10: no relation at all
    assert rewards.geneval_relations(det(0, 0, 100, 100), det(10, 0, 110, 100)) == set()
    # mostly vertical offset: dx = -6/60.3 is not a relation, dy is
    assert rewards.geneval_relations(det(0, 0, 10, 10), det(6, 60, 16, 70)) == {"above"}
    # exactly at 0.5 is not beyond it (GenEval: dx < -0.5): offset (-4, 3) of length 5, shrunk by 0.1 x (10 + 5) = 1.5
    # to dx = -2.5 / 5 = -0.5 exactly, and by 0.1 x (2 + 2) to dy = 2.6 / 5 = 0.52
    assert rewards.geneval_relations(det(-5, 2, 5, 4), det(1.5, -1, 6.5, 1)) == {"below"}


GENEVAL_RULE_CASES = [
    # (metadata, objects, correct, Flow-GRPO's partial score)
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {"dog": [det(0, 0, 9, 9)]}, True, 1.0),
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {"cat": [det(0, 0, 9, 9)]}, False, 0.0),
    # two dogs for "a dog": GenEval counts at least 1 (correct); Flow-GRPO's score wants exactly 1: 1 - 1/1 = 0
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {"dog": [det(0, 0, 9, 9), det(20, 0, 29, 9)]},
     True, 0.0),
    ({"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]},
     {"dog": [det(0, 0, 9, 9)]}, False, 0.5),
    ({"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]},
     {"cup": [det(10 * i, 0, 10 * i + 5, 5) for i in range(3)]}, True, 1.0),
    ({"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]},
     {"cup": [det(10 * i, 0, 10 * i + 5, 5) for i in range(4)]}, False, 1 - 1 / 3),  # the exclude clause fails it
    ({"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]},
     {"cup": [det(10 * i, 0, 10 * i + 5, 5) for i in range(5)]}, False, 1 - 3 / 2),  # negative, as Flow-GRPO's
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
     {"car": [det(0, 0, 9, 9, 0.9, "red"), det(20, 0, 29, 9, 0.8, "blue")]}, True, 0.0),  # 2nd car: not checked by GenEval
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
     {"car": [det(0, 0, 9, 9, 0.9, "blue"), det(20, 0, 29, 9, 0.8, "red")]}, False, 0.0),  # the most confident decides
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
     {"car": [det(0, 0, 9, 9, 0.9, "red")]}, True, 1.0),
    ({"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
     {"cat": [det(90, 40, 110, 60)], "dog": [det(0, 40, 20, 60)]}, True, 1.0),
    # relation fails: GenEval says no; Flow-GRPO's terms are [1, 1, 0, 1] (its failed check adds 0 and then 1)
    ({"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}]},
     {"cat": [det(90, 40, 110, 60)], "dog": [det(0, 40, 20, 60)]}, False, 0.75),
    # no target object: the position clause cannot be checked: [0 (cat), 1 (dog), 0 (no target)]
    ({"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
     {"dog": [det(0, 40, 20, 60)]}, False, 1 / 3),
    ({"tag": "color_attr", "include": [{"class": "bus", "count": 1, "color": "yellow"}, {"class": "tie", "count": 1, "color": "green"}]},
     {"bus": [det(0, 0, 50, 50, 0.9, "yellow")], "tie": [det(60, 0, 70, 30, 0.9, "yellow")]}, False, 0.75),
]


@pytest.mark.parametrize("metadata,objects,correct,partial_score", GENEVAL_RULE_CASES)
def test_geneval_rules_on_hand_built_detections(metadata, objects, correct, partial_score):
    verdict, reasons = rewards.geneval_correct(objects, metadata)
    assert verdict == correct and bool(reasons) == (not correct)
    assert rewards.geneval_partial(objects, metadata) == pytest.approx(partial_score, abs=1e-12)


def test_geneval_metadata_is_checked_before_training():
    rewards.check_prompt("geneval", "a photo of a dog", {"tag": "single_object", "include": [{"class": "dog", "count": 1}]})
    for bad in ({}, {"tag": "single_object"}, {"tag": "nonsense", "include": []},
                {"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]},
                {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "teal"}]},
                {"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]},
                [5], {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": {"class": "dog", "count": 3}},
                {"tag": "counting", "include": [{"class": "dog", "count": 2}],
                 "exclude": [{"class": "dog", "count": 3, "position": ["left of", 0]}]}):
        with pytest.raises(ValueError, match="geneval|GenEval"):
            rewards.check_prompt("geneval", "a photo", bad)
