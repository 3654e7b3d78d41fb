"""Fuzz of both servers with bad requests (not a test; bounded; loopback only).

Starts ``mlx-fill serve`` and ``MLX_FILL=strict mlx_lm.server`` (and, with ``--servers``, a
stock ``mlx_lm.server`` for comparison) on 127.0.0.1 with the embedded fixture model, sends each
the same cases, and prints one table per server:

    class        cases  2xx  4xx shaped  4xx unshaped  5xx  no response  hangs  crashes

Classes: ``malformed`` bodies, ``types`` (a wrong type or value in every field, with and without
tools), ``huge`` (huge and deep values), ``schemas`` (invalid tool schemas), ``unicode``
(surrogates, invalid UTF-8, odd code points in every text field), ``cut`` (streams the client
closes early), ``concurrent`` (valid tool requests at once). "Shaped": the OpenAI error object
for ``mlx-fill serve``, mlx-lm's ``{"error": str}`` for ``mlx_lm.server``. "No response": the
connection closed without one. "Hang": no answer within ``--timeout``. "Crash": after the case
the process is gone or ``/health`` is not 200 (the server is restarted and the run goes on).

For ``mlx_lm.server`` rows are split by whether the project handles the request: the hook marks
it (``tools``, ``tool_choice`` or ``prediction``) or refuses it (:mod:`mlx_fill.adapters.stock_guard`);
everything else is stock mlx-lm, listed apart with the cases that were not 2xx/4xx.

    python -m scripts.fuzz [--model qwen3-json] [--servers serve,hook] [--classes ...]
        [--limit N] [--timeout 60] [--budget-s 1500] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
BASE = {"messages": USER, "max_tokens": 4, "temperature": 0}
OUTCOMES = ("2xx", "4xx shaped", "4xx unshaped", "5xx", "no response", "hangs", "crashes")
SERVERS = ("serve", "hook", "stock")
CLASSES = ("malformed", "types", "completions", "schemas", "unicode", "cut", "concurrent", "huge")
FIELDS = ("messages", "model", "tools", "tool_choice", "stop", "max_tokens",
          "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
          "stream_options", "n", "logprobs", "top_logprobs", "prediction", "response_format",
          "chat_template_kwargs", "chat_template", "logit_bias", "repetition_penalty",
          "repetition_context_size", "presence_penalty", "presence_context_size",
          "frequency_penalty", "frequency_context_size", "xtc_probability", "xtc_threshold",
          "num_draft_tokens", "adapters", "role_mapping", "user")
BAD_VALUES = ("null", "true", "-1", "0", "1.5", '"x"', "[]", "{}", "[1, 2]", '{"a": 1}',
              str(2 ** 64), str(2 ** 63), "NaN", '"\\ud800"', '[null]', "1e999")


@dataclass
class Case:
    cls: str
    name: str
    raw: bytes = b""
    kind: str = "post"  # post | cut | concurrent | completions (a /v1/completions body)


def _body(extra: dict | None = None, raw_fields: str = "", tools: bool = False) -> bytes:
    body = dict(BASE, **(extra or {}))
    if tools:
        body["tools"] = TOOLS
    text = json.dumps(body)
    return (text[:-1] + ", " + raw_fields + "}" if raw_fields else text).encode()


def _field(name: str, value: str, tools: bool) -> bytes:
    body = dict(BASE)
    body.pop(name, None)
    if tools and name != "tools":
        body["tools"] = TOOLS
    if name == "messages":
        return ('{"max_tokens": 4' + (f', "tools": {json.dumps(TOOLS)}' if tools else "")
                + f', "messages": {value}}}').encode()
    return (json.dumps(body)[:-1] + f', "{name}": {value}}}').encode()


def cases(classes: tuple[str, ...]) -> list[Case]:
    out: list[Case] = []
    if "malformed" in classes:
        valid = _body()
        for name, raw in [
                ("empty", b""), ("open brace", b"{"), ("null", b"null"), ("array", b"[]"),
                ("string", b'"x"'), ("number", b"1"), ("truncated", valid[:len(valid) // 2]),
                ("trailing garbage", valid + b"}}"), ("binary", bytes(range(256))),
                ("invalid utf-8", valid.replace(b"hi", b"\xff\xfe")),
                ("overlong utf-8", valid.replace(b"hi", b"\xc0\xaf")),
                ("utf-16", json.dumps(BASE).encode("utf-16")),
                ("bom", b"\xef\xbb\xbf" + valid), ("no messages", b'{"max_tokens": 4}'),
                ("5000-digit int", _body(raw_fields='"seed": ' + "9" * 5000)),
                ("5000-digit int, tools", _body(raw_fields='"seed": ' + "9" * 5000, tools=True)),
                ("NaN", _body(raw_fields='"temperature": NaN')),
                ("duplicate keys", valid[:-1] + b', "messages": 5}'),
                ("unterminated escaped quotes", b'{"messages": "' + b'\\"' * 100000),
                ("deep brackets 10000", b"[" * 10000 + b"]" * 10000),
                ("comment", b"// x\n" + valid)]:
            out.append(Case("malformed", name, raw))
    if "types" in classes:
        for tools in (False, True):
            for name in FIELDS:
                if tools and name in ("tools",):
                    continue
                for value in BAD_VALUES:
                    out.append(Case("types", f"{name}={value}" + (" +tools" if tools else ""),
                                    _field(name, value, tools)))
    if "completions" in classes:
        for tools in (False, True):
            extra = f', "tools": {json.dumps(TOOLS)}' if tools else ""
            for value in (*BAD_VALUES, '["hi", "there"]', '["hi"]', '[["hi"]]', '["hi", 1]', '""'):
                out.append(Case("completions", f"prompt={value}" + (" +tools" if tools else ""),
                                f'{{"max_tokens": 4{extra}, "prompt": {value}}}'.encode(),
                                kind="completions"))
    if "huge" in classes:
        deep = "[" * 10000 + "]" * 10000
        out += [
            Case("huge", "10000-deep messages", _field("messages", deep, False)),
            Case("huge", "10000-deep metadata +tools", _body(raw_fields=f'"metadata": {deep}', tools=True)),
            Case("huge", "600-deep schema +tools", _body(raw_fields='"tools": [{"type": "function", "function": {"name": "f", "parameters": '
                 + '{"type": "object", "properties": {"x": ' * 600 + "{}" + "}}" * 600 + "}}]")),
            Case("long prompt", "5000 tools", _body({"tools": [
                {"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}}
                for i in range(5000)]})),
            Case("long prompt", "20000-property schema", _body({"tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {
                    f"p{i}": {"type": "string"} for i in range(20000)}}}}]})),
            Case("huge", "8 KiB tool description", _body({"tools": [{"type": "function", "function": {
                "name": "f", "description": "word " * ((8 << 10) // 5), "parameters": {"type": "object"}}}]})),
            Case("huge", "4 MiB escaped quotes", b'{"messages": "' + b'\\"' * (2 << 20)),
            Case("huge", "5 MiB body", _body({"user": "x" * (5 << 20)})),
            Case("huge", "400 stop words +tools", _body({"stop": [f"s{i}" for i in range(400)]}, tools=True)),
            Case("huge", "10000 logit_bias ids", _body({"logit_bias": {str(i): 0.0 for i in range(10000)}})),
            Case("huge", "100 messages +tools", _body({"messages": USER * 100, "max_tokens": 2}, tools=True)),
            Case("huge", "50000-enum schema", _body({"tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {"a": {
                    "enum": [i if i % 2 else str(i) for i in range(50000)]}}}}}]})),
            Case("huge", "max_tokens 10**30 +tools", _body({"max_tokens": 10 ** 30}, tools=True)),
        ]
    if "schemas" in classes:
        for name, params in [
                ("type nonsense", {"type": "nonsense"}), ("properties int", {"properties": 5}),
                ("remote $ref", {"$ref": "http://127.0.0.1:9/x.json"}),
                ("dangling $ref", {"$ref": "#/nope"}), ("recursive $ref", {"properties": {"c": {"$ref": "#"}}}),
                ("$ref loop", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
                ("bad pattern", {"type": "string", "pattern": "("}),
                ("redos pattern", {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}),
                ("empty enum", {"enum": []}), ("duplicate required", {"required": ["x", "x"]}),
                ("type list with int", {"type": ["string", 5]}), ("minimum string", {"minimum": "a"}),
                ("items list", {"type": "array", "items": [1]}), ("schema list", [1, 2]),
                ("schema string", "x"), ("additionalProperties string", {"additionalProperties": "x"}),
                ("empty anyOf", {"anyOf": []}), ("const object", {"const": {"a": [1]}}),
                ("unknown $schema", {"$schema": "http://127.0.0.1:9/s"}),
                ("draft-04 mixed enum", {"$schema": "http://json-schema.org/draft-04/schema#",
                                         "enum": [1, "1", 2, "2"] * 50}),
                ("required not list", {"required": "x"}), ("true schema", True), ("false schema", False)]:
            for choice in (None, {"type": "function", "function": {"name": "f"}}):
                extra = {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
                if choice:
                    extra["tool_choice"] = choice
                out.append(Case("schemas", name + (" +tool_choice" if choice else ""), _body(extra)))
        for name, tools in [("tool without function", [{"type": "function"}]),
                            ("tool name int", [{"type": "function", "function": {"name": 5}}]),
                            ("tool not object", [5]), ("tools object", {"a": 1}),
                            ("duplicate tool names", TOOLS * 2)]:
            out.append(Case("schemas", name, _body(raw_fields=f'"tools": {json.dumps(tools)}')))
    if "unicode" in classes:
        texts = {"lone high surrogate": '"\\ud800"', "lone low surrogate": '"\\udfff"',
                 "reversed pair": '"\\udc00\\ud800"', "valid pair": '"\\ud83d\\ude00"',
                 "NUL": '"a\\u0000b"', "U+FFFF": '"\\uffff"', "BOM": '"\\ufeff"',
                 "RTL override": '"\\u202e abc"', "1000 combining marks": '"a' + "\\u0301" * 1000 + '"'}
        spots = {
            "content": lambda t: f'"messages": [{{"role": "user", "content": {t}}}]',
            "role": lambda t: f'"messages": [{{"role": {t}, "content": "hi"}}]',
            "model": lambda t: f'"model": {t}', "stop": lambda t: f'"stop": [{t}]',
            "tool name": lambda t: f'"tools": [{{"type": "function", "function": {{"name": {t}}}}}]',
            "schema key": lambda t: f'"tools": [{{"type": "function", "function": {{"name": "f", '
                                    f'"parameters": {{"type": "object", "properties": {{{t}: {{}}}}}}}}}}]',
            "prediction": lambda t: f'"prediction": {{"type": "content", "content": {t}}}',
            "template kwarg key": lambda t: f'"chat_template_kwargs": {{{t}: 1}}',
            "tool call arguments": lambda t: '"messages": [{"role": "user", "content": "hi"}, '
                '{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", '
                f'"arguments": {t}}}}}]}}, {{"role": "user", "content": "go"}}]',
        }
        for text_name, text in texts.items():
            for spot, make in spots.items():
                fields = make(text)
                body = dict(BASE)
                for key in ("messages",):
                    if f'"{key}":' in fields:
                        body.pop(key)
                raw = (json.dumps(body)[:-1] + ", " + fields + "}").encode()
                out.append(Case("unicode", f"{text_name} in {spot}", raw))
    if "cut" in classes:
        for i, tools in enumerate((False, True, False, True, False, True)):
            out.append(Case("cut", f"stream cut #{i}" + (" +tools" if tools else ""),
                            _body({"stream": True, "max_tokens": 64}, tools=tools), kind="cut"))
    if "concurrent" in classes:
        for i in range(2):
            out.append(Case("concurrent", f"8 tool requests #{i}", _body({"max_tokens": 16}, tools=True),
                            kind="concurrent"))
    order = (*CLASSES, "long prompt")  # the slowest last
    return sorted(out, key=lambda c: order.index(c.cls))


# --- servers ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# The folders fill reads and writes: a server started here uses the caller's. Every other
# MLX_FILL_* knob is left at its default there (``env`` sets what a server is to run with).
CACHE_VARIABLES = ("MLX_FILL_CACHE", "MLX_FILL_ASSETS")


class Server:
    """One server process on 127.0.0.1, restartable."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path):
        self.name, self.argv, self.env, self.log_dir = name, argv, env, log_dir
        self.proc: subprocess.Popen | None = None
        self.base = ""
        self.restarts = 0

    def start(self, timeout: float = 300) -> None:
        port = free_port()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MLX_FILL") or k in CACHE_VARIABLES}
        env.update(self.env, HF_HUB_OFFLINE="1")  # a request's "model" never reaches the network
        log = open(self.log_dir / f"{self.name}-{self.restarts}.log", "wb")
        self.proc = subprocess.Popen([*self.argv, "--host", HOST, "--port", str(port)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://{HOST}:{port}"
        deadline = time.monotonic() + timeout
        while not self.healthy(2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{self.name} did not start; see {log.name}")
            time.sleep(0.5)
        post(self, _body(), 300)  # the model is loaded before the first case

    def healthy(self, timeout: float = 15) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return httpx.get(self.base + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def post(server: Server, raw: bytes, timeout: float, route: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.base + route, content=raw, timeout=timeout,
                      headers={"content-type": "application/json"})


def shaped(server: Server, r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if server.name == "serve":
        return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
                and isinstance(err["message"], str) and bool(err["message"]))
    return isinstance(err, str) and bool(err)


def classify(server: Server, r: httpx.Response) -> str:
    if r.status_code >= 500:
        return "5xx"
    if r.status_code >= 400:
        return "4xx shaped" if shaped(server, r) else "4xx unshaped"
    if r.headers.get("content-type", "").startswith("text/event-stream") and '"error"' in r.text:
        return "5xx"  # an error inside a 200 stream
    return "2xx"


def run_case(server: Server, case: Case, timeout: float) -> str:
    try:
        if case.kind == "cut":
            with httpx.stream("POST", server.base + "/v1/chat/completions", content=case.raw,
                              timeout=timeout, headers={"content-type": "application/json"}) as r:
                for _ in r.iter_bytes():
                    break  # the client goes away after its first bytes
            outcome = "2xx" if r.status_code < 300 else classify(server, r)
        elif case.kind == "concurrent":
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda _: post(server, case.raw, timeout), range(8)))
            worst = [classify(server, a) for a in answers]
            outcome = next((o for o in worst if o != "2xx"), "2xx")
        elif case.kind == "completions":
            outcome = classify(server, post(server, case.raw, timeout, "/v1/completions"))
        else:
            outcome = classify(server, post(server, case.raw, timeout))
    except httpx.TimeoutException:
        server.restart()  # the server is still at work on it: later cases must not queue behind
        return "hangs"
    except httpx.HTTPError:
        outcome = "no response"
    if not server.healthy():
        server.restart()
        return "crashes"
    return outcome


def handled(server: Server, case: Case) -> bool:
    """Whether the project handles the request: always for ``mlx-fill serve``; for
    ``mlx_lm.server`` under the hook, when the hook marks it for fill or refuses it."""
    if server.name == "serve":
        return True
    if server.name == "stock":
        return False
    from mlx_fill.adapters.server_patch import wants_fill
    from mlx_fill.adapters.stock_guard import refusal
    try:
        body = json.loads(case.raw)
    except (ValueError, RecursionError):
        return False
    if not isinstance(body, dict):
        return False
    prompt = body.get("prompt") if case.kind == "completions" else None
    return wants_fill(body) or refusal(body, VOCAB[0], temperature=body.get("temperature", 0.0),
                                       text_prompt=prompt) is not None  # the servers' --temp 0


VOCAB = [None]


def table(rows: dict[str, Counter]) -> str:
    head = f"{'class':<22}{'cases':>7}" + "".join(f"{o:>14}" for o in OUTCOMES)
    lines = [head, "-" * len(head)]
    total = Counter()
    for cls, counts in rows.items():
        total.update(counts)
        lines.append(f"{cls:<22}{sum(counts.values()):>7}" + "".join(f"{counts[o]:>14}" for o in OUTCOMES))
    lines.append(f"{'all':<22}{sum(total.values()):>7}" + "".join(f"{total[o]:>14}" for o in OUTCOMES))
    return "\n".join(lines)


def names_arg(known: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    """argparse ``type=``: a non-empty comma-separated list of names from ``known``."""
    def parse(value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not names or any(n not in known for n in names):
            raise argparse.ArgumentTypeError(f"{value!r}: name {what} of {','.join(known)}")
        return names
    return parse


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str]:
    """The arguments and the model folder; a mistake is a :class:`UserError` naming the
    argument, raised before any server starts."""
    from mlx_fill.assets.fixtures import FIXTURES, REAL_FIXTURES, fixture_path
    from mlx_fill.cli import _Parser
    from mlx_fill.core.errors import UserError, float_in, model_dir, non_negative_int, output_file

    ap = _Parser(prog="python -m scripts.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-json", help="fixture name or model directory")
    ap.add_argument("--servers", type=names_arg(SERVERS, "servers"), default="serve,hook",
                    help=f"of {','.join(SERVERS)}")
    ap.add_argument("--classes", type=names_arg(CLASSES, "classes"), default=",".join(CLASSES))
    ap.add_argument("--limit", type=non_negative_int, default=0, help="at most N cases per class (0: all)")
    ap.add_argument("--timeout", type=float_in(0.0, low_open=True), default=60,
                    help="seconds before a request is a hang")
    ap.add_argument("--budget-s", type=float_in(0.0, low_open=True), default=1500,
                    help="stop starting cases after this")
    ap.add_argument("--json", type=output_file, default=None, help="write every outcome here")
    args = ap.parse_args(argv)
    fixtures = (*FIXTURES, *REAL_FIXTURES)
    here = Path(args.model).exists()  # a folder of a fixture's name wins over the fixture
    try:
        if args.model in fixtures and not here:
            return args, str(fixture_path(args.model))
        if not here and "/" not in args.model:
            raise argparse.ArgumentTypeError(f"{args.model!r} is neither a fixture "
                                             f"({', '.join(fixtures)}) nor a folder; pass one "
                                             f"of those")
        return args, str(model_dir(args.model))
    except (argparse.ArgumentTypeError, UserError) as e:
        ap.error(f"argument --model: {e}")


def main(argv: list[str] | None = None) -> int:
    from mlx_fill.core.errors import UserError
    try:
        args, model = _parse_args(argv)
    except UserError as e:
        print(f"fuzz: {e}", file=sys.stderr)
        return 2
    VOCAB[0] = json.loads((Path(model) / "config.json").read_text()).get("vocab_size")
    all_cases = cases(tuple(args.classes))
    if args.limit:
        per: dict[str, int] = Counter()
        all_cases = [c for c in all_cases if (per.update([c.cls]) or per[c.cls] <= args.limit)]
    log_dir = Path(tempfile.mkdtemp(prefix="mlx-fill-fuzz-"))
    specs = {"serve": ([str(BIN / "mlx-fill"), "serve", "--model", model, "--max-tokens", "4"], {}),
             "hook": ([str(BIN / "mlx_lm.server"), "--model", model, "--max-tokens", "4"],
                      {"MLX_FILL": "strict"}),
             "stock": ([str(BIN / "mlx_lm.server"), "--model", model, "--max-tokens", "4"], {})}
    start = time.monotonic()
    report: dict = {"model": model, "servers": {}}
    for name in args.servers:
        server = Server(name, *specs[name], log_dir)
        rows: dict[str, dict[str, Counter]] = {"handled": defaultdict(Counter),
                                               "stock mlx-lm": defaultdict(Counter)}
        outcomes = []
        try:
            server.start()
            for case in all_cases:
                if time.monotonic() - start > args.budget_s:
                    print(f"[{name}] budget spent: stopped before {case.cls}/{case.name}", file=sys.stderr)
                    break
                outcome = run_case(server, case, args.timeout)
                who = "handled" if handled(server, case) else "stock mlx-lm"
                rows[who][case.cls][outcome] += 1
                outcomes.append({"class": case.cls, "case": case.name, "outcome": outcome, "who": who})
                if len(outcomes) % 100 == 0:
                    print(f"[{name}] {len(outcomes)}/{len(all_cases)} cases", file=sys.stderr, flush=True)
        finally:
            server.stop()
        report["servers"][name] = {"outcomes": outcomes, "restarts": server.restarts}
        for who, by_class in rows.items():
            if not by_class:
                continue
            title = {"serve": "mlx-fill serve", "hook": "MLX_FILL=strict mlx_lm.server",
                     "stock": "mlx_lm.server (no MLX_FILL)"}[name]
            print(f"\n## {title}: {who if name == 'hook' else 'all requests'}\n")
            print(table(dict(by_class)))
        odd = [o for o in outcomes if o["outcome"] not in ("2xx", "4xx shaped")]
        if odd:
            print(f"\n{name}: cases neither 2xx nor a shaped 4xx:")
            for o in odd:
                print(f"  [{o['who']}] {o['class']}/{o['case']}: {o['outcome']}")
        print(f"\n{name}: {len(outcomes)} cases, {server.restarts} restarts, logs in {log_dir}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
