"""Shardable fixtures: a trained fixture with every attention head duplicated.

mlx-lm's tensor sharding (``Model.shard``, used by ``sharded_load`` under ``mlx.launch``) gives
each rank ``heads / N`` query heads, ``kv_heads / N`` KV heads and, in a Gated DeltaNet layer,
``linear heads / N`` key and value heads. The trained fixtures have one KV head (and one linear
key head), so two ranks get zero and the first forward fails (``[reshape] Cannot infer the shape
of an empty array``). :func:`widen` writes ``<name>-x<factor>`` (assembled and cached by
:func:`mlx_fill.assets.fixtures.fixture_path`): the same model with
every head repeated ``factor`` times (copy ``c`` of head ``h`` is head ``c * H + h``, so a
grouped-query head keeps reading a copy of its own KV head) and the output projections' columns
scaled by ``1 / factor``. Mathematically that is the same function (the copies' contributions
sum to the original's); in floating point the logits differ from the narrow model's by rounding
only, so it emits what the trained fixture emits. It also writes
``model.safetensors.index.json``, which pipeline sharding reads to pick a rank's files.

Supported: ``qwen3-json`` (qwen3: tensor sharding only; mlx-lm 0.32.2's qwen3 has no
``pipeline``) and ``qwen35-xml`` (qwen3_5: both; softmax attention and Gated DeltaNet layers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx


WIDENABLE = ("qwen3-json", "qwen35-xml")
INDEX = "model.safetensors.index.json"


def _rows(w: mx.array, heads: int, factor: int) -> mx.array:
    """Output rows grouped by head, the head blocks repeated ``factor`` times."""
    return mx.concatenate([w] * factor, axis=0) if heads else w


def _cols(w: mx.array, factor: int) -> mx.array:
    """Input columns repeated ``factor`` times, scaled so the copies sum to the original."""
    return mx.concatenate([w / factor] * factor, axis=1)


def _widen_attention(w: dict[str, mx.array], p: str, factor: int) -> None:
    for name in ("q_proj", "k_proj", "v_proj"):
        w[f"{p}.{name}.weight"] = _rows(w[f"{p}.{name}.weight"], 1, factor)
    w[f"{p}.o_proj.weight"] = _cols(w[f"{p}.o_proj.weight"], factor)


def _widen_linear_attention(w: dict[str, mx.array], p: str, text: dict, factor: int) -> None:
    """A Gated DeltaNet layer: q, k and v sections of ``in_proj_qkv`` and of the depthwise
    convolution, ``in_proj_z/a/b``, ``dt_bias`` and ``A_log`` repeat per section; ``out_proj``
    columns are scaled. ``mx.repeat`` maps value head ``j`` to key head ``j // (Hv / Hk)``, so
    repeating whole sections keeps every value head with a copy of its key head."""
    kd = text["linear_key_head_dim"] * text["linear_num_key_heads"]

    def sections(a: mx.array) -> mx.array:
        q, k, v = a[:kd], a[kd:2 * kd], a[2 * kd:]
        return mx.concatenate([q] * factor + [k] * factor + [v] * factor, axis=0)

    w[f"{p}.in_proj_qkv.weight"] = sections(w[f"{p}.in_proj_qkv.weight"])
    w[f"{p}.conv1d.weight"] = sections(w[f"{p}.conv1d.weight"])
    for name in ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log"):
        w[f"{p}.{name}"] = _rows(w[f"{p}.{name}"], 1, factor)
    w[f"{p}.out_proj.weight"] = _cols(w[f"{p}.out_proj.weight"], factor)


def _widen_config(config: dict, factor: int) -> dict:
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                "linear_num_value_heads"):
        if key in text:
            text[key] *= factor
    return config


def widen(source: Path, out: Path, factor: int = 2, copy: tuple[str, ...] = ()) -> Path:
    """Write the head-duplicated copy of the model in ``source`` (a qwen3 or qwen3_5 model dir
    with one ``model.safetensors``) to ``out``, with a weight index and the files named in
    ``copy`` (tokenizer files) copied as they are. Raises ValueError for another architecture."""
    config = json.loads((source / "config.json").read_text())
    text = config.get("text_config", config)
    if text.get("model_type") not in ("qwen3", "qwen3_5_text") or factor < 1:
        raise ValueError(f"cannot widen model_type {text.get('model_type')!r} by {factor}")
    if "head_dim" not in text:
        raise ValueError("widening needs an explicit head_dim")
    weights = dict(mx.load(str(source / "model.safetensors")))
    for key in sorted(weights):
        if key.endswith("self_attn.o_proj.weight"):
            _widen_attention(weights, key.rsplit(".o_proj.weight", 1)[0], factor)
        elif key.endswith("linear_attn.out_proj.weight"):
            _widen_linear_attention(weights, key.rsplit(".out_proj.weight", 1)[0], text, factor)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(_widen_config(config, factor), indent=2))
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(weights)}}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    for name in copy:
        shutil.copyfile(source / name, out / name)
    return out
