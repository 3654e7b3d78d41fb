"""Every fenced ``bash`` and ``python`` example of the README runs as printed, on the embedded
default (``qwen3-json``), and every tool-call example returns a parsed call and ``usage.fill``.

The file is README.md at the repository root; ``MLX_FILL_EXAMPLES_DOC`` names another markdown
file (a path relative to the root, e.g. ``docs/examples.md``) to check instead.

Conventions of the markdown (a marker is an HTML comment on the line just above the fence):

* ``<!-- no-run -->``: the block is not run (installs, Apple-only or GPU-only commands, the
  test suite itself). An unmarked block that installs (``pip install``, ``python -m venv``) or
  runs the suite (``pytest``, ``.ci/run``) fails at once, before it runs, and so does an
  unmarked ``bash`` block that starts a server.
* ``<!-- server -->``: a ``bash`` block that starts a server and keeps running (``mlx_lm.server``,
  ``mlx-fill serve``). The test starts it in the background on a free loopback port (every
  ``8080`` in the block is replaced by that port), waits until the port accepts connections, and
  stops it (its process group) when the module's tests end. One server per block, shared by
  every block after it.
* Every other block runs to completion, with a timeout: ``bash`` blocks with ``bash -e``,
  ``python`` blocks with this interpreter, in a scratch folder, with ``MODEL`` exported as
  ``export MODEL=$(mlx-fill fixture qwen3-json)`` sets it (each block is its own process, so an
  ``export`` in one block does not reach the next) and every ``8080`` replaced by the port of the
  nearest ``<!-- server -->`` block above.
* A ``python`` block that passes ``tools`` is a tool-call example: it must print a line
  ``tool call: ...`` holding a parsed call (a name, not ``None``) and a line ``usage.fill: JSON``
  whose ``injected`` is above 0. Any block that prints a ``usage.fill:`` line must print valid
  JSON there. After a tool-call example against an ``MLX_FILL=...`` server, that server's log
  must hold the hook's start-up line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / os.environ.get("MLX_FILL_EXAMPLES_DOC", "README.md")
RUN_TIMEOUT = 600  # seconds for one block (a loaded 2-core machine; a first run fetches assets)
START_TIMEOUT = 240  # seconds until a server's port accepts connections
FENCE = re.compile(r"^```(bash|sh|shell|python)\s*$")
MARKER = re.compile(r"^<!--\s*(no-run|server)\s*-->$")
# what a block must not do from inside the test suite (install into its environment, run the
# suite again); such a block has to be marked no-run
UNRUNNABLE = re.compile(r"\bpytest\b|\bpip3? install\b|\.ci/run\b|\bpython3? -m venv\b")
SERVER = re.compile(r"\bmlx_lm[. ]server\b|\bmlx-fill serve\b")  # a command that keeps running


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str  # "bash" or "python"
    code: str
    marker: str | None  # "no-run", "server" or None
    server: int | None  # line of the nearest server block above (None: none)

    @property
    def name(self) -> str:
        return f"{DOC.name}:{self.line}-{self.lang}{'-' + self.marker if self.marker else ''}"


def blocks(path: Path) -> list[Block]:
    """The fenced bash/python blocks of ``path`` in order, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, server, i = [], None, 0
    while i < len(lines):
        fence = FENCE.match(lines[i].strip())
        if fence is None:
            if lines[i].strip().startswith("```"):  # another language: skip to its end
                i += 1
                while i < len(lines) and lines[i].strip() != "```":
                    i += 1
            i += 1
            continue
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARKER.match(above)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        lang = "python" if fence.group(1) == "python" else "bash"
        marker = mark.group(1) if mark else None
        found.append(Block(i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", marker, server))
        if marker == "server":
            server = i + 1
        i = end + 1
    return found


BLOCKS = blocks(DOC) if DOC.is_file() else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The environment every block runs in: this interpreter's scripts first on PATH, MODEL set
    to the embedded default's folder (what the README's ``export MODEL=...`` line sets)."""
    bin_dir = str(Path(sys.executable).parent)
    model = subprocess.run([os.path.join(bin_dir, "mlx-fill"), "fixture", "qwen3-json"],
                           capture_output=True, text=True, timeout=RUN_TIMEOUT, check=True)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "MODEL": model.stdout.strip(), "PYTHONUNBUFFERED": "1"}


class Servers:
    """The servers started for ``<!-- server -->`` blocks, by block line; stopped at the end."""

    def __init__(self, env: dict[str, str], folder: Path):
        self.env, self.folder = env, folder
        self.running: dict[int, tuple[subprocess.Popen, int, Path, str]] = {}

    def start(self, block: Block) -> tuple[int, Path]:
        """(port, log file) of ``block``'s server, started on first use."""
        if block.line not in self.running:
            port = _free_port()
            code = block.code.replace("8080", str(port))
            log = self.folder / f"server-{block.line}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(["bash", "-c", code], cwd=self.folder, env=self.env,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.running[block.line] = (proc, port, log, code)
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"{block.name}: the server exited ({proc.returncode}):\n{log.read_text()}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"{block.name}: port {port} not open after {START_TIMEOUT} s:\n"
                                    f"{log.read_text()}")
                    time.sleep(0.5)
        _, port, log, _ = self.running[block.line]
        return port, log

    def command(self, line: int) -> str:
        return self.running[line][3]

    def stop(self) -> None:
        for proc, *_ in self.running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(env, tmp_path_factory):
    pool = Servers(env, tmp_path_factory.mktemp("servers"))
    yield pool
    pool.stop()


def _check_output(block: Block, out: str) -> None:
    """The tool-call and ``usage.fill`` promises of the module docstring, on ``out``."""
    fills = [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("usage.fill:")]
    for text in fills:
        json.loads(text)  # a usage.fill line holds the JSON block
    if block.lang != "python" or "tools" not in block.code:
        return
    calls = [line for line in out.splitlines() if line.startswith("tool call:")]
    assert calls, f"{block.name}: no 'tool call:' line in its output:\n{out}"
    assert "None" not in calls[0] and "name" in calls[0], f"{block.name}: no parsed call: {calls[0]}"
    assert fills, f"{block.name}: no 'usage.fill:' line in its output:\n{out}"
    assert json.loads(fills[0])["injected"] > 0, f"{block.name}: nothing injected: {fills[0]}"


@pytest.mark.skipif(not BLOCKS, reason=f"{DOC} has no bash/python blocks")
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_example_runs_as_printed(block: Block, env, servers, tmp_path):
    if block.marker == "no-run":
        pytest.skip("marked <!-- no-run -->")
    assert not UNRUNNABLE.search(block.code), (
        f"{block.name} installs packages or runs the test suite: mark it <!-- no-run -->")
    assert block.marker == "server" or block.lang != "bash" or not SERVER.search(block.code), (
        f"{block.name} starts a server: mark it <!-- server --> (or <!-- no-run -->)")
    if block.marker == "server":
        servers.start(block)
        return
    code, log = block.code, None
    if block.server is not None:
        server = next(b for b in BLOCKS if b.line == block.server)
        port, log = servers.start(server)
        code = code.replace("8080", str(port))
    argv = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-e", "-c", code]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    _check_output(block, done.stdout)
    if log is not None and "tools" in block.code and "MLX_FILL=" in servers.command(block.server):
        assert "mlx-fill: MLX_FILL=" in log.read_text(), f"no hook start-up line in:\n{log.read_text()}"


def test_the_block_reader_sees_markers_and_servers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- no-run -->\n```bash\npip install x\n```\n\n```text\nnot code\n```\n"
                   "<!-- server -->\n```bash\nserve --port 8080\n```\n\n```python\nprint(1)\n```\n")
    found = blocks(doc)
    assert [(b.lang, b.marker, b.server, b.code) for b in found] == [
        ("bash", "no-run", None, "pip install x\n"), ("bash", "server", None, "serve --port 8080\n"),
        ("python", None, 10, "print(1)\n")]
