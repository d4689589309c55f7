"""`ExpertCache`: one pool of device slots for experts of any layer, the `slot_of` table
(layer -> expert -> slot or -1), a replacement policy, and per-layer counters. The host store
stays the truth: evicting a slot loses nothing, nor does rebuilding the pool at another size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrt.offload.mxfp4_rows import unpack
from agentrt.offload.policy import DEFAULT_POLICY, POLICIES, Key
from agentrt.offload.store import ExpertStore


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    copied: int = 0
    cpu: int = 0
    evictions: int = 0
    prefetched: int = 0  # copied ahead on the previous layer's prediction
    prefetch_hits: int = 0  # of which this layer then routed to

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class ExpertCache:
    def __init__(
        self, store: ExpertStore, num_slots: int, device, policy: str = DEFAULT_POLICY
    ) -> None:
        self.store = store
        self.device = torch.device(device)
        self.slot_of = {layer: [-1] * store.num_experts for layer in store.layers}
        self.stats = {layer: LayerStats() for layer in store.layers}
        self.resizes = 0  # times the pool was rebuilt (elastic: KV took room from it)
        self.pending: list[Key] = []  # experts to copy back in after a resize (`refill`)
        self.refilled = 0  # experts `refill` copied back in
        self._new_pool(num_slots, policy)

    def _new_pool(self, num_slots: int, policy: str) -> None:
        """Empty slots, their owners and free list, and a fresh policy."""
        self.slots = torch.zeros(  # zeros: a slot read under weight 0 must hold finite numbers
            num_slots, self.store.expert_numel, dtype=self.store.storage_dtype, device=self.device
        )
        self.slot_rows = list(self.slots.unbind(0))  # one view per slot (no indexing per copy)
        self.owner: list[Key | None] = [None] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.policy = POLICIES[policy]()

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    def release(self) -> None:
        """Empty the pool and free its memory (every cached expert is dropped; the host store
        still holds them all). `resize` makes a new one."""
        self.resize(0)

    def resize(self, num_slots: int) -> None:
        """A new pool of `num_slots` empty slots in place of the current one, which is freed
        first (so the two never take memory at once). The policy starts afresh."""
        for row in self.slot_of.values():
            row[:] = [-1] * len(row)
        self.slots, self.slot_rows = None, []  # the old pool's memory goes back first
        while True:  # (memory short of the budget, another process's say: half as many slots)
            try:
                self._new_pool(num_slots, self.policy.name)
                break
            except torch.OutOfMemoryError:
                if num_slots == 0:
                    raise
                num_slots //= 2
        self.resizes += num_slots > 0  # (`release` alone, or with the new pool of `rebuild`: one)

    def ranked(self) -> list[Key]:
        """The resident experts, most valuable first (by the policy)."""
        return self.policy.rank(key for key in self.owner if key is not None)

    def rebuild(
        self, num_slots: int, between: Callable[[], None], failed: Callable[[], int] | None = None
    ) -> None:
        """A pool of `num_slots` in place of this one, with `between` (say, KV growing or
        shrinking) run after this pool's memory is freed and before the new one is made (the
        new one is made even if `between` fails: of `failed()` slots then, the room what
        `between` left allows, else `num_slots`); the experts worth keeping that fit are listed
        in `pending`, for `refill`."""
        keep = self.worth_keeping()
        self.release()
        done = False
        try:
            between()
            done = True
        finally:
            if not done and failed is not None:
                num_slots = failed()
            self.resize(num_slots)
            self.pending = keep[: self.num_slots]

    def worth_keeping(self) -> list[Key]:
        """What a resize should bring back: the experts still waiting for a refill (an earlier
        resize's), then the resident ones, most valuable first."""
        return list(dict.fromkeys([*self.pending, *self.ranked()]))

    def refill(self) -> int:
        """Copy in the experts listed in `pending` (say, those a resize dropped), from the host
        store on the current stream, least valuable first, each touched as it comes (the
        resize's fresh policy then ranks them as before: a later resize keeps the most valuable
        ones); returns how many were listed."""
        keys, self.pending = self.pending, []
        for layer, expert in reversed(keys):
            if self.slot_of[layer][expert] < 0:  # (else already back)
                slot = self.admit(layer, expert, exclude=set())
                if slot is None:
                    break
                on_gpu = self.device.type == "cuda"
                self.slot_rows[slot].copy_(self.store.flat[layer][expert], non_blocking=on_gpu)
                self.refilled += 1
            self.policy.touch((layer, expert))
        return len(keys)

    def lookup(self, layer: int, expert: int) -> int:
        return self.slot_of[layer][expert]

    def admit(self, layer: int, expert: int, exclude: set[Key]) -> int | None:
        """A slot for (layer, expert), evicting the policy's victim outside `exclude`; None if
        every slot is in use by `exclude`."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = self.policy.victim(exclude)
            if victim is None:
                return None
            slot = self.slot_of[victim[0]][victim[1]]
            self._evict(victim)
        self.owner[slot] = (layer, expert)
        self.slot_of[layer][expert] = slot
        self.policy.insert((layer, expert))
        return slot

    def drop(self, layer: int, expert: int) -> None:
        """Forget a just admitted expert whose copy could not be issued (its slot is free)."""
        slot = self.slot_of[layer][expert]
        if slot >= 0:
            self._evict((layer, expert))
            self.stats[layer].evictions -= 1  # (not a replacement)
            self.free.append(slot)

    def _evict(self, key: Key) -> None:
        layer, expert = key
        slot = self.slot_of[layer][expert]
        self.slot_of[layer][expert] = -1
        self.owner[slot] = None
        self.policy.remove(key)
        self.stats[layer].evictions += 1

    def gate_up(self, slot: int) -> torch.Tensor:
        s = self.store
        if s.packed:  # (dequantized: the plain path's view of a packed slot)
            return unpack(self.slots[slot : slot + 1], s.layout.gate_up, s.dtype)[0]
        return s.stacks(self.slots[slot : slot + 1])[0][0]

    def down(self, slot: int) -> torch.Tensor:
        s = self.store
        if s.packed:
            return unpack(self.slots[slot : slot + 1], s.layout.down, s.dtype)[0]
        return s.stacks(self.slots[slot : slot + 1])[1][0]

    def check(self) -> None:
        """Invariants (tests): owner and slot_of agree, free slots are unowned, policy matches."""
        resident = set()
        for slot, key in enumerate(self.owner):
            if key is not None:
                assert self.slot_of[key[0]][key[1]] == slot
                resident.add(key)
        for layer, row in self.slot_of.items():
            for expert, slot in enumerate(row):
                assert slot == -1 or self.owner[slot] == (layer, expert)
        assert all(self.owner[s] is None for s in self.free)
        assert set(self.policy.order) == resident
        assert len(resident) + len(self.free) == self.num_slots

    def hit_rate(self) -> float:
        hits = sum(s.hits for s in self.stats.values())
        total = hits + sum(s.misses for s in self.stats.values())
        return hits / total if total else 0.0
