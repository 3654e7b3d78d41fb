"""What ``mlx-fill serve`` makes of decoded text: content streamed as it becomes final, reasoning
held apart, stop strings cut, and tool calls parsed with the tokenizer's own tool parser."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any


class OutputSplitter:
    """Accumulates decoded text, cuts it at the first stop string, and streams the part that is
    final content: after a reasoning block (``<think>...</think>`` when the tokenizer has one,
    opened by the output or left open by the prompt), before a tool-call start marker, minus any
    tail that could still begin a marker or a stop string. :func:`split_output` splits the
    finished text the same way, so streamed content equals non-streamed content."""

    def __init__(self, tokenizer: Any, stop: list[str], on_text: Callable[[str], None] | None,
                 *, thinking_open: bool = False):
        self.text = ""
        self.stop = stop
        self.start = getattr(tokenizer, "tool_call_start", None) or None
        thinking = getattr(tokenizer, "has_thinking", False)
        self.think_start = getattr(tokenizer, "think_start", None) if thinking else None
        self.think_end = getattr(tokenizer, "think_end", None) if thinking else None
        self.thinking_open = thinking_open and self.think_end is not None
        self.on_text = on_text
        self.sent: int | None = None
        self.stopped = False

    def feed(self, segment: str) -> bool:
        """Add decoded text; True when a stop string was reached."""
        self.text += segment
        for s in self.stop:
            i = self.text.find(s)
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = True
        self._flush(final=self.stopped)
        return self.stopped

    def _body_start(self, final: bool) -> int | None:
        """Where content begins in ``text``; None while that is not known yet."""
        if self.think_end is None:
            return 0
        if self.think_end in self.text:
            head, tail = self.text.split(self.think_end, 1)
            if not tail.strip("\n") and not final:
                return None  # split_output drops the newlines after the block
            return len(head) + len(self.think_end) + len(tail) - len(tail.lstrip("\n"))
        if final:
            return 0  # an unclosed block stays content, as in split_output
        if self.thinking_open:
            return None
        lead = self.text.lstrip()
        if self.think_start and (lead.startswith(self.think_start) or self.think_start.startswith(lead)):
            return None
        return 0

    def _flush(self, final: bool) -> None:
        if self.on_text is None:
            return
        if self.sent is None:
            self.sent = self._body_start(final)
            if self.sent is None:
                return
        end = len(self.text)
        if self.start and self.start in self.text[self.sent:]:
            end = self.text.index(self.start, self.sent)
        elif not final:
            for marker in [m for m in (self.start, *self.stop) if m]:
                for k in range(min(len(marker) - 1, end), 0, -1):
                    if self.text.endswith(marker[:k]):
                        end = min(end, len(self.text) - k)
                        break
        if end > self.sent:
            self.on_text(self.text[self.sent:end])
            self.sent = end

    def finish(self) -> str:
        self._flush(final=True)
        return self.text


def split_output(tokenizer: Any, text: str, tools: list | None) -> tuple[str, str, list[dict]]:
    """(content, reasoning, tool_calls) of a finished completion, tool calls parsed by the
    tokenizer's mlx-lm tool parser; an unparsable call stays in the content."""
    reasoning = ""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if getattr(tokenizer, "has_thinking", False) and end and end in text:
        head, text = text.split(end, 1)
        reasoning = head.split(start, 1)[-1] if start else head
        reasoning, text = reasoning.strip("\n"), text.lstrip("\n")
    call_start = getattr(tokenizer, "tool_call_start", None)
    call_end = getattr(tokenizer, "tool_call_end", None)
    parser = getattr(tokenizer, "tool_parser", None)
    if not (tools and call_start and parser):
        return text, reasoning, []
    content, calls, rest = [], [], text
    while call_start in rest:
        before, rest = rest.split(call_start, 1)
        content.append(before)
        body, sep, rest = rest.partition(call_end) if call_end else (rest, "", "")
        try:
            parsed = parser(body.strip(), tools)
        except Exception:  # noqa: BLE001 -- mlx-lm's parser on model text: any failure is unparsable
            parsed = None
        found = [openai_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        if not found or None in found:
            content.append(call_start + body + sep)
            continue
        calls.extend(found)
    content.append(rest)
    return "".join(content), reasoning, calls


def openai_call(call: Any) -> dict | None:
    """An OpenAI ``tool_calls`` item for one call mlx-lm's parser returned (``{"name",
    "arguments"}``; a call without arguments takes none, ``{}``), or None for a shape that is
    not a call (no string name)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}}
