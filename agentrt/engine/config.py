"""`EngineConfig`: the inference engine's settings for one loaded model."""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.errors import InvalidArgumentError

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
    prefill_graphs: bool = False  # short prefills as CUDA graphs of padded lengths
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
        tokens), so larger chunks amortise it: 8192; else 2048 (with the experts on the GPU,
        suffixes of up to 4096 tokens run as prefill-graph replays whatever the chunk)."""
        return OFFLOADED_PREFILL_CHUNK if offloaded and device.startswith("cuda") else 2048

    @staticmethod
    def default_dtype(device: str) -> str:
        return "float32" if device == "cpu" else "bfloat16"
