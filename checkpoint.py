"""checkpoint.py: checkpoints (sharded, verified, resumable on any world size) and the export diffusers loads.

checkpoints/iter-NNNNNN/ holds the torch.distributed.checkpoint shards of the trainable weights, AdamW and the EMA,
each rank's RNG state, state.json and manifest.json; checkpoints/latest names the newest whole one. Every checkpoint
and export is written to a temporary directory and renamed, so a crash at any point leaves the previous one whole; a
checkpoint is verified against its manifest (sizes and sha256) before it is read, and its pickled metadata is read
with an allow-list, so resuming a checkpoint from elsewhere cannot run code. final/ is the export: a diffusers LoRA
(pipe.load_lora_weights) or a full transformer (from_pretrained).
"""

import contextlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

import parallel
from failures import ConfigError, RunStopped

# torch.distributed.checkpoint warns on every save/load without a process group; one process is intended there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# ----------------------------------------------------------------------------------------------
# Checkpoints: torch.distributed.checkpoint (sharded), written to a temp dir then renamed


def state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: the frozen base is not saved (it is reloaded from --model), so loading cannot be strict;
    # load_checkpoint checks instead that only frozen parameters were missing.
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def save_checkpoint(run_dir: Path, iteration: int, transformer, optimizer, rank: int, ema: dict | None = None) -> None:
    """model (trainable weights), optim (AdamW) and, with an EMA, ema {parameter name: float32 tensor, sharded as the
    weights}: one DCP checkpoint, plus each rank's RNG state, state.json and the manifest. Written to a temporary
    directory and renamed; `latest` moves only once the checkpoint is whole. A write that fails (a full disk) removes
    the temporary directory and stops the run in one line, `latest` still naming the previous checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = run_dir / "checkpoints"
    tmp, final = root / f".tmp-{iteration:06d}", root / f"iter-{iteration:06d}"
    add_unstepped_state(optimizer)
    model_state, optim_state = get_state_dict(transformer, optimizer, options=state_options())
    try:
        dcp.save({"model": model_state, "optim": optim_state, **({"ema": ema} if ema else {})}, checkpoint_id=str(tmp))
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   tmp / f"rng-rank{rank}.pt")
        parallel.barrier()
        if rank == 0:
            (tmp / "state.json").write_text(json.dumps({"iteration": iteration}))
            (tmp / MANIFEST).write_text(json.dumps(manifest(tmp), indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            (root / "latest.tmp").write_text(final.name)
            os.replace(root / "latest.tmp", root / "latest")  # the pointer moves only once the checkpoint is whole
            for old in root.glob("iter-*"):
                if old != final:
                    shutil.rmtree(old)
    except (OSError, CheckpointException) as error:  # DCP reports a rank's OSError as a CheckpointException
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            (root / "latest.tmp").unlink()
        latest = root / "latest"
        kept = (f"{latest} still names {latest.read_text()}: free space and run the same command again, it continues "
                "from there" if latest.is_file() else "no checkpoint was written before: free space and run the same "
                "command again, it starts the run over")
        cause = getattr(error, "strerror", None) or str(error).strip().splitlines()[-1][:200]
        raise RunStopped(f"could not write checkpoint {final} ({cause}): is the disk full? {kept}") from None
    parallel.barrier()


def add_unstepped_state(optimizer: torch.optim.AdamW) -> None:
    """AdamW keeps no state for a parameter that never had a gradient: one whose output nothing reads, as LoRA on
    Qwen-Image's last text-stream output projection (the image tokens alone leave the last block). Loading expects a
    state for every trainable parameter (torch.distributed.checkpoint initialises them all), so such a parameter gets
    the state AdamW itself would create at its first step: step 0, zero moments. That changes no update."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


MANIFEST = "manifest.json"


def manifest(directory: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file of a checkpoint but the manifest itself."""
    import hashlib

    entries = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 24), b""):
                digest.update(block)
        entries[str(path.relative_to(directory))] = [path.stat().st_size, digest.hexdigest()]
    return entries


def checkpoint_problem(path: Path) -> str:
    """'' if the checkpoint is the one save_checkpoint wrote (every file of its manifest present, same size and
    sha256, nothing added), else what differs: resuming flipped bytes silently trained on garbage."""
    try:
        expected = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{path / MANIFEST} is missing or unreadable"
    found = manifest(path)
    if found == expected:
        return ""
    changed = sorted(name for name in set(found) | set(expected) if found.get(name) != expected.get(name))
    return f"{', '.join(changed[:5])} differ from {path / MANIFEST} (size or sha256; files missing, changed or added)"


class CheckpointUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this loads only the classes DCP writes into it, so a planted pickle in a
    checkpoint from elsewhere cannot run code on --resume (plain pickle would call anything it names)."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               *(("torch.distributed.checkpoint.metadata", name) for name in (
                   "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                   "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeCheckpointReader(dcp.FileSystemReader):
    """FileSystemReader with .metadata read by CheckpointUnpickler (tensors are read with weights_only=True by DCP)."""

    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as file:
            metadata = CheckpointUnpickler(file).load()
        # Every file the metadata points at must lie in the checkpoint's own folder: a .metadata of allowed classes
        # could otherwise name ../../elsewhere.distcp and resume from a file nobody checked against the manifest.
        root = Path(self.path).resolve()
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            target = (root / str(info.relative_path)).resolve()
            if target.parent != root:
                raise pickle.UnpicklingError(f"its metadata points at {info.relative_path}, outside the checkpoint folder")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_checkpoint(run_dir: Path, transformer, optimizer, rank: int, ema: dict | None = None) -> int:
    """Restores model, optimizer, EMA (in place into `ema`'s tensors) and RNG states after checking the checkpoint
    against its manifest; returns the iteration to continue from. Refuses, in one line naming the file, a checkpoint
    that is not what save_checkpoint wrote, that does not fit the model of the run's config.json, or whose weights are
    not finite. Any world size resumes any checkpoint: DCP reshards the weights, optimizer and EMA, and a rank without
    an RNG file of its own keeps its fresh seed (the algorithm draws nothing from the global RNG: every draw is a pure
    function of the seed, the iteration and an index)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = run_dir / "checkpoints"
    name = (root / "latest").read_text().strip()
    path = root / name

    def refused(problem: str) -> ConfigError:
        return ConfigError(f"--resume {run_dir}: refusing the checkpoint: {problem}; a run keeps only its latest "
                           "checkpoint: restore the run directory from a copy or start a new run")

    problem = "" if re.fullmatch(r"iter-\d{6}", name) else f"{root / 'latest'} names {name!r}, not an iter-NNNNNN checkpoint"
    problem = parallel.broadcast_from_rank0(problem or (checkpoint_problem(path) if rank == 0 else ""))
    if problem:
        raise refused(problem)
    model_state, optim_state = get_state_dict(transformer, optimizer, options=state_options())
    state = {"model": model_state, "optim": optim_state, **({"ema": ema} if ema else {})}
    reader = SafeCheckpointReader(path)
    try:  # here, so a refusal is one line (inside dcp.load it becomes a CheckpointException)
        needed = {}  # shard file -> the bytes its metadata reads from it
        for info in reader.read_metadata().storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        present = {shard: (path / shard).stat().st_size for shard in needed}
        short = [f"{shard} ({present[shard]} bytes, its metadata needs {size})"
                 for shard, size in needed.items() if present[shard] < size]
    except (pickle.UnpicklingError, OSError, AttributeError, EOFError) as error:
        raise refused(f"{path / '.metadata'}: {error}") from None
    if short:
        raise refused(f"{short[0]} is truncated")
    try:
        dcp.load(state, storage_reader=reader)
        keys = set_state_dict(transformer, optimizer, model_state_dict=state["model"],
                              optim_state_dict=state["optim"], options=state_options())
    except (Exception, CheckpointException) as error:  # DCP's (a BaseException) wraps each rank's: a missing key, a
        # size mismatch, a bad shard; its last line is the cause
        reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--resume {run_dir}: checkpoint {path} does not fit the model and adapter of its config.json "
                          f"(model, lora_rank, lora_targets, ema_decay), or a shard is damaged ({reason}); restore "
                          "config.json as the run wrote it, or start a new run") from None
    frozen = {n for n, p in transformer.named_parameters() if not p.requires_grad}
    if keys.unexpected_keys or set(keys.missing_keys) - frozen:
        raise ConfigError(f"checkpoint {path} does not match the model: missing trainable "
                          f"{sorted(set(keys.missing_keys) - frozen)[:5]}, unexpected {keys.unexpected_keys[:5]}")
    tensors = {f"weight {n}": p for n, p in transformer.named_parameters() if p.requires_grad}
    tensors |= {f"EMA {n}": e for n, e in (ema or {}).items()}
    tensors |= {f"AdamW {k}": v for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    bad = [n for n, v in tensors.items() if not torch.isfinite(v.to_local() if hasattr(v, "to_local") else v).all()]
    if parallel.reduce_metrics({"bad_max": float(bool(bad))}, _device_of(transformer))["bad_max"]:  # every rank agrees
        raise refused(f"it holds values that are not finite ({bad[0] if bad else 'on another rank'})")
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.is_file():
        try:
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"]:
                torch.cuda.set_rng_state_all(rng["cuda"])
        except Exception as error:  # a torn file: torch's reader raises RuntimeError, pickle's UnpicklingError, ...
            raise refused(f"{rng_file} cannot be read ({type(error).__name__})") from None
    try:
        return int(json.loads((path / "state.json").read_text())["iteration"]) + 1
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise refused(f"{path / 'state.json'} cannot be read ({type(error).__name__})") from None


def _device_of(module: torch.nn.Module) -> torch.device:
    parameter = next(module.parameters())
    return parameter.device if parameter.device.type != "meta" else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Export: what a user loads into diffusers


def export_final(out: Path, model, lora: bool, rank: int, info: dict | None = None) -> None:
    """LoRA in the diffusers LoRA format (pipe.load_lora_weights) or the full transformer
    (from_pretrained), gathered from the shards onto rank 0; export.json beside it says which weights it holds
    (info: trained or EMA, the iteration)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model.transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    # Written whole into a temp dir, then renamed: a kill during the export never leaves a truncated final/.
    tmp, old = out.with_name(f".{out.name}.tmp"), out.with_name(f".{out.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    write_export(tmp, model, full, lora)
    (tmp / "export.json").write_text(json.dumps(info or {"weights": "trained"}, indent=1))
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def write_export(out: Path, model, full: dict, lora: bool) -> None:
    if lora:
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(model.transformer, state_dict=full)
        # The adapter config (rank, lora_alpha, targets) travels in the file's metadata: without it
        # load_lora_weights applies scale 1 instead of lora_alpha / rank.
        type(model.pipe).save_lora_weights(out, transformer_lora_layers=layers,
                                           transformer_lora_adapter_metadata=model.transformer.peft_config["default"].to_dict())
    else:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        model.transformer.save_config(out / "transformer")
        save_file({k: v.contiguous() for k, v in full.items()}, out / "transformer" / "diffusion_pytorch_model.safetensors")
