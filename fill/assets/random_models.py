"""Seeded random-weight models with real mlx-lm architectures.

Used by the exactness tests, ``mlx-fill qualify`` examples and the mechanism benchmark: the
primitive's exactness does not depend on trained weights, only on the architecture, dtype,
quantization and cache types, so these models exercise every code path the fixtures do.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import quantize_model, save_model

ARCHS = ("llama", "qwen3", "qwen3_5", "llama_swa", "gpt_oss", "gemma3_text", "qwen3_moe",
         "glm4_moe", "qwen3_5_moe", "falcon_h1", "llama4")
# Architectures whose sliding-window layers use a ``RotatingKVCache`` of ``sliding_window``.
SLIDING = ("llama_swa", "gpt_oss", "gemma3_text")
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)

_TINY: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, rms_norm_eps=1e-6,
    max_position_embeddings=16384, rope_theta=10000.0, tie_word_embeddings=False,
)
# Shaped like Qwen3-0.6B (about 0.5B parameters with tied embeddings).
_HALF_B: dict[str, Any] = dict(
    hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
)
SIZES = {"tiny": _TINY, "0.5b": _HALF_B}


def config_for(arch: str, size: str = "tiny", sliding_window: int = 64) -> dict[str, Any]:
    """An mlx-lm ``config.json`` dict for ``arch`` at ``size``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    cfg = dict(SIZES[size])
    if arch == "llama_swa":
        n = cfg["num_hidden_layers"]
        cfg.update(model_type="llama", sliding_window=sliding_window,
                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(n)])
    elif arch in ("qwen3_5", "qwen3_5_moe"):
        cfg.update(model_type=arch, full_attention_interval=2, linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, rope_parameters={
                       "type": "default", "rope_theta": cfg["rope_theta"],
                       "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})
        if arch == "qwen3_5_moe":
            cfg.update(_MOE, num_experts=4, shared_expert_intermediate_size=64)
    elif arch == "gpt_oss":  # alternating sliding / full layers, attention sinks, 4 experts
        cfg.update(model_type=arch, sliding_window=sliding_window, num_local_experts=4,
                   num_experts_per_tok=2, rope_scaling=None)
    elif arch == "gemma3_text":  # tied embeddings; every second layer global
        cfg.update(model_type=arch, sliding_window=sliding_window, sliding_window_pattern=2,
                   query_pre_attn_scalar=cfg["head_dim"], rope_local_base_freq=10000.0,
                   tie_word_embeddings=True)
    elif arch == "qwen3_moe":
        cfg.update(_MOE, model_type=arch, num_experts=4, decoder_sparse_step=1,
                   mlp_only_layers=[])
    elif arch == "glm4_moe":  # one dense layer first, then routed + shared experts
        cfg.update(_MOE, model_type=arch, n_group=1, topk_group=1, n_shared_experts=1,
                   n_routed_experts=4, routed_scaling_factor=1.0, first_k_dense_replace=1,
                   use_qk_norm=True, attention_bias=False, partial_rotary_factor=0.5,
                   rope_scaling=None)
    elif arch == "falcon_h1":  # every layer a CacheList(ArraysCache, KVCache): Mamba-2 + attention
        cfg.update(model_type=arch, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                   mamba_d_state=16, mamba_chunk_size=8, mamba_expand=1,
                   tie_word_embeddings=True)
    elif arch == "llama4":  # ChunkedKVCache layers (chunked attention of ``sliding_window``)
        text = dict(cfg, model_type="llama4_text", attention_bias=False,
                    attention_chunk_size=sliding_window, interleave_moe_layer_step=2,
                    intermediate_size_mlp=cfg["intermediate_size"], num_experts_per_tok=1,
                    num_local_experts=4, rope_scaling=None, use_qk_norm=True)
        cfg = dict(model_type=arch, text_config=text)
    else:
        cfg["model_type"] = arch
    return cfg


def build(config: dict[str, Any], *, dtype: mx.Dtype = mx.float32, seed: int = 0,
          bits: int | None = None, group_size: int = 64) -> tuple[nn.Module, dict[str, Any]]:
    """Instantiate ``config`` with seeded random weights in ``dtype``; quantize to ``bits``."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    config = dict(config, torch_dtype=str(dtype).replace("mlx.core.", ""))
    if bits is not None:
        model, config = quantize_model(model, config, group_size, bits)
    mx.eval(model.parameters())
    return model, config


def save(model: nn.Module, config: dict[str, Any], path: Path) -> Path:
    """Write ``config.json`` + safetensors so ``mlx_lm.utils.load_model(path)`` loads it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path
