"""The architectures agentrt runs. Each model file declares the config.json `model_type`s it
reads (`MODEL_TYPES`), its architecture-specific `ModelConfig` fields (`config_fields(text,
num_layers)`), how its norm weights are stored (`ZERO_CENTERED_NORMS`, for synthetic weights)
and its builder (`build(cfg, experts)`); adding an architecture is its file plus one line
here."""

from __future__ import annotations

from types import ModuleType

from agentrt.errors import ModelFormatError, UnsupportedArchitectureError
from agentrt.models import gpt_oss, qwen3_5_moe, qwen3_moe

ARCHITECTURES: dict[str, ModuleType] = {
    "gpt_oss": gpt_oss,
    "qwen3_5_moe": qwen3_5_moe,
    "qwen3_moe": qwen3_moe,
}


def architecture(name: str) -> ModuleType:
    """The model file of architecture `name`."""
    module = ARCHITECTURES.get(name)
    if module is None:
        raise UnsupportedArchitectureError(f"no model implementation for {name!r}")
    return module


def arch_of(model_type: object) -> str:
    """The architecture that reads config.json's `model_type`."""
    if model_type is None:
        raise ModelFormatError("config.json has no model_type")
    for name, module in ARCHITECTURES.items():
        if str(model_type) in module.MODEL_TYPES:
            return name
    raise UnsupportedArchitectureError(
        f"unknown architecture {model_type!r}; supported: {', '.join(ARCHITECTURES)}"
    )
