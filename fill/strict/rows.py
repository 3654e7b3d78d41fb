"""The strict-row compiler: scaffold probing through the model's own chat template.

The request's conversation is rendered through ``tokenizer.apply_chat_template`` (with the
request's tools and template kwargs) several ways: with candidate tool calls that use the REAL
tool names and REAL schema keys, with varied argument values, and with a plain-content reply.
Each rendering's reply (the text after the generation prompt, found at the TEXT level so the
``<think>\\n`` + ``\\n</think>`` newline merge cannot hide it) is tokenized whole, and the id
sequences are diffed. The diff only decides WHERE to cut; every span is sliced from a real
rendering, so every cut is a token boundary of a stream the model could produce. Nothing here
knows a tool-call syntax: Qwen3 JSON, Qwen3-Coder/Qwen3.5 XML and GLM compile through the same
diff (the syntax is only detected, for the guard, by which grammar reads the rendered call).

Rows:

* ``scaffold`` -- right after the model's own call-start token: the template text up to where
  the real tool names diverge (with one tool: through the name, and through the sole key when
  the schema makes it certain).
* ``name`` -- after a tool name's first distinguishing token: the rest of the name, the
  name-to-arguments punctuation, and the sole key when certain.
* ``close`` -- after a complete value delimiter, when the guard says no further argument can
  legally follow: the rest of the call through its end marker (and, under the tool's own
  origin, once the required keys of a tool that may take more are written).
* ``key`` -- after a complete value delimiter, when a required key follows the written ones in
  the schema's order (:meth:`~mlx_fill.strict.schema.ToolSchema.next_required`): the text
  between the two values through that key, cut before the next value begins.
* ``header`` -- in the syntaxes whose ``CallSyntax.forced`` says where the protocol's forced
  text ends (harmony, Llama 3.x JSON, Mistral): the part of a scaffold or name row's span
  beyond it (the channel header, the arguments object's opening), cut off into a row of its own.

Templates that raise on a call without an id (Mistral: 9 alphanumeric characters) are probed
with fixed ids; a template that renders only one call per turn (Llama 3.x, harmony) is probed
one call per render.

Every row carries a certainty class (:data:`Certainty`), decided here by :func:`certainty` and
nowhere else: ``determined`` rows are ids that the template, the schema and a parser state
that cannot be entered from inside an argument value force; ``likely`` rows are what the
template suggests, and may only ever be verified (``mlx_fill.strict.source`` states the rule for each
supported syntax and for the other call syntaxes in the assets). Each tool is also rendered
called with no arguments (a model may leave out what its schema requires): a head row that
writes past where that call parts from the tool's other probes writes keys the model chooses.
Calls of tools the request does not offer (:data:`FOREIGN_NAMES`) show where the text every
call begins with ends: a scaffold those calls do not begin with writes the model's name.

Spans shorter than 2 ids or containing an EOS id are dropped. Plans are cached under an exact
identity key (template, tools, tokenizer, kwargs); a cached table is reused for a new
conversation only when that conversation renders the same reference call body.
"""

from __future__ import annotations

import functools
import bisect
import hashlib
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence, get_args

import jinja2

from .guards import SYNTAXES, CallSyntax, Markers, Role, detect_syntax, protocol_markers
from .tokenbytes import ids_bytes, token_bytes
from .schema import ToolSchema, tool_schemas

# Values the probes put into the first argument: different first/last characters and types,
# so that a cut never lands on a token that could merge with a value the model might write.
HEAD_VALUES: tuple = ("Paris", "/tmp/x", "-1", " lead", "\nx", "x\n", "a.", '{"k": 1}', '"q"',
                      "über", "7", "", "`x`", "\\d", "  ", 7, -2.5, True, None, ["a"], {"k": "v"})
# Values for the last argument of close probes: plain text, so the value's rendered text is the
# value itself in every syntax and its end can be located exactly.
CLOSE_VALUES: tuple = ("Paris", "ok.", "a-b", "x y", "7", "/tmp", "über", "end!", "x\ny", "sp ",
                       "q?", "a)", "tab\t", "日本")
# Close rows are probed on this many tools (those with arguments, in the tools' order): what
# follows a call's last value is the template's, not the tool's (over the audit's seven
# families and nineteen tool sets, the rows equal those of probing every tool), and the probes
# of a tool cost 14 renders and about 60 parses of its whole call.
CLOSE_TOOLS = 3
EXTRA_KEY = "zq_extra"
CONTENT_PROBE = "Hello."
REASONING_PROBE = "Thinking."
RESULT_PROBE = "Done."  # the tool message answering each call of a batch of turns
MIN_SPAN = 2

Certainty = Literal["determined", "likely"]
CERTAINTIES: tuple[str, ...] = get_args(Certainty)


def certainty(kind: str, syntax: str, *, after_call: bool = False,
              into_arguments: bool = False, unsettled_name: bool = False) -> Certainty:
    """The certainty class of a row -- the one statement of the rule.

    * ``scaffold`` rows are ``determined``: they fire right after the call-start token, where
      the template writes the text every call begins with. ``name`` rows are ``determined``
      only once the model has ended the name (a tool whose name is another's start, ``read``
      beside ``read_file``, has a row keyed past its end). The exceptions are ``likely``: a row
      that writes name text the model's own ids have not settled (``unsettled_name``): a
      scaffold that runs into the name (one tool offered, or tools whose names start alike:
      which tool a call names is the model's to begin, and it may call one it was not given),
      and a ``name`` row keyed inside the name or at its end (after ``fetch`` of
      ``fetch_web_page_text`` the model may go on to a tool it was not given, ``fetch_url``,
      or end the name there; beside ``read_files``, ``read_file`` is such a start); a row
      that reaches into the arguments (``into_arguments``): past where a call of its tool with
      no arguments parts from it (:func:`_arguments_at`), as the sole key of a schema does
      (which keys a call writes is the model's: it may leave out a key the schema requires,
      or write one the schema lacks, ``file_path`` for ``path``), in Hermes JSON into the
      ``arguments`` object, whose spacing is the model's own JSON (a template inserts string
      arguments verbatim, so ``{ "k"`` is as valid as ``{"k"``), and in Llama 3.x JSON past
      the name string: the call is JSON the model writes after an instruction, with no
      special token around it, and the models write its arguments under ``"arguments"`` as
      well as the template's ``"parameters"``; and in a raw-text syntax
      (``CallSyntax.raw_values``: XML, GLM), a call that opens after an earlier call of the
      same turn has ended (``after_call``) may be text inside that call's last value (a value
      can hold the call's end marker and a new start marker).
    * ``key`` rows are ``likely``: a model may write an optional key first, or the keys in an
      order of its own, and in XML and GLM they fire where a raw value may go on.
    * ``close`` rows are ``likely`` in every supported syntax: in XML and GLM they fire after
      ``</parameter>`` / ``</arg_value>``, which a raw-text value can contain; in the JSON
      syntaxes they fire only after a closed string (a JSON string cannot hold an unescaped
      quote, so they never fire inside a value) but propose the arguments object's closing,
      whose spacing is again the model's.
    * ``header`` rows are ``likely``: they hold what follows the protocol's forced text in
      harmony, Llama 3.x JSON and Mistral (``CallSyntax.forced``): harmony's channel header
      (the template writes ``<|channel|>commentary json``, the model is trained on
      `` <|constrain|>json``) and the arguments object's opening, whose spacing is the model's.
      Their scaffold and name rows hold only forced text (the rest of a name after the special
      or template-written opening), classed as above.
    """
    if kind not in ("scaffold", "name", "close", "header", "key"):
        raise ValueError(f"unknown row kind {kind!r}")
    raw_values = SYNTAXES[syntax].raw_values
    if (kind in ("close", "header", "key") or into_arguments or unsettled_name
            or (after_call and raw_values)):
        return "likely"
    return "determined"


# A Llama 3.x call body's opening: the rest of the name string, through its closing quote.
_LLAMA_NAME = re.compile(r'(?:[^"\\\n]|\\.)*"')


def _into_arguments(syntax: str, body_text: str | None) -> bool:
    """Does a row's call-body text (key + span) reach what the model writes its own way around
    the arguments: in Hermes JSON the ``arguments`` object, in Llama 3.x JSON anything past
    the name string (the key the arguments go under, and its spacing)?"""
    if syntax not in ("hermes-json", "llama-json"):
        return False
    if body_text is None:
        return True
    if syntax == "llama-json":
        name = _LLAMA_NAME.match(body_text)
        return name is not None and len(body_text) > name.end()
    at = body_text.find('"arguments"')
    return at >= 0 and "{" in body_text[at:]


@dataclass(frozen=True)
class Row:
    """One strict row.

    ``key`` is the text the guard must see: the call body so far (``scaffold``/``name``, a first
    ``key`` row) or the text written since the last argument value ended (``close``, ``key``).
    ``trigger`` are ids the emitted stream must end with; ``span`` the ids to propose;
    ``certainty`` its class (only a ``determined`` row may ever be asserted). A row without a
    valid class cannot be built. ``resumes``: for a row entered mid-span
    (:func:`resumed_heads`), the claim of the row whose span it finishes.
    """

    kind: str
    detail: str
    key: str
    trigger: tuple[int, ...]
    span: tuple[int, ...]
    certainty: Certainty
    resumes: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.certainty not in CERTAINTIES:
            raise ValueError(f"row {self.origin}: certainty must be one of {CERTAINTIES}, "
                             f"got {self.certainty!r}")

    @functools.cached_property
    def claim(self) -> str:
        """What asserting this row would claim, as the evidence ledger counts it: its origin
        and the ids it writes where it fires (its key, trigger and span). A row of the same
        origin that writes other ids, as a scaffold row does under another tool set, is
        another claim with evidence of its own. A row entered mid-span makes the claim of the
        row it finishes: the model writing its rest after writing the start itself is the whole
        row agreeing, and a disagreement with the whole row holds against every part of it."""
        if self.resumes is not None:
            return self.resumes
        digest = hashlib.sha256(repr((self.key, self.trigger, self.span)).encode()).hexdigest()
        return f"{self.origin}@{digest[:12]}"

    @property
    def origin(self) -> str:
        return f"strict:{self.kind}:{self.detail}" if self.detail else f"strict:{self.kind}"

    @property
    def yields(self) -> bool:
        """Whether the row guesses the model's own choice (the next key, a close while optional
        keys may follow) and gives way to another source's proposal."""
        return self.kind == "key" or (self.kind == "close" and bool(self.detail))


@dataclass(frozen=True)
class RowTable:
    """Compiled rows for one (template, tools, tokenizer, kwargs) identity.

    ``head`` rows serve a turn's first call; ``later_head`` the same spans for a call that
    opens after an earlier call of the turn has ended, classed by :func:`certainty` with
    ``after_call`` (they differ only in class). ``keys`` holds the key rows by (text since the
    value ended, tool, the key they write) of the tools in ``keyed``: a tool's are compiled
    when its first call reaches them (:func:`compile_tool_keys`; a (tool, key) pair costs
    35 probe renders and a few parses, about 10 ms here, and a table is compiled while a
    request's first call is being decoded). ``optional_close`` the close rows by (text, tool)
    for a tool that may take keys beyond its required ones, under the tool's own origin
    (``strict:close:TOOL``): they fire once its required keys are written, and are right only
    as often as its calls leave the others out.
    """

    syntax: str
    markers: Markers
    tools: dict[str, ToolSchema]
    head: dict[str, Row]
    close: dict[str, Row]
    reference_body: tuple[int, ...]
    later_head: dict[str, Row] = field(default_factory=dict)
    keys: dict[tuple[str, str, str], Row] = field(default_factory=dict)
    optional_close: dict[tuple[str, str], Row] = field(default_factory=dict)
    keyed: set[str] = field(default_factory=set)

    def rows(self) -> list[Row]:
        """Every distinct compiled row (a later-call head row only where its class differs)."""
        later = [r for k, r in self.later_head.items() if self.head.get(k) != r]
        return [*self.head.values(), *later, *self.close.values(), *self.keys.values(),
                *self.optional_close.values()]

    def after_value(self) -> tuple[str, ...]:
        """Every text a close or key row is keyed by (what ``str.endswith`` takes)."""
        return tuple({*self.close, *(text for text, _, _ in self.keys)})

    def head_rows(self, calls_ended: int) -> dict[str, Row]:
        """The head rows for a call opening after ``calls_ended`` calls of this turn."""
        return self.later_head if calls_ended else self.head


@dataclass(frozen=True)
class Rendered:
    """One probe: the reply text after the generation prompt, its ids, and byte offsets."""

    text: str
    ids: tuple[int, ...]
    offsets: tuple[int, ...]          # byte offset where each id starts; offsets[-1]=len


class TemplateError(ValueError):
    """The template cannot be probed (raised internally; the compiler then yields no rows)."""


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict,
            generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation, **kwargs)


def _call(name: str, args: dict, call_id: str | None = None) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    return call if call_id is None else {**call, "id": call_id}


def _turn(calls: list[tuple[str, dict]], content: str, ids: bool) -> dict:
    """An assistant turn with ``calls``; ``ids``: each call gets a fixed 9-alphanumeric id."""
    return {"role": "assistant", "content": content,
            "tool_calls": [_call(name, args, f"call{k:05d}" if ids else None)
                           for k, (name, args) in enumerate(calls)]}


class Primer:
    """A conversation rendered with its generation prompt (:attr:`text`), rendered when first
    read and then kept: every probe's reply extends it (:class:`_Prober`) and its tail is the
    prompt the reply opens in (:func:`initial_role`), so one compile renders it once."""

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None,
                 kwargs: dict) -> None:
        self._render = functools.partial(_render, tokenizer, messages, tools, kwargs, True)

    @functools.cached_property
    def text(self) -> str:
        return self._render()


class _Prober:
    """Renders reply probes for one conversation and tokenizes them whole; ``primer``: the
    conversation's :class:`Primer`, when the caller reads it too."""

    def __init__(self, tokenizer, messages, tools, kwargs, primer: Primer | None = None) -> None:
        self.tokenizer = tokenizer
        self.messages = list(messages)
        self.tools = tools
        self.kwargs = kwargs
        self.table = token_bytes(tokenizer)
        self.primer = (primer or Primer(tokenizer, self.messages, tools, kwargs)).text
        self.call_ids = False

    def turn(self, calls: list[tuple[str, dict]], content: str = "") -> Rendered:
        """The reply of an assistant turn with ``calls``; a template that raises on a call
        without an id is probed with fixed ids from then on."""
        try:
            return self.reply(_turn(calls, content, self.call_ids))
        except jinja2.TemplateError:
            if self.call_ids:
                raise
            rendered = self.reply(_turn(calls, content, True))
            self.call_ids = True
            return rendered

    def reply(self, message: dict, *after: dict) -> Rendered:
        """The probe's reply: the assistant turn ``message`` and the messages ``after`` it. A
        template whose generation prompt opens reasoning but that drops an empty think block
        from a rendered turn (GLM-4.7-Flash) is probed with a reasoning placeholder, so the
        rendered turn extends the generation prompt."""
        full = _render(self.tokenizer, [*self.messages, message, *after], self.tools,
                       self.kwargs, False)
        if not full.startswith(self.primer) and "reasoning_content" not in message:
            message = {**message, "reasoning_content": REASONING_PROBE}
            full = _render(self.tokenizer, [*self.messages, message, *after], self.tools,
                           self.kwargs, False)
        if not full.startswith(self.primer):
            raise TemplateError("the rendered assistant turn does not extend the generation prompt")
        text = full[len(self.primer):]
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        offsets = _offsets(self.table, ids)
        if ids_bytes(self.table, ids) != text.encode("utf-8"):
            raise TemplateError("token bytes do not reproduce the rendered text")
        return Rendered(text, ids, tuple(offsets))

    def calls(self, calls: list[tuple[str, dict]], markers: Markers) -> list[_Body]:
        """Bodies of ``calls`` rendered as one assistant turn (one render for many probes)."""
        return _bodies(self.turn(calls), markers, [name for name, _ in calls])

    def turns(self, calls: list[tuple[str, dict]], markers: Markers) -> list[_Body]:
        """Bodies of ``calls`` rendered as consecutive assistant turns of one call each, every
        one but the last answered by a :data:`RESULT_PROBE` tool message (one render for many
        probes where a template renders one call per turn)."""
        messages = []
        for call in calls:
            turn = _turn([call], "", self.call_ids)
            call_id = turn["tool_calls"][0].get("id")
            messages += [turn, {"role": "tool", "content": RESULT_PROBE,
                                **({"tool_call_id": call_id} if call_id else {})}]
        rendered = self.reply(*messages[:-1])
        if rendered.text.count(markers.call_start) != len(calls):
            raise TemplateError("a batch of turns renders call markers of its own")
        return _bodies(rendered, markers, [name for name, _ in calls])

    def probe(self, calls: list[tuple[str, dict]], markers: Markers) -> list[_Body]:
        """Bodies of ``calls``, from one render of them all where the template renders the
        first and the last call there exactly as it renders that call alone: as one turn, else
        as consecutive turns (:meth:`turns`, for a template that renders one call per turn);
        otherwise one render per call. A single call is rendered alone, once."""
        if len(calls) == 1:
            return self.calls(calls, markers)
        alone: dict[int, _Body] = {}

        def single(i: int) -> _Body:
            if i not in alone:
                alone[i] = self.calls([calls[i]], markers)[0]
            return alone[i]

        for batched in (self.calls, self.turns):
            try:
                batch = batched(calls, markers)
            except (TemplateError, jinja2.TemplateError):
                continue
            if all(single(i) == batch[i] for i in {0, len(calls) - 1}):
                return batch
        return [single(i) for i in range(len(calls))]


def initial_role(tokenizer, messages, tools, kwargs, markers: Markers,
                 primer: Primer | None = None) -> Role:
    """Reasoning when the generation prompt leaves a think block open, else content;
    ``primer``: the conversation's :class:`Primer`, when the caller reads it too."""
    with_gen = (primer or Primer(tokenizer, messages, tools, kwargs)).text
    without = _render(tokenizer, messages, tools, kwargs, False)
    gen = with_gen[len(without):] if with_gen.startswith(without) else with_gen[-64:]
    opened = gen.rfind(markers.think_start) if markers.think_start else -1
    if opened >= 0 and opened > gen.rfind(markers.think_end or "\0"):
        return Role.REASONING
    return Role.CONTENT


def _markers(tokenizer) -> Markers | None:
    """The tokenizer's tool-call markers (mlx-lm's tool parser), or those of the template's
    call protocol where mlx-lm gives none or no end marker (:func:`protocol_markers`)."""
    start = getattr(tokenizer, "tool_call_start", None) or ""
    end = getattr(tokenizer, "tool_call_end", None) or ""
    if not start or not end:
        found = protocol_markers(getattr(tokenizer, "chat_template", None),
                                 getattr(tokenizer, "eos_token", None))
        return found[0] if found is not None else None
    think_start = getattr(tokenizer, "think_start", None) or ""
    think_end = getattr(tokenizer, "think_end", None) or ""
    return Markers(start, end, think_start, think_end)


@dataclass(frozen=True)
class _Body:
    """A probe's call body: ids from the call-start marker's end through the end marker."""

    trigger: tuple[int, ...]      # the token(s) that complete the start marker
    ids: tuple[int, ...]
    text: str
    tool: str


def _bodies(r: Rendered, markers: Markers, tools: list[str]) -> list[_Body]:
    """The call bodies of a rendered turn, in order, one per tool name."""
    raw = r.text.encode("utf-8")
    index = {off: i for i, off in enumerate(r.offsets)}
    start_m, end_m = markers.call_start.encode(), markers.call_end.encode()
    out, pos = [], 0
    for tool in tools:
        start = raw.find(start_m, pos)
        if start < 0:
            raise TemplateError("the rendered call has no start marker")
        s_end = start + len(start_m)
        end = raw.find(end_m, s_end)
        if end < 0:
            raise TemplateError("the rendered call has no end marker")
        e_end = end + len(end_m)
        if s_end not in index or e_end not in index:
            raise TemplateError("call markers are not token boundaries")
        j, k = index[s_end], index[e_end]
        j0 = bisect.bisect_right(r.offsets, start, 0, j) - 1   # the id holding the marker's start
        out.append(_Body(r.ids[j0:j], r.ids[j:k], raw[s_end:end].decode("utf-8"), tool))
        pos = e_end
    return out


def _head_probes(schema: ToolSchema) -> list[tuple[str, dict]]:
    """Probe calls covering every legal way this tool's call can begin."""
    if schema.sole_key is not None:
        argsets = [{schema.sole_key: v} for v in HEAD_VALUES]
    else:
        argsets = [{k: "x"} for k in schema.properties]
        if schema.open:
            argsets.append({EXTRA_KEY: "x"})
        if not schema.required:
            argsets.append({})
    return [(schema.name, a) for a in argsets]


def _free_bodies(prober: _Prober, markers: Markers, schemas: list[ToolSchema],
                 probes: list[tuple[str, dict]]) -> list[_Body] | None:
    """Bodies of the tools called with no arguments, for those whose head probes lack that
    call (a model may call a tool without the keys its schema requires); None when the
    template cannot render them."""
    calls = [(s.name, {}) for s in schemas if (s.name, {}) not in probes]
    if not calls:
        return []
    try:
        return prober.probe(calls, markers)
    except (TemplateError, jinja2.TemplateError):
        return None


# Names of tools a request does not offer, with initial letters of both cases: their calls
# show where the text every call begins with ends (:func:`_into_name`).
FOREIGN_NAMES = ("get", "Run", "example_function_name", "x")


def _foreign_bodies(prober: _Prober, markers: Markers, schemas: list[ToolSchema],
                    bodies: list[_Body]) -> list[_Body] | None:
    """Bodies of calls, without arguments, of :data:`FOREIGN_NAMES` the request does not
    offer (a model may call a tool it was not given); none where the offered tools' calls
    share no scaffold or one tool is offered (its scaffold runs into its name), None when the
    template cannot render them."""
    if len(schemas) < 2 or _common_prefix([b.ids for b in bodies]) < MIN_SPAN:
        return []
    offered = {s.name for s in schemas}
    try:
        return prober.probe([(name, {}) for name in FOREIGN_NAMES if name not in offered],
                            markers)
    except (TemplateError, jinja2.TemplateError):
        return None


def _close_probes(schema: ToolSchema) -> list[tuple[str, dict, str]]:
    """Complete calls of a tool with arguments, last value varied: (name, args, last value)."""
    if not schema.properties:
        return []
    out = []
    for v in CLOSE_VALUES:
        args = {k: "x" for k in schema.properties[:-1]}
        args[schema.properties[-1]] = v
        out.append((schema.name, args, v))
    return out


def _decode(table, ids: Sequence[int]) -> str | None:
    try:
        return ids_bytes(table, ids).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _letters(text: str) -> bool:
    return any(c.isalpha() for c in text)


class _Trie:
    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.tools: set[str] = set()
        self.leaf = False

    def add(self, ids: Sequence[int], tool: str) -> None:
        node = self
        node.tools.add(tool)
        for t in ids:
            node = node.children.setdefault(t, _Trie())
            node.tools.add(tool)
        node.leaf = True

    def chain(self) -> list[int]:
        """Ids along the unary path below this node (stops at a branch or a probe's end)."""
        out, node = [], self
        while len(node.children) == 1 and not node.leaf:
            (t, node), = node.children.items()
            out.append(t)
        return out


def _clean(span: list[int], eos: set[int], stops: set[int] | None = None) -> tuple[int, ...] | None:
    """The span, or None when it is too short or holds an EOS id. With ``stops`` (a syntax
    with stop tokens, EOS included) the span is cut before its first stop id instead."""
    if stops is not None:
        cut = next((i for i, t in enumerate(span) if t in stops), len(span))
        span = span[:cut]
    if len(span) < MIN_SPAN or any(t in eos for t in span):
        return None
    return tuple(span)


def stop_ids(tokenizer, syntax: CallSyntax, eos: set[int]) -> set[int] | None:
    """EOS ids plus the ids of the syntax's stop tokens; None for a syntax without stops
    (and without a forced head: spans holding EOS are dropped there)."""
    if not syntax.stops and syntax.forced is None:
        return None
    out = set(eos)
    for text in syntax.stops:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            out.add(ids[0])
    return out


def _forced_cut(table, syntax: CallSyntax, key: str, span: Sequence[int]) -> int:
    """How many leading ids of a head row's ``span``, written after body text ``key``, end
    inside the text the syntax's protocol forces (``CallSyntax.forced``: the ids the row keeps
    once :func:`_split_forced` cuts it); all of them in a syntax that forces no cut."""
    if syntax.forced is None:
        return len(span)
    text = _decode(table, span)
    m = re.match(syntax.forced, key + (text or ""))
    forced = m.end() if m and text is not None else len(key)
    cut = 0
    for i in range(1, len(span) + 1):
        part = _decode(table, span[:i])
        if part is not None and len(key) + len(part) <= forced:
            cut = i
    return cut


def _split_forced(rows: dict[str, Row], cuts: dict[str, int], table, syntax: CallSyntax,
                  eos: set[int]) -> dict[str, Row]:
    """Head rows cut where the syntax's forced text ends (``cuts``: per row key, its
    :func:`_forced_cut`): the part up to the last token boundary inside it keeps the row and
    its class; the rest becomes a
    ``header`` row (``likely``) keyed by the body after the first part. A row whose forced
    part is already written is a ``header`` row whole; a header key another row holds is
    dropped (ambiguous)."""
    out: dict[str, Row] = {}
    headers: dict[str, Row] = {}
    for key, row in rows.items():
        cut = cuts[key]
        head = _clean(list(row.span[:cut]), eos)
        if head is not None:
            out[key] = replace(row, span=head)
        rest = _clean(list(row.span[cut:]), eos)
        if rest is not None:
            hkey = row.key + (_decode(table, row.span[:cut]) or "")
            headers[hkey] = replace(row, kind="header", key=hkey,
                                    trigger=(*row.trigger, *row.span[:cut]), span=rest,
                                    certainty=certainty("header", syntax.name))
    for hkey, row in headers.items():
        if hkey not in out:
            out[hkey] = row
    return out


def _arguments_at(bodies: list[_Body], free: list[_Body] | None) -> dict[str, int]:
    """Per tool, how many leading body ids its probes share with its call without arguments
    (``free``, :func:`_free_bodies`): where what a call of the tool writes whatever its
    arguments ends. Without ``free`` (the template cannot render such a call), 0 for every
    tool: where that is cannot be told."""
    if free is None:
        return {b.tool: 0 for b in bodies}
    calls: dict[str, list[tuple[int, ...]]] = defaultdict(list)
    for b in [*bodies, *free]:
        calls[b.tool].append(b.ids)
    return {tool: _common_prefix(ids) for tool, ids in calls.items()}


def _into_name(span: tuple[int, ...], text: str | None, bodies: list[_Body],
               foreign: list[_Body] | None) -> bool:
    """Whether a scaffold ``span`` (every body's first ids), decoding to ``text`` (None: not
    text), writes what the model writes of a tool's name: text past where the earliest body's
    name begins, anywhere where a body's name is not in its text as written (where it begins
    cannot be told), or ids a call of a tool the request does not offer (``foreign``,
    :func:`_foreign_bodies`; None: not rendered) does not begin with (its name merges with
    the scaffold's last id: ``=`` then ``get`` is ``=get``)."""
    start = min(b.text.find(b.tool) for b in bodies)
    return (start < 0 or text is None or len(text) > start or foreign is None
            or any(b.ids[:len(span)] != span for b in foreign))


def _name_ends(bodies: list[_Body]) -> dict[str, int | None]:
    """Per tool, where its name ends in the text of its calls (the first body of the tool):
    its last occurrence that begins no later than where the bodies' texts part (every call
    writes its name after the same lead); None when its calls do not write the name as it is
    (escaped)."""
    lead = len(os.path.commonprefix([b.text for b in bodies]))
    ends: dict[str, int | None] = {}
    for b in bodies:
        if b.tool not in ends:
            at = b.text.rfind(b.tool, 0, lead + len(b.tool))
            ends[b.tool] = None if at < 0 else at + len(b.tool)
    return ends


def _head_rows(bodies: list[_Body], table, eos: set[int], syntax: str,
               after_call: bool, args_at: dict[str, int], foreign: list[_Body] | None,
               stops: set[int] | None = None) -> dict[str, Row]:
    """Scaffold and name rows, classed for a turn's first call or (``after_call``) a later one;
    ``args_at``: per tool, how many body ids a call writes whatever its arguments
    (:func:`_arguments_at`); ``foreign``: calls of tools the request does not offer
    (:func:`_foreign_bodies`)."""
    root = _Trie()
    for b in bodies:
        root.add(b.ids, b.tool)
    rows: dict[str, Row] = {}
    cuts: dict[str, int] = {}  # per row key, how many of its span ids the protocol forces
    triggers = {b.trigger for b in bodies}
    trigger_text = _decode(table, bodies[0].trigger) or ""
    if len(triggers) != 1 or not _letters(trigger_text):
        return rows
    trigger = bodies[0].trigger
    call_syntax = SYNTAXES[syntax]
    scaffold = root.chain()
    only = next(iter(root.tools)) if len(root.tools) == 1 else ""
    span = _clean(scaffold, eos, stops)
    if span is not None:
        text = _decode(table, span)
        kept = cuts[""] = _forced_cut(table, call_syntax, "", span)
        into = (_into_arguments(syntax, _decode(table, span[:kept]))
                or kept > min(args_at.values()))
        rows[""] = Row("scaffold", only, "", trigger, span,
                       certainty("scaffold", syntax, after_call=after_call,
                                 into_arguments=into,
                                 unsettled_name=_into_name(span, text, bodies, foreign)))
    node = root
    for t in scaffold:
        node = node.children[t]
    name_ends = _name_ends(bodies)

    def walk(n: _Trie, path: list[int]) -> None:
        for t, child in n.children.items():
            p = [*path, t]
            if len(child.tools) == 1:
                key = _decode(table, p)
                span = _clean(child.chain(), eos, stops)
                if key is not None and span is not None:
                    tool = next(iter(child.tools))
                    kept = cuts[key] = _forced_cut(table, call_syntax, key, span)
                    into = (_into_arguments(syntax, _decode(table, p + list(span[:kept])))
                            or len(p) + kept > args_at[tool])
                    end = name_ends[tool]
                    rows[key] = Row("name", tool, key, (*trigger, *p), span,
                                    certainty("name", syntax, after_call=after_call,
                                              into_arguments=into,
                                              unsettled_name=end is None or len(key) <= end))
            else:
                walk(child, p)

    if len(node.tools) > 1:
        walk(node, list(scaffold))
    return (_split_forced(rows, cuts, table, call_syntax, eos) if call_syntax.forced is not None
            else rows)


def resumed_heads(rows: dict[str, Row], table: Sequence[bytes]) -> dict[str, Row]:
    """Head rows entered mid-span: for a row whose first ``k`` span ids were emitted without
    the row firing (a gate kept only a prefix, or a batched step emitted one id first), the row
    keyed by the body after them (``key`` + their text), triggered by ``trigger`` + those ids,
    proposing the rest of the span with the row's own class and making the row's own claim
    (:attr:`Row.claim`). The rest of a forced span is forced by the same template text, so
    nothing about the row changes but where it starts.
    Close rows need none: every position after a value's end is a close row of its own.
    A key that a compiled row or another resumption already holds is dropped (ambiguous);
    a prefix that splits a UTF-8 character has no key."""
    out: dict[str, Row] = {}
    taken: set[str] = set()
    for row in rows.values():
        for k in range(1, len(row.span)):
            text = _decode(table, row.span[:k])
            if text is None:
                continue
            key = row.key + text
            if key in rows or key in taken:
                out.pop(key, None)
                taken.add(key)
                continue
            taken.add(key)
            out[key] = replace(row, key=key, trigger=(*row.trigger, *row.span[:k]),
                               span=row.span[k:], resumes=row.claim)
    return out


def _until_chosen(table, key: str, span: tuple[int, ...], chosen: str | None
                  ) -> tuple[int, ...]:
    """``span`` (written after ``key``) through the last token boundary at or before the end
    of the first ``chosen`` text in ``key`` + span, where the model starts writing a value of
    its own; empty when that value has begun in ``key``, whole when there is no ``chosen``."""
    text = _decode(table, span)
    at = (key + text).find(chosen) if chosen and text is not None else -1
    if at < 0:
        return span
    end, cut = at + len(chosen) - len(key), 0
    for i in range(1, len(span) + 1):
        part = _decode(table, span[:i])
        if part is not None and len(part) <= end:
            cut = i
    return span[:cut]


def _close_rows(prober: _Prober, markers: Markers, schemas: list[ToolSchema], syntax,
                eos: set[int], stops: set[int] | None = None) -> dict[str, Row]:
    """Close rows, keyed by the text since the last value ended: probed on the first
    :data:`CLOSE_TOOLS` tools with arguments, a row where every probe proposes the same span."""
    table = prober.table
    found: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = defaultdict(set)
    probed = [schema for schema in schemas if schema.properties][:CLOSE_TOOLS]
    probes = [p for schema in probed for p in _close_probes(schema)]
    if not probes:
        return {}
    bodies = prober.probe([(name, args) for name, args, _ in probes], markers)
    for (_, _, v), body in zip(probes, bodies):
        raw = body.text.encode("utf-8")
        v_end = raw.rfind(v.encode("utf-8"))
        if v_end < 0:
            continue
        v_end += len(v.encode("utf-8"))
        for i, key, inside in _value_ends(body, table, v_end, syntax, len(body.ids)):
            found[key].add((inside, _until_chosen(table, key, body.ids[i:], syntax.model_chosen)))
    return {key: Row("close", "", key, trigger, span, certainty("close", syntax.name))
            for key, (trigger, span) in _agreed(found, eos, stops).items()}


def _first_key_rows(prober: _Prober, markers: Markers, schemas: list[ToolSchema],
                    probes: list[tuple[str, dict]], bodies: list[_Body], syntax: str,
                    eos: set[int], stops: set[int] | None = None) -> dict[str, Row]:
    """Key rows for a call's first key, keyed by the call body so far: for a tool whose
    arguments may begin with more than one key, the first required key in the schema's order
    (:meth:`ToolSchema.next_required` of no keys), from where its head probe leaves the
    tool's other head probes (the end of its name row) to where the first value may begin
    (the ids its probes share over every :data:`HEAD_VALUES` value)."""
    table = prober.table
    firsts = [(s.name, key) for s in schemas if s.sole_key is None
              and (key := s.next_required(())) is not None]
    if not firsts:
        return {}
    varied = iter(prober.probe([(name, {key: w}) for name, key in firsts for w in HEAD_VALUES],
                               markers))
    rows: dict[str, Row] = {}
    for name, key in firsts:
        own = [next(varied) for _ in HEAD_VALUES]
        ids = own[0].ids
        shared = _common_prefix([b.ids for b in own])
        others = [b.ids for (tool, args), b in zip(probes, bodies)
                  if tool == name and list(args) != [key]]
        if not others:
            continue
        start = max(_common_prefix([ids, other]) for other in others)
        text = _decode(table, ids[:start])
        span = _clean(list(ids[start:shared]), eos, stops)
        if text is None or span is None:
            continue
        rows[text] = Row("key", f"{name}.{key}", text, (*own[0].trigger, *ids[:start]), span,
                         certainty("key", syntax))
    return rows


def _key_probes(schema: ToolSchema) -> list[tuple[str, str]]:
    """(the key before it, key) for every required key that follows another in the schema's
    order: where :meth:`ToolSchema.next_required` can name it after a written value."""
    props = schema.properties
    return [(props[i - 1], key) for i, key in enumerate(props) if i and key in schema.required]


def _common_prefix(seqs: list[tuple[int, ...]]) -> int:
    """How many leading ids every one of ``seqs`` shares."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        if len({s[i] for s in seqs}) != 1:
            return i
    return n


def _key_rows(prober: _Prober, markers: Markers, schemas: list[ToolSchema], syntax,
              eos: set[int], stops: set[int] | None = None) -> dict[tuple[str, str, str], Row]:
    """Key rows: for a key that follows ``before`` in a tool's schema, probe calls writing
    ``before`` then the key. With the first value fixed and the second varied (every
    :data:`HEAD_VALUES` type and first character), the ids all renders share end where the
    second value may begin; with the second fixed and the first varied (:data:`CLOSE_VALUES`),
    every token boundary after the first value's end where the guard reads that end gives a
    row keyed by the text since it, proposing the ids from there through that shared end."""
    table = prober.table
    pairs = [(s.name, before, key) for s in schemas for before, key in _key_probes(s)]
    if not pairs:
        return {}
    probes: list[tuple[str, dict]] = []
    for name, before, key in pairs:
        probes += [(name, {before: CLOSE_VALUES[0], key: w}) for w in HEAD_VALUES]
        probes += [(name, {before: v, key: HEAD_VALUES[0]}) for v in CLOSE_VALUES]
    bodies = iter(prober.probe(probes, markers))
    found: dict[tuple[str, str, str], set] = defaultdict(set)
    for name, before, key in pairs:
        varied = [next(bodies) for _ in HEAD_VALUES]
        shared = _common_prefix([b.ids for b in varied])
        end = _value_end(varied[0], before, CLOSE_VALUES[0])
        if end is None:
            continue
        span_end = _offsets(table, varied[0].ids)[shared] - end
        for v in CLOSE_VALUES:
            body = next(bodies)
            v_end = _value_end(body, before, v)
            if v_end is None:
                continue
            ends = _offsets(table, body.ids)[1:]
            stop = next((j for j, e in enumerate(ends) if e > v_end + span_end), len(body.ids))
            for i, text, inside in _value_ends(body, table, v_end, syntax, stop, (before,)):
                found[(text, name, key)].add((inside, body.ids[i:stop]))
    return {(text, name, key): Row("key", f"{name}.{key}", text, trigger, span,
                                   certainty("key", syntax.name))
            for (text, name, key), (trigger, span) in _agreed(found, eos, stops).items()}


def _offsets(table, ids: Sequence[int]) -> list[int]:
    """Byte offset where each of ``ids`` starts in their text, then the text's length."""
    out, pos = [], 0
    for t in ids:
        out.append(pos)
        pos += len(table[t])
    out.append(pos)
    return out


def _value_ends(body: _Body, table, v_end: int, syntax, stop: int,
                keys: tuple[str, ...] | None = None):
    """``(i, text, inside)`` for every token boundary ``i < stop`` of ``body`` after byte
    ``v_end`` where the guard reads an argument value ending at ``v_end`` (and, given
    ``keys``, exactly those keys written): ``text`` is the body text since the value's end,
    ``inside`` the ids between the value's end and the boundary."""
    raw = body.text.encode("utf-8")
    v_chars = len(raw[:v_end].decode("utf-8", errors="ignore"))
    offs = _offsets(table, body.ids)
    for i in range(stop):
        if offs[i] <= v_end:
            continue
        try:
            text = raw[v_end:offs[i]].decode("utf-8")
            state = syntax.parse(raw[:offs[i]].decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if state is None or state.value_end != v_chars or keys is not None and state.keys != keys:
            continue
        yield i, text, tuple(t for t, o in zip(body.ids[:i], offs[:i]) if o >= v_end)


def _agreed(found: dict, eos: set[int], stops: set[int] | None
            ) -> dict[object, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per key of ``found`` (its probes' ``(inside ids, span)`` options): ``(trigger, span)``
    where every probe proposes the same span (cleaned, :func:`_clean`), the trigger being the
    ids their insides end with alike; keys whose probes disagree, or whose span is too short,
    are left out."""
    out = {}
    for key, options in found.items():
        spans = {s for _, s in options}
        span = _clean(list(next(iter(spans))), eos, stops) if len(spans) == 1 else None
        if span is not None:
            out[key] = (_common_suffix([t for t, _ in options]), span)
    return out


def _value_end(body: _Body, before: str, value: str) -> int | None:
    """Byte offset in ``body.text`` right after ``value``, written as the value of ``before``."""
    raw = body.text.encode("utf-8")
    at = raw.find(before.encode("utf-8"))
    at = raw.find(value.encode("utf-8"), at + len(before.encode("utf-8"))) if at >= 0 else -1
    return None if at < 0 else at + len(value.encode("utf-8"))


def _common_suffix(seqs: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The trailing ids every one of ``seqs`` ends with."""
    common: list[int] = []
    for parts in zip(*(reversed(s) for s in seqs)):
        if len(set(parts)) != 1:
            break
        common.insert(0, parts[0])
    return tuple(common)


def awaits_reply(messages: list[dict] | None) -> bool:
    """Whether ``messages`` is a conversation a template renders and a reply follows: not
    empty (some templates raise on no message) and not ending with the assistant's own turn."""
    return bool(messages) and messages[-1].get("role") != "assistant"


def compile_table(tokenizer, messages: list[dict], tools: list[dict] | None,
                  template_kwargs: dict | None = None, primer: Primer | None = None
                  ) -> RowTable | None:
    """Compile strict rows for this conversation; None when there is nothing to compile.

    Raises ``ValueError`` (naming the path) for malformed tools/schemas. Returns None when there
    are no tools, the tokenizer has no tool-call markers, the conversation awaits no reply
    (:func:`awaits_reply`), or the template cannot render tool calls after the generation prompt.
    """
    schemas = tool_schemas(tools)
    markers = _markers(tokenizer)
    if not schemas or markers is None or not awaits_reply(messages):
        return None
    protocol = protocol_markers(getattr(tokenizer, "chat_template", None),
                                getattr(tokenizer, "eos_token", None))
    kwargs = dict(template_kwargs or {})
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    try:
        prober = _Prober(tokenizer, messages, tools, kwargs, primer)
        probes = [p for schema in schemas for p in _head_probes(schema)]
        bodies = prober.probe(probes, markers)
        content = prober.reply({"role": "assistant", "content": CONTENT_PROBE})
        if markers.call_start in content.text:
            return None
        if protocol is None or protocol[0] != markers:
            mixed = prober.turn([probes[0]], CONTENT_PROBE)
            before_call = mixed.text[: mixed.text.find(markers.call_start)]
            markers = replace(markers, inline_calls=before_call.endswith(CONTENT_PROBE))
        ref = bodies[0]
        syntax = detect_syntax(ref.text, probes[0][0], tuple(probes[0][1]))
        head, later, close = {}, {}, {}  # a syntax without a grammar compiles none
        if syntax.grammar_file is not None:
            stops = stop_ids(tokenizer, syntax, eos)
            first = _first_key_rows(prober, markers, schemas, probes, bodies, syntax.name, eos,
                                    stops)
            args_at = _arguments_at(bodies, _free_bodies(prober, markers, schemas, probes))
            foreign = _foreign_bodies(prober, markers, schemas, bodies)
            head = {**first, **_head_rows(bodies, prober.table, eos, syntax.name,
                                          after_call=False, args_at=args_at, foreign=foreign,
                                          stops=stops)}
            later = {**first, **_head_rows(bodies, prober.table, eos, syntax.name,
                                           after_call=True, args_at=args_at, foreign=foreign,
                                           stops=stops)}
            close = _close_rows(prober, markers, schemas, syntax, eos, stops)
    except (TemplateError, jinja2.TemplateError):
        return None  # the template cannot render tool calls after the generation prompt
    optional_close = {(text, s.name): replace(row, detail=s.name) for s in schemas
                      if not s.closable(tuple(s.required)) for text, row in close.items()}
    return RowTable(syntax.name, markers, {s.name: s for s in schemas}, head, close, ref.ids,
                    later, {}, optional_close)


def compile_tool_keys(table: RowTable, tool: str, tokenizer, messages: list[dict],
                      tools: list[dict], template_kwargs: dict | None = None) -> None:
    """Compile ``tool``'s key rows into ``table.keys``, once per table (``table.keyed``), by
    rendering probes in this conversation (which renders the table's reference body, as
    :func:`table_for` checked). A tool the table does not know, or a syntax without a grammar,
    compiles none; so does a template that cannot render the probes."""
    schema = table.tools.get(tool)
    if schema is None or tool in table.keyed:
        return
    table.keyed.add(tool)
    syntax = SYNTAXES[table.syntax]
    if syntax.grammar_file is None:
        return
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    try:
        prober = _Prober(tokenizer, messages, tools, dict(template_kwargs or {}))
        table.keys.update(_key_rows(prober, table.markers, [schema], syntax, eos,
                                    stop_ids(tokenizer, syntax, eos)))
    except (TemplateError, jinja2.TemplateError):
        return


def compile_all_keys(table: RowTable, tokenizer, messages: list[dict], tools: list[dict],
                     template_kwargs: dict | None = None) -> RowTable:
    """``table`` with every tool's key rows compiled (:func:`compile_tool_keys`): what an audit
    prints and checks."""
    for tool in table.tools:
        compile_tool_keys(table, tool, tokenizer, messages, tools, template_kwargs)
    return table


def reference_body(tokenizer, messages: list[dict], tools: list[dict], kwargs: dict,
                   table: RowTable, primer: Primer | None = None) -> tuple[int, ...] | None:
    """The first head probe's body ids rendered in THIS conversation (table reuse check)."""
    schema = next(iter(table.tools.values()))
    try:
        prober = _Prober(tokenizer, messages, tools, kwargs, primer)
        return prober.calls(_head_probes(schema)[:1], table.markers)[0].ids
    except (TemplateError, jinja2.TemplateError):
        return None


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()


def identity_key(tokenizer, tools: list[dict] | None, template_kwargs: dict | None) -> str:
    """Exact table identity: template, tools, tokenizer and kwargs hashes."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    tok_id = (getattr(hf, "name_or_path", ""), len(hf),
              sorted((i, t.content) for i, t in hf.added_tokens_decoder.items()))
    template = getattr(tokenizer, "chat_template", None) or getattr(hf, "chat_template", None)
    return _digest([_digest(template), _digest(tools), _digest(tok_id),
                    _digest(template_kwargs or {})])


_TABLES: dict[str, RowTable | None] = {}
_MAX_TABLES = 64


def table_for(tokenizer, messages: list[dict], tools: list[dict] | None,
              template_kwargs: dict | None = None, primer: Primer | None = None
              ) -> RowTable | None:
    """The cached table for this identity when this conversation renders the same reference
    call body; otherwise a freshly compiled one (cached when the identity is new). ``primer``:
    the conversation's :class:`Primer`, when the caller reads it too."""
    schemas = tool_schemas(tools)
    if not schemas or not awaits_reply(messages):
        return None
    key = identity_key(tokenizer, tools, template_kwargs)
    if key in _TABLES:
        table = _TABLES[key]
        if table is None:
            return None
        kwargs = dict(template_kwargs or {})
        body = reference_body(tokenizer, messages, tools, kwargs, table, primer)
        if body == table.reference_body:
            return table
        return compile_table(tokenizer, messages, tools, template_kwargs, primer)
    table = compile_table(tokenizer, messages, tools, template_kwargs, primer)
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = table
    return table
