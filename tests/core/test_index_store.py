"""A server's conversation indexes between requests (``IndexStore``): a request takes the index
that keeps the most of its prompt, synced it equals one indexed anew, no two live requests share
one, and the store stays within its bounds; sessions take and give back through
``build_session`` / ``end_session``."""

from __future__ import annotations

import random

from adapter_models import random_qwen3_dir
from mlx_lm import load

from mlx_fill.core.index import EchoIndex, IndexStore
from mlx_fill.session import build_session, end_session


def _conversation(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50) for _ in range(n)]


def _state(index: EchoIndex):
    return index.seq, {k: {key: list(b) for key, b in m.items()} for k, m in index._maps.items()}


def test_a_taken_index_synced_to_the_prompt_equals_one_indexed_anew():
    store = IndexStore()
    first = _conversation(0, 400)
    index = store.take(first)
    index.sync(first + [7, 7, 7])  # the reply, as a request leaves its index
    store.give(index)
    later = first + [7, 9] + _conversation(1, 100)  # the next request: its reply re-rendered
    taken = store.take(later)
    assert taken is index and len(store) == 0
    taken.sync(later)
    assert _state(taken) == _state(EchoIndex(tokens=later))


def test_the_longest_kept_prefix_wins_and_an_index_that_would_drop_more_is_left():
    store = IndexStore()
    a, b = _conversation(2, 300), _conversation(3, 300)
    for seq in (a, b):
        index = EchoIndex()
        index.sync(seq)
        store.give(index)
    assert store.take(b + [1]).seq == b
    assert store.take(a[:100] + [99]).seq == []  # keeps 100 of 300: a new index
    assert len(store) == 1


def test_live_requests_never_share_an_index():
    store = IndexStore()
    seq = _conversation(4, 200)
    index = EchoIndex()
    index.sync(seq)
    store.give(index)
    first, second = store.take(seq), store.take(seq)
    assert first is index and second is not index and second.seq == []


def test_the_store_keeps_its_bounds_dropping_the_least_recently_given():
    store = IndexStore(max_ids=1000, max_indexes=3)
    given = []
    for seed in range(5):
        index = EchoIndex()
        index.sync(_conversation(10 + seed, 300))
        store.give(index)
        given.append(index)
    assert len(store) == 3  # 900 ids
    assert all(store.take(g.seq) is g for g in given[2:])
    small = IndexStore(max_ids=100)
    big = EchoIndex()
    big.sync(_conversation(20, 101))
    small.give(big)
    assert len(small) == 0


def test_sessions_borrow_the_conversation_index_and_give_it_back():
    model, tokenizer = load(str(random_qwen3_dir()))
    store = IndexStore()
    prompt = _conversation(30, 500)

    def session(ids):
        return build_session("all", model=model, tokenizer=tokenizer, prompt_ids=ids,
                             indexes=store)

    first = session(prompt)
    assert len(store) == 0 and first.release is not None
    end_session(first)
    end_session(first)  # idempotent: given back once
    assert len(store) == 1
    kept = store.take(prompt)
    store.give(kept)
    second = session(prompt + [5, 6])
    assert len(store) == 0
    end_session(second)
    assert store.take(prompt + [5, 6]) is kept  # synced to the second request's prompt
    assert kept.seq[:len(prompt) + 2] == prompt + [5, 6]
    store.give(kept)
    assert build_session("strict", model=model, tokenizer=tokenizer, prompt_ids=prompt,
                         indexes=store).release is None
    assert len(store) == 1
