"""How well can the call-or-prose decision of an assistant turn be predicted from what precedes it?

    python -m scripts.training.decision_ceiling            # every source with both kinds of turn

The tool-calling fixtures are asked to answer held-back call turns with a call and prose turns
without one. Where a source mixes both (tau-bench's agent answers the user in prose about as
often as it calls a tool), that asks the model to reproduce the recorded agent's choice. This
script measures how far the visible context determines that choice at all, without a language
model: a logistic regression over the words of the last three messages (and word pairs of the
last one), the role of the previous message, the tools called so far and the turn index, trained
on every decision in the training sessions of ``fixture_data.split_sessions`` and scored on the
held-back ones (the same split as the fixtures' eval, the same truncations).

Reported per source: the decisions on each side, the AUC of the predicted call probability
(call turns ranked above prose turns), and the best operating points even with the threshold
chosen on the held-back turns themselves (so optimistic): the share of prose turns kept prose
while at least 85% of call turns get a call, and the share of call turns that get one while at
least 90% of prose turns stay prose. The regularization is fixed (``L2``), not tuned.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

import numpy as np

from scripts.training import fixture_data

L2 = 1e-3
STEPS = 3000
STEP_SIZE = 0.5
MIN_COUNT = 3  # a feature seen in fewer training decisions is dropped
CALL_FLOOR, PROSE_FLOOR = 0.85, 0.90


def _words(message: dict) -> list[str]:
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        text += " call_" + call["function"]["name"]
    return re.findall(r"[a-z_]+|\d+|[?!]", text.lower())


def features(messages: list[dict], index: int) -> set[str]:
    """Features of the decision at ``messages[index]`` (an assistant turn): built from
    ``messages[:index]`` only."""
    seen = messages[:index]
    previous = seen[-1]
    out = {"previous=" + previous["role"], f"turn={min(index // 2, 10)}"}
    words = _words(previous)
    out |= {"w:" + w for w in words} | {"b:" + a + "_" + b for a, b in zip(words, words[1:])}
    for back in (2, 3):
        if len(seen) >= back:
            message = seen[-back]
            out |= {f"m{back}={message['role']}"} | {f"m{back}:" + w for w in _words(message)}
    called = [c["function"]["name"] for m in seen for c in m.get("tool_calls") or []]
    out |= {"called:" + name for name in called} | {f"calls={min(len(called), 6)}"}
    last = next((m for m in reversed(seen) if m["role"] == "assistant"), None)
    if last is not None:
        out.add("last=" + ("call" if last.get("tool_calls") else "prose"))
    return out


def decisions(sessions: list[fixture_data.Session], source: str) -> tuple[list[set[str]], np.ndarray]:
    """(features, 1 for a call turn / 0 for a prose turn) of every assistant turn after the first
    message of ``source``'s sessions."""
    rows, labels = [], []
    for session in sessions:
        if session.source != source:
            continue
        for index, message in enumerate(session.messages):
            if message["role"] == "assistant" and index > 0:
                rows.append(features(session.messages, index))
                labels.append(int(bool(message.get("tool_calls"))))
    return rows, np.array(labels)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(a call turn scores above a prose turn), ties counted half."""
    calls, prose = scores[labels == 1], scores[labels == 0]
    above = (calls[:, None] > prose[None, :]).sum() + 0.5 * (calls[:, None] == prose[None, :]).sum()
    return float(above / (len(calls) * len(prose)))


def fit(train_rows: list[set[str]], labels: np.ndarray):
    """A logistic regression (L2, gradient descent); returns ``score(rows) -> P(call)``."""
    counts = Counter(f for row in train_rows for f in row)
    vocabulary = {f: i for i, f in enumerate(sorted(f for f, n in counts.items() if n >= MIN_COUNT))}

    def matrix(rows):
        out = np.zeros((len(rows), len(vocabulary) + 1), np.float32)
        out[:, -1] = 1.0
        for r, row in enumerate(rows):
            out[r, [vocabulary[f] for f in row if f in vocabulary]] = 1.0
        return out

    x, targets = matrix(train_rows), labels.astype(np.float32)
    weights = np.zeros(x.shape[1], np.float32)
    for _ in range(STEPS):
        p = 1.0 / (1.0 + np.exp(-x @ weights))
        weights -= STEP_SIZE * (x.T @ (p - targets) / len(targets) + L2 * weights)
    return lambda rows: 1.0 / (1.0 + np.exp(-matrix(rows) @ weights))


def operating_points(scores: np.ndarray, labels: np.ndarray) -> dict:
    """Best prose share with calls >= CALL_FLOOR and best call share with prose >= PROSE_FLOOR,
    over every threshold."""
    points = []
    for threshold in np.unique(np.concatenate([scores, [0.0, 1.0]])):
        called = scores > threshold
        points.append((float(called[labels == 1].mean()), float((~called[labels == 0]).mean())))
    return {"prose_kept_at_calls_85": round(max(p for c, p in points if c >= CALL_FLOOR), 3),
            "calls_at_prose_kept_90": round(max(c for c, p in points if p >= PROSE_FLOOR), 3)}


def measure(seed: int = 0) -> dict:
    train, held = fixture_data.split_sessions(fixture_data.load_recordings(), seed)
    out = {}
    for source in fixture_data.SOURCES:
        train_rows, train_labels = decisions(train, source)
        held_rows, held_labels = decisions(held, source)
        if len(set(train_labels)) < 2 or len(set(held_labels)) < 2:
            continue  # one kind of turn only: nothing to decide
        scores = fit(train_rows, train_labels)(held_rows)
        out[source] = {
            "train_calls": int(train_labels.sum()), "train_prose": int((1 - train_labels).sum()),
            "held_calls": int(held_labels.sum()), "held_prose": int((1 - held_labels).sum()),
            "auc": round(auc(scores, held_labels), 3),
            "accuracy_at_half": round(float(((scores > 0.5) == held_labels).mean()), 3),
            **operating_points(scores, held_labels),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the split's seed (the fixtures' eval uses 0)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
