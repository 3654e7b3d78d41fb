"""Multi-turn agent prompts for the model-based draft sources' fixture tests: early turns of
recorded sessions (``../shared/transcripts/dev.jsonl.gz``) rendered through the fixture family's
real chat template, each prompt being everything before an assistant turn."""

from __future__ import annotations

from collections import defaultdict
from itertools import zip_longest
from typing import Any

from mlx_fill.replay import load_sessions
from mlx_fill.study import shared_dir
from mlx_fill.transcripts import render_session


def transcript_prompts(tokenizer: Any, count: int, max_len: int = 2400,
                       per_session: int = 2) -> list[list[int]]:
    """``count`` prompts (ids up to an assistant turn, at most ``max_len`` long, at most
    ``per_session`` from one session), sessions taken round-robin over transcript sources."""
    sessions, _ = load_sessions(shared_dir() / "transcripts" / "dev.jsonl.gz")
    by_source: dict[str, list[dict]] = defaultdict(list)
    for s in sessions:
        by_source[str(s.get("source"))].append(s)
    out: list[list[int]] = []
    for group in zip_longest(*by_source.values()):
        for session in group:
            if session is None or len(out) >= count:
                continue
            try:
                rendered = render_session(session, tokenizer)
            except ValueError:
                continue
            prompts = [rendered.tokens[:t.start] for t in rendered.turns[1:] if t.start <= max_len]
            out += prompts[:min(per_session, count - len(out))]
        if len(out) >= count:
            return out
    raise ValueError(f"only {len(out)} prompts of at most {max_len} ids in the transcripts")
