#!/usr/bin/env bash
# Rate sweep of `asyncinfer bench serve` against a CPU server, one server per policy.
# Usage: bash benchmarks/serve_sweep.sh OUT_DIR [RATES] [REQUESTS]
# Writes OUT_DIR/POLICY-rRATE.json per run and OUT_DIR/serve-sweep.png (TTFT, TPOT vs rate).
set -euo pipefail
out="${1:?usage: $0 OUT_DIR [RATES] [REQUESTS]}"
rates="${2:-0.5 1 2}"
requests="${3:-16}"
port=18431
mkdir -p "$out"
for policy in prefill_first decode_first skip_ahead; do
  asyncinfer serve --port "$port" --policy "$policy" >"$out/server-$policy.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  for rate in $rates; do
    asyncinfer bench serve --url "http://127.0.0.1:$port" --rate "$rate" \
      --num-requests "$requests" --input-len 128 --output-len 32 --seed 0 \
      --policy "$policy" --json "$out/$policy-r$rate.json"
  done
  kill "$server"
  wait "$server" 2>/dev/null || true
done
python -m benchmarks.plot "$out/serve-sweep.png" "$out"/*-r*.json
