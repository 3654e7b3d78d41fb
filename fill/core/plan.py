"""Dispatch plans: which chunk sizes and chunk ends keep an append bit-identical to serial decode.

A plan is measured by ``mlx-fill qualify`` and belongs to the configuration it was measured
under, its :class:`PlanKey`: everything that changes the kernels an append runs or what a
forward costs. That is the backend and device (GPU architecture on Metal/CUDA), the MLX and
mlx-lm versions, on the CPU the BLAS actually serving MLX's matrix products with its version
and core type (:mod:`mlx_fill.core.kernels`), the activation dtype, the weight quantization, and the
model shape (:func:`model_shape`: the mlx-lm model configuration; a plan applies to exactly
that configuration, no tolerance). A plan applies only where every field matches; a mismatch never
means "nearest plan" (:mod:`mlx_fill.core.resolve` qualifies instead).

``exact`` plans cut chunks at ``max_chunk`` and at every KV length in ``kv_boundaries`` (where a
backend switches attention or matmul kernels); ``fast`` plans use the largest chunk and accept
batched-verify numerics. A configuration with no qualified plan gets chunks of one token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import mlx.core as mx

from . import kernels
from .paths import user_cache_dir
from .shapes import SHAPES

if TYPE_CHECKING:
    from .proposal import Round

PlanMode = Literal["exact", "fast"]
FAST_MAX_CHUNK = 64  # a fast plan's chunk size, and the largest max_chunk a plan file may hold
COST_KV = 512  # KV length ``qualify`` measures the cost curve at


@dataclass(frozen=True)
class PlanKey:
    """The configuration a plan was qualified under. Every field must match for a plan to
    apply; a field a plan file lacks reads ``unknown`` and matches nothing."""

    backend: str
    device: str
    mlx: str
    mlx_lm: str
    blas: str
    blas_version: str
    blas_core: str
    dtype: str
    quant: str
    shape: str

    def differences(self, other: "PlanKey") -> list[str]:
        """Names of the fields whose values differ between ``self`` and ``other``."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def slug(self) -> str:
        """A file name stem: readable head plus a digest of every field."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        head = "-".join((self.backend, self.device.split()[0] if self.device else "", self.dtype,
                         self.quant))
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in head) + f"-{digest[:12]}"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PlanKey":
        return cls(**{f.name: str(d.get(f.name, kernels.UNKNOWN)) for f in fields(cls)})


@dataclass(frozen=True)
class DispatchPlan:
    """Chunking rule for appends. ``cost[m]`` = time(m-row forward) / time(1-row forward).

    ``round_overhead``: what a fill round costs beyond its rows, in one-row forwards. A round's
    forward is synchronous (its samples are read before decoding goes on), while a plain
    step overlaps building the next forward with the current one's compute; measured by
    ``qualify`` as time(synchronous 1-row append) / time(pipelined step) - 1.

    ``pending``: chunk sizes a budgeted ``qualify`` has not measured yet (``max_chunk`` is the
    largest size measured exact together with every smaller one; a later ``qualify`` with this
    plan as ``prior`` measures the rest). ``reason``: why ``max_chunk`` is 1 when ``qualify``
    could not measure the model at all (an unsupported cache, a failed forward).

    ``long_cost[m]``: time(m-row forward at KV length ``long_kv``) / time(1-row forward at
    ``cost_kv``), ``m = 1`` included; empty where only ``cost_kv`` was measured. A forward's time
    is affine in the KV length it attends over (the weights once, then attention over every
    cached row), so the two lengths give c(M) at any KV length (:meth:`cost_of`).

    ``shapes[m]``: the append shape (:mod:`~mlx_fill.core.shapes`) qualified for chunks of
    ``m`` rows, ``native`` or ``batched-m1``; a size without an entry takes the entry of the
    next larger measured size (whose checks covered it), else ``native``."""

    key: PlanKey | None
    mode: PlanMode = "exact"
    max_chunk: int = 1
    kv_boundaries: tuple[int, ...] = ()
    cost: dict[int, float] = field(default_factory=dict)
    qualified: bool = False
    round_overhead: float = 0.0
    note: str = ""  # how and on what it was measured (free text, shown by ``mlx-fill plan``)
    pending: tuple[int, ...] = ()
    reason: str = ""
    shapes: dict[int, str] = field(default_factory=dict)
    cost_kv: int = COST_KV
    long_kv: int = 0
    long_cost: dict[int, float] = field(default_factory=dict)

    def shape_for(self, m: int) -> str:
        """The append shape a chunk of ``m`` rows runs with under this plan."""
        if m in self.shapes:
            return self.shapes[m]
        larger = [s for s in self.shapes if s > m]
        return self.shapes[min(larger)] if larger else "native"

    def chunks(self, start: int, n: int) -> list[int]:
        """Sizes of consecutive chunks covering ``n`` ids appended at KV length ``start``.

        Every chunk is at most ``max_chunk`` long and, in ``exact`` mode, no chunk crosses a
        KV length listed in ``kv_boundaries`` (a chunk may end exactly at one).
        """
        limit = self._chunk_limit()
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

    def _chunk_limit(self) -> int:
        return max(1, self.max_chunk) if self.mode == "exact" else max(self.max_chunk, FAST_MAX_CHUNK)

    def rows_cost(self, n: int, kv: int | None = None) -> float:
        """Cost of appending ``n`` rows at KV length ``kv`` in chunks of at most the plan's chunk
        size, in one-row forwards at that length (KV boundaries aside: an exact plan with
        ``max_chunk = 1`` costs ``n``, whatever c(M) says)."""
        full, rest = divmod(n, self._chunk_limit())
        return (full * self.cost_of(self._chunk_limit(), kv)
                + (self.cost_of(rest, kv) if rest else 0.0))

    def round_cost(self, r: Round, overhead: float | None = None) -> float:
        """Round ``r`` in one-row forwards: its rows (:meth:`rows_cost`) plus ``overhead``
        (None: the plan's ``round_overhead``); a draft rejected against the in-flight sample
        (no rows) the overhead alone."""
        over = self.round_overhead if overhead is None else overhead
        return (self.rows_cost(r.rows, r.kv) if r.rows else 0.0) + over

    def round_saving(self, r: Round, overhead: float | None = None) -> float:
        """One-row forwards round ``r`` saved against plain decoding: the plain steps that
        would have fed the ids it emitted, less :meth:`round_cost` (negative: the round cost
        more than it emitted)."""
        return r.emitted - self.round_cost(r, overhead)

    @property
    def kv_dependent(self) -> bool:
        """Whether c(M) depends on the KV length (a second length was measured)."""
        return bool(self.cost) and bool(self.long_cost) and self.long_kv > self.cost_kv

    def cost_of(self, m: int, kv: int | None = None) -> float:
        """c(m) in one-row-forward units at KV length ``kv`` (None: at ``cost_kv``): measured
        where known, linear interpolation between measured sizes, linear extrapolation
        (pessimistic) beyond them, ``m`` when unmeasured. With a ``long_cost`` curve both row
        counts' times are affine in ``kv`` through the two measured lengths, and c(m) is their
        ratio, at least 1 (an m-row forward never costs less than a one-row one; a lower ratio
        is timing noise)."""
        if m <= 1:
            return 1.0
        if not self.cost:
            return float(m)
        near = _on_curve({1: 1.0, **self.cost}, m)
        if kv is None or not self.kv_dependent:
            return near
        f = (max(kv, 0) - self.cost_kv) / (self.long_kv - self.cost_kv)
        one = 1.0 + f * (self.long_cost.get(1, 1.0) - 1.0)
        rows = near + f * (_on_curve(self.long_cost, m) - near)
        return max(1.0, rows / one) if one > 0.0 and rows > 0.0 else near

    def with_mode(self, mode: PlanMode) -> "DispatchPlan":
        return replace(self, mode=mode)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"] = {str(k): v for k, v in self.cost.items()}
        d["shapes"] = {str(k): v for k, v in self.shapes.items()}
        d["long_cost"] = {str(k): v for k, v in self.long_cost.items()}
        return d

    @property
    def complete(self) -> bool:
        """Whether every chunk size ``qualify`` meant to measure was measured."""
        return not self.pending

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DispatchPlan":
        """The plan :meth:`to_json` wrote. A field of the wrong type or out of its range is a
        ``ValueError`` (or ``KeyError`` / ``TypeError`` / ``AttributeError``) naming it: ``mode``
        one of :data:`PlanMode`; ``max_chunk`` a whole number from 1 to ``FAST_MAX_CHUNK``;
        chunk sizes (``cost`` / ``long_cost`` / ``shapes`` keys, ``pending``) at least 1; KV
        lengths at least 0; c(M) values finite and above 0; ``round_overhead`` finite and at
        least 0; ``shapes`` values among :data:`~mlx_fill.core.shapes.SHAPES`; ``d`` itself, the
        maps and the lists of the JSON type they are, and ``max_chunk`` present."""
        if not isinstance(d, dict):
            raise ValueError(f"a plan is a JSON object, got {type(d).__name__}")
        if "max_chunk" not in d:
            raise ValueError("max_chunk: missing")
        for name, kind, what in (("key", dict, "object"), ("cost", dict, "object"),
                                 ("long_cost", dict, "object"), ("shapes", dict, "object"),
                                 ("pending", (list, tuple), "array"),
                                 ("kv_boundaries", (list, tuple), "array")):
            if d.get(name) is not None and not isinstance(d[name], kind):
                raise ValueError(f"{name}: {d[name]!r:.40} is not a JSON {what}")
        key = PlanKey.from_json(d["key"]) if d.get("key") else None
        mode = d.get("mode", "exact")
        if mode not in get_args(PlanMode):
            raise ValueError(f"mode: {mode!r} is not one of {list(get_args(PlanMode))}")
        shapes = {_size(k, "shapes"): v for k, v in d.get("shapes", {}).items()}
        for m, shape in shapes.items():
            if shape not in SHAPES:
                raise ValueError(f"shapes[{m}]: {shape!r} is not one of {list(SHAPES)}")
        overhead = float(d.get("round_overhead", 0.0))
        if not 0.0 <= overhead < math.inf:
            raise ValueError(f"round_overhead: {overhead!r} is not a finite number at least 0")
        return cls(key=key, mode=mode,
                   max_chunk=_whole(d["max_chunk"], "max_chunk", 1, FAST_MAX_CHUNK),
                   kv_boundaries=tuple(_whole(b, "kv_boundaries", 0)
                                       for b in d.get("kv_boundaries", ())),
                   cost=_costs(d.get("cost", {}), "cost"),
                   qualified=bool(d.get("qualified", False)),
                   round_overhead=overhead, note=str(d.get("note", "")),
                   pending=tuple(_whole(m, "pending", 1) for m in d.get("pending", ())),
                   reason=str(d.get("reason", "")), shapes=shapes,
                   cost_kv=_whole(d.get("cost_kv", COST_KV), "cost_kv", 0),
                   long_kv=_whole(d.get("long_kv", 0), "long_kv", 0),
                   long_cost=_costs(d.get("long_cost", {}), "long_cost"))


def _whole(value: object, name: str, low: int, high: int | None = None) -> int:
    """``value`` when it is a JSON whole number from ``low`` to ``high`` (None: no bound);
    otherwise a ``ValueError`` naming the field ``name``."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value and (
            high is None or value <= high):
        return value
    bound = f"at least {low}" if high is None else f"from {low} to {high}"
    raise ValueError(f"{name}: {value!r} is not a whole number {bound}")


def _size(key: str, name: str) -> int:
    """A chunk size written as a JSON object key, at least 1; else a ``ValueError``."""
    try:
        return _whole(int(key), name, 1)
    except ValueError:
        raise ValueError(f"{name}: the key {key!r} is not a chunk size of at least 1") from None


def _costs(points: dict[str, Any], name: str) -> dict[int, float]:
    """A c(M) map (chunk size -> cost in one-row forwards) read from JSON: sizes at least 1,
    costs finite and above 0; else a ``ValueError`` naming the field ``name``."""
    out = {}
    for k, v in points.items():
        cost = float(v)
        if not 0.0 < cost < math.inf:
            raise ValueError(f"{name}[{k}]: {v!r} is not a finite number above 0")
        out[_size(k, name)] = cost
    return out


def _on_curve(points: dict[int, float], m: int) -> float:
    """The value at ``m`` of the piecewise-linear curve through ``points`` (row count -> time),
    extrapolated linearly beyond its ends."""
    pts = sorted(points.items())
    if len(pts) == 1:
        return pts[0][1]
    for (m0, c0), (m1, c1) in zip(pts, pts[1:]):
        if m0 <= m <= m1:
            return c0 + (c1 - c0) * (m - m0) / (m1 - m0)
    (m0, c0), (m1, c1) = (pts[0], pts[1]) if m < pts[0][0] else (pts[-2], pts[-1])
    return c1 + (c1 - c0) / (m1 - m0) * (m - m1)


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


_SHAPE_FIELDS = (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                 ("ffn", "intermediate_size"), ("heads", "num_attention_heads"),
                 ("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                 ("vocab", "vocab_size"))


def _model_args(model: Any) -> dict[str, Any]:
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        return asdict(args)
    return dict(args) if isinstance(args, dict) else {}


def model_shape(model: Any) -> str:
    """The model's shape: architecture and main sizes, readable, then ``config=`` a digest of its
    mlx-lm configuration (``model.args``), class and parameter shapes. Two models share a shape
    only when all of these are equal (a fine-tune of the same base does; any resize does not)."""
    from mlx.utils import tree_flatten
    args = _model_args(model)
    text = args.get("text_config") if isinstance(args.get("text_config"), dict) else {}
    parts = [str(args.get("model_type") or text.get("model_type") or type(model).__module__)]
    for short, name in _SHAPE_FIELDS:
        value = args.get(name, text.get(name))
        if value is not None:
            parts.append(f"{short}={value}")
    identity = {"class": f"{type(model).__module__}.{type(model).__qualname__}", "args": args,
                "params": [(n, list(p.shape)) for n, p in tree_flatten(model.parameters())]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    return " ".join(parts + [f"config={digest[:12]}"])


def config_key(model: Any) -> PlanKey:
    """The :class:`PlanKey` of ``model`` on the current default device, in this process."""
    blas = kernels.blas()
    return PlanKey(kernels.backend(), kernels.device(), kernels.mlx_version(),
                   kernels.mlx_lm_version(), blas.library, blas.version, blas.core,
                   _dtype_of(model), _quant_of(model), model_shape(model))


def shipped_dir() -> Path:
    """The plans shipped in the package (``mlx_fill/plans``)."""
    return Path(str(resources.files("mlx_fill.core") / "plans"))


def cached_dir() -> Path:
    """Plans qualified on this machine: ``<user cache>/plans``."""
    return user_cache_dir() / "plans"


@dataclass(frozen=True)
class Candidate:
    """One plan file considered for a key. ``problem`` says why it does not apply (None: it
    does); ``origin`` is ``MLX_FILL_PLAN``, ``cached`` or ``shipped``."""

    path: Path
    origin: str
    plan: DispatchPlan | None
    problem: str | None


@dataclass(frozen=True)
class Lookup:
    """The plan files considered for ``key``, in lookup order, and the first that applies."""

    key: PlanKey
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.problem is None), None)


def _plan_files() -> list[tuple[str, Path]]:
    files: list[tuple[str, Path]] = []
    if os.environ.get("MLX_FILL_PLAN"):
        files.append(("MLX_FILL_PLAN", Path(os.environ["MLX_FILL_PLAN"])))
    for origin, folder in (("cached", cached_dir()), ("shipped", shipped_dir())):
        if folder.is_dir():
            files.extend((origin, p) for p in sorted(folder.glob("*.json")))
    return files


def read_plan_file(path: Path) -> DispatchPlan | str:
    """The plan in ``path``, or why it cannot be read (``unreadable (...)``, one line)."""
    try:
        return DispatchPlan.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable ({type(e).__name__}: {e})"


def env_plan_problem() -> str | None:
    """Why ``$MLX_FILL_PLAN`` names no readable plan file, as one line naming the variable;
    None when it is unset or names one."""
    value = os.environ.get("MLX_FILL_PLAN")
    if not value or not isinstance(problem := read_plan_file(Path(value)), str):
        return None
    return f"MLX_FILL_PLAN={value} is {problem}; name a plan file `mlx-fill qualify` wrote, or unset it"


def _candidate(origin: str, path: Path, key: PlanKey) -> Candidate:
    plan = read_plan_file(path)
    if isinstance(plan, str):
        return Candidate(path, origin, None, plan)
    if not plan.qualified:
        return Candidate(path, origin, plan, "not qualified")
    if plan.key is None:
        return Candidate(path, origin, plan, "no key")
    differ = plan.key.differences(key)
    if differ:
        return Candidate(path, origin, plan, "key differs in " + ", ".join(differ))
    return Candidate(path, origin, plan, None)


def find_plan(key: PlanKey) -> Lookup:
    """Every plan file for ``key`` from ``$MLX_FILL_PLAN``, the user cache, then the plans
    shipped in the package, with the reason each one that does not apply is rejected."""
    return Lookup(key, tuple(_candidate(origin, path, key) for origin, path in _plan_files()))


def load_plan(model: Any, mode: PlanMode = "exact") -> DispatchPlan:
    """The first plan whose key equals ``model``'s configuration (:func:`find_plan`);
    :func:`unqualified` when none does. Never measures anything (see :mod:`mlx_fill.core.resolve`)."""
    key = config_key(model)
    chosen = find_plan(key).chosen
    plan = chosen.plan if chosen is not None and chosen.plan is not None else unqualified(key)
    return plan.with_mode(mode)


def save_plan(plan: DispatchPlan, path: Path | None = None) -> Path:
    """Write ``plan`` as JSON (default: the user cache, one file per full key). The file is
    replaced atomically, so a concurrent reader sees the old plan or the new one."""
    if path is None:
        assert plan.key is not None
        path = cached_dir() / f"{plan.key.slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(plan.to_json(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def format_key(key: PlanKey | None) -> list[str]:
    """The key as ``  field: value`` lines under a ``key:`` line (``key: none`` without one)."""
    if key is None:
        return ["key: none"]
    return ["key:"] + [f"  {f.name}: {getattr(key, f.name) or '-'}" for f in fields(key)]


def format_cost(plan: DispatchPlan) -> str:
    """c(M) at the KV lengths it was measured at, and the round overhead, on one line."""
    sizes = sorted(m for m in plan.cost if m > 1)
    if not sizes:
        return f"cost: none measured  round overhead={plan.round_overhead:.2f}"
    kvs = [plan.cost_kv, plan.long_kv] if plan.kv_dependent else [plan.cost_kv]
    parts = [f"at KV {kv}: " + " ".join(f"c({m})={plan.cost_of(m, kv):.2f}" for m in sizes)
             for kv in kvs]
    return f"cost {';  '.join(parts)}  round overhead={plan.round_overhead:.2f}"
