"""Host cost of the CUDA calls an offloaded decode step makes per MoE layer (CUDA only): what a
graph host step spends before its CPU experts can start. Prints JSON: microseconds per call
(median of 200), for a 6 MiB expert copy from pinned memory through torch's `copy_` and through
`cudaMemcpyAsync` called directly (ctypes, when libcudart is loaded), timing events, stream
waits and the stream context manager.

    python benchmarks/host_step_costs.py
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time

import torch

EXPERT_BYTES = 6 << 20


def per_call_us(fn, calls: int = 200) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return round(1e6 * statistics.median(samples), 2)


def libcudart():
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t]
            lib.cudaMemcpyAsync.argtypes += [ctypes.c_int, ctypes.c_void_p]
            return path, lib
        except (OSError, AttributeError):
            continue
    return None, None


def main() -> None:
    dev = torch.device("cuda")
    src = torch.empty(EXPERT_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(EXPERT_BYTES, dtype=torch.uint8, device=dev)
    side, current = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)

    def torch_copy() -> None:
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)

    out: dict[str, object] = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    out["copy_torch_us"] = per_call_us(torch_copy)
    out["copy_torch_in_context_us"] = per_call_us(lambda: dst.copy_(src, non_blocking=True))
    path, lib = libcudart()
    out["libcudart"] = path
    if lib is not None:
        args = (dst.data_ptr(), src.data_ptr(), EXPERT_BYTES, 1, side.cuda_stream)
        out["copy_cudart_us"] = per_call_us(lambda: lib.cudaMemcpyAsync(*args))
    out["event_new_record_us"] = per_call_us(lambda: torch.cuda.Event(enable_timing=True).record())
    event = torch.cuda.Event(enable_timing=True)
    out["event_reuse_record_us"] = per_call_us(lambda: event.record(side))
    out["wait_stream_us"] = per_call_us(lambda: current.wait_stream(side))

    def stream_context() -> None:
        with torch.cuda.stream(side):
            pass

    out["stream_context_us"] = per_call_us(stream_context)
    out["current_stream_us"] = per_call_us(lambda: torch.cuda.current_stream(dev))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
