"""The speculative roster's seam: :class:`DraftSource`, and its adapter to a fill source.

A drafter never decides what is emitted: every drafted id is checked by the target through the
one verifier (``mlx_fill.core.acceptance``) on the shared append-and-rewind primitive.

Contract of a :class:`DraftSource`:

- ``prefill(prompt)`` once per request with the full prompt ids;
- ``draft(feed, n)`` with ``feed`` = the ids committed since the previous call (the last
  emitted token included, injected ones too); returns at most ``n`` ids for the slots after
  the last fed id. Returning fewer, including none, is always allowed.
- ``commit(drafted, accepted)`` after verification: the first ``accepted`` drafted ids were
  committed, the rest rejected (a drafter with its own cache rewinds it here).

Sources that read the target's live caches, hidden-state taps or lm-head (KV-borrowing and
block drafters) receive them through a read-only ``TargetView`` given at construction; none
ships here because no such checkpoint is obtainable for the fixture models.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

from mlx_fill.core.proposal import DecodeView, Proposal


@runtime_checkable
class DraftSource(Protocol):
    name: str

    def prefill(self, prompt: Sequence[int]) -> None: ...

    def draft(self, feed: Sequence[int], n: int) -> list[int]: ...

    def commit(self, drafted: Sequence[int], accepted: int) -> None: ...


class DraftProposalSource:
    """Runs a :class:`DraftSource` as a ``verify`` proposal source, so the decode loop has one
    apply path. ``length`` picks each round's draft length from the source's running
    acceptance (the cost model); a length of 0 proposes nothing this round. A source with
    ``needs_fed_context = True`` (it reads the target's hidden state at the last fed position)
    is not asked while the view's last token is still pending."""

    def __init__(self, source: DraftSource, length: Callable[[], int]):
        self.source = source
        self.name = source.name
        self._length = length
        self._seen = 0
        self._prefilled = False

    def propose(self, view: DecodeView) -> Proposal | None:
        if not self._prefilled:
            self.source.prefill(list(view.prompt))
            self._seen = len(view.prompt)
            self._prefilled = True
        if view.pending and getattr(self.source, "needs_fed_context", False):
            return None
        n_prompt = len(view.prompt)
        feed = list(view.emitted[self._seen - n_prompt:])  # O(new tokens), not O(context)
        self._seen = n_prompt + len(view.emitted)
        n = self._length()
        if n <= 0:
            if feed:
                self.source.draft(feed, 0)
            return None
        ids = self.source.draft(feed, n)[:n]
        if not ids:
            return None
        return Proposal(tuple(int(t) for t in ids), "verify", self.name)

    def withdraw(self) -> None:
        """The draft just proposed was not made (another source's was)."""
        withdraw = getattr(self.source, "withdraw", None)
        if withdraw is not None:
            withdraw()

    def feedback(self, proposal: Proposal, accepted: int) -> None:
        self.source.commit(list(proposal.ids), accepted)
