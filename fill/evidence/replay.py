"""``mlx-fill replay`` and ``mlx-fill ab``: replay recorded agent sessions against OpenAI endpoints.

The transcript is the environment. For every selected assistant turn the request holds the
RECORDED conversation up to that turn (never the model's own earlier replies), with tool results
verbatim from the recording, so every arm sees identical inputs and pairs on (session, turn, rep).

``mlx-fill ab`` arms: ``A`` is the reference (``--url-a``); every ``--url-b`` is a candidate that
the report pairs with A (see :func:`candidate_arms` for their names and :func:`schedule` for the
order of requests).

Rendering contract for the recorded history:

* ``structured`` sessions send assistant turns as ``content`` + ``tool_calls`` (ids kept, or
  ``call_<message>_<k>`` when the recording has none; arguments as the recorded raw string when
  present) and tool results as ``role: tool`` bound to their call id. The session's ``tools``
  array is sent; when it has none, one is synthesized from the recorded calls (per tool: the
  union of observed argument keys, keys present in every call ``required``, a JSON type where
  all observed values agree) and the session is marked ``tools_origin = "synthesized"``.
* ``inline_text`` sessions never had a tools array: their calls live in the assistant text, and
  their tool results went back to the model as user messages, so they are sent that way, with
  no tools (``tools_origin = "none"``).

A turn is an assistant message that follows a non-assistant message. Corrupt transcript lines
(unparsable JSON, no ``messages`` list) are skipped and reported. Sessions logged as OpenAI chat
or Anthropic Messages are read too (:mod:`mlx_fill.evidence.log_formats`), and Claude Code and
Codex CLI session logs (:mod:`mlx_fill.evidence.claude_code_log`,
:mod:`mlx_fill.evidence.codex_log`), and API-proxy logs (:mod:`mlx_fill.evidence.proxy_log`).

Timing is client-side, from sending the request: ``wall_s`` to the end of the reply, ``ttft_s``
to the first content or tool-call delta, ``first_tool_call_s`` to the first tool-call delta
(``mlx_lm.server`` streams each call whole once it is parsed, so this is when the first call was
complete). The last two need ``--stream`` (the default). ``usage.fill`` is recorded verbatim when
the server reports it (mlx-fill servers), else None.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from . import report
from .claude_code_log import is_event, sessions_from_events
from .codex_log import is_rollout_line, rollout_line_problem, sessions_from_rollout
from .log_formats import CALL_PARTS, as_recording, quoted
from .proxy_log import ProxyLog, is_exchange
from mlx_fill.core.errors import NOT_REGULAR, UserError, float_in, int_up_to, output_dir, positive_int

JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
              (list, "array"), (dict, "object"), (type(None), "null"))


# ----------------------------------------------------------------------------- transcripts

@dataclass(frozen=True)
class CorruptLine:
    """A skipped line of a transcripts file: its number, why, and (read from a folder) the
    file's path in the folder (:func:`path_text`)."""

    line: int
    reason: str
    file: str = ""

    @property
    def where(self) -> str:
        """The line as a message names it."""
        return f"{self.file} line {self.line}" if self.file else f"line {self.line}"


TRANSCRIPT_FILES = (".jsonl", ".jsonl.gz")  # the names a folder's transcripts files end in


def _transcript_paths(folder: Path) -> Iterator[Path]:
    """The transcripts files in ``folder`` at any depth (:data:`TRANSCRIPT_FILES`), as found,
    each real file once: a symlinked folder is walked as the folder it links to, each real
    folder once (a link to one walked already, such as an ancestor, is not entered again);
    folders that are no links are walked first, and symlinked files come last, so that a file
    is named by a path without a link where it has one."""
    seen: set[tuple[int, int]] = set()  # (device, inode) of the folders walked, files found
    linked: list[Path] = []
    for top, folders, names in os.walk(folder, followlinks=True):
        if not _first_sight(Path(top), seen):
            folders.clear()
            continue
        folders.sort(key=lambda name: (os.path.islink(os.path.join(top, name)), name))
        for path in (Path(top, name) for name in sorted(names) if name.endswith(TRANSCRIPT_FILES)):
            if path.is_symlink():
                linked.append(path)
            elif path.is_file() and _first_sight(path, seen):
                yield path
    yield from (path for path in linked if path.is_file() and _first_sight(path, seen))


def _first_sight(path: Path, seen: set[tuple[int, int]]) -> bool:
    """Whether the real file or folder ``path`` names (links followed) is not in ``seen``;
    it is added. A path that cannot be looked at is no first sight."""
    try:
        status = path.stat()
    except OSError:
        return False
    key = (status.st_dev, status.st_ino)
    if key in seen:
        return False
    seen.add(key)
    return True


def path_text(path: str | Path) -> str:
    """``path`` as a message or a report shows it: the bytes of its name that are not UTF-8
    (which Python reads as surrogate escapes, and no UTF-8 file or terminal takes) as ``\\xff``
    escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def transcript_files(folder: Path) -> list[Path]:
    """The transcripts files in ``folder`` at any depth (:data:`TRANSCRIPT_FILES`), by path."""
    return sorted(_transcript_paths(folder))


# why a line of valid JSON is not read: Python converts no integer of more digits than its
# limit (``sys.get_int_max_str_digits()``, a guard against quadratic parsing)
LONG_NUMBER = "a number of more than {} digits, longer than Python reads"
# what a byte that is not UTF-8 reads as under ``errors="surrogateescape"`` (no UTF-8 text does)
NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _open_text(path: Path):
    """The file as text lines, gzip or plain; a byte that is not UTF-8 reads as its
    :data:`NOT_UTF8` escape, so that it spoils its own line only."""
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")


def load_recordings(path: str | Path) -> tuple[list[dict], list[CorruptLine]]:
    """Sessions from a transcripts JSONL file (gzip detected by magic bytes), or from every
    transcripts file in a folder (:func:`transcript_files`, in that order).

    A session logged as OpenAI chat or Anthropic Messages is read in the recording format
    (:func:`~mlx_fill.evidence.log_formats.as_recording`); the lines of a Claude Code session
    log are read as its conversations
    (:func:`~mlx_fill.evidence.claude_code_log.sessions_from_events`), after the file's sessions,
    and then the lines of a Codex CLI rollout
    (:func:`~mlx_fill.evidence.codex_log.sessions_from_rollout`), a conversation that cannot
    be read reported under its last line, and then the sessions of an API-proxy log's lines
    that no later line goes on from (:class:`~mlx_fill.evidence.proxy_log.ProxyLog`), a line
    without one skipped saying why. A line that is not a JSON object with a ``messages``
    list of role-bearing dicts, a rollout line that cannot be read
    (:func:`~mlx_fill.evidence.codex_log.rollout_line_problem`), a line that holds bytes
    that are not UTF-8, or one holding an integer longer than Python converts
    (:data:`LONG_NUMBER`), is skipped and returned as a :class:`CorruptLine`; a truncated or
    corrupt gzip stream ends the file's read with one. Every session is read under a name of its
    own (:func:`_own_names`).
    """
    path = Path(path)
    if not path.is_dir():
        sessions, corrupt = _load_file(path)
        return _own_names(sessions), corrupt
    sessions, corrupt = [], []
    for file in transcript_files(path):
        read, skipped = _load_file(file)
        sessions += read
        corrupt += [replace(c, file=path_text(file.relative_to(path))) for c in skipped]
    return _own_names(sessions), corrupt


def _own_names(sessions: list[dict]) -> list[dict]:
    """``sessions``, each under a ``session_id`` no other holds (a replay's records and an A/B
    report's pairs are keyed by it): one without a name, as OpenAI chat and Anthropic Messages
    logs come, is named ``session N`` by its place in the read, and a name held before gets
    ``#2``, ``#3``, ..."""
    taken: set[str] = set()
    for n, session in enumerate(sessions, 1):
        base = str(session.get("session_id") or "") or f"session {n}"
        name, again = base, 1
        while name in taken:
            again += 1
            name = f"{base}#{again}"
        taken.add(name)
        session["session_id"] = name
    return sessions


def _load_file(path: Path) -> tuple[list[dict], list[CorruptLine]]:
    """:func:`load_recordings` of one file."""
    sessions, corrupt = [], []
    events: list[tuple[int, dict]] = []  # (line, event) of a Claude Code session log
    rollout: list[tuple[int, dict]] = []  # (line, item) of a Codex CLI rollout
    proxy = ProxyLog()  # the lines of an API-proxy log
    number = 0
    with _open_text(path) as fh:
        try:
            for number, line in enumerate(fh, 1):
                # a byte-order mark, as some editors write (at the start of every file that
                # was joined into this one), is not text
                line = line.removeprefix("\ufeff")
                if not line.strip():
                    continue
                if bad := NOT_UTF8.search(line):
                    byte = ord(bad.group()) - 0xdc00
                    corrupt.append(CorruptLine(number, f"not UTF-8 text (byte 0x{byte:02x} at "
                                                       f"character {bad.start() + 1})"))
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    corrupt.append(CorruptLine(number, _invalid_json(exc, line)))
                    continue
                except ValueError:  # the one other: an integer of more digits than Python converts
                    corrupt.append(CorruptLine(number, LONG_NUMBER.format(sys.get_int_max_str_digits())))
                    continue
                except RecursionError:
                    corrupt.append(CorruptLine(number, "JSON nested too deeply to read"))
                    continue
                if is_exchange(obj):
                    if why := proxy.add(number, obj):
                        corrupt.append(CorruptLine(number, why))
                elif is_event(obj):
                    events.append((number, obj))
                elif is_rollout_line(obj):
                    if problem := rollout_line_problem(obj):
                        corrupt.append(CorruptLine(number, problem))
                    else:
                        rollout.append((number, obj))
                else:
                    _keep(obj, number, sessions, corrupt)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            corrupt.append(CorruptLine(number + 1, f"unreadable: {exc}"))
    for index, session in sessions_from_events([e for _, e in events]):
        if isinstance(session, str):  # why the conversation is not read
            corrupt.append(CorruptLine(events[index][0], session))
        else:
            _keep(session, events[index][0], sessions, corrupt)
    for index, session in sessions_from_rollout([item for _, item in rollout]):
        _keep(session, rollout[index][0], sessions, corrupt)
    exchanges, refused = proxy.sessions(_recording)
    sessions += exchanges
    corrupt += [CorruptLine(number, why) for number, why in refused]
    corrupt.sort(key=lambda c: c.line)
    return sessions, corrupt


def _invalid_json(error: json.JSONDecodeError, line: str) -> str:
    """Why ``line`` is no JSON: where the reading stopped, and, where it stopped at the line's
    end or inside a string never closed, that the line looks cut off (a log still being
    written, a file copied before its end)."""
    text, said = line.rstrip("\r\n"), error.msg.removesuffix(" at")
    at_end = error.pos >= len(text)
    where = "at the line's end" if at_end else f"at character {error.pos + 1} of {len(text)}"
    cut = at_end or said.startswith("Unterminated string")
    return f"invalid JSON: {said} {where}" + (" (the line ends before its JSON does: cut off?)"
                                              if cut else "")


def _keep(obj: Any, line: int, sessions: list[dict], corrupt: list[CorruptLine]) -> None:
    """``obj`` read as a recording into ``sessions``, or its problem into ``corrupt`` under
    ``line``."""
    recording = _recording(obj)
    if isinstance(recording, str):
        corrupt.append(CorruptLine(line, recording))
    else:
        sessions.append(recording)


def _recording(obj: Any) -> dict | str:
    """``obj`` read as a recording (:func:`~mlx_fill.evidence.log_formats.as_recording`), or
    why it holds none (:func:`_session_problem`)."""
    obj = as_recording(obj)
    return _session_problem(obj) or obj


def skipped_lines(corrupt: list[CorruptLine]) -> str:
    """What a command that goes on without ``corrupt`` (not empty) says about them: how many,
    and the first one's line and reason."""
    return f"skipped {len(corrupt)} corrupt lines ({corrupt[0].where}: {corrupt[0].reason})"


def check_transcripts(path: Path) -> None:
    """Raise a :class:`UserError` saying why ``path`` cannot be read as transcripts before it
    is read: it does not exist, it is a pipe or a device (the reader opens a file twice), or a
    folder without transcripts files."""
    if not path.exists():
        raise UserError(f"no such transcripts file or folder: {path}")
    if not path.is_file() and not path.is_dir():
        raise UserError(f"{path} {NOT_REGULAR}")
    if path.is_dir() and next(_transcript_paths(path), None) is None:  # stops at the first
        raise UserError(f"{path} is a folder without transcripts files (names ending in "
                        f"{' or '.join(TRANSCRIPT_FILES)})")


def read_sessions(path: Path) -> tuple[list[dict], list[CorruptLine]]:
    """:func:`load_recordings` for a command: transcripts :func:`check_transcripts` refuses,
    a file that cannot be read, or transcripts without a session, are a :class:`UserError`
    that says so (with the first corrupt line's reason)."""
    check_transcripts(path)
    try:
        sessions, corrupt = load_recordings(path)
    except OSError as err:
        raise UserError(f"cannot read transcripts {err.filename or path}: "
                        f"{err.strerror or err}") from err
    if not sessions:
        first = f", {corrupt[0].where}: {corrupt[0].reason}" if corrupt else ""
        raise UserError(f"{path} holds no session ({len(corrupt)} corrupt lines{first}); pass "
                        f"JSONL transcripts, one JSON object with a messages list per line")
    return sessions, corrupt


def has_reply(sessions: list[dict]) -> bool:
    """Whether any of ``sessions`` (as :func:`read_sessions` returns them) holds an assistant
    message: what a command checks before it loads a model or fetches a tokenizer."""
    return any(m.get("role") == "assistant" for s in sessions for m in s["messages"])


def _session_problem(obj) -> str | None:
    if not isinstance(obj, dict):
        return "not a JSON object"
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no messages list"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "a message without a role"
        content = m.get("content")
        if isinstance(content, list) and (parts := [p["type"] for p in content if isinstance(p, dict)
                                                    and p.get("type") in CALL_PARTS]):
            return (f"a {parts[0]} content part in a message of role {quoted(m['role'])} "
                    f"(Anthropic's Messages format: calls in an assistant message, their results, "
                    f"text or text parts, in the user message after it)")
        if not isinstance(content, (str, type(None))):
            return "a message whose content is not a string"
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            return "a message whose tool_calls is not a list"
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return "a tool call without a name"
        if not all(isinstance(c.get("arguments_raw", ""), str) for c in calls):
            return "a tool call whose arguments_raw is not a string"
    if not encodable(obj):
        return "text that is not Unicode (a lone surrogate escape such as \\ud800)"
    return None


def encodable(obj: Any) -> bool:
    """Whether every string in ``obj`` encodes to UTF-8 (JSON's ``\\ud800`` escapes decode to
    lone surrogates, which no tokenizer or file takes). Walked without recursion: a value
    nested as deeply as JSON reads is checked too."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
    return True


def _json_type(values: list) -> str | None:
    kinds = set()
    for value in values:
        kinds.add(next(name for cls, name in JSON_TYPES if isinstance(value, cls)))
    if kinds == {"integer", "number"}:
        return "number"
    return kinds.pop() if len(kinds) == 1 else None


def synthesize_tools(messages: list[dict]) -> list[dict]:
    """OpenAI function schemas inferred from the recorded calls, in first-seen tool order."""
    observed: dict[str, list[dict]] = {}
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            arguments = call.get("arguments")
            observed.setdefault(call["name"], []).append(arguments if isinstance(arguments, dict) else {})
    tools = []
    for name, calls in observed.items():
        keys: dict[str, list] = {}
        for arguments in calls:
            for key, value in arguments.items():
                keys.setdefault(key, []).append(value)
        properties = {}
        for key, values in keys.items():
            kind = _json_type(values)
            properties[key] = {"type": kind} if kind else {}
        required = [key for key in keys if all(key in arguments for arguments in calls)]
        tools.append({"type": "function", "function": {
            "name": name,
            "description": "synthesized from the recorded calls",
            "parameters": {"type": "object", "properties": properties, "required": required},
        }})
    return tools


@dataclass(frozen=True)
class Turn:
    """One request: the recorded history up to an assistant turn and that turn as reference."""

    session_id: str
    transcript_source: str
    turn: int
    message_index: int
    messages: list[dict]
    tools: list[dict] | None
    tools_origin: str
    expected: dict


def _call_id(call: dict, message_index: int, k: int) -> str:
    return call.get("id") or f"call_{message_index}_{k}"


def _render_history(session: dict) -> list[dict]:
    """The recorded messages as OpenAI chat messages (see the module contract)."""
    structured = session.get("tool_call_style") == "structured"
    out: list[dict] = []
    pending_ids: list[str] = []
    for index, message in enumerate(session["messages"]):
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and structured and message.get("tool_calls"):
            calls = message["tool_calls"]
            pending_ids = [_call_id(c, index, k) for k, c in enumerate(calls)]
            out.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": cid, "type": "function", "function": {
                    "name": c["name"],
                    "arguments": c.get("arguments_raw") or json.dumps(c.get("arguments") or {}, ensure_ascii=False)}}
                for cid, c in zip(pending_ids, calls)]})
        elif role == "tool" and structured:
            call_id = message.get("tool_call_id") or (pending_ids.pop(0) if pending_ids else f"call_{index}")
            if call_id in pending_ids:
                pending_ids.remove(call_id)
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": content})
        else:
            out.append({"role": role, "content": content})
    return out


def session_tools(session: dict) -> tuple[list[dict] | None, str]:
    """The tools array a session is replayed with and its origin: ``recorded``,
    ``synthesized`` (structured session without one) or ``none`` (inline-text harness)."""
    if session.get("tool_call_style") != "structured":
        return None, "none"
    if session.get("tools"):
        return session["tools"], "recorded"
    return synthesize_tools(session["messages"]) or None, "synthesized"


def recording_turns(session: dict) -> tuple[list[Turn], str]:
    """The session's turns, in order, and how its tools were obtained."""
    structured = session.get("tool_call_style") == "structured"
    tools, origin = session_tools(session)
    history = _render_history(session)
    turns = []
    messages = session["messages"]
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index == 0 or messages[index - 1]["role"] == "assistant":
            continue
        calls = message.get("tool_calls") or []
        expected = {
            "content": message.get("content") or "",
            "tool_calls": [{"name": c["name"], "arguments": c.get("arguments")} for c in calls] if structured else [],
            "tool_names": [c["name"] for c in calls],
        }
        turns.append(Turn(str(session.get("session_id", "")), str(session.get("source", "")), len(turns),
                          index, history[:index], tools, origin, expected))
    return turns, origin


# ----------------------------------------------------------------------------- requests

@dataclass
class Reply:
    """What one request produced, with client-side timing (seconds from request start)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    wall_s: float = 0.0
    ttft_s: float | None = None
    first_tool_call_s: float | None = None
    usage: dict = field(default_factory=dict)
    error: str | None = None


def _parse_arguments(raw):
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return raw


def _usage_dict(usage) -> dict:
    """``usage`` as a plain dict; ``fill`` (mlx-fill servers only) kept verbatim, else None."""
    if usage is None:
        return {}
    data = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    return {"prompt_tokens": data.get("prompt_tokens"), "completion_tokens": data.get("completion_tokens"),
            "fill": data.get("fill")}


def request_turn(client, model: str, turn: Turn, *, max_tokens: int, temperature: float,
                 stream: bool) -> Reply:
    """Send one turn; failures are returned in ``Reply.error``, never raised."""
    params = {"model": model, "messages": turn.messages, "max_tokens": max_tokens,
              "temperature": temperature}
    if turn.tools:
        params["tools"] = turn.tools
    reply = Reply()
    start = time.perf_counter()
    try:
        if stream:
            _read_stream(client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **params), reply, start)
        else:
            response = client.chat.completions.create(**params)
            choice = response.choices[0]
            reply.content = choice.message.content or ""
            reply.tool_calls = [{"name": c.function.name, "arguments": _parse_arguments(c.function.arguments)}
                                for c in choice.message.tool_calls or []]
            reply.finish_reason = choice.finish_reason
            reply.usage = _usage_dict(response.usage)
    except Exception as exc:  # noqa: BLE001 - any failure of one request is recorded, the run goes on
        reply.error = f"{type(exc).__name__}: {exc}"
    reply.wall_s = time.perf_counter() - start
    return reply


def _read_stream(chunks, reply: Reply, start: float) -> None:
    parts: list[str] = []
    calls: dict[int, dict] = {}
    for chunk in chunks:
        now = time.perf_counter() - start
        if chunk.usage is not None:
            reply.usage = _usage_dict(chunk.usage)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                parts.append(delta.content)
                reply.ttft_s = reply.ttft_s if reply.ttft_s is not None else now
            for position, call in enumerate(delta.tool_calls or []):
                reply.ttft_s = reply.ttft_s if reply.ttft_s is not None else now
                reply.first_tool_call_s = reply.first_tool_call_s if reply.first_tool_call_s is not None else now
                index = call.index if call.index is not None else len(calls) + position
                slot = calls.setdefault(index, {"name": "", "arguments": ""})
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                reply.finish_reason = choice.finish_reason
    reply.content = "".join(parts)
    reply.tool_calls = [{"name": c["name"], "arguments": _parse_arguments(c["arguments"])}
                        for _, c in sorted(calls.items())]


def turn_record(turn: Turn, reply: Reply, *, arm: str, rep: int, order: int, url: str, model: str) -> dict:
    """One ``kind: turn`` line of the runs file."""
    return {
        "kind": "turn", "arm": arm, "rep": rep, "order": order, "url": url, "model": model,
        "session_id": turn.session_id, "source": turn.transcript_source, "turn": turn.turn,
        "message_index": turn.message_index, "tools_origin": turn.tools_origin,
        "prompt_messages": len(turn.messages), "expected": turn.expected,
        "output": {"content": reply.content, "tool_calls": reply.tool_calls, "finish_reason": reply.finish_reason},
        "timing": {"wall_s": reply.wall_s, "ttft_s": reply.ttft_s, "first_tool_call_s": reply.first_tool_call_s},
        "usage": reply.usage, "error": reply.error,
    }


# ----------------------------------------------------------------------------- command

def select_turns(sessions: list[dict], *, sources: list[str] | None, max_sessions: int | None,
                 turns_per_session: int | None) -> tuple[list[Turn], list[dict]]:
    """Turns to replay (first ``turns_per_session`` of each selected session) and per-session notes."""
    picked, notes = [], []
    for session in sessions:
        if sources and session.get("source") not in sources:
            continue
        if max_sessions is not None and len(notes) >= max_sessions:
            break
        turns, origin = recording_turns(session)
        turns = turns[:turns_per_session] if turns_per_session is not None else turns
        if not turns:
            continue
        notes.append({"session_id": str(session.get("session_id", "")), "source": session.get("source"),
                      "tools_origin": origin, "turns": len(turns)})
        picked.extend(turns)
    return picked, notes


def schedule(turns: list[Turn], arms: list[str], reps: int) -> Iterator[tuple[Turn, int, str]]:
    """(turn, rep, arm), every (turn, rep) group run back to back so drift hits every arm alike.

    Each group holds every arm once. Group ``g`` takes ``arms`` rotated left by ``2 * (g // 2)``
    (mod n), reversed when ``g`` is odd; with two arms that is A B, B A, A B, ... Contracts:

    * each pair of groups (0-1, 2-3, ...) puts every arm at positions summing to ``n - 1``, so
      over any even number of groups every arm has the same mean position (linear drift is even);
    * every ``n`` groups (n even) or ``2n`` groups (n odd), every arm takes every position equally
      often. The first request of a group is the one that cannot profit from what another arm
      left warm (a server shared by several arms answers the rest from its prompt cache); plain
      forward/reverse alternation would never put a middle arm first when n > 2.
    """
    group = 0
    for turn in turns:
        for rep in range(reps):
            shift = 2 * (group // 2) % len(arms)
            order = arms[shift:] + arms[:shift]
            order = order if group % 2 == 0 else order[::-1]
            group += 1
            for arm in order:
                yield turn, rep, arm


ARM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
MAX_REPS = 1000


def _split_candidate(value: str) -> tuple[str | None, str]:
    """``NAME=URL`` as (NAME, URL); a bare ``URL`` as (None, URL). The value is split on its first
    ``=`` only when the part before is a valid arm name and the part after starts with ``http``."""
    name, sep, url = value.partition("=")
    if sep and ARM_NAME.fullmatch(name) and url.startswith("http"):
        return name, url
    return None, value


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an endpoint base URL a client can reach (one phrase), or None."""
    from urllib.parse import urlsplit
    if not url.startswith(("http://", "https://")):
        return "is not an http:// or https:// URL"
    if any(c.isspace() for c in url):
        return "holds white space"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- parsed here: a port out of range or not a number raises
    except ValueError as err:
        return f"is not a valid URL ({err})"
    return None if parts.hostname else "names no host"


def endpoint_url(value: str) -> str:
    """argparse ``type=``: an endpoint base URL (:func:`url_problem`)."""
    problem = url_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"{value!r} {problem}; pass e.g. http://127.0.0.1:8080/v1")
    return value


def candidate_arms(values: list[str]) -> dict[str, str]:
    """Candidate arm name -> URL for the ``--url-b`` values, in the order given.

    One unnamed value is arm ``B`` (the two-arm A/B of old); otherwise a ``NAME=URL`` value is
    arm NAME and the unnamed value at (1-based) position k is arm ``Bk``. Raises ``UserError``
    for a value that is neither ``URL`` nor ``NAME=URL`` with an ``http(s)://`` URL, for a
    repeated name, and for the name ``A`` (the reference arm).
    """
    split = [_split_candidate(value) for value in values]
    arms: dict[str, str] = {}
    for k, (name, url) in enumerate(split, 1):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--url-b {url!r} is neither URL nor NAME=URL; pass e.g. "
                            f"http://127.0.0.1:8402 or strict=http://127.0.0.1:8402 (NAME: {ARM_NAME.pattern})")
        if problem := url_problem(url):
            raise UserError(f"--url-b {url!r} {problem}; pass e.g. http://127.0.0.1:8402")
        name = name or ("B" if len(split) == 1 else f"B{k}")
        if name == "A" or name in arms:
            why = "is the reference arm (--url-a)" if name == "A" else "is given twice"
            raise UserError(f"--url-b arm name {name!r} {why}; give every candidate its own NAME=URL")
        arms[name] = url
    return arms


def add_arguments_for(name: str, parser) -> None:
    parser.add_argument("--sessions", type=Path, required=True,
                        help="a transcripts JSONL(.gz) file, or a folder of them")
    if name == "ab":
        parser.add_argument("--url-a", required=True, type=endpoint_url,
                            help="reference endpoint base URL (e.g. fill off)")
        parser.add_argument("--url-b", required=True, action="append",
                            help="candidate endpoint base URL (e.g. fill on), or NAME=URL; repeat it to "
                                 "compare several candidates with A in one run (arms NAME, or B1, B2, ...)")
        parser.add_argument("--reps", type=int_up_to(MAX_REPS), default=1,
                            help=f"repetitions of every turn per arm, at most {MAX_REPS}")
    else:
        parser.add_argument("--url", required=True, type=endpoint_url,
                            help="endpoint base URL, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--model", default="default_model", help="model name sent with each request")
    parser.add_argument("--turns", type=positive_int, default=None, help="replay at most N turns per session")
    parser.add_argument("--max-sessions", type=positive_int, default=None, help="replay at most N sessions")
    parser.add_argument("--source", action="append", default=None,
                        help="only sessions from this transcript source (repeatable)")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float_in(0.0, 2.0), default=0.0,
                        help="temperature of each request, 0 to 2")
    parser.add_argument("--timeout", type=float_in(0.0, low_open=True), default=600.0,
                        help="seconds per request")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="stream replies (needed for time to first token / tool call)")
    parser.add_argument("--out", type=output_dir, default=None,
                        help="output directory, without a runs.jsonl yet (default: "
                             "mlx-fill-runs/<command>-<UTC time>)")


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def run(args) -> int:
    from openai import OpenAI
    from tqdm import tqdm

    command = getattr(args, "command", "ab" if hasattr(args, "url_a") else "replay")
    arms = {"A": args.url_a, **candidate_arms(args.url_b)} if command == "ab" else {"replay": args.url}
    reps = getattr(args, "reps", 1)
    started = datetime.now(timezone.utc)
    out_dir = args.out or Path("mlx-fill-runs") / f"{command}-{started:%Y%m%dT%H%M%SZ}"
    runs_path = out_dir / "runs.jsonl"
    if runs_path.exists():
        raise UserError(f"{runs_path} already exists (an earlier run's); pass another --out "
                        f"or remove that file")
    sessions, corrupt = read_sessions(args.sessions)
    for bad in corrupt:
        print(f"transcripts {bad.where} skipped: {bad.reason}", file=sys.stderr)
    turns, notes = select_turns(sessions, sources=args.source, max_sessions=args.max_sessions,
                                turns_per_session=args.turns)
    if not turns:
        present = sorted({str(s.get("source")) for s in sessions})
        if args.source and not set(args.source) & set(present):
            raise UserError(f"no session of --source {', '.join(args.source)} in {args.sessions}; "
                            f"pass one of its sources: {', '.join(present)}")
        raise UserError(f"no assistant turn to replay in {args.sessions}; pass sessions with "
                        f"assistant replies")
    out_dir.mkdir(parents=True, exist_ok=True)
    clients = {arm: OpenAI(base_url=_base_url(url), api_key="not-needed", timeout=args.timeout, max_retries=0)
               for arm, url in arms.items()}
    header = {
        "kind": "run", "command": command, "sessions_file": path_text(args.sessions), "urls": arms,
        "model": args.model, "reps": reps, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "stream": args.stream, "started": started.isoformat(timespec="seconds"),
        "sessions_selected": len(notes), "turns_selected": len(turns), "sessions": notes,
        "corrupt_lines": [asdict(c) for c in corrupt],
    }
    errors, first_error = 0, ""
    with open(runs_path, "x", encoding="utf-8") as fh:
        fh.write(json.dumps(header, ensure_ascii=False) + "\n")
        plan = list(schedule(turns, list(arms), reps))
        for order, (turn, rep, arm) in enumerate(tqdm(plan, desc=f"mlx-fill {command}", unit="req")):
            reply = request_turn(clients[arm], args.model, turn, max_tokens=args.max_tokens,
                                 temperature=args.temperature, stream=args.stream)
            errors += reply.error is not None
            first_error = first_error or reply.error or ""
            if reply.error and errors <= 3:
                tqdm.write(f"{turn.session_id} turn {turn.turn} arm {arm}: {reply.error}")
            fh.write(json.dumps(turn_record(turn, reply, arm=arm, rep=rep, order=order, url=arms[arm],
                                            model=args.model), ensure_ascii=False) + "\n")
            fh.flush()
    result = report.write_report(report.load_runs(runs_path), out_dir, by_tool=True)
    print(report.verdict_line(result))
    print(f"runs: {runs_path}\nreport: {out_dir / 'report.md'}")
    if errors == len(plan):
        print(f"mlx-fill {command}: every request failed (the first: {first_error})", file=sys.stderr)
        return 1
    verdict = result.get("verdict")
    return 0 if verdict is None or verdict["pass"] else 1
