"""`ModelConfig`: the architecture-neutral description of a checkpoint that every model file
builds from. `ModelConfig.from_hf` reads a Hugging Face `config.json` (including the nested
`text_config` of multimodal Qwen3.5 checkpoints). Knows nothing about tensors or sessions."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agentrt.errors import ModelFormatError, UnsupportedArchitectureError

LINEAR = "linear_attention"
FULL = "full_attention"

# ----------------------------------------------------------------------------- model config

_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "sliding_window": 0,
    "sliding_layers": (),
    "rope_scaling": (),
    "expert_bias": False,
    "swiglu_limit": 0.0,
    "swiglu_alpha": 0.0,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of one text model (architecture-neutral field names)."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    intermediate_size: int = 0  # dense MLP size (qwen3_moe mlp_only_layers)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    eos_token_ids: tuple[int, ...] = ()
    # attention layers that see only the last `sliding_window` positions (gpt-oss: every other)
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # rotary scaling beyond the default, as sorted (name, value) pairs (e.g. YaRN's)
    rope_scaling: tuple[tuple[str, float], ...] = ()
    # routed experts with biases and gpt-oss's clamped SwiGLU (limit 0: the plain SwiGLU)
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    weight_prefix: str = "model."  # where the text model's weights live in the checkpoint
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived helpers
    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def plain_experts(self) -> bool:
        """Routed experts are bias-free SwiGLUs (what the offload engine runs)."""
        return not self.expert_bias and not self.swiglu_limit

    def canonical(self) -> dict[str, Any]:
        """JSON-safe dict of every field that changes the computation (for fingerprints);
        the optional fields at their defaults are left out (earlier fingerprints hold)."""
        data = asdict(self)
        data.pop("extra")
        for name, default in _OPTIONAL_DEFAULTS.items():
            if data[name] == default:
                data.pop(name)
        return json.loads(json.dumps(data))

    def with_changes(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    # ---- loading
    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict) -> ModelConfig:
        """Build from a HF `config.json` path, a model directory, or an already parsed dict."""
        raw = source if isinstance(source, dict) else _read_config_json(Path(source))
        return _from_hf_dict(raw)


def _read_config_json(path: Path) -> dict:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        where = path.parent if path.name == "config.json" else path
        raise ModelFormatError(f"no config.json in {where} (a model directory)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"malformed {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"malformed {path}: top level is not a JSON object")
    return data


def _text_section(raw: dict) -> tuple[dict, str]:
    """Return the text-model part of a config and the weight prefix of its tensors."""
    if isinstance(raw.get("text_config"), dict):
        text = dict(raw["text_config"])
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        if "eos_token_id" not in text or text["eos_token_id"] is None:
            text["eos_token_id"] = raw.get("eos_token_id")
        return text, "model.language_model."
    return raw, "model."


_YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


def _rope(text: dict, module) -> tuple[float, float, tuple]:
    """(theta, partial rotary factor, scaling pairs) of a config's rotary embedding (the model
    file's defaults where the config names none)."""
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    if not params and not scaling:
        params = dict(getattr(module, "DEFAULT_ROPE_PARAMETERS", None) or {})
    default_theta = getattr(module, "DEFAULT_ROPE_THETA", 10000.0)
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ModelFormatError("config.json: rope_parameters / rope_scaling must be objects")
    rope_type = (
        params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    if rope_type not in ("default", "mrope", "yarn"):
        raise UnsupportedArchitectureError(f"rope type {rope_type!r} is not supported yet")
    theta = params.get("rope_theta", text.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    pairs: tuple = ()
    if rope_type == "yarn":
        merged = {**scaling, **params}
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if merged.get(key) not in (None, 0, 1, 1.0):
                raise UnsupportedArchitectureError(f"YaRN with {key} is not supported yet")
        values = {k: float(_require(merged, k)) for k in _YARN_KEYS}
        values["truncate"] = float(bool(merged.get("truncate", True)))
        pairs = tuple(sorted(values.items()))
    return float(theta), float(partial), pairs


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _layer_types(types, num_layers: int) -> tuple[str, ...]:
    if len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ModelFormatError(f"layer_types does not describe {num_layers} layers: {types}")
    return tuple(types)


def _require(text: dict, key: str, *aliases: str) -> Any:
    for name in (key, *aliases):
        if text.get(name) is not None:
            return text[name]
    raise ModelFormatError(f"config.json lacks {key!r}")


def _from_hf_dict(raw: dict) -> ModelConfig:
    from agentrt.models.architectures import arch_of, architecture  # (they import this module)

    arch = arch_of(raw.get("model_type"))
    text, prefix = _text_section(raw)
    if text.get("use_sliding_window"):
        raise UnsupportedArchitectureError("sliding-window attention is not supported yet")
    try:
        num_layers = int(_require(text, "num_hidden_layers"))
        hidden = int(_require(text, "hidden_size"))
        heads = int(_require(text, "num_attention_heads"))
        module = architecture(arch)
        theta, partial, rope_scaling = _rope(text, module)
        fields = module.config_fields(text, num_layers)
        cfg = ModelConfig(
            arch=arch,
            vocab_size=int(_require(text, "vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=_layer_types(fields["layer_types"], num_layers),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or (hidden // heads if heads else 0)),
            rope_theta=theta,
            partial_rotary_factor=partial,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            num_experts=int(_require(text, "num_experts", "num_local_experts")),
            num_experts_per_tok=int(_require(text, "num_experts_per_tok")),
            moe_intermediate_size=int(
                fields.get("moe_intermediate_size") or _require(text, "moe_intermediate_size")
            ),
            norm_topk_prob=fields["norm_topk_prob"],
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            intermediate_size=int(
                fields.get("intermediate_size", text.get("intermediate_size")) or 0
            ),
            dense_layers=fields.get("dense_layers", ()),
            linear_num_key_heads=int(text.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(text.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(text.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(text.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim") or 4),
            eos_token_ids=_eos_ids(text.get("eos_token_id")),
            sliding_window=int(fields.get("sliding_window", 0)),
            sliding_layers=tuple(fields.get("sliding_layers", ())),
            rope_scaling=rope_scaling,
            expert_bias=bool(fields.get("expert_bias", False)),
            swiglu_limit=float(fields.get("swiglu_limit", 0.0)),
            swiglu_alpha=float(fields.get("swiglu_alpha", 0.0)),
            weight_prefix=prefix,
            torch_dtype=str(
                text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or "bfloat16"
            ),
        )
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        raise ModelFormatError(f"malformed config.json: {type(exc).__name__}: {exc}") from None
    _validate(cfg)
    return cfg


DTYPES = ("float32", "bfloat16", "float16")
_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "max_position_embeddings",
)


def _validate(cfg: ModelConfig) -> None:
    bad = [name for name in _POSITIVE if getattr(cfg, name) <= 0]
    if bad:
        raise ModelFormatError(f"config.json: {', '.join(bad)} must be positive")
    if (
        cfg.is_hybrid
        and min(cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim) <= 0
    ):
        raise ModelFormatError(
            "config.json: linear-attention head counts and dims must be positive"
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelFormatError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ModelFormatError("num_experts_per_tok exceeds num_experts")
    if cfg.is_hybrid and cfg.linear_num_value_heads % max(cfg.linear_num_key_heads, 1):
        raise ModelFormatError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.dense_layers and not cfg.intermediate_size:
        raise ModelFormatError("dense MLP layers need intermediate_size")
    if cfg.torch_dtype not in DTYPES:
        raise ModelFormatError(f"config.json: dtype {cfg.torch_dtype!r} is not one of {DTYPES}")
    if cfg.is_hybrid and cfg.linear_conv_kernel_dim <= 0:
        raise ModelFormatError("config.json: linear_conv_kernel_dim must be positive")
    if cfg.sliding_layers and cfg.sliding_window <= 0:
        raise ModelFormatError("sliding-window layers need a positive sliding_window")
