#!/usr/bin/env bash
# The state cache on one CUDA device: the state-cache and CUDA-graph tests, then `agentrt bench
# statecache` on the qwen3.5-35b-a3b-shaped synthetic model for 8K/32K/64K-token prefixes.
# Usage (device tool): bash benchmarks/gpu_statecache.sh  (writes into $OUT). Env TESTS: pytest -k
# (SKIP_TESTS=1: the benchmark only), LENGTHS: prefix lengths, FIDELITY=1: `--fidelity` instead
# of the timings (restored vs recomputed, the noise floor, per capture design; ROUNDS prompts).
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"; lscpu | grep "Model name" >> "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -rs tests/test_gpu.py -k "${TESTS:-state_cache or graph or semantic}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
fi
if [ "${FIDELITY:-0}" = 1 ]; then
  python3 -m agentrt.cli bench statecache --fidelity --model synthetic:qwen3.5-35b-a3b --device cuda \
    --lengths "${LENGTHS:-8192,32768,65536}" --rounds "${ROUNDS:-3}" --state-dir /tmp/bench-state \
    --json "$OUT/fidelity.json" > "$OUT/fidelity.log" 2>&1
  tail -5 "$OUT/fidelity.log"
  exit 0
fi
python3 -m agentrt.cli bench statecache --model synthetic:qwen3.5-35b-a3b --device cuda \
  --lengths "${LENGTHS:-8192,32768,65536}" --state-dir /tmp/bench-state --json "$OUT/statecache.json" > "$OUT/statecache.log" 2>&1
tail -5 "$OUT/statecache.log"
du -sh /tmp/bench-state >> "$OUT/statecache.log"
