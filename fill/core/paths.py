"""Where mlx-fill keeps per-user state (plans, assets, fixture model dirs, evidence ledger)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .errors import UserError, unwritable


def user_cache_dir() -> Path:
    """``$MLX_FILL_CACHE``, else ``$XDG_CACHE_HOME/mlx-fill``, else ``~/.cache/mlx-fill``. A
    folder named by one of those variables that cannot hold files is a :class:`UserError`
    naming the variable."""
    if os.environ.get("MLX_FILL_CACHE"):
        return _usable("MLX_FILL_CACHE", os.environ["MLX_FILL_CACHE"], "")
    if os.environ.get("XDG_CACHE_HOME"):
        return _usable("XDG_CACHE_HOME", os.environ["XDG_CACHE_HOME"], "mlx-fill")
    return Path(os.path.expanduser("~")) / ".cache" / "mlx-fill"


@functools.lru_cache(maxsize=None)
def _usable(variable: str, value: str, leaf: str) -> Path:
    """``value``/``leaf``, checked once per value: a folder that exists or can be made there."""
    folder = Path(value) / leaf
    problem = unwritable(folder)
    if problem:
        raise UserError(f"{variable}={value} cannot hold the mlx-fill cache: {problem}; set "
                        f"{variable} to a writable folder")
    return folder
