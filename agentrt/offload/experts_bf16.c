/* The native CPU expert kernel for bf16 experts (see cpu_kernel.py, which builds and loads it
   with threadpool.c in front). */
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <immintrin.h>

static inline float bf2f(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f2bf(float f) {  /* round to nearest even; a NaN stays a (quiet) NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFF + ((u >> 16) & 1); return (uint16_t)(u >> 16);
}

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#define AVX2_DOT 1
/* acc += the products of 16 bf16 weights and inputs (8 lanes; each 32-bit lane holds two
   bf16 values: the low one becomes fp32 by a shift, the high one by a mask, no shuffles) */
static inline __m256 fma16(const uint16_t* w, const uint16_t* x, __m256 acc) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i wv = _mm256_loadu_si256((const __m256i*)w), xv = _mm256_loadu_si256((const __m256i*)x);
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)),
                          _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(wv, high)),
                           _mm256_castsi256_ps(_mm256_and_si256(xv, high)), acc);
}
static inline float sum8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_hadd_ps(r, r);
    return _mm_cvtss_f32(_mm_hadd_ps(r, r));
}
#endif

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
#elif defined(AVX2_DOT)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; k + 32 <= n; k += 32) {
        acc0 = fma16(w + k, x + k, acc0);
        acc1 = fma16(w + k + 16, x + k + 16, acc1);
    }
    s = sum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; k < n; k++) s += bf2f(w[k]) * bf2f(x[k]);
    return s;
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
#elif defined(AVX2_DOT)
    __m256 a[4][2];
    for (int q = 0; q < M; q++) { a[q][0] = _mm256_setzero_ps(); a[q][1] = _mm256_setzero_ps(); }
    for (; k + 32 <= n; k += 32)
        for (int q = 0; q < M; q++) {
            a[q][0] = fma16(w + k, x + q * ld + k, a[q][0]);
            a[q][1] = fma16(w + k + 16, x + q * ld + k + 16, a[q][1]);
        }
    for (int q = 0; q < M; q++) t[q] = sum8(_mm256_add_ps(a[q][0], a[q][1]));
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

/* A decode call: out[hidden] = (accumulate ? out : 0) + sum_e weights[e] * down_e @ act_e,
   act_e = bf16(silu(g) * u), [g; u] = gate_up_e @ x (act: [n * inter] bf16 scratch). Its items
   in two phases: the (row, expert) activations (gate and up rows together, so no scratch; row
   major, so a pool thread's share is about the same rows of every expert, whatever their
   number: those `experts_warm` read for it), then the output rows; the OpenMP path
   (experts_bf16) and the pool of threadpool.c (built in front of this file: experts_start
   posts a call and returns, agentrt_pool_wait waits for it and returns its seconds) compute
   the same items alike, whichever thread takes one. */
typedef struct {
    const uint16_t** gate_up; const uint16_t** down; const float* weights; int n;
    const uint16_t* x; float* out; int hidden, inter, accumulate; uint16_t* act;
} job_t;
static job_t job;
static void job_items(const void* arg, int phase, long lo, long hi) {
    const job_t* j = (const job_t*)arg;
    if (phase == 0) {
        for (long p = lo; p < hi; p++) {
            int e = (int)(p % j->n), i = (int)(p / j->n);
            const uint16_t* gu = j->gate_up[e];
            float g = dot(gu + (int64_t)i * j->hidden, j->x, j->hidden);
            float u = dot(gu + (int64_t)(j->inter + i) * j->hidden, j->x, j->hidden);
            j->act[(int64_t)e * j->inter + i] = f2bf(g / (1.f + expf(-g)) * u);
        }
        return;
    }
    for (long r = lo; r < hi; r++) {
        float s = j->accumulate ? j->out[r] : 0.f;
        for (int e = 0; e < j->n; e++) {
            const uint16_t* row = j->down[e] + (int64_t)r * j->inter;
            s += j->weights[e] * dot(row, j->act + (int64_t)e * j->inter, j->inter);
        }
        j->out[r] = s;
    }
}
/* the decode call on the calling thread's OpenMP team */
void experts_bf16(const uint16_t** gate_up, const uint16_t** down, const float* weights, int n,
                  const uint16_t* x, float* out, int hidden, int inter, int accumulate,
                  uint16_t* act) {
    job_t j = {gate_up, down, weights, n, x, out, hidden, inter, accumulate, act};
    long items[2] = {(long)n * inter, hidden};
    #pragma omp parallel
    for (int phase = 0; phase < 2; phase++) {
        #pragma omp for schedule(dynamic, 16)
        for (long p = 0; p < items[phase]; p++) job_items(&j, phase, p, p + 1);
    }
}
/* threads: the pool's size, at its first call (later calls keep it); active: the threads
   that take part in this call */
int experts_start(const uint16_t** gate_up, const uint16_t** down, const float* weights, int n,
                  const uint16_t* x, float* out, int hidden, int inter, int accumulate,
                  uint16_t* act, int threads, int active) {
    if (!pool_idle()) return -2;
    job_t j = {gate_up, down, weights, n, x, out, hidden, inter, accumulate, act};
    job = j;
    pool_task task = {job_items, &job, 2, {(long)n * inter, hidden}};
    return pool_start(task, threads, active);
}
/* A warm-up of n experts a later decode call will likely compute: each pool thread reads the
   rows of its share of that call's items (gate/up rows of its activations, then down rows of
   its outputs; the same items whatever the number of experts, up to a row at the ends) into
   its core's caches, one load per cache line. */
typedef struct { const uint16_t** gate_up; const uint16_t** down; int n, hidden, inter; } warm_t;
static warm_t warm_job;
static uint64_t warm_sink;  /* (the loads' sum, so the compiler keeps them) */
static uint64_t touch(const uint16_t* row, long count) {
    const volatile uint8_t* bytes = (const volatile uint8_t*)row;
    uint64_t s = 0;
    for (long off = 0; off < count * 2; off += 64) s += bytes[off];
    return s;
}
static void warm_items(const void* arg, int phase, long lo, long hi) {
    const warm_t* j = (const warm_t*)arg;
    uint64_t s = 0;
    for (long p = lo; p < hi; p++) {
        if (phase == 0) {
            int e = (int)(p % j->n), i = (int)(p / j->n);
            s += touch(j->gate_up[e] + (int64_t)i * j->hidden, j->hidden);
            s += touch(j->gate_up[e] + (int64_t)(j->inter + i) * j->hidden, j->hidden);
        } else {
            for (int e = 0; e < j->n; e++) s += touch(j->down[e] + p * j->inter, j->inter);
        }
    }
    __atomic_fetch_add(&warm_sink, s, __ATOMIC_RELAXED);
}
/* post the warm-up (the arrays must stay valid until agentrt_pool_wait); as experts_start */
int experts_warm(const uint16_t** gate_up, const uint16_t** down, int n, int hidden, int inter,
                 int threads, int active) {
    if (!pool_idle()) return -2;
    warm_t j = {gate_up, down, n, hidden, inter};
    warm_job = j;
    pool_task task = {warm_items, &warm_job, 2, {(long)n * inter, hidden}};
    return pool_start(task, threads, active);
}
/* whether the build has vector dot products (AVX512-BF16, or AVX2 with FMA), else a plain
   loop, slower than torch's */
int experts_fast_path(void) {
#if defined(__AVX512BF16__) || defined(AVX2_DOT)
    return 1;
#else
    return 0;
#endif
}
