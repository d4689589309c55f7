#!/usr/bin/env bash
# The offloading issue's GPU run (one H200): the CUDA offload / graph tests, the bandwidth
# calibration (`bench bw`), then `agentrt bench decode` over every placement under a 16GiB budget
# on the qwen3.5-35b-a3b-shaped synthetic model, decoding real text through the Qwen3 tokenizer.
# Prepare on the dev machine first: bash scripts/gpu_ttft.sh prepare (copies the tokenizer to
# .tok/), then run with carry .whl .tok. Writes into $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
M=synthetic:qwen3.5-35b-a3b
python3 -m pytest -q -rs tests/test_gpu.py -k "offload or graph" 2>&1 | tee "$OUT/gpu_offload_tests.log" | tail -3
python3 -m agentrt.cli bench bw --model $M --device cuda --json "$OUT/bw.json" > "$OUT/bw.log" 2>&1
grep -A6 gb_per_s "$OUT/bw.json"
python3 -m agentrt.cli bench decode --model $M --device cuda --vram-budget 16GiB \
  --offload none,auto,static,layer --split on,off --expert-policy lru,lfu \
  --tokenizer .tok/qwen3 --prompt-len 256 --tokens 48 --json "$OUT/decode_offload.json" \
  > "$OUT/decode_offload.log" 2>&1
grep -v '^ \|^{\|^}' "$OUT/decode_offload.log" | tail -20
# the split again with idle OpenMP threads spinning instead of sleeping (diagnosis of the CPU
# side's speed inside decode: host_*_ms_per_token in the JSON split a token's host time)
OMP_WAIT_POLICY=ACTIVE timeout 240 python3 -m agentrt.cli bench decode --model $M --device cuda \
  --vram-budget 16GiB --offload auto --split on,off --expert-policy lru --tokenizer .tok/qwen3 \
  --prompt-len 256 --tokens 48 --json "$OUT/decode_offload_active.json" \
  > "$OUT/decode_offload_active.log" 2>&1
grep -v '^ \|^{\|^}' "$OUT/decode_offload_active.log" | tail -6
