"""A server's conversation indexes between requests (``IndexStore``): a request takes the index
whose served prompt its own extends, synced it equals one indexed anew, another conversation's
index is left alone, no two live requests share one, and the store stays within its bounds;
sessions take and give back through ``build_session`` / ``end_session``."""

from __future__ import annotations

import random

import pytest

from adapter_models import random_qwen3_dir
from mlx_lm import load

from mlx_fill.core.index import EchoIndex, IndexStore
from mlx_fill.session import build_session, end_session


def _conversation(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50) for _ in range(n)]


def _state(index: EchoIndex):
    return index.seq, {k: {key: list(b) for key, b in m.items()} for k, m in index._maps.items()}


def _served(seq: list[int], reply: list[int]) -> EchoIndex:
    """An index as a request leaves it: its prompt ``seq`` and its reply."""
    index = EchoIndex()
    index.sync(seq + reply)
    return index


def test_a_taken_index_synced_to_the_prompt_equals_one_indexed_anew():
    store = IndexStore()
    first = _conversation(0, 400)
    index = store.take(first)
    index.sync(first + [7, 7, 7])  # the reply, as a request leaves its index
    store.give(index, len(first))
    later = first + [7, 9] + _conversation(1, 100)  # the next request: its reply re-rendered
    taken = store.take(later)
    assert taken is index and len(store) == 0
    taken.sync(later)
    assert _state(taken) == _state(EchoIndex(tokens=later))


def test_the_longest_kept_prompt_wins_and_an_index_whose_prompt_this_one_leaves_is_left():
    store = IndexStore()
    shared = _conversation(2, 1000)  # a system prompt and tools two conversations share
    a, b = shared + _conversation(3, 100), shared + _conversation(4, 100)
    store.give(_served(a, [1, 2]), len(a))
    assert store.take(b).seq == []  # b departs from the prompt a's index served: left for a
    assert len(store) == 1
    store.give(_served(shared, [3]), len(shared))
    assert store.take(a + [1, 2, 5]).seq == a + [1, 2]  # both served prompts kept: the longer
    assert store.take(b).seq == shared + [3]  # b extends what this one served
    assert len(store) == 0


def test_live_requests_never_share_an_index():
    store = IndexStore()
    seq = _conversation(5, 200)
    index = _served(seq, [])
    store.give(index, len(seq))
    store.give(index, len(seq))  # given back twice: kept once
    assert len(store) == 1
    first, second = store.take(seq), store.take(seq)
    assert first is index and second is not index and second.seq == []


def test_the_store_keeps_its_bounds_dropping_the_least_recently_given():
    store = IndexStore(max_ids=1000, max_indexes=3)
    given = []
    for seed in range(5):
        seq = _conversation(10 + seed, 300)
        given.append(_served(seq, []))
        store.give(given[-1], len(seq))
    assert len(store) == 3  # 900 ids
    assert all(store.take(g.seq) is g for g in given[2:])
    for g in given[2:]:
        store.give(g, len(g))
    store.give(_served(_conversation(20, 1001), []), 1001)  # over the bound alone: not kept
    assert len(store) == 3


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
    store.give(kept, len(prompt))
    second = session(prompt + [5, 6])
    assert len(store) == 0
    end_session(second)
    assert store.take(prompt + [5, 6]) is kept  # synced to the second request's prompt
    assert kept.seq[:len(prompt) + 2] == prompt + [5, 6]
    store.give(kept, len(prompt) + 2)
    assert build_session("strict", model=model, tokenizer=tokenizer, prompt_ids=prompt,
                         indexes=store).release is None
    assert len(store) == 1


def test_a_session_whose_trace_cannot_be_opened_gives_its_index_back(tmp_path):
    """The build fails after the index was taken and synced: the conversation keeps it."""
    model, tokenizer = load(str(random_qwen3_dir()))
    store, prompt = IndexStore(), _conversation(31, 400)
    with pytest.raises(OSError):
        build_session("all", model=model, tokenizer=tokenizer, prompt_ids=prompt, indexes=store,
                      trace_path=str(tmp_path / "gone" / "trace.jsonl"))
    assert len(store) == 1
    assert store.take(prompt + [7]).seq[:len(prompt)] == prompt
