"""The model-free roster end to end: token identity with plain decoding through the fill loop,
on a dense and a hybrid (recurrent-rewind) tiny model, each source alone and competing."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import FillSession
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
@pytest.mark.parametrize("names,compete,plan", [
    (["echo"], False, None), (["ngram"], False, None), (["suffix"], False, None),
    (["echo", "suffix", "ngram"], True, None), (["echo", "suffix", "ngram"], True, PLAN),
    (["echo", "suffix", "ngram"], False, PLAN)])
def test_sources_are_token_identical_to_plain_decoding(arch, names, compete, plan):
    model = tiny_model(arch)
    ref = _decode(model)
    sources = make_sources(names, plan=plan, prompt_ids=PROMPT, global_tree=GlobalSuffixTree(),
                           acceptance={})
    fill = FillSession(sources, prompt_ids=PROMPT, plan=PLAN, compete=names if compete else ())
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
