"""parallel.py: the processes of a run: the torchrun process group, the collectives, FSDP2 / HSDP and compilation.

One process runs without any of it: every collective here is the identity when torch.distributed is not initialised.
Under torchrun the transformer's blocks are sharded with FSDP2 (apply_fsdp, the recipe in one function), the frozen
parts (VAE, text encoders, reward models) stay replicated, and rank 0 decides what every rank must agree on.
"""

import contextlib
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

import adapters
from failures import RunStopped, UserError

# ----------------------------------------------------------------------------------------------
# Processes: the group, its restarts, and peers that die


def setup_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device; initialises the process group under torchrun (nccl on GPU, gloo on CPU) on a
    store of its own per restart (restart_store), and notes every rank's host and pid (lost_ranks)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = restart_store()
    group = dict(store=store, rank=rank, world_size=world) if store else {}
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **group)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **group)
    _peers[:] = [None] * world
    dist.all_gather_object(_peers, (socket.gethostname(), os.getpid()))
    return rank, world, device


def restart_store() -> dist.Store | None:
    """The process group's store under torchrun: its agent's store (MASTER_ADDR:MASTER_PORT), which outlives the
    workers across --max_restarts, under a prefix of its own per restart. Without the prefix a restarted group reads
    the dead group's keys: gloo dialled the dead workers' ports ("connectFullMesh failed ... Connection refused") and
    the restart failed. None (init_process_group's own env:// rendezvous) where torchrun's agent hosts no store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return dist.PrefixStore(f"v-grpo/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def restarted() -> bool:
    """This process restarts an earlier launch of the same job: torchrun --max_restarts, or a Slurm requeue."""
    return any(int(os.environ.get(name, "0") or 0) > 0 for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


_peers: list[tuple[str, int] | None] = []  # (host, pid) of every rank, in rank order (setup_distributed)


def lost_ranks() -> list[int]:
    """Ranks of this machine whose process has ended (a kill -9, an out-of-memory kill, a crash): a collective
    with them fails or hangs. Ranks on other machines cannot be seen from here and are not listed."""
    host = socket.gethostname()
    return [rank for rank, peer in enumerate(_peers) if peer and peer[0] == host and not _alive(peer[1])]


def _alive(pid: int) -> bool:
    """A process that exists and has not ended: a killed worker stays a zombie until torchrun's agent reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether the pid exists at all
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


@contextlib.contextmanager
def stop_if_a_peer_dies(run_dir: Path):
    """Inside: an error (a collective that failed: gloo's "Connection closed by peer", an interrupted checkpoint)
    that comes with a rank of this machine gone becomes one line, from the lowest surviving rank, saying which rank
    died and which checkpoint the same command continues from. Other errors pass through as they are."""
    try:
        yield
    except Exception as error:
        lost = lost_ranks() if dist.is_initialized() else []
        if not lost or isinstance(error, UserError):
            raise
        raise PeerLost(lost, run_dir) from None


class PeerLost(RunStopped):
    """Raised once per process: by stop_if_a_peer_dies (a failed collective) or by the signal torchrun's agent sends
    (train.stop_requested), whichever comes first. A second one would come as a traceback from wherever the
    interpreter is as it exits (the agent's SIGTERM lands during the atexit finalizers)."""
    raised = False

    def __init__(self, lost: list[int], run_dir: Path):
        PeerLost.raised = True
        latest = Path(run_dir) / "checkpoints" / "latest"
        kept = (f"the last checkpoint, {latest.read_text()}, is intact and the same command continues from it"
                if latest.is_file() else "no checkpoint was written yet: the same command starts the run again")
        super().__init__(f"rank {', '.join(map(str, lost))} (pid {', '.join(str(_peers[r][1]) for r in lost)}) stopped, "
                         f"and this rank cannot go on without it; {kept} (torchrun --max_restarts does so by itself)")
        self.from_rank = min(set(range(len(_peers))) - set(lost))  # one line, from the lowest surviving rank


# ----------------------------------------------------------------------------------------------
# Collectives: the identity in one process


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate x along dim 0 over ranks in rank order (identity in one process)."""
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def reduce_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average over ranks; min/max for keys ending _min/_max."""
    if not dist.is_initialized():
        return metrics
    out = {}
    for key, value in metrics.items():
        x = torch.tensor(value, dtype=torch.float64, device=device)
        op = dist.ReduceOp.MIN if key.endswith("_min") else dist.ReduceOp.MAX if key.endswith("_max") else dist.ReduceOp.SUM
        dist.all_reduce(x, op=op)
        out[key] = x.item() / (dist.get_world_size() if op == dist.ReduceOp.SUM else 1)
    return out


def first_failure(message: str) -> str:
    """The first non-empty message of any rank, on every rank ('' if none): a failure one rank meets stops all."""
    if not dist.is_initialized():
        return message
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m), "")


def broadcast_from_rank0(value: str) -> str:
    """Rank 0's value on every rank (identity in one process)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """The end of a run under torchrun: every rank waits (rank 0 may still be writing the export: nobody tears gloo /
    nccl down under it), then leaves the group."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def gloo_teardown_abort(output: str) -> bool:
    """A torchrun worker aborted with 'terminate called without an active exception' (exit -6) while gloo was torn
    down after its work: an upstream c10d teardown race (pytorch/pytorch#190489, #179291), seen in about 1 of 60 CI
    launches and never in 30 stressed local ones. Callers accept it only with proof that every rank finished."""
    return "terminate called without an active exception" in output and "exitcode: -6" in output


# ----------------------------------------------------------------------------------------------
# FSDP2 / HSDP and regional compilation


def apply_fsdp(transformer: torch.nn.Module, device: torch.device, dtype: torch.dtype, replicas: int = 1) -> None:
    """The FSDP2 recipe: shard each transformer block, then the root (which keeps the embeddings and
    the output layer). Parameters are gathered in `dtype` for compute; gradients are reduced in fp32.
    replicas = 1: FSDP over a 1-D mesh of all ranks. replicas > 1: HSDP, the torchtitan way: a 2-D mesh
    (replicate, shard), parameters sharded within each group of world / replicas ranks (a node: all-gathers
    stay on its fast links) and replicated across the groups (one gradient all-reduce between nodes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if replicas > 1:
        mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in adapters.transformer_blocks(transformer):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(transformer, mesh=mesh, mp_policy=policy)


def hsdp_replicas(cfg_hsdp: int, world: int) -> int:
    """--hsdp 0 (auto): one replica group per node when torchrun spans several nodes, else plain FSDP."""
    if cfg_hsdp:
        return cfg_hsdp
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return world // per_node if world > per_node else 1


@contextlib.contextmanager
def gathered_once(transformer: torch.nn.Module):
    """Under FSDP2, keep each unit's parameters unsharded from its first all-gather to the end of the block, so a
    rollout batch gathers the model once instead of once per ODE step (rollouts take no gradients, so nothing
    else changes). Costs one unsharded copy of the transformer for the duration; a no-op without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in transformer.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            # FSDP2 never reshards the root after forward (backward needs it next); the blocks do.
            unit.set_reshard_after_forward(unit is not transformer, recurse=False)
            unit.reshard()


def compile_blocks(transformer: torch.nn.Module, backend: str) -> None:
    """Regional compilation, before FSDP2 as torchtitan does it: each transformer block compiled in place
    (Module.compile), so the blocks keep their names (checkpoints, LoRA export) and FSDP2 still shards them one by
    one. Rollouts, the surrogate's passes and their backward all run through it; a new batch shape (the last rollout
    chunk, an evaluation) compiles once more."""
    for block in adapters.transformer_blocks(transformer):
        block.compile(backend=backend)
