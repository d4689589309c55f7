"""Routed experts behind one small interface: `experts(layer, hidden, topk_ids, topk_weights)`.

`RoutedExperts` holds, for every MoE layer, the stacked weights `gate_up [E, 2I, H]` (gate rows
first, then up rows, as in HF's fused layout) and `down [E, H, I]`, and computes the weighted sum of
the chosen experts for each token. Two equivalent dense paths: a grouped loop over the experts that
received tokens (prefill), and a gather + batched matmul with no host sync (few tokens, decode).
The offload engine replaces this object through the same call signature; the model files never
know where expert weights live.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GATHER_MAX_ROWS = 64  # token-expert pairs up to which the gather path is used


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of one expert: x `[N, H]`, gate_up `[2I, H]`, down `[H, I]` -> `[N, H]`."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


class RoutedExperts:
    """Stacked expert weights of every MoE layer, computed densely on their own device."""

    def __init__(self, gate_up: dict[int, torch.Tensor], down: dict[int, torch.Tensor]) -> None:
        self.gate_up = gate_up
        self.down = down

    @classmethod
    def empty(cls, layers, num_experts: int, hidden: int, inter: int, device, dtype) -> RoutedExperts:
        gate_up = {l: torch.empty(num_experts, 2 * inter, hidden, device=device, dtype=dtype) for l in layers}
        down = {l: torch.empty(num_experts, hidden, inter, device=device, dtype=dtype) for l in layers}
        return cls(gate_up, down)

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[T, H]`, ids/weights `[T, k]` -> `[T, H]` = sum_j weights[:, j] * expert_{ids[:, j]}(x)."""
        if ids.numel() <= GATHER_MAX_ROWS:
            return self.gathered(layer, x, ids, weights)
        return self.grouped(layer, x, ids, weights)

    def gathered(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Gather the chosen experts' weights and run them as one batched matmul (no host sync)."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        gate_up, down = self.gate_up[layer][flat], self.down[layer][flat]  # [Tk, 2I, H], [Tk, H, I]
        xs = x.repeat_interleave(top_k, dim=0).unsqueeze(1)  # [Tk, 1, H]
        gate, up = torch.bmm(xs, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, down.transpose(1, 2)).squeeze(1)  # [Tk, H]
        out = out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)
        return out.sum(1)

    def grouped(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sort token-expert pairs by expert and run each used expert once over its tokens."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up[layer].shape[0]).tolist()
        token_of = order // top_k
        xs = x[token_of]  # [Tk, H] sorted by expert
        ys = torch.empty_like(xs)
        begin = 0
        for expert, count in enumerate(counts):
            if count:
                end = begin + count
                ys[begin:end] = expert_ffn(xs[begin:end], self.gate_up[layer][expert], self.down[layer][expert])
                begin = end
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    def to(self, device=None, dtype=None) -> RoutedExperts:
        move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        return RoutedExperts({l: move(t) for l, t in self.gate_up.items()}, {l: move(t) for l, t in self.down.items()})

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.gate_up, self.down) for t in d.values())
