#!/usr/bin/env bash
# Several GPU runs in one device call (each under its own time limit, so one that runs long
# cannot take the others' results with it): the GPU tests other than offload's, the suffix
# prefill profile, the TTFT replay of the reasoning-dropped traces, and the state-cache
# benchmark at 8K/32K. Carry .whl .tok .traces-dev (see gpu_ttft.sh prepare).
# Env: TESTS (pytest -k, default "not offloaded"), LENGTHS (default 8192,32768).
set -u
cd "$(dirname "$0")/.."
source scripts/device_env.sh
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null
timeout 150 python3 -m pytest -q -rs tests/test_gpu.py -k "${TESTS:-not offloaded}" > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"
timeout 120 python3 scripts/profile_suffix.py 8 24 2000 > "$OUT/suffix.txt" 2>&1
grep median "$OUT/suffix.txt"
VARIANTS=dropped timeout 240 bash scripts/gpu_ttft.sh | tail -14
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
