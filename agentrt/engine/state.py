"""`SequenceState`: everything the model remembers about one sequence, and its snapshots.

Per attention layer a `KVCache`; per linear-attention layer a `LinearCache` (conv state and fp32
recurrent state, plus states captured at requested positions during prefill). `export(pos)` makes
an independent `Snapshot` of the state after `pos` tokens (any pos for attention-only models; for
hybrid models pos must be the current length or a captured position); `import_` restores one.
The state knows token ids only, never text, and nothing about storage.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from agentrt.models.config import ModelConfig
from agentrt.models.kv import KVCache, LayerCache, LinearCache, Snapshot


def new_layer_caches(
    cfg: ModelConfig,
    device,
    dtype: torch.dtype,
    capacity: int,
    grow: int,
    host_layers: frozenset[int] = frozenset(),
) -> list[LayerCache]:
    """One cache per layer on `device`; layers in `host_layers` (run on the CPU) keep theirs in
    host memory."""
    caches: list[LayerCache] = []
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim = 2 * key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    main = device
    for layer in range(cfg.num_layers):
        device = "cpu" if layer in host_layers else main
        if layer in cfg.attention_layers:
            caches.append(
                KVCache.empty(cfg.num_kv_heads, cfg.head_dim, capacity, device, dtype, grow)
            )
        else:
            caches.append(
                LinearCache.zeros(
                    conv_dim,
                    cfg.linear_conv_kernel_dim,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                    device,
                    dtype,
                )
            )
    return caches


@dataclass
class SequenceState:
    """The live state of one sequence on the engine's device."""

    cfg: ModelConfig
    caches: list[LayerCache]
    token_ids: list[int] = field(default_factory=list)
    # captures the last prefill took earlier than asked (see `Engine.capture_grid`):
    # asked position -> the position whose state was captured for it
    moved: dict[int, int] = field(default_factory=dict)
    # the shortest prefix the state can be cut back to: after a restore, sliding-window layers
    # hold only the restored window (below it, another sequence's KV), so a prefix that ends
    # earlier than one position before the restored end would attend to stale keys
    floor: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def kv_caches(self) -> list[KVCache]:
        return [c for c in self.caches if isinstance(c, KVCache)]

    def linear_caches(self) -> list[LinearCache]:
        return [c for c in self.caches if isinstance(c, LinearCache)]

    def captured_positions(self) -> list[int]:
        linear = self.linear_caches()
        return sorted(linear[0].captured) if linear else []

    def can_export(self, pos: int) -> bool:
        if not 0 <= pos <= self.num_tokens or 0 < pos < self.floor:
            return False
        return (
            pos == self.num_tokens or not self.linear_caches() or pos in self.captured_positions()
        )

    def capture_position(self, pos: int) -> int:
        """Where the state captured for a capture asked at `pos` is: `pos`, or a position up to
        63 tokens before it on the last eager prefill's chunk grid."""
        return self.moved.get(pos, pos)

    def capture_for(self, pos: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """(where, conv states, recurrent states) of the capture asked at `pos` (see
        `capture_position`; what `StateCache.save(..., conv, rec, at=where)` takes)."""
        at = self.capture_position(pos)
        return (at, *self.linear_at(at))

    def record_capture(self, pos: int) -> None:
        """Record the current linear states as the capture at `pos` (the current length)."""
        for cache in self.linear_caches():
            cache.captured[pos] = (cache.conv.clone(), cache.recurrent.clone())

    def record_slot(self, pos: int, slots: list[tuple[torch.Tensor, torch.Tensor]], j: int) -> None:
        """Record cut `j` of a static pass (per linear layer: stacked conv and recurrent states,
        `LinearCache.slots`) as the capture at `pos`."""
        for cache, (conv, rec) in zip(self.linear_caches(), slots, strict=True):
            cache.captured[pos] = (conv[j].clone(), rec[j].clone())

    def linear_at(self, pos: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Conv and recurrent states after `pos` tokens (live tensors: copy before mutating)."""
        linear = self.linear_caches()
        if pos == self.num_tokens:
            return [c.conv for c in linear], [c.recurrent for c in linear]
        if linear and pos not in linear[0].captured:
            raise ValueError(f"no linear state captured at position {pos}")
        return [c.captured[pos][0] for c in linear], [c.captured[pos][1] for c in linear]

    @torch.inference_mode()
    def export(self, pos: int | None = None) -> Snapshot:
        """An independent copy of the state after the first `pos` tokens (default: all)."""
        pos = self.num_tokens if pos is None else pos
        if not self.can_export(pos):
            raise ValueError(
                f"no state at position {pos} (length {self.num_tokens}, "
                f"captured {self.captured_positions()})"
            )
        kv = [(c.k[:, :pos].clone(), c.v[:, :pos].clone()) for c in self.kv_caches()]
        conv, rec = self.linear_at(pos)
        conv, rec = [c.clone() for c in conv], [r.clone() for r in rec]
        return Snapshot(pos, kv, conv, rec, tuple(self.token_ids[:pos]))

    @torch.inference_mode()
    def import_(self, snap: Snapshot) -> None:
        """Replace the whole state by `snap` (copied onto this state's device/dtype)."""
        if len(snap.token_ids) != snap.num_tokens:
            raise ValueError("snapshot token ids do not match its length")
        for cache, (k, v) in zip(self.kv_caches(), snap.kv, strict=True):
            cache.reserve(snap.num_tokens, 0)
            cache.k[:, : snap.num_tokens].copy_(k, non_blocking=True)
            cache.v[:, : snap.num_tokens].copy_(v, non_blocking=True)
        for cache, conv, rec in zip(self.linear_caches(), snap.conv, snap.recurrent, strict=True):
            cache.conv.copy_(conv, non_blocking=True)
            cache.recurrent.copy_(rec, non_blocking=True)
            cache.captured.clear()
        self.token_ids = list(snap.token_ids)
        self.floor = 0  # (every position's KV came with it)

    def adopt(self, token_ids: Sequence[int]) -> None:
        """Declare that the caches now hold the state after `token_ids` (filled externally: a
        restore, whose sliding-window layers got only the last window; see `floor`)."""
        self.token_ids = list(token_ids)
        self.floor = max(0, len(token_ids) - 1) if self.cfg.sliding_layers else 0
        self.clear_captures()

    @torch.inference_mode()
    def truncate(self, pos: int) -> None:
        """Keep the first `pos` tokens (only where a state at `pos` exists), in place: KV is cut
        back, linear-attention state comes from the capture at `pos`; captures at or before
        `pos` stay valid."""
        if pos == self.num_tokens:
            return
        if not self.can_export(pos):
            raise ValueError(
                f"no state at position {pos} (length {self.num_tokens}, "
                f"captured {self.captured_positions()})"
            )
        conv, rec = self.linear_at(pos)
        for cache, c, r in zip(self.linear_caches(), conv, rec, strict=True):
            cache.conv.copy_(c)
            cache.recurrent.copy_(r)
            for p in [p for p in cache.captured if p > pos]:
                del cache.captured[p]
        self.token_ids = self.token_ids[:pos]
        self.floor = min(self.floor, pos)  # (0: nothing left that an earlier restore wrote)

    @torch.inference_mode()
    def reset(self) -> None:
        for cache in self.linear_caches():
            cache.reset()
        self.token_ids = []
        self.floor = 0

    @contextmanager
    def passes(self, keep: type[BaseException] | tuple[type[BaseException], ...] = ()) -> Iterator:
        """Around model passes that update this state in place before their tokens are added:
        one that raises (out of memory, say; anything but `keep`, raised between passes) may
        have advanced the linear-attention layers past the state's tokens, so a hybrid state is
        emptied (no later request may reuse it); attention-only state stays (KV past its tokens
        is never read)."""
        try:
            yield
        except keep:
            raise
        except BaseException:
            if self.linear_caches():
                self.reset()
            self.clear_captures()
            raise

    def clear_captures(self) -> None:
        self.moved.clear()
        for cache in self.linear_caches():
            cache.captured.clear()
