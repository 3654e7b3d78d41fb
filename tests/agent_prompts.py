"""Multi-turn agent prompts for the model-based draft sources' fixture tests: early turns of
recorded sessions (``fixtures/transcripts/dev.jsonl.gz``) as the replay tool sends them (OpenAI
messages + tools), rendered through the fixture family's real chat template with the generation
prompt, as a server would."""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import zip_longest
from typing import Any

from mlx_fill.evidence.replay import load_recordings, recording_turns
from mlx_fill.assets.checkout import TRANSCRIPTS


def _with_argument_objects(messages: list[dict]) -> list[dict]:
    """Tool-call arguments as mappings (templates such as Qwen3.5's iterate over them), as
    mlx-lm's server does before templating."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    args = {"input": args}
                calls.append({**c, "function": {**c["function"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def transcript_prompts(tokenizer: Any, count: int, max_len: int = 2400,
                       per_session: int = 2) -> list[list[int]]:
    """``count`` prompts (at most ``max_len`` ids, at most ``per_session`` from one session),
    sessions taken round-robin over transcript sources."""
    sessions, _ = load_recordings(TRANSCRIPTS)
    by_source: dict[str, list[dict]] = defaultdict(list)
    for s in sessions:
        by_source[str(s.get("source"))].append(s)
    out: list[list[int]] = []
    for group in zip_longest(*by_source.values()):
        for session in group:
            if session is None or len(out) >= count:
                continue
            taken = 0
            for turn in recording_turns(session)[0]:
                ids = list(tokenizer.apply_chat_template(
                    _with_argument_objects(turn.messages), tools=turn.tools,
                    add_generation_prompt=True, tokenize=True))
                if len(ids) > max_len or taken == per_session:
                    break
                out.append(ids)
                taken += 1
        if len(out) >= count:
            return out[:count]
    raise ValueError(f"only {len(out)} prompts of at most {max_len} ids in the transcripts")
