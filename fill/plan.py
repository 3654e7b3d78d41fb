"""Dispatch plans: which chunk sizes and chunk ends keep an append bit-identical to serial decode.

A plan belongs to a configuration (:class:`PlanKey`: backend, device architecture, activation
dtype, weight quantization) and is produced by ``mlx-fill qualify`` on the machine itself.
``exact`` plans cut chunks at ``max_chunk`` and at every KV length in ``kv_boundaries`` (where a
backend switches attention or matmul kernels); ``fast`` plans use the largest chunk and accept
batched-verify numerics. A configuration with no qualified plan gets chunks of one token.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from .paths import user_cache_dir

PlanMode = Literal["exact", "fast"]
FAST_MAX_CHUNK = 64


@dataclass(frozen=True)
class PlanKey:
    """The configuration a plan was qualified for."""

    backend: str
    device: str
    dtype: str
    quant: str

    def slug(self) -> str:
        return "-".join(p.replace(" ", "_").replace("/", "_") for p in
                        (self.backend, self.device, self.dtype, self.quant))


@dataclass(frozen=True)
class DispatchPlan:
    """Chunking rule for appends. ``cost[m]`` = time(m-row forward) / time(1-row forward)."""

    key: PlanKey | None
    mode: PlanMode = "exact"
    max_chunk: int = 1
    kv_boundaries: tuple[int, ...] = ()
    cost: dict[int, float] = field(default_factory=dict)
    qualified: bool = False

    def chunks(self, start: int, n: int) -> list[int]:
        """Sizes of consecutive chunks covering ``n`` ids appended at KV length ``start``.

        Every chunk is at most ``max_chunk`` long and, in ``exact`` mode, no chunk crosses a
        KV length listed in ``kv_boundaries`` (a chunk may end exactly at one).
        """
        limit = self.max_chunk if self.mode == "exact" else max(self.max_chunk, FAST_MAX_CHUNK)
        sizes: list[int] = []
        pos, end = start, start + n
        cuts = sorted(b for b in self.kv_boundaries if start < b < end) if self.mode == "exact" else []
        while pos < end:
            stop = min(end, pos + limit)
            for b in cuts:
                if pos < b < stop:
                    stop = b
                    break
            sizes.append(stop - pos)
            pos = stop
        return sizes

    def cost_of(self, m: int) -> float:
        """c(m) in one-row-forward units: measured where known, linear interpolation between
        measured points, linear extrapolation (pessimistic) beyond them, ``m`` when unmeasured."""
        if m <= 1:
            return 1.0
        if not self.cost:
            return float(m)
        pts = sorted({1: 1.0, **self.cost}.items())
        for (m0, c0), (m1, c1) in zip(pts, pts[1:]):
            if m0 <= m <= m1:
                return c0 + (c1 - c0) * (m - m0) / (m1 - m0)
        (m0, c0), (m1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) / (m1 - m0) * (m - m1)

    def with_mode(self, mode: PlanMode) -> "DispatchPlan":
        return replace(self, mode=mode)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"] = {str(k): v for k, v in self.cost.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DispatchPlan":
        key = PlanKey(**d["key"]) if d.get("key") else None
        return cls(key=key, mode=d.get("mode", "exact"), max_chunk=int(d["max_chunk"]),
                   kv_boundaries=tuple(int(b) for b in d.get("kv_boundaries", ())),
                   cost={int(k): float(v) for k, v in d.get("cost", {}).items()},
                   qualified=bool(d.get("qualified", False)))


def unqualified(key: PlanKey | None = None) -> DispatchPlan:
    """The safe fallback: one token per forward, which is serial decoding itself."""
    return DispatchPlan(key=key, mode="exact", max_chunk=1, qualified=False)


def _quant_of(model: Any) -> str:
    for _, m in model.named_modules():
        bits = getattr(m, "bits", None)
        if bits is not None and hasattr(m, "group_size"):
            return f"q{bits}g{m.group_size}-{getattr(m, 'mode', 'affine')}"
    return "none"


def _dtype_of(model: Any) -> str:
    from mlx.utils import tree_flatten
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("weight") and p.dtype in (mx.float32, mx.float16, mx.bfloat16):
            return str(p.dtype).replace("mlx.core.", "")
    return "unknown"


def config_key(model: Any) -> PlanKey:
    """The :class:`PlanKey` of ``model`` on the current default device."""
    dev = mx.default_device()
    backend = "cpu" if dev.type == mx.cpu else ("cuda" if mx.cuda.is_available() else "metal")
    if backend == "cpu":
        import platform
        device = platform.machine()
    else:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        device = str(info.get("architecture") or info.get("device_name") or "gpu")
    return PlanKey(backend, device, _dtype_of(model), _quant_of(model))


def _plan_files() -> list[Path]:
    files: list[Path] = []
    if os.environ.get("MLX_FILL_PLAN"):
        files.append(Path(os.environ["MLX_FILL_PLAN"]))
    user = user_cache_dir() / "plans"
    if user.is_dir():
        files.extend(sorted(user.glob("*.json")))
    shipped = resources.files("mlx_fill") / "plans"
    if shipped.is_dir():
        files.extend(Path(str(p)) for p in sorted(shipped.iterdir(), key=lambda p: p.name)
                     if p.name.endswith(".json"))
    return files


def load_plan(model: Any, mode: PlanMode = "exact") -> DispatchPlan:
    """The first qualified plan for ``model``'s configuration from ``$MLX_FILL_PLAN``, the user
    cache dir, then the plans shipped in the package; :func:`unqualified` when none matches."""
    key = config_key(model)
    for f in _plan_files():
        try:
            plan = DispatchPlan.from_json(json.loads(f.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if plan.key == key and plan.qualified:
            return plan.with_mode(mode)
    return unqualified(key).with_mode(mode)


def save_plan(plan: DispatchPlan, path: Path | None = None) -> Path:
    """Write ``plan`` as JSON (default: user cache dir, one file per configuration)."""
    if path is None:
        assert plan.key is not None
        path = user_cache_dir() / "plans" / f"{plan.key.slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan.to_json(), indent=2, sort_keys=True) + "\n")
    return path
