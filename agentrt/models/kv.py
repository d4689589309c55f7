"""Per-layer state containers that model layers read and write during a forward pass.

`KVCache` holds one attention layer's keys and values (preallocated, grown in steps); `LinearCache`
holds one linear-attention layer's causal-conv state and fp32 recurrent state, plus the states it
captured at requested positions during the last prefill. The engine's `SequenceState` owns a list of
these (one per layer); a `Snapshot` is an independent copy of all of them after some number of
tokens (what the state cache stores and restores). Nothing here knows about sessions or storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentrt.models import per_pass


@dataclass
class KVCache:
    """Keys/values of one attention layer: `k`, `v` are `[num_kv_heads, capacity, head_dim]`."""

    k: torch.Tensor
    v: torch.Tensor
    grow_tokens: int = 1024

    @classmethod
    def empty(
        cls, num_kv_heads: int, head_dim: int, capacity: int, device, dtype, grow: int
    ) -> KVCache:
        shape = (num_kv_heads, capacity, head_dim)
        k = torch.zeros(shape, device=device, dtype=dtype)  # zeros: masked slots must stay finite
        return cls(k, torch.zeros_like(k), grow)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def grown_capacity(self, num_tokens: int) -> int:
        """The capacity `reserve(num_tokens, ...)` leaves (at least doubling, in whole steps)."""
        if num_tokens <= self.capacity:
            return self.capacity
        step = max(self.grow_tokens, 1)
        new_cap = max(num_tokens, 2 * self.capacity)
        return (new_cap + step - 1) // step * step

    def bytes_at(self, capacity: int) -> int:
        """Device bytes of keys and values at `capacity` positions."""
        return 2 * self.k.shape[0] * capacity * self.k.shape[2] * self.k.element_size()

    def reserve(self, num_tokens: int, used: int, capacity: int | None = None) -> None:
        """Make room for `num_tokens` positions, keeping the first `used` ones: `capacity` of
        them if given (at least `num_tokens`), else `grown_capacity`."""
        if num_tokens <= self.capacity:
            return
        new_cap = max(capacity, num_tokens) if capacity else self.grown_capacity(num_tokens)
        k = self.k.new_zeros((self.k.shape[0], new_cap, self.k.shape[2]))
        v = torch.zeros_like(k)
        k[:, :used].copy_(self.k[:, :used])
        v[:, :used].copy_(self.v[:, :used])
        self.k, self.v = k, v

    def shrink(self, capacity: int, used: int) -> None:
        """Down to `capacity` positions (new, smaller buffers), keeping the first `used` ones
        (at most `capacity`)."""
        if capacity >= self.capacity:
            return
        used = min(used, capacity)
        k = self.k.new_zeros((self.k.shape[0], capacity, self.k.shape[2]))
        v = torch.zeros_like(k)
        k[:, :used].copy_(self.k[:, :used])
        v[:, :used].copy_(self.v[:, :used])
        self.k, self.v = k, v

    def write(
        self, start: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[Hkv, T, D]` keys/values at `start`; return views of all `start + T` positions."""
        end = start + k_new.shape[1]
        self.reserve(end, start)
        self.k[:, start:end].copy_(k_new)
        self.v[:, start:end].copy_(v_new)
        return self.k[:, :end], self.v[:, :end]

    def write_at(self, start: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store `[Hkv, T, D]` at positions start.. given as a `[1]` device tensor (fixed shapes,
        CUDA-graph safe; capacity must already hold start + T positions)."""
        pos = per_pass.positions(start, k_new.shape[1])  # (shared by a pass's layers)
        self.k.index_copy_(1, pos, k_new)
        self.v.index_copy_(1, pos, v_new)


@dataclass
class LinearCache:
    """State of one linear-attention layer.

    `conv`: `[conv_dim, kernel-1]` last inputs of the causal conv (model dtype).
    `recurrent`: `[num_v_heads, k_head_dim, v_head_dim]` fp32.
    `captured`: absolute position -> (conv, recurrent) copies recorded during the last prefill.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # `[K, ...]` conv and recurrent states at the cuts of the last static pass that had cuts
    slots: tuple[torch.Tensor, torch.Tensor] | None = None
    # where every static pass puts them (one pair for all captured graphs: outputs of their own
    # would each stay allocated in the graphs' memory pool, ~120 MiB per graph at 35B shapes)
    slot_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def zeros(
        cls, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, device, dtype
    ) -> LinearCache:
        conv = torch.zeros((conv_dim, kernel - 1), device=device, dtype=dtype)
        rec = torch.zeros((heads, dk, dv), device=device, dtype=torch.float32)
        return cls(conv, rec)

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()
        self.captured.clear()


LayerCache = KVCache | LinearCache


@dataclass
class Snapshot:
    """State after `num_tokens` tokens: KV per attention layer, conv/recurrent per linear layer."""

    num_tokens: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # [Hkv, num_tokens, D] each
    conv: list[torch.Tensor]  # [conv_dim, K-1]
    recurrent: list[torch.Tensor]  # [Hv, dk, dv] fp32
    token_ids: tuple[int, ...]

    def num_bytes(self) -> int:
        tensors = [t for pair in self.kv for t in pair] + self.conv + self.recurrent
        return sum(t.numel() * t.element_size() for t in tensors)
