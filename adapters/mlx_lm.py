"""The loop drop-in: mlx-lm's ``generate_step`` and ``stream_generate`` with ``fill=``.

``generate_step(prompt, model, stream=generation_stream, *, fill=None, **kw)`` is
:func:`mlx_fill.core.loop.generate_step`: mlx-lm's signature plus ``fill=``, the stock generator when
``fill`` is None. ``stream_generate(model, tokenizer, prompt, max_tokens, draft_model, stream, *,
fill=..., **kw)`` is mlx-lm's ``stream_generate``; with a session every
:class:`~mlx_lm.generate.GenerationResponse` it yields carries ``response.fill``, the session's live
:class:`~mlx_fill.core.proposal.FillStats` (final once the response with a ``finish_reason``
arrives; ``.as_dict()`` is the ``usage.fill`` block)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any

from mlx_lm.generate import generation_stream

from mlx_fill.core.loop import check_fill, generate_step
from mlx_fill.core.proposal import FillSession

__all__ = ["generate_step", "install_generate_step", "stream_generate"]


def install_generate_step() -> bool:
    """Make ``mlx_lm.generate``'s module attribute ``generate_step`` the fill-aware one, so
    ``stream_generate``/``generate`` (which look it up per call) pass ``fill=`` through.
    Idempotent; returns True when this call changed it. Patches the module, never the
    ``mlx_lm.generate`` *function* the package re-exports under the same name."""
    module = sys.modules.get("mlx_lm.generate") or importlib.import_module("mlx_lm.generate")
    if module.generate_step is generate_step:
        return False
    module.generate_step = generate_step
    return True


def stream_generate(model: Any, tokenizer: Any, prompt: Any, max_tokens: int = 256,
                    draft_model: Any = None, stream: Any = generation_stream, *,
                    fill: FillSession | None = None, **kwargs: Any) -> Iterator[Any]:
    """mlx-lm's ``stream_generate`` (its positional arguments too) with keyword-only ``fill=``;
    with ``fill=None`` it is exactly the stock call. Raises TypeError for a ``fill`` that is not
    a session, ValueError with ``draft_model=`` (mlx-lm's speculative path has no fill)."""
    stock = importlib.import_module("mlx_lm.generate").stream_generate
    if fill is None:
        return stock(model, tokenizer, prompt, max_tokens, draft_model, stream, **kwargs)
    check_fill(fill)
    if draft_model is not None:
        raise ValueError("fill= and draft_model= are exclusive: the speculative path has no fill")
    install_generate_step()
    return _with_telemetry(stock(model, tokenizer, prompt, max_tokens, None, stream, fill=fill,
                                 **kwargs), fill)


def _with_telemetry(responses: Iterator[Any], fill: FillSession) -> Iterator[Any]:
    for response in responses:
        response.fill = fill.stats
        yield response
