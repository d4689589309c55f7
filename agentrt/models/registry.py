"""Resolve a model spec (`tiny`, `synthetic:NAME`, or a HF-format directory) to a loaded model.

`tokenizer_dir_of` says where a spec's tokenizer lives (if anywhere); tokenizers themselves are
loaded by the session layer. Knows nothing about engines or sessions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.errors import ModelNotFoundError
from agentrt.models.layers import CausalLM

SYNTHETIC_PREFIX = "synthetic:"
_TINY_SIZES = ("tiny", "tiny-qwen3-moe", "tiny-gpt-oss")  # (the tiny tokenizer fits them)


@dataclass
class ModelSource:
    model: CausalLM
    name: str
    path: Path | None  # checkpoint directory (None for in-memory synthetic models)
    identity: dict  # JSON-safe identity of the weights (for state-cache fingerprints)


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def check_spec(spec: str) -> None:
    """Cheap validation of a model spec (config and weight files listed; no weights read)."""
    from agentrt.models.config import ModelConfig
    from agentrt.models.loader import check_headers, checkpoint_files

    if spec == "tiny":
        return
    if spec.startswith(SYNTHETIC_PREFIX):
        from agentrt.models.synthetic import resolve_size

        resolve_size(spec[len(SYNTHETIC_PREFIX) :])
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {spec!r} not found: give a HF-format directory, 'tiny', or 'synthetic:NAME'"
        )
    ModelConfig.from_hf(path)
    check_headers(checkpoint_files(path))


def config_of(spec: str):
    """The `ModelConfig` of a spec, without loading weights."""
    from agentrt.models.config import ModelConfig
    from agentrt.models.tiny import ensure_tiny

    if spec.startswith(SYNTHETIC_PREFIX):
        from agentrt.models.synthetic import model_config, resolve_size

        return model_config(resolve_size(spec[len(SYNTHETIC_PREFIX) :]))
    path = ensure_tiny() if spec == "tiny" else Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {spec!r} not found: give a HF-format directory, 'tiny', or 'synthetic:NAME'"
        )
    return ModelConfig.from_hf(path)


MXFP4_SIZES = ("gpt-oss-20b", "gpt-oss-120b")  # synthetic shapes published with MXFP4 experts


def mxfp4_experts(spec: str) -> bool:
    """Whether `spec`'s routed experts come as MXFP4: a checkpoint whose config names an mxfp4
    quantization, or a synthetic gpt-oss shape (the published checkpoints are)."""
    if spec.startswith(SYNTHETIC_PREFIX):
        from agentrt.models.synthetic import resolve_size

        return resolve_size(spec[len(SYNTHETIC_PREFIX) :]).partition("@")[0] in MXFP4_SIZES
    if spec == "tiny":
        return False
    try:
        raw = json.loads((Path(spec).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def tokenizer_dir_of(spec: str) -> Path | None:
    """Where the tokenizer of `spec` lives (without loading the model), or None."""
    from agentrt.models.tiny import ensure_tiny

    if spec == "tiny":
        return ensure_tiny()
    if spec.startswith(SYNTHETIC_PREFIX):
        from agentrt.models.synthetic import resolve_size

        size = resolve_size(spec[len(SYNTHETIC_PREFIX) :])
        return ensure_tiny() if size.partition("@")[0] in _TINY_SIZES else None
    path = Path(spec).expanduser()
    return path if path.is_dir() and _has_tokenizer(path) else None


def open_model(
    spec: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0, experts=None
) -> ModelSource:
    """Load `spec` onto `device` in `dtype` (routed experts into `experts` when given)."""
    from agentrt.models.loader import load_model, weights_identity
    from agentrt.models.tiny import ensure_tiny

    if spec == "tiny":
        path = ensure_tiny()
        return ModelSource(
            load_model(path, device, dtype, experts=experts),
            "tiny",
            path,
            {"files": weights_identity(path)},
        )
    if spec.startswith(SYNTHETIC_PREFIX):
        from agentrt.models.synthetic import build_in_memory, resolve_size

        size = resolve_size(spec[len(SYNTHETIC_PREFIX) :])
        model = build_in_memory(size, device, dtype, seed=seed, experts=experts)
        ident = {"synthetic": size, "seed": seed, "device": torch.device(device).type}
        return ModelSource(model, spec, None, ident)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {spec!r} not found: give a HF-format directory, 'tiny', or 'synthetic:NAME'"
        )
    model = load_model(path, device, dtype, experts=experts)
    return ModelSource(model, path.name, path, {"files": weights_identity(path)})
