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
import math
import tempfile
from pathlib import Path
from typing import Callable


class UserError(Exception):
    """A mistake the user can fix; the message says what is wrong and what to do."""


# what a command says of an input path that exists but is no regular file (a transcripts file
# is opened more than once, which a pipe such as the shell's ``<(...)`` does not allow)
NOT_REGULAR = "is not a regular file (a pipe or a device); save what it holds to a file and pass that"


def existing_file(value: str) -> Path:
    """argparse ``type=``: a path that must be an existing (regular) file."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a folder; pass a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{value} {NOT_REGULAR}" if path.exists()
                                         else f"no such file: {value}")
    return path


def positive_int(value: str) -> int:
    """argparse ``type=``: an integer of at least 1."""
    return _int_from(value, 1)


def non_negative_int(value: str) -> int:
    """argparse ``type=``: an integer of at least 0."""
    return _int_from(value, 0)


def _int_from(value: str, low: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < low:
        raise argparse.ArgumentTypeError(f"{value} is not at least {low}")
    return number


def model_dir(value: str) -> Path:
    """argparse ``type=``: a local mlx-lm model directory (one holding ``config.json`` and
    ``model*.safetensors`` weights, the files ``mlx_lm.load`` reads)."""
    path = Path(value)
    if not (path / "config.json").is_file():
        what = ("has no config.json" if path.is_dir()
                else "is a file, not a folder" if path.exists() else "does not exist")
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


def int_up_to(high: int) -> Callable[[str], int]:
    """argparse ``type=``: an integer from 1 to ``high``."""
    def parse(value: str) -> int:
        number = positive_int(value)
        if number > high:
            raise argparse.ArgumentTypeError(f"{value} is more than {high}; pass at most {high}")
        return number
    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse ``type=``: a finite number from ``low`` to ``high`` (above ``low`` when
    ``low_open``)."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"{value} is not a finite number")
        if number < low or (low_open and number == low):
            bound = "above" if low_open else "at least"
            raise argparse.ArgumentTypeError(f"{value} is not {bound} {low:g}")
        if number > high:
            raise argparse.ArgumentTypeError(f"{value} is more than {high:g}; pass at most {high:g}")
        return number
    return parse


def unwritable(folder: Path) -> str | None:
    """Why no file could be created in ``folder`` (made when missing): its nearest existing
    ancestor is a file, or takes no new file; None when one could."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".mlx-fill-probe-"):
            pass
    except OSError as err:
        return f"{existing} takes no new files ({err.strerror or err})"
    return None


def output_file(value: str) -> Path:
    """argparse ``type=``: a path to write a file at: not a folder, and in a folder that exists
    or can be created (the writer creates it)."""
    if not value:
        raise argparse.ArgumentTypeError("an empty path; pass a file path")
    path = Path(value)
    problem = f"{value} is a folder" if path.is_dir() else unwritable(path.parent)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {value}: {problem}; pass another file path")
    return path


def replaced_file(value: str) -> Path:
    """argparse ``type=``: :func:`output_file`, for a writer that replaces the file whole (a new
    file renamed onto the path): not an existing pipe or device, which the rename would remove."""
    path = output_file(value)
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"cannot write {value}: it is not a regular file (a pipe "
                                         f"or a device), and writing would replace it; pass a "
                                         f"file path")
    return path


def output_dir(value: str) -> Path:
    """argparse ``type=``: a folder to write files into: an existing folder, or a path where one
    can be created (the writer creates it)."""
    if not value:
        raise argparse.ArgumentTypeError("an empty path; pass a folder")
    path = Path(value)
    problem = unwritable(path)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write into {value}: {problem}; pass another folder")
    return path
