"""Tests of runs.py: the run directory's sample grids and curves.
"""

import json
import sys

import numpy as np
import torch

import runs


def test_video_samples_are_written_as_an_animated_grid_frame_by_frame(tmp_path):
    """Videos (B, F, 3, H, W) give an animated WebP of F grids, frame f of each cell showing the video's frame f
    (lossless, enlarged nearest); images still give a PNG."""
    from PIL import Image

    colours = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(0))  # (video, frame, rgb)
    videos = colours[:, :, :, None, None].expand(2, 3, 3, 8, 8)
    written = runs.save_samples(videos, ["a red car | color 0.5", "a blue car"], [{"prompt": "a red car"}],
                                tmp_path / "iter-000001.png")
    assert written == tmp_path / "iter-000001.webp" and (tmp_path / "iter-000001.json").is_file()
    animation = Image.open(written)
    assert animation.n_frames == 3
    for f in range(3):
        animation.seek(f)
        frame = np.asarray(animation.convert("RGB")).astype(int)
        for b in range(2):
            want = (colours[b, f] * 255).round().int().numpy()
            assert np.abs(frame[64, 128 * b + 64] - want).max() <= 1, (f, b)  # the centre of cell b
    assert runs.save_samples(videos[:, 0], ["a", "b"], None, tmp_path / "still.png") == tmp_path / "still.png"
    assert Image.open(tmp_path / "still.png").format == "PNG"


def test_curves_are_drawn_from_metrics_and_a_missing_matplotlib_is_a_hint(tmp_path, monkeypatch):
    lines = [{"iteration": i, "reward/color_mean": 0.5 + i / 100, "kl": 0.01, "approx_kl": 0.0, "clipfrac": 0.1,
              **({"eval/color_mean": 0.5, "eval/reward_mean": 0.5} if i % 2 == 0 else {})} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"iteration": 6, "rew')
    assert runs.draw_curves(tmp_path)  # the torn last line is left out
    from PIL import Image

    assert Image.open(tmp_path / "curves.png").size[0] > 4 * Image.open(tmp_path / "curves.png").size[1] / 2
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert not runs.plot_curves(lines, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
