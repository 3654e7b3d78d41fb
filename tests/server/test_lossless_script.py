"""``scripts.lossless``: fill on against fill off through real servers. The comparison names
every field that differs, and a short run on the embedded fixture finds none. Both it and
``scripts.fuzz`` answer a bad argument with one line before any server starts."""

from __future__ import annotations

import pytest

from scripts import fuzz, lossless

REPLY = {"content": "hi", "tool_calls": [("f", "{}")], "finish": "stop",
         "usage": {"prompt_tokens": 9, "completion_tokens": 3}}


def test_identical_replies_differ_in_nothing_and_fill_counts_must_match_the_completion():
    on = {**REPLY, "usage": {**REPLY["usage"], "fill": {"emitted": 3, "injected": 2}}}
    assert lossless.differences(REPLY, on) == []
    miscounted = {**REPLY, "usage": {**REPLY["usage"], "fill": {"emitted": 4}}}
    assert lossless.differences(REPLY, miscounted) == [
        "usage.fill.emitted 4 != completion_tokens 3"]


@pytest.mark.parametrize(("change", "named"), [
    ({"content": "ho"}, ["content"]),
    ({"tool_calls": [("f", '{"a": 1}')]}, ["tool_calls"]),
    ({"finish": "length"}, ["finish"]),
    ({"usage": {"prompt_tokens": 9, "completion_tokens": 4}}, ["usage.completion_tokens"]),
    ({"error": "APIStatusError", "status": 500, "body": "boom"}, ["error", "status", "body"]),
])
def test_every_compared_field_that_differs_is_named(change, named):
    assert lossless.differences(REPLY, {**REPLY, **change}) == named


def test_every_group_names_requests_the_script_sends():
    names = {name for name, _ in lossless.requests()}
    assert all(name in names for group in lossless.groups() for name, _ in group)


def test_a_short_run_through_both_servers_finds_no_difference(capsys):
    assert lossless.main(["--servers", "serve,hook", "--modes", "strict", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "serve   strict          4         0" in out and "hook    strict          4         0" in out
    assert "DIFFERS" not in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--servers", "stock"], "argument --servers: 'stock': name serve, hook or both"),
    (["--modes", "off"], "argument --modes: 'off': name modes of strict,echo,all"),
    (["--limit", "0"], "argument --limit: 0 is not at least 1"),
    (["--model", "./nosuch"], "argument --model: ./nosuch does not exist"),
    (["--timeout", "0"], "argument --timeout: 0"),
])
def test_bad_arguments_are_one_line_before_any_server_starts(argv, needle, capsys):
    _usage_error(capsys, lambda: lossless.main(argv), needle)


def _usage_error(capsys, call, needle: str) -> None:
    """``call()`` (a script's ``main``) returns 2 with one stderr line holding ``needle``."""
    code = call()
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--model", "nosuch"], "argument --model: 'nosuch' is neither a fixture (qwen3-json"),
    (["--model", "./nosuch"], "argument --model: ./nosuch does not exist"),
    (["--model", "{folder}"], "has no config.json"),
    (["--servers", "bogus"], "argument --servers: 'bogus': name servers of serve,hook,stock"),
    (["--classes", "types,bogus"], "argument --classes: 'types,bogus': name classes of malformed,"),
    (["--limit", "-1"], "argument --limit: -1 is not at least 0"),
    (["--timeout", "nan"], "argument --timeout: nan is not a finite number"),
    (["--budget-s", "0"], "argument --budget-s: 0 is not above 0"),
    (["--json", "{folder}"], "argument --json: cannot write"),
])
def test_fuzz_bad_arguments_are_one_line_before_any_server_starts(argv, needle, tmp_path,
                                                                  monkeypatch, capsys):
    monkeypatch.setattr(fuzz, "Server", lambda *a, **k: pytest.fail("a server started"))
    _usage_error(capsys, lambda: fuzz.main([a.format(folder=tmp_path) for a in argv]), needle)
