"""Tests of bench.py: its sections' accounting and tables on tiny settings.
"""

import math
import subprocess
import sys

import pytest
import torch

import bench
import bench_gpu
import builders
import models
import train
from helpers import IMAGE_FAMILIES, run_here


@pytest.fixture
def train_in_process(monkeypatch):
    """bench.py's and bench_gpu.py's `python train.py ARGS` runs as train.main(ARGS) in the test's process
    (helpers.run_here), other commands as they are: a fresh interpreter's imports are ~6 s of each such run on these
    CPUs (the real-model section test spent 30 of its 44 s on them), and the CLI has tests of its own (test_train.py,
    test_failures.py)."""
    launch = subprocess.run

    def run(command, *, check=False, **kwargs):
        if command[0] != sys.executable or not str(command[1]).endswith("train.py"):
            return launch(command, check=check, **kwargs)
        proc = run_here(train.main, *command[2:])
        if check and proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, command, proc.stdout, proc.stderr)
        return proc
    monkeypatch.setattr(subprocess, "run", run)


def test_sd3_stability_section_counts_each_methods_evaluations_on_the_same_evaluation(tmp_path, train_in_process):
    """Section 9's code path at 2 iterations, random tiny SD3: train.py and flow_grpo_sd3 start from the same weights
    and evaluation (equal first evaluation up to one update), and each counts its own optimizer steps and model
    evaluations per iteration: 2 steps and 64 samples x (8 ODE steps + K = 8 forwards and 8 backwards + 4 old-policy
    forwards: the tiny preset's second mini-batch + 0.5: the reference pass that logs ref_kl on one micro-batch of 4
    samples x K = 8) against 2 steps and 64 x (10 SDE steps + 9 trained steps x (forward, backward, reference
    forward))."""
    text, data = bench.section_sd3_stability(tmp_path, seeds=(0,), lrs={"V-GRPO": (1e-3,), bench.MDP: (1e-3,)},
                                             iterations={"V-GRPO": 2, bench.MDP: 2}, eval_every=1, fit_steps=0,
                                             flags=("--eval_samples", "8"))
    ours, base = data["histories"]["V-GRPO"]["0.001"][0], data["histories"][bench.MDP]["0.001"][0]
    assert [(h["grad_steps"], h["nfe_fwd"], h["nfe_bwd"]) for h in ours] == [(2, 64 * 20.5, 64 * 8), (4, 2 * 64 * 20.5, 2 * 64 * 8)]
    assert [(h["grad_steps"], h["nfe_fwd"], h["nfe_bwd"]) for h in base] == [(2, 64 * 28, 64 * 9), (4, 2 * 64 * 28, 2 * 64 * 9)]
    assert [h["nfe"] for h in ours] == [64 * 28.5, 2 * 64 * 28.5] and [h["nfe"] for h in base] == [64 * 37, 2 * 64 * 37]
    assert all(h["eval"] is not None and h["seconds"] > 0 for h in ours + base)
    assert abs(ours[0]["eval"] - base[0]["eval"]) < 1e-3
    assert text.count("\n| V-GRPO | 0.001 |") == len(bench.SD3_THRESHOLDS) == text.count(f"\n| {bench.MDP} | 0.001 |")


def test_comparison_takes_each_methods_best_learning_rate_among_those_every_seed_reaches():
    def cost(nfe):
        return None if nfe is None else dict(iterations=1, nfe=nfe, seconds=nfe / 100)

    costs = {"V-GRPO": {1e-3: [cost(10), cost(30)], 3e-3: [cost(5), None]},  # 3e-3 is cheaper but misses a seed
             bench.MDP: {1e-3: [cost(80), cost(60)], 3e-3: [cost(40), cost(30)]}}
    assert bench.best_lr(costs["V-GRPO"]) == 1e-3 and bench.best_lr(costs[bench.MDP]) == 3e-3
    same, best = bench.comparison(costs, 1e-3).splitlines()
    assert "at the same lr 0.001: model evaluations x5.000 ± 3.000" in same  # 80/10, 60/30
    assert "each at its best lr (V-GRPO 0.001, Flow-GRPO (MDP) 0.003): model evaluations x2.500 ± 1.500" in best
    costs["V-GRPO"][1e-3][1] = None
    assert "best against best: not comparable (V-GRPO" in bench.comparison(costs, 1e-3)


def test_stability_table_counts_success_only_before_a_divergence():
    def run(rewards, fracs):
        return [{"reward_mean": r, "frac_target_mode": f, "nfe_fwd": 100 * i, "nfe_bwd": 50 * i}
                for i, (r, f) in enumerate(zip(rewards, fracs), 1)]

    steady = run([-2.0, -1.0, -0.5, -0.6], [0.3, 0.95, 0.99, 0.99])
    late = run([-2.0, -11.0, -0.5, -0.4], [0.3, 0.4, 0.95, 0.99])  # succeeds only after leaving the range
    broken = run([-2.0, -1.0, float("nan"), float("nan")], [0.3, 0.95, 0.1, 0.1])  # succeeds, then non-finite
    assert [bench.diverged_at(h) for h in (steady, late, broken)] == [None, 1, 2]
    row = bench.stability_row("v", 1e-2, [steady, late, broken])
    # diverged 2/3; success counted for steady and broken (before its divergence), at iteration 1 with 300 evaluations;
    # fall-back only over runs that did not diverge: best -0.5, final -0.6
    assert row == ["v", "0.01", "2/3", "2/3", "1", "0k", "0.100"]


def test_bench_gpu_section_runs_every_family_at_tiny_sizes_on_cpu():
    """The GPU section's code path (random transformers built directly in their dtype, LoRA, activation
    checkpointing, the preset's CFG in the sampling step) for every family, at the tiny pipelines' sizes."""
    tiny = {family: dict(family=family, config=dict(builders.tiny_pipeline(family).transformer.config), resolution=32,
                         steps=2, tokens=8, cfg=4.0 if family in ("qwenimage", "flux2") else 1.0, samples=2)
            for family in IMAGE_FAMILIES}  # the families bench.py's GPU section measures
    text, results = bench_gpu.section_gpu(tiny, device=torch.device("cpu"), dtype=torch.float32,
                                          rollout_batches={n: (2,) for n in tiny}, backend="eager")
    assert set(results) == {f"{n} ckpt={c}" for n in tiny for c in (False, True)} | {f"{n} rollout-batch=2" for n in tiny}
    training = [r for key, r in results.items() if "ckpt" in key]
    assert all(r["step_s"] > 0 and r["floor_s"] > 0 and math.isfinite(r["ratio"]) for r in training)
    assert all(text.count(f"\n| {n} |") == 3 for n in tiny)
    # FLOPs of a sampling step: at least those of its linear layers, 2 x in x out per row, counted by hooks
    for n, spec in tiny.items():
        model, linear = bench_gpu.RandomModel(spec, torch.device("cpu"), torch.float32), []
        for m in model.transformer.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda m, args, out: linear.append(2 * out.numel() * m.in_features))
        cond = {k: v.expand(2, *v.shape[1:]) for k, v in model.cond_template.items()}
        velocity = model.guided(model.velocity, model.cond_template, spec["cfg"]) if spec["cfg"] != 1 else model.velocity
        with torch.no_grad():
            velocity(torch.randn(2, *model.latent_shape()), torch.full((2,), 0.5), cond)
        r = results[f"{n} rollout-batch=2"]
        assert sum(linear) <= r["flops"] and r["eager_mfu"] is None and r["compiled_images_per_s"] > 0
    model = bench_gpu.RandomModel({**tiny["qwenimage"], "samples": 2}, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.transformer.parameters()} == {torch.bfloat16}
    assert torch.equal(model.cond_template["mask"], torch.ones_like(model.cond_template["mask"]))
    assert model.cond_template["embeds"].std() > 0.5  # random text features, not cond_like's zeros


def test_bench_real_model_section_runs_the_checks_on_saved_pipelines(tiny_dirs, train_in_process):
    """Section 6's code path, on the tiny pipelines in place of the hub checkpoints."""
    small = ("--resolution", "32", "--max_sequence_length", "8", "--sampling_steps", "3", "--tiny_fit_steps", "0",
             "--lr", "1e-2", "--micro_batch_size", "1")
    presets = {"sd35m": "sd3", "flux": "flux", "qwenimage": "qwenimage", "flux2": "flux2"}
    text, results = bench_gpu.section_real_models({p: tiny_dirs / family for p, family in presets.items()},
                                                  device=torch.device("cpu"), small_run=small)
    for r in results.values():
        assert r["rollout_vs_pipe"] < 1e-5 and r["export_vs_trained"] < 1e-5 < 1e-4 < r["trained_vs_base"]
        assert r["checkpoint_dtypes"] == ["torch.float32"]
    assert all(text.count(f"\n| {p} |") == 1 for p in presets)


def test_bench_scale_section_counts_the_old_pass_rows_it_saves():
    model = bench.tiny_model()
    model.transformer.add_adapter(models.lora_config(train.Config()))
    saving = bench.old_pass_saving(model, model.encode(["a red car"]), samples=8, num_grad_steps=2, repeats=1)
    assert saving["rows_per_sample"] == {"before": {"grad": 4, "no_grad": 4}, "after": {"grad": 4, "no_grad": 2}}
    assert saving["before_s"] > 0 and saving["after_s"] > 0


def test_peers_section_takes_each_methods_best_lr_and_compares_run_by_run(tmp_path, monkeypatch):
    """Section 11 on made-up histories: the eval climbs `rate` per optimizer step from 0.5 (a method's rate at each lr;
    V-GRPO's fastest lr misses the gain on one sweep seed, so its slower one is taken); the tables count the runs
    reaching each gain and give the peer's cost over V-GRPO's per base and seed."""
    rates = {("V-GRPO", 1e-3): 0.01, ("V-GRPO", 3e-3): 0.03, ("DiffusionNFT", 1e-3): 0.005, ("DiffusionNFT", 3e-3): 0.002}

    def history(method, task, base, seed, lr):
        rate = 0.0 if (method, lr, seed) == ("V-GRPO", 3e-3, 1) else rates[method, lr]
        return [dict(eval=0.5 + rate * 2 * i, grad_steps=2 * i, nfe_fwd=100 * i, nfe_bwd=40 * i, nfe=140 * i,
                     seconds=1.5 * i, reward_mean=0.5) for i in range(12)]

    def peer_runs(keys, **_):
        return {key: history(*key) for key in keys}

    monkeypatch.setattr(bench, "peer_runs", peer_runs)
    monkeypatch.setattr(bench, "base_eval", lambda root, base, task: 0.5)
    monkeypatch.setattr(bench, "PEER_GAINS", {"color": (0.02, 0.04, 0.2)})
    text, data = bench.section_peers(tmp_path, tasks=("color",), methods=("V-GRPO", "DiffusionNFT"), bases=(0, 1),
                                     seeds=(0, 1), lrs=(1e-3, 3e-3), sweep_seeds=(0, 1))
    assert data["best_lr"] == {"V-GRPO / color": 1e-3, "DiffusionNFT / color": 1e-3}
    # V-GRPO reaches +0.04 at step 4 (i = 2), DiffusionNFT at step 8 (i = 4); +0.2 only V-GRPO (i = 10)
    assert "\n| V-GRPO | 0.001 | +0.04 | 4 of 4 | 4 (4-4) | 200 (200-200) | 80 (80-80) | 3 (3-3) |" in text
    assert "\n| DiffusionNFT | 0.001 | +0.04 | 4 of 4 | 8 (8-8) | 400 (400-400) | 160 (160-160) | 6 (6-6) |" in text
    assert "\n| DiffusionNFT | 0.001 | +0.2 | 0 of 4 | - | - | - | - |" in text
    assert "\n| DiffusionNFT / V-GRPO | +0.04 | 4 of 4 | 2 (2-2) | 2 (2-2) | 2 (2-2) |" in text
    assert "\n| DiffusionNFT / V-GRPO | +0.2 | 0 of 4 | - | - | - |" in text


def test_every_peer_method_runs_its_own_runner_with_its_own_options(tmp_path, monkeypatch):
    """Section 11's worker builds only the method it runs: it built DiffusionNFT(**options) for every method, and
    MixGRPO-Flash's options (flash=True) stopped its first run with a TypeError (the section's test stubbed the runs)."""
    import baselines

    calls = []
    for kind, runner, key in (("nft", "diffusion_nft_sd3", "nft"), ("mix", "mixgrpo_sd3", "mix"),
                              ("flow", "flow_grpo_sd3", None)):
        monkeypatch.setattr(baselines, runner, lambda *a, kind=kind, key=key, **k: calls.append((kind, k.get(key))) or [])
    monkeypatch.setattr(bench, "vgrpo_sd3", lambda *a, **k: calls.append(("vgrpo", None)) or [])
    monkeypatch.setattr(bench, "peer_base", lambda root, base: tmp_path)
    for method, (kind, options) in bench.PEER_METHODS.items():
        calls.clear()
        assert bench.peer_history(method, "color", 0, 0, 1e-3, iterations=1, eval_every=1, root=tmp_path) == []
        ((ran, peer),) = calls
        assert ran == kind
        if kind in ("nft", "mix"):
            expected = (baselines.DiffusionNFT if kind == "nft" else baselines.MixGRPO)(**options)
            assert peer == expected, (method, peer)


def test_gains_are_measured_from_the_bases_evaluation_before_any_update(tmp_path, train_in_process):
    """A run's first evaluation follows its first update (DiffusionNFT's first step alone gained up to +0.026 on the
    colour task, V-GRPO's at most +0.007): gains count from the untrained base's evaluation, which is train.py's
    evaluation of a run whose one update moves nothing (lr 1e-30 rounds away in float32)."""
    history = [dict(eval=e, grad_steps=i, nfe_fwd=10 * i, nfe_bwd=4 * i, nfe=14 * i, seconds=i, reward_mean=0.5)
               for i, e in enumerate([0.55, None, 0.56])]
    assert bench.gain_cost(history, 0.04, start=0.5)["iterations"] == 1  # 0.55 is already +0.05 over the base
    assert bench.gain_cost(history, 0.04, start=0.52)["iterations"] == 3
    assert bench.gain_cost(history, 0.07, start=0.5) is None
    start = bench.base_eval(tmp_path, 0, "color")
    run = bench.vgrpo_sd3(bench.peer_base(tmp_path, 0), tmp_path / "run", 0, 1, 1, ("--rewards", "color:1", "--lr", "1e-30"))
    assert run[0]["eval"] == pytest.approx(start, abs=1e-6)
