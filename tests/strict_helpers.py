"""Shared helpers for the strict-tier tests: real tokenizers, fixture tools, rendered replies."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from mlx_fill.assets.store import load_tokenizer
from mlx_fill.core.proposal import DecodeView, FillSession
from mlx_fill.strict.source import strict_source

FAMILIES = ("qwen3", "qwen3-coder", "qwen3.5", "glm4.x")
TOOLS_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "audit" / "tools"


@lru_cache(maxsize=None)
def tokenizer(family: str):
    return load_tokenizer(family)


def tools(name: str = "default") -> list[dict]:
    return json.loads((TOOLS_DIR / f"{name}.json").read_text())


def call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def reply_ids(tok, messages, tool_list, reply: dict, kwargs: dict | None = None) -> list[int]:
    """The ids of ``reply`` as the template renders it after the generation prompt, cut after
    the first EOS (what the model would emit)."""
    kwargs = kwargs or {}
    primer = tok.apply_chat_template(messages, tools=tool_list, tokenize=False,
                                     add_generation_prompt=True, **kwargs)
    full = tok.apply_chat_template([*messages, reply], tools=tool_list, tokenize=False,
                                   add_generation_prompt=False, **kwargs)
    assert full.startswith(primer)
    ids = tok.encode(full[len(primer):], add_special_tokens=False)
    for i, t in enumerate(ids):
        if t in tok.eos_token_ids:
            return ids[: i + 1]
    return ids


def teacher_force(source, ids: list[int], eos=frozenset()) -> list[tuple[int, tuple, str]]:
    """Drive ``source`` over ``ids`` as the decode loop would; (position, span, origin) per fire.

    A contained span is appended whole; a span that is not the stream's next ids fails the
    calling test through the returned list (callers assert containment).
    """
    session = FillSession([source])
    fires, pos = [], 0
    while pos < len(ids):
        p = session.propose(DecodeView([], ids[:pos], eos))
        if p is None:
            pos += 1
            continue
        fires.append((pos, p.ids, p.origin))
        contained = tuple(ids[pos: pos + len(p.ids)]) == p.ids
        session.feedback(p, len(p.ids) if contained else 0, pos)
        pos += len(p.ids) if contained else 1
    return fires


def contained(ids: list[int], fires) -> bool:
    return all(tuple(ids[pos: pos + len(span)]) == span for pos, span, _ in fires)


def wrong_asserts(tok, messages, tool_list, ids: list[int], ledger,
                  kwargs: dict | None = None) -> list[tuple[str, str, str]]:
    """(origin, asserted text, the stream's text there) for every ``assert`` proposal that is
    not the stream's next ids, driving a strict source (``ledger``: its evidence) over ``ids``
    at every position, each proposal refused (a wrong assert is reported, not applied); none
    where no rows compile."""
    source = strict_source(tok, messages, tool_list, kwargs, ledger=ledger)
    if source is None:
        return []
    session = FillSession([source])
    wrong = []
    for pos in range(len(ids)):
        p = session.propose(DecodeView([], ids[:pos], frozenset(tok.eos_token_ids)))
        if p is None:
            continue
        want = tuple(ids[pos:pos + len(p.ids)])
        if p.policy == "assert" and want != p.ids:
            wrong.append((p.origin, tok.decode(list(p.ids)), tok.decode(list(want))))
        session.feedback(p, 0, pos)
    return wrong
