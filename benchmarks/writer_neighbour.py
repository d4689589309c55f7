"""How much the state-cache writer's LMDB commits slow the threads computing beside them, with
LMDB writing through its shared map (`AGENTRT_STATE_WRITEMAP=1`) and through write(2) (the
default). A neighbour (torch bf16 matrix-vector products, as decode's CPU experts run, on all
cores but one) is timed alone, then beside a thread that frames and stores checkpoints of
qwen3.5-35b-a3b's linear-state size (~63 MB, random values, a new key each, 50 ms apart) in a
fresh state directory, each setting ROUNDS times, alternating. Prints JSON: the neighbour's
GB/s per run, its median share of the alone rate per setting, and seconds per checkpoint.

    python benchmarks/writer_neighbour.py [SECONDS] [ROUNDS]      (default 8 2)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from agentrt.env import set_all
from agentrt.statecache.codec import Record, pack_parts
from agentrt.statecache.store import Store

BLOB_FLOATS = 63 * 2**20 // 4


def neighbour(seconds: float) -> float:
    """GB/s of weights read by repeated bf16 matrix-vector products for `seconds`."""
    weights = torch.randn(4096, 4096).to(torch.bfloat16)
    x = torch.randn(4096).to(torch.bfloat16)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mv(weights, x)
        done += 1
    return done * weights.numel() * 2 / (time.perf_counter() - t0) / 1e9


def write_checkpoints(root: Path, stop: threading.Event, spent: list[float]) -> None:
    store = Store(root / "state", 16 * 2**30)
    states = list(torch.randn(BLOB_FLOATS).chunk(30))
    n = 0
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            blob = pack_parts(states)
            record = Record(b"fp", "bench", n, "message_end", [], len(blob), 0, 0.0, 0.0)
            store.put_checkpoint(b"k%d" % n, record, {}, blob)
            spent.append(time.perf_counter() - t0)
            n += 1
            time.sleep(0.05)
    finally:
        store.close()


def run(setting: str | None, seconds: float) -> dict:
    if setting is None:
        return {"rate": neighbour(seconds)}
    set_all({"AGENTRT_STATE_WRITEMAP": setting})
    stop, spent = threading.Event(), []
    with tempfile.TemporaryDirectory() as tmp:
        thread = threading.Thread(target=write_checkpoints, args=(Path(tmp), stop, spent))
        thread.start()
        rate = neighbour(seconds)
        stop.set()
        thread.join()
    return {"rate": rate, "checkpoints": len(spent), "s_per_checkpoint": statistics.mean(spent)}


def main(seconds: float = 8.0, rounds: int = 2) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    modes = {"alone": None, "writemap": "1", "write": "0"}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, setting in modes.items():
            runs[name].append(run(setting, seconds))
    alone = statistics.median(r["rate"] for r in runs["alone"])
    out = {
        "threads": torch.get_num_threads(),
        "neighbour_GBps": {name: [round(r["rate"], 2) for r in rs] for name, rs in runs.items()},
        "share_of_alone": {
            name: round(statistics.median(r["rate"] for r in rs) / alone, 3)
            for name, rs in runs.items()
        },
        "s_per_checkpoint": {
            name: round(statistics.mean(r["s_per_checkpoint"] for r in rs), 3)
            for name, rs in runs.items()
            if name != "alone"
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(*(float(a) if i == 0 else int(a) for i, a in enumerate(sys.argv[1:])))
