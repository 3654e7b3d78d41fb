"""``mlx-fill demo`` (the README's main job) runs on the embedded default and reports identity."""

from __future__ import annotations

from mlx_fill.cli import main
from mlx_fill.fixtures import fixture_emits_calls


def test_demo_runs_identical_and_fills_when_the_fixture_calls_tools(capsys):
    assert main(["demo", "--turns", "2", "--max-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert "token ids identical (fill off vs strict): True" in out
    assert "all turns identical: True" in out
    if fixture_emits_calls("qwen3-json", share=0.5):
        # a fixture that calls tools gets its call scaffold filled (verified) on the default exchange
        assert "tool call: bash(" in out and "'strict:scaffold:bash'" in out, out
