"""The wheel carries the one `mlx_fill` namespace and the activation hook at the purelib root."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_layout_and_import(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    wheel = next(tmp_path.glob("mlx_fill-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("mlx_fill/__init__.py", "mlx_fill/core/primitive.py",
                   "mlx_fill/core/acceptance.py", "mlx_fill/spec/roster.py",
                   "mlx_fill/adapters/server/serve.py", "mlx_fill/strict/grammars/hermes_json.lark",
                   "mlx_fill/core/plans/cpu-x86_64-float32-none-qwen3-json.json",
                   "mlx_fill/assets/manifest/qwen3.json", "mlx_fill/evidence/study.py",
                   "mlx_fill.pth", "mlx_fill.start"):
        assert module in names, module
    assert not any(n.startswith(("fill/", "spec/", "adapters/", "tests/")) for n in names)
    for scripts_only in ("mlx_fill/assets/random_models.py", "mlx_fill/spec/mtp.py",
                         "mlx_fill/spec/mtp_head.py", "mlx_fill/spec/mtp_tap.py"):
        assert scripts_only not in names, scripts_only
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(target))
    code = ("import mlx_fill, mlx_fill.core.acceptance, mlx_fill.adapters.mlx_lm, mlx_fill.core.loop;"
            "print(mlx_fill.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip().startswith(str(target))
