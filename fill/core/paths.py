"""Where mlx-fill keeps per-user state (plans, assets, fixture model dirs, evidence ledger)."""

from __future__ import annotations

import os
from pathlib import Path

def user_cache_dir() -> Path:
    """``$MLX_FILL_CACHE``, else ``$XDG_CACHE_HOME/mlx-fill``, else ``~/.cache/mlx-fill``."""
    if os.environ.get("MLX_FILL_CACHE"):
        return Path(os.environ["MLX_FILL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-fill"
