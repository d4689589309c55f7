"""`OffloadedExperts`: the model's experts interface over an `ExpertStore` and an `ExpertCache`.

Per layer and step: dedupe the routed experts; hits run from their device slots; of the m misses,
q (chosen by the q* rule from calibrated bandwidths, most valuable first by the policy) are copied
into victim slots on a copy stream, and the other m - q run on the CPU (hidden rows to host,
results back) on the calling thread, with torch's intra-op thread pool (or the native kernel,
`cpu_kernel.py`), while the GPU works through what was queued before; every CPU expert of the
process runs on that one thread (a second thread would bring a second OpenMP team to compete
for the same cores), except in graph decode's host steps, below. Every (token,
expert) pair's output lands in the same place it would in the dense path, and the weighted sum
over the k experts is the same, so the result equals the dense computation. Many-token steps
(prefill) go to `prefill.PrefillStreamer`, layer by layer through a staging ring; it fills only
free slots, so prefill does not evict the decode working set.
`cpu_layers` (the static baseline) computes every expert of those layers on the CPU.

Inside a captured CUDA-graph decode step (`recorder` set by `engine.cuda_graph`), each MoE layer
cuts the capture: the graph copies the token's routed ids, weights and hidden row to pinned host
buffers; the host step plans hits/copies/CPU work, issues the copies, runs the CPU experts
(torch's intra-op thread pool, or the native kernel's own pool: see below) and writes slot
indices, GPU weights and the CPU partial
sum to pinned buffers; the next graph piece uploads them and runs the GPU experts from their
slots as one gathered batched matmul. The host step's copies, events and stream waits go
straight to the CUDA runtime (`copies.CudaCalls`) where torch's calls cost several times more.

Prefetch (decode, `routers` given): the graph side also applies the next MoE layer's router to
this layer's MoE input (the residual stream changes little between layers) and hands its top-k
to the host step, which copies the predicted experts the next layer lacks into victim slots on
the copy stream, behind this layer's own copies: they travel while the GPU computes this
layer's experts and the next layer's attention, when the copy engine would idle, and the next
layer finds them as hits. How many: what PCIe carries besides the layer's own copies, with the
split in a layer's time (the CPU takes the rest), copy-only in the gap between host steps. q*
counts copies still queued ahead. With the native CPU kernel (on 4 or more
threads) the host step posts its CPU experts to the kernel's thread pool first and plans and
issues the prefetch and fills the next piece's inputs meanwhile (with torch's kernels they run
on the host step's thread, after those). On the CPU (tests) eager decode prefetches too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrt.models.moe import expert_ffn
from agentrt.offload.cache import ExpertCache
from agentrt.offload.copies import CudaCalls
from agentrt.offload.cpu_kernel import NativeExperts
from agentrt.offload.prefill import PrefillStreamer
from agentrt.offload.split import q_star
from agentrt.offload.store import ExpertStore

PREFILL_PAIRS = 64  # above this many (token, expert) pairs a step is treated as prefill
# with measured bandwidths, every PROBE_EVERY-th decision that would send no miss to the CPU
# sends one anyway: otherwise a few slow early samples would settle q* = m for good
PROBE_EVERY = 64


@dataclass
class Bandwidths:
    """Bytes/s: `copy` = host->device expert copies, `cpu` = CPU expert compute while copying.

    They start from the calibration profile and follow what decode steps measure in the engine's
    real arrangement (an exponential moving average), so q* adapts when, say, the CPU is slower
    next to running copies than the calibration saw."""

    copy: float
    cpu: float
    alpha: float = 0.1  # weight of each new measurement

    def observe(self, side: str, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        old = getattr(self, side)
        setattr(self, side, (1 - self.alpha) * old + self.alpha * num_bytes / seconds)


@dataclass
class Totals:
    copied: int = 0
    cpu: int = 0
    streamed: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0  # measured by CUDA events around decode copies
    copy_timed_bytes: int = 0
    # decode-step CPU expert work: wall time, or the native kernel pool's own clock from the
    # call's post to its end (its host step meanwhile prefetches and fills the inputs)
    cpu_seconds: float = 0.0
    cpu_timed_bytes: int = 0
    host_steps: int = 0  # graph-decode host steps (one per offloaded layer and token)
    host_seconds: float = 0.0  # their wall time, all of it
    # of which planning and issuing the copies (prefetches included) and filling the next
    # piece's inputs (overlapping the CPU experts when the native kernel's pool runs them)
    plan_seconds: float = 0.0
    prefetched: int = 0  # experts copied ahead for the next layer (see `_prefetch_after`)
    prefetch_hits: int = 0  # of which the next layer did route to


class OffloadedExperts:
    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        bandwidths: Bandwidths,
        split: bool = True,
        cpu_layers: frozenset[int] = frozenset(),
        adaptive: bool = True,
        routers: dict[int, torch.Tensor] | None = None,
        cpu_kernel: NativeExperts | None = None,
        prefill_plan: str = "auto",
        staging_bytes: int | None = None,
    ) -> None:
        self.store, self.cache, self.bw, self.split = store, cache, bandwidths, split
        self.cpu_layers = cpu_layers
        self.device = cache.device
        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        sample = store.expert_views(store.layers[0])[0][0] if store.layers else None
        # raw CUDA runtime calls for a host step's copies, events and waits (None: torch's)
        self.fast = (
            CudaCalls.open(self.device, sample) if sample is not None and store.pinned else None
        )
        self._stream_now: torch.cuda.Stream | None = None  # the current stream, once per token
        # prefetch (decode): each layer's router weights, to predict the next MoE layer's experts
        # from this layer's hidden state; none for the static baseline (nothing is missing) nor
        # from pageable memory on a GPU (such a copy would hold up the host step)
        usable = not cpu_layers and (store.pinned or not self.on_cuda)
        self.routers = routers if routers and usable else None
        layers = store.layers
        self.next_layer = dict(zip(layers, layers[1:], strict=False))
        self._pending: dict[int, object] = {}  # layer -> event of its prefetches' end
        self._done_events: dict[int, object] = {}  # (raw handles with `fast`, else torch's)
        self._mark = self.fast.new_event() if self.fast is not None else None
        self._prefetched: dict[int, set[int]] = {}  # layer -> experts prefetched for its next use
        self._period: float | None = None  # seconds from one host step's start to the next's (EMA)
        self._host_start: tuple[int, float] | None = None  # (layer, time) of the last one
        self._copies_done_at = 0.0  # when the copy engine runs dry (host clock, a model)
        self._token_stream: torch.cuda.Stream | None = None
        # a decode token's CPU experts through the native bf16 kernel (None: torch's kernels)
        self.cpu_kernel = cpu_kernel if store.dtype == torch.bfloat16 else None
        self.totals = Totals()
        self.recorder = None  # engine.cuda_graph.Pieces while a decode step is being captured
        self._io: dict[int, _LayerIO] = {}
        self._copy_timing: tuple | None = None  # (start event, end event, bytes) of the last copies
        self._events = _EventRing() if self.on_cuda else None
        # follow measured bandwidths (auto mode, on a GPU where both sides are measured; CPU-only
        # runs keep the configured ones, so their decisions stay reproducible)
        self.adaptive = adaptive and split and not cpu_layers and self.on_cuda
        self._copy_only_decisions = 0
        # slots the VRAM budget allows next to this many bytes of KV (set under a budget: the
        # engine then lets growing KV take room from the cache, docs/architecture.md §5 elastic)
        self.slots_for_kv: Callable[[int], int] | None = None
        # many-token steps (prefill), layer by layer through a staging ring (`prefill.py`)
        self.prefill = PrefillStreamer(
            store,
            cache,
            bandwidths,
            split=split,
            plan=prefill_plan,
            copy_stream=self.copy_stream,
            staging_bytes=0 if cpu_layers else staging_bytes,
            adaptive=self.adaptive,
            routers=self.routers,
            cpu_kernel=self.cpu_kernel,
            calls=self.fast,
        )

    def buffers_key(self) -> tuple[int, ...]:
        """What a captured decode step depends on here: the slot pool (rebuilt by a resize)."""
        return (self.cache.slots.data_ptr(), self.cache.num_slots)

    # ------------------------------------------------------------------ interface

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x `[T, H]`, ids/weights `[T, k]` -> `[T, H]` (the weighted sum of the chosen experts)."""
        num_tokens, top_k = ids.shape
        if num_tokens == 1 and self.on_cuda:
            if layer not in self._io:  # pinned buffers exist before any capture needs them
                self._io[layer] = _LayerIO(top_k, x.shape[1], x.dtype, self.device)
            if self.recorder is not None:
                return self._captured(layer, x, ids, weights)
        self._await_prefetch(layer)  # (a graph step's prefetches are awaited within it)
        if ids.numel() > PREFILL_PAIRS and layer not in self.cpu_layers:
            return self._prefill_step(layer, x, ids, weights)
        flat = ids.reshape(-1).tolist()
        pairs = self._pairs(flat, top_k)  # expert -> rows of the flattened pairs
        if layer in self.cpu_layers:
            plan_gpu, plan_cpu = [], list(pairs)
        else:
            self._read_copy_timing()  # `tolist` synchronised: earlier copies are done
            plan_gpu, plan_cpu = self._plan_decode(layer, pairs)
            if num_tokens == 1 and not self.on_cuda:  # (on a GPU, graph decode prefetches)
                self._prefetch_after(layer, self._predict(layer, x, top_k).tolist(), pairs)
        out = torch.empty(len(flat), x.shape[1], dtype=x.dtype, device=x.device)
        rows, x_host = self._cpu_inputs(x, pairs, plan_cpu, top_k)
        self._run_slots(layer, x, pairs, plan_gpu, top_k, out)  # queued on the GPU ...
        if plan_cpu:  # ... while this thread computes the CPU experts
            segments = [(e, len(pairs[e])) for e in plan_cpu]
            result = self._cpu_ffn(layer, x_host, segments, observe=len(flat) <= PREFILL_PAIRS)
            out[rows] = result.to(out.device, out.dtype)
        return (out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(1)

    def _prefill_step(self, layer, x, ids, weights) -> torch.Tensor:
        """A many-token step through the prefill streamer; its plan is counted here too."""
        out = self.prefill.run(layer, x, ids, weights)
        plan = self.prefill.last_plan
        self.totals.streamed += len(plan.copy)
        self.totals.cpu += len(plan.cpu)
        self.totals.bytes_copied += len(plan.copy) * self.store.expert_bytes
        return out

    @staticmethod
    def _pairs(flat: list[int], top_k: int) -> dict[int, list[int]]:
        pairs: dict[int, list[int]] = {}
        for row, expert in enumerate(flat):
            pairs.setdefault(expert, []).append(row)
        return pairs

    # ------------------------------------------------------------------ planning

    def _plan_decode(self, layer: int, pairs: dict[int, list[int]], synced: bool = False):
        """Hits run from their slots; misses split into copies (admitted) and CPU work. The copies
        are issued before any bookkeeping, so they (and the caller's CPU experts) start as early
        as possible; `synced`: the device has finished all earlier work (a graph host step)."""
        lookup = self.cache.slot_of[layer]
        hits = [e for e in pairs if lookup[e] >= 0]
        misses = [e for e in pairs if lookup[e] < 0]
        ahead = self._prefetched.pop(layer, None)
        if ahead:  # (still resident: a pool resize may have dropped them)
            right = sum(1 for e in ahead if e in pairs and lookup[e] >= 0)
            self.cache.stats[layer].prefetch_hits += right
            self.totals.prefetch_hits += right
        queued = self._queued() if synced else 0.0
        q = q_star(len(misses), self.bw.copy, self.bw.cpu, queued) if self.split else len(misses)
        if self.adaptive and q == len(misses) >= 2:
            self._copy_only_decisions += 1
            if self._copy_only_decisions % PROBE_EVERY == 0:
                q -= 1  # the least valuable miss (last by the policy's rank) runs on the CPU
        policy = self.cache.policy
        ranked = [e for _, e in policy.rank((layer, e) for e in misses)] if q else misses
        exclude = {(layer, e) for e in pairs}
        copied = self._copy_in(layer, ranked[:q], exclude, synced) if q else []
        cpu = ranked[q:] + [e for e in ranked[:q] if e not in copied]
        for expert in pairs:  # after the copies: they are already on their way
            policy.touch((layer, expert))
        stats = self.cache.stats[layer]
        stats.hits += len(hits)
        stats.misses += len(misses)
        stats.copied += len(copied)
        stats.cpu += len(cpu)
        return hits + copied, cpu

    def _copy_in(self, layer: int, experts: list[int], exclude: set, synced: bool = False):
        """Copy experts into victim slots; returns those that got a slot. Unless `synced`, the
        copies go on the copy stream, which first waits for the work queued on the current
        stream (a victim slot may still be read by it), and the current stream then waits for
        them. A graph host step (`synced`) has nothing in flight: they go on the current stream,
        which the next graph piece runs on (no stream switch and no waits, which cost host time
        before the CPU experts can start). They go through the CUDA runtime directly (`fast`,
        ~3-6 us each on the H200 machine) or else one `torch._foreach_copy_` call (a `copy_` per
        expert cost ~15 us of host time each there)."""
        done, targets = self._admit(layer, experts, exclude)
        if not done:
            return done
        rows = self.store.expert_views(layer)[0]
        side = self.copy_stream if not synced else None
        # (the slots' device's current stream, not the current device's: they may differ)
        current = None
        if self.on_cuda:
            current = self._current() if synced else torch.cuda.current_stream(self.device)
        stream = side if side is not None else current  # the one the copies go on
        if side is not None:
            side.wait_stream(current)
        with torch.cuda.stream(side) if side is not None else nullcontext():
            start = self._events.record(stream) if self.on_cuda else None
            self._issue(targets, [rows[e] for e in done], stream, layer, done)
            if start is not None:
                nbytes = len(done) * self.store.expert_bytes
                self._copy_timing = (start, self._events.record(stream), nbytes)
        if side is not None:
            current.wait_stream(side)
        self._copies_queued(len(done))
        self.totals.copied += len(done)
        self.totals.bytes_copied += len(done) * self.store.expert_bytes
        return done

    def _current(self) -> torch.cuda.Stream:
        """The slots' device's current stream; in graph decode's host steps, the one looked up
        at the token's first (the call costs ~9 us of host time)."""
        if self._stream_now is not None:
            return self._stream_now
        return torch.cuda.current_stream(self.device)

    def _copies_queued(self, count: int) -> None:
        """Follow when the copy engine will have carried what was just queued on it."""
        now = time.perf_counter()
        per = self.store.expert_bytes / self.bw.copy if self.bw.copy > 0 else 0.0
        self._copies_done_at = max(now, self._copies_done_at) + count * per

    def _queued(self) -> float:
        """Experts' worth of copies still ahead of new ones on the copy engine (prefetches into
        this layer still running, by the model of `_copies_queued`)."""
        if not self.on_cuda or self.bw.copy <= 0:
            return 0.0
        ahead = self._copies_done_at - time.perf_counter()
        return max(0.0, ahead) * self.bw.copy / self.store.expert_bytes

    def _admit(self, layer: int, experts: list[int], exclude: set) -> tuple[list[int], list]:
        """Slots for `experts` (those that got one, and the slots' views)."""
        slots, done, targets = self.cache.slot_rows, [], []
        for expert in experts:
            slot = self.cache.admit(layer, expert, exclude)
            if slot is not None:
                done.append(expert)
                targets.append(slots[slot])
        return done, targets

    def _issue(self, targets: list, sources: list, stream, layer: int, experts: list) -> None:
        """Queue the copies `sources -> targets` on `stream` (the current one: a CUDA stream, or
        None on the CPU, where they run now) of `layer`'s `experts`, just admitted; if that
        fails, their slots are given up (the cache must not list them as resident)."""
        try:
            if self.fast is not None:
                self.fast.copy(targets, sources, stream.cuda_stream)
            else:
                torch._foreach_copy_(targets, sources, non_blocking=self.on_cuda)
        except BaseException:
            for expert in experts:
                self.cache.drop(layer, expert)
            raise

    # ------------------------------------------------------------------ prefetch

    def _predict(self, layer: int, x: torch.Tensor, k: int) -> torch.Tensor:
        """The next MoE layer's `k` likeliest experts, best first: its router applied to this
        layer's MoE input `x [1, H]` (the residual stream changes little from one layer to the
        next); empty without routers or a next layer."""
        nxt = self.next_layer.get(layer)
        if self.routers is None or nxt is None:
            return x.new_empty(0, dtype=torch.long)
        return torch.topk(F.linear(x[:1], self.routers[nxt]), k, dim=-1).indices[0]

    def _prefetch_after(self, layer: int, predicted: list[int], busy, own: int = 0) -> None:
        """Copy ahead, for the MoE layer after `layer`, the predicted experts it lacks (best
        first, as many as `_prefetch_cap` allows given this layer's `own` copies), into victim
        slots outside `busy` (this layer's experts) and the prediction. On a GPU they go on the
        copy stream after this layer's own copies, so they run while this layer's GPU experts
        and the next layer's attention compute; the next layer's host step makes its stream
        wait for them before anything reads or refills those slots (every prefetch of a step is
        awaited within it: the last layer has no next)."""
        nxt = self.next_layer.get(layer)
        if nxt is None or not predicted:
            return
        lookup = self.cache.slot_of[nxt]
        want = [e for e in dict.fromkeys(predicted) if lookup[e] < 0][: self._prefetch_cap(own)]
        if not want:
            return
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

    def _issue_ahead(self, layer: int, targets: list, sources: list, experts: list):
        """Queue prefetch copies on the copy stream behind what the current stream has queued
        (this layer's own copies); returns the event of their end (a raw handle with `fast`)."""
        side, current = self.copy_stream, self._current()
        event = self._done_events.get(layer)
        if event is None:  # one per layer, recorded again each token
            event = self.fast.new_event() if self.fast is not None else torch.cuda.Event()
            self._done_events[layer] = event
        if self.fast is None:
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._issue(targets, sources, side, layer, experts)
            event.record(side)
            return event
        self.fast.record(self._mark, current.cuda_stream)
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

    # ------------------------------------------------------------------ compute

    def _run_slots(self, layer, x, pairs, experts, top_k, out) -> None:
        for expert in experts:
            rows = pairs[expert]
            slot = self.cache.lookup(layer, expert)
            idx = torch.tensor(rows, device=x.device) // top_k
            out[rows] = expert_ffn(x[idx], self.cache.gate_up(slot), self.cache.down(slot))

    def _cpu_inputs(self, x, pairs, experts, top_k) -> tuple[list[int], torch.Tensor | None]:
        """The rows the CPU experts compute, and their hidden states on the host."""
        if not experts:
            return [], None
        rows = [r for e in experts for r in pairs[e]]
        index = torch.tensor([r // top_k for r in rows], device=x.device)
        self.totals.cpu += len(experts)
        return rows, x[index].to("cpu", self.store.dtype)

    def _cpu_ffn(
        self, layer: int, x_host: torch.Tensor, segments: list[tuple[int, int]], observe=True
    ) -> torch.Tensor:
        """The CPU experts' outputs for their rows of `x_host` (`segments`: expert and row count,
        in order); `observe`: a decode step, whose time updates the measured CPU bandwidth."""
        out, begin = torch.empty_like(x_host), 0
        _, gate_up, down = self.store.expert_views(layer)
        t0 = time.perf_counter()
        one_row = self.cpu_kernel is not None and all(count == 1 for _, count in segments)
        result = torch.empty(x_host.shape[1], dtype=torch.float32) if one_row else None
        with torch.inference_mode():
            for expert, count in segments:
                end = begin + count
                if one_row:  # (a decode token in a CPU layer: the native kernel)
                    x_row = x_host[begin].contiguous()
                    self.cpu_kernel.run([gate_up[expert]], [down[expert]], [1.0], x_row, result)
                    out[begin] = result
                    begin = end
                    continue
                h = F.linear(x_host[begin:end], gate_up[expert])
                gate, up = h.chunk(2, dim=-1)
                out[begin:end] = F.linear(F.silu(gate) * up, down[expert])
                begin = end
        if observe:
            self._observe_cpu(len(segments) * self.store.expert_bytes, time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------------ captured decode

    def _captured(self, layer, x, ids, weights) -> torch.Tensor:
        """Graph side of one MoE layer in a captured decode step (see the module docstring)."""
        io = self._io[layer]
        io.ids_h.copy_(ids[0], non_blocking=True)
        io.w_h.copy_(weights[0].float(), non_blocking=True)
        io.x_h.copy_(x[0], non_blocking=True)
        if self.routers is not None and layer in self.next_layer:
            io.pred_h.copy_(self._predict(layer, x, io.pred_h.numel()), non_blocking=True)
        self.recorder.cut(lambda _pos: self._host_step(layer, io))
        io.cpu_d.copy_(io.cpu_h, non_blocking=True)
        if layer in self.cpu_layers:
            return io.cpu_d.to(x.dtype).unsqueeze(0)
        io.slot_d.copy_(io.slot_h, non_blocking=True)
        io.gw_d.copy_(io.gw_h, non_blocking=True)
        s = self.store
        w = self.cache.slots.index_select(0, io.slot_d)  # [k, 3*I*H]
        gate_up = w[:, : 2 * s.inter * s.hidden].view(-1, 2 * s.inter, s.hidden)
        down = w[:, 2 * s.inter * s.hidden :].view(-1, s.hidden, s.inter)
        xs = x.expand(w.shape[0], -1).unsqueeze(1)  # [k, 1, H]
        gate, up = torch.bmm(xs, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        ys = torch.bmm(F.silu(gate) * up, down.transpose(1, 2)).squeeze(1)  # [k, H]
        # where, not a product: a slot read under weight 0 may overflow (fp16) and inf * 0 = nan
        gw = io.gw_d.unsqueeze(1)
        out = torch.where(gw != 0, ys.float() * gw, 0.0).sum(0) + io.cpu_d
        return out.to(x.dtype).unsqueeze(0)

    def _host_step(self, layer: int, io: _LayerIO) -> None:
        """Between graph pieces: plan and issue the copies, compute the CPU experts while they
        run, then fill the next piece's inputs and make it wait for the copies."""
        t_begin = time.perf_counter()
        self._measure_period(layer, t_begin)
        try:
            self._host_work(layer, io, t_begin)
        finally:
            self._stream_now = None  # (kept from one host step to the next by `_measure_period`)

    def _host_work(self, layer: int, io: _LayerIO, t_begin: float) -> None:
        """The host step's work (see `_host_step`). With the native kernel, the CPU experts run
        on its thread while this one plans and issues the next layer's prefetch and fills the
        next piece's inputs."""
        self._await_prefetch(layer)  # before this layer's copies may refill a prefetched slot
        pending, self._copy_timing = self._copy_timing, None  # the last copies (done: synced)
        ids = io.ids_np.tolist()
        copied_before = self.cache.stats[layer].copied
        if layer in self.cpu_layers:
            gpu, cpu = [], ids
        else:
            gpu, cpu = self._plan_decode(layer, {e: [row] for row, e in enumerate(ids)}, True)
        w = io.w_np.tolist()
        prefetch = self.routers is not None and layer in self.next_layer
        running = False  # the native kernel's pool computes while this thread works on
        try:
            if cpu and self.cpu_kernel is not None and self.cpu_kernel.pooled:
                running = self._start_native(layer, io, ids, w, cpu)
            if prefetch:
                own = self.cache.stats[layer].copied - copied_before
                self._prefetch_after(layer, io.pred_np.tolist(), ids, own)
            slot_of, on_gpu = self.cache.slot_of[layer], set(gpu)
            io.slot_np[:] = [slot_of[e] if e in on_gpu else 0 for e in ids]
            io.gw_np[:] = [w[j] if e in on_gpu else 0.0 for j, e in enumerate(ids)]
            self.totals.plan_seconds += time.perf_counter() - t_begin
        finally:  # (the kernel writes the buffer until it is waited for; an interrupt may
            # land between the post and `running`)
            kernel = self.cpu_kernel
            seconds = kernel.finish() if kernel is not None and kernel.posted else 0.0
        self.totals.cpu += len(cpu)
        if running:
            self._observe_cpu(len(cpu) * self.store.expert_bytes, seconds)
        elif cpu:
            self._host_cpu_experts(layer, io, ids, w, cpu)
        else:
            io.cpu_np.fill(0.0)
        if pending is not None:
            self._read_copy_timing(pending)
        # (the copies went on the current stream: the next piece, which reads the slots they
        # fill, runs after them)
        self.totals.host_steps += 1
        self.totals.host_seconds += time.perf_counter() - t_begin

    def _start_native(self, layer: int, io, ids: list[int], w: list[float], cpu) -> bool:
        """Post the token's CPU experts to the native kernel's thread pool (weighted and summed
        into the pinned fp32 buffer); False where the pool could not start (then the kernel
        runs on this thread)."""
        try:
            self.cpu_kernel.start(*self._native_args(layer, ids, w, cpu), io.x_h, io.cpu_h)
        except OSError:
            return False
        return True

    def _native_args(self, layer: int, ids: list[int], w: list[float], cpu) -> tuple:
        """The CPU experts' weights and routing weights, as the native kernel takes them."""
        _, gate_up, down = self.store.expert_views(layer)
        weight = dict(zip(ids, w, strict=True))
        return [gate_up[e] for e in cpu], [down[e] for e in cpu], [weight[e] for e in cpu]

    def _measure_period(self, layer: int, now: float) -> None:
        """Follow the time from the previous MoE layer's host step to this one's (a layer's
        time), which sizes the prefetches; look up the current stream at a token's first."""
        last, self._host_start = self._host_start, (layer, now)
        if last is not None and self.next_layer.get(last[0]) == layer:
            self._period = _average(self._period, now - last[1])
            self._stream_now = self._token_stream
        elif self.on_cuda:
            self._token_stream = torch.cuda.current_stream(self.device)
            self._stream_now = self._token_stream

    def _host_cpu_experts(self, layer: int, io, ids: list[int], w: list[float], cpu) -> None:
        """The token's CPU experts on this thread, weighted and summed into the pinned fp32
        buffer (by the native kernel when there is one, in one call)."""
        t0 = time.perf_counter()
        x, acc = io.x_h.unsqueeze(0), io.cpu_h
        if self.cpu_kernel is not None:
            self.cpu_kernel.run(*self._native_args(layer, ids, w, cpu), io.x_h, acc)
            self._observe_cpu(len(cpu) * self.store.expert_bytes, time.perf_counter() - t0)
            return
        _, gate_up, down = self.store.expert_views(layer)
        weight = dict(zip(ids, w, strict=True))
        with torch.inference_mode():
            for i, expert in enumerate(cpu):
                y = expert_ffn(x, gate_up[expert], down[expert])[0].float()
                if i == 0:
                    torch.mul(y, weight[expert], out=acc)
                else:
                    acc.add_(y, alpha=weight[expert])
        self._observe_cpu(len(cpu) * self.store.expert_bytes, time.perf_counter() - t0)

    def _observe_cpu(self, num_bytes: int, seconds: float) -> None:
        self.totals.cpu_seconds += seconds
        self.totals.cpu_timed_bytes += num_bytes
        if self.adaptive:
            self.bw.observe("cpu", num_bytes, seconds)

    def _read_copy_timing(self, timing: tuple | None = None) -> None:
        """Account the copies timed by `timing` (default: the last ones issued), which are done."""
        if timing is None:
            timing, self._copy_timing = self._copy_timing, None
        if timing is None:
            return
        start, end, num_bytes = timing
        seconds = start.elapsed_time(end) / 1000
        self.totals.copy_seconds += seconds
        self.totals.copy_timed_bytes += num_bytes
        if self.adaptive:
            self.bw.observe("copy", num_bytes, seconds)

    def close(self) -> None:
        """Nothing to release (kept for callers that close what they open)."""


def _average(old: float | None, new: float) -> float:
    """An exponential moving average moving a tenth of the way to each new sample."""
    return new if old is None else 0.9 * old + 0.1 * new


class _EventRing:
    """Timing events for the copies, created once and recorded again in turn (creating a CUDA
    event costs host time on every layer of every token). A pair of them is read at the latest
    right after the next pair is recorded, so two pairs are in use at most; the ring holds
    four pairs."""

    def __init__(self, size: int = 8) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(size)]
        self.next = 0

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """The next event of the ring, recorded on `stream`."""
        event = self.events[self.next]
        self.next = (self.next + 1) % len(self.events)
        event.record(stream)
        return event


def _event(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """A timing event recorded on `stream` (default: the current stream)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class _LayerIO:
    """Pinned host buffers and their device mirrors for one MoE layer's graph cut."""

    def __init__(self, top_k: int, hidden: int, dtype: torch.dtype, device) -> None:
        pin = torch.device(device).type == "cuda"
        self.ids_h = torch.zeros(top_k, dtype=torch.long, pin_memory=pin)
        self.pred_h = torch.zeros(top_k, dtype=torch.long, pin_memory=pin)  # next layer's guess
        self.w_h = torch.zeros(top_k, dtype=torch.float32, pin_memory=pin)
        self.x_h = torch.zeros(hidden, dtype=dtype, pin_memory=pin)
        self.slot_h = torch.zeros(top_k, dtype=torch.long, pin_memory=pin)
        self.gw_h = torch.zeros(top_k, dtype=torch.float32, pin_memory=pin)
        self.cpu_h = torch.zeros(hidden, dtype=torch.float32, pin_memory=pin)
        # numpy views of the same memory: the host step reads and writes single elements, which
        # cost microseconds each through tensor indexing and tens of nanoseconds through numpy
        self.ids_np, self.w_np, self.pred_np = (
            self.ids_h.numpy(),
            self.w_h.numpy(),
            self.pred_h.numpy(),
        )
        self.slot_np, self.gw_np, self.cpu_np = (
            self.slot_h.numpy(),
            self.gw_h.numpy(),
            self.cpu_h.numpy(),
        )
        self.slot_d = torch.zeros(top_k, dtype=torch.long, device=device)
        self.gw_d = torch.zeros(top_k, dtype=torch.float32, device=device)
        self.cpu_d = torch.zeros(hidden, dtype=torch.float32, device=device)
