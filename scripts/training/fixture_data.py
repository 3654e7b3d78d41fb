"""Training/eval conversations for the fixture models, from the real agent transcripts.

Sources (``fixtures/transcripts/dev.jsonl.gz``): pi (read/bash/edit/write, one long session),
tau-bench airline (structured calls, schemas from the session's ``tools``, compacted and limited to
the tools the session calls plus ``transfer_to_human_agents``), mini-swe-agent (bash
blocks parsed out of the text, turned into structured ``bash`` calls, the THOUGHT prose dropped).
Everything is rendered through the family's REAL chat template with the ``tools`` array.
Training uses :class:`Sequence` windows (header + consecutive turns, every assistant turn in the
window a target); eval uses one :class:`Example` per assistant turn: the session's system prompt
and first user message (both truncated) plus as many preceding turns as fit the token budget,
the target being the rendered turn up to and including the first stop token. Long tool results,
messages and argument strings are truncated so sequences stay short.

Split: whole sessions are held back for eval (pi has one session: its last ~12% of turns are held
back). Everything is deterministic for a given seed.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlx_fill.assets.checkout import TRANSCRIPTS

SOURCES = ("pi_mono", "tau_bench_gpt4o_airline", "mini_swe_agent_gemini3pro")
MAX_RESULT_CHARS = 320
MAX_MESSAGE_CHARS = 360
# argument strings are cut short: a tiny greedy model must learn to close the value (a long
# recorded command or file body teaches it to run on until it repeats itself)
MAX_ARGUMENT_CHARS = 48
MAX_SYSTEM_CHARS = 240
MAX_TARGET_TOKENS = 160

BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run one bash command in the repository shell and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The command to run."}},
                   "required": ["command"]}}}
_PI_DESCRIPTIONS = {
    "read": "Read the contents of a file.", "bash": "Execute a bash command in the current working directory.",
    "edit": "Edit a file by replacing exact text.", "write": "Write content to a file, creating it if needed.",
}


@dataclass
class Session:
    source: str
    session_id: str
    tools: list[dict]
    messages: list[dict]  # OpenAI chat messages (tool_calls in {"type","function":{name,arguments}} form)


@dataclass
class Example:
    source: str
    session_id: str
    prompt_ids: list[int]
    target_ids: list[int]
    expected_calls: list[dict] = field(default_factory=list)  # [{"name", "arguments"}], [] = prose
    tools: list[dict] = field(default_factory=list)


@dataclass
class Sequence:
    """One training sequence: a window of a session with loss on every assistant turn in it.
    ``spans`` are [start, end) index ranges of ``ids`` that are targets (a turn up to its stop)."""

    source: str
    ids: list[int]
    spans: list[tuple[int, int]]


def transcripts_path() -> Path:
    """``$MLX_FILL_TRANSCRIPTS`` (a folder holding ``dev.jsonl.gz``), else the repository's
    ``fixtures/transcripts``."""
    if os.environ.get("MLX_FILL_TRANSCRIPTS"):
        return Path(os.environ["MLX_FILL_TRANSCRIPTS"])
    return TRANSCRIPTS.parent


def _cut(text: str, limit: int) -> str:
    text = text or ""
    return text if len(text) <= limit else text[:limit].rstrip() + " …"


def _cut_arguments(arguments: dict) -> dict:
    return {k: (_cut(v, MAX_ARGUMENT_CHARS) if isinstance(v, str) else v) for k, v in arguments.items()}


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def _synthesized_tools(messages: list[dict], descriptions: dict[str, str]) -> list[dict]:
    """Schemas built from the observed argument keys/types (sessions without a tools array)."""
    seen: dict[str, dict[str, str]] = {}
    counts: dict[str, dict[str, int]] = {}
    calls: dict[str, int] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            props = seen.setdefault(call["name"], {})
            calls[call["name"]] = calls.get(call["name"], 0) + 1
            for key, value in call["arguments"].items():
                props.setdefault(key, _json_type(value))
                counts.setdefault(call["name"], {}).setdefault(key, 0)
                counts[call["name"]][key] += 1
    tools = []
    for name in sorted(seen):
        required = [k for k, n in counts.get(name, {}).items() if n == calls[name]]
        tools.append({"type": "function", "function": {
            "name": name, "description": descriptions.get(name, f"The {name} tool."),
            "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in seen[name].items()},
                           "required": required}}})
    return tools


def _compact_tool(tool: dict) -> dict:
    """Tool schema with the first sentence of each description and no parameter descriptions."""
    function = tool["function"]

    def strip(schema):
        if isinstance(schema, dict):
            return {k: strip(v) for k, v in schema.items() if k != "description"}
        if isinstance(schema, list):
            return [strip(v) for v in schema]
        return schema

    description = re.split(r"(?<=\.)\s", function.get("description", ""), maxsplit=1)[0]
    return {"type": "function", "function": {"name": function["name"], "description": description,
                                              "parameters": strip(function.get("parameters", {}))}}


def _normalize(row: dict) -> Session:
    source = row["source"]
    messages = []
    for raw in row["messages"]:
        role = raw["role"]
        if role == "system":
            messages.append({"role": "system", "content": _cut(raw["content"], MAX_SYSTEM_CHARS)})
        elif role == "user":
            messages.append({"role": "user", "content": _cut(raw["content"], MAX_MESSAGE_CHARS)})
        elif role == "tool":
            messages.append({"role": "tool", "content": _cut(raw["content"], MAX_RESULT_CHARS)})
        elif role == "assistant":
            content = raw.get("content") or ""
            calls = raw.get("tool_calls") or []
            if raw.get("inline_tool_calls"):
                # the THOUGHT prose around mini-swe-agent's bash block is dropped: the tiny models
                # cannot learn it in their CPU budget and it delays the call they must emit
                content = ""
            else:
                content = _cut(content, MAX_MESSAGE_CHARS)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [
                    {"type": "function", "function": {"name": c["name"], "arguments": _cut_arguments(c["arguments"])}}
                    for c in calls
                ]
            messages.append(message)
    if source == "tau_bench_gpt4o_airline":
        # the full airline schema set is ~1.4k tokens: keep the tools this session calls
        used = {c["function"]["name"] for m in messages for c in m.get("tool_calls", [])}
        used.add("transfer_to_human_agents")
        tools = [_compact_tool(t) for t in row["tools"] if t["function"]["name"] in used]
    elif source == "mini_swe_agent_gemini3pro":
        tools = [BASH_TOOL]
    else:
        flat = [{"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                for c in m.get("tool_calls", [])]} for m in messages]
        tools = _synthesized_tools(flat, _PI_DESCRIPTIONS)
    # consecutive user messages (pi's slash commands) merge into one turn
    merged: list[dict] = []
    for message in messages:
        if merged and message["role"] == "user" and merged[-1]["role"] == "user":
            merged[-1] = {"role": "user", "content": merged[-1]["content"] + "\n" + message["content"]}
        else:
            merged.append(message)
    return Session(source, row["session_id"], tools, merged)


def load_recordings() -> list[Session]:
    path = transcripts_path() / "dev.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return [_normalize(row) for row in rows if row["source"] in SOURCES]


def split_sessions(sessions: list[Session], seed: int) -> tuple[list[Session], list[Session]]:
    """(train, eval): ~12% of sessions per source held back; pi's single session split by turns."""
    rng = np.random.Generator(np.random.PCG64(seed))
    train, held = [], []
    for source in SOURCES:
        group = [s for s in sessions if s.source == source]
        if len(group) == 1:
            session = group[0]
            cut = int(len(session.messages) * 0.88)
            while cut < len(session.messages) and session.messages[cut]["role"] != "user":
                cut += 1
            head = session.messages[:cut]
            tail = [m for m in head if m["role"] in ("system",)][:1] + session.messages[cut:]
            train.append(Session(source, session.session_id, session.tools, head))
            held.append(Session(source, session.session_id + "#tail", session.tools, tail))
            continue
        order = rng.permutation(len(group))
        n_held = max(1, round(len(group) * 0.12))
        held += [group[i] for i in order[:n_held]]
        train += [group[i] for i in order[n_held:]]
    return train, held


class Renderer:
    """Renders windows of a session through the family template and cuts prompt/target ids."""

    def __init__(self, tokenizer, stop_ids: set[int], max_tokens: int):
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.max_tokens = max_tokens

    def _render(self, messages, tools, add_generation_prompt):
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def example(self, session: Session, index: int) -> Example | None:
        """The example for the assistant turn at ``messages[index]``: header (system + first user
        message) + the longest run of turns before it that fits; None when nothing fits."""
        messages = session.messages
        first_user, header = _header(messages)
        if first_user is None or index <= first_user:
            return None
        budget = self.max_tokens - MAX_TARGET_TOKENS
        start, estimate = index, sum(_approx_tokens(m) for m in header) + 400
        while start - 1 > first_user and estimate + _approx_tokens(messages[start - 1]) < budget:
            start -= 1
            estimate += _approx_tokens(messages[start])
        while True:
            while start < index and messages[start]["role"] == "tool":
                start += 1
            window = header + messages[start:index]
            prompt_text = self._render(window, session.tools, True)
            prompt = self._encode(prompt_text)
            if len(prompt) <= budget:
                break
            if start == index:
                return None
            start += 1
        turn = messages[index]
        follower = messages[index + 1] if index + 1 < len(messages) else {"role": "user", "content": "ok"}
        full_text = self._render(window + [turn, follower], session.tools, False)
        if not full_text.startswith(prompt_text):
            return None
        # the continuation is tokenized on its own, as generation after the prompt produces it
        # (the prompt may end inside what would otherwise be one token, e.g. Qwen3.5's "<think>\n")
        rest = self._encode(full_text[len(prompt_text):])
        stop = next((k for k, t in enumerate(rest) if t in self.stop_ids), None)
        if stop is None or stop + 1 > MAX_TARGET_TOKENS:
            return None
        expected = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in turn.get("tool_calls", [])]
        return Example(session.source, session.session_id, prompt, rest[: stop + 1], expected, session.tools)

    def sequences(self, session: Session) -> list[Sequence]:
        """Training windows of ``session``: header + consecutive turns, at most ``max_tokens`` ids,
        loss on each assistant turn whose generation prompt is a prefix of the window's rendering.
        Each window starts with the turn pair before its first new target as context, so every
        assistant turn is a target once and (except the first) sees at least one earlier turn."""
        messages = session.messages
        first_user, header = _header(messages)
        if first_user is None:
            return []
        targets = [k for k in range(first_user + 1, len(messages)) if messages[k]["role"] == "assistant"]
        header_tokens = len(self._encode(self._render(header, session.tools, True)))
        out, next_target = [], 0
        while next_target < len(targets):
            first = targets[next_target]
            start = first - 2 if next_target > 0 and first - 2 > first_user else first
            while start < first and messages[start]["role"] == "tool":
                start += 1
            # over-include by estimate; _window cuts at the exact token count
            end, estimate = first + 1, header_tokens + sum(_approx_tokens(m) for m in messages[start:first + 1])
            while end < len(messages) and estimate + _approx_tokens(messages[end]) < 1.5 * self.max_tokens:
                estimate += _approx_tokens(messages[end])
                end += 1
            sequence, covered = self._window(session, header, start, first, end)
            if sequence is not None:
                out.append(sequence)
            next_target = max(next_target + 1, sum(1 for k in targets if k < covered))
        return out

    def _window(self, session, header, start, first, end) -> tuple[Sequence | None, int]:
        """The sequence for ``messages[start:end]`` with targets from ``first`` on, cut to
        ``max_tokens``; and the message index up to which targets were taken."""
        messages = session.messages
        window = header + messages[start:end]
        follower = messages[end] if end < len(messages) else {"role": "user", "content": "ok"}
        full = self._render(window + [follower], session.tools, False)
        offset = len(header) - start
        boundaries = []
        for k in range(first, end):
            if messages[k]["role"] != "assistant":
                continue
            prompt = self._render(window[: k + offset], session.tools, True)
            if full.startswith(prompt):
                boundaries.append((k, len(prompt)))
        if not boundaries:
            return None, first + 1
        ids = self._encode(full[: boundaries[0][1]])
        spans, covered = [], first + 1
        for n, (k, at) in enumerate(boundaries):
            piece = self._encode(full[at: boundaries[n + 1][1] if n + 1 < len(boundaries) else len(full)])
            stop = next((j for j, t in enumerate(piece) if t in self.stop_ids), None)
            if stop is None or stop + 1 > MAX_TARGET_TOKENS or len(ids) + stop + 1 > self.max_tokens:
                if spans:
                    break
                return None, k + 1
            spans.append((len(ids), len(ids) + stop + 1))
            covered = k + 1
            ids = ids + piece
        return Sequence(session.source, ids[: spans[-1][1]], spans), covered


def _header(messages: list[dict]) -> tuple[int | None, list[dict]]:
    """(index of the first user message, the header every window starts with: the system
    prompt if any + that first user message); (None, []) without a user message."""
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return None, []
    return first_user, ([messages[0]] if messages[0]["role"] == "system" else []) + [messages[first_user]]


def _approx_tokens(message: dict) -> int:
    return len(json.dumps(message, ensure_ascii=False)) // 3 + 6
