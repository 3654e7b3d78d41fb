"""Model directories for the adapter tests (real mlx-lm loadable dirs, real qwen3 tokenizer).

``serving_model_dir()`` is the trained ``qwen3-json`` fixture when its weights are in the
checkout, else a tiny seeded random-weight qwen3 with the full qwen3 vocabulary (its output is
gibberish, but every plumbing path runs). ``TRAINED`` says which one the tests got.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mlx_fill.assets import store as assets
from mlx_fill.evidence.demo import DEFAULT_MESSAGES, DEFAULT_TOOLS
from mlx_fill.assets.fixtures import TOKENIZER_FILES, fixture_emits_calls, fixture_path
from mlx_fill.core.paths import user_cache_dir
from mlx_fill.assets.random_models import build, config_for, save

QWEN3_VOCAB = 151936


def random_qwen3_dir() -> Path:
    """A tiny random qwen3 (tied embeddings, full vocab) with the qwen3 tokenizer and template."""
    dest = user_cache_dir() / "test-models" / "qwen3-random-tiny"
    if (dest / "model.safetensors").is_file() and all((dest / f).is_file() for f in TOKENIZER_FILES):
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = dict(config_for("qwen3"), vocab_size=QWEN3_VOCAB, tie_word_embeddings=True)
    model, config = build(config, seed=7)
    save(model, config, tmp)
    family = assets.family_dir("qwen3")
    for name in TOKENIZER_FILES:
        shutil.copyfile(family / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def serving_model_dir() -> tuple[Path, bool]:
    """(model dir, trained?): the qwen3-json fixture when its recorded eval shows it emits tool
    calls, else the random tiny qwen3 (plumbing runs the same on both)."""
    if fixture_emits_calls("qwen3-json"):
        return fixture_path("qwen3-json"), True
    return random_qwen3_dir(), False


# --- real server subprocesses (loopback only) ---------------------------------------------

import contextlib
import os
import re
import socket
import subprocess
import sys
import time

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120.0) -> None:
    """Wait until ``url`` answers 200; RuntimeError (with the end of ``log``) when ``proc``
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready after {timeout}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def wait_line(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 120.0) -> re.Match:
    """The first line of ``log`` matching ``pattern`` (a regular expression), once written;
    RuntimeError (with the end of ``log``) when ``proc`` exits first or ``timeout`` seconds
    pass."""
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, log.read_text(), re.M)):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no line {pattern!r} after {timeout}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    return found


@contextlib.contextmanager
def running_server(argv: list[str], port: int, *, env: dict[str, str] | None = None,
                   log: Path, ready_path: str = "/v1/models", timeout: float = 120.0):
    """Start ``argv`` (a server listening on 127.0.0.1:``port``), wait until ``ready_path``
    answers, yield the base URL, then stop it. Its stdout+stderr go to ``log``."""
    knobs = ("MLX_FILL", "MLX_FILL_MAX_SPAN", "MLX_FILL_TRACE", "MLX_FILL_PLAN", "MLX_FILL_SOURCES",
             "MLX_FILL_STORE_TOKENS")
    full_env = {k: v for k, v in os.environ.items() if k not in knobs}
    full_env.update(env or {})
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(proc, base + ready_path, log, timeout)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# The fixture's training domain: the demo's held-back mini-swe-agent exchange (system prompt and
# PR description, a structured ``bash`` tool), on which the fixture makes parseable calls.
AGENT_TOOLS = DEFAULT_TOOLS
AGENT_MESSAGES = DEFAULT_MESSAGES

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}]
