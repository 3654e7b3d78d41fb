"""``mlx-fill serve``: an OpenAI-compatible endpoint (FastAPI + uvicorn) with fill.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (tools, tool_choice, stream with SSE
and ``stream_options.include_usage``, stop, max_tokens, temperature, top_p, prediction),
``GET /health`` (also reports MLX active/peak memory). Errors are OpenAI-shaped
(``{"error": {message, type, param, code}}``, 404/405 included): 400 for malformed
tools/schemas/predictions and anything over a :class:`~mlx_fill.limits.Limits` bound (JSON and
schema depth and size, tools, rendered prompt tokens, ``max_tokens``), 413 for bodies over
``--max-request-bytes``, 422 for values of the wrong type; bad input never yields a 500, and a
bad streamed request fails before its first chunk. Request checks run off the event loop.

One worker thread owns the model (MLX work never runs on two threads). Prompts are rendered with
the model directory's own chat template (requests cannot supply one, and
``chat_template_kwargs`` may set only the variables that template reads) through transformers'
``ImmutableSandboxedEnvironment``. mlx-lm's ``LRUPromptCache`` keeps the KV cache of each
finished turn under prompt + generated ids, so the next turn of a conversation only prefills
its new suffix; the fill loop's invariant (cache == prompt + yielded ids, also when a client
disconnects mid-span) keeps those entries exact. A client that disconnects cancels its
generation at the next token, or during prefill at the next chunk (a cut prefill is not cached);
at shutdown in-flight requests get ``--shutdown-grace-s``, then stop the same way. Binds
127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_fill.core.errors import UserError, model_ref
from mlx_fill.limits import DEFAULT_LIMITS, Limits, over_compile_budget
from .body import decode_body, error_response, read_body
from .openai_request import ChatRequest, RequestError, parse_chat_request
from .template_vars import tokenizer_template_variables

DEFAULT_MAX_TOKENS = 512
DEFAULT_PREFILL_STEP = 2048
DEFAULT_PROMPT_CACHE_BYTES = 8 << 30


class PrefillCancelled(Exception):
    """Raised between prefill chunks when the client left or the server is shutting down."""


@dataclass
class Outcome:
    """One finished generation."""

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    usage_extra: dict = field(default_factory=dict)


class Engine:
    """The model, its tokenizer, the prompt cache and the fill configuration. Not thread-safe:
    :class:`App` calls it from one worker thread only."""

    def __init__(self, model_path: str, *, fill: str = "strict", draft_model: str | None = None,
                 prompt_cache_size: int = 8, max_tokens: int = DEFAULT_MAX_TOKENS,
                 limits: Limits = DEFAULT_LIMITS, prefill_step_size: int = DEFAULT_PREFILL_STEP,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES, dtype: str | None = None):
        import mlx_lm
        from mlx_lm.models.cache import LRUPromptCache

        from mlx_fill.session import check_env, check_mode
        self.model_path = model_path
        self.fill = check_mode(fill)
        check_env()
        from mlx_fill.core.resolve import prepare  # dispatch plans: qualified at start-up, not in a request
        self.model, self.tokenizer = mlx_lm.load(model_path)
        if dtype is not None:  # the floating-point weights cast, as model.set_dtype does
            import mlx.core as mx
            self.model.set_dtype(getattr(mx, dtype))
            # evaluated here: a lazy cast recorded on this thread's stream cannot be evaluated
            # by the worker thread that generates ("There is no Stream(cpu, 0) in current thread")
            mx.eval(self.model.parameters())
        if self.fill != "off":
            prepare(self.model)
        self.draft = None
        if draft_model is not None:
            from mlx_fill.spec.draft import check_same_tokenizer
            self.draft, draft_tokenizer = mlx_lm.load(draft_model)
            check_same_tokenizer(draft_tokenizer, self.tokenizer)
            if self.fill != "off":
                prepare(self.draft)
        self.prompt_cache = LRUPromptCache(prompt_cache_size, max_bytes=prompt_cache_bytes)
        self.limits = limits
        self.max_tokens = min(max_tokens, limits.max_tokens_ceiling)
        self.prefill_step_size = prefill_step_size
        self.template_vars = tokenizer_template_variables(self.tokenizer)
        self.stopping = threading.Event()  # set at shutdown: every generation stops
        self.ledger = None
        if self.fill != "off":
            from mlx_fill.session import server_ledger
            self.ledger = server_ledger(str(model_path), self.tokenizer)
        self.acceptance: dict = {}  # per-draft acceptance estimates, kept for the server's lifetime
        self.global_tree = None
        if self.fill == "all":
            from mlx_fill.spec.suffix import GlobalSuffixTree
            self.global_tree = GlobalSuffixTree()

    def parse(self, body: Any) -> ChatRequest:
        """:func:`parse_chat_request` under this engine's limits and template variables."""
        return parse_chat_request(body, limits=self.limits, template_vars=self.template_vars)

    def render(self, req: ChatRequest) -> list[int]:
        """The prompt ids; RequestError (400 ``context_length_exceeded``) above
        ``limits.max_prompt_tokens``."""
        tools = None if req.tool_choice == "none" else req.tools
        try:
            ids = self.tokenizer.apply_chat_template(
                req.messages, tools=tools, add_generation_prompt=True, tokenize=True,
                **req.chat_template_kwargs)
        except Exception as e:  # noqa: BLE001 -- template errors are the request's (e.g. a role it rejects)
            raise RequestError(400, f"messages: the model's chat template rejected the request "
                                    f"({type(e).__name__}: {e})", "messages") from None
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(400, f"messages: the rendered prompt is {len(ids)} tokens, at most "
                                    f"{self.limits.max_prompt_tokens}", "messages",
                               "context_length_exceeded")
        return list(ids)

    def _session(self, req: ChatRequest, prompt_ids: list[int]):
        from mlx_fill.session import build_session
        refuse = "compile_budget" if over_compile_budget(req.tools, self.limits) else None
        session = build_session(
            self.fill, model=self.model, tokenizer=self.tokenizer, prompt_ids=prompt_ids,
            messages=req.messages, tools=req.tools, template_kwargs=req.chat_template_kwargs,
            temperature=req.temperature, seed=req.seed, prediction=req.prediction,
            global_tree=self.global_tree, ledger=self.ledger, draft_model=self.draft,
            refuse=refuse, acceptance=self.acceptance)
        return session

    def _thinking_open(self, prompt_ids: list[int]) -> bool:
        """The prompt leaves a reasoning block open (the output starts inside it)."""
        start = getattr(self.tokenizer, "think_start_id", None)
        end = getattr(self.tokenizer, "think_end_id", None)
        if not getattr(self.tokenizer, "has_thinking", False) or start is None or start not in prompt_ids:
            return False
        last = len(prompt_ids) - 1 - prompt_ids[::-1].index(start)
        return end not in prompt_ids[last:]

    def _cache_for(self, prompt_ids: list[int]):
        from mlx_lm.models.cache import (
            can_trim_prompt_cache,
            make_prompt_cache,
            trim_prompt_cache,
        )
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.model_path, prompt_ids)
        if cache is not None and not rest:  # exact hit: re-feed the last id for its logits
            if can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1) == 1:
                rest = prompt_ids[-1:]
            else:
                cache = None
        if cache is None:
            return make_prompt_cache(self.model), list(prompt_ids)
        return cache, list(rest)

    def prepare(self, req: ChatRequest) -> Prepared:
        """Render the prompt and build the fill session; RequestError (400) when the template or
        the fill sources reject the request. Runs on the worker thread, before any response."""
        prompt_ids = self.render(req)
        try:
            session = self._session(req, prompt_ids)
        except ValueError as e:
            raise RequestError(400, str(e), str(e).split(":", 1)[0]) from None
        return Prepared(req, prompt_ids, session)

    def generate(self, prepared: Prepared, cancelled: threading.Event,
                 on_text: Callable[[str], None] | None = None) -> Outcome | None:
        """Run one prepared request; ``on_text`` receives content deltas as they become final
        (tool-call text and text that may still turn into a marker or stop string are held
        back). ``cancelled`` (or the engine's ``stopping``) stops it at the next token, or
        between two prefill chunks. Returns None when cancelled before its first token; a
        prefill cut short leaves no prompt-cache entry."""
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        from mlx_fill.session import end_session, predicted_count, usage_extra
        from mlx_fill.adapters.mlx_lm import generate_step

        req, prompt_ids, session = prepared.req, prepared.prompt_ids, prepared.session
        def stop() -> bool:
            return cancelled.is_set() or self.stopping.is_set()

        def between_chunks(_done: int, _total: int) -> None:
            if stop():
                raise PrefillCancelled

        if stop():
            end_session(session)
            return None
        cache, rest = self._cache_for(prompt_ids)
        max_tokens = req.max_tokens or self.max_tokens
        sampler = make_sampler(temp=req.temperature, top_p=req.top_p)
        if req.seed is not None:
            mx.random.seed(req.seed)
        splitter = OutputSplitter(self.tokenizer, req.stop, on_text,
                                  thinking_open=self._thinking_open(prompt_ids))
        detok = self.tokenizer.detokenizer
        eos = set(self.tokenizer.eos_token_ids)
        tokens: list[int] = []
        finish = "length"
        steps = generate_step(mx.array(rest), self.model, fill=session, max_tokens=max_tokens,
                              sampler=sampler, prompt_cache=cache,
                              prefill_step_size=self.prefill_step_size,
                              prompt_progress_callback=between_chunks)
        prefilled = False
        try:
            for token, _ in steps:
                prefilled = True
                tokens.append(token)
                if stop():
                    finish = "cancelled"
                    break
                if token in eos:
                    finish = "stop"
                    break
                detok.add_token(token)
                if splitter.feed(detok.last_segment):
                    finish = "stop"
                    break
        except PrefillCancelled:
            finish = "cancelled"
        finally:
            steps.close()  # the cache now holds prompt + every yielded id
            end_session(session, self.ledger)
            if prefilled:  # a prefill cut between chunks holds only part of the prompt
                self.prompt_cache.insert_cache(self.model_path, prompt_ids + tokens, cache)
        if not prefilled:
            return None
        if finish == "length":
            detok.finalize()
            splitter.feed(detok.last_segment)
        predicted = (None if req.prediction is None
                     else predicted_count(self.tokenizer, req.prediction))
        extra = usage_extra(session, predicted=predicted)
        text = splitter.finish()
        return Outcome(text, tokens, finish, len(prompt_ids), len(prompt_ids) - len(rest), extra)


@dataclass
class Prepared:
    """A request whose prompt is rendered and whose fill session (None: fill off) is built."""

    req: ChatRequest
    prompt_ids: list[int]
    session: Any


class OutputSplitter:
    """Accumulates decoded text, cuts it at the first stop string, and streams the part that is
    final content: after a reasoning block (``<think>...</think>`` when the tokenizer has one,
    opened by the output or left open by the prompt), before a tool-call start marker, minus any
    tail that could still begin a marker or a stop string. :func:`split_output` splits the
    finished text the same way, so streamed content equals non-streamed content."""

    def __init__(self, tokenizer: Any, stop: list[str], on_text: Callable[[str], None] | None,
                 *, thinking_open: bool = False):
        self.text = ""
        self.stop = stop
        self.start = getattr(tokenizer, "tool_call_start", None) or None
        thinking = getattr(tokenizer, "has_thinking", False)
        self.think_start = getattr(tokenizer, "think_start", None) if thinking else None
        self.think_end = getattr(tokenizer, "think_end", None) if thinking else None
        self.thinking_open = thinking_open and self.think_end is not None
        self.on_text = on_text
        self.sent: int | None = None
        self.stopped = False

    def feed(self, segment: str) -> bool:
        """Add decoded text; True when a stop string was reached."""
        self.text += segment
        for s in self.stop:
            i = self.text.find(s)
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = True
        self._flush(final=self.stopped)
        return self.stopped

    def _body_start(self, final: bool) -> int | None:
        """Where content begins in ``text``; None while that is not known yet."""
        if self.think_end is None:
            return 0
        if self.think_end in self.text:
            head, tail = self.text.split(self.think_end, 1)
            if not tail.strip("\n") and not final:
                return None  # split_output drops the newlines after the block
            return len(head) + len(self.think_end) + len(tail) - len(tail.lstrip("\n"))
        if final:
            return 0  # an unclosed block stays content, as in split_output
        if self.thinking_open:
            return None
        lead = self.text.lstrip()
        if self.think_start and (lead.startswith(self.think_start) or self.think_start.startswith(lead)):
            return None
        return 0

    def _flush(self, final: bool) -> None:
        if self.on_text is None:
            return
        if self.sent is None:
            self.sent = self._body_start(final)
            if self.sent is None:
                return
        end = len(self.text)
        if self.start and self.start in self.text[self.sent:]:
            end = self.text.index(self.start, self.sent)
        elif not final:
            for marker in [m for m in (self.start, *self.stop) if m]:
                for k in range(min(len(marker) - 1, end), 0, -1):
                    if self.text.endswith(marker[:k]):
                        end = min(end, len(self.text) - k)
                        break
        if end > self.sent:
            self.on_text(self.text[self.sent:end])
            self.sent = end

    def finish(self) -> str:
        self._flush(final=True)
        return self.text


def split_output(tokenizer: Any, text: str, tools: list | None) -> tuple[str, str, list[dict]]:
    """(content, reasoning, tool_calls) of a finished completion, tool calls parsed by the
    tokenizer's mlx-lm tool parser; an unparsable call stays in the content."""
    reasoning = ""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if getattr(tokenizer, "has_thinking", False) and end and end in text:
        head, text = text.split(end, 1)
        reasoning = head.split(start, 1)[-1] if start else head
        reasoning, text = reasoning.strip("\n"), text.lstrip("\n")
    call_start = getattr(tokenizer, "tool_call_start", None)
    call_end = getattr(tokenizer, "tool_call_end", None)
    parser = getattr(tokenizer, "tool_parser", None)
    if not (tools and call_start and parser):
        return text, reasoning, []
    content, calls, rest = [], [], text
    while call_start in rest:
        before, rest = rest.split(call_start, 1)
        content.append(before)
        body, sep, rest = rest.partition(call_end) if call_end else (rest, "", "")
        try:
            parsed = parser(body.strip(), tools)
        except (ValueError, json.JSONDecodeError):
            content.append(call_start + body + sep)
            continue
        for call in parsed if isinstance(parsed, list) else [parsed]:
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"],
                                       "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
    content.append(rest)
    return "".join(content), reasoning, calls


def create_app(engine: Engine):
    """The FastAPI application serving ``engine`` under ``engine.limits``. At shutdown the
    engine's ``stopping`` flag stops any generation still running (within one token or one
    prefill chunk)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.stopping.set()
        worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="mlx-fill", docs_url=None, redoc_url=None, lifespan=lifespan)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-fill-gen")
    model_id = Path(engine.model_path).name or engine.model_path
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
                       e.status_code, str(e.detail))
        return JSONResponse(RequestError(e.status_code, message).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        return JSONResponse({"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                       "type": "server_error", "param": None, "code": None}},
                            status_code=500)

    @app.get("/health")
    async def health():
        import mlx.core as mx
        return {"status": "ok", "model": model_id, "fill": engine.fill,
                "active_memory": mx.get_active_memory(), "peak_memory": mx.get_peak_memory()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "mlx-fill"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await read_body(request, engine.limits)
        body = await run_in_threadpool(decode_body, raw, engine.limits)  # off the event loop
        req = await run_in_threadpool(engine.parse, body)  # schema checks too
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        name = req.model or model_id
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()
        prepared = await loop.run_in_executor(worker, engine.prepare, req)
        if not req.stream:
            future = loop.run_in_executor(worker, engine.generate, prepared, cancelled, None)
            try:
                while not future.done():
                    await asyncio.wait({future}, timeout=0.25)
                    if not future.done() and await request.is_disconnected():
                        cancelled.set()  # the client is gone: stop at the next token or chunk
            finally:
                if not future.done():
                    cancelled.set()  # this handler was cancelled (shutdown past its grace)
            out = await future
            if out is None:
                return error_response(499, "client closed the request")
            content, reasoning, calls = split_output(engine.tokenizer, out.text, req.tools)
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if reasoning:
                message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                    "model": name, "choices": [{"index": 0, "message": message, "logprobs": None,
                                                "finish_reason": _finish(out, calls)}],
                    "usage": _usage(out)}

        queue: asyncio.Queue = asyncio.Queue()

        def on_text(delta: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("text", delta))

        def run() -> None:
            try:
                out = engine.generate(prepared, cancelled, on_text)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", out))
            except BaseException as e:  # noqa: BLE001 -- delivered to the client as an error event
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk",
                                          "created": int(time.time()), "model": name,
                                          "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                       "finish_reason": finish}], **extra}) + "\n\n"

        async def events():
            streamed = ""
            loop.run_in_executor(worker, run)
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    kind, value = await queue.get()
                    if kind == "text":
                        streamed += value
                        yield chunk({"content": value})
                        continue
                    if kind == "error":
                        err = value if isinstance(value, RequestError) else RequestError(
                            500, f"{type(value).__name__}: {value}")
                        yield "data: " + json.dumps(err.body()) + "\n\n"
                        break
                    if value is None:
                        break
                    out: Outcome = value
                    content, reasoning, calls = split_output(engine.tokenizer, out.text, req.tools)
                    delta: dict[str, Any] = {}
                    if content.startswith(streamed) and len(content) > len(streamed):
                        delta["content"] = content[len(streamed):]  # held back, never a call
                    if reasoning:
                        delta["reasoning"] = reasoning
                    if calls:
                        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
                    yield chunk(delta, _finish(out, calls))
                    if req.include_usage:
                        yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk",
                                                     "created": int(time.time()), "model": name,
                                                     "choices": [], "usage": _usage(out)}) + "\n\n"
                    break
                yield "data: [DONE]\n\n"
            finally:
                cancelled.set()  # a disconnected client stops its generation at the next token

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _finish(out: Outcome, calls: list) -> str:
    if calls and out.finish_reason == "stop":
        return "tool_calls"
    return "length" if out.finish_reason == "cancelled" else out.finish_reason


def _usage(out: Outcome) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.tokens),
            "total_tokens": out.prompt_tokens + len(out.tokens),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}, **out.usage_extra}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=model_ref, help="mlx-lm model directory (or hub id)")
    parser.add_argument("--fill", default="strict", choices=("strict", "echo", "all", "off"))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the model's floating-point weights after loading (default: as stored)")
    parser.add_argument("--draft-model", default=None, type=model_ref,
                        help="a smaller model with the same tokenizer, used as a verify source")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="completion length when a request gives none")
    parser.add_argument("--prompt-cache-size", type=int, default=8,
                        help="KV caches kept for reuse across turns")
    parser.add_argument("--prompt-cache-bytes", type=int, default=DEFAULT_PROMPT_CACHE_BYTES,
                        help="bytes of KV caches kept for reuse across turns")
    parser.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP,
                        help="prompt tokens per prefill chunk (a cancelled request stops "
                             "between chunks)")
    for f in dataclasses.fields(Limits):
        parser.add_argument("--" + f.name.replace("_", "-"), type=int,
                            default=f.default, help=f"{f.metadata['help']} (default {f.default})")
    parser.add_argument("--log-level", default="warning")


def limits_from(args: argparse.Namespace) -> Limits:
    """The :class:`Limits` named by the parsed ``--max-*`` flags."""
    return Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})


def run(args: argparse.Namespace) -> int:
    import uvicorn
    try:
        limits = limits_from(args)
    except ValueError as err:
        raise UserError(str(err)) from err
    try:
        engine = Engine(args.model, fill=args.fill, draft_model=args.draft_model,
                        prompt_cache_size=args.prompt_cache_size, max_tokens=args.max_tokens,
                        limits=limits, prefill_step_size=args.prefill_step_size,
                        prompt_cache_bytes=args.prompt_cache_bytes, dtype=args.dtype)
    except (OSError, ValueError) as err:
        remote = [m for m in (args.model, args.draft_model) if m and not Path(m).exists()]
        if not remote:
            raise
        raise UserError(f"could not download {', '.join(remote)} from the Hugging Face Hub "
                        f"({str(err).splitlines()[0]}); pass a local mlx-lm model directory") from err
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=limits.shutdown_grace_s)
    return 0
