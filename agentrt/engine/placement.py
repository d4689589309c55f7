"""Expert placement for one engine: size the device expert cache from the VRAM budget (budget minus
the non-expert weights, a KV reservation and workspace), load or measure the bandwidth profile,
and install `OffloadedExperts` in the model (auto mode), or place the static / layer baselines
(the fewest CPU layers that fit the same budget unless given)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.env import home_dir
from agentrt.errors import InvalidArgumentError
from agentrt.models.ffn import MoEBlock
from agentrt.models.layers import CausalLM
from agentrt.offload.calibrate import (
    Profile,
    calibrate,
    load_profile,
    profile_kernel,
    profile_path,
    save_profile,
    understates_cpu,
)
from agentrt.offload.config import OffloadConfig
from agentrt.offload.cpu_mxfp4 import PackedCPUExperts, cpu_kernel_for
from agentrt.offload.experts import Bandwidths, OffloadedExperts
from agentrt.offload.host_layer import HostLayer
from agentrt.offload.ring import staging_bytes_for
from agentrt.offload.slots import ExpertCache
from agentrt.offload.store import ExpertStore


def dense_bytes(model: CausalLM) -> int:
    """Bytes of the model's parameters on the device (everything but routed experts)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model: CausalLM) -> int:
    cfg = model.config
    itemsize = model.embed_tokens.weight.element_size()
    return 2 * len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * itemsize


def staging_bytes(store: ExpertStore, config: OffloadConfig) -> int:
    """Device bytes of the offloaded prefill's staging ring (auto mode)."""
    if config.mode != "auto":
        return 0
    return staging_bytes_for(store.num_experts, store.expert_bytes, config.staging_bytes)


@dataclass(frozen=True)
class Footprint:
    """What a model takes from the budget besides its experts' slots: the dense weights'
    bytes, KV bytes per token, and the experts a token routes to (the fewest slots)."""

    dense: int
    kv_per_token: int
    top_k: int

    @classmethod
    def of(cls, model: CausalLM) -> Footprint:
        top_k = model.config.num_experts_per_tok
        return cls(dense_bytes(model), kv_bytes_per_token(model), top_k)


def slots_for_budget(
    model: CausalLM, store: ExpertStore, config: OffloadConfig, kv_bytes: int | None = None
) -> int:
    """Expert slots that fit: budget - dense weights - KV (the reservation unless `kv_bytes`)
    - workspace - the prefill staging ring."""
    every = len(store.layers) * store.num_experts
    if config.expert_cache_slots is not None:
        return min(config.expert_cache_slots, every)  # (more would hold nothing)
    if config.vram_budget is None:
        return every  # no budget: room for every expert
    return _budget_slots(Footprint.of(model), store, config, kv_bytes)


def _budget_slots(
    model: Footprint, store: ExpertStore, config: OffloadConfig, kv_bytes: int | None
) -> int:
    """`slots_for_budget` under a budget, from the model's `Footprint`."""
    reserved = config.kv_reserve_tokens * model.kv_per_token
    kv = reserved if kv_bytes is None else max(kv_bytes, reserved)
    fixed = model.dense + config.workspace_bytes + staging_bytes(store, config)
    free = config.vram_budget - fixed - kv
    slots = free // store.expert_bytes
    if slots < model.top_k:
        need = (fixed + kv) / 2**30
        raise InvalidArgumentError(
            f"vram budget {config.vram_budget / 2**30:.1f} GiB leaves no room for experts "
            f"(dense weights, {kv / 2**30:.2f} GiB of KV, the workspace and the prefill "
            f"staging need {need:.1f} GiB)"
        )
    return int(slots)


# profiles checked (`understates_cpu`) or measured by this process: a benchmark installs the
# engine once per setting, and each check costs a pool warm-up and a quarter second's settle
_CHECKED: set[Path] = set()


def profile_for(
    store: ExpertStore, device: torch.device, recalibrate: bool = False, kernel=None
) -> Profile:
    """The saved calibration profile for this GPU / CPU / expert shape / CPU kernel (`kernel`:
    a `NativeExperts`, else torch's), else a few seconds of measurement (saved for the next
    start); a saved one whose CPU figure a quick measurement now doubles is measured again."""

    key = profile_kernel(kernel)  # (keyed by the kernel and whether it runs on its pool)
    path = profile_path(home_dir() / "profiles", device, store.dtype, store.expert_bytes, key)
    profile = None if recalibrate else load_profile(path)
    if profile is not None and path not in _CHECKED and understates_cpu(profile, store, kernel):
        print("agentrt: saved calibration understates the CPU: measuring again", file=sys.stderr)
        profile = None
    if profile is None:
        print(
            "agentrt: calibrating expert copy / CPU bandwidths (a few seconds) ...", file=sys.stderr
        )
        profile = calibrate(store, device, kernel=kernel)
        save_profile(profile, path)  # (a pool that could not start measured the caller's thread)
    _CHECKED.add(path)
    return profile


def bandwidths(
    store: ExpertStore, device: torch.device, config: OffloadConfig, recalibrate: bool, kernel=None
) -> Bandwidths:
    """Configured overrides, else the saved profile (of the CPU kernel `kernel`, a
    `NativeExperts`, else torch's), else a few seconds of measurement. With the split, copies
    and CPU experts run together (B_P', B_H'); copy-only, the copies run alone (B_P: it sizes
    the prefetch)."""
    if config.copy_bandwidth and config.cpu_bandwidth:
        return Bandwidths(config.copy_bandwidth, config.cpu_bandwidth)
    profile = profile_for(store, device, recalibrate, kernel)
    return Bandwidths(
        config.copy_bandwidth or (profile.copy_overlapped if config.split else profile.copy),
        config.cpu_bandwidth or profile.cpu_overlapped,
    )


def _slots_for_kv(model, store, config: OffloadConfig):
    """How many slots the budget leaves beside a KV of given bytes (None without a budget, or
    with an explicit slot count: the cache's size is then fixed). It keeps the model's sizes,
    not the model, which holds the experts object that keeps this."""
    if config.vram_budget is None or config.expert_cache_slots is not None:
        return None
    sizes = Footprint.of(model)
    return lambda kv: _budget_slots(sizes, store, config, kv)


def install(
    model: CausalLM, store: ExpertStore, device, config: OffloadConfig, recalibrate: bool = False
):
    """Build the cache and `OffloadedExperts` for `config.mode` and swap them into the model
    (`layer` mode also moves its CPU layers into `HostLayer`s)."""
    device = torch.device(device)
    # (the native kernel computes plain SwiGLU experts only: others run through torch's)
    kernel = cpu_kernel_for(config.cpu_kernel, store) if store.plain or store.packed else None
    if config.mode == "auto":
        _prepare(kernel, store.layers)  # (any layer's misses may run on the CPU)
        cache = ExpertCache(store, slots_for_budget(model, store, config), device, config.policy)
        bw = bandwidths(store, device, config, recalibrate, kernel)
        given = config.copy_bandwidth is not None or config.cpu_bandwidth is not None
        routers = _routers(model) if config.prefetch else None
        experts = OffloadedExperts(
            store,
            cache,
            bw,
            split=config.split,
            adaptive=not given,
            routers=routers,
            cpu_kernel=kernel,
            warm_cpu=config.warms(store.packed),
            overlap=config.overlap,
            prefetch_pace=config.prefetch_pace,
            prefill_plan=config.prefill_plan,
            staging_bytes=config.staging_bytes,
            slots_for_kv=_slots_for_kv(model, store, config),
            kv_reserved=config.kv_reserve_tokens,
        )
    else:
        cpu_layers = _cpu_expert_layers(model, store, config)
        resident = [layer for layer in store.layers if layer not in cpu_layers]
        cache = ExpertCache(store, max(len(resident) * store.num_experts, 1), device, config.policy)
        _preload(cache, store, resident)
        _prepare(kernel, cpu_layers)
        # nothing is ever missing outside the CPU layers
        experts = OffloadedExperts(
            store,
            cache,
            Bandwidths(0.0, 1.0),
            cpu_layers=cpu_layers,
            cpu_kernel=kernel,
            staging_bytes=0,  # (every layer resident in order, or on the CPU)
        )
        experts.fix_slots()
    model.set_experts(experts)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return experts


def _prepare(kernel, layers) -> None:
    """A packed kernel's one-time work for the layers whose experts it computes, done at install
    (`PackedCPUExperts.prepare`), not by a request's first call."""
    if isinstance(kernel, PackedCPUExperts):
        kernel.prepare(layers)


def _routers(model: CausalLM) -> dict[int, torch.Tensor]:
    """Each MoE layer's router weights `[E, H]` (prefetch predicts with the next layer's)."""
    return {m.layer: m.router_weight for m in model.modules() if isinstance(m, MoEBlock)}


def _cpu_expert_layers(model: CausalLM, store: ExpertStore, config: OffloadConfig) -> frozenset:
    """static: the experts of the first N MoE layers; layer: the first N decoder layers, moved
    whole into `HostLayer`s (their experts too). N from the config, else from the budget."""
    if config.mode == "static":
        n = config.cpu_moe_layers
        if n is None:
            n = _static_layers_for_budget(model, store, config)
        return frozenset(store.layers[:n])
    n = (
        config.cpu_layers
        if config.cpu_layers is not None
        else _layers_for_budget(model, store, config)
    )
    n = min(n, len(model.layers))
    for i in range(n):
        if not isinstance(model.layers[i], HostLayer):  # (moved by an earlier install)
            model.layers[i] = HostLayer(model.layers[i])
    return frozenset(layer for layer in store.layers if layer < n)


def _room(model: CausalLM, config: OffloadConfig, fixed: int) -> int:
    """Budget bytes left after `fixed` bytes of weights, the KV reservation and the workspace."""
    return (
        config.vram_budget
        - fixed
        - config.kv_reserve_tokens * kv_bytes_per_token(model)
        - config.workspace_bytes
    )


def _static_layers_for_budget(model: CausalLM, store: ExpertStore, config: OffloadConfig) -> int:
    """Fewest MoE layers whose experts go to the CPU so the others' experts fit the budget."""
    if config.vram_budget is None:
        return 0
    per_layer = store.num_experts * store.expert_bytes
    fit = max(_room(model, config, dense_bytes(model)), 0) // per_layer
    return max(len(store.layers) - int(fit), 0)


def _layers_for_budget(model: CausalLM, store: ExpertStore, config: OffloadConfig) -> int:
    """Fewest leading decoder layers to run on the CPU so the remaining layers fit the budget."""
    if config.vram_budget is None:
        return 0
    per_layer = [
        sum(p.numel() * p.element_size() for p in layer.parameters())
        + (store.num_experts * store.expert_bytes if i in store.flat else 0)
        for i, layer in enumerate(model.layers)
    ]
    room = _room(model, config, dense_bytes(model) - sum(per_layer) + _expert_bytes(store))
    on_gpu, used = 0, 0
    for size in reversed(per_layer):  # the last layers stay on the GPU (as llama.cpp -ngl)
        if used + size > room:
            break
        used, on_gpu = used + size, on_gpu + 1
    return len(per_layer) - on_gpu


def _expert_bytes(store: ExpertStore) -> int:
    return len(store.layers) * store.num_experts * store.expert_bytes


def _preload(cache: ExpertCache, store: ExpertStore, layers: list[int]) -> None:
    for layer in layers:
        for expert in range(store.num_experts):
            slot = cache.admit(layer, expert, exclude=set())
            cache.slots[slot].copy_(store.flat[layer][expert])
