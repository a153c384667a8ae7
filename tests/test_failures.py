"""Tests of failures.py: signals and Ctrl-C at any moment, a reward server failing mid-run, and every error one
line without a traceback.
"""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import models
import reward_bridge
import rewards
import train
import vgrpo
from helpers import ROOT, SMALL_RUN, one_line_stop, read_metrics


def test_ctrl_c_checkpoints_the_current_iteration_and_exits_cleanly(tiny_dirs, tmp_path):
    """SIGINT mid-run: as SIGTERM (test_runs.py, the same command continuing its run), the iteration it stopped in is
    checkpointed whole and the process exits 0."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
           "--run_dir", tmp_path, *SMALL_RUN, "--iterations", "1000", "--save_every", "1000", "--eval_every", "0"]
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not ((tmp_path / "metrics.jsonl").is_file() and len(read_metrics(tmp_path)) >= 2):
        assert proc.poll() is None and time.time() < deadline, "training did not get going"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-2000:]
    last = read_metrics(tmp_path)[-1]["iteration"]
    assert f"stop requested (SIGTERM/SIGINT): checkpoint of iteration {last} saved" in output and last < 999
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # no half-written checkpoint left behind
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"iter-{last:06d}"
    assert not (tmp_path / "final").exists()  # stopped early: no final export



@pytest.mark.parametrize("script", ["train.py", "evaluate.py"])
def test_ctrl_c_during_the_imports_stops_quietly(script, tmp_path):
    """Before: Ctrl-C about a second after start, while torch and diffusers import, printed a KeyboardInterrupt
    traceback from inside an import. Now one line and exit 130 whenever it comes before the training loop."""
    proc = subprocess.Popen([sys.executable, str(ROOT / script), "--run_dir" if script == "train.py" else "--out",
                             str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # python is up; torch and diffusers take seconds to import
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] in ("stopped (Ctrl-C) while starting: nothing to save",
                                            "stopped (Ctrl-C) before the first iteration: nothing to save")

def test_ctrl_c_before_the_first_iteration_stops_quietly(tmp_path):
    """Before: a KeyboardInterrupt traceback from inside the tiny model's fit. Nothing has been trained, so there is
    nothing to save: one line, exit 130."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--run_dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not run_dir.is_dir():  # main() has checked the run directory: past the imports, before the model
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    time.sleep(1)  # building and fitting the tiny model (about 30 s)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "stopped (Ctrl-C) before the first iteration: nothing to save"


def test_a_ctrl_c_that_a_library_swallows_during_setup_still_stops_before_training(tiny_dirs, tmp_path, monkeypatch,
                                                                                   capsys):
    """Seen once in CI: Ctrl-C one second into the tiny model's setup, and the run trained on for a minute (something
    during setup caught the KeyboardInterrupt). Here the model loading catches it on purpose: the run still stops
    before the first iteration, in one line, exit 130, nothing trained."""
    real_load = models.load_pipeline

    def swallowing_load(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except BaseException:  # what a library did
            pass
        return real_load(*args, **kwargs)

    monkeypatch.setattr(models, "load_pipeline", swallowing_load)
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training started after Ctrl-C"))
    try:
        with pytest.raises(SystemExit) as exit_info:
            train.main([str(a) for a in ("--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
                                         "--run_dir", tmp_path, *SMALL_RUN)])
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "stopped (Ctrl-C) before the first iteration: nothing to save"


class FaultyRewardServer:
    """Scores like the color reward for the first `good` requests, then fails as `fault` says."""

    def __init__(self, fault: str, good: int):
        self.fault, self.good, self.count = fault, good, 0
        color = rewards.load_reward("color")
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.count += 1
                scores = color(torch.stack([reward_bridge.decode_png(d) for d in request["images"]]), request["prompts"],
                               request["metadata"]).tolist()
                status, body = 200, {"scores": scores}
                if outer.count > outer.good:
                    status, body = {"500": (500, {"error": "CUDA out of memory"}),
                                    "nan": (200, {"scores": [float("nan")] * len(scores)}),
                                    "count": (200, {"scores": scores[:-1]})}[outer.fault]
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("fault,reason", [("down", "gave no answer after 2 attempts"),
                                          ("500", "HTTP 500: {\"error\": \"CUDA out of memory\"}"),
                                          ("nan", "malformed response")])
def test_a_reward_server_failing_mid_run_stops_in_one_line_and_the_run_resumes(fault, reason, tiny_dirs, tmp_path,
                                                                               capsys):
    """Before: the right message under a traceback. Now one line, exit 1, nothing saved from the failed iteration,
    and --resume carries on once the server answers again (one case resumes; the others stop the same way)."""
    server = FaultyRewardServer("500" if fault == "down" else fault, good=2)  # iteration 0: 2 requests of 4
    options = json.dumps({"http": {"url": server.url, "retries": 2, "timeout": 20.0}})
    argv = ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", tmp_path, *SMALL_RUN,
            "--rewards", "http", "--reward_options", options, "--eval_every", "0", "--save_every", "1",
            "--rollout_batch_size", "4"]
    if fault == "down":
        real = reward_bridge.HttpReward._request

        def gone(self, body):
            if server.count >= 2:
                raise ConnectionRefusedError(111, "Connection refused")
            return real(self, body)
        reward_bridge.HttpReward._request, restore = gone, real
    try:
        message = one_line_stop(train.main, argv, capsys, code=1)
    finally:
        if fault == "down":
            reward_bridge.HttpReward._request = restore
        server.close()
    assert message.startswith("error: reward http: ") and reason in message and "--resume" in message
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter-000000" and not (tmp_path / "final").exists()
    assert [m["iteration"] for m in read_metrics(tmp_path)] == [0]
    if fault == "500":
        healthy = FaultyRewardServer("500", good=10**6)
        options = json.dumps({"http": {"url": healthy.url, "retries": 2, "timeout": 20.0}})
        try:
            train.main(["--resume", str(tmp_path), "--reward_options", options])
        finally:
            healthy.close()
        assert [m["iteration"] for m in read_metrics(tmp_path)] == [0, 1] and (tmp_path / "final").exists()


def test_missing_tracker_package_is_one_clear_error(monkeypatch, capsys):
    real = train.importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name))
    monkeypatch.setattr(models, "load_pipeline", lambda *a: pytest.fail("a model was loaded"))
    assert "--tracker tensorboard: the package is not installed" in one_line_stop(train.main, ["--tracker", "tensorboard"],
                                                                                  capsys)


def test_cli_error_is_one_line_on_stderr_without_traceback():
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--rewards", "nope"], capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[transformers]")]
    assert proc.returncode == 2 and lines == [lines[0]] and lines[0].startswith("error: --rewards: unknown reward")
