"""Tests of checkpoint.py: resume equals a straight run (any world size), tampered or damaged checkpoints refused
in one line, exports replaced only whole and reproducing training, a full disk at a save.
"""

import json
import os
import pickle
import shutil

import pytest
import torch

import checkpoint
import failures
import models
import train
import vgrpo
from helpers import SMALL_RUN, assert_export_reproduces_training, lora_weights, one_line_stop, read_metrics, run_train


def test_resume_gives_the_same_parameters_and_prompts_as_a_straight_run(tiny_dirs, sd3_run, sd3_straight, tmp_path):
    shutil.copytree(sd3_straight, tmp_path / "straight")
    shutil.copytree(sd3_run, tmp_path / "resumed")  # its 2 iterations, checkpoint at iteration 1
    metrics_file = tmp_path / "resumed" / "metrics.jsonl"
    logged_not_saved = {**read_metrics(tmp_path / "resumed")[-1], "iteration": 2}  # a stop after logging iteration 2
    metrics_file.write_text(metrics_file.read_text() + json.dumps(logged_not_saved) + "\n")
    proc = run_train("--resume", tmp_path / "resumed", "--iterations", "4")
    assert f"continuing {tmp_path / 'resumed'} at iteration 2 of 4" in proc.stdout
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [m["iteration"] for m in resumed] == [0, 1, 2, 3]
    assert [m["prompt_indices"] for m in resumed] == [m["prompt_indices"] for m in straight]
    for k, v in lora_weights(tmp_path / "straight").items():
        torch.testing.assert_close(lora_weights(tmp_path / "resumed")[k], v, rtol=1e-6, atol=1e-8)


def test_resume_on_another_number_of_processes_reshards_and_trains_on(tiny_dirs, sd3_run, sd3_straight, tmp_path):
    """Before: FileNotFoundError for rng-rank1.pt. A checkpoint of 1 process resumes under 2 (DCP reshards the LoRA
    weights and AdamW state; rank 1 has no RNG file of its own and keeps its fresh seed, which nothing draws from),
    and theirs back in 1: the prompts are a straight run's and the weights agree to what 1 and 2 processes agree to."""
    shutil.copytree(sd3_straight, tmp_path / "straight")
    shutil.copytree(sd3_run, tmp_path / "mixed")  # 1 process, checkpoint at iteration 1
    assert "at iteration 2 of 3" in run_train("--resume", tmp_path / "mixed", "--iterations", "3", nproc=2).stdout
    assert len(list((tmp_path / "mixed" / "checkpoints" / "iter-000002").glob("rng-rank*.pt"))) == 2
    assert "at iteration 3 of 4" in run_train("--resume", tmp_path / "mixed", "--iterations", "4").stdout
    straight, mixed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "mixed")
    assert [m["prompt_indices"] for m in mixed] == [m["prompt_indices"] for m in straight]
    for kind in ("lora_B", "lora_A"):
        a = torch.cat([v.flatten() for k, v in sorted(lora_weights(tmp_path / "straight").items()) if kind in k])
        b = torch.cat([v.flatten() for k, v in sorted(lora_weights(tmp_path / "mixed").items()) if kind in k])
        assert ((b - a).norm() / a.norm()).item() < 0.05, kind


def plant_pickle(ckpt, marker):
    """Replace .metadata by a pickle that creates `marker` when unpickled, and re-sign the manifest as an attacker
    who can write the directory would."""
    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (ckpt / ".metadata").write_bytes(pickle.dumps(Exploit()))
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(checkpoint.manifest(ckpt)))


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 8])
    path.write_bytes(bytes(data))


TAMPERING = {
    "flipped bytes": (lambda ckpt, marker: flip_bytes(next(ckpt.glob("*.distcp"))), "differ from"),
    "truncated shard": (lambda ckpt, marker: os.truncate(next(ckpt.glob("*.distcp")), 100), "differ from"),
    "removed rng file": (lambda ckpt, marker: (ckpt / "rng-rank0.pt").unlink(), "rng-rank0.pt differ from"),
    "no manifest": (lambda ckpt, marker: (ckpt / checkpoint.MANIFEST).unlink(), "manifest.json is missing"),
    "planted pickle": (plant_pickle, "system is not part of a checkpoint's metadata"),
    "latest outside": (lambda ckpt, marker: (ckpt.parent / "latest").write_text("../../elsewhere"), "not an iter-NNNNNN"),
    # a whole, self-consistent checkpoint outside the folder, named by a pointer that starts like a checkpoint's
    "latest by a name prefix": (lambda ckpt, marker: (shutil.copytree(ckpt, ckpt.parent.parent / "elsewhere"),
                                                      (ckpt.parent / "latest").write_text("iter-000001/../../elsewhere")),
                                "not an iter-NNNNNN"),
}


@pytest.mark.parametrize("how", TAMPERING)
def test_resume_refuses_a_tampered_checkpoint_in_one_line(how, sd3_run, tmp_path, capsys):
    """Before: flipped bytes resumed silently (final |w| 8.5e12 instead of 0.135), truncated files gave tracebacks and
    a planted pickle ran. Now each is refused before any tensor is loaded, and nothing planted runs."""
    run = tmp_path / "run"
    shutil.copytree(sd3_run, run)
    marker = tmp_path / "pwned"
    tamper, message = TAMPERING[how]
    tamper(run / "checkpoints" / "iter-000001", marker)
    text = one_line_stop(train.main, ["--resume", run, "--iterations", "3"], capsys)
    assert text.startswith(f"error: --resume {run}: refusing the checkpoint: ") and message in text
    assert not marker.exists()


def resign(ckpt):
    """Rewrite the manifest to match the damaged files, as a crash-free tool that copied them would."""
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(checkpoint.manifest(ckpt)))


def rewrite_tensors(ckpt, change):
    """Load the checkpoint's tensors, change(state) them, write them back as DCP, re-sign the manifest."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    flat = ckpt.parent / "flat.pt"
    dcp_to_torch_save(ckpt, flat)
    state = torch.load(flat, weights_only=False)
    change(state)
    torch.save(state, flat)
    for shard in ckpt.glob("*.distcp"):
        shard.unlink()
    torch_save_to_dcp(flat, ckpt)
    flat.unlink()
    resign(ckpt)


def nan_weight(state):
    name = next(k for k in state["model"] if "lora_B" in k)
    state["model"][name] = torch.full_like(state["model"][name], float("nan"))


def metadata_pointing_outside(ckpt):
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    shard = next(ckpt.glob("*.distcp"))
    shutil.copy(shard, ckpt.parent.parent.parent / "outside.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../../../outside.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    resign(ckpt)


def edit_config(run, **changes):
    config = run / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def one_nan(state):
    name = next(k for k in state["model"] if "lora_B" in k)
    state["model"][name].view(-1)[7] = float("nan")


def one_byte_short(ckpt):
    shard = next(ckpt.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 1)
    resign(ckpt)


def metadata_in_a_folder_named_like_the_checkpoint(ckpt):
    """Shards in iter-000001-evil/, beside iter-000001/: a name-prefix test of the folder would take them."""
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    evil = ckpt.parent / (ckpt.name + "-evil")
    evil.mkdir()
    for shard in ckpt.glob("*.distcp"):
        shutil.copy(shard, evil / shard.name)
    for info in metadata.storage_data.values():
        info.relative_path = f"../{evil.name}/{info.relative_path}"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    resign(ckpt)


DAMAGE = {  # the manifest re-signed each time: these get past it
    "truncated shard": (lambda run, ckpt: (os.truncate(next(ckpt.glob("*.distcp")), 100), resign(ckpt)),
                        "is truncated"),
    "shard one byte short": (lambda run, ckpt: one_byte_short(ckpt), "is truncated"),
    "NaN weights": (lambda run, ckpt: rewrite_tensors(ckpt, nan_weight), "holds values that are not finite (weight "),
    "one NaN in a weight": (lambda run, ckpt: rewrite_tensors(ckpt, one_nan), "holds values that are not finite (weight "),
    "metadata in a folder named like it": (lambda run, ckpt: metadata_in_a_folder_named_like_the_checkpoint(ckpt),
                                           "outside the checkpoint folder"),
    "torn rng file": (lambda run, ckpt: (os.truncate(ckpt / "rng-rank0.pt", 50), resign(ckpt)), "rng-rank0.pt cannot be read"),
    "garbage state.json": (lambda run, ckpt: ((ckpt / "state.json").write_text("{iteration"), resign(ckpt)),
                           "state.json cannot be read"),
    "metadata pointing outside": (lambda run, ckpt: metadata_pointing_outside(ckpt), "outside the checkpoint folder"),
    "config.json lr edited": (lambda run, ckpt: edit_config(run, lr="fast"), "lr is 'fast', not a number"),
    "config.json bool for a float": (lambda run, ckpt: edit_config(run, lr=True), "lr is True, not a number"),
    "config.json bool for an int": (lambda run, ckpt: edit_config(run, num_mc=True), "num_mc is True, not an integer"),
    "config.json float for an int": (lambda run, ckpt: edit_config(run, num_mc=4.0), "num_mc is 4.0, not an integer"),
    "config.json number for a bool": (lambda run, ckpt: edit_config(run, stratified=1), "stratified is 1, not true or false"),
    "config.json lora_rank edited": (lambda run, ckpt: edit_config(run, lora_rank=16), "does not fit the model and adapter"),
    "config.json model edited": (lambda run, ckpt: edit_config(run, model="tiny-flux"), "does not fit the model and adapter"),
}


@pytest.mark.parametrize("how", DAMAGE)
def test_resume_refuses_a_damaged_checkpoint_or_edited_config_in_one_line(how, sd3_run, tmp_path, capsys, monkeypatch):
    """Before: PytorchStreamReader / JSONDecodeError / size-mismatch tracebacks, a TypeError for "lr": "fast", and a
    .metadata of allowed classes could make --resume read a file outside the checkpoint and train on it."""
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training resumed"))
    run = tmp_path / "runs" / "run"
    shutil.copytree(sd3_run, run)
    damage, message = DAMAGE[how]
    damage(run, run / "checkpoints" / "iter-000001")
    text = one_line_stop(train.main, ["--resume", run, "--iterations", "3"], capsys)
    assert message in text, text


def test_checkpoint_unpickler_reads_what_dcp_writes(sd3_run):
    """The allow-list is complete for real checkpoints (model + AdamW state): the metadata loads and equals plain
    pickle's reading of it."""
    path = sd3_run / "checkpoints" / "iter-000001" / ".metadata"
    with open(path, "rb") as file:
        safe = checkpoint.CheckpointUnpickler(file).load()
    assert safe.state_dict_metadata.keys() == pickle.loads(path.read_bytes()).state_dict_metadata.keys()
    assert any(k.startswith("optim.state.") for k in safe.state_dict_metadata)


def test_export_replaces_final_only_when_the_new_one_is_whole(tiny_dirs, tmp_path, monkeypatch):
    """A crash in the middle of writing the export leaves the previous final/ as it was (before: a truncated
    final/*.safetensors until a resume rewrote it)."""
    model = models.load_pipeline(train.Config(model=str(tiny_dirs / "sd3")), "sd3", torch.device("cpu"), torch.float32)
    models.make_trainable(model.transformer, train.Config())
    checkpoint.export_final(tmp_path / "final", model, lora=True, rank=0)
    before = (tmp_path / "final" / "pytorch_lora_weights.safetensors").read_bytes()
    real_write = checkpoint.write_export

    def crash_midway(out, *args):
        real_write(out, *args)
        os.truncate(out / "pytorch_lora_weights.safetensors", 100)
        raise KeyboardInterrupt  # killed before the rename

    monkeypatch.setattr(checkpoint, "write_export", crash_midway)
    with torch.no_grad():
        next(p for p in model.transformer.parameters() if p.requires_grad).add_(1)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.export_final(tmp_path / "final", model, lora=True, rank=0)
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").read_bytes() == before


def test_a_full_disk_at_a_save_stops_in_one_line_and_keeps_the_previous_checkpoint(tiny_dirs, tmp_path, monkeypatch):
    """Before: OSError 28 as a traceback and a .tmp-* directory left behind."""
    cfg = train.Config(model=str(tiny_dirs / "sd3"))
    model = models.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    models.make_trainable(model.transformer, cfg)
    optimizer = torch.optim.AdamW([p for p in model.transformer.parameters() if p.requires_grad])
    checkpoint.save_checkpoint(tmp_path, 0, model.transformer, optimizer, rank=0)
    real_save = checkpoint.dcp.save

    def fill_the_disk(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # some shards written, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", fill_the_disk)
    with pytest.raises(failures.RunStopped) as error:  # before the first checkpoint: the same command starts over
        checkpoint.save_checkpoint(tmp_path / "new", 0, model.transformer, optimizer, rank=0)
    assert "no checkpoint was written before: free space and run the same command again, it starts the run over" in \
        str(error.value) and "--resume" not in str(error.value)  # before: it advised --resume, which had nothing
    with pytest.raises(failures.RunStopped) as error:
        checkpoint.save_checkpoint(tmp_path, 1, model.transformer, optimizer, rank=0)
    assert "could not write checkpoint" in str(error.value) and "No space left on device" in str(error.value)
    assert "latest still names iter-000000: free space and run the same command again" in str(error.value)
    assert "\n" not in str(error.value)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "iter-000000" and sorted(p.name for p in root.iterdir()) == ["iter-000000", "latest"]
    assert checkpoint.checkpoint_problem(root / "iter-000000") == ""  # intact, resumable


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_full_finetune_export_reproduces_training(family, tiny_dirs, tmp_path):
    run_train("--model", tiny_dirs / family, "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", tmp_path,
              "--lora_rank", "0", *SMALL_RUN)
    assert_export_reproduces_training(tmp_path, tiny_dirs / family, family, lora=False)


def test_lora_export_reproduces_training_when_alpha_is_not_twice_the_rank(tiny_dirs, tmp_path):
    run_train("--model", tiny_dirs / "flux", "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", tmp_path,
              "--lora_rank", "4", "--lora_alpha", "3", "--lr", "1e-2", *SMALL_RUN)
    assert_export_reproduces_training(tmp_path, tiny_dirs / "flux", "flux", lora=True)
