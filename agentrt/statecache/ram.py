"""The state cache's RAM tier: the payloads (KV chunks, record blobs) this process wrote
recently, as stored in LMDB (a restore reads both alike), bounded by bytes, least recently
used first out."""

from __future__ import annotations

import threading
from collections import OrderedDict


class RamTier:
    """LRU of decoded payloads (chunks and blobs), bounded by bytes, shared by threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, key: bytes):
        with self.lock:
            item = self.items.get(key)
            if item is None:
                return None
            self.items.move_to_end(key)
            return item[0]

    def put(self, key: bytes, value: object, size: int) -> None:
        if size > self.max_bytes:
            return
        with self.lock:
            if key in self.items:
                self.bytes -= self.items.pop(key)[1]
            self.items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.bytes -= self.items.popitem(last=False)[1][1]

    def drop(self, key: bytes) -> None:
        with self.lock:
            item = self.items.pop(key, None)
            if item is not None:
                self.bytes -= item[1]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
