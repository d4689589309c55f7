"""The few CUDA runtime calls an offloaded decode's host step makes per MoE layer, issued straight
through `libcudart` (ctypes) on raw stream and event handles: expert copies host -> device
(`cudaMemcpyAsync`), event records, queries and stream waits. Through torch they cost several
times more host time (measured on the H200 machine by `benchmarks/host_step_costs.py`: a pinned
6 MiB copy 28.5 us in a stream context, 4.7 us direct; `current_stream` 8.9 us; a stream context
15.9 us; `wait_stream` 6.3 us), and a host step spends it before the layer's CPU experts start,
40 times per token. torch's `copy_` also records an event for its pinned-memory allocator, which
the expert store's blocks, alive as long as the engine, do not need.

`CudaCalls.open(device, sample)` checks the path once (a copy of a real expert compared with
torch's) and returns None where the runtime library cannot be found or the check fails: callers
then use torch's calls.
"""

from __future__ import annotations

import ctypes

import torch

from agentrt.host.libs import loaded_libraries

HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice
_DISABLE_TIMING = 2  # cudaEventDisableTiming
_NOT_READY = 600  # cudaErrorNotReady (a query's answer, not a failure)
_SIGNATURES = {  # argument types of the calls used (all return a cudaError_t)
    "cudaMemcpyAsync": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    + [ctypes.c_void_p],
    "cudaEventCreateWithFlags": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
    "cudaEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
    "cudaStreamWaitEvent": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint],
    "cudaEventQuery": [ctypes.c_void_p],
    "cudaGetLastError": [],
}


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), with argument types set."""
    for path in loaded_libraries("libcudart"):
        try:
            lib = ctypes.CDLL(path)
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
        except (OSError, AttributeError):
            continue
        return lib
    return None


class CudaCalls:
    """Copies, events and waits on raw handles (`torch.cuda.Stream.cuda_stream` ints)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._memcpy = lib.cudaMemcpyAsync

    @classmethod
    def open(cls, device, sample: torch.Tensor) -> CudaCalls | None:
        """A checked instance for copies of tensors like `sample` (pinned, contiguous) to
        `device`, or None (no CUDA device, pageable memory, no runtime library, a failed check,
        or a device that is not the current one: events are created, and stream handle 0
        means, the current device's)."""
        device = torch.device(device)
        if device.type != "cuda" or not sample.is_pinned() or not sample.is_contiguous():
            return None
        if device.index is not None and device.index != torch.cuda.current_device():
            return None
        lib = _cudart()
        if lib is None:
            return None
        calls = cls(lib)
        target = torch.empty_like(sample, device=device)
        try:
            stream = torch.cuda.current_stream(device).cuda_stream
            event = calls.new_event()
            calls.copy([target], [sample], stream)
            calls.record(event, stream)
            calls.wait(stream, event)
            torch.cuda.synchronize(device)
        except (RuntimeError, ctypes.ArgumentError):
            return None
        return calls if torch.equal(target.cpu(), sample) else None

    def copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor], stream: int) -> None:
        """Queue `sources[i] -> targets[i]` (same sizes, contiguous) on `stream`."""
        for target, source in zip(targets, sources, strict=True):
            nbytes = source.numel() * source.element_size()
            self.copy_bytes(target.data_ptr(), source.data_ptr(), nbytes, stream)

    def copy_bytes(
        self, target: int, source: int, nbytes: int, stream: int, kind: int = HOST_TO_DEVICE
    ) -> None:
        """Queue a copy of `nbytes` bytes between raw addresses on `stream` (`kind`:
        `HOST_TO_DEVICE` from pinned memory, or `DEVICE_TO_DEVICE`)."""
        self._check(self._memcpy(target, source, nbytes, kind, stream))

    def new_event(self) -> int:
        """A new event without timing (never destroyed: a few per engine)."""
        handle = ctypes.c_void_p()
        self._check(self._lib.cudaEventCreateWithFlags(ctypes.byref(handle), _DISABLE_TIMING))
        return handle.value

    def record(self, event: int, stream: int) -> None:
        self._check(self._lib.cudaEventRecord(event, stream))

    def done(self, event: int) -> bool:
        """Whether the work before `event`'s last record has finished."""
        err = self._lib.cudaEventQuery(event)
        if err == _NOT_READY:
            self._lib.cudaGetLastError()  # (the runtime keeps it as the thread's last error)
            return False
        self._check(err)
        return True

    def wait(self, stream: int, event: int) -> None:
        """Work queued on `stream` from now on waits for `event`'s last record."""
        self._check(self._lib.cudaStreamWaitEvent(stream, event, 0))

    def _check(self, err: int) -> None:
        """Raise on a failed call, after clearing the thread's last CUDA error (torch's next
        launch check would otherwise report it against an unrelated kernel)."""
        if err:
            self._lib.cudaGetLastError()
            raise RuntimeError(f"CUDA runtime call failed with error {err}")
