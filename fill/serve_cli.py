"""``mlx-fill serve``: the endpoint of :mod:`mlx_fill.adapters.server.serve`, its cross-request
store optionally seeded from recorded sessions (:mod:`mlx_fill.evidence`), which the adapters
layer does not read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_fill.adapters.server import serve
from mlx_fill.adapters.server.engine import STORE_SEED_NEEDS_ALL
from mlx_fill.core.errors import UserError
from mlx_fill.evidence.replay import read_sessions, skipped_lines
from mlx_fill.evidence.transcripts import seed_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument("--store-seed", type=Path, default=None,
                        help="with --fill all: a transcripts file (JSONL, gzip or plain; the "
                             "repository's format, OpenAI chat, Anthropic Messages, Claude Code "
                             "logs, Codex CLI rollouts or API-proxy logs) or a folder of them, "
                             "whose assistant replies, rendered through the model's template, "
                             "fill the cross-request store at start, as if this server had "
                             "served those sessions")


def run(args: argparse.Namespace) -> int:
    if args.store_seed is None:
        return serve.run(args)
    if args.fill != "all":  # said before a large file is read
        raise UserError(STORE_SEED_NEEDS_ALL)
    sessions, corrupt = read_sessions(args.store_seed)
    if corrupt:
        print(f"mlx-fill serve: {args.store_seed}: {skipped_lines(corrupt)}", file=sys.stderr)

    def seed(tokenizer, store) -> None:
        try:
            line = seed_store(store, sessions, tokenizer)
        except ValueError as err:  # the model's template: its replies cannot be cut into turns
            raise UserError(f"--store-seed {args.store_seed}: {err}") from err
        print(f"mlx-fill serve: store seeded from {args.store_seed}: {line}", file=sys.stderr)
    return serve.run(args, store_seed=seed)
