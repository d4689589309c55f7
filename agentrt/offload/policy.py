"""Replacement policies of the expert cache, behind one small interface:
`touch(key)` on every use, `insert(key)` / `remove(key)` when a slot is filled / emptied,
`victim(resident, exclude)` to choose what to evict, `rank(keys)` to order candidates for copying
(most valuable first). Keys are (layer, expert)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

Key = tuple[int, int]


HALF_LIFE = 4096  # uses over which an LFU count fades to half (the default)


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
    """Frequency-aware: evict the resident expert used least often, ties to the least recent.
    Counts decay continuously with a half-life of `half_life` uses, so old favourites fade:
    instead of halving every count, each use adds a weight that grows by 2^(1/half_life) per
    use (the same order; counts and weight are scaled down together, rarely, before they
    overflow). A heap of (count, last use, key) entries finds the victim: counts only grow, so
    an entry never overstates its key, and `victim` refreshes an outdated one when it surfaces;
    a use costs two dictionary writes. An inserted key gets its entry at the first `victim`
    call that may choose it (the engine admits a layer's misses and then uses them: one entry
    instead of one outdated at once)."""

    name = "lfu"
    RESCALE_AT = 1e200  # the weight at which counts and weight are scaled down together

    def __init__(self, half_life: int = HALF_LIFE) -> None:
        super().__init__()
        self.count: dict[Key, float] = {}
        self.half_life = half_life
        self.growth = 2.0 ** (1.0 / half_life)
        self.weight = 1.0
        self.heap: list[tuple[float, int, Key]] = []
        self._taken: Key | None = None  # the last victim, whose entry `victim` took out
        self._fresh: list[Key] = []  # inserted keys without an entry yet

    def _entry(self, key: Key) -> tuple[float, int, Key]:
        return (self.count.get(key, 0.0), self.last_use.get(key, 0), key)

    def _rebuild(self) -> None:
        self.heap = [self._entry(k) for k in self.order]
        self._fresh = []
        heapq.heapify(self.heap)

    def touch(self, key: Key) -> None:
        self.clock += 1
        self.last_use[key] = self.clock
        self.count[key] = self.count.get(key, 0.0) + self.weight
        self.weight *= self.growth
        if self.weight > self.RESCALE_AT:
            self._rescale()

    def _rescale(self) -> None:
        """Scale every count and the weight down by the weight (order kept); forget counts
        that fall to nothing."""
        scale = self.weight
        self.count = {k: v / scale for k, v in self.count.items() if v / scale > 1e-12}
        self.weight = 1.0
        self._rebuild()

    def insert(self, key: Key) -> None:
        super().insert(key)
        self._fresh.append(key)  # (its entry is pushed by the first victim it may be)

    def _push_fresh(self, exclude: set[Key]) -> None:
        """Entries for the keys inserted since, but those in `exclude`, which stay for later
        (a key is admitted and then used in the same layer: one entry, after the use)."""
        later = []
        for key in self._fresh:
            if key in exclude:
                later.append(key)
            elif key in self.order:
                heapq.heappush(self.heap, self._entry(key))
        self._fresh = later

    def victim(self, exclude: set[Key]) -> Key | None:
        self._restore_taken()
        if self._fresh:
            self._push_fresh(exclude)
        skipped, found = [], None
        heap, last_use = self.heap, self.last_use  # (a use moves both count and last use)
        while heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if key not in self.order:
                continue  # stale: evicted since
            if entry[1] != last_use.get(key, 0):  # used since: back in at its present place
                heapq.heappush(heap, self._entry(key))
            elif key in exclude:
                skipped.append(entry)
            else:
                found = self._taken = key  # (its entry leaves with it: the caller evicts it)
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self.order) + 64:
            self._rebuild()
        return found

    def _restore_taken(self) -> None:
        """The last victim's entry back, where the caller kept it resident after all."""
        key, self._taken = self._taken, None
        if key is not None and key in self.order:
            heapq.heappush(self.heap, self._entry(key))

    def rank(self, keys: Iterable[Key]) -> list[Key]:
        return sorted(keys, key=lambda k: (-self.count.get(k, 0.0), -self.last_use.get(k, 0)))


POLICIES = {"lru": LRU, "lfu": LFU}
DEFAULT_POLICY = "lfu"  # the expert cache's (OffloadConfig.policy)
