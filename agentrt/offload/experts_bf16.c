/* The native CPU expert kernel (see cpu_kernel.py, which builds and loads it). */
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
            #pragma omp for schedule(dynamic, 16)
            for (int j = 0; j < 2 * inter; j++) h[j] = dot(gu + (int64_t)j * hidden, x, hidden);
            #pragma omp for schedule(static)
            for (int i = 0; i < inter; i++) {
                float g = h[i], u = h[inter + i];
                act[(int64_t)e * inter + i] = f2bf(g / (1.f + expf(-g)) * u);
            }
        }
        #pragma omp for schedule(dynamic, 16)
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
   thread claims chunks of the (expert, row) activations (gate and up rows together, so no
   scratch and one barrier) from a shared counter, then chunks of the output rows: the same
   arithmetic, in the same order, as experts_bf16, whichever thread computes an item. Claiming
   (not fixed shares) keeps a thread that the OS preempts (the state-cache writer, other
   processes) from holding up the barrier for the rest of its share. Waits spin briefly (a host step is shorter than a sleep and wake-up),
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
static long claimed[2];  /* atomic: items of each phase handed out so far */
static int claim_chunk = 16;  /* items per claim; 0: fixed equal shares (the older split) */
/* the next range [lo, hi) of a phase's `total` items for thread t, or 0 when none is left */
static int claim(int phase, long total, int t, int size, int* turn, long* lo, long* hi) {
    if (claim_chunk <= 0) {
        if ((*turn)++) return 0;
        *lo = total * t / size; *hi = total * (t + 1) / size;
        return 1;
    }
    *lo = __atomic_fetch_add(&claimed[phase], claim_chunk, __ATOMIC_RELAXED);
    *hi = *lo + claim_chunk < total ? *lo + claim_chunk : total;
    return *lo < total;
}
/* items per claim of the pool's later calls (0: fixed shares; benchmarks compare the two) */
void experts_schedule(int chunk) { claim_chunk = chunk; }
static void* pool_thread(void* arg) {
    int t = (int)(intptr_t)arg;
    unsigned seen = 0, sense = 0;
    for (;;) {
        await_value(&generation, seen, 0);
        seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        job_t j = job;
        int size = pool_size;
        long lo, hi;
        int turn = 0;
        while (claim(0, (long)j.n * j.inter, t, size, &turn, &lo, &hi))
            for (long p = lo; p < hi; p++) {
                int e = (int)(p / j.inter), i = (int)(p % j.inter);
                const uint16_t* gu = j.gate_up[e];
                float g = dot(gu + (int64_t)i * j.hidden, j.x, j.hidden);
                float u = dot(gu + (int64_t)(j.inter + i) * j.hidden, j.x, j.hidden);
                j.act[(int64_t)e * j.inter + i] = f2bf(g / (1.f + expf(-g)) * u);
            }
        barrier(&sense, size);
        turn = 0;
        while (claim(1, j.hidden, t, size, &turn, &lo, &hi))
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
/* threads: the pool's size, at its first call (later calls keep it) */
int experts_start(const uint16_t** gate_up, const uint16_t** down, const float* weights, int n,
                  const uint16_t* x, float* out, int hidden, int inter, int accumulate,
                  uint16_t* act, int threads) {
    if (!holds(&finished, generation, 1)) return -2;
    if (broken || (pool_size == 0 && start_pool(threads) != 0)) { broken = 1; return -1; }
    job_t j = {gate_up, down, weights, n, x, out, hidden, inter, accumulate, act};
    job = j;
    started_at = now();
    __atomic_store_n(&claimed[0], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&claimed[1], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pending, pool_size, __ATOMIC_RELAXED);
    publish(&generation, generation + 1);
    return 0;
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
