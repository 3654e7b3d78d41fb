"""``draft``: a second, smaller mlx-lm model sharing the target's tokenizer, as a DraftSource.

The draft model keeps its own cache and drafts greedily; rejected drafts are taken back with
the same append-and-rewind primitive the target uses (``checkpoint`` / ``rewind``), so hybrid
(recurrent) draft models work too.

Cache convention (the one ``mlx_lm.generate.speculative_generate_step`` uses): between rounds the
draft cache holds every committed id except a *pending* tail of one id (the correction) or two
(the last accepted draft, which was never forwarded by the draft model, and the bonus). A round
of ``n`` drafts forwards the pending tail once, then ``n - 1`` single drafted ids; ``commit``
keeps the accepted drafted ids that were forwarded and drops the rest; the next ``feed`` repeats
the accepted ids (they were emitted), and those are recognised and not forwarded twice.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.resolve import plan_for
from mlx_fill.core.primitive import Checkpoint, append, checkpoint, rewind
from .base import DraftProposalSource

PROBE = "Hello, world! <tool_call>{\"name\": \"read_file\", \"arguments\": {\"path\": \"/tmp/x.py\"}}"


class TokenizerMismatch(ValueError):
    """The draft model's tokenizer is not the target's: drafted ids would mean other tokens."""


def _tokenizer_signature(tok: Any) -> dict[str, Any]:
    """What must agree for ids to mean the same tokens: vocabulary size, a probe encoding and
    the special ids."""
    inner = getattr(tok, "_tokenizer", tok)
    return {
        "vocab_size": len(inner),
        "probe": list(inner.encode(PROBE, add_special_tokens=False)),
        "eos_token_id": inner.eos_token_id,
        "bos_token_id": inner.bos_token_id,
        "pad_token_id": inner.pad_token_id,
        "special_ids": sorted(int(i) for i in inner.all_special_ids),
    }


def check_same_tokenizer(draft_tokenizer: Any, target_tokenizer: Any) -> None:
    """Raise :class:`TokenizerMismatch` naming every field where the two tokenizers differ."""
    a, b = _tokenizer_signature(draft_tokenizer), _tokenizer_signature(target_tokenizer)
    diff = [k for k in a if a[k] != b[k]]
    if diff:
        detail = "; ".join(f"{k}: draft={a[k]!r} target={b[k]!r}" for k in diff
                           if k != "probe") or "probe string encodes differently"
        raise TokenizerMismatch(f"draft model tokenizer differs from the target's ({detail})")


class DraftModelSource:
    """A draft model as a :class:`~mlx_fill.spec.base.DraftSource`.

    Drafts are the argmax of the draft model's raw logits. mlx-lm drafts through the request's
    sampler and logits processors; at temperature 0 without processors the two coincide, and
    either way every emitted token is the target's own sample (the verifier decides).

    ``tokenizer`` / ``target_tokenizer``: pass both to have the pair checked at construction
    (:class:`TokenizerMismatch` on any difference); passing only one is an error. Passing
    neither means the caller vouches that the vocabularies are the same.
    ``plan``: the dispatch plan for the draft model's appends (default: the draft's own,
    ``resolve.plan_for(draft)``, qualified on first use).
    """

    name = "draft"

    def __init__(self, draft_model: Any, *, plan: DispatchPlan | None = None,
                 tokenizer: Any = None, target_tokenizer: Any = None) -> None:
        if (tokenizer is None) != (target_tokenizer is None):
            raise ValueError("pass both tokenizer and target_tokenizer to check the pair, or neither")
        if tokenizer is not None:
            check_same_tokenizer(tokenizer, target_tokenizer)
        self.model = draft_model
        self.plan = plan or plan_for(draft_model)
        self._cache: list[Any] | None = None
        self._pending: list[int] = []
        self._round: Checkpoint | None = None
        self._drafted: list[int] = []
        self._known: list[int] = []  # accepted drafts the next feed repeats (already handled)

    def prefill(self, prompt: Sequence[int]) -> None:
        """Start a request: a fresh cache holding ``prompt[:-1]``; the last id stays pending."""
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prefill needs a non-empty prompt")
        self._cache = make_prompt_cache(self.model)
        if len(ids) > 1:
            append(self.model, self._cache, ids[:-1], plan=self.plan, logits="none")
            mx.eval([c.state for c in self._cache])
        self._pending = ids[-1:]
        self._round = None
        self._drafted = []
        self._known = []

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        """Greedy drafts for the ``n`` slots after the last fed id (``n <= 0``: only record
        ``feed``; its forward is deferred to the next drafting round). A previous round that
        got no :meth:`commit` (the session dropped it) counts as fully rejected."""
        if self._cache is None:
            raise ValueError("draft() before prefill()")
        if self._round is not None:  # the session dropped the round (e.g. cut to nothing at EOS)
            self.commit(self._drafted, 0)
        feed = [int(t) for t in feed]
        while self._known and feed:
            if feed[0] != self._known[0]:
                raise ValueError(f"feed {feed} does not start with the accepted drafts "
                                 f"{self._known}")
            feed.pop(0)
            self._known.pop(0)
        self._pending.extend(feed)
        if n <= 0:
            return []
        if not self._pending:
            raise ValueError("draft() needs at least one id not yet in the draft cache")
        logits = append(self.model, self._cache, self._pending, plan=self.plan, logits="last")
        self._pending = []
        self._round = checkpoint(self.model, self._cache, self.plan)
        drafted = [int(mx.argmax(logits, axis=-1).item())]
        while len(drafted) < n:
            logits = append(self.model, self._cache, drafted[-1:], plan=self.plan, logits="last",
                            record=self._round)
            drafted.append(int(mx.argmax(logits, axis=-1).item()))
        self._drafted = drafted
        return list(drafted)

    def commit(self, drafted: Sequence[int], accepted: int) -> None:
        """Keep the first ``accepted`` drafted ids (``drafted`` may be a prefix of what
        :meth:`draft` returned: the loop cuts spans at EOS and ``max_tokens``)."""
        if self._round is None:
            raise ValueError("commit() without a drafting round")
        if not 0 <= accepted <= len(drafted) or list(drafted) != self._drafted[:len(drafted)]:
            raise ValueError(f"commit({list(drafted)}, {accepted}) does not match the last round "
                             f"{self._drafted}")
        forwarded = len(self._round.appended)  # drafts 1..n-1 went through the draft model
        rewind(self._round, min(accepted, forwarded))
        if accepted > forwarded:  # every draft accepted: the last one was never forwarded
            self._pending = [self._drafted[accepted - 1]]
        self._known = list(drafted[:accepted])
        self._round = None
        self._drafted = []


def make_draft_source(draft_model: Any, *, num_draft_tokens: int = 3,
                      plan: DispatchPlan | None = None, tokenizer: Any = None,
                      target_tokenizer: Any = None) -> DraftProposalSource:
    """The ``draft`` fill source for one request: ``num_draft_tokens`` drafts per round
    (mlx_lm.server's default 3), tokenizer pair checked as in :class:`DraftModelSource`."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    src = DraftModelSource(draft_model, plan=plan, tokenizer=tokenizer,
                           target_tokenizer=target_tokenizer)
    return DraftProposalSource(src, length=lambda: num_draft_tokens)
