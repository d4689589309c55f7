"""The CPU side of packed MXFP4 experts (`ExpertStore(packed=True)`): a decode token's CPU
experts read straight from the packed host rows by a native kernel (`experts_mxfp4.c`, built
with the system C compiler at first use, like `cpu_kernel.py`'s), with the store's biases and
activation. Its inputs go int16 per block of 32 values (`quantized_blocks`, each value within
1/65534 of its block's largest magnitude), so a block's products sum exactly in integers: 1.8x
the throughput of decoding the codes to fp32 on one AVX2 core. `mxfp4_kernel(store)` returns
None where it cannot be built (callers then dequantize each expert and run torch's kernels)."""

from __future__ import annotations

import ctypes
import functools
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from agentrt.models.moe import PLAIN
from agentrt.offload.cpu_kernel import (
    POOL_SOURCE,
    PoolCalls,
    build_library,
    kernel_for,
    row_pointers,
)
from agentrt.offload.store import ExpertStore

SOURCE = POOL_SOURCE + (Path(__file__).parent / "experts_mxfp4.c").read_text()  # (package data)
_P = ctypes.c_void_p


class PackedCPUExperts(PoolCalls):
    """The built kernel bound to one packed store (shapes, biases, activation). `run_experts`
    and `run_rows` run in an OpenMP region on the calling thread; `start_experts` posts
    `run_experts`'s call to the library's thread pool (graph decode's host steps, where
    `pooled`) and `finish` waits for it, with the same bits; `warm` posts a read of experts a
    later call will likely compute. Calls take turns (one scratch buffer)."""

    def __init__(self, lib: ctypes.CDLL, store: ExpertStore) -> None:
        self._fn = lib.experts_mxfp4
        self._fn.argtypes = [_P, _P, ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_int, _P, _P]
        self._fn.argtypes += [ctypes.c_float, ctypes.c_float, ctypes.c_int, _P]
        self._fn.restype = None
        self._start = lib.experts_mxfp4_start
        self._start.argtypes = [*self._fn.argtypes, ctypes.c_int, ctypes.c_int]
        self._start.restype = ctypes.c_int
        self._rows = lib.experts_mxfp4_rows
        self._rows.argtypes = [_P, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int, ctypes.c_int]
        self._rows.argtypes += [_P, _P, ctypes.c_float, ctypes.c_float, _P]
        self._rows.restype = None
        self._warm = lib.experts_mxfp4_warm
        self._warm.argtypes = [_P] + [ctypes.c_int] * 5
        self._warm.restype = ctypes.c_int
        self._need = lib.experts_mxfp4_scratch
        self._need.argtypes = [ctypes.c_int] * 4
        self._need.restype = ctypes.c_long
        self.store = store
        self._init_pool(lib)
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._x32 = torch.empty(0, dtype=torch.float32)  # a decode call's input (`_x32_of`)
        self._biases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # fp32 copies per layer

    def run_experts(self, layer: int, experts, weights, x: torch.Tensor, out: torch.Tensor,
                    accumulate: bool = False) -> None:  # fmt: skip
        """`out` (fp32 `[H]`, contiguous) = sum over `experts` of `layer` of weights[i] times
        the expert's output for `x` (`[H]`), plus `out` if `accumulate`."""
        with self._turn():
            args, alive = self._experts_args(layer, experts, weights, x, out, accumulate)
            self._fn(*args)
        del alive  # (the C arrays and the input the call read)

    def start_experts(self, layer: int, experts, weights, x: torch.Tensor, out: torch.Tensor,
                      accumulate: bool = False) -> None:  # fmt: skip
        """Post `run_experts`'s call to the thread pool and return at once; `finish` must
        follow (until then `out` must stay unchanged, and other callers wait). Raises OSError
        (and turns `pooled` off) where the pool's threads cannot be made."""
        self._post(
            self._start, lambda: self._experts_args(layer, experts, weights, x, out, accumulate)
        )

    def warm(self, layer: int, experts) -> bool:
        """Post a read of `experts` of `layer`, which a later decode call will likely compute,
        into the caches of the pool's cores (each thread the bytes of its share of that call's
        items), and return at once; the next call (or `settle`) waits for it first. False
        (nothing posted) where another thread's call runs or the pool is off."""
        if not experts:
            return False
        rows = self.store.flat[layer]
        row_ptrs = (_P * len(experts))(*row_pointers(rows, experts))
        args = (row_ptrs, len(experts), self.store.hidden, self.store.inter)
        return self._post_warm(self._warm, args, (row_ptrs, rows))  # (the rows it reads too)

    def _experts_args(self, layer, experts, weights, x, out, accumulate) -> tuple[tuple, tuple]:
        """A decode call's C arguments (under the lock: the scratch is shared), and what must
        stay alive while it runs."""
        s, n = self.store, len(experts)
        row_ptrs, gu, dn = self._pointers(layer, experts)
        x32 = self._x32_of(x)
        w = (ctypes.c_float * n)(*weights)
        scratch = self._scratch_for(self._need(n, s.hidden, s.inter, 0))
        args = (row_ptrs, w, n, x32.data_ptr(), out.data_ptr(), s.hidden, s.inter, gu, dn)
        args += (s.act.limit, s.act.alpha, int(accumulate), scratch.data_ptr())
        return args, (row_ptrs, gu, dn, x32, w, out, scratch)

    def run_rows(self, layer: int, experts, counts, x: torch.Tensor, scale, out) -> None:
        """Prefill's CPU experts: `x [R, H]` holds `counts[e]` consecutive rows for each of
        `experts` (in order); `out [R, H]` gets each row's expert output times its `scale`
        (`[R]` or `[R, 1]`). Each weight row comes from memory once for all of its expert's
        rows."""
        s, n = self.store, len(experts)
        row_ptrs, gu, dn = self._pointers(layer, experts)
        starts = (ctypes.c_int * (n + 1))(0, *itertools.accumulate(counts[e] for e in experts))
        x32 = x.float().contiguous()
        w32 = scale.reshape(-1).float().contiguous()
        result = torch.empty(x32.shape, dtype=torch.float32)
        with self._turn():
            scratch = self._scratch_for(self._need(n, s.hidden, s.inter, x32.shape[0]))
            self._rows(
                row_ptrs, starts, n, x32.data_ptr(), w32.data_ptr(), result.data_ptr(),
                s.hidden, s.inter, gu, dn, s.act.limit, s.act.alpha, scratch.data_ptr(),
            )  # fmt: skip
        out.copy_(result)

    def _x32_of(self, x: torch.Tensor) -> torch.Tensor:
        """A decode call's input as fp32 `[H]`, in a buffer kept for the next calls (they take
        turns under the lock, and the posted call keeps it until `finish`)."""
        if self._x32.numel() != x.numel():
            self._x32 = torch.empty(x.numel(), dtype=torch.float32)
        return self._x32.copy_(x.reshape(-1))

    def _pointers(self, layer: int, experts) -> tuple:
        """C arrays of the experts' packed rows and of their fp32 biases (None without)."""
        n = len(experts)
        row_ptrs = (_P * n)(*row_pointers(self.store.flat[layer], experts))
        bias = self._layer_biases(layer)
        if bias is None:
            return row_ptrs, None, None
        gu = (_P * n)(*row_pointers(bias[0], experts))
        return row_ptrs, gu, (_P * n)(*row_pointers(bias[1], experts))

    def prepare(self, layers) -> None:
        """The fp32 biases of `layers` now (at install): a layer's first call would otherwise
        convert them on a request's path (1-2 ms a layer for gpt-oss-120b on the dev machine)."""
        for layer in layers:
            self._layer_biases(layer)

    def _layer_biases(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        both = self.store.biases(layer, "cpu")
        if both is None:
            return None
        if layer not in self._biases:
            self._biases[layer] = tuple(b.float().contiguous() for b in both)
        return self._biases[layer]

    def _scratch_for(self, numel: int) -> torch.Tensor:
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=torch.float32)
        return self._scratch


def quantized_blocks(x: torch.Tensor) -> torch.Tensor:
    """`x [..., K]` (K a multiple of 32) as the native kernel sees it: each block of 32 values
    int16-quantized against its largest magnitude (scale amax / 32767, fp32 arithmetic as the
    kernel's, rounding half to even; a subnormal scale counts as zero) and scaled back; fp32.
    (The plain-torch reference of the kernel's inputs.)"""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 32767.0
    scale = torch.where(scale < torch.finfo(torch.float32).tiny, 0.0, scale)  # (as the kernel)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inv) * scale).reshape(x.shape)


def reference_ffn(x, gate_up, down, gate_up_bias=None, down_bias=None, act=PLAIN) -> torch.Tensor:
    """The kernel's arithmetic in plain torch (`expert_ffn` on the dequantized weights, with
    its inputs and activations through `quantized_blocks`): x `[N, H]` -> `[N, H]`."""
    h = act(F.linear(quantized_blocks(x), gate_up.float(), gate_up_bias))
    return F.linear(quantized_blocks(h), down.float(), down_bias)


@functools.cache
def _library() -> ctypes.CDLL | None:
    return build_library("experts_mxfp4", SOURCE)


def cpu_kernel_for(name: str, store: ExpertStore, strict: bool = False):
    """The CPU expert kernel `name` (`OffloadConfig.cpu_kernel`) selects for `store`'s experts:
    for packed rows their own (None with "torch"), else `cpu_kernel.kernel_for`'s. Calibration
    profiles are keyed by it, so everything that calibrates or installs picks it here."""
    if store.packed:
        return mxfp4_kernel(store) if name != "torch" else None
    return kernel_for(name, store.dtype, strict)


def mxfp4_kernel(store: ExpertStore) -> PackedCPUExperts | None:
    """The native kernel for `store`'s packed experts, or None (not packed, or unbuildable)."""
    if not store.packed:
        return None
    lib = _library()
    return PackedCPUExperts(lib, store) if lib is not None else None
