"""Tests of reward_bridge.py: the HTTP client and server (round trips, every bad answer and request, deadlines,
stalled clients), `python rewards.py serve`, and GenEval's served scorer (detections, crops, colour classifier).
"""

import base64
import contextlib
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import reward_bridge
import rewards
from helpers import ROOT, free_port, smooth_images, stub_geneval_scorer


@pytest.fixture(scope="module")
def color_server():
    """`python rewards.py serve color` as a real subprocess on 127.0.0.1."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "rewards.py"), "serve", "color", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                assert json.loads(response.read()) == {"status": "ok", "reward": "color"}
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("reward server did not start: " + proc.stdout.read())
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_http_reward_round_trips_a_batch_with_identical_scores(color_server):
    images = smooth_images(5, 24, 24)
    prompts = [f"a {c} thing" for c in ("red", "green", "blue", "white", "black")]
    remote = rewards.load_reward("http", url=color_server)(images, prompts, [{}] * 5)
    torch.testing.assert_close(remote, rewards.load_reward("color")(images, prompts), rtol=0, atol=0)


def test_http_reward_reports_a_rejected_request_with_the_server_message(color_server):
    with pytest.raises(reward_bridge.RewardServerError, match="rejected the request \\(400\\).*needs a colour word"):
        rewards.load_reward("http", url=color_server)(smooth_images(1, 8, 8), ["no colour here"])


def test_http_reward_gives_a_clear_error_after_bounded_retries_when_the_server_is_down():
    client = reward_bridge.HttpReward(f"http://127.0.0.1:{free_port()}", retries=3, backoff=0.05, timeout=2)
    start = time.perf_counter()
    with pytest.raises(reward_bridge.RewardServerError, match="no answer after 3 attempts.*python rewards.py serve"):
        client(smooth_images(1, 8, 8), ["a red car"])
    assert 0.05 + 0.1 <= time.perf_counter() - start < 10  # two backoff waits, then it gives up


@pytest.mark.parametrize("status", [302, 307, 400, 404])
def test_http_reward_stops_on_a_redirect_or_a_refusal_without_following_it(status):
    def send(handler):
        body = b'{"error": "nope"}'
        handler.send_response(status)
        handler.send_header("Location", "http://127.0.0.1:1/elsewhere")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    url, server = one_shot_server(send)
    try:
        with pytest.raises(reward_bridge.RewardServerError, match=f"rejected the request \\({status}\\)"):
            reward_bridge.HttpReward(url, retries=1)(smooth_images(1, 8, 8), ["a red car"])
    finally:
        server.shutdown()


@pytest.mark.parametrize("body", [b"not json", b'{"score": [1.0]}', b'{"scores": [1.0, 2.0]}', b'{"scores": ["x"]}',
                                  b'{"scores": [NaN]}', b'{"scores": [true]}', b'{"scores": [null]}',
                                  b'{"scores": [[0.5]]}', b'{"scores": {"a": 1}}', b"[" * 100_000 + b"]" * 100_000])
def test_http_reward_rejects_a_malformed_response(body):
    class Bad(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Bad)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(reward_bridge.RewardServerError, match="malformed response from reward server"):
            reward_bridge.HttpReward(f"http://127.0.0.1:{server.server_port}")(smooth_images(1, 8, 8), ["a red car"])
    finally:
        server.shutdown()


def one_shot_server(handler_body):
    """A local server whose POST answer is handler_body(handler); returns (url, server)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            handler_body(self)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", server


def answer(body: bytes):
    def send(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return send


@pytest.mark.parametrize("body", [b'{"scores": [1e39]}', b'{"scores": [-4e38]}', b'{"scores": [1' + b"0" * 400 + b"]}"])
def test_http_reward_rejects_scores_that_are_not_finite_in_float32(body):
    """1e39 is a finite Python float but inf as float32 (before: every step skipped, exit 0); a 400-digit JSON integer
    raised an uncaught OverflowError."""
    url, server = one_shot_server(answer(body))
    try:
        with pytest.raises(reward_bridge.RewardServerError, match="malformed response.*finite in float32"):
            reward_bridge.HttpReward(url)(smooth_images(1, 8, 8), ["a red car"])
    finally:
        server.shutdown()


def test_http_reward_deadline_covers_the_whole_request_not_each_read():
    """A server that trickles its answer one byte every 0.2 s never trips a per-read timeout of 1 s (before: held 144 s
    with timeout 1); the whole-request deadline ends each attempt after 1 s."""
    def trickle(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        with contextlib.suppress(OSError):
            for _ in range(1000):
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.2)

    url, server = one_shot_server(trickle)
    try:
        start = time.perf_counter()
        with pytest.raises(reward_bridge.RewardServerError, match="no answer after 2 attempts.*within the 1 s timeout"):
            reward_bridge.HttpReward(url, timeout=1, retries=2, backoff=0.01)(smooth_images(1, 8, 8), ["a red car"])
        assert time.perf_counter() - start < 6  # 2 x 1 s, plus slack for a loaded machine
    finally:
        server.shutdown()


def test_http_reward_refuses_other_url_schemes_and_bounds_echoed_bodies(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password=hunter2")
    with pytest.raises(ValueError, match="must be http://HOST"):
        reward_bridge.HttpReward(f"file://{secret}")  # before: urllib read the file and printed it in the error
    url, server = one_shot_server(answer(b'{"scores": "' + b"x" * 100_000 + b'"}'))
    try:
        with pytest.raises(reward_bridge.RewardServerError) as error:
            reward_bridge.HttpReward(url)(smooth_images(1, 8, 8), ["a red car"])
        assert len(str(error.value)) < 500
    finally:
        server.shutdown()


def post(url, payload: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=payload, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_reward_server_answers_every_bad_request_with_400_and_the_reason(color_server):
    """Before: an image that is not a PNG (PIL's OSError) dropped the connection unanswered, as did 50 MB of garbage;
    one image with two prompts was scored twice."""
    png = reward_bridge.encode_png(rewards.to_uint8(smooth_images(1, 16, 16))[0])
    jpeg = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")
    cases = {
        "a JPEG": ({"images": [base64.b64encode(jpeg.getvalue()).decode()], "prompts": ["a red car"]}, "not a base64 PNG"),
        "50 MB of garbage": ({"images": [base64.b64encode(os.urandom(50 << 20)).decode()], "prompts": ["a red car"]},
                             "not a base64 PNG"),
        "one image, two prompts": ({"images": [png], "prompts": ["a red car", "a blue car"]}, "1 images, 2 prompts"),
        "metadata of another length": ({"images": [png], "prompts": ["a red car"], "metadata": [{}, {}]}, "2 metadata"),
        "prompts that are not strings": ({"images": [png], "prompts": [3]}, "prompts a list of strings"),
        "a prompt the reward cannot score": ({"images": [png], "prompts": ["a cat"]}, "needs a colour word"),
    }
    for name, (request, reason) in cases.items():
        status, answer = post(color_server, json.dumps(request).encode())
        assert status == 400 and reason in answer["error"], (name, status, answer)
    status, answer = post(color_server, json.dumps({"images": [png], "prompts": ["a red car"]}).encode())
    assert status == 200 and len(answer["scores"]) == 1  # and it still serves


@pytest.mark.parametrize("argv,message", [
    (["serve", "color", "--port", "99999"], "--port 99999 must be 0-65535"),
    (["serve", "color", "--timeout", "-1"], "--timeout -1.0 a number of seconds > 0"),
    (["serve", "color", "--option", "quality=3"], "'color' has no option 'quality'"),
    (["serve", "pickscore", "--option", "model=7"], "option 'model' of 'pickscore' must be str"),
    (["serve", "geneval"], "serve geneval needs --option detector_config=PATH"),
    (["serve", "unifiedreward"], "unifiedreward is an HTTP client here: run its own server (python -m sglang.launch_server"),
])
def test_serve_refuses_bad_flags_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reward_bridge.serve(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.splitlines() == [err] and message in err, err


def test_serve_on_a_port_in_use_is_one_line(capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(SystemExit) as exit_info:
            reward_bridge.serve(["serve", "color", "--port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("error: cannot listen on 127.0.0.1:") and "\n" not in err


def test_reward_server_serves_others_while_a_client_stalls_and_refuses_oversized_bodies():
    """One client announces 1000 bytes and sends 10: the server keeps answering everyone else at once (before: one
    thread, no socket timeout, blocked for all), drops the stalled client after its timeout, and a body above the
    limit gets 413 without being read."""
    server = reward_bridge.reward_server(rewards.load_reward("color"), "color", port=0, timeout=5, max_request_bytes=1 << 20)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        stalled = socket.create_connection(("127.0.0.1", server.server_port))
        stalled.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
        start = time.perf_counter()
        images, prompts = smooth_images(2, 16, 16), ["a red car", "a blue car"]
        remote = reward_bridge.HttpReward(url, timeout=10, retries=1)(images, prompts)
        assert time.perf_counter() - start < 3  # not after the stalled client's 5 s: served concurrently
        torch.testing.assert_close(remote, rewards.load_reward("color")(images, prompts), rtol=0, atol=0)
        stalled.settimeout(20)
        assert stalled.recv(1024) == b""  # the server closed it after its 5 s socket timeout
        big = socket.create_connection(("127.0.0.1", server.server_port), timeout=10)
        big.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 << 20))  # answered unread
        assert big.recv(1024).split(b"\r\n")[0].endswith(b"413 Request Entity Too Large")
        big.close()
    finally:
        server.shutdown()
        server.server_close()


def test_geneval_scorer_served_over_http_returns_scores_and_accuracy():
    scorer = stub_geneval_scorer()
    server = reward_bridge.reward_server(scorer, "geneval", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = rewards.load_reward("geneval", url=f"http://127.0.0.1:{server.server_port}")
        images = torch.zeros(3, 3, 32, 32)
        images[0, 0] = 1.0  # red: a red dog on the left, no cat
        images[1, 2] = 1.0  # blue: a cat only
        images[2, 0], images[2, 2] = 0.8, 0.8  # both, magenta-ish: left dog red (ties go to red), right cat red
        meta = [{"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]},
                {"tag": "single_object", "include": [{"class": "dog", "count": 1}]},
                {"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]}]
        scores = client(images, [m["tag"] for m in meta], meta)
        assert scores.tolist() == [1.0, 0.0, 1.0] and client.extras["accuracy"] == [1.0, 0.0, 1.0]
        assert len(client.extras["reasons"]) == 3 and "expected dog>=1" in client.extras["reasons"][1]
        direct = scorer(images, ["x"] * 3, meta)
        assert direct["scores"].tolist() == scores.tolist()
        with pytest.raises(reward_bridge.RewardServerError, match="400"):  # no metadata: the server says so
            client(images, ["x"] * 3)
    finally:
        server.shutdown()
        server.server_close()



GENEVAL_BAD_METADATA = {  # request metadata -> the field the 400 answer names
    "a number where the object goes": (5, "metadata must be a list of JSON objects, one per prompt"),
    "metadata that is an object": ({"tag": "single_object"}, "metadata must be a list of JSON objects"),
    "an exclude clause with a position": ({"tag": "counting", "include": [{"class": "dog", "count": 2}],
                                           "exclude": [{"class": "dog", "count": 3, "position": ["left of", 0]}]},
                                          "'exclude'[0] must be an object with 'class' and 'count' and no other field"),
    "an object where the exclude list goes": ({"tag": "counting", "include": [{"class": "dog", "count": 2}],
                                               "exclude": {"class": "dog", "count": 3}}, "'exclude' must be a list"),
    "an object where the include list goes": ({"tag": "single_object", "include": {"class": "dog", "count": 1}},
                                              "'include' must be a non-empty list"),
    "a clause that is a string": ({"tag": "single_object", "include": ["dog"]}, "'include'[0] must be an object"),
    "a count that is a boolean": ({"tag": "single_object", "include": [{"class": "dog", "count": True}]},
                                  "'include'[0]['count'] must be an integer >= 1"),
    "a position naming a later clause": ({"tag": "position", "include": [{"class": "dog", "count": 1, "position":
                                                                            ["left of", 1]}, {"class": "cat", "count": 1}]},
                                         "'include'[0]['position'] must be [relation, index of an earlier include clause]"),
    "an unknown colour": ({"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "teal"}]},
                          "'include'[0]['color'] 'teal' is not one of"),
}


def test_geneval_server_answers_malformed_metadata_with_400_naming_the_field():
    """Before: metadata [5] gave a 500 (AttributeError inside the rules), an exclude clause with a position a 400 "not
    in list", a dict where a list goes was iterated by its keys. Each is now a 400 naming the field; the server goes
    on serving."""
    server = reward_bridge.reward_server(stub_geneval_scorer(), "geneval", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    png = reward_bridge.encode_png(rewards.to_uint8(smooth_images(1, 16, 16))[0])
    try:
        for name, (metadata, field) in GENEVAL_BAD_METADATA.items():
            request = {"images": [png], "prompts": ["a photo of a dog"],
                       "metadata": metadata if name == "metadata that is an object" else [metadata]}
            status, answer = post(url, json.dumps(request).encode())
            assert status == 400 and field in answer["error"], (name, status, answer)
        good = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
        status, answer = post(url, json.dumps({"images": [png], "prompts": ["a dog"], "metadata": [good]}).encode())
        assert status == 200 and len(answer["scores"]) == 1
    finally:
        server.shutdown()
        server.server_close()

def test_mmdet_results_become_detections_per_class():
    boxes = [np.zeros((0, 5)) for _ in rewards.GENEVAL_CLASSES]
    boxes[rewards.GENEVAL_CLASSES.index("dog")] = np.array([[1, 2, 3, 4, 0.9], [5, 6, 7, 8, 0.4]])
    masks = [[] for _ in rewards.GENEVAL_CLASSES]
    masks[rewards.GENEVAL_CLASSES.index("dog")] = [np.ones((10, 10), bool), np.zeros((10, 10), bool)]
    found = reward_bridge.mmdet_detections((boxes, masks))
    assert list(found) == ["dog"] and [d.box for d in found["dog"]] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert [d.score for d in found["dog"]] == [0.9, 0.4] and found["dog"][0].mask.all()
    assert reward_bridge.mmdet_detections(boxes)["dog"][1].mask is None


def test_geneval_crop_greys_out_what_the_mask_leaves_out_and_crops_to_the_box():
    image = np.full((8, 8, 3), 200, np.uint8)
    mask = np.zeros((8, 8), bool)
    mask[2:4, 2:4] = True
    crop = reward_bridge.geneval_crop(image, rewards.Detection((1, 1, 5, 5), 0.9, mask))
    assert crop.shape == (1, 3, 4, 4)
    expected = torch.full((3, 4, 4), 0x99 / 255)
    expected[:, 1:3, 1:3] = 200 / 255
    torch.testing.assert_close(crop[0], expected)


def test_clip_colour_classifier_is_zero_shot_over_the_templates(tiny_clip_dir, monkeypatch):
    """The colour of a crop is the argmax of its CLIP image embedding against each colour's averaged, normalised
    template embeddings (clip_benchmark's zero_shot_classifier), computed here by hand from the same model."""
    colors = reward_bridge.ClipColors(str(tiny_clip_dir))
    image = (smooth_images(1, 40, 40, seed=3)[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    objects = [rewards.Detection((0, 0, 20, 40), 0.9), rewards.Detection((10, 5, 40, 30), 0.9)]
    got = colors(image, objects, "dog")
    scorer = colors.scorer
    for obj, name in zip(objects, got):
        crop = reward_bridge.geneval_crop(image, obj)
        weights = []
        for c in rewards.GENEVAL_COLORS:
            texts = [t.format(c=c, name="dog") for t in reward_bridge.ClipColors.TEMPLATES]
            weights.append(F.normalize(scorer.embed_texts(texts).mean(0), dim=-1))
        logits = scorer.embed_images(crop) @ torch.stack(weights).T
        assert name == rewards.GENEVAL_COLORS[int(logits.argmax())]


# ----------------------------------------------------------------------------------------------
# UnifiedReward behind an OpenAI-compatible chat server, here a tiny random-weight LLaVA-OneVision


class TinyJudge:
    """A random-weight LLaVA-OneVision (SigLIP + Qwen2: the architecture of UnifiedReward-7b-v1.5, whose transformers
    class is LlavaOnevisionForConditionalGeneration) with a byte-level Qwen2 tokenizer and LLaVA-OneVision's anyres
    image processor, sized to answer in a fraction of a second. transformers' LlavaOnevisionProcessor needs
    torchvision for its video half, so the image tokens are expanded here as the processor does: one <image> token
    per image feature the model computes."""

    GRID = [[32, 32], [32, 64], [64, 32], [64, 64]]

    def __init__(self):
        from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                                  LlavaOnevisionImageProcessorPil, Qwen2Tokenizer)
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.tokenizer = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(bytes_to_unicode().values())}, merges=[],
                                        unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        self.tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<image>", "<video>"]})
        self.images = LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32}, image_grid_pinpoints=self.GRID)
        ids = self.tokenizer.convert_tokens_to_ids
        config = LlavaOnevisionConfig(
            vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
            text_config=dict(model_type="qwen2", vocab_size=len(self.tokenizer), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id),
            image_token_index=ids("<image>"), video_token_index=ids("<video>"), image_grid_pinpoints=self.GRID,
            vision_feature_select_strategy="full")
        self.model = LlavaOnevisionForConditionalGeneration(config).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # five times the default init's spread: the answer then depends on image and prompt
            for weight in self.model.parameters():
                if weight.dim() > 1:
                    weight.normal_(0, 0.1, generator=generator)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def inputs(self, image, question: str, answer_prefix: str = "") -> dict:
        """The chatml conversation (user: image, question; assistant: answer_prefix) as model inputs."""
        pixels = self.images(images=[image], return_tensors="pt")
        with torch.no_grad():
            features = self.model.model.get_image_features(pixel_values=pixels["pixel_values"],
                                                           image_sizes=pixels["image_sizes"], vision_feature_layer=-1,
                                                           vision_feature_select_strategy="full").pooler_output
        ids = self.tokenizer.convert_tokens_to_ids
        tokens = [ids("<|im_start|>"), *self.encode("user\n"), *[ids("<image>")] * len(features[0]), *self.encode(question),
                  ids("<|im_end|>"), *self.encode("\n"), ids("<|im_start|>"), *self.encode("assistant\n" + answer_prefix)]
        return {"input_ids": torch.tensor([tokens]), "pixel_values": pixels["pixel_values"],
                "image_sizes": pixels["image_sizes"]}

    def answer(self, image, question: str, digits: str | None) -> str:
        """Greedy decoding (temperature 0); with `digits`, constrained to "Final Score: D" with D one of them (as a
        server's structured-output option constrains it), so the number is the model's own choice."""
        from transformers import LogitsProcessor, LogitsProcessorList

        inputs = self.inputs(image, question)
        start = inputs["input_ids"].shape[1]
        forced = self.encode("Final Score: ")
        allowed = [self.encode(d)[0] for d in digits or ""]
        eos = self.tokenizer.eos_token_id

        class FinalScore(LogitsProcessor):
            def __call__(self, input_ids, scores):
                step = input_ids.shape[1] - start
                keep = [forced[step]] if step < len(forced) else allowed if step == len(forced) else [eos]
                mask = torch.full_like(scores, -torch.inf)
                mask[:, keep] = 0
                return scores + mask

        processors = LogitsProcessorList([FinalScore()] if digits else [])
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=24, do_sample=False, logits_processor=processors)
        return self.tokenizer.decode(out[0, start:], skip_special_tokens=True)


def decode_data_url(url: str):
    from PIL import Image

    assert url.startswith("data:image;base64,")
    picture = Image.open(io.BytesIO(base64.b64decode(url.removeprefix("data:image;base64,"))))
    assert picture.format == "PNG"
    return picture.convert("RGB")


@pytest.fixture(scope="module")
def judge_server():
    """An OpenAI-compatible chat server (POST /v1/chat/completions, Bearer key) answering with TinyJudge. Its
    `mode` says how to answer: constrained to `digits` (None: unconstrained), after `delay` seconds. It records
    every request it receives."""
    judge, lock = TinyJudge(), threading.Lock()
    mode, received = {"digits": "12345", "delay": 0.0}, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/chat/completions" or self.headers.get("Authorization") != "Bearer flowgrpo":
                return self.reply(401 if self.path == "/v1/chat/completions" else 404, {"error": "unauthorized or not found"})
            received.append(request)
            parts = {part["type"]: part for part in request["messages"][0]["content"]}
            time.sleep(mode["delay"])
            with lock:
                text = judge.answer(decode_data_url(parts["image_url"]["image_url"]["url"]), parts["text"]["text"],
                                    mode["digits"])
            self.reply(200, {"object": "chat.completion", "model": request["model"],
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}]})

        def reply(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # a client that timed out has gone
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}/v1", judge=judge, mode=mode,
                          received=received)
    server.shutdown()


def test_unifiedreward_sends_the_authors_request_and_scores_the_models_final_score_over_5(judge_server):
    """What Flow-GRPO's and DiffusionNFT's scorer sends (the image resized to 512x512 as a PNG data URL, the authors'
    question with the prompt, temperature 0, the served model's name, the API key) and how the answer becomes a score:
    the digit the model itself picks after "Final Score: ", computed here by one forward pass, over 5."""
    from PIL import Image

    images, prompts = smooth_images(6, 48, 40, seed=5), [f"a photo of {n} cats" for n in range(6)]
    judge_server.received.clear()
    scores = rewards.load_reward("unifiedreward", url=judge_server.url)(images, prompts)

    assert scores.dtype == torch.float32 and scores.shape == (6,) and len(set(scores.tolist())) > 1
    by_prompt = {r["messages"][0]["content"][1]["text"]: r for r in judge_server.received}
    digits = [judge_server.judge.encode(str(d))[0] for d in range(1, 6)]
    for image, prompt, score in zip(rewards.to_uint8(images), prompts, scores.tolist()):
        question = reward_bridge.UNIFIEDREWARD_QUESTION.format(prompt=prompt)
        assert question.startswith("<image>\nYou are given a text caption") and question.endswith(f"Text Caption: [{prompt}]")
        request = by_prompt[question]
        assert (request["model"], request["temperature"], len(request["messages"])) == ("UnifiedReward-7b-v1.5", 0, 1)
        assert [p["type"] for p in request["messages"][0]["content"]] == ["image_url", "text"]
        sent = decode_data_url(request["messages"][0]["content"][0]["image_url"]["url"])
        expected = Image.fromarray(image).resize((512, 512))
        assert sent.size == (512, 512) and np.array_equal(np.asarray(sent), np.asarray(expected))
        with torch.no_grad():
            logits = judge_server.judge.model(**judge_server.judge.inputs(expected, question, "Final Score: ")).logits
        assert score == pytest.approx((int(logits[0, -1, digits].argmax()) + 1) / 5)


@pytest.mark.parametrize("mode, options, message", [
    ({"digits": None}, {}, 'answered image 0 with no "Final Score: N"'),
    ({"digits": "6789"}, {}, r"answered image 0 with the score [6-9], outside \[1, 5\]"),
    ({"delay": 3.0}, {"timeout": 1.0, "retries": 1}, "no complete answer within the 1 s timeout.*sglang.launch_server"),
    ({}, {"api_key": "wrong"}, r"rejected the request \(401\)"),
])
def test_unifiedreward_refuses_an_answer_without_a_score_in_range_a_timeout_or_a_refusal(judge_server, mode, options,
                                                                                          message):
    """Flow-GRPO's parser would score the first two 0 and 1 ("Final Score: 10" reads as 1); here each is an error."""
    judge_server.mode.update(mode)
    try:
        with pytest.raises(reward_bridge.RewardServerError, match=message):
            rewards.load_reward("unifiedreward", url=judge_server.url, **options)(smooth_images(1, 16, 16), ["a cat"])
    finally:
        judge_server.mode.update({"digits": "12345", "delay": 0.0})
