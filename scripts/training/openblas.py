"""Run a training script with OpenBLAS serving MLX's CPU matrix products.

The Linux ``mlx[cpu]`` wheel links a reference BLAS: about 2 GFLOP/s on the fixture shapes on 2
cores. Debian's OpenBLAS (``apt-get install libopenblas0-pthread``), preloaded, answers the same
``cblas_*`` symbols. OpenBLAS picks its kernels from the CPU it detects, and under virtualization
0.3.21 may not recognize the processor and fall back to its Prescott (SSE3) kernels. Measured
here on a virtualized Xeon with AVX-512:

    reference BLAS          2.2 GFLOP/s (1024^3), 2.1 (1300x64x6942)
    OpenBLAS, detected      30  (it chose Prescott)          21
    OpenBLAS, SkylakeX      185                              56

So the core type is named from the CPU's ISA flags (``OPENBLAS_CORETYPE``), unless already set.
:func:`reexec` restarts the current script once with both variables set; :func:`describe` says
which BLAS the running process has, for the training record (a different GEMM kernel rounds
differently, and these tiny models' training outcome depends on rounding).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

_MARK = "MLX_FILL_BLAS_REEXEC"


def core_type(flags: set[str]) -> str | None:
    """The OpenBLAS core type for an x86-64 CPU with these ``/proc/cpuinfo`` flags (None: let
    OpenBLAS detect it)."""
    if "avx512f" in flags and "avx512bw" in flags:
        return "SkylakeX"
    if "avx2" in flags and "fma" in flags:
        return "Haswell"
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def reexec() -> None:
    """Restart this process with OpenBLAS preloaded and its core type named, when on Linux with
    ``libopenblas`` installed and not already done; otherwise return and run as is. Set
    ``MLX_FILL_BLAS=bundled`` to keep MLX's own BLAS."""
    if (not sys.platform.startswith("linux") or os.environ.get(_MARK)
            or os.environ.get("MLX_FILL_BLAS") == "bundled" or "openblas" in os.environ.get("LD_PRELOAD", "")):
        return
    library = ctypes.util.find_library("openblas")
    if library is None:
        print("openblas: libopenblas not found (apt-get install libopenblas0-pthread); "
              "training with MLX's bundled BLAS, several times slower", file=sys.stderr)
        return
    env = dict(os.environ, **{_MARK: "1"})
    env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    kind = core_type(_cpu_flags())
    if kind and "OPENBLAS_CORETYPE" not in env:
        env["OPENBLAS_CORETYPE"] = kind
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)  # run as ``python -m scripts.training.…``
    argv = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    os.execve(sys.executable, [sys.executable, *argv], env)


def describe() -> str:
    """``openblas:<core type>`` when OpenBLAS is preloaded in this process, else ``mlx-bundled``."""
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"openblas:{os.environ.get('OPENBLAS_CORETYPE', 'detected')}"
    return "mlx-bundled"
