"""Write the agent sessions the fixtures and ``smollm2-tools`` never trained on, as a transcripts
file that ``mlx-fill replay`` / ``mlx-fill ab`` read.

The split is the training scripts' own (``scripts.training.fixture_data.split_sessions``, seed
0): about 12% of the sessions of every source held back whole; pi's single session contributes
its last turns (its system message and the messages from the training cut on), so those turns
are replayed with only the held-back part of the conversation as history.
``--trained`` writes the complement instead: the sessions of those sources that training read
(pi's cut before its held-back turns), for checking a policy on turns it was not tuned on.

    python -m scripts.bench.heldout_sessions OUT.jsonl.gz [--seed 0] [--per-source N] [--trained]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

from mlx_fill.core.errors import non_negative_int, output_file, positive_int
from scripts.training import fixture_data

TAIL = "#tail"


def _training_sources_rows() -> dict[tuple[str, str], dict]:
    """The raw transcript rows of the training sources, by (source, session id)."""
    with gzip.open(fixture_data.transcripts_path() / "dev.jsonl.gz", "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return {(r["source"], r["session_id"]): r for r in rows if r["source"] in fixture_data.SOURCES}


def _cut(messages: list[dict], tail: fixture_data.Session) -> tuple[list[dict], int]:
    """For a session split by turns: its leading system message (none or one) and the index of
    its first held-back message in the raw ``messages``. The held-back ``tail`` is that system
    message, then the raw messages from the cut on, one for one."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    return system, len(messages) - (len(tail.messages) - len(system))


def trained_rows(seed: int, per_source: int | None = None) -> list[dict]:
    """The raw transcript rows of the sessions training read, at most ``per_source`` of each
    source, in split order; a session split by turns keeps the messages before its held-back
    ``#tail``."""
    raw = _training_sources_rows()
    train, held = fixture_data.split_sessions(fixture_data.load_recordings(), seed)
    tails = {s.session_id.removesuffix(TAIL): s for s in held if s.session_id.endswith(TAIL)}
    out: list[dict] = []
    for session in train:
        if per_source is not None and sum(r["source"] == session.source for r in out) >= per_source:
            continue
        row = dict(raw[(session.source, session.session_id)])
        tail = tails.get(session.session_id)
        if tail is not None:
            _, cut = _cut(row["messages"], tail)
            row["messages"] = row["messages"][:cut]
        out.append(row)
    return out


def heldout_rows(seed: int, per_source: int | None = None) -> list[dict]:
    """The raw transcript rows of the held-back sessions (a ``#tail`` session cut as in the
    split), at most ``per_source`` of each source, in split order."""
    raw = _training_sources_rows()
    _, held = fixture_data.split_sessions(fixture_data.load_recordings(), seed)
    out: list[dict] = []
    for session in held:
        if per_source is not None and sum(r["source"] == session.source for r in out) >= per_source:
            continue
        base = session.session_id.removesuffix(TAIL)
        row = dict(raw[(session.source, base)])
        if session.session_id.endswith(TAIL):
            system, cut = _cut(row["messages"], session)
            row["messages"] = system + row["messages"][cut:]
            row["session_id"] = session.session_id
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=output_file)
    ap.add_argument("--seed", type=non_negative_int, default=0,
                    help="the train / held-back split's seed (default 0)")
    ap.add_argument("--per-source", type=positive_int, default=None,
                    help="at most N sessions of each source")
    ap.add_argument("--trained", action="store_true",
                    help="write the sessions training read instead of the held-back ones")
    args = ap.parse_args(argv)
    rows = (trained_rows if args.trained else heldout_rows)(args.seed, args.per_source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    what = "trained" if args.trained else "held-back"
    print(f"{len(rows)} {what} sessions -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
