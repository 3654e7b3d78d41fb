"""``mtp``: a Qwen3.5 / Qwen3-Next checkpoint's own multi-token-prediction head as a DraftSource
(the head: :mod:`mlx_fill.spec.mtp_head`; the hidden-state capture: :mod:`mlx_fill.spec.mtp_tap`).

Qwen3.5 checkpoints ship ``mtp.*`` tensors that mlx-lm's loader drops: ``mtp.fc`` (merges the
normed embedding of a token with the normed target hidden state, ``[2H -> H]``, embedding
first), ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.{i}`` (full-
attention decoder layers of the target's own kind) and ``mtp.norm``; the head shares the target's
embeddings and lm-head. :func:`load_mtp_head` reads those tensors from the checkpoint's
safetensors (adding the ``+1`` of zero-centred norms when the checkpoint is an unconverted HF one,
by mlx-lm's own test: an unsanitized ``conv1d`` weight).

Row convention (predict-ahead): the head's cache row at position ``p`` is built from
``(embed(token[p+1]), hidden[p])`` where ``hidden[p]`` is the target's PRE-final-norm last-layer
hidden state at ``p`` (captured by :class:`HiddenTap`); its output predicts ``token[p+2]``.
In the fill loop the target's sample for the slot after the last emitted id ``t[N-1]`` is in
flight but not visible to sources, so a round of ``n`` drafts builds row ``N-2`` from the true
``(t[N-1], hidden[N-2])`` (draft 1, the slot the loop checks for free), row ``N-1`` from
``(d_1, hidden[N-1])`` (draft 2, still a true hidden) and chains the head's own pre-norm output
as the hidden for drafts 3..n. ``commit`` keeps row ``N-2`` always and row ``N-1`` when ``d_1``
was accepted (both then hold true inputs) and rewinds the rest with the shared primitive; rows
for later accepted positions are rebuilt from the verify forward's true hidden states on the
next round, so the head's cache only ever holds rows built from true inputs.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_fill.core.plan import DispatchPlan, unqualified
from mlx_fill.core.primitive import Checkpoint, checkpoint, rewind
from .base import DraftProposalSource
from .mtp_head import MTPHead
from .mtp_tap import HiddenTap, decoder_body, lm_head_logits

PREFILL_CHUNK = 512


class MTPSource:
    """The target's MTP head as a :class:`~mlx_fill.spec.base.DraftSource` (greedy drafts).

    ``target`` must be the model the fill loop decodes with (its :class:`HiddenTap` supplies
    the true hidden states); ``plan`` is only used for the head cache's checkpoints.
    """

    name = "mtp"
    needs_fed_context = True  # drafts read the target's hidden state at the last fed position

    def __init__(self, target: Any, head: MTPHead, *, plan: DispatchPlan | None = None):
        self.target = target
        self.head = head
        self.tap = HiddenTap.install(target)
        self.plan = plan or unqualified()
        self._embed = decoder_body(target).embed_tokens
        self._ctx: list[int] = []
        self._cache: list[KVCache] = []
        self._built = 0  # head rows for positions < _built hold true inputs
        self._round: Checkpoint | None = None
        self._round_base = 0

    def prefill(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("prefill needs a non-empty prompt")
        self._ctx = [int(t) for t in prompt]
        self._cache = self.head.make_cache()
        self._built = 0
        self._round = None

    def _rows(self, ids: Sequence[int], hidden: mx.array) -> mx.array:
        """Append head rows for ``ids`` with ``hidden`` ``[L, H]``; returns pre-norm outputs."""
        return self.head(self._embed(mx.array(list(ids))[None]), hidden[None], self._cache)

    def _logits_argmax(self, out: mx.array) -> int:
        return int(mx.argmax(lm_head_logits(self.target, self.head.norm(out[:, -1:])), axis=-1).item())

    def _build_true_rows(self, stop: int) -> None:
        """Rows for positions ``_built..stop-1`` from committed ids and captured hidden states.
        When the target never forwarded the earliest positions in this request (a prompt-cache
        hit) the rows start at the first captured one: RoPE scores depend on relative positions
        only, so the head just sees a shorter context."""
        first = self.tap.first()
        if first is not None and first > self._built:
            self._built = min(first, stop)
        while self._built < stop:
            end = min(stop, self._built + PREFILL_CHUNK)
            self._rows(self._ctx[self._built + 1:end + 1], self.tap.rows(self._built, end))
            mx.eval([c.state for c in self._cache])
            self._built = end
        self.tap.release_below(self._built)

    def draft(self, feed: Sequence[int], n: int) -> list[int]:
        """Greedy drafts for the ``n`` slots after the last fed id (module docstring for the
        rows); a previous round that got no :meth:`commit` counts as fully rejected."""
        if self._round is not None:  # the session dropped the round (e.g. cut to nothing at EOS)
            self.commit((), 0)
        self._ctx.extend(int(t) for t in feed)
        size = len(self._ctx)
        if n <= 0 or size < 2:
            return []
        self._build_true_rows(size - 2)
        self._round = checkpoint(self.head, self._cache, self.plan)
        self._round_base = size - 2
        out = self._rows(self._ctx[-1:], self.tap.rows(size - 2, size - 1))
        self._round.appended.append(self._ctx[-1])
        drafted = [self._logits_argmax(out)]
        hidden = self.tap.rows(size - 1, size)
        while len(drafted) < n:
            out = self._rows(drafted[-1:], hidden)
            self._round.appended.append(drafted[-1])
            drafted.append(self._logits_argmax(out))
            hidden = out[0]
        return drafted

    def commit(self, drafted: Sequence[int], accepted: int) -> None:
        if self._round is None:
            raise ValueError("commit() without a drafting round")
        if not 0 <= accepted <= len(drafted):
            raise ValueError(f"accepted={accepted} outside 0..{len(drafted)}")
        keep = 2 if accepted >= 1 and len(self._round.appended) >= 2 else 1
        rewind(self._round, keep)
        self._built = self._round_base + keep
        self._round = None



def make_mtp_source(target: Any, head: MTPHead, *, num_draft_tokens: int = 2,
                    plan: DispatchPlan | None = None) -> DraftProposalSource:
    """The ``mtp`` fill source for one request (load ``head`` once per model with
    :func:`load_mtp_head`); ``num_draft_tokens`` defaults to 2, Qwen's MTP block size - 1."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    return DraftProposalSource(MTPSource(target, head, plan=plan), length=lambda: num_draft_tokens)
