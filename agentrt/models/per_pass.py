"""Values every attention layer of one forward pass derives alike from the pass's position (the
rotary cos/sin, the positions a static pass writes its KV at, the end flash attention reads to,
flash attention's sequence bounds): inside `one_pass()` the first layer computes each and the
others read it, so a decode step launches those kernels once instead of once per layer. A value
lives for one pass only: a captured pass records its computation once (a replay recomputes it),
and the next pass computes it again, since a device position tensor may change in place between
passes. Outside a pass every call computes its value."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")

_pass: object | None = None
_values: dict[Hashable, object] = {}


@contextmanager
def one_pass() -> Iterator[None]:
    """The scope of one forward pass (see the module docstring); a nested pass opens its own."""
    global _pass, _values
    outer = _pass, _values
    _pass, _values = object(), {}
    try:
        yield
    finally:
        _pass, _values = outer


def shared(key: tuple, make: Callable[[], T]) -> T:
    """`make()` once per pass for `key` (every input of the value: a tensor's by its
    `data_ptr`, with its device and the dtype asked for); outside a pass, each time."""
    if _pass is None:
        return make()
    if key not in _values:
        _values[key] = make()
    return _values[key]  # type: ignore[return-value]


def positions(start: torch.Tensor, length: int) -> torch.Tensor:
    """start, start + 1, .., start + length - 1 (long) for a `[1]` device tensor `start`."""
    key = ("positions", start.data_ptr(), start.device, length)
    return shared(key, lambda: start + torch.arange(length, device=start.device))


def end_int32(start: torch.Tensor | int, length: int, device: torch.device) -> torch.Tensor:
    """`[1]` int32: start + length (flash attention's `seqused_k`)."""
    if isinstance(start, int):
        end, device = start + length, torch.device(device)
        make = lambda: torch.full((1,), end, dtype=torch.int32, device=device)  # noqa: E731
        return shared(("end", end, device), make)
    key = ("end", start.data_ptr(), start.device, length)
    return shared(key, lambda: (start + length).to(torch.int32))


def sequence_bounds(length: int, device: torch.device) -> torch.Tensor:
    """`[0, length]` int32: flash attention's varlen bounds of one sequence."""
    key = ("bounds", device, length)
    return shared(
        key, lambda: torch.arange(0, 2 * length, length, dtype=torch.int32, device=device)
    )
