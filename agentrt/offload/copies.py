"""Host -> device expert copies issued straight through the CUDA runtime (`cudaMemcpyAsync`
through ctypes), one call per expert, where torch's `copy_` from pinned memory costs several
times more host time per copy (dispatch, checks, and an event recorded for its pinned-memory
allocator, which the expert store's blocks, alive as long as the engine, do not need). An
offloaded decode issues ~5 such copies per MoE layer, 40 layers per token, each before the
layer's CPU experts can start.

`FastCopies.open(device, sample)` checks the path once (a copy of a real expert compared with
torch's) and returns None where the runtime library cannot be found or the check fails: callers
then use `torch._foreach_copy_`.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), if any."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.argtypes += [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return lib
    return None


class FastCopies:
    """Issues pinned-host -> device copies of whole contiguous tensors on a given stream."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device) -> None:
        self._memcpy = lib.cudaMemcpyAsync
        self.device = device

    @classmethod
    def open(cls, device, sample: torch.Tensor) -> FastCopies | None:
        """A checked instance for copies of tensors like `sample` (pinned, contiguous) to
        `device`, or None (no CUDA device, pageable memory, no runtime library, a failed check)."""
        device = torch.device(device)
        if device.type != "cuda" or not sample.is_pinned() or not sample.is_contiguous():
            return None
        lib = _cudart()
        if lib is None:
            return None
        fast = cls(lib, device)
        target = torch.empty_like(sample, device=device)
        try:
            fast.copy([target], [sample], torch.cuda.current_stream(device))
            torch.cuda.synchronize(device)
        except RuntimeError:
            return None
        return fast if torch.equal(target.cpu(), sample) else None

    def copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor], stream) -> None:
        """Queue `sources[i] -> targets[i]` (same sizes, contiguous) on `stream`."""
        handle = stream.cuda_stream
        for target, source in zip(targets, sources, strict=True):
            nbytes = source.numel() * source.element_size()
            err = self._memcpy(
                target.data_ptr(), source.data_ptr(), nbytes, _HOST_TO_DEVICE, handle
            )
            if err:
                raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {err}")
