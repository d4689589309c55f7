"""Synthetic checkpoints: seeded random weights with the exact shapes of real models.

Sizes: `tiny` (the embedded default, a small hybrid `qwen3_5_moe`), `tiny-qwen3-moe`,
`tiny-gpt-oss`, and real shapes `qwen3.5-35b-a3b`, `qwen3-30b-a3b`, `gpt-oss-20b`, `gpt-oss-120b`
(written checkpoints hold gpt-oss experts in the model's dtype, not MXFP4: the 120b shape takes
234 GB in bf16; built in memory into a packed expert store, `--expert-format mxfp4`, they are
drawn as MXFP4 codes, 61 GB).
A checkpoint can be written to disk in HF format (config.json + safetensors, sharded per layer for
large sizes, fused expert tensors) or built straight into device memory for benchmarks (no disk
copy). Written files are owner-only (0600; directories it creates, 0700). Every tensor has its own
seed derived from (seed, name), so a tensor never depends on generation order. On CPU the values
come from integer draws of torch's Mersenne Twister scaled to a uniform distribution, so files are
byte-identical on every machine; on CUDA, in-memory builds use the device generator
(deterministic per device, not equal to CPU). Real-size figures made with these weights are NOT
the real models' quality or routing statistics.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from agentrt.errors import InvalidArgumentError
from agentrt.host.private import private_dir, private_output, write_private
from agentrt.models import FP32_PARAMS, build_empty, torch_dtype
from agentrt.models.architectures import architecture
from agentrt.models.config import FULL, LINEAR, ModelConfig
from agentrt.models.layers import CausalLM

INIT_STD = 0.02
_Q35_35B = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    max_position_embeddings=262144,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    dtype="bfloat16",
    eos_token_id=248044,
)
_Q3_30B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=6144,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    dtype="bfloat16",
    eos_token_id=151645,
)
_GPT_OSS_120B = dict(
    model_type="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=36,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=128,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    swiglu_limit=7.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    dtype="bfloat16",
    eos_token_id=200002,
)
_GPT_OSS_20B = _GPT_OSS_120B | dict(num_hidden_layers=24, num_local_experts=32)
# The tiny sizes keep each real model's structure at toy widths (fp32, long context for traces).
_TINY_SHAPE = dict(
    vocab_size=2048,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    max_position_embeddings=262144,
    dtype="float32",
)
_TINY_Q35 = (
    {k: v for k, v in _Q35_35B.items() if k != "eos_token_id"}
    | _TINY_SHAPE
    | dict(
        num_hidden_layers=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        shared_expert_intermediate_size=64,
    )
)
_TINY_Q3 = (
    {k: v for k, v in _Q3_30B.items() if k != "eos_token_id"}
    | _TINY_SHAPE
    | dict(
        num_hidden_layers=4,
        intermediate_size=256,
    )
)
_TINY_GPT_OSS = {k: v for k, v in _GPT_OSS_120B.items() if k != "eos_token_id"} | dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=16,
    sliding_window=32,
    max_position_embeddings=262144,
    dtype="float32",
)

SIZES: dict[str, dict] = {
    "tiny": _TINY_Q35,
    "tiny-qwen3-moe": _TINY_Q3,
    "tiny-gpt-oss": _TINY_GPT_OSS,
    "qwen3.5-35b-a3b": _Q35_35B,
    "qwen3-30b-a3b": _Q3_30B,
    "gpt-oss-20b": _GPT_OSS_20B,
    "gpt-oss-120b": _GPT_OSS_120B,
}
_ARCH_OF_TYPE = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss"}
_HF_CLASS = {
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


SKEW = "@skew="  # `NAME@skew=S`: router rows scaled for skewed expert popularity


def resolve_size(size: str, arch: str | None = None) -> str:
    """Size entry for `--size S [--arch A]`; `tiny` follows the requested architecture. A size
    may end in `@skew=S` (S >= 0: `router_skew`)."""
    base, skew = _split_skew(size)
    if base == "tiny" and arch in ("qwen3_moe", "gpt_oss"):
        base = "tiny-qwen3-moe" if arch == "qwen3_moe" else "tiny-gpt-oss"
    if base not in SIZES:
        raise InvalidArgumentError(f"unknown size {base!r}; known: {', '.join(SIZES)}")
    own = _ARCH_OF_TYPE[SIZES[base]["model_type"]]
    if arch is not None and arch != own:
        raise InvalidArgumentError(f"size {base!r} is a {own} model, not {arch}")
    return base + (f"{SKEW}{skew:g}" if skew else "")


def _split_skew(size: str) -> tuple[str, float]:
    base, _, skew = size.partition(SKEW)
    if not skew:
        return base, 0.0
    try:
        value = float(skew)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InvalidArgumentError(f"{size!r}: the skew must be a number >= 0 (e.g. @skew=1.5)")
    return base, value


def router_skew(size: str) -> float:
    """The router skew of a size string (0: plain random routers, near-uniform routing)."""
    return _split_skew(size)[1]


def hf_config(size: str) -> dict:
    """The config.json dict of a synthetic size (layer types spelled out)."""
    raw = json.loads(json.dumps(SIZES[_split_skew(size)[0]]))
    n = raw["num_hidden_layers"]
    if raw["model_type"] == "qwen3_5_moe_text":
        raw["layer_types"] = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)]
    if raw["model_type"] == "gpt_oss":
        raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else FULL for i in range(n)]
    raw["architectures"] = [_HF_CLASS[raw["model_type"]]]
    return raw


def model_config(size: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(size))


# ----------------------------------------------------------------------------- random values


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def fill_uniform_(t: torch.Tensor, low: float, high: float, seed: int) -> torch.Tensor:
    """Fill `t` with U(low, high) values; bit-reproducible on CPU (integer draws)."""
    gen = torch.Generator(device=t.device).manual_seed(seed)
    if t.device.type != "cpu":
        return t.uniform_(low, high, generator=gen)
    ints = torch.randint(0, 2**24, tuple(t.shape), generator=gen, dtype=torch.int32)
    return t.copy_(ints.double().mul_((high - low) / 2**24).add_(low))


def init_value(
    name: str, t: torch.Tensor, seed: int, zero_centered: bool, skew: float = 0.0
) -> None:
    """The synthetic init of one tensor, chosen by its name (mirrors HF's init scheme); routers
    skewed by `skew` (`skew_router_`)."""
    _init_value(name, t, seed, zero_centered)
    if skew and name.endswith((".mlp.gate.weight", ".mlp.router.weight")):
        skew_router_(t, skew, tensor_seed(seed, name + ":skew"))


def skew_router_(t: torch.Tensor, skew: float, seed: int) -> None:
    """Scale each expert's router row `t[e]` by exp(skew * z_e), z_e standard normal: with
    near-isotropic inputs an expert is chosen more often the larger its row, so popularity
    across experts grows heavy-tailed with `skew`. An emulation of real routers' favourites
    (it adds no locality from one token to the next beyond what the hidden states carry)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(t.shape[0], generator=gen, dtype=torch.float32)
    t.mul_(torch.exp(skew * z).to(device=t.device, dtype=t.dtype).unsqueeze(1))


def _init_value(name: str, t: torch.Tensor, seed: int, zero_centered: bool) -> None:
    s = tensor_seed(seed, name)
    half = INIT_STD * math.sqrt(3.0)
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        t.fill_(1.0)
    elif name.endswith("norm.weight"):
        t.fill_(0.0 if zero_centered else 1.0)
    elif name.endswith("A_log"):
        fill_uniform_(t, 0.01, 16.0, s).log_()
    elif name.endswith("conv1d.weight"):
        fill_uniform_(t, -0.5, 0.5, s)
    else:
        fill_uniform_(t, -half, half, s)


def named_tensors(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names (HF names, fused experts) and destination tensors (the model's own
    layout, see `checkpoint_tensor`), in a fixed order."""
    prefix = model.config.weight_prefix
    for name, param in model.named_parameters():
        yield (name if name == "lm_head.weight" else prefix + name), param.data
    experts = model.experts
    stacks = {"gate_up_proj": experts.gate_up, "down_proj": experts.down}
    if hasattr(experts, "fill_synthetic"):  # (experts kept packed: drawn by the sink itself)
        stacks = {}
    if experts.gate_up_bias is not None and experts.down_bias is not None:
        stacks |= {"gate_up_proj_bias": experts.gate_up_bias, "down_proj_bias": experts.down_bias}
    for layer in sorted(experts.gate_up):
        for kind, stack in stacks.items():
            yield f"{prefix}layers.{layer}.mlp.experts.{kind}", stack[layer]


def checkpoint_tensor(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of `named_tensors` as the checkpoint stores it (an architecture with its own
    fused expert layout converts it: `checkpoint_layout` in its model file)."""
    convert = getattr(architecture(cfg.arch), "checkpoint_layout", None)
    if convert is None or ".mlp.experts." not in name:
        return tensor
    return convert(name.rsplit(".", 1)[-1], tensor)


def build_in_memory(
    size: str,
    device,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    experts=None,
    cfg: ModelConfig | None = None,
) -> CausalLM:
    """A synthetic model of `size` directly in device memory (routed experts into `experts`
    when given). Values are drawn on `device`, so a host expert store holds the same values as
    a model built entirely on that device. `cfg`: `size`'s config changed (e.g. cut to its
    first layers); tensors of the same name get the same values."""
    cfg = cfg or model_config(size)
    model = build_empty(cfg, device, dtype or torch_dtype(cfg.torch_dtype), experts)
    zero_centered = architecture(cfg.arch).ZERO_CENTERED_NORMS
    skew = router_skew(size)
    device = torch.device(device)
    staged = _Staged(device)
    packed = hasattr(experts, "fill_synthetic")  # (experts kept MXFP4: drawn packed)
    with torch.inference_mode():
        if packed:
            experts.fill_synthetic(seed, INIT_STD, device)
        for name, tensor in named_tensors(model):
            if tensor.device.type == device.type:
                init_value(name, tensor, seed, zero_centered, skew)
            else:  # host store of a device model: draw on the device, then copy down
                scratch = torch.empty_like(tensor, device=device)
                init_value(name, scratch, seed, zero_centered, skew)
                staged.copy(tensor, scratch)
        staged.flush()
    return model


class _Staged:
    """Copies of device tensors into host views, gathered per host base tensor: a view of an
    expert store's per-layer block (gate_up and down rows interleaved per expert) is filled in a
    device copy of the block, which goes down in one contiguous copy once the views written
    cover the block and the next block comes (a copy into a strided host view goes through a
    pageable temporary of its own, then a host copy). Other targets are copied at once; a block
    left partly covered gets its views one by one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: torch.Tensor | None = None  # the block being gathered, and its device copy
        self.copy_of: torch.Tensor | None = None
        self.written: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host view, device view)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        base = target._base
        if target.is_contiguous() or base is None or not base.is_contiguous():
            target.copy_(source)
            return
        if base is not self.host:
            self.flush()
            self.host, self.copy_of = base, torch.empty_like(base, device=self.device)
        offset = target.storage_offset() - base.storage_offset()
        view = self.copy_of.as_strided(target.shape, target.stride(), offset)
        view.copy_(source)
        self.written.append((target, view))

    def flush(self) -> None:
        if self.host is not None:
            if sum(t.numel() for t, _ in self.written) == self.host.numel():
                self.host.copy_(self.copy_of)
            else:
                for target, view in self.written:
                    target.copy_(view)
        self.host = self.copy_of = None
        self.written = []


# ----------------------------------------------------------------------------- writing to disk


def _shard_of(name: str) -> str:
    """Group tensors into one shard per layer (plus one for embeddings/head/final norm)."""
    parts = name.split(".")
    if "layers" in parts:
        return f"layer{int(parts[parts.index('layers') + 1]):03d}"
    return "base"


def write_checkpoint(
    size: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    config_overrides: dict | None = None,
    max_single_bytes: int = 2**30,
    mxfp4: bool = False,
) -> Path:
    """Write `size` as a HF-format checkpoint (config.json + safetensors) into `out_dir`.

    Small models go into one `model.safetensors`; large ones into one shard per layer plus an
    index, generated and written shard by shard so memory holds one layer at a time. `mxfp4`
    (gpt-oss): routed experts as the published checkpoints store them, `_blocks` / `_scales`
    pairs of random MXFP4 codes (`mxfp4_tensor`) and a `quantization_config` saying so.
    """
    out = private_dir(out_dir)
    raw = hf_config(size)
    raw.update(config_overrides or {})
    if dtype:
        raw["dtype"] = dtype
    if mxfp4:
        mark_mxfp4(raw)
    cfg = ModelConfig.from_hf(raw)
    target = torch_dtype(cfg.torch_dtype)
    skeleton = build_empty_meta(cfg)
    shards: dict[str, list[tuple[str, torch.Size]]] = {}
    for name, tensor in named_tensors(skeleton):
        if mxfp4 and name.endswith(EXPERT_STACKS):
            rows, cols = tensor.shape[1], tensor.shape[2]
            blocks = torch.empty(tensor.shape[0], rows, cols // 32, 16, device="meta")
            shards.setdefault(_shard_of(name), []).append((name + "_blocks", blocks))
            shards.setdefault(_shard_of(name), []).append((name + "_scales", blocks[..., 0]))
            continue
        shards.setdefault(_shard_of(name), []).append((name, tensor))
    total_bytes = sum(t.numel() for _, t in named_tensors(skeleton)) * target.itemsize
    if total_bytes <= max_single_bytes:
        shards = {"all": [entry for entries in shards.values() for entry in entries]}
    weight_map = {}
    for i, (shard, entries) in enumerate(sorted(shards.items())):
        file = "model.safetensors" if shard == "all" else f"model-{shard}.safetensors"
        _write_shard(out / file, entries, cfg, target, seed, router_skew(size))
        weight_map.update({name: file for name, _ in entries})
        if progress:
            progress(i + 1, len(shards))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        write_private(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    write_private(out / "config.json", json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out


def _write_shard(path: Path, entries, cfg: ModelConfig, target, seed: int, skew: float) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, meta in entries:
        if name.endswith(("_blocks", "_scales")):
            tensors[name] = mxfp4_tensor(name, meta.shape, seed)
            continue
        t = torch.empty(meta.shape, dtype=torch.float32)
        init_value(name, t, seed, architecture(cfg.arch).ZERO_CENTERED_NORMS, skew)
        keep_fp32 = name.rsplit(".", 1)[-1] in FP32_PARAMS
        tensors[name] = checkpoint_tensor(cfg, name, t if keep_fp32 else t.to(target))
        tensors[name] = tensors[name].contiguous()
    with private_output(path) as tmp:  # 0600; save_file truncates it, keeping the mode
        save_file(tensors, str(tmp), metadata={"format": "pt"})


EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")


def mark_mxfp4(raw: dict) -> None:
    """Say in config.json `raw` that its routed experts are MXFP4 pairs (gpt-oss only)."""
    if raw.get("model_type") != "gpt_oss":
        raise ValueError("MXFP4 experts are written for gpt-oss checkpoints only")
    raw["quantization_config"] = {"quant_method": "mxfp4"}


def mxfp4_tensor(name: str, shape, seed: int) -> torch.Tensor:
    """One half of a synthetic MXFP4 expert pair: `_blocks`, uniformly random code bytes
    (seeded by name), or `_scales`, one exponent that gives the weights about the synthetic
    init's spread."""
    from agentrt.models.mxfp4 import exponent_for

    if name.endswith("_scales"):
        return torch.full(tuple(shape), exponent_for(INIT_STD), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.randint(0, 256, tuple(shape), generator=gen, dtype=torch.uint8)


def build_empty_meta(cfg: ModelConfig) -> CausalLM:
    """Shapes only: a model on the meta device (for planning shards and parameter counts)."""
    return build_empty(cfg, "meta", torch_dtype(cfg.torch_dtype))


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    model = build_empty_meta(cfg)
    dense = sum(p.numel() for p in model.parameters())
    if cfg.tie_word_embeddings:
        dense -= model.lm_head.weight.numel()
    routed = len(cfg.moe_layers) * cfg.num_experts * cfg.expert_params
    active = dense + len(cfg.moe_layers) * cfg.num_experts_per_tok * cfg.expert_params
    return {
        "total": dense + routed,
        "routed_experts": routed,
        "dense": dense,
        "active_per_token": active,
    }
