"""Token sampling: greedy, temperature, top-p (nucleus), seeded; and the parameters of one request.
Knows logits and token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # below this, sampling is argmax in fp32 anyway


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
    drop = before >= top_p
    drop[..., 0] = False  # the most likely token always stays
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from `[V]` fp32 logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    probs = top_p_filter(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))
