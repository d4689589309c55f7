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
(but the fixed resident layers of a static or layer placement, `fix_slots`) cuts the capture:
the graph copies the token's routed ids, weights and hidden row to pinned host buffers; the
host step plans hits/copies/CPU work, issues the copies, runs the CPU experts (torch's
intra-op thread pool, or the native kernel's own pool: see below) and writes slot indices, GPU
weights and the CPU partial sum to pinned buffers; the next graph piece uploads them and runs
the GPU experts from their
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

The host steps live in `host_step.py` and the prefetch in `prefetch.py` (mixins of
`OffloadedExperts`); this module keeps set-up, the planning of a step's misses and its compute.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from agentrt.env import setting
from agentrt.models.moe import ExpertBackend, expert_ffn
from agentrt.offload.copies import CudaCalls
from agentrt.offload.cpu_kernel import NativeExperts, StoreExperts
from agentrt.offload.cpu_mxfp4 import PackedCPUExperts
from agentrt.offload.host_step import CapturedDecode, LayerIO
from agentrt.offload.prefetch import Prefetch, PrefetchPace
from agentrt.offload.prefill import PrefillStreamer
from agentrt.offload.slots import ExpertCache
from agentrt.offload.split import Bandwidths, q_star
from agentrt.offload.stats import Totals
from agentrt.offload.store import ExpertStore
from agentrt.offload.uploads import Uploads

PREFILL_PAIRS = 64  # above this many (token, expert) pairs a step is treated as prefill
# with measured bandwidths, every PROBE_EVERY-th decision that would send no miss to the CPU
# sends one anyway: otherwise a few slow early samples would settle q* = m for good
PROBE_EVERY = 64


class OffloadedExperts(Prefetch, CapturedDecode, ExpertBackend):
    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        bandwidths: Bandwidths,
        split: bool = True,
        cpu_layers: frozenset[int] = frozenset(),
        adaptive: bool = True,
        routers: dict[int, torch.Tensor] | None = None,
        cpu_kernel: NativeExperts | PackedCPUExperts | None = None,
        warm_cpu: bool = True,
        overlap: bool = False,
        prefetch_pace: bool | None = None,
        prefill_plan: str = "auto",
        staging_bytes: int | None = None,
        slots_for_kv: Callable[[int], int] | None = None,
        kv_reserved: int = 0,
    ) -> None:
        self.store, self.cache, self.bw, self.split = store, cache, bandwidths, split
        self.cpu_layers = cpu_layers
        self.device = cache.device
        for layer in store.layers if store.bias is not None else ():
            store.biases(layer, self.device)  # (on the device before any decode graph's capture)
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
        # the end of a host step's own copies, which its prefetches wait for (`_mark_own_copies`)
        self._mark = (
            self.fast.new_event() if self.fast else (torch.cuda.Event() if self.on_cuda else None)
        )
        self._prefetched: dict[int, set[int]] = {}  # layer -> experts prefetched for its next use
        paced = setting("PREFETCH_PACE") == "1" if prefetch_pace is None else prefetch_pace
        self.pace = PrefetchPace(on=paced and self.routers is not None)  # (else none to pace)
        self._awaited = None  # the prefetches a graph host step awaited (`_pace_prefetch`)
        # layer -> the experts a graph host step read into the CPU's caches for it (missing
        # there, they go to its CPU side)
        self._warmed: dict[int, set[int]] = {}
        # (layer, routed experts) of each planned decode layer, kept while a benchmark sets a
        # list here: it replays them through a plain LRU (the routing's regime)
        self.route_log: list[tuple[int, list[int]]] | None = None
        self._period: float | None = None  # seconds from one host step's start to the next's (EMA)
        self._host_start: tuple[int, float] | None = None  # (layer, time) of the last one
        self._copies_done_at = 0.0  # when the copy engine runs dry (host clock, a model)
        self._token_stream: torch.cuda.Stream | None = None
        # a decode token's CPU experts through the native bf16 kernel (None: torch's kernels;
        # it computes bias-free SwiGLU experts only)
        self.cpu_kernel = cpu_kernel if store.dtype == torch.bfloat16 and store.plain else None
        # packed MXFP4 experts: the native kernel that reads their rows (`cpu_mxfp4.py`)
        self.packed_cpu = cpu_kernel if store.packed else None
        # either native kernel (its pool: graph decode's host steps post to it and wait)
        self.native = self.cpu_kernel or self.packed_cpu
        # either native kernel, addressed by (layer, experts): graph decode's host steps
        self.layer_cpu = self.packed_cpu or (
            StoreExperts(self.cpu_kernel, store) if self.cpu_kernel is not None else None
        )
        # whether graph host steps post those reads (both native kernels' pools have them)
        self.warm_cpu = warm_cpu and self.layer_cpu is not None
        # captured decode runs a layer's device experts in a piece of their own, launched
        # while the CPU computes its share (`CapturedDecode._captured`)
        self.overlap = overlap
        self._open = None  # a host step between its halves (`_host_plan`, `_host_finish`)
        self.totals = Totals()
        self.recorder = None  # engine.cuda_graph.Pieces while a decode step is being captured
        self._io: dict[int, LayerIO] = {}
        self.fixed_slots: dict[int, torch.Tensor] = {}  # layer -> expert's slot (`fix_slots`)
        self.uploads = Uploads(self.device)  # (a captured step's small host->device transfers)
        self._copy_timing: tuple | None = None  # (start event, end event, bytes) of the last copies
        self._events = _EventRing() if self.on_cuda else None
        # follow measured bandwidths (auto mode, on a GPU where both sides are measured; CPU-only
        # runs keep the configured ones, so their decisions stay reproducible)
        self.adaptive = adaptive and split and not cpu_layers and self.on_cuda
        self._copy_only_decisions = 0
        # the slots the budget leaves the cache beside `kv` bytes of KV (None: no budget, the
        # cache's size is fixed): the engine lets growing KV take room from the cache
        # (docs/architecture.md §5 elastic); `kv_reserved` KV positions cost it nothing
        self.slots_for_kv = slots_for_kv
        self.kv_reserved = kv_reserved if slots_for_kv is not None else 0
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
            cpu_kernel=self.native,
            calls=self.fast,
            uploads=self.uploads,
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
                self._io[layer] = LayerIO(top_k, x.shape[1], x.dtype, self.device)
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

    def _plan_decode(
        self,
        layer: int,
        pairs: dict[int, list[int]],
        synced: bool = False,
        start_cpu: Callable[[list[int]], None] | None = None,
        before_copies: Callable[[], None] | None = None,
        later: list[Callable[[], None]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Hits run from their slots; misses split into copies (admitted) and CPU work.
        `start_cpu(cpu)`, where given, is called as soon as the CPU's share is known, before the
        copies are admitted and issued (a graph host step starts its CPU experts there: they
        take longer than choosing victims and issuing the copies, and the copies then queue
        behind the prefetches anyway), and `before_copies()` after the admission; the
        bookkeeping comes last, or is appended to `later` (a graph host step runs it once the
        next piece is launched). The returned CPU share ends with any copy that found no slot
        (none: q is capped by the slots outside the layer's own experts), which `start_cpu`
        was not given. `synced`: the device has finished all earlier work (a graph host step)."""
        lookup = self.cache.slot_of[layer]
        hits = [e for e in pairs if lookup[e] >= 0]
        misses = [e for e in pairs if lookup[e] < 0]
        policy = self.cache.policy
        if self.route_log is not None:
            self.route_log.append((layer, list(pairs)))
        try:
            # (every slot but those of the layer's own resident experts can take a copy)
            q = self._copies_for(len(misses), synced, self.cache.num_slots - len(hits))
            ranked = [e for _, e in policy.rank((layer, e) for e in misses)] if q else misses
            warm = self._warmed.pop(layer, None)
            if warm:  # (read into the CPU's caches: the CPU side takes them first)
                ranked = [e for e in ranked if e not in warm] + [e for e in ranked if e in warm]
            cpu = ranked[q:]
            if start_cpu is not None:
                start_cpu(cpu)
            copied, targets = self._admit(layer, ranked[:q], {(layer, e) for e in pairs})
            cpu = cpu + [e for e in ranked[:q] if e not in copied]
        finally:  # (whatever happened, nothing reads the slots before this)
            if before_copies is not None:
                before_copies()
        if copied:
            self._copy_in(layer, copied, targets, synced)
        # (after the copies: they are already on their way)
        args = (layer, list(pairs), hits, misses, copied, cpu, warm)
        book = functools.partial(self._book_decode, *args)
        if later is None:
            book()
        else:
            later.append(book)
        return hits + copied, cpu

    def _book_decode(self, layer, routed, hits, misses, copied, cpu, warm) -> None:
        """A planned decode layer's bookkeeping: prefetch hits, the policy's uses, counters."""
        self._count_prefetch_hits(layer, hits)
        policy = self.cache.policy
        for expert in routed:
            policy.touch((layer, expert))
        stats = self.cache.stats[layer]
        stats.hits += len(hits)
        stats.misses += len(misses)
        stats.copied += len(copied)
        stats.cpu += len(cpu)
        if warm:
            self.totals.warm_used += len(warm.intersection(cpu))

    def _count_prefetch_hits(self, layer: int, hits: list[int]) -> None:
        """Count the experts prefetched for `layer` that its token routed to and found resident
        (`hits`: a pool resize may have dropped some)."""
        ahead = self._prefetched.pop(layer, None)
        if ahead:
            right = len(set(ahead).intersection(hits))
            self.cache.stats[layer].prefetch_hits += right
            self.totals.prefetch_hits += right

    def _copies_for(self, misses: int, synced: bool, room: int) -> int:
        """How many of `misses` experts to copy (q*; all of them without the split), at most
        `room` (the slots that can take one)."""
        if not self.split:
            return min(misses, room)
        q = q_star(misses, self.bw.copy, self.bw.cpu, self._queued() if synced else 0.0)
        q = min(q, room)
        if self.adaptive and q == misses >= 2:
            self._copy_only_decisions += 1
            if self._copy_only_decisions % PROBE_EVERY == 0:
                q -= 1  # the least valuable miss (last by the policy's rank) runs on the CPU
        return q

    def _copy_in(self, layer: int, done: list[int], targets: list, synced: bool = False) -> None:
        """Issue the copies of `done`, just admitted into the slots `targets`. Unless `synced`,
        the copies go on the copy stream, which first waits for the work queued on the current
        stream (a victim slot may still be read by it), and the current stream then waits for
        them. A graph host step (`synced`) has nothing in flight: they go on the current stream,
        which the next graph piece runs on (no stream switch and no waits, which cost host
        time). They go through the CUDA runtime directly (`fast`, ~3-6 us each on the H200
        machine) or else one `torch._foreach_copy_` call (a `copy_` per expert cost ~15 us of
        host time each there)."""
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

    # ------------------------------------------------------------------ compute

    def _run_slots(self, layer, x, pairs, experts, top_k, out) -> None:
        for expert in experts:
            rows = pairs[expert]
            slot = self.cache.lookup(layer, expert)
            idx = torch.tensor(rows, device=x.device) // top_k
            out[rows] = expert_ffn(
                x[idx],
                self.cache.gate_up(slot),
                self.cache.down(slot),
                *self.store.expert_biases(layer, expert, x.device),
                act=self.store.act,
            )

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
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.packed_cpu is not None:  # (packed rows: their kernel, every row in one call)
                counts = dict(segments)
                out = torch.empty_like(x_host)
                per_expert = [counts.get(e, 0) for e in range(self.store.num_experts)]
                ones = torch.ones(x_host.shape[0])
                self.packed_cpu.run_rows(layer, list(counts), per_expert, x_host, ones, out)
            else:
                out = self._unpacked_ffn(layer, x_host, segments)
        if observe:
            self._observe_cpu(len(segments) * self.store.expert_bytes, time.perf_counter() - t0)
        return out

    def _unpacked_ffn(self, layer: int, x_host: torch.Tensor, segments) -> torch.Tensor:
        """`_cpu_ffn` for a store in the model's dtype: the native kernel for one-row experts,
        else torch's."""
        out, begin = torch.empty_like(x_host), 0
        _, gate_up, down = self.store.expert_views(layer)
        one_row = self.cpu_kernel is not None and all(count == 1 for _, count in segments)
        result = torch.empty(x_host.shape[1], dtype=torch.float32) if one_row else None
        for expert, count in segments:
            end = begin + count
            if one_row:  # (a decode token in a CPU layer: the native kernel)
                x_row = x_host[begin].contiguous()
                self.cpu_kernel.run([gate_up[expert]], [down[expert]], [1.0], x_row, result)
                out[begin] = result
            else:
                out[begin:end] = expert_ffn(
                    x_host[begin:end],
                    gate_up[expert],
                    down[expert],
                    *self.store.expert_biases(layer, expert, "cpu"),
                    act=self.store.act,
                )
            begin = end
        return out

    def chunk_at(self, position: int) -> None:
        """The next prefill chunk starts `position` tokens into its sequence (`auto` times its
        passes after a long context apart)."""
        self.prefill.context = position

    def close(self) -> None:
        """Wait for a warm-up the CPU kernel's pool may still run over the host store (the
        store may be freed next)."""
        kernel = self.native
        if kernel is not None:
            kernel.settle()


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
