"""The loop drop-in (``mlx_fill.adapters.mlx_lm``), ``build_session`` and the autoload hook."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from adapter_models import TOOLS, random_qwen3_dir
from mlx_fill.core.acceptance import pure_processor
from mlx_fill.adapters import autoload
from mlx_fill.adapters.mlx_lm import generate_step, stream_generate
from mlx_fill.sources.echo import EchoSource
from mlx_fill.sources.prediction import PredictionSource, prediction_text, prediction_usage
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.proposal import DecodeView, FillStats
from mlx_fill.core.cost import CostGate, DraftAcceptance
from mlx_fill.modes import OFF, enabled
from mlx_fill.session import build_session, check_mode, end_session, prediction_ids
from mlx_lm import load
from mlx_lm.generate import GenerationResponse
from mlx_lm.generate import stream_generate as stock_stream_generate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lm():
    model, tokenizer = load(str(random_qwen3_dir()))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                           add_generation_prompt=True)
    return model, tokenizer, prompt


def tokens_of(responses) -> list[int]:
    return [r.token for r in responses]


def test_fill_off_delegates_to_stock(lm):
    model, tok, prompt = lm
    ours = list(stream_generate(model, tok, prompt, max_tokens=12))
    stock = list(stock_stream_generate(model, tok, prompt, max_tokens=12))
    assert tokens_of(ours) == tokens_of(stock)
    assert all(type(r) is GenerationResponse and not hasattr(r, "fill") for r in ours)


def price_rows_as_free(monkeypatch) -> None:
    """Every session gets its model's qualified plan with a flat cost curve, so the cost gates
    let every draft through and a test can count injected ids (on a machine where no
    multi-row chunk is exact, verifying can never pay: skipped)."""
    import mlx_fill.session as session_module
    real = session_module.plan_for

    def pinned(model, group=None):
        plan = real(model, group)
        if plan.max_chunk == 1:
            pytest.skip("no multi-row chunk is exact on this machine: verifying cannot pay")
        return replace(plan, cost={64: 1.0})

    monkeypatch.setattr(session_module, "plan_for", pinned)


def test_prediction_session_is_lossless_and_attaches_telemetry(lm, monkeypatch):
    """With rows priced as free the prediction is verified; the output is plain decoding's
    either way."""
    model, tok, prompt = lm
    price_rows_as_free(monkeypatch)
    ref = list(stream_generate(model, tok, prompt, max_tokens=30))
    head = "".join(r.text for r in ref[:15])
    session = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                            prediction={"type": "content", "content": head})
    out = list(stream_generate(model, tok, prompt, max_tokens=30, fill=session))
    assert tokens_of(out) == tokens_of(ref)
    assert all(isinstance(r.fill, FillStats) for r in out)
    stats = out[-1].fill.as_dict()
    assert stats["injected"] > 0 and stats["verify_accepted"] > 0
    predicted = tok.encode(head, add_special_tokens=False)
    assert session.emitted_ids == tokens_of(out)  # what the loop emitted, as the consumer got it
    usage = prediction_usage(predicted, session.emitted_ids)
    assert usage["accepted_prediction_tokens"] >= len(predicted) - 1  # but a re-encoded last id


def test_a_prediction_given_as_its_ids_is_the_prediction_it_encodes(lm):
    """A caller that has encoded the prediction (to count its tokens) passes the ids; the
    session predicts the same ids as from the OpenAI object, and a malformed object still
    raises."""
    model, tok, prompt = lm
    prediction = {"type": "content", "content": [{"type": "text", "text": "The answer is 42."}]}

    def predicted(given) -> list[int]:
        session = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                                prediction=given)
        return next(s.ids for s in session.sources if isinstance(s, PredictionSource))

    ids = prediction_ids(tok, prediction)
    assert ids and predicted(prediction) == predicted(ids) == predicted(tuple(ids)) == ids
    with pytest.raises(ValueError, match="prediction.type"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                      prediction={"type": "text", "content": "x"})


def test_a_prediction_that_is_not_text_or_token_ids_is_one_value_error(lm):
    """Ids outside the vocabulary (an embedding lookup past its rows ends the process), ids
    that are not integers, and text no tokenizer can encode (a lone surrogate, as JSON's
    ``"\\ud800"`` decodes) are refused before anything runs, each naming what is wrong."""
    model, tok, prompt = lm
    vocab = model.args.vocab_size
    for given, needle in (([1, vocab], rf"prediction\[1\]: expected a token id from 0 to {vocab - 1}"),
                          ([-1], r"prediction\[0\]"), ([3, None], r"prediction\[1\]"),
                          ([[1, 2]], r"prediction\[0\]"), ([True], r"prediction\[0\]"),
                          ({"type": "content", "content": "x\ud800y"}, "prediction.content: not valid Unicode"),
                          ({"type": "content", "content": [{"type": "text", "text": "\udfff"}]},
                           r"prediction.content\[0\].text: not valid Unicode")):
        with pytest.raises(ValueError, match=needle):
            build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, prediction=given)
    build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, prediction=[0, vocab - 1])


@pytest.mark.parametrize("given,kind", [("def f(): pass", "str"), (mx.array([1, 2]), "array"),
                                        (7, "int")])
def test_a_prediction_of_neither_shape_names_both(lm, given, kind):
    """``build_session`` takes OpenAI's object or the ids; text or an ``mx.array`` said only
    ``expected an object``, as if ids were not taken."""
    model, tok, prompt = lm
    with pytest.raises(ValueError, match=r"prediction: expected OpenAI's \{'type': 'content', "
                                         rf"'content': \.\.\.\}} or a list of token ids, got {kind}"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, prediction=given)


def test_a_max_span_outside_one_to_the_ceiling_is_one_value_error(lm):
    """``max_span`` is checked as ``MLX_FILL_MAX_SPAN`` is: 0 or -1 do not silently turn fill
    off, a fraction does not fail later inside a source."""
    from mlx_fill.session import MAX_SPAN_CEILING
    model, tok, prompt = lm
    for bad in (0, -1, 2.5, True, MAX_SPAN_CEILING + 1):
        with pytest.raises(ValueError, match="max_span: expected a whole number"):
            build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, max_span=bad)
    assert build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                         max_span=MAX_SPAN_CEILING) is not None


@pytest.mark.parametrize("bad", [[], (), "kept", 0])
def test_an_acceptance_that_is_not_a_dict_is_one_type_error(lm, bad):
    """``acceptance`` is the dict a server keeps across requests; a list failed inside a
    source's gate with a message about list indices."""
    model, tok, prompt = lm
    with pytest.raises(TypeError, match="acceptance: expected a dict kept across requests"):
        build_session("all", model=model, tokenizer=tok, prompt_ids=prompt, acceptance=bad)
    kept: dict = {}
    assert build_session("all", model=model, tokenizer=tok, prompt_ids=prompt,
                         acceptance=kept) is not None
    assert kept, "the gates' estimates are kept in the caller's dict"


@pytest.mark.parametrize("name", ["indexes", "global_tree", "ledger", "group", "draft_model"])
@pytest.mark.parametrize("bad", ["kept", [1], 3])
def test_a_kept_object_of_another_kind_is_one_type_error(lm, name, bad):
    """The objects a server keeps across requests failed inside a source with ``'str' object
    has no attribute 'take'`` (or were accepted and failed mid-decode); in every mode, off too."""
    model, tok, prompt = lm
    for mode in ("off", "strict", "all"):
        with pytest.raises(TypeError, match=rf"^{name}: expected .*, or None; got "
                                            rf"{type(bad).__name__}$"):
            build_session(mode, model=model, tokenizer=tok, prompt_ids=prompt, **{name: bad})


@pytest.mark.parametrize("bad", [2, True, 1.5])
def test_a_trace_path_that_is_no_path_is_one_type_error(lm, bad):
    """``open`` takes an int as a file descriptor: ``trace_path=2`` wrote the trace into stderr
    and ``end_session`` closed it."""
    model, tok, prompt = lm
    with pytest.raises(TypeError, match="trace_path: expected a file path"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, trace_path=bad)


@pytest.mark.parametrize("bad", [[("enable_thinking", False)], "enable_thinking=False", 0])
def test_template_kwargs_that_are_no_object_are_one_value_error(lm, bad):
    """The strict source renders the template with ``**template_kwargs``; anything but a dict
    failed there and left the request without strict rows, saying nothing."""
    model, tok, prompt = lm
    with pytest.raises(ValueError, match="template_kwargs: must be an object of chat template "
                                         f"variables, got {type(bad).__name__}"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, messages=[],
                      template_kwargs=bad)


@pytest.mark.parametrize("bad", [["echo", 5], 5, {"echo"}])
def test_extra_sources_that_are_no_names_are_one_type_error(lm, bad):
    """A list holding a non-string failed with ``'int' object has no attribute 'strip'``."""
    model, tok, prompt = lm
    with pytest.raises(TypeError, match="extra_sources: expected source names"):
        build_session("all", model=model, tokenizer=tok, prompt_ids=prompt, extra_sources=bad)


def test_fill_with_draft_model_is_rejected(lm):
    model, tok, prompt = lm
    session = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt)
    with pytest.raises(ValueError, match="draft_model"):
        stream_generate(model, tok, prompt, fill=session, draft_model=model)


def test_stream_generate_takes_stocks_positional_arguments(lm):
    """``max_tokens``, ``draft_model`` and ``stream`` are positional as in mlx-lm's
    ``stream_generate``; ``fill=`` is keyword-only, so a stock call never lands in it."""
    model, tok, prompt = lm
    stock = tokens_of(stock_stream_generate(model, tok, prompt, 5, None, mx.cpu))
    assert tokens_of(stream_generate(model, tok, prompt, 5, None, mx.cpu)) == stock
    session = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt)
    assert tokens_of(stream_generate(model, tok, prompt, 5, fill=session)) == stock
    with pytest.raises(ValueError, match="draft_model"):
        stream_generate(model, tok, prompt, 5, model, fill=session)


@pytest.mark.parametrize("bad", ["strict", True, 3, {}])
def test_a_fill_that_is_not_a_session_is_one_type_error(lm, bad):
    """``fill=`` takes what ``build_session`` returns; anything else is refused at the call,
    naming the argument, not an AttributeError from inside the loop."""
    model, tok, prompt = lm
    with pytest.raises(TypeError, match="fill: expected a FillSession"):
        stream_generate(model, tok, prompt, max_tokens=3, fill=bad)
    with pytest.raises(TypeError, match="fill: expected a FillSession"):
        generate_step(mx.array(prompt), model, max_tokens=3, fill=bad)


def test_a_session_used_after_end_session_decodes_without_its_closed_trace(lm, tmp_path,
                                                                          monkeypatch, capsys):
    """``end_session`` closes the trace; a decode that reuses the session still returns plain
    decoding's tokens (it stopped with ``I/O operation on closed file`` at the first event)."""
    model, tok, prompt = lm
    price_rows_as_free(monkeypatch)
    ref = list(stream_generate(model, tok, prompt, max_tokens=20))
    head = "".join(r.text for r in ref)
    trace = tmp_path / "trace.jsonl"
    session = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                            prediction={"type": "content", "content": head}, trace_path=trace)
    end_session(session)
    end_session(session)
    assert tokens_of(stream_generate(model, tok, prompt, max_tokens=20, fill=session)) == tokens_of(ref)
    assert session.stats.injected > 0 and trace.read_text() == ""
    assert capsys.readouterr().err.splitlines() == [
        "mlx-fill: trace not written (I/O operation on closed file); tracing stops for this "
        "request"]


@pytest.mark.parametrize("model", [None, "Qwen/Qwen3-0.6B"])
def test_a_model_that_is_not_a_loaded_model_is_one_type_error(lm, model):
    """``plan_for`` and ``build_session`` name the argument; they failed with
    ``AttributeError: 'NoneType' object has no attribute 'parameters'``."""
    from mlx_fill import plan_for
    _, tok, prompt = lm
    with pytest.raises(TypeError, match=r"model: expected a loaded mlx-lm model \(an "
                                        r"mlx\.nn\.Module\), got (NoneType|str)"):
        plan_for(model)
    with pytest.raises(TypeError, match="model: expected a loaded mlx-lm model"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt)


@pytest.mark.parametrize("bad", [None, "hello", [1, "2"], [[1, 2]], mx.array([[1, 2]])])
def test_prompt_ids_that_are_no_token_ids_are_one_type_error(lm, bad):
    model, tok, _ = lm
    with pytest.raises(TypeError, match="prompt_ids: expected the prompt's token ids"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=bad)


def test_a_hugging_face_tokenizer_is_wrapped_as_stream_generate_wraps_it(lm):
    """mlx-lm's ``stream_generate`` takes the tokenizer unwrapped; so does ``build_session``
    (it failed with ``'int' object is not iterable`` on its ``eos_token_ids``). No tokenizer is
    one TypeError naming it."""
    model, tok, prompt = lm
    ref = tokens_of(stream_generate(model, tok._tokenizer, prompt, max_tokens=12))
    session = build_session("strict", model=model, tokenizer=tok._tokenizer, prompt_ids=prompt,
                            prediction=ref)
    assert session.eos_ids == frozenset(tok.eos_token_ids)
    assert tokens_of(stream_generate(model, tok._tokenizer, prompt, max_tokens=12,
                                     fill=session)) == ref
    with pytest.raises(TypeError, match="tokenizer: expected the model's tokenizer"):
        build_session("strict", model=model, tokenizer=None, prompt_ids=prompt)


def test_modes_and_sources(lm):
    model, tok, prompt = lm
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    assert build_session("off", model=model, tokenizer=tok, prompt_ids=prompt) is None
    strict = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, messages=msgs, tools=TOOLS)
    assert not any(isinstance(s, EchoSource) for s in strict.sources)
    echo = build_session("echo", model=model, tokenizer=tok, prompt_ids=prompt, messages=msgs, tools=TOOLS)
    assert sum(isinstance(s, EchoSource) for s in echo.sources) == 1
    every = build_session("all", model=model, tokenizer=tok, prompt_ids=prompt, messages=msgs, tools=TOOLS)
    assert {s.name for s in every.sources} >= {"echo", "suffix", "ngram"}
    with pytest.raises(ValueError, match="fill mode"):
        check_mode("turbo")
    with pytest.raises(ValueError, match="unknown model-free sources"):
        build_session("all", model=model, tokenizer=tok, prompt_ids=prompt, extra_sources="echo,warp")


@pytest.mark.parametrize("kw,reason", [
    ({"logprobs": True}, "logprobs"), ({"seed": 3}, "seed"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"media": True}, "media")])
def test_refusals_are_counted(lm, kw, reason):
    model, tok, prompt = lm
    s = build_session("all", model=model, tokenizer=tok, prompt_ids=prompt, **kw)
    assert s.refused == reason and s.stats.refusals == {reason: 1} and s.sources == []


def test_temperature_disables_assert_and_env_knobs(lm, tmp_path, monkeypatch):
    model, tok, prompt = lm
    monkeypatch.setenv("MLX_FILL_MAX_SPAN", "7")
    monkeypatch.setenv("MLX_FILL_TRACE", str(tmp_path / "trace.jsonl"))
    s = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt, temperature=0.7)
    assert not s.allow_assert and s.max_span == 7 and s.trace is not None
    monkeypatch.setenv("MLX_FILL_MAX_SPAN", "0")
    with pytest.raises(ValueError, match="MLX_FILL_MAX_SPAN"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt)
    monkeypatch.delenv("MLX_FILL_MAX_SPAN")
    (tmp_path / "plan.json").write_text('{"bad": 1}')
    for plan in (tmp_path / "plan.json", tmp_path / "missing.json"):  # as check_env refuses them
        monkeypatch.setenv("MLX_FILL_PLAN", str(plan))
        with pytest.raises(ValueError, match=f"^MLX_FILL_PLAN={plan} is .*; name a plan file"):
            build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt)


def test_malformed_tools_raise_with_path(lm):
    model, tok, prompt = lm
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}]
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                      messages=[{"role": "user", "content": "x"}], tools=bad)


@pytest.mark.parametrize("messages,needle", [
    ("hello", r"messages: must be a list of message objects, got str"),
    ({"role": "user", "content": "x"}, r"messages: must be a list of message objects, got dict"),
    ([{"role": "user", "content": "x"}, 5], r"messages\[1\]: must be an object, got int")])
def test_malformed_messages_raise_with_path(lm, messages, needle):
    """Messages that are not a list of objects are one ValueError naming where, at
    ``build_session``, not an AttributeError or KeyError from the strict compiler."""
    model, tok, prompt = lm
    with pytest.raises(ValueError, match=needle):
        build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                      messages=messages, tools=TOOLS)


@pytest.mark.parametrize("mode", [3, True, ["strict"]])
def test_a_mode_that_is_not_a_string_is_one_value_error(lm, mode):
    model, tok, prompt = lm
    with pytest.raises(ValueError, match="fill mode must be one of off, strict, echo, all"):
        build_session(mode, model=model, tokenizer=tok, prompt_ids=prompt)


def test_prediction_source_follows_and_reanchors():
    src = PredictionSource([1, 2, 3, 4, 5, 6, 7, 8, 9], max_span=3)
    view = lambda emitted: DecodeView(prompt=[0], emitted=emitted)
    assert src.propose(view([])).ids == (1, 2, 3)
    assert src.propose(view([1, 2])).ids == (3, 4, 5)
    assert src.propose(view([1, 2, 3, 99])) is None  # diverged, no anchor yet
    assert src.propose(view([1, 2, 3, 99, 5, 6])).ids == (7, 8, 9)  # re-anchored on (5, 6)
    assert src.propose(view([1, 2, 3, 99, 5, 6, 7, 8, 9])) is None  # prediction used up
    assert prediction_text({"type": "content", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}) == "ab"
    with pytest.raises(ValueError, match=r"prediction.content\[0\]"):
        prediction_text({"type": "content", "content": [{"type": "image"}]})


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    knobs = ("MLX_FILL", "MLX_FILL_MAX_SPAN", "MLX_FILL_TRACE", "MLX_FILL_PLAN", "MLX_FILL_SOURCES",
             "MLX_FILL_STORE_TOKENS")
    full = {k: v for k, v in os.environ.items() if k not in knobs}
    return subprocess.run([sys.executable, *code.split("\0")], capture_output=True, text=True, check=False,
                          env={**full, **env}, timeout=120)


PATCHED = ("-c\0import sys, json, mlx_lm.server as s; g = sys.modules['mlx_lm.generate']; "
           "print(json.dumps([getattr(s.ResponseGenerator._is_batchable, '__mlx_fill__', False), "
           "g.generate_step.__module__]))")


def test_hook_installed_and_inert_when_unset():
    purelib = Path(subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    for name in ("mlx_fill.pth", "mlx_fill.start"):
        assert (purelib / name).read_text() == (REPO / "adapters" / "hooks" / name).read_text(), name
    unset = _python("-X\0importtime\0-c\0pass")
    assert "mlx_fill.adapters" not in unset.stderr  # nothing of ours is imported when unset
    assert json.loads(_python(PATCHED, MLX_FILL="off").stdout) == [False, "mlx_lm.generate"]


def test_the_pth_line_spells_off_as_the_modes_do():
    """The ``.pth`` line must import nothing when fill is off, so it repeats the spellings of
    off literally; they are the one list in ``mlx_fill.modes``."""
    line = (REPO / "adapters" / "hooks" / "mlx_fill.pth").read_text()
    start = line.index("not in (") + len("not in ")
    spelled = ast.literal_eval(line[start:line.index(")", start) + 1])
    assert spelled == OFF
    assert all(check_mode(s) == "off" and not enabled(s) for s in OFF)


def test_hook_patches_lazily_and_idempotently():
    again = ("; import mlx_fill.adapters.autoload as a; from mlx_fill.adapters.server_patch "
             "import apply; a.activate(); print(apply(s, 'strict'))")
    r = _python(PATCHED + again, MLX_FILL="strict")
    patched, second = r.stdout.splitlines()
    assert json.loads(patched) == [True, "mlx_fill.core.loop"], r.stderr
    assert second == "False" and "Warning" not in r.stderr
    # Not imported by the hook itself: mlx_lm stays unimported until someone imports it.
    r = _python("-c\0import sys; print('mlx_lm' in sys.modules)", MLX_FILL="strict")
    assert r.stdout.strip() == "False"


def test_hook_fails_open_with_one_warning_line(monkeypatch, capsys):
    class NotAServer:  # a module whose shape does not match mlx-lm 0.32's server
        class ResponseGenerator:
            def _is_batchable(self):
                return True

    monkeypatch.setenv("MLX_FILL", "strict")
    monkeypatch.setattr(autoload, "_warned", False)
    autoload._patch("mlx_lm.server", NotAServer)
    autoload._patch("mlx_lm.server", NotAServer)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-fill: not activated"), lines
    assert lines[0].endswith("runs unchanged")
    assert not hasattr(NotAServer.ResponseGenerator._is_batchable, "__mlx_fill__")


@pytest.mark.parametrize("env", [{"MLX_FILL": "turbo"},
                                 {"MLX_FILL": "all", "MLX_FILL_SOURCES": "echo,warp"},
                                 {"MLX_FILL": "strict", "MLX_FILL_PLAN": "/nonexistent/plan.json"}],
                         ids=["bad-mode", "bad-spec", "missing-plan"])
def test_bad_configuration_fails_open_in_server_process(env):
    r = _python(PATCHED, **env)
    assert json.loads(r.stdout) == [False, "mlx_lm.generate"]
    assert r.stderr.count("mlx-fill: not activated") == 1


def test_strict_fill_on_a_scripted_tool_call_is_lossless(lm, monkeypatch):
    """A logits processor makes the random model write the template's own rendering of a tool
    call; strict fill injects the scaffold (rows priced as free, so the cost gate lets every
    row through) and the tokens stay exactly the fill-off tokens."""
    model, tok, _ = lm
    price_rows_as_free(monkeypatch)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    full = tok.apply_chat_template([*msgs, call], tools=TOOLS)
    assert full[:len(prompt)] == prompt
    script = full[len(prompt):]
    script = script[:next(i for i, t in enumerate(script) if t in tok.eos_token_ids) + 1]

    @pure_processor  # a function of the tokens it is given: fill may run it on rejected rows
    def follow_script(tokens, logits):
        nxt = script[min(tokens.shape[-1] - len(prompt), len(script) - 1)]
        return mx.where(mx.arange(logits.shape[-1]) == nxt, 0.0, -mx.inf)[None] + 0 * logits

    kw = {"max_tokens": 80, "logits_processors": [follow_script]}
    off = tokens_of(stream_generate(model, tok, prompt, **kw))
    session = build_session("strict", model=model, tokenizer=tok, prompt_ids=prompt,
                            messages=msgs, tools=TOOLS)
    on = list(stream_generate(model, tok, prompt, fill=session, **kw))
    assert tokens_of(on) == off
    assert tok.decode(off).startswith(tok.decode(script[:-1]))
    stats = on[-1].fill.as_dict()
    assert stats["injected"] > 0
    assert any(origin.startswith("strict") for origin in stats["by_origin"])


def test_prediction_is_priced_per_draft_by_the_cost_gate():
    """On a cost curve where a 2-row forward costs 1.6 one-row forwards, a prediction (priced on
    its estimate, as a session prices it) is first kept as a shadow; once its ids are seen to
    match it is proposed, and after it stops matching (re-anchored drafts that are wrong) it is
    declined again."""
    steep = DispatchPlan(key=None, max_chunk=16, cost={2: 1.6, 4: 2.0, 8: 3.2, 16: 6.0}, qualified=True)
    right = list(range(100, 140))
    src = PredictionSource(right, max_span=16,
                           gate=CostGate(steep, 16, acceptance=DraftAcceptance(16, z=0.0)))
    view = lambda emitted: DecodeView(prompt=[0], emitted=emitted)
    assert src.propose(view([])) is None  # at the prior nothing pays: a shadow draft
    assert src.propose(view(right[:12])) is not None  # the shadow matched position by position
    p = src.propose(view(right[:12]))
    src.feedback(p, len(p.ids))
    assert len(p.ids) > 1
    gate = src.gate
    for _ in range(30):  # rounds whose drafts are rejected at once close it again
        gate.observe(16, 0, key=("sync",))
    assert src.propose(view(right[:13])) is None


def test_round_overhead_is_the_plans_in_the_loop_and_nothing_in_mlx_lm_server(lm, monkeypatch):
    """The serial loop's plain steps are pipelined, so its rounds pay the plan's measured
    round overhead; mlx_lm.server reads every token's logprob before the next step, so its
    sessions price a round by its rows alone."""
    from types import SimpleNamespace

    import mlx_fill.session as session_module
    from mlx_fill.adapters import server_patch
    model, tok, prompt = lm
    real = session_module.plan_for
    monkeypatch.setattr(session_module, "plan_for",
                        lambda m, group=None: replace(real(m, group), round_overhead=0.3))
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    session = build_session("all", model=model, tokenizer=tok, prompt_ids=prompt, messages=msgs,
                            tools=TOOLS)
    assert session.pace.round_overhead == 0.3
    gates = [s.gate for s in session.sources if getattr(s, "gate", None) is not None]
    assert gates and all(g.pace is session.pace for g in gates)
    args = SimpleNamespace(sampling=SimpleNamespace(temperature=0.0), seed=None, logprobs=False,
                           top_logprobs=-1)
    request = server_patch.FillRequest("all", {"messages": msgs, "tools": TOOLS}, prompt_ids=prompt)
    served = server_patch.ServerFill("all").open_session(request, args,
                                                         {"tokenizer": tok, "model": model})
    assert served.stats.refusals == {} and served.pace.round_overhead == 0.0


def test_hook_all_drafts_from_one_store_of_the_replies_it_served(lm, monkeypatch):
    """``MLX_FILL=all`` in ``mlx_lm.server``: every request's suffix source reads and extends
    one cross-request store of the served model's replies, bounded by
    ``MLX_FILL_STORE_TOKENS``; a request for another model starts a new one; other modes keep
    none. Decoding through it changes no token."""
    from types import SimpleNamespace

    from mlx_fill.adapters import server_patch
    from mlx_fill.spec.suffix import SuffixDraft
    model, tok, prompt = lm
    monkeypatch.setenv("MLX_FILL_STORE_TOKENS", "5000")
    msgs = [{"role": "user", "content": "hello"}]
    args = SimpleNamespace(sampling=SimpleNamespace(temperature=0.0), seed=None, logprobs=False,
                           top_logprobs=-1)
    state = server_patch.ServerFill("all")

    def serve(model_key: str) -> tuple[list[int], SuffixDraft]:
        request = server_patch.FillRequest("all", {"messages": msgs, "tools": TOOLS},
                                           prompt_ids=list(prompt))
        session = state.open_session(request, args, {"tokenizer": tok, "model": model},
                                     model_key=model_key)
        suffix = [s.source.source for s in session.sources if s.name == "suffix"]
        return tokens_of(stream_generate(model, tok, prompt, max_tokens=24, fill=session)), suffix[0]

    stock = tokens_of(stock_stream_generate(model, tok, prompt, max_tokens=24))
    first, first_suffix = serve("m")
    store = state.store_for("m")
    assert first == stock and store.max_tokens == 5000 and first_suffix.global_tree is store
    (doc,) = store.docs.values()
    assert doc[:8] == list(prompt[-8:]) and len(doc) > 8 and doc[8:] == first[:len(doc) - 8]
    second, second_suffix = serve("m")
    assert second == stock and second_suffix.global_tree is store and len(store.docs) == 2
    assert state.store_for("other") is not store and len(state.store_for("other")) == 0
    assert server_patch.ServerFill("strict").store_for("m") is None
