"""Training-only replacements for the exp-heavy ops of the fixture models, computed by numpy.

The MLX CPU wheel evaluates ``exp`` one element at a time (about 50 M/s on this machine, 20x
slower than numpy's vectorized ``np.exp``), and a fixture training step spends most of its time
in the three places that call it: the causal attention softmax, the SiLU of the MLP and the
cross-entropy over the trained vocabulary rows. Each replacement here is an
``mx.custom_function`` whose forward runs in numpy (forcing evaluation of its input, which eager
training allows) and whose gradient is the textbook one, so the trained function is the same
mathematical model that mlx-lm later runs with its own kernels. Nothing here is used at inference.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

# modules whose attention / MLP the fixture architectures resolve through their own globals
PATCHED_MODULES = ("qwen3", "glm4", "qwen3_next")


def _np(x: mx.array) -> np.ndarray:
    """A writable float32 copy (the kernels below work in place: half the memory passes)."""
    return np.array(x, dtype=np.float32)


@mx.custom_function
def causal_softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis with key j > query i masked (queries and keys aligned at 0)."""
    s = _np(scores)
    length = s.shape[-1]
    s += np.triu(np.full((length, length), -np.inf, np.float32), k=1)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return mx.array(s)


@causal_softmax.vjp
def _causal_softmax_vjp(scores, cotangent, output):
    return output * (cotangent - (cotangent * output).sum(axis=-1, keepdims=True))


def _sigmoid(v: np.ndarray) -> np.ndarray:
    s = np.negative(v)
    np.exp(s, out=s)
    s += 1.0
    np.reciprocal(s, out=s)
    return s


@mx.custom_function
def silu(x: mx.array) -> mx.array:
    v = _np(x)
    return mx.array(v * _sigmoid(v))


@silu.vjp
def _silu_vjp(x, cotangent, output):
    # a single-input custom function receives its primal itself, not a tuple
    s = mx.array(_sigmoid(_np(x)))
    return cotangent * (s + output * (1.0 - s))


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return silu(gate) * x


@mx.custom_function
def cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    """Per-row ``logsumexp(logits) - logits[label]`` (float32 logits of shape (N, V))."""
    z = _np(logits)
    picked = z[np.arange(len(z)), np.asarray(labels)]
    m = z.max(axis=-1, keepdims=True)
    z -= m
    np.exp(z, out=z)
    return mx.array(m[:, 0] + np.log(z.sum(axis=-1)) - picked)


@cross_entropy.vjp
def _cross_entropy_vjp(primals, cotangent, output):
    p = _np(primals[0])
    p -= p.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    p[np.arange(len(p)), np.asarray(primals[1])] -= 1.0
    return mx.array(p) * cotangent[:, None], mx.zeros_like(primals[1])


def attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` for a cache-free causal training forward."""
    causal = isinstance(mask, str) and mask == "causal"
    if cache is not None or sinks is not None or not (mask is None or causal):
        raise ValueError("numpy_kernels.attention serves cache-free causal training forwards only")
    repeats = queries.shape[1] // keys.shape[1]
    if repeats > 1:
        keys, values = mx.repeat(keys, repeats, axis=1), mx.repeat(values, repeats, axis=1)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    weights = causal_softmax(scores) if causal else mx.softmax(scores, axis=-1)
    return weights @ values


@contextmanager
def installed() -> Iterator[None]:
    """Route the fixture architectures' attention and SwiGLU through these kernels while the
    block runs (mlx-lm's model code looks both up in its module globals at call time)."""
    saved = []
    for name in PATCHED_MODULES:
        module = importlib.import_module(f"mlx_lm.models.{name}")
        saved.append((module, module.scaled_dot_product_attention, module.swiglu))
        module.scaled_dot_product_attention, module.swiglu = attention, swiglu
    try:
        yield
    finally:
        for module, sdpa, glu in saved:
            module.scaled_dot_product_attention, module.swiglu = sdpa, glu
