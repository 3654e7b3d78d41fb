"""Fill inside a distributed ``mlx_lm.server``: two ranks on localhost under ``mlx.launch``
(ring backend), the widened ``qwen35-xml-x2`` fixture sharded by pipeline and by tensor
parallelism, tool requests with ``MLX_FILL=strict`` (the template scaffold, verified) and an
OpenAI ``prediction`` that is partly wrong (so rounds are rejected and rewound: restore and
replay on this hybrid model). Every server runs through ``dist_server.py`` with ``PIN_COST=1``:
the cost gates read the plan's measured cost curve, which is the sharded configuration's own, so
the curve is pinned (rows priced as free, chunking as qualified) for the telemetry to compare.

Checked against the same model unsharded: the answer is the fill-off answer, ``usage.fill`` is
the unsharded fill run's in what was proposed, accepted and injected (not the wall-clock
``checkpoint_ms`` and ``source_ms``, nor the lane and its forward count: the unsharded server
batches tool requests, a sharded one serves them serially), and a fault injected
on one rank (rank 0 in the pipeline run, rank 1 in the tensor run) disarms fill on every rank
at the same step: still the fill-off answer, no hang, ``usage.fill.refusals == {"shard_fault":
1}``. Every server and launch is bounded by a timeout, sized for a machine that runs another
CPU-bound job beside the test (:data:`READY_S`, :data:`REQUEST_S`: a start-up loads and
qualifies the model on every rank; a two-rank request synchronizes at every step)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from adapter_models import AGENT_MESSAGES, AGENT_TOOLS, free_port, running_server, wait_ready

from mlx_fill.assets.fixtures import fixture_path

HERE = Path(__file__).parent
LAUNCH = shutil.which("mlx.launch")
MAX_TOKENS = 64
# bounds, not expectations: on a loaded machine a start-up (load, plan qualification on every
# rank) and a request take several times what they take on a quiet one
READY_S = 600.0
REQUEST_S = 600.0
PROBE_S = 180.0
PROBE = "import mlx.core as mx; g = mx.distributed.init(); print(mx.distributed.all_sum(1).item())"


def _ring_port() -> int:
    """A port ``p`` with ``p + 1`` also free: ``mlx.launch`` gives rank ``i`` port ``p + i``."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _launch_argv(script: list[str], ring_port: int) -> list[str]:
    return [LAUNCH, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
            "--starting-port", str(ring_port), "--python", sys.executable, *script]


@pytest.fixture(scope="module")
def ring(tmp_path_factory) -> None:
    if LAUNCH is None:
        pytest.skip("mlx.launch is not on the PATH")
    probe = tmp_path_factory.mktemp("probe") / "probe.py"
    probe.write_text(PROBE)
    reason = ""
    # two tries, each on fresh ports: a port picked free can be taken before the ranks bind it
    for _ in range(2):
        try:
            out = subprocess.run(_launch_argv([str(probe)], _ring_port()), capture_output=True,
                                 text=True, timeout=PROBE_S, start_new_session=True)
        except subprocess.TimeoutExpired:
            reason = f"mlx.launch --backend ring did not finish a two-rank all_sum in {PROBE_S} s"
            continue
        if out.returncode == 0 and out.stdout.split().count("2") == 2:
            return
        reason = f"the ring backend is unavailable here: {(out.stderr or out.stdout)[-500:]}"
    pytest.skip(reason)


@contextlib.contextmanager
def launched_server(model: Path, *, pipeline: bool, env: dict[str, str], log: Path,
                    timeout: float = READY_S):
    """Two ranks of ``dist_server.py`` under ``mlx.launch``; the whole process group is killed
    on exit (also when a rank hangs)."""
    port = free_port()
    argv = _launch_argv([str(HERE / "dist_server.py"), "--model", str(model), "--port", str(port),
                         *(["--pipeline"] if pipeline else [])], _ring_port())
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_FILL")}
    full_env.update(env)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/v1/models", log, timeout)
            yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                max_retries=0, timeout=REQUEST_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


PREDICTION = ("<tool_call>\n<function=bash>\n<parameter=command>\ngrep -rn TODO src | head\n"
              "</parameter>\n</function>\n</tool_call>")
REQUESTS = {"a": None, "b": "Show me the first lines of README.md."}


def ask(client: openai.OpenAI, name: str):
    last = REQUESTS[name] or AGENT_MESSAGES[-1]["content"]
    messages = [*AGENT_MESSAGES[:-1], {"role": "user", "content": last}]
    extra = {"prediction": {"type": "content", "content": PREDICTION}} if name == "a" else {}
    return client.chat.completions.create(model="default_model", messages=messages,
                                          tools=AGENT_TOOLS, temperature=0, max_tokens=MAX_TOKENS,
                                          **extra)


def answers(client: openai.OpenAI) -> dict[str, tuple]:
    """(message content, tool calls, finish reason, usage.fill) per request, in order."""
    out = {}
    for name in REQUESTS:
        r = ask(client, name)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        fill = dict((r.usage.model_extra or {}).get("fill") or {})
        for key in ("checkpoint_ms", "source_ms", "lane", "batch_peak", "forwards", "forwards_saved"):
            # wall-clock times; the lane (a sharded model decodes serially) and the forwards it
            # takes (a batched round is led by the in-flight sample, a serial one may not be)
            fill.pop(key, None)
        out[name] = (m.content, calls, r.choices[0].finish_reason, fill)
    return out


def decisions(telemetry: dict) -> dict:
    """A request's telemetry but for the drafted ids the serial and batched lanes differ in: a
    view's end that declines a draft (its first id only matches the sample in flight) is
    followed, in a batched step, by a view ending at that sample. Equal across lanes."""
    lane_bound = ("verify_proposed", "verify_rejected", "proposed_by_origin")
    return {k: v for k, v in telemetry.items() if k not in lane_bound}


def qualified(model: Path) -> None:
    """Measure the unsharded model's plan into the user cache before its server starts: a
    server measures a missing plan in the background and serves one token per forward
    meanwhile, which would make its telemetry depend on timing (the ranks of a sharded model
    measure theirs in lockstep before the first request). Its cost curve is flat, as the ranks'
    (``dist_server.pin_cost_measure``): the servers price rows as free, and a curve timed on a
    loaded machine can be refused as noise."""
    from mlx_lm import load

    import mlx_fill.core.qualify as qualify
    from mlx_fill.core.resolve import resolve
    loaded, _ = load(str(model))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qualify, "measure_plausible_cost",
                      lambda model, cache, sizes, *args: {m: 1.0 for m in sizes})
        resolve(loaded, wait=True)


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory) -> dict[str, dict]:
    model = fixture_path("qwen35-xml-x2")
    qualified(model)
    logs = tmp_path_factory.mktemp("logs")
    cmd = lambda p: [sys.executable, str(HERE / "dist_server.py"), "--model", str(model), "--port", str(p)]
    p_off, p_fill = free_port(), free_port()
    with running_server(cmd(p_off), p_off, log=logs / "off.log", timeout=READY_S) as off, \
            running_server(cmd(p_fill), p_fill, env={"MLX_FILL": "strict", "PIN_COST": "1"},
                           log=logs / "fill.log", timeout=READY_S) as on:
        client = lambda base: openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                            timeout=REQUEST_S)
        return {"off": answers(client(off)), "fill": answers(client(on))}


@pytest.mark.parametrize("pipeline,fault_rank", [(True, 0), (False, 1)], ids=["pipeline", "tensor"])
def test_two_ranks_answer_as_unsharded_and_survive_a_one_rank_fault(
        ring, unsharded, tmp_path, pipeline, fault_rank):
    model = fixture_path("qwen35-xml-x2")
    env = {"MLX_FILL": "strict", "FAULT_RANK": str(fault_rank), "PIN_COST": "1"}
    with launched_server(model, pipeline=pipeline, env=env, log=tmp_path / "ranks.log") as client:
        got = answers(client)
    off, fill = unsharded["off"], unsharded["fill"]
    for name in REQUESTS:
        assert got[name][:3] == off[name][:3], name  # the fill-off answer
    assert decisions(got["a"][3]) == decisions(fill["a"][3])  # the unsharded fill run's telemetry
    assert got["a"][3]["injected"] > 0 and got["a"][3]["refusals"] == {}
    assert got["a"][3]["verify_rejected"] > 0  # a rejected tail was rewound on both ranks
    assert got["b"][3]["refusals"] == {"shard_fault": 1}  # disarmed on every rank, answered
    assert off["a"][1], "the fixture should answer the agent exchange with a tool call"
