#!/usr/bin/env bash
# llama.cpp beside agentrt on the same synthetic weights.
#
#   bash benchmarks/llamacpp/llamacpp.sh prepare [LLAMA_CPP_DIR]
#       Writes .llamacpp.tgz (about 5 MB): the parts of a llama.cpp source tree the build, the
#       GGUF export and the benchmarks need (ggml, src, include, common, vendor, cmake, the
#       converter's conversion/ and gguf-py/, tools/llama-bench, examples/simple), with the
#       tools and examples lists cut down to those two. Without a directory it takes the tree
#       vendored in the llama-cpp-python sdist (`pip download --no-binary=:all: --no-deps
#       llama-cpp-python==0.3.36`). Carry it (and .tok, .whl) to the GPU machine.
#   bash benchmarks/llamacpp/llamacpp.sh build
#       Unpacks it to $LLAMA (default /tmp/llama.cpp) and builds llama-bench and llama-simple:
#       CUDA for sm_90 where a GPU and nvcc are found (LLAMA_CUDA=ON|OFF decides otherwise),
#       else the CPU backend only. Build outputs stay on a warm machine between calls.
#   bash benchmarks/llamacpp/llamacpp.sh export [MODEL] [GGUF]
#       `export_gguf.py` of MODEL (default synthetic:qwen3.5-35b-a3b, bf16) into GGUF (default
#       /dev/shm/<name>.gguf), with the tokenizer in $TOK (default .tok/qwen3; .tok/gpt-oss
#       for gpt-oss sizes); DEVICE=cuda draws the values on the GPU, as `synthetic:NAME` built
#       there (the weights agentrt runs);
#       SPLIT=40G writes shards of at most that size (GGUF is then the first's name); EXPERTS
#       (auto, model or mxfp4; auto: MXFP4 for gpt-oss sizes, drawn as agentrt's packed expert
#       store draws them, so `--expert-format mxfp4` runs the same weights).
#   bash benchmarks/llamacpp/llamacpp.sh spill GGUF DIR
#       Moves every shard of a split GGUF but the last into DIR (a disk) and links them back,
#       so that MMAP=0 (weights copied into pinned host buffers) fits beside the rest.
#   bash benchmarks/llamacpp/llamacpp.sh bench GGUF
#       llama-bench over a sweep of --n-cpu-moe, -ot exps=CPU and -ngl layer splits (see
#       `bench` below).
# agentrt's side on the same weights and budget: `python benchmarks/llamacpp/agentrt_side.py`
# (remove the GGUF from /dev/shm first: a 128 GiB host cannot hold it and agentrt's pinned
# experts at once).
# gpt-oss-120b, its experts MXFP4 in both runtimes (about 61 GB):
#   DEVICE=cuda llamacpp.sh export synthetic:gpt-oss-120b@skew=0.3 /dev/shm/go.gguf
#   PROMPTS=0 CONFIGS="N ..." llamacpp.sh bench /dev/shm/go.gguf   (N around the fewest that fit)
#   python benchmarks/llamacpp/agentrt_side.py --out DIR --model synthetic:gpt-oss-120b@skew=0.3 \
#     --tokenizer .tok/gpt-oss --lengths none --offloads auto,static
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LLAMA=${LLAMA:-/tmp/llama.cpp}

prepare() {
  local src=${1:-}
  if [ -z "$src" ]; then
    local tmp; tmp=$(mktemp -d)
    python3 -m pip download -q --no-binary=:all: --no-deps llama-cpp-python==0.3.36 -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
  fi
  local out; out=$(mktemp -d)/llama.cpp
  mkdir -p "$out/tools" "$out/examples" "$out/pocs"
  (cd "$src" && cp -r ggml src include common cmake vendor conversion gguf-py CMakeLists.txt \
    LICENSE convert_hf_to_gguf.py "$out/")
  cp -r "$src/tools/llama-bench" "$out/tools/"
  cp -r "$src/examples/simple" "$out/examples/"
  for d in vulkan sycl cann musa opencl metal hip webgpu kompute zdnn; do
    rm -rf "$out/ggml/src/ggml-$d"
  done
  printf 'llama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' > "$out/tools/CMakeLists.txt"
  printf 'llama_add_compile_flags()\nadd_subdirectory(simple)\n' > "$out/examples/CMakeLists.txt"
  : > "$out/pocs/CMakeLists.txt"
  tar -czf "$ROOT/.llamacpp.tgz" -C "$(dirname "$out")" llama.cpp
  ls -la "$ROOT/.llamacpp.tgz"
}

build() {
  if [ ! -d "$LLAMA" ]; then
    tar -xzf "$ROOT/.llamacpp.tgz" -C "$(dirname "$LLAMA")"
  fi
  local cuda=${LLAMA_CUDA:-auto}  # auto: where a GPU and nvcc are found
  if [ "$cuda" = auto ]; then
    cuda=OFF
    if command -v nvidia-smi >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then cuda=ON; fi
  fi
  export PATH=/usr/local/cuda/bin:$PATH
  cmake -S "$LLAMA" -B "$LLAMA/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=$cuda \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >/dev/null
  cmake --build "$LLAMA/build" -j "${LLAMA_JOBS:-$(nproc)}" --target llama-bench llama-simple
  ls "$LLAMA/build/bin"
}

export_gguf() {
  local model=${1:-synthetic:qwen3.5-35b-a3b}
  local out=${2:-/dev/shm/${model#synthetic:}.gguf}
  local tok=${TOK:-.tok/qwen3}
  [[ "$model" == *gpt-oss* ]] && tok=${TOK:-.tok/gpt-oss}
  python3 "$HERE/export_gguf.py" --llama-cpp "$LLAMA" --model "$model" \
    --device "${DEVICE:-cpu}" --tokenizer "$tok" -o "$out" --outtype "${OUTTYPE:-bf16}" \
    --split-max-size "${SPLIT:-0}" --expert-format "${EXPERTS:-auto}"
}

spill() {
  local first=$1 dir=$2 shard
  mkdir -p "$dir"
  for shard in $(ls "${first%-00001-of-*}"-*-of-*.gguf | head -n -1); do
    mv "$shard" "$dir/" && ln -s "$dir/$(basename "$shard")" "$shard"
  done
  ls -la "$(dirname "$first")" "$dir"
}

bench() {
  # llama-bench on GGUF for each --n-cpu-moe in $NCPUMOE (default 28,30,32,34,36), plus
  # `-ot exps=CPU` (every expert on the CPU) and, for each N in $NGL, the default layer split
  # `-ngl N` (N whole layers on the GPU, the rest on the CPU), flash attention on, prompt processing $PROMPTS
  # (default 512,4096,8192) and $GEN (default 64) generated tokens, batch and micro-batch
  # $UBATCH (default 4096), weights mapped from the file unless MMAP=0 (then loaded into
  # pinned host buffers: the GGUF must then live on a disk, not in /dev/shm beside them); each
  # run's peak GPU memory (nvidia-smi, every 200 ms) next to its JSON in $OUT.
  local gguf=$1 out=${OUT:-bench-out}; mkdir -p "$out"
  local load=mmap; [ "${MMAP:-1}" = 0 ] && load=none  # (this llama-bench: --load-mode, no -mmp)
  local common=(-m "$gguf" -fa 1 -p "${PROMPTS:-512,4096,8192}" -n "${GEN:-64}"
    -b "${UBATCH:-4096}" -ub "${UBATCH:-4096}" -r "${REPEAT:-2}" -lm "$load" -o json)
  local configs; configs="$(echo "${NCPUMOE:-28,30,32,34,36}" | tr ',' ' ') all"
  for n in $(echo "${NGL:-}" | tr ',' ' '); do configs="$configs ngl$n"; done
  configs=${CONFIGS:-$configs}  # or the list itself, e.g. CONFIGS="34 all ngl7"
  for n in $configs; do
    local args=(-ngl 99 --n-cpu-moe "$n")  # (-ngl is a list in llama-bench: given once)
    case "$n" in
      all) args=(-ngl 99 -ot "exps=CPU") ;;
      ngl*) args=(-ngl "${n#ngl}") ;;  # the default layer split: N whole layers on the GPU
    esac
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$out/mem_$n.txt" &
    local smi=$!
    timeout "${LIMIT:-600}" "$LLAMA/build/bin/llama-bench" "${common[@]}" "${args[@]}" \
      > "$out/llama_bench_$n.json" 2> "$out/llama_bench_$n.log" || echo "n-cpu-moe $n failed"
    kill "$smi" 2>/dev/null || true
    echo "n-cpu-moe $n: peak $(sort -n "$out/mem_$n.txt" | tail -1) MiB"
  done
  python3 "$HERE/summarize.py" "$out" | tee "$out/llama_bench_summary.txt"
}

case "${1:-}" in
  prepare) prepare "${2:-}" ;;
  build) build ;;
  export) export_gguf "${2:-}" "${3:-}" ;;
  spill) spill "${2:?the first shard}" "${3:?a directory on a disk}" ;;
  bench) bench "${2:?a GGUF file}" ;;
  *) echo "usage: $0 prepare [DIR] | build | export [MODEL] [GGUF] | spill GGUF DIR | bench GGUF" >&2; exit 2 ;;
esac
