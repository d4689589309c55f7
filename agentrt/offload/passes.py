"""The passes of offloaded prefill as `auto` measures them: each pass (one chunk through every
MoE layer) is timed from its first layer's start to its last layer's end, per setting (its size
of chunk, `planner.size_class`, and whether it follows a long context: attention, which a plan
that waits for the routing cannot hide, grows with it) and the strategy it ran (one of
`planner.strategies_for` its size), but the first pass of each size; the next pass in a
setting takes the strategy `planner.pick_strategy` picks from those times. Marks are CUDA
events (read once complete, never waited for: a pass queued right behind another is read at a
later pass) or host times off CUDA. Knows nothing of layers, plans' contents or copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agentrt.offload.planner import pick_strategy

WEIGHT = 0.5  # a new pass's share of its strategy's measured seconds
LONG_CONTEXT = 8192  # a pass that starts this many tokens into its sequence or more is timed apart

Setting = tuple[int, bool]  # (size class, after a long context)


class PassClock:
    """Seconds per pass by setting and strategy, and the strategy of the pass in progress."""

    def __init__(self, candidates: Callable[[int], Sequence[str]]) -> None:
        self.candidates = candidates  # size class -> the strategies timed for it, in order
        self.measured: dict[Setting, dict[str, float]] = {}  # setting -> strategy -> seconds
        self.passes: dict[Setting, int] = {}  # setting -> timed passes begun
        self.sizes: set[int] = set()  # size classes that ran their first pass
        self._open: list | None = None  # [setting, strategy, start mark, end mark or None]
        self._done: list[tuple] = []  # ended passes not yet read: (setting, strategy, start, end)

    def begin(self, size: int, mark, context: int = 0) -> str:
        """A pass of size class `size`, `context` tokens into its sequence, starts at `mark`:
        the strategy it runs. A size's first pass is not timed (it pays for what runs once per
        shape: allocator pools, first calls)."""
        if self._open is not None and self._open[3] is not None:
            self._done.append(tuple(self._open))  # (one stopped before its last layer: dropped)
        self._open = None
        self._read()
        if size not in self.sizes:
            self.sizes.add(size)
            return self.candidates(size)[0]
        setting = (size, context >= LONG_CONTEXT)
        passes = self.passes.get(setting, 0)
        self.passes[setting] = passes + 1
        measured = self.measured.setdefault(setting, {})
        unread = {strategy for at, strategy, *_ in self._done if at == setting}
        strategy = pick_strategy(measured, passes, self.candidates(size), unread)
        self._open = [setting, strategy, mark, None]
        return strategy

    def end(self, mark) -> None:
        """The pass in progress ran its last layer (its work queued up to `mark`)."""
        if self._open is not None:
            self._open[3] = mark

    def _read(self) -> None:
        """Fold in the ended passes whose marks are complete."""
        waiting = []
        for setting, strategy, start, end in self._done:
            seconds = _elapsed(start, end)
            if seconds is None:
                waiting.append((setting, strategy, start, end))
                continue
            by_strategy = self.measured.setdefault(setting, {})
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
