"""CUDA-graph capture and replay of the single-token decode step (all CUDA-graph code lives here).

The step runs the model in its static form (position in a device tensor, KV written with
`index_copy_`, attention over the whole reserved capacity under a mask), so every replay launches
the same kernels on the same buffers. A graph is valid only for the exact cache buffers it was
captured on; the key is their data pointers, so growing the KV buffers or switching to another
`SequenceState` triggers a new capture (one graph is kept at a time). Any capture failure
disables graphs for the engine and decode continues eagerly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from agentrt.engine.state import SequenceState
from agentrt.models.cache import KVCache
from agentrt.models.layers import CausalLM


@dataclass
class _Captured:
    key: tuple[int, ...]
    graph: torch.cuda.CUDAGraph
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
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._static_step(state, token, pos)
        return _Captured(key, graph, token, pos, logits)

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
        cap.graph.replay()
        return cap.logits.clone()
