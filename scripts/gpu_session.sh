#!/usr/bin/env bash
# Several GPU runs in one device call (each under its own time limit, so one that runs long
# cannot take the others' results with it): the TTFT replay of the reasoning-dropped traces,
# the state-cache benchmark with the state-cache / semantic / CPU-layer GPU tests, and the CPU
# expert kernel in decode's arrangement. Carry .whl .tok .traces-dev (see gpu_ttft.sh prepare).
set -u
cd "$(dirname "$0")/.."
VARIANTS=dropped timeout 290 bash scripts/gpu_ttft.sh
TESTS="semantic or state_cache or layer" LENGTHS=8192,32768 timeout 200 bash scripts/gpu_statecache.sh
source scripts/device_env.sh
for env in "" "OMP_WAIT_POLICY=ACTIVE"; do
  env $env timeout 25 python3 scripts/cpu_burst.py >> "$OUT/cpu_burst.jsonl" 2>&1
done
tail -3 "$OUT/cpu_burst.jsonl"
