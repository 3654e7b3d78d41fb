"""Sliding-window models: appends and rewinds on a ``RotatingKVCache`` that has wrapped are
bit-identical to serial decoding, and fill on/off decode the same tokens far past the window."""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlx_fill.assets.random_models import SLIDING, build, config_for
from mlx_fill.core.exactness import arrays_equal, caches_equal
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.primitive import Unsupported, append, check_supported, checkpoint, rewind
from mlx_fill.core.proposal import FillSession

from reference_source import ReferenceSource

WINDOW = 16
PLAN = DispatchPlan(key=None, max_chunk=16, qualified=True)


@functools.lru_cache(maxsize=None)
def model_of(arch: str):
    model, _ = build(config_for(arch, sliding_window=WINDOW))
    return model


def ids_of(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(512) for _ in range(n)]


def prefilled(model, prompt: list[int]):
    cache = make_prompt_cache(model)
    if prompt:
        model(mx.array(prompt)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def serial(model, cache, ids):
    rows = [model(mx.array([[t]]), cache=cache)[0, -1:] for t in ids]
    mx.eval(rows)
    return rows


def ring(cache) -> RotatingKVCache:
    return next(c for c in cache if isinstance(c, RotatingKVCache))


@pytest.mark.parametrize("arch", SLIDING)
@pytest.mark.parametrize("prompt_len", [0, 5, 3 * WINDOW // 2])
def test_appends_and_rewinds_past_the_window_equal_serial(arch, prompt_len):
    """Random spans appended and partly rewound until 3x the window: after every append and
    every rewind the cache equals serial decoding of the kept ids, bit for bit, and every
    appended row's logits equal the serial step's."""
    model = model_of(arch)
    rng = random.Random(prompt_len)
    prompt = ids_of(prompt_len, 1)
    ref, got = prefilled(model, prompt), prefilled(model, prompt)
    stream = ids_of(200, 2)
    pos, crossings = 0, 0
    while ref[0].offset < 3 * WINDOW + 8:
        n = rng.choice([2, 3, 5, 7, 8, 12, 16])
        keep = rng.randrange(n + 1)
        span = stream[pos:pos + n]
        before = ring(got)._idx
        cp = checkpoint(model, got, PLAN)
        rows = append(model, got, span, plan=PLAN, logits="all", record=cp)
        probe = serial(model, ref, span)
        assert all(arrays_equal(rows[i:i + 1], probe[i]) for i in range(n)), (pos, n)
        assert caches_equal(ref, got), f"after append at {pos} (+{n})"
        rewind(cp, keep)
        # The reference forgets the rejected tail by decoding the kept ids only.
        ref = prefilled(model, prompt)
        serial(model, ref, stream[:pos + keep])
        assert caches_equal(ref, got), f"after rewind at {pos} (+{n}, keep {keep})"
        crossings += int(before + n > WINDOW and ring(got).offset >= WINDOW)
        pos += keep
    assert crossings, "no span crossed the ring's end"


@pytest.mark.parametrize("arch", SLIDING)
def test_rewind_across_the_wrap_point(arch):
    """A span that runs over the end of the ring, rewound to ids before the end: the slots
    the rejected ids overwrote at the ring's start come back."""
    model = model_of(arch)
    prompt = ids_of(WINDOW + 4, 3)
    got, ref = prefilled(model, prompt), prefilled(model, prompt)
    lead = ids_of(WINDOW - 4, 4)  # the first step after the prompt writes slot 0
    append(model, got, lead, plan=PLAN, logits="none")
    serial(model, ref, lead)
    assert caches_equal(ref, got)
    assert ring(got)._idx == WINDOW - 4
    span = ids_of(10, 5)
    cp = checkpoint(model, got, PLAN)
    append(model, got, span, plan=PLAN, logits="none", record=cp)
    assert ring(got)._idx == 6  # wrapped: the last 6 ids overwrote slots 0..5
    rewind(cp, 3)  # keep 3 ids before the end, drop the 7 that cross it
    serial(model, ref, span[:3])
    assert caches_equal(ref, got)
    nxt = ids_of(20, 6)  # decoding goes on identically past another wrap
    assert all(arrays_equal(a, b) for a, b in zip(serial(model, ref, nxt),
                                                   serial(model, got, nxt)))


@pytest.mark.parametrize("arch", SLIDING)
def test_rewind_after_serial_steps_since_the_checkpoint(arch):
    """``rewind(cp, 0)`` after plain one-token steps (as qualify's serial arm does) restores
    a wrapped ring exactly, and the checkpoint can be rewound to again."""
    model = model_of(arch)
    prompt = ids_of(2 * WINDOW + 3, 7)
    got, ref = prefilled(model, prompt), prefilled(model, prompt)
    cp = checkpoint(model, got, PLAN)
    for _ in range(2):
        steps = ids_of(WINDOW + 5, 8)
        serial(model, got, steps)
        cp.appended = steps
        rewind(cp, 0)
        assert caches_equal(ref, got)


@pytest.mark.parametrize("arch", SLIDING)
@pytest.mark.parametrize("policy,corrupt", [("assert", 0.0), ("verify", 0.5)])
def test_fill_on_and_off_are_token_identical_past_the_window(arch, policy, corrupt):
    model = model_of(arch)
    prompt = ids_of(3 * WINDOW // 2, 9)  # the prompt alone is longer than the window
    n = 3 * WINDOW

    def run(fill):
        cache = make_prompt_cache(model)
        gen = (generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                             fill=fill) if fill is not None else
               stock_generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache))
        return [t for t, _ in gen], cache

    ref, ref_cache = run(None)
    source = ReferenceSource(ref, policy, corrupt, every=3, span=7, seed=5)
    session = FillSession([source], prompt_ids=prompt, plan=PLAN)
    out, cache = run(session)
    assert out == ref
    assert session.stats.refusals == {} and session.stats.forwards < n
    assert caches_equal(ref_cache, cache)


def test_rotating_layers_of_different_windows_are_refused():
    with pytest.raises(Unsupported) as e:
        check_supported([RotatingKVCache(16), RotatingKVCache(32)])
    assert e.value.reason == "rotating_mixed"
