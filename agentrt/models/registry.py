"""Resolve a model spec (`tiny`, `synthetic:NAME`, or a HF-format directory) to a loaded model.

Returns the model plus where its tokenizer lives (if anywhere); tokenizers themselves are loaded
by the session layer. Knows nothing about engines or sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.errors import ModelNotFoundError
from agentrt.models.layers import CausalLM

SYNTHETIC_PREFIX = "synthetic:"
_TINY_SIZES = ("tiny", "tiny-qwen3-moe")


@dataclass
class ModelSource:
    model: CausalLM
    name: str
    path: Path | None  # checkpoint directory (None for in-memory synthetic models)
    tokenizer_dir: Path | None


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def open_model(spec: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> ModelSource:
    """Load `spec` onto `device` in `dtype`."""
    from agentrt.models.loader import load_model
    from agentrt.models.tiny import ensure_tiny

    if spec == "tiny":
        path = ensure_tiny()
        return ModelSource(load_model(path, device, dtype), "tiny", path, path)
    if spec.startswith(SYNTHETIC_PREFIX):
        from agentrt.models.synthetic import build_in_memory, resolve_size

        size = resolve_size(spec[len(SYNTHETIC_PREFIX) :])
        model = build_in_memory(size, device, dtype, seed=seed)
        tok = ensure_tiny() if size in _TINY_SIZES else None
        return ModelSource(model, spec, None, tok)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {spec!r} not found: give a HF-format directory, 'tiny', or 'synthetic:NAME'"
        )
    model = load_model(path, device, dtype)
    return ModelSource(model, path.name, path, path if _has_tokenizer(path) else None)
