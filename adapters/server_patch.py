"""Fill inside an unmodified ``mlx_lm.server`` (mlx-lm 0.32.x), applied by the autoload hook.

Routing: a chat or text completion whose body carries ``tools``, ``tool_choice`` or
``prediction`` is marked on the HTTP thread (``APIHandler.handle_completion``) and the mark is
copied onto its ``GenerationArguments`` (``ResponseGenerator.generate``). Such a request keeps
the batched lane (``ResponseGenerator._is_batchable`` answers as stock) when the loaded model's
caches batch-fill (:func:`mlx_fill.adapters.server.batch_fill.supported`) and it is not
sharded; otherwise it takes the serial lane (``_serve_single``), as does everything stock
serves serially (a ``seed``, ``--kv-bits``, a draft model, images). Requests without a mark
are untouched.

Batched decoding: ``_tokenize`` records the full prompt ids and leaves the mark *pending*; the
next ``BatchGenerator.insert_segments`` on the generation thread (the server calls it right
after ``_tokenize`` in its batched lane) takes it, builds the request's :class:`FillSession`
and registers it under the returned uid (:mod:`~mlx_fill.adapters.server.batch_fill`, which
runs the side steps). ``usage.fill.lane`` is ``batch`` and ``usage.fill.batch_peak`` the
largest generation batch the request decoded in.

Serial decoding: ``_serve_single`` publishes the mark in a context variable on the generation
thread; ``mlx_lm.server.stream_generate`` (the name server.py bound at import) is wrapped to
build the request's :class:`FillSession` and pass ``fill=`` to the fill-aware ``generate_step``
(installed in ``mlx_lm.generate`` by the same hook); ``usage.fill.lane`` is ``serial``.

Bounded work: a request whose tools are over the compile budget, or whose
``chat_template_kwargs`` go beyond the variables of the model's template, is served without fill
(``usage.fill.refusals``: ``compile_budget`` / ``template_kwargs``) before any schema is checked.

Responses: ``usage.fill`` (the session's stats) and, with a ``prediction``,
``usage.completion_tokens_details.{accepted,rejected}_prediction_tokens``, in the final
response and in the streamed usage chunk (``stream_options.include_usage``).

Dispatch plan: ``ModelProvider._load`` is wrapped to resolve the loaded model's plan right
after loading (:func:`mlx_fill.core.resolve.prepare`; quick-qualified once when no plan applies), so
the server measures at start-up, before its first fill request, not inside one.

Distributed (``mlx.launch``, a model ``sharded_load`` split over ``pipeline_group`` or
``tensor_group``): every rank receives the request (mlx-lm pickles it with its fill mark) and
takes the serial lane. Rank 0 builds the session and alone reads the ledger; the other ranks
build a follower session (:func:`~mlx_fill.session.follower_session`) that applies rank 0's
proposals (:mod:`mlx_fill.core.shared`). A rank whose session build fails still decodes through
fill's loop with a refused session, so the per-request agreement happens on every rank. The
plan is resolved at load on every rank together (rank 0's, shared).

Every wrapper carries ``__mlx_fill__ = True`` (idempotence) and ``__wrapped__``. All targets are
checked before any is replaced; a mismatch raises, and the hook turns that into one warning.
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_fill.sources.ledger import Ledger
from mlx_fill.limits import over_compile_budget
from mlx_fill.core.proposal import FillSession
from mlx_fill.session import (
    attach_shared,
    build_session,
    follower_session,
    check_env,
    end_session,
    predicted_count,
    server_ledger,
    usage_extra,
)
from mlx_fill.adapters import stock_guard
from mlx_fill.adapters.server import batch_fill
from mlx_fill.adapters.server.batch_fill import SeqFill
from mlx_fill.adapters.server.template_vars import template_variables

ROUTED_KEYS = ("tools", "tool_choice", "prediction")
log = logging.getLogger("mlx_fill")

# (class name, method, leading parameter names the wrapper relies on)
TARGETS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("APIHandler", "handle_completion", ("self", "request", "stop_words")),
    ("APIHandler", "generate_response", ("self", "text", "finish_reason")),
    ("APIHandler", "completion_usage_response", ("self",)),
    ("ResponseGenerator", "generate", ("self", "request", "generation_args")),
    ("ResponseGenerator", "_is_batchable", ("self", "args")),
    ("ResponseGenerator", "_serve_single", ("self", "request", "stream")),
    ("ResponseGenerator", "_tokenize", ("self", "tokenizer", "request", "args")),
    ("ModelProvider", "_load", ("self", "model_path")),
    ("BatchGenerator", "insert_segments", ("self", "segments")),
)


@dataclass
class FillRequest:
    """What the fill needs from one HTTP request; filled in as the request moves threads."""

    mode: str
    body: dict
    prompt_ids: list[int] | None = None
    session: FillSession | None = None
    predicted: int = 0
    error: str | None = None
    batched: SeqFill | None = None  # set when the request decodes in the batched lane

    def usage(self) -> dict[str, Any]:
        """``usage`` additions: ``fill`` (with ``lane``; in the batched lane ``batch_peak``)
        and, with a prediction, ``completion_tokens_details``."""
        predicted = self.predicted if self.body.get("prediction") is not None else None
        extra = usage_extra(self.session, predicted=predicted, error=self.error)
        if "fill" in extra and self.session is not None:
            extra["fill"]["lane"] = "batch" if self.batched is not None else "serial"
            if self.batched is not None:
                extra["fill"]["batch_peak"] = self.batched.batch_peak
        return extra


_current: contextvars.ContextVar[tuple[FillRequest, Any, str] | None] = contextvars.ContextVar(
    "mlx_fill_request", default=None)


def wants_fill(body: Any) -> bool:
    """Requests that take the serial fill lane: those carrying tools, tool_choice or prediction."""
    return isinstance(body, dict) and bool(
        body.get("tools") or body.get("tool_choice") is not None or body.get("prediction") is not None)


def _check(server: Any) -> None:
    for cls_name, method, params in TARGETS:
        cls = getattr(server, cls_name, None)
        fn = getattr(cls, method, None)
        if fn is None:
            raise RuntimeError(f"mlx_lm.server.{cls_name}.{method} is missing")
        names = tuple(inspect.signature(fn).parameters)[:len(params)]
        if names != params:
            raise RuntimeError(f"mlx_lm.server.{cls_name}.{method}{names} does not start with {params}")
    if not callable(getattr(server, "stream_generate", None)):
        raise TypeError("mlx_lm.server.stream_generate is missing or not callable")


def _wrap(original: Callable, wrapper: Callable) -> Callable:
    wrapper.__wrapped__ = original
    wrapper.__mlx_fill__ = True
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__doc__ = original.__doc__
    return wrapper


def _add_usage(response: Any, fill_request: FillRequest | None) -> Any:
    if fill_request is not None and isinstance(response, dict) and isinstance(response.get("usage"), dict):
        response["usage"].update(fill_request.usage())
    return response


_ledgers: dict[tuple[str, str], Ledger | None] = {}


def _ledger_for(model_key: str, tokenizer: Any) -> Ledger | None:
    """The server's evidence ledger for its model and template, loaded once; None (logged,
    fill still serves in ``verify``) when the persisted file is unreadable."""
    key = (model_key, getattr(tokenizer, "chat_template", None) or "")
    if key not in _ledgers:
        try:
            _ledgers[key] = server_ledger(model_key, tokenizer)
        except ValueError as e:
            log.warning("mlx-fill: evidence ledger disabled (%s)", e)
            _ledgers[key] = None
    return _ledgers[key]


# per model: the cost-gated sources' per-draft acceptance estimates, kept for the process lifetime
_acceptance: dict[str, dict] = {}

_template_vars: dict[str, frozenset[str]] = {}


def _allowed_kwargs(tokenizer: Any) -> frozenset[str]:
    """The ``chat_template_kwargs`` keys the tokenizer's template reads, computed once per
    template."""
    template = getattr(tokenizer, "chat_template", None)
    key = hashlib.sha256(json.dumps(template, sort_keys=True, default=str).encode()).hexdigest()
    if key not in _template_vars:
        _template_vars[key] = template_variables(template)
    return _template_vars[key]


def _budget_refusal(body: dict, tokenizer: Any) -> str | None:
    """Why fill must not even look at this request's tools or template arguments: tools over
    the default :class:`~mlx_fill.limits.Limits` compile budget (checked without recursion or
    jsonschema, so the generation thread never spends long on them), or
    ``chat_template_kwargs`` beyond the model template's variables (fill renders only the
    model directory's template)."""
    if over_compile_budget(body.get("tools")):
        return "compile_budget"
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not (isinstance(kwargs, dict)
                                   and set(kwargs) <= _allowed_kwargs(tokenizer)):
        return "template_kwargs"
    return None


def _open_session(fill_request: FillRequest, args: Any, kwargs: dict,
                  ledger: Ledger | None = None, model_key: str = "",
                  group: Any = None) -> FillSession | None:
    """The request's session; a request fill cannot serve (malformed tools or prediction) or
    must not compile (:func:`_budget_refusal`) gets a refused session, so it decodes exactly as
    without fill and says why in ``usage.fill``."""
    body = fill_request.body
    tokenizer = kwargs["tokenizer"]
    prompt_ids = fill_request.prompt_ids or []
    refusal = _budget_refusal(body, tokenizer)
    if refusal is not None:
        session = FillSession([], prompt_ids=prompt_ids)
        session.refuse(refusal)
        return session
    try:
        fill_request.predicted = predicted_count(tokenizer, body.get("prediction"))
        session = build_session(
            fill_request.mode, model=kwargs["model"], tokenizer=tokenizer, prompt_ids=prompt_ids,
            messages=body.get("messages"), tools=body.get("tools") or None,
            template_kwargs=body.get("chat_template_kwargs") or None,
            temperature=float(getattr(args.sampling, "temperature", 0.0) or 0.0),
            seed=getattr(args, "seed", None),
            logprobs=bool(getattr(args, "logprobs", False)) or (getattr(args, "top_logprobs", -1) or -1) > 0,
            response_format=body.get("response_format"),
            media=kwargs.get("input_embeddings") is not None,
            prediction=body.get("prediction"), ledger=ledger,
            acceptance=_acceptance.setdefault(model_key, {}), group=group)
    except ValueError as e:
        session = FillSession([], prompt_ids=prompt_ids)
        session.refuse("invalid_request")
        fill_request.error = str(e)
        return session
    # mlx_lm.server reads every token's logprob before it builds the next step, so its plain
    # steps are synchronous, like a round's: a round costs its rows and nothing more
    if session is not None:
        session.pace.round_overhead = 0.0
    return session


def apply(server: Any, mode: str) -> bool:
    """Patch the executed ``mlx_lm.server`` module for fill ``mode``. Returns False when it was
    already patched. Raises (patching nothing) when a target is missing or has another shape."""
    if getattr(server.ResponseGenerator._is_batchable, "__mlx_fill__", False):
        return False
    _check(server)
    check_env()
    from .mlx_lm import install_generate_step
    API, RG = server.APIHandler, server.ResponseGenerator
    handle_completion, generate_response = API.handle_completion, API.generate_response
    usage_response, generate = API.completion_usage_response, RG.generate
    is_batchable, serve_single, tokenize = RG._is_batchable, RG._serve_single, RG._tokenize
    stream_generate = server.stream_generate
    load = server.ModelProvider._load
    insert_segments = server.BatchGenerator.insert_segments

    def handle_completion_w(self, request, stop_words, *a, **kw):
        body = getattr(self, "body", None)
        if stock_guard.refused(self):  # answered 400: the value would stop mlx-lm's generation thread
            return None
        self.mlx_fill = FillRequest(mode, body) if wants_fill(body) else None
        if self.mlx_fill is not None:
            request.mlx_fill = self.mlx_fill
        return handle_completion(self, request, stop_words, *a, **kw)

    def generate_response_w(self, *a, **kw):
        return _add_usage(generate_response(self, *a, **kw), getattr(self, "mlx_fill", None))

    def usage_response_w(self, *a, **kw):
        return _add_usage(usage_response(self, *a, **kw), getattr(self, "mlx_fill", None))

    def generate_w(self, request, generation_args, *a, **kw):
        fill_request = getattr(request, "mlx_fill", None)
        if fill_request is not None:
            generation_args.mlx_fill = fill_request
        return generate(self, request, generation_args, *a, **kw)

    def is_batchable_w(self, args, *a, **kw):
        if getattr(args, "mlx_fill", None) is not None and not _batch_fills(self.model_provider):
            return False
        return is_batchable(self, args, *a, **kw)

    def tokenize_w(self, tokenizer, request, args, *a, **kw):
        _pending.clear()
        out = tokenize(self, tokenizer, request, args, *a, **kw)
        fill_request = getattr(request, "mlx_fill", None)
        if fill_request is not None:
            fill_request.prompt_ids = list(out[0])
            model_key = str((getattr(self.model_provider, "model_key", None) or ("",))[0])
            _pending.append((fill_request, tokenizer, args, model_key))
        return out

    def insert_segments_w(self, segments, *a, **kw):
        pending = _pending.pop() if _pending else None
        uids = insert_segments(self, segments, *a, **kw)
        if pending is not None and len(uids) == 1:
            _register(self, uids[0], *pending)
        return uids

    def serve_single_w(self, request, stream, *a, **kw):
        _pending.clear()
        args = request[2]
        fill_request = getattr(args, "mlx_fill", None)
        model_key = str((getattr(getattr(self, "model_provider", None), "model_key", None) or ("",))[0])
        token = _current.set((fill_request, args, model_key) if fill_request is not None else None)
        try:
            return serve_single(self, request, stream, *a, **kw)
        finally:
            _current.reset(token)

    def stream_generate_w(*a, **kw):
        current = _current.get()
        if current is None or kw.get("draft_model") is not None or "fill" in kw or a:
            return stream_generate(*a, **kw)
        _current.set(None)  # one session per request
        fill_request, args, model_key = current
        group = _group(kw["model"])
        if group is not None and group.rank() != 0:
            return stream_generate(fill=_follower(fill_request, kw, group), **kw)
        ledger = None
        try:
            ledger = _ledger_for(model_key, kw["tokenizer"])
            session = attach_shared(_open_session(fill_request, args, kw, ledger, model_key, group),
                                    group)
        except Exception as e:  # noqa: BLE001 -- a fill bug must not fail the request
            log.warning("mlx-fill: request served without fill (%s: %s)", type(e).__name__, e)
            fill_request.error = f"{type(e).__name__}: {e}"
            if group is None:
                return stream_generate(*a, **kw)
            # the other ranks decode with fill's loop: agree with them, refused
            return stream_generate(fill=follower_session(
                kw["model"], fill_request.prompt_ids or [], group, refuse="error"), **kw)
        fill_request.session = session
        return _finishing(stream_generate(fill=session, **kw), session, ledger)

    def load_w(self, *a, **kw):
        out = load(self, *a, **kw)
        if getattr(self, "model", None) is not None:
            from mlx_fill.core.resolve import prepare
            group = getattr(self, "pipeline_group", None) or getattr(self, "tensor_group", None)
            if group is not None:
                _groups[id(self.model)] = group
            prepare(self.model, group)
        return out

    install_generate_step()
    batch_fill.install(sys.modules["mlx_lm.generate"])
    server.BatchGenerator.insert_segments = _wrap(insert_segments, insert_segments_w)
    server.ModelProvider._load = _wrap(load, load_w)
    API.handle_completion = _wrap(handle_completion, handle_completion_w)
    API.generate_response = _wrap(generate_response, generate_response_w)
    API.completion_usage_response = _wrap(usage_response, usage_response_w)
    RG.generate = _wrap(generate, generate_w)
    RG._tokenize = _wrap(tokenize, tokenize_w)
    RG._serve_single = _wrap(serve_single, serve_single_w)
    server.stream_generate = _wrap(stream_generate, stream_generate_w)
    RG._is_batchable = _wrap(is_batchable, is_batchable_w)  # last: the idempotence flag
    return True


_groups: dict[int, Any] = {}  # id(model) -> the distributed group it was sharded over

# (fill request, tokenizer, args, model key) of the last ``_tokenize`` on the generation
# thread, taken by the ``insert_segments`` that follows it in the batched lane
_pending: list[tuple[FillRequest, Any, Any, str]] = []
_batchable_models: dict[int, bool] = {}


def _batch_fills(model_provider: Any) -> bool:
    """Whether fill requests for the provider's loaded model keep the batched lane: its caches
    batch-fill and it is not sharded over a distributed group (ranks agree on proposals only in
    the serial lane). False before a model is loaded."""
    model = getattr(model_provider, "model", None)
    if model is None or _group(model) is not None:
        return False
    if id(model) not in _batchable_models:
        _batchable_models[id(model)] = batch_fill.supported(model)
    return _batchable_models[id(model)]


def _register(batch_generator: Any, uid: int, fill_request: FillRequest, tokenizer: Any,
              args: Any, model_key: str) -> None:
    """Build the batched request's session and register it under ``uid``; a build failure
    serves the request without fill (logged, ``usage.fill.error``)."""
    ledger = None
    try:
        ledger = _ledger_for(model_key, tokenizer)
        session = _open_session(fill_request, args,
                                {"tokenizer": tokenizer, "model": batch_generator.model},
                                ledger, model_key)
    except Exception as e:  # noqa: BLE001 -- a fill bug must not fail the request
        log.warning("mlx-fill: request served without fill (%s: %s)", type(e).__name__, e)
        fill_request.error = f"{type(e).__name__}: {e}"
        return
    fill_request.session = session
    seq = SeqFill(session, list(fill_request.prompt_ids or []),
                  on_end=lambda: end_session(session, ledger))
    fill_request.batched = seq
    batch_fill.registry(batch_generator)[uid] = seq


def _group(model: Any) -> Any:
    """The group a model loaded by ``ModelProvider._load`` under ``mlx.launch`` spans, else None."""
    return _groups.get(id(model))


def _follower(fill_request: FillRequest, kwargs: dict, group: Any) -> FillSession:
    """A rank other than 0: a session that follows rank 0 (its sources, ledger and decisions
    are rank 0's); one whose build fails still agrees, refused."""
    prompt_ids = fill_request.prompt_ids or []
    try:
        return follower_session(kwargs["model"], prompt_ids, group)
    except Exception as e:  # noqa: BLE001 -- must still take part in the agreement
        log.warning("mlx-fill: rank %d refuses fill (%s: %s)", group.rank(), type(e).__name__, e)
        return follower_session(kwargs["model"], prompt_ids, group, refuse="error")


def _finishing(responses, session: FillSession, ledger: Ledger | None):
    try:
        yield from responses
    finally:
        end_session(session, ledger)
