"""The append-and-rewind primitive is bit-identical to serial decoding, for every cache type."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlx_fill.core.exactness import arrays_equal, cache_content, caches_equal
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.primitive import Unsupported, append, checkpoint, rewind

from mlx_fill.assets.random_models import build, config_for

from conftest import tiny_model

PLAN = DispatchPlan(key=None, mode="exact", max_chunk=16, kv_boundaries=(256,), qualified=True)


def ids_of(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(512) for _ in range(n)]


def fresh_cache(model, prefix: list[int], quantized_kv: bool = False):
    """A cache holding ``prefix``, built by one prompt forward (identical in every arm)."""
    cache = make_prompt_cache(model)
    if quantized_kv:
        cache = [QuantizedKVCache(group_size=32, bits=4) if isinstance(c, KVCache) else c
                 for c in cache]
    if prefix:
        model(mx.array(prefix)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def serial(model, cache, ids: list[int]) -> list[mx.array]:
    """One-token-at-a-time decode: what the primitive must reproduce. Returns each step's logits."""
    rows = []
    for t in ids:
        rows.append(model(mx.array([[t]]), cache=cache)[0, -1:])
    mx.eval(rows)
    return rows


@pytest.mark.parametrize("prefix_len,n", [(0, 5), (1, 9), (7, 16), (23, 33), (250, 12)])
def test_append_matches_serial(any_model, prefix_len, n):
    prefix, ids = ids_of(prefix_len, 1), ids_of(n, 2)
    ref = fresh_cache(any_model, prefix)
    got = fresh_cache(any_model, prefix)
    ref_rows = serial(any_model, ref, ids)
    last = append(any_model, got, ids, plan=PLAN, logits="last")
    assert caches_equal(ref, got)
    assert arrays_equal(last, ref_rows[-1])
    got_all = fresh_cache(any_model, prefix)
    rows = append(any_model, got_all, ids, plan=PLAN, logits="all")
    assert rows.shape[0] == n
    assert all(arrays_equal(rows[i:i + 1], ref_rows[i]) for i in range(n))


def test_append_matches_serial_with_quantized_kv_cache():
    model, _ = build(dict(config_for("qwen3"), head_dim=32))
    prefix, ids = ids_of(30, 3), ids_of(20, 4)
    ref = fresh_cache(model, prefix, quantized_kv=True)
    ref_rows = serial(model, ref, ids)
    got = fresh_cache(model, prefix, quantized_kv=True)
    assert arrays_equal(append(model, got, ids, plan=PLAN), ref_rows[-1])
    assert caches_equal(ref, got)


@pytest.mark.parametrize("keep", [0, 1, 3, 6])
def test_rewind_equals_forwarding_only_kept(any_model, keep):
    prefix, ids = ids_of(11, 5), ids_of(6, 6)
    ref = fresh_cache(any_model, prefix)
    if keep:
        append(any_model, ref, ids[:keep], plan=PLAN, logits="none")
    got = fresh_cache(any_model, prefix)
    cp = checkpoint(any_model, got, PLAN)
    append(any_model, got, ids, plan=PLAN, logits="all", record=cp)
    rewind(cp, keep)
    assert caches_equal(ref, got)
    # Decoding continues identically after the rewind.
    nxt = ids_of(3, 7)
    assert all(arrays_equal(a, b) for a, b in zip(serial(any_model, ref, nxt),
                                                   serial(any_model, got, nxt)))


def test_rewind_twice_narrows(any_model):
    """A burst cut short after a verify rewind: rewinding the same checkpoint again narrows."""
    prefix, ids = ids_of(9, 8), ids_of(5, 9)
    ref = fresh_cache(any_model, prefix)
    append(any_model, ref, ids[:2], plan=PLAN, logits="none")
    got = fresh_cache(any_model, prefix)
    cp = checkpoint(any_model, got, PLAN)
    append(any_model, got, ids, plan=PLAN, logits="none", record=cp)
    rewind(cp, 4)
    rewind(cp, 2)
    assert caches_equal(ref, got)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_exception_mid_append_leaves_cache_unchanged(arch):
    model = tiny_model(arch)
    cache = fresh_cache(model, ids_of(13, 10))
    before = [mx.array(a) for a in cache_content(cache)]
    calls = []

    def explode(_cache):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("cancelled mid-burst")

    plan = DispatchPlan(key=None, max_chunk=3, qualified=True)
    with pytest.raises(KeyboardInterrupt):
        append(model, cache, ids_of(10, 11), plan=plan, after_chunk=explode)
    after = cache_content(cache)
    assert len(after) == len(before) and all(arrays_equal(a, b) for a, b in zip(before, after))


def test_unknown_cache_type_is_refused():
    class Mystery:
        offset = 0
    with pytest.raises(Unsupported) as e:
        append(tiny_model("qwen3"), [Mystery()], [1, 2], plan=PLAN)
    assert e.value.reason == "cache_type"


def test_plan_chunks_respect_max_chunk_and_boundaries():
    plan = DispatchPlan(key=None, max_chunk=8, kv_boundaries=(256, 300), qualified=True)
    assert plan.chunks(250, 20) == [6, 8, 6]
    assert plan.chunks(0, 5) == [5]
    assert sum(plan.chunks(290, 40)) == 40 and plan.chunks(290, 40)[0] == 8
    assert plan.chunks(296, 8) == [4, 4]
    assert DispatchPlan(key=None).chunks(10, 3) == [1, 1, 1]
    assert plan.with_mode("fast").chunks(250, 20) == [20]


@pytest.mark.parametrize("ids,needle", [
    ([1, 512], r"ids\[1\]: expected a token id from 0 to 511, got 512"),
    ([-1], r"ids\[0\]: expected a token id from 0 to 511, got -1"),
    ([3, 1.0], r"ids\[1\]: expected a token id from 0 to 511, got 1.0"),
    ([True], r"ids\[0\]: expected a token id from 0 to 511, got True"),
    (["7"], r"ids\[0\]: expected a token id from 0 to 511, got '7'")])
def test_an_id_that_is_no_token_of_the_vocabulary_is_refused_before_any_forward(ids, needle):
    """An id past the embedding's rows reads outside it (garbage logits, or the process ends)
    and a fraction was truncated to an id the caller never gave: one ValueError naming the id,
    the cache untouched."""
    model = tiny_model("qwen3")
    cache = fresh_cache(model, ids_of(4, 12))
    before = [mx.array(a) for a in cache_content(cache)]
    with pytest.raises(ValueError, match=needle):
        append(model, cache, ids, plan=PLAN)
    assert all(arrays_equal(a, b) for a, b in zip(before, cache_content(cache)))
    assert append(model, cache, mx.array([0, 511]), plan=PLAN).shape == (1, 512)


def test_a_bad_plan_or_logits_is_one_error_naming_it():
    """Also at ``checkpoint``: a hybrid model's rewind restores the checkpoint and replays the
    kept ids with its plan, so a bad plan found there lost them."""
    model = tiny_model("qwen3")
    cache = fresh_cache(model, ids_of(4, 13))
    with pytest.raises(TypeError, match="plan: expected a DispatchPlan"):
        append(model, cache, [1], plan=None)
    with pytest.raises(TypeError, match="plan: expected a DispatchPlan"):
        checkpoint(model, cache, None)
    with pytest.raises(ValueError, match="logits: expected 'none', 'last' or 'all', got 'every'"):
        append(model, cache, [1], plan=PLAN, logits="every")
    assert cache[0].offset == 4


@pytest.mark.parametrize("keep", [-1, 4, 1.5, "1", None, True])
def test_rewind_to_no_count_of_the_appended_ids_is_one_value_error(keep):
    """``keep`` is a whole number from 0 to the ids appended since the checkpoint; anything
    else is refused before the cache changes."""
    model = tiny_model("qwen3")
    cache = fresh_cache(model, ids_of(4, 14))
    cp = checkpoint(model, cache, PLAN)
    append(model, cache, [1, 2, 3], plan=PLAN, record=cp)
    with pytest.raises(ValueError, match=r"keep=.*: expected a whole number from 0 to 3"):
        rewind(cp, keep)
    assert cache[0].offset == 7 and cp.appended == [1, 2, 3]
