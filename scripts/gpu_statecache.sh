#!/usr/bin/env bash
# The state-cache issue's GPU run (one H200): CUDA state-cache tests, then `agentrt bench
# statecache` on the qwen3.5-35b-a3b-shaped synthetic model for 8K/32K/64K-token prefixes.
# Usage (device tool): bash scripts/gpu_statecache.sh  (writes into $OUT).
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export AGENTRT_HOME=/tmp/agentrt-home PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pytest -q -rs tests/test_gpu.py -k "state_cache or graph or chunked" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
python3 -m agentrt.cli bench statecache --model synthetic:qwen3.5-35b-a3b --device cuda \
  --lengths 8192,32768,65536 --state-dir /tmp/bench-state --json "$OUT/statecache.json" > "$OUT/statecache.log" 2>&1
tail -5 "$OUT/statecache.log"
du -sh /tmp/bench-state >> "$OUT/statecache.log"
