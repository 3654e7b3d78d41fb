"""The evidence ledger: verified agreement per (model, template, claim), persisted (the file
keeps them under ``rows``). A source's claim is its origin (``echo:corroborated``: every draft
it makes stands on the same policy); a strict row's is its origin and the ids it writes where it
fires (:attr:`mlx_fill.strict.rows.Row.claim`), so evidence for a row never promotes another
row of the same origin that writes other ids (a scaffold row under another tool set).

Every ``verify`` outcome of a ledger-tracked row is an agreement (the target produced every
proposed id) or a disagreement. A row is promoted from ``verify`` to ``assert`` only once it has
``promote_after`` agreements and zero disagreements, and only for rows in ``eligible``; the first
disagreement demotes it for good (its counter stays nonzero). A promoted row is written
unchecked, so the evidence only says the model followed it so far: :meth:`Ledger.asserts`
verifies a promoted claim again after every ``AUDIT_EVERY - 1`` asserts (per process), and a
model that has stopped following it (compact JSON after a call-start token) is demoted by that
check; the reply asserted before it keeps what was asserted. Promotion never applies at
temperature > 0 (the session drops every ``assert`` there). Echo is not eligible unless the operator lists it (off by default). A strict
row whose certainty class is ``likely`` (:func:`mlx_fill.strict.rows.certainty`: what follows a raw-text
value, spacing inside a JSON arguments object) is never promoted, whatever ``eligible`` lists
and however much evidence it has; the ledger logs that once per row.

Counters live in ``user_cache_dir()/"ledger"/<slug>.json``, one file per model/template pair,
written atomically on :meth:`Ledger.save`, which adds this process's counts since it last read
the file to what the file holds then (under a lock): servers sharing a cache lose no
disagreement another recorded. A save waits at most :data:`LOCK_WAIT_S` for the lock; one that
does not get it leaves its counts to the next save.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mlx_fill.core.paths import user_cache_dir

DEFAULT_PROMOTE_AFTER = 50
AUDIT_EVERY = 10  # a promoted claim's firings per process: all asserted but every AUDIT_EVERY-th
LOCK_WAIT_S = 2.0  # the longest a save waits on another process's lock (a save takes milliseconds)
log = logging.getLogger(__name__)


@dataclass
class Evidence:
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
    claims: dict[str, Evidence] = field(default_factory=dict)
    path: Path | None = None
    _refused: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    # asserts per claim since its last verified outcome in this process (:meth:`asserts`)
    _unchecked: dict[str, int] = field(default_factory=dict, init=False, repr=False,
                                       compare=False)
    # the counts as last read from or written to the file (what :meth:`save` adds to is the rest)
    _saved: dict[str, tuple[int, int]] = field(default_factory=dict, init=False, repr=False,
                                               compare=False)

    def __post_init__(self) -> None:
        if self.promote_after < 1:
            raise ValueError(f"promote_after must be >= 1, got {self.promote_after}")

    def record(self, claim: str, agreed: bool) -> None:
        """One verified outcome of ``claim`` (an origin, or a strict row's claim)."""
        ev = self.claims.setdefault(claim, Evidence())
        self._unchecked[claim] = 0
        if agreed:
            ev.agreements += 1
        else:
            ev.disagreements += 1

    def is_eligible(self, origin: str) -> bool:
        """Listed exactly, or under a listed prefix ending in ``:`` (``"strict:"``)."""
        return origin in self.eligible or any(
            e.endswith(":") and origin.startswith(e) for e in self.eligible)

    def promoted(self, origin: str, *, certainty: str | None = None,
                 claim: str | None = None) -> bool:
        """True iff ``origin`` may be asserted: not a ``likely`` strict row, eligible, enough
        agreements for its ``claim`` (default: the origin itself), none against. ``certainty``
        is the row's class (None for sources that are not compiled rows). Temperature is the
        session's to enforce (no ``assert`` above 0)."""
        if not self.is_eligible(origin):
            return False
        if certainty != "determined" and certainty is not None:
            if origin not in self._refused:
                self._refused.add(origin)
                log.info("evidence ledger: %s is a %s strict row; it stays verify whatever "
                         "MLX_FILL_PROMOTE says", origin, certainty)
            return False
        ev = self.claims.get(claim or origin)
        return ev is not None and ev.disagreements == 0 and ev.agreements >= self.promote_after

    def asserts(self, origin: str, *, certainty: str | None = None,
                claim: str | None = None) -> bool:
        """Whether this firing of ``origin`` is asserted: it is :meth:`promoted`, and fewer than
        ``AUDIT_EVERY - 1`` of its claim's firings were asserted since its last verified
        outcome (:meth:`record`); otherwise it is verified, which keeps checking that the model
        still writes the row and demotes it at the first disagreement."""
        if not self.promoted(origin, certainty=certainty, claim=claim):
            return False
        key = claim or origin
        n = self._unchecked.get(key, 0)
        if n >= AUDIT_EVERY - 1:
            return False
        self._unchecked[key] = n + 1
        return True

    def to_json(self) -> dict:
        return {"model": self.model, "template": self.template,
                "rows": {k: {"agreements": v.agreements, "disagreements": v.disagreements}
                         for k, v in sorted(self.claims.items())}}

    def save(self) -> Path:
        """Write the counters: what the file holds now (another process may have saved since
        this one read it) plus what this process recorded since; this ledger then holds the
        sum. Raises ValueError for a file that became corrupt or foreign meanwhile, and
        TimeoutError when another process holds the file's lock (:data:`LOCK_WAIT_S`); the
        counts not written stay counted here, and the next save writes them."""
        path = self.path or ledger_path(self.model, self.template)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path, LOCK_WAIT_S):
            merged = _read_claims(path, self.model, self.template)
            for claim, ev in self.claims.items():
                agreements, disagreements = self._saved.get(claim, (0, 0))
                now = merged.setdefault(claim, Evidence())
                now.agreements += ev.agreements - agreements
                now.disagreements += ev.disagreements - disagreements
            self.claims = merged
            self._mark_saved()
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        self.path = path
        return path

    def _mark_saved(self) -> None:
        """The counters held now are what the file holds."""
        self._saved = {k: (v.agreements, v.disagreements) for k, v in self.claims.items()}


@contextmanager
def _locked(path: Path, wait_s: float):
    """An exclusive lock on ``path``'s ledger among processes (a ``.lock`` file beside it);
    TimeoutError when another process holds it for ``wait_s`` seconds."""
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path} held by another process for {wait_s:g} s; "
                                       f"the counts are kept for the next save") from None
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_claims(path: Path, model: str, template: str) -> dict[str, Evidence]:
    """The counters ``path`` holds ({} without a file); ValueError for a corrupt file or one
    of another model/template."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        rows = {claim: Evidence(int(ev["agreements"]), int(ev["disagreements"]))
                for claim, ev in data["rows"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"corrupt evidence ledger {path}: {e}") from e
    if data.get("model") != model or data.get("template") != template:
        raise ValueError(f"ledger {path} belongs to another model/template")
    return rows


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
    led.claims = _read_claims(path, model, template)
    led._mark_saved()
    return led
