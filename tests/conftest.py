"""Shared fixtures: seeded random-weight models with real mlx-lm architectures; one asset store
for the whole run."""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import pytest

from mlx_fill.core import qualify, resolve
from mlx_fill.core.paths import user_cache_dir
from mlx_fill.assets.random_models import build, config_for

# The families are fetched on first use into this run's user cache (``MLX_FILL_CACHE``); naming
# that folder as ``MLX_FILL_ASSETS`` keeps it visible to the tests that point MLX_FILL_CACHE at a
# temporary folder, so each family is fetched once per run. A pre-filled MLX_FILL_ASSETS wins.
os.environ.setdefault("MLX_FILL_ASSETS", str(user_cache_dir() / "assets"))

# (id, arch, dtype, bits): every cache type and weight format the primitive supports.
MODEL_CONFIGS = [
    ("llama-f32", "llama", mx.float32, None),
    ("qwen3-bf16", "qwen3", mx.bfloat16, None),
    ("qwen3-f16", "qwen3", mx.float16, None),
    ("qwen3-q4", "qwen3", mx.float32, 4),
    ("qwen3-q8", "qwen3", mx.float32, 8),
    ("qwen35-hybrid-f32", "qwen3_5", mx.float32, None),
    ("qwen35-hybrid-bf16", "qwen3_5", mx.bfloat16, None),
    ("llama-swa-f32", "llama_swa", mx.float32, None),
]


@pytest.fixture(autouse=True, scope="module")
def measurements_end_with_their_module():
    """A first-use measurement a module's tests started in the background ends with that module:
    it saves into the cache folder that module set and counts among that module's measurements,
    never the next module's."""
    yield
    assert resolve.wait_qualified(timeout=600), "a background measurement outlived its module"


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, dtype: mx.Dtype = mx.float32, bits: int | None = None):
    """A cached tiny random model (weights are never mutated by the tests)."""
    model, _ = build(config_for(arch), dtype=dtype, bits=bits, group_size=32)
    return model


@pytest.fixture(params=MODEL_CONFIGS, ids=[c[0] for c in MODEL_CONFIGS])
def any_model(request):
    _, arch, dtype, bits = request.param
    return tiny_model(arch, dtype, bits)


@pytest.fixture
def steady_cost(monkeypatch):
    """For tests of what qualify finds exact on a tiny model: its forwards cost about the same
    at every M, so on a loaded machine timing noise can put a measured c(M) below 1 in every
    try, and qualify then rightly refuses the curve (max_chunk=1), which is not what these
    tests check. The curve is still measured; values below 1 for M >= 2 are raised to 1."""
    measured = qualify.measure_cost

    def at_least_one_row(*args, **kwargs) -> dict[int, float]:
        return {m: c if m < 2 else max(c, 1.0) for m, c in measured(*args, **kwargs).items()}

    monkeypatch.setattr(qualify, "measure_cost", at_least_one_row)
