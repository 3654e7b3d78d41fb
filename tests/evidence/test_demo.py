"""``mlx-fill demo`` (the README's main job) runs on the embedded default and reports identity,
on a fresh machine: an empty user cache and no pre-filled assets, so its first run fetches the
qwen3 tokenizer and template itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlx_fill.assets.fixtures import fixture_emits_calls


def test_demo_in_a_fresh_cache_fetches_its_assets_and_runs_identical(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLX_FILL_ASSETS"}
    env["MLX_FILL_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.run([str(Path(sys.executable).parent / "mlx-fill"), "demo"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("mlx-fill: fetching the qwen3 tokenizer and chat template") == 1
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "token ids identical (fill off vs strict): True" in out
    assert "all turns identical: True" in out
    if fixture_emits_calls("qwen3-json", share=0.5):
        # a fixture that calls tools gets its call scaffold filled (verified) on the default exchange
        assert "tool call: bash(" in out and "'strict:scaffold:bash'" in out, out


def test_demo_predict_runs_one_edit_identical_with_the_counts():
    """``--predict`` on the embedded fixture (the README's demo uses ``qwen25-coder-0.5b``)."""
    proc = subprocess.run([str(Path(sys.executable).parent / "mlx-fill"), "demo", "--predict",
                           "--fixture", "qwen3-json", "--max-tokens", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "--max-tokens 3 raised to twice the prediction so the edit fits" in proc.stdout
    assert "token ids identical (fill off vs prediction): True" in proc.stdout
    assert "prediction: accepted " in proc.stdout and "(usage.completion_tokens_details)" in proc.stdout
    assert "decoding wall (prefill shared): " in proc.stdout
