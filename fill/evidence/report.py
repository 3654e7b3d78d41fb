"""``mlx-fill report``: agreement and wall-clock verdicts for replay / A/B runs files.

A runs file (written by ``mlx-fill replay`` / ``mlx-fill ab``) holds one JSON object per line:
``{"kind": "run", ...}`` headers and ``{"kind": "turn", ...}`` records (one per request).
Records of an A/B run pair on ``(session_id, turn, rep)`` between the reference arm ``A`` and
each candidate arm: ``B`` in a two-arm run, or every other arm (e.g. ``strict``, ``echo``) when
``mlx-fill ab`` got several ``--url-b``. Each candidate gets the verdict below against A on its own.

Verdict contract (A = reference arm, e.g. fill off; B = a candidate, e.g. fill on):

* Agreement of one reply = the call(s) it made (tool name + arguments compared as canonical JSON,
  key-order independent) when it made any, else its normalized prose; it agrees when that key
  equals the recorded turn's key.
* "Agreement does not drop" is McNemar's exact paired test on the discordant pairs
  (``a_only`` = A agreed, B did not; ``b_only`` = the reverse). The drop is significant when the
  one-sided 95% Clopper-Pearson lower bound on P(a_only | discordant) exceeds 1/2, which is the
  same event as the exact one-sided binomial p-value falling below 0.05. The bounds are also
  reported as bounds on the drop in agreement rate, conditional on the observed discordant count.
* Wall clock is the per-pair ratio B/A; its median carries distribution-free one-sided 95%
  order-statistic bounds. B is "slower" when the lower bound exceeds 1 and "faster" when the
  upper bound is below 1; otherwise "inconclusive".
* A candidate passes unless agreement drops significantly or it is significantly slower; the run
  passes when every candidate does.

Result shape (``report.json``): ``headers``, ``corrupt_lines``, ``arms`` (per-arm summaries), and
``verdict`` (None without an A/B pair). When the one candidate is ``B`` (one unnamed ``--url-b``),
``paired``, ``by_source`` (per transcript source: the same paired summary, and the
candidate's emitted / decoded / injected tokens), ``by_tool`` (with ``--by-tool``) and
``verdict`` = ``{pass, agreement_drops, wall}`` sit at the top level. Otherwise ``candidates``
maps each candidate name (in order of first appearance, i.e. the ``--url-b`` order) to those
keys, and the top-level ``verdict`` is
``{pass, failed}`` (``failed``: the candidates that did not pass).
"""

from __future__ import annotations

import json
import math
import statistics
import unicodedata
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from mlx_fill.core.errors import UserError

ALPHA = 0.05
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


# ----------------------------------------------------------------------------- exact binomial

def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (stable for large n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    lgn = math.lgamma(n + 1)
    total = 0.0
    for i in range(k + 1):
        total += math.exp(lgn - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
    return min(1.0, total)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return 1.0 - binom_cdf(k - 1, n, p)


def _bisect(f, lo: float, hi: float, iterations: int = 80) -> float:
    """Root of a function increasing on [lo, hi] (f(lo) <= 0 <= f(hi))."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def clopper_pearson_lower(successes: int, trials: int, alpha: float = ALPHA) -> float:
    """One-sided (1 - alpha) lower confidence bound on a binomial proportion."""
    if successes <= 0:
        return 0.0
    return _bisect(lambda t: binom_sf(successes, trials, t) - alpha, 0.0, 1.0)


def clopper_pearson_upper(successes: int, trials: int, alpha: float = ALPHA) -> float:
    """One-sided (1 - alpha) upper confidence bound on a binomial proportion."""
    if successes >= trials:
        return 1.0
    return _bisect(lambda t: alpha - binom_cdf(successes, trials, t), 0.0, 1.0)


# ----------------------------------------------------------------------------- verdict math

@dataclass(frozen=True)
class McNemar:
    """Paired agreement counts and the one-sided test that B's agreement is not below A's."""

    pairs: int
    both: int
    a_only: int
    b_only: int
    neither: int
    p_drop: float
    drop_lower95: float
    drop_upper95: float

    @property
    def a_rate(self) -> float:
        return (self.both + self.a_only) / self.pairs if self.pairs else 0.0

    @property
    def b_rate(self) -> float:
        return (self.both + self.b_only) / self.pairs if self.pairs else 0.0

    @property
    def drop(self) -> float:
        """Observed drop in agreement rate, A minus B."""
        return self.a_rate - self.b_rate

    @property
    def significant_drop(self) -> bool:
        return self.drop_lower95 > 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "a_rate": self.a_rate, "b_rate": self.b_rate, "drop": self.drop,
                "significant_drop": self.significant_drop}


def mcnemar_drop(a_agrees: Sequence[bool], b_agrees: Sequence[bool], alpha: float = ALPHA) -> McNemar:
    """McNemar's exact one-sided test for a drop in agreement from arm A to arm B.

    Conditional on the ``m = a_only + b_only`` discordant pairs, ``a_only ~ Binomial(m, theta)``
    and the agreement drop equals ``(2 theta - 1) m / pairs``. ``p_drop = P(X >= a_only | theta
    = 1/2)``; the drop bounds map the one-sided Clopper-Pearson bounds on theta.
    """
    if len(a_agrees) != len(b_agrees):
        raise ValueError(f"paired outcomes differ in length: {len(a_agrees)} vs {len(b_agrees)}")
    both = sum(1 for a, b in zip(a_agrees, b_agrees) if a and b)
    a_only = sum(1 for a, b in zip(a_agrees, b_agrees) if a and not b)
    b_only = sum(1 for a, b in zip(a_agrees, b_agrees) if b and not a)
    pairs = len(a_agrees)
    discordant = a_only + b_only
    if discordant == 0:
        return McNemar(pairs, both, 0, 0, pairs - both, 1.0, 0.0, 0.0)
    scale = discordant / pairs
    lower = (2 * clopper_pearson_lower(a_only, discordant, alpha) - 1) * scale
    upper = (2 * clopper_pearson_upper(a_only, discordant, alpha) - 1) * scale
    return McNemar(pairs, both, a_only, b_only, pairs - both - discordant,
                   binom_sf(a_only, discordant, 0.5), lower, upper)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of a non-empty sample."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of an empty sample")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class RatioSummary:
    """Median of per-pair ratios B/A, its one-sided 95% bounds and the distribution.

    ``lower95``/``upper95`` are None when there are too few pairs for a distribution-free bound
    (fewer than 5 at alpha = 0.05).
    """

    n: int
    median: float
    lower95: float | None
    upper95: float | None
    quantiles: dict[str, float]

    @property
    def verdict(self) -> str:
        if self.lower95 is not None and self.lower95 > 1.0:
            return "slower"
        if self.upper95 is not None and self.upper95 < 1.0:
            return "faster"
        return "inconclusive"

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def median_bounds(values: Sequence[float], alpha: float = ALPHA) -> tuple[float | None, float | None]:
    """Distribution-free one-sided (1 - alpha) bounds on the median (sign-test order statistics).

    The upper bound is the k-th smallest value for the least k with P(Bin(n, 1/2) <= k - 1) >=
    1 - alpha; the lower bound is the k-th largest.
    """
    ordered = sorted(values)
    n = len(ordered)
    for k in range(1, n + 1):
        if binom_cdf(k - 1, n, 0.5) >= 1 - alpha:
            return ordered[n - k], ordered[k - 1]
    return None, None


def paired_ratio(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA) -> RatioSummary:
    """Summarize per-pair ratios ``b[i] / a[i]`` (both strictly positive)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if not a:
        raise ValueError("no pairs to compare")
    if any(x <= 0 for x in (*a, *b)):
        raise ValueError("wall-clock times must be positive")
    ratios = [y / x for x, y in zip(a, b)]
    lower, upper = median_bounds(ratios, alpha)
    return RatioSummary(len(ratios), statistics.median(ratios), lower, upper,
                        {f"p{int(q * 100)}": quantile(ratios, q) for q in QUANTILES})


# ----------------------------------------------------------------------------- agreement keys

def normalize_prose(text: str | None) -> str:
    """NFC, whitespace runs collapsed to one space, ends stripped."""
    return " ".join(unicodedata.normalize("NFC", text or "").split())


def canonical_arguments(arguments) -> str:
    """Key-order independent form of call arguments (a JSON string is parsed first)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "raw:" + arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def agreement_key(reply: dict) -> tuple:
    """What agreement compares: the calls made (name + canonical arguments) or the prose."""
    calls = reply.get("tool_calls") or []
    if calls:
        return ("calls", tuple((c["name"], canonical_arguments(c.get("arguments"))) for c in calls))
    return ("prose", normalize_prose(reply.get("content")))


def agrees(record: dict) -> bool:
    return agreement_key(record["output"]) == agreement_key(record["expected"])


def tool_label(record: dict) -> str:
    """The recorded turn's first tool name, or ``(prose)``."""
    names = record["expected"].get("tool_names") or []
    return names[0] if names else "(prose)"


# ----------------------------------------------------------------------------- runs files

@dataclass
class Runs:
    headers: list[dict]
    turns: list[dict]
    corrupt_lines: list[int]


def load_runs(path: str | Path) -> Runs:
    """Read a runs JSONL file; unparsable lines are counted, not fatal."""
    runs = Runs([], [], [])
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                runs.corrupt_lines.append(number)
                continue
            if not isinstance(obj, dict):
                runs.corrupt_lines.append(number)
            elif obj.get("kind") == "run":
                runs.headers.append(obj)
            elif obj.get("kind") == "turn":
                runs.turns.append(obj)
    return runs


def pair_records(turns: Iterable[dict], candidate: str = "B") -> tuple[list[tuple[dict, dict]], int]:
    """Pairs (A, candidate) on (session_id, turn, rep); returns the pairs and the count of A and
    candidate records left out (unpaired or failed). Other arms' records are ignored."""
    by_key: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for rec in turns:
        if rec["arm"] in ("A", candidate):
            by_key[(rec["session_id"], rec["turn"], rec.get("rep", 0))][rec["arm"]] = rec
    pairs, left_out = [], 0
    for arms in by_key.values():
        a, b = arms.get("A"), arms.get(candidate)
        if a and b and not a.get("error") and not b.get("error"):
            pairs.append((a, b))
        else:
            left_out += len(arms)
    return pairs, left_out


def _median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def arm_summary(records: Sequence[dict]) -> dict:
    """Per-arm latency, agreement and token accounting over successful records."""
    ok = [r for r in records if not r.get("error")]
    emitted = sum(r["usage"].get("completion_tokens") or 0 for r in ok)
    fills = [r["usage"].get("fill") for r in ok]
    decoded = sum(f["forwards"] if f and "forwards" in f else (r["usage"].get("completion_tokens") or 0)
                  for r, f in zip(ok, fills))
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "agreement": sum(agrees(r) for r in ok) / len(ok) if ok else None,
        "wall_s_median": _median_or_none([r["timing"]["wall_s"] for r in ok]),
        "ttft_s_median": _median_or_none([r["timing"]["ttft_s"] for r in ok if r["timing"].get("ttft_s") is not None]),
        "first_tool_call_s_median": _median_or_none(
            [r["timing"]["first_tool_call_s"] for r in ok if r["timing"].get("first_tool_call_s") is not None]),
        "tool_call_turns": sum(1 for r in ok if r["output"].get("tool_calls")),
        "tokens_emitted": emitted,
        "tokens_decoded": decoded,
        "emitted_per_decoded": emitted / decoded if decoded else None,
        "fill_reported": sum(1 for f in fills if f),
        "tokens_injected": sum((f or {}).get("injected", 0) for f in fills),
    }


def summarize(runs: Runs, by_tool: bool = False) -> dict:
    """The JSON result (shape in the module docstring): per-arm summaries and, when there is an
    arm ``A`` and at least one other, each candidate's paired verdict against A."""
    arms: dict[str, list[dict]] = defaultdict(list)
    for rec in runs.turns:
        arms[rec["arm"]].append(rec)
    result: dict = {
        "headers": runs.headers,
        "corrupt_lines": runs.corrupt_lines,
        "arms": {arm: arm_summary(recs) for arm, recs in sorted(arms.items())},
    }
    names = [arm for arm in arms if arm != "A"] if "A" in arms else []
    if not names:
        result["verdict"] = None
    elif names == ["B"]:
        result.update(_candidate_summary(runs.turns, "B", by_tool))
    else:
        result["candidates"] = {name: _candidate_summary(runs.turns, name, by_tool) for name in names}
        failed = [name for name, c in result["candidates"].items() if not c["verdict"]["pass"]]
        result["verdict"] = {"pass": not failed, "failed": failed}
    return result


def candidate_results(result: dict) -> dict[str, dict]:
    """Candidate name -> its ``paired`` / ``by_source`` / ``by_tool`` / ``verdict`` for either
    result shape (empty without an A/B pair)."""
    if "candidates" in result:
        return result["candidates"]
    if not result.get("verdict"):
        return {}
    return {"B": {"paired": result["paired"], "by_source": result.get("by_source"),
                  "by_tool": result.get("by_tool"), "verdict": result["verdict"]}}


def _candidate_summary(turns: Sequence[dict], candidate: str, by_tool: bool) -> dict:
    """``paired`` (with ``left_out_records``), ``by_source``, ``by_tool`` when asked, and
    ``verdict`` for one candidate against A."""
    pairs, left_out = pair_records(turns, candidate)
    paired = _paired_summary(pairs)
    paired["left_out_records"] = left_out
    out: dict = {"paired": paired, "by_source": _by_source(pairs)}
    if by_tool:
        out["by_tool"] = {name: _paired_summary(group)
                          for name, group in _group_pairs(pairs, tool_label).items()}
    out["verdict"] = {
        "pass": bool(pairs) and not paired["agreement"]["significant_drop"]
        and (paired["wall"] is None or paired["wall"]["verdict"] != "slower"),
        "agreement_drops": paired["agreement"]["significant_drop"],
        "wall": paired["wall"]["verdict"] if paired["wall"] else None,
    }
    return out


def _group_pairs(pairs: Sequence[tuple[dict, dict]],
                 label: Callable[[dict], str]) -> dict[str, list[tuple[dict, dict]]]:
    """The pairs grouped by ``label`` of their A record, in sorted label order."""
    groups: dict[str, list] = defaultdict(list)
    for a, b in pairs:
        groups[label(a)].append((a, b))
    return dict(sorted(groups.items()))


def _by_source(pairs: Sequence[tuple[dict, dict]]) -> dict[str, dict]:
    """Per transcript source: the pairs' :func:`_paired_summary` (wall ratio candidate/A,
    agreement) and the candidate's token accounting (:func:`arm_summary`: emitted, decoded,
    injected)."""
    out = {}
    for source, group in _group_pairs(pairs, lambda a: a.get("source") or "?").items():
        tokens = arm_summary([b for _, b in group])
        out[source] = {**_paired_summary(group),
                       **{k: tokens[k] for k in ("tokens_emitted", "tokens_decoded",
                                                  "emitted_per_decoded", "tokens_injected")}}
    return out


def _paired_summary(pairs: Sequence[tuple[dict, dict]]) -> dict:
    a_ok = [agrees(a) for a, _ in pairs]
    b_ok = [agrees(b) for _, b in pairs]
    identical = sum(1 for a, b in pairs if a["output"]["content"] == b["output"]["content"]
                    and agreement_key(a["output"]) == agreement_key(b["output"]))
    wall = paired_ratio([a["timing"]["wall_s"] for a, _ in pairs],
                        [b["timing"]["wall_s"] for _, b in pairs]) if pairs else None
    both_tool = [(a, b) for a, b in pairs if a["timing"].get("first_tool_call_s")
                 and b["timing"].get("first_tool_call_s")]
    first_tool = paired_ratio([a["timing"]["first_tool_call_s"] for a, _ in both_tool],
                              [b["timing"]["first_tool_call_s"] for _, b in both_tool]) if both_tool else None
    return {
        "pairs": len(pairs),
        "agreement": mcnemar_drop(a_ok, b_ok).as_dict(),
        "identical_outputs": identical,
        "wall": wall.as_dict() if wall else None,
        "wall_ratios": [b["timing"]["wall_s"] / a["timing"]["wall_s"] for a, b in pairs],
        "first_tool_call": first_tool.as_dict() if first_tool else None,
    }


# ----------------------------------------------------------------------------- outputs

def _fmt(x, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def _verdict_bullets(name: str, p: dict) -> list[str]:
    """The verdict bullets of candidate ``name`` against A, from its ``paired`` summary."""
    ag, wall = p["agreement"], p["wall"]
    lines = [
        f"- agreement with the recording: A {ag['a_rate']:.1%}, {name} {ag['b_rate']:.1%} over "
        f"{p['pairs']} pairs; discordant A-only {ag['a_only']}, {name}-only {ag['b_only']}; "
        f"McNemar one-sided p = {ag['p_drop']:.4f}; drop 95% bounds "
        f"[{ag['drop_lower95']:+.3f}, {ag['drop_upper95']:+.3f}] -> "
        f"{'significant drop' if ag['significant_drop'] else 'no significant drop'}",
        f"- identical outputs A vs {name}: {p['identical_outputs']}/{p['pairs']}",
    ]
    if wall:
        q = wall["quantiles"]
        lines.append(
            f"- wall clock {name}/A: median {wall['median']:.3f} (one-sided 95% bounds "
            f"{_fmt(wall['lower95'])} .. {_fmt(wall['upper95'])}) -> {wall['verdict']}; "
            f"p10 {q['p10']:.3f}, p25 {q['p25']:.3f}, p75 {q['p75']:.3f}, p90 {q['p90']:.3f}")
    if p["first_tool_call"]:
        ft = p["first_tool_call"]
        lines.append(f"- time to first tool call {name}/A: median {ft['median']:.3f} over {ft['n']} pairs")
    if p["left_out_records"]:
        lines.append(f"- records left out of pairing (errors or missing arm): {p['left_out_records']}")
    return lines


def _by_tool_table(name: str, by_tool: dict) -> list[str]:
    """Markdown table of candidate ``name``'s paired summaries per recorded tool."""
    lines = [f"| tool | pairs | agree A | agree {name} | A-only | {name}-only | p(drop) | wall {name}/A p50 |",
             "|---|---|---|---|---|---|---|---|"]
    for tool, g in by_tool.items():
        ag = g["agreement"]
        lines.append(f"| {tool} | {g['pairs']} | {ag['a_rate']:.1%} | {ag['b_rate']:.1%} | {ag['a_only']} | "
                     f"{ag['b_only']} | {ag['p_drop']:.3f} | {_fmt(g['wall'] and g['wall']['median'])} |")
    return lines


def _by_source_table(name: str, by_source: dict) -> list[str]:
    """Markdown table of candidate ``name``'s wall ratio and token accounting per source."""
    lines = [f"| source | pairs | wall {name}/A p50 | one-sided 95% bounds | {name} injected / emitted "
             f"| {name} decoded / emitted |", "|---|---|---|---|---|---|"]
    for source, g in by_source.items():
        w = g["wall"]
        per = g["tokens_decoded"] / g["tokens_emitted"] if g["tokens_emitted"] else None
        lines.append(f"| {source} | {g['pairs']} | {w['median']:.3f} | {_fmt(w['lower95'])} .. "
                     f"{_fmt(w['upper95'])} | {g['tokens_injected']} / {g['tokens_emitted']} | "
                     f"{_fmt(per, '.2f')} |")
    return lines


def render_markdown(result: dict, plots: Sequence[str]) -> str:
    """One-page markdown report."""
    lines = ["# mlx-fill replay report", ""]
    for h in result["headers"]:
        urls = ", ".join(f"{k} = {v}" for k, v in sorted(h.get("urls", {}).items()))
        lines.append(f"- `{h.get('command')}` on `{h.get('sessions_file')}` ({urls}), model "
                     f"`{h.get('model')}`, {h.get('turns_selected')} turns from {h.get('sessions_selected')} "
                     f"sessions, reps {h.get('reps', 1)}, started {h.get('started')}")
        synth = [s["session_id"] for s in h.get("sessions", []) if s.get("tools_origin") == "synthesized"]
        if synth:
            lines.append(f"- tools synthesized from recorded calls for {len(synth)} session(s)")
        if h.get("corrupt_lines"):
            lines.append(f"- corrupt transcript lines skipped: {len(h['corrupt_lines'])}")
    if result["corrupt_lines"]:
        lines.append(f"- corrupt runs-file lines skipped: {len(result['corrupt_lines'])}")
    lines.append("")
    candidates = candidate_results(result)
    named = "candidates" in result
    if named:
        failed = result["verdict"]["failed"]
        lines += [f"## Verdict: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}", ""]
    for name, c in candidates.items():
        status = "PASS" if c["verdict"]["pass"] else "FAIL"
        lines += [f"### {name} vs A: {status}" if named else f"## Verdict: {status}", "",
                  *_verdict_bullets(name, c["paired"]), ""]
        if c.get("by_source"):
            lines += [*_by_source_table(name, c["by_source"]), ""]
    lines += ["## Arms", "",
              "| arm | requests | errors | agreement | wall p50 s | TTFT p50 s | first tool call p50 s "
              "| tool-call turns | emitted | decoded | emitted/decoded | injected |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in result["arms"].items():
        lines.append(
            f"| {arm} | {s['requests']} | {s['errors']} | {_fmt(s['agreement'], '.1%')} | "
            f"{_fmt(s['wall_s_median'])} | {_fmt(s['ttft_s_median'])} | {_fmt(s['first_tool_call_s_median'])} | "
            f"{s['tool_call_turns']} | {s['tokens_emitted']} | {s['tokens_decoded']} | "
            f"{_fmt(s['emitted_per_decoded'], '.3f')} | {s['tokens_injected']} |")
    lines.append("")
    lines.append("Decoded = target forwards reported in `usage.fill`, else one per emitted token.")
    for name, c in candidates.items():
        if c.get("by_tool"):
            title = f"By recorded tool: {name} vs A" if named else "By recorded tool"
            lines += ["", f"## {title}", "", *_by_tool_table(name, c["by_tool"])]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_plots(result: dict, runs: Runs, out_dir: Path) -> list[str]:
    """PNG plots (matplotlib Agg): per-arm latency boxes and, for A/B, the wall-ratio histogram
    (``wall_ratio.png``; one overlaid histogram and median line per candidate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    arms = sorted(result["arms"])
    metrics = (("wall_s", "wall clock (s)"), ("ttft_s", "time to first token (s)"),
               ("first_tool_call_s", "time to first tool call (s)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(12, 3.6))
    for ax, (key, title) in zip(axes, metrics):
        data = [[r["timing"][key] for r in runs.turns if r["arm"] == arm and not r.get("error")
                 and r["timing"].get(key) is not None] for arm in arms]
        if any(data):
            ax.boxplot([d or [float("nan")] for d in data], tick_labels=arms)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(title)
    fig.tight_layout()
    paths.append(str(out_dir / "latency.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    paired = {name: c["paired"] for name, c in candidate_results(result).items() if c["paired"]["wall_ratios"]}
    if paired:
        single = len(paired) == 1
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for i, (name, p) in enumerate(paired.items()):
            ratios, color = p["wall_ratios"], f"C{i % 10}"
            ax.hist([math.log2(r) for r in ratios], bins=min(30, max(5, len(ratios) // 2)), color=color,
                    alpha=1.0 if single else 0.45, label=None if single else name)
            ax.axvline(math.log2(p["wall"]["median"]), color="k" if single else color, linestyle="--",
                       label="median" if single else f"{name} median")
        ax.axvline(0.0, color="grey", linewidth=0.8)
        label = next(iter(paired)) if single else "candidate"
        ax.set_xlabel(f"log2(wall {label} / wall A) per pair (< 0: {label} faster)")
        ax.set_ylabel("pairs")
        ax.legend()
        fig.tight_layout()
        paths.append(str(out_dir / "wall_ratio.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write_report(runs: Runs, out_dir: Path, by_tool: bool = False) -> dict:
    """Write ``report.json``, ``report.md`` and the plots into ``out_dir``; return the result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = summarize(runs, by_tool=by_tool)
    plots = write_plots(result, runs, out_dir) if runs.turns else []
    (out_dir / "report.json").write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    (out_dir / "report.md").write_text(render_markdown(result, plots), encoding="utf-8")
    return result


def verdict_line(result: dict) -> str:
    """A summary for the terminal: one line, or with candidates other than ``B`` one line per
    candidate (``verdict NAME: ...``)."""
    if not result.get("verdict"):
        parts = [f"{arm}: agreement {_fmt(s['agreement'], '.1%')}, wall p50 {_fmt(s['wall_s_median'])} s, "
                 f"{s['errors']} errors" for arm, s in result["arms"].items()]
        return "; ".join(parts) or "no records"
    named = "candidates" in result
    return "\n".join(_candidate_line(f"verdict {name}" if named else "verdict", name, c)
                     for name, c in candidate_results(result).items())


def _candidate_line(prefix: str, name: str, c: dict) -> str:
    p, verdict = c["paired"], c["verdict"]
    wall = p["wall"]
    return (f"{prefix}: {'PASS' if verdict['pass'] else 'FAIL'} over {p['pairs']} pairs; agreement A "
            f"{p['agreement']['a_rate']:.1%} {name} {p['agreement']['b_rate']:.1%} "
            f"(McNemar p = {p['agreement']['p_drop']:.3f}); wall {name}/A median "
            f"{_fmt(wall and wall['median'])} ({verdict['wall']}); identical outputs "
            f"{p['identical_outputs']}/{p['pairs']}")


def add_arguments(parser) -> None:
    parser.add_argument("runs", type=Path, help="runs JSONL written by mlx-fill replay / ab")
    parser.add_argument("--by-tool", action="store_true", help="break the verdict down by recorded tool")
    parser.add_argument("--out", type=Path, default=None,
                        help="report directory (default: <runs stem>.report next to the runs file)")


def run(args) -> int:
    if not args.runs.is_file():
        raise UserError(f"no such runs file: {args.runs}; pass the runs.jsonl that "
                        f"`mlx-fill replay` or `mlx-fill ab` wrote")
    runs = load_runs(args.runs)
    if not runs.turns:
        raise UserError(f"{args.runs} holds no turn records; pass the runs.jsonl that "
                        f"`mlx-fill replay` or `mlx-fill ab` wrote")
    out_dir = args.out or args.runs.with_name(args.runs.stem + ".report")
    result = write_report(runs, out_dir, by_tool=args.by_tool)
    print(verdict_line(result))
    print(f"report: {out_dir / 'report.md'}")
    verdict = result.get("verdict")
    return 0 if verdict is None or verdict["pass"] else 1
