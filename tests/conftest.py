"""Fixtures shared by the test files: saved tiny pipelines of every family, short runs on them, the real-width
pipelines, a tiny CLIP. Each is built once per session; under pytest-xdist the workers share one copy (built_once).
"""

import gc
import json
import os
from pathlib import Path

# Before torch is imported, here and in every process the tests start: torch's CPU allocator asks for transparent
# huge pages for its allocations of 2 MB and more. The real-width tests allocate and free gigabytes, and the kernel's
# zeroing of 4 kB pages took a third of the suite's CPU time (a 2-process FSDP2 bf16 step: 29 s -> 22 s, sys 30 -> 13).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import adapters
import bf16_matmul
import builders
from helpers import DIFFUSERS_FROM_GRID, SMALL_RUN, built_once, run_train, sincos_table_from_grid


def pytest_configure(config):
    """Under pytest-xdist (the README's -n 2): one thread per worker, and for the processes its tests start. Two
    workers of two threads each on two cores run slower than one worker: the default-run test took 182 s instead of
    46 s. Every result is independent of the thread count (the committed bases are fitted the same either way)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The README's default run, the suite's longest test (about a minute, a tiny model's few hundred MB), goes first:
    last in its file's order it could end alone on one worker while the other had nothing left to run. (Sorting every
    long test first put real-width tests side by side and ran a worker out of memory: only this one moves.)"""
    items.sort(key=lambda item: item.name != "test_default_run_from_the_readme_raises_the_reward")


@pytest.fixture(autouse=True)
def free_real_width_models(request):
    """After a test that used real-width models, collect the cycles that hold them (gigabytes each): two xdist workers
    and a test's torchrun processes share 24 GB."""
    yield
    if "real_dirs" in request.fixturenames:
        gc.collect()


@pytest.fixture(autouse=True, scope="session")
def sd3_position_table_fast():
    """Every SD3 transformer computes its sin-cos position table at construction, even when loading a checkpoint that
    holds it: at real width 384 x 384 positions x 1536 channels, 226M float64 sines and cosines, 7-15 s on these CPUs,
    paid by each real-width SD3 model the tests build. Half the channels depend on the row only and half on the column
    only (diffusers' get_2d_sincos_pos_embed_from_grid), so helpers.sincos_table_from_grid computes one row and one
    column of the table and broadcasts them: the same numbers in float32, the dtype PatchEmbed stores them in, in
    0.6 s (test_builders checks them against diffusers' own). No test's result depends on how long this takes."""
    from diffusers.models import embeddings

    embeddings.get_2d_sincos_pos_embed_from_grid = sincos_table_from_grid
    yield
    embeddings.get_2d_sincos_pos_embed_from_grid = DIFFUSERS_FROM_GRID


@pytest.fixture
def bf16_matmul_fast(monkeypatch):
    """bf16 products through the float32 kernel, in this process and in the Python processes the test starts, where
    torch's bf16 kernel is the slow reference loop (bf16_matmul.py)."""
    if not bf16_matmul.needed():
        yield
        return
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(bf16_matmul.SITE), os.environ.get("PYTHONPATH")])))
    with bf16_matmul.Float32Products():
        yield


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Random tiny pipelines of every family saved with save_pretrained, and a jsonl prompt file."""
    def build(root):
        for family in adapters.ADAPTERS:
            builders.tiny_pipeline(family, seed=0).save_pretrained(root / family)
        (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"a {c} {t}", "color": c})
                                                      for c in ("red", "green", "blue") for t in ("car", "flower")))
    return built_once(tmp_path_factory, "pipelines", build)


@pytest.fixture(scope="session")
def sd3_run(tiny_dirs, tmp_path_factory):
    """Two LoRA iterations on the saved tiny SD3 pipeline, one process."""
    return built_once(tmp_path_factory, "sd3-run", lambda run_dir: run_train(
        "--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir", run_dir, *SMALL_RUN))


@pytest.fixture(scope="session")
def sd3_straight(tiny_dirs, tmp_path_factory):
    """sd3_run's settings for 4 iterations straight: what a continued run must equal."""
    return built_once(tmp_path_factory, "sd3-straight", lambda run_dir: run_train(
        "--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN, "--iterations", "4",
        "--run_dir", run_dir))


class SavedReal:
    """`real_dirs / NAME`: the saved pipeline of one member at real width, built and saved the first time a test asks
    for it (5 to 25 s each), so that a test waits for the one it uses only; `real_dirs / "prompts.txt"`: two prompts.
    Saved in bfloat16, as the real checkpoints are: half the bytes to write and read of float32 (11 GB -> 5.5 GB);
    the tests that compare in float32 load them as float32."""

    def __init__(self, tmp_path_factory):
        self.factory, self.paths = tmp_path_factory, {}

    def __truediv__(self, name: str) -> Path:
        if name not in self.paths:
            if name == "prompts.txt":
                self.paths[name] = built_once(self.factory, "real-prompts", lambda root: (
                    root / name).write_text("a red car\na blue flower\n")) / name
            else:
                self.paths[name] = built_once(self.factory, f"real-{name}", lambda root: builders.reduced_pipeline(
                    name).to(torch.bfloat16).save_pretrained(root))
        return self.paths[name]


@pytest.fixture(scope="session")
def real_dirs(tmp_path_factory):
    """One member of each family at real width (SAVED_REAL), saved with save_pretrained: SD3.5-Medium (2 blocks),
    FLUX.1-dev and FLUX.2 [klein] 4B (1 double + 1 single block), Qwen-Image and Wan2.1-T2V-1.3B (1 block)."""
    return SavedReal(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A random CLIPModel + CLIP processor (tokenizer built offline), saved like a hub checkpoint."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    tok = builders.tiny_clip_tokenizer()
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=24)
    path = tmp_path_factory.mktemp("clip")
    CLIPModel(config).save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(path)
    return str(path)
