"""Benchmarks (not tests): fill and speculation vs plain mlx-lm decoding, side by side, one run.

Parts, all interleaved (every repeat runs every arm on the same prompt back to back, the
order reversed every other repeat after one untimed run of the first arm, so machine drift hits
all arms) and reported as medians:

1. ``e2e`` — fixture models (the trained ones, and ``smollm2-tools``, a real pre-trained model
   taught to call tools) on the frozen held-out prompts (``fixtures/prompts/heldout.jsonl``,
   every transcript source): plain ``mlx_lm`` ``generate_step`` vs the fill loop in each mode
   (and the fixture's own MTP head where one is committed). Prints tokens/s, target forwards per
   emitted token, the share of emitted tokens a fill source wrote, the sources' bookkeeping
   (time inside propose/feedback per emitted token, as a share of one plain decode step) and the
   speed ratio to plain per arm, per source and overall, and checks that every arm produced
   exactly plain decoding's ids. ``prose`` runs the same arms on chat requests with no tools
   and nothing to copy: what the flag costs where there is nothing to fill.
2. ``mechanism`` — a random-weight Qwen3-0.6B-shaped model (bf16; 4-bit weights with fp32
   activations) driven through recorded assistant turns by a forcing logits processor, so every
   arm emits the recorded tokens: what fill and speculation save at a realistic forward cost on
   the real workload shape.

3. ``predict`` (only when named in ``--parts``) — Predicted Outputs on file edits with
   ``qwen25-coder-0.5b`` (:mod:`scripts.bench.predict`, also runnable alone with its own options).

    python -m scripts.bench [--quick] [--parts e2e,prose,mechanism,predict] [--fixtures a,b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step as stock_generate_step

from mlx_fill.core.acceptance import pure_processor
from mlx_fill.core.loop import generate_step
from mlx_fill.core.resolve import plan_for
from mlx_fill.core.proposal import FillSession

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "fixtures" / "prompts" / "heldout.jsonl"
PARTS = ("e2e", "prose", "mechanism", "predict")
E2E_ARMS = ("off", "strict", "echo", "ngram", "suffix", "draft", "all")
MECH_ARMS = ("plain", "strict", "echo", "suffix", "all")
QUICK_MECH_ARMS = ("plain", "strict", "all")
SCAN_TURNS = 8


@dataclass
class Arm:
    """Accumulated measurements of one arm."""

    name: str
    seconds: list[float] = field(default_factory=list)  # per prompt: median over repeats
    tokens: int = 0
    forwards: int = 0
    injected: int = 0  # tokens written by a fill source (verified or asserted), not sampled
    source_ms: float = 0.0  # time inside the sources' propose/feedback, all repeats
    mismatches: int = 0

    def tps(self) -> float:
        return self.tokens / max(sum(self.seconds), 1e-9)


def interleave(acc: dict[str, Arm], arms, repeats: int, run_arm, reference,
               also: dict[str, Arm] | None = None) -> None:
    """Run every arm ``repeats`` times back to back on one prompt (``run_arm(arm) -> (session,
    ids, seconds)``), then record each arm's median time, tokens, forwards and whether its ids
    equal ``reference`` (plain decoding's ids when None), into ``acc`` and ``also`` (a
    per-source table) alike. The first arm runs once untimed before the others (the first
    decode after a prefill is slower), and every other repetition runs the arms in reverse
    order, so no arm always runs first or always follows the same one."""
    times: dict[str, list[float]] = {a: [] for a in arms}
    outs: dict[str, list[int]] = {}
    tables = [acc] if also is None else [acc, also]
    run_arm(arms[0])
    for r in range(repeats):
        for a in (arms if r % 2 == 0 else arms[::-1]):
            session, outs[a], dt = run_arm(a)
            times[a].append(dt)
            for table in tables:
                arm = table[a]
                arm.forwards += session.stats.forwards if session is not None else len(outs[a])
                arm.injected += session.stats.injected if session is not None else 0
                arm.source_ms += session.stats.source_ms if session is not None else 0.0
    expected = outs["plain"] if reference is None else reference
    for table in tables:
        for a in arms:
            table[a].seconds.append(statistics.median(times[a]))
            table[a].tokens += len(outs[a])
            table[a].mismatches += outs[a] != expected


def timed_decode(prompt: list[int], model, session: FillSession | None, *, max_tokens: int,
                 eos: frozenset[int], processors=None, cache=None) -> tuple[list[int], float]:
    """Greedy ids up to the first EOS and the wall time of the whole request (prefill incl.;
    with ``cache``, a prompt cache already holding everything before ``prompt``)."""
    t0 = time.perf_counter()
    kw = dict(max_tokens=max_tokens, logits_processors=processors, prompt_cache=cache)
    gen = (stock_generate_step(mx.array(prompt), model, **kw) if session is None
           else generate_step(mx.array(prompt), model, fill=session, **kw))
    out: list[int] = []
    for t, _ in gen:
        out.append(t)
        if t in eos:
            break
    return out, time.perf_counter() - t0


def e2e_session(arm: str, *, model, tok, ids, row, draft=None, mtp_head=None,
                acceptance: dict | None = None) -> FillSession | None:
    """The arm's session for one request; ``acceptance`` carries the arm's per-draft
    acceptance estimates across requests, as a server keeps them."""
    from mlx_fill.session import build_session
    if arm == "plain":
        return None
    if arm in ("ngram", "suffix"):
        from mlx_fill.spec.roster import make_sources
        sources = make_sources([arm], plan=plan_for(model), tokenizer=tok, prompt_ids=ids,
                               acceptance=acceptance)
        return FillSession(sources, prompt_ids=ids, eos_ids=tok.eos_token_ids)
    if arm == "mtp":
        from mlx_fill.spec.mtp import make_mtp_source
        src = make_mtp_source(model, mtp_head, plan=plan_for(model))
        return FillSession([src], prompt_ids=ids, eos_ids=tok.eos_token_ids)
    if arm == "draft":
        from mlx_fill.spec.draft import make_draft_source
        src = make_draft_source(draft[0], tokenizer=draft[1], target_tokenizer=tok,
                                plan=plan_for(model))
        return FillSession([src], prompt_ids=ids, eos_ids=tok.eos_token_ids)
    if arm == "off":
        return FillSession([], prompt_ids=ids, eos_ids=tok.eos_token_ids)
    return build_session(arm, model=model, tokenizer=tok, prompt_ids=ids,
                         messages=row["messages"], tools=row["tools"], acceptance=acceptance)


def load_fixture(name: str, dtype: str | None):
    """(model, tokenizer) of fixture ``name``, its floating-point weights cast to ``dtype``."""
    from mlx_lm import load

    from mlx_fill.assets.fixtures import fixture_path
    model, tok = load(str(fixture_path(name)))
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    return model, tok


def heldout_rows(quick: bool, per_source: int | None) -> list[dict]:
    """The frozen held-out requests: the first ``per_source`` of each source, else every 4th
    with ``quick``, else all."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    if per_source is not None:
        return [r for i, r in enumerate(rows)
                if sum(q["source"] == r["source"] for q in rows[:i]) < per_source]
    return rows[:: 4] if quick else rows


def prefilled(model, prompt: list[int]):
    """A prompt cache holding ``prompt[:-1]`` (each arm then decodes from the last id; the
    caller trims the cache back after every arm)."""
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    for start in range(0, len(prompt) - 1, 512):
        model(mx.array(prompt[start:min(start + 512, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def run_e2e(quick: bool, repeats: int, fixtures: list[str] | None = None,
            max_tokens: int = 128, dtype: str | None = None, per_source: int | None = None,
            shared_prefill: bool = False) -> dict:
    """Every arm on the held-out prompts of every fixture: one table per fixture, overall and
    per transcript source (``by_source``). ``shared_prefill``: the prompt is prefilled once
    and every arm decodes from that cache, so the times are of decoding alone (a model whose
    prefill costs most of a request, SmolLM2 in bfloat16 on two CPU cores, would otherwise
    show every arm at the prefill's ratio)."""
    from mlx_lm.models.cache import trim_prompt_cache

    from mlx_lm import load

    from mlx_fill.assets.fixtures import fixture_path
    from mlx_fill.spec.mtp_head import has_mtp, load_mtp_head

    rows = heldout_rows(quick, per_source)
    fixtures = fixtures or (["qwen3-json"] if quick else ["qwen3-json", "qwen35-xml", "glm-xml"])
    result = {}
    for name in fixtures:
        path = fixture_path(name)
        model, tok = load_fixture(name, dtype)
        draft = load_fixture("qwen3-draft", dtype) if name == "qwen3-json" else None
        eos = frozenset(tok.eos_token_ids)
        arms = ["plain", *[a for a in E2E_ARMS if a != "draft" or draft is not None]]
        models = dict.fromkeys(arms, model)
        mtp_head = None
        if has_mtp(path):
            # the MTP arm decodes with its own copy: the hidden-state tap it installs stays off
            # the model the other arms time
            models["mtp"], _ = load_fixture(name, dtype)
            mtp_head = load_mtp_head(path, models["mtp"])
            arms.append("mtp")
        acc = {a: Arm(a) for a in arms}
        learned: dict[str, dict] = {a: {} for a in arms}
        by_source: dict[str, dict[str, Arm]] = {}
        for row in rows:
            ids = tok.apply_chat_template(row["messages"], tools=row["tools"],
                                          add_generation_prompt=True)

            cache = prefilled(model, ids) if shared_prefill else None

            def run_arm(a: str, ids=ids, row=row, cache=cache):
                s = e2e_session(a, model=models[a], tok=tok, ids=ids, row=row, draft=draft,
                                mtp_head=mtp_head, acceptance=learned[a])
                if cache is None or models[a] is not model:
                    return s, *timed_decode(ids, models[a], s, max_tokens=max_tokens, eos=eos)
                out = timed_decode(ids[-1:], model, s, max_tokens=max_tokens, eos=eos, cache=cache)
                trim_prompt_cache(cache, cache[0].offset - (len(ids) - 1))
                return s, *out

            mine = by_source.setdefault(row["source"], {a: Arm(a) for a in arms})
            interleave(acc, arms, repeats, run_arm, reference=None, also=mine)
        result[name] = summarize(acc, repeats)
        result[name]["by_source"] = {src: summarize(t, repeats) for src, t in by_source.items()}
    return result


PROSE_PROMPTS = (
    "Why is the sky blue? Answer in a short paragraph.",
    "Write a short poem about autumn leaves.",
    "What are three tips for sleeping better?",
    "Explain what a hash table is to a beginner.",
    "Describe a good breakfast in a few sentences.",
    "What should I pack for a weekend hike?",
)


def run_prose(quick: bool, repeats: int, fixtures: list[str] | None = None,
              max_tokens: int = 128, dtype: str | None = None) -> dict:
    """Chat requests with no tools and nothing to copy, ``plain`` vs ``off`` (a session with
    no source) vs ``strict`` and ``all``: what having the flag on costs where nothing fills."""
    prompts = PROSE_PROMPTS[:2] if quick else PROSE_PROMPTS
    result = {}
    for name in fixtures or ["qwen3-json"]:
        model, tok = load_fixture(name, dtype)
        eos = frozenset(tok.eos_token_ids)
        arms = ["plain", "off", "strict", "all"]
        acc = {a: Arm(a) for a in arms}
        learned: dict[str, dict] = {a: {} for a in arms}
        for text in prompts:
            messages = [{"role": "user", "content": text}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
            row = {"messages": messages, "tools": None}

            def run_arm(a: str):
                s = e2e_session(a, model=model, tok=tok, ids=ids, row=row, acceptance=learned[a])
                return s, *timed_decode(ids, model, s, max_tokens=max_tokens, eos=eos)

            interleave(acc, arms, repeats, run_arm, reference=None)
        result[name] = summarize(acc, repeats)
    return result


def summarize(acc: dict[str, Arm], repeats: int) -> dict:
    plain = acc["plain"]
    step_ms = 1e3 * sum(plain.seconds) / max(plain.tokens, 1)  # one plain decode step, prefill incl.
    return {a.name: {"tokens_per_s": round(a.tps(), 2), "ratio_vs_plain": round(a.tps() / plain.tps(), 3),
                     "forwards_per_token": round(a.forwards / repeats / max(a.tokens, 1), 3),
                     "fill_fraction": round(a.injected / repeats / max(a.tokens, 1), 3),
                     "bookkeeping_share": round(a.source_ms / repeats / max(a.tokens, 1) / step_ms, 4),
                     "mismatched_prompts": a.mismatches, "tokens": a.tokens}
            for a in acc.values()}


def forcing_processor(prompt_len: int, target: list[int]):
    """Logits processor that puts all mass on the recorded token for each output position.

    The result still depends on the model's logits (``+ 0 * logits``): MLX evaluates lazily, and
    a sampled token that did not depend on the forward would let every step skip the model."""
    def force(tokens: mx.array, logits: mx.array) -> mx.array:
        pos = tokens.shape[0] - prompt_len
        want = target[min(pos, len(target) - 1)]
        forced = mx.where(mx.arange(logits.shape[-1]) == want, 0.0, -1e9).astype(logits.dtype)[None]
        return forced + 0 * logits
    return pure_processor(force)


@dataclass
class RecordedTurn:
    prompt: list[int]
    output: list[int]
    messages: list[dict]
    tools: list[dict] | None


def mechanism_turns(tok, per_source: int, max_prompt: int, max_out: int) -> list[RecordedTurn]:
    """Recorded assistant turns (tool calls and prose), rendered through the real template:
    the prompt is the history with the generation prompt, cut to its last ``max_prompt`` ids
    (the recent context the echo sources draw on; prefill cost is not what this part measures),
    the output the recorded reply's ids up to the end-of-turn token. Only the first
    ``SCAN_TURNS`` turns of a session are rendered (each rendering is the whole history)."""
    from mlx_fill.evidence.replay import load_recordings, recording_turns
    from mlx_fill.evidence.transcripts import template_history
    from mlx_fill.assets.checkout import TRANSCRIPTS

    sessions, _ = load_recordings(TRANSCRIPTS)
    picked: list[RecordedTurn] = []
    for source in ("pi_mono", "tau_bench_gpt4o_airline", "mini_swe_agent_gemini3pro"):
        mine = 0
        for session in (s for s in sessions if s.get("source") == source):
            turns, _ = recording_turns(session)
            for turn in turns[1:SCAN_TURNS]:
                if mine >= per_source:
                    break
                kw = dict(tools=turn.tools, tokenize=False, enable_thinking=False)
                messages = template_history(turn.messages)  # as a server hands them over
                head = tok.apply_chat_template(messages, add_generation_prompt=True, **kw)
                whole = tok.apply_chat_template(
                    template_history(session_turn_history(session, turn.message_index)), **kw)
                if not whole.startswith(head):
                    continue
                reply = whole[len(head):]
                end = reply.find("<|im_end|>")
                if end < 0:
                    continue
                prompt = tok.encode(head, add_special_tokens=False)[-max_prompt:]
                out = tok.encode(reply[:end + len("<|im_end|>")], add_special_tokens=False)
                if len(out) >= 8:
                    picked.append(RecordedTurn(prompt, out[:max_out], messages, turn.tools))
                    mine += 1
            if mine >= per_source:
                break
    return picked


def session_turn_history(session: dict, message_index: int) -> list[dict]:
    """The recorded history through the assistant message at ``message_index``."""
    from mlx_fill.evidence.replay import _render_history
    return _render_history(session)[:message_index + 1]


def mechanism_session(arm: str, turn: RecordedTurn, *, tok, plan) -> FillSession | None:
    from mlx_fill.spec.roster import make_sources
    from mlx_fill.strict.source import strict_source
    if arm == "plain":
        return None
    sources = []
    if arm in ("strict", "all"):
        src = strict_source(tok, turn.messages, turn.tools) if turn.tools else None
        sources += [src] if src is not None else []
    names = {"strict": [], "echo": ["echo"], "suffix": ["suffix"],
             "all": ["echo", "suffix", "ngram"]}[arm]
    if names:
        sources += make_sources(names, plan=plan, tokenizer=tok, prompt_ids=turn.prompt)
    return FillSession(sources, prompt_ids=turn.prompt, eos_ids=tok.eos_token_ids, plan=plan)


def run_mechanism(quick: bool, repeats: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_fill.assets.store import load_tokenizer
    from mlx_fill.assets.random_models import build, config_for

    tok = load_tokenizer("qwen3")
    arms = QUICK_MECH_ARMS if quick else MECH_ARMS
    turns = mechanism_turns(tok, 1 if quick else 3, 128 if quick else 1024, 24 if quick else 96)
    configs = [("bf16", mx.bfloat16, None)] if quick else [("bf16", mx.bfloat16, None),
                                                           ("q4-fp32act", mx.float32, 4)]
    result = {}
    for label, dtype, bits in configs:
        model, _ = build(dict(config_for("qwen3", "0.5b"), vocab_size=len(tok._tokenizer)),
                         dtype=dtype, bits=bits)
        plan = plan_for(model)
        acc = {a: Arm(a) for a in arms}
        for turn in turns:
            # the prompt is prefilled once; every arm decodes from that cache, trimmed back after
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array(turn.prompt[:-1])[None], cache=cache))
            force = [forcing_processor(1, turn.output)]

            def run_arm(a: str, turn=turn, force=force, cache=cache):
                s = mechanism_session(a, turn, tok=tok, plan=plan)
                out = timed_decode(turn.prompt[-1:], model, s, max_tokens=len(turn.output),
                                   eos=frozenset(), processors=force, cache=cache)
                trim_prompt_cache(cache, cache[0].offset - (len(turn.prompt) - 1))
                return s, *out

            interleave(acc, arms, repeats, run_arm, reference=turn.output)
        result[label] = summarize(acc, repeats)
        result[label]["plan"] = {"max_chunk": plan.max_chunk, "qualified": plan.qualified}
    return result


def print_table(title: str, table: dict) -> None:
    print(f"\n## {title}")
    print(f"{'arm':<8} {'tok/s':>8} {'x plain':>8} {'fwd/tok':>8} {'filled':>7} {'bookkeep':>9} {'mismatch':>9}")
    for arm, r in table.items():
        if not isinstance(r, dict) or "tokens_per_s" not in r:
            continue
        print(f"{arm:<8} {r['tokens_per_s']:>8.2f} {r['ratio_vs_plain']:>8.3f} "
              f"{r['forwards_per_token']:>8.3f} {r['fill_fraction']:>7.1%} "
              f"{r['bookkeeping_share']:>9.2%} {r['mismatched_prompts']:>9}")
    for source, sub in table.get("by_source", {}).items():
        print_table(f"{title} / {source}", sub)


def name_list(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """argparse ``type=``: a comma-separated list of names from ``known``."""
    def parse(value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad or value!r}; choose from "
                                              f"{','.join(known)}")
        return names
    return parse


def main(argv: list[str] | None = None) -> int:
    """Run the named parts; a bad argument is one ``bench:`` line on stderr and exit 2."""
    from mlx_fill.assets.fixtures import FIXTURES, REAL_FIXTURES, WIDE_FIXTURES
    from mlx_fill.cli import _Parser
    from mlx_fill.core.errors import UserError, output_file, positive_int

    ap = _Parser(prog="python -m scripts.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts, fixtures and repeats")
    ap.add_argument("--parts", type=name_list(PARTS, "parts"), default=",".join(PARTS[:3]),
                    help=f"comma-separated, from {','.join(PARTS)}")
    ap.add_argument("--max-tokens", type=positive_int, default=128,
                    help="tokens per e2e / prose request")
    ap.add_argument("--per-source", type=positive_int, default=None,
                    help="e2e: the first N held-out requests of each source (default: every 4th "
                         "with --quick, else all)")
    ap.add_argument("--shared-prefill", action="store_true",
                    help="e2e: prefill each prompt once and time decoding alone")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="cast the e2e / prose models' floating-point weights (default: as stored)")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help="timing repeats (default: 1 with --quick, else 3)")
    ap.add_argument("--json", type=output_file, default=None, help="write the report here")
    ap.add_argument("--fixtures", type=name_list((*FIXTURES, *REAL_FIXTURES, *WIDE_FIXTURES), "fixtures"),
                    default=None,
                    help="e2e fixtures, comma-separated (default: qwen3-json with --quick, else "
                         "qwen3-json,qwen35-xml,glm-xml)")
    try:
        args = ap.parse_args(argv)
    except UserError as err:
        print(f"bench: {err}", file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.quick else 3)
    parts = args.parts
    fixtures = args.fixtures
    from mlx_fill.core import kernels
    report = {"machine": f"{platform.machine()} {platform.system()}, mlx {mx.__version__}",
              "blas": " ".join(filter(None, vars(kernels.blas()).values())),
              "dtype": args.dtype,
              "date": time.strftime("%Y-%m-%d"), "quick": args.quick, "repeats": repeats}
    if "e2e" in parts:
        report["e2e"] = run_e2e(args.quick, repeats, fixtures, args.max_tokens, args.dtype,
                                args.per_source, args.shared_prefill)
        for name, table in report["e2e"].items():
            print_table(f"e2e {name}", table)
    if "prose" in parts:
        report["prose"] = run_prose(args.quick, repeats, fixtures, args.max_tokens, args.dtype)
        for name, table in report["prose"].items():
            print_table(f"prose {name}", table)
    if "mechanism" in parts:
        report["mechanism"] = run_mechanism(args.quick, repeats)
        for name, table in report["mechanism"].items():
            print_table(f"mechanism qwen3-0.5b-shaped {name}", table)
    if "predict" in parts:
        from scripts.bench import predict
        report["predict"] = predict.run("qwen25-coder-0.5b", predict.default_tasks(), repeats,
                                        args.dtype, 1024)
        predict.print_table(report["predict"]["tasks"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if any(not e["identical"] for t in report.get("predict", {}).get("tasks", [])
           for e in t["arms"].values()):
        print("\nMISMATCHED OUTPUTS: predict", file=sys.stderr)
        return 1
    bad = [(p, n, a) for p in ("e2e", "prose", "mechanism") for n, t in report.get(p, {}).items()
           for a, r in t.items() if isinstance(r, dict) and r.get("mismatched_prompts")]
    if bad:
        print(f"\nMISMATCHED OUTPUTS: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
