"""Tests of parallel.py under torchrun (gloo, CPU): FSDP2 and HSDP train what one process trains, every family,
bf16 at real width; a worker killed and restarted (--max_restarts); two nodes; collectives of ranks that disagree;
compiled blocks; one all-gather per rollout batch.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import bench
import models
import parallel
import train
import vgrpo
from helpers import (BF16_TOKENS, REAL_SMALL_RUN, ROOT, SMALL_RUN, assert_export_reproduces_training,
                     assert_preset_iteration, assert_same_training, built_once, free_port, lora_weights, read_metrics,
                     run_train)


def test_torchrun_fsdp2_two_processes_match_one_process(tiny_dirs, straight_two, tmp_path):
    """The 6 iterations the restart tests below train on 2 processes (FSDP2), against the same run on 1."""
    run_train(*restart_args(tiny_dirs), "--run_dir", tmp_path)
    assert_same_training(tmp_path, straight_two)


def test_compiled_blocks_sample_and_train_as_eager_ones_under_their_own_names():
    """--compile: each transformer block compiled in place (here with aot_eager: the same graphs and autograd as
    inductor, without generating kernels, so the CPU suite stays fast); the LoRA model samples and takes surrogate
    gradients as the eager one does, and its parameter names (checkpoints, the LoRA export) are unchanged."""
    import torch._dynamo

    eager, compiled = bench.tiny_model(), bench.tiny_model()
    for model in (eager, compiled):
        torch.manual_seed(0)
        models.make_trainable(model.transformer, train.Config())
    names = [n for n, _ in compiled.transformer.named_parameters()]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        parallel.compile_blocks(compiled.transformer, "aot_eager")
        assert [n for n, _ in compiled.transformer.named_parameters()] == names
        cond = eager.encode(["a red car", "a blue car"])
        noise = torch.randn(2, *eager.latent_shape(), generator=torch.Generator().manual_seed(0))
        x0 = [vgrpo.sample_ode(m.velocity, noise, cond, m.timesteps(), solver="euler") for m in (eager, compiled)]
        t, eps = vgrpo.draw_mc_pairs(1, 2, 2, tuple(noise.shape[1:]), generator=torch.Generator().manual_seed(1))
        grads = []
        for model in (eager, compiled):
            s, _ = vgrpo.elbo_surrogate(model.velocity, x0[0], cond, t, eps)
            s.sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.transformer.parameters() if p.requires_grad]))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled blocks did run
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(x0[1], x0[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_fsdp2_rollouts_gather_the_model_once_per_rollout_batch(tmp_path):
    """6 Euler steps on the tiny SD3 transformer sharded over 2 gloo ranks: one all-gather per FSDP unit (2 blocks +
    root) instead of one per block and step, the same samples, and the parameters sharded again afterwards."""
    out = bench.rollout_all_gathers()
    (per_step, x_per_step), (once, x_once) = out["False"], out["True"]
    blocks, steps = 2, 6
    # Per step: every block at every step, the root once (FSDP2 keeps the root unsharded after a forward).
    assert per_step["n"] == blocks * steps + 1 and once["n"] == blocks + 1
    assert per_step["bytes"] > 3 * once["bytes"]
    assert x_once == x_per_step


def test_torchrun_hsdp_2x2_matches_one_process(tiny_dirs, tmp_path):
    """4 processes as 2 replica groups x 2 shards (a 2-D device mesh) train the same model as 1 process."""
    common = ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--num_prompts", "4"]
    run_train(*common, "--run_dir", tmp_path / "one")
    proc = run_train(*common, "--run_dir", tmp_path / "hsdp", "--hsdp", "2", nproc=4)
    assert "world size 4 (HSDP: 2 replicas x 2 shards)" in proc.stdout
    assert_same_training(tmp_path / "one", tmp_path / "hsdp")


REDUCE_WORKER = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import parallel
dist.init_process_group("gloo")
rank = dist.get_rank()
out = parallel.reduce_metrics({"x_max": float(rank), "x_min": float(rank), "x": float(rank), "nan_max": float(rank == 1)},
                          torch.device("cpu"))
out["failure"] = parallel.first_failure("" if rank == 0 else "rank 1 failed")
open(f"{sys.argv[2]}/rank{rank}.json", "w").write(json.dumps(out))  # one file each: torchrun interleaves stdout
dist.destroy_process_group()
"""


def test_ranks_that_disagree_reduce_to_max_min_mean_and_the_first_failure(tmp_path):
    """A NaN or a stop request seen by one rank only must stop every rank: _max keys take the largest value (before,
    MIN for _max survived every test: all ranks agreed in all of them); a failure message reaches all ranks."""
    worker = tmp_path / "worker.py"
    worker.write_text(REDUCE_WORKER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(worker), str(ROOT), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"x_max": 1.0, "x_min": 0.0, "x": 0.5, "nan_max": 1.0, "failure": "rank 1 failed"}


@pytest.mark.parametrize("family", ["qwenimage", "flux2", "wan"])
def test_new_family_trains_with_cfg_under_fsdp2_resumes_and_exports_exactly(family, tiny_dirs, tmp_path):
    """Qwen-Image, FLUX.2 [klein] and Wan through train.py with their pipelines' CFG (the presets' rollouts; Wan's on
    its own UniPC scheduler, 5-frame videos scored frame by frame): 2 processes train the model 1 process trains, the
    LoRA gathered from the shards loads into diffusers with the trained output, and a run resumed from iteration 1
    continues exactly as a straight one. With the reference KL (the adapters switched off on the sharded transformer)
    and an EMA (sharded, in the checkpoint)."""
    guards = ("--ref_kl_coef", "0.3", "--ema_decay", "0.5") if family == "flux2" else ()  # one family is enough
    video = ("--num_frames", "5", "--solver", "scheduler") if family == "wan" else ()
    common = ["--model", tiny_dirs / family, "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--cfg_scale", "4",
              *guards, *video]
    run_train(*common, "--run_dir", tmp_path / "one")
    run_train(*common, "--run_dir", tmp_path / "two", nproc=2)
    assert_same_training(tmp_path / "one", tmp_path / "two")
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert one[0]["ref_kl"] == two[0]["ref_kl"] == 0.0
    if guards:  # trained on, ref_kl covers every sample; only logged, one micro-batch per rank (other samples)
        assert two[1]["ref_kl"] == pytest.approx(one[1]["ref_kl"], rel=0.05)
    assert_export_reproduces_training(tmp_path / "two", tiny_dirs / family, family, lora=True)
    if family == "wan":  # evaluation samples: an animated grid of the 5 frames
        from PIL import Image

        assert Image.open(tmp_path / "one" / "samples" / "iter-000001.webp").n_frames == 5
    run_train(*common, "--run_dir", tmp_path / "straight", "--iterations", "3")
    shutil.copytree(tmp_path / "one", tmp_path / "resumed")  # checkpoint at iteration 1
    assert "at iteration 2 of 3" in run_train("--resume", tmp_path / "resumed", "--iterations", "3").stdout
    assert [m["prompt_indices"] for m in read_metrics(tmp_path / "resumed")] == [
        m["prompt_indices"] for m in read_metrics(tmp_path / "straight")]
    for k, v in lora_weights(tmp_path / "straight").items():
        torch.testing.assert_close(lora_weights(tmp_path / "resumed")[k], v, rtol=1e-6, atol=1e-8)


def checkpoint_dtypes(run_dir):
    """{(model | optim, dtype)} of the trainable tensors in the run's latest DCP checkpoint, from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    path = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {(key.split(".")[0], v.properties.dtype) for key, v in metadata.items()
            if hasattr(v, "properties") and ("lora" in key or key.startswith("optim"))}


@pytest.mark.parametrize("preset,name,extra", [
    # AB2 rollouts, one gradient step (the preset's 2 on micro-batches of 1: FLUX.2 [klein]'s preset test)
    ("flux", "flux.1-dev", ["--micro_batch_size", "2", "--num_grad_steps", "1"]),
    ("qwenimage", "qwen-image", ["--micro_batch_size", "2"]),  # true CFG rollouts
])
def test_preset_iteration_under_fsdp2_bf16_at_real_width_stores_float32_and_exports_exactly(preset, name, extra,
                                                                                         real_dirs, tmp_path,
                                                                                         bf16_matmul_fast):
    """The FLUX.1-dev and Qwen-Image presets (Qwen-Image: true CFG, a text mask, rotary tables that are plain tensors,
    a LoRA weight that never gets a gradient) at real width, one iteration on 2 processes, FSDP2 with bf16 compute:
    the sharded LoRA and AdamW states are float32, the preset's LoRA rank and alpha are the run's, and the LoRA
    gathered from the shards (alpha = 2 x rank: scale 2) loads into diffusers with the trained transformer's output.
    (The other presets' iteration: test_train.py, one process in float32.)"""
    run_train("--preset", preset, "--model", real_dirs / name, "--prompts", real_dirs / "prompts.txt", "--run_dir",
              tmp_path, *REAL_SMALL_RUN, *BF16_TOKENS, "--num_prompts", "2", "--num_mc", "2", "--dtype", "bfloat16",
              "--lr", "1e-2", *extra, nproc=2)
    assert checkpoint_dtypes(tmp_path) == {("model", torch.float32), ("optim", torch.float32)}
    assert_preset_iteration(tmp_path, real_dirs / name, preset, name)


# ----------------------------------------------------------------------------------------------
# Restarts and several nodes

def restart_args(tiny_dirs) -> list:
    """SMALL_RUN for 6 iterations with a checkpoint every 2: room to kill a worker after the first one."""
    return ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--iterations", "6",
            "--save_every", "2"]


@pytest.fixture(scope="session")
def straight_two(tiny_dirs, tmp_path_factory):
    """restart_args on 2 processes, straight through: what a restarted or two-node run must equal."""
    return built_once(tmp_path_factory, "straight-two",
                      lambda run_dir: run_train(*restart_args(tiny_dirs), "--run_dir", run_dir, nproc=2))


def worker_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the train.py worker of `rank` writing run_dir (its command line names it; torchrun sets RANK)."""
    for proc in Path("/proc").iterdir():
        try:
            if str(run_dir) in (proc / "cmdline").read_bytes().decode(errors="replace") and \
                    f"RANK={rank}" in (proc / "environ").read_bytes().decode(errors="replace").split("\0"):
                return int(proc.name)
        except (OSError, ValueError):  # another user's process, or one that ended meanwhile
            continue
    return None


def test_torchrun_max_restarts_continues_from_the_last_checkpoint_after_a_worker_is_killed(tiny_dirs, straight_two,
                                                                                          tmp_path):
    """Before: the restarted workers died in gloo's connectFullMesh ("Connection refused" to the dead group's port)
    and the job failed; the survivor printed tracebacks from dcp.save / gather_object. Now the survivor says in one
    line which rank died and that the last checkpoint is intact, the restarted group continues from it, and the run
    ends with every iteration logged once and the straight run's weights, bit for bit (CPU, gloo)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max_restarts=1",
           str(ROOT / "train.py"), *map(str, restart_args(tiny_dirs)), "--run_dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (run_dir / "checkpoints" / "latest").is_file():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    victim = worker_pid(run_dir, rank=1)
    os.kill(victim, signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert f"error: rank 1 (pid {victim}) stopped, and this rank cannot go on without it; the last checkpoint" in output
    assert "Traceback" not in output.split("Root Cause")[0].split("failed (exitcode: -9)")[0]  # the workers' part
    assert f"continuing {run_dir} at iteration" in output
    assert [m["iteration"] for m in read_metrics(run_dir)] == list(range(6))
    assert [m["reward_mean"] for m in read_metrics(run_dir)] == [m["reward_mean"] for m in read_metrics(straight_two)]
    for k, v in lora_weights(straight_two).items():
        assert torch.equal(lora_weights(run_dir)[k], v), k


def test_the_agents_sigterm_after_a_failed_collective_raised_peer_lost_stops_quietly(monkeypatch, tmp_path):
    """CI caught the race the test above can lose: a failed collective raised PeerLost, the one line was printed, and
    torchrun's SIGTERM then landed in the atexit finalizers, where the handler raised PeerLost again as a traceback.
    Now whichever path raises it first, the other only asks to stop."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: no /proc entry, as a worker the agent has collected
    monkeypatch.setattr(parallel, "_peers", [(socket.gethostname(), os.getpid()), (socket.gethostname(), dead.pid)])
    monkeypatch.setattr(parallel.PeerLost, "raised", False)
    run = types.SimpleNamespace(stop={"requested": False}, dir=tmp_path)
    with pytest.raises(parallel.PeerLost, match=f"rank 1 \\(pid {dead.pid}\\) stopped"):
        train.stop_requested(run)  # the signal first: it raises
    train.stop_requested(run)  # and a second signal only asks to stop
    assert run.stop["requested"]
    monkeypatch.setattr(parallel.PeerLost, "raised", False)
    parallel.PeerLost([1], tmp_path)  # the failed collective first (stop_if_a_peer_dies)
    train.stop_requested(run)  # the agent's SIGTERM after it: no second PeerLost


def test_two_torchrun_agents_as_two_nodes_train_what_two_processes_on_one_node_train(tiny_dirs, straight_two,
                                                                                    tmp_path):
    """torchrun --nnodes 2 --nproc_per_node 1 with c10d rendezvous: two agents on this machine stand for two nodes
    (one process each, the run directory on a file system both see). --hsdp 0 makes it HSDP, 2 replicas of 1 shard:
    the same training as FSDP over 2 processes on one node, to rounding."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=two-nodes", str(ROOT / "train.py"),
           *map(str, restart_args(tiny_dirs)), "--run_dir", str(tmp_path)]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(o[-2000:] for o in outputs)
    assert any("world size 2 (HSDP: 2 replicas x 1 shards)" in o for o in outputs)
    assert_same_training(straight_two, tmp_path)
