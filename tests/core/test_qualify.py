"""`mlx-fill qualify`: the CLI writes a usable plan; plan derivation follows the checks."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ConcatenateKVCache

from mlx_lm.generate import generate_step as stock_generate_step

from mlx_fill import cli
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan, PlanKey, load_plan
from mlx_fill.core.primitive import Unsupported, check_supported
from mlx_fill.core.proposal import FillSession
from mlx_fill.core.qualify import Check, derive_plan, qualify
from mlx_fill.assets.random_models import build, config_for, save

from cli_lines import one_error_line

KEY = PlanKey("cuda", "sm_90 NVIDIA H200", "0.32.4", "0.32.2", "none", "", "", "bfloat16", "none",
              "qwen3 layers=4")
CPU_KEY = replace(KEY, backend="cpu", device="x86_64", blas="libblas", blas_version="3.10.0")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model, config = build(config_for("qwen3_5"), dtype=mx.bfloat16)
    return save(model, config, tmp_path_factory.mktemp("tiny") / "qwen35")


def test_qualify_quick_cli_writes_a_plan(tiny_dir, tmp_path, monkeypatch, capsys, steady_cost):
    """In-process, so that ``steady_cost`` reaches the tiny model's cost curve."""
    out = tmp_path / "plan.json"
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path / "cache"))
    assert cli.main(["qualify", "--model", str(tiny_dir), "--quick", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "max_chunk=" in stdout and "c(16)=" in stdout
    assert "round overhead=" in stdout
    plan = json.loads(out.read_text())
    assert plan["qualified"] and plan["max_chunk"] >= 1
    assert isinstance(plan["round_overhead"], float) and plan["round_overhead"] >= 0.0
    assert set(plan["cost"]) == {"1", "2", "3", "4", "8", "16"}
    # a hybrid model (state caches and KV caches): c(M) measured at a second, longer KV length
    assert plan["long_kv"] == 4096 and set(plan["long_cost"]) == set(plan["cost"])
    assert "at KV 512:" in stdout and "at KV 4096:" in stdout
    assert plan["key"]["dtype"] == "bfloat16" and plan["key"]["quant"] == "none"
    # The plan is picked up through MLX_FILL_PLAN for a model of the same configuration.
    os.environ["MLX_FILL_PLAN"] = str(out)
    try:
        from mlx_lm.utils import load_model
        model, _ = load_model(tiny_dir)
        loaded = load_plan(model)
    finally:
        del os.environ["MLX_FILL_PLAN"]
    assert loaded.qualified and loaded.max_chunk == plan["max_chunk"]
    assert loaded.round_overhead == plan["round_overhead"]


def test_unqualified_configuration_falls_back_to_single_token_chunks(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path))
    model, _ = build(config_for("qwen3"), dtype=mx.float16, bits=8, group_size=32)
    plan = load_plan(model)
    assert not plan.qualified and plan.max_chunk == 1 and plan.chunks(5, 3) == [1, 1, 1]


def test_unsupported_cache_is_named():
    with pytest.raises(Unsupported) as e:
        check_supported([ConcatenateKVCache()])
    assert e.value.reason == "cache_type"


def checks(spec):
    """spec: {(size, kv, start): exact}"""
    return [Check(m, kv, start, ok) for (m, kv, start), ok in spec.items()]


def test_derive_plan_all_exact():
    spec = {(m, kv, s): True for m in (2, 4, 8) for kv in (0, 256)
            for s in {kv, max(0, kv - m // 2)}}
    plan = derive_plan(KEY, checks(spec), (1, 2, 4, 8))
    assert plan.max_chunk == 8 and plan.kv_boundaries == ()


def test_derive_plan_turns_crossing_failures_into_boundaries():
    spec = {(m, kv, s): True for m in (2, 4, 8) for kv in (0, 256)
            for s in {kv, max(0, kv - m // 2)}}
    spec[(4, 256, 254)] = False
    spec[(8, 256, 252)] = False
    plan = derive_plan(KEY, checks(spec), (1, 2, 4, 8))
    assert plan.max_chunk == 8 and plan.kv_boundaries == (256,)
    assert plan.chunks(252, 8) == [4, 4]


def test_derive_plan_stops_at_first_inexact_size():
    spec = {(m, kv, s): True for m in (2, 4, 8) for kv in (0, 256)
            for s in {kv, max(0, kv - m // 2)}}
    spec[(4, 0, 0)] = False  # not a crossing: M=4 itself is inexact
    plan = derive_plan(KEY, checks(spec), (1, 2, 4, 8))
    assert plan.max_chunk == 2


def test_on_cpu_a_crossing_failure_makes_the_size_inexact():
    spec = {(m, kv, s): True for m in (2, 4, 8) for kv in (0, 256)
            for s in {kv, max(0, kv - m // 2)}}
    spec[(4, 256, 254)] = False
    plan = derive_plan(CPU_KEY, checks(spec), (1, 2, 4, 8))
    assert plan.max_chunk == 2 and plan.kv_boundaries == ()


def unknown_cache_model():
    """A tiny qwen3 whose layers use a cache type fill does not know (mlx-lm runs it)."""
    model, _ = build(config_for("qwen3"), seed=4)
    model.make_cache = lambda: [ConcatenateKVCache() for _ in model.layers]
    return model


def test_qualify_cli_writes_no_plan_from_timing_noise(tiny_dir, tmp_path, monkeypatch, capsys):
    """A cost curve timed below one row in every try: one line naming what was measured, exit
    2, no plan written."""
    from mlx_fill.core import qualify as measure
    monkeypatch.setattr(measure, "measure_cost", lambda *a, **k: {1: 1.0, 2: 0.5, 4: 0.7})
    out = tmp_path / "plan.json"
    line = one_error_line(capsys, ["qualify", "--model", str(tiny_dir), "--quick", "--out", str(out)],
                          "c(2)=0.50, c(4)=0.70", "qualify again on a quieter machine")
    assert line.startswith("mlx-fill qualify: the cost curve measured an M-row forward cheaper")
    assert not out.exists()


def test_qualify_never_raises_on_a_cache_it_does_not_know(capsys):
    plan, checks = qualify(unknown_cache_model(), quick=True, bar=False)
    assert plan.max_chunk == 1 and plan.qualified and checks == []
    assert plan.reason == "cache_type: ConcatenateKVCache"
    assert plan.key is not None and DispatchPlan.from_json(plan.to_json()) == plan
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cache_type: ConcatenateKVCache" in err and "max_chunk=1" in err


def test_a_server_keeps_serving_a_model_qualify_cannot_measure(capsys):
    """Served without fill, the refusal counted; the tokens are stock decoding's."""
    model = unknown_cache_model()
    prompt = mx.array([5, 9, 2, 7, 1, 3])
    ref = [t for t, _ in stock_generate_step(prompt, model, max_tokens=12)]
    session = FillSession([], prompt_ids=prompt.tolist(), plan=qualify(model, quick=True,
                                                                       bar=False)[0])
    out = [t for t, _ in generate_step(prompt, model, fill=session, max_tokens=12)]
    assert out == ref and session.stats.refusals == {"cache_type": 1}


def test_a_spent_budget_leaves_sizes_pending_and_a_later_run_measures_them(steady_cost):
    model, _ = build(config_for("qwen3"), seed=6)
    first, checks = qualify(model, quick=True, bar=False, budget_s=0)
    assert checks == [] and first.max_chunk == 1 and first.pending == (2, 3, 4, 8, 16)
    assert not first.complete and set(first.cost) == {1, 2, 3, 4, 8, 16}
    assert DispatchPlan.from_json(first.to_json()).pending == first.pending
    done, checks = qualify(model, quick=True, bar=False, prior=first)
    assert done.complete and set(done.cost) == set(first.cost) and done.max_chunk == 16
    assert {c.size for c in checks} == {2, 3, 4, 8, 16}


def test_derive_plan_continues_from_an_earlier_run():
    spec = {(m, kv, s): True for m in (8, 16) for kv in (0, 256)
            for s in {kv, max(0, kv - m // 2)}}
    plan = derive_plan(KEY, checks(spec), (8, 16), floor=4, boundaries=(512,))
    assert plan.max_chunk == 16 and plan.kv_boundaries == (512,)
    assert derive_plan(KEY, [], (8, 16), floor=4).max_chunk == 4  # nothing measured: floor


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text", "llama_swa"])
def test_sliding_window_models_qualify_past_the_window(arch, steady_cost):
    """The acceptance of issue 31: a window shorter than the prompt, chunks > 1 exact,
    including the ring checks (chunks crossing the ring's end, reached by decoding)."""
    model, _ = build(config_for(arch, sliding_window=16))
    plan, checks = qualify(model, quick=True, bar=False)
    assert plan.max_chunk > 1 and not plan.reason
    rings = [c for c in checks if c.ring]
    assert {c.kv for c in rings} == {16, 32} and all(c.exact for c in rings)
    assert not plan.long_cost and not plan.kv_dependent  # a ring's cost is not a long cache's
