"""Tests of memory.py: the memory plan against the bytes a measured CPU run at real width allocates, the --plan
command, the largest fitting batch, and a GPU launch refused before loading.
"""

import math
import re
import shlex
import shutil
from functools import partial

import pytest
import torch

import adapters
import failures
import memory
import models
import train


def saved_for_backward(model, rows):
    """Bytes autograd saves in one training forward of `model` (an adapter), measured with real tensors on the CPU."""
    saved = memory.SavedBytes(model.transformer, [])
    with saved.hooks():
        model.velocity(torch.zeros(rows, *model.latent_shape()), torch.full((rows,), 0.5), model.cond_like(rows))
    return saved.other


@pytest.mark.parametrize("name,depth", [("sd3.5-medium", {"num_layers": 5, "dual_attention_layers": (0, 1, 2)}),
                                        ("flux.1-dev", {"num_layers": 2, "num_single_layers": 3}),
                                        ("qwen-image", {"num_layers": 3}),
                                        ("flux.2-klein-4b", {"num_layers": 2, "num_single_layers": 3}),
                                        ("wan2.1-t2v-1.3b", {"num_layers": 3})])
def test_memory_plan_matches_a_measured_cpu_run_at_real_width(name, depth, real_dirs, bf16_matmul_fast):
    """The plan extrapolates activations from a twin holding each block type (the first twice) to the model's depth
    and batch, and counts parameters from configs on the meta device. Checked against what real tensors hold:
    bytes saved for backward by a real-width model of a depth the twin does not have (SD3.5: 3 dual blocks, 1 plain,
    the last; FLUX.1 and FLUX.2: 2 double, 3 single; Qwen-Image and Wan: 3; Wan on 9-frame videos) at 3 rows in bf16
    autocast with LoRA, and the bytes models.load_pipeline holds per component of a saved pipeline (Wan's transformer
    keeps its time embedder, norms and modulation tables in float32 in a bf16 load)."""
    # Wan on 9 frames: 3 latent frames, which the plan extrapolates from 1 and 2
    cfg = train.Config(model=str(real_dirs / name), resolution=64, max_sequence_length=8,
                       num_frames=9 if "wan" in name else 0)
    family, components = memory.meta_components(cfg.model)
    pipeline_config = components.pop("pipeline_config", None)
    loaded = models.load_pipeline(cfg, family, torch.device("cpu"), torch.bfloat16)
    for component, module in components.items():
        held = [*loaded.pipe.components[component].parameters(), *loaded.pipe.components[component].buffers()]
        assert memory.stored_bytes(module, torch.bfloat16) == sum(t.numel() * t.element_size() for t in held), component

    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # as activation_profile: Qwen-Image's rotary tables stay real
        deeper = type(components["transformer"]).from_config({**dict(components["transformer"].config), **depth})
    adapter = adapters.ADAPTERS[family]
    settings = dict(resolution=64, max_sequence_length=8, num_frames=loaded.num_frames)
    profile = memory.activation_profile(deeper, adapter, torch.bfloat16, partial(models.make_trainable, cfg=cfg),
                                        settings=settings, vae=components["vae"], pipeline_config=pipeline_config)
    real = memory.materialize(deeper, torch.bfloat16, seed=1)
    models.make_trainable(real, cfg)
    rows = 3
    pipe = memory.planning_pipe(real, components["vae"], adapter, pipeline_config)
    measured = saved_for_backward(adapter(pipe, torch.bfloat16, sampling_steps=1, **settings), rows)
    planned = memory.saved_bytes([profile["other"], *profile["blocks"]], rows)
    # Exact up to storages shared differently between blocks; measured: equal to the byte.
    assert planned == pytest.approx(measured, rel=1e-3), (planned, measured)


def test_plan_cli_says_whether_it_fits_from_a_config_only_directory(real_dirs, tmp_path, capsys, bf16_matmul_fast):
    """--plan reads configs only (the directory has no weights), prints the table ending in 'per GPU: X GiB of G GiB',
    exits 0 when it fits with 10% headroom (saying how large a rollout batch would fit too), else 1 with flags that
    make it fit (and they do)."""
    root = tmp_path / "configs"
    shutil.copytree(real_dirs / "sd3.5-medium", root, ignore=shutil.ignore_patterns("*.safetensors"))
    argv = ["--plan", "--model", str(root), "--resolution", "128", "--max_sequence_length", "16", "--rewards",
            "color", "--plan_world_size", "2", "--num_prompts", "2", "--group_size", "8", "--micro_batch_size", "8",
            "--num_mc", "4", "--num_grad_steps", "1", "--rollout_batch_size", "2"]

    def plan(*extra):
        code = 0
        try:
            train.main(argv + list(extra))
        except SystemExit as exit_info:
            code = exit_info.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err.strip()

    code, out, _ = plan("--plan_gpu_gb", "80")
    *_, last, note = out.strip().splitlines()
    assert code == 0 and re.fullmatch(r"per GPU: [0-9.]+ GiB of 80 GiB", last)
    assert note.startswith("--rollout_batch_size 8 fits too")  # the 8 samples per rank in one sampling call
    assert "reward models" in out and "activations saved for backward (32 rows" in out
    tight = ["--plan_gpu_gb", last.split()[2]]
    code, _, err = plan(*tight)
    advice = re.fullmatch(r"error: does not fit .* with 10% headroom: (.*) makes it fit \(.*\)", err)
    assert code == 1 and advice, (code, err)
    assert plan(*tight, *shlex.split(advice.group(1)))[0] == 0  # the advice is a configuration that fits


def test_largest_fitting_is_the_brute_force_largest():
    for low, high, limit in [(1, 1, 5), (1, 144, 1), (1, 144, 144), (3, 100, 37), (24, 144, 25), (2, 9, 8)]:
        calls = []
        got = memory.largest_fitting(low, high, lambda n: calls.append(n) or n <= limit)
        assert got == max(n for n in range(low, high + 1) if n <= limit or n == low)
        assert len(calls) <= math.ceil(math.log2(high - low + 1)) + 1


@pytest.mark.parametrize("lora_rank", [32, 0])
def test_memory_plan_counts_the_trainable_state_ema_and_reference_copy_as_allocated(lora_rank, tiny_dirs):
    """The plan's rows for the trained weights' float32 state (LoRA: weight + grad + 2 AdamW moments; full
    fine-tuning: grad + 2 moments, the weight itself is the float32 'transformer weights' row), the EMA and the frozen
    base copy of the reference KL, against the bytes a real step allocates. (A LoRA state of 12 bytes per parameter,
    the float32 master weight forgotten, passed every other test.)"""
    cfg = train.Config(model=str(tiny_dirs / "sd3"), lora_rank=lora_rank, ema_decay=0.9, ref_kl_coef=0.1,
                       dtype="float32")
    plan, _ = memory.plan_memory(cfg, "sd3", 1, 80.0, partial(models.make_trainable, cfg=cfg))
    planned = {part.split(" ")[0]: gib * memory.GiB for part, gib, _ in plan.rows}
    model = models.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    copy_bytes = sum(p.numel() * p.element_size() for p in model.transformer.parameters())
    models.make_trainable(model.transformer, cfg)
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    assert planned["trainable"] == state + grads + (weights if lora_rank else 0)
    assert planned["EMA"] == weights
    if lora_rank:
        assert "frozen" not in planned  # under LoRA the reference is the same weights, adapters off
    else:
        assert planned["frozen"] == copy_bytes


def test_gpu_launch_refuses_a_plan_that_does_not_fit_before_loading(monkeypatch):
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = train.Config(micro_batch_size=4)
    prepare = partial(models.make_trainable, cfg=cfg)
    with pytest.raises(failures.ConfigError, match="the memory plan needs .* GiB per GPU of 0 GiB"):
        memory.check_memory_plan(cfg, "sd3", 1, 1e-3, rank=0, prepare=prepare)
    memory.check_memory_plan(cfg, "sd3", 1, 80.0, rank=0, prepare=prepare)  # the tiny model fits anything
