"""Routed experts behind one small interface: `experts(layer, hidden, topk_ids, topk_weights)`.

`RoutedExperts` holds, for every MoE layer, the stacked weights `gate_up [E, 2I, H]` (gate rows
first, then up rows, as in HF's fused layout) and `down [E, H, I]`, optionally their biases
(`gate_up_bias [E, 2I]`, `down_bias [E, H]`) and an activation other than the plain SwiGLU
(`SwiGLU(limit, alpha)`: gpt-oss's clamped one), and computes the weighted sum of the chosen
experts for each token (grouped GEMM where torch has it, else gather/loop paths).
The offload engine replaces this object through the same call signature; the model files never
know where expert weights live.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrt.models import expert_gemv

GATHER_MAX_ROWS = 64  # token-expert pairs up to which the gather path is used


@dataclass(frozen=True)
class SwiGLU:
    """An expert's activation on its gate and up halves `[N, 2I]` -> `[N, I]`. `limit` 0: the
    plain silu(gate) * up; else gpt-oss's: gate clamped above at `limit`, up to +-`limit`,
    (up + 1) * gate * sigmoid(`alpha` * gate)."""

    limit: float = 0.0
    alpha: float = 1.0

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        if not self.limit:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


PLAIN = SwiGLU()


def expert_ffn(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    act: SwiGLU = PLAIN,
) -> torch.Tensor:
    """One expert: x `[N, H]`, gate_up `[2I, H]`, down `[H, I]` (biases `[2I]`, `[H]`) ->
    `[N, H]`."""
    return F.linear(act(F.linear(x, gate_up, gate_up_bias)), down, down_bias)


def _grouped_mm_fn():
    """torch's grouped GEMM (`F.grouped_mm`, or `torch._grouped_mm` on older releases), if any."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def unsort(ys: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert outputs `[Tk, H]` in sorted order -> `[T, k, H]` in token order, by a gather
    through the inverse permutation (a scatter, `unsorted[order] = ys`, took 6.3 of 93.7 ms of
    GPU time in a 2048-token pass of qwen3.5-35b-a3b on an H200)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return ys.index_select(0, inverse).view(-1, top_k, ys.shape[-1])


class ExpertBackend(ABC):
    """Where a model's routed experts run: `RoutedExperts` (every expert on the model's device)
    or the offload engine's `OffloadedExperts` (a host store behind a device cache). The model
    calls it once per MoE layer; the engine's CUDA graphs key their captures on what
    `buffers_key` names, so a backend whose device buffers change says so there."""

    @abstractmethod
    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x `[T, H]`, ids/weights `[T, k]` -> `[T, H]`: the weighted sum of the chosen experts."""

    def buffers_key(self) -> tuple[int, ...]:
        """Device buffers a captured step reads beyond the sequence state's (none here)."""
        return ()


class RoutedExperts(ExpertBackend):
    """Stacked expert weights of every MoE layer, computed densely on their own device.

    Paths (all equal up to float rounding; tests compare them): `expert_gemv.token_moe` (one
    token on CUDA: two kernels that read the chosen experts in place), `grouped_mm` (tokens
    sorted by expert, one grouped GEMM per projection, no host sync, CUDA-graph safe),
    `gathered` (few tokens: gather the chosen experts' weights and batch-matmul them), and
    `looped` (a Python loop over the experts that received tokens; the plain reference).
    """

    def __init__(
        self,
        gate_up: dict[int, torch.Tensor],
        down: dict[int, torch.Tensor],
        gate_up_bias: dict[int, torch.Tensor] | None = None,
        down_bias: dict[int, torch.Tensor] | None = None,
        act: SwiGLU = PLAIN,
    ) -> None:
        self.gate_up = gate_up
        self.down = down
        self.gate_up_bias = gate_up_bias
        self.down_bias = down_bias
        self.act = act
        self.use_grouped_mm = _grouped_mm_fn() is not None

    @classmethod
    def empty(
        cls,
        layers,
        num_experts: int,
        hidden: int,
        inter: int,
        device,
        dtype,
        bias: bool = False,
        act: SwiGLU = PLAIN,
    ) -> RoutedExperts:
        def stacks(*shape) -> dict[int, torch.Tensor]:
            return {
                layer: torch.empty(num_experts, *shape, device=device, dtype=dtype)
                for layer in layers
            }

        biases = (stacks(2 * inter), stacks(hidden)) if bias else (None, None)
        return cls(stacks(2 * inter, hidden), stacks(hidden, inter), *biases, act=act)

    def _biases(self, layer: int, expert) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gate/up and down biases of `expert` (an index or an index tensor), or Nones."""
        if self.gate_up_bias is None or self.down_bias is None:
            return None, None
        return self.gate_up_bias[layer][expert], self.down_bias[layer][expert]

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x `[T, H]`, ids/weights `[T, k]` -> `[T, H]`: sum_j w[:, j] * expert[ids[:, j]](x)."""
        gate_up, down = self.gate_up[layer], self.down[layer]
        if ids.shape[0] == 1 and expert_gemv.available(x) and expert_gemv.fits(gate_up, down):
            biases = self._biases(layer, slice(None))
            biases = None if biases[0] is None else biases
            y = expert_gemv.token_moe(x, ids, weights, gate_up, down, biases, self.act)
            return y.to(x.dtype).unsqueeze(0)  # (a decode token: two kernels)
        if self.use_grouped_mm:
            try:
                return self.grouped_mm(layer, x, ids, weights)
            except RuntimeError:  # unsupported dtype/device/layout for this torch build
                if x.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise  # a capture problem (the caller falls back), not grouped_mm's
                self.use_grouped_mm = False
        if ids.numel() <= GATHER_MAX_ROWS:
            return self.gathered(layer, x, ids, weights)
        return self.looped(layer, x, ids, weights)

    @staticmethod
    def _sort(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stable order of token-expert pairs by expert, and the token of each sorted pair."""
        order = torch.argsort(ids.reshape(-1), stable=True)
        return order, order // ids.shape[1]

    @classmethod
    def _combine(cls, ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum over its k experts' (unweighted) outputs."""
        unsorted = unsort(ys, order, weights.shape[1])
        return (unsorted * weights.unsqueeze(-1).to(ys.dtype)).sum(1)

    def grouped_mm(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        grouped = _grouped_mm_fn()
        num_experts = self.gate_up[layer].shape[0]
        order, token_of = self._sort(ids)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1), dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        h = grouped(x[token_of], self.gate_up[layer].transpose(1, 2), offs=offs)  # [Tk, 2I]
        # routing weights scale the activations [Tk, I] (a quarter of the outputs' size) before
        # the down projection; the combine is then a plain sum (a [1, k] x [k, H] product per
        # token took 5.4 ms of a 90.8 ms 2048-token pass: M=1 GEMMs are a poor fit)
        scale = weights.reshape(-1).index_select(0, order).to(h.dtype).unsqueeze(1)
        up_bias, down_bias = self._biases(layer, ids.reshape(-1).index_select(0, order))
        if up_bias is None:
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up) if self.act == PLAIN else self.act(h)
            ys = grouped(act.mul_(scale), self.down[layer].transpose(1, 2), offs=offs)
        else:
            act = self.act(h + up_bias).mul_(scale)
            ys = grouped(act, self.down[layer].transpose(1, 2), offs=offs) + down_bias * scale
        return unsort(ys, order, ids.shape[1]).sum(1)

    def gathered(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Gather the chosen experts' weights and run them as one batched matmul (no host sync)."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        gate_up, down = self.gate_up[layer][flat], self.down[layer][flat]  # [Tk, 2I, H], [Tk, H, I]
        xs = x.repeat_interleave(top_k, dim=0).unsqueeze(1)  # [Tk, 1, H]
        h = torch.bmm(xs, gate_up.transpose(1, 2))  # [Tk, 1, 2I]
        up_bias, down_bias = self._biases(layer, flat)
        if up_bias is not None:
            h = h + up_bias.unsqueeze(1)
        out = torch.bmm(self.act(h), down.transpose(1, 2)).squeeze(1)  # [Tk, H]
        if down_bias is not None:
            out = out + down_bias
        return (out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(1)

    def looped(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Reference: run each used expert once over its sorted tokens (one host sync)."""
        order, token_of = self._sort(ids)
        counts = torch.bincount(ids.reshape(-1), minlength=self.gate_up[layer].shape[0]).tolist()
        xs = x[token_of]
        ys = torch.empty_like(xs)
        begin = 0
        for expert, count in enumerate(counts):
            if count:
                end = begin + count
                ys[begin:end] = expert_ffn(
                    xs[begin:end],
                    self.gate_up[layer][expert],
                    self.down[layer][expert],
                    *self._biases(layer, expert),
                    act=self.act,
                )
                begin = end
        return self._combine(ys, order, weights)

    def num_bytes(self) -> int:
        stacks = [d for d in (self.gate_up, self.down, self.gate_up_bias, self.down_bias) if d]
        return sum(t.numel() * t.element_size() for d in stacks for t in d.values())
