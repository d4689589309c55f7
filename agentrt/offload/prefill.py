"""Layer-granular offloaded prefill: the experts of a many-token step (a prefill chunk), one MoE
layer at a time, at the speed of the host->device link.

Per layer: the chunk's routing is counted on the device and read once (one sync per layer); the
planner (`planner.py`) picks how the missing experts come: streamed, routed-only, or partly on
the CPU. The experts the device computes are laid out in *parts* of a few experts each; a part's
missing experts are copied from the pinned host store in as few copies as their runs allow into
one buffer of a small staging ring (`ring.py`; its cache hits are copied in from their slots on
the device), and the part runs as two grouped GEMMs over the tokens sorted by position. While part
i computes, the copy stream fills the ring's other buffers: the layer's next parts, and, when the
next layer streams, its parts too, so its copies travel under this layer's compute and the next
layer's attention. Missing experts planned for the CPU run on this thread at the same time
(`prefill_cpu.py`).

Prefill evicts nothing from the expert cache (the decode working set stays; it only fills slots
that are free, as on a fresh start), and the host store stays the truth: every (token, expert)
pair's output equals the dense path's.

Owns: the per-layer plans, the layout of a layer's pairs, the measured costs, the counters.
Does not know: chat, sessions, decode (the caller routes single tokens elsewhere).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from agentrt.models.moe import RoutedExperts, _grouped_mm_fn, unsort
from agentrt.offload.copies import CudaCalls
from agentrt.offload.cpu_rates import CpuRates, PlanMeasures
from agentrt.offload.mxfp4_rows import grouped_tile
from agentrt.offload.packed import part_ffn, resident_ffn
from agentrt.offload.pairs import Sorted, bincount, grouped_ffn, looped_ffn, part_biases
from agentrt.offload.passes import PassClock
from agentrt.offload.planner import (
    Costs,
    LayerPlan,
    choose,
    ema,
    plan_ahead,
    predicted_plan,
    reserve_plan,
    routed_plan,
    size_class,
    strategies_for,
)
from agentrt.offload.prefill_cpu import cpu_inputs, cpu_order, row_workers, run_cpu_experts
from agentrt.offload.ring import Fill, StagingRing
from agentrt.offload.slots import ExpertCache
from agentrt.offload.stats import PrefillTotals
from agentrt.offload.store import ExpertStore
from agentrt.offload.uploads import PartTables, Uploads, layer_tables

CPU_FLOPS = 1e12  # the CPU experts' matmul rate (FLOP/s; `cpu_rates` says why it stays fixed)


class PrefillStreamer:
    """Runs the experts of prefill steps (see the module docstring)."""

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        bandwidths,
        *,
        split: bool,
        plan: str = "auto",
        copy_stream: torch.cuda.Stream | None = None,
        staging_bytes: int | None = None,
        adaptive: bool = False,
        routers: dict[int, torch.Tensor] | None = None,
        cpu_kernel=None,
        calls: CudaCalls | None = None,
        uploads: Uploads,
    ) -> None:
        self.store, self.cache, self.bw = store, cache, bandwidths
        self.split, self.plan, self.adaptive = split, plan, adaptive
        # the plan of the pass in progress: `plan`, or for auto the strategy its clock picked
        self.mode = plan
        self.clock = PassClock(strategies_for)
        self.context = 0  # where the next chunk starts in its sequence (the engine sets it)
        self.device = cache.device
        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = copy_stream
        self.ring = StagingRing(store, staging_bytes, self.device, copy_stream, calls)
        self.calls = self.ring.calls  # raw CUDA copies (`copies.CudaCalls`), or None: torch's
        self.uploads = uploads  # (small transfers, not queued behind the expert copies)
        self._stream = 0  # the current stream's handle, taken once per layer (with `calls`)
        self.layers = store.layers
        self.next_layer = dict(zip(self.layers, self.layers[1:], strict=False))
        # per plan of pass: the CPU experts' weight reads and matmuls (followed if adaptive),
        # and routed layers' measured time beyond their plans' per size of chunk
        self.measures = PlanMeasures(
            bandwidths.cpu, CPU_FLOPS, store.expert_bytes, self.token_flops
        )
        self.routers = routers  # each MoE layer's router weights (predicted plans), or None
        # the native CPU kernel (`cpu_kernel.NativeExperts` for bf16 stores, packed rows' own
        # `cpu_mxfp4.PackedCPUExperts`) or None: torch's
        self.cpu_kernel = cpu_kernel if store.dtype == torch.bfloat16 or store.packed else None
        self.row_workers = row_workers()  # (None: many-row CPU experts on torch's team)
        self.accuracy = 0.8  # share of routed missing experts the prediction covered (EMA)
        self.exposed_s = 0.0  # device time from one layer's experts to the next's routing
        # host time of a layer besides its sync and CPU experts (EMA; a streamed layer's too,
        # so a slow first measure does not keep auto streaming for good)
        self.dispatch_s = 0.0
        self.bucket = 0  # the size class of the chunk being run (`planner.size_class`)
        # (layer, its experts' end, its routing, its plan, the overhead it was planned with):
        # events, or host times off CUDA
        self._layer_end: tuple | None = None
        self.totals = PrefillTotals()
        self.last_plans: dict[int, str] = {}  # layer -> the kind of its last plan
        self.last_plan = LayerPlan("stream", ())
        self._routed: tuple[int, LayerPlan] | None = None  # (layer, its routed plan): this layer
        self._grouped = _grouped_mm_fn()

    @property
    def token_flops(self) -> float:
        """FLOPs of one token through one expert (three projections of `inter x hidden`)."""
        return 6.0 * self.store.inter * self.store.hidden

    @property
    def staging_bytes(self) -> int:
        return self.ring.num_bytes

    @property
    def cpu(self) -> CpuRates:
        """The CPU experts' rates as the passes of this pass's plan measured them."""
        return self.measures.cpu(self.mode)

    def costs(self) -> Costs:
        s, cpu = self.store, self.cpu
        return Costs(
            expert_bytes=s.expert_bytes,
            copy_bw=self.bw.copy,
            cpu_bw=cpu.read_bw,
            cpu_flops=cpu.flops,
            token_flops=self.token_flops,
            exposed_s=self.exposed_s + self.overhead_s,
            dispatch_s=self.dispatch_s,
        )

    @property
    def overhead_s(self) -> float:
        """What plans that wait for the routing took beyond their cost model, for chunks of
        this size, in passes of this plan."""
        return self.measures.overhead(self.mode, self.bucket)

    # ------------------------------------------------------------------ one layer

    def run(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x `[T, H]`, ids/weights `[T, k]` -> `[T, H]` (the weighted sum of the chosen experts)."""
        if layer == self.layers[0]:
            self._begin_pass(x.shape[0])
        start = self._resident_start(layer)
        if start is not None:
            out = self._run_resident(layer, start, x, ids, weights)
        else:
            out = self._timed_layer(layer, x, ids, weights)
        if layer == self.layers[-1] and self.plan == "auto":
            self.clock.end(self._mark())
        return out

    def _begin_pass(self, tokens: int) -> None:
        """A new pass: what an earlier one queued serves nothing (one stopped part-way, even
        where this first layer is resident); `auto` picks the plan of this pass."""
        self.ring.drop()
        if self.cpu_kernel is not None:  # (decode's pool: asleep while the OpenMP team runs)
            self.cpu_kernel.rest()
        if self.plan == "auto":
            self.mode = self.clock.begin(size_class(tokens), self._mark(), self.context)

    def _timed_layer(self, layer, x, ids, weights) -> torch.Tensor:
        """`_run_layer`, its host time counted (besides the sync and the CPU experts)."""
        t = self.totals
        t0, blocked = time.perf_counter(), t.cpu_seconds + t.wait_seconds
        try:
            return self._run_layer(layer, x, ids, weights)
        except BaseException:  # (what it queued must not serve a later pass)
            self.ring.drop()
            raise
        finally:
            host = time.perf_counter() - t0 - (t.cpu_seconds + t.wait_seconds - blocked)
            t.host_seconds += host
            self.dispatch_s = ema(self.dispatch_s, host, 0.2)

    def _run_layer(self, layer, x, ids, weights) -> torch.Tensor:
        """`run` for a layer that is not resident in place."""
        top_k = ids.shape[1]
        self.bucket = size_class(x.shape[0])
        if self.calls is not None:
            self._stream = torch.cuda.current_stream(self.device).cuda_stream
        flat = ids.reshape(-1)
        num = self.store.num_experts
        counts = bincount(flat, num)
        predicted = self._predict(layer, x, top_k)
        routed_at = self._mark()
        both = torch.cat([counts, predicted]) if predicted is not None else counts
        t0 = time.perf_counter()
        both_h = both.tolist()  # the one sync of the layer
        self.totals.wait_seconds += time.perf_counter() - t0
        counts_h, predicted_h = both_h[:num], both_h[num:]
        self._observe_exposed(layer, routed_at)
        parts, plan = self._layer_plan(layer, counts_h)
        self._plan_ahead(layer, counts_h, predicted_h)
        order, ys, cpu_rows, tables = self._sorted(x, flat, weights, parts, plan, counts_h, top_k)
        x_cpu = cpu_inputs(ys, cpu_rows, self.on_cuda) if plan.cpu else None
        self._count(layer, plan, counts_h, flat.numel())  # (before parts fill free slots)
        begin = 0
        for fill, part_tables in zip(parts, tables, strict=True):
            begin = self._run_part(fill, counts_h, ys, begin, part_tables)
        if plan.cpu:
            self._run_cpu(layer, plan, counts_h, x_cpu, ys, cpu_rows)
        out = unsort(ys.out, order, top_k).sum(1)
        self._layer_end = (layer, self._mark(), routed_at, plan, self.overhead_s, self.bucket)
        return out

    def _resident_start(self, layer: int) -> int | None:
        """The first slot of a layer whose experts all sit in consecutive slots in expert
        order (the baselines' resident layers), else None."""
        row = self.cache.slot_of[layer]
        first = row[0]
        if first < 0 or row != list(range(first, first + len(row))):
            return None
        return first

    def _run_resident(self, layer, start: int, x, ids, weights) -> torch.Tensor:
        """A resident layer: grouped GEMMs straight from its slots (no staging, no sync). Its
        hits are counted as the experts the chunk can reach (no sync to count the routed ones)."""
        s, num = self.store, self.store.num_experts
        block = self.cache.slots[start : start + num]
        self.cache.stats[layer].hits += min(num, ids.numel())
        self.last_plan = LayerPlan("resident", ())
        if s.packed:
            return resident_ffn(s, layer, block, x, ids, weights)
        gate_up, down = s.stacks(block)
        bias = s.biases(layer, x.device)
        up_bias, down_bias = ({layer: bias[0]}, {layer: bias[1]}) if bias else (None, None)
        resident = RoutedExperts({layer: gate_up}, {layer: down}, up_bias, down_bias, act=s.act)
        return resident(layer, x, ids, weights)

    def _mark(self):
        """An event on the current stream (a host time off CUDA)."""
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _observe_exposed(self, layer: int, routed_at) -> None:
        """Follow, within one forward pass (across passes the device may have idled), the
        device time from the previous layer's experts to this layer's routing, and how much
        longer than its plan predicted a routed layer took from its routing to this one's
        (what the cost model misses there: the CPU slower next to the copies, late copies
        behind the routing); both count against plans that wait for the routing."""
        last, self._layer_end = self._layer_end, None
        if last is None or self.next_layer.get(last[0]) != layer:
            return
        _, end, routed_then, plan, overhead_then, bucket = last
        self.exposed_s = ema(self.exposed_s, self._seconds(end, routed_at), 0.2)
        if plan.kind not in ("stream", "resident"):
            taken = self._seconds(routed_then, routed_at)
            model = plan.seconds - overhead_then  # (the plan's cost counted the overhead)
            # (the pass's plan: the same as the last layer's)
            self.measures.follow_overhead(self.mode, bucket, max(0.0, taken - model))

    def _seconds(self, start, end) -> float:
        if self.on_cuda:
            return start.elapsed_time(end) / 1000
        return end - start

    def _missing(self, layer: int) -> list[int]:
        lookup = self.cache.slot_of[layer]
        return [e for e in range(self.store.num_experts) if lookup[e] < 0]

    def _predict(self, layer: int, x: torch.Tensor, top_k: int) -> torch.Tensor | None:
        """Tokens per expert of the next MoE layer as its router picks them from this layer's
        input (the `predicted` plan, with routers), else None."""
        nxt = self.next_layer.get(layer)
        if self.routers is None or nxt is None or self.mode != "predicted":
            return None
        ids = torch.topk(F.linear(x, self.routers[nxt]), top_k, dim=-1).indices
        return bincount(ids.reshape(-1), self.store.num_experts)

    def _layer_plan(self, layer: int, counts: list[int]) -> tuple[list[Fill], LayerPlan]:
        """This layer's parts and plan: what was queued ahead (stream; or the predicted or
        reserve plan's experts, with the routed ones beyond them planned now), else the
        planner's plan (the reserve plan with the split: the routed one, which is what it
        chose where it queued nothing ahead, the CPU taking every missing expert it can)."""
        ahead, lookup = self.ring.ahead_for(layer), self.cache.slot_of[layer]
        self._routed = None
        if ahead and ahead[0].kind == "stream":
            return ahead, LayerPlan("stream", tuple(self._missing(layer)))
        covered = {e for fill in ahead for e in fill.experts}
        routed = {e: c for e, c in enumerate(counts) if c and lookup[e] < 0}
        late = {e: c for e, c in routed.items() if e not in covered}
        costs = self.costs()
        if ahead:  # (predicted or reserve: the experts beyond those copied ahead, as routed)
            kind = ahead[0].kind
            if kind == "predicted":
                self._observe_prediction(len(routed) - len(late), len(routed))
            # (a reserve's late experts queue behind the copies ahead of them: counted whole,
            # an upper bound, so they lean to the CPU they were reserved for)
            queued = costs.copy_s(len(covered)) if kind == "reserve" else 0.0
            plan = routed_plan(late, costs, self.split, queued)
            copy = tuple(sorted(covered | set(plan.copy)))
            plan = LayerPlan(kind, copy, plan.cpu, plan.seconds)
        else:
            self._routed = (layer, routed_plan(routed, costs, self.split))
            mode = "routed" if self.mode == "reserve" and self.split else self.mode
            plan = choose(mode, self._missing(layer), routed, costs, self.split, self._routed[1])
        if plan.kind == "stream":
            experts = list(range(self.store.num_experts))
        else:
            copied = set(plan.copy)
            experts = [
                e
                for e, c in enumerate(counts)
                if c and e not in covered and (lookup[e] >= 0 or e in copied)
            ]
        fills = self.ring.fills(layer, experts, set(plan.copy), plan.kind)
        self.ring.queue.extend(fills)
        return ahead + fills, plan

    def _observe_prediction(self, right: int, routed: int) -> None:
        """Follow the share of routed missing experts that were copied ahead on prediction."""
        if routed:
            self.accuracy = 0.8 * self.accuracy + 0.2 * right / routed

    def _plan_ahead(self, layer: int, counts: list[int], predicted: list[int]) -> None:
        """Queue the next layer's fills now (copies start once a buffer of the ring is free)
        where it streams or takes predicted or all but reserved experts; issue what the ring
        can take."""
        nxt = self.next_layer.get(layer)
        if nxt is not None and self.mode != "routed":
            choice, ahead = self._ahead_choice(layer, nxt, counts, predicted)
            if choice == "stream":
                experts, missing = list(range(self.store.num_experts)), set(self._missing(nxt))
                self.ring.queue.extend(self.ring.fills(nxt, experts, missing, "stream"))
            elif ahead:
                self.ring.queue.extend(self.ring.fills(nxt, list(ahead), set(ahead), choice))
        self.ring.issue_ready()

    def _ahead_choice(self, layer, nxt, counts, predicted) -> tuple[str, tuple[int, ...]]:
        """What the next layer copies before its routing: `stream`, `predicted` or `reserve`
        (and which experts) or `none`; this layer's routing stands in for the next one's."""
        if self.mode == "stream":
            return "stream", ()
        here, costs = self.cache.slot_of[layer], self.costs()
        routed = {e: c for e, c in enumerate(counts) if c and here[e] < 0}
        if self.mode == "predicted":
            lookup = self.cache.slot_of[nxt]
            guess = {e: c for e, c in enumerate(predicted) if c and lookup[e] < 0}
            late = len(routed) * (1 - self.accuracy)
            ahead = predicted_plan(guess, late, costs, self.split)[0] if guess else ()
            return "predicted", ahead
        missing = self._missing(nxt)
        # (reserve streams where no reserve helps; without a CPU side, it streams or waits
        # for the routing, whichever the costs favour)
        if self.mode == "reserve" and self.split and missing:
            reserve = reserve_plan(len(missing), sum(counts), len(counts), costs)[0]
            choice = "reserve" if reserve else "stream"
            ahead = self._reserved(nxt, missing, reserve) if reserve else ()
        else:
            known = self._routed[1] if self._routed and self._routed[0] == layer else None
            routed_s = (known or routed_plan(routed, costs, self.split)).seconds
            choice, ahead = plan_ahead(len(missing), None, routed_s, costs), ()
        if choice == "stream":
            self.measures.forget_overhead(self.mode, self.bucket)
        return choice, ahead

    def _reserved(self, layer: int, missing: list[int], reserve: int) -> tuple[int, ...]:
        """The missing experts of `layer` copied ahead when `reserve` of them are left to the
        CPU: those the expert cache's policy ranks lowest are reserved (the least used in
        decode, likely routed the fewest tokens here too)."""
        ranked = self.cache.policy.rank((layer, e) for e in missing)
        return tuple(sorted(e for _, e in ranked[: len(missing) - reserve]))

    def _run_part(
        self, fill: Fill, counts: list[int], ys: Sorted, begin: int, tables: PartTables
    ) -> int:
        """Wait for the part's copies, bring its hits in from their slots, run it; returns the
        sorted row after its rows."""
        buf = self.ring.take(fill)
        copied, lookup = set(fill.copies), self.cache.slot_of[fill.layer]
        rows = [counts[e] for e in fill.experts]
        hits = [(pos, lookup[e]) for pos, e in enumerate(fill.experts) if pos not in copied]
        used = [(pos, slot) for pos, slot in hits if rows[pos]]
        self.ring.copy_hits(buf, self.cache, used, self._stream)
        self._admit_free(fill, buf)
        end = begin + sum(rows)
        if end > begin:
            self._grouped_ffn(buf[: len(rows)], ys, begin, end, rows, tables, fill)
        self.ring.release(fill)
        return end

    def _admit_free(self, fill: Fill, buf: torch.Tensor) -> None:
        """While the expert cache has free slots (a fresh start), the part's copied experts
        also go into them (a device copy from staging), up to the layer's share of the slots
        (so the first layers do not take them all): nothing is evicted, and decode then finds
        them."""
        cache = self.cache
        if not cache.free or not fill.copies or cache.pending:  # (a refill will use them)
            return
        share = -(-cache.num_slots // len(self.layers))
        room = share - sum(1 for slot in cache.slot_of[fill.layer] if slot >= 0)
        lookup = cache.slot_of[fill.layer]
        for pos in fill.copies[: max(0, room)]:
            if not cache.free:
                return
            if lookup[fill.experts[pos]] >= 0:
                continue
            slot = cache.admit(fill.layer, fill.experts[pos], exclude=set())
            cache.slot_rows[slot].copy_(buf[pos])
            self.totals.admitted += 1

    def _grouped_ffn(self, weights, ys: Sorted, begin: int, end: int, rows, tables, fill) -> None:
        """The part's experts over sorted rows [begin, end): gate/up (+ biases), the
        activation scaled by the routing weights, down (+ biases, scaled) (one grouped GEMM
        each, or a loop where torch has none)."""
        s, x = self.store, ys.x_sorted[begin:end]
        biases = part_biases(s, fill.layer, tables.experts)
        if s.packed:
            scale = ys.scale[begin:end].unsqueeze(1)
            ys.out[begin:end] = part_ffn(s, weights, rows, x, scale, biases, tables)
            return
        gate_up, down = s.stacks(weights)
        scale = ys.scale[begin:end].unsqueeze(1)
        if self._grouped is not None:
            try:
                parts = (self._grouped, x, gate_up, down, tables.offsets, scale, s.act, biases)
                ys.out[begin:end] = grouped_ffn(*parts)
                return
            except RuntimeError:  # (a dtype or layout this torch build's kernel lacks)
                self._grouped = None
        ys.out[begin:end] = looped_ffn(x, gate_up, down, rows, scale, biases, s.act)

    # ------------------------------------------------------------------ layout and CPU side

    def _sorted(self, x, flat, weights, parts, plan, counts, top_k):
        """Pairs sorted by their expert's position (the parts' experts in order, then the CPU
        experts): the sort order, the sorted inputs and output buffer, the CPU rows' range, the
        parts' tables (`uploads.layer_tables`: one transfer for the layer)."""
        num = self.store.num_experts
        position = [num] * num  # (experts without tokens sort nowhere: they have no pairs)
        at = 0
        for fill in parts:
            for expert in fill.experts:
                position[expert] = at
                at += 1
        for expert in cpu_order(plan.cpu, counts):
            position[expert] = at
            at += 1
        block_m = grouped_tile(x.dtype)[0] if self.store.packed and self.on_cuda else None
        pos, tables = layer_tables(self.uploads, position, parts, counts, block_m)
        order = torch.argsort(pos[flat], stable=True)
        x_sorted = x.index_select(0, order // top_k)
        scale = weights.reshape(-1).index_select(0, order).to(x.dtype)
        cpu_pairs = sum(counts[e] for e in plan.cpu)
        total = flat.numel()
        ys = Sorted(x_sorted, scale, torch.empty_like(x_sorted))
        return order, ys, (total - cpu_pairs, total), tables

    def _run_cpu(self, layer, plan: LayerPlan, counts, x_cpu, ys: Sorted, rows) -> None:
        """The CPU experts over their rows (in `cpu_order`), weighted, into `ys.out` (this
        thread runs them once the device's parts are dispatched)."""
        x_host, scale, ready = x_cpu
        t0 = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        self.totals.cpu_input_seconds += time.perf_counter() - t0
        out = torch.empty(x_host.shape, dtype=x_host.dtype, pin_memory=self.on_cuda)
        args = (self.store, self.cpu_kernel, layer, cpu_order(plan.cpu, counts), counts)
        with torch.inference_mode():
            run_cpu_experts(*args, x_host, scale, out, self.row_workers, self.totals)
        seconds = time.perf_counter() - t0
        self.uploads.from_host(out, ys.out[rows[0] : rows[1]])
        self.totals.cpu_seconds += seconds
        self.totals.cpu_pairs += rows[1] - rows[0]
        if self.adaptive:  # (the inputs' arrival counted in: it delays the CPU side too)
            self.cpu.observe(len(plan.cpu), rows[1] - rows[0], seconds)

    def _count(self, layer: int, plan: LayerPlan, counts: list[int], pairs: int) -> None:
        lookup, t = self.cache.slot_of[layer], self.totals
        routed = [e for e, c in enumerate(counts) if c]
        missing = [e for e in routed if lookup[e] < 0]
        stats = self.cache.stats[layer]
        stats.hits += len(routed) - len(missing)
        stats.misses += len(missing)
        stats.cpu += len(plan.cpu)
        t.add_layer(plan.kind, len(plan.copy), len(plan.cpu), pairs, len(missing))
        t.copy_bytes += len(plan.copy) * self.store.expert_bytes
        self.last_plans[layer] = plan.kind
        self.last_plan = plan
