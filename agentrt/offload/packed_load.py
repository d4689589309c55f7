"""`PackedSink`: where a model's routed experts load when the host store keeps them MXFP4-packed.

It stands in for the model's `RoutedExperts` while the weights load (the offload engine replaces
it once they are in): an MXFP4 checkpoint's `_blocks` / `_scales` pairs go straight into the
store's rows (`put_mxfp4`: no dequantization, no unpacked copy), a synthetic model's experts are
drawn packed (`fill_synthetic`), and unpacked weights (a bf16 checkpoint) land in host stacks
made on first use, rounded to MXFP4 and packed as each layer completes (`layer_loaded`, which
the loader calls) or at `finish`. Biases load into the store's own.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import torch

from agentrt.errors import ModelFormatError
from agentrt.models.moe import RoutedExperts
from agentrt.models.mxfp4 import BLOCK
from agentrt.offload.mxfp4_rows import synthetic_rows, write_part
from agentrt.offload.store import ExpertStore


class _Stacks(MutableMapping):
    """layer -> an unpacked `[E, rows, cols]` host stack, made when first asked for (every layer
    of the store is a key from the start, as in `RoutedExperts`)."""

    def __init__(self, store: ExpertStore, rows: int, cols: int) -> None:
        self.store, self.shape = store, (store.num_experts, rows, cols)
        self.made: dict[int, torch.Tensor] = {}

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self.store.flat:
            raise KeyError(layer)
        if layer not in self.made:
            self.made[layer] = torch.empty(self.shape, dtype=self.store.dtype)
        return self.made[layer]

    def __setitem__(self, layer: int, value: torch.Tensor) -> None:
        self.made[layer] = value

    def __delitem__(self, layer: int) -> None:
        self.made.pop(layer, None)

    def __iter__(self) -> Iterator[int]:
        return iter(self.store.layers)

    def __len__(self) -> int:
        return len(self.store.flat)

    def __contains__(self, layer: object) -> bool:
        return layer in self.store.flat


class PackedSink(RoutedExperts):
    """The loading side of a packed `ExpertStore` (see the module docstring)."""

    def __init__(self, store: ExpertStore) -> None:
        h, i = store.hidden, store.inter
        biases = (None, None)
        if store.bias is not None:
            biases = tuple({layer: pair[k] for layer, pair in store.bias.items()} for k in (0, 1))
        super().__init__(_Stacks(store, 2 * i, h), _Stacks(store, h, i), *biases, act=store.act)
        self.store = store
        self.direct: set[tuple[int, str]] = set()  # (layer, part) written packed

    def put_mxfp4(self, layer: int, kind: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """A checkpoint's MXFP4 pair of `layer` (`kind` gate_up_proj or down_proj), rows in the
        store's order (`[E, rows, G, 16]` codes, `[E, rows, G]` exponents), into the rows."""
        name = "gate_up" if kind == "gate_up_proj" else "down"
        part = getattr(self.store.layout, name)
        want = (self.store.num_experts, part.rows, part.groups)
        if tuple(scales.shape) != want or tuple(blocks.shape) != (*want, BLOCK // 2):
            raise ModelFormatError(
                f"layer {layer} experts.{kind}: MXFP4 blocks {tuple(blocks.shape)} and scales "
                f"{tuple(scales.shape)}, expected {(*want, BLOCK // 2)} and {want}"
            )
        write_part(self.store.flat[layer], part, blocks, scales)
        self.direct.add((layer, name))

    def fill_synthetic(self, seed: int, std: float, device) -> None:
        """Every expert drawn packed (`mxfp4_rows.synthetic_rows`: random FP4 codes, seeded per
        layer, under one exponent that gives the weights about `std`), drawn on `device` and
        copied down per layer."""
        store = self.store
        for layer in store.layers:
            rows = synthetic_rows(store.layout, store.num_experts, layer, seed, std, device)
            store.flat[layer].copy_(rows)
            self.direct |= {(layer, "gate_up"), (layer, "down")}

    def layer_loaded(self, layer: int) -> None:
        """`layer`'s experts are all in: pack what came unpacked and free its stacks (so a
        bf16 checkpoint holds about one layer unpacked at a time)."""
        for name, stacks in (("gate_up", self.gate_up), ("down", self.down)):
            weights = stacks.made.pop(layer, None)
            if weights is not None and (layer, name) not in self.direct:
                self.store.put_part(layer, getattr(self.store.layout, name), weights)

    def finish(self) -> None:
        """Pack whatever is still unpacked (layers no loader reported finished)."""
        for layer in sorted({*self.gate_up.made, *self.down.made}):
            self.layer_loaded(layer)


def load_sink(store: ExpertStore) -> RoutedExperts:
    """Where a model's routed experts load into `store`: its own views, or a `PackedSink`."""
    return PackedSink(store) if store.packed else store.as_routed()


def finish_loading(sink: RoutedExperts) -> None:
    """After loading into `load_sink`'s result: a packed store's unpacked remainder packed."""
    if isinstance(sink, PackedSink):
        sink.finish()
