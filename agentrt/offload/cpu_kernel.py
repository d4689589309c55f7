"""A native CPU kernel for a decode token's CPU experts (bf16 weights, fp32 sums), and for
prefill's (several rows per expert, each weight row read once), built with the system C
compiler at first use and called through ctypes.

torch's bf16 `F.linear` on one row reads the expert weights well below the memory bandwidth
(`agentrt bench bw` on the H200 machine: 26-41 GB/s against a DRAM read of 88-94 GB/s; on the
2-core AVX2 dev machine 15-17 GB/s where this kernel reads 23-25 GB/s), and a decode token's
experts are two matrix-vector products each. The kernel computes every CPU expert of a layer in
one OpenMP region: rows of `gate_up @ x` with AVX512-BF16 dot products (`vdpbf16ps`, fp32
accumulation), or with AVX2 FMAs on the bf16 values widened to fp32 (each 32-bit lane's two
halves by a shift and a mask), or a plain loop without either; SiLU(gate) * up in fp32 rounded
to bf16, then each output row's weighted sum over the experts of `down @ act`, added into the
fp32 output. It is more precise than torch's path, which rounds each product to bf16. Graph
decode's host steps post the same computation to a pool of the library's own threads instead
(`start`, `finish`: the host step works meanwhile; `threadpool.c`), which gives the same bits.

`native_experts()` returns None (callers keep torch's path) where there is no C compiler, the
build fails or the library cannot load; it builds once per source and compiler flags into
`home_dir()/kernels`. `kernel_for(name)` picks by `OffloadConfig.cpu_kernel`: "native", "torch",
or "auto" (the default): native where the CPU has AVX512-BF16 or AVX2 with FMA (on the H200
machine 55-75 GB/s against torch's 22-35), torch's elsewhere (faster than the plain loop).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from agentrt.env import bad_setting, home_dir, setting, switched_off, variable
from agentrt.errors import AgentrtError
from agentrt.host.cputhreads import busy_helpers, helpers_yield, usable_cores
from agentrt.host.private import FILE_MODE, private_dir
from agentrt.offload.config import CPU_KERNELS

# (package data) the thread pool's source in front of the kernel's, which uses it
POOL_SOURCE = (Path(__file__).parent / "threadpool.c").read_text()
SOURCE = POOL_SOURCE + (Path(__file__).parent / "experts_bf16.c").read_text()
FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-shared", "-fPIC"]
_P = ctypes.c_void_p


class _Guard:
    """One per native library (one pool and one posted call in C, whatever number of Python
    objects bind it): the lock its calls take turns by and the posted call's arguments, both
    reset in a forked child (where no call of the parent's runs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.args: tuple | None = None  # what a posted call reads (kept alive until finish)
        self.resting = False  # the pool's threads sent to sleep until the next posted call
        self.warming = None  # what a posted warm-up reads (kept until it is waited for)
        self.spin_s: float | None = None  # their spin (`pool_spin_s()`, read once per library)
        os.register_at_fork(after_in_child=self._forget_calls)

    def _forget_calls(self) -> None:
        self.lock, self.args, self.warming = threading.Lock(), None, None


_GUARDS: dict[int, _Guard] = {}  # library handle -> its guard
_GUARDS_LOCK = threading.Lock()


# How long the pool's idle threads (and a caller waiting for them) spin before they sleep. A
# decode whose CPU share is sparse posts a call every few layers, 5-20 ms apart: with a 2 ms
# spin each call found the pool asleep and paid for waking it (one expert after 20 ms idle:
# +1.3-2.1 ms on one thread of the 2-core dev machine, none with 20 ms of spin; on an H100
# host such calls read 2.2 GB/s against 30.7 for calls layer after layer). The pool only runs
# decode's CPU experts, so its threads spin while a decode runs and sleep 20 ms after it, or
# as soon as a prefill begins (`PoolCalls.rest`).
SPIN_S = 0.02


def pool_spin_s() -> float:
    """Seconds the pool's idle threads spin before they sleep: `AGENTRT_POOL_SPIN_MS`
    (milliseconds, for comparisons), else `SPIN_S`."""
    value = (setting("POOL_SPIN_MS") or "").strip()
    if not value:
        return SPIN_S
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0 <= ms <= 10_000:
        expected = "a number of milliseconds from 0 to 10000"
        bad_setting(
            "POOL_SPIN_MS", value, expected, f"the CPU kernel's threads spin {SPIN_S * 1e3:g} ms"
        )
        return SPIN_S
    return ms / 1e3


class PoolCalls:
    """Calls posted to a native kernel's thread pool (`threadpool.c`), shared by the kernels:
    `_post` posts one under the library's lock (on `active_threads` of the pool) and keeps its
    arguments alive, `finish` waits for it and releases them. `pooled`: whether graph decode's
    host steps use the pool (4 or more threads, and `AGENTRT_CPU_POOL` not 0); `pool_threads`:
    one fewer than torch's (a core for the caller). The pool's threads spin `pool_spin_s()`
    after a call before they sleep, unless `rest` sent them to sleep."""

    def _init_pool(self, lib: ctypes.CDLL) -> None:
        """Bind the library's pool (`agentrt_pool_wait`, `agentrt_pool_schedule`; the kernel
        binds its own start) and its guard."""
        self._wait = lib.agentrt_pool_wait
        self._wait.argtypes, self._wait.restype = [], ctypes.c_double
        self._schedule = lib.agentrt_pool_schedule
        self._schedule.argtypes, self._schedule.restype = [ctypes.c_int], None
        self._spin = lib.agentrt_pool_spin
        self._spin.argtypes, self._spin.restype = [ctypes.c_double], ctypes.c_double
        self._cancel = lib.agentrt_pool_cancel
        self._cancel.argtypes, self._cancel.restype = [], None
        with _GUARDS_LOCK:
            self._guard = _GUARDS.setdefault(lib._handle, _Guard())
            if self._guard.spin_s is None:  # (the library's first binding)
                self._guard.spin_s = pool_spin_s()
                self._spin(self._guard.spin_s)
        threads = min(torch.get_num_threads(), usable_cores())
        self.pool_threads = max(1, threads - 1)  # (a core for the caller)
        self.pooled = threads >= 4 and not switched_off("CPU_POOL")

    @property
    def _lock(self) -> threading.Lock:
        """The library's lock: every call of every object bound to it takes turns."""
        return self._guard.lock

    def rest(self) -> None:
        """Send the pool's idle threads to sleep now rather than after their spin (a prefill
        begins: its CPU experts run on torch's OpenMP team, whose cores spinning pool threads
        would hold); the next posted call makes them spin again."""
        if not self._guard.resting:
            self._guard.resting = True
            self._spin(0.0)

    def reclaim(self) -> None:
        """Wait for a call this thread posted and left (a decode step that failed after the post):
        its lock would stop this thread's next call, and it writes its output until waited for."""
        if self.posted:
            self.finish()

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """The library's lock, once a posted warm-up is done (a call on the caller's OpenMP
        team would compete with its threads for the cores)."""
        self.reclaim()
        with self._lock:
            self._settle()
            yield

    def _post_warm(self, start, args: tuple, alive: tuple) -> bool:
        """Post a warm-up `start(*args, pool_threads, active)` (see `NativeExperts.warm`) and
        return at once, keeping `alive` until the next call (or `settle`) waits for it. False
        (nothing posted) where another thread's call runs or the pool is off."""
        guard = self._guard
        self.reclaim()
        if not self.pooled or not guard.lock.acquire(blocking=False):
            return False
        try:
            self._settle()
            guard.warming = alive  # (before the post: an interrupt may land once it runs)
            code = start(*args, self.pool_threads, self.active_threads())
            if code != 0:
                guard.warming = None
            return code == 0
        finally:
            guard.lock.release()

    def settle(self) -> None:
        """Wait for a posted warm-up, if any."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        """(Under the lock.) Cut a posted warm-up short (what it has not read, the next call
        reads from memory anyway), wait for it and release what it reads."""
        if self._guard.warming is not None:
            self._cancel()
            self._wait()
            self._guard.warming = None

    def _post(self, start, make) -> None:
        """Under the lock, `make()` -> (C arguments, what must stay alive), then
        `start(*arguments, pool_threads)`; `finish` must follow. Raises OSError (and turns
        `pooled` off) where the pool's threads cannot be made."""
        guard = self._guard
        self.reclaim()
        guard.lock.acquire()
        self._settle()
        if guard.resting:  # (a decode begins: the pool spins between its calls again)
            guard.resting = False
            self._spin(guard.spin_s)
        try:
            args, alive = make()
            guard.args = (args, alive, threading.get_ident())
            code = start(*args, self.pool_threads, self.active_threads())
        except BaseException:  # (an interrupt may land once the call is posted)
            self._wait()  # (returns at once when nothing was posted)
            guard.args = None
            guard.lock.release()
            raise
        if code != 0:
            guard.args = None
            guard.lock.release()
            self.pooled = False
            print("agentrt: the CPU kernel's threads could not start", file=sys.stderr)
            raise OSError(f"native CPU expert kernel: no thread pool (code {code})")

    def active_threads(self) -> int:
        """The pool's threads a call takes now: all but one per helper thread busy with CPU
        work (the state-cache writer and its compression threads), at least one: a pool thread
        that the OS preempts for a helper holds the rest up at the next barrier.
        `AGENTRT_HELPERS_YIELD=0` keeps all of them (to compare the two)."""
        return max(1, self.pool_threads - (busy_helpers() if helpers_yield() else 0))

    def schedule(self, chunk: int) -> None:
        """How the pool's threads divide later calls: claims of `chunk` items from each
        thread's own equal share, then from the others' (the default, 16), or fixed equal
        shares (0: a preempted thread then holds up the rest; benchmarks compare the two)."""
        with self._turn():  # (not while a warm-up's threads claim items)
            self._schedule(chunk)

    @property
    def posted(self) -> bool:
        """Whether this thread has a call posted that `finish` has not waited for."""
        args = self._guard.args
        return args is not None and args[-1] == threading.get_ident()

    def finish(self) -> float:
        """Wait for the posted call; returns its seconds (the pool's own clock)."""
        try:
            return self._wait()
        finally:
            self._guard.args = None
            self._guard.lock.release()


class NativeExperts(PoolCalls):
    """The built kernel, with scratch buffers per expert shape (shared by every caller of the
    process, so calls take turns). `run` computes in an OpenMP region on the calling thread
    (torch's team: prefill, CPU layers, calibration); `start` posts the same call to the
    library's pool of one thread fewer than torch's and returns, so the caller works meanwhile,
    and `finish` waits for it (graph decode's host steps, where `pooled`: 4 or more threads,
    and `AGENTRT_CPU_POOL` not 0)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [_P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._fn = lib.experts_bf16
        self._fn.argtypes, self._fn.restype = [*args, _P], None
        self._start = lib.experts_start
        self._start.argtypes = [*args, _P, ctypes.c_int, ctypes.c_int]
        self._start.restype = ctypes.c_int
        self._rows = lib.experts_rows_bf16
        self._rows.argtypes = [_P, _P, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int, ctypes.c_int, _P]
        self._rows.restype = None
        self._warm = lib.experts_warm
        self._warm.argtypes = [_P, _P] + [ctypes.c_int] * 5
        self._warm.restype = ctypes.c_int
        lib.experts_fast_path.restype = ctypes.c_int
        self.fast_path = bool(lib.experts_fast_path())  # AVX512-BF16 or AVX2 dots compiled in
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}  # activations per shape
        self._init_pool(lib)

    def run(
        self,
        gate_up: list[torch.Tensor],
        down: list[torch.Tensor],
        weights: list[float],
        x: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool = False,
    ) -> None:
        """`out` (fp32 `[H]`) = sum_e weights[e] * expert_e(x) (plus `out` if `accumulate`), for
        contiguous bf16 CPU weights `gate_up[e] [2I, H]`, `down[e] [H, I]` and `x [H]`."""
        with self._turn():
            self._fn(*self._args_of(gate_up, down, weights, x, out, accumulate))

    def run_rows(
        self,
        gate_up: list[torch.Tensor],
        down: list[torch.Tensor],
        counts: list[int],
        x: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Prefill's CPU experts: `x` (bf16 `[rows, H]`, contiguous) holds `counts[e]`
        consecutive rows for expert e; `out` (fp32 `[rows, H]`) gets each row's expert output
        times its `weights` (fp32 `[rows]`). On the calling thread's OpenMP team."""
        args, alive = self._rows_args(gate_up, down, counts, x, weights, out)
        with self._turn():
            self._rows(*args)
        del alive  # (the scratch and the C arrays the call read)

    def _rows_args(self, gate_up, down, counts, x, weights, out) -> tuple[tuple, tuple]:
        """The rows call's C arguments, and what must stay alive while it runs."""
        n = len(gate_up)
        hidden, inter = down[0].shape
        act = torch.empty(x.shape[0] * inter, dtype=torch.bfloat16)
        starts = (ctypes.c_int * (n + 1))(0, *itertools.accumulate(counts))
        pointers = _pointers(gate_up, down)
        tensors = (x, weights, out)
        args = (*pointers, starts, n, *(t.data_ptr() for t in tensors), hidden, inter)
        return (*args, act.data_ptr()), (act, gate_up, down, *tensors, pointers, starts)

    def start(self, gate_up, down, weights, x, out, accumulate: bool = False) -> None:
        """Post the call `run` makes to the thread pool and return at once; `finish` must
        follow (until then the tensors must stay unchanged, and other callers wait). Raises
        OSError (and turns `pooled` off) where the pool's threads cannot be made."""

        def make() -> tuple[tuple, tuple]:
            args = self._args_of(gate_up, down, weights, x, out, accumulate)
            return args, (gate_up, down, x, out)

        self._post(self._start, make)

    def warm(self, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> bool:
        """Post a read of experts a later call will likely compute (their weights as `start`
        takes them, kept alive until the read is waited for) into the caches of the pool's
        cores, each thread the rows of its share of that call's items, and return at once: it
        runs while the caller waits for other work (a graph piece), and the next call (or
        `settle`) waits for it first. False (nothing posted) where another thread's call runs
        or the pool is off."""
        if not gate_up:
            return False
        hidden, inter = down[0].shape
        pointers = _pointers(gate_up, down)
        args = (*pointers, len(gate_up), hidden, inter)
        return self._post_warm(self._warm, args, (*pointers, gate_up, down))

    def _args_of(self, gate_up, down, weights, x, out, accumulate: bool) -> tuple:
        """The C call's arguments, the activations' scratch (of this shape) last."""
        n = len(gate_up)
        hidden, inter = down[0].shape
        act = self._act_buffer(hidden, inter, n)
        return (
            *_pointers(gate_up, down),
            (ctypes.c_float * n)(*weights),
            n,
            x.data_ptr(),
            out.data_ptr(),
            hidden,
            inter,
            int(accumulate),
            act.data_ptr(),
        )

    def _act_buffer(self, hidden: int, inter: int, n: int) -> torch.Tensor:
        """The bf16 activations' scratch for `n` experts of this shape (kept, grown as needed)."""
        act = self._scratch.get((hidden, inter))
        if act is None or act.numel() < n * inter:
            act = torch.empty(max(n, 8) * inter, dtype=torch.bfloat16)
            self._scratch[(hidden, inter)] = act
        return act


class StoreExperts:
    """`NativeExperts` over one store's bf16 experts, addressed by (layer, experts) as
    `cpu_mxfp4.PackedCPUExperts` addresses packed ones, so graph decode's host steps take
    either kernel the same way."""

    def __init__(self, kernel: NativeExperts, store) -> None:
        self.kernel, self.store = kernel, store

    def warm(self, layer: int, experts: list[int]) -> bool:
        """`NativeExperts.warm` for these experts of `layer`."""
        return self.kernel.warm(*self._views(layer, experts))

    def start_experts(self, layer: int, experts: list[int], weights, x, out) -> None:
        """`NativeExperts.start` for these experts of `layer`."""
        self.kernel.start(*self._views(layer, experts), weights, x, out)

    def run_experts(self, layer: int, experts: list[int], weights, x, out, accumulate) -> None:
        """`NativeExperts.run` for these experts of `layer`."""
        self.kernel.run(*self._views(layer, experts), weights, x, out, accumulate=accumulate)

    def _views(self, layer: int, experts: list[int]) -> tuple[list, list]:
        return expert_weights(self.store, layer, experts)


def expert_weights(store, layer: int, experts) -> tuple[list, list]:
    """The gate/up and down weights of `experts` of `layer` in a bf16 store, as the native
    kernel's calls take them (a list of each)."""
    _, gate_up, down = store.expert_views(layer)
    return [gate_up[e] for e in experts], [down[e] for e in experts]


def row_pointers(stack: torch.Tensor, ids: list[int]) -> list[int]:
    """The data pointers of rows `ids` of `stack` (`stack[e].data_ptr()` for each e), without
    a view made per row (a host step's CPU experts are posted sooner)."""
    base, step = stack.data_ptr(), stack.stride(0) * stack.element_size()
    return [base + e * step for e in ids]


def _pointers(*groups: list[torch.Tensor]) -> list:
    """Each list of tensors as a C array of their data pointers."""
    return [(_P * len(group))(*[t.data_ptr() for t in group]) for group in groups]


@functools.cache
def native_experts() -> NativeExperts | None:
    """The kernel, built on first use (once per source, flags and machine); None without a
    C compiler or if the build or the load fails (the reason goes to stderr once)."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return None
    lib = build_library("experts_bf16", SOURCE)
    return NativeExperts(lib) if lib is not None else None


def build_library(name: str, source: str) -> ctypes.CDLL | None:
    """The C `source` built with `FLAGS` into `home_dir()/kernels` once per source, flags,
    compiler and CPU (its instruction sets: `-march=native` code may not run on another CPU
    sharing the home directory), and loaded; None (the reason on stderr) without a compiler or
    if it fails."""
    compiler = variable("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        print(f"agentrt: no C compiler: {name} unavailable, torch's kernels run", file=sys.stderr)
        return None
    build = [source, *FLAGS, compiler, *sorted(cpu_flags())]
    key = hashlib.sha256("\n".join(build).encode()).hexdigest()[:16]
    path = home_dir() / "kernels" / f"{name}-{key}.so"
    try:
        if not path.exists():
            _build(compiler, path, source, name)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"agentrt: native CPU kernel {name} unavailable ({exc})", file=sys.stderr)
        return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    names = ("flags", "Features")  # (x86, Arm)
    line = next((line for line in text.splitlines() if line.startswith(names)), "")
    return frozenset(line.partition(":")[2].split())


def has_fast_dot() -> bool:
    """Whether this CPU has the kernel's vector dot products: AVX512-BF16 (`vdpbf16ps`), or
    AVX2 with FMA."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or {"avx2", "fma"} <= flags


def kernel_for(
    name: str, dtype: torch.dtype = torch.bfloat16, strict: bool = False
) -> NativeExperts | None:
    """The CPU expert kernel `name` ("auto", "torch" or "native") selects for experts of
    `dtype`: the native kernel (built on first use), or None for torch's kernels (also where
    the kernel cannot be built, or for experts that are not bfloat16; with `strict`, an
    explicit "native" raises there instead). auto takes the native kernel only where both the
    CPU and the build have its vector dot products (`has_fast_dot`, `fast_path`)."""
    if name not in CPU_KERNELS:
        raise ValueError(f"cpu kernel must be one of {', '.join(CPU_KERNELS)}, got {name!r}")
    if strict and name == "native" and dtype != torch.bfloat16:
        raise AgentrtError("the native CPU expert kernel takes bfloat16 experts")
    if name == "torch" or dtype != torch.bfloat16:
        return None
    if name == "auto" and not has_fast_dot():
        return None
    kernel = native_experts()
    if strict and kernel is None:
        raise AgentrtError("the native CPU expert kernel is not available here (see above)")
    if name == "auto" and kernel is not None and not kernel.fast_path:
        return None
    return kernel


def kernel_name(kernel: NativeExperts | None) -> str:
    """ "native" or "torch": which kernel runs (profiles and reports are named by it)."""
    return "torch" if kernel is None else "native"


def _build(compiler: str, path: Path, text: str, name: str) -> None:
    """Compile into a temporary file, then move it into place (concurrent builds are safe)."""
    private_dir(path.parent)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source, out = Path(tmp) / f"{name}.c", Path(tmp) / path.name
        source.write_text(text)
        command = [compiler, *FLAGS, str(source), "-o", str(out), "-lm"]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.chmod(out, FILE_MODE)
        os.replace(out, path)
