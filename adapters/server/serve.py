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

This module is the HTTP app and the command; the engine is :mod:`.engine`, the output splitting
:mod:`.output`.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_fill.core.errors import UserError, model_ref
from mlx_fill.limits import Limits
from .body import decode_body, error_response, read_body
from .engine import (DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP, DEFAULT_PROMPT_CACHE_BYTES, Engine,
                     Outcome)
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
        worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="mlx-fill", docs_url=None, redoc_url=None, lifespan=lifespan)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-fill-gen")
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
    parser.add_argument("--fill", default="strict", choices=("strict", "echo", "all", "off"),
                        help="fill mode for every request: strict (template/schema tokens), echo "
                             "(strict, plus spans copied from the conversation), all (echo, plus "
                             "suffix and n-gram lookups), off (plain decoding)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the model's floating-point weights after loading (default: as stored)")
    parser.add_argument("--draft-model", default=None, type=model_ref,
                        help="a smaller model with the same tokenizer, used as a verify source")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080, help="TCP port to listen on")
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
    parser.add_argument("--log-level", default="warning",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="server log level (info logs one line per request)")


def limits_from(args: argparse.Namespace) -> Limits:
    """The :class:`Limits` named by the parsed ``--max-*`` flags."""
    return Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})


def check_listen(host: str, port: int) -> None:
    """A :class:`UserError` when ``host:port`` cannot be bound (in use, out of range, not an
    address of this machine), said before the model loads."""
    import socket
    if not 0 <= port <= 65535:
        raise UserError(f"cannot listen on {host}:{port} (a port is 0 to 65535); pick another --port")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as err:
        reason = err.strerror or str(err)
        raise UserError(f"cannot listen on {host}:{port} ({reason}); pick another --port or "
                        f"--host") from err


def run(args: argparse.Namespace) -> int:
    import uvicorn
    try:
        limits = limits_from(args)
    except ValueError as err:
        raise UserError(str(err)) from err
    check_listen(args.host, args.port)
    try:
        engine = Engine(args.model, mode=args.fill, draft_model=args.draft_model,
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
