"""The training kernels (``scripts/training/numpy_kernels.py``, ``scripts/training/chunked_delta.py``) compute the
functions mlx-lm's own ops compute, values and gradients: a fixture trained through them is the
model mlx-lm runs.

Training is float arithmetic in a different order, so these compare within float32 rounding
(the bit-exact claims of the project concern cache state at inference, not training)."""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
import pytest

from scripts.training import chunked_delta, numpy_kernels, openblas

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


def _delta_inputs(T: int):
    from mlx_lm.models.gated_delta import normalize_qk

    B, Hk, Hv, D = 2, 1, 2, 16  # two value heads per key head, as the qwen35-xml fixture
    q, k = normalize_qk(mx.random.normal((B, T, Hk, D)), mx.random.normal((B, T, Hk, D)),
                        inv_scale=D**-0.5, eps=1e-6)
    return (q, k, mx.random.normal((B, T, Hv, D)), mx.random.normal((B, T, Hv)) * 2,
            mx.random.normal((B, T, Hv)) * 2)


@pytest.mark.parametrize("T", [1, 40, 64, 150])  # under, at and across chunk boundaries (C = 64)
def test_chunked_gated_delta_matches_the_step_recurrence_values_and_gradients(T):
    from mlx_lm.models.gated_delta import compute_g, gated_delta_ops

    q, k, v, a, b = _delta_inputs(T)
    A_log, dt_bias = mx.array([0.3, -1.0]), mx.array([0.5, -0.2])
    state = mx.random.normal((2, 2, 16, 16)) * 0.1
    cot = mx.random.normal(v.shape)

    def reference(q, k, v, a, b, state):
        return gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state)

    def ours(q, k, v, a, b, state):
        return chunked_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)

    args = (q, k, v, a, b, state)
    for got, want in zip(ours(*args), reference(*args)):
        _close(got, want)
    for arg in range(6):
        want = mx.grad(lambda *x: (reference(*x)[0] * cot).sum() + reference(*x)[1].sum(), argnums=arg)(*args)
        got = mx.grad(lambda *x: (ours(*x)[0] * cot).sum() + ours(*x)[1].sum(), argnums=arg)(*args)
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), (arg, mx.abs(got - want).max().item())


def test_chunked_delta_refuses_what_it_does_not_implement():
    q, k, v, a, b = _delta_inputs(4)
    with pytest.raises(ValueError, match="unmasked scalar-gate"):
        chunked_delta.gated_delta_update(q, k, v, a, b, mx.zeros(2), mx.zeros(2), mask=mx.ones((2, 4), mx.bool_))


def test_chunked_delta_installed_routes_qwen3_5_and_restores_it():
    from mlx_lm.models import qwen3_5

    before = qwen3_5.gated_delta_update
    with chunked_delta.installed():
        assert qwen3_5.gated_delta_update is chunked_delta.gated_delta_update
    assert qwen3_5.gated_delta_update is before


def test_openblas_core_type_follows_the_isa_flags():
    assert openblas.core_type({"avx512f", "avx512bw", "avx2", "fma"}) == "SkylakeX"
    assert openblas.core_type({"avx2", "fma"}) == "Haswell"
    assert openblas.core_type({"sse4_2"}) is None
