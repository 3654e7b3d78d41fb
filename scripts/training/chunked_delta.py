"""Training-only chunked form of the gated delta rule (Qwen3.5's GatedDeltaNet layers).

On the CPU, mlx-lm runs the recurrence ``gated_delta_ops`` one time step at a time: a 768-token
training window is 768 small steps per layer forward, and as many again backward. The same
function can be computed a chunk of ``C`` steps at a time (the WY form of Yang et al., "Gated
Delta Networks"): per head, with ``S`` the ``[Dv, Dk]`` state at a chunk's start, ``G`` the
cumulative log-gate inside the chunk, ``Γ[i, j] = exp(G[i] - G[j])`` for ``j <= i``,

    A = strict_lower(diag(β) (K Kᵀ) ∘ Γ)          T = (I + A)⁻¹
    U = T diag(β) V - T diag(β eᴳ) K Sᵀ           (the per-step deltas, all at once)
    O = diag(eᴳ) Q Sᵀ + lower(Q Kᵀ ∘ Γ) U
    S ← e^{G[C-1]} S + Uᵀ diag(e^{G[C-1] - G}) K

which is the step recurrence unrolled exactly (only rounding differs). The sequential part is one
step per chunk. ``T`` comes from LAPACK's triangular inverse (``mx.linalg.tri_inv``) with its
textbook gradient. :func:`installed` routes ``mlx_lm.models.qwen3_5``'s ``gated_delta_update``
through it for cache-free training forwards; nothing here is used at inference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

CHUNK = 64


@mx.custom_function
def unit_lower_inverse(m: mx.array) -> mx.array:
    """Inverse of a batch of unit lower-triangular matrices ``[..., C, C]``."""
    return mx.linalg.tri_inv(m, upper=False, stream=mx.cpu)


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(m, cotangent, inverse):
    # d(M⁻¹) = -M⁻¹ dM M⁻¹; only the strictly lower entries of M are free
    t = inverse.swapaxes(-1, -2)
    return mx.tril(-(t @ cotangent @ t), k=-1)


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array,
                        state: mx.array | None = None, chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """``gated_delta_ops`` with scalar gates, computed ``chunk`` steps at a time.

    Shapes as mlx-lm's: q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]``; log_g, beta ``[B, T, Hv]``
    (``log_g`` = log of the per-step decay); state ``[B, Hv, Dv, Dk]`` or None (zeros).
    Returns (y ``[B, T, Hv, Dv]``, final state)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    n = -(-T // chunk)
    pad = n * chunk - T

    def blocks(x):  # [B, T, H, ...] -> [B, H, n, C, ...]; padded steps are no-ops (k = v = β = 0, g = 1)
        x = mx.moveaxis(x, 1, 2)
        if pad:
            x = mx.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(*x.shape[:2], n, chunk, *x.shape[3:])

    q, k, v, log_g, beta = (blocks(x.astype(mx.float32)) for x in (q, k, v, log_g, beta))
    G = mx.cumsum(log_g, axis=-1)                                    # [B, H, n, C]
    at_or_below = mx.tril(mx.ones((chunk, chunk), mx.bool_))
    gap = G[..., :, None] - G[..., None, :]
    decay = mx.exp(mx.where(at_or_below, gap, -mx.inf))             # Γ, zero above the diagonal
    a = mx.tril((beta[..., None] * (k @ k.swapaxes(-1, -2))) * decay, k=-1)
    t = unit_lower_inverse(a + mx.eye(chunk))
    w = t @ (k * (beta * mx.exp(G))[..., None])                      # [B, H, n, C, Dk]
    u0 = t @ (v * beta[..., None])                                   # [B, H, n, C, Dv]
    qk = (q @ k.swapaxes(-1, -2)) * decay
    q_decayed = q * mx.exp(G)[..., None]
    k_to_end = k * mx.exp(G[..., -1:] - G)[..., None]
    s = mx.zeros((B, Hv, Dv, Dk), mx.float32) if state is None else state.astype(mx.float32)
    outputs = []
    for c in range(n):
        st = s.swapaxes(-1, -2)                                      # [B, H, Dk, Dv]
        u = u0[:, :, c] - w[:, :, c] @ st
        outputs.append(q_decayed[:, :, c] @ st + qk[:, :, c] @ u)
        s = mx.exp(G[:, :, c, -1])[..., None, None] * s + u.swapaxes(-1, -2) @ k_to_end[:, :, c]
    y = mx.concatenate(outputs, axis=2)[:, :, :T]                    # [B, H, T, Dv]
    return mx.moveaxis(y, 1, 2), s


def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                       lower_bound=None, allow_neg_eigval=False):
    """mlx-lm's ``gated_delta_update`` for unmasked, cache-free training forwards, chunked."""
    if mask is not None or lower_bound is not None or allow_neg_eigval:
        raise ValueError("chunked_delta serves unmasked scalar-gate training forwards only")
    beta = mx.sigmoid(b)
    log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)  # log of mlx-lm's compute_g
    y, state = chunked_gated_delta(q, k, v, log_g, beta, state)
    return y.astype(q.dtype), state


@contextmanager
def installed() -> Iterator[None]:
    """Route ``mlx_lm.models.qwen3_5``'s gated delta rule through :func:`gated_delta_update`
    while the block runs (the model looks it up in its module globals at call time)."""
    from mlx_lm.models import qwen3_5

    saved = qwen3_5.gated_delta_update
    qwen3_5.gated_delta_update = gated_delta_update
    try:
        yield
    finally:
        qwen3_5.gated_delta_update = saved
