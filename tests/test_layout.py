"""The layout is the design: the core imports nothing of mlx_fill outside ``fill/core/``, no
relative import leaves its top-level folder, no core function is long, and the optional
extras stay optional."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"fill": "mlx_fill", "spec": "mlx_fill.spec", "adapters": "mlx_fill.adapters"}
MAX_CORE_FUNCTION_LINES = 120


def _modules() -> list[tuple[Path, str, bool]]:
    """(file, its package's dotted name, is a package ``__init__``) for every product module."""
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            dotted = ".".join((package, *parts[:-1]))
            out.append((path, dotted, parts[-1] == "__init__"))
    return out


def _folder_of(dotted: str) -> str:
    """The top-level folder a dotted ``mlx_fill`` name lives in on disk."""
    for folder, package in sorted(FOLDERS.items(), key=lambda kv: -len(kv[1])):
        if dotted == package or dotted.startswith(package + "."):
            return folder
    raise AssertionError(dotted)


def _imports(path: Path, package: str) -> list[tuple[int, str, bool]]:
    """(line, absolute dotted target, was relative) of every import of ``mlx_fill``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, False) for a in node.names
                      if a.name.split(".")[0] == "mlx_fill"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                found.append((node.lineno, target, True))
            elif node.module and node.module.split(".")[0] == "mlx_fill":
                found.append((node.lineno, node.module, False))
    return found


def _outside_core(path: Path, package: str) -> list[str]:
    return [f"{line}: imports {target}" for line, target, _ in _imports(path, package)
            if not (target == "mlx_fill.core" or target.startswith("mlx_fill.core."))]


def _crossing(path: Path, package: str, folder: str) -> list[str]:
    return [f"{line}: relative import of {target}" for line, target, relative
            in _imports(path, package) if relative and _folder_of(target) != folder]


def test_the_core_imports_nothing_of_mlx_fill_outside_the_core():
    bad = [f"{path.relative_to(ROOT)}:{v}" for path, package, _ in _modules()
           if package.startswith("mlx_fill.core") for v in _outside_core(path, package)]
    assert not bad, bad


def test_no_relative_import_crosses_a_top_level_folder():
    bad = [f"{path.relative_to(ROOT)}:{v}" for path, package, _ in _modules()
           for v in _crossing(path, package, path.relative_to(ROOT).parts[0])]
    assert not bad, bad


def test_the_layout_checks_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..spec.roster import NAMES\nfrom .loop import generate_step\n"
                     "import mlx_fill.strict.rows\nfrom mlx_fill.core import plan\n")
    assert _outside_core(probe, "mlx_fill.core") == [
        "1: imports mlx_fill.spec.roster", "3: imports mlx_fill.strict.rows"]
    assert _crossing(probe, "mlx_fill.core", "fill") == ["1: relative import of mlx_fill.spec.roster"]
    assert _crossing(probe, "mlx_fill.adapters", "adapters") == [
        "1: relative import of mlx_fill.spec.roster"]
    assert _crossing(probe, "mlx_fill.spec", "spec") == []


def test_no_core_function_is_longer_than_the_limit():
    long = []
    for path in sorted((ROOT / "fill" / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CORE_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def test_the_extras_stay_optional():
    """``import mlx_fill``, the session, the loop drop-in and the in-server hook import neither
    the ``serve`` extra (fastapi, uvicorn) nor the ``evidence`` extra (matplotlib, openai)."""
    code = ("import sys, mlx_fill, mlx_fill.session, mlx_fill.adapters.mlx_lm, "
            "mlx_fill.adapters.server_patch, mlx_fill.adapters.autoload, mlx_fill.evidence.study, "
            "mlx_fill.evidence.replay, mlx_fill.evidence.report;"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'matplotlib', 'openai') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    assert out.strip() == "[]"


def test_the_public_api_is_listed_once_and_resolves():
    """``mlx_fill.__all__`` is the public face; every name in it resolves (lazily)."""
    import mlx_fill

    assert len(set(mlx_fill.__all__)) == len(mlx_fill.__all__)
    for name in mlx_fill.__all__:
        assert getattr(mlx_fill, name) is not None, name
    assert sorted(dir(mlx_fill)) == sorted(mlx_fill.__all__)
