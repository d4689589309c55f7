#!/usr/bin/env bash
# Offloaded prefill on the GPU machine: the prefill GPU tests, then `agentrt bench prefill
# --offload auto` with the qwen3.5-35b-a3b-shaped synthetic model under a 16 GiB budget, and
# (STEPS=...,ttft) the TTFT replay of the reasoning-dropped sample traces under the same budget,
# (workers) the prefill bench again with AGENTRT_PREFILL_CPU_WORKERS=1, (cpuprobe)
# benchmarks/bench_cpu_prefill.py,
# (long) a 64K-token prompt, (decode) offloaded decode after a 512- and a 32K-token prefill,
# (timeline) one 8K chunk's device timeline (benchmarks/profile_prefill_timeline.py).
# Carry .whl .tok .traces-dev (benchmarks/gpu_ttft.sh prepare) and .triton-cache.tgz if present.
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
STEPS=",${STEPS:-tests,prefill},"
has() { [[ "$STEPS" == *",$1,"* ]]; }
if has tests; then
  timeout 200 python3 -m pytest -q -x -rs tests/test_gpu.py -k "prefill_plans or prefill_on_cuda or offloaded_decode or kv_grown_ahead" \
    > "$OUT/gpu_tests.log" 2>&1
  tail -4 "$OUT/gpu_tests.log"
fi
prefill() {  # $1: the output files' stem
  timeout "${PREFILL_TIMEOUT:-400}" python3 -m agentrt.cli bench prefill --offload auto \
    --model synthetic:qwen3.5-35b-a3b --device cuda --vram-budget 16GiB \
    --tokenizer .tok/qwen3 --lengths "${LENGTHS:-4096,8192}" --prefill-chunk 8192 \
    --suffixes "${SUFFIXES:-64,512,2048}" --prefix "${PREFIX:-32768}" --repeat "${REPEAT:-2}" \
    --prefill-plan "${PLANS:-auto,stream,routed,predicted}" ${PREFILL_ARGS:-} \
    --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  grep -A40 "^plan " "$OUT/$1.log" || tail -30 "$OUT/$1.log"
}
if has prefill; then
  prefill prefill
fi
if has workers; then  # the same with the many-row CPU experts on single-threaded workers
  AGENTRT_PREFILL_CPU_WORKERS=1 prefill prefill_workers
fi
if has cpuprobe; then  # the CPU experts of many rows: torch's team, the workers, the model
  timeout 120 python3 benchmarks/bench_cpu_prefill.py > "$OUT/cpu_prefill.json" 2>&1
  cat "$OUT/cpu_prefill.json"
fi
if has timeline; then  # one 8K chunk's device timeline (copies and compute overlapping or not)
  timeout "${TIMELINE_TIMEOUT:-300}" python3 benchmarks/profile_prefill_timeline.py \
    synthetic:qwen3.5-35b-a3b 8192 "${TIMELINE_PLAN:-auto}" 16GiB model \
    > "$OUT/timeline.json" 2> "$OUT/timeline.err"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); r.pop('plans'); \
r.pop('top_kernels_ms'); print(json.dumps(r))" "$OUT/timeline.json" || tail -5 "$OUT/timeline.err"
fi
if has ttft; then
  # (semantic and off, the pair the worst-case ratio needs; TTFT_CACHES=semantic,prefix,off adds
  # prefix, which needs a longer TTFT_TIMEOUT)
  VARIANTS=dropped NAME=ttft_offload PREFILL_CHUNK=8192 \
    TTFT_ARGS="--vram-budget 16GiB --cache ${TTFT_CACHES:-semantic,off} ${TTFT_ARGS:-}" \
    timeout "${TTFT_TIMEOUT:-400}" bash benchmarks/gpu_ttft.sh | tail -14
fi
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" --exclude .seeded --exclude '*.ptx' \
  --exclude '*.ttir' --exclude '*.ttgir' --exclude '*.llir' --exclude '*.source' . 2>/dev/null
if has long; then  # a 64K-token cold prompt under the budget (KV takes slots from the cache)
  timeout "${LONG_TIMEOUT:-200}" python3 -m agentrt.cli bench prefill --offload auto \
    --model synthetic:qwen3.5-35b-a3b --device cuda --vram-budget 16GiB --lengths 65536 \
    --prefill-chunk 8192 --repeat 1 --prefill-plan stream --no-resident \
    --json "$OUT/prefill_64k.json" > "$OUT/prefill_64k.log" 2>&1
  grep -A3 "^plan " "$OUT/prefill_64k.log" || tail -20 "$OUT/prefill_64k.log"
fi
if has decode; then  # the decode hit rate and tok/s right after a short and a long prefill
  # (one invocation, rounds interleaved: both lengths decode under the same calibration)
  timeout "${DECODE_TIMEOUT:-300}" python3 -m agentrt.cli bench decode --offload auto \
    --model synthetic:qwen3.5-35b-a3b --device cuda --vram-budget 16GiB \
    --prompt-len 512,32768 --repeat "${DECODE_REPEAT:-3}" --tokens 64 \
    --json "$OUT/decode_after.json" > "$OUT/decode_after.log" 2>&1
  grep -v '^ \|^{\|^}' "$OUT/decode_after.log" | tail -8
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['after_prompt'])" \
    "$OUT/decode_after.json"
fi
