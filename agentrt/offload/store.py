"""`ExpertStore`: every routed expert in host memory, one contiguous block per expert
(gate_up rows, then down), so that one expert is one copy. Pinned when the host allows it;
otherwise pageable, with a warning. Experts with biases (gpt-oss) keep them beside the blocks,
per layer (a few MB: they live on every device that computes experts, `biases`), and the
store names the experts' activation (`act`).

A packed store (`packed=True`) keeps each expert MXFP4 as one uint8 row (`mxfp4_rows.RowLayout`:
17/32 of a byte per weight), so copies, slots and staging carry the packed bytes; `dtype` is
then the dtype experts compute in, and the per-expert weights the CPU side reads
(`expert_views`) are dequantized on access."""

from __future__ import annotations

import functools
import sys
import time

import torch

from agentrt.models.moe import PLAIN, RoutedExperts, SwiGLU
from agentrt.models.mxfp4 import quantize
from agentrt.offload.mxfp4_rows import RowLayout, unpack, write_part


class ExpertStore:
    """`flat[layer]` is `[E, 3*I*H]` (packed: `[E, row_bytes]` uint8); `gate_up(layer)` /
    `down(layer)` are views of it (packed: dequantized copies)."""

    def __init__(
        self,
        layers,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        pin: bool,
        bias: bool = False,
        act: SwiGLU = PLAIN,
        packed: bool = False,
    ) -> None:
        self.hidden, self.inter, self.num_experts, self.dtype = hidden, inter, num_experts, dtype
        self.layout = RowLayout(hidden, inter) if packed else None
        self.pinned = pin
        self.act = act
        self.flat: dict[int, torch.Tensor] = {}
        # layer -> (gate_up bias [E, 2I], down bias [E, H]) on the host, and their copies on
        # other devices
        self.bias: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        if bias:
            self.bias = {
                layer: (
                    torch.zeros(num_experts, 2 * inter, dtype=dtype),
                    torch.zeros(num_experts, hidden, dtype=dtype),
                )
                for layer in layers
            }
        self._bias_on: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # per-expert views, built once per layer (indexing per use costs more on the host than
        # launching the copy or kernel that uses the view)
        self._views: dict[int, tuple[list[torch.Tensor], ...]] = {}
        for layer in layers:
            self.flat[layer] = self._alloc((num_experts, self.expert_numel), self.storage_dtype)

    def _alloc(self, shape, dtype) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError as exc:  # e.g. a locked-memory limit
                self.pinned = False
                out = torch.empty(shape, dtype=dtype)
                print(
                    f"agentrt: pinning host memory failed ({exc}); experts stay pageable: "
                    f"{_pageable_cost(out[0])}",
                    file=sys.stderr,
                )
                return out
        return torch.empty(shape, dtype=dtype)

    @classmethod
    def for_config(cls, cfg, dtype: torch.dtype, pin: bool, packed: bool = False) -> ExpertStore:
        """An empty store for the routed experts of a model of `ModelConfig` `cfg`."""
        from agentrt.models import expert_activation

        return cls(
            cfg.moe_layers,
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            dtype,
            pin,
            bias=cfg.expert_bias,
            act=expert_activation(cfg),
            packed=packed,
        )

    @property
    def layers(self) -> list[int]:
        return sorted(self.flat)

    @property
    def plain(self) -> bool:
        """Bias-free SwiGLU experts in bf16 rows (what the native CPU kernel computes)."""
        return self.bias is None and self.act == PLAIN and not self.packed

    def biases(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`layer`'s (gate_up, down) biases on `device` (copied there once), or None."""
        if self.bias is None:
            return None
        device = torch.device(device)
        if device.type == "cpu":
            return self.bias[layer]
        key = (str(device), layer)
        if key not in self._bias_on:
            self._bias_on[key] = tuple(b.to(device) for b in self.bias[layer])
        return self._bias_on[key]

    def expert_biases(self, layer: int, expert: int, device) -> tuple:
        """One expert's (gate_up, down) biases on `device`, or () without biases."""
        both = self.biases(layer, device)
        return () if both is None else (both[0][expert], both[1][expert])

    @property
    def packed(self) -> bool:
        return self.layout is not None

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of `flat` (and of the device slots and staging that copy it)."""
        return torch.uint8 if self.packed else self.dtype

    @property
    def expert_numel(self) -> int:
        """Elements of `storage_dtype` per expert."""
        return self.layout.row_bytes if self.packed else 3 * self.inter * self.hidden

    @functools.cached_property
    def expert_bytes(self) -> int:
        """Bytes per expert (fixed at construction; cached: the host step asks often)."""
        return self.expert_numel * self.storage_dtype.itemsize

    def stacks(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked expert rows `[n, 3*I*H]` (a layer's, slots', a staging buffer's) as the
        stacks `gate_up [n, 2I, H]` and `down [n, H, I]` (views)."""
        n, split = rows.shape[0], 2 * self.inter * self.hidden
        gate_up = rows[:, :split].view(n, 2 * self.inter, self.hidden)
        return gate_up, rows[:, split:].view(n, self.hidden, self.inter)

    def gate_up(self, layer: int) -> torch.Tensor:
        if self.packed:
            return unpack(self.flat[layer], self.layout.gate_up, self.dtype)
        return self.stacks(self.flat[layer])[0]

    def down(self, layer: int) -> torch.Tensor:
        if self.packed:
            return unpack(self.flat[layer], self.layout.down, self.dtype)
        return self.stacks(self.flat[layer])[1]

    def expert_views(self, layer: int) -> tuple[list[torch.Tensor], ...]:
        """(flat block, gate_up, down) of each expert of `layer`, as lists indexed by expert."""
        views = self._views.get(layer)
        if views is None and self.packed:
            rows = self.flat[layer]
            views = self._views[layer] = (
                list(rows.unbind(0)),
                _Unpacked(rows, self.layout.gate_up, self.dtype),
                _Unpacked(rows, self.layout.down, self.dtype),
            )
        if views is None:
            views = self._views[layer] = tuple(
                list(t.unbind(0)) for t in (self.flat[layer], self.gate_up(layer), self.down(layer))
            )
        return views

    def put_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Set `layer`'s experts from `[E, 2I, H]` and `[E, H, I]` weights (packed: rounded to
        MXFP4 and packed, expert by expert)."""
        if not self.packed:
            self.gate_up(layer).copy_(gate_up)
            self.down(layer).copy_(down)
            return
        self.put_part(layer, self.layout.gate_up, gate_up)
        self.put_part(layer, self.layout.down, down)

    def put_part(self, layer: int, part, weights: torch.Tensor) -> None:
        """One matrix of every packed expert of `layer` (`weights [E, rows, cols]`), rounded to
        MXFP4, a few experts at a time (the temporaries stay small)."""
        for begin in range(0, self.num_experts, 8):
            rows = self.flat[layer][begin : begin + 8]
            write_part(rows, part, *quantize(weights[begin : begin + 8]))

    def as_routed(self) -> RoutedExperts:
        """Views shaped like `RoutedExperts` (the loader fills the store through them; not for
        a packed store, which `put_layer` or the loader's packed path fills)."""
        if self.packed:
            raise ValueError("a packed expert store has no bf16 views to fill")
        gate_up = {layer: self.gate_up(layer) for layer in self.layers}
        down = {layer: self.down(layer) for layer in self.layers}
        if self.bias is None:
            return RoutedExperts(gate_up, down, act=self.act)
        up_bias = {layer: pair[0] for layer, pair in self.bias.items()}
        down_bias = {layer: pair[1] for layer, pair in self.bias.items()}
        return RoutedExperts(gate_up, down, up_bias, down_bias, act=self.act)

    @classmethod
    def from_routed(cls, routed: RoutedExperts, pin: bool, packed: bool = False) -> ExpertStore:
        first = next(iter(routed.gate_up.values()))
        num_experts, two_inter, hidden = first.shape
        biased = routed.gate_up_bias is not None
        store = cls(
            sorted(routed.gate_up),
            num_experts,
            hidden,
            two_inter // 2,
            first.dtype,
            pin,
            bias=biased,
            act=routed.act,
            packed=packed,
        )
        for layer in store.layers:
            store.put_layer(layer, routed.gate_up[layer], routed.down[layer])
            if biased:
                store.bias[layer][0].copy_(routed.gate_up_bias[layer])
                store.bias[layer][1].copy_(routed.down_bias[layer])
        return store


class _Unpacked:
    """One matrix of each packed expert row of a layer, dequantized when indexed by expert."""

    def __init__(self, rows: torch.Tensor, part, dtype: torch.dtype) -> None:
        self.rows, self.part, self.dtype = rows, part, dtype

    def __getitem__(self, expert: int) -> torch.Tensor:
        return unpack(self.rows[expert : expert + 1], self.part, self.dtype)[0]

    def __len__(self) -> int:
        return self.rows.shape[0]


def _pageable_cost(block: torch.Tensor) -> str:
    """Measured host->GPU bandwidth of one expert from pageable memory (the cost of not pinning)."""
    if not torch.cuda.is_available():
        return "no GPU, nothing lost"
    dest = torch.empty_like(block, device="cuda")
    dest.copy_(block)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dest.copy_(block)
    torch.cuda.synchronize()
    gbps = 5 * block.numel() * block.element_size() / (time.perf_counter() - t0) / 1e9
    return f"copies run at {gbps:.1f} GB/s from pageable memory"
