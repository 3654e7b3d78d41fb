"""Concurrency benchmark (not a test): ``mlx_lm.server`` with ``MLX_FILL`` unset vs ``strict``
vs ``all`` under C concurrent clients replaying held-out agent openings.

One server per mode is started (loopback, ``--model``), all at once, each warmed with one
request; then for each C the same request list (every held-out opening of ``--source``,
``--repeat`` times) is sent through C client threads, temperature 0, ``--max-tokens`` each, to
one server at a time, the modes interleaved ``--reps`` times in rotated order. Reported per
(mode, C): total completion tokens/s over the wall time (median of the repetitions),
per-request latency median and p90 (pooled), the share of
answers identical to the unset server's at the same C (content, tool calls, finish reason,
completion tokens), and for fill modes the injected tokens and the largest generation batch a
request decoded in (``usage.fill.batch_peak``).

    python -m scripts.bench.concurrency [--model qwen3-json] [--dtype float32|bfloat16]
        [--clients 1,4,8] [--modes unset,strict,all] [--source mini_swe_agent] [--reps 1]
        [--limit N] [--prime] [--json out.json]

``--model`` is a fixture name (``mlx-fill fixture NAME``) or a model directory; ``--dtype
bfloat16`` serves a bfloat16 copy converted once into a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import httpx

from mlx_fill.assets.fixtures import fixture_path
from mlx_fill.core.errors import output_file, positive_int
from scripts.bench.__main__ import name_list

ROOT = Path(__file__).resolve().parents[2]
HELDOUT = ROOT / "fixtures" / "prompts" / "heldout.jsonl"
BIN = Path(sys.executable).parent


def requests_for(source: str, repeat: int) -> list[dict]:
    """The held-out openings whose ``source`` starts with ``source`` (messages and tools)."""
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    picked = [{"messages": r["messages"], "tools": r["tools"]} for r in rows
              if r["source"].startswith(source)]
    if not picked:
        raise SystemExit(f"no held-out prompt from source {source!r}")
    return picked * repeat


MODES = ("unset", "strict", "echo", "all")  # ``MLX_FILL`` of each server (unset: stock mlx-lm)


def positive_ints(value: str) -> list[int]:
    """argparse ``type=``: a non-empty comma-separated list of integers of at least 1."""
    levels = [positive_int(v.strip()) for v in value.split(",") if v.strip()]
    if not levels:
        raise argparse.ArgumentTypeError("name at least one level")
    return levels


def model_dir(name: str, dtype: str) -> str:
    """``name`` (a model folder, else a fixture's name) as a folder in ``dtype``."""
    if Path(name).is_dir():
        path = name
    else:
        try:
            path = str(fixture_path(name))
        except ValueError as err:
            raise SystemExit(f"concurrency: --model {name}: {err}") from None
    if dtype == "float32":
        return path
    out = Path(tempfile.gettempdir()) / f"mlx-fill-bench-{Path(path).name}-{dtype}"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", path,
                        "--mlx-path", str(out), "--dtype", dtype], check=True)
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``mlx_lm.server`` subprocess with ``MLX_FILL`` set to ``mode`` (unset: no fill)."""

    def __init__(self, model: str, mode: str, log: Path, prompt_cache_size: int = 10):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_FILL")}
        if mode != "unset":
            env["MLX_FILL"] = mode
        self.log = open(log, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            [str(BIN / "mlx_lm.server"), "--model", model, "--port", str(self.port),
             "--prompt-cache-size", str(prompt_cache_size)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not start (log: {log})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def one(url: str, req: dict, max_tokens: int) -> dict:
    body = {"model": "default_model", "temperature": 0, "max_tokens": max_tokens, **req}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800).json()
    latency = time.perf_counter() - t0
    msg, usage = r["choices"][0]["message"], r["usage"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return {"latency": latency, "tokens": usage["completion_tokens"], "fill": usage.get("fill"),
            "answer": (msg.get("content"), calls, r["choices"][0]["finish_reason"],
                       usage["completion_tokens"])}


def run_level(server: Server, reqs: list[dict], clients: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda q: one(server.url, q, max_tokens), reqs))
    wall = time.perf_counter() - t0
    lat = sorted(r["latency"] for r in results)
    fills = [r["fill"] for r in results if r["fill"]]
    return {"clients": clients, "wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "tok_s": sum(r["tokens"] for r in results) / wall,
            "lat_median": statistics.median(lat), "lat_p90": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
            "latencies": lat, "injected": sum(f.get("injected", 0) for f in fills),
            "batch_peak": max((f.get("batch_peak", 0) for f in fills), default=0),
            "lanes": sorted({f.get("lane", "?") for f in fills}),
            "answers": [r["answer"] for r in results]}


def merge_reps(runs: list[dict]) -> dict:
    """One level's repetitions: median throughput, latencies pooled, answers of the first
    repetition (every repetition's answers must agree: ``stable``)."""
    lat = sorted(x for r in runs for x in r["latencies"])
    return {**runs[0], "tok_s": statistics.median(r["tok_s"] for r in runs),
            "tok_s_reps": [round(r["tok_s"], 2) for r in runs],
            "lat_median": statistics.median(lat), "lat_p90": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
            "stable": all(r["answers"] == runs[0]["answers"] for r in runs)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-json", help="a model folder or a fixture name")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--clients", type=positive_ints, default="1,4,8",
                    help="concurrency levels, comma-separated")
    ap.add_argument("--modes", type=name_list(MODES, "modes"), default="unset,strict,all",
                    help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--source", default="mini_swe_agent")
    ap.add_argument("--repeat", type=positive_int, default=1)
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--reps", type=positive_int, default=1,
                    help="repetitions of every (C, mode), interleaved")
    ap.add_argument("--limit", type=positive_int, default=None, help="only the first N requests")
    ap.add_argument("--prime", action="store_true",
                    help="send every request once to every server before measuring: the prompt "
                         "caches then hold the prompts, so the levels time decoding, not prefill")
    ap.add_argument("--json", type=output_file, default=None)
    a = ap.parse_args(argv)
    model = model_dir(a.model, a.dtype)
    reqs = requests_for(a.source, a.repeat)[:a.limit]
    levels, modes = a.clients, a.modes
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        servers = {}
        for mode in modes:  # all running at once; one level of one server at a time
            servers[mode] = Server(model, mode, Path(logs) / f"{mode}.log",
                                   prompt_cache_size=len(reqs) + 2)
            stack.callback(servers[mode].stop)
            one(servers[mode].url, reqs[0], 8)  # warm-up: load, plan, first compile
            if a.prime:
                run_level(servers[mode], reqs, 1, 1)
        for c in levels:
            # interleaved: each repetition runs every mode at this C, in rotated order, so
            # drifting background load falls on every mode alike
            reps = [[] for _ in modes]
            for rep in range(a.reps):
                order = modes[rep % len(modes):] + modes[:rep % len(modes)]
                for mode in order:
                    reps[modes.index(mode)].append(run_level(servers[mode], reqs, c, a.max_tokens))
            for mode, runs in zip(modes, reps):
                rows[mode].append(merge_reps(runs))
    base = {r["clients"]: r for r in rows.get("unset", [])}
    print(f"\n{a.model} {a.dtype}, {len(reqs)} requests ({a.source}), {a.max_tokens} tokens max, "
          f"temperature 0, {a.reps} interleaved repetition(s)"
          f"{', prompts primed (decode timed)' if a.prime else ''}\n")
    print("| MLX_FILL | C | tok/s | vs unset | latency median s | p90 s | identical | injected | lane | batch peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, levels_rows in rows.items():
        for r in levels_rows:
            b = base.get(r["clients"])
            ratio = f"{r['tok_s'] / b['tok_s']:.3f}x" if b else "-"
            same = (f"{sum(x == y for x, y in zip(r['answers'], b['answers']))}/{len(r['answers'])}"
                    if b else "-")
            print(f"| {mode} | {r['clients']} | {r['tok_s']:.1f} | {ratio} | {r['lat_median']:.2f} | "
                  f"{r['lat_p90']:.2f} | {same} | {r['injected']} | {','.join(r['lanes']) or '-'} | "
                  f"{r['batch_peak'] or '-'} |")
    unstable = [f"{m} C={r['clients']}" for m, lv in rows.items() for r in lv if not r["stable"]]
    if unstable:
        print(f"\nanswers differed between repetitions: {', '.join(unstable)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "dtype": a.dtype, "rows": rows},
                                           indent=1, default=str))


if __name__ == "__main__":
    main()
