"""``mlx-fill report``: agreement and wall-clock verdicts for replay / A/B runs files (the
statistics: :mod:`mlx_fill.evidence.stats`; the Markdown and plots: :mod:`mlx_fill.evidence.render`).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from mlx_fill.core.errors import UserError, output_dir
from .render import candidate_results, fmt, render_markdown, write_plots
from .stats import mcnemar_drop, paired_ratio


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


# what every ``kind: turn`` record holds (``replay.turn_record``), by the type of its value
TURN_FIELDS: dict[str, type] = {"arm": str, "session_id": str, "output": dict, "expected": dict,
                                "timing": dict, "usage": dict}
JSON_NAMES = {str: "string", dict: "object", list: "list"}  # a field type, as a message says it


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _usage_problem(usage: dict) -> str | None:
    """What a turn's ``usage`` holds that is not token counts, or None: ``prompt_tokens`` and
    ``completion_tokens`` are counts or null, ``fill`` is null or an object whose ``forwards``
    and ``injected``, where present, are counts."""
    for key in ("prompt_tokens", "completion_tokens"):
        if usage.get(key) is not None and not _count(usage[key]):
            return f"its usage.{key} is not a whole number of tokens"
    fill = usage.get("fill")
    if fill is None:
        return None
    if not isinstance(fill, dict):
        return "its usage.fill is not a JSON object"
    for key in ("forwards", "injected"):
        if key in fill and not _count(fill[key]):
            return f"its usage.fill.{key} is not a whole number"
    return None


def _reply_problem(reply: dict, key: str) -> str | None:
    """What a turn's ``output`` or ``expected`` holds that is not a reply, or None."""
    if reply.get("content") is not None and not isinstance(reply["content"], str):
        return f"its {key}.content is not a string"
    calls = reply.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls)):
        return f"its {key}.tool_calls is not a list of calls with a name"
    names = reply.get("tool_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return f"its {key}.tool_names is not a list of strings"
    return None


def _turn_problem(record: dict) -> str | None:
    """What a ``kind: turn`` record lacks for the report, or None."""
    for key in (*TURN_FIELDS, "turn"):
        if key not in record:
            return f"it has no {key!r}"
    for key, kind in TURN_FIELDS.items():
        if not isinstance(record[key], kind):
            return f"its {key!r} is not a JSON {JSON_NAMES[kind]}"
    wall = record["timing"].get("wall_s")
    if not (_seconds(wall) and wall > 0):
        return "its timing has no wall_s number of seconds above 0"
    for key in ("ttft_s", "first_tool_call_s"):
        if record["timing"].get(key) is not None and not _seconds(record["timing"][key]):
            return f"its timing.{key} is not a number of seconds"
    for key in ("turn", "rep"):
        if not _count(record.get(key, 0)):
            return f"its {key} is not a whole number"
    if record.get("source") is not None and not isinstance(record["source"], str):
        return "its source is not a string"
    return (_usage_problem(record["usage"]) or _reply_problem(record["output"], "output")
            or _reply_problem(record["expected"], "expected"))


# what a ``kind: run`` header holds where it holds it (``replay.run``), by the type of its value
HEADER_FIELDS: dict[str, type] = {"urls": dict, "sessions": list, "corrupt_lines": list}


def _header_problem(header: dict) -> str | None:
    """What a ``kind: run`` header holds that the report cannot read, or None."""
    for key, kind in HEADER_FIELDS.items():
        if key in header and not isinstance(header[key], kind):
            return f"its {key!r} is not a JSON {JSON_NAMES[kind]}"
    if not all(isinstance(s, dict) for s in header.get("sessions", [])):
        return "its sessions are not JSON objects"
    return None


def load_runs(path: str | Path) -> Runs:
    """Read a runs JSONL file; lines that are no record (not JSON, or JSON that is not an object
    of ``kind`` ``run`` or ``turn``) are counted in ``corrupt_lines``, not fatal. A line that is not
    UTF-8 text, a turn record or run header without the fields ``replay`` writes (of their
    types), or a turn record of an arm, session, turn and repetition an earlier line holds (two
    runs' records in one file, which pairing would read as one), is a ``UserError`` naming the
    file and line."""
    runs = Runs([], [], [])
    fix = "pass the runs.jsonl that `mlx-fill replay` or `mlx-fill ab` wrote"
    recorded: dict[tuple, int] = {}  # (arm, session, turn, rep) -> the line that holds it
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path} line {number} is not UTF-8 text; {fix}") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                runs.corrupt_lines.append(number)
                continue
            if not isinstance(obj, dict) or obj.get("kind") not in ("run", "turn"):
                runs.corrupt_lines.append(number)
            elif obj.get("kind") == "run":
                problem = _header_problem(obj)
                if problem:
                    raise UserError(f"{path} line {number} is not a run header ({problem}); {fix}")
                runs.headers.append(obj)
            elif obj.get("kind") == "turn":
                problem = _turn_problem(obj)
                if problem:
                    raise UserError(f"{path} line {number} is not a turn record ({problem}); {fix}")
                key = (obj["arm"], obj["session_id"], obj["turn"], obj.get("rep", 0))
                if key in recorded:
                    raise UserError(f"{path} line {number} repeats the record of line "
                                    f"{recorded[key]} (arm {key[0]}, session {key[1]!r}, turn "
                                    f"{key[2]}, rep {key[3]}): the file holds two runs; pass one "
                                    f"run's runs.jsonl")
                recorded[key] = number
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


def _candidate_summary(turns: Sequence[dict], candidate: str, by_tool: bool) -> dict:
    """``paired`` (with ``left_out_records``), ``by_source``, ``by_tool`` when asked, and
    ``verdict`` for one candidate against A."""
    pairs, left_out = pair_records(turns, candidate)
    paired = _paired_summary(pairs)
    paired["left_out_records"] = left_out
    out: dict = {"paired": paired, "by_source": _by_transcript_source(pairs)}
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


def _by_transcript_source(pairs: Sequence[tuple[dict, dict]]) -> dict[str, dict]:
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
    identical = sum(1 for a, b in pairs if a["output"].get("content") == b["output"].get("content")
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
        parts = [f"{arm}: agreement {fmt(s['agreement'], '.1%')}, wall p50 {fmt(s['wall_s_median'])} s, "
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
            f"{fmt(wall and wall['median'])} ({verdict['wall']}); identical outputs "
            f"{p['identical_outputs']}/{p['pairs']}")


def add_arguments(parser) -> None:
    parser.add_argument("runs", type=Path, help="runs JSONL written by mlx-fill replay / ab")
    parser.add_argument("--by-tool", action="store_true", help="break the verdict down by recorded tool")
    parser.add_argument("--out", type=output_dir, default=None,
                        help="report directory (default: <runs stem>.report next to the runs file)")


def _what_else(runs: Runs) -> str:
    """What a runs file without turn records held instead, as a clause of the error."""
    if not runs.corrupt_lines:
        return f" ({len(runs.headers)} run headers)" if runs.headers else " (no lines)"
    return (f" ({len(runs.corrupt_lines)} line(s) not JSON, or with no \"kind\" run or turn; "
            f"the first is line {runs.corrupt_lines[0]})")


def run(args) -> int:
    if not args.runs.is_file():
        what = "a folder, not a runs file" if args.runs.is_dir() else "no such runs file"
        raise UserError(f"{what}: {args.runs}; pass the runs.jsonl that "
                        f"`mlx-fill replay` or `mlx-fill ab` wrote")
    runs = load_runs(args.runs)
    if not runs.turns:
        raise UserError(f"{args.runs} holds no turn records{_what_else(runs)}; pass the "
                        f"runs.jsonl that `mlx-fill replay` or `mlx-fill ab` wrote")
    out_dir = args.out or args.runs.with_name(args.runs.stem + ".report")
    result = write_report(runs, out_dir, by_tool=args.by_tool)
    print(verdict_line(result))
    print(f"report: {out_dir / 'report.md'}")
    verdict = result.get("verdict")
    return 0 if verdict is None or verdict["pass"] else 1
