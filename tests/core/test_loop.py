"""The fill-aware decode loop: token identity with plain decoding and the cache invariant."""

from __future__ import annotations

import io
import json
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from mlx_fill.core.acceptance import pure_processor
from mlx_fill.core.exactness import caches_equal
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import FillSession
from mlx_fill.assets.random_models import build, config_for

from conftest import tiny_model
from reference_source import ReferenceSource

PLAN = DispatchPlan(key=None, max_chunk=4, qualified=True)
PROMPT = [random.Random(1).randrange(512) for _ in range(20)]


def decode(model, fill=None, n=40, stop_after=None, **kw):
    """Run a decode; optionally close the generator after ``stop_after`` tokens."""
    cache = make_prompt_cache(model)
    gen = (generate_step(mx.array(PROMPT), model, max_tokens=n, prompt_cache=cache, fill=fill, **kw)
           if fill is not None else
           stock_generate_step(mx.array(PROMPT), model, max_tokens=n, prompt_cache=cache, **kw))
    out = []
    for tok, _ in gen:
        out.append(tok)
        if stop_after is not None and len(out) >= stop_after:
            gen.close()
            break
    return out, cache


def session(source, prompt=PROMPT, **kw):
    return FillSession([source], prompt_ids=prompt, plan=PLAN, **kw)


ARCHS = ["qwen3", "qwen3_5"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy,corrupt", [("assert", 0.0), ("verify", 0.0), ("verify", 0.6)])
@pytest.mark.parametrize("every", [5, 1])  # 1: every round chains onto the previous one
def test_fill_is_token_identical(arch, policy, corrupt, every):
    model = tiny_model(arch)
    ref, ref_cache = decode(model)
    s = session(ReferenceSource(ref, policy, corrupt, every=every))
    out, cache = decode(model, s)
    assert out == ref
    assert caches_equal(cache, ref_cache)
    assert s.stats.injected > 0 and s.stats.forwards < len(ref)
    if corrupt:
        assert s.stats.verify_rejected > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["assert", "verify"])
@pytest.mark.parametrize("stop_after", [6, 7, 9, 11, 13])
@pytest.mark.parametrize("every", [5, 1])
def test_consumer_stop_mid_burst_leaves_prompt_plus_yielded(arch, policy, stop_after, every):
    model = tiny_model(arch)
    ref, _ = decode(model)
    out, cache = decode(model, session(ReferenceSource(ref, policy, every=every)), stop_after=stop_after)
    ref_out, ref_cache = decode(model, stop_after=stop_after)
    assert out == ref_out
    assert caches_equal(cache, ref_cache)


QUANTIZED = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=27)  # quantized inside a span


@pytest.mark.parametrize("policy,corrupt", [("assert", 0.0), ("verify", 0.0), ("verify", 0.6)])
@pytest.mark.parametrize("every", [5, 1])
@pytest.mark.parametrize("kind", ["kv", "rotating", "quantized"])  # rotating: wraps mid-decode
def test_at_every_yield_the_cache_is_what_plain_decoding_holds_there(policy, corrupt, every, kind):
    """A consumer holding the generator (and reusing its cache, say after a stop condition,
    without closing it) sees at each yield the cache plain decoding has at that yield, also
    inside a burst of a round's ids."""
    model = (build(dict(config_for("qwen3"), head_dim=32))[0] if kind == "quantized"
             else tiny_model("qwen3"))
    max_kv_size = 24 if kind == "rotating" else None
    kw = QUANTIZED if kind == "quantized" else {}
    ref = [t for t, _ in stock_generate_step(mx.array(PROMPT), model, max_tokens=40, **kw,
                                             prompt_cache=make_prompt_cache(model, max_kv_size))]
    s = session(ReferenceSource(ref, policy, corrupt, every=every))
    cache, ref_cache = make_prompt_cache(model, max_kv_size), make_prompt_cache(model, max_kv_size)
    plain = stock_generate_step(mx.array(PROMPT), model, max_tokens=40, prompt_cache=ref_cache, **kw)
    fill = generate_step(mx.array(PROMPT), model, max_tokens=40, prompt_cache=cache, fill=s, **kw)
    for i, ((t, _), (r, _)) in enumerate(zip(fill, plain)):
        assert t == r
        assert caches_equal(cache, ref_cache), f"yield {i}"
    assert s.stats.injected > 0


@pytest.mark.parametrize("policy", ["assert", "verify"])
@pytest.mark.parametrize("max_tokens", [7, 8, 10, 13, 14])
@pytest.mark.parametrize("every", [5, 1])
def test_max_tokens_inside_a_span(policy, max_tokens, every):
    model = tiny_model("qwen3_5")
    ref, _ = decode(model)
    out, cache = decode(model, session(ReferenceSource(ref, policy, every=every)), n=max_tokens)
    ref_out, ref_cache = decode(model, n=max_tokens)
    assert out == ref_out and len(out) == max_tokens
    assert caches_equal(cache, ref_cache)


def test_throwing_source_disarms_and_generation_continues():
    class Broken:
        name = "broken"

        def propose(self, view):
            raise RuntimeError("index corrupted")

        def feedback(self, proposal, accepted):
            pass

    model = tiny_model("qwen3")
    ref, _ = decode(model)
    s = FillSession([Broken(), ReferenceSource(ref, "verify")], prompt_ids=PROMPT, plan=PLAN)
    out, _ = decode(model, s)
    assert out == ref
    assert s.stats.source_errors == {"broken:RuntimeError": 1}
    assert s.stats.injected > 0


def test_proposed_eos_is_cut_and_never_committed():
    model = tiny_model("qwen3")
    ref, _ = decode(model)
    eos = ref[8]
    trace = io.StringIO()
    s = FillSession([ReferenceSource(ref, "assert", every=5, span=6)], prompt_ids=PROMPT, plan=PLAN,
                    eos_ids=[eos], trace=trace)
    out, _ = decode(model, s)
    assert out == ref  # the model itself still emits the token where it decides to
    applied = [json.loads(line)["ids"] for line in trace.getvalue().splitlines()]
    assert applied and all(eos not in ids for ids in applied)


class FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def test_a_trace_that_cannot_be_written_stops_with_one_line_and_the_decode_goes_on(capsys):
    model = tiny_model("qwen3")
    ref, _ = decode(model)
    trace = FullDisk()
    s = FillSession([ReferenceSource(ref, "assert", every=5, span=6)], prompt_ids=PROMPT, plan=PLAN,
                    trace=trace)
    out, _ = decode(model, s)
    assert out == ref and s.stats.injected > 0 and s.trace is None and trace.closed
    err = capsys.readouterr().err.splitlines()
    assert err == ["mlx-fill: trace not written (No space left on device); tracing stops for "
                   "this request"]


def test_logits_processors_see_the_same_history():
    model = tiny_model("qwen3")
    procs = make_logits_processors(repetition_penalty=1.5, repetition_context_size=8)
    ref, _ = decode(model, logits_processors=procs)
    s = session(ReferenceSource(ref, "verify", corrupt=0.5))
    out, _ = decode(model, s, logits_processors=procs)
    assert out == ref and s.stats.injected > 0
    s = session(ReferenceSource(ref, "assert"))  # no processor would see an asserted row
    out, _ = decode(model, s, logits_processors=procs)
    assert out == ref and s.stats.injected == 0


def test_a_processor_that_may_keep_state_is_served_without_fill_unless_declared_pure():
    """Plain decoding calls a logits processor once per emitted token; a verify round calls it
    on every row, rejected ones too, which would advance a stateful one (a grammar matcher, a
    counter) past plain decoding's. Fill steps aside for a processor it cannot know is pure."""
    calls = []

    def counting(tokens, logits):
        calls.append(tokens.shape[0])
        return logits

    model = tiny_model("qwen3")
    ref, _ = decode(model, logits_processors=[counting])
    plain_calls, calls[:] = list(calls), []
    s = session(ReferenceSource(ref, "verify", corrupt=0.5))
    out, _ = decode(model, s, logits_processors=[counting])
    assert out == ref and calls == plain_calls
    assert s.stats.refusals == {"logits_processor": 1} and s.stats.injected == 0
    calls[:] = []
    s = session(ReferenceSource(ref, "verify", corrupt=0.5))
    out, _ = decode(model, s, logits_processors=[pure_processor(counting)])
    assert out == ref and s.stats.injected > 0 and s.stats.verify_rejected > 0
    assert len(calls) > len(plain_calls)  # run on the rejected rows: declared pure, so harmless


class Raised(Exception):
    pass


def run_until_raised(gen) -> tuple[list[int], bool]:
    out = []
    try:
        for t, _ in gen:
            out.append(t)
    except Raised:
        return out, True
    return out, False


@pytest.mark.parametrize("policy,corrupt", [("assert", 0.0), ("verify", 0.0), ("verify", 0.6)])
@pytest.mark.parametrize("every", [5, 1])
@pytest.mark.parametrize("at", [1, 6, 7, 9, 12, 13])
def test_a_processor_that_raises_ends_the_decode_where_plain_decoding_does(policy, corrupt,
                                                                          every, at):
    """A logits processor that raises once its history holds ``at`` output ids: plain decoding
    feeds that id, raises before yielding it, and its cache holds it. Fill yields the same ids,
    raises the same error, and leaves the same cache, also when a round's rows reach it."""

    @pure_processor
    def raising(tokens, logits):
        if tokens.shape[0] >= len(PROMPT) + at:
            raise Raised
        return logits

    model = tiny_model("qwen3")
    ref, _ = decode(model)
    plain_cache, cache = make_prompt_cache(model), make_prompt_cache(model)
    plain = run_until_raised(stock_generate_step(mx.array(PROMPT), model, max_tokens=40,
                                                 prompt_cache=plain_cache,
                                                 logits_processors=[raising]))
    s = session(ReferenceSource(ref, policy, corrupt, every=every))
    fill = run_until_raised(generate_step(mx.array(PROMPT), model, max_tokens=40,
                                          prompt_cache=cache, logits_processors=[raising],
                                          fill=s))
    assert plain[1] and fill == plain
    assert caches_equal(cache, plain_cache)


def test_a_processor_raising_on_a_rejected_row_is_not_the_decodes_error():
    """A pure processor may raise on ids the model never writes (a validator): a verify round
    shows it the draft's rejected rows, where serial decoding never goes; that error is not
    the request's."""
    model = tiny_model("qwen3")
    ref, _ = decode(model)

    @pure_processor
    def validating(tokens, logits):
        written = tokens[len(PROMPT):].tolist()
        if written != ref[:len(written)]:
            raise Raised
        return logits

    s = session(ReferenceSource(ref, "verify", corrupt=0.6))
    out, cache = decode(model, s, logits_processors=[validating])
    assert out == ref and s.stats.verify_rejected > 0
    assert caches_equal(cache, decode(model)[1])


def test_a_held_generator_leaves_a_cache_another_decode_went_on_with():
    """A consumer stops mid-burst, keeps the generator, and decodes its next turn on the same
    cache: dropping the old generator then must not rewind that turn, and resuming it is one
    error line."""
    model = tiny_model("qwen3")
    ref, _ = decode(model)
    for policy in ("assert", "verify"):
        cache = make_prompt_cache(model)
        s = session(ReferenceSource(ref, policy, every=5))
        gen = generate_step(mx.array(PROMPT), model, max_tokens=40, prompt_cache=cache, fill=s)
        got = [t for _, (t, _) in zip(range(7), gen)][-1]  # the 7th id: inside the round at 5
        assert got == ref[6]
        turn = [t for t, _ in stock_generate_step(mx.array(ref[6:10]), model, max_tokens=5,
                                                  prompt_cache=cache)]
        offset = cache[0].offset
        with pytest.raises(RuntimeError, match="written by another decode"):
            next(gen)
        gen.close()
        assert cache[0].offset == offset and turn
        plain = make_prompt_cache(model)
        list(stock_generate_step(mx.array(PROMPT), model, max_tokens=7, prompt_cache=plain))
        list(stock_generate_step(mx.array(ref[6:10]), model, max_tokens=5, prompt_cache=plain))
        assert caches_equal(cache, plain)


def test_pure_processor_refuses_what_takes_no_attribute():
    with pytest.raises(TypeError, match="pure_processor: .* takes no attribute"):
        pure_processor([].append)


@pytest.mark.parametrize("start", [24, 27, 30, 33])
@pytest.mark.parametrize("every", [1, 3])
def test_kv_quantization_threshold_inside_a_rejected_span(start, every):
    """Serial decoding quantizes the cache once it holds ``quantized_kv_start`` ids; a round
    whose rows cross that point and are rejected before it must leave the cache unquantized,
    the rows after attending the same keys serial decoding's do."""
    model, _ = build(dict(config_for("qwen3"), head_dim=32))
    kw = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=start)
    ref, ref_cache = decode(model, **kw)
    for seed in range(3):
        s = session(ReferenceSource(ref, "verify", 0.6, every=every, seed=seed))
        out, cache = decode(model, s, **kw)
        assert out == ref and s.stats.verify_rejected > 0
        assert caches_equal(cache, ref_cache)


def test_kv_quantization_threshold_inside_a_span():
    model, _ = build(dict(config_for("qwen3"), head_dim=32))
    kw = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=27)
    ref, ref_cache = decode(model, **kw)
    out, cache = decode(model, session(ReferenceSource(ref, "assert", every=3)), **kw)
    assert out == ref
    assert caches_equal(cache, ref_cache)


def test_media_input_refuses_fill_and_decodes_normally():
    model = tiny_model("qwen3")
    embeds = model.model.embed_tokens(mx.array(PROMPT))
    ref = [t for t, _ in stock_generate_step(mx.array(PROMPT), model, max_tokens=10,
                                             input_embeddings=embeds)]
    s = session(ReferenceSource(ref, "assert"))
    out = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=10, fill=s,
                                       input_embeddings=embeds)]
    assert out == ref
    assert s.stats.refusals == {"media": 1} and s.stats.injected == 0


@pytest.mark.parametrize("cache,message", [
    ([], r"^prompt_cache: expected make_prompt_cache\(model\)'s list of layer caches, got an empty list$"),
    ("cache", r"^prompt_cache: expected .* got str$"),
    ([None, None], r"^prompt_cache\[0\]: expected a layer cache \(mlx_lm.models.cache\), got NoneType$"),
])
def test_a_prompt_cache_that_is_no_layer_caches_is_one_line(cache, message):
    model = tiny_model("qwen3")
    s = session(ReferenceSource([1, 2, 3], "verify"))
    with pytest.raises(TypeError, match=message):
        next(generate_step(mx.array(PROMPT), model, prompt_cache=cache, fill=s))


def test_a_session_serves_one_decode():
    model = tiny_model("qwen3")
    ref, _ = decode(model)
    s = session(ReferenceSource(ref, "verify"))
    assert decode(model, s)[0] == ref
    with pytest.raises(ValueError, match="already served a request; build one per request"):
        generate_step(mx.array(PROMPT), model, fill=s)
    fresh = session(ReferenceSource(ref, "verify"))
    with pytest.raises(TypeError, match=r"^generate_step\(\) got an unexpected keyword argument 'max_token'"):
        generate_step(mx.array(PROMPT), model, fill=fresh, max_token=5)
    assert decode(model, fresh)[0] == ref  # a call that failed to bind did not take the session


@pytest.mark.parametrize("policy", ["assert", "verify"])
def test_telemetry_counts_what_the_consumer_received_when_it_stops_mid_burst(policy):
    model = tiny_model("qwen3")
    ref, _ = decode(model)
    s = session(ReferenceSource(ref, policy))  # proposes ref[5:11] after the 5th token
    out, _ = decode(model, s, stop_after=8)
    assert out == ref[:8]
    assert s.stats.emitted == 8
    assert s.stats.injected == 3 and s.stats.events == 1


@pytest.mark.parametrize("prompt,error,needle", [
    (mx.array(PROMPT[:3] + [512]), ValueError, r"prompt\[3\]: expected a token id from 0 to 511, got 512"),
    (mx.array([-1] + PROMPT[:3]), ValueError, r"prompt\[0\]: expected a token id from 0 to 511, got -1"),
    (mx.array([PROMPT]), ValueError, r"prompt: expected a 1-D array of token ids, got shape \(1, 20\)"),
    (mx.array(PROMPT, dtype=mx.float32), TypeError, r"prompt: expected integer token ids, got mlx.core.float32"),
    (PROMPT, TypeError, r"prompt: expected an mx.array of token ids, got list")])
def test_a_prompt_that_is_no_token_ids_of_the_model_is_one_error(prompt, error, needle):
    """Stock mlx-lm fails on these deep inside the model (an id past the embedding's rows can
    end the process); with a session the prompt is checked before any forward."""
    model = tiny_model("qwen3")
    with pytest.raises(error, match=needle):
        next(generate_step(prompt, model, max_tokens=3, fill=session(ReferenceSource([], "verify"))))


def test_max_tokens_is_any_whole_number_mlx_lm_counts_to():
    """mlx-lm compares ``max_tokens`` with its count, so ``12.0`` stops after 12 tokens; the
    loop with fill did too until a round sliced with it (a TypeError mid-decode). What is no
    whole number (mlx-lm's loop never reaches it and decodes without end) is one TypeError."""
    model = tiny_model("qwen3")
    ref, _ = decode(model, n=12)
    s = session(ReferenceSource(ref, "verify", every=1))
    out, _ = decode(model, s, n=12.0)
    assert out == ref and s.stats.injected > 0
    for bad in (2.5, None, "12"):
        with pytest.raises(TypeError, match=r"max_tokens: expected a whole number of tokens "
                                            r"\(-1: no limit\), got"):
            next(generate_step(mx.array(PROMPT), model, max_tokens=bad,
                               fill=session(ReferenceSource(ref, "verify"))))
