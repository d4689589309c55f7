"""CUDA-graph capture and replay of the single-token decode step and of short prefills (all
CUDA-graph code lives here).

The step runs the model in its static form (position in a device tensor, KV written with
`index_copy_`, attention over the used part of the reserved capacity with the length in a device
tensor: `layers.static_attention`), so every replay launches the same kernels on the same
buffers. A graph is valid only for the cache buffers it was captured on (keyed by their data
pointers): new KV buffers or another `SequenceState` mean a new capture (one graph kept at a time,
counted by `DecodeGraph.captures`); a failed capture is tried once more, then decode runs eagerly.

Offloaded experts (and layers run on the CPU) need the host in the middle of a step: which experts
a token routed to decides what to copy and what to compute on the CPU. Such modules cut the
capture (`Pieces.cut`): the step becomes a chain of graphs sharing one memory pool, with a host
function between consecutive graphs. A cut's graph side copies what the host needs into pinned
buffers and, in the next piece, copies the host's results back, so each replay is
`graph, host, graph, host, ..., graph`.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field

import torch

from agentrt.engine.state import SequenceState
from agentrt.models.kv import KVCache
from agentrt.models.layers import CausalLM, Span

# called with the position decoded; what it returns (host-only work) runs once the next piece is
# launched, while the GPU runs it
HostStep = Callable[[int], Callable[[], None] | None]
# A capture that fails is tried again this many times in all before decode falls back to eager
# steps for the engine (a transient failure must not cost the rest of the session its graphs)
CAPTURE_ATTEMPTS = 2


@dataclass
class Pieces:
    """A decode step captured as graphs separated by host steps (one graph when nothing cuts)."""

    device: torch.device
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    hosts: list[HostStep] = field(default_factory=list)
    syncs: list[bool] = field(default_factory=list)  # per host step: waits for the graph first
    pool: object = None
    capturing: bool = False

    def begin(self) -> None:
        if self.pool is None:  # one memory pool shared by every piece (replayed in order)
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a state-cache writer thread syncing its events must not break the capture
        graph.capture_begin(self.pool, capture_error_mode="thread_local")
        self.graphs.append(graph)
        self.capturing = True

    def cut(self, host: HostStep, sync: bool = True) -> None:
        """End the graph; `host` runs before the next (begun now), after this one ends if `sync`."""
        self.end()
        self.hosts.append(host)
        self.syncs.append(sync)
        self.begin()

    def end(self) -> None:
        if self.capturing:  # never end a capture twice (it would hide the first error)
            self.capturing = False
            self.graphs[-1].capture_end()

    def replay(self, position: int) -> None:
        stream, later = torch.cuda.current_stream(self.device), None
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if later is not None:  # (the last host step's deferred work, while this piece runs)
                later()
            if i < len(self.hosts):
                if self.syncs[i]:  # the host step reads what the graph wrote to pinned buffers
                    stream.synchronize()
                later = self.hosts[i](position)


@dataclass
class EagerCuts:
    """Stands in for `Pieces` while the captured form of a step runs eagerly (the warm-up before
    its capture): each cut waits for the GPU work queued before it and runs its host step at once
    with no recorder set, as a replay would. So every kernel the capture records has run
    (loaded, compiled, tuned) before the capture begins."""

    device: torch.device
    position: int
    cutters: list

    def cut(self, host: HostStep, sync: bool = True) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        with _recording(self.cutters, None):
            later = host(self.position)
            if later is not None:
                later()


@dataclass
class _Captured:
    key: tuple[int, ...]
    pieces: Pieces
    token: torch.Tensor  # [1] long
    pos: torch.Tensor  # [1] long
    logits: torch.Tensor  # [V] fp32


def _buffers_key(state: SequenceState) -> tuple[int, ...]:
    ptrs = []
    for cache in state.caches:
        kv = isinstance(cache, KVCache)
        tensors = (cache.k, cache.v) if kv else (cache.conv, cache.recurrent)
        ptrs += [t.data_ptr() for t in tensors] + [tensors[0].shape[1] if kv else 0]
    return tuple(ptrs)


class DecodeGraph:
    """Captures the decode step of one model lazily and replays it."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model, self.device, self.enabled = model, device, True
        self.current: _Captured | None = None
        self.captures, self.capture_seconds = 0, 0.0  # (at start-up, between turns, in a request)

    def _static_step(
        self, state: SequenceState, token: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.model(token, state.caches, pos)
        return self.model.logits(hidden)[0]

    def _capture(self, state: SequenceState, key: tuple[int, ...]) -> _Captured:
        self.current = None  # release the previous graph's pool first
        token = torch.zeros(1, dtype=torch.long, device=self.device)
        pos = torch.full((1,), state.num_tokens, dtype=torch.long, device=self.device)
        cutters = _cutters(self.model)
        on_cuda = self.device.type == "cuda"
        eager = EagerCuts(self.device, state.num_tokens, cutters) if on_cuda else None
        with _recording(cutters, eager):  # the captured form, run eagerly (CPU: the plain step)
            _warm_up(state, self.device, lambda: self._static_step(state, token, pos))
        for module in cutters:  # (what they time in a warm-up, first calls included, is no guide)
            getattr(module, "warmed_up", lambda: None)()
        torch.cuda.synchronize(self.device)
        gc.collect()  # (nothing the collector frees may run its finaliser inside the capture)
        torch.cuda.empty_cache()
        pieces = Pieces(self.device)
        try:
            with _recording(cutters, pieces), _collector_off():
                logits = _record(pieces, lambda: self._static_step(state, token, pos))
        except Exception as exc:
            abandon_pool(self.device, pieces.pool)
            exc.add_note(f"in piece {len(pieces.graphs)} of the step")  # (the layer it failed in)
            raise
        return _Captured(key, pieces, token, pos, logits)

    def prepare(self, state: SequenceState) -> None:
        """Capture the step for `state`'s buffers now unless done (between requests: the next
        decode step then replays at once); KV for position `state.num_tokens` must be reserved."""
        self._current_for(state)

    def _current_for(self, state: SequenceState) -> _Captured | None:
        """The captured step for `state`'s buffers (captured now if needed), or None when
        capture failed (graphs are then off for the engine)."""
        if not self.enabled:
            return None
        key = _buffers_key(state) + self.model.experts.buffers_key()  # (offloaded: the pool)
        if self.current is not None and self.current.key == key:
            return self.current
        for attempt in range(1, CAPTURE_ATTEMPTS + 1):
            t0 = time.perf_counter()
            try:
                self.current = self._capture(state, key)
                self.captures += 1
                return self.current
            except Exception as exc:  # noqa: BLE001 - any capture problem: retry, then eager
                self.current = None
                last = attempt == CAPTURE_ATTEMPTS
                _failed("CUDA graph", exc, "decoding eagerly" if last else "capturing again")
            finally:  # (failed attempts cost their time too)
                self.capture_seconds += time.perf_counter() - t0
        self.enabled = False
        return None

    def step(self, state: SequenceState, token_id: int) -> torch.Tensor | None:
        """Logits after feeding `token_id` at position `state.num_tokens` (None: graphs are off);
        KV capacity for the new position must already be reserved."""
        cap = self._current_for(state)
        if cap is None:
            return None
        cap.token.fill_(token_id)
        cap.pos.fill_(state.num_tokens)
        try:
            cap.pieces.replay(state.num_tokens)
        except BaseException:
            # a host step failed midway: the pieces already run advanced the linear-attention
            # state without the token being recorded; the sequence is no longer consistent
            state.reset()
            self.current = None
            raise
        return cap.logits.clone()


def _warm_up(state: SequenceState, device: torch.device, step: Callable[[], object]) -> None:
    """Run a static step once eagerly on a side stream (lazy init, kernel autotuning) before it
    is captured, then undo what it did to the linear-attention state (the KV it wrote lies past
    the sequence's valid length)."""
    saved = [(c.conv.clone(), c.recurrent.clone()) for c in state.linear_caches()]
    on_cuda = device.type == "cuda"  # (the CPU runs it too, in tests of the bookkeeping)
    stream = torch.cuda.Stream(device) if on_cuda else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            step()
    finally:  # also after a failure part-way (e.g. out of memory): the state stays as it was
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
        for cache, (conv, rec) in zip(state.linear_caches(), saved, strict=True):
            cache.conv.copy_(conv)
            cache.recurrent.copy_(rec)


def _record(pieces: Pieces, step: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Capture `step` into `pieces` on a side stream; its output (each replay refills it)."""
    with torch.cuda.stream(torch.cuda.Stream(pieces.device)):
        pieces.begin()
        try:
            return step()
        finally:
            pieces.end()


def _failed(what: str, exc: Exception, then: str) -> None:
    """One line on stderr for a failed capture: the error's first line and its notes."""
    line = (str(exc).strip().splitlines() or [""])[0]
    line += "".join(f", {note}" for note in getattr(exc, "__notes__", ()))
    print(f"agentrt: {what} capture failed ({type(exc).__name__}: {line}); {then}", file=sys.stderr)


def abandon_pool(device: torch.device, pool: object) -> None:
    """After a failed capture into `pool`: close the allocator's recording into it (torch closes
    it only after a successful capture; left open, it refuses later captures into the pool)."""
    if device.type != "cuda" or pool is None:
        return
    torch.cuda.synchronize(device)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with suppress(RuntimeError):  # (it was closed after all)
            end(index, pool)


@contextmanager
def _recording(cutters: list, recorder: object) -> Iterator[None]:
    """`recorder` (Pieces, EagerCuts or None) set on every cutter for the block."""
    saved = [module.recorder for module in cutters]
    for module in cutters:
        module.recorder = recorder
    try:
        yield
    finally:
        for module, previous in zip(cutters, saved, strict=True):
            module.recorder = previous


@contextmanager
def _collector_off() -> Iterator[None]:
    """The cycle collector off for the block: a collection inside a capture may free a tensor
    or an event whose release calls what a capture forbids."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _cutters(model: CausalLM) -> list:
    """Objects in the step that cut captures: they have a `recorder` attribute (None outside a
    capture). The routed-experts object, and any module of the model."""
    extra = [model.experts] if hasattr(model.experts, "recorder") else []
    return [m for m in model.modules() if hasattr(m, "recorder")] + extra


# ----------------------------------------------------------------------------- prefill graphs

# Attention in a replay reads only the positions in use (flash varlen with the length in a device
# tensor; a mask over the whole capacity where that kernel is unusable). Every replay streams
# (nearly) all expert weights once: on the H200 a replay cost 36 ms at 64 tokens and 94 ms at
# 2048, ~31 us per token above 1K (`benchmarks/profile_static.py`, qwen3.5-35b-a3b), so one replay
# beats two. Padding costs at most ~16 ms at these steps; each bucket costs start-up one capture
# (~0.1-0.2 s there), so the steps widen with length.
PREFILL_BUCKETS = (64, 128, 256, 512, 768, 1024, 1280, 1536, 2048, 2560, 3072)
# Every bucket's graph has cut slots: linear layers take the states at the cuts from the pass
# itself (`kernels.gated_delta_rule_states`: one 64-row window per cut), so a cut costs little
# more than the plain replay, and a piece without cuts replays the same graph (its slots repeat
# the end). `plain=True` also captures a graph without cuts per bucket (twice the captures).
PREFILL_CUT_BUCKETS = None
PREFILL_PLAIN = False
PREFILL_RESERVE = 32768  # KV positions reserved at once: each growth means new captures
# KV reserved up front for the graphs (`graph_kv_tokens`) may take at most this share of the
# device memory free when the engine opens
GRAPH_KV_SHARE = 0.25


def graph_kv_tokens(max_context: int, kv_bytes_per_token: int, free_bytes: int) -> int:
    """KV positions to reserve before capturing graphs, so that no later growth (which would
    invalidate them) happens inside a request: the model's whole context when its KV fits
    `GRAPH_KV_SHARE` of the free device memory, else the most `PREFILL_RESERVE` steps that do
    (at least one)."""
    if max_context * kv_bytes_per_token <= GRAPH_KV_SHARE * free_bytes:
        return max_context
    steps = int(GRAPH_KV_SHARE * free_bytes // max(1, PREFILL_RESERVE * kv_bytes_per_token))
    return min(max_context, max(1, steps) * PREFILL_RESERVE)


PREFILL_MAX_PROMPT = 4096  # longer prompts run eagerly, in big chunks, nearer GPU-bound
PREFILL_CUT_SLOTS = 2  # capture positions inside one replay (more split the prompt)


@dataclass
class _CapturedPrefill:
    replay: Callable[[], None]
    ids: torch.Tensor  # [B] long
    span: Span
    logits: torch.Tensor  # [V] fp32
    slots: list[tuple[torch.Tensor, torch.Tensor]]  # per linear layer: states at the cuts


class PrefillGraphs:
    """Short prefills replayed as CUDA graphs: the prompt is padded up to the next bucket length
    and run as the model's static pass (`Span`: positions, the real length and capture cuts in
    device tensors, padding masked out of the linear-attention state), so one graph per bucket
    serves every prompt up to that length at any position. An eager forward of a large model
    costs host time per kernel launch whatever its length; a replay costs one launch.

    Each bucket has a graph with `cut_slots` cuts (capture positions inside the piece, whose
    linear states the pass records; unused slots repeat the end), which pieces without cuts
    replay too; with `plain`, each also has one without cuts (`cut_buckets` then limits which
    buckets have a cut variant). Graphs are valid for the cache buffers they were captured on:
    all are captured together (`prepare`, or at first use) and again whenever the KV buffers
    change (so capture costs land in one request; KV is reserved `reserve` positions at a time,
    so growth is rare); they share one memory pool (they never run at once); any capture
    failure turns them off for the engine.

    `capture=False` runs the same static pass eagerly (CPU tests of the padding and masking)."""

    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        buckets: tuple[int, ...] = PREFILL_BUCKETS,
        capture: bool = True,
        reserve: int = PREFILL_RESERVE,
        max_prompt: int = PREFILL_MAX_PROMPT,
        cut_slots: int = PREFILL_CUT_SLOTS,
        cut_buckets: tuple[int, ...] | None = PREFILL_CUT_BUCKETS,
        plain: bool = PREFILL_PLAIN,
    ) -> None:
        self.model = model
        self.device = device
        self.buckets = tuple(sorted(buckets))
        wanted = set(self.buckets if cut_buckets is None else cut_buckets) & set(self.buckets)
        # the largest bucket always has a cut variant: a piece of any length then fits one
        self.cut_buckets = tuple(sorted(wanted | {self.buckets[-1]}))
        self.capture = capture
        self.reserve = reserve
        self.max_prompt = max_prompt
        self.cut_slots = cut_slots
        self.plain = plain or not cut_slots
        if not self.plain:  # one graph per bucket, with cuts
            self.cut_buckets = self.buckets
        self.enabled = True
        self.graphs: dict[tuple[int, int], _CapturedPrefill] = {}  # (bucket, slots) -> graph
        self.key: tuple[int, ...] | None = None
        self.pool = None
        self.warmed = False  # (see `_capture`)
        self.cold_captures = 0  # captures that needed an eager warm-up after all

    def bucket(self, num_tokens: int, cuts: bool = False) -> int | None:
        sizes = self.cut_buckets if (cuts or not self.plain) and self.cut_slots else self.buckets
        return next((b for b in sizes if b >= num_tokens), None)

    def _variants(self) -> list[tuple[int, int]]:
        plain = [(b, 0) for b in self.buckets] if self.plain else []
        return plain + ([(b, self.cut_slots) for b in self.cut_buckets] if self.cut_slots else [])

    def prepare(self, state: SequenceState) -> bool:
        """Capture every graph now for `state` (empty or not), reserving its KV first, so that
        no request pays for the captures; False if graphs are off."""
        if not self.enabled or not self.capture:
            return self.enabled
        self._reserve(state, state.num_tokens)
        return self._ensure_captured(state)

    def _reserve(self, state: SequenceState, start: int, size: int | None = None) -> None:
        need = start + (self.buckets[-1] if self.capture else size)  # captures run every bucket
        for cache in state.kv_caches():
            if cache.capacity < need:
                cache.reserve(max(need, self.reserve), start)

    def _step(self, state: SequenceState, ids: torch.Tensor, span: Span) -> torch.Tensor:
        hidden = self.model(ids, state.caches, span)
        return self.model.logits(hidden.index_select(0, span.valid - 1))[0]

    def _span(self, start: int, valid: int, cuts: list[int] | None) -> Span:
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device)

        return Span(tensor([start]), tensor([valid]), None if cuts is None else tensor(cuts))

    def run(
        self, state: SequenceState, token_ids: list[int], cuts: list[int] = ()
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """Append `token_ids` to `state`'s caches (the caller records the ids). Returns the
        logits after them and, per linear layer, the (conv, recurrent) states after each of
        `cuts` (offsets in (0, len)), stacked: buffers every pass writes, valid only until the
        next replay of any graph (copy them now); None when no bucket is long enough, there are
        more cuts than slots, or graphs are off (then nothing was changed)."""
        size = self.bucket(len(token_ids), bool(cuts))
        if size is None or not self.enabled or len(cuts) > self.cut_slots:
            return None
        slots = self.cut_slots if cuts or not self.plain else 0
        padded_cuts = list(cuts) + [len(token_ids)] * (slots - len(cuts))
        start = state.num_tokens
        self._reserve(state, start, size)
        ids = torch.tensor(list(token_ids) + [0] * (size - len(token_ids)), dtype=torch.long)
        if not self.capture:
            span = self._span(start, len(token_ids), padded_cuts if slots else None)
            logits = self._step(state, ids.to(self.device), span)
            return logits, [c.slots for c in state.linear_caches()] if slots else []
        if not self._ensure_captured(state):
            return None
        cap = self.graphs[(size, slots)]
        cap.ids.copy_(ids)
        cap.span.start.fill_(start)
        cap.span.valid.fill_(len(token_ids))
        if slots:
            cap.span.cuts.copy_(torch.tensor(padded_cuts, dtype=torch.long))
        cap.replay()
        return cap.logits.clone(), cap.slots

    def _ensure_captured(self, state: SequenceState) -> bool:
        """Capture every graph for `state`'s buffers unless done; False if capture failed."""
        key = _buffers_key(state)
        if key == self.key:
            return True
        try:
            self.graphs.clear()  # release their memory before capturing anew
            self.key, self.pool = None, None
            for bucket, slots in self._variants():
                self.graphs[(bucket, slots)] = self._capture(state, bucket, slots)
            self.key = key
            return True
        except Exception as exc:  # noqa: BLE001 - any capture problem: prefill eagerly
            self.enabled, self.key = False, None
            self.graphs.clear()
            _failed("prefill graph", exc, "prefilling eagerly")
            return False

    def _capture(self, state: SequenceState, size: int, slots: int) -> _CapturedPrefill:
        """Static input buffers for one graph, then the recorded step. The engine's first
        capture runs the step eagerly first (lazy initialisation, the kernels' probes, Triton
        compilation and autotuning); later ones record at once and warm up only if recording
        failed (a bucket that needs a kernel variant not compiled yet): an eager pass of the
        whole model per bucket doubled the start-up time of the graphs."""
        ids = torch.zeros(size, dtype=torch.long, device=self.device)
        span = self._span(state.num_tokens, size, [size] * slots if slots else None)

        def step() -> torch.Tensor:
            return self._step(state, ids, span)

        if not self.warmed:
            _warm_up(state, self.device, step)
            self.warmed = True
        try:
            replay, logits = self._record(step)
        except Exception:  # noqa: BLE001 - compile or tune eagerly, then record again
            abandon_pool(self.device, self.pool)  # (later graphs record into a new pool)
            self.pool = None
            self.cold_captures += 1
            _warm_up(state, self.device, step)
            replay, logits = self._record(step)
        taken = [c.slots for c in state.linear_caches()] if slots else []
        return _CapturedPrefill(replay, ids, span, logits, taken)

    def _record(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Capture `step` as a CUDA graph: (replay, the output tensor each replay refills)."""
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        pieces = Pieces(self.device, pool=self.pool)
        out = _record(pieces, step)
        return (lambda: pieces.replay(0)), out
