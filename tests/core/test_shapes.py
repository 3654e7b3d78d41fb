"""Append shape as a plan dimension: ``native`` and ``batched-m1`` chunks are bit-identical to
serial decoding where the plan says so, qualify records its choice per size, and appends
honour it."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_models import ids_of, prefilled

from mlx_fill.assets.random_models import build, config_for
from mlx_fill.core import shapes
from mlx_fill.core.exactness import arrays_equal, caches_equal
from mlx_fill.core.plan import DispatchPlan, PlanKey, shipped_dir
from mlx_fill.core.primitive import append
from mlx_fill.core.qualify import Check, check_exactness, derive_plan, qualify

from conftest import tiny_model

KEY = PlanKey("metal", "applegpu_g16s", "0.32.2", "0.32.2", "none", "", "", "bfloat16", "q4",
              "qwen3 layers=4")


@pytest.fixture
def batched_rows(monkeypatch):
    """Counts the projections that ran in the batched one-row form."""
    calls = []
    real = shapes._rows

    def counting(x):
        calls.append(x.shape)
        return real(x)

    monkeypatch.setattr(shapes, "_rows", counting)
    return calls


@pytest.mark.parametrize("arch,bits", [("qwen3", None), ("qwen3", 4), ("qwen3", 8),
                                       ("qwen3_5", None), ("qwen3_moe", 4)])
@pytest.mark.parametrize("shape", shapes.SHAPES)
def test_both_shapes_are_bit_exact_on_this_backend(arch, bits, shape, batched_rows):
    model = tiny_model(arch, mx.float32, bits)
    prompt, ids = ids_of(19, 1), ids_of(12, 2)
    ref, got = prefilled(model, prompt), prefilled(model, prompt)
    ref_rows = [model(mx.array([[t]]), cache=ref)[0, -1:] for t in ids]
    plan = DispatchPlan(key=None, max_chunk=4, qualified=True, shapes={4: shape})
    rows = append(model, got, ids, plan=plan, logits="all")
    assert caches_equal(ref, got)
    assert all(arrays_equal(rows[i:i + 1], ref_rows[i]) for i in range(len(ids)))
    assert bool(batched_rows) == (shape == "batched-m1")
    assert all(s[:-1] == (1, 4) for s in batched_rows)  # [1, M, K] inputs fed as [M, 1, K]


def test_the_batched_form_is_per_thread(batched_rows):
    """A serial step on another thread while this one appends batched-m1 runs natively."""
    model = tiny_model("qwen3")
    seen = []
    with shapes.append_shape(model, "batched-m1"):
        t = threading.Thread(target=lambda: seen.append(
            model(mx.array([ids_of(5, 3)]), cache=make_prompt_cache(model)).shape))
        t.start()
        t.join(timeout=120)
    assert seen == [(1, 5, 512)] and batched_rows == []


def checks(spec):
    """spec: {(size, kv, start, shape): exact}"""
    return [Check(m, kv, s, ok, False, shape) for (m, kv, s, shape), ok in spec.items()]


def both(sizes, kvs=(0, 256)):
    return {(m, kv, s, shape): True for m in sizes for kv in kvs
            for s in {kv, max(0, kv - m // 2)} for shape in shapes.SHAPES}


def test_qualify_keeps_the_exact_shape_per_size():
    spec = both((2, 4, 8))
    for kv, s in ((0, 0), (256, 256), (256, 254)):
        spec[(4, kv, s, "native")] = False  # the multirow matvec differs from one row
    spec[(8, 0, 0, "native")] = False
    spec[(8, 0, 0, "batched-m1")] = False  # M = 8 crosses to the prefill kernel in both
    plan = derive_plan(KEY, checks(spec), (1, 2, 4, 8))
    assert plan.max_chunk == 4 and plan.shapes == {2: "native", 4: "batched-m1"}
    assert plan.shape_for(3) == "batched-m1" and plan.shape_for(1) == "native"


def test_qualify_keeps_the_cheaper_exact_shape():
    cost = {"native": {2: 1.4, 4: 2.5}, "batched-m1": {2: 1.6, 4: 2.1}}
    plan = derive_plan(KEY, checks(both((2, 4))), (1, 2, 4), cost=cost)
    assert plan.shapes == {2: "native", 4: "batched-m1"}
    assert derive_plan(KEY, checks(both((2, 4))), (1, 2, 4)).shapes == {2: "native", 4: "native"}


def test_the_shape_is_recorded_and_plans_without_it_load():
    plan = DispatchPlan(key=KEY, max_chunk=4, qualified=True, shapes={2: "native", 4: "batched-m1"})
    back = DispatchPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back == plan and back.shape_for(4) == "batched-m1"
    for path in shipped_dir().glob("*.json"):
        shipped = DispatchPlan.from_json(json.loads(path.read_text()))
        assert shipped.qualified and shipped.shapes == {} and shipped.shape_for(4) == "native"


def test_a_plans_shape_is_honoured(batched_rows):
    model = tiny_model("qwen3")
    plan = DispatchPlan(key=None, max_chunk=4, qualified=True, shapes={4: "native"})
    append(model, prefilled(model, ids_of(9, 4)), ids_of(8, 5), plan=plan)
    assert batched_rows == []
    append(model, prefilled(model, ids_of(9, 4)), ids_of(8, 5),
           plan=replace(plan, shapes={4: "batched-m1"}))
    assert batched_rows and {s[-2] for s in batched_rows} == {4}


def test_qualify_checks_the_other_shape_only_where_it_could_win():
    model = tiny_model("qwen3")
    cheaper = {"native": {2: 1.5, 4: 2.0}, "batched-m1": {2: 1.2, 4: 2.5}}
    found, _ = check_exactness(model, (1, 2, 4), (0, 33), 512, shapes=shapes.SHAPES,
                               costs=cheaper)
    assert {(c.size, c.shape) for c in found} == {(2, "native"), (2, "batched-m1"),
                                                   (4, "native")}
    assert all(c.exact for c in found)
    found, _ = check_exactness(model, (1, 2), (0,), 512, shapes=shapes.SHAPES)
    assert {c.shape for c in found} == set(shapes.SHAPES)  # no costs: every shape


def test_qualify_records_a_shape_per_size(steady_cost):
    model, _ = build(config_for("qwen3"), seed=8)
    plan, found = qualify(model, quick=True, bar=False)
    assert {c.shape for c in found} >= {"native"}
    assert set(plan.shapes) == {2, 3, 4, 8, 16} and plan.max_chunk == 16
    assert set(plan.shapes.values()) <= set(shapes.SHAPES)
