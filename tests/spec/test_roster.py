"""The model-free roster end to end: token identity with plain decoding through the fill loop,
on a dense and a hybrid (recurrent-rewind) tiny model, plus BestOf's calibrated choice."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import DecodeView, FillSession
from mlx_fill.spec.combine import BestOf
from mlx_fill.spec.roster import make_sources
from mlx_fill.spec.suffix import GlobalSuffixTree

from conftest import tiny_model

PLAN = DispatchPlan(key=None, max_chunk=8, cost={2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 1.8},
                    qualified=True)
_rng = random.Random(5)
_chunk = [_rng.randrange(512) for _ in range(12)]
PROMPT = _chunk + [_rng.randrange(512) for _ in range(6)] + _chunk + _chunk[:3]


def _decode(model, fill=None, n=48):
    cache = make_prompt_cache(model)
    gen = (generate_step(mx.array(PROMPT), model, max_tokens=n, prompt_cache=cache, fill=fill)
           if fill is not None else
           stock_generate_step(mx.array(PROMPT), model, max_tokens=n, prompt_cache=cache))
    return [t for t, _ in gen]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("names,combine,plan", [
    (["echo"], False, None), (["ngram"], False, None), (["suffix"], False, None),
    (["echo", "suffix", "ngram"], True, None), (["echo", "suffix", "ngram"], False, PLAN)])
def test_sources_are_token_identical_to_plain_decoding(arch, names, combine, plan):
    model = tiny_model(arch)
    ref = _decode(model)
    sources = make_sources(names, plan=plan, prompt_ids=PROMPT, global_tree=GlobalSuffixTree(),
                           combine=combine, acceptance={})
    fill = FillSession(sources, prompt_ids=PROMPT, plan=PLAN)
    out = _decode(model, fill)
    assert out == ref
    st = fill.stats
    if names != ["echo"]:  # 1-gram lookups always find something to propose
        assert st.verify_proposed > 0 and st.verify_rejected > 0  # rewinds were exercised
    if arch == "qwen3" and plan is None:  # this random model repeats prompt text
        assert st.verify_accepted > 0


def test_make_sources_validates_names_and_delimiters():
    with pytest.raises(ValueError, match="unknown"):
        make_sources(["echo", "draft"], plan=None)
    with pytest.raises(ValueError, match="duplicate"):
        make_sources(["echo", "echo"], plan=None)
    with pytest.raises(ValueError, match="single token"):
        make_sources(["echo"], plan=None, delimiters=["not one token"],
                     tokenizer=type("T", (), {"encode": lambda self, s, **k: [1, 2]})())


class _Fixed:
    """A member that always drafts the same ids."""

    def __init__(self, name, ids):
        self.name, self.ids = name, ids

    def prefill(self, prompt):
        pass

    def draft(self, feed, n):
        return list(self.ids[:n])

    def commit(self, drafted, accepted):
        pass

    def confidence(self):
        return ()


def test_best_of_learns_which_member_to_trust_from_shadow_drafts():
    good, bad = _Fixed("good", [1, 2, 3, 4]), _Fixed("bad", [9, 9, 9, 9, 9, 9])
    best = BestOf([bad, good], max_len=8)
    emitted: list[int] = []
    chosen = []
    for _ in range(30):
        p = best.propose(DecodeView([0], emitted))
        chosen.append(p.origin)
        accepted = 4 if p.origin == "best:good" else 0
        best.feedback(p, accepted)
        emitted += [1, 2, 3, 4] + [5]  # what the target actually produced
    assert chosen[0] == "best:bad"  # longer draft wins under the prior
    assert all(c == "best:good" for c in chosen[-10:])


def test_best_of_with_cost_curve_proposes_for_a_right_member_and_not_for_a_useless_one():
    """Both start unproven (nothing pays on the prior's lower bound); declined drafts are scored
    as shadows, so the member that is always right opens and the useless one never does."""
    costly = DispatchPlan(key=None, max_chunk=8, cost={2: 1.2, 4: 1.5, 8: 2.0}, qualified=True)
    for member, proposes in ((_Fixed("right", [1, 1, 1]), True),
                             (_Fixed("never", [7, 7, 7]), False)):
        best = BestOf([member], plan=costly, max_len=8, stats={})
        emitted: list[int] = []
        out = []
        for _ in range(40):
            p = best.propose(DecodeView([0], emitted))
            out.append(p)
            accepted = 0 if p is None or member.name == "never" else len(p.ids)
            if p is not None:
                best.feedback(p, accepted)
            emitted += [1] * (accepted + 1)
        assert all((p is not None) == proposes for p in out[-10:]), (member.name, out)
