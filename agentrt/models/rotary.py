"""Rotary position embedding: the default one and YaRN's scaled frequencies (`rope_frequencies`),
applied rotate-half to the first `rotary_dim` channels of each head; positions are a Python int
(eager) or a `[1]` device tensor (static passes)."""

from __future__ import annotations

import math

import torch
from torch import nn

from agentrt.models import per_pass
from agentrt.models.config import ModelConfig


def rope_frequencies(
    dim: int, theta: float, scaling: dict[str, float]
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[dim/2]` and the factor cos/sin are scaled by: the default rotary
    embedding, or YaRN's (`scaling` with `factor`, `beta_fast`, `beta_slow`,
    `original_max_position_embeddings`, `truncate`): interpolated low frequencies, kept high
    ones, a linear ramp between, and cos/sin scaled by 0.1 ln(factor) + 1. Computed on the CPU
    (the caller moves them): under a meta-device context, `arange` loads torch._dynamo (2 s)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
    base = 1.0 / (theta**exponent)
    if not scaling:
        return base, 1.0
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(scaling["beta_fast"]), correction(scaling["beta_slow"])
    if scaling.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float, device="cpu") - low) / ((high - low) or 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: the base frequency (extrapolation), 0: interpolated
    inv_freq = base / factor * (1 - keep) + base * keep
    return inv_freq, (0.1 * math.log(factor) + 1.0) if factor > 1 else 1.0


class Rotary(nn.Module):
    """Rotary position embedding on the first `rotary_dim` channels of each head (rotate-half),
    default or YaRN-scaled (`scaling`, see `rope_frequencies`)."""

    def __init__(self, head_dim: int, partial: float, theta: float, scaling: tuple = ()) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial)
        self.theta = theta
        self.scaling = tuple(scaling)
        inv_freq, self.attention_factor = rope_frequencies(self.rotary_dim, theta, dict(scaling))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def of(cls, cfg: ModelConfig) -> Rotary:
        return cls(cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta, cfg.rope_scaling)

    def cos_sin(
        self, start: int | torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[length, rotary_dim]` for positions start.. (`start` a Python int, or a
        `[1]` device tensor in static passes); sin's first half negated (see `_cos_sin`).
        Shared by the attention layers of one pass (`per_pass`)."""
        inv = self.inv_freq
        shape = (length, dtype, inv.device, self.rotary_dim, self.theta, self.scaling)
        if isinstance(start, torch.Tensor):  # static pass: position held in a device tensor
            key = ("cos_sin of", start.data_ptr(), *shape)
        else:
            key = ("cos_sin at", start, *shape)

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            if isinstance(start, torch.Tensor):
                pos = start.float() + torch.arange(length, device=start.device, dtype=torch.float)
            else:
                pos = torch.arange(start, start + length, device=inv.device, dtype=torch.float)
            return self._cos_sin(pos, dtype)

        return per_pass.shared(key, make)

    def _cos_sin(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of `[-freqs, freqs]`: sin comes with its first half negated, which folds
        rotate-half's negation into the table (`apply` launches no negation)."""
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat([-freqs, freqs], dim=-1)  # [T, rotary_dim]
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (
                emb.sin() * self.attention_factor
            ).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[T, H, D]` rotated by `cos_sin`'s tables (rotate-half: the halves swapped, times
        the signed sin)."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos[:, None, :] + swapped * sin[:, None, :]
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, start: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, H, D]` and k `[T, Hkv, D]` rotated for positions start.. in one `apply` over
        all their heads: read in place where k's heads follow q's in one projection's output
        (a fused q/k/v), else joined first. Returns views of the result."""
        cos, sin = self.cos_sin(start, q.shape[0], q.dtype)
        out = self.apply(_heads_of_both(q, k), cos, sin)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]


def _heads_of_both(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`[T, H + Hkv, D]`: a view where k's heads follow q's in memory at q's strides, else a
    copy of both."""
    t, h, d = q.shape
    adjacent = (
        (t == 1 or q.stride(0) == k.stride(0))  # (a single token's row stride is arbitrary)
        and q.stride()[1:] == k.stride()[1:]
        and q.stride(1) == d
        and q.stride(2) == 1
        and k.shape[0] == t
        and k.shape[2] == d
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and k.data_ptr() == q.data_ptr() + h * d * q.element_size()
    )
    if adjacent:
        return q.as_strided((t, h + k.shape[1], d), q.stride())
    return torch.cat([q, k], dim=1)
