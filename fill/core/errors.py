"""The one exception type for mistakes a user can fix, and argparse types that detect them early.

A ``UserError`` (a missing file, a bad model path, an unknown name, an offline fetch, a
malformed input file) carries one line that says what is wrong and what to do. ``mlx-fill``
prints it as ``mlx-fill COMMAND: MESSAGE`` on stderr and exits 2; every other exception is a
bug and keeps its traceback. Library code raises it (or a subclass that also derives from the
matching builtin, e.g. ``AssetsMissing(UserError, FileNotFoundError)``) where the mistake is
detected.
"""

from __future__ import annotations

import argparse
from pathlib import Path


class UserError(Exception):
    """A mistake the user can fix; the message says what is wrong and what to do."""


def existing_file(value: str) -> Path:
    """argparse ``type=``: a path that must be an existing file."""
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {value}")
    return path


def positive_int(value: str) -> int:
    """argparse ``type=``: an integer of at least 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return number


def model_dir(value: str) -> Path:
    """argparse ``type=``: a local mlx-lm model directory (one holding ``config.json`` and
    ``model*.safetensors`` weights, the files ``mlx_lm.load`` reads)."""
    path = Path(value)
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
    elif not any(path.glob("model*.safetensors")):
        what = "has no model*.safetensors weights"
    else:
        return path
    raise argparse.ArgumentTypeError(f"{value} {what}; pass an mlx-lm model directory, such as "
                                     f"the one `mlx-fill fixture qwen3-json` prints")


def model_ref(value: str) -> str:
    """argparse ``type=``: a local mlx-lm model directory, or a Hugging Face repo id
    (``owner/name``, which mlx-lm downloads) when no such path exists."""
    path = Path(value)
    looks_like_repo = value.count("/") == 1 and not value.startswith((".", "/", "~"))
    if path.exists() or not looks_like_repo:
        model_dir(value)
    return value
