#!/usr/bin/env bash
# gpt-oss on the GPU machine: its GPU tests (flash sink attention, graphs, offloaded decode,
# packed MXFP4 kernels and offload), then `synthetic:gpt-oss-20b` (MODEL=..., e.g.
# synthetic:gpt-oss-120b; FORMAT=mxfp4, the default, keeps the experts packed: 10 / 61 GB of
# pinned host memory; FORMAT=model: bf16, 42 GB for the 20b) under a 16 GiB budget: `bench decode` over the placements, `bench prefill` of 4K and
# 8K tokens, and TTFT over the sample traces rendered in harmony (decode runs `none` too: every
# expert resident, the bound's t_gpu; 61 GB of device memory for the 120b). Copy
# ../shared/data/tokenizers/gpt-oss into .tok/ first (with the Qwen3 tokenizer beside it the
# carry is about 59 MB of the 64 MiB). STEPS: a comma list of tests, kernel (the packed CPU
# kernel on its own: bench_cpu_mxfp4.py), decode, prefill, timeline (profile_prefill_timeline.py),
# ttft. Decode: OFFLOADS, TOKENS, REPEAT, and SPINS (e.g. 2,20: one invocation per spin of the
# CPU kernel's pool, AGENTRT_POOL_SPIN_MS). TTFT: TRACES (gpu_ttft.sh's; e.g. a session past 64K
# tokens from `agentrt trace gen --tokens 76000 -o .traces-dev/long/gen-76k.jsonl.zst`: 56
# requests, up to 73K gpt-oss tokens) and MAX_REQUESTS (first requests of each trace, 16).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
M=${MODEL:-synthetic:gpt-oss-20b}
F=${FORMAT:-mxfp4}
TOK=.tok/gpt-oss
STEPS=",${STEPS:-tests,kernel,decode,prefill,ttft},"
has() { [[ "$STEPS" == *",$1,"* ]]; }
if has tests; then
  timeout 300 python3 -m pytest -q -rs tests/test_gpu.py -k "gpt_oss or flash_sink or mxfp4" \
    > "$OUT/gpu_tests.log" 2>&1
  tail -4 "$OUT/gpu_tests.log"
fi
if has kernel; then
  timeout 120 python3 benchmarks/bench_cpu_mxfp4.py > "$OUT/cpu_mxfp4.json" 2>&1
  tr -d ' \n' < "$OUT/cpu_mxfp4.json"; echo
fi
if has decode; then  # SPINS: one invocation per CPU-pool spin in ms (AGENTRT_POOL_SPIN_MS)
  for SPIN in $(echo "${SPINS:-default}" | tr ',' ' '); do
    NAME=decode; [ "$SPIN" = default ] || NAME=decode_spin$SPIN
    [ "$SPIN" = default ] && unset AGENTRT_POOL_SPIN_MS || export AGENTRT_POOL_SPIN_MS=$SPIN
    echo "== decode, pool spin $SPIN"
    timeout "${DECODE_TIMEOUT:-400}" python3 -m agentrt.cli bench decode --model "$M" --device cuda \
      --vram-budget 16GiB --offload "${OFFLOADS:-none,auto,static,layer}" --tokenizer "$TOK" \
      --expert-format "$F" --prompt-len 256 --tokens "${TOKENS:-32}" --repeat "${REPEAT:-1}" \
      --json "$OUT/$NAME.json" > "$OUT/$NAME.log" 2>&1
    grep -v '^ \|^{\|^}' "$OUT/$NAME.log" | tail -16
  done
  unset AGENTRT_POOL_SPIN_MS
fi
if has prefill; then
  timeout "${PREFILL_TIMEOUT:-400}" python3 -m agentrt.cli bench prefill --offload auto \
    --model "$M" --device cuda --vram-budget 16GiB --tokenizer "$TOK" --expert-format "$F" \
    --lengths "${LENGTHS:-4096,8192}" --prefill-chunk 8192 --repeat 1 \
    --prefill-plan "${PLANS:-auto,stream}" ${PREFILL_ARGS:-} --json "$OUT/prefill.json" \
    > "$OUT/prefill.log" 2>&1
  grep -A20 "^plan " "$OUT/prefill.log" || tail -20 "$OUT/prefill.log"
fi
if has timeline; then  # one 8K chunk's device timeline (copies and compute overlapping or not)
  timeout "${TIMELINE_TIMEOUT:-300}" python3 benchmarks/profile_prefill_timeline.py "$M" 8192 auto \
    16GiB "$F" > "$OUT/timeline.json" 2> "$OUT/timeline.err"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); r.pop('plans'); \
r.pop('top_kernels_ms'); print(json.dumps(r))" "$OUT/timeline.json" || tail -5 "$OUT/timeline.err"
fi
if has ttft; then  # TRACES: other trace files (e.g. a long generated session), MAX_REQUESTS
  MODEL=$M TOK=$TOK TEMPLATE=$TOK/chat_template.jinja VARIANTS=dropped PREFILL_CHUNK=8192 \
    NAME=ttft_gpt_oss TTFT_ARGS="--vram-budget 16GiB --expert-format $F --cache semantic,off --max-requests ${MAX_REQUESTS:-16}" \
    timeout "${TTFT_TIMEOUT:-400}" bash benchmarks/gpu_ttft.sh | tail -14
fi
