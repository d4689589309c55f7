"""Python's cycle collector around a loaded engine. What start-up makes (the model's modules,
tensors and their views, the expert tables) lives as long as the engine, yet every full
collection walks it: about 200,000 objects with torch loaded, 65-85 ms a pass on the
development machine, which lands inside whichever request happens to trigger it.
`settle()` collects once and then freezes what is left, so later passes walk only what
requests made (`unsettle` undoes it); `CollectorClock` measures the collector's time over a
block (benchmarks)."""

from __future__ import annotations

import gc
import time


def settle() -> None:
    """Collect, then move every surviving object out of the collector's generations (they stay
    alive and are freed by reference counting as usual; a cycle among them is never freed)."""
    gc.collect()
    gc.freeze()


def unsettle() -> None:
    """Every object `settle` froze back in the collector's oldest generation (say, once the
    engine that made them is closed)."""
    gc.unfreeze()


class CollectorClock:
    """Counts the collector's passes by generation and their seconds while it is entered."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.passes = [0, 0, 0]  # by generation: young, middle, full
        self._began: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.passes[info["generation"]] += 1
            self._began = None

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
