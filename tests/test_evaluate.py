"""Tests of evaluate.py: base, runs and exported LoRAs side by side, GenEval's accuracy, real width in bf16,
video runs, bad input.
"""

import json
import math
import subprocess
import sys
import threading
from dataclasses import asdict

import numpy as np
import pytest
import torch

import builders
import checkpoint
import evaluate
import models
import prompts as prompt_sets
import reward_bridge
import train
from helpers import ROOT, one_line_stop, run_here, stub_geneval_scorer


def run_evaluate(*args, nproc=0, here=True, timeout=600):
    """evaluate.py under torchrun with nproc processes, as a subprocess; with nproc=0 and `here`, evaluate.main in this
    process (here=False for real width: as run_train)."""
    if not nproc and here:
        return run_here(evaluate.main, *args)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc \
        else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "evaluate.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_evaluate_takes_a_video_runs_prompts_and_may_score_its_monitors(tmp_path):
    """evaluate.py on a tiny-wan run: the built-in prompts are the video ones (the motion reward needs their direction
    words), and --rewards may name the run's monitor (before: "already trained on", as validation met the run's
    --monitor_rewards beside the evaluated rewards). Checked without a model: the configuration evaluate.py builds."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("iter-000000")
    config = train.Config(preset="tiny-wan", **train.PRESETS["tiny-wan"])
    (run / "config.json").write_text(json.dumps(asdict(config)))
    args, cfg = evaluate.parse_args(["--runs", str(run), "--rewards", "color,motion"])
    assert train.validate(cfg, 1) == "wan" and cfg.num_frames == config.num_frames
    spec, listed = evaluate.evaluation_prompts(args, cfg, say=lambda *_: None)
    assert [p.text for p in listed] == builders.TINY_VIDEO_PROMPTS


@pytest.mark.parametrize("spec,expected_rewards", [
    ("ocr", "ocr"), ("geneval:test", "geneval"),
    ("pickscore", "imagereward,pickscore,aesthetic,unifiedreward,clipscore,hpsv21"),
    ("drawbench", "imagereward,pickscore,aesthetic,unifiedreward,clipscore,hpsv21")])
def test_the_papers_sets_are_evaluated_with_diffusionnfts_protocol_unless_a_flag_says_otherwise(spec, expected_rewards):
    """DiffusionNFT's scripts/evaluation.py, written out from its code: num_inference_steps 40, guidance_scale 1.0,
    resolution 512, the pipeline's own call (SD3: Euler on its grid), one image per test prompt, and per dataset the
    scorers of its all_reward_scorers (hpsv2 = HPSv2.1). Before, the run's or preset's sampler and rewards."""
    args, cfg = evaluate.parse_args(["--prompts", spec])
    assert (cfg.sampling_steps, cfg.cfg_scale, cfg.resolution, cfg.solver) == (40, 1.0, 512, "euler")
    assert cfg.rewards == expected_rewards and args.samples_per_prompt == 1
    _, cfg = evaluate.parse_args(["--prompts", spec, "--sampling_steps", "8", "--rewards", "color"])
    assert (cfg.sampling_steps, cfg.rewards, cfg.resolution) == (8, "color", 512)
    _, cfg = evaluate.parse_args(["--prompts", "hpdv2"])  # not one of the paper's sets: the preset's sampler
    assert (cfg.sampling_steps, cfg.resolution) != (40, 512)


def test_a_table_with_the_papers_columns_ends_with_its_published_rows():
    summaries = {"base": {"ocr": {"mean": 0.5, "ci95": 0.01}, "pickscore": {"mean": 0.21, "ci95": 0.001},
                          "color": {"mean": 0.3, "ci95": 0.01}}}
    table = evaluate.markdown_table(summaries)
    assert "| model | ocr | pickscore |" in table  # the shared columns only, in the table's order
    assert "| + V-GRPO, 580 steps (paper) | 0.91 | 0.235 |" in table
    assert "| + DiffusionNFT, ~1.7K steps (paper) | 0.91 | 0.238 |" in table
    assert "Published" not in evaluate.markdown_table({"base": {"color": {"mean": 0.3, "ci95": 0.01}}})


def test_evaluate_scores_base_run_and_export_side_by_side(sd3_run, tmp_path):
    """The same prompts and noise for every row: the exported LoRA scores exactly as the run's checkpoint, the base
    differently; the table has a 95% interval per reward; two processes give the same scores as one."""
    args = ["--runs", str(sd3_run), "--loras", str(sd3_run / "final"), "--rewards", "color,jpeg_compressibility",
            "--max_prompts", "6", "--samples_per_prompt", "2"]
    one = run_evaluate(*args, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    result = json.loads((tmp_path / "one" / "eval.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["base", f"run:{sd3_run}", f"lora:{sd3_run / 'final'}"]
    run, lora, base = rows[f"run:{sd3_run}"], rows[f"lora:{sd3_run / 'final'}"], rows["base"]
    assert len(run["scores"]["color"]) == 12 and run["scores"] == lora["scores"]
    assert base["scores"]["color"] != run["scores"]["color"]
    per_prompt = np.asarray(run["scores"]["color"]).reshape(6, 2).mean(1)
    assert run["metrics"]["color"]["mean"] == pytest.approx(per_prompt.mean())
    assert run["metrics"]["color"]["ci95"] == pytest.approx(1.96 * per_prompt.std(ddof=1) / math.sqrt(6))
    table = (tmp_path / "one" / "table.md").read_text()
    assert table.count("\n| ") == 3 and "±" in table and table.splitlines()[0] in one.stdout
    assert (tmp_path / "one" / "grid.png").stat().st_size > 0
    two = run_evaluate(*args, "--out", str(tmp_path / "two"), nproc=2)
    assert two.returncode == 0, two.stderr[-2000:]
    rows_two = json.loads((tmp_path / "two" / "eval.json").read_text())["rows"]
    # One and two processes differ below float32 rounding (the text encoders see one or two prompts per batch; the
    # thread counts differ), which can move a decoded pixel across a uint8 level: the colour reward averages the
    # pixels (a level moves it by 1e-6), the JPEG's size moves in whole bytes, 0.001 of jpeg_compressibility (kB)
    # each. Seen with OMP_NUM_THREADS=1: one byte; allowed: 4. Other noise or another model moves both by far more.
    for name in rows:
        np.testing.assert_allclose(rows_two[name]["scores"]["color"], rows[name]["scores"]["color"], atol=1e-5)
        np.testing.assert_allclose(rows_two[name]["scores"]["jpeg_compressibility"],
                                   rows[name]["scores"]["jpeg_compressibility"], atol=4 * 0.001 + 1e-6)


def test_evaluate_reports_genevals_accuracy_per_task(sd3_run, tmp_path):
    server = reward_bridge.reward_server(stub_geneval_scorer(), "geneval", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        options = json.dumps({"geneval": {"url": f"http://127.0.0.1:{server.server_port}"}})
        result = run_evaluate("--runs", str(sd3_run), "--no-base", "--prompts", "geneval-generated", "--rewards", "geneval",
                              "--reward_options", options, "--max_prompts", "200", "--out", str(tmp_path / "g"))
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "g" / "eval.json").read_text())["rows"]
    row = rows[f"run:{sd3_run}"]
    accuracy, tags = row["extras"]["geneval"]["accuracy"], [p.metadata["tag"] for p in prompt_sets.load("geneval-generated:test")[:200]]
    tasks = {t: np.mean([a for a, tag in zip(accuracy, tags) if tag == t]) for t in set(tags)}
    assert row["metrics"]["geneval accuracy"]["tasks"] == pytest.approx(tasks)
    assert row["metrics"]["geneval accuracy"]["mean"] == pytest.approx(np.mean(list(tasks.values())))
    assert "geneval accuracy per task" in (tmp_path / "g" / "table.md").read_text()


def test_evaluate_at_real_width_in_bf16_scores_base_against_a_lora(real_dirs, tmp_path, bf16_matmul_fast):
    """SD3.5-Medium's real widths, 2 blocks, bf16 compute: one prompt, the base and an exported LoRA whose B
    matrices were moved away from zero, so their samples must differ."""
    model = models.load_pipeline(train.Config(model=str(real_dirs / "sd3.5-medium"), lora_alpha=64),
                                 "sd3", torch.device("cpu"), torch.float32)
    models.make_trainable(model.transformer, train.Config())
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    checkpoint.write_export(tmp_path / "lora", model, {k: v for k, v in model.transformer.state_dict().items()}, lora=True)
    (tmp_path / "one.txt").write_text("a red car\n")
    result = run_evaluate("--model", str(real_dirs / "sd3.5-medium"), "--loras", str(tmp_path / "lora"), "--prompts",
                          str(tmp_path / "one.txt"), "--rewards", "color,jpeg_compressibility", "--dtype", "bfloat16",
                          "--resolution", "32", "--max_sequence_length", "4", "--sampling_steps", "2",
                          "--out", str(tmp_path / "e"), here=False)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "e" / "eval.json").read_text())["rows"]
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["settings"]["dtype"] == "bfloat16"
    base, lora = rows["base"]["scores"], rows[f"lora:{tmp_path / 'lora'}"]["scores"]
    assert all(math.isfinite(v) for s in (base, lora) for vs in s.values() for v in vs)
    assert base["color"] != lora["color"]  # a mean of pixels: any change moves it (a 32 px JPEG's size may not)


@pytest.mark.parametrize("argv,message", [
    (["--runs", "/nonexistent"], "no checkpoint there"),
    (["--loras", "/nonexistent"], "no pytorch_lora_weights.safetensors"),
    (["--no-base"], "nothing to evaluate"),
    (["--samples_per_prompt", "0"], "must be >= 1"),
    (["--prompts", "drawbench:train"], "no 'train' split"),
    (["--rewards", "nonsense"], "unknown reward"),
])
def test_evaluate_bad_input_is_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(models, "load_pipeline", lambda *a: pytest.fail("a model was loaded"))
    assert message in one_line_stop(evaluate.main, argv, capsys)


def test_evaluate_error_is_one_line_on_stderr_without_traceback():
    """What a user sees: `python evaluate.py` itself, as a process."""
    result = run_evaluate("--runs", "/nonexistent", here=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["error: --runs /nonexistent: no checkpoint there (checkpoints/latest is missing)"]
