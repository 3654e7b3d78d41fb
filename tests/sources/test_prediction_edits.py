"""The edit benchmark (``scripts.bench.predict``) on the embedded ``qwen3-json`` fixture: every
arm emits exactly plain decoding's ids, and the ``usage.completion_tokens_details`` counts equal
what the fill trace shows (accepted = the ids of ``prediction`` proposals the target kept)."""

from __future__ import annotations

import json

import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import mlx.core as mx
from mlx_fill.assets.fixtures import fixture_path
from mlx_fill.core.resolve import plan_for
from mlx_fill.session import end_session, env_max_span, prediction_ids, usage_extra
from mlx_fill.sources.prediction import ORIGIN, prediction_usage
from scripts.bench import predict

MAX_TOKENS = 24


def _task(name: str) -> predict.EditTask:
    return {t.name: t for t in predict.TASKS}[name]


@pytest.fixture(scope="module")
def loaded():
    return load(str(fixture_path("qwen3-json")))


def test_every_task_expects_a_real_edit_of_a_real_file():
    for task in predict.TASKS:
        assert task.expected() != task.original(), task.name
        assert 25 <= len(task.original().splitlines()) <= 300, task.name


def test_every_task_edits_a_frozen_copy_so_its_reported_numbers_stay_its_own():
    """The package's files change; a task's file and prediction are copies under
    fixtures/edits/, each of the line count its reported row names."""
    lines = {"rename-symbol": 28, "delete-block": 129, "add-parameter": 52, "fix-typo": 75,
             "rename-method": 121}
    for task in predict.TASKS:
        for path in (task.path, task.prediction_path or task.path):
            assert path.startswith("fixtures/edits/"), (task.name, path)
        if task.name in lines:
            assert len(task.original().splitlines()) == lines[task.name], task.name


def test_two_task_edit_run_is_identical_and_counts_match_the_trace(loaded):
    model, tok = loaded
    rate = predict.best_round_rate(plan_for(model), env_max_span())
    for name in ("rename-symbol", "useless-prediction"):
        task = _task(name)
        result = predict.run_task(task, model=model, tok=tok, repeats=1, max_tokens=MAX_TOKENS, rate=rate)
        assert result["output_tokens"] > 0
        for arm, entry in result["arms"].items():
            assert entry["identical"], (name, arm)
            if arm != "off":
                assert (entry["accepted_prediction_tokens"] + entry["rejected_prediction_tokens"]
                        == result["predicted_tokens"])


def test_a_prediction_the_model_follows_is_accepted_and_counted_on_the_completion(loaded, tmp_path):
    """The prediction is the model's own plain reply, so the counts cannot all be zero."""
    model, tok = loaded
    task = predict.TASKS[0]
    messages = predict.messages_for(task)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=cache)
    base = cache[0].offset
    plain = predict.decode(model, tok, ids[-1:], cache, None, MAX_TOKENS)
    trim_prompt_cache(cache, cache[0].offset - base)
    prediction = {"type": "content", "content": tok.decode(plain)}
    trace = tmp_path / "trace.jsonl"
    session = predict.session_for("prediction", model=model, tok=tok, ids=ids, messages=messages,
                                  prediction=prediction, trace=trace)
    filled = predict.decode(model, tok, ids[-1:], cache, session, MAX_TOKENS)
    end_session(session)
    assert filled == plain
    predicted = prediction_ids(tok, prediction)
    details = usage_extra(session, prediction=predicted)["completion_tokens_details"]
    assert details == prediction_usage(predicted, filled)  # on the ids the decode emitted
    accepted = predict.trace_accepted(trace, ORIGIN)
    assert 0 < accepted <= details["accepted_prediction_tokens"]  # what the source drafted, and more
    assert details["rejected_prediction_tokens"] <= 1  # the reply itself: at most a re-encoded last id


def test_the_bound_is_priced_on_a_curve_measured_in_the_run(loaded, monkeypatch):
    """``bound`` uses the cost curve the run measures (at the plan's sizes), ``bound_plan`` the
    stored one: a curve twice as steep as the plan's gives a lower bound than the plan's."""
    model, tok = loaded
    plan = plan_for(model)
    steep = {m: 1.0 if m == 1 else 2 * c for m, c in plan.cost.items()}
    monkeypatch.setattr("mlx_fill.core.qualify.measure_cost", lambda *a, **k: steep)
    curve = predict.measured_curve(model, plan)
    assert curve.cost == steep and curve.max_chunk == plan.max_chunk
    report = predict.run("qwen3-json", [_task("useless-prediction")], 1, None, 8)
    assert report["measured_cost"]["cost"] == steep
    assert report["measured_cost"]["best_round_rate"] < report["plan"]["best_round_rate"]
    task = report["tasks"][0]
    assert task["coverage"] > 0 and task["bound"] < task["bound_plan"]


def _edits_file(tmp_path, *tasks: dict):
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "a.py").write_text("def old_name():\n    return 1\n")
    (tmp_path / "src" / "a_new.py").write_text("def new_name():\n    return 1\n")
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in tasks) + "\n\n")
    return path


def test_an_edits_file_gives_tasks_read_from_its_folder(tmp_path):
    path = _edits_file(
        tmp_path,
        {"name": "by-replacement", "file": "src/a.py", "instruction": "Rename old_name.",
         "replacements": [["old_name", "new_name"]]},
        {"name": "by-file", "file": "src/a.py", "instruction": "Rename old_name.",
         "expected": "src/a_new.py", "prediction": "src/a_new.py", "max_tokens": 7},
        {"name": "unchecked", "file": "src/a.py", "instruction": "Tidy it."})
    by_name = {t.name: t for t in predict.load_edits(path)}
    assert list(by_name) == ["by-replacement", "by-file", "unchecked"]
    assert by_name["by-replacement"].expected() == by_name["by-file"].expected() == \
        "def new_name():\n    return 1\n"
    assert by_name["by-file"].prediction() == "def new_name():\n    return 1\n"
    assert by_name["by-file"].max_tokens == 7
    assert by_name["unchecked"].expected() is None
    assert by_name["unchecked"].prediction() == by_name["unchecked"].original()
    assert "def old_name" in predict.messages_for(by_name["unchecked"])[1]["content"]


@pytest.mark.parametrize(("task", "needle"), [
    ({"name": "t", "file": "src/nosuch.py", "instruction": "x"}, "No such file"),
    ({"name": "t", "file": "src/a.py"}, "'instruction' must be a non-empty string"),
    ({"name": "t", "file": "src/a.py", "instruction": "x", "replacements": [["absent", "y"]]},
     "'absent' is not in"),
    ({"name": "t", "file": "src/a.py", "instruction": "x", "replacements": "old,new"},
     "'replacements' must be a list of [old, new] strings"),
    ({"name": "t", "file": "src/a.py", "instruction": "x", "max_tokens": 0},
     "'max_tokens' must be a positive integer"),
    ({"name": "t", "file": "src/a.py", "instruction": "x", "extra": 1}, "unknown fields ['extra']"),
    ({"name": "t", "file": "src/a.py", "instruction": "x", "expected": "src/a_new.py",
      "replacements": [["old_name", "x"]]}, "give 'replacements' or 'expected', not both"),
    ([1, 2], "a task is a JSON object"),
    ({"name": "a,b", "file": "src/a.py", "instruction": "x"}, "'name' must hold no comma"),
    ({"name": "t ", "file": "src/a.py", "instruction": "x"}, "'name' must hold no comma"),
    ({"name": "t", "file": "src/a.py", "instruction": "x \ud83c"},
     "a string holds '\\ud83c', half of a UTF-16 surrogate pair"),
])
def test_a_bad_edit_task_is_one_line_naming_its_line(tmp_path, task, needle, capsys):
    path = _edits_file(tmp_path, task)
    assert predict.main(["--edits", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("predict: ") and len(err.strip().splitlines()) == 1, err
    assert f"--edits {path} line 1: " in err and needle in err, err


def test_the_tasks_of_an_edits_file_are_the_names_tasks_chooses_from(tmp_path, capsys):
    path = _edits_file(tmp_path, {"name": "mine", "file": "src/a.py", "instruction": "x"},
                       {"name": "mine", "file": "src/a.py", "instruction": "y"})
    assert predict.main(["--edits", str(path)]) == 2
    assert "the name 'mine' is taken by an earlier task" in capsys.readouterr().err
    path = _edits_file(tmp_path, {"name": "mine", "file": "src/a.py", "instruction": "x"})
    assert predict.main(["--edits", str(path), "--tasks", "rename-symbol"]) == 2
    assert "--tasks: unknown tasks ['rename-symbol']; choose from mine" in capsys.readouterr().err
    assert predict.main(["--edits", str(path), "--tasks", "mine,mine"]) == 2
    assert "--tasks names ['mine'] more than once" in capsys.readouterr().err
    assert predict.main(["--edits", str(path), "--tasks", ","]) == 2
    assert "--tasks names no task; choose from mine" in capsys.readouterr().err


def test_an_edits_file_is_read_as_its_writers_write_it(tmp_path):
    """A leading BOM, CRLF line ends and a raw U+2028 inside a string (JSON allows it; ``JSON.stringify``
    and ``ensure_ascii=False`` write it) keep one task per line."""
    path = _edits_file(tmp_path)
    task = {"name": "mine", "file": "src/a.py", "instruction": "Rename\u2028old_name \u540d\u524d."}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(task, ensure_ascii=False).encode() + b"\r\n")
    (only,) = predict.load_edits(path)
    assert only.instruction == task["instruction"]


@pytest.mark.parametrize(("line", "needle"), [
    ("# a comment", "not a JSON object (Expecting value at column 1)"),
    ('{"max_tokens": ' + "9" * 5000 + "}", "not a JSON object (Exceeds the limit"),
    ("[" * 100_000, "not a JSON object (maximum recursion depth exceeded"),
])
def test_a_line_that_is_not_json_says_so(tmp_path, line, needle, capsys):
    path = _edits_file(tmp_path, {"name": "mine", "file": "src/a.py", "instruction": "x"})
    path.write_text(path.read_text() + line + "\n")
    assert predict.main(["--edits", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--edits {path} line 3: {needle}" in err, err


def test_an_edit_task_reads_its_files_as_they_are(tmp_path):
    """CRLF line ends reach the prompt, the prediction and the expected file unchanged, and a
    replacement matches them."""
    path = _edits_file(tmp_path, {"name": "crlf", "file": "src/w.py", "instruction": "Rename f.",
                                  "replacements": [["def f():\r\n", "def g():\r\n"]]})
    (tmp_path / "src" / "w.py").write_bytes(b"def f():\r\n    return 1\r\n")
    (task,) = predict.load_edits(path)
    assert task.original() == task.prediction() == "def f():\r\n    return 1\r\n"
    assert task.expected() == "def g():\r\n    return 1\r\n"
    assert "def f():\r\n    return 1\r\n" in predict.messages_for(task)[1]["content"]


@pytest.mark.parametrize(("task", "needle"), [
    ({"name": "t", "file": "src/w.py", "instruction": "x", "replacements": [["def f():\n", "y"]]},
     "'def f():\\n' is not in {folder}/src/w.py (its lines end in \\r\\n)"),
    ({"name": "t", "file": "src/a.py", "instruction": "x",
      "replacements": [["old_name", "new_name"], ["old_name()", "x()"]]},
     "'old_name()' is not in {folder}/src/a.py after the replacements before it"),
    ({"name": "t", "file": "src/latin1.py", "instruction": "x"},
     "{folder}/src/latin1.py is not UTF-8 text (invalid continuation byte at byte 3)"),
    ({"name": "t", "file": "src/a.py", "instruction": "x", "prediction": "src/latin1.py"},
     "{folder}/src/latin1.py is not UTF-8 text"),
])
def test_a_file_or_replacement_that_does_not_fit_is_named(tmp_path, task, needle, capsys):
    path = _edits_file(tmp_path, task)
    (tmp_path / "src" / "w.py").write_bytes(b"def f():\r\n    return 1\r\n")
    (tmp_path / "src" / "latin1.py").write_bytes("caf\u00e9 = 1\n".encode("latin-1"))
    assert predict.main(["--edits", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"--edits {path} line 1: " in err and needle.format(folder=tmp_path) in err, err


def test_an_edit_is_made_whatever_line_ends_the_reply_writes():
    expected = "def g():\r\n    return 1\r\n"
    assert predict.edit_made("```python\ndef g():\n    return 1\n```", expected)
    assert not predict.edit_made("```python\ndef f():\n    return 1\n```", expected)


def test_a_file_holding_fences_or_no_last_newline_is_one_code_block_each_way(tmp_path):
    """The prompt's fence outlasts the file's own backticks and closes on its own line; the reply's
    block is read to its own closing fence, so a correct edit of such a file is one."""
    path = _edits_file(
        tmp_path,
        {"name": "md", "file": "src/r.md", "instruction": "Rename.", "replacements": [["old", "new"]]},
        {"name": "bare", "file": "src/b.py", "instruction": "Rename.", "replacements": [["f", "g"]]})
    (tmp_path / "src" / "r.md").write_text("# R\n\n```sh\nold\n```\n")
    (tmp_path / "src" / "b.py").write_text("f = 1")
    md, bare = predict.load_edits(path)
    assert predict.messages_for(md)[1]["content"] == "Rename.\n\n````\n# R\n\n```sh\nold\n```\n````"
    assert predict.messages_for(bare)[1]["content"] == "Rename.\n\n```python\nf = 1\n```"
    assert predict.edit_made("````markdown\n# R\n\n```sh\nnew\n```\n````\n", md.expected())
    assert predict.edit_made("Here:\n```python\ng = 1\n```\nDone.", bare.expected())
    assert predict.edit_made("```python\ng = 1```", bare.expected())
    for task in predict.TASKS:  # the built-in prompts are as they were
        assert predict.messages_for(task)[1]["content"].endswith(f"\n{task.original()}```")
