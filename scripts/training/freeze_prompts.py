"""Freeze held-back agent turns into ``fixtures/prompts/heldout.jsonl``.

Each line is one request the fixture models never trained on: ``messages`` (system + first user
message + the turns just before an assistant reply, truncated as in training), ``tools``, the
transcript ``source``, and ``expect`` = ``call`` when the recorded reply made a tool call, else
``prose``. The identity tests and ``scripts/bench`` read this file, so every run sees the same
prompts; rerun this script only to change the frozen set.

    python -m scripts.training.freeze_prompts [--per-source 14] [--out fixtures/prompts/heldout.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.training import fixture_data as fd

from mlx_fill.assets.store import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]

MAX_PROMPT_TOKENS = 480
CONTEXT_MESSAGES = 4


def windows(session: fd.Session, fits):
    """(messages, expect) for every assistant reply of ``session`` after its first user turn:
    header (system + first user message) plus the longest run of at most
    ``CONTEXT_MESSAGES`` preceding turns that ``fits``; replies where even the header alone
    does not fit are skipped."""
    msgs = session.messages
    first_user = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        return
    header = ([msgs[0]] if msgs[0]["role"] == "system" else []) + [msgs[first_user]]
    for index, turn in enumerate(msgs):
        if turn["role"] != "assistant" or index <= first_user:
            continue
        for start in range(max(first_user + 1, index - CONTEXT_MESSAGES), index + 1):
            if start < index and msgs[start]["role"] == "tool":
                continue
            window = header + msgs[start:index]
            if fits(window, session.tools):
                yield window, "call" if turn.get("tool_calls") else "prose"
                break


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-source", type=int, default=14)
    ap.add_argument("--out", type=Path, default=ROOT / "fixtures" / "prompts" / "heldout.jsonl")
    args = ap.parse_args()
    tok = load_tokenizer("qwen3")

    def fits(messages: list[dict], tools: list[dict]) -> bool:
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        return len(ids) <= MAX_PROMPT_TOKENS

    _, held = fd.split_sessions(fd.load_recordings(), 0)
    rows = []
    for source in fd.SOURCES:
        picked = {"call": 0, "prose": 0}
        quota = {"call": args.per_source - args.per_source // 4, "prose": args.per_source // 4}
        for session in (s for s in held if s.source == source):
            for messages, expect in windows(session, fits):
                if picked[expect] >= quota[expect]:
                    continue
                picked[expect] += 1
                rows.append({"id": f"{session.session_id}:{len(rows)}", "source": source,
                             "expect": expect, "messages": messages, "tools": session.tools})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts = {s: sum(r["source"] == s for r in rows) for s in fd.SOURCES}
    print(f"wrote {len(rows)} prompts to {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
