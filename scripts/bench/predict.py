"""Predicted Outputs on file edits: fill with the original file as ``prediction`` vs plain decoding.

Each task is a real file of this repository (28-129 lines, a copy frozen under
``fixtures/edits/`` as its results were measured) and a real edit instruction (rename a symbol
or a method at every call, change a constant, delete a block, insert a line, add a parameter,
fix a misspelling planted in the file); the model is asked to reply with the
whole edited file, and the request's OpenAI ``prediction`` is the original file, as an editor's
"apply edit" sends it. One task gives the prediction of another file (useless: what the flag
costs where nothing matches). Arms, in one run, interleaved on the same prefilled prompt (every
repeat runs every arm back to back, the order reversed every other repeat), all through the
mlx-lm drop-in ``mlx_fill.adapters.mlx_lm.stream_generate``:

* ``off``: plain mlx-lm (``fill=None`` is the stock call);
* ``prediction``: a session with the prediction alone (``build_session("strict", prediction=...)``
  without messages: no strict source);
* ``prediction+all``: the prediction with every context source (``build_session("all", ...)``).

The prompt is prefilled once per task and every arm decodes from that cache, so ``decode x
plain`` compares decoding alone (session build included); ``request x plain`` adds the one
prefill's time to every arm (the whole request's wall). Per task and arm: output ids, identity
to ``off``, the prediction's accepted/rejected tokens as ``usage.completion_tokens_details``
reports them (the predicted ids in the reply, OpenAI's definition) and beside them the ids the
prediction source itself filled (``trace_accepted``: the trace's accepted ids of origin
``prediction``; fewer where another source or a plain step emitted a predicted id),
target forwards per token, and whether the model made the requested edit (compared with the
expected file; reported, not gated). ``coverage`` is the share of the output ids inside blocks
shared with the prediction (``difflib`` on ids); ``bound`` is the decode ratio that coverage
allows: covered ids at the best rate of one verify round (``max n / rows_cost(n)``, the
largest exact chunk at its cost), the rest one per forward, priced on the cost curve measured
at the start of this run (qualify's measure on a 512-id cache, the plan's sizes), since what a
multi-row forward costs against a step differs between machines and with their load;
``bound_plan`` prices it on the plan's stored curve, the one the cost gates decide on.

    python -m scripts.bench.predict [--fixture qwen25-coder-0.5b | --model DIR] [--tasks a,b]
        [--edits FILE] [--repeats 1] [--dtype bfloat16] [--json out.json]

``--edits FILE`` runs your own edits instead of the built-in tasks: a JSONL file, one task per
line, ``{"name", "file", "instruction"}`` and optionally ``"replacements": [[old, new], ...]``
(each ``old`` in the file; the expected file follows) or ``"expected"`` (the edited file's
path), ``"prediction"`` (the path of the text sent as the prediction; default ``file``) and
``"max_tokens"``; paths are relative to the edits file's folder, and the files are read as
they are (UTF-8, ``\\r\\n`` kept; the reply is checked line for line). Without ``replacements``
or ``expected`` the edit itself is not checked (``edit ok`` reads None).

Exits 1 when any arm's ids differ from ``off``.
"""

from __future__ import annotations

import difflib
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_fill.assets.fixtures import FIXTURES, REAL_FIXTURES
from mlx_fill.cli import _Parser
from mlx_fill.core.errors import UserError, existing_file, model_ref, output_file, positive_int
from mlx_fill.session import check_env

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("off", "prediction", "prediction+all")
SYSTEM = ("You are a coding assistant that edits files. Apply exactly the requested change and "
          "reply with the complete edited file in one code block, nothing else.")
_FENCE = re.compile(r"(`{3,})[^`\n]*\n(.*?)\1`*[ \t]*$", re.DOTALL | re.MULTILINE)


@dataclass(frozen=True)
class EditTask:
    """One edit: ``path`` (relative to the repository root, or absolute), the instruction, and
    the edit as ``(old, new)`` replacements of the original text (each ``old`` must occur in it),
    from which the expected file follows, or ``expected_path``, the edited file itself (neither:
    the edit is not checked). ``prediction_path``: predict another file instead (useless).
    ``typo``: ``(word, misspelling)``; the original is the file with its one ``word`` misspelled
    (the prediction too, as an editor sends the file it holds), the expected file is the real one."""

    name: str
    path: str
    instruction: str
    replacements: tuple[tuple[str, str], ...]
    prediction_path: str | None = None
    max_tokens: int | None = None  # a cap below the run's (the useless task needs no whole file)
    typo: tuple[str, str] | None = None
    expected_path: str | None = None

    def original(self) -> str:
        text = read_text(ROOT / self.path)
        if self.typo is not None:
            word, misspelled = self.typo
            if text.count(word) != 1:
                raise ValueError(f"task {self.name}: {word!r} must occur once in {self.path}")
            text = text.replace(word, misspelled)
        return text

    def expected(self) -> str | None:
        """The edited file, or None where the task gives no way to know it."""
        if self.expected_path is not None:
            return read_text(ROOT / self.expected_path)
        if not self.replacements:
            return None
        text = original = self.original()
        for old, new in self.replacements:
            if old not in text:
                why = (" after the replacements before it" if old in original else
                       " (its lines end in \\r\\n)" if "\n" in old and "\r\n" in original else "")
                raise ValueError(f"task {self.name}: {old!r} is not in {self.path}{why}")
            text = text.replace(old, new)
        return text

    def prediction(self) -> str:
        if self.prediction_path is None:
            return self.original()
        return read_text(ROOT / self.prediction_path)


def read_text(path: Path) -> str:
    """The file at ``path`` as it is, line ends kept (an editor predicts the file it holds);
    ValueError naming the file when it is not UTF-8 text or the path cannot be opened."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ValueError(f"cannot open {str(path)!r} ({e})") from None


_MODEL_REF = '''

def model_ref(value: str) -> str:
    """argparse ``type=``: a local mlx-lm model directory, or a Hugging Face repo id
    (``owner/name``, which mlx-lm downloads) when no such path exists."""
    path = Path(value)
    looks_like_repo = value.count("/") == 1 and not value.startswith((".", "/", "~"))
    if path.exists() or not looks_like_repo:
        model_dir(value)
    return value
'''

# Every task's files are frozen copies under fixtures/edits/ (as its results were measured), so a
# task stays the task whose numbers are reported while the package's own files change.
TASKS: tuple[EditTask, ...] = (
    EditTask("rename-symbol", "fixtures/edits/fill/modes.py",
             "Rename the function `check_mode` to `normalize_mode`.",
             (("def check_mode(", "def normalize_mode("),)),
    EditTask("change-constant", "fixtures/edits/setup.py",
             'In the HOOKS constant, change the folder name "hooks" to "startup".',
             (('/ "adapters" / "hooks" /', '/ "adapters" / "startup" /'),)),
    EditTask("delete-block", "fixtures/edits/fill/core/errors.py",
             "Delete the function `model_ref` (its definition and body).",
             ((_MODEL_REF, ""),)),
    EditTask("insert-line", "fixtures/edits/fill/__init__.py",
             'In _EXPORTS, add the entry `"predicted_count": "mlx_fill.session",` right after the '
             '`"usage_extra"` entry.',
             (('    "usage_extra": "mlx_fill.session",\n',
               '    "usage_extra": "mlx_fill.session",\n    "predicted_count": "mlx_fill.session",\n'),)),
    EditTask("add-parameter", "fixtures/edits/adapters/mlx_lm.py",
             "Add a keyword parameter `label: str = \"fill\"` to `_with_telemetry` (after `fill`) "
             "and do not use it anywhere.",
             (("def _with_telemetry(responses: Iterator[Any], fill: FillSession)",
               "def _with_telemetry(responses: Iterator[Any], fill: FillSession, label: str = \"fill\")"),)),
    EditTask("fix-typo", "fixtures/edits/spec/ngram.py",
             "Fix the misspelled word in the module docstring.",
             (("behavoiur", "behaviour"),), typo=("behaviour", "behavoiur")),
    EditTask("rename-method", "fixtures/edits/combine.py",
             "Rename the method `_score_shadows` to `_score_shadow_drafts` (its definition and "
             "every call).",
             (("_score_shadows(", "_score_shadow_drafts("),)),
    EditTask("useless-prediction", "fixtures/edits/fill/modes.py",
             "Rename the function `check_mode` to `normalize_mode`.",
             (("def check_mode(", "def normalize_mode("),), prediction_path="fixtures/edits/setup.py",
             max_tokens=96),
)
DEFAULT_TASKS = ("rename-symbol", "change-constant", "useless-prediction")


def default_tasks() -> list[EditTask]:
    by_name = {t.name: t for t in TASKS}
    return [by_name[n] for n in DEFAULT_TASKS]


_EDIT_FIELDS = {"name", "file", "instruction", "replacements", "expected", "prediction", "max_tokens"}


def load_edits(path: Path) -> tuple[EditTask, ...]:
    """The tasks of an edits file (the module docstring's format; UTF-8, a leading BOM allowed,
    one task per ``\n``-ended line), each checked: its files read as UTF-8 text and every
    replacement's ``old`` occurs in the file. Raises UserError naming the line and what is
    wrong."""
    try:
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--edits {path}: cannot read it ({e})") from None
    folder = path.resolve().parent
    tasks: list[EditTask] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--edits {path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise UserError(f"{where}: not a JSON object ({e})") from None
        try:
            task = _edit_task(obj, folder)
            task.original(), task.expected(), task.prediction()
        except (ValueError, OSError) as e:
            raise UserError(f"{where}: {e}") from None
        if task.name in {t.name for t in tasks}:
            raise UserError(f"{where}: the name {task.name!r} is taken by an earlier task")
        tasks.append(task)
    if not tasks:
        raise UserError(f"--edits {path}: no tasks in it")
    return tuple(tasks)


def _edit_task(obj, folder: Path) -> EditTask:
    if not isinstance(obj, dict):
        raise ValueError("a task is a JSON object")
    unknown = sorted(set(obj) - _EDIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {unknown}; a task has {sorted(_EDIT_FIELDS)}")
    for key in ("name", "file", "instruction"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise ValueError(f"{key!r} must be a non-empty string")
    if "," in obj["name"] or obj["name"] != obj["name"].strip():
        raise ValueError("'name' must hold no comma and no blank space at its ends (--tasks "
                         "picks tasks by name)")
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"a string holds {e.object[e.start]!r}, half of a UTF-16 surrogate pair, "
                         "which is not text") from None
    for key in ("expected", "prediction"):
        if key in obj and (not isinstance(obj[key], str) or not obj[key]):
            raise ValueError(f"{key!r} must be a path")
    pairs = obj.get("replacements", [])
    if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) and p[0]
            for p in pairs):
        raise ValueError("'replacements' must be a list of [old, new] strings, old not empty")
    if pairs and "expected" in obj:
        raise ValueError("give 'replacements' or 'expected', not both")
    cap = obj.get("max_tokens")
    if cap is not None and (type(cap) is not int or cap < 1):
        raise ValueError("'max_tokens' must be a positive integer")

    def at(key: str) -> str | None:
        return str(folder / obj[key]) if key in obj else None

    return EditTask(obj["name"], at("file"), obj["instruction"], tuple(tuple(p) for p in pairs),
                    prediction_path=at("prediction"), max_tokens=cap, expected_path=at("expected"))


def messages_for(task: EditTask) -> list[dict]:
    """The request: the instruction and the file in a code block whose fence is longer than
    any run of backticks in the file and closes on a line of its own."""
    lang = {".py": "python", ".sh": "bash", ".toml": "toml"}.get(Path(task.path).suffix, "")
    text = task.original()
    fence = "`" * max(3, 1 + max(map(len, re.findall("`+", text)), default=0))
    body = text if text.endswith("\n") or not text else text + "\n"
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{task.instruction}\n\n{fence}{lang}\n{body}{fence}"}]


def edited_file(text: str) -> str:
    """The file in the model's reply: the first fenced block's body (to the first line that
    ends in its fence), else the whole reply."""
    match = _FENCE.search(text)
    return match.group(2) if match else text


def edit_made(reply: str, expected: str) -> bool:
    """Whether the file in ``reply`` is ``expected`` line for line (its line ends and trailing
    blank space aside: a model writes ``\\n`` where the file has ``\\r\\n``)."""
    return edited_file(reply).rstrip().splitlines() == expected.rstrip().splitlines()


def coverage(out: list[int], predicted: list[int]) -> float:
    """Share of ``out`` inside blocks it shares with ``predicted`` (``difflib`` on ids)."""
    if not out:
        return 0.0
    matcher = difflib.SequenceMatcher(None, out, predicted, autojunk=False)
    return sum(b.size for b in matcher.get_matching_blocks()) / len(out)


def best_round_rate(plan, max_span: int) -> float:
    """Tokens per one-row forward of a fully accepted verify round at its best length: ``max
    n / plan.rows_cost(n)`` over ``n <= max_span + 1`` rows (the largest exact chunk at its
    measured cost, for a concave cost curve)."""
    return max(n / plan.rows_cost(n) for n in range(1, max_span + 2))


def measured_curve(model, plan, repeats: int = 3):
    """``plan`` with its cost curve measured now on this machine: qualify's ``c(M)`` on its
    cost cache at the plan's sizes, each size in the append shape the plan runs it with
    (median of ``repeats``, timing noise retried as qualify does)."""
    from dataclasses import replace

    from mlx_fill.core import qualify

    vocab = qualify.vocab_of(model)
    cache = qualify.cost_cache(model, vocab)
    sizes = tuple(sorted(plan.cost)) or (1, plan.max_chunk)  # a plan stored without a curve
    costs = {shape: qualify.measure_plausible_cost(model, cache, sizes, vocab, repeats, shape)
             for shape in {plan.shape_for(m) for m in sizes}}
    return replace(plan, cost={m: costs[plan.shape_for(m)][m] for m in sizes})


def bound_for(share: float, rate: float) -> float:
    """The decode ratio to plain when a ``share`` of the output is emitted at ``rate`` tokens per
    forward and the rest one per forward."""
    return 1.0 / ((1.0 - share) + share / rate)


def decode(model, tok, prompt_tail: list[int], cache, session, max_tokens: int) -> list[int]:
    """The ids ``stream_generate`` (the drop-in) yields, EOS excluded, from a prompt cache."""
    from mlx_fill.adapters.mlx_lm import stream_generate

    out = []
    for r in stream_generate(model, tok, prompt_tail, fill=session, prompt_cache=cache,
                             max_tokens=max_tokens):
        if r.finish_reason is None or r.finish_reason == "length":
            out.append(r.token)
    return out


def trace_accepted(path: Path, origin: str) -> int:
    """Ids of proposals from ``origin`` the target accepted, summed over a fill trace file."""
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(e["accepted"] for e in events if e["origin"] == origin)


def session_for(arm: str, *, model, tok, ids: list[int], messages: list[dict], prediction: dict,
                trace: Path):
    from mlx_fill.session import build_session

    if arm == "off":
        return None
    mode, msgs = ("strict", None) if arm == "prediction" else ("all", messages)
    return build_session(mode, model=model, tokenizer=tok, prompt_ids=ids, messages=msgs,
                         prediction=prediction, trace_path=str(trace))


def run_task(task: EditTask, *, model, tok, repeats: int, max_tokens: int, rate: float,
             plan_rate: float | None = None) -> dict:
    """Every arm on one task (see module docstring); one result row."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlx_fill.session import end_session, prediction_ids, usage_extra
    from mlx_fill.sources.prediction import ORIGIN

    messages = messages_for(task)
    max_tokens = min(max_tokens, task.max_tokens or max_tokens)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    prediction = {"type": "content", "content": task.prediction()}
    predicted = prediction_ids(tok, prediction)
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for start in range(0, len(ids) - 1, 512):
        model(mx.array(ids[start:min(start + 512, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    prefill_s = time.perf_counter() - t0
    base = len(ids) - 1
    decode(model, tok, ids[-1:], cache, None, 4)  # untimed: the first decode after a prefill
    trim_prompt_cache(cache, cache[0].offset - base)

    times: dict[str, list[float]] = {a: [] for a in ARMS}
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mlx-fill-predict-") as tmp:
        for r in range(repeats):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                trace = Path(tmp) / f"{arm}-{r}.jsonl"
                t0 = time.perf_counter()
                session = session_for(arm, model=model, tok=tok, ids=ids, messages=messages,
                                      prediction=prediction, trace=trace)
                out = decode(model, tok, ids[-1:], cache, session, max_tokens)
                times[arm].append(time.perf_counter() - t0)
                end_session(session)
                trim_prompt_cache(cache, cache[0].offset - base)
                row = {"tokens": len(out), "ids": out}
                if session is not None:
                    stats = session.stats
                    usage = usage_extra(session, prediction=predicted)["completion_tokens_details"]
                    row.update(forwards=stats.forwards, **usage,
                               trace_accepted=trace_accepted(trace, ORIGIN))
                else:
                    row["forwards"] = len(out)
                rows[arm] = row
    off = rows["off"]["ids"]
    text = tok.decode(off)
    expected = task.expected()
    result = {"task": task.name, "file": task.path, "prompt_tokens": len(ids),
              "predicted_tokens": len(predicted), "output_tokens": len(off),
              "edit_correct": (edit_made(text, expected)
                               if expected is not None and len(off) < max_tokens else None),
              "coverage": round(coverage(off, predicted), 3),
              "prefill_s": round(prefill_s, 2), "arms": {}}
    result["bound"] = round(bound_for(result["coverage"], rate), 2)
    if plan_rate is not None:
        result["bound_plan"] = round(bound_for(result["coverage"], plan_rate), 2)
    off_s = statistics.median(times["off"])
    for arm in ARMS:
        row, seconds = rows[arm], statistics.median(times[arm])
        entry = {"decode_s": round(seconds, 2), "decode_x_plain": round(off_s / seconds, 2),
                 "request_x_plain": round((prefill_s + off_s) / (prefill_s + seconds), 2),
                 "identical": row["ids"] == off,
                 "forwards_per_token": round(row["forwards"] / max(len(row["ids"]), 1), 3)}
        if arm != "off":
            entry.update({k: row[k] for k in ("accepted_prediction_tokens",
                                              "rejected_prediction_tokens", "trace_accepted")})
            entry["of_bound"] = round(entry["decode_x_plain"] / result["bound"], 2)
        result["arms"][arm] = entry
    return result


def print_table(results: list[dict]) -> None:
    head = (f"{'task':<20}{'out':>5}{'cover':>7}{'edit ok':>8}  {'arm':<15}{'decode x':>9}{'request x':>10}"
            f"{'fwd/tok':>8}{'acc/rej':>11}{'bound':>7}{'of bound':>9}{'ident':>7}")
    print(head)
    for res in results:
        for arm, e in res["arms"].items():
            acc = (f"{e['accepted_prediction_tokens']}/{e['rejected_prediction_tokens']}"
                   if "accepted_prediction_tokens" in e else "-")
            print(f"{res['task']:<20}{res['output_tokens']:>5}{res['coverage']:>7.2f}"
                  f"{str(res['edit_correct']):>8}  {arm:<15}{e['decode_x_plain']:>9.2f}"
                  f"{e['request_x_plain']:>10.2f}{e['forwards_per_token']:>8.3f}{acc:>11}"
                  f"{res['bound']:>7.2f}{e.get('of_bound', float('nan')):>9.2f}{str(e['identical']):>7}")


def run(model_ref: str, tasks: list[EditTask], repeats: int, dtype: str | None,
        max_tokens: int) -> dict:
    """Every task on the model at ``model_ref`` (a fixture name, a model directory or a Hugging
    Face repo id); the report. :class:`UserError` when mlx-lm cannot load it or it has no chat
    template."""
    from mlx_fill.assets.fixtures import fixture_path
    from mlx_fill.core.model_folder import load_model_folder, require_chat_template
    from mlx_fill.core.resolve import plan_for
    from mlx_fill.session import env_max_span

    known = model_ref in (*FIXTURES, *REAL_FIXTURES)
    folder = str(fixture_path(model_ref)) if known else model_ref
    model, tok = load_model_folder(folder)
    require_chat_template(folder, tok)
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    plan = plan_for(model)
    curve = plan
    if plan.max_chunk > 1:
        from mlx_fill.core.qualify import ImplausibleCost
        try:
            curve = measured_curve(model, plan)
        except ImplausibleCost as e:
            print(f"the bound keeps the plan's cost curve: {e}", file=sys.stderr, flush=True)
    rate, plan_rate = (best_round_rate(p, env_max_span()) for p in (curve, plan))
    results = []
    for task in tasks:
        results.append(run_task(task, model=model, tok=tok, repeats=repeats,
                                max_tokens=max_tokens, rate=rate, plan_rate=plan_rate))
        print(f"done {task.name}: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    return {"model": model_ref, "dtype": dtype, "repeats": repeats,
            "machine": f"{platform.machine()} {platform.system()}, mlx {mx.__version__}",
            "plan": {"max_chunk": plan.max_chunk, "cost": plan.cost,
                     "round_overhead": plan.round_overhead,
                     "best_round_rate": round(plan_rate, 2)},
            "measured_cost": {"cost": curve.cost, "best_round_rate": round(rate, 2)},
            "date": time.strftime("%Y-%m-%d %H:%M"), "tasks": results}


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m scripts.bench.predict", description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--fixture", default="qwen25-coder-0.5b", choices=(*FIXTURES, *REAL_FIXTURES))
    which.add_argument("--model", type=model_ref, default=None,
                       help="an mlx-lm model directory or Hugging Face repo id instead of a fixture")
    ap.add_argument("--edits", type=existing_file, default=None,
                    help="a JSONL file of your own edit tasks (the module docstring's format) "
                         "instead of the built-in ones")
    ap.add_argument("--tasks", type=lambda v: [n.strip() for n in v.split(",") if n.strip()],
                    default=None,
                    help=f"comma-separated task names (default: every task of --edits, else "
                         f"{','.join(DEFAULT_TASKS)}; built in: {', '.join(t.name for t in TASKS)})")
    ap.add_argument("--repeats", type=positive_int, default=1)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--max-tokens", type=positive_int, default=1024)
    ap.add_argument("--json", type=output_file, default=None)

    def fail(msg: str) -> int:
        print(f"predict: {msg}", file=sys.stderr)
        return 2

    try:
        args = ap.parse_args(argv)
        check_env()  # the arms read the MLX_FILL_* knobs a server reads
        known = load_edits(args.edits) if args.edits is not None else TASKS
    except UserError as e:
        return fail(str(e))
    by_name = {t.name: t for t in known}
    names = args.tasks if args.tasks is not None else (
        list(by_name) if args.edits is not None else DEFAULT_TASKS)
    if not names:
        return fail(f"--tasks names no task; choose from {','.join(by_name)}")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        return fail(f"--tasks: unknown tasks {unknown}; choose from {','.join(by_name)}")
    if len(set(names)) != len(names):
        return fail(f"--tasks names {sorted({n for n in names if names.count(n) > 1})} more "
                    f"than once; name each task once")
    try:
        report = run(args.model or args.fixture, [by_name[n] for n in names], args.repeats,
                     args.dtype, args.max_tokens)
    except UserError as e:
        return fail(str(e))
    print(f"plan: {report['plan']}")
    print(f"cost curve measured in this run (the bound's): {report['measured_cost']}")
    print_table(report["tasks"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    bad = [(t["task"], a) for t in report["tasks"] for a, e in t["arms"].items() if not e["identical"]]
    if bad:
        print(f"\nMISMATCHES (ids): {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
