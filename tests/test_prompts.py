"""Tests of prompts.py: the named sets (GenEval's splits, OCR, hub sets read from the cache) and their errors.
"""

import collections
import hashlib
import io
import json

import pytest

import failures
import prompts as prompt_sets
import rewards


def test_geneval_test_split_is_genevals_own_evaluation_set():
    """GenEval's create_prompts.py written out gives its published prompts/evaluation_metadata.jsonl byte for byte:
    the sha256 below is that file's (djghosh13/geneval), 553 records."""
    records = [p.metadata for p in prompt_sets.load("geneval:test")]
    text = "".join(json.dumps(r) + "\n" for r in records)
    assert len(records) == 553
    assert hashlib.sha256(text.encode()).hexdigest() == "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13"


def test_geneval_train_split_has_every_task_and_no_test_prompt_beyond_single_objects():
    train_set = prompt_sets.load("geneval")
    test_texts = {p.text for p in prompt_sets.load("geneval:test") if p.metadata["tag"] != "single_object"}
    tags = collections.Counter(p.metadata["tag"] for p in train_set)
    assert set(tags) == set(rewards.GENEVAL_TASKS) and min(tags.values()) > 1000
    assert not test_texts & {p.text for p in train_set}
    for p in train_set[::97]:
        rewards.check_prompt("geneval", p.text, p.metadata)


def test_prompt_files_strip_each_line_and_skip_blank_ones(tmp_path):
    """Spaces, tabs and Windows line ends around a prompt are not part of it; a line of only those is no prompt."""
    txt = tmp_path / "prompts.txt"
    txt.write_bytes(b"  a red car  \r\n\n\t \r\n\ta blue flower\t\n   \nlast line without newline ")
    assert [p.text for p in prompt_sets.load_file(str(txt))] == ["a red car", "a blue flower", "last line without newline"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('\n{"prompt": "a red car", "color": "red"}\n   \n{"prompt": "  kept as written  "}\n')
    assert [(p.text, p.metadata.get("color")) for p in prompt_sets.load_file(str(jsonl))] == [
        ("a red car", "red"), ("  kept as written  ", None)]


def test_ocr_sets_quote_a_text_and_share_none_between_train_and_test():
    train_set, test_set = prompt_sets.load("ocr"), prompt_sets.load("ocr:test")
    assert (len(train_set), len(test_set)) == (20_000, 1000)
    for p in train_set[::50] + test_set[::10]:
        assert rewards.ocr_target(p.text) == rewards.ocr_target(p.text, p.metadata) == p.metadata["text"]
    norm = lambda ps: {p.metadata["text"].lower() for p in ps}  # noqa: E731
    assert not norm(train_set) & norm(test_set)


def fake_hub_cache(root, repo, revision, files: dict):
    """The layout huggingface_hub's cache has after a download (datasets--ORG--NAME/snapshots/REVISION/FILE)."""
    snapshot = root / f"datasets--{repo.replace('/', '--')}" / "snapshots" / revision
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    return root


@pytest.fixture
def hub_mirror(tmp_path, monkeypatch):
    """A local mirror of the hub files the named sets read, served through huggingface_hub's own cache lookup (no
    network: HF_HUB_OFFLINE), in the format each dataset publishes."""
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(captions):
        buffer = io.BytesIO()
        pq.write_table(pa.table({"caption": captions, "other": list(range(len(captions)))}), buffer)
        return buffer.getvalue()

    repo, revision = prompt_sets.HPDV2
    fake_hub_cache(tmp_path, repo, revision, {
        "train.json": json.dumps([{"prompt": "a cat", "image_path": ["1.jpg"]}, {"prompt": " a cat "},
                                  {"prompt": "a dog on a hill"}]).encode(),
        "test.json": json.dumps([{"prompt": f"test prompt {i}", "rank": [0, 1]} for i in range(4)]).encode(),
        "benchmark/drawbench.json": json.dumps(["A red colored car.", "A bird scaring a scarecrow."]).encode()})
    repo, revision = prompt_sets.PICKAPIC
    fake_hub_cache(tmp_path, repo, revision, {
        "data/test_unique-00000-of-00001-73a51cbb6488571d.parquet": parquet(["a castle", "a boat", "a castle"]),
        "data/train-00000-of-00001-b138676ed2d1f52a.parquet": parquet(["a castle", "a wizard", "", "a wizard", "a moon"])})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_hub_sets_are_read_from_the_hub_cache_and_converted_to_prompts(hub_mirror):
    said = []
    texts = lambda spec: [p.text for p in prompt_sets.load(spec, say=said.append)]  # noqa: E731
    assert texts("hpdv2") == ["a cat", "a dog on a hill"]  # stripped, first occurrence of each
    assert texts("hpdv2:test") == [f"test prompt {i}" for i in range(4)]
    assert texts("drawbench:test") == ["A red colored car.", "A bird scaring a scarecrow."]
    assert texts("pickapic:test") == ["a castle", "a boat"]
    assert texts("pickapic") == ["a wizard", "a moon"]  # train minus test, no empty caption
    assert all("licence" in line and "prompts from hub dataset" in line for line in said)


@pytest.mark.parametrize("spec,message", [
    ("nonsense", "neither a prompt file .* nor a named set"),
    ("drawbench:train", "has no 'train' split; it has test"),
    ("ocr:validation", "has no 'validation' split"),
])
def test_bad_prompt_set_names_are_one_line(spec, message):
    with pytest.raises(failures.ConfigError, match=message):
        prompt_sets.load(spec)


def test_offline_without_the_file_or_with_a_corrupt_one_is_one_line(hub_mirror):
    repo, revision = prompt_sets.HPDV2
    test_file = hub_mirror / f"datasets--{repo.replace('/', '--')}" / "snapshots" / revision / "test.json"
    test_file.write_text('[{"prompt": "trunc')
    with pytest.raises(failures.ConfigError, match="cannot be read .*delete it and run again"):
        prompt_sets.load("hpdv2:test")
    test_file.unlink()
    with pytest.raises(failures.ConfigError, match=r"needs test.json of the hub dataset ymhao/HPDv2 .*python prompts.py hpdv2:test"):
        prompt_sets.load("hpdv2:test")
