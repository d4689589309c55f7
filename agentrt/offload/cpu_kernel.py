"""A native CPU kernel for a decode token's CPU experts (bf16 weights, fp32 sums), built with the
system C compiler at first use and called through ctypes.

torch's bf16 `F.linear` on one row reads the expert weights well below the memory bandwidth
(`agentrt bench bw` on the H200 machine: 26-41 GB/s against a DRAM read of 88-94 GB/s; on the
2-core dev machine 16-18 GB/s where this kernel reads 41-53 GB/s), and a decode token's experts
are two matrix-vector products each. The kernel computes every CPU expert of a layer in one
OpenMP region: rows of `gate_up @ x` with AVX512-BF16 dot products (`vdpbf16ps`, fp32
accumulation; a plain loop without that instruction set), SiLU(gate) * up in fp32 rounded to
bf16, then each output row's weighted sum over the experts of `down @ act`, added into the fp32
output. It is more precise than torch's path, which rounds each product to bf16.

`native_experts()` returns None (callers keep torch's path) where there is no C compiler, the
build fails or the library cannot load; it builds once per source and compiler flags into
`home_dir()/kernels`. `kernel_for(name)` picks by `OffloadConfig.cpu_kernel`: "native", "torch",
or "auto" (the default): native where the CPU has AVX512-BF16, torch's elsewhere (without that
instruction set the kernel's plain loop is slower than torch's vectorised one). On the H200
machine the kernel read expert weights at 55-75 GB/s against torch's 22-35 (16 cores).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from agentrt.config import home_dir

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <immintrin.h>
#include <pthread.h>
#include <omp.h>
#include <time.h>

static inline float bf2f(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f2bf(float f) {  /* round to nearest even */
    uint32_t u; memcpy(&u, &f, 4); u += 0x7FFF + ((u >> 16) & 1); return (uint16_t)(u >> 16);
}

static float dot(const uint16_t* w, const uint16_t* x, int n) {
    float s = 0.f;
    int k = 0;
#if defined(__AVX512BF16__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; k + 64 <= n; k += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + k),
                                (__m512bh)_mm512_loadu_si512(x + k));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(w + k + 32),
                                (__m512bh)_mm512_loadu_si512(x + k + 32));
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
    for (; k < n; k++) s += bf2f(w[k]) * bf2f(x[k]);
    return s;
}

/* out[hidden] = (accumulate ? out : 0) + sum_e weights[e] * down_e @ act_e,
   act_e = bf16(silu(g) * u), [g; u] = gate_up_e @ x. h: [2 * inter] fp32 scratch,
   act: [n * inter] bf16 scratch. */
void experts_bf16(const uint16_t** gate_up, const uint16_t** down, const float* weights, int n,
                  const uint16_t* x, float* out, int hidden, int inter, int accumulate,
                  float* h, uint16_t* act) {
    #pragma omp parallel
    {
        for (int e = 0; e < n; e++) {
            const uint16_t* gu = gate_up[e];
            #pragma omp for schedule(static)
            for (int j = 0; j < 2 * inter; j++) h[j] = dot(gu + (int64_t)j * hidden, x, hidden);
            #pragma omp for schedule(static)
            for (int i = 0; i < inter; i++) {
                float g = h[i], u = h[inter + i];
                act[(int64_t)e * inter + i] = f2bf(g / (1.f + expf(-g)) * u);
            }
        }
        #pragma omp for schedule(static)
        for (int r = 0; r < hidden; r++) {
            float s = accumulate ? out[r] : 0.f;
            for (int e = 0; e < n; e++) {
                const uint16_t* row = down[e] + (int64_t)r * inter;
                s += weights[e] * dot(row, act + (int64_t)e * inter, inter);
            }
            out[r] = s;
        }
    }
}

/* The same on the library's own thread (its OpenMP team is the only one these calls use):
   experts_start posts a call and returns, experts_wait waits for it and returns its seconds.
   Its OpenMP team leaves one core to the caller, which works meanwhile (and spins when it
   waits). Both sides spin briefly (a host step is shorter than a sleep and wake-up) before
   sleeping on a condition variable. One call at a time (the caller serialises). */
typedef struct {
    const uint16_t** gate_up; const uint16_t** down; const float* weights; int n;
    const uint16_t* x; float* out; int hidden, inter, accumulate; float* h; uint16_t* act;
} job_t;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static job_t job;
static int phase = 0;  /* 0 idle, 1 posted, 2 done (atomic) */
static int started = 0;
static double seconds = 0.0;

static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}
static void await_phase(int want) {
    double t0 = now();
    for (int i = 1; __atomic_load_n(&phase, __ATOMIC_ACQUIRE) != want; i++) {
        _mm_pause();
        if ((i & 1023) == 0 && now() - t0 > 0.002) {
            pthread_mutex_lock(&mu);
            while (__atomic_load_n(&phase, __ATOMIC_ACQUIRE) != want) pthread_cond_wait(&cv, &mu);
            pthread_mutex_unlock(&mu);
            return;
        }
    }
}
static void set_phase(int value) {
    __atomic_store_n(&phase, value, __ATOMIC_RELEASE);
    pthread_mutex_lock(&mu);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}
static void* worker(void* arg) {
    (void)arg;
    int all = omp_get_max_threads();
    omp_set_num_threads(all > 1 ? all - 1 : 1);  /* a core for the caller */
    for (;;) {
        await_phase(1);
        job_t j = job;
        double t0 = now();
        experts_bf16(j.gate_up, j.down, j.weights, j.n, j.x, j.out, j.hidden, j.inter,
                     j.accumulate, j.h, j.act);
        seconds = now() - t0;
        set_phase(2);
    }
    return NULL;
}
static void forked_child(void) {  /* the thread does not survive a fork */
    started = 0; phase = 0;
    pthread_mutex_init(&mu, NULL); pthread_cond_init(&cv, NULL);
}
int experts_start(const uint16_t** gate_up, const uint16_t** down, const float* weights, int n,
                  const uint16_t* x, float* out, int hidden, int inter, int accumulate,
                  float* h, uint16_t* act) {
    if (!started) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, NULL) != 0) return -1;
        pthread_detach(thread);
        pthread_atfork(NULL, NULL, forked_child);
        started = 1;
    }
    job_t j = {gate_up, down, weights, n, x, out, hidden, inter, accumulate, h, act};
    job = j;
    set_phase(1);
    return 0;
}
double experts_wait(void) {
    await_phase(2);
    __atomic_store_n(&phase, 0, __ATOMIC_RELEASE);
    return seconds;
}
"""
FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-shared", "-fPIC"]
_P = ctypes.c_void_p


class NativeExperts:
    """The built kernel, with scratch buffers per expert shape (shared by every caller of the
    process, so calls take turns). `run` computes on the calling thread; `start` posts the same
    call to the library's own thread and returns (the caller works meanwhile), `finish` waits
    for it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._start = lib.experts_start
        self._start.argtypes = [_P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_int]
        self._start.argtypes += [ctypes.c_int, _P, _P]
        self._fn = lib.experts_bf16
        self._fn.argtypes, self._fn.restype = self._start.argtypes, None
        self._start.restype = ctypes.c_int
        self._wait = lib.experts_wait
        self._wait.argtypes, self._wait.restype = [], ctypes.c_double
        self._scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._args: tuple | None = None  # what the running call reads (kept alive until finish)

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
        contiguous bf16 CPU weights `gate_up[e] [2I, H]`, `down[e] [H, I]` and `x [H]`, on the
        calling thread (its OpenMP team uses every core)."""
        with self._lock:
            self._fn(*self._args_of(gate_up, down, weights, x, out, accumulate))

    def start(self, gate_up, down, weights, x, out, accumulate: bool = False) -> None:
        """Post the call `run` makes to the library's thread (whose team has one core fewer)
        and return at once; `finish` must follow (until then the tensors must stay unchanged,
        and other callers wait)."""
        self._lock.acquire()
        try:
            args = self._args_of(gate_up, down, weights, x, out, accumulate)
            if self._start(*args) != 0:
                raise OSError("the native CPU expert kernel could not start its thread")
            self._args = (args, gate_up, down, x, out)
        except BaseException:
            self._lock.release()
            raise

    def finish(self) -> float:
        """Wait for the posted call; returns its seconds (the kernel's own clock)."""
        try:
            return self._wait()
        finally:
            self._args = None
            self._lock.release()

    def _args_of(self, gate_up, down, weights, x, out, accumulate: bool) -> tuple:
        """The C call's arguments (pointers; the scratch buffers of this shape)."""
        n = len(gate_up)
        hidden, inter = down[0].shape
        h, act = self._buffers(hidden, inter, n)
        return (
            (_P * n)(*[t.data_ptr() for t in gate_up]),
            (_P * n)(*[t.data_ptr() for t in down]),
            (ctypes.c_float * n)(*weights),
            n,
            x.data_ptr(),
            out.data_ptr(),
            hidden,
            inter,
            int(accumulate),
            h.data_ptr(),
            act.data_ptr(),
        )

    def _buffers(self, hidden: int, inter: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, act = self._scratch.get((hidden, inter), (None, None))
        if h is None or act.numel() < n * inter:
            h = torch.empty(2 * inter, dtype=torch.float32)
            act = torch.empty(max(n, 8) * inter, dtype=torch.bfloat16)
            self._scratch[(hidden, inter)] = (h, act)
        return h, act


@functools.cache
def native_experts() -> NativeExperts | None:
    """The kernel, built on first use (once per source, flags and machine); None without a
    C compiler or if the build or the load fails (the reason goes to stderr once)."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        print("agentrt: no C compiler: CPU experts use torch's kernels", file=sys.stderr)
        return None
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + compiler).encode()).hexdigest()[:16]
    path = home_dir() / "kernels" / f"experts_bf16-{key}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        return NativeExperts(ctypes.CDLL(str(path)))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"agentrt: native CPU expert kernel unavailable ({exc})", file=sys.stderr)
        return None


KERNELS = ("auto", "torch", "native")


def has_bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16 (`vdpbf16ps`, the kernel's fast path)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return "avx512_bf16" in flags.split()


def kernel_for(name: str, dtype: torch.dtype = torch.bfloat16) -> NativeExperts | None:
    """The CPU expert kernel `name` ("auto", "torch" or "native") selects for experts of
    `dtype`: the native kernel (built on first use), or None for torch's kernels (also where
    the kernel cannot be built, or for experts that are not bfloat16)."""
    if name == "torch" or dtype != torch.bfloat16:
        return None
    if name == "auto" and not has_bf16_dot():
        return None
    return native_experts()


def kernel_name(kernel: NativeExperts | None) -> str:
    """ "native" or "torch": which kernel runs (profiles and reports are named by it)."""
    return "torch" if kernel is None else "native"


def _build(compiler: str, path: Path) -> None:
    """Compile into a temporary file, then move it into place (concurrent builds are safe)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source, out = Path(tmp) / "experts_bf16.c", Path(tmp) / path.name
        source.write_text(SOURCE)
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(out), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(out, path)
