"""Activation inside an unmodified mlx-lm process: ``MLX_FILL=strict mlx_lm.server ...``.

Installing mlx-fill puts ``mlx_fill.pth`` (and the PEP 829 ``mlx_fill.start``) at the root of
site-packages. Its line checks ``MLX_FILL`` and returns at once when it is unset or ``off``
(nothing is imported then); otherwise it calls :func:`activate`, which installs a post-import
hook: when ``mlx_lm.generate`` / ``mlx_lm.server`` finish executing (or right away if they are
already imported) the fill patches are applied. mlx-lm is never imported by the hook itself.

Patching is version-gated (:data:`SUPPORTED`), signature-checked, idempotent and fail-open: if
anything does not match, one warning is printed and mlx-lm runs unchanged.
``python -m mlx_lm.server`` runs server.py as ``__main__`` and is not hooked; use the
``mlx_lm.server`` console script or ``mlx_lm server``.
"""

from __future__ import annotations

import os
import sys

from mlx_fill.modes import enabled

ENV = "MLX_FILL"
SUPPORTED = ("0.32.",)  # mlx-lm version prefixes whose private server API was checked
WATCHED = ("mlx_lm.generate", "mlx_lm.server")
_warned = False


def warn_once(message: str) -> None:
    """The single fail-open warning of this process: one line on stderr."""
    global _warned
    if not _warned:
        _warned = True
        print(f"mlx-fill: {message}; mlx-lm runs unchanged", file=sys.stderr, flush=True)


def _patch(name: str, module) -> None:
    """Apply the patch for ``name`` to the executed ``module``; fail open on any mismatch."""
    try:
        from mlx_fill.session import check_env, check_mode
        mode = check_mode(os.environ.get(ENV))
        check_env()
        version = getattr(sys.modules.get("mlx_lm"), "__version__", "")
        if not version.startswith(SUPPORTED):
            raise RuntimeError(f"mlx-lm {version or '?'} is not a supported version {SUPPORTED}")
        if name == "mlx_lm.generate":
            from .mlx_lm import install_generate_step
            install_generate_step()
        else:
            from .server_patch import apply
            apply(module, mode)
    except Exception as e:  # noqa: BLE001 -- fail open: the server must start unpatched rather than not at all
        warn_once(f"not activated ({type(e).__name__}: {e})")


class _Loader:
    """Wraps a module loader: executes the module, then patches it."""

    def __init__(self, name: str, loader):
        self._name = name
        self._loader = loader

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _patch(self._name, module)


class _Finder:
    """A ``sys.meta_path`` finder that only wraps the loaders of :data:`WATCHED` modules."""

    def find_spec(self, name, path=None, target=None):
        if name not in WATCHED:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (site-packages, editable, ...)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(name, spec.loader)
        return spec


def activate() -> None:
    """Install the post-import hook if ``MLX_FILL`` is set. Idempotent; cheap when unset."""
    if not enabled(os.environ.get(ENV)):
        return
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name in WATCHED:
        if name in sys.modules:
            _patch(name, sys.modules[name])
