"""Start-up time of `Runtime.open` per phase, with or without prefill graphs, and the time of
each prefill-graph capture (its eager warm-up and its recording) on one CUDA device.

Usage: python benchmarks/startup_probe.py on|off [MODEL] [OUT.json]
(MODEL default synthetic:qwen3.5-35b-a3b). One mode per process, so that neither run inherits the
other's warmed kernels; run `off` once first on a fresh machine so both find Triton's kernel
cache warm. Prints JSON.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from agentrt import Runtime
from agentrt.engine import cuda_graph


def _timed_captures(log: list[dict]) -> None:
    """Wrap the warm-up and the recording of each prefill-graph capture with timers."""
    warm, record = cuda_graph._warm_up, cuda_graph.PrefillGraphs._record

    def timed_warm(state, device, step):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        warm(state, device, step)
        torch.cuda.synchronize()
        log.append({"phase": "warm_up", "s": round(time.perf_counter() - t0, 4)})

    def timed_record(self, step):
        t0 = time.perf_counter()
        out = record(self, step)
        torch.cuda.synchronize()
        log.append({"phase": "record", "s": round(time.perf_counter() - t0, 4)})
        return out

    cuda_graph._warm_up = timed_warm
    cuda_graph.PrefillGraphs._record = timed_record


def main(graphs: bool, model: str, out: str | None) -> None:
    log: list[dict] = []
    _timed_captures(log)
    t0 = time.perf_counter()
    rt = Runtime.open(model, "cuda", prefill_graphs=graphs, cache="off")
    run = {"model": model, "prefill_graphs": graphs, "open_s": round(time.perf_counter() - t0, 3)}
    run["phases"] = rt.startup
    if graphs:
        warm = [e["s"] for e in log if e["phase"] == "warm_up"]
        rec = [e["s"] for e in log if e["phase"] == "record"]
        run["captures"] = len(rec)
        run["warm_up_s"] = [round(sum(warm), 3), warm]
        run["record_s"] = [round(sum(rec), 3), rec]
    rt.close()
    print(json.dumps(run), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(run, f, indent=2)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] not in ("on", "off"):
        sys.exit(__doc__)
    model = args[1] if len(args) > 1 else "synthetic:qwen3.5-35b-a3b"
    main(args[0] == "on", model, args[2] if len(args) > 2 else None)
