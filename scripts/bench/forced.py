"""Forced replay: every arm decodes what real agents wrote, on a real model, timed side by side.

For every selected assistant turn of recorded sessions (``--transcripts``, any file in the
repository's transcript format; default: the sessions no fixture trained on, the held-back split
of ``scripts.bench.heldout_sessions`` plus every session of a source training never used) the
conversation is rendered through the model's own chat template with the session's tools
(:func:`mlx_fill.evidence.transcripts.render_recording`), the turn's prompt is prefilled once
(untimed, shared by every arm: each arm decodes from that cache, trimmed back after it), and the
RECORDED reply's ids are decoded under a forcing logits processor: the target's forward runs for
every row as in a real decode (the forced logits are ``0 * logits`` plus the forcing mask, so
MLX evaluates the forward), the sampler's argmax is the recorded id, and the fill loop's verify
accepts exactly the recorded ids (its rows are processed through the same processor, with the
history grown row by row: :mod:`mlx_fill.core.acceptance`).

Arms, interleaved per turn (the order rotated by one every turn and every repeat, after one
untimed decode of the first): ``plain`` (mlx-lm ``generate_step``), ``off`` (the fill loop with no
source), ``strict``, ``echo``, ``suffix``, ``ngram``, ``all`` (the product's modes and roster
members, cost-gated on the plan), and the peers as they ship, ungated: ``peer-lookup`` (prompt
lookup with a fixed draft of 10, transformers' ``prompt_lookup_num_tokens=10``: the earliest
occurrence of the longest trailing 2- or 1-gram) and ``peer-suffix`` (SuffixDecoding's span rule
as Arctic Inference ships it: ``max_spec_factor = 1`` times the match length, ``min_token_prob =
0.1``, depth 64, every non-empty draft proposed; the request's own tree and the cross-request
store of earlier responses). As a server serving the turns in this order, ``suffix``, ``all``
and ``peer-suffix`` keep a store of the earlier turns' replies (each repeat of a turn starts from
the store as the turn found it, so no repeat reads its own reply; ``--no-cross-request``: every
turn as a freshly started server's first; ``--store-seed FILE``: the store starts with FILE's
replies, as a server that served those sessions). On request (``--arms``),
``prediction``: ``all`` with OpenAI's ``prediction`` set to the file the reply rewrites as a read
tool last returned it (:func:`rewritten_file`; ``--rewrites`` replays only such turns; elsewhere
it is ``all``). ``oracle`` is the bound
(:mod:`scripts.bench.oracle`): per turn, the best span any source offered at every position,
priced by the plan's c(M) and round overhead (the store's drafts included); where ``all`` ran,
also restricted to its accepted spans and to its round positions (:func:`own_spans`).

Reported per transcript source, overall and per tool (the first call's name; ``(prose)`` for a
structured turn without calls, ``(inline)`` for harnesses whose calls are text): decode wall time
x plain (sum of plain's per-turn medians over the arm's), target forwards per token, the same
decode priced by the plan's curve (``priced``), accepted ids per round, rejected rows per token
and the bookkeeping share of a plain step. ``--curve`` prices the same rounds through another
c(M) curve (M = 2, 3, ...), reported as "projected". With ``--decide-on-curve`` (and
``--surrogate``) the sessions' plan itself takes that curve and round overhead (this machine's
``max_chunk`` kept), so the gates choose their spans as they would on hardware that qualified
such a plan, and the priced columns are on the curve.

    python -m scripts.bench.forced [--transcripts PATH] [--model DIR] [--per-source N]
        [--max-tokens N] [--max-context N] [--repeats N] [--curve 1.1,1.4,...] [--json PATH]
        [--arms plain,...] [--rewrites] [--surrogate [--decide-on-curve]] [--no-cross-request]
"""

from __future__ import annotations

import argparse
import copy
import functools
import gzip
import json
import pickle
import platform
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import jinja2
import mlx.core as mx

from mlx_fill.cli import _Parser
from mlx_fill.core.errors import UserError, float_in, int_up_to, output_file, positive_int
from mlx_fill.core.errors import model_dir as model_folder
from mlx_fill.core.index import EchoIndex
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.primitive import checkpoint, restore
from mlx_fill.core.proposal import FillSession, Pace
from mlx_fill.core.resolve import plan_for
from mlx_fill.evidence.log_formats import arguments_object
from mlx_fill.evidence.replay import has_reply, read_sessions, skipped_lines
from mlx_fill.evidence.transcripts import TemplateMarkers, markers, render_recording, seed_store
from mlx_fill.session import check_env
from mlx_fill.spec.base import DraftProposalSource
from mlx_fill.spec.ngram import NgramDraft
from mlx_fill.spec.suffix import STORE_TOKENS, GlobalSuffixTree, SuffixDraft, SuffixParams
from mlx_fill.strict.schema import tool_schemas
from mlx_fill.sources.echo import EchoDraft

from .__main__ import forcing_processor, timed_decode
from .oracle import RoundRecord, accepted_prefix, curve_plan, oracle_cost, priced_cost

MAX_REPEATS = 1000  # timed decodes per arm and turn
ARMS = ("plain", "off", "strict", "echo", "suffix", "ngram", "all", "peer-lookup", "peer-suffix")
PREDICTION = "prediction"  # not a default arm: `all` with the file as last read (--rewrites)
READ_TOOLS = frozenset({"read", "read_file", "open", "view"})  # names compared lowercased
# an editor tool's ``command`` that reads (OpenHands' ``str_replace_editor``, Anthropic's text
# editor tool: ``view`` returns the file as ``cat -n`` writes it)
READ_COMMANDS = frozenset({"view"})
NUMBERED_LINE = re.compile(r" *(\d+)[\t\u2192]")  # `cat -n`'s tab, or Claude Code's Read: an arrow
REMINDER = ("<system-reminder>", "</system-reminder>")  # a note Claude Code appends to a read
PATH_KEYS = ("path", "file_path", "filename")
OVERALL = "overall"
ORACLE = "oracle"
# the oracle again with its spans cut to at most this many ids: how much of the bound is knowing
# where a short draft is accepted, how much is knowing how far a long one runs
ORACLE_CAPS = (1, 2, 4, 8)
PEER_LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens=10
PEER_SUFFIX = SuffixParams(max_spec=64, alpha=1.0, offset=0.0, min_prob=0.1, max_depth=64)
ORACLE_SPAN = 64  # the longest span the oracle's model-free drafts offer (the session's max_span)
STORE_ARMS = frozenset({"suffix", "all", PREDICTION, "peer-suffix"})  # arms with a cross-request store


@dataclass
class ForcedTurn:
    """One recorded assistant turn: ``prompt`` (rendered, clipped to the context budget),
    ``output`` (the recorded reply's ids, end-of-turn included, capped), the request's
    ``messages``/``tools`` (for strict), its ``transcript_source`` and ``tool`` label;
    ``prediction``: the text of the file the reply rewrites as last read (:func:`rewritten_file`)."""

    transcript_source: str
    session_id: str
    tool: str
    prompt: list[int]
    output: list[int]
    messages: list[dict]
    tools: list[dict] | None
    prediction: str | None = None


# ----------------------------------------------------------------------------- turns

LONG_PROMPT = 8192  # prompt ids past which the prefill's time is worth a warning


def default_sessions() -> list[dict]:
    """Sessions no fixture trained on: the held-back split of the training sources plus every
    session of a source that training never read."""
    from scripts.training import fixture_data

    from .heldout_sessions import heldout_rows
    rows = heldout_rows(0)
    path = fixture_data.transcripts_path() / "dev.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        others = [json.loads(line) for line in fh]
    return rows + [r for r in others if r.get("source") not in fixture_data.SOURCES]


def _calls(message: dict) -> list[tuple[str, dict, Any]]:
    """``(name, arguments, id)`` of a message's tool calls (arguments decoded; {} if not an object)."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        out.append((str(fn.get("name")), arguments_object(fn.get("arguments")), call.get("id")))
    return out


def _path(args: dict) -> str | None:
    return next((args[k] for k in PATH_KEYS if isinstance(args.get(k), str)), None)


def is_read(name: str, args: dict) -> bool:
    """Whether a call reads a file: a read tool (:data:`READ_TOOLS`, any case) or an editor
    tool's read command (:data:`READ_COMMANDS`)."""
    command = args.get("command")  # a shell tool's may be a list (Codex's ``shell``)
    return name.lower() in READ_TOOLS or (isinstance(command, str) and command in READ_COMMANDS)


def file_text(result: str) -> str:
    """A read's result as the file's text: a ``cat -n`` listing (every line numbered, the
    numbers consecutive, after at most one header line ending in ``:`` and before at most one
    :data:`REMINDER` block) without its numbers; any other result as it is."""
    lines = _without_reminder(result.split("\n"))
    if lines and lines[0].endswith(":") and not NUMBERED_LINE.match(lines[0]):
        lines = lines[1:]
    body = lines[:-1] if lines and lines[-1] == "" else lines
    numbers = [NUMBERED_LINE.match(line) for line in body]
    if not numbers or not all(numbers):
        return result
    first = int(numbers[0].group(1))
    if [int(n.group(1)) for n in numbers] != list(range(first, first + len(body))):
        return result
    return "\n".join(NUMBERED_LINE.sub("", line, count=1) for line in lines)


def _without_reminder(lines: list[str]) -> list[str]:
    """``lines`` without a :data:`REMINDER` block that ends them (and the empty lines before it)."""
    body = lines[:-1] if lines and lines[-1] == "" else lines
    if not body or body[-1] != REMINDER[1] or REMINDER[0] not in body:
        return lines
    start = len(body) - 1 - body[::-1].index(REMINDER[0])
    while start > 0 and body[start - 1] == "":
        start -= 1
    return body[:start]


def rewritten_file(messages: Sequence[dict], index: int) -> str | None:
    """The prediction for reply ``messages[index]``: when one of its calls names a path (and is
    not a read, :func:`is_read`) whose text a read returned earlier in the session, that text
    as last read (:func:`file_text`), JSON-escaped as the call's arguments carry it; else None.
    A result answers the first unanswered call of the latest reply with calls that has its
    id, so an id that a harness reuses (in one reply or in every reply) binds as it was meant."""
    targets = {_path(a) for name, a, _ in _calls(messages[index]) if not is_read(name, a)}
    targets.discard(None)
    if not targets:
        return None
    pending: list[tuple[Any, str | None]] = []  # (id, path it reads or None) of unanswered calls
    last: dict[str, str] = {}
    for m in messages[:index]:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            pending = [(call_id, _path(args) if is_read(name, args) else None)
                       for name, args, call_id in _calls(m)]
        elif m.get("role") == "tool":
            k = next((k for k, (call_id, _) in enumerate(pending)
                      if call_id == m.get("tool_call_id")), None)
            path = None if k is None else pending.pop(k)[1]
            if path is not None and isinstance(m.get("content"), str):
                last[path] = file_text(m["content"])
    found = [last[p] for p in sorted(targets) if p in last]
    return json.dumps(found[0], ensure_ascii=False)[1:-1] if found else None


def turn_tool(labels: Sequence[str], structured: bool) -> str:
    """The tool a turn is reported under: its first call's name, ``(prose)`` for a structured
    turn without one, ``(inline)`` for a harness whose calls are plain text."""
    if not structured:
        return "(inline)"
    return next((t for t in labels if t != "(text)"), "(prose)")


def clip_context(prompt: Sequence[int], head: int, max_context: int | None,
                 boundary: int | None) -> list[int]:
    """``prompt`` within ``max_context`` ids: its first ``head`` ids (the system prompt and
    the tools; at most half the budget) and the latest ids, cut forward to the next
    ``boundary`` id (a message start) when the tail holds one."""
    if max_context is None or len(prompt) <= max_context:
        return list(prompt)
    head = min(head, max_context // 2)
    tail = list(prompt[len(prompt) - (max_context - head):])
    if boundary is not None and boundary in tail:
        tail = tail[tail.index(boundary):]
    return list(prompt[:head]) + tail


def _head_length(tok, history: list[dict], tools, tokens: Sequence[int],
                 boundary: int | None) -> int:
    """How many leading ids of the rendering are the system message and the tools block. A
    template that renders no system message alone (one that requires a user message) renders
    it before the first user message; the head then ends at the last message ``boundary``
    (the generation prompt's first id) the two renderings share."""
    if not history or history[0].get("role") != "system":
        return 0
    render = functools.partial(tok.apply_chat_template, tools=tools, tokenize=False,
                               add_generation_prompt=False, enable_thinking=False)
    try:
        return accepted_prefix(tok.encode(render(history[:1]), add_special_tokens=False), tokens, 0)
    except jinja2.TemplateError:
        user = next((m for m in history if m.get("role") == "user"), None)
        if user is None or boundary is None:
            return 0
        shared = tokens[:accepted_prefix(
            tok.encode(render([history[0], user]), add_special_tokens=False), tokens, 0)]
        return max((i for i, t in enumerate(shared) if t == boundary), default=0)


def forced_turns(tok, sessions: list[dict], *, per_source: int | None, max_tokens: int | None,
                 max_context: int | None, rewrites: bool = False,
                 mk: TemplateMarkers | None = None) -> tuple[list[ForcedTurn], Counter]:
    """The turns to replay: per source, ``per_source`` turns evenly spaced over all of its
    sessions' turns (the middles of ``per_source`` equal stretches; every turn when None), in
    session order; ``rewrites``: only turns that rewrite a file read earlier in the session
    (:func:`rewritten_file`); ``mk``: ``tok``'s template markers (probed when None). Returns
    the turns and the count of sessions that could not be rendered, per reason."""
    mk = mk or markers(tok)
    opener = tok.encode(mk.opener, add_special_tokens=False)
    boundary = opener[0] if opener else None
    skipped: Counter = Counter()
    by_source: dict[str, list[tuple[Any, Any, str | None]]] = defaultdict(list)
    for session in sessions:
        try:
            rendered = render_recording(session, tok, mk)
            tool_schemas(rendered.tools)  # what a server checks before it decodes
        except (ValueError, KeyError, TypeError) as e:
            skipped[f"{session.get('source')}: {type(e).__name__}: {e}"] += 1
            continue
        for turn in rendered.turns:
            predicted = rewritten_file(rendered.messages, turn.message_index)
            if turn.end - turn.start >= 2 and (predicted or not rewrites):
                by_source[rendered.transcript_source].append((rendered, turn, predicted))
    out: list[ForcedTurn] = []
    for source, cands in by_source.items():
        if per_source is not None and len(cands) > per_source:
            cands = [cands[(2 * i + 1) * len(cands) // (2 * per_source)] for i in range(per_source)]
        heads: dict[int, int] = {}
        for rendered, turn, predicted in cands:
            key = id(rendered)
            if key not in heads:
                heads[key] = _head_length(tok, rendered.messages, rendered.tools, rendered.tokens,
                                          boundary)
            prompt = rendered.tokens[:turn.start] + rendered.think_ids
            output = rendered.tokens[turn.start:turn.end][:max_tokens]
            out.append(ForcedTurn(
                source, rendered.session_id,
                turn_tool(turn.labels[:len(output)], rendered.tools is not None),
                clip_context(prompt, heads[key], max_context, boundary), output,
                rendered.messages[:turn.message_index], rendered.tools, predicted))
    return out, skipped


# ----------------------------------------------------------------------------- arms

class RoundLog:
    """Records every round of a session (wraps its ``propose``/``feedback``): whether the
    proposal was asked for with the view's last token pending (a chained round), its policy,
    length, outcome and source."""

    def __init__(self, session: FillSession):
        self.rounds: list[RoundRecord] = []
        self.proposed: list[tuple[int, tuple[int, ...]]] = []  # (position, ids) of every round
        self._pending = False
        propose, feedback = session.propose, session.feedback

        def logged_propose(view):
            self._pending = view.pending
            return propose(view)

        def logged_feedback(proposal, accepted, position):
            self.rounds.append(RoundRecord(self._pending, proposal.policy, len(proposal.ids),
                                           accepted, session.pace.kv_length,
                                           proposal.origin.split(":")[0]))
            self.proposed.append((position, tuple(proposal.ids)))
            return feedback(proposal, accepted, position)

        session.propose = logged_propose
        session.feedback = logged_feedback


def peer_session(arm: str, turn: ForcedTurn, *, tok, plan: DispatchPlan,
                 store: GlobalSuffixTree | None = None) -> FillSession:
    """A peer as it ships: no cost gate, every non-empty draft proposed; ``peer-suffix`` also
    reads ``store``, the earlier responses (Arctic Inference's cross-request cache)."""
    if arm == "peer-lookup":
        src = NgramDraft(EchoIndex(), n_min=1, n_max=2, k=PEER_LOOKUP_TOKENS, occurrence="first")
        length = PEER_LOOKUP_TOKENS
    else:
        src = SuffixDraft(EchoIndex(), name="suffix", global_tree=store, params=PEER_SUFFIX)
        length = PEER_SUFFIX.max_spec
    return FillSession([DraftProposalSource(src, length=lambda: length)], prompt_ids=turn.prompt,
                       eos_ids=tok.eos_token_ids, plan=plan)


def arm_session(arm: str, turn: ForcedTurn, *, model, tok, plan: DispatchPlan,
                acceptance: dict, store: GlobalSuffixTree | None = None) -> FillSession | None:
    """The arm's session for one turn (None: plain mlx-lm). ``acceptance`` carries the arm's
    learned estimates across turns and ``store`` the earlier responses (the suffix source's
    cross-request tree), as a server keeps them."""
    from mlx_fill.session import build_session
    from mlx_fill.spec.roster import make_sources
    if arm == "plain":
        return None
    if arm == "off":
        return FillSession([], prompt_ids=turn.prompt, eos_ids=tok.eos_token_ids, plan=plan)
    if arm.startswith("peer-"):
        return peer_session(arm, turn, tok=tok, plan=plan, store=store)
    if arm in ("suffix", "ngram"):
        pace = Pace(round_overhead=plan.round_overhead)  # as build_session sets it
        sources = make_sources([arm], plan=plan, tokenizer=tok, prompt_ids=turn.prompt,
                               global_tree=store, acceptance=acceptance, pace=pace)
        return FillSession(sources, prompt_ids=turn.prompt, eos_ids=tok.eos_token_ids,
                           plan=plan, pace=pace, cap_in_deficit=True)
    prediction = None
    if arm == PREDICTION:
        arm = "all"
        if turn.prediction is not None:
            prediction = {"type": "content", "content": turn.prediction}
    return build_session(arm, model=model, tokenizer=tok, prompt_ids=turn.prompt,
                         messages=turn.messages, tools=turn.tools, acceptance=acceptance,
                         global_tree=store, prediction=prediction)


def offline_available(turn: ForcedTurn, proposals: Sequence[tuple[int, Sequence[int]]],
                      store: GlobalSuffixTree | None = None) -> list[int]:
    """``available[p]``: the longest accepted span any source offered for the slots after
    output slot ``p``: the model-free drafts (echo, prompt lookup, suffix, and suffix over
    ``store``, the earlier turns' replies; ungated, up to :data:`ORACLE_SPAN`) on the recorded
    prefix through ``p``, and every proposal an arm made (strict's included) at ``p + 1``.
    ``store`` is left as it was found."""
    out = turn.output
    n = len(out)
    index = EchoIndex()
    drafters = [EchoDraft(index, max_span=ORACLE_SPAN),
                NgramDraft(index, n_min=1, n_max=3, k=ORACLE_SPAN),
                NgramDraft(index, n_min=1, n_max=2, k=ORACLE_SPAN, occurrence="first"),
                SuffixDraft(index, params=SuffixParams(max_spec=ORACLE_SPAN))]
    if store is not None:
        mark = store.next_doc  # what this turn's drafts add is forgotten at the end
        drafters.append(SuffixDraft(index, global_tree=store, params=SuffixParams(max_spec=ORACLE_SPAN)))
    for d in drafters:
        d.prefill(turn.prompt)
    available = proposed_spans(out, proposals)
    for p in range(n - 1):
        for d in drafters:  # each keeps its own count of the shared index's fed ids
            ids = d.draft([out[p]], ORACLE_SPAN)
            available[p] = max(available[p], accepted_prefix(ids, out, p + 1))
    if store is not None:
        store.forget_since(mark)
    return available


def proposed_spans(output: Sequence[int], proposals: Sequence[tuple[int, Sequence[int]]]
                   ) -> list[int]:
    """``spans[p]``: the longest prefix of ``output`` after slot ``p`` that a proposal made at
    position ``p + 1`` (``proposals``: position and ids) had accepted; 0 where none was made."""
    spans = [0] * len(output)
    for position, ids in proposals:
        if 1 <= position < len(output):
            spans[position - 1] = max(spans[position - 1],
                                      accepted_prefix(ids, output, position))
    return spans


def own_spans(turn: ForcedTurn, proposals: Sequence[tuple[int, Sequence[int]]],
              available: Sequence[int]) -> tuple[list[int], list[int]]:
    """What an arm's rounds (``proposals``: position and ids) had, as two inputs of
    :func:`oracle_cost`, so that the oracle restricted to them bounds the arm: ``accepted[p]``,
    the span the arm's round at output slot ``p + 1`` had accepted (its choices of draft and
    position, without a rejected row or a wasted round), and ``positions[p]``, the longest span
    any source offered there (``available``), only where the arm ran a round."""
    n = len(turn.output)
    drafted = {position - 1 for position, _ in proposals if 1 <= position < n}
    positions = [available[p] if p in drafted else 0 for p in range(n)]
    return proposed_spans(turn.output, proposals), positions


# ----------------------------------------------------------------------------- run

@dataclass
class Tally:
    """One arm's totals over a group of turns."""

    seconds: float = 0.0  # sum of per-turn medians
    tokens: int = 0
    plain_cost: int = 0  # plain decoding's forwards (tokens + 1 per turn): the priced unit
    forwards: float = 0.0  # per decode (median-run's counts are equal across repeats)
    priced: float = 0.0
    projected: float = 0.0
    source_ms: float = 0.0
    rejected: int = 0
    accepted_hist: Counter = field(default_factory=Counter)
    # per proposing source: rounds, proposed and accepted ids, one-row forwards saved (priced)
    by_source: dict = field(default_factory=lambda: defaultdict(Counter))
    mismatched: int = 0
    capped: Counter = field(default_factory=Counter)  # the oracle's priced cost per span cap
    # the oracle restricted to what `all` had (see :func:`own_spans`): its accepted spans at its
    # round positions, and any source's longest span at those positions
    own_accepted: float = 0.0
    own_positions: float = 0.0


def run(turns: list[ForcedTurn], *, model, tok, plan: DispatchPlan, repeats: int,
        projection: DispatchPlan | None, arms: Sequence[str] = ARMS,
        cross_request: bool = True, store: GlobalSuffixTree | None = None,
        progress=None) -> dict:
    """Every arm on every turn; returns the tallies per group (source, ``overall``, and
    ``tool:<name>``) and whether every arm emitted exactly plain's ids. With ``cross_request``
    the arms in :data:`STORE_ARMS` keep a cross-request store of the earlier turns' replies, as
    a server serving the turns in this order does (each repeat of a turn starts from the store
    as the turn found it, so no repeat reads its own reply), and so does the oracle; each
    starts as a copy of ``store`` (a server's store before the first turn; None: empty)."""
    from .__main__ import prefilled

    groups: dict[str, dict[str, Tally]] = defaultdict(lambda: {a: Tally() for a in [*arms, ORACLE]})
    learned: dict[str, dict] = {a: {} for a in arms}
    def start_store() -> GlobalSuffixTree | None:
        if not cross_request:
            return None
        return pickle.loads(pickle.dumps(store)) if store is not None else GlobalSuffixTree()

    stores = {a: start_store() if a in STORE_ARMS else None for a in arms}
    history = start_store()  # the oracle's: the replies so far
    identical = True
    for t_index, turn in enumerate(turns):
        cache = prefilled(model, turn.prompt)
        prompt_state = checkpoint(model, cache, plan)  # every arm decodes from here
        force = [forcing_processor(1, turn.output)]
        n = len(turn.output)

        def run_arm(a: str, keep: bool
                    ) -> tuple[list[int], float, FillSession | None, RoundLog | None, dict]:
            """One decode of arm ``a`` from the state the turn found (its estimates copied, its
            store marked); ``keep``: the store keeps this decode's reply, else it is forgotten."""
            state, arm_store = copy.deepcopy(learned[a]), stores[a]
            mark = arm_store.next_doc if arm_store is not None else 0
            s = arm_session(a, turn, model=model, tok=tok, plan=plan, acceptance=state, store=arm_store)
            log = RoundLog(s) if s is not None else None
            ids, dt = timed_decode(turn.prompt[-1:], model, s, max_tokens=n, eos=frozenset(),
                                   processors=force, cache=cache)
            restore(prompt_state)
            if arm_store is not None and not keep:
                arm_store.forget_since(mark)
            return ids, dt, s, log, state

        run_arm(arms[0], keep=False)  # the first decode after a prefill is slower
        times: dict[str, list[float]] = {a: [] for a in arms}
        last: dict[str, tuple] = {}
        for r in range(repeats):
            shift = (t_index + r) % len(arms)
            for a in [*arms[shift:], *arms[:shift]]:  # every repeat decides as the first did
                ids, dt, s, log, state = run_arm(a, keep=r == repeats - 1)
                times[a].append(dt)
                last[a] = (ids, s, log, state)
        proposals = []
        for a in arms:
            ids, s, log, learned[a] = last[a]
            if log is not None:
                proposals += log.proposed
        available = offline_available(turn, proposals, history)
        if history is not None:
            history.extend(history.open(turn.prompt), turn.output)
        at = len(turn.prompt)
        oracle_priced = oracle_cost(available, plan, at)
        oracle_capped = Counter({cap: oracle_cost([min(a, cap) for a in available], plan, at)
                                 for cap in ORACLE_CAPS})
        oracle_projected = (oracle_cost(available, projection, at) if projection is not None
                            else 0.0)
        own_accepted = own_positions = 0.0
        if "all" in last:
            accepted, positions = own_spans(turn, last["all"][2].proposed, available)
            own_accepted = oracle_cost(accepted, plan, at)
            own_positions = oracle_cost(positions, plan, at)
        for key in (OVERALL, turn.transcript_source, f"tool:{turn.tool}"):
            g = groups[key]
            for a in arms:
                ids, s, log, _ = last[a]
                tally = g[a]
                tally.seconds += statistics.median(times[a])
                tally.tokens += n
                tally.plain_cost += n + 1
                forwards = s.stats.forwards if s is not None else n + 1  # see oracle
                rounds = log.rounds if log is not None else []
                tally.forwards += forwards
                tally.priced += priced_cost(forwards, rounds, plan, plan)
                if projection is not None:
                    tally.projected += priced_cost(forwards, rounds, plan, projection)
                tally.source_ms += s.stats.source_ms if s is not None else 0.0
                tally.rejected += sum(r.proposed - r.accepted for r in rounds
                                      if r.policy == "verify" and r.rows)
                tally.accepted_hist.update(r.accepted for r in rounds if r.rows)
                for r in rounds:
                    tally.by_source[r.source].update({
                        "rounds": 1, "proposed": r.proposed, "accepted": r.accepted,
                        "saved": plan.round_saving(r)})
                same = ids == last["plain"][0] and ids == turn.output
                tally.mismatched += not same
                identical &= same
            o = g[ORACLE]
            o.tokens += n
            o.plain_cost += n + 1
            o.priced += oracle_priced
            o.capped.update(oracle_capped)
            o.projected += oracle_projected
            o.own_accepted += own_accepted
            o.own_positions += own_positions
        if progress is not None:
            progress(t_index + 1, len(turns), turn,
                     {"identical": identical, "groups": dict(groups)})
    return {"identical": identical, "groups": dict(groups)}


def summarize(result: dict, projection: bool, wall: bool = True) -> dict:
    """The JSON report's ``rows`` (sources and ``overall``) and ``by_tool``: per arm, wall x
    plain, forwards per token, priced x plain (and projected), rejected rows per token,
    bookkeeping per token (ms, and as a share of a plain step), accepted ids per round. Without
    ``wall`` (a surrogate decode) ``x_plain`` is the priced ratio and the share is None (the
    surrogate's step is not the model's)."""
    rows: dict[str, dict] = {}
    by_tool: dict[str, dict] = {}
    for key, g in result["groups"].items():
        plain = g["plain"]
        step_ms = 1e3 * plain.seconds / max(plain.tokens, 1)
        table = {}
        for arm, t in g.items():
            tokens = max(t.tokens, 1)
            priced = round(t.plain_cost / max(t.priced, 1e-9), 3)
            if arm == ORACLE:
                entry = {"x_plain": priced, "fwd_per_tok": None, "priced_x_plain": priced,
                         "priced_x_plain_span_cap": {str(c): round(t.plain_cost / max(t.capped[c], 1e-9), 3)
                                                     for c in ORACLE_CAPS}}
                if "all" in g:
                    entry["priced_x_plain_own"] = {
                        "accepted": round(t.plain_cost / max(t.own_accepted, 1e-9), 3),
                        "positions": round(t.plain_cost / max(t.own_positions, 1e-9), 3)}
            else:
                entry = {"x_plain": round(plain.seconds / max(t.seconds, 1e-12), 3),
                         "fwd_per_tok": round(t.forwards / tokens, 3),
                         "priced_x_plain": priced,
                         "rejected_per_tok": round(t.rejected / tokens, 3),
                         "bookkeeping_ms_per_tok": round(t.source_ms / tokens, 4),
                         "bookkeeping_share": (round(t.source_ms / tokens / max(step_ms, 1e-9), 4)
                                               if wall else None),
                         "accepted_per_round": {str(k): v for k, v in sorted(t.accepted_hist.items())},
                         "by_source": {
                             src: {"rounds": c["rounds"], "proposed": c["proposed"],
                                   "accepted": c["accepted"],
                                   "saved_per_tok": round(c["saved"] / tokens, 4)}
                             for src, c in sorted(t.by_source.items())},
                         "mismatched_turns": t.mismatched}
            if not wall:
                entry["x_plain"] = priced
            if projection:
                entry["projected_x_plain"] = round(t.plain_cost / max(t.projected, 1e-9), 3)
            table[arm] = entry
        table["turns_tokens"] = plain.tokens
        (by_tool if key.startswith("tool:") else rows)[key.removeprefix("tool:")] = table
    return {"rows": rows, "by_tool": by_tool}


def print_tables(report: dict, arms: Sequence[str]) -> None:
    cols = [*arms, ORACLE]
    head = f"{'':<28}{'tokens':>7} " + "".join(f"{a:>12}" for a in cols)

    def block(title: str, table: dict, metric: str) -> None:
        print(f"\n## {title}")
        print(head)
        for key, row in table.items():
            cells = "".join(f"{'-' if row[a].get(metric) is None else format(row[a][metric], '.3f'):>12}"
                            for a in cols)
            print(f"{key[:28]:<28}{row['turns_tokens']:>7} {cells}")

    rows = dict(sorted(report["rows"].items(), key=lambda kv: (kv[0] == OVERALL, kv[0])))
    what = ("decode wall x plain (oracle: priced on the plan's c(M))" if report.get("wall", True)
            else "SURROGATE decode: x plain priced on the plan's c(M) (no wall time)")
    block(what, rows, "x_plain")
    block("target forwards per token", rows, "fwd_per_tok")
    block("priced x plain (the plan's c(M) and round overhead)", rows, "priced_x_plain")
    if report.get("projected_curve"):
        block(f"projected x plain (c(M) = {report['projected_curve']})", rows, "projected_x_plain")
    block("per tool: " + ("decode wall x plain" if report.get("wall", True)
                          else "x plain priced on the plan's c(M)"), report["by_tool"], "x_plain")
    overall = report["rows"][OVERALL]
    if "all" in overall:
        a = overall["all"]
        share = ("" if a["bookkeeping_share"] is None
                 else f" ({a['bookkeeping_share']:.2%} of a plain step)")
        print(f"\nall / oracle: {report['all_over_oracle']:.3f} (wall x plain over the oracle's "
              f"priced), {report['all_over_oracle_priced']:.3f} (both priced);  bookkeeping of "
              f"all: {a['bookkeeping_ms_per_tok']:.3f} ms per token{share};  rejected rows per "
              f"token: {a['rejected_per_tok']:.3f}")
        print(f"accepted ids per round (all): {a['accepted_per_round']}")
        print("one-row forwards saved per token by source (all; rounds, accepted of proposed "
              "ids): " + ", ".join(
                  f"{src} {c['saved_per_tok']:.3f} ({c['rounds']}, {c['accepted']}/{c['proposed']})"
                  for src, c in a["by_source"].items()))
        own = overall[ORACLE]["priced_x_plain_own"]
        print(f"the oracle priced x plain on all's accepted spans {own['accepted']:.3f} (no "
              f"rejected row or wasted round), on any source's span at all's positions "
              f"{own['positions']:.3f}, anywhere {overall[ORACLE]['priced_x_plain']:.3f}; "
              f"all {a['priced_x_plain']:.3f}")
    capped = overall[ORACLE]["priced_x_plain_span_cap"]
    print("oracle priced x plain with spans of at most " + ", ".join(
        f"{c} ids {x:.3f}" for c, x in capped.items()) + f" (uncapped {overall[ORACLE]['priced_x_plain']:.3f})")
    print(f"identical to plain: {report['identical']}")


def surrogate(model, plan: DispatchPlan):
    """A tiny random llama with ``model``'s vocabulary whose sessions use ``plan`` (forced ids
    make the rounds independent of the weights; only their wall time would differ)."""
    from mlx_fill.assets.random_models import build, config_for
    from mlx_fill.core.resolve import SHARED_PLAN
    vocab = int(model.model.embed_tokens.weight.shape[0])
    tiny, _ = build(dict(config_for("llama"), vocab_size=vocab))
    setattr(tiny, SHARED_PLAN, plan)
    return tiny


def load_model(path: str | None, dtype: str | None):
    """(model, tokenizer, path): ``path`` (any mlx-lm model dir) or the real SmolLM2-135M."""
    from mlx_fill.assets.fixtures import fixture_path
    from mlx_fill.core.model_folder import load_model_folder
    model_dir = str(path) if path else str(fixture_path("smollm2-135m"))
    model, tok = load_model_folder(model_dir)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    return model, tok, model_dir


def cost_curve(text: str) -> list[float]:
    """argparse ``type=``: ``c(2),c(3),...`` as positive finite numbers."""
    try:
        curve = [float(x) for x in text.split(",")]
        curve_plan(curve)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return curve


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m scripts.bench.forced", description=__doc__.splitlines()[0])
    ap.add_argument("--transcripts", type=Path, default=None,
                    help="a transcripts JSONL(.gz) file, or a folder of them (default: the "
                         "held-back sessions)")
    ap.add_argument("--model", default=None, type=model_folder,
                    help="an mlx-lm model dir (default: smollm2-135m)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16", "none"),
                    help="cast the model's floating-point weights; none keeps the stored dtype")
    ap.add_argument("--per-source", type=positive_int, default=None, help="turns per source (default: all)")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="recorded ids per turn (default: all)")
    ap.add_argument("--max-context", type=positive_int, default=None,
                    help="prompt ids kept: the system prompt and tools, then the latest turns")
    ap.add_argument("--repeats", type=int_up_to(MAX_REPEATS), default=3,
                    help=f"timed decodes of every arm per turn (the median is reported), at most "
                         f"{MAX_REPEATS}")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"comma-separated, plain first; also {PREDICTION!r} (`all` with the "
                         "file as last read as the prediction, on turns that have one)")
    ap.add_argument("--rewrites", action="store_true",
                    help="only turns whose reply rewrites a file a read tool returned earlier")
    ap.add_argument("--curve", type=cost_curve, default=None,
                    help="c(M) for M = 2, 3, ..., comma-separated: price the trace as 'projected'")
    ap.add_argument("--curve-overhead", type=float_in(0.0), default=0.0,
                    help="the projected curve's round overhead in one-row forwards")
    ap.add_argument("--surrogate", action="store_true",
                    help="decode with a tiny random llama of the model's vocabulary and price the "
                         "rounds on the model's own plan: fast, priced columns only (no wall time)")
    ap.add_argument("--decide-on-curve", action="store_true",
                    help="with --surrogate and --curve: the gates decide on the curve (the plan "
                         "such hardware would qualify), priced on it")
    ap.add_argument("--no-cross-request", action="store_true",
                    help="no store of earlier replies: each turn as a freshly started server's first")
    ap.add_argument("--store-seed", type=Path, default=None,
                    help="a transcripts file (or folder) whose replies fill the cross-request "
                         "store before the first turn (a server that served those sessions)")
    ap.add_argument("--store-tokens", type=positive_int, default=STORE_TOKENS,
                    help=f"the cross-request store's bound in ids (default {STORE_TOKENS:,})")
    ap.add_argument("--json", type=output_file, default=None)

    def fail(msg: str) -> int:
        print(f"forced: {msg}", file=sys.stderr)
        return 2

    try:
        args = ap.parse_args(argv)
    except UserError as err:
        return fail(str(err))

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or arms[0] != "plain" or any(a not in (*ARMS, PREDICTION) for a in arms):
        return fail(f"--arms must start with plain and name arms of {','.join(ARMS)},{PREDICTION}")
    if len(set(arms)) != len(arms):
        return fail(f"--arms names {sorted({a for a in arms if arms.count(a) > 1})} more than "
                    f"once; name each arm once")
    projection = curve_plan(args.curve, args.curve_overhead) if args.curve else None
    if args.decide_on_curve and (projection is None or not args.surrogate):
        return fail("--decide-on-curve needs --curve and --surrogate (a wall time is this "
                    "machine's, whatever the curve)")
    if args.store_seed is not None and args.no_cross_request:
        return fail("--store-seed fills the cross-request store; drop --no-cross-request")

    def sessions_of(path: Path) -> list[dict]:
        sessions, corrupt = read_sessions(path)
        if corrupt:
            print(f"forced: {path}: {skipped_lines(corrupt)}", file=sys.stderr)
        return sessions

    try:
        check_env()  # the arms read the MLX_FILL_* knobs a server reads
        sessions = sessions_of(args.transcripts) if args.transcripts is not None else default_sessions()
        seed_sessions = sessions_of(args.store_seed) if args.store_seed is not None else []
    except UserError as e:
        return fail(str(e))
    no_reply = (f"no assistant turn to replay in {args.transcripts or 'the held-back sessions'}",
                "pass sessions with assistant replies")
    if not has_reply(sessions):
        return fail("; ".join(no_reply))  # before the model loads (a first use downloads it)
    try:
        model, tok, model_dir = load_model(args.model, None if args.dtype == "none" else args.dtype)
    except UserError as e:
        return fail(str(e))
    plan = plan_for(model)
    if args.decide_on_curve:
        plan = replace(plan, cost=projection.cost, round_overhead=projection.round_overhead,
                       max_chunk=min(plan.max_chunk, projection.max_chunk), long_cost={},
                       long_kv=0)
    if args.surrogate:
        model = surrogate(model, plan)
    try:
        mk = markers(tok)
    except ValueError as e:
        return fail(f"{model_dir}: {e}")
    turns, skipped = forced_turns(tok, sessions, per_source=args.per_source,
                                  max_tokens=args.max_tokens, max_context=args.max_context,
                                  rewrites=args.rewrites, mk=mk)
    not_rendered = [f"{k} sessions not rendered ({reason})" for reason, k in skipped.items()]
    if not turns:
        what, todo = (("no turn rewrites a file a read tool returned earlier (--rewrites)",
                       "drop --rewrites or pass sessions with such turns") if args.rewrites
                      else no_reply)
        return fail("; ".join([what, *not_rendered[:1], todo]))
    for line in not_rendered:
        print(f"forced: {line}", file=sys.stderr)
    longest = max(len(t.prompt) for t in turns)
    if args.max_context is None and longest > LONG_PROMPT:
        print(f"forced: prompts up to {longest:,} ids are prefilled whole (minutes each on a CPU); "
              f"--max-context {LONG_PROMPT} keeps the system prompt, the tools and the latest "
              f"turns", file=sys.stderr)
    store = GlobalSuffixTree(max_tokens=args.store_tokens)
    if seed_sessions:
        print(f"forced: store seeded from {args.store_seed}: "
              f"{seed_store(store, seed_sessions, tok)}", file=sys.stderr)
    print(f"forced replay: {len(turns)} turns, {sum(len(t.output) for t in turns)} recorded ids, "
          f"model {model_dir}, plan max_chunk {plan.max_chunk} overhead {plan.round_overhead}",
          file=sys.stderr)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def finish(result: dict, done: int) -> dict:
        report = {"identical": result["identical"], "wall": not args.surrogate,
                  **summarize(result, projection is not None, wall=not args.surrogate)}
        overall = report["rows"][OVERALL]
        oracle_x = overall[ORACLE]["x_plain"]
        report["all_over_oracle"] = (round(overall["all"]["x_plain"] / oracle_x, 3)
                                     if "all" in overall else None)
        report["all_over_oracle_priced"] = (round(overall["all"]["priced_x_plain"] / oracle_x, 3)
                                            if "all" in overall else None)
        report["projected_curve"] = args.curve
        report["meta"] = {
            "model": model_dir, "dtype": args.dtype, "turns": done, "repeats": args.repeats,
            "per_source": args.per_source, "max_tokens": args.max_tokens,
            "max_context": args.max_context, "surrogate": args.surrogate,
            "decided_on_curve": args.decide_on_curve, "cross_request": not args.no_cross_request,
            "transcripts": str(args.transcripts) if args.transcripts else "held-back split",
            "store_seed": str(args.store_seed) if args.store_seed else None,
            "store_tokens": args.store_tokens,
            "plan": {"cost": plan.cost, "max_chunk": plan.max_chunk,
                     "round_overhead": plan.round_overhead, "cost_kv": plan.cost_kv,
                     "long_kv": plan.long_kv, "long_cost": plan.long_cost},
            "machine": f"{platform.machine()} {platform.system()}, mlx {mx.__version__}",
            "seconds": round(time.perf_counter() - t0, 1),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        if args.json:  # after every turn: a run cut short keeps what it measured
            args.json.write_text(json.dumps(report, indent=2))
        return report

    def progress(i, total, turn, partial):
        print(f"  turn {i}/{total} {turn.transcript_source} {turn.tool} prompt {len(turn.prompt)} "
              f"out {len(turn.output)}", file=sys.stderr, flush=True)
        finish(partial, i)

    result = run(turns, model=model, tok=tok, plan=plan, repeats=args.repeats,
                 projection=projection, arms=arms, cross_request=not args.no_cross_request,
                 store=store, progress=progress)
    report = finish(result, len(turns))
    print_tables(report, arms)
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
