"""`agentrt model info`: describe a model spec (directory, `tiny`, `synthetic:NAME`) from its
config alone (shapes on the meta device, no weights loaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrt.errors import ModelNotFoundError
from agentrt.models import torch_dtype
from agentrt.models.config import ModelConfig
from agentrt.models.registry import SYNTHETIC_PREFIX


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _resolve(spec: str) -> tuple[ModelConfig, Path | None]:
    from agentrt.models.synthetic import model_config, resolve_size
    from agentrt.models.tiny import ensure_tiny

    if spec.startswith(SYNTHETIC_PREFIX):
        return model_config(resolve_size(spec[len(SYNTHETIC_PREFIX) :])), None
    path = ensure_tiny() if spec == "tiny" else Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model {spec!r} not found")
    return ModelConfig.from_hf(path), path


def _files(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {"checkpoint": "built in memory (seeded random weights)"}
    from agentrt.models.loader import checkpoint_files

    files = checkpoint_files(path)
    return {
        "checkpoint": str(path),
        "weight_files": len(files),
        "weight_bytes": _gib(sum(f.stat().st_size for f in files)),
        "tokenizer": (path / "tokenizer.json").is_file(),
        "chat_template": _has_template(path),
    }


def _has_template(path: Path) -> bool:
    import json

    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return (path / "chat_template.jinja").is_file()


def describe(spec: str) -> dict[str, Any]:
    from agentrt.models.synthetic import parameter_counts

    cfg, path = _resolve(spec)
    counts = parameter_counts(cfg)
    itemsize = torch_dtype(cfg.torch_dtype).itemsize
    return {
        "model": spec,
        "architecture": cfg.arch,
        "layers": _layers_line(cfg),
        "hidden_size": cfg.hidden_size,
        "attention": f"{cfg.num_heads} heads, {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}",
        "experts": f"{cfg.num_experts} routed, top-{cfg.num_experts_per_tok}, "
        f"intermediate {cfg.moe_intermediate_size}"
        + (
            f", shared {cfg.shared_expert_intermediate_size}"
            if cfg.shared_expert_intermediate_size
            else ""
        ),
        "expert_bytes": f"{cfg.expert_params * itemsize / 2**20:.2f} MiB per expert "
        f"({cfg.torch_dtype})",
        "vocab_size": cfg.vocab_size,
        "context": cfg.max_position_embeddings,
        "params_total": f"{counts['total'] / 1e9:.3f} B",
        "params_active": f"{counts['active_per_token'] / 1e9:.3f} B per token",
        "routed_expert_bytes": _gib(counts["routed_experts"] * itemsize),
        **_mxfp4_bytes(cfg),
        **_files(path),
    }


def _mxfp4_bytes(cfg) -> dict[str, str]:
    """What the routed experts take kept MXFP4-packed (`--expert-format mxfp4`), where they can
    be (hidden and expert sizes multiples of 32)."""
    if cfg.hidden_size % 32 or cfg.moe_intermediate_size % 32:
        return {}
    per_expert = cfg.expert_params * 17 // 32
    total = per_expert * cfg.num_experts * len(cfg.moe_layers)
    return {"routed_mxfp4_bytes": f"{_gib(total)} ({per_expert / 2**20:.2f} MiB per expert)"}


def _layers_line(cfg) -> str:
    """Layer count by kind: linear attention, full attention, sliding-window attention."""
    sliding = len(cfg.sliding_layers)
    parts = [f"{len(cfg.linear_layers)} linear-attention"]
    parts.append(f"{len(cfg.attention_layers) - sliding} full-attention")
    if sliding:
        parts.append(f"{sliding} sliding-window ({cfg.sliding_window})")
    return f"{cfg.num_layers} ({', '.join(parts)})"
