"""Captured decode's host steps of `OffloadedExperts` (a mixin): inside a CUDA-graph decode
step each MoE layer cuts the capture; the graph hands the token's routed ids, weights and
hidden row over in pinned buffers (`LayerIO`), the host step plans hits, copies and CPU
experts, issues the copies, runs the CPU experts and fills the next piece's inputs; the next
piece runs the device experts from their slots (`expert_gemv`, on CUDA) and adds the CPU's sum.
A layer whose experts all sit in fixed slots (static and layer placements) looks them up on the
GPU and cuts nothing."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentrt.models import expert_gemv
from agentrt.models.moe import expert_ffn
from agentrt.offload.mxfp4_rows import weighted
from agentrt.offload.packed import token_experts


class CapturedDecode:
    """Host steps of captured decode (attributes: see `OffloadedExperts.__init__`)."""

    def _captured(self, layer, x, ids, weights) -> torch.Tensor:
        """Graph side of one MoE layer in a captured decode step (see the module docstring).
        With `overlap`, the device experts run in a piece of their own, launched once the host
        has planned and posted its CPU experts: the GPU computes them while the CPU computes
        its share, and the next piece adds the CPU's sum."""
        table = self.fixed_slots.get(layer)
        if table is not None:  # (every expert resident for good: its slots looked up on the GPU)
            slots, gw = table.index_select(0, ids[0]), weights[0].float()
            return self._device_experts(layer, x, ids, slots, gw, None).to(x.dtype).unsqueeze(0)
        io = self._io[layer]
        io.ids_h.copy_(ids[0], non_blocking=True)
        io.w_h.copy_(weights[0].float(), non_blocking=True)
        io.x_h.copy_(x[0], non_blocking=True)
        if self.routers is not None and layer in self.next_layer:
            io.pred_h.copy_(self._predict(layer, x, io.pred_h.numel()), non_blocking=True)
        if layer in self.cpu_layers:
            self.recorder.cut(lambda _pos: self._host_step(layer, io))
            self.uploads.from_host(io.cpu_h, io.cpu_d, hold=False)
            return io.cpu_d.to(x.dtype).unsqueeze(0)
        overlap = self.overlap
        if overlap:  # (the piece launched after the plan reads the prefetched slots)
            self.recorder.cut(lambda _pos: self._host_plan(layer, io, paced=True))
        else:
            self.recorder.cut(lambda _pos: self._host_step(layer, io))
        # (read by the GPU's cores: copies would queue behind the next layer's prefetches)
        self.uploads.from_host(io.slot_h, io.slot_d, hold=False)
        self.uploads.from_host(io.gw_h, io.gw_d, hold=False)
        if not overlap:
            self.uploads.from_host(io.cpu_h, io.cpu_d, hold=False)
            y = self._device_experts(layer, x, ids, io.slot_d, io.gw_d, io.cpu_d)
            return y.to(x.dtype).unsqueeze(0)
        y = self._device_experts(layer, x, ids, io.slot_d, io.gw_d, None)
        self.recorder.cut(lambda _pos: self._host_finish(layer, io), sync=False)
        self.uploads.from_host(io.cpu_h, io.cpu_d, hold=False)
        return (y + io.cpu_d).to(x.dtype).unsqueeze(0)

    def _device_experts(self, layer, x, ids, slots, gw, add: torch.Tensor | None) -> torch.Tensor:
        """The device experts' weighted sum (fp32 `[H]`): the token's experts read from device
        `slots` under weights `gw` (0 for an expert not computed here), plus `add` (the CPU's
        sum) where given."""
        s = self.store
        if s.packed:  # (weighted in the down product's kernel)
            out = token_experts(s, layer, self.cache.slots, slots, x, ids[0], gw).sum(0)
            return out if add is None else out + add
        biases = s.biases(layer, x.device)
        if expert_gemv.available(x):  # the slots read in place
            gate_up, down = s.stacks(self.cache.slots)
            return expert_gemv.token_moe(
                x, slots, gw, gate_up, down, biases, s.act, add, bias_ids=ids[0]
            )
        gate_up, down = s.stacks(self.cache.slots.index_select(0, slots))  # [k, ...]
        xs = x.expand(gate_up.shape[0], -1).unsqueeze(1)  # [k, 1, H]
        h = torch.bmm(xs, gate_up.transpose(1, 2))  # [k, 1, 2I]
        if biases is not None:  # (rows in routed order: the token's ids index the biases)
            h = h + biases[0].index_select(0, ids[0]).unsqueeze(1)
        ys = torch.bmm(s.act(h), down.transpose(1, 2)).squeeze(1)  # [k, H]
        if biases is not None:
            ys = ys + biases[1].index_select(0, ids[0])
        return self._weighted(ys, gw, add)

    @staticmethod
    def _weighted(ys: torch.Tensor, gw: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
        """The device experts' outputs `ys [k, H]` under their weights `gw` (fp32), plus `add`."""
        out = weighted(ys, gw).sum(0)  # (ys * fp32 gw: fp32)
        return out if add is None else out + add

    def fix_slots(self) -> None:
        """For a placement that preloads every expert of the layers outside `cpu_layers` and
        never evicts one (static, layer): those layers' slot tables on the device. A captured
        decode step looks their slots up there and does not cut the capture at them (no host
        step: the GPU runs them back to back, as llama.cpp runs its GPU layers); eager steps
        still plan them, all hits. A cache that gives slots to growing KV fixes nothing."""
        if self.slots_for_kv is not None:  # (its resizes would move the slots)
            return
        for layer in self.store.layers:
            slots = self.cache.slot_of[layer]
            if layer not in self.cpu_layers and min(slots) >= 0:
                table = torch.tensor(slots, dtype=torch.long, device=self.device)
                self.fixed_slots[layer] = table

    def _host_step(self, layer: int, io: LayerIO) -> Callable[[], None]:
        """Between graph pieces: plan and issue the copies, compute the CPU experts while they
        run, then fill the next piece's inputs and make it wait for the copies (`_host_plan`
        then `_host_finish`). Returns what only the host reads (`_after_step`), which runs once
        the next piece is launched."""
        self._host_plan(layer, io)
        return self._host_finish(layer, io)

    def _host_plan(self, layer: int, io: LayerIO, paced: bool = False) -> None:
        """A host step's first half: plan, post the CPU experts to the native kernel's pool,
        issue the copies and fill the device experts' inputs (the CPU experts may still run).
        `paced`: the next piece, launched right after it, reads the prefetched slots (overlap):
        the prefetch pace is told here whether they arrived (else at the step's end)."""
        t_begin = time.perf_counter()
        self._awaited = None  # (one a failed step left is not this step's)
        self._measure_period(layer, t_begin)
        try:
            self._open = self._plan_step(layer, io, t_begin)
        except BaseException:  # (the kernel writes the buffer until it is waited for)
            if self.native is not None:
                self.native.reclaim()
            raise
        finally:
            self._stream_now = None  # (kept from one host step to the next by `_measure_period`)
        if paced:
            self._pace_prefetch()

    def _plan_step(self, layer: int, io: LayerIO, t_begin: float) -> _Planned:
        """`_host_plan`'s work. With the native kernel's pool, the CPU experts start as soon as
        the plan names them, and run while this thread issues the copies and fills the inputs."""
        pending, self._copy_timing = self._copy_timing, None  # the last copies (done: synced)
        ids, w = io.ids_np.tolist(), io.w_np.tolist()
        copied_before = self.cache.stats[layer].copied
        later: list[Callable[[], None]] = []  # the bookkeeping, once the next piece runs
        kernel = self.native
        pooled = kernel is not None and kernel.pooled
        posted: list[int] = []  # the CPU experts the pool computes

        def start(cpu: list[int]) -> None:
            if cpu and pooled and self._start_native(layer, io, cpu, _weights_of(cpu, ids, w)):
                posted.extend(cpu)
                self.totals.cpu_start_seconds += time.perf_counter() - t_begin

        # (the prefetches into this layer awaited once its CPU experts are posted, before its
        # copies may refill a prefetched slot)
        awaited = functools.partial(self._await_prefetch, layer, True)
        if layer in self.cpu_layers:
            gpu, cpu = [], ids
            start(cpu)
            awaited()
        else:
            pairs = {e: [row] for row, e in enumerate(ids)}
            gpu, cpu = self._plan_decode(layer, pairs, True, start, awaited, later)
        prefetching = self.routers is not None and layer in self.next_layer
        if prefetching and self.on_cuda:
            self._mark_own_copies()
        slot_of, on_gpu = self.cache.slot_of[layer], set(gpu)
        io.slot_np[:] = [slot_of[e] if e in on_gpu else 0 for e in ids]
        io.gw_np[:] = [w[j] if e in on_gpu else 0.0 for j, e in enumerate(ids)]
        planned_s = time.perf_counter() - t_begin
        self.totals.plan_seconds += planned_s
        prefetch = (io.pred_np.tolist(), copied_before) if prefetching else None
        return _Planned(ids, w, cpu, posted, planned_s, pending, later, prefetch, pooled)

    def _host_finish(self, layer: int, io: LayerIO) -> Callable[[], None]:
        """A host step's second half: wait for the pool's CPU experts, compute any the pool
        did not take (copies that found no slot, or no pool) into the CPU's sum. Returns
        `_after_step`'s work."""
        step, self._open = self._open, None
        t_begin = time.perf_counter()
        kernel = self.native
        seconds = kernel.finish() if kernel is not None and kernel.posted else 0.0
        running = bool(step.posted)
        if running:
            self.totals.cpu_wait_seconds += time.perf_counter() - t_begin
            self._observe_cpu(len(step.posted) * self.store.expert_bytes, seconds)
        self.totals.cpu += len(step.cpu)
        rest = step.cpu[len(step.posted) :]  # (after the posted ones: copies that found no slot)
        if rest:
            args = (layer, io, rest, _weights_of(rest, step.ids, step.w))
            self._host_cpu_experts(*args, accumulate=running)
        elif not running:
            io.cpu_np.fill(0.0)
        # (the copies went on the current stream: the pieces that read the slots they fill run
        # after them)
        self.totals.host_steps += 1
        self.totals.host_seconds += step.planned_s + time.perf_counter() - t_begin
        self._pace_prefetch()  # (none left to check where `_host_plan` did)
        return functools.partial(self._after_step, layer, step)

    def _after_step(self, layer: int, step: _Planned) -> None:
        """A host step's work that the next piece does not wait for (it runs while the GPU
        runs that piece, before the next host step): the plan's bookkeeping, the next layer's
        prefetch (its copies wait for the step's own, marked before the piece; the read of its
        likely CPU experts into the pool's caches posted first), and the last copies' timing."""
        t_begin = time.perf_counter()
        for work in step.later:
            work()
        if step.prefetch is not None:
            predicted, copied_before = step.prefetch
            own = self.cache.stats[layer].copied - copied_before
            warm = None
            if step.pooled and self.warm_cpu:
                warm = functools.partial(self._warm_next, layer, max(1, len(step.ids) // 2))
            self._prefetch_after(layer, predicted, step.ids, own, warm)
        if step.pending is not None:
            self._read_copy_timing(step.pending)
        self.totals.after_seconds += time.perf_counter() - t_begin

    def _warm_next(self, layer: int, most: int, likely: list[int]) -> None:
        """Post a read of the next layer's `most` likeliest CPU experts into the caches of the
        native kernel's pool: it runs while this thread issues the prefetches and the GPU
        works through the next piece, and the next host step, which puts these experts on the
        CPU side of its plan where they miss, finds them in its threads' caches (its post cuts
        short what the read has not done by then)."""
        experts = likely[:most]
        nxt = self.next_layer[layer]
        if self.layer_cpu.warm(nxt, experts):
            self._warmed[nxt] = set(experts)
            self.totals.warmed += len(experts)

    def _start_native(self, layer: int, io, cpu: list[int], weights: list[float]) -> bool:
        """Post the token's CPU experts to the native kernel's thread pool (weighted and summed
        into the pinned fp32 buffer); False where the pool could not start (then the kernel
        runs on this thread)."""
        try:
            self.layer_cpu.start_experts(layer, cpu, weights, io.x_h, io.cpu_h)
        except OSError:
            return False
        return True

    def warmed_up(self) -> None:
        """After a captured step's eager warm-up: its layer times (first calls, compilation) do
        not size the prefetches."""
        self._period, self._host_start = None, None

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

    def _host_cpu_experts(
        self, layer: int, io, cpu: list[int], weights: list[float], accumulate: bool = False
    ) -> None:
        """The token's CPU experts on this thread, weighted and summed into the pinned fp32
        buffer, or added to it (`accumulate`); by the native kernel when there is one, in one
        call."""
        t0 = time.perf_counter()
        x, acc = io.x_h.unsqueeze(0), io.cpu_h
        if self.layer_cpu is not None:
            self.layer_cpu.run_experts(layer, cpu, weights, io.x_h, acc, accumulate)
            self._observe_cpu(len(cpu) * self.store.expert_bytes, time.perf_counter() - t0)
            return
        _, gate_up, down = self.store.expert_views(layer)
        with torch.inference_mode():
            for i, (expert, weight) in enumerate(zip(cpu, weights, strict=True)):
                bias = self.store.expert_biases(layer, expert, "cpu")
                y = expert_ffn(x, gate_up[expert], down[expert], *bias, act=self.store.act)
                y = y[0].float()
                if i == 0 and not accumulate:
                    torch.mul(y, weight, out=acc)
                else:
                    acc.add_(y, alpha=weight)
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


@dataclass
class _Planned:
    """A host step between its halves (`CapturedDecode._host_plan`, `_host_finish`): the
    token's experts `ids` and weights `w`, its CPU experts and of which those `posted` to the
    pool, the plan's seconds, the last copies' timing, the bookkeeping for later, the next
    layer's prediction and this layer's copy count before the step (None: no prefetch), and
    whether the pool runs CPU experts."""

    ids: list[int]
    w: list[float]
    cpu: list[int]
    posted: list[int]
    planned_s: float
    pending: tuple | None
    later: list[Callable[[], None]]
    prefetch: tuple[list[int], int] | None
    pooled: bool


def _weights_of(cpu: list[int], ids: list[int], w: list[float]) -> list[float]:
    """The routing weight of each of the `cpu` experts (the token's `ids` weigh `w`)."""
    weight = dict(zip(ids, w, strict=True))
    return [weight[e] for e in cpu]


def _average(old: float | None, new: float) -> float:
    """An exponential moving average moving a tenth of the way to each new sample."""
    return new if old is None else 0.9 * old + 0.1 * new


class LayerIO:
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
