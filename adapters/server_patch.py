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

State: one :class:`ServerFill` per patched server holds everything the hook keeps between
calls (ledgers, acceptance estimates, template variables, distributed groups, the request parked
between ``_tokenize`` and ``insert_segments``, the serial request on the generation thread); the
module holds none. Each wrapper is a named function of that state and the wrapped original
(:data:`WRAPPERS`); a request body is first seen in :meth:`ServerFill.receive`.

Every wrapper carries ``__mlx_fill__ = True`` (idempotence) and ``__wrapped__``. Every private
name the hook and the batched lane touch is in :mod:`mlx_fill.adapters.mlx_lm_seam` and checked
before anything is replaced: a server mismatch raises (the hook turns that into one warning and
patches nothing); a batched-lane mismatch is one warning and fill off in that lane only.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_fill.sources.ledger import Ledger
from mlx_fill.limits import over_compile_budget
from mlx_fill.core.index import IndexStore
from mlx_fill.core.proposal import FillSession
from mlx_fill.spec.suffix import GlobalSuffixTree
from mlx_fill.session import (
    attach_shared,
    build_session,
    follower_session,
    check_env,
    end_session,
    env_store_tokens,
    keeps_index,
    prediction_ids,
    server_ledger,
    usage_extra,
)
from mlx_fill.adapters import mlx_lm_seam as seam
from mlx_fill.adapters import stock_guard
from mlx_fill.adapters.server import batch_fill
from mlx_fill.adapters.server.batch_fill import SeqFill
from mlx_fill.adapters.server.template_vars import template_variables

log = logging.getLogger("mlx_fill")


@dataclass
class FillRequest:
    """What the fill needs from one HTTP request; filled in as the request moves threads."""

    mode: str
    body: dict
    prompt_ids: list[int] | None = None
    session: FillSession | None = None
    prediction: list[int] | None = None  # the ids of the request's OpenAI ``prediction``
    error: str | None = None
    batched: SeqFill | None = None  # set when the request decodes in the batched lane

    def usage(self) -> dict[str, Any]:
        """``usage`` additions: ``fill`` (with ``lane``; in the batched lane ``batch_peak``)
        and, with a prediction, ``completion_tokens_details``."""
        extra = usage_extra(self.session, prediction=self.prediction, error=self.error)
        if "fill" in extra and self.session is not None:
            extra["fill"]["lane"] = "batch" if self.batched is not None else "serial"
            if self.batched is not None:
                extra["fill"]["batch_peak"] = self.batched.batch_peak
        return extra


@dataclass
class Parked:
    """A batched-lane request between ``_tokenize`` and the ``insert_segments`` that follows it
    on the generation thread."""

    request: FillRequest
    tokenizer: Any
    args: Any
    model_key: str


def wants_fill(body: Any) -> bool:
    """Requests that take the serial fill lane: those carrying tools, tool_choice or prediction."""
    return isinstance(body, dict) and bool(
        body.get("tools") or body.get("tool_choice") is not None or body.get("prediction") is not None)


class ServerFill:
    """The hook's state for one patched ``mlx_lm.server``: fill ``mode``; whether the batched
    lane fills (``batch_lane``: its seam matched); per model key and template the evidence
    ledger, per model key the cost-gated sources' acceptance estimates (kept for the process
    lifetime), in mode ``all`` the cross-request store of the model last served (its replies,
    bounded by ``MLX_FILL_STORE_TOKENS``; another model starts a new one), per template its
    variables; per loaded model its distributed group and whether its caches batch-fill; the
    request parked between ``_tokenize`` and ``insert_segments``; the serial request published
    on the generation thread (a context variable)."""

    def __init__(self, mode: str, batch_lane: bool = True):
        self.mode = mode
        self.batch_lane = batch_lane
        self.ledgers: dict[tuple[str, str], Ledger | None] = {}
        self.acceptance: dict[str, dict] = {}
        self.store: tuple[str, GlobalSuffixTree] | None = None
        self.indexes: tuple[str, IndexStore] | None = None
        self.template_vars: dict[str, frozenset[str]] = {}
        self.groups: dict[int, Any] = {}  # id(model) -> the distributed group it was sharded over
        self.batchable: dict[int, bool] = {}  # id(model) -> its caches batch-fill
        self.parked: Parked | None = None
        self.current: contextvars.ContextVar[tuple[FillRequest, Any, str] | None] = (
            contextvars.ContextVar("mlx_fill_request", default=None))

    def receive(self, body: Any) -> FillRequest | None:
        """The one place a request body is first seen: the request's fill mark, or None when
        fill leaves it alone."""
        return FillRequest(self.mode, body) if wants_fill(body) else None

    def ledger_for(self, model_key: str, tokenizer: Any) -> Ledger | None:
        """The server's evidence ledger for its model and template, loaded once; None (logged,
        fill still serves in ``verify``) when the persisted file is unreadable."""
        key = (model_key, getattr(tokenizer, "chat_template", None) or "")
        if key not in self.ledgers:
            try:
                self.ledgers[key] = server_ledger(model_key, tokenizer)
            except ValueError as e:
                log.warning("mlx-fill: evidence ledger disabled (%s)", e)
                self.ledgers[key] = None
        return self.ledgers[key]

    def store_for(self, model_key: str) -> GlobalSuffixTree | None:
        """The suffix source's cross-request store for ``model_key`` in mode ``all`` (one store,
        the model last served: a request for another model replaces it), else None."""
        if self.mode != "all":
            return None
        if self.store is None or self.store[0] != model_key:
            self.store = (model_key, GlobalSuffixTree(max_tokens=env_store_tokens()))
        return self.store[1]

    def indexes_for(self, model_key: str) -> IndexStore | None:
        """The model-free sources' conversation indexes for ``model_key`` in modes ``echo`` and
        ``all`` (one store, the model last served), else None."""
        if not keeps_index(self.mode):
            return None
        if self.indexes is None or self.indexes[0] != model_key:
            self.indexes = (model_key, IndexStore())
        return self.indexes[1]

    def allowed_kwargs(self, tokenizer: Any) -> frozenset[str]:
        """The ``chat_template_kwargs`` keys the tokenizer's template reads, computed once per
        template."""
        template = getattr(tokenizer, "chat_template", None)
        key = hashlib.sha256(json.dumps(template, sort_keys=True, default=str).encode()).hexdigest()
        if key not in self.template_vars:
            self.template_vars[key] = template_variables(template)
        return self.template_vars[key]

    def budget_refusal(self, body: dict, tokenizer: Any) -> str | None:
        """Why fill must not even look at this request's tools or template arguments: tools over
        the default :class:`~mlx_fill.limits.Limits` compile budget (checked without recursion or
        jsonschema, so the generation thread never spends long on them), or
        ``chat_template_kwargs`` beyond the model template's variables (fill renders only the
        model directory's template)."""
        if over_compile_budget(body.get("tools")):
            return "compile_budget"
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not (isinstance(kwargs, dict)
                                       and set(kwargs) <= self.allowed_kwargs(tokenizer)):
            return "template_kwargs"
        return None

    def open_session(self, fill_request: FillRequest, args: Any, kwargs: dict,
                     ledger: Ledger | None = None, model_key: str = "",
                     group: Any = None) -> FillSession | None:
        """The request's session; a request fill cannot serve (malformed tools or prediction) or
        must not compile (:meth:`budget_refusal`) gets a refused session, so it decodes exactly
        as without fill and says why in ``usage.fill`` (a malformed request: the refusal
        ``invalid_request`` and, in ``fill_request.error``, the field it got wrong)."""
        body = fill_request.body
        tokenizer = kwargs["tokenizer"]
        prompt_ids = fill_request.prompt_ids or []
        refusal = self.budget_refusal(body, tokenizer)
        try:
            fill_request.prediction = prediction_ids(tokenizer, body.get("prediction"))
            if refusal is not None:
                session = FillSession([], prompt_ids=prompt_ids)
                session.refuse(refusal)
                return session
            session = build_session(
                fill_request.mode, model=kwargs["model"], tokenizer=tokenizer,
                prompt_ids=prompt_ids, messages=body.get("messages"),
                tools=body.get("tools") or None,
                template_kwargs=body.get("chat_template_kwargs") or None,
                temperature=float(getattr(args.sampling, "temperature", 0.0) or 0.0),
                seed=getattr(args, "seed", None),
                logprobs=bool(getattr(args, "logprobs", False))
                or (getattr(args, "top_logprobs", -1) or -1) > 0,
                response_format=body.get("response_format"),
                media=kwargs.get("input_embeddings") is not None,
                prediction=fill_request.prediction, ledger=ledger,
                acceptance=self.acceptance.setdefault(model_key, {}),
                global_tree=self.store_for(model_key), group=group,
                indexes=self.indexes_for(model_key))
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

    def group(self, model: Any) -> Any:
        """The group a model loaded by ``ModelProvider._load`` under ``mlx.launch`` spans, else
        None."""
        return self.groups.get(id(model))

    def batch_fills(self, model_provider: Any) -> bool:
        """Whether fill requests for the provider's loaded model keep the batched lane: its
        caches batch-fill and it is not sharded over a distributed group (ranks agree on
        proposals only in the serial lane). False before a model is loaded."""
        model = seam.loaded_model(model_provider)
        if model is None or self.group(model) is not None:
            return False
        if id(model) not in self.batchable:
            self.batchable[id(model)] = batch_fill.supported(model)
        return self.batchable[id(model)]

    def register(self, batch_generator: Any, uid: int, parked: Parked) -> None:
        """Build the batched request's session and register it under ``uid``; a build failure
        serves the request without fill (logged, ``usage.fill.error``)."""
        fill_request = parked.request
        ledger = None
        try:
            ledger = self.ledger_for(parked.model_key, parked.tokenizer)
            session = self.open_session(fill_request, parked.args,
                                        {"tokenizer": parked.tokenizer,
                                         "model": batch_generator.model},
                                        ledger, parked.model_key)
        except Exception as e:  # noqa: BLE001 -- a fill bug must not fail the request
            log.warning("mlx-fill: request served without fill (%s: %s)", type(e).__name__, e)
            fill_request.error = f"{type(e).__name__}: {e}"
            return
        fill_request.session = session
        seq = SeqFill(session, list(fill_request.prompt_ids or []),
                      on_end=lambda: end_session(session, ledger))
        fill_request.batched = seq
        batch_fill.registry(batch_generator)[uid] = seq

    def serial_stream(self, stream_generate: Callable, current: tuple[FillRequest, Any, str],
                      kw: dict):
        """The serial lane's ``stream_generate`` call for the published request: with its
        session (rank 0 or one machine), a follower session (other ranks), or without fill when
        the session cannot be built (logged, ``usage.fill.error``)."""
        fill_request, args, model_key = current
        group = self.group(kw["model"])
        if group is not None and group.rank() != 0:
            return stream_generate(fill=_follower(fill_request, kw, group), **kw)
        ledger = None
        try:
            ledger = self.ledger_for(model_key, kw["tokenizer"])
            session = attach_shared(self.open_session(fill_request, args, kw, ledger, model_key,
                                                      group), group)
        except Exception as e:  # noqa: BLE001 -- a fill bug must not fail the request
            log.warning("mlx-fill: request served without fill (%s: %s)", type(e).__name__, e)
            fill_request.error = f"{type(e).__name__}: {e}"
            if group is None:
                return stream_generate(**kw)
            # the other ranks decode with fill's loop: agree with them, refused
            return stream_generate(fill=follower_session(
                kw["model"], fill_request.prompt_ids or [], group, refuse="error"), **kw)
        fill_request.session = session
        return _finishing(stream_generate(fill=session, **kw), session, ledger)


def _add_usage(response: Any, fill_request: FillRequest | None) -> Any:
    if fill_request is not None and isinstance(response, dict) and isinstance(response.get("usage"), dict):
        response["usage"].update(fill_request.usage())
    return response


# --- the wrappers: each a named function of the server's state and the wrapped original --------


def _handle_completion(state: ServerFill, original: Callable) -> Callable:
    """HTTP thread: mark a request fill may serve (on the handler and on the request)."""
    def handle_completion(self, request, stop_words, *a, **kw):
        if stock_guard.refused(self, request):  # answered 400: the value would stop mlx-lm's generation thread
            return None
        self.mlx_fill = state.receive(seam.request_body(self))
        if self.mlx_fill is not None:
            request.mlx_fill = self.mlx_fill
        return original(self, request, stop_words, *a, **kw)
    return handle_completion


def _generate_response(state: ServerFill, original: Callable) -> Callable:
    """The final response: ``usage`` gains the request's fill block."""
    def generate_response(self, *a, **kw):
        return _add_usage(original(self, *a, **kw), getattr(self, "mlx_fill", None))
    return generate_response


def _usage_response(state: ServerFill, original: Callable) -> Callable:
    """The streamed usage chunk: ``usage`` gains the request's fill block."""
    def completion_usage_response(self, *a, **kw):
        return _add_usage(original(self, *a, **kw), getattr(self, "mlx_fill", None))
    return completion_usage_response


def _generate(state: ServerFill, original: Callable) -> Callable:
    """Copy the request's mark onto its generation arguments (they cross to the generation
    thread, and to every rank)."""
    def generate(self, request, generation_args, *a, **kw):
        fill_request = getattr(request, "mlx_fill", None)
        if fill_request is not None:
            generation_args.mlx_fill = fill_request
        return original(self, request, generation_args, *a, **kw)
    return generate


def _is_batchable(state: ServerFill, original: Callable) -> Callable:
    """Routing: a marked request takes the serial lane when the batched lane fills but the
    loaded model does not batch-fill; otherwise stock's answer."""
    def is_batchable(self, args, *a, **kw):
        if (getattr(args, "mlx_fill", None) is not None and state.batch_lane
                and not state.batch_fills(seam.model_provider(self))):
            return False
        return original(self, args, *a, **kw)
    return is_batchable


def _tokenize(state: ServerFill, original: Callable) -> Callable:
    """Record a marked request's full prompt ids and park it for the ``insert_segments`` that
    follows in the batched lane."""
    def tokenize(self, tokenizer, request, args, *a, **kw):
        state.parked = None
        out = original(self, tokenizer, request, args, *a, **kw)
        fill_request = getattr(request, "mlx_fill", None)
        if fill_request is not None:
            fill_request.prompt_ids = seam.prompt_of(out)
            if state.batch_lane:
                state.parked = Parked(fill_request, tokenizer, args,
                                      seam.model_key(seam.model_provider(self)))
        return out
    return tokenize


def _insert_segments(state: ServerFill, original: Callable) -> Callable:
    """Batched lane: the parked request's session is registered under its new uid."""
    def insert_segments(self, segments, *a, **kw):
        parked, state.parked = state.parked, None
        uids = original(self, segments, *a, **kw)
        if parked is not None and len(uids) == 1:
            state.register(self, uids[0], parked)
        return uids
    return insert_segments


def _serve_single(state: ServerFill, original: Callable) -> Callable:
    """Serial lane: publish the marked request on the generation thread for the
    ``stream_generate`` call inside."""
    def serve_single(self, request, *a, **kw):
        state.parked = None
        args = seam.serial_args(request)
        fill_request = getattr(args, "mlx_fill", None)
        model_key = seam.model_key(seam.model_provider(self))
        token = state.current.set((fill_request, args, model_key)
                                  if fill_request is not None else None)
        try:
            return original(self, request, *a, **kw)
        finally:
            state.current.reset(token)
    return serve_single


def _stream_generate(state: ServerFill, original: Callable) -> Callable:
    """Serial lane: the published request decodes with ``fill=`` (one session per request)."""
    def stream_generate(*a, **kw):
        current = state.current.get()
        if current is None or kw.get("draft_model") is not None or "fill" in kw or a:
            return original(*a, **kw)
        state.current.set(None)
        return state.serial_stream(original, current, kw)
    return stream_generate


def _load(state: ServerFill, original: Callable) -> Callable:
    """Resolve the loaded model's dispatch plan right after loading (every rank together), and
    pay its tokenizer's one-time strict costs (:func:`~mlx_fill.strict.source.warm_strict`)."""
    def load(self, *a, **kw):
        out = original(self, *a, **kw)
        model = seam.loaded_model(self)
        if model is not None:
            from mlx_fill.core.resolve import plan_source, prepare
            from mlx_fill.core.shared import ranks_of
            from mlx_fill.strict.source import warm_strict
            group = seam.provider_group(self)
            if group is not None:
                state.groups[id(model)] = group
            prepare(model, group)
            ranks = ranks_of(group)
            if ranks is None or ranks.root:  # rank 0 alone compiles strict rows
                warm_strict(seam.loaded_tokenizer(self))
            lanes = ("batch (side steps in BatchGenerator) and serial (generate_step)"
                     if state.batch_lane else "serial (generate_step)")
            log.info("mlx-fill: MLX_FILL=%s active; %s; lanes patched: %s", state.mode,
                     plan_source(model), lanes)
        return out
    return load


# (class name in mlx_lm.server or None for the module, attribute, wrapper); the last one
# carries the idempotence flag :func:`apply` checks
WRAPPERS: tuple[tuple[str | None, str, Callable[[ServerFill, Callable], Callable]], ...] = (
    ("BatchGenerator", "insert_segments", _insert_segments),
    ("ModelProvider", "_load", _load),
    ("APIHandler", "handle_completion", _handle_completion),
    ("APIHandler", "generate_response", _generate_response),
    ("APIHandler", "completion_usage_response", _usage_response),
    ("ResponseGenerator", "generate", _generate),
    ("ResponseGenerator", "_tokenize", _tokenize),
    ("ResponseGenerator", "_serve_single", _serve_single),
    (None, "stream_generate", _stream_generate),
    ("ResponseGenerator", "_is_batchable", _is_batchable),
)


def _wrap(original: Callable, wrapper: Callable) -> Callable:
    wrapper.__wrapped__ = original
    wrapper.__mlx_fill__ = True
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__doc__ = original.__doc__
    return wrapper


def apply(server: Any, mode: str) -> bool:
    """Patch the executed ``mlx_lm.server`` module for fill ``mode``. Returns False when it was
    already patched. Raises (patching nothing) when a server target is missing or has another
    shape; a batched-lane mismatch is one warning and that lane runs without fill."""
    if getattr(server.ResponseGenerator._is_batchable, "__mlx_fill__", False):
        return False
    mismatch = seam.server_mismatch(server)
    if mismatch is not None:
        raise RuntimeError(mismatch)
    check_env()
    from .mlx_lm import install_generate_step
    generate = sys.modules["mlx_lm.generate"]
    batch_mismatch = seam.batch_mismatch(generate, sys.modules["mlx_lm.models.cache"])
    if batch_mismatch is not None:
        warnings.warn(f"mlx-fill: batched lane runs without fill ({batch_mismatch})",
                      RuntimeWarning, stacklevel=2)
    state = ServerFill(mode, batch_lane=batch_mismatch is None)
    install_generate_step()
    if state.batch_lane:
        batch_fill.install(generate)
    for cls_name, name, make in WRAPPERS:
        owner = server if cls_name is None else getattr(server, cls_name)
        original = getattr(owner, name)
        setattr(owner, name, _wrap(original, make(state, original)))
    return True


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
