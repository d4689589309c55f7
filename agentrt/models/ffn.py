"""The feed-forward blocks of a decoder layer: the dense SwiGLU `MLP` (a dense layer's, or a MoE
block's shared expert), the softmax top-k `Router`, and `MoEBlock` (router, routed experts held
outside the module tree, optional sigmoid-gated shared expert), with their fused forms
(`fusion`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.models.config import ModelConfig
from agentrt.models.fusion import Fusable, row_blocks
from agentrt.models.moe import RoutedExperts


class MLP(Fusable):
    """Dense SwiGLU MLP (shared expert, dense layers); fused: gate and up as one matmul."""

    _gate_up: torch.Tensor | None = None

    def __init__(self, hidden: int, intermediate: int, fuse: bool = True) -> None:
        """`fuse` False: the block that holds this MLP fuses its gate and up (with more rows)."""
        super().__init__()
        self.fuse = fuse
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def fuse_rows(self) -> None:
        if self.fuse:
            self._gate_up = row_blocks([self.gate_proj, self.up_proj], self._gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self._gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Softmax over expert logits, top-k, optional renormalisation of the k weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [T, E]
        if self.normalize:  # the k largest probabilities renormalised: a softmax over their
            # logits (two kernels fewer, and a softmax over k values instead of E)
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1, dtype=torch.float).to(x.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        return ids, weights.to(x.dtype)


class MoEBlock(Fusable):
    """Router + routed experts (held outside the module tree) + optional shared expert. The
    router is `Router` under the name `gate` unless a model file passes its own (a module that
    maps `[T, H]` to ids and weights `[T, k]`) and the checkpoint's name for it. Fused: the
    shared expert's gate and up and its sigmoid gate as one matmul."""

    _shared_in: torch.Tensor | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        experts: RoutedExperts,
        router: nn.Module | None = None,
        router_name: str = "gate",
    ) -> None:
        super().__init__()
        self.layer = layer
        self.router_name = router_name
        self.add_module(router_name, router if router is not None else Router(cfg))
        self._experts = [experts]  # list: keeps the swappable object out of the module tree
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            # (its gate and up fused with the sigmoid gate below, by this block)
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, False)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    @property
    def router_weight(self) -> torch.Tensor:
        """The router's `[E, H]` weight (what the offload engine's prefetch predicts with)."""
        return getattr(self, self.router_name).weight

    def fuse_rows(self) -> None:
        if self.shared_expert is None:
            return
        shared = self.shared_expert
        parts = [shared.gate_proj, shared.up_proj, self.shared_expert_gate]
        self._shared_in = row_blocks(parts, self._shared_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = getattr(self, self.router_name)(x)
        out = self._experts[0](self.layer, x, ids, weights)
        if self.shared_expert is None:
            return out
        if self._shared_in is None:
            return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        inter = self.shared_expert.gate_proj.out_features
        gate, up, scale = F.linear(x, self._shared_in).split([inter, inter, 1], dim=-1)
        shared = self.shared_expert.down_proj(F.silu(gate) * up)
        return out + torch.sigmoid(scale) * shared
