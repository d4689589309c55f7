#!/usr/bin/env bash
# Several GPU runs in one device call (each under its own time limit, so one that runs long
# cannot take the others' results with it): the GPU tests, fla's chunked vs recurrent kernel
# times, the TTFT replay of the reasoning-dropped traces, and the state-cache benchmark at
# 8K/32K (PROFILE=1 adds the suffix prefill profile; GRAPHS=1 a second TTFT replay with
# --prefill-graphs, into ttft_graphs.*). Carry .whl .tok .traces-dev (see gpu_ttft.sh prepare).
# Env: TESTS (pytest -k, default all), LENGTHS (default 8192,32768).
set -u
cd "$(dirname "$0")/.."
source scripts/device_env.sh
timeout 180 python3 -m pytest -q -rs -o faulthandler_timeout=100 tests/test_gpu.py -k "${TESTS:-gpu}" \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"
timeout 60 python3 scripts/fla_crossover.py > "$OUT/fla_crossover.jsonl" 2>&1
cat "$OUT/fla_crossover.jsonl"
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 120 python3 scripts/profile_suffix.py 8 24 2000 > "$OUT/suffix.txt" 2>&1
  grep median "$OUT/suffix.txt"
fi
VARIANTS=dropped timeout 240 bash scripts/gpu_ttft.sh | tail -14
if [ "${GRAPHS:-0}" = 1 ]; then
  VARIANTS=dropped NAME=ttft_graphs TTFT_ARGS=--prefill-graphs timeout 240 bash scripts/gpu_ttft.sh | tail -14
fi
timeout 200 python3 -m agentrt.cli bench statecache --model synthetic:qwen3.5-35b-a3b --device cuda \
  --lengths "${LENGTHS:-8192,32768}" --state-dir /tmp/bench-state --json "$OUT/statecache.json" \
  > "$OUT/statecache.log" 2>&1
python3 - "$OUT/statecache.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    keys = ("prompt_tokens", "recompute_s", "restore_ram_s", "restore_lmdb_s", "speedup_lmdb",
            "capture_overhead_end", "capture_overhead_many", "writer_mib_s")
    print({k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keys})
EOF
