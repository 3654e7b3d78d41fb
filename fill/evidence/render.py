"""Rendering of ``mlx-fill report``: the Markdown report and its plots (matplotlib, the
``evidence`` extra, imported when plots are written)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .report import Runs


def candidate_results(result: dict) -> dict[str, dict]:
    """Candidate name -> its ``paired`` / ``by_source`` / ``by_tool`` / ``verdict`` for either
    result shape (empty without an A/B pair)."""
    if "candidates" in result:
        return result["candidates"]
    if not result.get("verdict"):
        return {}
    return {"B": {"paired": result["paired"], "by_source": result.get("by_source"),
                  "by_tool": result.get("by_tool"), "verdict": result["verdict"]}}


def fmt(x, spec: str = ".3f") -> str:
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
            f"{fmt(wall['lower95'])} .. {fmt(wall['upper95'])}) -> {wall['verdict']}; "
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
                     f"{ag['b_only']} | {ag['p_drop']:.3f} | {fmt(g['wall'] and g['wall']['median'])} |")
    return lines


def _by_transcript_source_table(name: str, by_source: dict) -> list[str]:
    """Markdown table of candidate ``name``'s wall ratio and token accounting per source."""
    lines = [f"| source | pairs | wall {name}/A p50 | one-sided 95% bounds | {name} injected / emitted "
             f"| {name} decoded / emitted |", "|---|---|---|---|---|---|"]
    for source, g in by_source.items():
        w = g["wall"]
        per = g["tokens_decoded"] / g["tokens_emitted"] if g["tokens_emitted"] else None
        lines.append(f"| {source} | {g['pairs']} | {w['median']:.3f} | {fmt(w['lower95'])} .. "
                     f"{fmt(w['upper95'])} | {g['tokens_injected']} / {g['tokens_emitted']} | "
                     f"{fmt(per, '.2f')} |")
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
            lines += [*_by_transcript_source_table(name, c["by_source"]), ""]
    lines += ["## Arms", "",
              "| arm | requests | errors | agreement | wall p50 s | TTFT p50 s | first tool call p50 s "
              "| tool-call turns | emitted | decoded | emitted/decoded | injected |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in result["arms"].items():
        lines.append(
            f"| {arm} | {s['requests']} | {s['errors']} | {fmt(s['agreement'], '.1%')} | "
            f"{fmt(s['wall_s_median'])} | {fmt(s['ttft_s_median'])} | {fmt(s['first_tool_call_s_median'])} | "
            f"{s['tool_call_turns']} | {s['tokens_emitted']} | {s['tokens_decoded']} | "
            f"{fmt(s['emitted_per_decoded'], '.3f')} | {s['tokens_injected']} |")
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
