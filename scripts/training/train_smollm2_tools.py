"""Teach SmolLM2-135M-Instruct (the ``smollm2-135m`` fixture) to call tools: a LoRA adapter trained
with mlx-lm's own trainer (``mlx_lm.tuner``) on the real agent transcripts.

    python -m scripts.training.train_smollm2_tools                  # train + eval, write fixtures/models/smollm2-tools/
    python -m scripts.training.train_smollm2_tools --steps 3 --out /tmp/x --no-eval   # smoke run
    python -m scripts.training.train_smollm2_tools --eval           # greedy eval of the committed adapter
    python -m scripts.training.train_smollm2_tools --resume fixtures/models/smollm2-tools --sources pi_mono tau_bench_gpt4o_airline --out /tmp/more
                                                                    # 60 more steps on the sources with prose turns

Data: the transcripts of ``fixture_data`` (pi, tau-bench airline, mini-swe-agent), split by
``fixture_data.split_sessions`` (whole sessions held back per source; pi's one session by its
last turns), rendered through the fixture's tools-aware ChatML template, so every call is Hermes
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` spelled in ordinary tokens (no token
is added to the vocabulary). Training sequences are session windows of at most ``--window`` ids
(``fixture_data.Renderer.sequences``; 1536 by default, so a tau-bench or pi tools block plus
several turns fit), the loss on every assistant turn in a window; the three sources take turns.

Training: LoRA (rank 8, scale 20) on the attention and MLP projections of the last 16 of 30
layers, Adam, batch 1, float32 weights, through ``mlx_lm.tuner.train`` with a loss masked to the
target spans and a seeded batch order. Deterministic for a seed and a BLAS; the run restarts
itself with OpenBLAS preloaded where installed (``openblas.py``) and records which BLAS it had.

The adapter (``adapters.safetensors``, ``adapter_config.json`` in mlx-lm's format plus the
training record) is what is committed; ``mlx-fill fixture smollm2-tools`` fuses it into the base
weights. Eval (greedy, held-back turns of every source): the share of call turns answered with a
parseable call to a declared tool (target >= 85%) and of prose turns answered without a call
(target >= 90%), written to ``eval.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_fill.assets import fixtures, smollm2
from scripts.training import decision_ceiling, fixture_data, openblas
from scripts.training.train_fixture import greedy

SEED = 0
WINDOW = 1536
STEPS = 60
TRAIN_CAP = 200  # windows per source
PAD_TO = 32
LEARNING_RATE = 1e-4
LORA_LAYERS = 16
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}
EVAL_CALLS_PER_SOURCE = 12
EVAL_PROSE = 12
CALL_TARGET, PROSE_TARGET = 0.85, 0.90


def training_sequences(tokenizer, window: int, seed: int,
                       sources: tuple[str, ...] = fixture_data.SOURCES) -> list[fixture_data.Sequence]:
    """Windows of the training sessions, loss on every assistant turn: of every source in
    ``sources``, the sessions in seeded order are rendered until TRAIN_CAP windows are there."""
    train_sessions, _ = fixture_data.split_sessions(fixture_data.load_recordings(), seed)
    renderer = fixture_data.Renderer(tokenizer._tokenizer, set(tokenizer.eos_token_ids), window)
    rng = np.random.Generator(np.random.PCG64(seed))
    chosen = []
    for source in sources:
        group = [s for s in train_sessions if s.source == source]
        sequences: list[fixture_data.Sequence] = []
        for index in rng.permutation(len(group)):
            if len(sequences) >= TRAIN_CAP:
                break
            sequences += renderer.sequences(group[index])
        chosen += sequences[:TRAIN_CAP]
    return chosen


def span_mask(sequence: fixture_data.Sequence) -> np.ndarray:
    """1 where ``ids[t]`` is a target (inside an assistant turn), else 0."""
    mask = np.zeros(len(sequence.ids), np.float32)
    for start, end in sequence.spans:
        mask[start:end] = 1.0
    return mask


def padded(sequence: fixture_data.Sequence, max_seq_length: int) -> tuple[mx.array, mx.array]:
    """(ids, mask) of one window with a leading batch axis, zero-padded (mask 0) so that the
    model input ``ids[:, :-1]`` is a multiple of PAD_TO long: the trainer's compiled step is
    traced once per length, as with mlx-lm's own batching."""
    ids = np.array(sequence.ids[:max_seq_length], np.int32)
    mask = span_mask(sequence)[:max_seq_length]
    length = 1 + PAD_TO * -(-(len(ids) - 1) // PAD_TO)
    ids = np.pad(ids, (0, length - len(ids)))
    mask = np.pad(mask, (0, length - len(mask)))
    return mx.array(ids[None]), mx.array(mask[None])


def span_batches(sequences: list[fixture_data.Sequence], seed: int):
    """``mlx_lm.tuner.train``'s ``iterate_batches``: one window per batch (:func:`padded`); the
    sources take turns (each source's windows in seeded order, cycled),
    so every source gets the same number of steps however many windows it has."""

    def iterate(dataset, batch_size, max_seq_length, loop=False, comm_group=None, **_):
        if batch_size != 1:
            raise ValueError("windows are trained one at a time")
        rng = np.random.Generator(np.random.PCG64(seed))
        groups = [[q for q in sequences if q.source == source] for source in fixture_data.SOURCES]
        orders = [[g[i] for i in rng.permutation(len(g))] for g in groups if g]
        for n in itertools.count():
            if n >= max(len(o) for o in orders) and not loop:
                return
            for order in orders:
                yield padded(order[n % len(order)], max_seq_length)

    return iterate


def span_loss(model, ids, mask):
    """Mean cross-entropy over the target tokens (``mask`` of the predicted position)."""
    logits = model(ids[:, :-1])
    weights = mask[:, 1:]
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), ids[:, 1:]) * weights
    tokens = weights.sum()
    return ce.sum() / tokens, tokens


def adapter_config(window: int, steps: int, seed: int) -> dict:
    """mlx-lm's adapter config (what ``load_adapters`` reads) plus the recipe."""
    return {"fine_tune_type": "lora", "num_layers": LORA_LAYERS, "lora_parameters": dict(LORA),
            "seed": seed, "max_seq_length": window, "iters": steps, "batch_size": 1,
            "learning_rate": LEARNING_RATE, "optimizer": "adam"}


def train(out: Path, window: int, steps: int, seed: int, sources: tuple[str, ...] = fixture_data.SOURCES,
          resume: Path | None = None) -> dict:
    """Train the adapter into ``out``; ``resume``: start from the adapter in that folder (its LoRA
    weights) instead of from zero; ``sources``: train on these sources' windows only."""
    from mlx_lm import load
    from mlx_lm.tuner import TrainingArgs, linear_to_lora_layers
    from mlx_lm.tuner import train as tuner_train

    mx.random.seed(seed)
    model, tokenizer = load(str(fixtures.fixture_path("smollm2-135m")))
    model.freeze()
    linear_to_lora_layers(model, LORA_LAYERS, LORA)
    if resume is not None:
        model.load_weights(str(resume / "adapters.safetensors"), strict=False)
    sequences = training_sequences(tokenizer, window, seed, sources)
    by_source = {s: sum(q.source == s for q in sequences) for s in fixture_data.SOURCES}
    print(f"{len(sequences)} windows {by_source}, {sum(len(q.ids) for q in sequences):,} tokens; "
          f"blas {openblas.describe()}", file=sys.stderr, flush=True)
    config = adapter_config(window, steps, seed)
    if resume is not None:
        config["resumed_from"] = json.loads((resume / "adapter_config.json").read_text())
    if sources != fixture_data.SOURCES:
        config["sources"] = list(sources)
    step_times: list[float] = []
    cpu_times: list[float] = []

    class Timer:
        """Wall and process CPU time per step (the CPU time says what a step costs when other
        jobs share the cores), from the trainer's per-step reports."""

        def __init__(self):
            self.cpu = time.process_time()

        def on_train_loss_report(self, info):
            step_times.append(1.0 / info["iterations_per_second"])
            cpu_times.append(time.process_time() - self.cpu)
            self.cpu = time.process_time()
            print(f"step {info['iteration']}: loss {info['train_loss']:.3f}, {step_times[-1]:.1f} s/step, "
                  f"{cpu_times[-1]:.1f} cpu-s/step", file=sys.stderr, flush=True)

        def on_val_loss_report(self, info):
            pass

    with tempfile.TemporaryDirectory(prefix="smollm2-tools-") as scratch:
        args = TrainingArgs(batch_size=1, iters=steps, max_seq_length=window, steps_per_report=1,
                            steps_per_eval=steps + 1, steps_per_save=steps + 1,
                            adapter_file=str(Path(scratch) / "adapters.safetensors"))
        started = time.perf_counter()
        tuner_train(model, optim.Adam(learning_rate=LEARNING_RATE), sequences, args=args,
                    loss=span_loss, iterate_batches=span_batches(sequences, seed), training_callback=Timer())
        minutes = (time.perf_counter() - started) / 60
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(scratch) / "adapters.safetensors", out / "adapters.safetensors")
    config["training"] = {"windows": len(sequences), "windows_by_source": by_source, "minutes": round(minutes, 1),
                          "median_step_s": round(float(np.median(step_times)), 2),
                          "median_step_cpu_s": round(float(np.median(cpu_times)), 2), "blas": openblas.describe()}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def eval_examples(tokenizer, window: int, seed: int):
    """(call turns, prose turns) of the held-back sessions: EVAL_CALLS_PER_SOURCE call turns of
    every source and EVAL_PROSE prose turns, drawn in seeded order among the turns whose prompt
    fits the window (only drawn turns are rendered)."""
    _, held = fixture_data.split_sessions(fixture_data.load_recordings(), seed)
    renderer = fixture_data.Renderer(tokenizer._tokenizer, set(tokenizer.eos_token_ids), window)
    rng = np.random.Generator(np.random.PCG64(seed + 1))

    def draw(turns: list[tuple[fixture_data.Session, int]], count: int) -> list[fixture_data.Example]:
        out = []
        for index in rng.permutation(len(turns)):
            if len(out) == count:
                break
            example = renderer.example(*turns[index])
            if example is not None:
                out.append(example)
        return out

    def turns(sessions, calls: bool):
        return [(s, k) for s in sessions for k, m in enumerate(s.messages)
                if m["role"] == "assistant" and bool(m.get("tool_calls")) == calls]

    calls = []
    for source in fixture_data.SOURCES:
        calls += draw(turns([s for s in held if s.source == source], True), EVAL_CALLS_PER_SOURCE)
    return calls, draw(turns(held, False), EVAL_PROSE)


def evaluate(model_dir: Path, window: int, seed: int) -> dict:
    """Greedy on held-back turns: parseable calls to a declared tool on call turns, no call on
    prose turns, per source. ``first_id`` says where the decision is made: the probability of the
    id that opens a call at a turn's first position (call vs prose turns of the sources that have
    prose turns, and its AUC), and how many prose turns greedy opens with a call."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    calls, prose = eval_examples(tokenizer, window, seed)
    stop = set(tokenizer.eos_token_ids)
    open_id = tokenizer.encode(tokenizer.tool_call_start, add_special_tokens=False)[0]
    counts: dict[str, list[int]] = {}  # source -> [good, total]
    p_open: list[float] = []
    prose_opened_with_call = 0
    for example in calls + prose:
        ids, first = greedy(model, example.prompt_ids, stop, fixture_data.MAX_TARGET_TOKENS + 32)
        text = tokenizer.decode(ids)
        p_open.append(float(mx.exp(first[open_id].astype(mx.float32))))
        parsed = fixtures.parse_tool_calls(tokenizer, text, example.tools)
        declared = {t["function"]["name"] for t in example.tools}
        if example.expected_calls:
            good = bool(parsed) and all(c["name"] in declared for c in parsed)
            key = example.source
        else:
            good = tokenizer.tool_call_start not in text
            key = "prose"
            prose_opened_with_call += ids[0] == open_id
        counts.setdefault(key, [0, 0])
        counts[key][0] += good
        counts[key][1] += 1
    call_good = sum(v[0] for k, v in counts.items() if k != "prose")
    prose_good, prose_total = counts.get("prose", [0, 0])
    # the decision is scored among the sources prose turns come from (mini-swe-agent only calls)
    prose_sources = {e.source for e in prose}
    mixed = np.array([e.source in prose_sources for e in calls + prose])
    is_call = np.array([1] * len(calls) + [0] * len(prose))[mixed]
    scores = np.array(p_open)[mixed]
    first_id = {"opening": tokenizer.decode([open_id]),
                "median_p_open_call_turns": round(float(np.median(scores[is_call == 1])), 3),
                "median_p_open_prose_turns": round(float(np.median(scores[is_call == 0])), 3),
                "auc": round(decision_ceiling.auc(scores, is_call), 3),
                "prose_turns_opened_with_call": f"{prose_opened_with_call}/{prose_total}"} if prose else None
    return {"call_turns": len(calls), "parseable_call_share": round(call_good / max(len(calls), 1), 3),
            "prose_turns": prose_total, "prose_without_call_share": round(prose_good / max(prose_total, 1), 3),
            "by_source": {k: f"{v[0]}/{v[1]}" for k, v in sorted(counts.items())}, "first_id": first_id,
            "targets": {"parseable_call_share": CALL_TARGET, "prose_without_call_share": PROSE_TARGET}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=smollm2.ADAPTER_DIR, help="where the adapter is written")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--window", type=int, default=WINDOW, help="tokens per training window / eval prompt")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--sources", nargs="+", choices=fixture_data.SOURCES, default=list(fixture_data.SOURCES),
                        help="train on these sources' windows only")
    parser.add_argument("--resume", type=Path, help="start from the adapter in this folder")
    parser.add_argument("--eval", action="store_true", help="only evaluate the adapter in --out")
    parser.add_argument("--no-eval", action="store_true", help="train only")
    args = parser.parse_args(argv)
    if argv is None:  # as a script: restart once with OpenBLAS
        openblas.reexec()
    if not args.eval:
        print(json.dumps(train(args.out, args.window, args.steps, args.seed, tuple(args.sources),
                               args.resume)["training"], indent=2))
    if args.no_eval:
        return 0
    with tempfile.TemporaryDirectory(prefix="smollm2-tools-eval-") as scratch:
        model_dir = Path(scratch)
        smollm2.assemble_fused(fixtures.fixture_path("smollm2-135m"), args.out, model_dir)
        result = evaluate(model_dir, args.window, args.seed)
    (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
