"""The one seam to mlx-lm internals: every private attribute and signature the ``MLX_FILL``
hook (:mod:`mlx_fill.adapters.server_patch`) and the batched lane
(:mod:`mlx_fill.adapters.server.batch_fill`) touch, named here and read only through here.

Two lanes, two checks, both run once when the hook patches ``mlx_lm.server``:

- :func:`server_mismatch`: the ``mlx_lm.server`` methods the hook wraps (:data:`SERVER_TARGETS`,
  with the leading parameters each wrapper relies on) and ``stream_generate``. A mismatch
  patches nothing: one warning, the server runs unchanged.
- :func:`batch_mismatch`: the ``GenerationBatch`` / ``BatchGenerator`` / ``BatchKVCache`` /
  ``TokenBuffer`` fields and methods the side step reads and writes, checked on empty
  instances (:data:`GENERATION_BATCH_FIELDS`, :data:`BATCH_METHODS`). A mismatch turns fill off
  in the batched lane only: one warning, those requests decode there as stock.

Checked against mlx-lm 0.32.2 (``tests/adapters/test_seam.py``) and read against mlx-lm's main
branch (``docs/architecture.md``): main keeps a stop matcher's state in ``_matcher_states`` with
the matchers in ``stop_matchers`` (0.32.x: ``_matchers``, one object per sequence with
``advance``), and ``ResponseGenerator._serve_single`` takes no ``stream``; both are supported.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import mlx.core as mx

# (class name in mlx_lm.server, method, leading parameter names the wrapper relies on)
SERVER_TARGETS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("APIHandler", "handle_completion", ("self", "request", "stop_words")),
    ("APIHandler", "generate_response", ("self", "text", "finish_reason")),
    ("APIHandler", "completion_usage_response", ("self",)),
    ("ResponseGenerator", "generate", ("self", "request", "generation_args")),
    ("ResponseGenerator", "_is_batchable", ("self", "args")),
    ("ResponseGenerator", "_serve_single", ("self", "request")),
    ("ResponseGenerator", "_tokenize", ("self", "tokenizer", "request", "args")),
    ("ModelProvider", "_load", ("self", "model_path")),
    ("BatchGenerator", "insert_segments", ("self", "segments")),
)

# the BatchGenerator method that runs one step of its batches (wrapped to publish the registry)
BATCH_STEP = "_next"

# (class name in mlx_lm.generate, method, leading parameter names) the batched lane wraps
BATCH_METHODS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("GenerationBatch", "next", ("self",)),
    ("GenerationBatch", "extract_cache", ("self", "idx")),
    ("GenerationBatch", "filter", ("self", "keep")),
    ("BatchGenerator", "_next", ("self",)),
    ("BatchGenerator", "remove", ("self", "uids")),
)

# fields of a GenerationBatch instance the side step reads or writes (besides the stop matcher)
GENERATION_BATCH_FIELDS = ("model", "uids", "prompt_cache", "tokens", "samplers",
                           "fallback_sampler", "logits_processors", "max_tokens", "_next_tokens",
                           "_next_logprobs", "_num_tokens", "_token_context")
RESPONSE_FIELDS = ("uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens")
BATCH_KV_FIELDS = ("keys", "values", "left_padding", "offset", "_idx", "step")


def _signature_mismatch(module: Any, targets: tuple, where: str) -> str | None:
    for cls_name, method, params in targets:
        fn = getattr(getattr(module, cls_name, None), method, None)
        if fn is None:
            return f"{where}.{cls_name}.{method} is missing"
        names = tuple(inspect.signature(fn).parameters)[:len(params)]
        if names != params:
            return f"{where}.{cls_name}.{method}{names} does not start with {params}"
    return None


def server_mismatch(server: Any) -> str | None:
    """Why the hook cannot patch this ``mlx_lm.server``, or None."""
    found = _signature_mismatch(server, SERVER_TARGETS, "mlx_lm.server")
    if found is None and not callable(getattr(server, "stream_generate", None)):
        found = "mlx_lm.server.stream_generate is missing or not callable"
    return found


def batch_mismatch(generate_module: Any, cache_module: Any) -> str | None:
    """Why the batched lane cannot fill under this ``mlx_lm.generate`` / ``mlx_lm.models.cache``
    (a field or method the side step uses is missing or has another shape), or None."""
    found = _signature_mismatch(generate_module, BATCH_METHODS, "mlx_lm.generate")
    if found is not None:
        return found
    try:
        gb = generate_module.GenerationBatch.empty(None, lambda x: x)
        kv = cache_module.BatchKVCache([0])
        buffer = cache_module.TokenBuffer([])
    except Exception as e:  # noqa: BLE001 -- any failure is a mismatch
        return f"empty batch: {type(e).__name__}: {e}"
    missing = [f"GenerationBatch.{n}" for n in GENERATION_BATCH_FIELDS if not hasattr(gb, n)]
    if not (hasattr(gb, "_matchers") or (hasattr(gb, "_matcher_states")
                                         and hasattr(gb, "stop_matchers"))):
        missing.append("GenerationBatch._matchers / _matcher_states")
    fields = tuple(getattr(generate_module.GenerationBatch.Response, "__dataclass_fields__", ()))
    if fields[:len(RESPONSE_FIELDS)] != RESPONSE_FIELDS:
        missing.append(f"GenerationBatch.Response{RESPONSE_FIELDS}")
    missing += [f"BatchKVCache.{n}" for n in BATCH_KV_FIELDS if not hasattr(kv, n)]
    missing += [f"TokenBuffer.{n}" for n in ("tokens", "update_and_fetch") if not hasattr(buffer, n)]
    return f"{', '.join(missing)} missing" if missing else None


# --- GenerationBatch: one sequence ``i`` of a generation batch -------------------------------


def in_flight(gb: Any, i: int) -> tuple[mx.array, mx.array]:
    """Sequence ``i``'s in-flight sample: its token ``[1]`` and log-probabilities ``[V]``."""
    return gb._next_tokens[i:i + 1], gb._next_logprobs[i]


def slots_left(gb: Any, i: int) -> int:
    """How many more tokens sequence ``i`` may emit, the in-flight sample's included."""
    return gb.max_tokens[i] - gb._num_tokens[i]


def stops(gb: Any, i: int, token: int) -> bool:
    """Advance sequence ``i``'s stop matcher over ``token``: whether a stop sequence ends there."""
    if hasattr(gb, "_matchers"):
        return bool(gb._matchers[i].advance(token))
    matcher = gb.stop_matchers[i]
    gb._matcher_states[i], matched = type(matcher).match(gb._matcher_states[i], matcher._trie,
                                                         token)
    return bool(matched)


def history(gb: Any, i: int) -> mx.array | None:
    """Sequence ``i``'s logits-processor history (ending with its last fed id), or None when it
    has no processors."""
    if not gb.logits_processors or not gb.logits_processors[i]:
        return None
    return gb._token_context[i].tokens


def commit(gb: Any, i: int, ids: list[int], next_sample: tuple[mx.array, mx.array] | None) -> None:
    """Record ``ids`` as fed and emitted by sequence ``i`` and, unless it finished, set its next
    input to ``next_sample`` (token ``[1]``, log-probabilities ``[V]``)."""
    gb.tokens[i].extend(ids)
    gb._num_tokens[i] += len(ids)
    if gb.logits_processors and gb.logits_processors[i]:
        gb._token_context[i].update_and_fetch(mx.array(ids, dtype=mx.int32))
    if next_sample is not None:
        token, logprobs = next_sample
        nt = gb._next_tokens
        gb._next_tokens = mx.concatenate([nt[:i], token.astype(nt.dtype), nt[i + 1:]])
        gb._next_logprobs[i] = logprobs


# --- BatchKVCache: the shared end of the left-padded rows ------------------------------------


def kv_end(bc: Any) -> int:
    """The column every row of a ``BatchKVCache`` ends at (its rows are left-padded to it)."""
    return bc._idx


def set_kv_end(bc: Any, end: int) -> None:
    bc._idx = end


# --- mlx_lm.server: what the hook reads of the server's own objects -------------------------


def request_body(handler: Any) -> Any:
    """The parsed JSON body ``APIHandler`` holds while it handles a completion (None if absent)."""
    return getattr(handler, "body", None)


def request_temperature(handler: Any) -> Any:
    """The temperature ``APIHandler`` samples the request at (the body's, else the server's
    ``--temp``), None if absent."""
    return getattr(handler, "temperature", None)


def text_prompt(request: Any) -> Any:
    """The ``prompt`` of a ``/v1/completions`` ``CompletionRequest``; None for a chat request."""
    return getattr(request, "prompt", None) if getattr(request, "request_type", None) == "text" else None


def response_generator(handler: Any) -> Any:
    """The ``ResponseGenerator`` an ``APIHandler`` hands its requests to (None if absent)."""
    return getattr(handler, "response_generator", None)


def send_error(handler: Any, status: int, payload: dict) -> None:
    """Answer the request an ``APIHandler`` is handling with ``status`` and the JSON
    ``payload``, headers as mlx-lm sends its own parameter errors."""
    handler._set_completion_headers(status)
    handler.end_headers()
    handler.wfile.write(json.dumps(payload).encode())


def model_provider(response_generator: Any) -> Any:
    """The ``ModelProvider`` a ``ResponseGenerator`` serves from (None if absent)."""
    return getattr(response_generator, "model_provider", None)


def loaded_model(provider: Any) -> Any:
    """The model a ``ModelProvider`` has loaded, None before loading."""
    return getattr(provider, "model", None)


def loaded_tokenizer(provider: Any) -> Any:
    """The tokenizer a ``ModelProvider`` has loaded, None before loading."""
    return getattr(provider, "tokenizer", None)


def model_key(provider: Any) -> str:
    """The loaded model's path (the first entry of ``ModelProvider.model_key``), or ``""``."""
    return str((getattr(provider, "model_key", None) or ("",))[0])


def provider_group(provider: Any) -> Any:
    """The distributed group a ``ModelProvider`` sharded its model over under ``mlx.launch``."""
    return getattr(provider, "pipeline_group", None) or getattr(provider, "tensor_group", None)


def serial_args(request: tuple) -> Any:
    """The ``GenerationArguments`` of the ``(queue, request, args)`` tuple ``_serve_single``
    takes."""
    return request[2]


def prompt_of(tokenized: tuple) -> list[int]:
    """The full prompt ids of what ``ResponseGenerator._tokenize`` returns (its first entry)."""
    return list(tokenized[0])
