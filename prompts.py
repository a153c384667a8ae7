"""prompts.py: the prompts a run trains and is evaluated on.

`--prompts` of train.py and evaluate.py takes a file or a named set:

    prompts.txt          one prompt per line
    prompts.jsonl        one JSON object per line with a string "prompt"; the whole object reaches the rewards as
                         the prompt's metadata (GenEval reads its "tag", "include" and "exclude" from it)
    NAME or NAME:SPLIT   a named set below; SPLIT is train or test. train.py trains on NAME:train and evaluates on
                         NAME:test; evaluate.py uses NAME:test

| set                 | train                              | test                              | from                 |
| ------------------- | ---------------------------------- | --------------------------------- | -------------------- |
| `ocr`               | Flow-GRPO's dataset/ocr/train.txt  | its test.txt, 1,018 prompts       | Flow-GRPO's files,   |
| `pickscore`         | its pickscore/train.txt, 25,432    | its test.txt, 2,048 prompts       | pinned (FLOW_GRPO):  |
| `geneval`           | its geneval/train_metadata.jsonl   | its test_metadata.jsonl: GenEval's| the paper's stages   |
|                     |                                    | 553 prompts, 4 times each         |                      |
| `ocr-templates`     | 20,000 generated                   | 1,000 generated, texts unseen in  | this file            |
|                     |                                    | train                             |                      |
| `geneval-generated` | GenEval's six tasks, generated     | GenEval's 553 evaluation prompts, | this file (GenEval's |
|                     | with seed 0, test removed          | exactly                           | create_prompts)      |
| `pickapic`          | unique captions of Pick-a-Pic      | its 500 test_unique captions      | hub, pyarrow needed  |
|                     | v1's train split minus test        |                                   |                      |
| `hpdv2`             | unique prompts of HPDv2 train      | the 400 prompts of HPDv2 test     | hub                  |
| `drawbench`         | none (an evaluation set)           | the 200 DrawBench prompts         | hub (HPDv2's copy)   |

Flow-GRPO's files are read as its training script reads them (every line, in order), downloaded once into
$VGRPO_CACHE (default ~/.cache/v-grpo) and checked against their pins on every read; offline with an empty cache
the run stops in one line naming the URL, the pin and the local path to place the file at by hand.
Hub sets are downloaded once with huggingface_hub into its cache (HF_HUB_CACHE), pinned to a commit, and read
from there afterwards; offline with an empty cache the run stops in one line saying what to fetch.
`python prompts.py NAME:SPLIT > file.jsonl` writes a set out.
"""

import hashlib
import json
import os
import sys
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import builders
import models
import rewards
from failures import ConfigError


@dataclass
class Prompt:
    text: str
    metadata: dict


# ----------------------------------------------------------------------------------------------
# A run's prompts


def training_prompts(cfg) -> tuple[list[Prompt], list[Prompt]]:
    """The training prompts and the eval_samples evaluation prompts (position i gets fixed noise i): --prompts (a file
    or a named set's train split; tiny models have built-ins) and --eval_prompts, by default the named set's test
    split or else the first training prompts, cycled. Checked against what the rewards need from each prompt.
    cfg: a train.Config."""
    if not cfg.prompts and cfg.model not in builders.TINY_MODELS:
        raise ConfigError(f"--prompts is required for a real model: a .txt (one prompt per line) or .jsonl file, or a "
                          f"named set ({', '.join(SETS)})")
    say = print if os.environ.get("RANK", "0") == "0" else (lambda _: None)
    prompts = (load(cfg.prompts, split="train", say=say) if cfg.prompts
               else [Prompt(p, {}) for p in builders.tiny_prompts(models.model_family(cfg.model))])
    eval_spec = cfg.eval_prompts or test_split(cfg.prompts)
    listed = load(eval_spec, split="test", say=say) if eval_spec else prompts[:cfg.eval_samples]
    eval_prompts = [listed[i % len(listed)] for i in range(cfg.eval_samples)]
    names = rewards.parse_reward_spec(cfg.rewards)
    check_for_rewards(prompts, names, cfg.prompts or "the built-in prompts")
    if eval_spec:
        check_for_rewards(eval_prompts, names, eval_spec)
    return prompts, eval_prompts


# ----------------------------------------------------------------------------------------------
# Files


# Every text encoder truncates a prompt long before this (CLIP at 77 tokens, T5 at 512); a longer line is a wrong
# file, and tokenising it whole cost 58 s per iteration at 2 MB and ran out of memory at 26 MB.
MAX_PROMPT_CHARS = 10_000


def load_file(path: str) -> list[Prompt]:
    """.txt: one prompt per line. .jsonl: one JSON object per line with a string 'prompt' (the whole object is the
    prompt's metadata). Anything else, or a file that is not UTF-8 text, is refused in one line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"prompt file {path} does not exist; pass a .txt or .jsonl file or a named set "
                          f"({', '.join(SETS)})")
    if file.suffix == ".json":
        raise ConfigError(f"prompt file {path}: .json is not read; write one JSON object per line as .jsonl, or one "
                          "prompt per line as .txt")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"prompt file {path} is not UTF-8 text (byte {error.start}); pass a .txt or .jsonl file") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if file.suffix == ".jsonl":
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ConfigError(f"{where}: expected a JSON object with a string 'prompt' field")
            prompt = Prompt(record["prompt"], record)
        else:
            prompt = Prompt(line.strip(), {})
        if len(prompt.text) > MAX_PROMPT_CHARS:
            raise ConfigError(f"{where}: the prompt is {len(prompt.text)} characters; text encoders read at most "
                              f"512 tokens, so more than {MAX_PROMPT_CHARS} means a wrong file")
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"prompt file {path} holds no prompts")
    return prompts


def load(spec: str, *, split: str = "train", say: Callable[[str], None] = lambda _: None) -> list[Prompt]:
    """The prompts `spec` names: a named set (NAME, or NAME:SPLIT overriding `split`) or a .txt / .jsonl file.
    say(line) is told where a named set comes from (source, licence, count)."""
    name, _, chosen = spec.partition(":")
    if name not in SETS:
        if Path(spec).suffix in (".txt", ".jsonl", ".json") or Path(spec).exists():
            return load_file(spec)
        raise ConfigError(f"--prompts {spec!r} is neither a prompt file (.txt or .jsonl) nor a named set: "
                          f"{', '.join(SETS)} (optionally NAME:train or NAME:test)")
    prompt_set, split = SETS[name], chosen or split
    if split not in prompt_set.splits:
        raise ConfigError(f"prompt set {name!r} has no {split!r} split; it has {', '.join(prompt_set.splits)} "
                          f"(write {name}:{next(iter(prompt_set.splits))})")
    prompts = prompt_set.splits[split]()
    say(f"prompts: {name}:{split}, {len(prompts)} prompts from {prompt_set.source} (licence: {prompt_set.licence})")
    return prompts


def test_split(spec: str) -> str:
    """NAME:test when spec names a set that has a test split (train.py evaluates on it by default), else ''."""
    name = spec.partition(":")[0]
    return f"{name}:test" if name in SETS and "test" in SETS[name].splits else ""


def check_for_rewards(prompts: list[Prompt], names, source: str) -> None:
    """Rewards that need something from every prompt (color: a colour word; ocr: a quoted text; geneval: its
    metadata) say so before training, in one line."""
    for name in names:
        for number, p in enumerate(prompts, 1):
            try:
                rewards.check_prompt(name, p.text, p.metadata)
            except ValueError as error:
                raise ConfigError(f"{source}, prompt {number}: {error}") from None


# ----------------------------------------------------------------------------------------------
# GenEval (Ghosh et al., 2023): its prompt generator (prompts/create_prompts.py) written out. With seed 43 and 100
# samples per task it gives GenEval's own evaluation set, prompt for prompt (the test compares the file's sha256).


def _with_article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _plural(name: str) -> str:
    return f"{name}es" if name[-1] == "s" else f"{name}s"


def _single_object(rng, classes, index=None) -> dict:
    i = rng.choice(len(classes)) if index is None else index
    return dict(tag="single_object", include=[{"class": classes[i], "count": 1}], prompt=f"a photo of {_with_article(classes[i])}")


def _two_object(rng, classes) -> dict:
    a, b = rng.choice(len(classes), size=2, replace=False)
    return dict(tag="two_object", include=[{"class": classes[a], "count": 1}, {"class": classes[b], "count": 1}],
                prompt=f"a photo of {_with_article(classes[a])} and {_with_article(classes[b])}")


def _counting(rng, classes) -> dict:
    i = rng.choice(len(classes))
    n = int(rng.integers(2, 4, endpoint=True))
    return dict(tag="counting", include=[{"class": classes[i], "count": n}], exclude=[{"class": classes[i], "count": n + 1}],
                prompt=f"a photo of {rewards.GENEVAL_NUMBERS[n]} {_plural(classes[i])}")


def _not_person(rng, classes, size=None):
    """Classes other than "person" (GenEval writes no "[colour] person" prompt): one, or `size` distinct ones."""
    drawn = rng.choice(len(classes) - 1, size=size, replace=False) + 1 if size else rng.choice(len(classes) - 1) + 1
    return (drawn + classes.index("person")) % len(classes)


def _colors(rng, classes) -> dict:
    i = _not_person(rng, classes)
    color = rewards.GENEVAL_COLORS[rng.choice(len(rewards.GENEVAL_COLORS))]
    return dict(tag="colors", include=[{"class": classes[i], "count": 1, "color": color}],
                prompt=f"a photo of {_with_article(color)} {classes[i]}")


def _position(rng, classes) -> dict:
    a, b = rng.choice(len(classes), size=2, replace=False)
    where = rewards.GENEVAL_POSITIONS[rng.choice(len(rewards.GENEVAL_POSITIONS))]
    return dict(tag="position", include=[{"class": classes[b], "count": 1},
                                         {"class": classes[a], "count": 1, "position": [where, 0]}],
                prompt=f"a photo of {_with_article(classes[a])} {where} {_with_article(classes[b])}")


def _color_attr(rng, classes) -> dict:
    a, b = _not_person(rng, classes, size=2)
    colors = rewards.GENEVAL_COLORS
    ca, cb = rng.choice(len(colors), size=2, replace=False)
    return dict(tag="color_attr", include=[{"class": classes[a], "count": 1, "color": colors[ca]},
                                           {"class": classes[b], "count": 1, "color": colors[cb]}],
                prompt=f"a photo of {_with_article(colors[ca])} {classes[a]} and {_with_article(colors[cb])} {classes[b]}")


GENEVAL_DRAWS = (_two_object, _counting, _colors, _position, _color_attr)  # GenEval's order after the single objects


def geneval_test() -> list[Prompt]:
    """GenEval's evaluation set, generate_suite(np.random.default_rng(43), 100): every class once as a single object
    (a permutation), then 100 draws of each other task in GenEval's order, duplicates dropped: 553 prompts (80 single
    object, 99 two objects, 80 counting, 94 colours, 100 position, 100 colour attribution)."""
    rng, classes = np.random.default_rng(43), rewards.GENEVAL_CLASSES
    samples = [_single_object(rng, classes, i) for i in rng.choice(len(classes), size=len(classes), replace=False)]
    samples += [draw(rng, classes) for draw in GENEVAL_DRAWS for _ in range(100)]
    unique, seen = [], set()
    for sample in samples:
        key = json.dumps(sample, sort_keys=True)
        if key not in seen:
            unique.append(sample)
            seen.add(key)
    return [Prompt(s["prompt"], s) for s in unique]


def geneval_train(per_task: int = 2000) -> list[Prompt]:
    """Training prompts: `per_task` draws of each of the six tasks from np.random.default_rng(0) with GenEval's
    generators (the tasks equally frequent; repeats kept, they weigh as the generator draws them), without the
    prompts of the test set. Single objects are the exception: the test set names all 80 classes, so they stay."""
    rng, classes = np.random.default_rng(0), rewards.GENEVAL_CLASSES
    test = {p.text for p in geneval_test() if p.metadata["tag"] != "single_object"}
    samples = [draw(rng, classes) for draw in (_single_object, *GENEVAL_DRAWS) for _ in range(per_task)]
    return [Prompt(s["prompt"], s) for s in samples if s["prompt"] not in test]


# ----------------------------------------------------------------------------------------------
# OCR: short texts the model must write, in scenes that carry text. Words and templates are this project's own.

OCR_TEMPLATES = (
    'a wooden sign at the edge of a forest that reads "{}"', 'a neon sign glowing above a bar at night saying "{}"',
    'a chalkboard outside a cafe with "{}" written on it', 'a vintage travel poster with the title "{}"',
    'a coffee mug printed with the words "{}"', 'a birthday cake with "{}" written in icing',
    'a street banner hanging between two buildings that says "{}"', 'a book cover with the title "{}"',
    'a t-shirt with "{}" printed across the chest', 'a license plate that reads "{}"',
    'a storefront window painted with "{}"', 'a road sign on a desert highway reading "{}"',
    'a hand-written note on lined paper that says "{}"', 'a billboard above a busy street showing "{}"',
    'a protest placard held up in a crowd reading "{}"', 'a movie poster with the headline "{}"',
    'graffiti on a brick wall spelling "{}"', 'a cat sitting next to a sign that says "{}"',
    'a glass bottle with a label that reads "{}"', 'a dog holding a small sign that says "{}"',
    'a doormat with the word "{}" woven into it', 'a laptop screen displaying the text "{}"',
    'a sandy beach with "{}" written in the sand', 'a scoreboard in a stadium showing "{}"',
    'a museum plaque engraved with "{}"', 'a pizza box with "{}" printed on the lid',
    'a train station departure board showing "{}"', 'an old typewriter page with "{}" typed on it',
    'a flag waving in the wind with "{}" on it', 'a greeting card that says "{}"',
)
OCR_WORDS = (
    "open", "closed", "welcome", "home", "coffee", "tea", "bakery", "books", "sale", "exit", "stop", "go", "north",
    "south", "east", "west", "river", "mountain", "forest", "ocean", "city", "garden", "market", "station", "hotel",
    "museum", "library", "school", "park", "bridge", "harbor", "island", "summer", "winter", "spring", "autumn",
    "morning", "night", "sunrise", "sunset", "dream", "hope", "love", "peace", "joy", "brave", "bold", "calm",
    "happy", "lucky", "wild", "free", "fresh", "daily", "best", "first", "last", "next", "new", "old", "red",
    "blue", "green", "gold", "silver", "black", "white", "orange", "purple", "pizza", "burger", "tacos", "sushi",
    "pasta", "bread", "cheese", "apple", "lemon", "honey", "sugar", "salt", "pepper", "music", "jazz", "dance",
    "party", "game", "play", "win", "team", "club", "star", "moon", "sun", "sky", "rain", "snow", "storm",
    "wind", "fire", "water", "earth", "stone", "wood", "iron", "glass", "paper", "ink", "art", "studio", "gallery",
    "theater", "cinema", "radio", "news", "post", "mail", "office", "bank", "shop", "store", "farm", "zoo",
    "airport", "road", "street", "avenue", "lane", "way", "trail", "camp", "cabin", "lake", "bay", "beach", "hill",
    "valley", "desert", "jungle", "arctic", "tiger", "lion", "bear", "wolf", "fox", "owl", "eagle", "shark",
    "whale", "panda", "rabbit", "horse", "dragon", "robot", "rocket", "planet", "galaxy", "future", "history",
    "science", "magic", "secret", "quiet", "please", "thanks", "hello", "goodbye", "yes", "no", "maybe", "always",
    "never", "now", "today", "tomorrow", "forever", "together", "family", "friends", "kitchen", "garage", "cellar",
    "attic", "tower", "castle", "palace", "temple", "church", "harvest", "festival", "parade", "carnival", "circus",
    "rodeo", "marathon", "finish", "start", "level", "score", "bonus", "extra", "super", "mega", "ultra", "prime",
    "classic", "modern", "vintage", "retro", "royal", "grand", "little", "big", "tiny", "giant", "golden", "crystal",
    "velvet", "cotton", "linen", "denim", "leather", "copper", "bronze", "marble", "granite", "cedar", "maple",
    "willow", "lotus", "rose", "tulip", "daisy", "ivy", "fern", "moss", "pebble", "cloud", "thunder", "echo",
    "shadow", "light", "spark", "flame", "frost", "breeze", "wave", "tide", "coral", "pearl", "amber", "jade",
)
OCR_TEST_SHARE = 10  # one text in 10 (by a hash of the text) is kept for the test split


def _ocr_texts(split: str) -> list[str]:
    """Every 1- and 2-word text from OCR_WORDS that belongs to `split`: the splits share no text."""
    texts = list(OCR_WORDS) + [f"{a} {b}" for a in OCR_WORDS for b in OCR_WORDS if a != b]
    in_test = lambda text: zlib.crc32(text.encode()) % OCR_TEST_SHARE == 0
    return [t for t in texts if in_test(t) == (split == "test")]


def ocr_prompts(split: str, count: int, seed: int) -> list[Prompt]:
    """`count` prompts: a template and a text of `split` drawn from np.random.default_rng(seed), each text written
    as it would be on a sign (title case, or all capitals one time in four)."""
    rng, texts = np.random.default_rng(seed), _ocr_texts(split)
    prompts = []
    for _ in range(count):
        text = texts[rng.integers(len(texts))]
        text = text.upper() if rng.random() < 0.25 else text.title()
        prompts.append(Prompt(OCR_TEMPLATES[rng.integers(len(OCR_TEMPLATES))].format(text), {"text": text}))
    return prompts


# ----------------------------------------------------------------------------------------------
# Sets from the Hugging Face hub: one pinned file each, converted to Prompt records when read


def hub_file(repo: str, filename: str, revision: str, what: str) -> Path:
    """The cached file, downloaded first if it is not there; one line saying what to fetch when it cannot be."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename, repo_type="dataset", revision=revision))
    except Exception as error:  # offline, no access, hub down: whatever hf_hub_download raises, the fix is the same
        raise ConfigError(f"prompt set {what} needs {filename} of the hub dataset {repo} (revision {revision[:7]}), "
                          f"which is not in the hub cache and could not be downloaded ({type(error).__name__}); run "
                          f"`python prompts.py {what}` once where the hub is reachable and copy the hub cache "
                          "(HF_HUB_CACHE) here, or pass a .txt / .jsonl file") from None


def _unreadable(path: Path, what: str, error: Exception) -> ConfigError:
    return ConfigError(f"prompt set {what}: the cached download {path} cannot be read ({type(error).__name__}: "
                       f"{str(error)[:200]}); delete it and run again to download it anew")


def read_json(path: Path, what: str, key: str | None = None) -> list[str]:
    """A JSON list of prompt strings, or of objects with the prompt under `key`."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
        texts = [item if key is None else item[key] for item in items]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("a prompt is not a string")
    except (ValueError, TypeError, KeyError, RecursionError) as error:
        raise _unreadable(path, what, error) from None
    return texts


def read_parquet(path: Path, what: str, column: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"prompt set {what} is stored as parquet: pip install pyarrow") from None
    try:
        texts = pq.read_table(path, columns=[column]).column(column).to_pylist()
    except Exception as error:  # pyarrow's errors (ArrowInvalid, OSError, ...) all mean the same file is bad
        raise _unreadable(path, what, error) from None
    return [t for t in texts if isinstance(t, str)]


def unique_prompts(texts: list[str], exclude: set[str] = frozenset()) -> list[Prompt]:
    """Stripped, non-empty, first occurrence of each, in file order, minus `exclude`."""
    seen, prompts = set(exclude), []
    for text in (t.strip() for t in texts):
        if text and text not in seen and len(text) <= MAX_PROMPT_CHARS:
            seen.add(text)
            prompts.append(Prompt(text, {}))
    return prompts


# Pick-a-Pic v1 without images (Kirstain et al., 2023), at the commit that added test_unique.
PICKAPIC = ("yuvalkirstain/pickapic_v1_no_images", "a3592a4f2e6adb7646ef56f3bb18e2968348a163")
# HPDv2 (Wu et al., 2023), Apache-2.0; benchmark/drawbench.json is its copy of DrawBench (Saharia et al., 2022).
HPDV2 = ("ymhao/HPDv2", "bb0f2563e451e11c3f376b2ba93615db00e042e1")


def pickapic(split: str) -> list[Prompt]:
    repo, revision = PICKAPIC
    files = {"test": "data/test_unique-00000-of-00001-73a51cbb6488571d.parquet",
             "train": "data/train-00000-of-00001-b138676ed2d1f52a.parquet"}
    test = read_parquet(hub_file(repo, files["test"], revision, "pickapic:test"), "pickapic:test", "caption")
    if split == "test":
        return unique_prompts(test)
    train = read_parquet(hub_file(repo, files["train"], revision, "pickapic:train"), "pickapic:train", "caption")
    return unique_prompts(train, exclude=set(test))


def hpdv2(split: str) -> list[Prompt]:
    repo, revision = HPDV2
    what = f"hpdv2:{split}"
    return unique_prompts(read_json(hub_file(repo, f"{split}.json", revision, what), what, key="prompt"))


def drawbench() -> list[Prompt]:
    repo, revision = HPDV2
    return unique_prompts(read_json(hub_file(repo, "benchmark/drawbench.json", revision, "drawbench:test"),
                                    "drawbench:test"))


# ----------------------------------------------------------------------------------------------
# Flow-GRPO's prompt files (Liu et al., 2025, MIT licence): the sets the paper, Flow-GRPO and DiffusionNFT train and
# evaluate on, each read exactly as Flow-GRPO's training script reads it, from one commit of its repository.

FLOW_GRPO = ("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd")  # 2025-07-18
FLOW_GRPO_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
# Each file by its git blob id (the SHA-1 of b"blob SIZE\0" + its bytes: what the repository's tree lists for it, and
# what `git hash-object FILE` prints) and its sha256. The two train files marked None were left out of the repository
# snapshot this project could read, so only the tree's blob id pins them.
FLOW_GRPO_FILES = {
    "dataset/ocr/train.txt": ("3ce0521b77b0a9031191d66ecc36ebaaf27a3922", None),
    "dataset/ocr/test.txt": ("8deb4f8d8f2e863f45353354243669b3c991a6a2",
                             "4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc"),
    "dataset/pickscore/train.txt": ("a437bd921c03fbc00c4e7ce148ae2d28fcd6e49b",
                                    "2f425adcbb9a6d0feee7c6c448e1cb83a1f71deca9434b803907e2578eca837f"),
    "dataset/pickscore/test.txt": ("45f05231b969fb5f74c8debd606b22cd3be27f8e",
                                   "d75c025fa451866e70f7e36243f7cdd93095523cb51f5f9651f2ce3236d20262"),
    "dataset/geneval/train_metadata.jsonl": ("0b97e8a6802c08fc7537cd00c76ae79c851bddcb", None),
    "dataset/geneval/test_metadata.jsonl": ("27cdaf5cc1356fe15aeadbb8df55682ca74228f0",
                                            "cec4b24b9fee7bac21c8f787054ecc8dc9ff831674037713a4cd35e0f0a74a28"),
}


def cache_dir() -> Path:
    """Downloaded prompt files: $VGRPO_CACHE, else $XDG_CACHE_HOME/v-grpo, else ~/.cache/v-grpo."""
    if os.environ.get("VGRPO_CACHE"):
        return Path(os.environ["VGRPO_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "v-grpo"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def pin_problem(data: bytes, path: str) -> str:
    """'' when data is Flow-GRPO's file at `path` (its blob id, and its sha256 where pinned), else what differs."""
    (blob, sha256), got_blob = FLOW_GRPO_FILES[path], git_blob_id(data)
    if got_blob != blob:
        return f"git blob {got_blob}, pinned {blob}"
    got_sha256 = hashlib.sha256(data).hexdigest() if sha256 else None
    return f"sha256 {got_sha256}, pinned {sha256}" if got_sha256 != sha256 else ""


def flow_grpo_file(path: str, what: str) -> Path:
    """Flow-GRPO's `path` at the pinned commit, in the cache: downloaded once, checked against its pin before it is
    kept and on every read. Where it cannot be had, one line naming the URL, the pin and the exact local path a user
    may place the file at by hand."""
    repo, commit = FLOW_GRPO
    local = cache_dir() / "flow_grpo" / commit / path
    url = FLOW_GRPO_URL.format(repo=repo, commit=commit, path=path)
    blob, sha256 = FLOW_GRPO_FILES[path]
    pin = f"git blob {blob}" + (f", sha256 {sha256}" if sha256 else "")
    if not local.is_file():
        try:
            if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
                raise OSError("HF_HUB_OFFLINE is set")
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        except (OSError, ValueError) as error:  # URLError, timeouts and refusals are OSErrors
            raise ConfigError(f"prompt set {what} is Flow-GRPO's {path}, which is not cached and could not be "
                              f"downloaded ({error}); download {url} ({pin}) and place it at {local}") from None
        problem = pin_problem(data, path)
        if problem:
            raise ConfigError(f"prompt set {what}: {url} gave a file that is not the pinned one ({problem}); "
                              "nothing was kept")
        local.parent.mkdir(parents=True, exist_ok=True)
        partial_file = local.with_name(f"{local.name}.part-{os.getpid()}")
        partial_file.write_bytes(data)
        os.replace(partial_file, local)  # whole or absent: a download cut short never looks cached
        return local  # checked above
    problem = pin_problem(local.read_bytes(), path)
    if problem:
        raise ConfigError(f"prompt set {what}: {local} is not Flow-GRPO's {path} ({problem}); delete it to download "
                          f"it again, or place the file from {url} there")
    return local


def flow_grpo_text(name: str, split: str) -> list[Prompt]:
    """dataset/NAME/SPLIT.txt as Flow-GRPO's TextPromptDataset reads it: every line stripped, in file order, repeats
    and all (the paper's runs sampled from exactly this list)."""
    path = flow_grpo_file(f"dataset/{name}/{split}.txt", f"{name}:{split}")
    with open(path, encoding="utf-8") as f:
        return [Prompt(line.strip(), {}) for line in f.readlines()]


def flow_grpo_geneval(split: str) -> list[Prompt]:
    """dataset/geneval/SPLIT_metadata.jsonl as Flow-GRPO's GenevalPromptDataset reads it: one JSON record a line, the
    record the prompt's metadata. The test split is GenEval's 553 prompts, each 4 times (2,212 lines)."""
    path = flow_grpo_file(f"dataset/geneval/{split}_metadata.jsonl", f"geneval:{split}")
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        return [Prompt(r["prompt"], r) for r in records]
    except (ValueError, KeyError, TypeError) as error:
        raise _unreadable(path, f"geneval:{split}", error) from None


@dataclass(frozen=True)
class PromptSet:
    splits: dict[str, Callable[[], list[Prompt]]]
    source: str
    licence: str


SETS = {
    "ocr": PromptSet({"train": lambda: flow_grpo_text("ocr", "train"), "test": lambda: flow_grpo_text("ocr", "test")},
                     f"Flow-GRPO's dataset/ocr ({FLOW_GRPO[0]}@{FLOW_GRPO[1][:7]}), the paper's OCR stage", "MIT"),
    "pickscore": PromptSet({"train": lambda: flow_grpo_text("pickscore", "train"),
                            "test": lambda: flow_grpo_text("pickscore", "test")},
                           f"Flow-GRPO's dataset/pickscore ({FLOW_GRPO[0]}@{FLOW_GRPO[1][:7]}), the paper's "
                           "preference stages", "MIT"),
    "geneval": PromptSet({"train": lambda: flow_grpo_geneval("train"), "test": lambda: flow_grpo_geneval("test")},
                         f"Flow-GRPO's dataset/geneval ({FLOW_GRPO[0]}@{FLOW_GRPO[1][:7]}), the paper's GenEval "
                         "stages", "MIT"),
    "ocr-templates": PromptSet({"train": lambda: ocr_prompts("train", 20_000, seed=0),
                                "test": lambda: ocr_prompts("test", 1000, seed=1)},
                               "prompts.py's templates x words, not the paper's (that is `ocr`)", "as this repository"),
    "geneval-generated": PromptSet({"train": geneval_train, "test": geneval_test},
                                   "prompts.py (GenEval's prompt generator, written out), not the paper's (that is "
                                   "`geneval`)", "as this repository"),
    "pickapic": PromptSet({"train": lambda: pickapic("train"), "test": lambda: pickapic("test")},
                          f"hub dataset {PICKAPIC[0]}", "see its dataset card"),
    "hpdv2": PromptSet({"train": lambda: hpdv2("train"), "test": lambda: hpdv2("test")}, f"hub dataset {HPDV2[0]}",
                       "Apache-2.0"),
    "drawbench": PromptSet({"test": drawbench}, f"hub dataset {HPDV2[0]} (benchmark/drawbench.json)", "Apache-2.0"),
}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(f"usage: python prompts.py NAME[:SPLIT] > prompts.jsonl   (sets: {', '.join(SETS)})")
    try:
        prompts = load(sys.argv[1], say=lambda line: print(line, file=sys.stderr))
    except ConfigError as error:
        sys.exit(f"error: {error}")
    try:
        for p in prompts:
            print(json.dumps({**p.metadata, "prompt": p.text}))
    except BrokenPipeError:  # the reader stopped early (`| head`): nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and no second error at exit's flush


if __name__ == "__main__":
    main()
