"""Verdict math of ``mlx-fill report``: exact binomial bounds, McNemar drop test, paired ratios,
agreement keys, and whole-report verdicts that must PASS and must FAIL."""

from __future__ import annotations

import json
import math

import pytest

from mlx_fill.evidence import render, report, stats
from mlx_fill.cli import main

from cli_lines import one_error_line


# ----------------------------------------------------------------------------- exact binomial

def test_binom_cdf_matches_exact_counts():
    assert stats.binom_cdf(1, 5, 0.5) == pytest.approx(6 / 32)
    assert stats.binom_cdf(4, 5, 0.5) == pytest.approx(31 / 32)
    assert stats.binom_cdf(2, 4, 0.25) == pytest.approx(sum(math.comb(4, i) * 0.25**i * 0.75 ** (4 - i) for i in range(3)))
    assert stats.binom_cdf(-1, 5, 0.5) == 0.0
    assert stats.binom_cdf(5, 5, 0.5) == 1.0
    assert stats.binom_sf(5, 5, 0.5) == pytest.approx(1 / 32)


def test_binom_cdf_is_stable_for_large_n():
    # 2000 fair coins: P(X <= 1000) is just over one half.
    value = stats.binom_cdf(1000, 2000, 0.5)
    assert 0.5 < value < 0.52


@pytest.mark.parametrize("n", [1, 7, 20, 100])
def test_clopper_pearson_closed_forms(n):
    # 0 successes: upper bound solves (1 - t)^n = alpha; n successes: lower bound solves t^n = alpha.
    assert stats.clopper_pearson_upper(0, n) == pytest.approx(1 - 0.05 ** (1 / n), abs=1e-9)
    assert stats.clopper_pearson_lower(n, n) == pytest.approx(0.05 ** (1 / n), abs=1e-9)
    assert stats.clopper_pearson_lower(0, n) == 0.0
    assert stats.clopper_pearson_upper(n, n) == 1.0


def test_clopper_pearson_brackets_the_estimate():
    lo, hi = stats.clopper_pearson_lower(7, 20), stats.clopper_pearson_upper(7, 20)
    assert lo < 7 / 20 < hi
    assert stats.binom_sf(7, 20, lo) == pytest.approx(0.05, abs=1e-9)
    assert stats.binom_cdf(7, 20, hi) == pytest.approx(0.05, abs=1e-9)


# ----------------------------------------------------------------------------- McNemar

def _outcomes(both, a_only, b_only, neither):
    a = [True] * both + [True] * a_only + [False] * b_only + [False] * neither
    b = [True] * both + [False] * a_only + [True] * b_only + [False] * neither
    return a, b


def test_identical_arms_show_no_drop():
    m = stats.mcnemar_drop(*_outcomes(15, 0, 0, 5))
    assert (m.pairs, m.both, m.a_only, m.b_only, m.neither) == (20, 15, 0, 0, 5)
    assert m.p_drop == 1.0 and not m.significant_drop
    assert m.a_rate == m.b_rate == 0.75


def test_large_drop_fails():
    m = stats.mcnemar_drop(*_outcomes(5, 10, 0, 5))
    assert m.p_drop == pytest.approx(2**-10)
    assert m.significant_drop
    assert m.drop == pytest.approx(0.5)
    assert 0 < m.drop_lower95 <= m.drop <= m.drop_upper95


def test_five_one_sided_losses_are_significant_but_four_are_not():
    # Exact one-sided p-values: 1/32 < 0.05 <= 1/16.
    assert stats.mcnemar_drop(*_outcomes(10, 5, 0, 0)).significant_drop
    assert not stats.mcnemar_drop(*_outcomes(10, 4, 0, 0)).significant_drop


def test_gains_are_never_a_drop():
    m = stats.mcnemar_drop(*_outcomes(5, 0, 12, 3))
    assert not m.significant_drop and m.drop < 0 and m.drop_upper95 < 0


@pytest.mark.parametrize("a_only", range(0, 13))
@pytest.mark.parametrize("b_only", [0, 1, 3, 8])
def test_bound_and_p_value_agree(a_only, b_only):
    m = stats.mcnemar_drop(*_outcomes(4, a_only, b_only, 2))
    assert m.significant_drop == (m.p_drop < 0.05)
    assert m.drop_lower95 <= m.drop + 1e-12 and m.drop <= m.drop_upper95 + 1e-12


def test_mcnemar_rejects_unpaired_input():
    with pytest.raises(ValueError, match="differ in length"):
        stats.mcnemar_drop([True], [True, False])


# ----------------------------------------------------------------------------- paired ratios

def test_median_bounds_use_extremes_at_five_pairs():
    assert stats.median_bounds([3.0, 1.0, 5.0, 2.0, 4.0]) == (1.0, 5.0)
    assert stats.median_bounds([1.0, 2.0, 3.0, 4.0]) == (None, None)


def test_median_bounds_tighten_with_more_pairs():
    values = [float(i) for i in range(1, 101)]
    lo, hi = stats.median_bounds(values)
    assert 40 < lo < 50.5 < hi < 61
    # Sign-test coverage: at most 5% of a fair sign sequence lies above the upper bound.
    assert stats.binom_cdf(int(hi) - 1, 100, 0.5) >= 0.95


def test_slower_arm_is_called_slower():
    a = [1.0 + 0.01 * i for i in range(20)]
    s = stats.paired_ratio(a, [2 * x for x in a])
    assert s.median == pytest.approx(2.0) and s.verdict == "slower"


def test_faster_arm_is_called_faster():
    a = [1.0 + 0.01 * i for i in range(20)]
    s = stats.paired_ratio(a, [0.6 * x for x in a])
    assert s.verdict == "faster" and s.upper95 < 1


def test_mixed_ratios_are_inconclusive():
    a = [1.0] * 20
    b = [0.5, 2.0] * 10
    assert stats.paired_ratio(a, b).verdict == "inconclusive"


def test_too_few_pairs_are_inconclusive():
    s = stats.paired_ratio([1.0, 1.0], [3.0, 3.0])
    assert (s.lower95, s.upper95, s.verdict) == (None, None, "inconclusive")


def test_paired_ratio_rejects_bad_times():
    with pytest.raises(ValueError, match="positive"):
        stats.paired_ratio([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="no pairs"):
        stats.paired_ratio([], [])


# ----------------------------------------------------------------------------- agreement keys

def test_call_agreement_ignores_key_order_and_argument_encoding():
    recorded = {"content": "", "tool_calls": [{"name": "get", "arguments": {"a": 1, "b": {"x": [1, 2], "y": "z"}}}]}
    replied = {"content": "sure", "tool_calls": [{"name": "get", "arguments": '{"b": {"y": "z", "x": [1, 2]}, "a": 1}'}]}
    assert report.agreement_key(recorded) == report.agreement_key(replied)


def test_call_agreement_sees_value_name_and_order_changes():
    base = {"tool_calls": [{"name": "get", "arguments": {"a": 1}}]}
    assert report.agreement_key(base) != report.agreement_key({"tool_calls": [{"name": "get", "arguments": {"a": 2}}]})
    assert report.agreement_key(base) != report.agreement_key({"tool_calls": [{"name": "put", "arguments": {"a": 1}}]})
    two = [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]
    assert report.agreement_key({"tool_calls": two}) != report.agreement_key({"tool_calls": two[::-1]})
    assert report.agreement_key(base) != report.agreement_key({"content": "get a=1"})


def test_unparsable_arguments_never_match_an_object():
    assert report.canonical_arguments('{"a": 1') == 'raw:{"a": 1'
    assert report.agreement_key({"tool_calls": [{"name": "f", "arguments": "{}"}]}) != \
        report.agreement_key({"tool_calls": [{"name": "f", "arguments": "{"}]})


def test_prose_is_normalized_for_whitespace_only():
    assert report.normalize_prose("  Hello,\n\n  world\t! ") == "Hello, world !"
    assert report.agreement_key({"content": "a  b"}) == report.agreement_key({"content": "a\nb", "tool_calls": []})
    assert report.agreement_key({"content": "A b"}) != report.agreement_key({"content": "a b"})
    assert report.normalize_prose("e\u0301") == "\u00e9"


# ----------------------------------------------------------------------------- whole reports

def _record(arm, session, turn, *, agree, wall, rep=0, tool=None, fill=None, error=None, first_tool=None):
    expected = {"content": "ok", "tool_calls": [], "tool_names": [tool] if tool else []}
    return {"kind": "turn", "arm": arm, "session_id": session, "turn": turn, "rep": rep,
            "expected": expected,
            "output": {"content": "ok" if agree else "something else", "tool_calls": [], "finish_reason": "stop"},
            "timing": {"wall_s": wall, "ttft_s": wall / 2, "first_tool_call_s": first_tool},
            "usage": {"prompt_tokens": 10, "completion_tokens": 8, "fill": fill}, "error": error}


def _runs(records):
    return report.Runs(headers=[{"kind": "run", "command": "ab"}], turns=records, corrupt_lines=[])


def _ab(n, *, b_agree, b_wall, a_agree=lambda i: True, a_wall=lambda i: 1.0 + 0.01 * i):
    records = []
    for i in range(n):
        records.append(_record("A", f"s{i % 4}", i, agree=a_agree(i), wall=a_wall(i), tool="get" if i % 2 else None))
        records.append(_record("B", f"s{i % 4}", i, agree=b_agree(i), wall=b_wall(i), tool="get" if i % 2 else None))
    return _runs(records)


def test_equal_arms_pass():
    result = report.summarize(_ab(24, b_agree=lambda i: True, b_wall=lambda i: 1.0 + 0.01 * ((i * 7) % 24)))
    assert result["verdict"]["pass"] is True
    assert result["paired"]["pairs"] == 24 and result["paired"]["identical_outputs"] == 24


def test_agreement_drop_fails_the_run():
    result = report.summarize(_ab(24, b_agree=lambda i: i % 3 == 0, b_wall=lambda i: 0.5))
    assert result["verdict"]["agreement_drops"] is True
    assert result["verdict"]["pass"] is False
    assert result["paired"]["wall"]["verdict"] == "faster"


def test_slower_arm_fails_the_run():
    result = report.summarize(_ab(24, b_agree=lambda i: True, b_wall=lambda i: 3.0))
    assert result["verdict"] == {"pass": False, "agreement_drops": False, "wall": "slower"}


def test_pairing_leaves_out_errors_and_lonely_records():
    runs = _ab(6, b_agree=lambda i: True, b_wall=lambda i: 1.0)
    runs.turns[1]["error"] = "APIConnectionError: refused"
    runs.turns.append(_record("A", "extra", 0, agree=True, wall=1.0))
    result = report.summarize(runs)
    assert result["paired"]["pairs"] == 5
    assert result["paired"]["left_out_records"] == 3
    assert result["arms"]["B"]["errors"] == 1


def test_reps_pair_separately():
    records = [_record(arm, "s", 0, rep=rep, agree=True, wall=1.0 + rep) for rep in range(3) for arm in "AB"]
    pairs, left_out = report.pair_records(records)
    assert len(pairs) == 3 and left_out == 0
    assert all(a["rep"] == b["rep"] and a["arm"] == "A" and b["arm"] == "B" for a, b in pairs)


def test_tokens_decoded_use_fill_forwards_when_reported():
    runs = _runs([_record("A", "s", 0, agree=True, wall=1.0),
                  _record("B", "s", 0, agree=True, wall=1.0, fill={"forwards": 3, "injected": 5, "emitted": 8})])
    arms = report.summarize(runs)["arms"]
    assert (arms["A"]["tokens_emitted"], arms["A"]["tokens_decoded"]) == (8, 8)
    assert (arms["B"]["tokens_emitted"], arms["B"]["tokens_decoded"], arms["B"]["tokens_injected"]) == (8, 3, 5)
    assert arms["B"]["emitted_per_decoded"] == pytest.approx(8 / 3)


def test_first_tool_call_is_compared_where_both_arms_called():
    runs = _runs([_record("A", "s", 0, agree=True, wall=1.0, first_tool=0.4),
                  _record("B", "s", 0, agree=True, wall=1.0, first_tool=0.2),
                  _record("A", "s", 1, agree=True, wall=1.0, first_tool=0.4),
                  _record("B", "s", 1, agree=True, wall=1.0)])
    result = report.summarize(runs)
    assert result["paired"]["first_tool_call"]["n"] == 1
    assert result["paired"]["first_tool_call"]["median"] == pytest.approx(0.5)
    assert result["arms"]["A"]["first_tool_call_s_median"] == pytest.approx(0.4)


def test_by_tool_groups_on_the_recorded_tool():
    result = report.summarize(_ab(8, b_agree=lambda i: True, b_wall=lambda i: 1.0), by_tool=True)
    assert set(result["by_tool"]) == {"get", "(prose)"}
    assert result["by_tool"]["get"]["pairs"] == 4


def test_by_source_splits_the_wall_ratio_and_the_candidates_tokens():
    """Each transcript source gets its own paired median (candidate/A) and the candidate's
    tokens; records without a source fall under "?"."""
    records = []
    for i in range(10):
        source = "pi" if i < 6 else "tau"
        fill = {"forwards": 4, "injected": 4, "emitted": 8}
        for arm, wall in (("A", 2.0), ("B", 1.0 if source == "pi" else 3.0)):
            rec = _record(arm, f"{source}{i % 2}", i, agree=True, wall=wall,
                          fill=fill if arm == "B" else None)
            rec["source"] = source
            records.append(rec)
    by_source = report.summarize(_runs(records))["by_source"]
    assert list(by_source) == ["pi", "tau"]
    assert by_source["pi"]["pairs"] == 6 and by_source["pi"]["wall"]["median"] == pytest.approx(0.5)
    assert by_source["tau"]["pairs"] == 4 and by_source["tau"]["wall"]["median"] == pytest.approx(1.5)
    assert (by_source["pi"]["tokens_emitted"], by_source["pi"]["tokens_decoded"],
            by_source["pi"]["tokens_injected"]) == (48, 24, 24)
    md = render.render_markdown(report.summarize(_runs(records)), [])
    assert "| pi | 6 | 0.500 |" in md and "| tau | 4 | 1.500 |" in md


def test_single_arm_runs_have_no_verdict():
    runs = _runs([_record("replay", "s", i, agree=i % 2 == 0, wall=1.0) for i in range(4)])
    result = report.summarize(runs)
    assert result["verdict"] is None and result["arms"]["replay"]["agreement"] == 0.5


def test_report_command_writes_outputs_and_exit_code(tmp_path, capsys):
    runs_path = tmp_path / "runs.jsonl"
    failing = _ab(24, b_agree=lambda i: False, b_wall=lambda i: 1.0)
    lines = [json.dumps(h) for h in failing.headers] + [json.dumps(r) for r in failing.turns]
    runs_path.write_text("\n".join(lines[:3] + ["{not json"] + lines[3:]) + "\n")
    assert main(["report", str(runs_path), "--by-tool"]) == 1
    out = capsys.readouterr().out
    assert "verdict: FAIL over 24 pairs" in out
    folder = tmp_path / "runs.report"
    result = json.loads((folder / "report.json").read_text())
    assert result["corrupt_lines"] == [4] and result["verdict"]["agreement_drops"] is True
    markdown = (folder / "report.md").read_text()
    assert "## Verdict: FAIL" in markdown and "| get |" in markdown
    for name in ("latency.png", "wall_ratio.png"):
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _abc(n=24):
    """A and two named candidates: ``strict`` as good as A, ``echo`` agreeing on a third only."""
    arms = {"A": lambda i: True, "strict": lambda i: True, "echo": lambda i: i % 3 == 0}
    return _runs([_record(arm, f"s{i % 4}", i, agree=agree(i), wall=1.0 + 0.01 * ((i * 7) % n),
                          tool="get" if i % 2 else None) for i in range(n) for arm, agree in arms.items()])


def _as_b(runs, candidate):
    """The two-arm run of A and ``candidate`` renamed ``B``."""
    return _runs([dict(r, arm="B") if r["arm"] == candidate else r for r in runs.turns if r["arm"] in ("A", candidate)])


def test_each_candidate_gets_the_two_arm_verdict_against_a():
    runs = _abc()
    result = report.summarize(runs, by_tool=True)
    assert "paired" not in result and "by_source" not in result and "by_tool" not in result
    assert list(result["candidates"]) == ["strict", "echo"] and set(result["arms"]) == {"A", "strict", "echo"}
    for name, c in result["candidates"].items():
        alone = report.summarize(_as_b(runs, name), by_tool=True)
        assert c == {key: alone[key] for key in ("paired", "by_source", "by_tool", "verdict")}
    assert result["candidates"]["strict"]["verdict"]["pass"] is True
    assert result["candidates"]["echo"]["verdict"]["agreement_drops"] is True
    assert result["verdict"] == {"pass": False, "failed": ["echo"]}
    lines = report.verdict_line(result).splitlines()
    assert [line.split(" over ")[0] for line in lines] == ["verdict strict: PASS", "verdict echo: FAIL"]
    assert "agreement A 100.0% echo 33.3%" in lines[1] and "wall echo/A median" in lines[1]


def test_pairing_with_several_candidates_counts_only_its_arms():
    runs = _abc(6)
    runs.turns[1]["error"] = "APIConnectionError: refused"  # strict, turn 0
    pairs, left_out = report.pair_records(runs.turns, "strict")
    assert len(pairs) == 5 and left_out == 2
    assert all(a["arm"] == "A" and b["arm"] == "strict" for a, b in pairs)
    pairs, left_out = report.pair_records(runs.turns, "echo")
    assert [b["arm"] for _, b in pairs] == ["echo"] * 6 and left_out == 0


def test_one_named_candidate_uses_the_candidates_shape():
    runs = _runs([r for r in _abc().turns if r["arm"] != "echo"])
    result = report.summarize(runs)
    assert list(result["candidates"]) == ["strict"] and result["verdict"] == {"pass": True, "failed": []}
    assert report.verdict_line(result).startswith("verdict strict: PASS over 24 pairs")


def test_report_command_with_several_candidates(tmp_path, capsys):
    runs_path = tmp_path / "runs.jsonl"
    runs = _abc()
    runs_path.write_text("\n".join(json.dumps(r) for r in runs.headers + runs.turns) + "\n")
    assert main(["report", str(runs_path), "--by-tool"]) == 1
    assert capsys.readouterr().out.startswith("verdict strict: PASS over 24 pairs")
    folder = tmp_path / "runs.report"
    assert json.loads((folder / "report.json").read_text())["verdict"]["failed"] == ["echo"]
    markdown = (folder / "report.md").read_text()
    for needle in ("## Verdict: FAIL (echo)", "### strict vs A: PASS", "### echo vs A: FAIL",
                   "identical outputs A vs echo: 8/24", "## By recorded tool: echo vs A", "| agree echo |"):
        assert needle in markdown, needle
    assert (folder / "wall_ratio.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    passing = [r for r in runs.turns if r["arm"] != "echo"] + [dict(r, arm="all") for r in runs.turns if r["arm"] == "A"]
    runs_path.write_text("\n".join(json.dumps(r) for r in runs.headers + passing) + "\n")
    assert main(["report", str(runs_path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3  # one verdict line per candidate, the path


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("usage.fill", "x", "its usage.fill is not a JSON object"),
    ("usage.fill", {"forwards": "x"}, "its usage.fill.forwards is not a whole number"),
    ("usage.completion_tokens", "x", "its usage.completion_tokens is not a whole number"),
    ("session_id", [1], "its 'session_id' is not a JSON string"),
    ("turn", [1], "its turn is not a whole number"),
    ("source", [1], "its source is not a string"),
    ("expected.tool_names", [1], "its expected.tool_names is not a list of strings"),
    ("timing.wall_s", 0, "its timing has no wall_s number of seconds above 0")])
def test_report_names_the_line_and_field_of_an_edited_turn(field, value, needle, tmp_path, capsys):
    records = _ab(8, b_agree=lambda i: True, b_wall=lambda i: 1.0).turns
    *parents, key = field.split(".")
    target = records[4]
    for name in parents:
        target = target[name]
    target[key] = value
    runs_path = tmp_path / "runs.jsonl"
    runs_path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    one_error_line(capsys, ["report", str(runs_path)], f"{runs_path} line 5 is not a turn record",
                   needle, "mlx-fill replay")


def test_report_refuses_a_file_holding_two_runs_records(tmp_path, capsys):
    """Two runs concatenated would pair the second run's records in place of the first's."""
    records = _ab(4, b_agree=lambda i: True, b_wall=lambda i: 1.0).turns
    runs_path = tmp_path / "runs.jsonl"
    runs_path.write_text("\n".join(json.dumps(r) for r in records + records) + "\n")
    one_error_line(capsys, ["report", str(runs_path)],
                   f"{runs_path} line {len(records) + 1} repeats the record of line 1",
                   "the file holds two runs")


def test_report_reads_a_reply_without_content(tmp_path, capsys):
    records = _ab(8, b_agree=lambda i: True, b_wall=lambda i: 1.0).turns
    records[1]["output"] = {}
    runs_path = tmp_path / "runs.jsonl"
    runs_path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["report", str(runs_path)]) == 0
    assert "identical outputs 7/8" in capsys.readouterr().out


def test_report_command_rejects_missing_or_empty_files(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.jsonl")]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"kind": "run"}) + "\n")
    assert main(["report", str(empty)]) == 2
    assert "no turn records" in capsys.readouterr().err
