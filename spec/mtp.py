"""``mtp``: a Qwen3.5 / Qwen3-Next checkpoint's own multi-token-prediction head as a DraftSource.

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

import json
import struct
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlx_fill.core.plan import DispatchPlan, unqualified
from mlx_fill.core.primitive import Checkpoint, cache_offset, checkpoint, rewind
from .base import DraftProposalSource

PREFILL_CHUNK = 512


def _text_model(target: Any) -> Any:
    """The language model holding ``args``, ``model`` (embeddings, layers, norm) and lm-head."""
    return getattr(target, "language_model", target)


def _body(target: Any) -> Any:
    return _text_model(target).model


def _lm_head(target: Any, x: mx.array) -> mx.array:
    lm = _text_model(target)
    if getattr(lm.args, "tie_word_embeddings", False) or not hasattr(lm, "lm_head"):
        return lm.model.embed_tokens.as_linear(x)
    return lm.lm_head(x)


class HiddenTap:
    """Read-only capture of a target's pre-final-norm hidden states, indexed by position.

    :meth:`install` makes the target's decoder body note the cache offset at which each forward
    starts and its final norm record its input; nothing the target computes changes. A forward
    starting at offset ``s`` supersedes every captured row at positions ``>= s`` (that is what a
    rewind followed by a new append means for the cache), so the rows held always belong to
    what the target's cache holds now. ``release_below(p)`` drops rows a consumer no longer
    needs (memory stays bounded by the unconsumed tail).
    """

    _patched: dict[type, type] = {}

    def __init__(self) -> None:
        self._segments: list[tuple[int, mx.array]] = []
        self._start: int | None = None

    @classmethod
    def install(cls, target: Any) -> "HiddenTap":
        """The tap on ``target`` (installed on first use; later calls return the same tap)."""
        body = _body(target)
        tap = getattr(body, "_fill_hidden_tap", None)
        if tap is not None:
            return tap
        tap = cls()
        body._fill_hidden_tap = tap
        body.norm._fill_hidden_tap = tap
        body.__class__ = cls._tapped(type(body), _body_call)
        body.norm.__class__ = cls._tapped(type(body.norm), _norm_call)
        return tap

    @classmethod
    def _tapped(cls, base: type, call: Any) -> type:
        if base not in cls._patched:
            cls._patched[base] = type(f"Tapped{base.__name__}", (base,), {"__call__": call})
        return cls._patched[base]

    def _begin(self, cache: Any) -> None:
        self._start = cache_offset(cache) if cache is not None and cache[0] is not None else None

    def _record(self, x: mx.array) -> None:
        start, self._start = self._start, None
        if start is None:
            return
        kept: list[tuple[int, mx.array]] = []
        for s, rows in self._segments:
            if s >= start:
                continue
            kept.append((s, rows if s + rows.shape[0] <= start else rows[:start - s]))
        kept.append((start, x[0]))
        self._segments = kept

    def first(self) -> int | None:
        """The lowest captured position (None when nothing is held)."""
        return self._segments[0][0] if self._segments else None

    def rows(self, start: int, stop: int) -> mx.array:
        """Hidden rows ``[stop - start, H]`` for positions ``start..stop-1``; KeyError when any
        of them was not captured."""
        parts: list[mx.array] = []
        pos = start
        for s, rows in self._segments:
            end = s + rows.shape[0]
            if end <= pos or s > pos:
                continue
            take = min(end, stop) - pos
            parts.append(rows[pos - s:pos - s + take])
            pos += take
            if pos == stop:
                break
        if pos != stop:
            raise KeyError(f"target hidden state at position {pos} was not captured "
                           f"(held: {[(s, s + r.shape[0]) for s, r in self._segments]})")
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def release_below(self, position: int) -> None:
        kept: list[tuple[int, mx.array]] = []
        for s, rows in self._segments:
            end = s + rows.shape[0]
            if end <= position:
                continue
            kept.append((s, rows) if s >= position else (position, rows[position - s:]))
        self._segments = kept


def _body_call(self, inputs, cache=None, input_embeddings=None):
    self._fill_hidden_tap._begin(cache)
    return super(type(self), self).__call__(inputs, cache, input_embeddings=input_embeddings)


def _norm_call(self, x):
    self._fill_hidden_tap._record(x)
    return super(type(self), self).__call__(x)


class MTPHead(nn.Module):
    """The MTP head's own weights; embeddings and lm-head are the target's (passed per call)."""

    def __init__(self, args: Any, num_layers: int = 1):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer

        if num_layers < 1:
            raise ValueError("an MTP head needs at least one layer")
        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        full = args.full_attention_interval - 1  # a layer index whose layer is full attention
        self.layers = [DecoderLayer(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list[KVCache]) -> mx.array:
        """Rows ``[1, L, H]`` from token embeddings and target hidden states (both
        ``[1, L, H]``); returns the pre-norm output (the hidden state chained to the next row)."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return x


def _safetensors_header(path: Path) -> dict[str, Any]:
    """Tensor names -> {dtype, shape, ...} from a safetensors header, without reading data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _mtp_name(key: str) -> str | None:
    """``mtp.fc.weight`` / ``model.mtp.fc.weight`` / ... -> ``fc.weight``; None otherwise."""
    parts = key.split(".")
    return ".".join(parts[parts.index("mtp") + 1:]) if "mtp" in parts else None


def _unfuse_experts(weights: dict[str, mx.array]) -> None:
    """HF Qwen3.5-MoE layout (``mlp.experts.gate_up_proj`` fused, ``mlp.experts.down_proj``) to
    mlx-lm's ``mlp.switch_mlp.{gate,up,down}_proj.weight``, in place (as mlx-lm's sanitize does
    for the decoder layers)."""
    for key in [k for k in weights if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate_up = weights.pop(key)
        mid = gate_up.shape[-2] // 2
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")


def has_mtp(model_path: str | Path) -> bool:
    """Whether the checkpoint at ``model_path`` carries ``mtp.*`` tensors."""
    return any(_mtp_name(k) for f in Path(model_path).glob("*.safetensors")
               for k in _safetensors_header(f))


def load_mtp_head(model_path: str | Path, target: Any) -> MTPHead:
    """Build the MTP head of the checkpoint at ``model_path`` for the loaded ``target``.

    MoE heads are read in mlx-lm's stacked layout or HF's fused ``experts.gate_up_proj`` one.
    Raises ValueError when the checkpoint carries no ``mtp.*`` tensors or they do not match
    the head's layout.
    """
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors"))
    headers = {f: _safetensors_header(f) for f in files}
    unsanitized = any("conv1d.weight" in k and v["shape"][-1] != 1
                      for h in headers.values() for k, v in h.items())
    weights: dict[str, mx.array] = {}
    for f, header in headers.items():
        if not any(_mtp_name(k) for k in header):
            continue
        for key, value in mx.load(str(f)).items():
            name = _mtp_name(key)
            if name is None:
                continue
            if unsanitized and name.endswith("norm.weight") and value.ndim == 1:
                value = value + 1.0
            weights[name] = value
    if not weights:
        raise ValueError(f"{path} carries no mtp.* tensors")
    _unfuse_experts(weights)
    layer_ids = {int(n.split(".")[1]) for n in weights if n.startswith("layers.")}
    head = MTPHead(_text_model(target).args, num_layers=max(layer_ids) + 1 if layer_ids else 0)
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    quant = config.get("quantization")
    if quant and any(n.endswith(".scales") for n in weights):
        nn.quantize(head, group_size=quant["group_size"], bits=quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"mtp.* tensors in {path} do not match the MTP head layout: {e}") from e
    mx.eval(head.parameters())
    return head


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
        self._embed = _body(target).embed_tokens
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
        return int(mx.argmax(_lm_head(self.target, self.head.norm(out[:, -1:])), axis=-1).item())

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
