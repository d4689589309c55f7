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
