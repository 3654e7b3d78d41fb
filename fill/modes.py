"""Fill modes, and the one list of spellings that mean "off".

Read by the session (a request's mode), the ``MLX_FILL`` hook (:mod:`mlx_fill.adapters.autoload`)
and ``mlx-fill serve``. The ``.pth`` line (``adapters/hooks/mlx_fill.pth``) repeats
:data:`OFF` literally, because it must import nothing when fill is off; a test keeps the two
equal.
"""

from __future__ import annotations

MODES = ("off", "strict", "echo", "all")
OFF = ("", "off", "0", "false", "no")


def check_mode(mode: str | None) -> str:
    """The normalised mode; ValueError for anything but :data:`MODES` (None and every spelling
    in :data:`OFF` mean off; a value that is not a string is no mode)."""
    if mode is not None and not isinstance(mode, str):
        raise ValueError(f"fill mode must be one of {', '.join(MODES)}; got {mode!r}")
    m = (mode or "").strip().lower()
    if m in OFF:
        return "off"
    if m not in MODES:
        raise ValueError(f"fill mode must be one of {', '.join(MODES)}; got {mode!r}")
    return m


def enabled(value: str | None) -> bool:
    """True when ``value`` (e.g. ``$MLX_FILL``) asks for any fill mode."""
    return (value or "").strip().lower() not in OFF
