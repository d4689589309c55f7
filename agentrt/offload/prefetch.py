"""Decode prefetch of `OffloadedExperts` (a mixin): the next MoE layer's router applied to this
layer's input predicts its experts, and those the cache lacks are copied ahead into victim slots
behind this layer's own copies, as many as the link carries in the time the layer leaves it
(`_prefetch_cap`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

    def _prefetch_after(self, layer: int, predicted: list[int], busy, own: int = 0) -> list[int]:
        """Copy ahead, for the MoE layer after `layer`, the predicted experts it lacks (best
        first, as many as `_prefetch_cap` allows given this layer's `own` copies), into victim
        slots outside `busy` (this layer's experts) and the prediction. On a GPU they go on the
        copy stream after this layer's own copies, so they run while this layer's GPU experts
        and the next layer's attention compute; the next layer's host step makes its stream
        wait for them before anything reads or refills those slots (every prefetch of a step is
        awaited within it: the last layer has no next). Returns the predicted experts the next
        layer lacks that were not copied ahead (the CPU's likely share there)."""
        nxt = self.next_layer.get(layer)
        if nxt is None or not predicted:
            return []
        lookup = self.cache.slot_of[nxt]
        missing = [e for e in dict.fromkeys(predicted) if lookup[e] < 0]
        want = missing[: self._prefetch_cap(own)]
        done = self._prefetch(layer, nxt, want, busy, predicted) if want else []
        return [e for e in missing if e not in done]

    def _prefetch(self, layer: int, nxt: int, want: list[int], busy, predicted) -> list[int]:
        """Admit and copy `want` into `nxt`'s slots (see `_prefetch_after`); returns those
        copied."""
        exclude = {(layer, e) for e in busy} | {(nxt, e) for e in predicted}
        done, targets = self._admit(nxt, want, exclude)
        if not done:
            return done
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
        return done

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
        """Experts to prefetch for the next layer, at least one: what PCIe carries in one
        layer's time (the measured period between host steps) besides this layer's `own`
        copies. With the split the CPU takes the rest; copy-only, the prefetches fill what the
        copy engine would leave idle (the GPU piece and the next host step). Measured on the
        H200 (copy-only, random weights, B_P 52 GB/s): the gap between host steps without the
        own copies (to 3f005ea) 250 prefetches per token at 78% right, 24.6 tok/s; that gap
        less the own copies 57 at 93%, 24.5; this cap 109 at 90%, 27.1 (on a host where static
        ran 15% slower). Unbounded on the CPU before any measurement (tests), one on a GPU."""
        if self._period is None:
            return 1 if self.on_cuda else self.store.num_experts
        return max(1, int(self._period * self.bw.copy / self.store.expert_bytes) - own)

    def _await_prefetch(self, layer: int) -> None:
        """The current stream waits for the copies prefetched into `layer`'s slots."""
        event = self._pending.pop(layer, None)
        if event is None:
            return
        if self.fast is not None:
            self.fast.wait(self._current().cuda_stream, event)
        else:
            self._current().wait_event(event)
