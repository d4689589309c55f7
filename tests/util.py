"""Small helpers shared by tests."""

from __future__ import annotations

import torch


def random_ids(n: int, vocab: int = 320, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def open_engine(path, chunk: int = 2048):
    """A CPU fp32 engine for a checkpoint directory."""
    from agentrt.config import EngineConfig
    from agentrt.engine import Engine
    from agentrt.models.loader import load_model

    model = load_model(path, "cpu", torch.float32)
    return Engine(
        model, EngineConfig(device="cpu", dtype="float32", prefill_chunk=chunk, linear_attn="torch")
    )
