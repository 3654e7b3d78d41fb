"""The evidence ledger: verified agreement per (model, template, origin: a source or a strict
row), persisted (the file keeps them under ``rows``).

Every ``verify`` outcome of a ledger-tracked row is an agreement (the target produced every
proposed id) or a disagreement. A row is promoted from ``verify`` to ``assert`` only once it has
``promote_after`` agreements and zero disagreements, and only for rows in ``eligible``; the first
disagreement demotes it for good (its counter stays nonzero). Promotion never applies at
temperature > 0 (the session drops every ``assert`` there). Echo is not eligible unless the operator lists it (off by default). A strict
row whose certainty class is ``likely`` (:func:`mlx_fill.strict.rows.certainty`: what follows a raw-text
value, spacing inside a JSON arguments object) is never promoted, whatever ``eligible`` lists
and however much evidence it has; the ledger logs that once per row.

Counters live in ``user_cache_dir()/"ledger"/<slug>.json``, one file per model/template pair,
written atomically on :meth:`Ledger.save`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mlx_fill.core.paths import user_cache_dir

DEFAULT_PROMOTE_AFTER = 50
log = logging.getLogger(__name__)


@dataclass
class OriginEvidence:
    agreements: int = 0
    disagreements: int = 0


@dataclass
class Ledger:
    """Counters for one (model, template) pair. ``eligible`` names the origins (e.g.
    ``"echo:corroborated"``) that may ever be promoted."""

    model: str
    template: str
    promote_after: int = DEFAULT_PROMOTE_AFTER
    eligible: frozenset[str] = frozenset()
    origins: dict[str, OriginEvidence] = field(default_factory=dict)
    path: Path | None = None
    _refused: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.promote_after < 1:
            raise ValueError(f"promote_after must be >= 1, got {self.promote_after}")

    def record(self, origin: str, agreed: bool) -> None:
        ev = self.origins.setdefault(origin, OriginEvidence())
        if agreed:
            ev.agreements += 1
        else:
            ev.disagreements += 1

    def is_eligible(self, origin: str) -> bool:
        """Listed exactly, or under a listed prefix ending in ``:`` (``"strict:"``)."""
        return origin in self.eligible or any(
            e.endswith(":") and origin.startswith(e) for e in self.eligible)

    def promoted(self, origin: str, *, certainty: str | None = None) -> bool:
        """True iff ``origin`` may be asserted: not a ``likely`` strict row, eligible, enough
        agreements, none against. ``certainty`` is the row's class (None for sources that are
        not compiled rows). Temperature is the session's to enforce (no ``assert`` above 0)."""
        if not self.is_eligible(origin):
            return False
        if certainty != "determined" and certainty is not None:
            if origin not in self._refused:
                self._refused.add(origin)
                log.info("evidence ledger: %s is a %s strict row; it stays verify whatever "
                         "MLX_FILL_PROMOTE says", origin, certainty)
            return False
        ev = self.origins.get(origin)
        return ev is not None and ev.disagreements == 0 and ev.agreements >= self.promote_after

    def to_json(self) -> dict:
        return {"model": self.model, "template": self.template,
                "rows": {k: {"agreements": v.agreements, "disagreements": v.disagreements}
                         for k, v in sorted(self.origins.items())}}

    def save(self) -> Path:
        path = self.path or ledger_path(self.model, self.template)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
        self.path = path
        return path


def ledger_path(model: str, template: str) -> Path:
    """One file per (model, template); the name carries a readable model name and a hash of
    both (templates are long)."""
    digest = hashlib.sha256(f"{model}\0{template}".encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)[-60:]
    return user_cache_dir() / "ledger" / f"{safe}-{digest}.json"


def load_ledger(model: str, template: str, *, promote_after: int = DEFAULT_PROMOTE_AFTER,
                eligible: frozenset[str] = frozenset()) -> Ledger:
    """The persisted ledger for (model, template), or an empty one. A corrupt file is an
    error, never silently reset (it holds the only record of past disagreements)."""
    path = ledger_path(model, template)
    led = Ledger(model, template, promote_after, frozenset(eligible), path=path)
    if path.exists():
        try:
            data = json.loads(path.read_text())
            for origin, ev in data["rows"].items():
                led.origins[origin] = OriginEvidence(int(ev["agreements"]), int(ev["disagreements"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt evidence ledger {path}: {e}") from e
        if data.get("model") != model or data.get("template") != template:
            raise ValueError(f"ledger {path} belongs to another model/template")
    return led
