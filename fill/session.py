"""The composition root: the one place that turns a request into a :class:`FillSession` (or
None) (modes, sources including a draft model, refusals, the dispatch plan resolved once) and
that owns the request's lifecycle for every adapter: :func:`usage_extra` (``usage.fill``) and
:func:`end_session` (trace closed, evidence ledger saved).

Modes (``MLX_FILL`` / ``--fill``): ``off`` -> no session; ``strict`` -> the strict source only
(spans the template/schema and parser state determine); ``echo`` -> strict + echo; ``all`` ->
strict + echo + suffix + ngram, plus the sources named in ``extra_sources`` / ``MLX_FILL_SOURCES``. An OpenAI
``prediction`` adds a :class:`~mlx_fill.sources.prediction.PredictionSource` (``verify``: lossless) in
every mode but ``off``. Every source that proposes ``verify`` drafts from context (echo, suffix,
ngram, prediction) is priced per draft by a :class:`~mlx_fill.core.cost.CostGate` on the
request's dispatch plan: it proposes only the prefix whose expected accepted ids pay for the
forward under the loaded model's own cost curve. The model-free sources (echo, suffix, ngram)
compete for each view: the longest of their priced drafts is made.

A request that fill must not touch still gets a session, refused with a counted reason, so the
reason shows in ``usage.fill.refusals``: ``logprobs`` (forced tokens have no real logprobs),
``seed`` (a fixed user seed must reproduce the serial sample stream), ``response_format``
(grammar-constrained output), ``media``, and a reason the caller gives (``compile_budget``: tool
schemas over the server's fill compile budget). At temperature > 0 ``assert`` proposals are
dropped (``allow_assert=False``); ``verify`` stays lossless in distribution.

Environment knobs: ``MLX_FILL_MAX_SPAN`` (ids per proposal, default 64), ``MLX_FILL_TRACE`` (a
JSONL file every fill event is appended to), ``MLX_FILL_PLAN`` (a dispatch plan file, tried
first by :func:`~mlx_fill.core.resolve.resolve`),
``MLX_FILL_SOURCES`` (comma-separated extra sources for ``all``),
``MLX_FILL_PROMOTE`` (comma-separated ledger rows, or prefixes ending in ``:`` such as
``strict:``, that the evidence ledger may promote from ``verify`` to ``assert``; default none)
and ``MLX_FILL_PROMOTE_AFTER`` (agreements needed, default 50), read by :func:`server_ledger`.
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_fill.core.errors import UserError, unwritable
from mlx_fill.core.index import EchoIndex, IndexStore
from mlx_fill.core.model_folder import vocab_size
from mlx_fill.core.paths import user_cache_dir
from mlx_fill.core.plan import env_plan_problem, unqualified
from mlx_fill.core.primitive import token_ids
from mlx_fill.modes import check_mode
from mlx_fill.core.resolve import budget_problem, plan_for
from mlx_fill.sources.prediction import ORIGIN as PREDICTION
from mlx_fill.sources.prediction import PredictionSource, prediction_text, prediction_usage
from mlx_fill.core.cost import CostGate
from mlx_fill.strict.schema import tool_schemas
from mlx_fill.strict.source import lazy_strict_source
from mlx_fill.spec.roster import ECHO_ORIGIN, NAMES, make_sources, source_gate
from mlx_fill.spec.suffix import STORE_TOKENS, STORE_TOKENS_CEILING
from mlx_fill.core.proposal import DEFAULT_MAX_SPAN, MEDIA_REFUSAL, FillSession, Pace, ProposalSource

log = logging.getLogger("mlx_fill")
DRAFT_TOKENS = 4  # ids a draft model proposes per round (``--draft-model``)
_MODE_SOURCES = {"strict": (), "echo": ("echo",), "all": ("echo", "suffix", "ngram")}


def keeps_index(mode: str) -> bool:
    """Whether sessions in ``mode`` build the model-free sources, whose conversation index a
    server keeps between requests (:class:`~mlx_fill.core.index.IndexStore`)."""
    return bool(_MODE_SOURCES.get(mode))


MAX_SPAN_CEILING = 4096  # ids one proposal may hold (MLX_FILL_MAX_SPAN)


class BadEnvironment(UserError, ValueError):
    """An ``MLX_FILL_*`` variable holds a value the product cannot use; the message names it."""


def _env_count(name: str, default: int, ceiling: int) -> int:
    """The whole number in environment variable ``name`` (``default`` when unset or empty),
    1..``ceiling``; :class:`BadEnvironment` otherwise."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadEnvironment(f"{name}={raw!r} is not a whole number; set it to 1..{ceiling} "
                             f"or unset it") from None
    if not 1 <= value <= ceiling:
        raise BadEnvironment(f"{name}={raw} is outside 1..{ceiling}; set it in that range or unset it")
    return value


def env_max_span() -> int:
    """``MLX_FILL_MAX_SPAN``: ids per proposal (default :data:`DEFAULT_MAX_SPAN`)."""
    return _env_count("MLX_FILL_MAX_SPAN", DEFAULT_MAX_SPAN, MAX_SPAN_CEILING)


def env_store_tokens() -> int:
    """``MLX_FILL_STORE_TOKENS``: the in-server hook's cross-request store bound in ids, for
    mode ``all`` (default :data:`~mlx_fill.spec.suffix.STORE_TOKENS`)."""
    return _env_count("MLX_FILL_STORE_TOKENS", STORE_TOKENS, STORE_TOKENS_CEILING)


def source_names(names: str | Sequence[str] | None) -> list[str]:
    """Extra source names from ``names`` (a list or comma-separated string), else
    ``MLX_FILL_SOURCES``; TypeError for anything else, or a list holding a non-string."""
    if names is None:
        names = os.environ.get("MLX_FILL_SOURCES", "")
    if isinstance(names, str):
        names = names.split(",")
    if not isinstance(names, (list, tuple)) or not all(isinstance(s, str) for s in names):
        raise TypeError(f"extra_sources: expected source names (a comma-separated string or a "
                        f"list of strings), got {names!r:.60}")
    return [s.strip() for s in names if s and s.strip()]


# The ledger rows that can ever be asserted: the ``determined`` strict kinds and corroborated echo
# spans. An MLX_FILL_PROMOTE entry names one of them (``strict:name:TOOL``), a row under one, or
# a prefix ending in ``:`` above them (``strict:``).
PROMOTABLE = ("strict:scaffold", "strict:name", ECHO_ORIGIN)


def _promotable(entry: str) -> bool:
    return any(entry == row or entry.startswith(row + ":")
               or entry.endswith(":") and row.startswith(entry) for row in PROMOTABLE)


def env_promote() -> tuple[frozenset[str], int]:
    """(rows the ledger may promote, agreements needed) from ``MLX_FILL_PROMOTE`` /
    ``MLX_FILL_PROMOTE_AFTER``; :class:`BadEnvironment` for an entry that names no row that
    can be asserted (a typo, or a ``likely`` kind such as ``strict:key``)."""
    from mlx_fill.sources.ledger import DEFAULT_PROMOTE_AFTER
    raw = os.environ.get("MLX_FILL_PROMOTE", "")
    rows = frozenset(r.strip() for r in raw.split(",") if r.strip())
    bad = sorted(r for r in rows if not _promotable(r))
    if bad:
        raise BadEnvironment(
            f"MLX_FILL_PROMOTE={raw!r}: {', '.join(bad)} can never be asserted; list rows of "
            f"{', '.join(PROMOTABLE)} (e.g. strict:name:TOOL) or a prefix ending in ':' "
            f"such as strict:, or unset it")
    return rows, _env_count("MLX_FILL_PROMOTE_AFTER", DEFAULT_PROMOTE_AFTER, 1_000_000)


def server_ledger(model_key: str, tokenizer: Any):
    """The persisted evidence ledger a server keeps for its model and chat template: every
    verified strict row and corroborated echo span is recorded, and only the rows named by
    ``MLX_FILL_PROMOTE`` can ever be promoted. Raises ValueError for a corrupt ledger file or
    a ledger folder that cannot be written (a file in its place), before any request."""
    from mlx_fill.sources.ledger import ledger_path, load_ledger
    eligible, after = env_promote()
    template = getattr(tokenizer, "chat_template", None) or ""
    folder = ledger_path(model_key, template).parent
    problem = unwritable(folder)
    if problem:
        raise ValueError(f"the evidence ledger cannot be kept in {folder}: {problem}")
    return load_ledger(model_key, template, promote_after=after, eligible=eligible)


def check_env() -> None:
    """Validate the environment knobs once (at patch / server start): :class:`BadEnvironment`
    (or the cache folder's :class:`UserError`) naming the variable, instead of every request
    failing later."""
    env_max_span()
    env_store_tokens()
    env_promote()
    unknown = [n for n in source_names(None) if n not in NAMES]
    if unknown:
        raise BadEnvironment(f"MLX_FILL_SOURCES: unknown sources {unknown}; known: {list(NAMES)}")
    trace = os.environ.get("MLX_FILL_TRACE")
    if trace:
        if os.path.isdir(trace) or not os.path.isdir(os.path.dirname(os.path.abspath(trace))):
            raise BadEnvironment(f"MLX_FILL_TRACE={trace} is not a file path in an existing "
                                 f"folder; name a file to append the trace to")
        problem = (unwritable(Path(trace).parent) if not os.path.exists(trace)
                   else None if os.access(trace, os.W_OK) else "the file is read-only")
        if problem:
            raise BadEnvironment(f"MLX_FILL_TRACE={trace} cannot be appended to: {problem}; "
                                 f"name a file to append the trace to")
    if budget := budget_problem():
        raise BadEnvironment(budget)
    if plan_problem := env_plan_problem():
        raise BadEnvironment(plan_problem)
    user_cache_dir()  # MLX_FILL_CACHE / XDG_CACHE_HOME: a folder that can hold files


def _check_messages(messages: Any) -> None:
    """ValueError naming where, unless ``messages`` is None or a list of message objects."""
    if messages is None:
        return
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages: must be a list of message objects, got "
                         f"{type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: must be an object, got {type(message).__name__}")


def _check_prompt_ids(prompt_ids: Any) -> None:
    """TypeError unless ``prompt_ids`` is the prompt's token ids: a list, tuple or 1-D
    ``mx.array`` of whole numbers."""
    ids = prompt_ids.tolist() if isinstance(prompt_ids, mx.array) else prompt_ids
    if not isinstance(ids, (list, tuple)) or not all(
            type(t) is int or isinstance(t, numbers.Integral) and not isinstance(t, bool)
            for t in ids):
        raise TypeError(f"prompt_ids: expected the prompt's token ids (a list of ints), got "
                        f"{type(prompt_ids).__name__} {prompt_ids!r:.40}")


def _wrapped(tokenizer: Any) -> Any:
    """``tokenizer``, a Hugging Face tokenizer wrapped in mlx-lm's ``TokenizerWrapper`` as
    mlx-lm's ``stream_generate`` wraps it (its eos ids a set, its streaming detokenizer)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerBase
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return TokenizerWrapper(tokenizer)
    return tokenizer


def _strict_source(tokenizer: Any, messages: Any, tools: Any, template_kwargs: Any, ledger: Any,
                   gate: CostGate | None = None):
    """The strict source, or None when the request has nothing strict can determine. Raises
    ValueError (naming the offending path) for malformed tools or schemas."""
    if messages is None:
        return None
    return lazy_strict_source(tokenizer, messages, tools, template_kwargs or {}, ledger, gate)


def _refusal(*, logprobs: bool, seed: int | None, response_format: Any, media: bool) -> str | None:
    if logprobs:
        return "logprobs"
    if seed is not None:
        return "seed"
    if response_format not in (None, {"type": "text"}):
        return "response_format"
    if media:
        return MEDIA_REFUSAL
    return None


def build_session(
    mode: str,
    *,
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    messages: list | None = None,
    tools: list | None = None,
    template_kwargs: dict | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    logprobs: bool = False,
    response_format: Any = None,
    media: bool = False,
    prediction: Any = None,
    max_span: int | None = None,
    trace_path: str | os.PathLike | None = None,
    extra_sources: str | Sequence[str] | None = None,
    global_tree: Any = None,
    ledger: Any = None,
    draft_model: Any = None,
    refuse: str | None = None,
    acceptance: dict | None = None,
    group: Any = None,
    indexes: IndexStore | None = None,
) -> FillSession | None:
    """The fill session for one request; None when ``mode`` is ``off``.

    ``prompt_ids``: the full rendered prompt (cached prefix included). ``logprobs`` is true when
    the client asked for logprobs or top_logprobs. ``prediction``: an OpenAI Predicted Outputs
    object, or the ids it encodes to where the caller has them (:func:`prediction_ids`; a list
    or tuple, each a token id of the model's vocabulary).
    ``refuse``: a reason the caller already has to serve without fill (e.g.
    ``compile_budget``); no source is built then. ``max_span`` / ``trace_path`` default to
    ``MLX_FILL_MAX_SPAN`` / ``MLX_FILL_TRACE``. ``draft_model``: a loaded draft model (same
    tokenizer) proposing :data:`DRAFT_TOKENS` ids per round after every other source.
    ``acceptance``: a dict the caller keeps for a server's lifetime (one per model), holding
    every cost-gated source's per-draft acceptance estimates across requests (None: each
    request starts from the prior). ``indexes``: the server's
    :class:`~mlx_fill.core.index.IndexStore` (one per model): the model-free sources' index is
    taken from it (the one whose served prompt this prompt extends, synced to it) and given
    back by :func:`end_session` (None: indexed anew). The session carries the dispatch plan
    (:func:`~mlx_fill.core.resolve.plan_for`: looked up once per configuration and process,
    quick-qualified on the loaded model the first time no plan applies). Raises ValueError for
    a bad mode or ``max_span``, an ``MLX_FILL_MAX_SPAN`` or ``MLX_FILL_PLAN`` that
    :func:`check_env` refuses (:class:`BadEnvironment`), malformed messages, tools/schemas,
    ``template_kwargs`` that are no object or a malformed prediction; TypeError for
    ``prompt_ids`` that are no token ids, an ``acceptance`` that is no dict, a ``trace_path``
    that is no path, ``extra_sources`` that are no names, ``indexes``, ``global_tree``,
    ``ledger``, ``group`` or ``draft_model`` of another kind, or no ``tokenizer`` (a Hugging Face tokenizer is wrapped as mlx-lm's
    ``stream_generate`` wraps it).
    The caller ends it with :func:`end_session` when generation ends.

    ``group``: the ``mx.distributed`` group a sharded ``model`` spans (``sharded_load`` under
    ``mlx.launch``). Every rank calls this for the same request; rank 0 builds the sources
    (and alone reads ``ledger``, ``global_tree`` and ``trace_path``), the other ranks get a
    session without sources that follows rank 0's proposals (:mod:`mlx_fill.core.shared`). A
    rank whose build raises must still decode with a session: use :func:`follower_session`.
    """
    mode = check_mode(mode)
    if max_span is not None and (isinstance(max_span, bool) or not isinstance(max_span, int)
                                 or not 1 <= max_span <= MAX_SPAN_CEILING):
        raise ValueError(f"max_span: expected a whole number from 1 to {MAX_SPAN_CEILING}, "
                         f"got {max_span!r}")
    if acceptance is not None and not isinstance(acceptance, dict):
        raise TypeError(f"acceptance: expected a dict kept across requests (or None), got "
                        f"{type(acceptance).__name__}")
    if trace_path is not None and not isinstance(trace_path, (str, bytes, os.PathLike)):
        # an int would be opened as that file descriptor, and closed by end_session
        raise TypeError(f"trace_path: expected a file path (a str or os.PathLike, or None), got "
                        f"{type(trace_path).__name__}")
    _check_kept_objects(indexes=indexes, global_tree=global_tree, ledger=ledger, group=group,
                        draft_model=draft_model)
    if mode == "off":
        return None
    from mlx_fill.core.shared import ranks_of
    ranks = ranks_of(group)
    if ranks is not None and not ranks.root:
        return follower_session(model, prompt_ids, group, max_span=max_span)
    _check_prompt_ids(prompt_ids)
    tokenizer = _wrapped(tokenizer)
    max_span = max_span if max_span is not None else env_max_span()
    if plan_problem := env_plan_problem():  # as check_env says it; the plan lookup would skip it
        raise BadEnvironment(plan_problem)
    refusal = refuse or _refusal(logprobs=logprobs, seed=seed, response_format=response_format,
                                 media=media)
    eos_ids = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    sources: list[ProposalSource] = []
    names: list[str] = []  # the model-free roster's sources, which compete for each view
    index: EchoIndex | None = None  # their shared index, where taken from ``indexes``
    pace = Pace()  # the session's and its gates' bar (the batched lane raises it per step)
    plan = unqualified()
    if refusal is None:
        if tokenizer is None:
            raise TypeError("tokenizer: expected the model's tokenizer (as mlx_lm.load returns "
                            "it), got None")
        tool_schemas(tools)  # ValueError naming the path of a malformed tool
        _check_messages(messages)
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ValueError(f"template_kwargs: must be an object of chat template variables, "
                             f"got {type(template_kwargs).__name__}")
        if isinstance(prediction, (list, tuple)):  # the ids, from a caller that encoded them
            predicted = token_ids(prediction, vocab_size(model) or _tokenizer_size(tokenizer),
                                  "prediction")
        elif prediction is not None and not isinstance(prediction, dict):
            raise ValueError(f"prediction: expected OpenAI's {{'type': 'content', 'content': ...}}"
                             f" or a list of token ids, got {type(prediction).__name__}")
        else:
            predicted = prediction_ids(tokenizer, prediction) or []
        # after the request's own validation: a bad request measures nothing
        plan = plan_for(model, group)
        pace.round_overhead = plan.round_overhead  # the serial loop's plain steps are pipelined
        strict = _strict_source(tokenizer, messages, tools, template_kwargs, ledger,
                                source_gate(plan, max_span, "strict", acceptance=acceptance,
                                            pace=pace))
        if strict is not None:
            sources.append(strict)
        if predicted:
            # one draft, the client's own statement of the output: no choice among keys to
            # guard against, so priced on the estimate itself
            gate = source_gate(plan, max_span, PREDICTION, acceptance=acceptance, pace=pace, z=0.0)
            sources.append(PredictionSource(predicted, max_span=max_span, gate=gate))
        names = list(_MODE_SOURCES[mode])
        if mode == "all":
            names += [n for n in source_names(extra_sources) if n not in names]
        if names:
            index = indexes.take(prompt_ids) if indexes is not None else None
            sources += make_sources(names, plan=plan, tokenizer=tokenizer,
                                    prompt_ids=prompt_ids, global_tree=global_tree,
                                    ledger=ledger, max_span=max_span, acceptance=acceptance,
                                    pace=pace, index=index)
        if draft_model is not None:
            from mlx_fill.spec.base import DraftProposalSource
            from mlx_fill.spec.draft import DraftModelSource
            sources.append(DraftProposalSource(DraftModelSource(draft_model),
                                               length=lambda: DRAFT_TOKENS))
    from_env = trace_path is None
    trace_path = trace_path if trace_path is not None else os.environ.get("MLX_FILL_TRACE") or None
    try:
        trace = (open(trace_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 -- closed by finish_session
                 if trace_path else None)
    except OSError as e:
        if index is not None:  # synced to this prompt by make_sources; its conversation keeps it
            indexes.give(index, len(prompt_ids))
        if not from_env:
            raise
        raise BadEnvironment(f"MLX_FILL_TRACE={trace_path} cannot be appended to ({e.strerror}); "
                             f"name a file in an existing folder") from None
    session = FillSession(sources, prompt_ids=prompt_ids, eos_ids=eos_ids, plan=plan,
                          max_span=max_span, allow_assert=temperature == 0, trace=trace,
                          pace=pace, compete=names, cap_in_deficit=True)
    if refusal is not None:
        session.refuse(refusal)
    if index is not None:  # taken from ``indexes``
        session.release = functools.partial(indexes.give, index, len(prompt_ids))
    return attach_shared(session, group)


def _check_kept_objects(**given: Any) -> None:
    """TypeError naming the first of the objects a caller keeps for :func:`build_session`
    (``indexes``, ``global_tree``, ``ledger``, ``group``, ``draft_model``) that is not what
    it must be (each may be None)."""
    from mlx_fill.sources.ledger import Ledger
    from mlx_fill.spec.suffix import GlobalSuffixTree
    expected = {"indexes": (IndexStore, "the server's IndexStore, one per model"),
                "global_tree": (GlobalSuffixTree, "a GlobalSuffixTree kept across requests"),
                "ledger": (Ledger, "an evidence Ledger (server_ledger returns one)"),
                "group": (mx.distributed.Group, "an mx.distributed group"),
                "draft_model": (None, "a loaded mlx-lm model (an mlx.nn.Module)")}
    for name, value in given.items():
        kind, what = expected[name]
        if value is None or (isinstance(value, kind) if kind is not None
                             else callable(getattr(value, "parameters", None))):
            continue
        raise TypeError(f"{name}: expected {what}, or None; got {type(value).__name__}")


def attach_shared(session: FillSession, group: Any) -> FillSession:
    """Give ``session`` the agreement of a sharded model's ``group`` (nothing for None or one
    rank), unless it has one; returns it."""
    from mlx_fill.core.shared import SharedRounds, ranks_of
    ranks = ranks_of(group)
    if ranks is not None and session.shared is None:
        session.shared = SharedRounds(ranks)
    return session


def follower_session(model: Any, prompt_ids: Sequence[int], group: Any, *,
                     max_span: int | None = None, refuse: str | None = None) -> FillSession:
    """The session of a rank that follows rank 0 (no sources; decides nothing), or of any rank
    whose own build failed (``refuse``: then rank 0 serves the request without fill when it is
    the one that failed, and a follower's refusal refuses it on every rank)."""
    session = FillSession([], prompt_ids=prompt_ids,
                          plan=plan_for(model, group) if refuse is None else None,
                          max_span=max_span if max_span is not None else env_max_span())
    if refuse is not None:
        session.refuse(refuse)
    return attach_shared(session, group)


def end_session(session: FillSession | None, ledger: Any = None) -> None:
    """The teardown every adapter runs when generation ends, also when it is cut short: close
    the session's trace file (if any), give back what it borrowed from its server
    (``FillSession.release``) and, when the request had a session, save the evidence ledger (an
    OSError is logged, never raised: the response is already made). Idempotent."""
    if session is None:
        return
    if session.release is not None:
        release, session.release = session.release, None
        release()
    if session.trace is not None and not session.trace.closed:
        try:
            session.trace.close()
        except OSError as e:
            print(f"mlx-fill: trace not written ({e.strerror or e})", file=sys.stderr, flush=True)
    if ledger is not None:
        try:
            ledger.save()
        except (OSError, ValueError) as e:  # unwritable, or made corrupt by another process
            log.warning("mlx-fill: evidence ledger not saved (%s)", e)


def usage_extra(session: FillSession | None, *, prediction: Sequence[int] | None = None,
                completion: Sequence[int] | None = None, error: str | None = None) -> dict[str, Any]:
    """The ``usage`` additions every adapter reports: ``fill`` (the session's stats, with
    ``error`` beside them when given: what the request got wrong that its session refused as
    ``invalid_request``; without a session, the ``error`` alone) and, for a request with a
    prediction (its ids,
    :func:`prediction_ids`; None: no prediction),
    ``completion_tokens_details.{accepted,rejected}_prediction_tokens`` against the
    ``completion``'s ids (default: the ids the session's decode emitted; without either, the
    details are left out: there is nothing to count them on)."""
    extra: dict[str, Any] = {}
    if session is not None:
        extra["fill"] = session.stats.as_dict()
        if error is not None:
            extra["fill"]["error"] = error
    elif error is not None:
        extra["fill"] = {"error": error}
    if completion is None and session is not None:
        completion = session.emitted_ids
    if prediction is not None and completion is not None:
        extra["completion_tokens_details"] = prediction_usage(prediction, completion)
    return extra


def _tokenizer_size(tokenizer: Any) -> int | None:
    """How many ids the tokenizer knows, added tokens included (None: it does not say)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return len(inner)
    except TypeError:
        return None


def prediction_ids(tokenizer: Any, prediction: Any) -> list[int] | None:
    """The ids the prediction's text encodes to (None without a prediction). Raises ValueError
    for a prediction that is not OpenAI's shape (:func:`prediction_text`)."""
    if prediction is None:
        return None
    return list(tokenizer.encode(prediction_text(prediction), add_special_tokens=False))
