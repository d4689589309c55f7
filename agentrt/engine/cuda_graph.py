"""CUDA-graph capture and replay of the single-token decode step (all CUDA-graph code lives here).

The step runs the model in its static form (position in a device tensor, KV written with
`index_copy_`, attention over the whole reserved capacity under a mask), so every replay launches
the same kernels on the same buffers. A graph is valid only for the exact cache buffers it was
captured on; the key is their data pointers, so growing the KV buffers or switching to another
`SequenceState` triggers a new capture (one graph is kept at a time). Any capture failure
disables graphs for the engine and decode continues eagerly.

Offloaded experts (and layers run on the CPU) need the host in the middle of a step: which experts
a token routed to decides what to copy and what to compute on the CPU. Such modules cut the
capture (`Pieces.cut`): the step becomes a chain of graphs sharing one memory pool, with a host
function between consecutive graphs. A cut's graph side copies what the host needs into pinned
buffers and, in the next piece, copies the host's results back, so each replay is
`graph, host, graph, host, ..., graph`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agentrt.engine.state import SequenceState
from agentrt.models.cache import KVCache
from agentrt.models.layers import CausalLM

HostStep = Callable[[int], None]  # called with the position being decoded


@dataclass
class Pieces:
    """A decode step captured as graphs separated by host steps (one graph when nothing cuts)."""

    device: torch.device
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    hosts: list[HostStep] = field(default_factory=list)
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

    def cut(self, host: HostStep) -> None:
        """End the current graph; `host` runs between it and the next one (which begins now)."""
        self.end()
        self.hosts.append(host)
        self.begin()

    def end(self) -> None:
        if self.capturing:  # never end a capture twice (it would hide the first error)
            self.capturing = False
            self.graphs[-1].capture_end()

    def replay(self, position: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        for graph, host in zip(self.graphs, self.hosts, strict=False):
            graph.replay()
            stream.synchronize()  # the host step reads what the graph wrote to pinned buffers
            host(position)
        self.graphs[-1].replay()


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
        tensors = (
            (cache.k, cache.v) if isinstance(cache, KVCache) else (cache.conv, cache.recurrent)
        )
        ptrs += [t.data_ptr() for t in tensors]
        ptrs.append(tensors[0].shape[1] if isinstance(cache, KVCache) else 0)
    return tuple(ptrs)


class DecodeGraph:
    """Captures the decode step of one model lazily and replays it."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.enabled = True
        self.current: _Captured | None = None

    def _static_step(
        self, state: SequenceState, token: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.model(token, state.caches, pos)
        return self.model.logits(hidden)[0]

    def _warm_up(self, state: SequenceState, token: torch.Tensor, pos: torch.Tensor) -> None:
        """Run the static step once eagerly (lazy init, autotuning), then undo its state changes."""
        saved = [(c.conv.clone(), c.recurrent.clone()) for c in state.linear_caches()]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._static_step(state, token, pos)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for cache, (conv, rec) in zip(state.linear_caches(), saved, strict=True):
            cache.conv.copy_(conv)
            cache.recurrent.copy_(rec)

    def _capture(self, state: SequenceState, key: tuple[int, ...]) -> _Captured:
        self.current = None  # release the previous graph's pool first
        token = torch.zeros(1, dtype=torch.long, device=self.device)
        pos = torch.full((1,), state.num_tokens, dtype=torch.long, device=self.device)
        self._warm_up(state, token, pos)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        pieces = Pieces(self.device)
        cutters = _cutters(self.model)
        for module in cutters:
            module.recorder = pieces
        try:
            with torch.cuda.stream(torch.cuda.Stream(self.device)):
                pieces.begin()
                try:
                    logits = self._static_step(state, token, pos)
                finally:
                    pieces.end()
        finally:
            for module in cutters:
                module.recorder = None
        return _Captured(key, pieces, token, pos, logits)

    def step(self, state: SequenceState, token_id: int) -> torch.Tensor | None:
        """Logits after feeding `token_id` at position `state.num_tokens` (None: graphs are off).

        KV capacity for the new position must already be reserved.
        """
        if not self.enabled:
            return None
        key = _buffers_key(state)
        try:
            if self.current is None or self.current.key != key:
                self.current = self._capture(state, key)
        except Exception as exc:  # noqa: BLE001 - any capture problem: fall back to eager decode
            self.enabled, self.current = False, None
            print(
                f"agentrt: CUDA graph capture failed ({type(exc).__name__}: {exc}); "
                "decoding eagerly",
                file=sys.stderr,
            )
            return None
        cap = self.current
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


def _cutters(model: CausalLM) -> list:
    """Objects in the step that cut captures: they have a `recorder` attribute (None outside a
    capture). The routed-experts object, and any module of the model."""
    found = [m for m in model.modules() if hasattr(m, "recorder")]
    if hasattr(model.experts, "recorder"):
        found.append(model.experts)
    return found
