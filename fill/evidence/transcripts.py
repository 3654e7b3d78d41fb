"""Recorded sessions rendered to token streams through a family's real chat template.

Loading (gzip or plain JSONL, corrupt lines skipped and reported) and the OpenAI-message form of
a recording (tools recorded or synthesized, inline-text harnesses without tools) come from
:mod:`mlx_fill.evidence.replay`, so the study and the replay harness see the same conversation.

:func:`render_recording` renders the WHOLE conversation once (non-thinking mode) and cuts it at
every assistant turn: the turn's output runs from after the template's assistant opener to its
end-of-turn token inclusive; everything else is prompt. A reply whose own text holds the
end-of-turn marker (an agent quoting a chat template) is not a turn: the marker, tokenized as the
special token it names, would end it early; its ids stay in the stream, as the history a later
request re-sends. Segments are tokenized separately, so the token stream is append-only across
turns (the history a later request re-sends is the same ids), which is what lets the study index
a session once. The one exception is the template's empty ``<think></think>`` block that the
non-thinking generation prompt appends: it is part of turn ``i``'s prompt (``think_ids``) but not
of the later history.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import jinja2

from .replay import _render_history, load_recordings, synthesize_tools

__all__ = ["RenderedTurn", "RenderedSession", "TemplateMarkers", "markers", "recorded_responses",
           "render_recording", "load_recordings", "seed_store"]

TEXT_LABEL = "(text)"


@dataclass(frozen=True)
class TemplateMarkers:
    """What the template writes around an assistant reply: ``opener`` (the generation prompt),
    ``think`` (the extra non-thinking block, possibly empty) and ``closer`` (end-of-turn)."""

    opener: str
    think: str
    closer: str


REPLY_PROBE = "\u2603"  # a reply no template writes around itself


def markers(tokenizer: Any) -> TemplateMarkers:
    """Probe the template: the generation prompt with and without ``enable_thinking=False``,
    and a reply in the history. Raises ValueError, saying why, for a template whose replies
    cannot be cut into turns this way: one whose generation prompt writes nothing, one whose
    non-thinking generation prompt rewrites the messages before it, a tokenizer with no
    end-of-turn token, a template that ends an earlier reply with another token, or one that
    refuses a conversation of one user message, or of a user message, a reply and a user
    message."""
    msgs = [{"role": "user", "content": "x"}]
    try:
        base = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        gen = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        nothink = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=False)
    except (jinja2.TemplateError, TypeError) as e:
        raise ValueError(f"the chat template refuses a conversation of one user message ({e}), "
                         f"so its replies cannot be cut into turns") from e
    if not gen.startswith(base) or not nothink.startswith(gen):
        raise ValueError("the chat template's generation prompt rewrites the "
                         "messages before it, so its replies cannot be cut into turns")
    if gen == base:
        raise ValueError("the chat template's generation prompt writes nothing before a reply, "
                         "so its replies cannot be found in a rendered conversation")
    closer = tokenizer.eos_token
    if not closer:
        raise ValueError("the tokenizer has no eos_token to end a turn")
    opener = gen[len(base):]
    history = _render(tokenizer, [*msgs, {"role": "assistant", "content": REPLY_PROBE}, *msgs], None)
    at = history.find(REPLY_PROBE, len(base))
    if history.startswith(base) and at >= 0:
        if not history.startswith(closer, at + len(REPLY_PROBE)):
            raise ValueError(f"the chat template ends an earlier reply with something other "
                             f"than the end-of-turn token {closer!r}, so its replies cannot be "
                             f"cut into turns")
        # a thinking-mode generation prompt that opens a think block (Qwen3.5) writes earlier
        # replies without it: the block is the non-thinking ``think``, not the opener
        opener = os.path.commonprefix([opener, history[len(base):at]]) or opener
    return TemplateMarkers(opener, nothink[len(base) + len(opener):], closer)


def _render(tokenizer: Any, history: list[dict], tools: list[dict] | None) -> str:
    """The whole conversation through the template (non-thinking); a template that refuses it
    (a Jinja error: roles out of its order, a field it requires; a value of a type its filters
    do not take, such as arguments that are no JSON object where it writes them key by key)
    raises ValueError."""
    try:
        return tokenizer.apply_chat_template(history, tools=tools, tokenize=False,
                                             add_generation_prompt=False, enable_thinking=False)
    except (jinja2.TemplateError, TypeError) as e:
        odd = any(not isinstance(c["function"]["arguments"], dict)
                  for m in history for c in m.get("tool_calls") or [])
        hint = "; a call's arguments are no JSON object" if isinstance(e, TypeError) and odd else ""
        raise ValueError(f"the chat template refuses the session ({e}{hint})") from e


@dataclass(frozen=True)
class RenderedTurn:
    """Output ids are ``tokens[start:end]``; ``labels[i]`` names the tool call (or ``(text)``)
    that output token ``i`` belongs to."""

    start: int
    end: int
    labels: tuple[str, ...]
    message_index: int


@dataclass
class RenderedSession:
    session_id: str
    transcript_source: str
    tokens: list[int]
    turns: list[RenderedTurn]
    think_ids: list[int]
    tools_origin: str
    messages: list[dict]
    tools: list[dict] | None


def _call_spans(text: str, names: list[str]) -> list[tuple[int, int, str]]:
    """Char spans of the ``<tool_call>`` blocks in an output, paired with the call names."""
    spans, pos = [], 0
    for name in names:
        a = text.find("<tool_call>", pos)
        if a < 0:
            break
        b = text.find("</tool_call>", a)
        b = len(text) if b < 0 else b + len("</tool_call>")
        spans.append((a, b, name))
        pos = b
    return spans


def template_history(history: list[dict]) -> list[dict]:
    """``history`` as a server hands it to the chat template: a call's ``arguments`` JSON string
    decoded where it holds an object (``mlx_lm.server`` and ``mlx-fill serve`` both do; a
    template that writes ``arguments | tojson`` would otherwise write the string escaped),
    any other string kept."""
    out = []
    for message in history:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_decoded(call) for call in calls]}
        out.append(message)
    return out


def _decoded(call: dict) -> dict:
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"])
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**fn, "arguments": arguments}} if isinstance(arguments, dict) else call


def render_recording(session: dict, tokenizer: Any, mk: TemplateMarkers | None = None
                   ) -> RenderedSession:
    """Render and tokenize one recorded session (see the module contract). Raises ValueError
    when the session cannot be rendered (a template that refuses it, a value nested too deeply)
    or the rendering cannot be cut into turns unambiguously."""
    mk = mk or markers(tokenizer)
    structured = session.get("tool_call_style") == "structured"
    if not structured:
        tools, origin = None, "none"
    elif session.get("tools"):
        tools, origin = session["tools"], "recorded"
        if not isinstance(tools, list):
            raise ValueError(f"tools: expected a list of tool objects, got {type(tools).__name__}")
    else:
        tools, origin = synthesize_tools(session["messages"]) or None, "synthesized"
    try:
        history = template_history(_render_history(session))
        text = _render(tokenizer, history, tools)
    except RecursionError as e:  # JSON reads deeper than Python's encoders and templates recurse
        raise ValueError("the session holds a value nested too deeply to render (tool "
                         "arguments or a tool schema)") from e
    assistants = [(i, m) for i, m in enumerate(history) if m["role"] == "assistant"]
    starts, pos = [], 0
    while True:
        i = text.find(mk.opener, pos)
        if i < 0:
            break
        starts.append(i + len(mk.opener))
        pos = i + 1
    if len(starts) != len(assistants):
        quoted = (f" (a message quotes the template's opener {mk.opener!r})"
                  if len(starts) > len(assistants) else "")
        raise ValueError(f"found {len(starts)} assistant openers for {len(assistants)} "
                         f"replies{quoted}")
    pieces: list[str] = []
    outputs: list[tuple[str, list[str], int, bool]] = []  # text, call names, message index, whole
    prev = 0
    for s, (mi, msg) in zip(starts, assistants):
        if mk.think and text.startswith(mk.think, s):
            s += len(mk.think)
        e = text.find(mk.closer, s)
        if e < 0:
            raise ValueError("assistant reply without an end-of-turn marker")
        e += len(mk.closer)
        pieces.append(text[prev:s])
        names = [c["function"]["name"] for c in msg.get("tool_calls") or []]
        whole = mk.closer not in json.dumps(msg, ensure_ascii=False)  # ends at its own marker
        outputs.append((text[s:e], names, mi, whole))
        pieces.append(text[s:e])
        prev = e
    pieces.append(text[prev:])
    backend = tokenizer._tokenizer.backend_tokenizer
    encs = backend.encode_batch(pieces, add_special_tokens=False)
    tokens: list[int] = []
    turns: list[RenderedTurn] = []
    for j, enc in enumerate(encs):
        if j % 2 == 1 and outputs[j // 2][3]:
            out_text, names, mi, _ = outputs[j // 2]
            spans = _call_spans(out_text, names)
            labels = []
            for a, _ in enc.offsets:
                labels.append(next((nm for x, y, nm in spans if x <= a < y), TEXT_LABEL))
            turns.append(RenderedTurn(len(tokens), len(tokens) + len(enc.ids), tuple(labels), mi))
        tokens.extend(enc.ids)
    think_ids = backend.encode(mk.think, add_special_tokens=False).ids if mk.think else []
    return RenderedSession(str(session.get("session_id", "")), str(session.get("source", "")),
                           tokens, turns, list(think_ids), origin, history, tools)


# Prompt ids kept in front of a recorded response: more than a store keeps of its prompt
# (:class:`~mlx_fill.spec.suffix.GlobalSuffixTree`'s ``context_tokens``).
RESPONSE_CONTEXT = 64


def recorded_responses(sessions: list[dict], tokenizer: Any
                       ) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Every assistant reply of ``sessions`` rendered through ``tokenizer``'s template
    (:func:`render_recording`), in order, as ``(the last RESPONSE_CONTEXT prompt ids before
    it, its ids)``: what a server that had served these sessions would have stored. Returns
    the pairs and how many sessions could not be rendered (skipped). Raises :func:`markers`'
    ValueError for a template whose replies cannot be cut into turns."""
    mk = markers(tokenizer)
    out: list[tuple[list[int], list[int]]] = []
    skipped = 0
    for session in sessions:
        try:
            rendered = render_recording(session, tokenizer, mk)
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        tokens = rendered.tokens
        out += [(tokens[max(0, t.start - RESPONSE_CONTEXT):t.start], tokens[t.start:t.end])
                for t in rendered.turns]
    return out, skipped


def seed_store(store: Any, sessions: list[dict], tokenizer: Any) -> str:
    """Fill ``store`` (a :class:`~mlx_fill.spec.suffix.GlobalSuffixTree`) with the replies of
    ``sessions`` (:func:`recorded_responses`), as a server that served them; returns a line
    saying how many were stored, how many its bounds kept, and how many sessions could not be
    rendered."""
    responses, unrendered = recorded_responses(sessions, tokenizer)
    store.seed(responses)
    return (f"{len(responses)} replies stored, {len(store.docs)} kept ({len(store):,} ids), "
            f"{unrendered} sessions not rendered")
