"""Tests of runs.py: the run directory: the same command continues a run (a requeue, a restart), --fresh, a finished
run, leftovers of an interrupted save, the trackers; its sample grids and curves.
"""

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import models
import runs
import train
from helpers import ROOT, SMALL_RUN, lora_weights, one_line_stop, read_metrics, run_train


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


def test_curves_draw_one_line_per_distinct_series_and_the_reference_kl():
    """Before: the evaluation panel drew `color` and `reward` as two identical lines (one reward of weight 1), and the
    KL panel had no ref_kl although the reference KL was logged."""
    lines = [{"iteration": i, "reward/color_mean": 0.5 + i / 100, "kl": 0.01 * i, "approx_kl": 0.0, "ref_kl": 0.02 * i,
              "clipfrac": 0.1, "eval/color_mean": 0.5 + i / 50, "eval/reward_mean": 0.5 + i / 50,
              "eval/jpeg_compressibility_mean": -1.0} for i in range(4)]
    panels = runs.curve_series(lines)
    assert list(panels["evaluation reward"]) == ["color = reward", "jpeg_compressibility"]
    assert panels["evaluation reward"]["color = reward"] == [(i, 0.5 + i / 50) for i in range(4)]
    assert sorted(panels["KL"]) == ["approx_kl", "kl", "ref_kl"] and list(panels["training reward"]) == ["color"]


# ----------------------------------------------------------------------------------------------
# The same command again: a requeued or restarted job continues its run


def tree_digest(root: Path) -> dict:
    """{relative path: sha256} of every file under root: what "changes nothing" compares."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_the_same_command_again_continues_its_run_and_a_finished_run_changes_nothing(tiny_dirs, sd3_straight,
                                                                                      tmp_path):
    """Before: the same command run again (a Slurm requeue, up-arrow) started at iteration 0 and overwrote
    metrics.jsonl, the checkpoints and final/ without a word. Now a run stopped by SIGTERM continues from its
    checkpoint with every iteration logged once and the straight run's weights; run once more, the finished run says so
    and no byte changes. (Ctrl-C: test_failures.py.)"""
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
           *SMALL_RUN, "--iterations", "4", "--run_dir", tmp_path / "run"]
    first = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((tmp_path / "run" / "metrics.jsonl").is_file() and read_metrics(tmp_path / "run")):
        assert first.poll() is None and time.time() < deadline, "training did not get going"
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)  # what a scheduler sends before preempting or requeueing the job
    output = first.communicate(timeout=120)[0]
    stopped_at = read_metrics(tmp_path / "run")[-1]["iteration"]
    assert first.returncode == 0, output[-2000:]
    assert f"stop requested (SIGTERM/SIGINT): checkpoint of iteration {stopped_at} saved" in output, output[-2000:]
    assert stopped_at < 3  # stopped early (4 iterations of about a second each after the first line)
    checkpoints = tmp_path / "run" / "checkpoints"  # the iteration it stopped in, whole; no final export
    assert (checkpoints / "latest").read_text() == f"iter-{stopped_at:06d}" and not list(checkpoints.glob(".tmp-*"))
    assert not (tmp_path / "run" / "final").exists()
    again = run_train(*cmd[2:])
    assert f"continuing {tmp_path / 'run'} at iteration {stopped_at + 1} of 4" in again.stdout
    straight, continued = read_metrics(sd3_straight), read_metrics(tmp_path / "run")
    assert [m["iteration"] for m in continued] == [0, 1, 2, 3]
    assert [m["prompt_indices"] for m in continued] == [m["prompt_indices"] for m in straight]
    for k, v in lora_weights(sd3_straight).items():
        assert torch.equal(lora_weights(tmp_path / "run")[k], v), k
    before = tree_digest(tmp_path / "run")
    done = run_train(*cmd[2:])
    assert f"{tmp_path / 'run'} is finished: it trained 4 iterations" in done.stdout and "iter " not in done.stdout
    assert tree_digest(tmp_path / "run") == before


def test_a_run_dir_is_continued_only_by_its_own_command_and_fresh_starts_it_over(sd3_run, tmp_path, monkeypatch,
                                                                                  capsys):
    """Another command on a run directory is refused in one line naming the way to each intent (--resume, --fresh,
    another --run_dir); settings that change no result (how long, how often it saves, the hardware) continue it;
    --fresh removes the run's own files and nothing else, except in a restart of the same job (torchrun, Slurm)."""
    run = tmp_path / "run"
    shutil.copytree(sd3_run, run)
    saved = json.loads((run / "config.json").read_text())
    text = one_line_stop(train.main, ["--run_dir", run, "--lr", "0.003"], capsys)
    assert f"--run_dir {run} holds a run with other settings: --lr 0.003 (the run's: {saved['lr']})" in text
    assert f"(--resume {run}), start it over (--fresh)" in text
    assert train.parse_config(["--run_dir", str(run), "--iterations", "9", "--save_every", "3"]).lr == saved["lr"]
    # a config.json from before a flag existed: the flag at its default changes nothing of the run
    (run / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "frame_interval"}))
    assert train.parse_config(["--run_dir", str(run), "--frame_interval", "0"]).lr == saved["lr"]
    (run / "config.json").write_text(json.dumps(saved))
    assert train.parse_config(["--run_dir", str(run), "--lr", "0.003", "--resume", str(run)]).lr == 0.003
    (run / "notes.txt").write_text("mine")
    fresh = train.parse_config(["--run_dir", str(run), "--lr", "0.003", "--fresh"])
    assert fresh.lr == 0.003 and fresh.model == "tiny"  # not the run's: a new run
    runs.start_run_dir(run, {"lr": 0.003}, fresh=train.fresh_start(fresh))
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "notes.txt"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted: --fresh began this run, the restart continues it
    shutil.rmtree(run)
    shutil.copytree(sd3_run, run)
    assert train.parse_config(["--run_dir", str(run), "--fresh"]).model == saved["model"]
    assert not train.fresh_start(train.parse_config(["--run_dir", str(run), "--fresh"]))


def test_run_files_without_a_run_and_max_restarts_without_a_run_dir_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    text = one_line_stop(train.main, ["--run_dir", tmp_path], capsys)
    assert f"--run_dir {tmp_path} holds metrics.jsonl but no config.json of a run: pass --fresh" in text
    runs.check_run_dir(str(tmp_path), continuing=False, fresh=True)  # --fresh replaces them
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    text = one_line_stop(train.main, [], capsys)
    assert "torchrun --max_restarts restarts the workers with the same flags: pass --run_dir" in text


def test_leftovers_of_an_interrupted_save_are_removed_at_the_next_start(sd3_run, tmp_path):
    """A kill during a save leaves checkpoints/.tmp-NNNNNN (seen: the survivor of a killed rank), or a whole
    checkpoint `latest` does not name yet, or an export's temporary folder: the next start removes them and keeps
    the checkpoint `latest` names."""
    run = tmp_path / "run"
    shutil.copytree(sd3_run, run)
    ckpt = run / "checkpoints"
    shutil.copytree(ckpt / "iter-000001", ckpt / ".tmp-000002")
    shutil.copytree(ckpt / "iter-000001", ckpt / "iter-000003")
    (ckpt / "latest.tmp").write_text("iter-000003")
    shutil.copytree(run / "final", run / ".final.tmp")
    kept = tree_digest(ckpt / "iter-000001")
    runs.start_run_dir(run, json.loads((run / "config.json").read_text()), fresh=False)
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter-000001", "latest"]
    assert not (run / ".final.tmp").exists() and tree_digest(ckpt / "iter-000001") == kept


def test_a_continued_run_continues_its_tracker_run(sd3_run, tmp_path, monkeypatch):
    """tensorboard: the events from the resumed iteration on are hidden (purge_step), so each iteration shows once;
    wandb: the same run id (tracker.json) with resume="allow", so the continued run logs to the same wandb run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    run.mkdir()
    cfg = train.Config(tracker="tensorboard")
    tracker = runs.Tracker(run, cfg, active=True)
    for it in range(4):
        tracker.log(it, {"reward_mean": float(it)})
    tracker.backend.close()
    tracker = runs.Tracker(run, cfg, active=True, start=2)  # continued from the checkpoint of iteration 1
    for it in range(2, 4):
        tracker.log(it, {"reward_mean": 10.0 + it})
    tracker.backend.close()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    assert [m["reward_mean"] for m in runs.read_metrics(run)] == [0.0, 1.0, 12.0, 13.0]
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: calls.append(kw)))
    for start in (0, 2):
        runs.Tracker(run, train.Config(tracker="wandb"), active=True, start=start)
    assert calls[0]["id"] == calls[1]["id"] and len(calls[0]["id"]) == 16 and calls[1]["resume"] == "allow"
