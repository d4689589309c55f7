"""The options of `Runtime.open`: `RuntimeConfig` (every option, defined once, with its default)
and the engine, offload and state-cache configs made from it, with the checks that make a bad
option a one-line error before anything loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrt.engine.config import EngineConfig
from agentrt.errors import InvalidArgumentError
from agentrt.offload.config import OffloadConfig, offload_mode, parse_bytes
from agentrt.statecache.config import StateCacheConfig

CACHE_MODES = ("semantic", "prefix", "off")


@dataclass(frozen=True)
class RuntimeConfig:
    """Every option of `Runtime.open` besides the model, with its default (the one place they
    are defined: `Runtime.open`'s keywords and the CLI's options fill it by name)."""

    device: str = "cpu"
    dtype: str | None = None  # None: float32 on cpu, bfloat16 on cuda
    cache: str = "semantic"  # semantic | prefix | off
    state_dir: str | Path | None = None  # None: ~/.cache/agentrt/state
    vram_budget: str | int | None = None  # e.g. "16GiB": caps what the engine allocates
    expert_cache_slots: int | None = None  # explicit expert-cache size (forces offload)
    seed: int = 0
    tokenizer: str | None = None  # a tokenizer directory overriding the model's own
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's
    chat_date: str | None = None  # YYYY-MM-DD templates see as today (None: the day it opened)
    reasoning_effort: str | None = None  # low | medium | high for requests that name none
    linear_attn: str = "auto"  # auto | torch | fla
    prefill_chunk: int | None = None  # None: per device and placement
    eager: bool = False  # no CUDA graph for decode
    # short prefills as CUDA-graph replays; None: on CUDA with the experts on the GPU, unless eager
    prefill_graphs: bool | None = None
    require_tokenizer: bool = False  # fail before loading weights when there is none
    state_max_gb: float | None = None
    boundaries: dict[str, str | list[str]] | None = None  # boundary text overrides per kind
    state_cache: StateCacheConfig | None = None  # a full state-cache config
    offload: str | OffloadConfig | None = None  # a placement name or a full OffloadConfig
    split: bool = True
    expert_policy: str = OffloadConfig.policy
    cpu_moe_layers: int | None = None
    recalibrate: bool = False
    cpu_layers: int | None = None
    prefetch: bool = True
    cpu_kernel: str = "auto"
    prefill_plan: str = "auto"
    # auto | model | mxfp4 (offloaded experts kept packed; auto: where the checkpoint's are)
    expert_format: str = "auto"


def check_device(device: str) -> str:
    import torch

    index = device[5:] if device.startswith("cuda:") else None
    if device not in ("cpu", "cuda") and not (index or "").isdigit():
        raise InvalidArgumentError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"device {device!r} requested but CUDA is not available on this machine"
        )
    if index is not None and int(index) >= torch.cuda.device_count():
        raise InvalidArgumentError(
            f"{device} does not exist: this machine has {torch.cuda.device_count()} GPU(s)"
        )
    return device


def expert_store(spec: str, device: str, dtype, packed: bool = False):
    """A host store for the routed experts of `spec` (pinned when a GPU will read it; `packed`:
    MXFP4 rows)."""
    from agentrt.models.registry import config_of
    from agentrt.offload.store import ExpertStore

    return ExpertStore.for_config(config_of(spec), dtype, device.startswith("cuda"), packed)


def check_cache(cache: str) -> None:
    if cache not in CACHE_MODES:
        raise InvalidArgumentError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")


def offload_config(c: RuntimeConfig, spec: str | None = None) -> OffloadConfig:
    """`c.offload` may be a mode name or a full `OffloadConfig`; the default is `auto` when a
    budget or a slot count is given, else `none`. `spec`: the model (for `expert_format`
    auto)."""
    if isinstance(c.offload, OffloadConfig):
        return c.offload
    mode = offload_mode(c.offload, c.vram_budget, c.expert_cache_slots)
    budget = parse_bytes(c.vram_budget) if c.vram_budget is not None else None
    return OffloadConfig(
        mode=mode,
        split=c.split,
        policy=c.expert_policy,
        expert_cache_slots=c.expert_cache_slots,
        vram_budget=budget,
        cpu_moe_layers=c.cpu_moe_layers,
        cpu_layers=c.cpu_layers,
        prefetch=c.prefetch,
        cpu_kernel=c.cpu_kernel,
        prefill_plan=c.prefill_plan,
        packed_mxfp4=packed_experts(c.expert_format, spec, mode),
    )


EXPERT_FORMATS = ("auto", "model", "mxfp4")


def packed_experts(expert_format: str, spec: str | None, mode: str = "auto") -> bool:
    """Whether offloaded experts stay MXFP4-packed: `mxfp4`, or `auto` with offload mode auto
    and a model whose experts come as MXFP4 (`registry.mxfp4_experts`)."""
    if expert_format not in EXPERT_FORMATS:
        formats = ", ".join(EXPERT_FORMATS)
        raise InvalidArgumentError(f"expert format must be one of {formats}, got {expert_format!r}")
    if expert_format == "auto":
        from agentrt.models.registry import mxfp4_experts

        return mode == "auto" and spec is not None and mxfp4_experts(spec)
    return expert_format == "mxfp4"


def engine_config(
    c: RuntimeConfig, device: str, placement: OffloadConfig, static_prefill: bool = True
) -> EngineConfig:
    """`static_prefill`: the model's static prefill passes are worth replaying by default."""
    return EngineConfig(
        device=device,
        dtype=c.dtype or EngineConfig.default_dtype(device),
        linear_attn=c.linear_attn,
        prefill_chunk=c.prefill_chunk
        or EngineConfig.default_prefill_chunk(device, placement.mode == "auto"),
        cuda_graphs=not c.eager,  # offloaded layers cut the graph into pieces (cuda_graph.py)
        prefill_graphs=prefill_graphs(c, device, placement, static_prefill),
    )


def static_prefill(spec: str) -> bool:
    """Whether prefill graphs pay for the model of `spec` (its model file's `PREFILL_GRAPHS`)."""
    from agentrt.models.architectures import architecture
    from agentrt.models.registry import config_of

    return getattr(architecture(config_of(spec).arch), "PREFILL_GRAPHS", True)


def prefill_graphs(
    c: RuntimeConfig, device: str, placement: OffloadConfig, static_prefill: bool = True
) -> bool:
    """Whether short prefills run as CUDA-graph replays: as asked, else on CUDA when the
    experts are on the GPU (offloaded prefill never takes them), decode is not eager and the
    model's static passes are worth replaying (`static_prefill`)."""
    if c.prefill_graphs is not None:
        return c.prefill_graphs
    cuda = device.startswith("cuda")
    return cuda and placement.mode == "none" and not c.eager and static_prefill


def cache_config(base: StateCacheConfig | None, state_dir, state_max_gb) -> StateCacheConfig:
    """`state_cache` (all settings) with `state_dir` / `state_max_gb` applied on top."""
    changes: dict[str, Any] = {}
    if state_dir is not None:
        changes["state_dir"] = Path(state_dir).expanduser()
    if state_max_gb is not None:
        changes["max_bytes"] = int(float(state_max_gb) * 2**30)
    return dataclasses.replace(base or StateCacheConfig(), **changes)
