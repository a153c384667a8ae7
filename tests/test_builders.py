"""Tests of builders.py: the toy images and videos the tiny models are fitted to, and the committed fitted bases.
"""

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import builders
import failures
import rewards
from helpers import DIFFUSERS_FROM_GRID, ROOT


def test_toy_images_captions_name_the_shape_and_mostly_the_true_colour():
    images, captions = builders.toy_images(400, torch.Generator().manual_seed(0))
    assert images.shape == (400, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    palette = torch.tensor(list(rewards.COLORS.values()))
    corner = images[:, :, 0, 0]
    assert torch.allclose(corner, torch.full_like(corner, 0.5))  # grey background
    centre = images[:, :, 16, 16]  # the shape always covers the centre
    named = torch.tensor([list(rewards.COLORS).index(c.split()[1]) for c in captions])
    truthful = (torch.cdist(centre, palette).argmin(1) == named).float().mean().item()
    assert 0.7 < truthful < 0.85  # 75% true + 25% random (a random pick is right 1/8 of the time)


def test_toy_videos_move_a_square_12_px_and_their_captions_name_the_direction_7_times_in_10():
    """builders.toy_videos, checked through the motion reward's closed form: in every video the square travels 12 px
    (of 32) along one axis, so the four directions score 0.375, 0, 0 and -0.375; the caption names the true
    direction 3 times in 5, else a random one (right in 1 of 4 of those): 0.7 of the captions."""
    videos, captions = builders.toy_videos(400, torch.Generator().manual_seed(0))
    assert videos.shape == (400, builders.TINY_FRAMES, 3, 32, 32) and 0 <= videos.min() and videos.max() <= 1
    reward = rewards.motion()
    scores = torch.stack([reward(videos, [f"moving {way}"] * len(videos)) for way in rewards.DIRECTIONS], dim=1)
    torch.testing.assert_close(scores.sort(dim=1).values, torch.tensor([-0.375, 0, 0, 0.375]).expand(400, 4))
    named = torch.tensor([list(rewards.DIRECTIONS).index(c.split()[-1]) for c in captions])
    right = (named == scores.argmax(dim=1)).float().mean().item()
    assert abs(right - 0.7) < 3 * math.sqrt(0.7 * 0.3 / 400), right


STATE_DIGEST = """
import hashlib, sys
import builders
for seed in sys.argv[1:]:
    pipe = builders.tiny_pipeline("sd3", seed=int(seed), fit_steps=250)
    digest = hashlib.sha256()
    for part in ("vae", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3"):
        for name, tensor in sorted(getattr(pipe, part).state_dict().items()):
            digest.update(name.encode() + tensor.numpy().tobytes())
    print(digest.hexdigest())
"""


def test_the_fitted_tiny_bases_are_byte_identical_whatever_the_thread_count():
    """Before: the fit behind `python train.py` summed in an order set by the thread count, so one seed's base
    started RL at a rollout reward of 0.5708 with OMP_NUM_THREADS=1 and 0.5625 with 2. The bases are now committed
    files checked against their sha256: every weight the same with 1 and 2 threads, and the fitted parts the file's.
    (All seeds in one process per thread count: one test of three, 36 s -> 14 s.)"""
    seeds = sorted(str(seed) for family, seed, _ in builders.FITTED if family == "sd3")
    digests = {threads: subprocess.run([sys.executable, "-c", STATE_DIGEST, *seeds], capture_output=True, text=True,
                                       check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)}
                                       ).stdout.split() for threads in (1, 2)}
    assert digests[1] == digests[2] and len(digests[1]) == len(seeds) and all(len(d) == 64 for d in digests[1])
    from safetensors.torch import load_file

    for seed in map(int, seeds):
        pipe, saved = builders.tiny_pipeline("sd3", seed=seed, fit_steps=250), load_file(builders.fitted_file("sd3", seed, 250))
        for part in builders.FITTED_PARTS:
            for name, tensor in getattr(pipe, part).state_dict().items():
                assert torch.equal(tensor, saved[f"{part}.{name}"]), (seed, part, name)


def test_a_damaged_fitted_base_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, "ASSETS", tmp_path)
    shutil.copy(ROOT / "assets" / "tiny-sd3-seed0-fit250.safetensors", tmp_path)
    with open(tmp_path / "tiny-sd3-seed0-fit250.safetensors", "r+b") as file:
        file.seek(1000)
        file.write(b"\x00\x01")
    with pytest.raises(failures.ConfigError, match="not the committed file .* restore it from the repository"):
        builders.tiny_pipeline("sd3", seed=0, fit_steps=250)


@pytest.mark.parametrize("embed_dim,grid_size,base_size,interpolation_scale", [
    (64, 48, 32, 1.0),  # SD3-medium's pattern (pos_embed_max_size 192, sample 128 / patch 2) at a quarter of the size
    (96, 96, 64, 1.0),  # SD3.5's (384, sample 128 / patch 2 and 64 / patch 2)
    (32, 24, 8, 2.0),  # interpolation_scale != 1: coordinates that are not integers
])
def test_the_fast_sd3_position_table_is_diffusers_own_in_float32(embed_dim, grid_size, base_size, interpolation_scale,
                                                                 monkeypatch):
    """conftest.sd3_position_table_fast puts helpers.sincos_table_from_grid in diffusers' place for every SD3 model the
    tests build: the same numbers as diffusers' own table, rounded to float32 as PatchEmbed stores it."""
    from diffusers.models import embeddings

    args = (embed_dim, grid_size)
    kwargs = dict(base_size=base_size, interpolation_scale=interpolation_scale, output_type="pt")
    fast = embeddings.get_2d_sincos_pos_embed(*args, **kwargs)
    monkeypatch.setattr(embeddings, "get_2d_sincos_pos_embed_from_grid", DIFFUSERS_FROM_GRID)
    theirs = embeddings.get_2d_sincos_pos_embed(*args, **kwargs)
    assert theirs.dtype == torch.float64 and fast.dtype == torch.float32
    assert torch.equal(fast, theirs.float()) and fast.shape == (grid_size ** 2, embed_dim)
