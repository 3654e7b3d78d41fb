"""The layout is the design: every package sits in a declared layer and imports only its own
package and the layers below (:data:`LAYERS`); no relative import leaves its top-level folder;
no package module imports the scripts; no core function is long, and none in ``adapters/`` and
``fill/evidence/``; the optional extras stay optional."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"fill": "mlx_fill", "spec": "mlx_fill.spec", "adapters": "mlx_fill.adapters"}
MAX_CORE_FUNCTION_LINES = 120
# the front ends and the evidence tools: functions a reader takes in at once
MAX_FUNCTION_LINES = {"adapters": 80, "fill/evidence": 80}

# The declared order, bottom first: a module may import its own package and any package of a
# lower layer, never one of its own layer or above. ``mlx_fill.limits`` and ``mlx_fill.modes``
# import nothing of mlx_fill and sit beside the core, as does the package itself (``__version__``;
# its public names resolve lazily, at first use); the scripts (``scripts/``) are above all.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("mlx_fill", "mlx_fill.core", "mlx_fill.limits", "mlx_fill.modes"),
    ("mlx_fill.strict", "mlx_fill.sources", "mlx_fill.assets"),
    ("mlx_fill.spec",),  # the speculative roster
    ("mlx_fill.session",),
    ("mlx_fill.adapters", "mlx_fill.evidence"),
    ("mlx_fill.cli", "mlx_fill.serve_cli"),  # the commands
)


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


def _package_of(dotted: str) -> tuple[int, str]:
    """(layer, package) of a dotted ``mlx_fill`` name: the longest declared package it is in
    (``mlx_fill`` itself holds only its ``__init__``: every other module must be declared)."""
    best = None
    for layer, packages in enumerate(LAYERS):
        for package in packages:
            inside = dotted == package or (package != "mlx_fill" and dotted.startswith(package + "."))
            if inside and (best is None or len(package) > len(best[1])):
                best = (layer, package)
    if best is None:
        raise AssertionError(f"{dotted} is in no declared layer")
    return best


def _module_name(path: Path, package: str, is_init: bool) -> str:
    return package if is_init else f"{package}.{path.stem}"


def _upward(path: Path, package: str, is_init: bool) -> list[str]:
    """Imports of ``path`` that reach its own layer (another package) or a layer above."""
    layer, own = _package_of(_module_name(path, package, is_init))
    bad = []
    for line, target, _ in _imports(path, package):
        t_layer, t_package = _package_of(target)
        if t_package != own and t_layer >= layer:
            bad.append(f"{line}: {own} (layer {layer}) imports {target} (layer {t_layer})")
    return bad


def _scripts_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and not node.level
                 and node.module else [])
        found += [f"{node.lineno}: imports {n}" for n in names if n.split(".")[0] == "scripts"]
    return found


def test_every_package_imports_only_its_own_and_lower_layers():
    bad = [f"{path.relative_to(ROOT)}:{v}" for path, package, is_init in _modules()
           for v in _upward(path, package, is_init)]
    assert not bad, bad


def test_no_package_module_imports_the_scripts():
    bad = [f"{path.relative_to(ROOT)}:{v}" for path, _, _ in _modules()
           for v in _scripts_imports(path)]
    assert not bad, bad


def test_the_layer_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from mlx_fill.session import build_session\nfrom mlx_fill.sources import echo\n"
                     "from mlx_fill.core.plan import DispatchPlan\nfrom .rows import RowTable\n"
                     "import scripts.bench\n")
    assert _upward(probe, "mlx_fill.strict", False) == [
        "1: mlx_fill.strict (layer 1) imports mlx_fill.session (layer 3)",
        "2: mlx_fill.strict (layer 1) imports mlx_fill.sources (layer 1)"]
    assert _upward(probe, "mlx_fill.evidence", False) == []
    assert _scripts_imports(probe) == ["5: imports scripts.bench"]


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


def _long_functions(folder: str, limit: int) -> list[str]:
    long = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    return long


def test_no_core_function_is_longer_than_the_limit():
    long = _long_functions("fill/core", MAX_CORE_FUNCTION_LINES)
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


def test_no_front_end_or_evidence_function_is_longer_than_the_limit():
    long = [f for folder, limit in MAX_FUNCTION_LINES.items() for f in _long_functions(folder, limit)]
    assert not long, long


def test_only_the_checkout_module_reads_the_checkout():
    """Package code finds the clone's ``fixtures/`` through :mod:`mlx_fill.assets.checkout`
    alone; ``REPO_ROOT`` belongs to the scripts and tests."""
    reads = [str(path.relative_to(ROOT)) for path, _, _ in _modules()
             if "parents[2]" in path.read_text() or "REPO_ROOT" in path.read_text()]
    assert reads == ["fill/assets/checkout.py"], reads
