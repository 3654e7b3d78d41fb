"""The numpy training kernels (``scripts/numpy_kernels.py``) compute the functions mlx-lm's own
ops compute, values and gradients: a fixture trained through them is the model mlx-lm runs.

Training is float arithmetic in a different order, so these compare within float32 rounding
(the bit-exact claims of the project concern cache state at inference, not training)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import numpy_kernels  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def _close(a: mx.array, b: mx.array) -> None:
    assert a.shape == b.shape
    assert mx.allclose(a, b, **TOL).item(), f"max abs difference {mx.abs(a - b).max().item()}"


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(3)


def test_attention_matches_mlx_sdpa_values_and_gradients():
    q = mx.random.normal((2, 4, 37, 16))
    k = mx.random.normal((2, 2, 37, 16))  # grouped-query: 2 query heads per KV head
    v = mx.random.normal((2, 2, 37, 16))
    cot = mx.random.normal((2, 4, 37, 16))

    def reference(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")

    def ours(q, k, v):
        return numpy_kernels.attention(q, k, v, None, 0.25, "causal")

    _close(ours(q, k, v), reference(q, k, v))
    for arg in range(3):
        want = mx.grad(lambda *a: (reference(*a) * cot).sum(), argnums=arg)(q, k, v)
        got = mx.grad(lambda *a: (ours(*a) * cot).sum(), argnums=arg)(q, k, v)
        _close(got, want)


def test_attention_refuses_what_it_does_not_implement():
    q = mx.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="cache-free causal"):
        numpy_kernels.attention(q, q, q, object(), 1.0, "causal")
    with pytest.raises(ValueError, match="cache-free causal"):
        numpy_kernels.attention(q, q, q, None, 1.0, mx.zeros((4, 4)))


def test_swiglu_matches_mlx_values_and_gradients():
    gate = mx.random.normal((6, 50)) * 4  # both tails of the sigmoid
    up = mx.random.normal((6, 50))
    _close(numpy_kernels.swiglu(gate, up), nn.silu(gate) * up)
    for arg in range(2):
        want = mx.grad(lambda g, u: (nn.silu(g) * u).sum(), argnums=arg)(gate, up)
        got = mx.grad(lambda g, u: numpy_kernels.swiglu(g, u).sum(), argnums=arg)(gate, up)
        _close(got, want)


def test_cross_entropy_matches_mlx_values_and_gradients():
    logits = mx.random.normal((20, 300)) * 5
    labels = mx.random.randint(0, 300, (20,))
    weights = mx.random.uniform(shape=(20,))
    _close(numpy_kernels.cross_entropy(logits, labels),
           nn.losses.cross_entropy(logits, labels, reduction="none"))
    want = mx.grad(lambda z: (nn.losses.cross_entropy(z, labels, reduction="none") * weights).sum())(logits)
    got = mx.grad(lambda z: (numpy_kernels.cross_entropy(z, labels) * weights).sum())(logits)
    _close(got, want)


def test_installed_routes_the_fixture_architectures_and_restores_them():
    import importlib

    modules = [importlib.import_module(f"mlx_lm.models.{n}") for n in numpy_kernels.PATCHED_MODULES]
    before = [(m.scaled_dot_product_attention, m.swiglu) for m in modules]
    with numpy_kernels.installed():
        for module in modules:
            assert module.scaled_dot_product_attention is numpy_kernels.attention
            assert module.swiglu is numpy_kernels.swiglu
    assert [(m.scaled_dot_product_attention, m.swiglu) for m in modules] == before
