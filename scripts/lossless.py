"""Fill on against fill off through both servers, on any model (not a test; loopback only).

For each server path it starts the fill-off server, then each fill-on one, one at a time on
127.0.0.1, sends every one the same valid chat requests at temperature 0 with the real
``openai`` client, and compares what came back:

- ``serve``: ``mlx-fill serve --fill off`` against ``--fill MODE`` for each of ``--modes``
  (``--dtype`` casts the weights there);
- ``hook``: stock ``mlx_lm.server`` against ``MLX_FILL=MODE mlx_lm.server`` (the model's stored
  dtype), the requests one at a time and then in groups sent at once (the batched lane).

The requests: prose, an agent's coding session (the demo's) at its first and second turn,
tools with every ``tool_choice``, a conversation with earlier calls and their results,
Predicted Outputs (exact, a prefix, cut mid-token, unrelated, long, holding special-token
text), ``stop`` strings at several places, small ``max_tokens``, CJK and emoji, copies of the
prompt, the same request twice (the cross-request store), each streamed and whole. Compared
per request: content, tool calls (name and arguments), finish reason, prompt and completion
token counts, an error's status and body; and on the fill-on server that
``usage.fill.emitted`` equals ``completion_tokens``. Prints one row per path and mode (requests,
differing, ids fill injected) and every difference; exits 1 on any.

    python -m scripts.lossless [--model qwen3-json] [--servers serve,hook] [--modes strict,all]
        [--dtype bfloat16] [--limit N] [--timeout 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlx_fill.assets.fixtures import FIXTURES, REAL_FIXTURES, fixture_path
from mlx_fill.cli import _Parser
from mlx_fill.core.errors import UserError, float_in, model_ref, output_file, positive_int
from mlx_fill.evidence.demo import DEFAULT_MESSAGES, DEFAULT_TOOLS, TOOL_RESULT
from mlx_fill.modes import MODES
from scripts.fuzz import BIN, Server, names_arg

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
ON_MODES = tuple(m for m in MODES if m != "off")  # each compared with off
CODE = "def foo(x):\n    return foo_helper(x) + 1\n\n\nprint(foo(2))\n"
EDITED = CODE.replace("foo", "bar")


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


HISTORY = [*_user("What's the weather in Paris?"),
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18, "sky": "cloudy"}'},
           {"role": "assistant", "content": "It is 18 degrees and cloudy in Paris."},
           *_user("And in Tokyo? Also search for umbrellas.")]
AGENT_TURN_2 = [*DEFAULT_MESSAGES,
                {"role": "assistant", "content": "THOUGHT: Find the check first.", "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "grep -rn required_columns ."}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}]
EDIT = _user("Rename foo to bar. Reply with only the code.\n\n" + CODE)
WEATHER_Q = _user("What's the weather in Paris?")


def requests() -> list[tuple[str, dict]]:
    """``(name, request keyword arguments)``, each sent whole and streamed."""
    out: list[tuple[str, dict]] = [
        ("prose", dict(messages=_user("What is the capital of France?"), max_tokens=24)),
        ("agent", dict(messages=DEFAULT_MESSAGES, tools=DEFAULT_TOOLS, max_tokens=64)),
        ("agent, its second turn", dict(messages=AGENT_TURN_2, tools=DEFAULT_TOOLS, max_tokens=64)),
        ("tools", dict(messages=WEATHER_Q, tools=TOOLS, max_tokens=40)),
        ("history", dict(messages=HISTORY, tools=TOOLS, max_tokens=48)),
        ("history, no tools", dict(messages=HISTORY, max_tokens=32)),
        ("copy", dict(messages=_user("Repeat exactly: the cat sat on the mat with a hat."),
                      max_tokens=32)),
        ("cjk", dict(messages=_user("请用中文介绍一下巴黎。🙂 Weather in 東京 🌧️?"), tools=TOOLS,
                     max_tokens=32)),
        ("repeated", dict(messages=_user("Search the web for cheap flights to Lisbon."),
                          tools=TOOLS, max_tokens=48)),
        ("repeated again", dict(messages=_user("Search the web for cheap flights to Lisbon."),
                                tools=TOOLS, max_tokens=48)),
    ]
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "search"}}):
        label = choice if isinstance(choice, str) else "named"
        out.append((f"tool_choice {label}", dict(messages=_user("What's the weather in Berlin?"),
                                                 tools=TOOLS, tool_choice=choice, max_tokens=40)))
    for label, text in (("exact", EDITED), ("prefix", EDITED[:20]), ("mid-token", EDITED[:13]),
                        ("unrelated", "The quick brown fox jumps over the lazy dog. " * 3),
                        ("long", EDITED * 40),
                        ("special text", "<|im_end|>" + EDITED + "<|im_end|><|im_start|>user\nhi")):
        out.append((f"prediction {label}", dict(messages=EDIT, max_tokens=40,
                                                prediction={"type": "content", "content": text})))
    for stop in (["Paris"], ["\n"], ['"}'], ["e"], ["zzz", "a"]):
        out.append((f"stop {stop}", dict(messages=WEATHER_Q, tools=TOOLS, max_tokens=40, stop=stop)))
    for cap in (1, 2, 3, 5, 8, 13):
        out.append((f"max_tokens {cap}", dict(messages=WEATHER_Q, tools=TOOLS, max_tokens=cap)))
    return out


def groups() -> list[list[tuple[str, dict]]]:
    """Requests sent at once (a batch for ``mlx_lm.server``'s batched lane)."""
    by_name = dict(requests())
    return [[(n, by_name[n]) for n in ("agent", "prediction exact", "prose")],
            [(n, by_name[n]) for n in ("history", "cjk", "tool_choice named")]]


def reply(client: Any, request: dict, stream: bool) -> dict:
    """What one request returned: content, tool calls, finish reason and usage, or the error."""
    try:
        if not stream:
            r = client.chat.completions.create(model="default_model", temperature=0, **request)
            choice = r.choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            return {"content": choice.message.content, "tool_calls": calls,
                    "finish": choice.finish_reason, "usage": r.usage.model_dump() if r.usage else None}
        content, calls, finish, usage = "", {}, None, None
        for chunk in client.chat.completions.create(
                model="default_model", temperature=0, stream=True,
                stream_options={"include_usage": True}, **request):
            usage = chunk.usage.model_dump() if chunk.usage is not None else usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    slot = calls.setdefault(call.index, ["", ""])
                    if call.function is not None:
                        slot[0] += call.function.name or ""
                        slot[1] += call.function.arguments or ""
                finish = choice.finish_reason or finish
        return {"content": content or None, "tool_calls": [tuple(calls[i]) for i in sorted(calls)],
                "finish": finish, "usage": usage}
    except Exception as e:  # noqa: BLE001 - an error is an outcome to compare
        body = getattr(e, "body", None)
        return {"error": type(e).__name__, "status": getattr(e, "status_code", None),
                "body": body if isinstance(body, (dict, str, type(None))) else str(body)}


COMPARED = ("content", "tool_calls", "finish", "error", "status", "body")


def differences(off: dict, on: dict) -> list[str]:
    """The fields in which the fill-on reply ``on`` differs from the fill-off reply ``off``, and
    a fill count that disagrees with the completion's."""
    out = [f for f in COMPARED if off.get(f) != on.get(f)]
    usage_off, usage_on = off.get("usage") or {}, on.get("usage") or {}
    out += [f"usage.{f}" for f in ("prompt_tokens", "completion_tokens")
            if usage_off.get(f) != usage_on.get(f)]
    fill = usage_on.get("fill") or {}
    if "emitted" in fill and fill["emitted"] != usage_on.get("completion_tokens"):
        out.append(f"usage.fill.emitted {fill['emitted']} != completion_tokens "
                   f"{usage_on.get('completion_tokens')}")
    return out


def run_server(server: Server, cases: list[tuple[str, dict]], sets: list[list[tuple[str, dict]]],
               timeout: float) -> dict[str, dict]:
    """Every case whole and streamed, then every group at once; replies by label."""
    from openai import OpenAI

    server.start()
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key="none", timeout=timeout, max_retries=0)
        out = {}
        for name, request in cases:
            for stream in (False, True):
                out[f"{name}{' (stream)' if stream else ''}"] = reply(client, request, stream)
        for g, group in enumerate(sets):
            with ThreadPoolExecutor(len(group)) as pool:
                replies = pool.map(lambda c: reply(client, c[1], False), group)
            out.update({f"{name} (at once, group {g + 1})": r for (name, _), r in zip(group, replies)})
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="python -m scripts.lossless", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-json",
                    help="a fixture name, an mlx-lm model directory or a Hugging Face repo id")
    ap.add_argument("--servers", default="serve,hook", help="of serve,hook")
    ap.add_argument("--modes", type=names_arg(ON_MODES, "modes"), default=",".join(ON_MODES),
                    help="fill modes to compare with off")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="cast the weights (mlx-fill serve only)")
    ap.add_argument("--limit", type=positive_int, default=None,
                    help="the first N requests only, none sent at once")
    ap.add_argument("--timeout", type=float_in(0.0, low_open=True), default=300,
                    help="seconds a request may take")
    ap.add_argument("--json", type=output_file, default=None, help="write every reply here")
    try:
        args = ap.parse_args(argv)
        servers = [s.strip() for s in args.servers.split(",") if s.strip()]
        if not servers or any(s not in ("serve", "hook") for s in servers):
            ap.error(f"argument --servers: {args.servers!r}: name serve, hook or both")
        if args.model in (*FIXTURES, *REAL_FIXTURES):
            model = str(fixture_path(args.model))
        else:
            try:
                model = model_ref(args.model)
            except argparse.ArgumentTypeError as e:
                ap.error(f"argument --model: {e}")
    except UserError as e:
        print(f"lossless: {e}", file=sys.stderr)
        return 2
    cases = requests()[:args.limit]
    sets = [] if args.limit else groups()
    log_dir = Path(tempfile.mkdtemp(prefix="mlx-fill-lossless-"))
    dtype = ["--dtype", args.dtype] if args.dtype else []

    def spec(path: str, mode: str) -> Server:
        if path == "serve":
            argv = [str(BIN / "mlx-fill"), "serve", "--model", model, "--fill", mode, *dtype]
            return Server(f"serve-{mode}", argv, {}, log_dir)
        env = {} if mode == "off" else {"MLX_FILL": mode}
        return Server(f"hook-{mode}", [str(BIN / "mlx_lm.server"), "--model", model], env, log_dir)

    report: dict = {"model": model, "dtype": args.dtype, "paths": {}}
    rows, differing = [], []
    for path in servers:
        t0 = time.monotonic()
        off = run_server(spec(path, "off"), cases, sets, args.timeout)
        report["paths"][path] = {"off": off}
        for mode in args.modes:
            on = run_server(spec(path, mode), cases, sets, args.timeout)
            report["paths"][path][mode] = on
            bad = {k: d for k in off if (d := differences(off[k], on[k]))}
            injected = sum(((r.get("usage") or {}).get("fill") or {}).get("injected", 0)
                           for r in on.values())
            rows.append((path, mode, len(on), len(bad), injected))
            differing += [(path, mode, k, d) for k, d in bad.items()]
        print(f"[{path}] done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"{'path':<8}{'mode':<8}{'requests':>9}{'differing':>10}{'injected ids':>14}")
    for path, mode, n, bad, injected in rows:
        print(f"{path:<8}{mode:<8}{n:>9}{bad:>10}{injected:>14}")
    for path, mode, name, fields in differing:
        print(f"DIFFERS {path} {mode} {name!r}: {', '.join(fields)}")
    print(f"server logs in {log_dir}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
