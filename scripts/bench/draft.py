"""Side-by-side measurement of the model-based draft sources (``draft``, ``mtp``) vs plain decoding.

For each available (target, drafter) pair and draft length, one run per arm on the same prompts:
plain greedy (mlx-lm ``generate_step``), the fill loop with the source, and, for ``draft``,
mlx-lm's own ``speculative_generate_step`` (dense targets only; it refuses hybrids). Reports
emitted tokens per target forward, drafted/accepted counts, drafter forwards and the wall-clock
ratio plain/arm (> 1 is faster), and checks every arm's tokens against plain greedy.

Pairs: the trained fixtures ``qwen3-json`` + ``qwen3-draft`` when they are in the checkout
(rendered agent prompts), and two seeded random-weight mechanism pairs that always run (a dense
qwen3 with a noisy copy of itself as drafter; a hybrid qwen3_5 with an MTP head constructed to
agree with a mostly-bigram target). Random pairs measure the mechanism, not a real speedup.

    python -m scripts.bench.draft [--tokens 64] [--lengths 2 3 4] [--mode exact|fast]
        [--mtp-target DIR [--mtp-head DIR]] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step as stock_generate_step
from mlx_lm.generate import speculative_generate_step
from mlx_lm.utils import load_model

from mlx_fill.assets.fixtures import FixtureMissing, fixture_path
from mlx_fill.core.errors import output_file, positive_int
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import DispatchPlan
from mlx_fill.core.resolve import plan_for
from mlx_fill.core.proposal import FillSession
from mlx_fill.assets.random_models import build, config_for, save
from mlx_fill.spec.draft import make_draft_source
from mlx_fill.spec.mtp import make_mtp_source
from mlx_fill.spec.mtp_head import MTPHead, load_mtp_head

OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def noisy_copy(arch: str, scale: float, seed: int):
    model, _ = build(config_for(arch))
    mx.random.seed(seed)
    model.update(tree_unflatten([(k, v + scale * mx.random.normal(v.shape) * mx.abs(v).mean())
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


def bigram_mtp_pair(eps: float = 0.15):
    """A hybrid qwen3_5 whose layer outputs are scaled by ``eps`` and an MTP head written into its
    checkpoint that is that target's bigram predictor (as in tests/test_mtp.py)."""
    model, config = build(config_for("qwen3_5"))
    model.update(tree_unflatten([(k, v * eps) for k, v in tree_flatten(model.parameters())
                                 if k.endswith(OUTPUT_PROJECTIONS)]))
    path = save(model, config, Path(tempfile.mkdtemp(prefix="bench-mtp-")))
    mx.random.seed(1)
    head = MTPHead(model.language_model.args)
    h = head.fc.weight.shape[0]
    head.fc.weight = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
    head.update(tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(head.parameters())
                                if k.endswith(OUTPUT_PROJECTIONS)]))
    head.norm.weight = model.language_model.model.norm.weight
    mx.save_safetensors(str(path / "model-mtp.safetensors"),
                        {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    target, _ = load_model(path)
    return target, load_mtp_head(path, target)


def random_prompts(count: int, length: int = 48) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(count)]


def agent_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    files = ["/src/app.py", "/src/util/io.py", "/tests/test_app.py", "/README.md"]
    out = []
    for i in range(count):
        path, prev = files[i % len(files)], files[i - 1]
        messages = [
            {"role": "system", "content": "You are a coding agent. Call tools to inspect files."},
            {"role": "user", "content": f"Open {prev} and tell me what main() returns."},
            {"role": "assistant", "content": '<tool_call>\n{"name": "read_file", "arguments": '
                                             f'{{"path": "{prev}"}}}}\n</tool_call>'},
            {"role": "tool", "content": f"def main():\n    return {i}\n"},
            {"role": "user", "content": f"Now read {path} as well."},
        ]
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True)))
    return out


def timed(run: Callable[[], list[int]]) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t0


def measure(name: str, target: Any, prompts: list[list[int]], tokens: int, plan: DispatchPlan,
            arms: dict[str, Callable[[list[int]], tuple[list[int], dict]]]) -> list[dict]:
    plain_out, plain_s = [], 0.0
    for p in prompts:
        out, s = timed(lambda: [t for t, _ in stock_generate_step(mx.array(p), target,
                                                                   max_tokens=tokens)])
        plain_out.append(out)
        plain_s += s
    emitted = sum(len(o) for o in plain_out)
    rows = [{"pair": name, "arm": "plain", "emitted": emitted, "tokens_per_forward": 1.0,
             "wall_s": round(plain_s, 3), "speed_vs_plain": 1.0, "identical": True}]
    for arm, run in arms.items():
        totals: dict[str, float] = {}
        wall, identical = 0.0, True
        for p, ref in zip(prompts, plain_out):
            t0 = time.perf_counter()
            out, counts = run(p)
            wall += time.perf_counter() - t0
            identical &= out == ref
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
        row = {"pair": name, "arm": arm, "emitted": emitted, "wall_s": round(wall, 3),
               "speed_vs_plain": round(plain_s / wall, 3), "identical": identical}
        if not arm.startswith("mlx-lm"):
            row["plan"] = f"{plan.mode}/{plan.max_chunk}{'' if plan.qualified else ' unqualified'}"
        if totals.get("forwards"):
            row["tokens_per_forward"] = round(emitted / totals["forwards"], 3)
        row.update({k: int(v) for k, v in totals.items()})
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def fill_arm(target: Any, make: Callable[[], Any], tokens: int, plan: DispatchPlan):
    def run(p: list[int]) -> tuple[list[int], dict]:
        source = make()
        fill = FillSession([source], plan=plan, max_span=64)
        out = [t for t, _ in generate_step(mx.array(p), target, fill=fill, max_tokens=tokens)]
        s = fill.stats
        return out, {"forwards": s.forwards, "drafted": s.verify_proposed,
                     "accepted": s.verify_accepted, "rounds": s.events}
    return run


def mlx_lm_arm(target: Any, draft: Any, k: int, tokens: int):
    def run(p: list[int]) -> tuple[list[int], dict]:
        out, rounds = [], 0
        for tok, _, from_draft in speculative_generate_step(mx.array(p), target, draft,
                                                            num_draft_tokens=k, max_tokens=tokens):
            out.append(int(tok))
            rounds += not from_draft
        return out, {"forwards": rounds}
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=positive_int, default=64)
    ap.add_argument("--prompts", type=positive_int, default=4)
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--mode", choices=["exact", "fast"], default="exact",
                    help="dispatch plan mode for the fill arms (default: this machine's exact plan)")
    ap.add_argument("--mtp-target", type=Path,
                    help="a qwen3_5 model dir with tokenizer (e.g. the qwen35-xml fixture)")
    ap.add_argument("--mtp-head", type=Path,
                    help="dir holding its mtp.* tensors (python -m scripts.training.train_mtp; default: the target)")
    ap.add_argument("--json", type=output_file)
    args = ap.parse_args(argv)
    rows: list[dict] = []

    pairs: list[tuple[str, Any, Any, list[list[int]]]] = []
    try:
        from mlx_lm import load
        target, tok = load(str(fixture_path("qwen3-json")))
        draft, _ = load(str(fixture_path("qwen3-draft")))
        pairs.append(("qwen3-json + qwen3-draft", target, draft, agent_prompts(tok, args.prompts)))
    except FixtureMissing as e:
        print(f"skipping the fixture pair: {e}", file=sys.stderr)
    pairs.append(("random qwen3 + noisy copy", build(config_for("qwen3"))[0],
                  noisy_copy("qwen3", 0.05, seed=7), random_prompts(args.prompts)))
    for name, target, draft, prompts in pairs:
        plan, dplan = plan_for(target).with_mode(args.mode), plan_for(draft).with_mode(args.mode)
        arms = {}
        for k in args.lengths:
            arms[f"draft k={k}"] = fill_arm(
                target, lambda k=k: make_draft_source(draft, num_draft_tokens=k, plan=dplan),
                args.tokens, plan)
            arms[f"mlx-lm speculative k={k}"] = mlx_lm_arm(target, draft, k, args.tokens)
        rows += measure(name, target, prompts, args.tokens, plan, arms)

    mtp_pairs = [("random qwen3_5 (hybrid) + bigram MTP head", *bigram_mtp_pair(),
                  random_prompts(args.prompts))]
    if args.mtp_target is not None:
        from mlx_lm import load
        target, tok = load(str(args.mtp_target))
        head = load_mtp_head(args.mtp_head or args.mtp_target, target)
        mtp_pairs.append((f"{args.mtp_target.name} + MTP head from {args.mtp_head or 'itself'}",
                          target, head, agent_prompts(tok, args.prompts)))
    for name, target, head, prompts in mtp_pairs:
        plan = plan_for(target).with_mode(args.mode)
        arms = {f"mtp k={k}": fill_arm(target, lambda k=k: make_mtp_source(target, head,
                                                                             num_draft_tokens=k),
                                       args.tokens, plan) for k in args.lengths}
        rows += measure(name, target, prompts, args.tokens, plan, arms)

    print("| pair | arm | plan | tokens/forward | drafted | accepted | wall s | speed vs plain "
          "| identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['arm']} | {r.get('plan', '')} | "
              f"{r.get('tokens_per_forward', '')} | "
              f"{r.get('drafted', '')} | {r.get('accepted', '')} | {r['wall_s']} | "
              f"{r['speed_vs_plain']} | {r['identical']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
