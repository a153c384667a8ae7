"""reward_bridge.py: rewards served by another process over HTTP, the client and the server.

Heavy scorers (GenEval's detector, a VLM judge, or any reward of rewards.py in another environment) run behind a
localhost server; train.py and evaluate.py reach them through the `http` and `geneval` clients of rewards.REWARDS.
UnifiedReward is the exception: it is served by SGLang or vLLM behind the OpenAI-compatible chat API, and its client
(UnifiedRewardChat) speaks that API as Flow-GRPO and DiffusionNFT do. The protocol of the others:

    POST <url>  {"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [dict, ...] | null}
    200         {"scores": [float, ...]}        (one finite number per image, same order)
    GET <url>   {"status": "ok", "reward": NAME}

`python rewards.py serve NAME --port P` (serve below) serves any reward of rewards.py over it, on 127.0.0.1 unless
--host says otherwise; `serve geneval` serves GenEval's scorer (GenEvalScorer: its detector and colour classifier
behind the rules in rewards.py).
"""

import argparse
import base64
import contextlib
import http.client
import io
import json
import math
import re
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import rewards
from rewards import Detection

# ----------------------------------------------------------------------------------------------
# The client


def encode_png(image: np.ndarray) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: str) -> torch.Tensor:
    """base64 PNG -> (3, H, W) float in [0, 1]; ValueError for anything else (PIL reports a bad image as OSError,
    which the server must not take for a broken connection)."""
    from PIL import Image

    try:
        picture = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        if picture.format != "PNG":
            raise ValueError(f"a {picture.format} image")
        array = np.asarray(picture.convert("RGB"))
    except (OSError, ValueError, TypeError, Image.DecompressionBombError) as error:
        raise ValueError(f"an image is not a base64 PNG ({type(error).__name__}: {str(error)[:100]})") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255


FLOAT32_MAX = torch.finfo(torch.float32).max


MAX_RESPONSE_BYTES = 1 << 20  # B scores are a few kB; more is not a reward server's answer


MAX_REQUEST_BYTES = 1 << 30  # the server's limit: a rollout batch of 1024 px PNGs is ~100 MB


class RewardServerError(RuntimeError):
    """A reward server that is down, refuses a request or answers something that is not scores."""


class HttpReward:
    """Client of a reward server speaking the protocol in this file's docstring. `timeout` bounds each whole
    request (connect, upload, answer), not each socket read: a server that trickles bytes cannot hold a step."""

    def __init__(self, url: str, *, timeout: float = 300.0, retries: int = 3, backoff: float = 1.0):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward server url {url!r} must be http://HOST[:PORT][/PATH] or https://...")
        if not (math.isfinite(timeout) and timeout > 0) or retries < 1:
            raise ValueError(f"reward server timeout {timeout} must be a finite number of seconds > 0 and retries "
                             f"{retries} at least 1")
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.headers = {"Content-Type": "application/json"}
        self.extras: dict[str, list] = {}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        body = json.dumps({"images": [encode_png(a) for a in rewards.to_uint8(images)], "prompts": list(prompts),
                           "metadata": None if metadata is None else list(metadata)}).encode()
        return self._parse(self._post(body), len(prompts)).to(images.device)

    def _post(self, body: bytes) -> bytes:
        """POST with bounded retries and exponential backoff on connection errors, timeouts and 5xx answers."""
        last = None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, payload = self._request(body)
            except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out, garbled
                last = f"{type(error).__name__}: {error}"
                continue
            if status == 200:
                return payload
            detail = payload[:300].decode(errors="replace")
            if status < 500:
                raise RewardServerError(f"reward server {self.url} rejected the request ({status}): {detail}")
            last = f"HTTP {status}: {detail}"
        raise RewardServerError(f"reward server {self.url} gave no answer after {self.retries} attempts (last error: "
                                f"{last}). Is it running? Start one with {self.start_hint}.")

    start_hint = "`python rewards.py serve NAME --port PORT`"

    def _request(self, body: bytes) -> tuple[int, bytes]:
        """One POST under a deadline: a watchdog shuts the socket down when `timeout` seconds have passed."""
        parts = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.netloc, timeout=self.timeout)  # also bounds the connect itself
        expired, sockets = threading.Event(), []

        def expire():
            expired.set()
            for sock in sockets:  # held here: the connection drops its reference once a response takes over
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read; close() alone would not

        watchdog = threading.Timer(self.timeout, expire)
        watchdog.start()
        try:
            connection.connect()
            sockets.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("POST", path, body, self.headers)
            response = connection.getresponse()
            payload = response.read(MAX_RESPONSE_BYTES + 1)
            if expired.is_set():
                raise TimeoutError
            return response.status, payload
        except (OSError, http.client.HTTPException):
            if expired.is_set():
                raise TimeoutError(f"no complete answer within the {self.timeout:g} s timeout") from None
            raise
        finally:
            watchdog.cancel()
            connection.close()

    def _parse(self, payload: bytes, n: int) -> torch.Tensor:
        """n numbers that are finite as float32 (1e39 is a finite float but inf once stored). Other lists of n values
        in the answer (GenEval's accuracy and reasons) are kept in self.extras for the evaluation."""
        try:
            answer = json.loads(payload)
            scores = answer["scores"]
            values = [float(s) for s in scores if isinstance(s, (int, float)) and not isinstance(s, bool)]
            ok = len(payload) <= MAX_RESPONSE_BYTES and len(values) == len(scores) == n and \
                all(abs(v) <= FLOAT32_MAX for v in values)  # also False for nan
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):  # OverflowError: an int too large
            ok = False
        if not ok:
            raise RewardServerError(f"malformed response from reward server {self.url}: expected "
                                    f'{{"scores": [{n} numbers finite in float32]}}, got {payload[:200]!r}')
        self.extras = {k: v for k, v in answer.items() if k != "scores" and isinstance(v, list) and len(v) == n}
        return torch.tensor(values, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# UnifiedReward behind an OpenAI-compatible chat server (vLLM, SGLang), as Flow-GRPO and DiffusionNFT call it

# How the authors (DiffusionNFT's README) serve it; the client's defaults match.
UNIFIEDREWARD_SERVER = ("python -m sglang.launch_server --model-path CodeGoat24/UnifiedReward-7b-v1.5 --api-key flowgrpo "
                        "--port 17140 --chat-template chatml-llava")

# The authors' pointwise question, word for word as Flow-GRPO's and DiffusionNFT's unifiedreward scorers send it.
UNIFIEDREWARD_QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in "
    "the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, assign a score from 1 "
    "to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")

# Their parser reads the first "Final Score: N" with N in 1..5; it turns an answer without one into a score of 0 and
# reads "Final Score: 10" as 1. Here the first "Final Score:" must be followed by a number in [1, 5], else an error.
FINAL_SCORE = re.compile(r"Final Score:\s*([-+]?\d+(?:\.\d+)?)?")


class UnifiedRewardChat(HttpReward):
    """UnifiedReward (a LLaVA-OneVision judge, CodeGoat24/UnifiedReward-7b-v1.5) served behind the OpenAI-compatible
    chat API, scored as Flow-GRPO and DiffusionNFT score it: each image resized to 512x512 and sent as a PNG data URL
    with the authors' question, one request per image (concurrently, at most `concurrency` at a time), temperature 0,
    score = N / 5 for the answer's "Final Score: N", so in [0.2, 1]. An answer without a score, a score outside
    [1, 5], an error or no answer within `timeout` seconds (each request) is a RewardServerError naming the image,
    never a silent zero. Start the server as the authors do (UNIFIEDREWARD_SERVER).
    """

    start_hint = f"`{UNIFIEDREWARD_SERVER}` (or `vllm serve` with --served-model-name UnifiedReward-7b-v1.5)"

    def __init__(self, url: str = "http://127.0.0.1:17140/v1", *, model: str = "UnifiedReward-7b-v1.5",
                 api_key: str = "flowgrpo", timeout: float = 300.0, retries: int = 3, concurrency: int = 64):
        if concurrency < 1:
            raise ValueError(f"unifiedreward concurrency {concurrency} must be at least 1")
        super().__init__(url.rstrip("/") + "/chat/completions", timeout=timeout, retries=retries)
        self.model, self.concurrency = model, concurrency
        self.headers["Authorization"] = f"Bearer {api_key}"

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        from concurrent.futures import ThreadPoolExecutor

        from PIL import Image

        bodies = [json.dumps(self.request(Image.fromarray(image).resize((512, 512)), prompt)).encode()
                  for image, prompt in zip(rewards.to_uint8(images), prompts, strict=True)]
        with ThreadPoolExecutor(min(self.concurrency, max(len(bodies), 1))) as pool:
            answers = list(pool.map(self._post, bodies))
        return torch.tensor([self.score(answer, index) for index, answer in enumerate(answers)],
                            dtype=torch.float32, device=images.device)

    def request(self, image, prompt: str) -> dict:
        """The chat request of the authors' scorer for one PIL image and its prompt."""
        url = "data:image;base64," + encode_png(np.asarray(image))
        return {"model": self.model, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": UNIFIEDREWARD_QUESTION.format(prompt=prompt)}]}]}

    def score(self, payload: bytes, index: int) -> float:
        try:
            text = json.loads(payload)["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            raise RewardServerError(f"malformed response from {self.url} for image {index}: expected an OpenAI chat "
                                    f"completion, got {payload[:200]!r}") from None
        match = FINAL_SCORE.search(text)
        value = float(match.group(1)) if match and match.group(1) else None
        if value is None or not 1 <= value <= 5:
            found = "no \"Final Score: N\"" if value is None else f"the score {match.group(1)}, outside [1, 5]"
            raise RewardServerError(f"UnifiedReward at {self.url} answered image {index} with {found}: {text[:200]!r}. "
                                    f"Is --model-path a UnifiedReward checkpoint and the chat template its own?")
        return value / 5


# ----------------------------------------------------------------------------------------------
# The server


def parse_request(body: bytes) -> tuple[torch.Tensor, list[str], list[dict] | None]:
    """A request of the protocol: as many images (PNG, all of one size) as prompts (strings) and metadata (dicts,
    or null); ValueError / TypeError / KeyError saying what is wrong otherwise."""
    request = json.loads(body)
    if not isinstance(request, dict):
        raise TypeError("the request must be a JSON object with images, prompts and metadata")
    images, prompts, metadata = request["images"], request["prompts"], request.get("metadata")
    if not isinstance(images, list) or not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise TypeError("images must be a list of base64 PNGs and prompts a list of strings")
    if metadata is not None and not (isinstance(metadata, list) and all(isinstance(m, dict) for m in metadata)):
        raise TypeError("metadata must be a list of JSON objects, one per prompt, or null")
    if len(images) != len(prompts) or (metadata is not None and len(metadata) != len(prompts)):
        raise ValueError(f"{len(images)} images, {len(prompts)} prompts and "
                         f"{'no' if metadata is None else len(metadata)} metadata: one of each per image")
    pixels = [decode_png(data) for data in images]
    if len({p.shape for p in pixels}) > 1:
        raise ValueError(f"the images differ in size ({sorted({tuple(p.shape) for p in pixels})}); send one size per request")
    return (torch.stack(pixels) if pixels else torch.zeros(0, 3, 1, 1)), prompts, metadata


def reward_server(reward: rewards.Reward, name: str, *, host: str = "127.0.0.1", port: int = 8000, timeout: float = 60.0,
                  max_request_bytes: int = MAX_REQUEST_BYTES) -> ThreadingHTTPServer:
    """A server for `reward` over the HTTP protocol (start it with serve_forever()). Each connection has its own
    thread and a socket timeout, and bodies above max_request_bytes are refused, so a slow or broken client holds only itself;
    the reward itself runs one request at a time (models are not assumed thread-safe)."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def setup(self):
            self.timeout = timeout  # StreamRequestHandler applies it to the socket: reads that stall end
            super().setup()

        def do_GET(self):
            self._answer(200, {"status": "ok", "reward": name})

        def do_POST(self):
            length = self.headers.get("Content-Length", "")
            if not length.isdigit() or int(length) > max_request_bytes:
                self._answer(413 if length.isdigit() else 411,
                             {"error": f"Content-Length must be given and at most {max_request_bytes} bytes"})
                return
            try:
                body = self.rfile.read(int(length))
            except OSError:  # the client stalled past the timeout or went away: nobody to answer
                self.close_connection = True
                return
            try:
                images, prompts, metadata = parse_request(body)
            except (KeyError, ValueError, TypeError, RecursionError) as error:  # the client's fault: say what
                self._answer(400, {"error": f"{type(error).__name__}: {error}"})
                return
            try:
                with lock:
                    result = reward(images, prompts, metadata)
                # A reward returns its scores; a served scorer may return {"scores": ..., other per-image lists}.
                fields = result if isinstance(result, dict) else {"scores": result}
                if len(fields["scores"]) != len(prompts):
                    raise ValueError(f"the reward gave {len(fields['scores'])} scores for {len(prompts)} images")
            except ValueError as error:  # a reward refusing its input (e.g. GenEval without metadata): the client's
                self._answer(400, {"error": f"ValueError: {error}"})
                return
            except Exception as error:  # the reward's fault: report it, keep serving
                self._answer(500, {"error": f"{type(error).__name__}: {error}"})
                return
            self._answer(200, {k: v.float().cpu().tolist() if isinstance(v, torch.Tensor) else list(v)
                               for k, v in fields.items()})

        def _answer(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # quiet: errors go back to the client instead
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


# ----------------------------------------------------------------------------------------------
# GenEval's scorer: the detector and the colour classifier behind its rules (rewards.py)


class GenEvalScorer:
    """GenEval behind the reward protocol: detect -> rewards.geneval_keep -> colours of the kept objects of classes a clause
    colours -> rewards.geneval_partial (the scores, Flow-GRPO's training reward) and rewards.geneval_correct (the accuracy GenEval
    reports). detect(images (B, H, W, 3) uint8 RGB) -> per image {class: [Detection]}; colors(image (H, W, 3), objects,
    class) -> one colour name per object."""

    def __init__(self, detect: Callable, colors: Callable, **settings: float):
        self.detect, self.colors = detect, colors
        self.settings = {**rewards.GENEVAL_SETTINGS, **settings}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> dict:
        if metadata is None:
            raise ValueError("GenEval needs each prompt's metadata (tag, include, exclude); send it with the request")
        for prompt, meta in zip(prompts, metadata):
            rewards.check_geneval_metadata(prompt, meta)
        keep = {k: self.settings[k] for k in ("threshold", "counting_threshold", "max_objects", "max_overlap")}
        pixels = rewards.to_uint8(images)
        scores, accuracy, reasons = [], [], []
        for image, raw, meta in zip(pixels, self.detect(pixels), metadata):
            objects = rewards.geneval_keep(raw, meta["tag"], **keep)
            for name in {c["class"] for c in meta["include"] if "color" in c and c["class"] in objects}:
                for det, color in zip(objects[name], self.colors(image, objects[name], name)):
                    det.color = color
            correct, why = rewards.geneval_correct(objects, meta, position_threshold=self.settings["position_threshold"])
            scores.append(rewards.geneval_partial(objects, meta, position_threshold=self.settings["position_threshold"]))
            accuracy.append(float(correct))
            reasons.append(why)
        return {"scores": torch.tensor(scores, dtype=torch.float32), "accuracy": torch.tensor(accuracy), "reasons": reasons}


def mmdet_detections(result) -> dict[str, list[Detection]]:
    """One image's result of mmdet 2.x inference_detector, (per-class (n, 5) arrays [x1, y1, x2, y2, score], per-class
    lists of (H, W) masks) or the boxes alone, as {class name: [Detection]} in the detector's order."""
    boxes, masks = result if isinstance(result, tuple) else (result, None)
    out = {}
    for index, name in enumerate(rewards.GENEVAL_CLASSES):
        rows = np.asarray(boxes[index]).reshape(-1, 5)
        if len(rows):
            out[name] = [Detection(tuple(row[:4].tolist()), float(row[4]), None if masks is None else np.asarray(masks[index][i]))
                         for i, row in enumerate(rows)]
    return out


def mask2former_detector(config: str, checkpoint: str, device: str) -> Callable:
    """GenEval's detector: Mask2Former Swin-S (mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco, GenEval's
    download_models.sh) through mmdet 2.x. Images are handed over in BGR, as mmdet reads GenEval's image files."""
    try:
        from mmdet.apis import inference_detector, init_detector
    except ImportError:
        raise ImportError("GenEval's detector needs mmdet 2.x and mmcv-full in the serving environment (GenEval's "
                          "README: mmdetection branch 2.x); the training environment only needs this server's URL") from None
    model = init_detector(config, checkpoint, device=device)
    return lambda images: [mmdet_detections(r) for r in inference_detector(model, [np.ascontiguousarray(i[..., ::-1]) for i in images])]


class ClipColors:
    """GenEval's colour check: zero-shot CLIP over rewards.GENEVAL_COLORS with its three templates per class ("a photo of a
    {c} {class}", "a photo of a {c}-colored {class}", "a photo of a {c} object"; text embeddings normalised, averaged
    per colour, normalised again), on each object's crop: the image composited over grey #999 outside the object's
    mask, cropped to its box, then CLIP's shorter-side resize and centre crop. CLIP ViT-L/14 (openai) in transformers,
    the weights GenEval loads through open_clip."""

    TEMPLATES = ("a photo of a {c} {name}", "a photo of a {c}-colored {name}", "a photo of a {c} object")

    def __init__(self, model: str = "openai/clip-vit-large-patch14", device: str = "cpu"):
        from transformers import AutoProcessor, CLIPModel

        self.scorer = rewards.ClipScorer(CLIPModel.from_pretrained(model), AutoProcessor.from_pretrained(model),
                                         use_logit_scale=False, device=device, dtype=torch.float32,
                                         preprocess=lambda images, proc: rewards.resize_shorter_and_center_crop(
                                     images, proc.crop_size["height"], proc.image_mean, proc.image_std))
        self.classifiers: dict[str, torch.Tensor] = {}

    def classifier(self, name: str) -> torch.Tensor:
        if name not in self.classifiers:
            texts = [t.format(c=c, name=name) for c in rewards.GENEVAL_COLORS for t in self.TEMPLATES]
            per_color = self.scorer.embed_texts(texts).view(len(rewards.GENEVAL_COLORS), len(self.TEMPLATES), -1).mean(1)
            self.classifiers[name] = F.normalize(per_color, dim=-1)  # (colours, D)
        return self.classifiers[name]

    def __call__(self, image: np.ndarray, objects: list[Detection], name: str) -> list[str]:
        crops = [geneval_crop(image, d) for d in objects]
        logits = [self.scorer.embed_images(crop) @ self.classifier(name).T for crop in crops]
        return [rewards.GENEVAL_COLORS[int(row.argmax())] for row in torch.cat(logits)]


def geneval_crop(image: np.ndarray, detection: Detection) -> torch.Tensor:
    """ImageCrops of evaluate_images.py: outside the mask the image is grey #999, then cropped to the box (PIL rounds
    the box). (H, W, 3) uint8 -> (1, 3, h, w) floats in [0, 1]."""
    from PIL import Image

    picture = Image.fromarray(image)
    if detection.mask is not None:
        picture = Image.composite(picture, Image.new("RGB", picture.size, "#999"), Image.fromarray(detection.mask))
    crop = np.asarray(picture.crop(tuple(detection.box)))
    return torch.from_numpy(crop.copy()).permute(2, 0, 1)[None].float() / 255


def geneval_server(*, device: str = "cpu", detector_config: str = "", detector_checkpoint: str = "",
                   clip: str = "openai/clip-vit-large-patch14") -> GenEvalScorer:
    """What `python rewards.py serve geneval` serves: GenEvalScorer with Mask2Former (detector_config: mmdet's
    configs/mask2former/mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py; detector_checkpoint: the .pth GenEval's
    download_models.sh fetches) and CLIP colours."""
    if not detector_config or not detector_checkpoint:
        raise ValueError("serve geneval needs --option detector_config=PATH --option detector_checkpoint=PATH "
                         "(Mask2Former, as GenEval's evaluation/download_models.sh fetches it)")
    return GenEvalScorer(mask2former_detector(detector_config, detector_checkpoint, device), ClipColors(clip, device))


# ----------------------------------------------------------------------------------------------
# python rewards.py serve NAME


# What `python rewards.py serve NAME` serves where it is not the rewards.REWARDS entry itself (an HTTP client there).
SERVED: dict[str, Callable[..., Callable]] = {"geneval": geneval_server}


def serve(argv: list[str] | None = None) -> None:
    """`python rewards.py serve NAME`: every mistake (an unknown option, a port out of range or in use, a bad timeout)
    is one line and exit 2 before anything is loaded or bound."""
    parser = argparse.ArgumentParser(description="Serve a reward of rewards.py over HTTP (protocol: module docstring).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd = sub.add_parser("serve", help="serve one reward")
    serve_cmd.add_argument("name", choices=sorted(rewards.REWARDS))
    serve_cmd.add_argument("--host", default="127.0.0.1", help="address to bind; 127.0.0.1 keeps it local")
    serve_cmd.add_argument("--port", type=int, default=None, help="default: the port the NAME client calls, else 8000")
    serve_cmd.add_argument("--timeout", type=float, default=60.0, help="seconds a client may stall a read")
    serve_cmd.add_argument("--max_request_mb", type=int, default=MAX_REQUEST_BYTES >> 20, help="largest request body")
    serve_cmd.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    serve_cmd.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                           help="factory option, e.g. --option model=/path/to/PickScore (repeatable; JSON values)")
    args = parser.parse_args(argv)

    def refuse(message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)

    client = rewards.REWARDS[args.name]
    if args.name not in SERVED and hasattr(client, "port"):
        how = UNIFIEDREWARD_SERVER if args.name == "unifiedreward" else "the protocol is in reward_bridge.py"
        refuse(f"{args.name} is an HTTP client here: run its own server ({how})")
    port = getattr(client, "port", 8000) if args.port is None else args.port
    if not 0 <= port <= 65535 or not (math.isfinite(args.timeout) and args.timeout > 0) or args.max_request_mb < 1:
        refuse(f"--port {port} must be 0-65535, --timeout {args.timeout} a number of seconds > 0 and "
               f"--max_request_mb {args.max_request_mb} at least 1")
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            refuse(f"--option {item!r} must look like KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value  # a bare string such as a path
    factory = SERVED.get(args.name) or client
    try:
        rewards.check_options(args.name, options, factory)
        served = factory(device=args.device, **options)
    except (ValueError, ImportError, OSError) as error:
        refuse(f"serve {args.name}: {error}")
    try:
        server = reward_server(served, args.name, host=args.host, port=port, timeout=args.timeout,
                               max_request_bytes=args.max_request_mb << 20)
    except OSError as error:  # the port is taken, the host is not this machine's
        refuse(f"cannot listen on {args.host}:{port}: {error.strerror or error}; pick another --port or --host")
    print(f"serving reward {args.name!r} on http://{args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()
