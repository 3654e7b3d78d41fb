"""A model folder that has mlx-lm's files but not what mlx-lm can load, a draft model with
another tokenizer, and server start-up settings the product cannot use: each is one line on
stderr and exit 2, said before any request is served."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlx_fill.assets.fixtures import fixture_path

from adapter_models import free_port
from cli_lines import one_error_line


def _copy(name: str, dest: Path) -> Path:
    """A writable copy of fixture ``name``'s folder (weights linked, not copied)."""
    src = fixture_path(name)
    dest.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dest / f.name).symlink_to(f)
        else:
            shutil.copy(f, dest / f.name)
    return dest


@pytest.mark.parametrize("command", ["plan", "qualify", "serve"])
def test_folder_contents_mlx_lm_cannot_load(command, tmp_path, capsys):
    folder = _copy("qwen3-json", tmp_path / "m")
    argv = [command, "--model", str(folder), *(["--port", str(free_port())] if command == "serve" else [])]
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text("[1, 2]")
    one_error_line(capsys, argv, f"{folder}: mlx-lm cannot load this model (")
    (folder / "config.json").write_text(config.replace('"qwen3"', '"bogus_arch"', 1))
    one_error_line(capsys, argv, "mlx-lm cannot load this model", "bogus_arch")
    (folder / "config.json").write_text(config)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    weights.write_bytes(data[: len(data) // 2])
    one_error_line(capsys, argv, "mlx-lm cannot load this model")


def test_serve_broken_tokenizer_and_missing_template(tmp_path, capsys):
    folder = _copy("qwen3-json", tmp_path / "m")
    argv = ["serve", "--model", str(folder), "--port", str(free_port())]
    (folder / "tokenizer.json").write_text('{"x":')
    one_error_line(capsys, argv, "mlx-lm cannot load this model")
    shutil.copy(fixture_path("qwen3-json") / "tokenizer.json", folder / "tokenizer.json")
    for f in folder.glob("*.jinja"):
        f.unlink()
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"no_template"'))
    one_error_line(capsys, argv, "has no chat template")


def test_serve_a_template_that_does_not_compile_or_no_tokenizer_files(tmp_path, capsys):
    folder = _copy("qwen3-json", tmp_path / "m")
    argv = ["serve", "--model", str(folder), "--port", str(free_port())]
    template = folder / "chat_template.jinja"
    template.write_text("{% for x in %}")
    one_error_line(capsys, argv, f"{folder}: the chat template does not compile (TemplateSyntaxError")
    template.unlink()
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    one_error_line(capsys, argv, f"{folder}: the tokenizer encodes text to no ids")


def test_serve_draft_model_with_another_tokenizer(capsys):
    one_error_line(capsys, ["serve", "--model", str(fixture_path("qwen3-json")), "--port",
                            str(free_port()), "--draft-model", str(fixture_path("smollm2-135m"))],
                   "--draft-model", "tokenizer differs")


@pytest.mark.parametrize(("flags", "needle"), [
    (["--prefill-step-size", "0"], "argument --prefill-step-size: 0 is not at least 1"),
    (["--prompt-cache-bytes", "-5"], "argument --prompt-cache-bytes: -5 is not at least 1"),
    (["--max-tokens", "0"], "argument --max-tokens: 0 is not at least 1"),
    (["--max-tokens", "5000", "--max-tokens-ceiling", "10"],
     "--max-tokens 5000 is above --max-tokens-ceiling 10"),
    (["--max-request-bytes", "0"], "argument --max-request-bytes: 0 is not at least 1"),
    (["--max-json-depth", "9999"], "argument --max-json-depth: 9999 is more than 512"),
    (["--store-tokens", "99999999999999"],
     "argument --store-tokens: 99999999999999 is more than 1000000000"),
])
def test_serve_settings_it_cannot_use(flags, needle, capsys):
    one_error_line(capsys, ["serve", "--model", str(fixture_path("qwen3-json")), "--port",
                            str(free_port()), *flags], needle)


@pytest.mark.parametrize(("name", "value", "needle"), [
    ("MLX_FILL_MAX_SPAN", "abc", "MLX_FILL_MAX_SPAN='abc' is not a whole number"),
    ("MLX_FILL_MAX_SPAN", "99999999999999999999", "is outside 1..4096"),
    ("MLX_FILL_STORE_TOKENS", "0", "MLX_FILL_STORE_TOKENS=0 is outside 1..1000000000"),
    ("MLX_FILL_SOURCES", "bogus", "MLX_FILL_SOURCES: unknown sources ['bogus']"),
    ("MLX_FILL_PROMOTE_AFTER", "0", "MLX_FILL_PROMOTE_AFTER=0 is outside"),
    ("MLX_FILL_TRACE", "{tmp}", "is not a file path in an existing folder"),
    # /proc takes no new file (on a system without it, the folder check above answers)
    ("MLX_FILL_TRACE", "/proc/mlx-fill.jsonl", "MLX_FILL_TRACE=/proc/mlx-fill.jsonl "),
    ("MLX_FILL_PLAN", "{tmp}/missing.json", "MLX_FILL_PLAN={tmp}/missing.json is unreadable "
                                            "(FileNotFoundError"),
    ("MLX_FILL_PLAN", "{tmp}", "MLX_FILL_PLAN={tmp} is unreadable (IsADirectoryError"),
    ("MLX_FILL_CACHE", "/proc/mlx-fill-cache", "MLX_FILL_CACHE=/proc/mlx-fill-cache cannot hold"),
    ("MLX_FILL_QUALIFY_BUDGET_S", "abc", "MLX_FILL_QUALIFY_BUDGET_S='abc' is not a number of seconds"),
    ("MLX_FILL_QUALIFY_BUDGET_S", "-1", "MLX_FILL_QUALIFY_BUDGET_S='-1' is not a number of seconds"),
])
def test_serve_environment_it_cannot_use(name, value, needle, tmp_path, monkeypatch, capsys):
    model = fixture_path("qwen3-json")
    monkeypatch.setenv(name, value.format(tmp=tmp_path))
    one_error_line(capsys, ["serve", "--model", str(model), "--port", str(free_port())],
                   needle.format(tmp=tmp_path))


def test_plan_refuses_a_plan_file_it_cannot_read_as_serve_does(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_FILL_PLAN", str(tmp_path / "missing.json"))
    one_error_line(capsys, ["plan", "--model", str(fixture_path("qwen3-json")), "--no-qualify"],
                   f"MLX_FILL_PLAN={tmp_path}/missing.json is unreadable (FileNotFoundError")


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf"])
def test_plan_refuses_a_qualify_budget_it_cannot_use_as_serve_does(value, tmp_path, monkeypatch,
                                                                   capsys):
    """``plan`` is what qualifies on first use: a budget it cannot read is not silently 120 s."""
    monkeypatch.setenv("MLX_FILL_QUALIFY_BUDGET_S", value)
    monkeypatch.setattr("mlx_fill.core.model_folder.load_model_folder",
                        lambda *a, **k: pytest.fail("loaded before checking the budget"))
    one_error_line(capsys, ["plan", "--model", str(fixture_path("qwen3-json"))],
                   f"MLX_FILL_QUALIFY_BUDGET_S={value!r} is not a number of seconds")


def test_a_trace_file_that_cannot_be_opened_at_a_request_is_named(tmp_path, monkeypatch):
    """A library caller that never ran ``check_env`` (or a folder removed since) gets the knob
    named, not the bare ``OSError``."""
    from mlx_fill.session import BadEnvironment, build_session

    monkeypatch.setenv("MLX_FILL_TRACE", str(tmp_path / "gone" / "trace.jsonl"))
    with pytest.raises(BadEnvironment, match=r"MLX_FILL_TRACE=.*gone/trace.jsonl cannot be appended"):
        build_session("strict", model=None, tokenizer=None, prompt_ids=[1], logprobs=True)


def test_the_edit_benchmark_refuses_what_the_server_refuses(tmp_path, monkeypatch, capsys):
    """``python -m scripts.bench.predict``: a bad ``MLX_FILL_*`` value (before any model
    loads), a folder mlx-lm cannot load, one without a chat template: one line, exit 2."""
    from scripts.bench import predict

    def refused(argv: list[str], needle: str) -> None:
        capsys.readouterr()
        code = predict.main([*argv, "--max-tokens", "4", "--tasks", "rename-symbol"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("predict: ") and needle in err, err

    folder = _copy("qwen3-json", tmp_path / "m")
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text("{}")
    monkeypatch.setenv("MLX_FILL_MAX_SPAN", "abc")
    refused(["--model", str(folder)], "MLX_FILL_MAX_SPAN='abc' is not a whole number")
    monkeypatch.delenv("MLX_FILL_MAX_SPAN")
    refused(["--model", str(folder)], f"{folder}: mlx-lm cannot load this model (")
    (folder / "config.json").write_text(config)
    for f in folder.glob("*.jinja"):
        f.unlink()
    tokenizer_config = folder / "tokenizer_config.json"
    tokenizer_config.write_text(tokenizer_config.read_text().replace('"chat_template"', '"no_template"'))
    refused(["--model", str(folder)], "has no chat template")
