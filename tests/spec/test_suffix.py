"""SuffixDecoding-style drafter: match lengths, path choice, stops, global tree eviction/bounds."""

from __future__ import annotations

import random

from mlx_fill.core.index import EchoIndex
from mlx_fill.spec.suffix import (_END_BITS, GlobalSuffixTree, OwnRuns, SuffixDraft, SuffixParams,
                                  _match_len, request_candidates, speculate)


def test_match_len_equals_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(3) for _ in range(rng.randrange(2, 80))]
        end = rng.randrange(len(seq))
        depth = rng.randrange(1, 40)
        m = 0
        while m < min(depth, end + 1) and seq[end - m] == seq[len(seq) - 1 - m]:
            m += 1
        assert _match_len(seq, end, seq, depth) == m


def test_path_follows_most_frequent_child_and_stops_below_min_prob():
    # context "1 2" continued by 3 4 (three times) and by 3 5 (once)
    seq = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2]
    idx = EchoIndex(ks=(1, 2), tokens=seq)
    p = SuffixParams(anchors=(2,), candidates=8, alpha=4.0, min_prob=0.5)
    ids, score, L = speculate(request_candidates(idx, p), p, budget=10)
    assert ids[:2] == [3, 4] and L >= 2
    assert 1.75 <= score <= 1.0 + 0.75 * (len(ids) - 1)  # probs: 4/4, then 3/4, then <= 3/4
    strict = SuffixParams(anchors=(2,), candidates=8, alpha=4.0, min_prob=0.8)
    assert speculate(request_candidates(idx, strict), strict, budget=10)[0] == [3]


def test_adaptive_length_is_alpha_times_match_length():
    seq = list(range(10, 30)) + [0] + list(range(10, 13))
    idx = EchoIndex(ks=(1, 2), tokens=seq)
    for alpha in (1.0, 2.0):
        p = SuffixParams(anchors=(2, 1), alpha=alpha, min_prob=0.0)
        ids, _, L = speculate(request_candidates(idx, p), p, budget=100)
        assert L == 3 and len(ids) == int(alpha * 3)


def test_global_tree_fifo_eviction_and_bounded_memory():
    g = GlobalSuffixTree(max_responses=3, max_tokens=10_000, ks=(1, 2), context_tokens=0)
    ids = [g.open([]) for _ in range(5)]
    for d in ids:
        g.extend(d, [d, d + 1, d + 2])
    assert list(g.docs) == ids[2:]  # the two oldest evicted first
    bounded = GlobalSuffixTree(max_responses=1000, max_tokens=50, ks=(1, 2), context_tokens=0)
    rng = random.Random(0)
    for _ in range(200):
        d = bounded.open([])
        bounded.extend(d, [rng.randrange(50) for _ in range(10)])
        assert len(bounded) <= 50 + 10  # the growing document may exceed until the next eviction
        assert bounded._entries <= 2 * max(1024, len(bounded) * 2) + 20


def test_global_tree_never_matches_the_callers_own_response():
    g = GlobalSuffixTree(ks=(1, 2), context_tokens=2)
    own = g.open([7, 8])
    g.extend(own, [1, 2, 3, 1, 2])
    p = SuffixParams(global_anchors=(2,))
    assert g.candidates([9, 1, 2], exclude=own, p=p) == []
    assert g.candidates([9, 1, 2], exclude=0, p=p)


def test_own_runs_find_what_a_full_scan_finds_through_interleaving_and_compaction():
    """Two responses decoded at once, a third store growing and evicted (so compaction moves
    entries): every lookup with a remembered run equals the lookup without one."""
    rng = random.Random(1)
    g = GlobalSuffixTree(max_tokens=600, ks=(1, 2, 4, 8), context_tokens=2)
    p = SuffixParams(global_anchors=(8, 4, 2, 1))
    docs = {d: (OwnRuns(), [7, 8]) for d in (g.open([7, 8]), g.open([7, 8]))}
    generations = set()
    for step in range(3000):
        doc = rng.choice(list(docs))
        runs, ctx = docs[doc]
        t = rng.choice([1, 1, 1, 2, 3]) if step % 500 < 400 else rng.randrange(40)
        ctx.append(t)
        g.extend(doc, [t])
        if step % 7 == 0:
            other = g.open([t])
            g.extend(other, [rng.choice([1, 2, 3]) for _ in range(12)])
        assert g.candidates(ctx, doc, p, runs) == g.candidates(ctx, doc, p)
        generations.add(g.generation)
    assert len(generations) > 1  # compaction ran while runs were remembered


class _Reads(list):
    """A bucket that counts the entries read."""

    reads = 0

    def __getitem__(self, i):
        type(self).reads += 1
        return super().__getitem__(i)


def test_own_runs_step_over_a_long_run_of_the_documents_entries_in_one_jump():
    own, other = 5, 4
    bucket = _Reads([other << _END_BITS | 3] + [own << _END_BITS | i for i in range(5000)])
    runs = OwnRuns()
    assert runs.skip(("k",), bucket, own) == 0  # the first lookup reads the run once
    for i in range(5000, 5010):
        bucket.append(own << _END_BITS | i)
        _Reads.reads = 0
        assert runs.skip(("k",), bucket, own) == 0
        assert _Reads.reads <= 3  # the new entry, the run's last, and nothing more
    bucket.append(other << _END_BITS | 9)  # another response's entry ends the run
    assert runs.skip(("k",), bucket, own) == len(bucket) - 1


def test_cross_request_tree_predicts_a_repeated_reply_opening():
    g = GlobalSuffixTree(ks=(1, 2, 4, 8), context_tokens=4)
    prompt = [100, 101, 102, 103]
    reply = [5, 6, 7, 8, 9, 10]
    first = SuffixDraft(EchoIndex(), global_tree=g)
    first.prefill(prompt)
    first.draft(reply, 0)  # the committed reply is added to the global tree
    second = SuffixDraft(EchoIndex(), global_tree=g, params=SuffixParams(alpha=4.0))
    second.prefill([1, 2] + prompt)
    assert second.draft([], 8)[:4] == [5, 6, 7, 8]
    assert second.last.store == "global"


def test_request_tree_draft_and_confidence_key():
    d = SuffixDraft(EchoIndex())
    d.prefill([1, 2, 3, 4, 5, 1, 2, 3])
    assert d.draft([], 5)[:2] == [4, 5]
    assert d.last.store == "request" and d.confidence()[0] == "request"


def test_a_seeded_store_predicts_a_served_reply_opening():
    g = GlobalSuffixTree(ks=(1, 2, 4, 8), context_tokens=4)
    g.seed([([100, 101, 102, 103], [5, 6, 7, 8, 9, 10]), ([1, 2], [3, 4])])
    assert len(g.docs) == 2 and len(g) == 4 + 6 + 2 + 2  # each reply behind its prompt's tail
    d = SuffixDraft(EchoIndex(), global_tree=g, params=SuffixParams(alpha=4.0))
    d.prefill([1, 2, 100, 101, 102, 103])
    assert d.draft([], 8)[:4] == [5, 6, 7, 8] and d.last.store == "global"
    bounded = GlobalSuffixTree(max_tokens=8, ks=(1, 2), context_tokens=0)
    bounded.seed([([], [1, 2, 3, 4, 5]), ([], [6, 7, 8, 9, 10])])
    assert [list(doc) for doc in bounded.docs.values()] == [[6, 7, 8, 9, 10]]  # the oldest evicted


def test_forgetting_since_a_mark_restores_what_lookups_find():
    g = GlobalSuffixTree(ks=(1, 2), context_tokens=0)
    g.seed([([], [1, 2, 3])])
    p = SuffixParams(global_anchors=(2, 1))
    before = g.candidates([9, 1, 2], exclude=0, p=p)
    tokens, mark = len(g), g.next_doc
    for _ in range(3):
        d = g.open([])
        g.extend(d, [1, 2, 4, 1, 2, 5])
    assert len(g.candidates([9, 1, 2], exclude=0, p=p)) > len(before)
    g.forget_since(mark)
    assert g.candidates([9, 1, 2], exclude=0, p=p) == before and len(g) == tokens
    assert g.open([]) > mark + 2  # ids are not reused: a forgotten response's entries stay dead
    many = GlobalSuffixTree(ks=(1, 2), context_tokens=0)
    for _ in range(300):  # forgotten entries are compacted away once they outnumber live ones
        m = many.next_doc
        many.extend(many.open([]), list(range(10)))
        many.forget_since(m)
    assert many._entries < 2 * 1024 + 20 and len(many) == 0
