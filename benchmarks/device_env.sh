#!/usr/bin/env bash
# Sourced by the GPU scripts: install carried wheels (.whl/) into /tmp/site and set the
# environment agentrt runs under on the device machine. Sets OUT if unset.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export AGENTRT_HOME=/tmp/agentrt-home PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Triton's kernel cache (compiled kernels and fla's autotuning results): a fresh machine spends
# minutes compiling fla's kernels, so a carried `.triton-cache.tgz` (from a run's $OUT) seeds it;
# autotuning results are kept there too (then only the chosen configs compile)
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1; mkdir -p "$TRITON_CACHE_DIR"
if [ -f .triton-cache.tgz ] && [ ! -f "$TRITON_CACHE_DIR/.seeded" ]; then
  tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.seeded"
fi
