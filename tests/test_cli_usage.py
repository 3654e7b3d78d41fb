"""``mlx-fill`` finishes the job: every option says what it does and its default, the bare
command prints the usage and exits 2, each subcommand answers the user mistakes it can meet
(missing or empty model folders, unreadable or malformed files, unknown names) with one line on
stderr and exit 2, and ``qualify`` refuses a cost curve that timing noise produced."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_fill.cli import COMMANDS, _Parser, main
from mlx_fill.core import qualify

from cli_lines import one_error_line


def _parsers(name: str) -> list[argparse.ArgumentParser]:
    """The parser of ``mlx-fill NAME`` and of its sub-actions (``assets fetch``, ...)."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = _Parser(prog=f"mlx-fill {name}")
    if hasattr(module, "add_arguments_for"):
        module.add_arguments_for(name, parser)
    else:
        module.add_arguments(parser)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for a in subs for p in a.choices.values())]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(name):
    for parser in _parsers(name):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            label = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label} has no help text"
            shown = formatter._get_help_string(action)
            if action.default not in (None, False):
                assert "default" in shown, f"{label}: its default {action.default!r} is not shown"


def test_bare_command_prints_the_usage_and_exits_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("usage: mlx-fill COMMAND") and captured.out == ""
    for name in COMMANDS:
        assert f"  {name} " in captured.err


def test_plan_missing_empty_or_weightless_model_dir_in_a_real_process(tmp_path):
    """The README's own mistake, run as a user runs it: one line, exit 2, no traceback."""
    mlx_fill = str(Path(sys.executable).parent / "mlx-fill")
    proc = subprocess.run([mlx_fill, "plan", "--model", "/no/such/dir"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "/no/such/dir does not exist" in proc.stderr, proc.stderr
    proc = subprocess.run([mlx_fill], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: mlx-fill")


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(argv):
    """``mlx-fill ... | head``: what the gone reader did not take is dropped, without a
    traceback, and the exit is a pipeline's for a command whose reader left (128 + SIGPIPE)."""
    mlx_fill = str(Path(sys.executable).parent / "mlx-fill")
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([mlx_fill, *argv], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("command", ["plan", "qualify", "serve"])
def test_model_folder_mistakes(command, tmp_path, capsys):
    one_error_line(capsys, [command, "--model", str(tmp_path / "none")], "does not exist")
    one_error_line(capsys, [command, "--model", str(tmp_path)], "has no config.json")
    (tmp_path / "config.json").write_text("{}")
    one_error_line(capsys, [command, "--model", str(tmp_path)], "has no model*.safetensors weights",
                   "mlx-fill fixture qwen3-json")
    (tmp_path / "trained.safetensors").write_bytes(b"")  # a name mlx_lm.load does not read
    one_error_line(capsys, [command, "--model", str(tmp_path)], "has no model*.safetensors weights")


def test_unknown_names(capsys):
    one_error_line(capsys, ["fixture", "qwen4-json"], "invalid choice: 'qwen4-json'")
    one_error_line(capsys, ["demo", "--fixture", "qwen4-json"], "invalid choice: 'qwen4-json'")
    one_error_line(capsys, ["audit", "--family", "qwen4"], "invalid choice: 'qwen4'")
    one_error_line(capsys, ["study", "--sources", "echo,nope"], "unknown sources ['nope']")
    one_error_line(capsys, ["serve", "--model", "owner/name", "--fill", "fast"], "invalid choice: 'fast'")
    one_error_line(capsys, ["assets", "path", "qwen4"], "invalid choice: 'qwen4'")


@pytest.mark.parametrize(("argv", "needle"), [
    (["demo", "--turns", "0"], "argument --turns: 0 is not at least 1"),
    (["demo", "--max-tokens", "many"], "argument --max-tokens: 'many' is not a whole number"),
    (["qualify", "--repeats", "-1", "--model", "."], "argument --repeats: -1 is not at least 1"),
    (["study", "--workers", "0"], "argument --workers: 0 is not at least 1"),
])
def test_counts_below_one(argv, needle, capsys):
    one_error_line(capsys, argv, needle)


@pytest.fixture
def corrupt_transcripts(tmp_path) -> Path:
    path = tmp_path / "sessions.jsonl"
    path.write_text('{"id": "a", "messages": [\n{"no": "messages"}\n')
    return path


@pytest.mark.parametrize("command", ["replay", "ab", "study"])
def test_transcripts_without_a_readable_session(command, corrupt_transcripts, capsys):
    argv = {"replay": ["replay", "--sessions", str(corrupt_transcripts), "--url", "http://127.0.0.1:9"],
            "ab": ["ab", "--sessions", str(corrupt_transcripts), "--url-a", "http://127.0.0.1:9",
                   "--url-b", "http://127.0.0.1:9"],
            "study": ["study", "--transcripts", str(corrupt_transcripts), "--no-progress"]}[command]
    one_error_line(capsys, argv, "holds no session (2 corrupt lines, line 1: invalid JSON")


def test_replay_unreadable_transcripts(tmp_path, capsys):
    folder = tmp_path / "a-folder.jsonl"
    folder.mkdir()
    one_error_line(capsys, ["replay", "--sessions", str(folder), "--url", "http://127.0.0.1:9"],
                   "is a folder without transcripts files (names ending in .jsonl or .jsonl.gz)")


def test_report_malformed_runs(tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    runs.write_text("{not json\n")
    one_error_line(capsys, ["report", str(runs)], "holds no turn records (1 line(s) not JSON", "the first is line 1", "mlx-fill replay")


def test_report_of_a_file_that_is_no_runs_file_says_what_it_held(tmp_path, capsys):
    """A transcripts file passed for its runs: JSON objects, but no record among them."""
    sessions = tmp_path / "sessions.jsonl"
    sessions.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" * 2
                        + json.dumps({"messages": []}) + "\n")
    one_error_line(capsys, ["report", str(sessions)], "holds no turn records (2 line(s) not JSON, "
                   'or with no "kind" run or turn; the first is line 1)')
    headers = tmp_path / "headers.jsonl"
    headers.write_text(json.dumps({"kind": "run", "command": "replay"}) + "\n")
    one_error_line(capsys, ["report", str(headers)], "holds no turn records (1 run headers)")


def test_audit_malformed_tools(tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text("[{")
    one_error_line(capsys, ["audit", "--family", "qwen3", "--tools", str(tools)], "is not valid JSON")


def test_study_malformed_cost_curve(tmp_path, capsys):
    curve = tmp_path / "plan.json"
    curve.write_text('{"max_chunk": ')
    one_error_line(capsys, ["study", "--cost-curve", str(curve)], "is not a DispatchPlan JSON")


def test_qualify_writes_into_the_user_cache_where_plan_finds_it(tmp_path, monkeypatch, capsys):
    """``mlx-fill qualify --model M`` (no ``--out``), then ``mlx-fill plan --model M`` finds that
    plan and does not qualify again (the measurement itself stands in: it is tested elsewhere)."""
    import mlx.core as mx

    from mlx_fill.assets.random_models import build, config_for, save
    from mlx_fill.core.plan import DispatchPlan, config_key

    model_dir = save(*build(config_for("qwen3"), dtype=mx.float32), tmp_path / "tiny")
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLX_FILL_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)

    def measured(model, **kw):
        return DispatchPlan(key=config_key(model), max_chunk=4, qualified=True,
                            cost={1: 1.0, 2: 1.5, 4: 2.5}), []

    monkeypatch.setattr(qualify, "qualify", measured)
    assert main(["qualify", "--model", str(model_dir)]) == 0
    wrote = capsys.readouterr().out.splitlines()[-1]
    assert wrote.startswith(f"wrote {tmp_path / 'cache'}") and not (tmp_path / "plan.json").exists()
    assert main(["plan", "--model", str(model_dir), "--no-qualify"]) == 0
    assert f"source: cached {wrote.removeprefix('wrote ')}" in capsys.readouterr().out


def _curves(*curves):
    """A ``measure_cost`` stand-in answering ``curves`` in turn."""
    answers = iter(curves)
    calls = []

    def measure(model, cache, sizes, vocab, repeats, shape="native"):
        calls.append(1)
        return dict(next(answers))
    return measure, calls


def test_cost_below_one_is_measured_again(monkeypatch):
    measure, calls = _curves({1: 1.0, 2: 0.84, 4: 2.0}, {1: 1.0, 2: 1.46, 4: 2.1})
    monkeypatch.setattr(qualify, "measure_cost", measure)
    assert qualify.measure_plausible_cost(None, [], (1, 2, 4), 8, 1) == {1: 1.0, 2: 1.46, 4: 2.1}
    assert len(calls) == 2


def test_cost_within_noise_of_one_is_stored_as_one(monkeypatch):
    near = {1: 1.0, 2: 0.97, 4: 1.5}
    measure, calls = _curves(near, near, near)
    monkeypatch.setattr(qualify, "measure_cost", measure)
    assert qualify.measure_plausible_cost(None, [], (1, 2, 4), 8, 1) == {1: 1.0, 2: 1.0, 4: 1.5}
    assert len(calls) == qualify.COST_TRIES


def test_cost_clearly_below_one_every_time_is_refused_with_what_was_measured(monkeypatch):
    measure, _ = _curves({1: 1.0, 2: 0.84}, {1: 1.0, 2: 0.9}, {1: 1.0, 2: 0.8})
    monkeypatch.setattr(qualify, "measure_cost", measure)
    with pytest.raises(qualify.ImplausibleCost, match=r"c\(2\)=0.84; c\(2\)=0.90; c\(2\)=0.80"):
        qualify.measure_plausible_cost(None, [], (1, 2), 8, 1)


def test_ranks_measure_again_together(monkeypatch):
    """With ``agree``, one rank's low reading makes every rank measure again."""
    measure, calls = _curves({1: 1.0, 2: 1.2}, {1: 1.0, 2: 1.3})
    monkeypatch.setattr(qualify, "measure_cost", measure)
    verdicts = iter([False, True])  # another rank measured below 1 the first time
    assert qualify.measure_plausible_cost(None, [], (1, 2), 8, 1,
                                          agree=lambda ok: next(verdicts)) == {1: 1.0, 2: 1.3}
    assert len(calls) == 2


def test_audit_summary_separates_determined_from_likely(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    (corpus / "tools").mkdir(parents=True)
    (corpus / "qwen3").mkdir()
    (corpus / "tools" / "default.json").write_text(json.dumps([{"type": "function", "function": {
        "name": "ls", "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                     "required": ["path"]}}}]))
    (corpus / "qwen3" / "a.json").write_text(json.dumps({
        "id": "a", "family": "qwen3", "messages": [{"role": "user", "content": "list /tmp"}],
        "reply": {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "ls", "arguments": {"path": "/tmp"}}}]},
        "expect": "fill"}))
    assert main(["audit", "--family", "qwen3", "--corpus", str(corpus)]) == 0
    out = capsys.readouterr().out.splitlines()
    determined = next(line for line in out if line.strip().startswith("determined "))
    likely = next(line for line in out if line.strip().startswith("likely "))
    assert "fails the audit" in determined
    assert "allowed" in likely and "only ever verified" in likely and "never an emitted token" in likely


def test_serve_port_in_use_or_out_of_range(tmp_path, capsys):
    import socket

    from mlx_fill.assets.fixtures import fixture_path

    model = str(fixture_path("qwen3-json"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_error_line(capsys, ["serve", "--model", model, "--port", str(port)],
                       f"cannot listen on 127.0.0.1:{port}", "pick another --port")
    one_error_line(capsys, ["serve", "--model", model, "--port", "70000"], "cannot listen on 127.0.0.1:70000")


def _no_traceback_line(capsys, call, *needles: str) -> str:
    """Run ``call()`` (a script's ``main``); assert exit 2 and one stderr line, no traceback and
    no usage, holding every ``needle``; return that line."""
    try:
        code = call()
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def inputs(tmp_path) -> dict[str, str]:
    """A file, a folder, a model folder argparse accepts, a replayable session file and a runs
    file, for arguments whose checks come before any of them is read in earnest."""
    (tmp_path / "a-file").write_text("keep\n")
    (tmp_path / "a-folder").mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    session = {"source": "unit", "session_id": "s", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp_path / "sessions.jsonl").write_text(json.dumps(session) + "\n")
    return {"file": str(tmp_path / "a-file"), "folder": str(tmp_path / "a-folder"),
            "under_file": str(tmp_path / "a-file" / "x.json"), "model": str(model),
            "sessions": str(tmp_path / "sessions.jsonl"), "runs": str(tmp_path / "a-file")}


URL = "http://127.0.0.1:9"


@pytest.mark.parametrize(("argv", "needle"), [
    (["qualify", "--model", "{model}", "--quick", "--out", "{folder}"], "is a folder"),
    (["audit", "--family", "qwen3", "--json", "{folder}"], "is a folder"),
    (["audit", "--family", "qwen3", "--json", "{under_file}"], "is a file, not a folder"),
    (["study", "--out", "{file}"], "is a file, not a folder"),
    (["replay", "--sessions", "{sessions}", "--url", URL, "--out", "{file}"], "is a file, not a folder"),
    (["ab", "--sessions", "{sessions}", "--url-a", URL, "--url-b", URL, "--out", "{under_file}"],
     "is a file, not a folder"),
    (["report", "{runs}", "--out", "{file}"], "is a file, not a folder"),
    (["assets", "fetch", "qwen3", "--dest", "{file}"], "is a file, not a folder"),
])
def test_output_paths_that_cannot_be_written(argv, needle, inputs, capsys):
    argv = [a.format(**inputs) for a in argv]
    flag = next(a for a in argv if a in ("--out", "--json", "--dest"))
    one_error_line(capsys, argv, f"argument {flag}: cannot write", needle)


def test_bench_scripts_refuse_a_folder_as_json(inputs, capsys):
    from scripts.bench import __main__ as bench
    from scripts.bench import forced

    _no_traceback_line(capsys, lambda: bench.main(["--json", inputs["folder"]]), "bench: ",
                       "argument --json", "is a folder")
    _no_traceback_line(capsys, lambda: forced.main(["--json", inputs["folder"]]), "forced: ",
                       "argument --json", "is a folder")


def test_replay_keeps_an_earlier_runs_file(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "runs.jsonl").write_text("earlier\n")
    for command in (["replay", "--url", URL], ["ab", "--url-a", URL, "--url-b", URL]):
        one_error_line(capsys, [*command, "--sessions", inputs["sessions"], "--out", str(out)],
                       f"{out / 'runs.jsonl'} already exists", "another --out")
    assert (out / "runs.jsonl").read_text() == "earlier\n"


@pytest.mark.parametrize(("tools", "needle"), [
    (42, "tools: must be a list"),
    ([1, 2, 3], "tools[0]: must be an object"),
    ({"type": "function"}, "tools: must be a list"),
    ([{"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}],
     "name: must be a non-empty string"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
     "parameters.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}], "pattern"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nope"}}}}}], "$ref: cannot resolve"),
])
def test_audit_unusable_tools(tools, needle, tmp_path, capsys):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(tools))
    one_error_line(capsys, ["audit", "--family", "qwen3", "--tools", str(path)],
                   f"{path} is not a usable OpenAI tools array", needle)


@pytest.mark.parametrize("tools", [[], None])
def test_audit_without_tools(tools, tmp_path, capsys):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(tools))
    one_error_line(capsys, ["audit", "--family", "qwen3", "--tools", str(path)],
                   f"no tools in {path}", "at least one tool")


LS_TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


def test_audit_names_the_tools_when_a_template_refuses_a_field_they_lack(tmp_path, capsys):
    """gpt-oss's template reads every tool's ``description``, which OpenAI makes optional."""
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(LS_TOOLS))
    one_error_line(capsys, ["audit", "--family", "gpt-oss", "--tools", str(path)],
                   "the chat template refuses the conversation with its tools", "'description'",
                   "or the tools")


@pytest.mark.parametrize(("case", "needle"), [
    ({"reply": "hi"}, "its 'reply' is not a message object"),
    ({"reply": {"role": "assistant", "content": 5}},
     "its 'reply.content' is a JSON int, not a string or null"),
    ({"reply": {"role": "assistant", "content": "", "tool_calls": "x"}},
     "its 'reply.tool_calls' is a JSON str, not a list"),
    ({"reply": {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}},
     "its 'reply.tool_calls[0]' is not an object with a 'function' object"),
    ({"reply": {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}},
     "its 'reply.tool_calls[0].function.name' is not a string"),
    ({"reply": {"role": "assistant", "tool_calls": [{"function": {"name": "ls", "arguments": 5}}]}},
     "its 'reply.tool_calls[0].function.arguments' is not an object or a string"),
    ({"raw_reply": 5}, "its 'raw_reply' is not a string"),
    ({"messages": [1, 2], "raw_reply": "x"}, "its 'messages' is not a non-empty list of message"),
    ({"messages": [{"content": "hi"}], "raw_reply": "x"}, "each with a 'role'"),
    ({"raw_reply": "x", "expect": "bogus"}, "its 'expect' is 'bogus', not 'fill' or 'none'"),
    ({"raw_reply": "x", "no_fill_in": [5]}, "'no_fill_in' is not a list of non-empty strings"),
    ({"raw_reply": "x", "no_fill_in": {"a": 1}}, "'no_fill_in' is not a list of non-empty strings"),
    ({"raw_reply": "x", "template_kwargs": 5}, "'template_kwargs' is not an object"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}], "raw_reply": "x"}, "lone surrogate"),
    ({"raw_reply": "a\udfff"}, "lone surrogate"),
    ({"raw_reply": "x", "reply": {"role": "assistant", "content": "x"}},
     "both 'reply' and 'raw_reply'"),
    (None, "cannot read"),
])
def test_audit_malformed_case_files(case, needle, tmp_path, capsys):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "default.json").write_text(json.dumps(LS_TOOLS))
    (tmp_path / "qwen3").mkdir()
    path = tmp_path / "qwen3" / "x.json"
    if case is None:
        path.mkdir()
    else:
        path.write_text(json.dumps({"id": "x", "family": "qwen3",
                                    "messages": [{"role": "user", "content": "hi"}], **case}))
    one_error_line(capsys, ["audit", "--family", "qwen3", "--corpus", str(tmp_path)], "x.json", needle)


def test_audit_empty_corpus_says_why(tmp_path, capsys):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "default.json").write_text(json.dumps(LS_TOOLS))
    one_error_line(capsys, ["audit", "--family", "qwen3", "--corpus", str(tmp_path)],
                   "no audit cases for qwen3", "--corpus DIR")


@pytest.mark.parametrize(("content", "needle"), [
    (b"\xff\xfe\x00garbage\x80\n", "line 1 is not UTF-8 text"),
    (b'{"kind": "run"}\n{"kind": "turn"}\n', "line 2 is not a turn record (it has no 'arm')"),
    (json.dumps({"kind": "turn", "arm": "A", "session_id": "s", "turn": 0, "output": {},
                 "expected": {}, "timing": {"wall_s": 1.0}}).encode() + b"\n",
     "line 1 is not a turn record (it has no 'usage')"),
    *[(json.dumps({"kind": "turn", "arm": "A", "session_id": "s", "turn": 0, "usage": {},
                   "output": {}, "expected": {}, "timing": {"wall_s": 1.0}, **bad}).encode() + b"\n",
       "line 1 is not a turn record (" + why) for bad, why in [
        ({"output": {"tool_calls": "ls"}}, "its output.tool_calls is not a list of calls with a name"),
        ({"output": {"tool_calls": [{"arguments": {}}]}}, "its output.tool_calls is not a list"),
        ({"expected": {"content": ["a"]}}, "its expected.content is not a string"),
        ({"timing": {"wall_s": -1}}, "its timing has no wall_s number of seconds"),
        ({"timing": {"wall_s": 1, "ttft_s": "x"}}, "its timing.ttft_s is not a number of seconds"),
        ({"rep": "x"}, "its rep is not a whole number")]],
    (b'{"kind": "run", "urls": 5}\n', "line 1 is not a run header (its 'urls' is not a JSON object)"),
    (b'{"kind": "run", "sessions": [5]}\n', "line 1 is not a run header (its sessions are not"),
])
def test_report_malformed_turn_records(content, needle, tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    runs.write_bytes(content)
    one_error_line(capsys, ["report", str(runs)], str(runs), needle, "mlx-fill replay")


@pytest.mark.parametrize("argv", [["fixture", "qwen3-json"], ["assets", "path", "qwen3"]])
def test_cache_folder_that_cannot_hold_files(argv, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "a-file"
    cache.write_text("")
    monkeypatch.setenv("MLX_FILL_CACHE", str(cache))
    one_error_line(capsys, argv, f"MLX_FILL_CACHE={cache}", "is a file, not a folder",
                   "set MLX_FILL_CACHE to a writable folder")


@pytest.mark.parametrize(("argv", "needle"), [
    (["ab", "--url-a", URL, "--url-b", URL, "--reps", "99999999999999999999"],
     "argument --reps: 99999999999999999999 is more than 1000"),
    (["qualify", "--model", "{model}", "--repeats", "99999999999999999999"],
     "argument --repeats: 99999999999999999999 is more than 1000"),
    (["replay", "--url", URL, "--timeout", "0"], "argument --timeout: 0 is not above 0"),
    (["replay", "--url", URL, "--timeout", "-1"], "argument --timeout: -1 is not above 0"),
    (["ab", "--url-a", URL, "--url-b", URL, "--timeout", "nan"], "--timeout: nan is not a finite number"),
    (["replay", "--url", URL, "--temperature", "nan"], "--temperature: nan is not a finite number"),
    (["replay", "--url", URL, "--temperature", "5"], "--temperature: 5 is more than 2"),
    (["ab", "--url-a", URL, "--url-b", URL, "--max-tokens", "0"], "--max-tokens: 0 is not at least 1"),
])
def test_numbers_out_of_range(argv, needle, inputs, capsys):
    argv = [a.format(**inputs) for a in argv]
    if argv[0] in ("replay", "ab"):
        argv += ["--sessions", inputs["sessions"]]
    one_error_line(capsys, argv, needle)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--max-tokens", "0"], "argument --max-tokens: 0 is not at least 1"),
    (["--max-tokens", "-4"], "argument --max-tokens: -4 is not at least 1"),
    (["--max-context", "-5"], "argument --max-context: -5 is not at least 1"),
    (["--max-context", "0"], "argument --max-context: 0 is not at least 1"),
    (["--per-source", "0"], "argument --per-source: 0 is not at least 1"),
    (["--per-source", "-1"], "argument --per-source: -1 is not at least 1"),
    (["--curve", "1,2,nan"], "argument --curve: '1,2,nan': a cost curve is positive finite numbers"),
    (["--curve", "1.2,0"], "argument --curve: '1.2,0': a cost curve is positive finite numbers"),
    (["--curve", "1.2,x"], "argument --curve: '1.2,x': could not convert string to float"),
    (["--arms", "plain,bogus"], "forced: --arms must start with plain"),
    (["--bogus"], "forced: unrecognized arguments: --bogus"),
    (["--curve", "1.1", "--curve-overhead", "nan"], "--curve-overhead: nan is not a finite number"),
    (["--arms", "plain,plain,off"], "forced: --arms names ['plain'] more than once"),
    (["--repeats", "100000000000000000000"], "argument --repeats: 100000000000000000000 is more than 1000"),
])
def test_forced_replay_arguments(argv, needle, capsys):
    from scripts.bench import forced

    _no_traceback_line(capsys, lambda: forced.main(["--surrogate", *argv]), needle)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--fixtures", "bogus"], "argument --fixtures: unknown fixtures ['bogus']"),
    (["--max-tokens", "0"], "argument --max-tokens: 0 is not at least 1"),
    (["--per-source", "-1"], "argument --per-source: -1 is not at least 1"),
    (["--parts", "bogus"], "argument --parts: unknown parts ['bogus']"),
])
def test_bench_arguments(argv, needle, capsys):
    from scripts.bench import __main__ as bench

    _no_traceback_line(capsys, lambda: bench.main(["--quick", "--parts", "e2e", *argv]), "bench: ",
                       needle)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--fixture", "nosuch"], "argument --fixture: invalid choice: 'nosuch'"),
    (["--tasks", "bogus"], "--tasks: unknown tasks ['bogus']"),
    (["--tasks", "rename-symbol,rename-symbol"], "--tasks names ['rename-symbol'] more than once"),
    (["--repeats", "0"], "argument --repeats: 0 is not at least 1"),
])
def test_predict_arguments(argv, needle, capsys):
    from scripts.bench import predict

    _no_traceback_line(capsys, lambda: predict.main(argv), "predict: ", needle)


@pytest.mark.parametrize(("module", "argv", "needle"), [
    ("concurrency", ["--clients", "0"], "argument --clients: 0 is not at least 1"),
    ("concurrency", ["--modes", "unset,bogus"], "argument --modes: unknown modes ['bogus']; choose from"),
    ("concurrency", ["--json", "/proc/x.json"], "argument --json: cannot write /proc/x.json"),
    ("draft", ["--lengths", "-5"], "argument --lengths: -5 is not at least 1"),
    ("draft", ["--tokens", "0"], "argument --tokens: 0 is not at least 1"),
    ("heldout_sessions", ["out.jsonl", "--seed", "-1"], "argument --seed: -1 is not at least 0"),
])
def test_benchmark_script_arguments_are_checked_before_any_work(module, argv, needle, capsys):
    """Exit 2 with argparse's usage and one error line: no traceback, nothing fetched or run."""
    import importlib

    main = importlib.import_module(f"scripts.bench.{module}").main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and needle in err.splitlines()[-1], err


def test_forced_names_why_a_session_did_not_render():
    from collections import Counter

    from scripts.bench import forced

    class Refusing:
        def encode(self, text, add_special_tokens=False):
            return [1]

    def refuse(session, tok, mk):
        raise ValueError("no template for this")

    skipped = Counter()
    original = forced.render_recording, forced.markers
    forced.render_recording, forced.markers = refuse, lambda tok: type("M", (), {"opener": "<"})()
    try:
        _, skipped = forced.forced_turns(Refusing(), [{"source": "s"}], per_source=None,
                                         max_tokens=None, max_context=None)
    finally:
        forced.render_recording, forced.markers = original
    assert list(skipped) == ["s: ValueError: no template for this"]
