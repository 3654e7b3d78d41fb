"""Prompt lookup: agrees with a brute-force reference, respects n range, K and occurrence."""

from __future__ import annotations

import random

import pytest

from mlx_fill.core.index import EchoIndex
from mlx_fill.core.proposal import DecodeView
from mlx_fill.spec.base import DraftProposalSource
from mlx_fill.spec.ngram import NgramDraft, prompt_lookup


def _reference(seq, n_min, n_max, k, first):
    """Saxena's PLD, written as a plain scan over the whole context."""
    for n in range(n_max, n_min - 1, -1):
        if len(seq) < n:
            continue
        tail = seq[-n:]
        ends = [i for i in range(n - 1, len(seq) - 1) if seq[i - n + 1:i + 1] == tail]
        if ends:
            e = ends[0] if first else ends[-1]
            return seq[e + 1:e + 1 + k]
    return []


@pytest.mark.parametrize("first", [True, False])
def test_prompt_lookup_equals_reference_scan(first):
    rng = random.Random(1 if first else 2)
    for _ in range(200):
        seq = [rng.randrange(5) for _ in range(rng.randrange(1, 60))]
        idx = EchoIndex(ks=(1, 2, 3), tokens=seq)
        got = prompt_lookup(idx, n_min=1, n_max=3, k=7, occurrence="first" if first else "last")
        assert got == _reference(seq, 1, 3, 7, first), seq


def test_longest_ngram_wins_and_k_caps():
    seq = [1, 2, 3, 40, 41, 9, 2, 3, 50, 51, 52, 1, 2, 3]
    idx = EchoIndex(ks=(1, 2, 3), tokens=seq)
    assert prompt_lookup(idx, n_max=3, k=2, occurrence="last") == [40, 41]
    assert prompt_lookup(idx, n_min=1, n_max=2, k=2, occurrence="last") == [50, 51]


def test_draft_source_contract_through_the_adapter():
    prompt = [5, 6, 7, 8, 5, 6]
    src = DraftProposalSource(NgramDraft(EchoIndex(), k=3), length=lambda: 2)
    p = src.propose(DecodeView(prompt, []))
    assert p.ids == (7, 8) and p.policy == "verify" and p.origin == "ngram"
    src.feedback(p, 1)
    p2 = src.propose(DecodeView(prompt, [7, 9]))  # 7 accepted, 9 the correction
    assert p2 is None or all(isinstance(t, int) for t in p2.ids)
    zero = DraftProposalSource(NgramDraft(EchoIndex(), k=3), length=lambda: 0)
    assert zero.propose(DecodeView(prompt, [])) is None


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        NgramDraft(n_min=3, n_max=1)
    with pytest.raises(ValueError):
        NgramDraft(EchoIndex(ks=(1,)), n_max=3)
    with pytest.raises(ValueError):
        NgramDraft(occurrence="middle")
