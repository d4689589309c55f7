"""A native CPU kernel for a decode token's CPU experts (bf16 weights, fp32 sums), and for
prefill's (several rows per expert, each weight row read once), built with the system C
compiler at first use and called through ctypes.

torch's bf16 `F.linear` on one row reads the expert weights well below the memory bandwidth
(`agentrt bench bw` on the H200 machine: 26-41 GB/s against a DRAM read of 88-94 GB/s; on the
2-core dev machine 16-18 GB/s where this kernel reads 41-53 GB/s), and a decode token's experts
are two matrix-vector products each. The kernel computes every CPU expert of a layer in one
OpenMP region: rows of `gate_up @ x` with AVX512-BF16 dot products (`vdpbf16ps`, fp32
accumulation; a plain loop without that instruction set), SiLU(gate) * up in fp32 rounded to
bf16, then each output row's weighted sum over the experts of `down @ act`, added into the fp32
output. It is more precise than torch's path, which rounds each product to bf16. Graph decode's
host steps post the same computation to a pool of the library's own threads instead (`start`,
`finish`: the host step works meanwhile), which gives the same bits; it is no second OpenMP
team, which would take libgomp over the core count and cut every team's spinning short.

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
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from agentrt.config import CPU_KERNELS, home_dir
from agentrt.errors import AgentrtError
from agentrt.private import FILE_MODE, private_dir

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <immintrin.h>
#include <pthread.h>
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
                  uint16_t* act, float* h) {
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

/* s[q] = dot(w, x + q * ld, n) for q < M: one weight row against M input rows at once (the
   weight vectors loaded once, 2 * M independent sums), each sum in the order `dot` takes. */
static inline __attribute__((always_inline)) void dot_m(const uint16_t* w, const uint16_t* x,
                                                        int64_t ld, int n, float* s, const int M) {
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    int k = 0;
#if defined(__AVX512BF16__)
    __m512 a[4][2];
    for (int q = 0; q < M; q++) { a[q][0] = _mm512_setzero_ps(); a[q][1] = _mm512_setzero_ps(); }
    for (; k + 64 <= n; k += 64) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int q = 0; q < M; q++) {
            a[q][0] = _mm512_dpbf16_ps(a[q][0], w0, (__m512bh)_mm512_loadu_si512(x + q * ld + k));
            a[q][1] = _mm512_dpbf16_ps(a[q][1], w1,
                                       (__m512bh)_mm512_loadu_si512(x + q * ld + k + 32));
        }
    }
    for (int q = 0; q < M; q++) t[q] = _mm512_reduce_add_ps(_mm512_add_ps(a[q][0], a[q][1]));
#endif
    for (int q = 0; q < M; q++) {
        float v = t[q];
        for (int kk = k; kk < n; kk++) v += bf2f(w[kk]) * bf2f(x[q * ld + kk]);
        s[q] = v;
    }
}
static void dot_rows(const uint16_t* w, const uint16_t* x, int64_t ld, int m, int n, float* s) {
    switch (m) {
        case 4: dot_m(w, x, ld, n, s, 4); break;
        case 3: dot_m(w, x, ld, n, s, 3); break;
        case 2: dot_m(w, x, ld, n, s, 2); break;
        default: dot_m(w, x, ld, n, s, 1);
    }
}

/* Prefill: rows grouped by expert (rows starts[e] .. starts[e + 1] - 1 of x [rows, hidden] for
   expert e), out[r] = w[r] * expert_e(x[r]) (fp32 [rows, hidden]). Each weight row is read once
   and dotted with its expert's rows four at a time (their inputs stay in cache), so an expert of
   a few tokens costs about one read of its weights. act: [rows * inter] bf16 scratch. The work
   is items: (expert, gate/up row i) for the activations, then (expert, output column j). */
typedef struct {
    const uint16_t** gate_up; const uint16_t** down; const int* starts; int n;
    const uint16_t* x; const float* w; float* out; int hidden, inter; uint16_t* act;
} rows_t;
static void rows_act(const rows_t* j, long item) {
    int e = (int)(item / j->inter), i = (int)(item % j->inter);
    const uint16_t* grow = j->gate_up[e] + (int64_t)i * j->hidden;
    const uint16_t* urow = j->gate_up[e] + (int64_t)(j->inter + i) * j->hidden;
    float g[4], u[4];
    for (int r = j->starts[e]; r < j->starts[e + 1]; r += 4) {
        int m = j->starts[e + 1] - r < 4 ? j->starts[e + 1] - r : 4;
        const uint16_t* xr = j->x + (int64_t)r * j->hidden;
        dot_rows(grow, xr, j->hidden, m, j->hidden, g);
        dot_rows(urow, xr, j->hidden, m, j->hidden, u);
        for (int q = 0; q < m; q++)
            j->act[(int64_t)(r + q) * j->inter + i] = f2bf(g[q] / (1.f + expf(-g[q])) * u[q]);
    }
}
static void rows_out(const rows_t* j, long item) {
    int e = (int)(item / j->hidden), c = (int)(item % j->hidden);
    const uint16_t* drow = j->down[e] + (int64_t)c * j->inter;
    float s[4];
    for (int r = j->starts[e]; r < j->starts[e + 1]; r += 4) {
        int m = j->starts[e + 1] - r < 4 ? j->starts[e + 1] - r : 4;
        dot_rows(drow, j->act + (int64_t)r * j->inter, j->inter, m, j->inter, s);
        for (int q = 0; q < m; q++) j->out[(int64_t)(r + q) * j->hidden + c] = j->w[r + q] * s[q];
    }
}
#define ROWS_CHUNK 16  /* items taken at a time */
void experts_rows_bf16(const uint16_t** gate_up, const uint16_t** down, const int* starts, int n,
                       const uint16_t* x, const float* w, float* out, int hidden, int inter,
                       uint16_t* act) {
    rows_t j = {gate_up, down, starts, n, x, w, out, hidden, inter, act};
    long acts = (long)n * inter, outs = (long)n * hidden;
    #pragma omp parallel
    {
        #pragma omp for schedule(dynamic, ROWS_CHUNK)
        for (long p = 0; p < acts; p++) rows_act(&j, p);
        #pragma omp for schedule(dynamic, ROWS_CHUNK)
        for (long p = 0; p < outs; p++) rows_out(&j, p);
    }
}

/* The same on a pool of the library's own threads (not OpenMP: a second OpenMP team in the
   process would take libgomp over the core count, and then it cuts every team's spinning
   short): experts_start posts a call and returns, experts_wait waits for it and returns its
   seconds. The caller works meanwhile (the pool is one thread smaller than its cores). Each
   thread computes its share of the (expert, row) activations (gate and up rows together, so no
   scratch and one barrier), then its share of the output rows: the same arithmetic, in the same
   order, as experts_bf16. Waits spin briefly (a host step is shorter than a sleep and wake-up),
   then sleep on a condition variable. One call at a time (experts_start returns -2 otherwise). */
typedef struct {
    const uint16_t** gate_up; const uint16_t** down; const float* weights; int n;
    const uint16_t* x; float* out; int hidden, inter, accumulate; uint16_t* act;
} job_t;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static job_t job;
static int pool_size = 0;
static unsigned generation = 0;  /* atomic: one more per posted call */
static int pending = 0;     /* atomic: pool threads yet to finish the posted call */
static unsigned finished = 0;  /* atomic: the generation of the last call done (`seconds`) */
static int broken = 0;  /* the pool could not be made */
static unsigned bar_count = 0, bar_sense = 0;  /* atomic: the barrier between the phases */
static double started_at = 0.0, seconds = 0.0;

static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int holds(unsigned* addr, unsigned value, int equal) {
    return (__atomic_load_n(addr, __ATOMIC_ACQUIRE) == value) == equal;
}
/* wait until (*addr == value) == equal: spin up to 2 ms, then sleep */
static void await_value(unsigned* addr, unsigned value, int equal) {
    double t0 = now();
    for (int i = 1; !holds(addr, value, equal); i++) {
        _mm_pause();
        if ((i & 1023) == 0 && now() - t0 > 0.002) {
            pthread_mutex_lock(&mu);
            while (!holds(addr, value, equal)) pthread_cond_wait(&cv, &mu);
            pthread_mutex_unlock(&mu);
            return;
        }
    }
}
static void publish(unsigned* addr, unsigned value) {
    __atomic_store_n(addr, value, __ATOMIC_RELEASE);
    pthread_mutex_lock(&mu);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}
static void barrier(unsigned* sense, unsigned size) {
    unsigned mine = !*sense;
    *sense = mine;
    if (__atomic_add_fetch(&bar_count, 1, __ATOMIC_ACQ_REL) == size) {
        __atomic_store_n(&bar_count, 0, __ATOMIC_RELAXED);
        publish(&bar_sense, mine);
    } else {
        await_value(&bar_sense, mine, 1);
    }
}
static void share(long total, int t, int size, long* lo, long* hi) {
    *lo = total * t / size; *hi = total * (t + 1) / size;
}
static void* pool_thread(void* arg) {
    int t = (int)(intptr_t)arg;
    unsigned seen = 0, sense = 0;
    for (;;) {
        await_value(&generation, seen, 0);
        seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        job_t j = job;
        int size = pool_size;
        long lo, hi;
        share((long)j.n * j.inter, t, size, &lo, &hi);
        for (long p = lo; p < hi; p++) {
            int e = (int)(p / j.inter), i = (int)(p % j.inter);
            const uint16_t* gu = j.gate_up[e];
            float g = dot(gu + (int64_t)i * j.hidden, j.x, j.hidden);
            float u = dot(gu + (int64_t)(j.inter + i) * j.hidden, j.x, j.hidden);
            j.act[(int64_t)e * j.inter + i] = f2bf(g / (1.f + expf(-g)) * u);
        }
        barrier(&sense, size);
        share(j.hidden, t, size, &lo, &hi);
        for (long r = lo; r < hi; r++) {
            float s = j.accumulate ? j.out[r] : 0.f;
            for (int e = 0; e < j.n; e++) {
                const uint16_t* row = j.down[e] + (int64_t)r * j.inter;
                s += j.weights[e] * dot(row, j.act + (int64_t)e * j.inter, j.inter);
            }
            j.out[r] = s;
        }
        if (__atomic_sub_fetch(&pending, 1, __ATOMIC_ACQ_REL) == 0) {
            seconds = now() - started_at;
            publish(&finished, seen);
        }
    }
    return NULL;
}
static void forked_child(void) {  /* the pool does not survive a fork */
    pool_size = 0; generation = 0; pending = 0; finished = 0; bar_count = 0; bar_sense = 0;
    broken = 0;
    pthread_mutex_init(&mu, NULL); pthread_cond_init(&cv, NULL);
}
static int start_pool(int threads) {
    static int registered = 0;
    if (!registered) { pthread_atfork(NULL, NULL, forked_child); registered = 1; }
    pool_size = threads > 0 ? threads : 1;
    for (int t = 0; t < pool_size; t++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, pool_thread, (void*)(intptr_t)t) != 0) {
            pool_size = t;  /* the threads made so far wait for a call that never comes */
            return -1;
        }
        pthread_detach(thread);
    }
    return 0;
}
/* post a call to the pool (threads: its size at the first call; later calls keep it) */
static int post(const job_t* j, int threads) {
    if (!holds(&finished, generation, 1)) return -2;
    if (broken || (pool_size == 0 && start_pool(threads) != 0)) { broken = 1; return -1; }
    job = *j;
    started_at = now();
    __atomic_store_n(&pending, pool_size, __ATOMIC_RELAXED);
    publish(&generation, generation + 1);
    return 0;
}
int experts_start(const uint16_t** gate_up, const uint16_t** down, const float* weights, int n,
                  const uint16_t* x, float* out, int hidden, int inter, int accumulate,
                  uint16_t* act, int threads) {
    job_t j = {gate_up, down, weights, n, x, out, hidden, inter, accumulate, act};
    return post(&j, threads);
}
/* whether the build has the AVX512-BF16 dot products (else a plain loop, slower than torch's) */
int experts_fast_path(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
/* returns at once when no call is posted */
double experts_wait(void) {
    await_value(&finished, generation, 1);
    return seconds;
}
"""
FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-shared", "-fPIC"]
_P = ctypes.c_void_p


class NativeExperts:
    """The built kernel, with scratch buffers per expert shape (shared by every caller of the
    process, so calls take turns). `run` computes in an OpenMP region on the calling thread
    (torch's team: prefill, CPU layers, calibration); `start` posts the same call to the
    library's pool of one thread fewer than torch's and returns, so the caller works meanwhile,
    and `finish` waits for it (graph decode's host steps, where `pooled`: 4 or more threads,
    and `AGENTRT_CPU_POOL` not 0)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [_P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._fn = lib.experts_bf16
        self._fn.argtypes, self._fn.restype = [*args, _P, _P], None
        self._start = lib.experts_start
        self._start.argtypes, self._start.restype = [*args, _P, ctypes.c_int], ctypes.c_int
        self._rows = lib.experts_rows_bf16
        self._rows.argtypes = [_P, _P, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int, ctypes.c_int, _P]
        self._rows.restype = None
        self._wait = lib.experts_wait
        self._wait.argtypes, self._wait.restype = [], ctypes.c_double
        lib.experts_fast_path.restype = ctypes.c_int
        self.fast_path = bool(lib.experts_fast_path())  # AVX512-BF16 compiled in
        self._scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._args: tuple | None = None  # what a posted call reads (kept alive until finish)
        threads = min(torch.get_num_threads(), _usable_cores())
        self.pool_threads = max(1, threads - 1)  # (a core for the caller)
        self.pooled = threads >= 4 and os.environ.get("AGENTRT_CPU_POOL") != "0"
        os.register_at_fork(after_in_child=self._forget_calls)

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
        with self._lock:
            h, _ = self._buffers(*down[0].shape, len(gate_up))
            args = self._args_of(gate_up, down, weights, x, out, accumulate)
            self._fn(*args, h.data_ptr())

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
        with self._lock:
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
        self._lock.acquire()
        try:
            args = self._args_of(gate_up, down, weights, x, out, accumulate)
            self._args = (args, gate_up, down, x, out, threading.get_ident())
            code = self._start(*args, self.pool_threads)
        except BaseException:  # (an interrupt may land once the call is posted)
            self._wait()  # (returns at once when nothing was posted)
            self._args = None
            self._lock.release()
            raise
        self._posted(code)

    def _posted(self, code: int) -> None:
        """After a post: raise (releasing the call) where the pool could not take it."""
        if code != 0:
            self._args = None
            self._lock.release()
            self.pooled = False
            print("agentrt: the CPU kernel's threads could not start", file=sys.stderr)
            raise OSError(f"native CPU expert kernel: no thread pool (code {code})")

    @property
    def posted(self) -> bool:
        """Whether this thread has a call posted that `finish` has not waited for."""
        return self._args is not None and self._args[-1] == threading.get_ident()

    def finish(self) -> float:
        """Wait for the posted call; returns its seconds (the pool's own clock)."""
        try:
            return self._wait()
        finally:
            self._args = None
            self._lock.release()

    def _forget_calls(self) -> None:
        """In a forked child: no call of the parent's is running here."""
        self._lock = threading.Lock()
        self._args = None

    def _args_of(self, gate_up, down, weights, x, out, accumulate: bool) -> tuple:
        """The C call's arguments up to the activations' scratch (of this shape)."""
        n = len(gate_up)
        hidden, inter = down[0].shape
        _, act = self._buffers(hidden, inter, n)
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

    def _buffers(self, hidden: int, inter: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, act = self._scratch.get((hidden, inter), (None, None))
        if h is None or act.numel() < n * inter:
            h = torch.empty(2 * inter, dtype=torch.float32)
            act = torch.empty(max(n, 8) * inter, dtype=torch.bfloat16)
            self._scratch[(hidden, inter)] = (h, act)
        return h, act


def _pointers(*groups: list[torch.Tensor]) -> list:
    """Each list of tensors as a C array of their data pointers."""
    return [(_P * len(group))(*[t.data_ptr() for t in group]) for group in groups]


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


def _usable_cores() -> int:
    """The cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def has_bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16 (`vdpbf16ps`, the kernel's fast path)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return "avx512_bf16" in flags.split()


def kernel_for(
    name: str, dtype: torch.dtype = torch.bfloat16, strict: bool = False
) -> NativeExperts | None:
    """The CPU expert kernel `name` ("auto", "torch" or "native") selects for experts of
    `dtype`: the native kernel (built on first use), or None for torch's kernels (also where
    the kernel cannot be built, or for experts that are not bfloat16; with `strict`, an
    explicit "native" raises there instead). auto takes the native kernel only where both the
    CPU and the build have AVX512-BF16."""
    if name not in CPU_KERNELS:
        raise ValueError(f"cpu kernel must be one of {', '.join(CPU_KERNELS)}, got {name!r}")
    if strict and name == "native" and dtype != torch.bfloat16:
        raise AgentrtError("the native CPU expert kernel takes bfloat16 experts")
    if name == "torch" or dtype != torch.bfloat16:
        return None
    if name == "auto" and not has_bf16_dot():
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


def _build(compiler: str, path: Path) -> None:
    """Compile into a temporary file, then move it into place (concurrent builds are safe)."""
    private_dir(path.parent)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source, out = Path(tmp) / "experts_bf16.c", Path(tmp) / path.name
        source.write_text(SOURCE)
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(out), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.chmod(out, FILE_MODE)
        os.replace(out, path)
