"""Tests of builders.py: the toy images and videos the tiny models are fitted to.
"""

import math

import torch

import builders
import rewards


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
