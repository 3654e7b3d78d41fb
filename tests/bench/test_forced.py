"""Forced replay (``python -m scripts.bench.forced``): a short run on a tiny model, and the oracle."""

from __future__ import annotations

import gzip
import json
import os

import mlx.core as mx
import pytest

from mlx_fill.assets.checkout import TRANSCRIPTS
from scripts.bench import forced
from scripts.bench.__main__ import forcing_processor
from mlx_fill.core.plan import DispatchPlan
from scripts.bench.oracle import RoundRecord, curve_plan, oracle_cost, priced_cost

FLAT = curve_plan([1.0] * 15)  # any chunk up to 16 rows costs one forward, no round overhead
LINEAR = curve_plan([float(m) for m in range(2, 17)], overhead=0.1)


def test_oracle_takes_the_span_when_rows_are_free():
    # slot 0 pending; a 3-id span after it: one round emits slots 0..3, a step emits slot 4
    assert oracle_cost([3, 0, 0, 0, 0], FLAT) == 1 + 1 + 1


def test_oracle_is_plain_decoding_when_rounds_cost_their_rows():
    assert oracle_cost([3, 2, 1, 0, 0], LINEAR) == 5 + 1
    assert oracle_cost([0] * 7, FLAT) == 7 + 1


def test_oracle_skips_a_short_span_for_a_longer_one_behind_it():
    # greedy takes the 1-id span at slot 0 and loses the 4-id span at slot 1:
    # 1 + 1.5 + 5 plain steps = 7.5; the optimum steps once, then one round of 4: 1 + 1 + 1.5 + 1
    plan = curve_plan([1.5] * 15)
    assert oracle_cost([1, 4, 0, 0, 0, 0, 0], plan) == pytest.approx(4.5)


def test_priced_cost_counts_steps_rounds_and_overhead():
    plan = curve_plan([1.5, 2.0, 2.5], overhead=0.25)  # c(2..4)
    rounds = [RoundRecord(True, "verify", 3, 2),   # chained: 4 rows, one forward
              RoundRecord(False, "verify", 2, 0)]  # first id rejected by the in-flight sample
    # 10 forward calls: the round's one and 9 plain steps
    assert priced_cost(10, rounds, plan, plan) == pytest.approx(9 + 2.5 + 0.25 + 0.25)
    assert rounds[0].emitted == 3 and rounds[1].rows == 0
    # the 9 plain steps fed 8 ids (the first fed the prompt's last): 11 ids, 12 plain forwards;
    # what the rounds saved is what plain decoding spends beyond the arm
    assert plan.round_saving(rounds[0]) == pytest.approx(3 - 2.5 - 0.25)
    assert plan.round_saving(rounds[1]) == pytest.approx(-0.25)
    assert sum(plan.round_saving(r) for r in rounds) == pytest.approx(
        12 - priced_cost(10, rounds, plan, plan))


def test_rounds_and_the_oracle_are_priced_at_their_kv_length():
    plan = DispatchPlan(key=None, max_chunk=16, cost={2: 1.2, 16: 6.0}, qualified=True,
                        cost_kv=512, long_kv=4096, long_cost={1: 2.0, 2: 3.6, 16: 15.0})
    near, far = RoundRecord(True, "verify", 1, 1, kv=512), RoundRecord(True, "verify", 1, 1, kv=4096)
    assert priced_cost(1, [near], plan, plan) == pytest.approx(1.2)
    assert priced_cost(1, [far], plan, plan) == pytest.approx(1.8)
    assert oracle_cost([1, 0], plan, 511) == pytest.approx(1 + 1.2)  # one round, slots 0 and 1
    assert oracle_cost([1, 0], plan, 4095) == pytest.approx(1 + 1.8)
    assert oracle_cost([1, 0], plan, 20000) == 1 + 2  # c(2) 2.2 there: two plain steps


def test_own_spans_read_an_arms_rounds_at_their_positions():
    from types import SimpleNamespace
    turn = SimpleNamespace(output=[5, 6, 7, 8, 9])
    # a round drafting slots 1.. (its third id wrong) and one drafting slots 3..
    proposals = [(1, [6, 7, 0]), (3, [8, 9])]
    accepted, positions = forced.own_spans(turn, proposals, available=[3, 1, 2, 1, 0])
    assert accepted == [2, 0, 2, 0, 0]
    assert positions == [3, 0, 2, 0, 0]  # any source's longest span, only where the arm drafted


def test_curve_plan_rejects_a_bad_curve():
    with pytest.raises(ValueError):
        curve_plan([])
    with pytest.raises(ValueError):
        curve_plan([1.2, 0.0])


def test_forcing_depends_on_the_logits():
    """A forced id that did not depend on the forward would let MLX skip the model."""
    force = forcing_processor(1, [3, 5])
    out = force(mx.array([7, 3]), mx.full((1, 8), float("nan")))
    assert bool(mx.isnan(out).any())
    ok = force(mx.array([7, 3]), mx.zeros((1, 8)))
    assert int(mx.argmax(ok, axis=-1).item()) == 5


def test_clip_context_keeps_head_and_latest_from_a_message_start():
    prompt = [1, 2, 3] + [9, 10, 11, 0, 12, 13, 0, 14, 15]
    # head of 3, budget 8: the last 5 ids are [13, 0, 14, 15]... cut to the message start 0
    assert forced.clip_context(prompt, 3, 8, 0) == [1, 2, 3, 0, 14, 15]
    assert forced.clip_context(prompt, 3, None, 0) == prompt
    assert forced.clip_context(prompt, 10, 6, None) == [1, 2, 3, 0, 14, 15]


@pytest.fixture(scope="module")
def two_sessions(tmp_path_factory):
    """One structured (tau-bench) and one inline-text session of the committed transcripts."""
    with gzip.open(TRANSCRIPTS, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    picked = [next(r for r in rows if r["source"] == s)
              for s in ("tau_bench_gpt4o_airline", "aider_examples")]
    path = tmp_path_factory.mktemp("forced") / "two.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return path


def tiny_replay_args(transcripts, max_tokens: int, *extra: str) -> list[str]:
    """Forced-replay arguments for one turn per source of ``transcripts`` on the tiny fixture."""
    from mlx_fill.assets.fixtures import fixture_path
    return ["--transcripts", str(transcripts), "--model", str(fixture_path("qwen3-json")),
            "--dtype", "none", "--per-source", "1", "--max-tokens", str(max_tokens),
            "--max-context", "384", "--repeats", "1", *extra]


def replay_report(args: list[str], tmp_path) -> dict:
    """Run the forced replay with ``args``; its JSON report (the run must succeed)."""
    out = tmp_path / "forced.json"
    assert forced.main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_short_forced_replay_is_identical_and_reports_every_arm(two_sessions, tmp_path):
    report = replay_report(tiny_replay_args(two_sessions, 16, "--curve", "1.1,1.4,1.7"), tmp_path)
    assert report["identical"] is True
    assert set(report["rows"]) == {"overall", "tau_bench_gpt4o_airline", "aider_examples"}
    turns = {"overall": 2, "tau_bench_gpt4o_airline": 1, "aider_examples": 1}
    for key, row in report["rows"].items():
        assert set(forced.ARMS) | {"oracle"} <= set(row)
        for arm in (*forced.ARMS, "oracle"):
            assert isinstance(row[arm]["x_plain"], float) and row[arm]["x_plain"] > 0
            assert "projected_x_plain" in row[arm]
        for arm in forced.ARMS:
            assert row[arm]["fwd_per_tok"] > 0 and row[arm]["mismatched_turns"] == 0
            assert row[arm]["bookkeeping_ms_per_tok"] >= 0
            assert row[arm]["bookkeeping_share"] >= 0  # timed: a share of the model's step
        # cutting the oracle's spans shorter never helps it, and it never loses to plain
        capped = [row["oracle"]["priced_x_plain_span_cap"][str(c)] for c in forced.ORACLE_CAPS]
        assert 1.0 <= capped[0] and capped == sorted(capped)
        assert capped[-1] <= row["oracle"]["priced_x_plain"]
        # restricting the oracle to what `all` had: its own rounds are one choice among its
        # accepted spans, which are among the spans offered at its positions
        own = row["oracle"]["priced_x_plain_own"]
        assert (row["all"]["priced_x_plain"] <= own["accepted"] <= own["positions"]
                <= row["oracle"]["priced_x_plain"])
        # each source's rounds are what it saved; together, what plain spent beyond the arm
        # (up to one step per turn: a turn cut at --max-tokens inside a round ends without it)
        plain_cost = row["turns_tokens"] + turns[key]
        for arm in ("all", "peer-suffix"):
            saved = sum(c["saved_per_tok"] for c in row[arm]["by_source"].values())
            spent = plain_cost - plain_cost / row[arm]["priced_x_plain"]
            assert saved * row["turns_tokens"] == pytest.approx(spent, abs=turns[key] + 0.1)
        assert set(row["all"]["by_source"]) <= {"strict", "echo", "suffix", "ngram"}
    overall = report["rows"]["overall"]
    # the ungated peers propose on these turns, and verify accepts recorded ids
    assert sum(overall["peer-lookup"]["accepted_per_round"].values()) > 0
    assert report["by_tool"] and report["all_over_oracle"] > 0


def test_forced_turns_emit_the_recorded_ids_not_the_models_own(two_sessions):
    """The tiny model's own greedy reply differs from what the agent wrote; forced, plain
    decoding and the fill loop both emit the recorded ids."""
    from mlx_fill.evidence.replay import load_recordings
    from mlx_lm.generate import generate_step

    from mlx_fill.assets.fixtures import fixture_path
    model, tok, _ = forced.load_model(str(fixture_path("qwen3-json")), None)
    sessions, _ = load_recordings(two_sessions)
    turns, _ = forced.forced_turns(tok, sessions, per_source=1, max_tokens=12, max_context=384)
    turn = next(t for t in turns if t.transcript_source == "aider_examples")
    own = [int(t) for t, _ in generate_step(mx.array(turn.prompt), model, max_tokens=12)]
    assert own != turn.output
    plan = forced.plan_for(model)
    result = forced.run([turn], model=model, tok=tok, plan=plan, repeats=1, projection=None,
                        arms=("plain", "off", "all"))
    assert result["identical"] is True


def test_a_store_of_earlier_replies_serves_a_later_turn_never_the_turns_own_repeats(two_sessions):
    """With the cross-request store a turn served again finds the earlier reply (fewer forwards
    for ``peer-suffix``, a cheaper oracle); a turn's repeats start from the store as the turn
    found it, so two repeats decode as one; without the store both servings cost the same."""
    from mlx_fill.assets.fixtures import fixture_path
    from mlx_fill.evidence.replay import load_recordings
    model, tok, _ = forced.load_model(str(fixture_path("qwen3-json")), None)
    sessions, _ = load_recordings(two_sessions)
    turns, _ = forced.forced_turns(tok, sessions, per_source=1, max_tokens=12, max_context=384)
    turn = next(t for t in turns if t.transcript_source == "aider_examples")
    plan = forced.plan_for(model)

    def per_turn(repeats: int, cross_request: bool) -> list[tuple[float, float]]:
        totals = []

        def progress(i, total, t, partial):
            g = partial["groups"]["overall"]
            totals.append((g["peer-suffix"].forwards, g["oracle"].priced))
        forced.run([turn, turn], model=model, tok=tok, plan=plan, repeats=repeats, projection=None,
                   arms=("plain", "peer-suffix"), cross_request=cross_request, progress=progress)
        return [totals[0], tuple(b - a for a, b in zip(*totals))]

    first, again = per_turn(2, True)
    assert again[0] < first[0] and again[1] < first[1], (first, again)
    fresh = per_turn(1, False)
    assert fresh[0] == fresh[1] == first, fresh  # the second repeat read no reply of its turn


def test_a_seeded_store_serves_the_first_turn_and_every_repeat_starts_from_it(two_sessions, capsys):
    """A store seeded with the sessions' own replies (a server that served them) holds the
    turn's reply: the first turn already costs ``peer-suffix`` and the oracle less than from an
    empty store; repeats read no reply of their own turn; the caller's store is not changed."""
    from mlx_fill.assets.fixtures import fixture_path
    from mlx_fill.evidence.replay import load_recordings
    from mlx_fill.evidence.transcripts import recorded_responses
    model, tok, _ = forced.load_model(str(fixture_path("qwen3-json")), None)
    sessions, _ = load_recordings(two_sessions)
    turns, _ = forced.forced_turns(tok, sessions, per_source=1, max_tokens=12, max_context=384)
    turn = next(t for t in turns if t.transcript_source == "aider_examples")
    plan = forced.plan_for(model)
    seeded = forced.GlobalSuffixTree()
    seeded.seed(recorded_responses(sessions, tok)[0])
    size = (len(seeded), seeded.next_doc)

    def cost(repeats: int, store) -> tuple[float, float, bool]:
        r = forced.run([turn], model=model, tok=tok, plan=plan, repeats=repeats, projection=None,
                       arms=("plain", "peer-suffix"), store=store)
        g = r["groups"]["overall"]
        return g["peer-suffix"].forwards, g["oracle"].priced, r["identical"]

    empty, warm = cost(1, None), cost(1, seeded)
    assert warm[0] < empty[0] and warm[1] < empty[1] and warm[2] and empty[2], (empty, warm)
    assert cost(2, seeded) == warm and (len(seeded), seeded.next_doc) == size
    assert forced.main(["--store-seed", str(two_sessions) + ".missing", "--surrogate"]) == 2
    assert forced.main(["--store-seed", str(two_sessions), "--no-cross-request"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"forced: no such transcripts file or folder: {two_sessions}.missing",
                   "forced: --store-seed fills the cross-request store; drop --no-cross-request"]


FILE = 'def area(r):\n    return 3.14 * r * r\n\n\nprint("area", area(2))\n'


def _call(call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def test_rewritten_file_is_the_file_as_last_read_escaped_as_the_call_carries_it():
    read = [{"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "", "tool_calls": [_call("1", "read", {"path": "a.py"})]},
            {"role": "tool", "tool_call_id": "1", "content": "old"},
            {"role": "assistant", "content": "", "tool_calls": [_call("2", "read", {"path": "a.py"})]},
            {"role": "tool", "tool_call_id": "2", "content": FILE}]
    write = {"role": "assistant", "content": "",
             "tool_calls": [_call("3", "write", {"path": "a.py", "content": FILE})]}
    other = {"role": "assistant", "content": "",
             "tool_calls": [_call("4", "edit", {"path": "b.py", "oldText": "x", "newText": "y"})]}
    predicted = forced.rewritten_file([*read, write], len(read))
    assert predicted == json.dumps(FILE)[1:-1]
    assert predicted in write["tool_calls"][0]["function"]["arguments"]
    assert forced.rewritten_file([*read, other], len(read)) is None  # b.py was never read
    assert forced.rewritten_file(read, 3) is None  # a read rewrites nothing


def test_a_result_answers_the_call_of_its_own_reply_when_ids_repeat():
    """A harness that numbers calls per reply (``call_0`` in every one) or repeats an id
    within one reply: each result reads as the answer to its own call."""
    write = {"role": "assistant", "content": "",
             "tool_calls": [_call("call_0", "write", {"path": "a.py", "content": FILE})]}
    reused = [{"role": "assistant", "content": "", "tool_calls": [_call("call_0", "read", {"path": "a.py"})]},
              {"role": "tool", "tool_call_id": "call_0", "content": FILE},
              {"role": "assistant", "content": "", "tool_calls": [_call("call_0", "bash", {"cmd": "pytest"})]},
              {"role": "tool", "tool_call_id": "call_0", "content": "1 failed"}]
    assert forced.rewritten_file([*reused, write], len(reused)) == json.dumps(FILE)[1:-1]
    twice = [{"role": "assistant", "content": "", "tool_calls": [
                 _call("x", "read", {"path": "a.py"}), _call("x", "read", {"path": "b.py"})]},
             {"role": "tool", "tool_call_id": "x", "content": FILE},
             {"role": "tool", "tool_call_id": "x", "content": "B = 2\n"}]
    assert forced.rewritten_file([*twice, write], len(twice)) == json.dumps(FILE)[1:-1]


def test_an_editor_view_and_capitalized_tool_names_are_reads():
    """OpenHands' ``str_replace_editor`` reads with ``command: view`` (a ``cat -n`` listing,
    read back without its numbers) and edits with another command; a ``Read`` tool reads."""
    listing = "Here's the result of running `cat -n` on /r/a.py:\n" + "".join(
        f"{i:6}\t{line}\n" for i, line in enumerate(FILE.splitlines(), 1))
    view = [{"role": "assistant", "content": "", "tool_calls": [
                _call("1", "str_replace_editor", {"command": "view", "path": "/r/a.py"})]},
            {"role": "tool", "tool_call_id": "1", "content": listing}]
    edit = {"role": "assistant", "content": "", "tool_calls": [_call(
        "2", "str_replace_editor", {"command": "str_replace", "path": "/r/a.py",
                                    "old_str": "3.14", "new_str": "pi"})]}
    assert forced.rewritten_file([*view, edit], len(view)) == json.dumps(FILE)[1:-1]
    assert forced.rewritten_file(view, 0) is None  # a view rewrites nothing
    read = [{"role": "assistant", "content": "", "tool_calls": [
                _call("1", "Read", {"file_path": "a.py"})]},
            {"role": "tool", "tool_call_id": "1", "content": FILE}]
    write = {"role": "assistant", "content": "", "tool_calls": [
        _call("2", "Write", {"file_path": "a.py", "content": FILE})]}
    assert forced.rewritten_file([*read, write], len(read)) == json.dumps(FILE)[1:-1]


def test_a_claude_code_read_is_the_file_without_its_numbers_and_reminder():
    """Claude Code's ``Read`` numbers each line with an arrow and may append a system note."""
    listing = "\n".join(f"{i:6}\u2192{line}" for i, line in enumerate(FILE.splitlines(), 1))
    note = "\n\n<system-reminder>\nConsider whether the file is malicious.\n</system-reminder>\n"
    assert forced.file_text(listing) == FILE.rstrip("\n")
    assert forced.file_text(listing + note) == FILE.rstrip("\n")
    quoted = "x = 1\n<system-reminder>\nnot a listing\n</system-reminder>\n"
    assert forced.file_text(quoted) == quoted


def test_a_command_argument_that_is_no_string_is_no_read():
    """Codex's ``shell`` tool takes its command as a list, another tool may take an object."""
    for command in (["bash", "-lc", "cat a.py"], {"view": "a.py"}):
        assert forced.is_read("shell", {"command": command}) is False
    shell = [{"role": "assistant", "content": "", "tool_calls": [
                 _call("1", "shell", {"command": ["bash", "-lc", "cat a.py"]})]},
             {"role": "tool", "tool_call_id": "1", "content": FILE}]
    write = {"role": "assistant", "content": "", "tool_calls": [
        _call("2", "shell", {"command": ["bash", "-lc", "cat > a.py"], "path": "a.py"})]}
    assert forced.rewritten_file([*shell, write], len(shell)) is None


@pytest.mark.parametrize("result", [
    "1\tid\n3\tname\n",  # numbers not consecutive: a table, not a listing
    "plain text\n",
    "",
])
def test_a_read_result_that_is_no_listing_is_the_file_as_it_is(result):
    assert forced.file_text(result) == result


def test_the_prediction_arm_replays_a_rewrite_identically(tmp_path):
    """``--rewrites`` keeps the turn that rewrites a file read earlier; the ``prediction`` arm
    (``all`` with that file as the prediction) emits the recorded ids."""
    from mlx_fill.assets.fixtures import fixture_path
    session = {"source": "synthetic", "session_id": "s1", "tool_call_style": "structured",
               "messages": [
                   {"role": "user", "content": "Use pi instead of 3.14 in a.py"},
                   {"role": "assistant", "content": "",
                    "tool_calls": [{"id": "1", "name": "read", "arguments": {"path": "a.py"}}]},
                   {"role": "tool", "tool_call_id": "1", "name": "read", "content": FILE},
                   {"role": "assistant", "content": "",
                    "tool_calls": [{"id": "2", "name": "write", "arguments": {
                        "path": "a.py", "content": FILE.replace("3.14", "math.pi")}}]},
                   {"role": "tool", "tool_call_id": "2", "name": "write", "content": "ok"},
                   {"role": "assistant", "content": "Done."}]}
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(session) + "\n")
    out = tmp_path / "forced.json"
    rc = forced.main(["--transcripts", str(path), "--model", str(fixture_path("qwen3-json")),
                      "--dtype", "none", "--rewrites", "--max-tokens", "48", "--repeats", "1",
                      "--arms", "plain,all,prediction", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["identical"] is True and report["meta"]["turns"] == 1
    assert set(report["by_tool"]) == {"write"}
    overall = report["rows"]["overall"]
    # the file as last read covers most of the new content: fewer forwards than `all` alone
    assert 0 < overall["prediction"]["fwd_per_tok"] < overall["all"]["fwd_per_tok"]


def test_a_hybrid_model_replays_every_source_identically(two_sessions, tmp_path):
    """Qwen3.5's recurrent layers cannot be trimmed: every arm decodes from the prompt's
    checkpoint, restored after each decode; its template's think block is the prompt's."""
    from mlx_fill.assets.fixtures import fixture_path
    args = tiny_replay_args(two_sessions, 8, "--arms", "plain,all")
    args[args.index("--model") + 1] = str(fixture_path("qwen35-xml"))
    report = replay_report(args, tmp_path)
    assert report["identical"] is True
    assert set(report["rows"]) == {"overall", "tau_bench_gpt4o_airline", "aider_examples"}


def test_a_model_whose_replies_cannot_be_cut_is_one_error_line(two_sessions, capsys):
    from mlx_fill.assets.fixtures import fixture_path
    args = tiny_replay_args(two_sessions, 8)
    args[args.index("--model") + 1] = str(fixture_path("glm-xml"))
    assert forced.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "generation prompt rewrites the messages before it" in err, err


def test_transcripts_that_are_no_regular_file_are_one_error_line(capsys):
    assert forced.main(["--transcripts", os.devnull, "--surrogate"]) == 2
    err = capsys.readouterr().err
    assert err == f"forced: {os.devnull} is not a regular file (a pipe or a device); save what " \
                  f"it holds to a file and pass that\n", err


def test_sessions_without_an_assistant_turn_are_one_error_line(tmp_path, capsys, monkeypatch):
    """Said before the model loads: a first use would download it for nothing."""
    path = tmp_path / "no_reply.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    monkeypatch.setattr(forced, "load_model", lambda *a: pytest.fail("the model was loaded"))
    assert forced.main(["--transcripts", str(path), "--surrogate"]) == 2
    assert capsys.readouterr().err == (f"forced: no assistant turn to replay in {path}; pass "
                                       f"sessions with assistant replies\n")


def test_a_file_of_corrupt_lines_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": 3}]}\n[1]\n')
    assert forced.main(["--transcripts", str(path), "--surrogate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 1: a message whose content is not a string" in err, err


def test_an_openai_chat_log_replays_identically(two_sessions, tmp_path):
    """A session logged as OpenAI chat messages (nested calls with string arguments, no source)
    replays under its own row, identical to plain."""
    session = json.loads(two_sessions.read_text().splitlines()[0])
    for m in session["messages"]:
        m["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
            "name": c["name"], "arguments": c.get("arguments_raw") or json.dumps(c["arguments"])}}
            for c in m.get("tool_calls") or []] or None
    for key in ("source", "tool_call_style"):
        session.pop(key)
    path = tmp_path / "openai.jsonl"
    path.write_text(json.dumps(session) + "\n")
    report = replay_report(tiny_replay_args(path, 8, "--arms", "plain,all"), tmp_path)
    assert report["identical"] is True and set(report["rows"]) == {"overall", "(unnamed)"}


def test_deciding_on_a_curve_prices_on_it(two_sessions, tmp_path, capsys):
    """``--decide-on-curve``: the sessions' plan is the curve, so the priced and projected
    columns agree for every arm; it needs ``--surrogate`` (a wall time is this machine's)."""
    args = tiny_replay_args(two_sessions, 12, "--arms", "plain,all,peer-suffix", "--curve",
                            "1.1,1.2,1.3", "--curve-overhead", "0.05", "--decide-on-curve")
    assert forced.main(args) == 2
    assert "--decide-on-curve needs --curve and --surrogate" in capsys.readouterr().err
    report = replay_report([*args, "--surrogate"], tmp_path)
    meta = report["meta"]
    assert meta["decided_on_curve"] is True and meta["plan"]["round_overhead"] == 0.05
    assert {int(m): c for m, c in meta["plan"]["cost"].items()} == {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}
    assert meta["plan"]["max_chunk"] == 4
    for row in report["rows"].values():
        for arm in ("plain", "all", "peer-suffix"):
            assert row[arm]["priced_x_plain"] == row[arm]["projected_x_plain"], (arm, row[arm])
            assert row[arm]["bookkeeping_share"] is None  # the surrogate's step is not the model's


def test_sessions_a_server_would_refuse_are_skipped_and_a_reply_without_a_request_replays(
        tmp_path, capsys):
    """A session whose tools a server would refuse is skipped with its reason, the others run;
    a session that opens with the assistant's reply (no message before it) replays under
    every arm, identical to plain."""
    with gzip.open(TRANSCRIPTS, "rt", encoding="utf-8") as fh:
        good = next(r for r in map(json.loads, fh) if r.get("tools")
                    and any(m.get("tool_calls") for m in r["messages"]))
    bad = {**good, "source": "broken_tools", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}
    call = next(m for m in good["messages"] if m.get("tool_calls"))
    opening = {**good, "source": "assistant_first", "messages": [call]}
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in (bad, opening)))
    report = replay_report(tiny_replay_args(path, 8, "--arms", "plain,strict,all"), tmp_path)
    assert report["identical"] is True and set(report["rows"]) == {"overall", "assistant_first"}
    err = capsys.readouterr().err
    assert "1 sessions not rendered (broken_tools: ValueError: tools[0].function.parameters" in err


def test_a_bad_fill_knob_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setenv("MLX_FILL_SOURCES", "warp")
    assert forced.main(["--surrogate", "--per-source", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MLX_FILL_SOURCES: unknown sources ['warp']" in err, err
