#!/usr/bin/env bash
# Worst-case TTFT on one CUDA device: `agentrt bench ttft` with the qwen3.5-35b-a3b-shaped
# synthetic model and the real Qwen3 tokenizer, on the mini-swe-agent and tau-bench samples, as
# recorded and with earlier reasoning dropped. Prepare on the dev machine first (the shared data
# does not travel):  bash benchmarks/gpu_ttft.sh prepare   then carry .whl .tok .traces-dev.
# Env: VARIANTS (default recorded,dropped), PREFILL_CHUNK (default 4096: on an H200 a suffix of
# 2-4K tokens then runs as one forward pass instead of two launch-bound ones), TTFT_ARGS (more
# options, e.g. --no-prefill-graphs), NAME (output file stem, default ttft), TRACES (trace files,
# default the two samples' directories; e.g. .traces-dev/long/*.zst, a session generated with
# `agentrt trace gen --tokens 78000 --max-turns 150 -o .traces-dev/long/gen-81k.jsonl.zst`, the
# 81K-token session of BENCHMARKS.md);
# MODEL, TOK, TEMPLATE: another model, tokenizer directory and chat template (e.g. gpt-oss's).
set -u
if [ "${1:-}" = prepare ]; then
  S=../shared/data
  mkdir -p .tok .traces-dev
  cp -r $S/tokenizers/qwen3 .tok/
  agentrt trace import --format mini-swe-agent $S/traces-dev/mini-swe-agent -o .traces-dev/msa --zst
  agentrt trace import --format tau-bench $S/traces-dev/tau-bench/gpt-4o-airline.json -o .traces-dev/tau --limit 3 --zst
  exit 0
fi
source "$(dirname "$0")/device_env.sh"
# shellcheck disable=SC2086
python3 -m agentrt.cli bench ttft ${TRACES:-.traces-dev/msa/*.zst .traces-dev/tau/*.zst} \
  --model "${MODEL:-synthetic:qwen3.5-35b-a3b}" --device cuda --tokenizer "${TOK:-.tok/qwen3}" \
  --chat-template "${TEMPLATE:-.tok/qwen3/chat_template.qwen3-hybrid-thinking.jinja}" \
  --variants "${VARIANTS:-recorded,dropped}" --prefill-chunk "${PREFILL_CHUNK:-4096}" \
  --max-tokens 8 --max-requests 32 ${TTFT_ARGS:-} --json "$OUT/${NAME:-ttft}.json" \
  --plot "$OUT/${NAME:-ttft}.png" > "$OUT/${NAME:-ttft}.log" 2>&1
tail -30 "$OUT/${NAME:-ttft}.log"
