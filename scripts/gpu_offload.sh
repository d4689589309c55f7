#!/usr/bin/env bash
# The offloading issue's GPU run (one H200): the CUDA offload / graph tests, the host cost of the
# CUDA calls a host step makes, the bandwidth calibration (`bench bw`), then `agentrt bench
# decode` over every placement under a 16GiB budget on the qwen3.5-35b-a3b-shaped synthetic
# model, decoding real text through the Qwen3 tokenizer.
# Prepare on the dev machine first: bash scripts/gpu_ttft.sh prepare (copies the tokenizer to
# .tok/), then run with carry .whl .tok. Writes into $OUT. Env: BW=0 / NOSPIN=0 skip the
# calibration run / the rerun without spinning OpenMP workers; SKIP_TESTS=1 skips the tests;
# POLICIES, PREFETCH (comma lists), TOKENS, REPEAT (rounds) and CPU_KERNEL (torch or native) shape
# the decode benchmark.
set -u
source "$(dirname "$0")/device_env.sh"
M=synthetic:qwen3.5-35b-a3b
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -rs tests/test_gpu.py -k "offload or graph" 2>&1 | tee "$OUT/gpu_offload_tests.log" | tail -3
fi
python3 scripts/host_step_costs.py > "$OUT/host_step_costs.json" 2>&1; cat "$OUT/host_step_costs.json"
python3 scripts/bench_cpu_kernel.py > "$OUT/cpu_kernel.json" 2>&1; cat "$OUT/cpu_kernel.json"
if [ "${BW:-1}" = 1 ]; then
  python3 -m agentrt.cli bench bw --model $M --device cuda --json "$OUT/bw.json" > "$OUT/bw.log" 2>&1
  grep -A6 gb_per_s "$OUT/bw.json"
fi
python3 -m agentrt.cli bench decode --model $M --device cuda --vram-budget 16GiB \
  --offload none,auto,static,layer --split on,off --expert-policy "${POLICIES:-lru,lfu}" \
  --prefetch "${PREFETCH:-on,off}" --repeat "${REPEAT:-2}" --cpu-kernel "${CPU_KERNEL:-torch}" \
  --tokenizer .tok/qwen3 --prompt-len 256 --tokens "${TOKENS:-64}" --json "$OUT/decode_offload.json" \
  > "$OUT/decode_offload.log" 2>&1
grep -v '^ \|^{\|^}' "$OUT/decode_offload.log" | tail -20
# the split and copy-only again with libgomp's default waiting (AGENTRT_OMP_SPIN=0: the CLI does
# not make idle OpenMP workers spin), to show what spinning workers change
if [ "${NOSPIN:-1}" = 1 ]; then
  AGENTRT_OMP_SPIN=0 timeout 200 python3 -m agentrt.cli bench decode --model $M --device cuda \
    --vram-budget 16GiB --offload auto --split on,off --expert-policy lru --tokenizer .tok/qwen3 \
    --prompt-len 256 --tokens 48 --json "$OUT/decode_offload_nospin.json" \
    > "$OUT/decode_offload_nospin.log" 2>&1
  grep -v '^ \|^{\|^}' "$OUT/decode_offload_nospin.log" | tail -6
fi
