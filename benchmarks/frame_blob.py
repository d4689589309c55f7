"""Framing one checkpoint blob of qwen3.5-35b-a3b's linear-state size (~63 MB of random fp32
states in 30 tensors, on the writer's 4 compression threads, as `pack_parts` runs in the
writer) with the raw-or-zstd sample as it is (windows spread over each payload) and with the
earlier sample (each payload's first 1 MiB) patched in, ROUNDS rounds alternating, REPEAT
blobs each. Prints JSON: median milliseconds per blob for each, per round.

    python benchmarks/frame_blob.py [ROUNDS] [REPEAT]      (default 3 6)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from agentrt.host.cputhreads import keep_freed_buffers
from agentrt.statecache import codec


def _first_mib(views) -> bytes:
    return bytes(views[0][: 1 << 20]) if views else b""


def median_ms(states: list[torch.Tensor], pool, repeat: int) -> float:
    codec.pack_parts(states, pool=pool)  # (first touch of the buffers)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        codec.pack_parts(states, pool=pool)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 1)


def main(rounds: int = 3, repeat: int = 6) -> None:
    keep_freed_buffers()  # (as the state cache does)
    states = list(torch.randn(63 * 2**20 // 4).chunk(30))
    samples = {"windows": codec._sample, "first_1MiB": _first_mib}
    out: dict[str, list[float]] = {name: [] for name in samples}
    with ThreadPoolExecutor(4) as pool:
        for _ in range(rounds):
            for name, sample in samples.items():
                codec._sample = sample
                out[name].append(median_ms(states, pool, repeat))
    codec._sample = samples["windows"]
    print(json.dumps({"ms_per_blob": out}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
