"""Batched fill (side steps inside mlx-lm's ``BatchGenerator``) against stock batching, at the
library level: tokens, logprobs and the caches each sequence leaves behind."""

from __future__ import annotations

import importlib
from dataclasses import replace

import mlx.core as mx
import pytest
from adapter_models import AGENT_MESSAGES, AGENT_TOOLS, serving_model_dir
from mlx_lm import load

from mlx_fill.adapters.server import batch_fill
from mlx_fill.assets.fixtures import fixture_path
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import DecodeView, FillSession, Proposal
from mlx_fill.core.resolve import plan_for

G = importlib.import_module("mlx_lm.generate")
N = 40


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def setup(request):
    """The serving model (``BatchKVCache`` layers) and the ``qwen35-xml`` fixture (GatedDeltaNet
    hybrid: ``ArraysCache`` and ``BatchKVCache`` layers)."""
    path = serving_model_dir()[0] if request.param == "dense" else fixture_path("qwen35-xml")
    model, tok = load(str(path))
    msgs = [AGENT_MESSAGES,
            [{"role": "user", "content": "List the files in the repo and show README.md"}],
            [{"role": "user", "content": "Run the tests please."}],
            [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Count lines in setup.py."}]]
    prompts = [tok.apply_chat_template(m, tools=AGENT_TOOLS, add_generation_prompt=True) for m in msgs]
    batch_fill.install(G)
    return model, tok, prompts


class Script:
    """Proposes ``ids`` at every position from a reference continuation, with ``wrong``
    positions replaced (so verify rejects there); ``policy`` ``assert`` or ``verify``."""

    name = "script"

    def __init__(self, ref: list[int], policy: str, span: int = 5, wrong: frozenset = frozenset()):
        self.ref, self.policy, self.span, self.wrong = ref, policy, span, wrong

    def propose(self, view: DecodeView):
        at = len(view.emitted)
        ids = [t if at + j not in self.wrong else (t + 1) % 1000 for j, t in enumerate(self.ref[at:at + self.span])]
        return Proposal(tuple(ids), self.policy, self.name) if ids else None

    def feedback(self, proposal, accepted):
        pass


def priced(model, cost: dict[int, float]) -> DispatchPlan:
    """The model's own plan (its chunking) with cost curve ``cost`` ({}: linear)."""
    return replace(plan_for(model), cost=cost)


def run(model, tok, prompts, sources=None, cost=None, stop_at_eos=True):
    """Decode all prompts in one batch; ``sources[i]`` (or None) fills sequence ``i``, under the
    model's plan priced with ``cost`` (default linear: a batch of B then delivers B / c(B) = 1
    token per one-row forward, the pace of plain decoding, so every scripted span runs).
    Returns per sequence (tokens, logprobs of the non-asserted tokens, finish cache, sessions)."""
    stop = [[t] for t in tok.eos_token_ids] if stop_at_eos else []
    bg = G.BatchGenerator(model, max_tokens=N, stop_tokens=stop)
    uids = bg.insert(prompts, max_tokens=[N] * len(prompts))
    reg = batch_fill.registry(bg)
    sessions = {}
    plan = priced(model, cost or {})
    for uid, p, src in zip(uids, prompts, sources or [None] * len(prompts)):
        if src is not None:
            sessions[uid] = FillSession([src], prompt_ids=p, eos_ids=tok.eos_token_ids, plan=plan)
            reg[uid] = batch_fill.SeqFill(sessions[uid], list(p))
    out = {u: [[], [], None] for u in uids}
    while bg._generation_batch.uids or bg._prompt_batch.uids or bg._unprocessed_sequences:
        for r in bg.next_generated():
            out[r.uid][0].append(r.token)
            out[r.uid][1].append(r.logprobs)
            if r.finish_reason is not None:
                out[r.uid][2] = (r.prompt_cache, list(r.all_tokens))
    return [out[u] for u in uids], [sessions.get(u) for u in uids], bg


def same_cache(a, b) -> bool:
    (ca, ta), (cb, tb) = a, b
    if ta != tb:
        return False
    for x, y in zip(ca, cb):
        if not hasattr(x, "offset"):  # recurrent layer: conv and state arrays
            if not all(mx.array_equal(u, v).item() for u, v in zip(x.cache, y.cache)):
                return False
            continue
        if x.offset != y.offset:
            return False
        n = x.offset
        if not (mx.array_equal(x.keys[..., :n, :], y.keys[..., :n, :]).item()
                and mx.array_equal(x.values[..., :n, :], y.values[..., :n, :]).item()):
            return False
    return True


def test_verify_and_assert_in_a_batch_match_stock_bit_for_bit(setup):
    model, tok, prompts = setup
    stock, _, _ = run(model, tok, prompts)
    refs = [s[0] for s in stock]
    sources = [Script(refs[0], "verify", wrong=frozenset({3, 11, 12})),
               None,
               Script(refs[2], "assert", span=4),
               Script(refs[3], "verify", span=7, wrong=frozenset({0, 6}))]
    filled, sessions, _ = run(model, tok, prompts, sources)
    for i, (f, s) in enumerate(zip(filled, stock)):
        assert f[0] == s[0], i
        assert same_cache(f[2], s[2]), i
        if i != 2:  # asserted ids carry the policy's one-hot logprobs
            assert all(mx.array_equal(a, b).item() for a, b in zip(f[1], s[1])), i
    assert sessions[0].stats.verify_accepted > 0 and sessions[0].stats.verify_rejected > 0
    assert sessions[2].stats.injected > 0
    assert sessions[3].stats.verify_accepted > 0


def test_spans_stop_at_max_tokens_and_eos(setup):
    model, tok, prompts = setup
    stock, _, _ = run(model, tok, prompts)
    sources = [Script(s[0], "verify", span=64) for s in stock]
    filled, sessions, bg = run(model, tok, prompts, sources)
    for f, s in zip(filled, stock):
        assert f[0] == s[0] and same_cache(f[2], s[2])
        assert len(f[0]) <= N
    assert not batch_fill.registry(bg), "finished sequences stay registered"


@pytest.mark.parametrize("policy,wrong", [("verify", frozenset({3, 11, 12})), ("assert", frozenset())])
def test_a_sequence_alone_fills_in_the_batch_buffers_bit_for_bit(setup, policy, wrong, monkeypatch):
    """A batch of one (the single-client case) runs its side steps in the batch's own buffers
    (no extract, no write-back); tokens, logprobs and the cache it leaves equal stock's."""
    model, tok, prompts = setup
    taken = []
    take = batch_fill._take_alone
    monkeypatch.setattr(batch_fill, "_take_alone", lambda caches: taken.append(take(caches)) or taken[-1])
    for prompt in (prompts[0], prompts[3]):
        (stock,), _, _ = run(model, tok, [prompt])
        (filled,), (session,), _ = run(model, tok, [prompt], [Script(stock[0], policy, wrong=wrong)])
        assert filled[0] == stock[0]
        assert same_cache(filled[2], stock[2])
        if policy == "verify":
            assert all(mx.array_equal(a, b).item() for a, b in zip(filled[1], stock[1]))
            assert session.stats.verify_accepted > 0 and session.stats.verify_rejected > 0
        else:
            assert session.stats.injected > 0
    assert taken and all(t is not None for t in taken)  # every side step took the fast path


def test_a_side_step_must_beat_the_batch(setup):
    """Under a flat cost curve a batched step of B sequences delivers B tokens per one-row
    forward; an asserted span of 3 (at most 3 tokens for one forward) does not beat that in a
    batch of 4 and is left to the batched steps, while alone (B = 1) it runs. Tokens equal
    stock batching either way."""
    model, tok, prompts = setup
    stock, _, _ = run(model, tok, prompts, stop_at_eos=False)
    assert all(len(s[0]) == N for s in stock)  # no sequence ends early: the batch stays at 4
    flat = {m: 1.0 for m in range(2, 65)}
    script = lambda: Script(stock[2][0], "assert", span=3)
    filled, sessions, _ = run(model, tok, prompts, [None, None, script(), None], cost=flat,
                              stop_at_eos=False)
    assert [f[0] for f in filled] == [s[0] for s in stock]
    assert sessions[2].stats.injected == 0 and sessions[2].pace.min_gain == 4.0
    alone, alone_sessions, _ = run(model, tok, prompts[2:3], [script()], cost=flat, stop_at_eos=False)
    assert alone[0][0] == stock[2][0]
    assert alone_sessions[0].stats.injected > 0 and alone_sessions[0].pace.min_gain == 1.0
