"""The one seam to mlx-lm internals: it matches the installed mlx-lm (0.32.2), it names what is
missing when mlx-lm moves, both stop-matcher layouts work, a batched-lane mismatch turns fill
off in that lane only (one warning, the server still patched), and no other module reads a
private field of ``GenerationBatch`` / ``BatchGenerator`` / ``BatchKVCache``."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import mlx_lm
import mlx_lm.server as S
from mlx_lm.models import cache as C

from mlx_fill.adapters import mlx_lm_seam as seam

G = importlib.import_module("mlx_lm.generate")  # the module (the package re-exports a function)
ROOT = Path(__file__).resolve().parents[2]
# private fields of mlx-lm's batch objects the seam names (a read elsewhere is a second seam)
PRIVATE = {"_next_tokens", "_next_logprobs", "_num_tokens", "_matchers", "_matcher_states",
           "_token_context", "_idx", "_buffer", "_size", "_next", "_trie"}


def test_the_installed_mlx_lm_matches_the_seam():
    assert mlx_lm.__version__.startswith("0.32.")
    assert seam.server_mismatch(S) is None
    assert seam.batch_mismatch(G, C) is None


def test_a_moved_field_is_named():
    class Batch(G.GenerationBatch):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            del self._num_tokens

    moved = types.SimpleNamespace(**{n: getattr(G, n) for n in ("BatchGenerator",)},
                                  GenerationBatch=Batch)
    assert seam.batch_mismatch(moved, C) == "GenerationBatch._num_tokens missing"

    class Server:
        class ResponseGenerator:
            def _serve_single(self, req):
                pass
    assert "APIHandler.handle_completion is missing" in seam.server_mismatch(Server)


class _MainMatcher:
    """mlx-lm main's ``StopSequenceMatcher``: a trie, state kept by the batch."""

    def __init__(self, stop):
        self._trie = {stop: {"__match__": True}}

    def make_state(self):
        return self._trie

    @staticmethod
    def match(state, trie, x):
        node = state.get(x, trie)
        return node, node.get("__match__") is not None


def test_both_stop_matcher_layouts_advance():
    old = types.SimpleNamespace(_matchers=[G.StopSequences([[5]]).matcher()])
    assert not seam.stops(old, 0, 4) and seam.stops(old, 0, 5)
    main = types.SimpleNamespace(stop_matchers=[_MainMatcher(5)])
    main._matcher_states = [m.make_state() for m in main.stop_matchers]
    assert not seam.stops(main, 0, 4) and seam.stops(main, 0, 5)


def test_a_batch_lane_mismatch_warns_once_and_leaves_that_lane_stock():
    code = ("import sys, json, warnings; warnings.simplefilter('always');"
            "import mlx_lm.server as s; G = sys.modules['mlx_lm.generate'];"
            "G.GenerationBatch.empty = None;"  # an mlx-lm whose batch the seam cannot read
            "from mlx_fill.adapters.server_patch import apply;"
            "print(json.dumps([apply(s, 'strict'), hasattr(s.ResponseGenerator._is_batchable,"
            " '__mlx_fill__'), getattr(G.GenerationBatch.next, '__mlx_fill__', False)]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_FILL")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
    assert json.loads(r.stdout) == [True, True, False], r.stderr
    assert r.stderr.count("batched lane runs without fill") == 1, r.stderr


def _private_reads(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")]


# the core's one reader of a private cache field (``RotatingKVCache._idx``, where a rotating
# layer's next write goes), which the core cannot take from the adapters' seam
CORE_RING = ROOT / "fill" / "core" / "ring.py"


def test_no_private_batch_field_is_read_outside_the_seam():
    found = [r for folder in ("fill", "spec", "adapters") for path in (ROOT / folder).rglob("*.py")
             if path.name != "mlx_lm_seam.py" for r in _private_reads(path)
             if not (path == CORE_RING and r.endswith(" ._idx"))]
    assert not found, found
    assert _private_reads(ROOT / "adapters" / "mlx_lm_seam.py")  # the check can fail
