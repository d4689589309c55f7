"""Frozen configuration dataclasses (environment variables are read in `env.py`).

`ModelConfig` is the architecture-neutral description of a checkpoint that every model file builds
from (`ModelConfig.from_hf` reads a Hugging Face `config.json`, including the nested `text_config`
of multimodal Qwen3.5 checkpoints). `EngineConfig` holds the engine's settings. This module knows
nothing about torch tensors, models or sessions.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agentrt.env import home_dir
from agentrt.errors import InvalidArgumentError, ModelFormatError, UnsupportedArchitectureError

SUPPORTED_ARCHS = ("qwen3_5_moe", "qwen3_moe")
LINEAR = "linear_attention"
FULL = "full_attention"

# model_type values found in config.json -> our architecture name
_MODEL_TYPES = {
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_moe": "qwen3_moe",
}


# ----------------------------------------------------------------------------- model config


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

    def canonical(self) -> dict[str, Any]:
        """JSON-safe dict of every field that changes the computation (for fingerprints)."""
        data = asdict(self)
        data.pop("extra")
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
        raise ModelFormatError(f"no config.json in {path.parent}")
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


def _arch_of(raw: dict) -> str:
    model_type = raw.get("model_type")
    if model_type is None:
        raise ModelFormatError("config.json has no model_type")
    arch = _MODEL_TYPES.get(str(model_type))
    if arch is None:
        raise UnsupportedArchitectureError(
            f"unknown architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch


def _rope(text: dict) -> tuple[float, float]:
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ModelFormatError("config.json: rope_parameters / rope_scaling must be objects")
    rope_type = (
        params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    if rope_type not in ("default", "mrope"):
        raise UnsupportedArchitectureError(f"rope type {rope_type!r} is not supported yet")
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _layer_types(arch: str, text: dict, num_layers: int) -> tuple[str, ...]:
    if arch != "qwen3_5_moe":
        return (FULL,) * num_layers
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ModelFormatError(f"layer_types does not describe {num_layers} layers: {types}")
    return tuple(types)


def _dense_layers(arch: str, text: dict, num_layers: int) -> tuple[int, ...]:
    if arch != "qwen3_moe":
        return ()
    only = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)


def _require(text: dict, key: str, *aliases: str) -> Any:
    for name in (key, *aliases):
        if text.get(name) is not None:
            return text[name]
    raise ModelFormatError(f"config.json lacks {key!r}")


def _from_hf_dict(raw: dict) -> ModelConfig:
    arch = _arch_of(raw)
    text, prefix = _text_section(raw)
    if text.get("use_sliding_window"):
        raise UnsupportedArchitectureError("sliding-window attention is not supported yet")
    try:
        num_layers = int(_require(text, "num_hidden_layers"))
        hidden = int(_require(text, "hidden_size"))
        heads = int(_require(text, "num_attention_heads"))
        theta, partial = _rope(text)
        cfg = ModelConfig(
            arch=arch,
            vocab_size=int(_require(text, "vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=_layer_types(arch, text, num_layers),
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
            moe_intermediate_size=int(_require(text, "moe_intermediate_size")),
            norm_topk_prob=bool(text.get("norm_topk_prob", arch == "qwen3_5_moe")),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            intermediate_size=int(text.get("intermediate_size") or 0),
            dense_layers=_dense_layers(arch, text, num_layers),
            linear_num_key_heads=int(text.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(text.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(text.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(text.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim") or 4),
            eos_token_ids=_eos_ids(text.get("eos_token_id")),
            weight_prefix=prefix,
            torch_dtype=str(
                text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or "bfloat16"
            ),
        )
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        raise ModelFormatError(f"malformed config.json: {type(exc).__name__}: {exc}") from None
    _validate(cfg)
    return cfg


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


# ----------------------------------------------------------------------------- engine config

_DTYPES = ("float32", "bfloat16", "float16")
OFFLOADED_PREFILL_CHUNK = 8192  # default prefill chunk with offloaded experts on CUDA


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the inference engine for one loaded model."""

    device: str = "cpu"
    dtype: str = "float32"
    prefill_chunk: int = 2048
    linear_attn: str = "auto"  # auto | torch | fla
    kv_grow_tokens: int = 1024
    cuda_graphs: bool = True  # capture the decode step on CUDA (False = --eager)
    prefill_graphs: bool = False  # short prefills as CUDA graphs of padded lengths (experimental)
    # eager prefill moves a capture inside a piece back onto this grid of the piece (tokens; 0:
    # captures stay where asked; None: 64 with fla's kernels, else 0), see Engine.capture_grid
    capture_grid: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise InvalidArgumentError(
                f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}"
            )
        if self.linear_attn not in ("auto", "torch", "fla"):
            raise InvalidArgumentError(
                f"linear_attn must be auto, torch or fla, got {self.linear_attn!r}"
            )
        if self.prefill_chunk < 1:
            raise InvalidArgumentError("prefill_chunk must be >= 1")
        if self.capture_grid not in (None, 0, 64):
            raise InvalidArgumentError(
                f"capture_grid must be 0 or 64 (the delta rule's chunk), got {self.capture_grid!r}"
            )

    @staticmethod
    def default_prefill_chunk(device: str, offloaded: bool) -> int:
        """Tokens per prefill chunk when none is asked for: with offloaded experts on CUDA each
        chunk brings every missing expert over PCIe once (about the same time for 4K and 8K
        tokens), so larger chunks amortise it: 8192; else 2048."""
        return OFFLOADED_PREFILL_CHUNK if offloaded and device.startswith("cuda") else 2048

    @staticmethod
    def default_dtype(device: str) -> str:
        return "float32" if device == "cpu" else "bfloat16"


# ----------------------------------------------------------------------------- state cache config

GIB = 2**30


def parse_bytes(text: str | int | float) -> int:
    """'16GiB', '512MB', '2g', 1.5e9 -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6}
    units |= {
        "mib": 2**20,
        "g": GIB,
        "gb": 10**9,
        "gib": GIB,
        "t": 2**40,
        "tb": 10**12,
        "tib": 2**40,
    }
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    try:
        return int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise InvalidArgumentError(f"cannot read {text!r} as a size (e.g. 16GiB, 512MB)") from None


def default_state_dir() -> Path:
    return home_dir() / "state"


@dataclass(frozen=True)
class StateCacheConfig:
    """Settings of the semantic state cache (docs/architecture.md §6)."""

    state_dir: Path = field(default_factory=default_state_dir)
    max_bytes: int = 20 * GIB  # cap on stored payloads (--state-max-gb)
    ram_bytes: int = 2 * GIB  # RAM tier of recent checkpoints
    min_distance: int = 128  # minimum tokens between two checkpoints taken in one pass
    queue_size: int = 8  # background writer queue; a full queue drops checkpoints
    compress_level: int = 1
    workers: int = 4  # decompression threads
    staging_bytes: int = 2 * GIB  # pinned host ring for device->host checkpoint copies (CUDA)

    def __post_init__(self) -> None:
        if not isinstance(self.state_dir, Path):  # a str from Python callers
            object.__setattr__(self, "state_dir", Path(self.state_dir).expanduser())
        if self.max_bytes <= 0 or self.ram_bytes < 0:
            raise InvalidArgumentError("state cache sizes must be positive")
        if self.min_distance < 0 or self.queue_size < 1 or self.workers < 1:
            raise InvalidArgumentError("invalid state cache settings")


# ----------------------------------------------------------------------------- offload config

OFFLOAD_MODES = ("none", "auto", "static", "layer")
PREFILL_PLANS = (
    "auto",
    "stream",
    "routed",
    "predicted",
)  # `OffloadConfig.prefill_plan` (offload/planner.py)
CPU_KERNELS = ("auto", "torch", "native")  # `OffloadConfig.cpu_kernel` (offload/cpu_kernel.py)


def offload_mode(mode: str | None, vram_budget, expert_cache_slots) -> str:
    """The `--offload` mode in effect: as given, else `auto` when a VRAM budget or an expert
    slot count is given, else `none`."""
    if mode:
        return mode
    return "auto" if vram_budget is not None or expert_cache_slots is not None else "none"


@dataclass(frozen=True)
class OffloadConfig:
    """Expert placement (docs/architecture.md §5). `auto`: host store + device expert cache + q*
    split; `static`: the experts of the first `cpu_moe_layers` MoE layers run on the CPU, the rest
    stay on the device (llama.cpp's --n-cpu-moe); `layer`: the first `cpu_layers` decoder layers run
    whole on the CPU (Ollama's partial offload); `none`: every expert on the device. For static and
    layer, None means the fewest CPU layers that let the rest fit `vram_budget` (0 without a
    budget)."""

    mode: str = "none"
    split: bool = True
    policy: str = "lru"
    # decode: copy ahead the experts the next layer's router predicts from this layer's input
    prefetch: bool = True
    # a decode token's CPU experts: torch's kernels, the native bf16 kernel built at first use
    # (offload/cpu_kernel.py; falls back to torch's without a C compiler), or auto: native where
    # the CPU has AVX512-BF16
    cpu_kernel: str = "auto"
    expert_cache_slots: int | None = None
    vram_budget: int | None = None  # bytes
    cpu_moe_layers: int | None = None
    cpu_layers: int | None = None
    kv_reserve_tokens: int = 32768
    workspace_bytes: int = GIB
    copy_bandwidth: float | None = None  # bytes/s overrides (else calibrated)
    cpu_bandwidth: float | None = None
    # offloaded prefill: how a layer's missing experts come (offload/planner.py) and the device
    # bytes of its staging ring (None: half a layer of experts; taken from the expert cache)
    prefill_plan: str = "auto"
    staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise InvalidArgumentError(
                f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.mode!r}"
            )
        if self.policy not in ("lru", "lfu"):
            raise InvalidArgumentError(
                f"expert cache policy must be lru or lfu, got {self.policy!r}"
            )
        if self.cpu_kernel not in CPU_KERNELS:
            raise InvalidArgumentError(
                f"cpu kernel must be auto, torch or native, got {self.cpu_kernel!r}"
            )
        if self.prefill_plan not in PREFILL_PLANS:
            raise InvalidArgumentError(
                f"prefill plan must be one of {', '.join(PREFILL_PLANS)}, got {self.prefill_plan!r}"
            )
        if self.staging_bytes is not None and self.staging_bytes < 0:
            raise InvalidArgumentError("staging_bytes must be >= 0")
        if self.expert_cache_slots is not None and self.expert_cache_slots < 1:
            raise InvalidArgumentError("expert_cache_slots must be >= 1")
        for name in ("cpu_moe_layers", "cpu_layers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{name} must be >= 0")
