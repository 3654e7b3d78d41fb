"""Which kernels this process runs: the parts of a dispatch plan's key that are not the model.

A chunked append is bit-identical to serial decoding only under the kernels it was checked with,
and its cost curve belongs to them too. What selects those kernels at run time:

- the MLX build (:func:`mlx_version`): MLX's own CPU and GPU kernels; and the mlx-lm release
  (:func:`mlx_lm_version`), whose model code decides which operations a forward runs;
- on the CPU backend, the BLAS library serving MLX's matrix products (:func:`blas`): the MLX
  Linux CPU wheel links a reference BLAS it bundles (``mlx_cpu.libs/libblas-<hash>.so.3.10.0``),
  but a library preloaded with ``LD_PRELOAD`` (OpenBLAS, as ``scripts/training/openblas.py`` does)
  answers the same ``cblas_*`` symbols first; OpenBLAS in turn picks kernels per core type
  (detected, or forced with ``OPENBLAS_CORETYPE``); on macOS it is Accelerate;
- on Metal or CUDA, the GPU architecture (:func:`device`).

:func:`blas` asks the dynamic linker the question MLX's own symbol lookup answers: the library
that ``cblas_sgemm`` resolves to from the global scope (the executable, ``LD_PRELOAD`` and
``RTLD_GLOBAL`` libraries) if any, else from ``mlx.core``'s own dependencies; ``dladdr`` names
its file. OpenBLAS is then asked for its version and core (``openblas_get_config``,
``openblas_get_corename``). Detection never raises: what cannot be found reads ``unknown``,
which matches no shipped plan.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

UNKNOWN = "unknown"
_GEMM = "cblas_sgemm"
_RTLD_NOLOAD = getattr(os, "RTLD_NOLOAD", 4)


@dataclass(frozen=True)
class Blas:
    """The BLAS serving MLX's CPU matrix products: ``library`` (``openblas``, ``accelerate``, or
    the file's name stem, e.g. ``libblas-bd8a282c`` for the copy the MLX CPU wheel bundles),
    its ``version`` and, for OpenBLAS, the ``core`` type whose kernels it runs."""

    library: str
    version: str
    core: str


NO_BLAS = Blas("none", "", "")  # GPU backends: the model's products run in MLX's GPU kernels


def backend() -> str:
    """``cpu``, ``cuda`` or ``metal``: where the default device runs."""
    if mx.default_device().type == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def device() -> str:
    """The CPU's instruction-set architecture (``x86_64``, ``arm64``) on the CPU backend; the GPU
    architecture (Metal GPU family, CUDA ``sm_XX``) and name on a GPU backend."""
    if backend() == "cpu":
        return platform.machine() or UNKNOWN
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        return UNKNOWN
    parts = [str(info[k]) for k in ("architecture", "device_name") if info.get(k)]
    return " ".join(parts) or UNKNOWN


def mlx_version() -> str:
    return str(getattr(mx, "__version__", UNKNOWN))


@functools.cache
def mlx_lm_version() -> str:
    """The installed mlx-lm release (read once per process)."""
    try:
        return importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _symbol_file(handle: ctypes.CDLL, name: str) -> str | None:
    """The file that defines ``name`` as seen through ``handle`` (None when undefined)."""
    try:
        address = ctypes.cast(getattr(handle, name), ctypes.c_void_p)
    except AttributeError:
        return None
    libdl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
    info = _DlInfo()
    if not libdl.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def gemm_library() -> str | None:
    """Path of the library ``cblas_sgemm`` resolves to for MLX (global scope first, as the
    dynamic linker binds it), or None when it cannot be found."""
    try:
        found = _symbol_file(ctypes.CDLL(None), _GEMM)
        if found is None:
            found = _symbol_file(ctypes.CDLL(mx.__file__, mode=_RTLD_NOLOAD), _GEMM)
    except OSError:
        return None
    return found


def _openblas(lib: ctypes.CDLL) -> Blas | None:
    try:
        get_config, get_core = lib.openblas_get_config, lib.openblas_get_corename
    except AttributeError:
        return None
    get_config.restype = get_core.restype = ctypes.c_char_p
    config = (get_config() or b"").decode(errors="replace")
    version = re.search(r"OpenBLAS\s+([0-9][\w.]*)", config)
    return Blas("openblas", version.group(1) if version else UNKNOWN,
                (get_core() or b"").decode(errors="replace") or UNKNOWN)


def describe_library(path: str) -> Blas:
    """:class:`Blas` for the library file at ``path`` (loaded already)."""
    name = Path(path).name
    if "Accelerate" in path or name.startswith("libBLAS"):
        return Blas("accelerate", platform.mac_ver()[0] or UNKNOWN, "")
    try:
        found = _openblas(ctypes.CDLL(path, mode=_RTLD_NOLOAD))
    except OSError:
        found = None
    if found is not None:
        return found
    stem, _, version = name.partition(".so")
    return Blas(stem.removesuffix(".dylib"), version.lstrip(".") or UNKNOWN, "")


def blas() -> Blas:
    """The BLAS MLX's CPU backend calls in this process (:data:`NO_BLAS` on a GPU backend)."""
    return _cpu_blas() if backend() == "cpu" else NO_BLAS


@functools.cache
def _cpu_blas() -> Blas:
    """Found once per process: the library a symbol binds to does not change after start-up
    (``LD_PRELOAD`` is read at exec), and every request's plan key asks for it."""
    path = gemm_library()
    return describe_library(path) if path else Blas(UNKNOWN, UNKNOWN, UNKNOWN)
