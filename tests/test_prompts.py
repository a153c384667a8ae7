"""Tests of prompts.py: the named sets (GenEval's splits, OCR, hub sets read from the cache) and their errors.
"""

import collections
import hashlib
import io
import json
import re
import shutil

import pytest

import failures
import prompts as prompt_sets
import rewards


def test_geneval_test_split_is_genevals_own_evaluation_set():
    """GenEval's create_prompts.py written out gives its published prompts/evaluation_metadata.jsonl byte for byte:
    the sha256 below is that file's (djghosh13/geneval), 553 records."""
    records = [p.metadata for p in prompt_sets.load("geneval-generated:test")]
    text = "".join(json.dumps(r) + "\n" for r in records)
    assert len(records) == 553
    assert hashlib.sha256(text.encode()).hexdigest() == "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13"


def test_geneval_train_split_has_every_task_and_no_test_prompt_beyond_single_objects():
    train_set = prompt_sets.load("geneval-generated")
    test_texts = {p.text for p in prompt_sets.load("geneval-generated:test") if p.metadata["tag"] != "single_object"}
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
    train_set, test_set = prompt_sets.load("ocr-templates"), prompt_sets.load("ocr-templates:test")
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
    ("ocr-templates:validation", "has no 'validation' split"),
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


# ----------------------------------------------------------------------------------------------
# Flow-GRPO's prompt files


def test_git_blob_id_is_what_git_hash_object_prints():
    """The pins are the ids Flow-GRPO's tree lists; git's own value for the empty file and for b"hello\\n"."""
    assert prompt_sets.git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert prompt_sets.git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


@pytest.fixture
def flow_grpo_files(tmp_path, monkeypatch):
    """A stand-in for Flow-GRPO's repository served from file:// URLs, its files pinned by their own hashes, and an
    empty cache: what the pins and URLs of the real files do, on files made here (the real ones are not committed)."""
    repo = tmp_path / "repo"
    files = {
        "dataset/ocr/test.txt": b'A sign that says "Open Late"\r\n  a mug printed with "Best Dad"  \n\nrepeat "x"\nrepeat "x"',
        "dataset/geneval/test_metadata.jsonl": (json.dumps({"tag": "single_object", "include": [{"class": "dog",
                                                "count": 1}], "prompt": "a photo of a dog"}) + "\n").encode(),
    }
    pins = {}
    for path, data in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(data)
        pins[path] = (prompt_sets.git_blob_id(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(prompt_sets, "FLOW_GRPO_FILES", pins)
    monkeypatch.setattr(prompt_sets, "FLOW_GRPO_URL", f"file://{repo}/{{path}}")
    monkeypatch.setenv("VGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return repo, tmp_path / "cache" / "flow_grpo" / prompt_sets.FLOW_GRPO[1]


def test_flow_grpo_sets_are_read_as_its_training_script_reads_them_and_cached_once(flow_grpo_files):
    """Every line stripped, in order, repeats kept (TextPromptDataset: `line.strip() for line in f.readlines()`);
    GenEval's records whole as metadata. Downloaded once: the second read needs no repository."""
    repo, cache = flow_grpo_files
    texts = [p.text for p in prompt_sets.load("ocr:test")]
    with open(repo / "dataset/ocr/test.txt") as f:  # Flow-GRPO's reading, written out
        assert texts == [line.strip() for line in f.readlines()]
    assert texts == ['A sign that says "Open Late"', 'a mug printed with "Best Dad"', "", 'repeat "x"', 'repeat "x"']
    (geneval,) = prompt_sets.load("geneval:test")
    assert geneval.text == "a photo of a dog" and geneval.metadata["include"] == [{"class": "dog", "count": 1}]
    shutil.rmtree(repo)
    assert [p.text for p in prompt_sets.load("ocr:test")] == texts  # from the cache
    assert (cache / "dataset/ocr/test.txt").is_file()


def test_flow_grpo_file_unreachable_or_altered_is_refused_in_one_line_naming_what_to_place_where(flow_grpo_files,
                                                                                                monkeypatch):
    repo, cache = flow_grpo_files
    local = cache / "dataset/ocr/test.txt"
    url = f"file://{repo}/dataset/ocr/test.txt"
    blob, sha256 = prompt_sets.FLOW_GRPO_FILES["dataset/ocr/test.txt"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline with an empty cache
    with pytest.raises(failures.ConfigError) as offline:
        prompt_sets.load("ocr:test")
    assert f"download {url} (git blob {blob}, sha256 {sha256}) and place it at {local}" in str(offline.value)
    assert not local.exists()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (repo / "dataset/ocr/test.txt").write_bytes(b'A sign that says "Open Late!"')  # the server gives another file
    with pytest.raises(failures.ConfigError, match=f"gave a file that is not the pinned one .*git blob .* pinned {blob}"):
        prompt_sets.load("ocr:test")
    assert not local.exists()  # nothing kept
    local.parent.mkdir(parents=True)
    local.write_bytes(b'A sign that says "Open Late"\r\n  a mug printed with "Best Dad"  \n\nrepeat "x"\nrepeat "y"')
    with pytest.raises(failures.ConfigError, match=f"{local} is not Flow-GRPO's dataset/ocr/test.txt .*delete it"):
        prompt_sets.load("ocr:test")  # a cached file one byte off


def test_the_pinned_flow_grpo_files_name_every_set_the_papers_stages_use():
    """ocr, pickscore and geneval, train and test: the paper's preference, GenEval and OCR stages (Flow-GRPO's
    files); the generated sets keep other names and say they are not the paper's."""
    for name, files in (("ocr", ("dataset/ocr/train.txt", "dataset/ocr/test.txt")),
                        ("pickscore", ("dataset/pickscore/train.txt", "dataset/pickscore/test.txt")),
                        ("geneval", ("dataset/geneval/train_metadata.jsonl", "dataset/geneval/test_metadata.jsonl"))):
        assert set(prompt_sets.SETS[name].splits) == {"train", "test"} and "Flow-GRPO" in prompt_sets.SETS[name].source
        assert all(re.fullmatch("[0-9a-f]{40}", prompt_sets.FLOW_GRPO_FILES[f][0]) for f in files)
    for name in ("ocr-templates", "geneval-generated"):
        assert "not the paper's" in prompt_sets.SETS[name].source
