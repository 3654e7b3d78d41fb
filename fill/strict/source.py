"""StrictSource: asserts the parts of a tool call that the template and schema determine.

Per position the source decodes only the new ids (incrementally, never splitting a UTF-8
character), advances the :class:`~mlx_fill.strict.guards.TurnGuard`, and proposes a compiled row only
when the guard puts the stream in the row's structural state:

* ``scaffold`` / ``name`` rows: the stream is inside a structurally opened call whose body so far
  equals the row's key text exactly, and the emitted ids end with the row's trigger ids. A row
  whose first ids were emitted without it firing (its gate let only a prefix through, or a
  batched step emitted one id) is entered mid-span: it proposes the rest of its span.
* ``close`` rows: the body parses (grammar, full consumption) as a known tool's call ending at a
  complete value delimiter, the text since that value equals the row's key, no key is
  duplicated, and the tool's schema allows no further argument.
  A tool that may take more keys than its required ones gets the same close rows under its
  own origin once the required keys are written (the model may still write an optional one).
* ``key`` rows: the same parse, while a required key is unwritten: the row for the text since
  that value and the required key that follows the written ones in the schema's order. A
  tool's key rows are compiled when a call first names it (its name row's text is written, or
  the body parses with its name: looked for until :data:`KEYING_REACH` characters past the
  longest head row's text, and at every value end).

Key rows and a close while optional keys may follow guess the model's own choice: their
proposals yield to any later source's (an echo of the call the model is repeating carries
more than the key).

Policy: every row is proposed as ``verify`` (the same forward checks it; a model that strays
from its template costs nothing but the check). With a ``gate``
(:class:`~mlx_fill.core.cost.CostGate`) a ``verify`` row is priced like any draft, keyed by its
origin: the gate keeps the prefix of the span that pays under the loaded model's cost curve,
and a row it declines is scored as a shadow. Only a ``determined`` row (its certainty class,
decided when the row is compiled: :func:`mlx_fill.strict.rows.certainty`) can ever become ``assert``,
and only once the evidence ledger promotes it after enough agreements and no disagreement
(``mlx_fill.sources.ledger``; strict rows are eligible when the ledger lists ``"strict:"``). A
``likely`` row stays ``verify`` whatever the ledger has seen: the ledger refuses to promote it.
The fixtures showed why the default is verify: an undertrained model that emits
``<tool_call>`` does not always continue with the template's scaffold. A call whose body does
not parse once it has ended, after rows fired in it, counts a ``parse_fallback`` and disarms the
source for the rest of the request.

Certainty per call syntax. A row is ``determined`` only where the template, the schema and a
parser state that cannot be entered from inside an argument value force its ids. In every
syntax the rest of a tool name is the model's until it ends the name (after ``fetch`` of
``fetch_web_page_text`` it may go on to a tool it was not given, ``fetch_url``, or end the name
there), and so is which keys a call writes (it may leave out a key the schema requires, or
write one the schema lacks): rows that write either are ``likely``.

* Qwen3-Coder / Qwen3.5 XML and GLM ``arg_key/arg_value``: values are raw text, so a value can
  hold ``</parameter>``, ``</function>``, ``</arg_value>``, ``</tool_call>`` and a new
  ``<tool_call>`` (a heredoc writing XML, ``echo '</arg_value>' > f``). Determined: the
  scaffold after the turn's first call-start token up to where a tool's name begins (XML's
  ``\n<function``; GLM writes the name right after ``<tool_call>``). Likely: a scaffold that
  runs into a name (one tool offered, or names that start alike: the model may call a tool it
  was not given) or ends on an id a name merges with (``=`` before ``ping``: a call of ``get``
  writes ``=get``), the rest of a name, a head row that writes a key (the schema's sole key, or
  the ``<parameter`` / ``<arg_key>`` that opens a first key), every ``close`` row, and the head
  rows of any later call in the turn (it opens after an end marker a value can contain).
* Qwen3 Hermes JSON: a string cannot hold an unescaped quote, and the guard reads call markers
  only outside strings, so no row fires inside a value (``"}}`` or ``</tool_call>`` in a string
  is text). Determined: the scaffold ``\\n{"name": "`` and the head rows of later calls.
  Likely: the rest of a name, and rows that reach into the ``arguments`` object (the name
  rows' ``{"key":``, a single-tool scaffold through the key, the close row's ``}}``): a
  template inserts string arguments verbatim, so their spacing is the model's own JSON
  (recorded SWE-agent calls use ``{ "key"``).

* Llama 3.x JSON (``{"name": NAME, "parameters": ARGS}`` as the whole reply, no call-start
  token; :func:`~mlx_fill.strict.guards.protocol_markers`): a call opens only on ``{"name": "``
  at the start of the reply (after whitespace or ``<|python_tag|>``), never after prose or on a
  later line, and never again once a call has ended. No row is determined: every row writes
  the rest of a name or past the name string (its closing quote merges with the comma,
  ``",``), where the key the arguments go under is the model's (the call is JSON written after
  an instruction, with no special token around it: the template writes ``"parameters"``, the
  models also write ``"arguments"``). Likely: the rest of a name with ``", "parameters":``
  (the space before ``{`` merges into the arguments' first token) and (``header``) the
  parameters object's opening (``tojson`` spacing is the model's). The closing ``}}`` merges
  with the last value's quote, and ``<|eot_id|>`` / ``<|eom_id|>`` are stops never proposed. A
  ``<|python_tag|>`` body of raw code (3.1 builtin tools) never opens a call.
* Mistral ``[TOOL_CALLS]`` (control id 9; the body is the JSON list up to EOS): determined:
  ``[{"name": "`` after it (when the tools' names do not start alike), and ``"arguments":``
  after a name the model has ended. Likely: the rest of a name with ``", "arguments":``, the
  arguments object's opening (``header``) and the close rows after the last value
  (``"}, "id": "``), cut where the model writes its own 9-character call id. A later call in
  the same list gets no rows.
* gpt-oss harmony: a call opens on ``to=functions`` only at the start of an assistant message
  (the reply, or after ``<|start|>``, optionally after ``assistant`` and
  ``<|channel|>commentary``), never in the final channel's prose or the analysis channel
  (reasoning). No row is determined: the rows after ``to=functions.`` write the rest of a
  name (with the two-token names of most tools that rest is one id, below the minimum span,
  and no row). Likely (``header``): the channel/constraint header after the name (the vendor
  template writes ``<|channel|>commentary json<|message|>``, the model is trained on
  ``<|channel|>commentary <|constrain|>json<|message|>``, and ``to=`` may follow the channel)
  and the arguments' opening; ``<|call|>`` ends the call and is a stop never proposed.

In all three the arguments are JSON and the guard reads markers only outside strings: the
tokenizers map ``<|call|>``, ``<|eot_id|>``, ``[TOOL_CALLS]`` written inside an argument to the
special id when a template renders it, and still nothing opens, ends or fires there (the
``adv-*`` audit cases of ``gpt-oss``, ``llama3.x`` and ``mistral-nemo``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .guards import SYNTAXES, Role, TurnGuard
from mlx_fill.core.proposal import DecodeView, Proposal
from .rows import (Primer, Row, RowTable, awaits_reply, compile_table, compile_tool_keys,
                   initial_role, resumed_heads, table_for)
from .schema import tool_schemas
from .tokenbytes import IncrementalText, token_bytes


# How far past the longest head row's text a call's body is parsed for the tool it names, where
# the name has not been read yet (a parse per id; the value-end parses go on reading it).
KEYING_REACH = 64


@dataclass
class StrictStats:
    """What this source did in one request."""

    fires: int = 0
    accepted: int = 0
    parse_fallbacks: int = 0


class StrictSource:
    """A ProposalSource over a compiled :class:`RowTable` for one request. ``compile_keys(tool)``
    compiles a tool's key rows into the table (:func:`~mlx_fill.strict.rows.compile_tool_keys`
    in this request's conversation); without it only the rows already compiled fire."""

    name = "strict"

    def __init__(self, table: RowTable, tokenizer, initial: Role, ledger=None, gate=None,
                 compile_keys: Callable[[str], None] | None = None) -> None:
        self.table = table
        self.compile_keys = compile_keys
        self.ledger = ledger
        self.gate = gate
        self.guard = TurnGuard(SYNTAXES[table.syntax], table.markers, initial)
        tokens = token_bytes(tokenizer)
        self.text = IncrementalText(tokens)
        self.stats = StrictStats()
        self.armed = True
        self._verified: Row | None = None  # the row of the last verify proposal made
        self._verified_at = 0  # the output index of that proposal's first id
        # a row whose verified prefix (cut short by a gate or cap) was accepted whole, the
        # output index of the row's first id and how many of its ids were verified: the next
        # emitted id settles whether the model went on with the row (:meth:`_settle_partial`)
        self._partial: tuple[Row, int, int] | None = None
        self._seen = 0
        self._fired_in_call = False
        self._calls_ended = 0
        # head rows by body text, for a turn's first call (0) and later calls (1), each with
        # its mid-span entries (:func:`~mlx_fill.strict.rows.resumed_heads`)
        self._heads = tuple({**resumed_heads(rows, tokens), **rows}
                            for rows in (table.head_rows(0), table.head_rows(1)))
        self._max_head_key = max((len(k) for h in self._heads for k in h), default=0)
        self._after_value = table.after_value()
        self._keys_read = len(table.keys)  # how many key rows _after_value covers
        self._call_keyed = False  # the current call's tool is read and its key rows compiled
        self._request_stats = None

    def _advance(self, emitted) -> None:
        if len(emitted) < self._seen:
            raise ValueError("the emitted stream shrank; a source sees each position once")
        new = emitted[self._seen:]
        self._seen = len(emitted)
        self._settle_partial(emitted)
        if self.gate is not None:
            self.gate.begin(new)
        if new:
            self.guard.feed(self.text.add(new))
        if self.guard.calls_ended != self._calls_ended:
            self._calls_ended = self.guard.calls_ended
            self._call_keyed = False
            if self._fired_in_call and self.guard.syntax.parse(self.guard.last_body) is None:
                self._disarm()
            self._fired_in_call = False

    def _settle_partial(self, emitted) -> None:
        """A row verified only in part, its prefix accepted, disagrees with the model when the
        id emitted after that prefix is not the row's next one (a promoted row's check cut by
        the request's cap would otherwise never find the model writing other spacing)."""
        if self._partial is None:
            return
        row, at, verified = self._partial
        if len(emitted) <= at + verified:
            return
        self._partial = None
        if self.ledger is not None and emitted[at + verified] != row.span[verified]:
            self.ledger.record(row.claim, False)

    def _row(self, emitted) -> Row | None:
        g = self.guard
        if g.role is not Role.CALL or g.declined:
            return None
        head = self._heads[min(g.calls_ended, 1)]
        if len(g.body) <= self._max_head_key and g.body in head:
            row = head[g.body]
            if not self._call_keyed and row.detail in self.table.tools:
                self._key_tool(row.detail)  # a name (or a lone tool's scaffold) row's tool
            if _ends_with(emitted, row.trigger):
                return row
            return None
        unkeyed = not self._call_keyed and len(self.table.keyed) < len(self.table.tools)
        if unkeyed and len(g.body) <= self._max_head_key + KEYING_REACH:
            self._key_call(g.call_prefix())
        if len(self.table.keys) != self._keys_read:  # compiled here or by another request
            self._keys_read = len(self.table.keys)
            self._after_value = self.table.after_value()
        if not g.body.endswith(self._after_value):
            return None
        state = g.call_prefix()
        if state is None or state.value_end is None:
            return None
        if not self._call_keyed:
            self._key_call(state)
        schema = self.table.tools.get(state.tool)
        if schema is None:
            return None
        text = g.body[state.value_end:]
        if state.closed or schema.closable(state.keys):
            row = self.table.close.get(text)
        elif schema.required <= set(state.keys):
            row = self.table.optional_close.get((text, state.tool))
        else:
            key = schema.next_required(state.keys)
            row = None if key is None else self.table.keys.get((text, state.tool, key))
        return row if row is not None and _ends_with(emitted, row.trigger) else None

    def _key_call(self, state) -> None:
        """:meth:`_key_tool` once the current call's body parses with its tool's name and goes
        on past it (a body that ends with the name may hold a prefix of it)."""
        if state is not None and state.tool is not None and not self.guard.body.endswith(state.tool):
            self._key_tool(state.tool)

    def _key_tool(self, tool: str) -> None:
        """The current call is ``tool``'s: compile its key rows (when this table has none yet)."""
        self._call_keyed = True
        if self.compile_keys is not None:
            self.compile_keys(tool)

    def bind_stats(self, request_stats) -> None:
        """Also count parse fallbacks in the request's ``usage.fill``."""
        self._request_stats = request_stats

    def _disarm(self) -> None:
        self.armed = False
        self.stats.parse_fallbacks += 1
        if self._request_stats is not None:
            self._request_stats.parse_fallbacks += 1

    def propose(self, view: DecodeView) -> Proposal | None:
        """A row's span when the guard is in its structural state; else None."""
        self._advance(view.emitted)
        if not self.armed:
            return None
        row = self._row(view.emitted)
        if row is None:
            return None
        policy, span = self._policy(row), row.span
        if policy == "verify" and self.gate is not None:
            n = self.gate.offer(span, row.origin)
            if n <= 0:
                return None
            span = span[:n]
        self.stats.fires += 1
        self._fired_in_call = True
        self._verified = row if policy == "verify" else None
        self._verified_at = len(view.emitted)
        return Proposal(span, policy, row.origin, row.certainty, yields=row.yields)

    def _policy(self, row: Row) -> str:
        """``assert`` only for a row whose claim the ledger promotes and does not check this
        time (:meth:`~mlx_fill.sources.ledger.Ledger.asserts`; the ledger refuses ``likely``
        rows), and never after a raw newline ended a JSON string of the turn
        (:attr:`~mlx_fill.strict.guards.TurnGuard.string_broken`: the parser state that makes
        a row ``determined`` is then a guess)."""
        promoted = (not self.guard.string_broken and self.ledger is not None
                    and self.ledger.asserts(row.origin, certainty=row.certainty, claim=row.claim))
        return "assert" if promoted else "verify"

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        """Count committed ids; a verified row's outcome is evidence for the ledger, under the
        row's claim: a disagreement always, an agreement only where the whole span was verified
        (a prefix the gate kept says nothing of the ids after it, which an assert would write;
        the id the model emits after that prefix is checked against the row's next one)."""
        self.stats.accepted += accepted
        if proposal.policy != "verify":
            return
        if self.gate is not None:
            self.gate.observe_proposed(len(proposal.ids), accepted)
        row, self._verified = self._verified, None
        if (self.ledger is None or row is None or row.origin != proposal.origin
                or row.span[:len(proposal.ids)] != tuple(proposal.ids)):
            return  # not the row this source proposed last (the session may cut it shorter)
        agreed = accepted == len(proposal.ids)
        if not agreed or len(proposal.ids) == len(row.span):
            self.ledger.record(row.claim, agreed)
        else:
            self._partial = (row, self._verified_at, accepted)


def _ends_with(seq, tail: tuple[int, ...]) -> bool:
    n = len(tail)
    return n == 0 or (len(seq) >= n and tuple(seq[-n:]) == tail)


@dataclass(frozen=True)
class CompiledStrict:
    """What rendering a conversation decides for its strict sources: the row table
    (:func:`~mlx_fill.strict.rows.table_for`) and the role the reply opens in
    (:func:`~mlx_fill.strict.rows.initial_role`). :meth:`source` builds a request's source
    from it without rendering anything."""

    table: RowTable
    initial: Role

    def source(self, tokenizer, messages: list[dict], tools: list[dict] | None,
               template_kwargs: dict | None = None, ledger=None, gate=None) -> StrictSource:
        """A StrictSource over these rows whose tools' key rows, when first needed, are
        compiled in ``messages``'s conversation; ``gate`` prices its ``verify`` rows."""
        compile_keys = functools.partial(compile_tool_keys, self.table, tokenizer=tokenizer,
                                         messages=messages, tools=tools,
                                         template_kwargs=template_kwargs)
        return StrictSource(self.table, tokenizer, self.initial, ledger, gate, compile_keys)


def compile_strict(tokenizer, messages: list[dict], tools: list[dict] | None,
                   template_kwargs: dict | None = None) -> CompiledStrict | None:
    """The rows and initial role of this conversation's strict sources (it renders the
    conversation a few times), or None when no rows compile (no tools, or a template that
    cannot render tool calls). Raises ValueError naming the path of a malformed tool."""
    kwargs = dict(template_kwargs or {})
    primer = Primer(tokenizer, messages, tools, kwargs)
    table = table_for(tokenizer, messages, tools, template_kwargs, primer)
    if table is None or not table.rows():
        return None
    role = initial_role(tokenizer, messages, tools, kwargs, table.markers, primer)
    return CompiledStrict(table, role)


def strict_source(tokenizer, messages: list[dict], tools: list[dict] | None,
                  template_kwargs: dict | None = None, ledger=None, gate=None) -> StrictSource | None:
    """A StrictSource for this request, or None when no rows compile (no tools, or a template
    that cannot render tool calls); ``gate`` prices its ``verify`` rows. Raises ValueError
    naming the path of a malformed tool."""
    compiled = compile_strict(tokenizer, messages, tools, template_kwargs)
    if compiled is None:
        return None
    return compiled.source(tokenizer, messages, tools, template_kwargs, ledger, gate)


WARM_TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def warm_strict(tokenizer) -> None:
    """Pay what a tokenizer's first strict compile pays once, at load rather than at a request's
    first call: its token-byte table (a pass over the vocabulary: 0.1-0.25 s for a byte-level
    one of 128k-248k ids), the template's compile and the call grammar's, by compiling the rows
    of a one-tool conversation (not cached); a tokenizer without tool-call markers, which no
    strict row serves, pays nothing. Best effort: whatever fails here fails, and is reported,
    in the request that needs it."""
    try:
        compile_table(tokenizer, [{"role": "user", "content": "hi"}], WARM_TOOLS)
    except Exception:  # noqa: BLE001 -- a template that cannot be probed is the request's to report
        pass


class LazyStrictSource:
    """Defers compiling the strict rows until the model itself emits the tool-call start token.

    Rows can only fire inside a call, and a call opens only on that token, so until it appears
    the source proposes nothing either way; prose turns then never pay for the compile (which
    renders the conversation several times). On first sight it builds the
    :class:`StrictSource`, which replays the emitted stream once and continues incrementally,
    so its proposals are exactly those of a source built up front.
    """

    name = "strict"

    def __init__(self, start_id: int, build) -> None:
        self._start_id = start_id
        self._build = build
        self._scanned = 0
        self._source: StrictSource | None = None
        self._built = False
        self._request_stats = None

    def bind_stats(self, request_stats) -> None:
        self._request_stats = request_stats

    def propose(self, view: DecodeView) -> Proposal | None:
        if not self._built:
            emitted = view.emitted
            seen = self._start_id in emitted[self._scanned:]
            self._scanned = len(emitted)
            if not seen:
                return None
            self._source, self._built = self._build(), True
            if self._source is not None and self._request_stats is not None:
                self._source.bind_stats(self._request_stats)
        return self._source.propose(view) if self._source is not None else None

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        if self._source is not None:
            self._source.feedback(proposal, accepted)


def lazy_strict_source(tokenizer, messages: list[dict], tools: list[dict] | None,
                       template_kwargs: dict | None = None, ledger=None, gate=None
                       ) -> LazyStrictSource | StrictSource | None:
    """:func:`strict_source` for serving: tools are validated now (ValueError naming the path),
    rows are compiled only once the model emits the tool-call start token. Falls back to the
    eager source when that marker is not one token of the vocabulary."""
    if not tool_schemas(tools) or not awaits_reply(messages):
        return None
    start = getattr(tokenizer, "tool_call_start", None) or ""
    start_id = tokenizer.convert_tokens_to_ids(start) if start else None
    if not isinstance(start_id, int) or tokenizer.encode(start, add_special_tokens=False) != [start_id]:
        return strict_source(tokenizer, messages, tools, template_kwargs, ledger, gate)
    return LazyStrictSource(
        start_id, lambda: strict_source(tokenizer, messages, tools, template_kwargs, ledger, gate))
