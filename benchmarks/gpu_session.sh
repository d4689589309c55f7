#!/usr/bin/env bash
# Several GPU runs in one device call, each under its own time limit (so one that runs long cannot
# take the others' results with it). STEPS picks them, in this order (default
# tests,crossover,ttft,statecache):
#   tests        the GPU tests (TESTS: pytest -k, default all)
#   crossover    fla's chunked vs recurrent kernel times
#   conv         torch vs fla causal conv, host and GPU time per call (bench_conv.py)
#   moe          the MoE combine before and after (bench_moe.py)
#   stall        how long the state-cache writer's packing stalls other threads (writer_stall.py)
#   profile      the suffix prefill profile (PREFILL_GRAPHS=1 for the graphed path)
#   ttft         the TTFT replay of the reasoning-dropped traces (into ttft.*; prefill graphs on,
#                the default)
#   ttft_eager   the same with --no-prefill-graphs (into ttft_eager.*)
#   static       graphed vs eager prefill per piece length, and decode (profile_static.py)
#   statecache   the state-cache benchmark at LENGTHS (default 8192,32768)
#   firstcalls   each prompt length's first and second call after an offloaded start-up under
#                16 GiB, with the kernels Triton tunes in between (first_calls.py)
# Carry .whl .tok .traces-dev (see gpu_ttft.sh prepare), and .triton-cache.tgz when a previous
# run left one in $OUT (it saves the fla kernel compilation of a fresh machine).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
STEPS=",${STEPS:-tests,crossover,ttft,statecache},"
has() { [[ "$STEPS" == *",$1,"* ]]; }
if has tests; then
  timeout 330 python3 -m pytest -q -rs -o faulthandler_timeout=150 tests/test_gpu.py -k "${TESTS:-gpu}" \
    > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
fi
# a script that prints JSON lines: STEP SECONDS SCRIPT OUTPUT_STEM
json_step() {
  if has "$1"; then
    timeout "$2" python3 benchmarks/$3 > "$OUT/$4.jsonl" 2>&1  # ($3: the script and its arguments)
    cat "$OUT/$4.jsonl"
  fi
}
json_step crossover 60 fla_crossover.py fla_crossover
json_step conv 60 bench_conv.py conv
json_step moe 60 bench_moe.py moe
json_step stall 60 "writer_stall.py 10 4" writer_stall
if has profile; then
  timeout 120 python3 benchmarks/profile_suffix.py 8 24 2000 > "$OUT/suffix.txt" 2>&1
  grep median "$OUT/suffix.txt"
fi
if has ttft; then
  VARIANTS=dropped timeout 240 bash benchmarks/gpu_ttft.sh | tail -14
fi
if has ttft_eager; then
  VARIANTS=dropped NAME=ttft_eager TTFT_ARGS=--no-prefill-graphs timeout "${TTFT_TIMEOUT:-240}" bash benchmarks/gpu_ttft.sh | tail -14
fi
if has static; then
  timeout 200 python3 benchmarks/profile_static.py > "$OUT/static.jsonl" 2>&1
  cat "$OUT/static.jsonl"
fi
if has statecache; then
  SKIP_TESTS=1 LENGTHS="${LENGTHS:-8192,32768}" timeout "${STATECACHE_TIMEOUT:-400}" bash benchmarks/gpu_statecache.sh >/dev/null
  python3 - "$OUT/statecache.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()
           if not isinstance(v, (dict, list))})
EOF
fi
if has firstcalls; then
  TRITON_PRINT_AUTOTUNING=1 timeout "${FIRST_CALLS_TIMEOUT:-360}" python3 benchmarks/first_calls.py \
    --prefill-chunk 8192 > "$OUT/first_calls.log" 2>&1
  grep -h "^first_calls\|^Triton autotuning for function\|^finished after" "$OUT/first_calls.log"
fi
# the Triton cache for the next fresh machine (carry it back as .triton-cache.tgz), if small
# (loading a kernel needs only its .cubin and .json files: the IR and PTX stages stay behind)
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" --exclude .seeded --exclude '*.ptx' \
  --exclude '*.ttir' --exclude '*.ttgir' --exclude '*.llir' --exclude '*.source' . 2>/dev/null
if [ "$(stat -c %s "$OUT/triton-cache.tgz" 2>/dev/null || echo 0)" -gt $((34 << 20)) ]; then
  rm -f "$OUT/triton-cache.tgz"; echo "triton cache over 34 MiB (the carry limit is 64 with .whl .tok): not kept"
fi
