"""Pinned host staging for checkpoint copies: one page-locked buffer allocated once, handed out
first-in first-out, shared by the cache objects of a process. A writer thread finishes jobs in
queue order, so regions are mostly freed in the order they were taken and a ring suffices (a
region freed out of order is reclaimed once those before it are). A request that does not fit
gets None (the caller then copies into ordinary memory)."""

from __future__ import annotations

import threading
from collections import deque

import torch

_ALIGN = 256


class PinnedRing:
    _shared: dict[int, PinnedRing] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, num_bytes: int) -> PinnedRing:
        """The process's ring of this size: page-locking gigabytes takes a while and stalls other
        CUDA calls, so it happens once per process, not once per cache object (a runtime that
        switches cache modes, a benchmark that runs several)."""
        with cls._shared_lock:
            ring = cls._shared.get(num_bytes)
            if ring is None:
                ring = cls._shared[num_bytes] = cls(num_bytes)
            return ring

    def __init__(self, num_bytes: int) -> None:
        self.capacity = num_bytes
        self.buffer: torch.Tensor | None = None
        self.live: deque[tuple[int, int]] = deque()
        self.lock = threading.Lock()
        self.ready = threading.Event()
        threading.Thread(target=self._allocate, name="agentrt-pin", daemon=True).start()

    def _allocate(self) -> None:
        try:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # page-locking refused (limits): stay unpinned, callers fall back
            self.buffer = None
        self.ready.set()

    @property
    def usable(self) -> bool:
        """Allocated and page-locked (so a failed `alloc` means: full)."""
        return self.ready.is_set() and self.buffer is not None

    def alloc(self, num_bytes: int) -> tuple[int, int] | None:
        """A free region of `num_bytes` (aligned), or None when the ring is full or not ready."""
        if not self.usable:
            return None
        size = -(-num_bytes // _ALIGN) * _ALIGN
        with self.lock:
            start = self._place(size)
            if start is None:
                return None
            self.live.append((start, start + size))
            return start, start + size

    def _place(self, size: int) -> int | None:
        if not self.live:
            return 0 if size <= self.capacity else None
        first, last_end = self.live[0][0], self.live[-1][1]
        if last_end > first:  # occupied span [first, last_end): room after it, or wrap to 0
            if last_end + size <= self.capacity:
                return last_end
            return 0 if size <= first else None
        return last_end if last_end + size <= first else None  # wrapped: room between

    def free(self, region: tuple[int, int]) -> None:
        with self.lock:
            if self.live and self.live[0] == region:
                self.live.popleft()
            else:  # out of order (a restore, another cache's writer): drop it where it is
                self.live.remove(region)

    def held_share(self) -> float:
        """The share of the ring its live regions hold."""
        with self.lock:
            return sum(end - start for start, end in self.live) / max(self.capacity, 1)

    def views(self, region: tuple[int, int], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped like `tensors`, laid out one after another inside `region`."""
        out, offset = [], region[0]
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            view = self.buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
            out.append(view)
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return out

    @staticmethod
    def span(tensors: list[torch.Tensor]) -> int:
        return sum(-(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN for t in tensors)
