"""`OffloadConfig`: where the routed experts live and how misses are served; the placement
names, prefill plans and CPU kernels it takes; `parse_bytes` for budgets like 16GiB."""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.errors import InvalidArgumentError
from agentrt.offload.policy import DEFAULT_POLICY

GIB = 2**30


def parse_bytes(text: str | int | float) -> int:
    """'16GiB', '512MB', '2g', 1.5e9 -> bytes."""
    if isinstance(text, (int, float)):
        text = repr(text)  # (numbers from the Python API: the same checks)
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
        size = int(float(number) * units[unit])
    except (ValueError, KeyError, OverflowError):  # (OverflowError: infinity, 1e400)
        raise InvalidArgumentError(f"cannot read {text!r} as a size (e.g. 16GiB, 512MB)") from None
    if size < 0:
        raise InvalidArgumentError(f"a size cannot be negative, got {text!r}")
    return size


OFFLOAD_MODES = ("none", "auto", "static", "layer")
PREFILL_PLANS = (
    "auto",
    "stream",
    "routed",
    "predicted",
    "reserve",
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
    policy: str = DEFAULT_POLICY
    # decode: copy ahead the experts the next layer's router predicts from this layer's input
    prefetch: bool = True
    # decode with prefetch and the native kernel's pool: read the next layer's likely CPU
    # experts (predicted, missing, not copied ahead) into the CPU's caches during its piece.
    # None: on for bf16 experts, off for packed MXFP4 ones (on an H200 host gpt-oss-120b decoded
    # 1.06x faster without it: its reads slowed the link's copies; `bench decode --cpu-warm`)
    cpu_warm: bool | None = None
    # captured decode: a layer's device experts run while the CPU computes its share (in a
    # graph piece launched before the CPU experts end), not after them. Off by default: on
    # two H100 hosts 0.90-1.06x by host and model (`bench decode --overlap on,off`)
    overlap: bool = False
    # captured decode with prefetch: the prefetch cap shrinks while a layer's prefetches are
    # still copying when the piece that reads them is launched (offload/prefetch.py); None:
    # as `AGENTRT_PREFETCH_PACE` says (off unless it is "1")
    prefetch_pace: bool | None = None
    # a decode token's CPU experts: torch's kernels, the native bf16 kernel built at first use
    # (offload/cpu_kernel.py; falls back to torch's without a C compiler), or auto: native where
    # the CPU has AVX512-BF16 or AVX2 with FMA
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
    # `auto` mode: keep the experts MXFP4-packed in the host store, the device slots and the
    # staging (17/32 of a byte per weight; computed by `offload/packed.py`); experts that are
    # not MXFP4 are rounded to it at load (about one layer unpacked in host memory at a time).
    packed_mxfp4: bool = False

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
        if self.packed_mxfp4 and self.mode != "auto":
            raise InvalidArgumentError(
                "packed MXFP4 experts (--expert-format mxfp4) need offload mode auto "
                "(--vram-budget or --expert-cache-slots)"
            )
        if self.staging_bytes is not None and self.staging_bytes < (self.mode == "auto"):
            raise InvalidArgumentError(  # (offloaded prefill copies the missing experts through it)
                "staging_bytes must be > 0 with offload mode auto"
                if self.mode == "auto"
                else "staging_bytes must be >= 0"
            )
        if self.expert_cache_slots is not None and self.expert_cache_slots < 1:
            raise InvalidArgumentError("expert_cache_slots must be >= 1")
        for name in ("cpu_moe_layers", "cpu_layers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{name} must be >= 0")

    def warms(self, packed: bool) -> bool:
        """Whether decode warms the CPU's caches for a store of these experts (`cpu_warm`)."""
        return (not packed) if self.cpu_warm is None else self.cpu_warm
