"""``mtp``: a Qwen3.5-style checkpoint's own MTP head, loaded from ``mtp.*`` tensors that
mlx-lm's loader drops, drafting with the predict-ahead row convention on a hybrid target.

Heads here have random weights: verification makes any head lossless, so these tests check the
loader, the hidden-state tap, the row convention and the rewinds; acceptance of a trained head is
measured by the benchmark script, never asserted here.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from mlx_fill.core.exactness import cache_content
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.primitive import append
from mlx_fill.core.proposal import FillSession
from mlx_fill.assets.random_models import build, config_for, save
from mlx_fill.spec.mtp import MTPSource, make_mtp_source
from mlx_fill.spec.mtp_head import MTPHead, has_mtp, load_mtp_head
from mlx_fill.spec.mtp_tap import HiddenTap

PLAN = DispatchPlan(key=None, max_chunk=16, qualified=True)


OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def write_checkpoint(path, *, with_mtp: bool, seed: int = 1, bigram: float | None = None):
    """A random qwen3_5 checkpoint; with ``with_mtp`` a random head's tensors are written as
    ``mtp.*`` into an extra shard (mlx-lm loads that shard and drops them).

    ``bigram=eps`` scales every layer's output projection by ``eps`` (the target becomes a
    mostly-bigram model whose hybrid layers still steer it) and writes a head constructed to be
    that bigram predictor (``fc`` passes the embedding, its layer adds nothing, ``norm`` is the
    target's final norm): its drafts are accepted often but not always, so verify rounds both
    accept and rewind."""
    model, config = build(config_for("qwen3_5"))
    if bigram is not None:
        model.update(tree_unflatten([(k, v * bigram) for k, v in tree_flatten(model.parameters())
                                     if k.endswith(OUTPUT_PROJECTIONS)]))
    save(model, config, path)
    if with_mtp:
        mx.random.seed(seed)
        head = MTPHead(model.language_model.args)
        if bigram is not None:
            h = head.fc.weight.shape[0]
            head.fc.weight = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
            head.update(tree_unflatten([(k, mx.zeros_like(v)) for k, v in
                                        tree_flatten(head.parameters())
                                        if k.endswith(OUTPUT_PROJECTIONS)]))
            head.norm.weight = model.language_model.model.norm.weight
        mx.save_safetensors(str(path / "model-mtp.safetensors"),
                            {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    return path


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen35-mtp"), with_mtp=True)


@pytest.fixture(scope="module")
def target(checkpoint_dir):
    model, _ = load_model(checkpoint_dir)
    return model


@pytest.fixture(scope="module")
def head(checkpoint_dir, target):
    return load_mtp_head(checkpoint_dir, target)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """(target, head) of the mostly-bigram checkpoint: drafts both accepted and rejected."""
    path = write_checkpoint(tmp_path_factory.mktemp("qwen35-bigram"), with_mtp=True, bigram=0.15)
    model, _ = load_model(path)
    return model, load_mtp_head(path, model)


def prompts(count: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(count)]


def plain(model, prompt, n):
    return [t for t, _ in stock_generate_step(mx.array(prompt), model, max_tokens=n)]


def run_mtp(target, head, prompt, n, k):
    source = make_mtp_source(target, head, num_draft_tokens=k, plan=PLAN)
    fill = FillSession([source], plan=PLAN)
    out = [t for t, _ in generate_step(mx.array(prompt), target, fill=fill, max_tokens=n)]
    return out, fill.stats, source.source


def test_loader_finds_the_tensors_mlx_lm_drops(checkpoint_dir, target, head, tmp_path):
    names = {k for k, _ in tree_flatten(target.parameters())}
    assert not any("mtp" in k for k in names)
    assert has_mtp(checkpoint_dir)
    written = mx.load(str(checkpoint_dir / "model-mtp.safetensors"))
    for k, v in tree_flatten(head.parameters()):
        assert mx.array_equal(v, written[f"mtp.{k}"]).item(), k
    bare = write_checkpoint(tmp_path / "bare", with_mtp=False)
    assert not has_mtp(bare)
    with pytest.raises(ValueError, match="no mtp"):
        load_mtp_head(bare, target)


def test_tap_is_transparent_and_holds_pre_norm_rows(bigram):
    """Installing the tap changes no output; after a decode with rewinds its rows equal the
    pre-final-norm hidden states of one fresh forward over the committed ids."""
    target, head = bigram
    prompt = prompts(1, seed=3)[0]
    before = plain(target, prompt, 12)
    tap = HiddenTap.install(target)
    assert HiddenTap.install(target) is tap
    assert plain(target, prompt, 12) == before
    out, stats, _ = run_mtp(target, head, prompt, 12, 3)
    assert out == before and stats.verify_rejected > 0
    committed = prompt + out
    decoded = tap.rows(tap.first(), len(committed) - 1)
    fresh_tap_start = tap.first()
    cache = make_prompt_cache(target)
    append(target, cache, committed[:-1], plan=PLAN, logits="none")
    ref = tap.rows(fresh_tap_start, len(committed) - 1)
    assert mx.allclose(decoded, ref, atol=1e-4).item()
    h = ref[-1:]
    normed = target.language_model.model.norm(h[None])
    assert not mx.allclose(h, normed[0], atol=1e-3).item(), "tap must hold PRE-norm rows"


@pytest.mark.parametrize("k", [1, 2, 4])
def test_random_head_token_identical(target, head, k):
    """A random head's drafts are (almost) never right; decoding must not change."""
    for prompt in prompts(2, seed=20 + k):
        ref = plain(target, prompt, 20)
        out, stats, _ = run_mtp(target, head, prompt, 20, k)
        assert out == ref
        assert stats.events > 0


@pytest.mark.parametrize("k", [2, 3, 5])
def test_accepting_head_token_identical(bigram, k):
    """Hybrid target with real accepts and rejects: every rejected verify rewinds the recurrent
    layers (snapshot + replay), every accepted one rebuilds head rows from verify hiddens."""
    target, head = bigram
    accepted = rejected = 0
    for prompt in prompts(3, seed=30 + k):
        ref = plain(target, prompt, 24)
        out, stats, _ = run_mtp(target, head, prompt, 24, k)
        assert out == ref
        accepted += stats.verify_accepted
        rejected += stats.verify_rejected
    assert accepted > 0 and rejected > 0


def test_head_cache_holds_only_true_rows(bigram):
    """After decoding, the head's cache equals a fresh head cache built from the predict-ahead
    rows ``(embed(t[p+1]), hidden[p])`` of the committed ids, for every kept position."""
    target, head = bigram
    prompt = prompts(1, seed=7)[0]
    out, _, src = run_mtp(target, head, prompt, 20, 3)
    committed = prompt + out
    assert src._ctx == committed[:len(src._ctx)]
    kept = src._built
    assert kept >= len(prompt) - 1
    tap = HiddenTap.install(target)
    cache = make_prompt_cache(target)
    append(target, cache, committed, plan=PLAN, logits="none")
    hidden = tap.rows(0, kept)
    fresh = head.make_cache()
    embed = target.language_model.model.embed_tokens
    head(embed(mx.array(committed[1:kept + 1])[None]), hidden[None], fresh)
    ours, ref = cache_content(src._cache), cache_content(fresh)
    assert [a.shape for a in ours] == [b.shape for b in ref]
    assert all(mx.allclose(a, b, atol=1e-4).item() for a, b in zip(ours, ref))


def test_missing_hidden_state_is_a_clear_error(target, head):
    """A source used with a model whose forwards the tap never saw refuses loudly (the fill
    session then disarms it and counts the error; generation continues)."""
    src = MTPSource(target, head, plan=PLAN)
    HiddenTap.install(target).release_below(10 ** 9)
    src.prefill(prompts(1)[0])
    with pytest.raises(KeyError, match="not captured"):
        src.draft([5], 3)


def test_moe_head_from_hf_fused_expert_layout(tmp_path):
    """A Qwen3.5-MoE head written in HF's fused-expert layout loads into mlx-lm's switch layout
    and drafts losslessly on its MoE hybrid target."""
    config = dict(config_for("qwen3_5"), num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32)
    model, config = build(config)
    save(model, config, tmp_path)
    mx.random.seed(3)
    head = MTPHead(model.language_model.args)
    tensors = {}
    for k, v in tree_flatten(head.parameters()):
        if ".switch_mlp." in k:
            continue
        tensors[f"mtp.{k}"] = v
    sw = head.layers[0].mlp.switch_mlp
    tensors["mtp.layers.0.mlp.experts.gate_up_proj"] = mx.concatenate(
        [sw.gate_proj.weight, sw.up_proj.weight], axis=-2)
    tensors["mtp.layers.0.mlp.experts.down_proj"] = sw.down_proj.weight
    mx.save_safetensors(str(tmp_path / "model-mtp.safetensors"), tensors)
    target, _ = load_model(tmp_path)
    loaded = load_mtp_head(tmp_path, target)
    expected = dict(tree_flatten(head.parameters()))
    for k, v in tree_flatten(loaded.parameters()):
        assert mx.array_equal(v, expected[k]).item(), k
    prompt = prompts(1, seed=9)[0]
    out, stats, _ = run_mtp(target, loaded, prompt, 12, 2)
    assert out == plain(target, prompt, 12) and stats.events > 0


def test_rounds_cut_to_nothing_at_eos_keep_the_source_armed(bigram):
    """The session drops a proposal whose first id is EOS without feedback; the head must treat
    that round as rejected and keep drafting (no source error, output unchanged)."""
    target, head = bigram
    prompt = prompts(1, seed=11)[0]
    ref = plain(target, prompt, 24)
    source = make_mtp_source(target, head, num_draft_tokens=3, plan=PLAN)
    fill = FillSession([source], plan=PLAN, eos_ids=frozenset(range(0, 512, 2)))
    out = [t for t, _ in generate_step(mx.array(prompt), target, fill=fill, max_tokens=24)]
    assert out == ref
    assert not fill.stats.source_errors and fill.stats.events > 0


def test_prompt_cache_hit_starts_rows_at_the_first_captured_position(bigram):
    """A request whose prompt prefix came from a reused cache (its hidden states never seen by
    the tap) still drafts, from the first captured position on, and stays lossless."""
    target, head = bigram
    prompt = prompts(1, seed=13, length=32)[0]
    ref = plain(target, prompt, 20)
    cache = make_prompt_cache(target)
    append(target, cache, prompt[:16], plan=PLAN, logits="none")
    HiddenTap.install(target).release_below(16)
    source = make_mtp_source(target, head, num_draft_tokens=2, plan=PLAN)
    fill = FillSession([source], plan=PLAN, prompt_ids=prompt)
    out = [t for t, _ in generate_step(mx.array(prompt[16:]), target, prompt_cache=cache,
                                       fill=fill, max_tokens=20)]
    assert out == ref
    assert not fill.stats.source_errors and fill.stats.verify_accepted > 0
    assert source.source._cache[0].offset < len(prompt) + len(out) - 16


@pytest.mark.slow
def test_fixture_hybrid_lossless_on_transcript_prompts(tmp_path):
    """The trained ``qwen35-xml`` hybrid fixture with a random ``mtp.*`` head written beside its
    weights: token-identical to plain greedy on 30 multi-turn transcript prompts."""
    import shutil

    from mlx_lm import load

    from mlx_fill.assets.fixtures import FixtureMissing, fixture_path
    from agent_prompts import transcript_prompts
    try:
        source_dir = fixture_path("qwen35-xml")
    except FixtureMissing as e:
        pytest.skip(f"trained fixture not in this checkout: {e}")
    model_dir = tmp_path / "qwen35-xml"
    shutil.copytree(source_dir, model_dir)
    target, tok = load(str(model_dir))
    mx.random.seed(5)
    head = MTPHead(target.language_model.args)
    mx.save_safetensors(str(model_dir / "model-mtp.safetensors"),
                        {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    target, tok = load(str(model_dir))
    head = load_mtp_head(model_dir, target)
    rounds = 0
    for prompt in transcript_prompts(tok, 30):
        out, stats, _ = run_mtp(target, head, prompt, 24, 2)
        assert out == plain(target, prompt, 24)
        rounds += stats.events
    assert rounds > 0


@pytest.mark.slow  # 40 s: assembles the committed head onto its fixture and decodes
def test_committed_fixture_head_is_assembled_and_gets_drafts_accepted():
    """The MTP head trained for the ``qwen35-xml`` fixture (``scripts/training/train_mtp.py``) is
    assembled into the fixture's dir byte for byte, loads, stays lossless on frozen held-out
    prompts and gets drafts accepted: a trained head, not only a random one, runs the path."""
    from mlx_lm import load

    from mlx_fill.assets.fixtures import committed_dir, fixture_path
    from agent_prompts import transcript_prompts

    committed = committed_dir("qwen35-xml") / "model-mtp.safetensors"
    folder = fixture_path("qwen35-xml")
    assert (folder / "model-mtp.safetensors").read_bytes() == committed.read_bytes()
    target, tok = load(str(folder))
    head = load_mtp_head(folder, target)
    drafted = accepted = 0
    for prompt in transcript_prompts(tok, 6):
        out, stats, _ = run_mtp(target, head, prompt, 24, 2)
        assert out == plain(target, prompt, 24)
        drafted += stats.verify_proposed
        accepted += stats.verify_accepted
    assert drafted > 0 and accepted > 0, (drafted, accepted)
