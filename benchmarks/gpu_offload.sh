#!/usr/bin/env bash
# Offloaded decode on one CUDA device: the CUDA offload tests, the host cost of the
# CUDA calls a host step makes, the CPU expert kernels (torch's and the native one), then per CPU
# kernel the bandwidth calibration (`bench bw`) and `agentrt bench decode` over every placement
# under a 16GiB budget on the qwen3.5-35b-a3b-shaped synthetic model, decoding real text through
# the Qwen3 tokenizer (each setting's 16 tokens after the timed ones run under cProfile).
# Prepare on the dev machine first: bash benchmarks/gpu_ttft.sh prepare (copies the tokenizer to
# .tok/), then run with carry .whl .tok. Writes into $OUT: summary.log (tests, costs, bw, the
# tables), decode_offload_<kernel>.json, py_profile_<kernel>.txt. Env: BW=0 skips the
# calibration run, NOSPIN=1 adds a rerun without spinning OpenMP workers; SKIP_TESTS=1 skips the tests;
# PROBES=0 skips host_step_costs.py, bench_cpu_kernel.py, bench_pool_contention.py and
# writer_load.py; MODEL and TOK pick another model
# and tokenizer directory (e.g. MODEL=synthetic:gpt-oss-20b TOK=.tok/gpt-oss, after
# `cp -r ../shared/data/tokenizers/gpt-oss .tok/`);
# OFFLOADS, POLICIES, PREFETCH (comma lists), TOKENS, REPEAT (rounds) shape the decode benchmark, and
# CPU_KERNEL (a comma list of torch, native and native-nopool: AGENTRT_CPU_POOL=0) runs it once
# per kernel, in that order; LIMIT
# (seconds, default 580) caps the whole script: a decode run that would pass it is cut short.
set -u
source "$(dirname "$0")/device_env.sh"
M=${MODEL:-synthetic:qwen3.5-35b-a3b}
TOK=${TOK:-.tok/qwen3}
LOG="$OUT/summary.log"
LIMIT=${LIMIT:-580}
left() { local n=$((LIMIT - SECONDS)); echo $((n > 1 ? n : 1)); }
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -rs tests/test_gpu.py -k "offload or native" 2>&1 | tail -8 | tee -a "$LOG"
fi
if [ "${PROBES:-1}" = 1 ]; then
  python3 benchmarks/host_step_costs.py 2>&1 | tee -a "$LOG"
  python3 benchmarks/bench_cpu_kernel.py 2>&1 | tee -a "$LOG"
  python3 benchmarks/bench_pool_contention.py 2>&1 | tee -a "$LOG"
  python3 benchmarks/writer_load.py 8192 1,2,4 3 2>&1 | tee -a "$LOG"
fi
for K in $(echo "${CPU_KERNEL:-native,torch}" | tr ',' ' '); do
  echo "=== cpu kernel $K ($(left) s left)" | tee -a "$LOG"
  # native-nopool: the native kernel on the host step's own thread (no pool, no overlap)
  if [ "$K" = native-nopool ]; then export AGENTRT_CPU_POOL=0; else unset AGENTRT_CPU_POOL; fi
  if [ "${BW:-1}" = 1 ]; then
    timeout "$(left)" python3 -m agentrt.cli bench bw --model $M --device cuda --cpu-kernel "${K%-nopool}" \
      --json "$OUT/bw.json" 2>&1 | tail -3 >> "$LOG"
    cat "$OUT/bw.json" >> "$LOG" && rm -f "$OUT/bw.json"
  fi
  offloads=${OFFLOADS:-none,auto,static,layer} auto_args=()  # (the split's settings: auto's)
  case ",$offloads," in *,auto,*)
    auto_args=(--split on,off --expert-policy "${POLICIES:-lfu}" --prefetch "${PREFETCH:-on,off}") ;;
  esac
  timeout "$(left)" python3 -m agentrt.cli bench decode --model $M --device cuda \
    --vram-budget 16GiB --offload "$offloads" "${auto_args[@]}" --repeat "${REPEAT:-2}" \
    --cpu-kernel "${K%-nopool}" --tokenizer "$TOK" --prompt-len 256 --tokens "${TOKENS:-64}" \
    --json "$OUT/decode_offload_$K.json" --py-profile "$OUT/py_profile_$K.txt" \
    2>&1 | grep -v '^ \|^{\|^}' | tee -a "$LOG" | tail -24
done
# the split and copy-only again with libgomp's default waiting (AGENTRT_OMP_SPIN=0: the CLI does
# not make idle OpenMP workers spin), to show what spinning workers change
if [ "${NOSPIN:-0}" = 1 ]; then
  AGENTRT_OMP_SPIN=0 timeout "$(left)" python3 -m agentrt.cli bench decode --model $M \
    --device cuda --vram-budget 16GiB --offload auto --split on,off \
    --tokenizer "$TOK" --prompt-len 256 --tokens 48 2>&1 | grep -v '^ \|^{\|^}' \
    | tee -a "$LOG" | tail -6
fi
echo "done at ${SECONDS} s" | tee -a "$LOG"
