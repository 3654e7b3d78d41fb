"""Requests that would stop an unmodified ``mlx_lm.server`` (mlx-lm 0.32.x) from serving.

mlx-lm's batched lane builds a request's stop-sequence matcher, sampler and logits processors on
its one generation thread outside any ``try``: a value that raises there kills the thread, and
from then on every request gets 404 "generation thread died" and ``/health`` 503 until a
restart. A ``logit_bias`` id outside the vocabulary is written out of bounds and can end the
process. In the serial lane (a ``seed``) the same values, and a seed outside uint64, end the
response after its headers.

:func:`refusal` names the first such field of a body that mlx-lm's own checks
(``validate_model_parameters``) already passed; the ``MLX_FILL`` hook answers it with a 400 in
mlx-lm's own shape (:func:`refused`) before the request reaches the thread. Everything
else is left to mlx-lm. The sampler's checks (``top_k``, ``min_p``, ``xtc_*``) hold where the
request samples (its temperature, else the server's ``--temp``, is not 0); at 0 mlx-lm's greedy
sampler never reads those fields, and the request is served as stock serves it.
"""

from __future__ import annotations

import math
from typing import Any

from mlx_fill.adapters import mlx_lm_seam as seam
from mlx_fill.core.model_folder import vocab_size

INT64 = 1 << 63
UINT64 = 1 << 64
# numbers mlx-lm turns into MLX scalars: an integer past int64 raises there
INT64_NUMBERS = ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty")
CONTEXT_SIZES = ("repetition_context_size", "presence_context_size", "frequency_context_size")


def _stop_refusal(stop: Any) -> str | None:
    """mlx-lm turns ``stop`` into ``tuple(stop or [])`` (a string into ``[stop]``) and
    tokenizes every item: each must be a string UTF-8 can carry."""
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, (list, dict)):
        return f"stop must be a string or a list of strings, got {type(stop).__name__}"
    for word in stop:
        if not isinstance(word, str):
            return f"stop must be a string or a list of strings, got an item of type {type(word).__name__}"
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:
            return "stop must be text UTF-8 can encode (no lone surrogates)"
    return None


def _prompt_refusal(prompt: Any) -> str | None:
    """A ``/v1/completions`` ``prompt`` that is a list of strings tokenizes as a batch (a list
    of id lists), which mlx-lm's prompt-cache lookup cannot hash; an empty one is a sequence
    without ids, which the batch generator refuses by raising."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "prompt must be a string, got a list of strings"
    if prompt == "":
        return "prompt must not be empty"
    return None


def _sampler_refusal(body: dict, vocab_size: int | None) -> str | None:
    """The fields only a sampling (temperature > 0) sampler reads."""
    top_k = body.get("top_k")
    if vocab_size is not None and isinstance(top_k, int) and top_k >= vocab_size:
        return f"top_k must be less than the vocabulary size ({vocab_size})"
    min_p = body.get("min_p")
    if isinstance(min_p, float) and math.isnan(min_p):
        return "min_p must be a number between 0 and 1"
    xtc_probability, xtc_threshold = body.get("xtc_probability"), body.get("xtc_threshold")
    if (isinstance(xtc_probability, float) and xtc_probability > 0
            and isinstance(xtc_threshold, float) and not 0 <= xtc_threshold <= 0.5):
        return "xtc_threshold must be between 0 and 0.5"
    return None


def refusal(body: Any, vocab_size: int | None = None, *, temperature: Any = None,
            text_prompt: Any = None) -> str | None:
    """Why mlx-lm's generation thread cannot serve ``body`` (one line), or None. ``vocab_size``:
    the loaded model's logits width; without it the checks that need it (``top_k``,
    ``logit_bias`` ids) are skipped. ``temperature``: the one the request samples at (None:
    unknown, the sampler's checks apply); 0 skips them. ``text_prompt``: a ``/v1/completions``
    request's ``prompt`` (None for a chat request). Assumes the types mlx-lm's
    ``validate_model_parameters`` already enforced (``seed``, ``top_k`` and the context sizes
    ints, penalties numbers, ``logit_bias`` a dict of int-like keys)."""
    if not isinstance(body, dict):
        return None
    why = _prompt_refusal(text_prompt) or _stop_refusal(body.get("stop"))
    if why is None and temperature != 0:
        why = _sampler_refusal(body, vocab_size)
    if why is not None:
        return why
    seed = body.get("seed")
    if isinstance(seed, int) and not 0 <= seed < UINT64:
        return "seed must be between 0 and 2**64 - 1"
    if body.get("top_logprobs") is True:  # an int to mlx-lm's check, not an MLX slice index
        return "top_logprobs must be an integer, got a boolean"
    for name in INT64_NUMBERS:
        value = body.get(name)
        if isinstance(value, int) and not -INT64 <= value < INT64:
            return f"{name} must be a float or an integer within int64"
    for name in CONTEXT_SIZES:
        value = body.get(name)
        if isinstance(value, int) and value >= INT64:
            return f"{name} must be less than 2**63"
    bias = body.get("logit_bias")
    if vocab_size is not None and isinstance(bias, dict):
        for key in bias:
            try:
                token = int(key)
            except (TypeError, ValueError):
                continue  # mlx-lm's own check answers these
            if not 0 <= token < vocab_size:
                return f"logit_bias keys must be token ids between 0 and {vocab_size - 1}"
    return None


def refused(handler: Any, request: Any) -> bool:
    """On an ``mlx_lm.server.APIHandler`` handling ``request`` (its ``CompletionRequest``)
    whose body passed mlx-lm's checks: when :func:`refusal` names a field, answer as mlx-lm
    answers a parameter it rejects (400, ``{"error": message}``) and return True; else False,
    nothing sent."""
    provider = seam.model_provider(seam.response_generator(handler))
    why = refusal(seam.request_body(handler), vocab_size(seam.loaded_model(provider)),
                  temperature=seam.request_temperature(handler),
                  text_prompt=seam.text_prompt(request))
    if why is None:
        return False
    seam.send_error(handler, 400, {"error": why})
    return True
