"""Replacement policies of the expert cache, behind one small interface:
`touch(key)` on every use, `insert(key)` / `remove(key)` when a slot is filled / emptied,
`victim(resident, exclude)` to choose what to evict, `rank(keys)` to order candidates for copying
(most valuable first). Keys are (layer, expert)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

Key = tuple[int, int]


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()  # resident keys, least recent first
        self.last_use: dict[Key, int] = {}
        self.clock = 0

    def touch(self, key: Key) -> None:
        self.clock += 1
        self.last_use[key] = self.clock
        if key in self.order:
            self.order.move_to_end(key)

    def insert(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self, exclude: set[Key]) -> Key | None:
        return next((k for k in self.order if k not in exclude), None)

    def rank(self, keys: Iterable[Key]) -> list[Key]:
        return sorted(keys, key=lambda k: -self.last_use.get(k, 0))


class LFU(LRU):
    """Frequency-aware: evict the resident expert used least often (counts decay by half every
    `half_life` uses, so old favourites fade); ties go to the least recent. A heap of
    (count, last use, key) entries, invalidated lazily, keeps `victim` O(log n)."""

    name = "lfu"

    def __init__(self, half_life: int = 4096) -> None:
        super().__init__()
        self.count: dict[Key, float] = {}
        self.half_life = half_life
        self.heap: list[tuple[float, int, Key]] = []

    def _entry(self, key: Key) -> tuple[float, int, Key]:
        return (self.count.get(key, 0.0), self.last_use.get(key, 0), key)

    def _rebuild(self) -> None:
        self.heap = [self._entry(k) for k in self.order]
        heapq.heapify(self.heap)

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.count[key] = self.count.get(key, 0.0) + 1.0
        if self.clock % self.half_life == 0:
            self.count = {k: v / 2 for k, v in self.count.items() if v > 0.01}
            self._rebuild()
        elif key in self.order:
            heapq.heappush(self.heap, self._entry(key))

    def insert(self, key: Key) -> None:
        super().insert(key)
        heapq.heappush(self.heap, self._entry(key))

    def victim(self, exclude: set[Key]) -> Key | None:
        skipped, found = [], None
        while self.heap:
            entry = heapq.heappop(self.heap)
            key = entry[2]
            if key not in self.order or entry != self._entry(key):
                continue  # stale: evicted, used since, or counts decayed
            if key in exclude:
                skipped.append(entry)
                continue
            found = key
            skipped.append(entry)  # stays valid until `remove` makes it stale
            break
        for entry in skipped:
            heapq.heappush(self.heap, entry)
        if len(self.heap) > 4 * len(self.order) + 64:
            self._rebuild()
        return found

    def rank(self, keys: Iterable[Key]) -> list[Key]:
        return sorted(keys, key=lambda k: (-self.count.get(k, 0.0), -self.last_use.get(k, 0)))


POLICIES = {"lru": LRU, "lfu": LFU}
