"""OpenAI Predicted Outputs as a fill source: the predicted text's ids, proposed for ``verify``.

The source only proposes; the decode loop samples every proposed slot with the target and keeps
the agreeing prefix, so a wrong prediction costs time, never tokens. It keeps a cursor into the
prediction: while the output follows the prediction the cursor advances with it; after a
divergence it re-anchors on the longest trailing n-gram of the output that occurs in the
prediction at or after the cursor (edits keep their order), else anywhere.

With a ``gate`` (:class:`~mlx_fill.core.cost.CostGate`) a prediction is priced like any other
draft: its key says whether the cursor is in step with the output (``("sync",)``) or was just
re-anchored on a ``k``-gram (``("anchor", k)``), the gate keeps the prefix that pays under the
loaded model's cost curve, and a declined span is scored as a shadow draft, so a prediction that
has stopped matching costs lookups, not forwards.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from mlx_fill.core.proposal import DEFAULT_MAX_SPAN, DecodeView, Proposal
from mlx_fill.core.cost import CostGate

ORIGIN = "prediction"
ANCHORS = (8, 4, 3, 2)


def prediction_text(prediction: Any) -> str:
    """The text of an OpenAI ``prediction`` object (``{"type": "content", "content": str |
    [{"type": "text", "text": str}, ...]}``). Raises ValueError naming the offending path."""
    if not isinstance(prediction, dict):
        raise ValueError("prediction: expected an object")  # noqa: TRY004 -- a client error
    if prediction.get("type") != "content":
        raise ValueError(f"prediction.type: expected 'content', got {prediction.get('type')!r}")
    content = prediction.get("content")
    if isinstance(content, str):
        return _unicode(content, "prediction.content")
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"prediction.content[{i}]: expected {{'type': 'text', 'text': str}}")
            parts.append(_unicode(part["text"], f"prediction.content[{i}].text"))
        return "".join(parts)
    raise ValueError("prediction.content: expected a string or a list of text parts")


def _unicode(text: str, where: str) -> str:
    """``text``, which a tokenizer can encode; ValueError naming ``where`` for a lone surrogate
    (JSON's ``"\\ud800"`` decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where}: not valid Unicode (a lone surrogate at character "
                         f"{err.start})") from None
    return text


class PredictionSource:
    """``verify`` proposals from a predicted completion's ids (at most ``max_span`` per round)."""

    def __init__(self, ids: Sequence[int], *, max_span: int = DEFAULT_MAX_SPAN, name: str = ORIGIN,
                 gate: CostGate | None = None):
        self.name = name
        self.ids = [int(t) for t in ids]
        self.max_span = max_span
        self.gate = gate
        self._request_stats: Any = None
        self._cursor: int | None = 0
        self._seen = 0
        self._state: tuple = ("sync",)
        self._grams: dict[int, dict[tuple[int, ...], list[int]]] = {k: {} for k in ANCHORS}
        for k in ANCHORS:
            for end in range(k, len(self.ids) + 1):
                self._grams[k].setdefault(tuple(self.ids[end - k:end]), []).append(end)

    def _reanchor(self, emitted: Sequence[int], after: int) -> tuple[int | None, int]:
        """(cursor, anchor length) after a divergence; (None, 0) when no anchor recurs."""
        for k in ANCHORS:
            if len(emitted) < k:
                continue
            ends = self._grams[k].get(tuple(emitted[-k:]))  # ascending
            if ends:
                at = bisect_left(ends, after)
                return (ends[at] if at < len(ends) else ends[0]), k
        return None, 0

    def propose(self, view: DecodeView) -> Proposal | None:
        emitted = view.emitted
        new = emitted[self._seen:]
        self._seen = len(emitted)
        if self.gate is not None:
            self.gate.begin(new)
        c = self._cursor
        if c is not None and list(new) == self.ids[c:c + len(new)]:
            c += len(new)
        else:
            c, k = self._reanchor(emitted, c or 0)
            self._state = ("anchor", k)
        self._cursor = c
        if c is None or c >= len(self.ids):
            return None
        ids = tuple(self.ids[c:c + self.max_span])
        key, self._state = self._state, ("sync",)
        if self.gate is not None:
            n = self.gate.offer(ids, key)
            if n <= 0:
                if self._request_stats is not None:
                    self._request_stats.declined_by_origin[self.name] += 1
                return None
            ids = ids[:n]
        return Proposal(ids, "verify", self.name)

    def bind_stats(self, request_stats: Any) -> None:
        """Count each offer the cost gate declines in ``request_stats.declined_by_origin``."""
        self._request_stats = request_stats

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        if self.gate is not None:
            self.gate.observe_proposed(len(proposal.ids), accepted)


ALIGN_ANCHOR = 4  # ids of the completion that place the prediction's cursor after a divergence


def prediction_usage(predicted: Sequence[int], completion: Sequence[int]) -> dict[str, int]:
    """OpenAI's ``completion_tokens_details`` for a prediction of ids ``predicted``, as OpenAI
    defines them: accepted = the predicted ids that appear in the completion, in order;
    rejected = the rest. Whichever source proposed an id (or none, or fill off) does not
    matter; ``usage.fill`` says what fill did.

    One pass over the completion with a cursor in the prediction: an id equal to the one at the
    cursor is accepted and both advance; otherwise the cursor moves forward to the nearest place
    where the completion's next :data:`ALIGN_ANCHOR` ids occur (the ids it skips are rejected:
    the edit deleted them), or, where they occur nowhere ahead, the completion's id is passed
    (the edit inserted it). Linear in both lengths (a binary search per divergence)."""
    starts: dict[tuple[int, ...], list[int]] = {}  # anchor -> its places in ``predicted``, ascending
    for at in range(len(predicted) - ALIGN_ANCHOR + 1):
        starts.setdefault(tuple(predicted[at:at + ALIGN_ANCHOR]), []).append(at)
    cursor = accepted = i = 0
    while i < len(completion) and cursor < len(predicted):
        if completion[i] == predicted[cursor]:
            accepted, cursor, i = accepted + 1, cursor + 1, i + 1
            continue
        places = starts.get(tuple(completion[i:i + ALIGN_ANCHOR]), [])
        ahead = bisect_left(places, cursor)
        if ahead < len(places):
            cursor = places[ahead]  # its next ALIGN_ANCHOR ids match: the loop accepts them
        else:
            i += 1
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": len(predicted) - accepted}
