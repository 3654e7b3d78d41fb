"""A dispatch plan applies only under the kernels and model shape it was qualified on; anything
else is qualified on first use (once, cached) and until then decodes one token per forward."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_fill.core import kernels
from mlx_fill.core import qualify
from mlx_fill.core import resolve
from mlx_fill.core.loop import generate_step
from mlx_fill.core.plan import (FAST_MAX_CHUNK, DispatchPlan, config_key, find_plan, load_plan,
                                model_shape, read_plan_file, save_plan, shipped_dir)
from mlx_fill.assets.fixtures import fixture_path
from mlx_fill.assets.random_models import build, config_for, save
from mlx_fill.session import build_session

from cli_lines import one_error_line

FAKE_OPENBLAS = kernels.Blas("openblas", "0.3.21", "SkylakeX")


@pytest.fixture
def model():
    return build(config_for("qwen3"), seed=3)[0]


@pytest.fixture
def plan_dirs(tmp_path, monkeypatch):
    """An empty user cache and an empty 'shipped' folder (the package's plans hidden). A
    measurement a test started in the background ends with the test, inside these folders: it
    neither writes to the real cache nor speaks into a later test's stderr."""
    monkeypatch.setenv("MLX_FILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLX_FILL_PLAN", raising=False)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr("mlx_fill.core.plan.shipped_dir", lambda: shipped)
    yield shipped
    assert resolve.wait_qualified(timeout=600), "a background measurement outlived its test"


@pytest.fixture
def qualify_calls(monkeypatch):
    """Counts the measurements the auto-qualify runs."""
    calls = []
    real = qualify.qualify

    def counting(model, **kw):
        calls.append(config_key(model))
        return real(model, **kw)

    monkeypatch.setattr(qualify, "qualify", counting)
    return calls


class Tok:
    eos_token_ids = ()


def session_for(model):
    return build_session("echo", model=model, tokenizer=Tok(), prompt_ids=[1, 2, 3])


def test_key_names_kernels_and_shape(model):
    key = config_key(model)
    assert key.mlx == mx.__version__ and key.dtype == "float32" and key.quant == "none"
    if sys.platform.startswith("linux") and key.backend == "cpu":
        assert key.blas not in ("unknown", "none") and key.blas_version != "unknown"
    assert key.shape.startswith("qwen3 layers=4 hidden=64")
    wider = build(dict(config_for("qwen3"), hidden_size=128))[0]
    assert model_shape(wider) != key.shape
    assert model_shape(build(config_for("qwen3"), seed=9)[0]) == key.shape  # weights are not shape


def test_shipped_plan_refused_under_another_blas_and_qualified_one_used(
        model, plan_dirs, qualify_calls, monkeypatch, capsys, steady_cost):
    here = config_key(model)
    shipped = DispatchPlan(key=here, max_chunk=16, cost={2: 1.5}, qualified=True, note="shipped")
    save_plan(shipped, plan_dirs / "cpu-test.json")
    assert resolve.resolve(model).source == "shipped" and session_for(model).plan == shipped
    assert qualify_calls == []

    monkeypatch.setattr(kernels, "blas", lambda: FAKE_OPENBLAS)
    meanwhile = resolve.resolve(model)
    assert meanwhile.source == "qualifying" and meanwhile.plan.max_chunk == 1
    res = resolve.resolve(model, wait=True)
    assert res.source == "qualified now" and res.path.parent == plan_dirs.parent / "cache" / "plans"
    assert (res.plan.key.blas, res.plan.key.blas_core) == ("openblas", "SkylakeX")
    refused = next(c for c in res.lookup.candidates if c.origin == "shipped")
    assert refused.problem == "key differs in blas, blas_version, blas_core"
    assert session_for(model).plan == res.plan and len(qualify_calls) == 1
    started, done = capsys.readouterr().err.splitlines()
    assert "qualifying" in started and "openblas 0.3.21 SkylakeX" in started
    assert "then chunk sizes for up to 120 s" in started and "saved to" in done
    text = resolve.format_resolution(res)
    assert "source: qualified now" in text
    assert "blas_core: '' in the plan, 'SkylakeX' here" in text


def test_auto_qualify_happens_once_and_is_cached(model, plan_dirs, qualify_calls, monkeypatch,
                                                 steady_cost):
    assert session_for(model).plan.max_chunk == 1  # served one token per forward meanwhile
    assert resolve.wait_qualified(timeout=600)
    first = session_for(model)
    assert first.plan.qualified and first.plan.key == config_key(model)
    assert session_for(model).plan == first.plan and len(qualify_calls) == 1
    cached = list((plan_dirs.parent / "cache" / "plans").glob("*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(resolve, "_resolved", {})  # a new process on the same machine
    res = resolve.resolve(model)
    assert res.source == "cached" and res.path == cached[0] and res.plan == first.plan
    assert len(qualify_calls) == 1


def test_a_lazily_cast_model_is_measured_in_the_background(model, plan_dirs, capsys, steady_cost):
    """Weights cast with ``set_dtype`` and not yet evaluated are a graph on the caller's stream;
    the measuring thread measures the model, not the error evaluating them there."""
    model.set_dtype(mx.bfloat16)
    res = resolve.resolve(model, wait=True)
    assert res.source == "qualified now" and res.plan.qualified and not res.plan.reason, res
    assert "Stream" not in capsys.readouterr().err


def test_a_failed_measurement_is_not_kept(model, monkeypatch, capsys):
    """A failure that is not the primitive refusing the cache says so, and the plan it gives
    (one token per forward) is not qualified: the next first use measures again."""
    def broken(*a, **k):
        raise RuntimeError("no stream")
    monkeypatch.setattr(qualify, "_measure", broken)
    plan, checks = qualify.qualify(model, quick=True, bar=False)
    assert plan.max_chunk == 1 and not plan.qualified and checks == []
    assert plan.reason == "RuntimeError: no stream" and "no stream" in capsys.readouterr().err


def test_the_loop_uses_the_sessions_plan(model, plan_dirs, monkeypatch):
    session = session_for(model)
    monkeypatch.setattr("mlx_fill.core.loop.plan_for", lambda m: pytest.fail("resolved twice"))
    steps = generate_step(mx.array([1, 2, 3, 1, 2, 3]), model, fill=session, max_tokens=8)
    assert len([t for t, _ in steps]) == 8


def test_no_plan_without_qualifying_means_one_token_per_forward(model, plan_dirs):
    res = resolve.resolve(model, qualify=False)
    assert res.source == "unqualified" and res.plan.max_chunk == 1 and not res.plan.qualified
    assert res.plan.chunks(10, 4) == [1, 1, 1, 1]


def test_plan_file_of_the_old_key_format_is_refused(model, plan_dirs):
    old = {"key": {"backend": "cpu", "device": "x86_64", "dtype": "float32", "quant": "none"},
           "max_chunk": 16, "mode": "exact", "qualified": True}
    (plan_dirs / "old.json").write_text(json.dumps(old))
    lookup = find_plan(config_key(model))
    assert lookup.chosen is None and "mlx, mlx_lm, blas" in lookup.candidates[0].problem
    assert load_plan(model).max_chunk == 1


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("max_chunk", -3, "max_chunk: -3 is not a whole number from 1 to 64"),
    ("max_chunk", 1e30, "max_chunk: 1e+30 is not a whole number from 1 to 64"),
    ("mode", "zzz", "mode: 'zzz' is not one of ['exact', 'fast']"),
    ("cost", {"2": float("nan")}, "cost[2]: nan is not a finite number above 0"),
    ("cost", {"2": -1.5}, "cost[2]: -1.5 is not a finite number above 0"),
    ("cost", {"2": float("inf")}, "cost[2]: inf is not a finite number above 0"),
    ("cost", {"0": 1.0}, "cost: the key '0' is not a chunk size of at least 1"),
    ("long_cost", {"1": 0}, "long_cost[1]: 0 is not a finite number above 0"),
    ("round_overhead", float("nan"), "round_overhead: nan is not a finite number at least 0"),
    ("round_overhead", -0.5, "round_overhead: -0.5 is not a finite number at least 0"),
    ("shapes", {"4": "sideways"}, "shapes[4]: 'sideways' is not one of"),
    ("pending", [0], "pending: 0 is not a whole number at least 1"),
    ("kv_boundaries", [-1], "kv_boundaries: -1 is not a whole number at least 0"),
    ("cost", [1.2, 1.5], "cost: [1.2, 1.5] is not a JSON object"),
    ("key", "cpu", "key: 'cpu' is not a JSON object"),
    ("pending", 4, "pending: 4 is not a JSON array")])
def test_a_plan_file_with_values_out_of_range_is_refused_in_one_line(field, value, needle, tmp_path,
                                                                     monkeypatch, capsys):
    """Read as ``mlx-fill plan`` lists it, and named in one line when ``MLX_FILL_PLAN`` points
    at it (``serve``, ``demo`` and the mlx_lm.server hook check it alike)."""
    shipped = json.loads(next(shipped_dir().glob("*.json")).read_text())
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**shipped, field: value}))
    assert read_plan_file(path).startswith(f"unreadable (ValueError: {needle}")
    monkeypatch.setenv("MLX_FILL_PLAN", str(path))
    one_error_line(capsys, ["serve", "--model", str(fixture_path("qwen3-json")), "--port", "0"],
                   f"MLX_FILL_PLAN={path} is unreadable (ValueError: {needle}")


@pytest.mark.parametrize(("content", "needle"), [
    ([1, 2], "a plan is a JSON object, got list"), ({"cost": {"2": 1.5}}, "max_chunk: missing")])
def test_a_plan_file_of_another_shape_is_refused_saying_what_it_lacks(content, needle, tmp_path):
    """A list or an object without ``max_chunk`` said ``'list' object has no attribute 'get'``
    and ``KeyError: 'max_chunk'``."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(content))
    assert read_plan_file(path) == f"unreadable (ValueError: {needle})"


def test_a_plan_reads_back_from_to_json_unserialized():
    """``study`` hands its workers ``to_json()`` as it is, lists still tuples."""
    plan = DispatchPlan(key=None, max_chunk=8, kv_boundaries=(0, 512), cost={2: 1.4},
                        pending=(4, 8))
    assert DispatchPlan.from_json(plan.to_json()) == plan


def test_shipped_plans_and_every_size_qualify_measures_fit_a_plan_file():
    shipped = sorted(shipped_dir().glob("*.json"))
    assert shipped and all(isinstance(read_plan_file(p), DispatchPlan) for p in shipped)
    assert max(qualify.FULL_SIZES) <= FAST_MAX_CHUNK
    plan = DispatchPlan(key=None, max_chunk=max(qualify.FULL_SIZES), qualified=True,
                        cost={m: 1.0 + m / 10 for m in qualify.FULL_SIZES}, round_overhead=0.0,
                        pending=(32,), shapes={2: "batched-m1"})
    assert DispatchPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def _openblas() -> str | None:
    path = ctypes.util.find_library("openblas")
    if path is None:
        return None
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"):
        if (Path(folder) / path).exists():
            return str(Path(folder) / path)
    return path


@pytest.mark.skipif(_openblas() is None, reason="libopenblas not installed")
def test_preloaded_openblas_refuses_a_bundled_blas_plan(tmp_path, model, steady_cost):
    """Real kernels: a plan qualified under MLX's bundled BLAS (``MLX_FILL_PLAN``) applies in a
    process without a preload and is refused in one with OpenBLAS preloaded, which qualifies its
    own plan under OpenBLAS and names the differing key fields."""
    model_dir = save(model, dict(config_for("qwen3"), torch_dtype="float32"), tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    env["MLX_FILL_CACHE"] = str(tmp_path / "cache")

    def plan_cmd(extra_env, *flags):
        proc = subprocess.run([sys.executable, "-m", "mlx_fill.cli", "plan", "--model",
                               str(model_dir), *flags], capture_output=True, text=True,
                              env={**env, **extra_env}, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    bundled = tmp_path / "bundled.json"
    from mlx_lm.utils import load_model
    save_plan(qualify.qualify(load_model(model_dir)[0], quick=True, bar=False)[0], bundled)
    if json.loads(bundled.read_text())["key"]["blas"] == "openblas":
        pytest.skip("this process already runs OpenBLAS")
    env["MLX_FILL_PLAN"] = str(bundled)
    assert f"source: MLX_FILL_PLAN {bundled}" in plan_cmd({})

    preload = {"LD_PRELOAD": _openblas(), "OPENBLAS_CORETYPE": "Haswell"}
    looked = plan_cmd(preload, "--no-qualify")
    assert "source: unqualified" in looked and "max_chunk=1 " in looked
    assert "blas: openblas" in looked and "blas_core: Haswell" in looked
    assert f"MLX_FILL_PLAN {bundled}: key differs in blas, blas_version, blas_core" in looked
    qualified = plan_cmd(preload)
    assert "source: qualified now" in qualified and "blas_core: Haswell" in qualified
    assert "source: cached" in plan_cmd(preload, "--no-qualify")


_EXIT_SCRIPT = """
import sys, time
from mlx_fill.core import qualify, resolve
# the tiny model's forwards cost about the same at every M: on a loaded machine every try can
# time some c(M) below 1, a curve that is not saved (``steady_cost``, in the script's process)
measured = qualify.measure_cost
qualify.measure_cost = lambda *a, **k: {m: c if m < 2 else max(c, 1.0)
                                        for m, c in measured(*a, **k).items()}
from mlx_fill.assets.random_models import build, config_for
model = build(config_for("qwen3"), seed=3)[0]
res = resolve.resolve(model, wait=sys.argv[1] == "wait")
time.sleep(float(sys.argv[2]))
print(res.source)
"""


@pytest.mark.parametrize("after_s", [0.0, 0.3, 1.0])
def test_exit_during_background_qualify_is_clean_and_saves_nothing(tmp_path, after_s):
    """A script that ends while its first-use measurement runs exits with status 0 (MLX aborts
    the process when torn down under a thread that evaluated on its own stream), says the
    measurement stopped, and leaves no plan behind."""
    env = {**os.environ, "MLX_FILL_CACHE": str(tmp_path / "cache")}
    env.pop("MLX_FILL_PLAN", None)
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, "exit", str(after_s)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["qualifying"]
    assert "qualifying stopped, the process is exiting; nothing saved" in proc.stderr, proc.stderr
    assert not list((tmp_path / "cache").rglob("*.json"))


def test_a_first_use_measurement_of_timing_noise_saves_nothing(model, plan_dirs, monkeypatch,
                                                              capsys):
    """A cost curve timed below one row in every try (a machine too loaded to time) is not a
    plan to keep: one stderr line says so, nothing is saved, the process decodes one token per
    forward, and the next process measures again."""
    monkeypatch.setattr(qualify, "measure_cost",
                        lambda *a, **k: {1: 1.0, 2: 0.5, 3: 0.6, 4: 0.7})
    res = resolve.resolve(model, wait=True)
    assert res.source == "unqualified" and res.plan.max_chunk == 1
    assert res.reason == "the cost curve measured only timing noise"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "measured only timing noise (" in err[1], err
    assert "nothing saved (the next first use measures again); one token per forward" in err[1]
    assert not list(plan_dirs.parent.rglob("*.json"))
    monkeypatch.setattr(resolve, "_resolved", {})  # a new process on the same machine
    assert resolve.resolve(model, wait=False).source == "qualifying"
    assert resolve.wait_qualified(timeout=600)


def test_exit_after_background_qualify_is_clean_and_saves_the_plan(tmp_path):
    """A script that waits for its first-use measurement (its cost curve; no budget left for
    exactness checks) and then exits: status 0, the plan saved."""
    env = {**os.environ, "MLX_FILL_CACHE": str(tmp_path / "cache"), "MLX_FILL_QUALIFY_BUDGET_S": "0"}
    env.pop("MLX_FILL_PLAN", None)
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, "wait", "0"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["qualified", "now"]
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1


def test_fake_blas_identity_reaches_the_key(model, monkeypatch):
    monkeypatch.setattr(kernels, "blas", lambda: FAKE_OPENBLAS)
    key = config_key(model)
    assert (key.blas, key.blas_version, key.blas_core) == ("openblas", "0.3.21", "SkylakeX")
    assert replace(key, blas_core="Haswell").differences(key) == ["blas_core"]


@pytest.fixture
def tiny_served_dir(tmp_path):
    """A tiny random qwen3 (512 ids) with the real qwen3 tokenizer: loadable by both servers."""
    from adapter_models import TOKENIZER_FILES, assets
    path = save(*build(config_for("qwen3"), seed=5), tmp_path / "served")
    for name in TOKENIZER_FILES:
        shutil.copyfile(assets.family_dir("qwen3") / name, path / name)
    return path


def test_serve_engine_qualifies_at_start_up(tiny_served_dir, plan_dirs, qualify_calls, steady_cost):
    from mlx_fill.adapters.server.serve import Engine
    engine = Engine(str(tiny_served_dir), mode="strict")
    assert resolve.wait_qualified(timeout=600)
    assert len(qualify_calls) == 1 and qualify_calls[0] == config_key(engine.model)
    assert list((plan_dirs.parent / "cache" / "plans").glob("*.json"))


def test_mlx_lm_server_hook_qualifies_at_model_load(tiny_served_dir, tmp_path):
    from adapter_models import BIN, free_port, running_server
    cache, log, port = tmp_path / "cache", tmp_path / "server.log", free_port()
    argv = [str(BIN / "mlx_lm.server"), "--model", str(tiny_served_dir), "--port", str(port)]
    with running_server(argv, port, env={"MLX_FILL": "strict", "MLX_FILL_CACHE": str(cache)},
                        log=log):
        deadline = time.monotonic() + 300  # a first-use qualify on a loaded machine
        while "saved to" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.3)
    text = log.read_text()
    assert text.count("qualifying this model once") == 1, text[-2000:]
    assert len(list((cache / "plans").glob("*.json"))) == 1  # before any request was sent
