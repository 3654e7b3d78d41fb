"""The DERIVED ``glm4.x`` family folder: Qwen3 tokenizer + GLM special tokens + GLM-4.5 template.

GLM's own tokenizer is not obtainable here. The derived vocabulary is the Qwen3 tokenizer
(ids 0..151668 unchanged) with each GLM special token the templates emit that Qwen3 lacks appended
as a single added id (151669 onwards, in ``GLM_ADDED_TOKENS`` order). ``<|endoftext|>``,
``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>`` and
``</think>`` already exist in Qwen3 and keep their Qwen3 ids. Token ids therefore differ from real
GLM checkpoints; the tool-call text format and the template are GLM's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATE_FILES: tuple[str, ...] = (
    "GLM-4.5.chat_template.jinja",
    "GLM-4.6.chat_template.jinja",
    "GLM-4.7-Flash.chat_template.jinja",
)
DEFAULT_TEMPLATE = "GLM-4.5.chat_template.jinja"

# (content, special): role/mask tokens are special (hidden by skip_special_tokens); the tool-call
# markup stays visible in decoded text so that mlx-lm's glm47 parser sees it.
GLM_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("[MASK]", True),
    ("[gMASK]", True),
    ("[sMASK]", True),
    ("<sop>", True),
    ("<eop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
    ("/nothink", False),
)
# GLM checkpoints stop on any of these (config.json ``eos_token_id``).
GLM_STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False)


def derived_tokenizer_json(qwen3_tokenizer_json: str) -> str:
    """The Qwen3 ``tokenizer.json`` text with the GLM tokens appended as added tokens."""
    data = json.loads(qwen3_tokenizer_json)
    added = data["added_tokens"]
    next_id = max(entry["id"] for entry in added) + 1
    existing = {entry["content"] for entry in added}
    for offset, (content, special) in enumerate(GLM_ADDED_TOKENS):
        if content in existing:
            raise ValueError(f"{content!r} already exists in the base vocabulary")
        added.append({
            "id": next_id + offset, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": special,
        })
    return _dump(data)


def derived_tokenizer_config(qwen3_config_json: str, template: str, tokenizer_json: str) -> str:
    """The Qwen3 ``tokenizer_config.json`` with the GLM template and the added-token table."""
    config = json.loads(qwen3_config_json)
    ids = {entry["content"]: entry for entry in json.loads(tokenizer_json)["added_tokens"]}
    for content, special in GLM_ADDED_TOKENS:
        config["added_tokens_decoder"][str(ids[content]["id"])] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special,
        }
    config["additional_special_tokens"] = [c for c, special in GLM_ADDED_TOKENS if special]
    config["chat_template"] = template
    config["eos_token"] = "<|endoftext|>"
    return _dump(config)


def assemble_derived(qwen3_dir: Path, template_dir: Path, dest: Path) -> Path:
    """Write the derived folder into ``dest`` (templates copied, tokenizer files generated).

    Deterministic: the same inputs give byte-identical files (their hashes are in the manifest).
    Files are written to a sibling temp folder first, then moved into place."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TEMPLATE_FILES:
        shutil.copyfile(template_dir / name, tmp / name)
    template = (template_dir / DEFAULT_TEMPLATE).read_text(encoding="utf-8")
    tokenizer_json = derived_tokenizer_json((qwen3_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    config = derived_tokenizer_config(
        (qwen3_dir / "tokenizer_config.json").read_text(encoding="utf-8"), template, tokenizer_json
    )
    (tmp / "tokenizer_config.json").write_text(config, encoding="utf-8")
    (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
