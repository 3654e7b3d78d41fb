"""Train / evaluate the tiny tool-calling fixture models (mlx-lm's own model classes).

    python -m scripts.training.train_fixture NAME          # train, write fixtures/models/NAME/
    python -m scripts.training.train_fixture --eval NAME   # greedy eval on held-back conversations,
                                                  # results into fixtures/models/README.md

Training is deterministic for a seed: model init via ``mx.random.seed``, data order and the
embedding initialization via numpy PCG64, for a given BLAS (``openblas``: the run restarts itself
with OpenBLAS preloaded where installed, and records which BLAS it had). Training runs through
the training kernels: the exp-heavy ops in numpy (``numpy_kernels``) and Qwen3.5's gated delta
rule a chunk at a time (``chunked_delta``), the same functions as mlx-lm's ops at several times
the step rate on the CPU wheel. Only the vocabulary rows the training corpus uses are trained
(restricted softmax over those rows); every other row keeps the seeded initialization
(``mlx_fill.assets.fixtures.seeded_embedding``) and is re-created, not committed. Training sequences
are session windows (``fixture_data.Renderer.sequences``): the loss is on every assistant turn
in a window plus a seeded share of the context tokens at lower weight (see :func:`pack`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from scripts.training import chunked_delta, fixture_data, numpy_kernels, openblas

from mlx_fill.assets import store as assets
from mlx_fill.assets import fixtures  # noqa: E402

INIT_STD = 0.02
CONTEXT_WEIGHT = 0.5
EVAL_CALLS = {"tau_bench_gpt4o_airline": 25, "mini_swe_agent_gemini3pro": 20, "pi_mono": 15}
EVAL_PROSE = 20
README = fixtures.FIXTURES_DIR / "README.md"
TABLE_BEGIN, TABLE_END = "<!-- eval-table:begin -->", "<!-- eval-table:end -->"


@dataclass(frozen=True)
class Spec:
    family: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    steps: int
    batch_tokens: int = 4096
    max_tokens: int = 512
    lr: float = 4e-3
    seed: int = 0
    context_share: float = 0.25
    train_cap: tuple = (("mini_swe_agent_gemini3pro", 1200),)


SPECS = {
    "qwen3-json": Spec("qwen3", "qwen3", 64, 4, 2, 1, 192, steps=900, lr=1e-2),
    # the Qwen3.5 tool preamble alone is ~300 tokens
    "qwen35-xml": Spec("qwen3.5", "qwen3_5", 64, 4, 2, 1, 192, steps=420, max_tokens=768, lr=1e-2),
    "glm-xml": Spec("glm4.x", "glm4", 64, 4, 2, 1, 192, steps=640, lr=1e-2),
    "qwen3-draft": Spec("qwen3", "qwen3", 64, 3, 2, 1, 192, steps=1000, lr=1e-2,
                        train_cap=(("mini_swe_agent_gemini3pro", 3000),)),
}


def model_config(spec: Spec, vocab_size: int, eos_ids: list[int]) -> dict:
    head_dim = spec.hidden // spec.heads
    common = {
        "hidden_size": spec.hidden, "num_hidden_layers": spec.layers, "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    }
    if spec.model_type == "qwen3":
        return {"model_type": "qwen3", **common, "rope_theta": 1000000.0, "eos_token_id": eos_ids}
    if spec.model_type == "glm4":
        return {"model_type": "glm4", **common, "attention_bias": False, "partial_rotary_factor": 0.5,
                "rope_theta": 10000.0, "eos_token_id": eos_ids}
    if spec.model_type == "qwen3_5":
        text = {**common, "model_type": "qwen3_5_text", "full_attention_interval": 2,
                "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 32,
                "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
                "rope_parameters": {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10]}}
        return {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True, "eos_token_id": eos_ids}
    raise ValueError(spec.model_type)


def build_model(config: dict):
    import importlib

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return arch.Model(arch.ModelArgs.from_dict(config))


def stop_ids(tokenizer, family: str) -> list[int]:
    ids = set(tokenizer.eos_token_ids)
    if family == "glm4.x":
        from mlx_fill.assets.glm import GLM_STOP_TOKENS

        ids |= {tokenizer.convert_tokens_to_ids(t) for t in GLM_STOP_TOKENS}
    return sorted(ids)


def examples_for(sessions, tokenizer, family: str, max_tokens: int):
    renderer = fixture_data.Renderer(tokenizer._tokenizer, set(stop_ids(tokenizer, family)), max_tokens)
    out = []
    for session in sessions:
        for index, message in enumerate(session.messages):
            if message["role"] == "assistant":
                example = renderer.example(session, index)
                if example is not None:
                    out.append(example)
    return out


def training_sequences(spec: Spec, tokenizer) -> list[fixture_data.Sequence]:
    """Windows of the training sessions, loss on every assistant turn in a window; a source in
    ``spec.train_cap`` contributes that many windows, from its sessions in seeded order."""
    sessions = fixture_data.load_recordings()
    train_sessions, _ = fixture_data.split_sessions(sessions, spec.seed)
    renderer = fixture_data.Renderer(tokenizer._tokenizer, set(stop_ids(tokenizer, spec.family)), spec.max_tokens)
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    caps = dict(spec.train_cap)
    chosen = []
    for source in fixture_data.SOURCES:
        group = [s for s in train_sessions if s.source == source]
        if source in caps:
            # sessions in seeded order, rendered only until the cap is reached
            group = [group[i] for i in rng.permutation(len(group))]
        sequences = []
        for session in group:
            if source in caps and len(sequences) >= caps[source]:
                break
            sequences += renderer.sequences(session)
        chosen += sequences[: caps.get(source)]
    return chosen


def eval_examples(spec: Spec, tokenizer):
    sessions = fixture_data.load_recordings()
    _, held = fixture_data.split_sessions(sessions, spec.seed)
    rng = np.random.Generator(np.random.PCG64(spec.seed + 1))
    examples = examples_for(held, tokenizer, spec.family, spec.max_tokens)
    calls, spare = [], []
    for source, count in EVAL_CALLS.items():
        group = [e for e in examples if e.source == source and e.expected_calls]
        order = rng.permutation(len(group))
        calls += [group[i] for i in np.sort(order[:count])]
        spare += [group[i] for i in np.sort(order[count:])]
    # a source with fewer fitting turns (tau-bench under Qwen3.5's long preamble) is topped up
    # from the others so that there are always sum(EVAL_CALLS) call conversations when possible
    shortfall = sum(EVAL_CALLS.values()) - len(calls)
    if shortfall > 0:
        calls += [spare[i] for i in np.sort(rng.permutation(len(spare))[:shortfall])]
    group = [e for e in examples if not e.expected_calls]
    prose = [group[i] for i in np.sort(rng.permutation(len(group))[:EVAL_PROSE])]
    return calls, prose


def batches(sequences, batch_tokens: int, rng):
    """Length-bucketed batches (lists of sequence indices), shuffled."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    out, current, width = [], [], 0
    for i in order:
        length = len(sequences[i].ids)
        if current and max(width, length) * (len(current) + 1) > batch_tokens:
            out.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    if current:
        out.append(current)
    return [out[i] for i in rng.permutation(len(out))]


def pack(sequences, indices, remap: np.ndarray, rng, context_share: float):
    """(inputs, flat positions where a loss is taken, their labels, weights, target mask).

    Every assistant-turn token is a target (weight 1). A seeded ``context_share`` of the other
    tokens (system prompt, tools block, user turns, tool results) is predicted too, at weight
    ``CONTEXT_WEIGHT``: plain language-model signal on the context trains the attention
    patterns the tool-call format needs many times faster than the assistant turns alone
    (about 10% of the tokens). The position count is padded to a multiple of 128 with weight-0
    entries to bound the number of distinct shapes."""
    length = int(math.ceil((max(len(sequences[i].ids) for i in indices) - 1) / 64) * 64)
    inputs = np.zeros((len(indices), length), np.int32)
    positions, labels, is_target = [], [], []
    for row, i in enumerate(indices):
        ids = remap[np.array(sequences[i].ids)]
        inputs[row, : len(ids) - 1] = ids[:-1]
        target = np.zeros(len(ids), bool)
        for start, end in sequences[i].spans:
            target[start:end] = True
        context = ~target & (rng.random(len(ids)) < context_share)
        context[0] = False
        taken = np.flatnonzero(target | context)  # a token at p is predicted from position p - 1
        positions.append(row * length + taken - 1)
        labels.append(ids[taken])
        is_target.append(target[taken])
    positions, labels, is_target = (np.concatenate(a) for a in (positions, labels, is_target))
    pad = int(math.ceil(len(positions) / 128) * 128) - len(positions)
    weights = np.pad(np.where(is_target, 1.0, CONTEXT_WEIGHT), (0, pad)).astype(np.float32)
    return (mx.array(inputs), mx.array(np.pad(positions, (0, pad)).astype(np.int32)),
            mx.array(np.pad(labels, (0, pad)).astype(np.int32)), mx.array(weights),
            mx.array(np.pad(is_target, (0, pad))))


def backbone(model):
    """The decoder stack (returns final-normed hidden states) and the output head mlx-lm applies
    to them: the untied ``lm_head`` where the architecture has one (``glm4``), else the tied
    embedding."""
    outer = model.language_model if hasattr(model, "language_model") else model
    head = getattr(outer, "lm_head", None)
    return outer.model, head if head is not None else outer.model.embed_tokens.as_linear


def embedding_path(model) -> str:
    keys = [k for k, _ in tree_flatten(model.parameters()) if k.endswith("embed_tokens.weight")]
    if len(keys) != 1:
        raise RuntimeError(f"expected one embedding, found {keys}")
    return keys[0]


def train(name: str) -> None:
    spec = SPECS[name]
    tokenizer = assets.load_tokenizer(spec.family)
    vocab_size = len(tokenizer._tokenizer)
    started = time.time()
    windows = training_sequences(spec, tokenizer)
    if not windows:
        raise RuntimeError(f"{name}: no conversation fits {spec.max_tokens} tokens")
    used = set()
    for e in windows:
        used.update(e.ids)
    used.update(tokenizer._tokenizer.convert_tokens_to_ids(t) for t in tokenizer._tokenizer.get_added_vocab())
    ids = np.array(sorted(used), dtype=np.int64)
    remap = np.full(vocab_size, -1, np.int64)
    remap[ids] = np.arange(len(ids))
    print(f"{name}: {len(windows)} windows, {sum(len(e.spans) for e in windows)} turns, "
          f"{sum(e - s for q in windows for s, e in q.spans)} target tokens of {sum(len(q.ids) for q in windows)}, "
          f"{len(ids)} vocab rows, data {time.time() - started:.0f}s", flush=True)

    config = model_config(spec, vocab_size, stop_ids(tokenizer, spec.family))
    restricted = json.loads(json.dumps(config))
    restricted.get("text_config", restricted)["vocab_size"] = len(ids)
    mx.random.seed(spec.seed)
    model = build_model(restricted)
    embed_key = embedding_path(model)
    full_init = fixtures.seeded_embedding(vocab_size, spec.hidden, spec.seed, INIT_STD)
    model.load_weights([(embed_key, mx.array(full_init[ids]))], strict=False)
    del full_init
    mx.eval(model.parameters())

    warmup = min(30, spec.steps // 5)
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, spec.lr, warmup),
         optim.cosine_decay(spec.lr, spec.steps - warmup, spec.lr * 0.05)], [warmup]
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    inner, head = backbone(model)

    def loss_fn(model, inputs, positions, labels, weights, is_target):
        # logits only where the loss is taken: the restricted softmax over trained rows
        hidden = inner(inputs).reshape(-1, spec.hidden)[positions]
        logits = head(hidden).astype(mx.float32)
        losses = numpy_kernels.cross_entropy(logits, labels)
        target_loss = (losses * is_target).sum() / is_target.sum()
        return (losses * weights).sum() / weights.sum(), target_loss

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    def step(*batch):
        (_, target_loss), grads = grad_fn(model, *batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return target_loss

    rng = np.random.Generator(np.random.PCG64(spec.seed))
    plan: list = []
    done, smoothed, t0 = 0, None, time.time()
    with numpy_kernels.installed(), chunked_delta.installed():
        while done < spec.steps:
            if not plan:
                plan = batches(windows, spec.batch_tokens, rng)
            loss = step(*pack(windows, plan.pop(), remap, rng, spec.context_share))
            mx.eval(state)
            done += 1
            smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
            if done % 25 == 0 or done == spec.steps:
                print(f"step {done}/{spec.steps} loss {smoothed:.3f} {time.time() - t0:.0f}s", flush=True)
    minutes = (time.time() - started) / 60
    save(name, spec, model, embed_key, ids, config, minutes, smoothed, len(windows))


def save(name, spec, model, embed_key, ids, config, minutes, final_loss, n_windows) -> None:
    out = fixtures.committed_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    rows = weights.pop(embed_key)
    weights = {k: v.astype(mx.float16) if v.ndim > 1 else v for k, v in weights.items()}
    weights["rows.ids"] = mx.array(ids.astype(np.int32))
    weights["rows.weight"] = rows.astype(mx.float16)
    mx.save_safetensors(str(out / "trained.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    n_params = sum(v.size for k, v in tree_flatten(model.parameters()) if k != embed_key)
    meta = {
        "family": spec.family, "embedding_key": embed_key, "init_seed": spec.seed, "init_std": INIT_STD,
        "training": {"command": f"python -m scripts.training.train_fixture {name}", "seed": spec.seed, "steps": spec.steps,
                     "batch_tokens": spec.batch_tokens, "max_tokens": spec.max_tokens, "lr": spec.lr,
                     "context_share": spec.context_share, "context_weight": CONTEXT_WEIGHT,
                     "blas": openblas.describe(),
                     "windows": n_windows, "trained_vocab_rows": int(len(ids)),
                     "non_embedding_params": int(n_params), "final_loss": round(float(final_loss), 4),
                     "minutes": round(minutes, 1)},
    }
    (out / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    _write_table()
    print(f"wrote {out} ({sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB)")


def greedy(model, prompt_ids: list[int], stop: set[int], max_tokens: int) -> tuple[list[int], mx.array]:
    """(ids up to and including the first stop id, the log-probabilities of the first id)."""
    from mlx_lm.generate import generate_step

    out, first = [], None
    for token, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        out.append(int(token))
        first = logprobs if first is None else first
        if out[-1] in stop:
            break
    return out, first


def evaluate(name: str) -> dict:
    from mlx_lm import load

    spec = SPECS[name]
    model, tokenizer = load(str(fixtures.fixture_path(name)))
    calls, prose = eval_examples(spec, tokenizer)
    stop = set(stop_ids(tokenizer, spec.family))
    parseable = exact = no_call = 0
    by_source: dict[str, list[int]] = {}  # source -> [parseable, call turns]
    for example in calls + prose:
        ids, _ = greedy(model, example.prompt_ids, stop, fixture_data.MAX_TARGET_TOKENS + 32)
        text = tokenizer.decode(ids)
        parsed = fixtures.parse_tool_calls(tokenizer, text, example.tools)
        if example.expected_calls:
            counts = by_source.setdefault(example.source, [0, 0])
            counts[1] += 1
            if parsed:
                parseable += 1
                counts[0] += 1
                exact += _canonical(parsed) == _canonical(example.expected_calls)
        elif tokenizer.tool_call_start not in text:
            no_call += 1
    result = {
        "model": name, "family": spec.family, "parser": tokenizer._tokenizer.init_kwargs.get("tool_parser_type"),
        "call_conversations": len(calls), "prose_conversations": len(prose),
        "parseable_call_share": round(parseable / len(calls), 3), "exact_call_share": round(exact / len(calls), 3),
        "prose_without_call_share": round(no_call / len(prose), 3) if prose else None,
        "parseable_by_source": {k: f"{v[0]}/{v[1]}" for k, v in sorted(by_source.items())},
    }
    (fixtures.committed_dir(name) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    _write_table()
    return result


def _canonical(calls: list[dict]) -> str:
    return json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls], sort_keys=True)


def _replace_block(text: str, begin: str, end: str, body: str) -> str:
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def _write_table() -> None:
    """Rewrite the README's training-record and eval tables from fixture.json / eval.json."""
    train_rows = ["| model | non-embedding params | trained vocab rows | windows | steps x tokens | "
                  "final loss | minutes | committed MB |", "|---|---|---|---|---|---|---|---|"]
    eval_rows = ["| model | parser | held-back call turns | parseable call | exact name+args | "
                 "prose turns | prose w/o call |", "|---|---|---|---|---|---|---|"]
    for name in fixtures.FIXTURES:
        folder = fixtures.committed_dir(name)
        if (folder / "fixture.json").is_file():
            t = json.loads((folder / "fixture.json").read_text())["training"]
            size = sum((folder / f).stat().st_size for f in fixtures.COMMITTED_FILES) / 1e6
            train_rows.append(f"| {name} | {t['non_embedding_params']:,} | {t['trained_vocab_rows']:,} | "
                              f"{t['windows']:,} | {t['steps']} x {t['batch_tokens']} | {t['final_loss']} | "
                              f"{t['minutes']} | {size:.1f} |")
        if (folder / "eval.json").is_file():
            r = json.loads((folder / "eval.json").read_text())
            prose = r["prose_without_call_share"]
            eval_rows.append(f"| {name} | {r['parser']} | {r['call_conversations']} | "
                             f"{r['parseable_call_share']:.1%} | {r['exact_call_share']:.1%} | "
                             f"{r['prose_conversations']} | {'n/a' if prose is None else f'{prose:.1%}'} |")
    text = README.read_text()
    text = _replace_block(text, "<!-- train-table:begin -->", "<!-- train-table:end -->", "\n".join(train_rows))
    README.write_text(_replace_block(text, TABLE_BEGIN, TABLE_END, "\n".join(eval_rows)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(SPECS))
    parser.add_argument("--eval", action="store_true", help="evaluate instead of training")
    args = parser.parse_args(argv)
    if not args.eval and argv is None:  # as a script: restart once with OpenBLAS (training only)
        openblas.reexec()
    if args.eval:
        print(json.dumps(evaluate(args.name), indent=2))
    else:
        train(args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
