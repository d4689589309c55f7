#!/usr/bin/env bash
# A GPU run (one CUDA device): GPU tests, bf16-vs-fp32 accuracy on tiny, and prefill /
# decode throughput of the qwen3.5-35b-a3b-shaped synthetic model, all on the GPU (no offload),
# with and without fla. Usage (device tool): bash benchmarks/gpu_foundation.sh  (writes into $OUT).
set -u
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)'; \
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'; } \
  > "$OUT/machine.txt" 2>&1
python3 -m pytest -q -rs tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
A="python3 -m agentrt.cli bench"
$A accuracy --model tiny --device cuda --linear-attn torch,fla --json "$OUT/accuracy.json" > "$OUT/accuracy.log" 2>&1
tail -3 "$OUT/accuracy.log"
M=synthetic:qwen3.5-35b-a3b
$A prefill --model $M --device cuda --lengths 2048,8192 --linear-attn fla,torch --repeat 3 \
  --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
tail -3 "$OUT/prefill.log"
$A decode --model $M --device cuda --prompt-len 2048 --tokens 64 --linear-attn fla,torch --graphs on,off \
  --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
tail -3 "$OUT/decode.log"
