"""``mlx-fill study``: model-free corpus study of the proposal sources on recorded sessions.

Every assistant turn is replayed as if the model had emitted exactly the recorded output,
rendered through the family's chat template (:mod:`mlx_fill.evidence.transcripts`). Each source runs as
at serve time (built by :func:`mlx_fill.spec.roster.make_sources`, driven through a
:class:`~mlx_fill.core.proposal.FillSession`), teacher-forced: the prompt forward emits the first
token; afterwards, at every step the session proposes, the longest prefix equal to the recorded
continuation is accepted, and that verify forward emits accepted + 1 tokens; with no proposal a
forward emits 1 token. ``tau`` = output tokens / forwards ("oracle tokens per forward": forwards
only, a long verify counts as one), ``fill`` = accepted / tokens, ``rejected_per_accepted`` =
proposed-but-rejected positions per accepted token. Given ``--cost-curve`` (a DispatchPlan JSON
with a ``cost`` map), the cost gates choose round lengths on it and a round proposing ``m`` ids
costs ``m + 1`` rows in the plan's chunks at the KV length it appends at (the turn's prompt and
the ids emitted before it, :meth:`~mlx_fill.core.plan.DispatchPlan.rows_cost`); ``speedup`` =
tokens / total cost. Every view is a chained one (its last id was sampled by the forward before
and leads the next round's rows), as this model charges it.

Rows: ``baseline`` (reference prompt lookup: n = 3..1, K = 10, first occurrence, fixed length),
each requested source alone (gated as served), ``all`` (echo, suffix and ngram as
``MLX_FILL=all`` serves them: each priced by its own gate, competing for each view), ``strict``
(:func:`mlx_fill.strict.source.compile_strict`: the session's rows compiled once, from its
tools in its first turn's conversation, a fresh source per turn) and
``best`` (strict rows before ``all``'s sources). Assert spans emit their length for their rows'
cost; an assert span that disagrees with the recording (it would have been wrong output) is
counted in ``assert_mismatches`` and scored as a verify. One session index is shared by all rows (they see the
same token stream in lockstep); each row with ``suffix`` has its own cross-request tree, which
lives for one worker's sessions (sessions are dealt round-robin to workers).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_fill.assets.store import FAMILIES, load_tokenizer
from mlx_fill.core.index import LOOKUP_MAX_SPAN, EchoIndex
from mlx_fill.core.errors import UserError, existing_file, output_dir, positive_int
from mlx_fill.assets.checkout import TRANSCRIPTS
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.cost import CostGate, RoundCosts
from mlx_fill.core.proposal import DecodeView, FillSession, Pace

from .replay import CorruptLine, has_reply, path_text, read_sessions
from .transcripts import markers

if TYPE_CHECKING:
    from mlx_fill.strict.source import CompiledStrict, StrictSource

ROW_SOURCES = {"ngram": ["ngram"], "echo": ["echo"], "suffix": ["suffix"],
               "all": ["echo", "suffix", "ngram"], "strict": ["strict"],
               "best": ["strict", "echo", "suffix", "ngram"]}
BASELINE = "baseline"
# the template kwargs the sessions are rendered with (:mod:`.transcripts`), strict rows too
STRICT_TEMPLATE_KWARGS = {"enable_thinking": False}
METRICS = ("tokens", "forwards", "proposed", "accepted", "rejected", "cost", "turns", "asserted",
           "assert_mismatches")


@dataclass
class Counts:
    tokens: int = 0
    forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0
    cost: float = 0.0
    turns: int = 0
    asserted: int = 0
    assert_mismatches: int = 0

    def add(self, other: "Counts") -> None:
        for m in METRICS:
            setattr(self, m, getattr(self, m) + getattr(other, m))

    def summary(self, with_cost: bool) -> dict[str, Any]:
        d: dict[str, Any] = {m: getattr(self, m) for m in METRICS}
        d["cost"] = round(self.cost, 3)
        d["tau"] = round(self.tokens / self.forwards, 4) if self.forwards else None
        d["fill"] = round(self.accepted / self.tokens, 4) if self.tokens else None
        d["rejected_per_accepted"] = round(self.rejected / self.accepted, 4) if self.accepted else None
        if with_cost:
            d["speedup"] = round(self.tokens / self.cost, 4) if self.cost else None
        return d


@dataclass
class Row:
    """One simulated configuration: its per-turn sources and counters."""

    name: str
    names: list[str]
    global_tree: Any
    by_source: dict[str, Counts] = field(default_factory=lambda: defaultdict(Counts))
    by_tool: dict[str, Counts] = field(default_factory=lambda: defaultdict(Counts))
    session: FillSession | None = None
    ptr: int = 0
    emitted: list[int] = field(default_factory=list)
    acceptance: dict = field(default_factory=dict)


def _make_session(row: Row, plan: DispatchPlan | None, prompt: list[int], index: EchoIndex,
                  max_span: int, strict: Any) -> FillSession:
    """The row's session for one turn, built as ``build_session`` builds a request's: the
    model-free sources gated on ``plan`` and competing for each view, strict rows before them,
    all sharing one :class:`~mlx_fill.core.proposal.Pace` (the KV length the session sets is
    what the gates price at)."""
    from mlx_fill.spec.base import DraftProposalSource
    from mlx_fill.spec.ngram import NgramDraft
    from mlx_fill.spec.roster import make_sources, source_gate
    if row.name == BASELINE:
        src = NgramDraft(index, n_min=1, n_max=3, k=10, occurrence="first", name=BASELINE)
        return FillSession([DraftProposalSource(src, length=lambda: 10)], max_span=max_span)
    pace = Pace()
    names = [n for n in row.names if n != "strict"]
    sources: list[Any] = make_sources(names, plan=plan, prompt_ids=prompt, index=index,
                                      global_tree=row.global_tree, max_span=max_span,
                                      acceptance=row.acceptance, pace=pace) if names else []
    if "strict" in row.names and strict is not None:
        gate = None if plan is None else source_gate(plan, max_span, "strict",
                                                     acceptance=row.acceptance, pace=pace)
        sources.insert(0, strict(gate))
    return FillSession(sources, max_span=max_span, plan=plan, pace=pace, compete=names)


def study_session(rendered, rows: list[Row], plan: DispatchPlan | None, eos: frozenset[int],
                  max_span: int, tokenizer: Any = None) -> None:
    """Teacher-forced replay of one rendered session through every row, in lockstep. Rows with
    ``strict`` get a fresh strict source per turn over the session's rows (needs ``tokenizer``)."""
    verify_costs = RoundCosts(plan, max_span, extra_rows=1) if plan is not None else None
    assert_costs = RoundCosts(plan, max_span, extra_rows=0) if plan is not None else None
    index = EchoIndex()
    tokens = rendered.tokens
    compiled = (_compile_strict(tokenizer, rendered)
                if tokenizer is not None and any("strict" in r.names for r in rows) else None)
    for turn in rendered.turns:
        prompt = tokens[:turn.start] + rendered.think_ids
        out = tokens[turn.start:turn.end]
        labels = turn.labels
        if not out:
            continue
        live = []
        strict = None if compiled is None else _strict_factory(compiled, tokenizer, rendered, turn)
        for row in rows:
            row.session = _make_session(row, plan, prompt, index, max_span, strict)
            c = row.by_source[rendered.transcript_source]
            c.turns += 1
            c.tokens += len(out)
            c.forwards += 1  # the prompt forward emits the first token
            c.cost += 1.0
            t = row.by_tool[labels[0]]
            t.forwards += 1
            t.tokens += 1
            t.cost += 1.0
            row.ptr = 1
            row.emitted = out[:1]
            live.append(row)
        while live:
            row = min(live, key=lambda r: r.ptr)
            ptr = row.ptr
            if ptr >= len(out):
                live.remove(row)
                continue
            c = row.by_source[rendered.transcript_source]
            # every step of this model is a forward whose sample leads the next round's rows
            view = DecodeView(prompt, row.emitted, eos, pending=True)
            p = row.session.propose(view)
            if p is None:
                step, cost, acc, prop = 1, 1.0, 0, 0
            else:
                ids = p.ids
                acc = 0
                limit = min(len(ids), len(out) - ptr)
                while acc < limit and ids[acc] == out[ptr + acc]:
                    acc += 1
                prop = len(ids)
                asserted = p.policy == "assert" and acc == len(ids)
                if asserted:
                    step = acc
                    c.asserted += acc
                else:  # an assert span that would be wrong output is counted, scored as verify
                    c.assert_mismatches += p.policy == "assert"
                    step = min(acc + 1, len(out) - ptr)
                costs = assert_costs if asserted else verify_costs
                cost = costs.at(len(prompt) + ptr)[len(ids)] if costs else 1.0
                row.session.feedback(p, acc, len(prompt) + ptr)
            c.forwards += 1
            c.cost += cost
            c.proposed += prop
            c.accepted += acc
            c.rejected += prop - acc
            tool = row.by_tool[labels[ptr]]
            tool.forwards += 1
            tool.cost += cost
            tool.proposed += prop
            tool.accepted += acc
            tool.rejected += prop - acc
            for j in range(ptr + 1, ptr + step):
                row.by_tool[labels[j]].tokens += 1
            tool.tokens += 1
            row.ptr = ptr + step
            row.emitted.extend(out[ptr:ptr + step])
        for row in rows:
            row.session = None


def _compile_strict(tokenizer: Any, rendered: Any) -> CompiledStrict | None:
    """The session's strict rows and initial role, compiled once, in the conversation of its
    first turn with output; every later turn's source is built over them. What the compile
    reads from a rendering (how the template writes a call after the conversation, its
    generation prompt) is taken as the template's and the tools', not the history's: the
    terms on which the study cuts every turn's prompt from one rendering of the session
    (:mod:`.transcripts`). So no turn renders its history. None for a session without tools,
    or whose rows do not compile (a malformed tool included)."""
    from mlx_fill.strict.source import compile_strict
    first = next((t for t in rendered.turns if t.end > t.start), None)
    if not rendered.tools or first is None:
        return None
    try:
        return compile_strict(tokenizer, rendered.messages[:first.message_index], rendered.tools,
                              STRICT_TEMPLATE_KWARGS)
    except ValueError:
        return None


def _strict_factory(compiled: CompiledStrict, tokenizer: Any, rendered: Any, turn: Any):
    """A per-turn constructor of the strict source over the session's ``compiled`` rows,
    ``make(gate)``: a fresh source for each row that calls it, compiling a tool's key rows,
    the first time any turn needs them, in this turn's conversation."""
    msgs = rendered.messages[:turn.message_index]

    def make(gate: CostGate | None = None) -> StrictSource:
        return compiled.source(tokenizer, msgs, rendered.tools, STRICT_TEMPLATE_KWARGS, gate=gate)
    return make


def _worker(args: tuple) -> dict:
    (path, family, picks, row_names, plan_json, max_span, worker, queue) = args
    from mlx_fill.assets.store import load_tokenizer
    from mlx_fill.spec.suffix import GlobalSuffixTree
    from .transcripts import load_recordings, markers, render_recording
    tok = load_tokenizer(family)
    mk = markers(tok)
    eos = frozenset(int(t) for t in tok.eos_token_ids)
    plan = DispatchPlan.from_json(plan_json) if plan_json else None
    sessions, _ = load_recordings(path)
    rows = [Row(BASELINE, [], None)] + [
        Row(n, ROW_SOURCES[n], GlobalSuffixTree() if "suffix" in ROW_SOURCES[n] else None)
        for n in row_names]
    skipped: list[str] = []
    for i in picks:
        s = sessions[i]
        try:
            rendered = render_recording(s, tok, mk)
        except (ValueError, KeyError, TypeError) as e:
            skipped.append(f"{s.get('session_id')}: {e}")
        else:
            study_session(rendered, rows, plan, eos, max_span, tok)
        if queue is not None:
            queue.put(1)
    return {"rows": {r.name: {"by_source": {k: vars(v) for k, v in r.by_source.items()},
                              "by_tool": {k: vars(v) for k, v in r.by_tool.items()}}
                     for r in rows},
            "skipped": skipped}


def run_study(path: Path, family: str, row_names: list[str], *, sessions: int | None = None,
              per_source: int | None = None, plan: DispatchPlan | None = None, max_span: int = LOOKUP_MAX_SPAN, workers: int = 2,
              progress: bool = True, recordings: tuple[list[dict], list] | None = None) -> dict:
    """Run the study and return the JSON-able result (see the module contract).
    ``recordings``: ``read_sessions(path)`` when the caller has already read it."""
    all_sessions, corrupt = recordings if recordings is not None else read_sessions(path)
    picks = list(range(len(all_sessions)))[:sessions] if sessions else list(range(len(all_sessions)))
    if per_source:
        taken: dict[str, int] = defaultdict(int)
        kept = []
        for i in picks:
            src = str(all_sessions[i].get("source", ""))
            if taken[src] < per_source:
                taken[src] += 1
                kept.append(i)
        picks = kept
    per_source_sessions: dict[str, int] = defaultdict(int)
    for i in picks:
        per_source_sessions[str(all_sessions[i].get("source", ""))] += 1
    del all_sessions
    workers = max(1, min(workers, len(picks), os.cpu_count() or 1))
    deals = [picks[w::workers] for w in range(workers)]
    plan_json = plan.to_json() if plan is not None else None
    t0 = time.time()
    if workers == 1:
        parts = [_worker((str(path), family, deals[0], row_names, plan_json, max_span, 0, None))]
    else:
        import multiprocessing as mp
        from tqdm import tqdm
        with mp.Manager() as mgr:
            q = mgr.Queue()
            with ProcessPoolExecutor(workers) as ex:
                futs = [ex.submit(_worker, (str(path), family, d, row_names, plan_json, max_span,
                                            w, q)) for w, d in enumerate(deals)]
                with tqdm(total=len(picks), desc="sessions", disable=not progress) as bar:
                    done = 0  # a worker that failed counts no more sessions: stop waiting for them
                    while done < len(picks) and not any(f.done() and f.exception() for f in futs):
                        try:
                            q.get(timeout=1.0)
                        except queue.Empty:
                            continue
                        done += 1
                        bar.update(1)
                parts = [f.result() for f in futs]  # a worker's exception is raised here
    elapsed = time.time() - t0
    with_cost = plan is not None
    rows_out: dict[str, Any] = {}
    for name in [BASELINE, *row_names]:
        by_source: dict[str, Counts] = defaultdict(Counts)
        by_tool: dict[str, Counts] = defaultdict(Counts)
        for part in parts:
            for k, v in part["rows"][name]["by_source"].items():
                by_source[k].add(Counts(**v))
            for k, v in part["rows"][name]["by_tool"].items():
                by_tool[k].add(Counts(**v))
        total = Counts()
        for v in by_source.values():
            total.add(v)
        rows_out[name] = {
            "sources": ROW_SOURCES.get(name, ["prompt-lookup n=3..1 K=10 first"]),
            "total": total.summary(with_cost),
            "by_source": {k: v.summary(with_cost) for k, v in sorted(by_source.items())},
            "by_tool": {k: v.summary(with_cost) for k, v in
                        sorted(by_tool.items(), key=lambda kv: -kv[1].tokens)},
        }
    return {
        "transcripts": path_text(path), "family": family, "sessions": len(picks),
        "per_source": per_source,
        "sessions_by_source": dict(per_source_sessions),
        "corrupt_lines": [vars(c) for c in corrupt],
        "skipped_sessions": [s for p in parts for s in p["skipped"]],
        "max_span": max_span, "cost_curve": plan_json, "workers": workers,
        "elapsed_s": round(elapsed, 1), "rows": rows_out,
    }


def markdown_report(result: dict) -> str:
    rows = result["rows"]
    sources = sorted({s for r in rows.values() for s in r["by_source"]})
    with_cost = result["cost_curve"] is not None
    lengths = ("cost gates, every round priced at its KV length" if with_cost
               else "oracle (always propose up to max span)")
    lines = [f"# mlx-fill study: {result['transcripts']}", "",
             f"family `{result['family']}`, {result['sessions']} sessions, max span "
             f"{result['max_span']}, {result['elapsed_s']} s on {result['workers']} workers; "
             f"lengths: {lengths}.",
             "", "## Tokens per forward (tau) by transcript source", "",
             "| row | " + " | ".join(sources) + " | all sources |",
             "|---|" + "---|" * (len(sources) + 1)]
    for name, r in rows.items():
        cells = [str(r["by_source"].get(s, {}).get("tau", "")) for s in sources]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['total']['tau']} |")
    lines += ["", "## Fill, waste" + (", cost-weighted speedup" if with_cost else ""), "",
              "| row | fill | rejected per accepted |" + (" speedup |" if with_cost else ""),
              "|---|---|---|" + ("---|" if with_cost else "")]
    for name, r in rows.items():
        t = r["total"]
        lines.append(f"| {name} | {t['fill']} | {t['rejected_per_accepted']} |"
                     + (f" {t['speedup']} |" if with_cost else ""))
    best = rows.get("all") or rows[list(rows)[-1]]
    lines += ["", "## By tool (row `all` if present)", "", "| tool | tokens | tau | fill |",
              "|---|---|---|---|"]
    for tool, v in list(best["by_tool"].items())[:15]:
        lines.append(f"| {tool} | {v['tokens']} | {v['tau']} | {v['fill']} |")
    lines += ["", "Rendering: each session is rendered once through the family template "
              "(non-thinking generation prompt, the session's tools or a synthesized tools array "
              "for structured harnesses, none for inline-text ones), so the tools block, system "
              "prompt and `<tool_call>` scaffolding are real tokens a source can predict.",
              f"Corrupt lines: {len(result['corrupt_lines'])}"
              + (f" (the first: {CorruptLine(**result['corrupt_lines'][0]).where}: "
                 f"{result['corrupt_lines'][0]['reason']})" if result["corrupt_lines"] else "")
              + f"; sessions skipped: "
              f"{len(result['skipped_sessions'])}"
              + (f" (the first: {result['skipped_sessions'][0]})." if result["skipped_sessions"]
                 else ".")]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    sources = sorted({s for r in rows.values() for s in r["by_source"]})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(rows))
    for i, (name, r) in enumerate(rows.items()):
        vals = [r["by_source"].get(s, {}).get("tau") or 0 for s in sources]
        ax.bar([x + i * width for x in range(len(sources))], vals, width, label=name)
    ax.set_xticks([x + width * (len(rows) - 1) / 2 for x in range(len(sources))])
    ax.set_xticklabels(sources, rotation=15, fontsize=8)
    ax.set_ylabel("tokens per forward (tau)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "tau_by_source.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transcripts", type=Path, default=None,
                        help="a JSONL(.gz) transcripts file, or a folder of them (default: the "
                             "repository's fixtures/transcripts/dev.jsonl.gz)")
    parser.add_argument("--family", default="qwen3", choices=FAMILIES, help="tokenizer/template family (one whose rendered replies can be cut "
                             "into turns; the others are refused saying why)")
    parser.add_argument("--sources", default="ngram,echo,suffix,all,best",
                        help="comma list from ngram,echo,suffix,strict,all,best (baseline "
                             "always runs; all = echo+suffix+ngram, best = strict + all)")
    parser.add_argument("--sessions", type=positive_int, default=None, help="first N sessions only")
    parser.add_argument("--per-source", type=positive_int, default=None,
                        help="at most N sessions of each transcript source (first N)")
    parser.add_argument("--cost-curve", type=existing_file, default=None,
                        help="DispatchPlan JSON (`mlx-fill qualify`) whose cost curve the gates "
                             "decide on and each round is priced by, at the KV length it appends at")
    parser.add_argument("--max-span", type=positive_int, default=32,
                        help="longest proposal span, in tokens, a source may offer")
    parser.add_argument("--workers", type=positive_int, default=2, help="worker processes (at most one per CPU)")
    parser.add_argument("--out", type=output_dir, default="out/study",
                        help="output folder for study.json, study.md and the plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    names = [s.strip() for s in args.sources.split(",") if s.strip()]
    bad = [n for n in names if n not in ROW_SOURCES]
    if bad:
        raise UserError(f"unknown sources {bad}; choose from {sorted(ROW_SOURCES)}")
    path = args.transcripts or TRANSCRIPTS
    if args.transcripts is None and not path.is_file():
        raise UserError(f"no transcripts at {path} (an installed package has none); pass "
                        f"--transcripts FILE, e.g. a clone's fixtures/transcripts/dev.jsonl.gz")
    plan = None
    if args.cost_curve is not None:
        try:
            plan = DispatchPlan.from_json(json.loads(args.cost_curve.read_text()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{args.cost_curve} is not a DispatchPlan JSON ({err}); write one "
                            f"with `mlx-fill qualify`") from err
        if not plan.cost:
            raise UserError(f"{args.cost_curve} has no cost map; write one with `mlx-fill qualify`")
    recordings = read_sessions(path)
    no_turn = (f"no assistant turn to study in {path}", "pass sessions with assistant replies")
    if not has_reply(recordings[0]):
        raise UserError("; ".join(no_turn))  # before the family's tokenizer is fetched
    try:
        markers(load_tokenizer(args.family))
    except ValueError as err:
        raise UserError(f"family {args.family}: {err}") from err
    result = run_study(path, args.family, names, sessions=args.sessions,
                       per_source=args.per_source, plan=plan,
                       max_span=args.max_span, workers=args.workers,
                       progress=not args.no_progress, recordings=recordings)
    if not result["rows"][BASELINE]["total"]["turns"]:
        skipped = result["skipped_sessions"]
        why = f"; {len(skipped)} sessions not rendered (the first: {skipped[0]})" if skipped else ""
        raise UserError(f"{no_turn[0]}{why}; {no_turn[1]}"
                        + (", or another --family" if skipped else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.json").write_text(json.dumps(result, indent=2) + "\n")
    report = markdown_report(result)
    (args.out / "study.md").write_text(report)
    plot(result, args.out)
    print(report)
    print(f"wrote {args.out}/study.json, study.md, tau_by_source.png")
    return 0
