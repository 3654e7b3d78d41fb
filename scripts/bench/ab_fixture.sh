#!/usr/bin/env bash
# Paired A/B of `mlx-fill serve --fill off` vs `--fill MODE` for each MODE in B_FILL on a fixture
# model; `mlx-fill ab` prints a verdict per MODE (each paired with the off arm) and writes
# runs.jsonl, report.md (by recorded tool) and plots into OUT_DIR. One MODE is the two-arm A/B
# (arm B, server-b.log); several (B_FILL=strict,echo,all) compare them all in one run, one server
# per MODE on PORT_B, PORT_B+1, ... (arms named after the modes, server-MODE.log); exit status 0
# only if every MODE passes.
#
#   bash scripts/bench/ab_fixture.sh [OUT_DIR]
#
# Environment (defaults in brackets): FIXTURE [qwen3-json], B_FILL (one or more, comma-separated)
# [all], SOURCE (one or more, comma-separated) [mini_swe_agent_gemini3pro],
# SESSIONS [fixtures/transcripts/dev.jsonl.gz;
# `python -m scripts.bench.heldout_sessions FILE` writes the sessions no fixture trained on],
# MAX_SESSIONS [5], TURNS [4], REPS [1], MAX_TOKENS [96], DTYPE [as stored; e.g. bfloat16],
# TIMEOUT [seconds per request, as `mlx-fill ab`], START_WAIT [120], PORT_A [8401], PORT_B [8402].
# All servers run at once but requests go one at a time, every turn to every arm back to back,
# so only one decodes at a time.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-mlx-fill-runs/ab-fixture-$(date -u +%Y%m%dT%H%M%SZ)}"
fixture="${FIXTURE:-qwen3-json}"
b_fill="${B_FILL:-all}"
source_name="${SOURCE:-mini_swe_agent_gemini3pro}"
sessions="${SESSIONS:-$root/fixtures/transcripts/dev.jsonl.gz}"
port_a="${PORT_A:-8401}"
port_b="${PORT_B:-8402}"

model="$(mlx-fill fixture "$fixture")"
mkdir -p "$out"
dtype_args=()
[ -n "${DTYPE:-}" ] && dtype_args=(--dtype "$DTYPE")
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
mlx-fill serve --model "$model" "${dtype_args[@]}" --fill off --port "$port_a" >"$out/server-a.log" 2>&1 &
pids+=($!)
IFS=, read -ra modes <<<"$b_fill"
ports=("$port_a")
url_b_args=()
for i in "${!modes[@]}"; do
  mode="${modes[$i]}"
  port=$((port_b + i))
  log="server-$mode.log"
  url_b="$mode=http://127.0.0.1:$port"
  if [ "${#modes[@]}" -eq 1 ]; then log="server-b.log"; url_b="http://127.0.0.1:$port"; fi
  mlx-fill serve --model "$model" "${dtype_args[@]}" --fill "$mode" --port "$port" >"$out/$log" 2>&1 &
  pids+=($!)
  ports+=("$port")
  url_b_args+=(--url-b "$url_b")
done

for port in "${ports[@]}"; do
  for _ in $(seq "${START_WAIT:-120}"); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null || { echo "server on $port did not start" >&2; exit 1; }
done
source_args=()
IFS=, read -ra names <<<"$source_name"
for name in "${names[@]}"; do source_args+=(--source "$name"); done

mlx-fill ab --sessions "$sessions" "${source_args[@]}" \
  --url-a "http://127.0.0.1:$port_a" "${url_b_args[@]}" \
  --max-sessions "${MAX_SESSIONS:-5}" --turns "${TURNS:-4}" --reps "${REPS:-1}" \
  --max-tokens "${MAX_TOKENS:-96}" --temperature 0 --out "$out" \
  ${TIMEOUT:+--timeout "$TIMEOUT"}
