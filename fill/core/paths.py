"""Where mlx-fill keeps per-user state (plans, assets, fixture model dirs, evidence ledger), and
where a repository checkout keeps the files its study, benchmarks and fixture training read."""

from __future__ import annotations

import os
from pathlib import Path

# the checkout an editable install runs from (in an installed wheel: site-packages, which has
# no ``fixtures/``)
REPO_ROOT = Path(__file__).resolve().parents[2]
# the real agent transcripts shipped with the repository (``fixtures/transcripts/README.md``)
TRANSCRIPTS = REPO_ROOT / "fixtures" / "transcripts" / "dev.jsonl.gz"


def user_cache_dir() -> Path:
    """``$MLX_FILL_CACHE``, else ``$XDG_CACHE_HOME/mlx-fill``, else ``~/.cache/mlx-fill``."""
    if os.environ.get("MLX_FILL_CACHE"):
        return Path(os.environ["MLX_FILL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-fill"
