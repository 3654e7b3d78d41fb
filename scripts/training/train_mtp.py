"""Train an MTP head for a Qwen3.5-style target by self-distillation, written as ``mtp.*`` tensors.

The target is frozen. For every training sequence ``s`` the target runs once (teacher forcing):
its pre-final-norm hidden states ``H`` (captured by :class:`mlx_fill.spec.mtp_tap.HiddenTap`) and its
greedy predictions ``y`` (``y[p]`` = the target's argmax for the slot after ``s[p]``). The head is
trained on the two ways :class:`~mlx_fill.spec.mtp.MTPSource` uses it:

* step 1, row ``p`` = ``(embed(s[p+1]), H[p])`` -> label ``y[p+1]`` (predict-ahead);
* step 2 (chained), row ``p`` = ``(embed(s[p+2]), out1[p])`` -> label ``y[p+2]``, where ``out1``
  is the head's own pre-norm output of step 1 (weight ``--chain-weight``).

Labels are the target's own predictions, not the corpus tokens, so the head learns what
verification will accept. The softmax runs over the ids the corpus and the labels use unless
``--full-vocab`` (the fixtures' vocabularies are 150k-250k ids wide). Corpora: ``fixture`` (the conversations a fixture was trained on,
``scripts/training/fixture_data.py``) or ``self`` (random prompts plus the target's greedy continuations).

    python -m scripts.training.train_mtp --make-random DIR            # tiny random qwen3_5 + self corpus
    python -m scripts.training.train_mtp "$(mlx-fill fixture qwen35-xml)" --corpus fixture \
        --out fixtures/models/qwen35-xml/model-mtp.safetensors
writes ``DIR/model-mtp.safetensors`` (or ``--out``; mlx-lm's loader ignores it;
``load_mtp_head(DIR, target)`` reads it; a fixture's committed head is assembled into its dir).
Prints the held-out step-1 / step-2 agreement with the target before and after.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from mlx_fill.assets.random_models import build, config_for, save
from mlx_fill.spec.mtp_head import MTPHead
from mlx_fill.spec.mtp_tap import HiddenTap

from scripts.training import openblas

HEAD_FILE = "model-mtp.safetensors"


def self_corpus(target, count: int, prompt_len: int, gen_len: int, seed: int) -> list[list[int]]:
    """Random prompts followed by the target's own greedy continuation."""
    vocab = target.language_model.args.vocab_size
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        cont = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=gen_len)]
        out.append(prompt + cont)
    return out


def fixture_corpus(model_dir: Path, fixture: str, limit: int) -> list[list[int]]:
    """The training windows of ``fixture`` (whole session windows, in seeded order)."""
    import train_fixture
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    windows = train_fixture.training_sequences(train_fixture.SPECS[fixture], tokenizer)
    rng = random.Random(0)
    rng.shuffle(windows)
    return [list(w.ids) for w in windows[:limit]]


def output_matrix(target) -> mx.array:
    """The target's ``[V, H]`` output projection (lm-head or tied embeddings)."""
    lm = target.language_model
    return lm.model.embed_tokens.weight if lm.args.tie_word_embeddings else lm.lm_head.weight


def teacher(target, tap: HiddenTap, seq: list[int]) -> tuple[mx.array, mx.array]:
    """(pre-norm hidden ``[T, H]``, greedy predictions ``[T]``) of the target over ``seq``;
    the full-vocabulary projection runs in row chunks to bound memory."""
    body = target.language_model.model
    body(mx.array(seq)[None], cache=make_prompt_cache(target))
    hidden = tap.rows(0, len(seq))
    out = output_matrix(target)
    labels = mx.concatenate([mx.argmax(body.norm(hidden[i:i + 128]) @ out.T, axis=-1)
                             for i in range(0, len(seq), 128)])
    mx.eval(hidden, labels)
    return hidden, labels


class Vocab:
    """The output rows the loss uses (all, or the ids the corpus and the labels touch), and
    the map from token ids to those rows."""

    def __init__(self, target, ids: set[int] | None):
        full = output_matrix(target)
        if ids is None:
            self.rows, self.index = full, None
        else:
            keep = sorted(ids)
            self.rows = full[mx.array(keep)]
            table = mx.zeros((full.shape[0],), dtype=mx.int32)
            self.index = table.at[mx.array(keep)].add(mx.arange(len(keep), dtype=mx.int32))
        mx.eval(self.rows)

    def logits(self, head: MTPHead, x: mx.array) -> mx.array:
        return head.norm(x) @ self.rows.T

    def labels(self, ids: mx.array) -> mx.array:
        return ids if self.index is None else self.index[ids]


def losses(head: MTPHead, target, vocab: Vocab, seq: mx.array, hidden: mx.array,
           labels: mx.array):
    """(step-1 loss, step-2 loss, step-1 hits, step-2 hits, rows) for one sequence."""
    embed = target.language_model.model.embed_tokens
    out1 = head(embed(seq[1:])[None], hidden[:-1][None], [None])
    l1 = vocab.logits(head, out1)[0]
    out2 = head(embed(seq[2:])[None], out1[:, :-1], [None])
    l2 = vocab.logits(head, out2)[0]
    labels = vocab.labels(labels)
    y1, y2 = labels[1:], labels[2:]
    ce1 = nn.losses.cross_entropy(l1, y1, reduction="mean")
    ce2 = nn.losses.cross_entropy(l2, y2, reduction="mean")
    hits1 = (mx.argmax(l1, axis=-1) == y1).sum()
    hits2 = (mx.argmax(l2, axis=-1) == y2).sum()
    return ce1, ce2, hits1, hits2, y1.size, y2.size


def agreement(head, target, vocab: Vocab, data) -> tuple[float, float]:
    h1 = h2 = n1 = n2 = 0
    for seq, hidden, labels in data:
        _, _, a, b, c, d = losses(head, target, vocab, seq, hidden, labels)
        h1, h2, n1, n2 = h1 + a.item(), h2 + b.item(), n1 + c, n2 + d
    return h1 / n1, h2 / n2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", type=Path, help="a qwen3_5 model dir")
    ap.add_argument("--make-random", type=Path, help="create a tiny random qwen3_5 here and use it")
    ap.add_argument("--corpus", choices=["self", "fixture"], default="self")
    ap.add_argument("--fixture", default="qwen35-xml")
    ap.add_argument("--sequences", type=int, default=160)
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--chain-weight", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=640, help="truncate sequences (keep the end)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"where to write the head (default: CHECKPOINT/{HEAD_FILE})")
    ap.add_argument("--full-vocab", action="store_true",
                    help="softmax over every id (default: the ids the corpus and labels use)")
    args = ap.parse_args(argv)
    if (args.checkpoint is None) == (args.make_random is None):
        ap.error("give a checkpoint dir or --make-random DIR")
    if argv is None:  # as a script: restart once with OpenBLAS
        openblas.reexec()
    path = args.checkpoint
    if args.make_random is not None:
        model, config = build(config_for("qwen3_5"))
        path = save(model, config, args.make_random)
    target, _ = load_model(path)
    target.freeze()
    tap = HiddenTap.install(target)

    total = args.sequences + args.held_out
    seqs = (self_corpus(target, total, 24, 40, args.seed) if args.corpus == "self"
            else fixture_corpus(path, args.fixture, total))
    seqs = [s[-args.max_len:] for s in seqs if len(s) >= 4]
    data = [(mx.array(s), *teacher(target, tap, s)) for s in seqs]
    train, held = data[args.held_out:], data[:args.held_out]
    used = None if args.full_vocab else (
        {t for s in seqs for t in s} | {int(t) for _, _, y in data for t in y.tolist()})
    vocab = Vocab(target, used)

    mx.random.seed(args.seed)
    head = MTPHead(target.language_model.args)
    head.set_dtype(target.language_model.model.embed_tokens.weight.dtype)
    print(f"untrained head: held-out agreement step1/step2 = {agreement(head, target, vocab, held)}")
    opt = optim.Adam(learning_rate=args.lr)

    def loss_fn(head, seq, hidden, labels):
        ce1, ce2, *_ = losses(head, target, vocab, seq, hidden, labels)
        return ce1 + args.chain_weight * ce2

    step = nn.value_and_grad(head, loss_fn)
    rng = random.Random(args.seed)
    t0 = time.time()
    for epoch in range(args.epochs):
        rng.shuffle(train)
        total_loss = 0.0
        for seq, hidden, labels in train:
            loss, grads = step(head, seq, hidden, labels)
            opt.update(head, grads)
            mx.eval(head.parameters(), opt.state)
            total_loss += loss.item()
        print(f"epoch {epoch + 1}: loss {total_loss / len(train):.3f} "
              f"({time.time() - t0:.0f}s)")
    print(f"trained head: held-out agreement step1/step2 = {agreement(head, target, vocab, held)}")
    out = args.out or path / HEAD_FILE
    mx.save_safetensors(str(out), {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
