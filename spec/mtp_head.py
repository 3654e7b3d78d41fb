"""The MTP head of a Qwen3.5 / Qwen3-Next checkpoint: its layers (:class:`MTPHead`) and its
weights, read from the ``mtp.*`` tensors that mlx-lm's loader drops (:func:`load_mtp_head`).

``mtp.fc`` merges the normed embedding of a token with the normed target hidden state
(``[2H -> H]``, embedding first), ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.{i}`` (full-attention decoder layers of the target's own kind) and ``mtp.norm``; the
head shares the target's embeddings and lm-head. Zero-centred norms get their ``+1`` when the
checkpoint is an unconverted HF one (by mlx-lm's own test: an unsanitized ``conv1d`` weight).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .mtp_tap import text_model


class MTPHead(nn.Module):
    """The MTP head's own weights; embeddings and lm-head are the target's (passed per call)."""

    def __init__(self, args: Any, num_layers: int = 1):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer

        if num_layers < 1:
            raise ValueError("an MTP head needs at least one layer")
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        full = args.full_attention_interval - 1  # a layer index whose layer is full attention
        self.layers = [DecoderLayer(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list[KVCache]) -> mx.array:
        """Rows ``[1, L, H]`` from token embeddings and target hidden states (both
        ``[1, L, H]``); returns the pre-norm output (the hidden state chained to the next row)."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return x


def _safetensors_header(path: Path) -> dict[str, Any]:
    """Tensor names -> {dtype, shape, ...} from a safetensors header, without reading data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _mtp_name(key: str) -> str | None:
    """``mtp.fc.weight`` / ``model.mtp.fc.weight`` / ... -> ``fc.weight``; None otherwise."""
    parts = key.split(".")
    return ".".join(parts[parts.index("mtp") + 1:]) if "mtp" in parts else None


def _unfuse_experts(weights: dict[str, mx.array]) -> None:
    """HF Qwen3.5-MoE layout (``mlp.experts.gate_up_proj`` fused, ``mlp.experts.down_proj``) to
    mlx-lm's ``mlp.switch_mlp.{gate,up,down}_proj.weight``, in place (as mlx-lm's sanitize does
    for the decoder layers)."""
    for key in [k for k in weights if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate_up = weights.pop(key)
        mid = gate_up.shape[-2] // 2
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")


def has_mtp(model_path: str | Path) -> bool:
    """Whether the checkpoint at ``model_path`` carries ``mtp.*`` tensors."""
    return any(_mtp_name(k) for f in Path(model_path).glob("*.safetensors")
               for k in _safetensors_header(f))


def load_mtp_head(model_path: str | Path, target: Any) -> MTPHead:
    """Build the MTP head of the checkpoint at ``model_path`` for the loaded ``target``.

    MoE heads are read in mlx-lm's stacked layout or HF's fused ``experts.gate_up_proj`` one.
    Raises ValueError when the checkpoint carries no ``mtp.*`` tensors or they do not match
    the head's layout.
    """
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors"))
    headers = {f: _safetensors_header(f) for f in files}
    unsanitized = any("conv1d.weight" in k and v["shape"][-1] != 1
                      for h in headers.values() for k, v in h.items())
    weights: dict[str, mx.array] = {}
    for f, header in headers.items():
        if not any(_mtp_name(k) for k in header):
            continue
        for key, value in mx.load(str(f)).items():
            name = _mtp_name(key)
            if name is None:
                continue
            if unsanitized and name.endswith("norm.weight") and value.ndim == 1:
                value = value + 1.0
            weights[name] = value
    if not weights:
        raise ValueError(f"{path} carries no mtp.* tensors")
    _unfuse_experts(weights)
    layer_ids = {int(n.split(".")[1]) for n in weights if n.startswith("layers.")}
    head = MTPHead(text_model(target).args, num_layers=max(layer_ids) + 1 if layer_ids else 0)
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    quant = config.get("quantization")
    if quant and any(n.endswith(".scales") for n in weights):
        nn.quantize(head, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"mtp.* tensors in {path} do not match the MTP head layout: {e}") from e
    mx.eval(head.parameters())
    return head
