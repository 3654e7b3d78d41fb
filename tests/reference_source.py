"""A proposal source for decode-loop tests: it knows the reference continuation."""

from __future__ import annotations

import random

from mlx_fill.core.proposal import Proposal


class ReferenceSource:
    """Proposes the next ``span`` ids of ``reference`` (the continuation serial decoding
    produces) every ``every`` emitted tokens, each draft corrupted at one position with
    probability ``corrupt`` (a verify round then rejects its tail and rewinds)."""

    name = "reference"

    def __init__(self, reference, policy: str, corrupt: float = 0.0, *, every: int = 5,
                 span: int = 6, seed: int = 3):
        self.ref, self.policy, self.corrupt = reference, policy, corrupt
        self.every, self.span, self.rng = every, span, random.Random(seed)

    def propose(self, view):
        i = len(view.emitted)
        span = list(self.ref[i:i + self.span])
        if i % self.every or not span:
            return None
        if self.rng.random() < self.corrupt:
            k = self.rng.randrange(len(span))
            span[k] = (span[k] + 1) % 512
        return Proposal(tuple(span), self.policy, self.name)

    def feedback(self, proposal, accepted):
        pass
