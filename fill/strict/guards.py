"""Parser-state guards for strict rows: where in an assistant turn the stream currently is.

A strict row may fire only where the tool-call protocol, not the model, decides the next text.
Two layers establish that:

* :class:`TurnGuard` follows the role of the stream incrementally (O(new chars) per call):
  reasoning (inside ``<think>``), content, fenced code in content, or the body of a tool call.
  A call opens only on the COMPLETE start marker written in content, at the start of a line
  (or right after closed reasoning or a previous call; after text only for templates that
  write calls inline, and then never quoted or in inline code), outside fenced code and
  outside reasoning. Anything else (a ``<tool_call>`` quoted in prose, inside a code fence,
  mentioned while reasoning, or nested inside another call's body) does not open a call. A malformed or ambiguous call (nested start marker, duplicate keys) is
  declined: no row fires until that call has ended.
* :class:`CallSyntax` parses a call body prefix with a lark grammar per tool-call syntax
  (``xml`` for Qwen3-Coder / Qwen3.5, ``hermes-json`` for Qwen3, ``glm`` for GLM-4.x,
  ``harmony`` for gpt-oss, ``llama-json`` for Llama 3.x, ``mistral`` for Mistral
  ``[TOOL_CALLS]``; :func:`protocol_markers` gives the markers of the last three). A prefix
  parses only when it ends right after a complete delimiter (``</parameter>``, never
  ``</parameter`` followed by ``ization>``), with full input consumption and no repair. The
  ``generic`` syntax parses nothing, so every guarded decision declines.

Values are raw text in ``xml`` and ``glm`` (``CallSyntax.raw_values``): a value may hold any
delimiter of the syntax, the call's end and start markers included, so a parser state after a
value has begun is never certain that the value has ended (``mlx_fill.strict.rows.certainty`` classes
the rows that fire there ``likely``). In ``hermes-json`` values are JSON: a string cannot hold an
unescaped quote, so the guard reads call markers only outside strings and a ``</tool_call>``
written inside a string value neither ends the call nor opens another. ``harmony``,
``llama-json`` and ``mistral`` bodies are JSON the same way: ``<|call|>``, ``<|eot_id|>`` or
``[TOOL_CALLS]`` written inside an argument string is text to the guard (the tokenizers map
such text to the special id when a template renders it, so the guard reads text, never ids).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError


@dataclass(frozen=True)
class CallPrefix:
    """A call body prefix that ends right after a complete structural delimiter.

    ``keys`` are the argument keys in order (duplicates preserved so callers can decline);
    ``value_end`` is the index in the body right after the last argument value's content
    (before a JSON string's closing quote), or None when no argument has been written;
    ``closed`` is True once the function/arguments object itself is closed.
    """

    tool: str
    keys: tuple[str, ...]
    value_end: int | None
    closed: bool


_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n(?s:(.*?))\n</parameter>\n?")
_XML_FUNC = re.compile(r"<function=([^>\n]+)>\n")
_GLM_ARG = re.compile(r"<arg_key>([^<\n]*)</arg_key>\n?<arg_value>(?s:(.*?))</arg_value>\n?")


class _XmlCall(Transformer):
    def start(self, items: list) -> CallPrefix:
        name, keys, value_end, closed = "", [], None, False
        for it in items:
            if isinstance(it, Token) and it.type == "FUNC_OPEN":
                name = _XML_FUNC.match(str(it)).group(1)
            elif isinstance(it, Token) and it.type == "FUNC_CLOSE":
                closed = True
            else:
                key, end = it
                keys.append(key)
                value_end = end
        return CallPrefix(name, tuple(keys), value_end, closed)

    def param(self, items: list) -> tuple[str, int]:
        tok = items[0]
        m = _XML_PARAM.match(str(tok))
        return m.group(1), tok.start_pos + m.end(2)


class _GlmCall(Transformer):
    def start(self, items: list) -> CallPrefix:
        name = str(items[0]).strip()
        keys = [k for k, _ in items[1:]]
        value_end = items[-1][1] if len(items) > 1 else None
        return CallPrefix(name, tuple(keys), value_end, False)

    def arg(self, items: list) -> tuple[str, int]:
        tok = items[0]
        m = _GLM_ARG.match(str(tok))
        return m.group(1), tok.start_pos + m.end(2)


def _call_name(tok: Token) -> str | None:
    """The tool name a token of a JSON-argument call holds (None for other tokens)."""
    if tok.type == "NAME":                        # harmony: ".NAME" after "to=functions"
        return str(tok)[1:]
    if tok.type == "NAME_REST":                   # llama-json: the rest of the name string
        return json.loads('"' + str(tok))
    if tok.type == "STRING":                      # hermes-json, mistral: the "name" string
        return json.loads(str(tok))
    return None


class _JsonCall(Transformer):
    def start(self, items: list) -> CallPrefix:
        name = next(n for it in items if isinstance(it, Token)
                    and (n := _call_name(it)) is not None)
        pairs = [it for it in items if isinstance(it, tuple)]
        closed = any(isinstance(it, _Closers) for it in items)
        value_end = pairs[-1][1] if pairs else None
        return CallPrefix(name, tuple(k for k, _ in pairs), value_end, closed)

    def pair(self, items: list) -> tuple[str, int]:
        key, value = items
        if isinstance(value, Token):
            end = value.end_pos - 1 if value.type == "STRING" else value.end_pos
        else:
            end = value.end_pos
        return json.loads(str(key)), end

    def closers(self, items: list) -> "_Closers":
        return _Closers()

    @v_args(meta=True)
    def object(self, meta, items: list) -> "_Nested":
        return _Nested(meta.end_pos)

    @v_args(meta=True)
    def array(self, meta, items: list) -> "_Nested":
        return _Nested(meta.end_pos)


@dataclass(frozen=True)
class _Nested:
    """A nested JSON value; only where it ends matters to the guard."""

    end_pos: int


class _Closers:
    """Marks that the arguments object (and maybe the call object) is closed."""


@dataclass(frozen=True)
class CallSyntax:
    """A tool-call body syntax: ``parse(body)`` returns the prefix state or None (decline).

    ``raw_values``: argument values are raw text that may hold any of the syntax's delimiters
    (False only where values are quoted JSON).
    ``forced``: where set, a regex matched at the start of a call body whose match is the text
    the protocol forces (the rest of the name and the template's name-to-arguments text); a
    head row is cut there, its part beyond is the model's own (``likely``). None keeps a head
    row whole (the syntaxes that class rows without a cut, see ``rows.certainty``).
    ``stops``: texts of stop tokens that end a call or turn (never proposed; a span is cut
    before them). ``model_chosen``: text after which the model writes a value of its own
    choosing (Mistral's call id); a close span is cut right after it.
    """

    name: str
    grammar_file: str | None
    raw_values: bool = True
    forced: str | None = None
    stops: tuple[str, ...] = ()
    model_chosen: str | None = None

    def parse(self, body: str) -> CallPrefix | None:
        if self.grammar_file is None:
            return None
        parser, transformer = _parser(self.grammar_file)
        try:
            tree = parser.parse(body)
            result = transformer.transform(tree)
        except LarkError:
            return None
        return result if isinstance(result, CallPrefix) else None


_TRANSFORMERS = {"xml_call.lark": _XmlCall, "glm_call.lark": _GlmCall,
                 "hermes_json.lark": _JsonCall, "harmony_call.lark": _JsonCall,
                 "llama_json.lark": _JsonCall, "mistral_call.lark": _JsonCall}


@lru_cache(maxsize=None)
def _parser(grammar_file: str) -> tuple[Lark, Transformer]:
    text = resources.files("mlx_fill.strict").joinpath("grammars", grammar_file).read_text()
    parser = Lark(text, parser="lalr", propagate_positions=True, maybe_placeholders=False)
    return parser, _TRANSFORMERS[grammar_file]()


SYNTAXES: dict[str, CallSyntax] = {
    "xml": CallSyntax("xml", "xml_call.lark"),
    "hermes-json": CallSyntax("hermes-json", "hermes_json.lark", raw_values=False),
    "glm": CallSyntax("glm", "glm_call.lark"),
    "harmony": CallSyntax("harmony", "harmony_call.lark", raw_values=False,
                          forced=r"\.[^<\s\"{]*", stops=("<|call|>", "<|return|>", "<|end|>")),
    "llama-json": CallSyntax("llama-json", "llama_json.lark", raw_values=False,
                             forced=r'(?:[^"\\\n]|\\.)*(?:", "parameters": )?',
                             stops=("<|eot_id|>", "<|eom_id|>")),
    "mistral": CallSyntax("mistral", "mistral_call.lark", raw_values=False,
                          forced=r'\[\{"name": "(?:[^"\\\n]|\\.)*(?:", "arguments": )?',
                          model_chosen='"id": "'),
    "generic": CallSyntax("generic", None),
}


def detect_syntax(body: str, tool: str, keys: tuple[str, ...]) -> CallSyntax:
    """The syntax whose grammar reads a complete rendered call body as exactly this call.

    ``body`` is the text between the start and end markers of a call the template rendered
    with ``tool`` and argument ``keys``; the generic (always declining) syntax when none does.
    """
    for syntax in SYNTAXES.values():
        got = syntax.parse(body)
        if got is not None and got.tool == tool and got.keys == keys:
            return syntax
    return SYNTAXES["generic"]


class Role(str, Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"


@dataclass(frozen=True)
class Markers:
    """Role-changing markers of a tokenizer/template (empty strings when absent).

    ``inline_calls``: the template writes a call right after content text on the same line
    (GLM-4.7-Flash), so a start marker after text opens a call unless it is quoted or inside
    inline code; otherwise a call opens only at the start of a line.
    ``open_after``: texts that may stand before the start marker besides whitespace.
    ``turn_start_only``: a call opens only where nothing but whitespace and an ``open_after``
    text precedes it in the turn's content, or since the last ``message_start`` (Llama 3.x: a
    call is the whole reply; harmony: a call is a message of its own, opened by
    ``<|start|>assistant``, or the reply right after the generation prompt's); never after a
    call has ended until a new message starts.
    """

    call_start: str
    call_end: str
    think_start: str = ""
    think_end: str = ""
    inline_calls: bool = False
    open_after: tuple[str, ...] = ()
    turn_start_only: bool = False
    message_start: str = ""


def protocol_markers(chat_template: str | None, eos_token: str | None) -> tuple[Markers, str] | None:
    """Markers and syntax name of a template whose call protocol mlx-lm gives no (or no end)
    marker for: gpt-oss harmony, Llama 3.x JSON, Mistral ``[TOOL_CALLS]``; else None.

    * harmony: a call opens on ``to=functions`` (its ``.`` merges with the name's first token)
      at the start of an assistant message (the reply, or after ``<|start|>``), after
      ``assistant`` and/or ``<|channel|>commentary``, and ends with ``<|call|>``; the analysis
      channel is reasoning. A final-channel line that starts with ``to=functions`` is prose.
    * Llama 3.x: a call is the reply itself, opening with ``{"name": "`` (optionally after
      ``<|python_tag|>``) and ending with ``<|eot_id|>``.
    * Mistral: ``[TOOL_CALLS]`` opens the call list, EOS ends it.
    """
    if not isinstance(chat_template, str):
        return None
    if "<|call|>" in chat_template and "<|channel|>" in chat_template:
        return Markers("to=functions", "<|call|>", "<|channel|>analysis<|message|>", "<|end|>",
                       open_after=("assistant", "<|channel|>commentary",
                                   "assistant<|channel|>commentary"),
                       turn_start_only=True, message_start="<|start|>"), "harmony"
    if '{"name": "' in chat_template and '"parameters": ' in chat_template:
        return Markers('{"name": "', "<|eot_id|>", open_after=("<|python_tag|>",),
                       turn_start_only=True), "llama-json"
    if "[TOOL_CALLS]" in chat_template and eos_token:
        return Markers("[TOOL_CALLS]", eos_token), "mistral"
    return None


_FENCE = "```"
# What ends a run of JSON string content: the closing quote, an escape, or a raw newline (which
# a JSON string cannot hold, as in the grammar: the string was malformed and has ended).
_STRING_STOP = re.compile(r'["\\\n]')


class TurnGuard:
    """Incremental role state of one assistant turn.

    ``feed(text)`` consumes newly decoded text. ``role`` is the current role; ``body`` the
    text of the current call after its start marker (only while ``role is Role.CALL``);
    ``declined`` is True while the current call may not be filled; ``last_body`` is the body of
    the most recently ended call (``calls_ended`` counts them). ``string_broken``: a JSON string
    of this turn was ended by a raw newline (which no JSON string holds); the model may still
    be inside it, so what the guard reads after it is a guess. ``call_prefix()`` parses
    ``body`` with the syntax's grammar (memoized per body length).
    """

    def __init__(self, syntax: CallSyntax, markers: Markers, initial: Role) -> None:
        if not markers.call_start or not markers.call_end:
            raise ValueError("a turn guard needs both tool-call markers")
        self.syntax = syntax
        self.markers = markers
        self.role = initial
        self.body = ""
        self.declined = False
        self.calls_ended = 0
        self.last_body = ""
        self.string_broken = False
        self._line = ""          # content text since the last newline (outside calls)
        self._tail = ""          # last chars, for marker detection
        self._in_fence = False
        self._window = max(len(m) for m in (markers.call_start, markers.call_end,
                                            markers.think_start, markers.think_end,
                                            markers.message_start, _FENCE))
        self._parsed_len = -1
        self._parsed: CallPrefix | None = None
        self._in_string = False  # JSON bodies: inside a string value (markers are text there)
        self._escape = False
        # a start marker that ends inside a string (Llama's {"name": ") opens the body in it
        self._opens_in_string = markers.call_start.count('"') % 2 == 1
        # turn_start_only: the content of the turn (or message) so far, kept while it could
        # precede a call; None once it cannot (too long, or a call has ended)
        self._head_cap = len(markers.call_start) + max(map(len, markers.open_after), default=0) + 16
        self._head: str | None = ""

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self.role is Role.CALL:
                i = self._feed_call(text, i)
            else:
                self._step(text[i])
                i += 1

    def _ends(self, marker: str) -> bool:
        return bool(marker) and self._tail.endswith(marker)

    def _feed_call(self, text: str, i: int) -> int:
        """Consume call-body text from ``text[i:]`` up to and including the end marker, in one
        piece (a long argument value costs O(its length), not O(length^2))."""
        if not self.syntax.raw_values:
            return self._feed_json_call(text, i)
        m = self.markers
        scan = self._tail + text[i:]
        end = scan.find(m.call_end)
        stop = len(scan) if end < 0 else end + len(m.call_end)
        if m.call_start in scan[:stop]:
            self.declined = True               # a start marker inside a call body
        chunk = text[i: i + stop - len(self._tail)]
        self.body += chunk
        self._tail = scan[:stop][-self._window:]
        if end >= 0:
            self.last_body = self.body[: -len(m.call_end)]
            self.role, self.body, self.declined = Role.CONTENT, "", False
            self._line = ""                    # a call may follow a call directly
            self._head = None                  # turn_start_only: not before a new message
            self.calls_ended += 1
        return i + len(chunk)

    def _feed_json_call(self, text: str, i: int) -> int:
        """:meth:`_feed_call` for JSON bodies: markers count only outside string values."""
        m = self.markers
        start = i
        while i < len(text):
            if self._in_string:
                if self._escape:
                    self._escape, i = False, i + 1
                    continue
                stop = _STRING_STOP.search(text, i)
                if stop is None:
                    i = len(text)
                    continue
                if stop.group() == "\n":
                    self._in_string, self.string_broken, i = False, True, stop.start()
                elif stop.group() == "\\":
                    self._escape, i = True, stop.end()
                else:
                    self._in_string, self._tail, i = False, "", stop.end()
                continue
            ch = text[i]
            i += 1
            if ch == '"':
                self._in_string, self._tail = True, ""
                continue
            self._tail = (self._tail + ch)[-self._window:]
            if self._ends(m.call_start):
                self.declined = True           # a start marker inside a call body
            if self._ends(m.call_end):
                self.body += text[start:i]
                self.last_body = self.body[: -len(m.call_end)]
                self.role, self.body, self.declined = Role.CONTENT, "", False
                self._line = ""
                self._head = None
                self.calls_ended += 1
                return i
        self.body += text[start:i]
        return i

    def _step(self, ch: str) -> None:
        """One character outside a call body: reasoning or content."""
        self._tail = (self._tail + ch)[-self._window:]
        m = self.markers
        if self.role is Role.REASONING:
            if self._ends(m.think_end):
                self.role, self._line = Role.CONTENT, ""   # a call may follow reasoning directly
            return
        self._line = "" if ch == "\n" else self._line + ch
        if m.turn_start_only:
            if m.message_start and self._ends(m.message_start):
                self._head = ""
            elif self._head is not None:
                self._head = self._head + ch if len(self._head) < self._head_cap else None
        if self._ends(_FENCE) and self._line.strip() == _FENCE:
            self._in_fence = not self._in_fence
        elif not self._in_fence and self._ends(m.think_start):
            self.role = Role.REASONING
        elif not self._in_fence and self._ends(m.call_start) and self._opens_here():
            self.role, self.body, self.declined = Role.CALL, "", False
            self._tail, self._parsed_len = "", -1
            self._in_string, self._escape = self._opens_in_string, False

    def _opens_here(self) -> bool:
        """Is the start marker that just completed in a structural position?"""
        m = self.markers
        if m.turn_start_only:
            return (self._head is not None
                    and self._head[: -len(m.call_start)].strip() in ("", *m.open_after))
        before = self._line[: -len(m.call_start)]
        if before.strip() in ("", *m.open_after):
            return True
        return (self.markers.inline_calls and before.count("`") % 2 == 0
                and not before.rstrip().endswith(('"', "'", "`")))

    def call_prefix(self) -> CallPrefix | None:
        """The parsed current call body, or None when it is not at a complete delimiter."""
        if self.role is not Role.CALL or self.declined:
            return None
        if self._parsed_len != len(self.body):
            self._parsed_len = len(self.body)
            self._parsed = self.syntax.parse(self.body)
            if self._parsed is not None and len(set(self._parsed.keys)) != len(self._parsed.keys):
                self.declined = True           # duplicate keys: the call is not well formed
                self._parsed = None
        return self._parsed
