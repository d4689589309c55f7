#!/usr/bin/env bash
# Decode right after each replayed turn and the next turn's TTFT, with the state-cache writer as
# it runs by default (write(2) commits; no checkpoint started beside a prefill; a prefill's
# checkpoints held while it decodes unless older ones are pending) against the cache off in the
# same process, then with `AGENTRT_DECODE_HOLD=0` (the writer works whenever it has work), then
# also with `AGENTRT_STATE_WRITEMAP=1` (LMDB commits through its shared map), each in its own
# process; then `writer_neighbour.py`. The qwen3.5-35b-a3b-shaped synthetic model under a
# 16 GiB budget, 8K chunks, the first REQUESTS (default 14) requests of the marshmallow-1343
# mini-swe-agent trace with earlier reasoning dropped, 8 tokens each. Prepare as for
# gpu_ttft.sh (`bash benchmarks/gpu_ttft.sh prepare`, carry .whl .tok .traces-dev and
# optionally .triton-cache.tgz, without which the first process compiles fla's kernels). The
# time limits keep all of it within one 10-minute device call. Arguments name the runs to make
# (default: defaults no-hold no-hold-writemap), for a call with less device time left.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
trace=$(ls .traces-dev/msa/*1343*.zst)
replay() {  # NAME CACHE SECONDS [VAR=VALUE ...]
  local name=$1 cache=$2 limit=$3; shift 3
  env "$@" timeout "$limit" python3 -m agentrt.cli bench ttft "$trace" \
    --model synthetic:qwen3.5-35b-a3b --device cuda --tokenizer .tok/qwen3 \
    --chat-template .tok/qwen3/chat_template.qwen3-hybrid-thinking.jinja --variants dropped \
    --prefill-chunk 8192 --max-tokens 8 --max-requests "${REQUESTS:-14}" --vram-budget 16GiB \
    --cache "$cache" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"
}
runs=("$@")
[ $# -gt 0 ] || runs=(defaults no-hold no-hold-writemap)
for run in "${runs[@]}"; do
  case $run in
    defaults) replay defaults semantic,off 220 ;;
    no-hold) replay no-hold semantic 140 AGENTRT_DECODE_HOLD=0 ;;
    no-hold-writemap) replay no-hold-writemap semantic 140 AGENTRT_DECODE_HOLD=0 AGENTRT_STATE_WRITEMAP=1 ;;
    *) echo "unknown run: $run" >&2; exit 2 ;;
  esac
done
python3 benchmarks/ttft_decode_rows.py "$OUT"/*.json | tee "$OUT/decode_rows.jsonl"
timeout 50 python3 benchmarks/writer_neighbour.py 4 2 | tee "$OUT/neighbour.json"
