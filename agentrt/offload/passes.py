"""The passes of offloaded prefill as `auto` measures them: each pass (one chunk through every
MoE layer) is timed from its first layer's start to its last layer's end, per size of chunk
(`planner.size_class`) and the strategy it ran (`planner.STRATEGIES`), but the first of each
size, and the next pass of a size takes the strategy `planner.pick_strategy` picks from those
times. Marks are CUDA events
(read once complete, never waited for: a pass queued right behind another is read at a later
pass) or host times off CUDA. Knows nothing of layers, plans' contents or copies."""

from __future__ import annotations

from collections.abc import Sequence

from agentrt.offload.planner import pick_strategy

WEIGHT = 0.5  # a new pass's share of its strategy's measured seconds


class PassClock:
    """Seconds per pass by size and strategy, and the strategy of the pass in progress."""

    def __init__(self, candidates: Sequence[str]) -> None:
        self.candidates = tuple(candidates)
        self.measured: dict[int, dict[str, float]] = {}  # size class -> strategy -> seconds
        self.passes: dict[int, int] = {}  # size class -> passes begun
        self.tried: dict[int, set[str]] = {}  # size class -> strategies begun
        self._open: list | None = None  # [size, strategy, start mark, end mark or None]
        self._done: list[tuple] = []  # ended passes not yet read: (size, strategy, start, end)

    def begin(self, size: int, mark) -> str:
        """A pass of size class `size` starts at `mark`: the strategy it runs. A size's first
        pass is not timed (it pays for what runs once per shape: allocator pools, first calls)."""
        if self._open is not None and self._open[3] is not None:
            self._done.append(tuple(self._open))
        elif self._open is not None:  # (stopped before its last layer: to be tried again)
            self.tried[self._open[0]].discard(self._open[1])
        self._open = None
        self._read()
        passes = self.passes.get(size, 0)
        self.passes[size] = passes + 1
        if passes == 0:
            return self.candidates[0]
        measured, tried = self.measured.setdefault(size, {}), self.tried.setdefault(size, set())
        strategy = pick_strategy(measured, passes - 1, self.candidates, tried)
        tried.add(strategy)
        self._open = [size, strategy, mark, None]
        return strategy

    def end(self, mark) -> None:
        """The pass in progress ran its last layer (its work queued up to `mark`)."""
        if self._open is not None:
            self._open[3] = mark

    def _read(self) -> None:
        """Fold in the ended passes whose marks are complete."""
        waiting = []
        for size, strategy, start, end in self._done:
            seconds = _elapsed(start, end)
            if seconds is None:
                waiting.append((size, strategy, start, end))
                continue
            by_strategy = self.measured.setdefault(size, {})
            old = by_strategy.get(strategy)
            by_strategy[strategy] = (
                seconds if old is None else (1 - WEIGHT) * old + WEIGHT * seconds
            )
        self._done = waiting


def _elapsed(start, end) -> float | None:
    """Seconds between two marks, or None while the end's work has not run yet."""
    if isinstance(start, float):
        return end - start
    if not end.query():
        return None
    return start.elapsed_time(end) / 1000
