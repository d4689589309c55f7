"""Decode prefetch of `OffloadedExperts` (a mixin): the next MoE layer's router applied to this
layer's input predicts its experts, and those the cache lacks are copied ahead into victim slots
behind this layer's own copies, as many as the link carries in the time the layer leaves it
(`_prefetch_cap`), paced by whether the last ones arrived before the GPU needed them
(`PrefetchPace`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PrefetchPace:
    """The share of a layer's time that the next layer's prefetches may fill on the link. The
    time between host steps sizes them (`Prefetch._prefetch_cap`), but copies that outlast the
    GPU piece stall the next one, which lengthens that time and so raises the cap again: left
    alone, the prefetches grow until the link alone paces decode. So each graph host step,
    just before the piece that reads the layer's prefetched slots is launched, checks whether
    those copies are done: when late, the share falls by a fifth (to `LOW` at least); on
    time, it rises by `UP` (to 1). Off by default (`OffloadConfig.prefetch_pace`, else
    `AGENTRT_PREFETCH_PACE=1`, turns it on): on two H100 hosts whose host memory reads at
    73-111 GB/s it made the copies late at 6-10% of the layers (17-91% without it on one), but
    the CPU then took the experts the link no longer carried, on the host steps' chain, and
    decode ran at 0.94-1.02x (BENCHMARKS.md, "Prefetches that outlast their piece"). Off, nothing
    is checked (a query costs host time on the layer chain)."""

    LOW, DOWN, UP = 0.2, 0.8, 0.01

    def __init__(self, on: bool) -> None:
        self.on, self.share = on, 1.0
        self.checks = self.late = 0

    def observe(self, late: bool) -> None:
        """One check's answer (made only where `on`)."""
        self.checks += 1
        self.late += late
        if late:
            self.share = max(self.LOW, self.share * self.DOWN)
        else:
            self.share = min(1.0, self.share + self.UP)


class Prefetch:
    """Prefetch for decode steps (attributes: see `OffloadedExperts.__init__`)."""

    def _predict(self, layer: int, x: torch.Tensor, k: int) -> torch.Tensor:
        """The next MoE layer's `k` likeliest experts, best first: its router applied to this
        layer's MoE input `x [1, H]` (the residual stream changes little from one layer to the
        next); empty without routers or a next layer."""
        nxt = self.next_layer.get(layer)
        if self.routers is None or nxt is None:
            return x.new_empty(0, dtype=torch.long)
        return torch.topk(F.linear(x[:1], self.routers[nxt]), k, dim=-1).indices[0]

    def _prefetch_after(
        self, layer: int, predicted: list[int], busy, own: int = 0, likely_cpu=None
    ) -> None:
        """Copy ahead, for the MoE layer after `layer`, the predicted experts it lacks (best
        first, as many as `_prefetch_cap` allows given this layer's `own` copies), into victim
        slots outside `busy` (this layer's experts) and the prediction. On a GPU they go on the
        copy stream after this layer's own copies, so they run while this layer's GPU experts
        and the next layer's attention compute; the next layer's host step makes its stream
        wait for them before anything reads or refills those slots (every prefetch of a step is
        awaited within it: the last layer has no next). `likely_cpu`, where given, is called
        with the predicted experts the next layer lacks and that it will not try to copy (the
        CPU's likely share there) before the copies are issued (a graph host step posts their
        warm-up there, which then overlaps the issue)."""
        nxt = self.next_layer.get(layer)
        if nxt is None or not predicted:
            return
        lookup = self.cache.slot_of[nxt]
        missing = [e for e in dict.fromkeys(predicted) if lookup[e] < 0]
        want = missing[: self._prefetch_cap(own)]
        if likely_cpu is not None and len(missing) > len(want):
            likely_cpu(missing[len(want) :])
        if want:
            self._prefetch(layer, nxt, want, busy, predicted)

    def _prefetch(self, layer: int, nxt: int, want: list[int], busy, predicted) -> None:
        """Admit and copy `want` into `nxt`'s slots (see `_prefetch_after`)."""
        exclude = {(layer, e) for e in busy} | {(nxt, e) for e in predicted}
        done, targets = self._admit(nxt, want, exclude)
        if not done:
            return
        rows = self.store.expert_views(nxt)[0]
        sources = [rows[e] for e in done]
        if self.on_cuda:
            self._pending[nxt] = self._issue_ahead(nxt, targets, sources, done)
            self._copies_queued(len(done))
        else:
            self._issue(targets, sources, None, nxt, done)
        self._prefetched[nxt] = set(done)
        self.cache.stats[nxt].prefetched += len(done)
        self.totals.prefetched += len(done)
        self.totals.bytes_copied += len(done) * self.store.expert_bytes

    def _mark_own_copies(self) -> None:
        """Mark the end of what the current stream has queued (this layer's own copies), which
        the prefetches issued after it wait for: a graph host step marks before the next piece
        is launched and prefetches once it runs."""
        if self.fast is not None:
            self.fast.record(self._mark, self._current().cuda_stream)
        else:
            self._mark.record(self._current())

    def _issue_ahead(self, layer: int, targets: list, sources: list, experts: list):
        """Queue prefetch copies on the copy stream behind the mark (`_mark_own_copies`);
        returns the event of their end (a raw handle with `fast`)."""
        side = self.copy_stream
        event = self._done_events.get(layer)
        if event is None:  # one per layer, recorded again each token
            event = self.fast.new_event() if self.fast is not None else torch.cuda.Event()
            self._done_events[layer] = event
        if self.fast is None:
            side.wait_event(self._mark)
            with torch.cuda.stream(side):
                self._issue(targets, sources, side, layer, experts)
            event.record(side)
            return event
        self.fast.wait(side.cuda_stream, self._mark)
        self._issue(targets, sources, side, layer, experts)
        self.fast.record(event, side.cuda_stream)
        return event

    def _prefetch_cap(self, own: int = 0) -> int:
        """Experts to prefetch for the next layer, at least one: what PCIe carries in one layer's
        time (the measured period between host steps; with pacing, the pace's share of it) besides
        this layer's `own` copies. With the split the CPU takes the rest; copy-only, the prefetches
        fill what the copy engine would leave idle (the GPU piece and the next host step). Measured
        on the H200 (copy-only, random weights, B_P 52 GB/s): the gap between host steps without the
        own copies (to 3f005ea) 250 prefetches per token at 78% right, 24.6 tok/s; that gap less the
        own copies 57 at 93%, 24.5; this cap 109 at 90%, 27.1 (on a host where static ran 15%
        slower). Unbounded on the CPU before any measurement (tests), one on a GPU."""
        if self._period is None:
            return 1 if self.on_cuda else self.store.num_experts
        ahead = self._period * self.pace.share * self.bw.copy
        return max(1, int(ahead / self.store.expert_bytes) - own)

    def _await_prefetch(self, layer: int, check: bool = False) -> None:
        """The current stream waits for the copies prefetched into `layer`'s slots; `check`:
        `_pace_prefetch` will then ask whether they are done (a graph host step)."""
        event = self._pending.pop(layer, None)
        if event is None:
            return
        if check and self.pace.on:
            self._awaited = event
        if self.fast is not None:
            self.fast.wait(self._current().cuda_stream, event)
        else:
            self._current().wait_event(event)

    def _pace_prefetch(self) -> None:
        """Tell the pace whether the prefetches the host step awaited are done, just before the
        piece that waits for them is launched (see `PrefetchPace`)."""
        event, self._awaited = self._awaited, None
        if event is not None:
            done = self.fast.done(event) if self.fast is not None else event.query()
            self.pace.observe(not done)
