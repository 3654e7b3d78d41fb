"""Every ``mlx-fill`` subcommand answers a user mistake with one line on stderr, ``mlx-fill
COMMAND: what is wrong and what to do``, and exit status 2; never a traceback."""

from __future__ import annotations

import json
import os

import pytest

from mlx_fill.assets import fixtures
from mlx_fill.cli import COMMANDS, main

from cli_lines import OFFLINE, one_error_line


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_a_bad_option_in_one_line(command, capsys):
    one_error_line(capsys, [command, "--no-such-option"], f"`mlx-fill {command} --help`")


def test_unknown_command(capsys):
    assert main(["nope"]) == 2
    assert capsys.readouterr().err == "mlx-fill: unknown command 'nope' (see `mlx-fill --help`)\n"


def test_demo_offline_in_a_fresh_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLX_FILL_ASSETS", raising=False)
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    one_error_line(capsys, ["demo"], "fetching it failed", "run `mlx-fill assets fetch qwen3`", "MLX_FILL_ASSETS")


def test_qualify_bad_model_path(tmp_path, capsys):
    one_error_line(capsys, ["qualify", "--model", str(tmp_path / "none")], "does not exist", "model directory")
    one_error_line(capsys, ["qualify", "--model", str(tmp_path)], "has no config.json")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    one_error_line(capsys, ["qualify", "--model", str(tmp_path / "weights.safetensors")],
                   "is a file, not a folder", "model directory")


def test_fixture_without_committed_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fixtures, "FIXTURES_DIR", tmp_path)
    one_error_line(capsys, ["fixture", "qwen3-json"], "trained.safetensors", "python -m scripts.training.train_fixture qwen3-json")


def test_assets_unknown_family(capsys):
    one_error_line(capsys, ["assets", "fetch", "qwen4"], "unknown asset family 'qwen4'", "qwen3.5")
    one_error_line(capsys, ["assets", "path", "qwen4"], "invalid choice")


def test_assets_fetch_never_replaces_what_it_did_not_write(tmp_path, monkeypatch, capsys):
    """A ``--dest`` whose FAMILY/ is a file, or a folder holding the user's own files, is named
    before any download; an earlier fetch's folder is the one thing a fetch replaces."""
    monkeypatch.setattr("mlx_fill.assets.fetch.build_families",
                        lambda *a, **k: pytest.fail("downloaded before checking --dest"))
    (tmp_path / "qwen3").write_text("mine")
    one_error_line(capsys, ["assets", "fetch", "qwen3", "--dest", str(tmp_path)],
                   f"cannot fetch qwen3 into {tmp_path / 'qwen3'}: it is a file", "--dest")
    (tmp_path / "qwen3").unlink()
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "notes.txt").write_text("mine")
    (tmp_path / "qwen3" / "tokenizer.json").write_text("{}")
    one_error_line(capsys, ["assets", "fetch", "qwen3", "--dest", str(tmp_path)],
                   "it holds notes.txt, not asset files", "move it away")
    assert (tmp_path / "qwen3" / "notes.txt").read_text() == "mine"


def test_audit_corpus_without_tools_and_malformed_cases(tmp_path, capsys):
    one_error_line(capsys, ["audit", "--family", "qwen3", "--corpus", str(tmp_path / "none")], "no corpus folder")
    one_error_line(capsys, ["audit", "--family", "qwen3", "--corpus", str(tmp_path)],
                   "tools/default.json does not exist", "--tools FILE")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "default.json").write_text(json.dumps([{"type": "function", "function": {
        "name": "ls", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]))
    (tmp_path / "qwen3").mkdir()
    case = tmp_path / "qwen3" / "a.json"
    case.write_text('{"id": "a", ')
    one_error_line(capsys, ["audit", "--family", "qwen3", "--corpus", str(tmp_path)], "a.json is not valid JSON")
    case.write_text(json.dumps({"id": "a", "family": "qwen3", "messages": []}))
    one_error_line(capsys, ["audit", "--family", "qwen3", "--corpus", str(tmp_path)],
                   "a.json is not an audit case", "reply or raw_reply")
    case.write_text(json.dumps({"id": "a", "family": "qwen3", "messages": [{"role": "user", "content": "hi"}],
                                "raw_reply": "hello", "no_fill_in": ["absent"]}))
    one_error_line(capsys, ["audit", "--family", "qwen3", "--corpus", str(tmp_path)],
                   "no_fill_in entry 'absent' is not in the reply text")


def test_serve_bad_model_path(tmp_path, capsys):
    one_error_line(capsys, ["serve", "--model", str(tmp_path / "none")], "does not exist")
    one_error_line(capsys, ["serve", "--model", str(tmp_path), "--draft-model", "./none"], "has no config.json")


def test_serve_draft_model_without_fill(monkeypatch, capsys):
    """``--fill off`` builds no session, so a draft model would be loaded and never run; said
    before either model loads."""
    from mlx_fill.assets.fixtures import fixture_path
    model = str(fixture_path("qwen3-json"))
    monkeypatch.setattr("mlx_fill.core.model_folder.load_model_folder",
                        lambda *a, **k: pytest.fail("a model loaded"))
    one_error_line(capsys, ["serve", "--model", model, "--port", "0", "--fill", "off",
                            "--draft-model", model], "--draft-model proposes through fill",
                   "drop --draft-model")


def test_serve_store_seed_errors(tmp_path, capsys):
    """Said before the model loads."""
    from mlx_fill.assets.fixtures import fixture_path
    serve = ["serve", "--model", str(fixture_path("qwen3-json")), "--port", "0", "--fill", "all"]
    one_error_line(capsys, [*serve, "--store-seed", str(tmp_path / "none.jsonl")], "no such transcripts file or folder")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    one_error_line(capsys, [*serve, "--store-seed", str(tmp_path / "bad.jsonl")], "holds no session", "line 1")
    one_error_line(capsys, [*serve, "--store-tokens", "0"], "--store-tokens: 0 is not at least 1")
    one_error_line(capsys, [*serve[:-2], "--store-seed", str(tmp_path / "bad.jsonl")], "pass --fill all")
    one_error_line(capsys, [*serve[:-2], "--store-tokens", "1000"], "pass --fill all")
    (tmp_path / "one.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    glm = ["serve", "--model", str(fixture_path("glm-xml")), "--port", "0", "--fill", "all"]
    one_error_line(capsys, [*glm, "--store-seed", str(tmp_path / "one.jsonl")],
                   "generation prompt rewrites the messages before it")


def test_serve_store_seed_with_a_template_that_refuses_one_user_message(tmp_path, capsys):
    """The store is seeded by cutting replies out of rendered conversations; a template that
    raises on the probe conversation (its own ``raise_exception``) was a Jinja traceback."""
    from mlx_fill.assets.fixtures import fixture_path
    model = tmp_path / "model"
    model.mkdir()
    for f in fixture_path("qwen3-json").iterdir():
        if f.name != "chat_template.jinja":
            (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}{{ raise_exception('no turns here') }}")
    (tmp_path / "one.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    one_error_line(capsys, ["serve", "--model", str(model), "--port", "0", "--fill", "all",
                            "--store-seed", str(tmp_path / "one.jsonl")],
                   "the chat template refuses a conversation of one user message (no turns here)")


def test_transcripts_that_are_no_regular_file_are_named_so(capsys):
    """A device or a pipe (the shell's ``<(zcat FILE)``) exists: it is not called missing, and
    it is not read as a file of no session (the reader opens a file twice)."""
    from mlx_fill.assets.fixtures import fixture_path
    needle = f"{os.devnull} is not a regular file (a pipe or a device); save what it holds"
    one_error_line(capsys, ["study", "--transcripts", os.devnull], needle)
    one_error_line(capsys, ["replay", "--sessions", os.devnull, "--url", "http://127.0.0.1:9"], needle)
    one_error_line(capsys, ["serve", "--model", str(fixture_path("qwen3-json")), "--port", "0",
                            "--fill", "all", "--store-seed", os.devnull], needle)


def test_study_missing_or_malformed_inputs(tmp_path, capsys):
    one_error_line(capsys, ["study", "--transcripts", str(tmp_path / "none.jsonl")], "no such transcripts file or folder")
    one_error_line(capsys, ["study", "--transcripts", str(tmp_path)],
                   f"{tmp_path} is a folder without transcripts files (names ending in .jsonl")
    one_error_line(capsys, ["report", str(tmp_path)], f"a folder, not a runs file: {tmp_path}")
    one_error_line(capsys, ["study", "--family", "qwen4"], "invalid choice: 'qwen4'")
    curve = tmp_path / "plan.json"
    curve.write_text("[1, 2]")
    one_error_line(capsys, ["study", "--cost-curve", str(curve)], "is not a DispatchPlan JSON", "mlx-fill qualify")


@pytest.mark.parametrize(("url", "needle"), [
    ("http://h:abc/v1", "is not a valid URL (Port"), ("http://[::1", "is not a valid URL"),
    ("http://[zz]/v1", "is not a valid URL"), ("http://h:99999/v1", "is not a valid URL (Port"),
    ("notaurl", "is not an http:// or https:// URL"), ("ftp://x/v1", "is not an http://"),
    ("http://", "names no host"), ("http://h/\nv1", "holds white space")])
@pytest.mark.parametrize("flag", ["--url", "--url-a", "--url-b"])
def test_replay_and_ab_endpoint_urls_are_checked_before_anything_runs(flag, url, needle, tmp_path, capsys):
    good = "http://127.0.0.1:9"
    urls = {"--url": ["replay", "--url", url], "--url-a": ["ab", "--url-a", url, "--url-b", good],
            "--url-b": ["ab", "--url-a", good, "--url-b", url]}[flag]
    if flag == "--url-b" and needle.startswith("is not an http"):
        needle = "is neither URL nor NAME=URL"
    out = tmp_path / "out"
    one_error_line(capsys, [urls[0], "--sessions", str(tmp_path / "none.jsonl"), *urls[1:],
                            "--out", str(out)], needle)
    assert not out.exists()


@pytest.mark.parametrize("command", ["replay", "ab"])
def test_replay_and_ab_missing_transcripts(command, tmp_path, capsys):
    urls = ["--url", "http://127.0.0.1:9"] if command == "replay" else [
        "--url-a", "http://127.0.0.1:9", "--url-b", "http://127.0.0.1:9"]
    one_error_line(capsys, [command, "--sessions", str(tmp_path / "none.jsonl"), *urls], "no such transcripts file")


def test_report_missing_runs_file(tmp_path, capsys):
    one_error_line(capsys, ["report", str(tmp_path / "runs.jsonl")], "no such runs file", "mlx-fill replay")


@pytest.mark.parametrize(("command", "missing", "extra"), [("serve", "fastapi", "serve"),
                                                           ("replay", "openai", "evidence")])
def test_a_missing_extra_is_named_with_its_install_command(capsys, monkeypatch, command, missing,
                                                           extra):
    import mlx_fill.cli as cli

    def absent(name, *a, **kw):
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(cli.importlib, "import_module", absent)
    one_error_line(capsys, [command, "--help"], missing, f"mlx-fill[{extra}]")


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(name, rest):
        raise KeyboardInterrupt
    monkeypatch.setattr("mlx_fill.cli._run", interrupted)
    assert main(["demo"]) == 130
    assert capsys.readouterr().err == "mlx-fill demo: interrupted\n"


def test_qualify_refuses_an_unwritable_cache_before_measuring(tmp_path, monkeypatch, capsys):
    model = fixtures.fixture_path("qwen3-json")
    cache = tmp_path / "cache"
    cache.write_text("a file")
    monkeypatch.setenv("MLX_FILL_CACHE", str(cache))
    monkeypatch.setattr("mlx_fill.core.model_folder.load_model_folder",
                        lambda *a, **k: pytest.fail("measured before checking the cache"))
    one_error_line(capsys, ["qualify", "--quick", "--model", str(model)], "is a file")


def test_qualify_out_refuses_a_pipe_it_would_replace(tmp_path, monkeypatch, capsys):
    """The plan is renamed onto ``--out``: a pipe or a device there (``/dev/null``) would be
    removed, so it is refused before anything is measured."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    monkeypatch.setattr("mlx_fill.core.model_folder.load_model_folder",
                        lambda *a, **k: pytest.fail("measured before checking --out"))
    one_error_line(capsys, ["qualify", "--quick", "--model", str(fixtures.fixture_path("qwen3-json")),
                            "--out", str(pipe)], "not a regular file", "pass a file path")
    assert pipe.is_fifo()


def test_serve_names_a_corrupt_ledger_in_one_line(tmp_path, monkeypatch):
    """The ledger holds the only record of past disagreements: never reset, and never a
    traceback."""
    from adapter_models import random_qwen3_dir
    from mlx_lm.utils import load_tokenizer

    from mlx_fill.adapters.server.engine import Engine
    from mlx_fill.core.errors import UserError
    from mlx_fill.sources.ledger import ledger_path

    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    model = random_qwen3_dir()
    path = ledger_path(str(model), load_tokenizer(model).chat_template)
    path.parent.mkdir(parents=True)
    path.write_text("[]")
    with pytest.raises(UserError, match="corrupt evidence ledger .*move the file away"):
        Engine(str(model), mode="strict")
    assert path.read_text() == "[]"
    path.unlink()
    path.parent.rmdir()
    path.parent.write_text("a file where the ledger folder goes")
    with pytest.raises(UserError, match="the evidence ledger cannot be kept in .*move the file"):
        Engine(str(model), mode="strict")


def test_a_damaged_fixture_folder_is_not_intact(tmp_path):
    """A folder whose weights were removed or cut short, or whose config no longer parses, is
    assembled again rather than handed to a loader."""
    source = fixtures.fixture_path("qwen3-json")
    folder = tmp_path / "qwen3-json"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((source / name).read_bytes())
    assert fixtures._intact(folder)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    assert not fixtures._intact(folder)
    (folder / "model.safetensors").unlink()
    assert not fixtures._intact(folder)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text("{bad")
    assert not fixtures._intact(folder)


@pytest.mark.parametrize("argv", [["audit", "--family", "qwen3", "--json", ""], ["study", "--out", ""]])
def test_an_empty_output_path_is_one_line(argv, capsys):
    one_error_line(capsys, argv, f"argument {argv[-2]}: an empty path; pass a")
