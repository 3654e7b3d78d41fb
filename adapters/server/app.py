"""The HTTP app of ``mlx-fill serve``: an OpenAI-compatible endpoint (FastAPI) with fill.

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
at shutdown in-flight requests get ``--shutdown-grace-s``, then stop the same way.

The command is :mod:`.serve`; the engine :mod:`.engine`; the output splitting :mod:`.output`;
reading and decoding a body :mod:`.body`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .body import decode_body, error_response, read_body
from .engine import Engine, Outcome
from .openai_request import RequestError
from .output import split_output


def create_app(engine: Engine):
    """The FastAPI application serving ``engine`` under ``engine.limits``. At shutdown the
    engine's ``stopping`` flag stops any generation still running (within one token or one
    prefill chunk)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.stopping.set()
        worker.close()

    app = FastAPI(title="mlx-fill", docs_url=None, redoc_url=None, lifespan=lifespan)
    worker = GenerationWorker()
    model_id = Path(engine.model_path).name or engine.model_path
    created = int(time.time())

    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        import mlx.core as mx
        return {"status": "ok", "model": model_id, "fill": engine.mode,
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
        prepared = await asyncio.get_running_loop().run_in_executor(worker, engine.prepare, req)
        if not req.stream:
            return await _complete(engine, worker, request, prepared, rid, name)
        return _stream(engine, worker, prepared, rid, name)

    return app


class GenerationWorker(ThreadPoolExecutor):
    """The one thread every request's model work runs on."""

    def __init__(self):
        super().__init__(max_workers=1, thread_name_prefix="mlx-fill-gen")

    def close(self) -> None:
        """Shut down after the jobs already queued (with the engine stopping, each ends at
        once) and a last one that clears the thread's MLX streams: MLX aborts the process at
        exit when a thread that evaluated has not, and the process exits right after."""
        import mlx.core as mx
        self.submit(mx.clear_streams)
        self.shutdown(wait=False)


def _add_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors: a :class:`RequestError` as it says, 404/405 with the path and method,
    anything else a 500 that names the exception."""

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


async def _complete(engine: Engine, worker: ThreadPoolExecutor, request: Request,
                    prepared: Any, rid: str, name: str):
    """A non-streamed completion; a client that disconnects cancels its generation at the next
    token or prefill chunk (499)."""
    req = prepared.req
    loop = asyncio.get_running_loop()
    cancelled = threading.Event()
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
    content, reasoning, calls = split_output(engine.tokenizer, out.text, req.shown_tools)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": name, "choices": [{"index": 0, "message": message, "logprobs": None,
                                        "finish_reason": _finish(out, calls)}],
            "usage": _usage(out)}


def _stream(engine: Engine, worker: ThreadPoolExecutor, prepared: Any, rid: str,
            name: str) -> StreamingResponse:
    """A streamed completion (SSE): content as it becomes final, then the finish chunk with the
    calls, the usage chunk when asked for, and ``[DONE]``; a disconnect cancels generation."""
    req = prepared.req
    loop = asyncio.get_running_loop()
    cancelled = threading.Event()
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
                content, reasoning, calls = split_output(engine.tokenizer, out.text, req.shown_tools)
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


def _finish(out: Outcome, calls: list) -> str:
    if calls and out.finish_reason == "stop":
        return "tool_calls"
    return "length" if out.finish_reason == "cancelled" else out.finish_reason


def _usage(out: Outcome) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.tokens),
            "total_tokens": out.prompt_tokens + len(out.tokens),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}, **out.usage_extra}
