"""MoE and quantized weights: appends and rewinds are bit-identical to serial decoding, fill
on/off decode the same tokens, and qualify measures their exact chunk sizes (float32 on the
CPU: MLX's CPU ``GatherMM`` serves float32 only; quantized experts run ``gather_qmm``)."""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_fill.assets.random_models import build, config_for
from mlx_fill.core.exactness import arrays_equal, caches_equal
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.primitive import append, checkpoint, rewind
from mlx_fill.core.proposal import FillSession, Proposal
from mlx_fill.core.qualify import check_exactness, derive_plan, qualify

# (id, arch, bits): every MoE family mlx-lm ships that users run, dense and MoE quantized.
MODELS = [
    ("qwen3_moe", "qwen3_moe", None),
    ("glm4_moe", "glm4_moe", None),
    ("gpt_oss", "gpt_oss", None),
    ("qwen3_5_moe", "qwen3_5_moe", None),
    ("qwen3-q4", "qwen3", 4),
    ("qwen3-q8", "qwen3", 8),
    ("qwen3_moe-q4", "qwen3_moe", 4),
    ("qwen3_moe-q8", "qwen3_moe", 8),
    ("gpt_oss-q4", "gpt_oss", 4),
    ("qwen3_5_moe-q4", "qwen3_5_moe", 4),
]
IDS = [m[0] for m in MODELS]


@functools.lru_cache(maxsize=None)
def model_of(name: str):
    _, arch, bits = next(m for m in MODELS if m[0] == name)
    model, _ = build(config_for(arch, sliding_window=16), bits=bits, group_size=32)
    return model


def ids_of(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(512) for _ in range(n)]


def prefilled(model, prompt):
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def serial(model, cache, ids):
    rows = [model(mx.array([[t]]), cache=cache)[0, -1:] for t in ids]
    mx.eval(rows)
    return rows


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("max_chunk", [4, 16])
def test_append_and_rewind_equal_serial(name, max_chunk):
    model = model_of(name)
    plan = DispatchPlan(key=None, max_chunk=max_chunk, qualified=True)
    prompt, ids = ids_of(21, 1), ids_of(11, 2)
    ref, got = prefilled(model, prompt), prefilled(model, prompt)
    ref_rows = serial(model, ref, ids)
    cp = checkpoint(model, got, plan)
    rows = append(model, got, ids, plan=plan, logits="all", record=cp)
    assert caches_equal(ref, got)
    assert all(arrays_equal(rows[i:i + 1], ref_rows[i]) for i in range(len(ids)))
    rewind(cp, 4)
    kept = prefilled(model, prompt)
    serial(model, kept, ids[:4])
    assert caches_equal(kept, got)
    nxt = ids_of(3, 3)
    assert all(arrays_equal(a, b) for a, b in zip(serial(model, kept, nxt),
                                                   serial(model, got, nxt)))


class Oracle:
    name = "oracle"

    def __init__(self, reference, corrupt):
        self.ref, self.corrupt, self.rng = reference, corrupt, random.Random(4)

    def propose(self, view):
        i = len(view.emitted)
        span = list(self.ref[i:i + 6])
        if i % 3 or not span:
            return None
        if self.rng.random() < self.corrupt:
            span[-1] = (span[-1] + 1) % 512
        return Proposal(tuple(span), "verify", self.name)

    def feedback(self, proposal, accepted):
        pass


@pytest.mark.parametrize("name", IDS)
def test_fill_on_and_off_are_token_identical(name):
    model = model_of(name)
    prompt = ids_of(12, 5)
    ref = [t for t, _ in stock_generate_step(mx.array(prompt), model, max_tokens=24)]
    session = FillSession([Oracle(ref, corrupt=0.5)], prompt_ids=prompt,
                          plan=DispatchPlan(key=None, max_chunk=8, qualified=True))
    out = [t for t, _ in generate_step(mx.array(prompt), model, fill=session, max_tokens=24)]
    assert out == ref and session.stats.refusals == {} and session.stats.forwards < 24


@pytest.mark.parametrize("name", IDS)
def test_qualify_checks_find_chunks_exact(name):
    """qualify's own checks (chunks starting at and crossing each KV length, serial arm and
    chunked arm bit for bit), at a few sizes and lengths: exact on the CPU backend."""
    model = model_of(name)
    checks, pending = check_exactness(model, (1, 2, 4, 8), (0, 33), 512,
                                      stop_after_failure=True)
    assert pending == () and len(checks) == 3 * 3 and all(c.exact for c in checks)
    assert derive_plan(None, checks, (1, 2, 4, 8)).max_chunk == 8


def test_quick_qualify_of_a_quantized_moe(steady_cost):
    plan, checks = qualify(model_of("qwen3_moe-q4"), quick=True, bar=False)
    assert plan.key.quant == "q4g32-affine" and plan.max_chunk > 1 and not plan.reason
    assert checks and plan.complete


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in IDS if n != "qwen3_moe-q4"])
def test_quick_qualify(name, steady_cost):
    plan, _ = qualify(model_of(name), quick=True, bar=False)
    assert plan.max_chunk > 1 and not plan.reason and plan.complete


def test_chunked_attention_cache_is_served_without_fill():
    """llama4's ChunkedKVCache: refused (``chunked_kv``), qualify writes a max_chunk=1 plan
    with the reason, and the request decodes exactly as stock mlx-lm."""
    model, _ = build(config_for("llama4", sliding_window=16))
    plan, _ = qualify(model, quick=True, bar=False)
    assert plan.max_chunk == 1 and plan.reason.startswith("chunked_kv")
    prompt = ids_of(20, 6)
    ref = [t for t, _ in stock_generate_step(mx.array(prompt), model, max_tokens=24)]
    session = FillSession([Oracle(ref, corrupt=0.0)], prompt_ids=prompt, plan=plan)
    out = [t for t, _ in generate_step(mx.array(prompt), model, fill=session, max_tokens=24)]
    assert out == ref and session.stats.refusals == {"chunked_kv": 1}


def test_cache_list_of_a_mamba_hybrid_is_measured_inexact_and_served_serially():
    """falcon_h1 (every layer a CacheList of Mamba-2 state and attention): a multi-token
    forward runs the chunked SSD scan, which rounds differently from one-token steps; qualify's
    checks find it, the plan keeps max_chunk=1, and verify rounds stay token-identical."""
    model, _ = build(config_for("falcon_h1"))
    checks, _ = check_exactness(model, (1, 2, 4), (0, 33), 512, stop_after_failure=True)
    assert not all(c.exact for c in checks if c.size == 2)
    assert derive_plan(None, checks, (1, 2, 4)).max_chunk == 1
    prompt = ids_of(12, 7)
    ref = [t for t, _ in stock_generate_step(mx.array(prompt), model, max_tokens=16)]
    session = FillSession([Oracle(ref, corrupt=0.5)], prompt_ids=prompt,
                          plan=DispatchPlan(key=None, max_chunk=1, qualified=True))
    out = [t for t, _ in generate_step(mx.array(prompt), model, fill=session, max_tokens=16)]
    assert out == ref and session.stats.refusals == {}
