"""``mlx-fill`` command line. Each subcommand lives in its own module, imported only when used.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` (the exit code).
A user mistake (a bad argument, or a :class:`~mlx_fill.core.errors.UserError` raised where it is
detected) prints one line, ``mlx-fill COMMAND: what is wrong and what to do``, on stderr and
exits 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import stat
import sys

from mlx_fill.core.errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mlx_fill.evidence.demo", "run a multi-turn tool-calling exchange with fill off and on"),
    "qualify": ("mlx_fill.core.qualify", "measure exact chunk sizes and the cost curve; write a plan"),
    "plan": ("mlx_fill.core.resolve", "show the dispatch plan a model gets, its key and source"),
    "fixture": ("mlx_fill.assets.fixtures", "print the path of a loadable fixture model directory"),
    "assets": ("mlx_fill.assets.store", "resolve or fetch tokenizer/template assets"),
    "audit": ("mlx_fill.evidence.audit", "compile strict rows for tools and audit them on a corpus"),
    "serve": ("mlx_fill.serve_cli", "OpenAI-compatible endpoint with fill"),
    "study": ("mlx_fill.evidence.study", "model-free corpus study of proposal sources"),
    "replay": ("mlx_fill.evidence.replay", "replay agent sessions against an OpenAI endpoint"),
    "ab": ("mlx_fill.evidence.replay", "paired A/B replay: a reference endpoint against one or more candidates"),
    "report": ("mlx_fill.evidence.report", "agreement and wall-clock verdicts for replay runs"),
}
# the optional dependencies, by the extra that installs them
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "matplotlib": "evidence", "openai": "evidence",
          "gguf": "models"}


def _usage() -> str:
    lines = ["usage: mlx-fill COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<9} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse help with each argument's default appended, unless its help already names its
    default or it has none to show (None, or a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument raised as a one-line :class:`UserError` (not usage + exit),
    and every default in the help (subcommand parsers too)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def main(argv: list[str] | None = None) -> int:
    """Run ``mlx-fill ARGV`` (default: the process's arguments); the exit code. A reader of
    stdout that leaves early (``mlx-fill plan ... | head``) ends the command quietly, as it
    ends any other command of a pipeline: exit 141 (128 + SIGPIPE), the rest not printed."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush
        return 141
    return code


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command: the usage, as for any other missing argument
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "--version":
        from mlx_fill import __version__
        print(__version__)
        return 0
    if name not in COMMANDS:
        print(f"mlx-fill: unknown command {name!r} (see `mlx-fill --help`)", file=sys.stderr)
        return 2
    try:
        return _run(name, rest)
    except KeyboardInterrupt:  # what was being written is written whole or not at all
        print(f"mlx-fill {name}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # an optional extra that is not installed
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"mlx-fill {name}: needs {e.name} (pip install 'mlx-fill[{extra}]')", file=sys.stderr)
        return 2


def _run(name: str, rest: list[str]) -> int:
    module = importlib.import_module(COMMANDS[name][0])
    parser = _Parser(prog=f"mlx-fill {name}", description=COMMANDS[name][1])
    if hasattr(module, "add_arguments_for"):
        module.add_arguments_for(name, parser)
    else:
        module.add_arguments(parser)
    try:
        args = parser.parse_args(rest)
        args.command = name
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"mlx-fill {name}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
