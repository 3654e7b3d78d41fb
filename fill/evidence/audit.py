"""``mlx-fill audit``: compile strict rows for a family's template and audit them on a corpus.

Each corpus case is one assistant turn. Its ids are the model's own: the case's assistant
message is rendered through the real template after the case's conversation (``reply``), or,
for streams a template cannot express, its text is tokenized whole (``raw_reply``). The stream
is cut after its first EOS id, then teacher-forced through a fresh :class:`StrictSource`
exactly as the decode loop drives it (``propose`` at each position through a ``FillSession``,
which cuts spans at EOS and at ``max_span``; an applied span is appended whole). Per case:

* fires, injected ids;
* containment failures: a proposed span that is not the ids the real stream has at that point;
* false fires: any fire in a case marked ``"expect": "none"``, or a fire starting inside one
  of the case's ``no_fill_in`` substrings of the reply text;
* missed: a case marked ``"expect": "fill"`` where nothing fired.

Every row and every fire carries its certainty class (``determined`` / ``likely``, see
:func:`mlx_fill.strict.rows.certainty`). Exit status 1 on any containment failure or false fire of a
``determined`` row, any miss, or any row or fire without a valid class; 0 otherwise. A
``likely`` row's containment failures and false fires are reported but do not fail the audit:
such a row is only ever verified, so a wrong proposal costs a check, never a token.

Case file (``<corpus>/<family>/*.json``)::

    {"id": "...", "family": "qwen3.5", "description": "...",
     "tools": "default.json",                # optional, under <corpus>/tools/; else --tools
     "messages": [...], "template_kwargs": {...},
     "reply": {"role": "assistant", ...}     # or "raw_reply": "text"
     "expect": "fill" | "none", "no_fill_in": ["..."]}
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jinja2

from mlx_fill.assets import checkout
from mlx_fill.assets.store import FAMILIES, load_tokenizer
from mlx_fill.core.errors import UserError, existing_file, output_file
from mlx_fill.core.proposal import DecodeView, FillSession
from mlx_fill.strict.rows import CERTAINTIES, compile_all_keys, table_for
from mlx_fill.strict.schema import tool_schemas
from mlx_fill.strict.source import strict_source
from mlx_fill.strict.tokenbytes import ids_bytes, token_bytes
from .replay import encodable

DEFAULT_CORPUS = checkout.AUDIT
# what a certainty class's containment failure or false fire means, as the summary says it
SUMMARY_RULES = {
    "determined": "any failure here fails the audit (a determined row may be asserted, "
                  "written into the cache unchecked)",
    "likely": "allowed: a likely row is only ever verified, so a wrong proposal costs the "
              "extra rows of the forward that checks it (rewound), never an emitted token",
}


@dataclass
class Fire:
    position: int
    origin: str
    ids: list[int]
    contained: bool
    false_fire: bool
    certainty: str | None

    @property
    def determined(self) -> bool:
        return self.certainty == "determined"

    @property
    def classed(self) -> bool:
        return self.certainty in CERTAINTIES


@dataclass
class CaseResult:
    id: str
    family: str
    expect: str
    tokens: int
    fires: list[Fire] = field(default_factory=list)
    compiled: bool = True

    @property
    def injected(self) -> int:
        return sum(len(f.ids) for f in self.fires if f.contained)

    @property
    def containment_failures(self) -> int:
        return sum(not f.contained for f in self.fires)

    @property
    def false_fires(self) -> int:
        return sum(f.false_fire for f in self.fires)

    @property
    def missed(self) -> bool:
        return self.expect == "fill" and not any(f.contained for f in self.fires)

    @property
    def determined_failures(self) -> int:
        """Fires of ``determined`` rows that were not contained or fired where they must not."""
        return sum(f.determined and (not f.contained or f.false_fire) for f in self.fires)

    @property
    def unclassed(self) -> int:
        return sum(not f.classed for f in self.fires)

    @property
    def ok(self) -> bool:
        return not (self.determined_failures or self.unclassed or self.missed)


def _render(tok, messages, tools, kwargs, generation: bool, case_id: str = "") -> str:
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=generation, **kwargs)
    except (jinja2.TemplateError, ValueError) as err:
        raise UserError(f"case {case_id}: the chat template refuses the conversation with its "
                        f"tools ({err}); fix the case's messages or reply, or the tools (a "
                        f"field the template reads)") from err
    except RecursionError:
        raise UserError(f"case {case_id}: the conversation is nested too deeply to render; "
                        f"fix the case") from None


def case_stream(tok, case: dict, tools) -> tuple[list[int], list[int], str]:
    """(prompt ids, reply ids cut after the first EOS, reply text) for one case."""
    kwargs = case.get("template_kwargs", {})
    messages = case["messages"]
    primer = _render(tok, messages, tools, kwargs, True, case["id"])
    if "raw_reply" in case:
        text = case["raw_reply"]
    else:
        full = _render(tok, [*messages, case["reply"]], tools, kwargs, False, case["id"])
        if not full.startswith(primer):
            raise UserError(f"case {case['id']}: the rendered reply does not extend the prompt; "
                            f"fix its messages or reply")
        text = full[len(primer):]
    ids = tok.encode(text, add_special_tokens=False)
    eos = set(tok.eos_token_ids)
    for i, t in enumerate(ids):
        if t in eos:
            ids = ids[: i + 1]
            break
    prompt = tok.encode(primer, add_special_tokens=False)
    return prompt, ids, text


def _regions(text: str, needles: list[str]) -> list[tuple[int, int]]:
    out = []
    for needle in needles:
        start = text.find(needle)
        if start < 0:
            raise UserError(f"no_fill_in entry {needle!r} is not in the reply text; fix the case")
        while start >= 0:
            out.append((start, start + len(needle)))
            start = text.find(needle, start + 1)
    return out


def audit_case(tok, case: dict, tools) -> CaseResult:
    """Teacher-force one case through a fresh StrictSource."""
    prompt, ids, text = case_stream(tok, case, tools)
    expect = case.get("expect", "fill")
    result = CaseResult(case["id"], case["family"], expect, len(ids))
    source = strict_source(tok, case["messages"], tools, case.get("template_kwargs"))
    if source is None:
        result.compiled = False
        return result
    session = FillSession([source])
    table = token_bytes(tok)
    regions = _regions(text, case.get("no_fill_in", []))
    eos = frozenset(tok.eos_token_ids)
    pos = 0
    while pos < len(ids):
        view = DecodeView(prompt, ids[:pos], eos)
        p = session.propose(view)
        if p is None:
            pos += 1
            continue
        span = list(p.ids)
        contained = ids[pos: pos + len(span)] == span
        at = len(ids_bytes(table, ids[:pos]).decode("utf-8", "replace"))
        false_fire = expect == "none" or any(a <= at < b for a, b in regions)
        result.fires.append(Fire(pos, p.origin, span, contained, false_fire, p.certainty))
        session.feedback(p, len(span) if contained else 0, pos)
        pos += len(span) if contained else 1
    return result


def read_json(path: Path, fix: str):
    """The JSON in ``path``; a missing or unparsable file is a ``UserError`` ending in ``fix``."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise UserError(f"{path} does not exist; {fix}") from err
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror or err}); {fix}") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}); {fix}") from err


def _reply_problem(reply: object) -> str | None:
    """What keeps ``reply`` from being an assistant message the templates can render, or None:
    its ``content`` must be a string or null, its ``tool_calls`` (when present) a list of
    objects each with a ``function`` object holding a string ``name`` and an object or string
    ``arguments``."""
    if not isinstance(reply, dict):
        return "its 'reply' is not a message object"
    content = reply.get("content")
    if content is not None and not isinstance(content, str):
        return f"its 'reply.content' is a JSON {type(content).__name__}, not a string or null"
    calls = reply.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"its 'reply.tool_calls' is a JSON {type(calls).__name__}, not a list"
    for i, call in enumerate(calls):
        where = f"reply.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return f"its '{where}' is not an object with a 'function' object"
        if not isinstance(function.get("name"), str):
            return f"its '{where}.function.name' is not a string"
        if not isinstance(function.get("arguments"), (dict, str)):
            return f"its '{where}.function.arguments' is not an object or a string"
    return None


def _case_problem(case: object) -> str | None:
    """What keeps ``case`` from being an audit case, or None."""
    if not isinstance(case, dict):
        return f"it is a JSON {type(case).__name__}, not an object"
    missing = [key for key in ("id", "family") if key not in case]
    if missing:
        return f"it has no {missing[0]!r}"
    messages = case.get("messages")
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        return "its 'messages' is not a non-empty list of message objects, each with a 'role'"
    if case.get("expect", "fill") not in ("fill", "none"):
        return f"its 'expect' is {case['expect']!r}, not 'fill' or 'none'"
    if not isinstance(case.get("template_kwargs", {}), dict):
        return "its 'template_kwargs' is not an object"
    no_fill_in = case.get("no_fill_in", [])
    if not (isinstance(no_fill_in, list) and all(isinstance(n, str) and n for n in no_fill_in)):
        return "its 'no_fill_in' is not a list of non-empty strings"
    if not encodable(case):
        return "it holds a lone surrogate escape (\\ud800-\\udfff), which is no text"
    if "raw_reply" in case and "reply" in case:
        return "it has both 'reply' and 'raw_reply'; keep one"
    if "raw_reply" in case:
        return None if isinstance(case["raw_reply"], str) else "its 'raw_reply' is not a string"
    if "reply" in case:
        return _reply_problem(case["reply"])
    return "it has neither 'reply' nor 'raw_reply'"


def load_cases(corpus: Path, family: str) -> list[dict]:
    """The cases of ``family`` under ``corpus``; a case file that is not a JSON object with
    ``id``, ``family``, a list of message objects ``messages`` and a ``reply`` message object
    (its ``content`` and ``tool_calls`` typed as :func:`_reply_problem` says) or a ``raw_reply``
    string is a ``UserError``."""
    folder = corpus / family if (corpus / family).is_dir() else corpus
    cases = []
    for path in sorted(folder.glob("*.json")):
        case = read_json(path, "fix or remove the case file")
        problem = _case_problem(case)
        if problem:
            raise UserError(f"{path} is not an audit case ({problem}; a case is a JSON object with "
                            f"id, family, a messages list and reply or raw_reply); fix or remove it")
        if case["family"] == family:
            cases.append(case)
    return cases


def checked_tools(tools: object, where: str) -> list:
    """``tools`` (read from ``where``), when it is a non-empty OpenAI tools array whose schemas
    compile; otherwise a ``UserError`` naming ``where`` and the offending entry."""
    try:
        schemas = tool_schemas(tools)
    except ValueError as err:
        raise UserError(f"{where} is not a usable OpenAI tools array ({err}); fix it") from err
    if not schemas:
        raise UserError(f"no tools in {where}: an audit needs an OpenAI tools array with at "
                        f"least one tool; fix it")
    return tools


def _tools(corpus: Path, case: dict, default):
    ref = case.get("tools")
    if ref is None:
        return default
    if isinstance(ref, list):
        return checked_tools(ref, f"case {case['id']}'s tools list")
    if not isinstance(ref, str):
        raise UserError(f"case {case['id']}: its 'tools' is neither a file name nor a tools array; "
                        f"fix the case")
    path = corpus / "tools" / ref
    return checked_tools(read_json(path, f"case {case['id']} names tools {ref!r}; add that file "
                                         f"under {corpus / 'tools'}"), str(path))


def print_rows(tok, family: str, tools, out) -> int:
    """Print every compiled row with its certainty class; returns how many rows lack one."""
    messages = [{"role": "user", "content": "audit"}]
    table = table_for(tok, messages, tools)
    if table is None:
        print(f"[{family}] no rows: the template cannot render tool calls", file=out)
        return 0
    compile_all_keys(table, tok, messages, tools)
    rows = table.rows()
    classes = {c: sum(r.certainty == c for r in rows) for c in CERTAINTIES}
    print(f"[{family}] syntax={table.syntax} rows={len(rows)} "
          + " ".join(f"{c}={n}" for c, n in classes.items()), file=out)
    for r in rows:
        where = "" if r in table.head.values() or r in table.close.values() else " (later call)"
        cls = r.certainty if r.certainty in CERTAINTIES else "MISSING-CLASS"
        print(f"  {r.origin:<32} {cls:<10} key={r.key!r} trigger={list(r.trigger)} "
              f"({tok.decode(list(r.trigger))!r}) span={list(r.span)} "
              f"({tok.decode(list(r.span))!r}){where}", file=out)
    return sum(r.certainty not in CERTAINTIES for r in rows)


def audit_family(family: str, tools, cases: list[tuple[dict, list]],
                 out=None) -> tuple[list[CaseResult], int]:
    """(case results, compiled rows without a certainty class) for one family: ``tools``'
    rows, then each of ``cases`` as (case, the tools it is audited with)."""
    out = out or sys.stdout  # looked up per call: the stream may be replaced after import
    tok = load_tokenizer(family)
    unclassed = print_rows(tok, family, tools, out)
    results = []
    for case, case_tools in cases:
        r = audit_case(tok, case, case_tools)
        results.append(r)
        status = "ok" if r.ok else "FAIL"
        fires = {c: sum(f.certainty == c for f in r.fires) for c in CERTAINTIES}
        print(f"  {status:<4} {r.id:<40} expect={r.expect:<4} fires={len(r.fires)} "
              f"({' '.join(f'{c}={n}' for c, n in fires.items())}) "
              f"injected={r.injected}/{r.tokens} containment_failures={r.containment_failures} "
              f"false_fires={r.false_fires}{' MISSED' if r.missed else ''}"
              f"{'' if r.compiled else ' (no rows compiled)'}", file=out)
        for f in r.fires:
            if f.contained and not f.false_fire and f.classed:
                continue
            cls = f.certainty if f.classed else "MISSING-CLASS"
            note = "" if f.determined or not f.classed else " (verified: does not fail)"
            print(f"       at {f.position} {f.origin} [{cls}]: {tok.decode(f.ids)!r}"
                  f"{'' if f.contained else ' NOT CONTAINED'}"
                  f"{' FALSE FIRE' if f.false_fire else ''}{note}", file=out)
    return results, unclassed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", required=True, choices=[*FAMILIES, "all"],
                        help="template family whose corpus cases to audit, or all")
    parser.add_argument("--tools", type=existing_file,
                        help="tools.json (OpenAI tools array); default <corpus>/tools/default.json")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="audit corpus folder: tools/default.json and one FAMILY/ folder of "
                             "JSON cases per family")
    parser.add_argument("--json", type=output_file, help="write the full report here")


def run(args: argparse.Namespace) -> int:
    if not args.corpus.is_dir():
        raise UserError(f"no corpus folder at {args.corpus}; pass --corpus DIR (e.g. fixtures/audit)")
    tools_path = args.tools or args.corpus / "tools" / "default.json"
    tools = checked_tools(read_json(tools_path, "pass --tools FILE (an OpenAI tools array) or add "
                                                "tools/default.json to the corpus"), str(tools_path))
    families = list(FAMILIES) if args.family == "all" else [args.family]
    cases = {family: [(case, _tools(args.corpus, case, tools))
                      for case in load_cases(args.corpus, family)] for family in families}
    if not any(cases.values()):
        raise UserError(f"no audit cases for {args.family} under {args.corpus} (FAMILY/*.json case "
                        f"files whose family matches); pass --corpus DIR (e.g. fixtures/audit)")
    results: list[CaseResult] = []
    unclassed = 0
    for family in families:
        family_results, family_unclassed = audit_family(family, tools, cases[family])
        results += family_results
        unclassed += family_unclassed
    bad = [r for r in results if not r.ok]
    fires = [f for r in results for f in r.fires]
    total_inj = sum(r.injected for r in results)
    total_tok = sum(r.tokens for r in results)
    print(f"cases={len(results)} failed={len(bad)} fires={len(fires)} "
          f"injected={total_inj}/{total_tok} tokens missed={sum(r.missed for r in results)} "
          f"unclassed_rows={unclassed}")
    for c, why in SUMMARY_RULES.items():
        mine = [f for f in fires if f.certainty == c]
        print(f"  {c:<10} fires={len(mine)} containment_failures={sum(not f.contained for f in mine)} "
              f"false_fires={sum(f.false_fire for f in mine)}: {why}")
    if args.json:
        report = [{**asdict(r), "injected": r.injected, "ok": r.ok,
                   "containment_failures": r.containment_failures,
                   "false_fires": r.false_fires, "determined_failures": r.determined_failures,
                   "missed": r.missed} for r in results]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cases": report, "unclassed_rows": unclassed},
                                        indent=1))
    return 1 if bad or unclassed or not results else 0
