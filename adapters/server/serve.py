"""``mlx-fill serve``: the command that serves an OpenAI-compatible endpoint with fill.

The app (routes, errors, streaming) is :mod:`.app`; the engine that owns the model is
:mod:`.engine`. Every :class:`~mlx_fill.limits.Limits` bound is a flag. Binds 127.0.0.1 unless
``--host`` says otherwise; a port that cannot be bound is one line, said before the model loads. Once the model is
loaded it prints one line, ``mlx-fill serve: URL/v1 (MODEL, fill MODE)``, with the port it
listens on (any free one for ``--port 0``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import socket
import sys
from collections.abc import Callable
from typing import Any

from mlx_fill.core.errors import UserError, int_up_to, model_ref, positive_int
from mlx_fill.limits import Limits
from mlx_fill.spec.suffix import STORE_TOKENS, STORE_TOKENS_CEILING
from .app import create_app
from .engine import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP, DEFAULT_PROMPT_CACHE_BYTES, Engine

__all__ = ["Engine", "add_arguments", "base_url", "bind", "create_app", "limits_from", "run"]


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
    parser.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                        help="completion length when a request gives none")
    parser.add_argument("--prompt-cache-size", type=positive_int, default=8,
                        help="KV caches kept for reuse across turns")
    parser.add_argument("--prompt-cache-bytes", type=positive_int, default=DEFAULT_PROMPT_CACHE_BYTES,
                        help="bytes of KV caches kept for reuse across turns")
    parser.add_argument("--prefill-step-size", type=positive_int, default=DEFAULT_PREFILL_STEP,
                        help="prompt tokens per prefill chunk (a cancelled request stops "
                             "between chunks)")
    parser.add_argument("--store-tokens", type=int_up_to(STORE_TOKENS_CEILING), default=None,
                        help=f"the cross-request store's bound in ids, oldest replies evicted "
                             f"first (default MLX_FILL_STORE_TOKENS, else {STORE_TOKENS:,}; "
                             f"about 0.3 GB per million)")
    for f in dataclasses.fields(Limits):
        cap = f.metadata["cap"]
        parser.add_argument("--" + f.name.replace("_", "-"),
                            type=positive_int if cap is None else int_up_to(cap),
                            default=f.default, help=f"{f.metadata['help']} (default {f.default})")
    parser.add_argument("--log-level", default="warning",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="server log level (info logs one line per request)")


def limits_from(args: argparse.Namespace) -> Limits:
    """The :class:`Limits` named by the parsed ``--max-*`` flags."""
    return Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and not yet listening (clients are refused until
    :func:`run` listens, after the model loads). Port 0 takes any free port. A
    :class:`UserError` when it cannot be bound (in use, out of range, not an address of this
    machine)."""
    if not 0 <= port <= 65535:
        raise UserError(f"cannot listen on {host}:{port} (a port is 0 to 65535); pick another --port")
    sock = None
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
    except OSError as err:
        if sock is not None:
            sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({err.strerror or err}); pick another "
                        f"--port or --host") from err
    return sock


def base_url(sock: socket.socket) -> str:
    """The URL a client reaches the bound ``sock`` at (its real port when 0 was asked)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def run(args: argparse.Namespace, store_seed: Callable[[Any, Any], None] | None = None) -> int:
    """Serve until stopped. ``store_seed``: fills :class:`Engine`'s store at start."""
    import uvicorn
    try:
        limits = limits_from(args)
    except ValueError as err:
        raise UserError(str(err)) from err
    if args.max_tokens > limits.max_tokens_ceiling:
        raise UserError(f"--max-tokens {args.max_tokens} is above --max-tokens-ceiling "
                        f"{limits.max_tokens_ceiling}; lower it or raise the ceiling")
    sock = bind(args.host, args.port)
    with sock:
        engine = Engine(args.model, mode=args.fill, draft_model=args.draft_model,
                        prompt_cache_size=args.prompt_cache_size, max_tokens=args.max_tokens,
                        limits=limits, prefill_step_size=args.prefill_step_size,
                        prompt_cache_bytes=args.prompt_cache_bytes, dtype=args.dtype,
                        store_tokens=args.store_tokens, store_seed=store_seed)
        config = uvicorn.Config(create_app(engine), log_level=args.log_level,
                                timeout_graceful_shutdown=limits.shutdown_grace_s)
        server = uvicorn.Server(config)
        sock.listen(config.backlog)
        print(f"mlx-fill serve: {base_url(sock)}/v1 ({engine.model_path}, fill {args.fill})",
              file=sys.stderr, flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it shut down on
            server.run(sockets=[sock])
    return 0 if server.started else 1
