"""``draft``: a second model as a DraftSource, verified through the fill loop.

How rounds align with ``mlx_lm.generate.speculative_generate_step`` (what the comparison does):

mlx-lm keeps the last emitted token ``y`` out of the target cache and, each round, drafts
``d_1..d_k`` for the slots after ``y`` and forwards ``[y, d_1..d_k]`` in one target call; it
emits the accepted drafts and then the target's correction/bonus sample. Its FIRST round drafts
the first output token itself. The fill loop forwards every emitted token on its own step (the
pipelined ``_step``), so after yielding ``y`` the target's sample for the next slot is already in
flight; it then asks the source for ``d_1..d_k`` (the same slots after ``y``), checks ``d_1``
against the in-flight sample for free and, on a match, forwards ``[d_1..d_k]``. The accept rule
and the emitted tokens per round are therefore the same; two intended differences remain:

1. the fill loop never drafts the first output token (no proposal before the first yield), so
   mlx-lm is run on ``prompt + [first greedy token]`` and its output is compared with the fill
   loop's output after that token: from then on both start every round after the same token;
2. a round whose ``d_1`` matches costs the fill loop two target forwards (``y`` alone, then
   the ``k`` drafts) instead of one ``k + 1``-row forward: identical tokens, more forwards.

Per-round accepted counts are read from mlx-lm's ``from_draft`` flags (accepted drafts of a
round are the ``True`` flags before its ``False`` correction) and from the fill session's
feedback (0 when ``d_1`` missed the in-flight sample).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_fill.assets import store as assets
from mlx_fill.core.exactness import cache_content
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.primitive import append
from mlx_fill.core.proposal import FillSession
from mlx_fill.assets.random_models import build, config_for
from mlx_fill.spec.draft import (DraftModelSource, TokenizerMismatch, check_same_tokenizer,
                                 make_draft_source)

PLAN = DispatchPlan(key=None, max_chunk=16, qualified=True)


def noisy_copy(arch: str, scale: float, seed: int):
    """The seed-0 random ``arch`` model with Gaussian noise on every weight: a draft model that
    agrees with the target often but not always."""
    model, _ = build(config_for(arch))
    mx.random.seed(seed)
    noisy = [(k, v + scale * mx.random.normal(v.shape) * mx.abs(v).mean())
             for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(noisy))
    mx.eval(model.parameters())
    return model


TARGETS = {arch: build(config_for(arch))[0] for arch in ("qwen3", "qwen3_5")}
DRAFTS = {arch: noisy_copy(arch, 0.05, seed=7) for arch in ("qwen3", "qwen3_5")}


def prompts(count: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(count)]


class Recorder:
    """Collects the per-round accepted counts the session reports."""

    def __init__(self, inner):
        self.inner, self.name, self.rounds = inner, inner.name, []

    def propose(self, view):
        return self.inner.propose(view)

    def feedback(self, proposal, accepted):
        self.rounds.append(accepted)
        self.inner.feedback(proposal, accepted)


def plain(model, prompt, n):
    return [t for t, _ in stock_generate_step(mx.array(prompt), model, max_tokens=n)]


def fill_draft(model, draft, prompt, n, k):
    rec = Recorder(make_draft_source(draft, num_draft_tokens=k, plan=PLAN))
    fill = FillSession([rec], plan=PLAN, max_span=64)
    out = [t for t, _ in generate_step(mx.array(prompt), model, fill=fill, max_tokens=n)]
    return out, rec.rounds, fill.stats


def mlx_lm_rounds(model, draft, prompt, n, k):
    """mlx-lm's speculative output and per-round accepted-draft counts."""
    out, rounds, run = [], [], 0
    for tok, _, from_draft in speculative_generate_step(
            mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=n):
        out.append(int(tok))
        if from_draft:
            run += 1
        else:
            rounds.append(run)
            run = 0
    if run:
        rounds.append(run)
    return out, rounds


@pytest.mark.parametrize("k", [2, 4])
def test_matches_mlx_lm_speculative_round_for_round(k):
    n = 40
    compared = accepted = 0
    for prompt in prompts(2, seed=k):
        target, draft = TARGETS["qwen3"], DRAFTS["qwen3"]
        ref = plain(target, prompt, n)
        ours, our_rounds, stats = fill_draft(target, draft, prompt, n, k)
        theirs, their_rounds = mlx_lm_rounds(target, draft, prompt + ref[:1], n - 1, k)
        assert ours == ref, "draft speculation changed the greedy output"
        assert theirs == ref[1:], "mlx-lm's speculative output differs from greedy (a tie?)"
        assert our_rounds == their_rounds
        compared += len(our_rounds)
        accepted += stats.verify_accepted
    assert compared > 10 and accepted > 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_token_identical_to_plain_decoding(arch):
    """Including a hybrid (recurrent) target and a hybrid draft model: both caches are rewound
    by snapshot + replay, a path mlx-lm's own speculative decoding refuses."""
    target, draft = TARGETS[arch], DRAFTS[arch]
    total_accepted = rejected = 0
    for i, prompt in enumerate(prompts(3, seed=10)):
        ref = plain(target, prompt, 32)
        ours, rounds, stats = fill_draft(target, draft, prompt, 32, k=3 + i % 3)
        assert ours == ref
        total_accepted += stats.verify_accepted
        rejected += stats.verify_rejected
    assert total_accepted > 0 and rejected > 0


def test_mlx_lm_refuses_hybrid_speculation():
    """The reason the hybrid test above matters: stock mlx-lm cannot speculate on qwen3_5."""
    with pytest.raises(ValueError, match="trimmable"):
        next(speculative_generate_step(mx.array(prompts(1)[0]), TARGETS["qwen3_5"],
                                       DRAFTS["qwen3_5"], num_draft_tokens=2))


def test_draft_cache_tracks_committed_ids():
    """After every committed round the draft cache holds exactly the committed ids minus the
    pending tail: equal to a fresh draft cache prefilled with those ids. Every third round is
    dropped without commit (as the session does when EOS cuts a proposal to nothing); the next
    draft() must take it back."""
    draft = DRAFTS["qwen3"]
    src = DraftModelSource(draft, plan=PLAN)
    prompt = prompts(1)[0]
    src.prefill(prompt)
    committed = list(prompt)
    rng = random.Random(5)
    feed: list[int] = []
    for i in range(8):
        d = src.draft(feed, 4)
        accepted = rng.randrange(0, 5) if i % 3 else 0
        if i % 3:
            src.commit(d, accepted)  # else: the session dropped the round without feedback
        feed = d[:accepted] + [rng.randrange(512)]
        committed += feed
        if not i % 3:
            continue
        fresh = make_prompt_cache(draft)
        # the ids before this round's feed, plus the accepted drafts the draft model forwarded
        held = len(committed) - len(feed) + min(accepted, 3)
        append(draft, fresh, committed[:held], plan=PLAN, logits="none")
        ours, ref = cache_content(src._cache), cache_content(fresh)
        assert [a.shape for a in ours] == [b.shape for b in ref]
        assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(ours, ref))


def test_rounds_cut_to_nothing_at_eos_keep_the_source_armed():
    """The session drops a proposal whose first id is EOS without feedback; the source must
    treat that round as rejected and keep drafting (no source error, output unchanged)."""
    target, draft = TARGETS["qwen3"], DRAFTS["qwen3"]
    prompt = prompts(1, seed=4)[0]
    ref = plain(target, prompt, 32)
    source = make_draft_source(draft, num_draft_tokens=3, plan=PLAN)
    eos = frozenset(range(0, 512, 2))
    fill = FillSession([source], plan=PLAN, eos_ids=eos)
    out = [t for t, _ in generate_step(mx.array(prompt), target, fill=fill, max_tokens=32)]
    assert out == ref
    assert not fill.stats.source_errors and fill.stats.verify_accepted > 0


def test_commit_rejects_a_foreign_round():
    src = DraftModelSource(DRAFTS["qwen3"], plan=PLAN)
    src.prefill(prompts(1)[0])
    d = src.draft([], 3)
    with pytest.raises(ValueError, match="does not match"):
        src.commit([(d[0] + 1) % 512], 1)


def test_tokenizer_pair_checked_at_construction():
    qwen = assets.load_tokenizer("qwen3")
    glm = assets.load_tokenizer("glm4.x")
    check_same_tokenizer(qwen, assets.load_tokenizer("qwen3"))
    with pytest.raises(TokenizerMismatch, match="vocab_size|probe|special"):
        DraftModelSource(DRAFTS["qwen3"], tokenizer=glm, target_tokenizer=qwen)
    with pytest.raises(ValueError, match="both"):
        DraftModelSource(DRAFTS["qwen3"], tokenizer=qwen)


def agent_prompts(tokenizer) -> list[list[int]]:
    """Rendered multi-turn tool conversations (the fixture family's real chat template)."""
    files = ["/src/app.py", "/src/util/io.py", "/tests/test_app.py"]
    out = []
    for i, path in enumerate(files):
        messages = [
            {"role": "system", "content": "You are a coding agent. Call tools to inspect files."},
            {"role": "user", "content": f"Open {path} and tell me what main() returns."},
            {"role": "assistant", "content": '<tool_call>\n{"name": "read_file", "arguments": '
                                             f'{{"path": "{files[i - 1]}"}}}}\n</tool_call>'},
            {"role": "tool", "content": f"def main():\n    return {i}\n"},
            {"role": "user", "content": f"Now read {path} as well."},
        ]
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True)))
    return out


def test_fixture_pair_matches_mlx_lm_and_greedy():
    """``qwen3-json`` + ``qwen3-draft`` (trained fixtures, real tokenizer): the fill loop's draft
    speculation, mlx-lm's speculative decoding and plain greedy agree token for token, and the
    accept/reject trace matches mlx-lm's round for round (alignment: module docstring). How
    often the pair agrees depends on how far the fixtures were trained, so acceptance is
    asserted by the random-model trace test above and the slow transcript test below."""
    from mlx_lm import load

    from mlx_fill.assets.fixtures import FixtureMissing, fixture_path
    try:
        target_dir, draft_dir = fixture_path("qwen3-json"), fixture_path("qwen3-draft")
    except FixtureMissing as e:
        pytest.skip(f"trained fixtures not in this checkout: {e}")
    target, tok = load(str(target_dir))
    draft, draft_tok = load(str(draft_dir))
    DraftModelSource(draft, tokenizer=draft_tok, target_tokenizer=tok)
    n, k = 24, 3
    for prompt in agent_prompts(tok)[:1]:
        ref = plain(target, prompt, n)
        ours, our_rounds, _ = fill_draft(target, draft, prompt, n, k)
        theirs, their_rounds = mlx_lm_rounds(target, draft, prompt + ref[:1], n - 1, k)
        assert ours == ref
        assert theirs == ref[1:]
        assert our_rounds == their_rounds and len(our_rounds) >= (n - 1) // (k + 1)


@pytest.mark.slow
def test_fixture_pair_lossless_on_transcript_prompts():
    """30 multi-turn prompts from the recorded agent sessions: draft speculation with the trained
    pair is token-identical to plain greedy, with accepted drafts."""
    from mlx_lm import load

    from mlx_fill.assets.fixtures import FixtureMissing, fixture_path
    from agent_prompts import transcript_prompts
    try:
        target_dir, draft_dir = fixture_path("qwen3-json"), fixture_path("qwen3-draft")
    except FixtureMissing as e:
        pytest.skip(f"trained fixtures not in this checkout: {e}")
    target, tok = load(str(target_dir))
    draft, _ = load(str(draft_dir))
    accepted = 0
    for prompt in transcript_prompts(tok, 30):
        ours, _, stats = fill_draft(target, draft, prompt, 24, 3)
        assert ours == plain(target, prompt, 24)
        accepted += stats.verify_accepted
    assert accepted > 0
