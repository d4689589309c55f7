/* The native CPU kernel for packed MXFP4 experts (see cpu_mxfp4.py, which builds and loads it
   with threadpool.c in front; row layout: mxfp4_rows.py). One expert row: gate_up's codes [2I, H/2] and exponents
   [2I, H/32], then down's codes [H, I/2] and exponents [H, I/32]; a code byte holds two E2M1
   values (low nibble first), each block of 32 values shares a power-of-two exponent (bias 127).
   Integer dot products: an input is quantized once per call to int16 per block of 32 (a scale
   of the block's largest magnitude / 32767, so each value within 1/65534 of it), laid out per
   block as its 16 even positions then its 16 odd ones, so each code byte's two values meet
   their inputs without shuffles; the codes decode (by a byte shuffle) to twice their E2M1
   values, small integers, whose products with the inputs sum exactly in int32 (four to a
   lane) before the block's two scales (weights' exponent, input's) apply in fp32. */
#include <stdint.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <immintrin.h>

static float SCALE[256];  /* 2^(e - 128): a block exponent, halved for the doubled codes */

static void fill_tables(void) {
    for (int e = 0; e < 255; e++) SCALE[e] = ldexpf(1.f, e - 128);
    SCALE[255] = NAN;  /* (the format's NaN exponent) */
}
static void tables(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, fill_tables);
}

static const int8_t FP4X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* x [32 * groups] -> q (per block: 16 even positions, then 16 odd ones) and d (the block's
   scale: q * d ~ x); a block whose scale would be subnormal (all its values below ~3.9e-34)
   counts as zero (scale 0), a block with a NaN or an infinity gets scale NaN (q 0), so the
   outputs it reaches are NaN as in fp32 math */
static const float ZERO32[32];
static void quantize(const float* x, int groups, int16_t* q, float* d) {
    for (int g = 0; g < groups; g++) {
        const float* b = x + 32 * g;
        float amax = 0.f;
        int finite = 1;
        for (int k = 0; k < 32; k++) {
            amax = fmaxf(amax, fabsf(b[k]));
            finite &= isfinite(b[k]) != 0;
        }
        float scale = amax / 32767.f;
        if (scale < FLT_MIN) scale = 0.f;  /* (1 / scale would overflow) */
        float inv = scale > 0.f ? 1.f / scale : 0.f;
        d[g] = finite ? scale : NAN;
        if (!finite) inv = 0.f, b = ZERO32;  /* (a NaN must not reach the integer conversion) */
        for (int k = 0; k < 16; k++) {
            q[32 * g + k] = (int16_t)rintf(b[2 * k] * inv);
            q[32 * g + 16 + k] = (int16_t)rintf(b[2 * k + 1] * inv);
        }
    }
}

/* one row's dot product with a quantized input (q, d) */
static float row_dot(const uint8_t* codes, const uint8_t* scales, const int16_t* q,
                     const float* d, int groups) {
    float total = 0.f;
    int g = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i table = _mm_loadu_si128((const __m128i*)FP4X2);
    const __m128i low = _mm_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (; g < groups; g++) {
        __m128i c = _mm_loadu_si128((const __m128i*)(codes + 16 * g));
        __m128i even = _mm_shuffle_epi8(table, _mm_and_si128(c, low));
        __m128i odd = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(c, 4), low));
        __m256i pe = _mm256_madd_epi16(_mm256_cvtepi8_epi16(even),
                                       _mm256_loadu_si256((const __m256i*)(q + 32 * g)));
        __m256i po = _mm256_madd_epi16(_mm256_cvtepi8_epi16(odd),
                                       _mm256_loadu_si256((const __m256i*)(q + 32 * g + 16)));
        __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(pe, po));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(SCALE[scales[g]] * d[g]), sum, acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_hadd_ps(r, r);
    r = _mm_hadd_ps(r, r);
    total = _mm_cvtss_f32(r);
#endif
    for (; g < groups; g++) {
        const uint8_t* c = codes + 16 * g;
        int32_t s = 0;
        for (int b = 0; b < 16; b++)
            s += FP4X2[c[b] & 15] * q[32 * g + b] + FP4X2[c[b] >> 4] * q[32 * g + 16 + b];
        total += (float)s * (SCALE[scales[g]] * d[g]);
    }
    return total;
}

/* s[k] = row_dot(codes, scales, q + k * ld, d + k * ldd, groups) for k < M: each block's
   codes decoded once for M inputs (prefill's rows of one expert) */
static inline __attribute__((always_inline)) void dot_m(const uint8_t* codes,
        const uint8_t* scales, const int16_t* q, int64_t ld, const float* d, int64_t ldd,
        int groups, float* s, const int M) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i table = _mm_loadu_si128((const __m128i*)FP4X2);
    const __m128i low = _mm_set1_epi8(15);
    __m256 acc[4];
    for (int k = 0; k < M; k++) acc[k] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m128i c = _mm_loadu_si128((const __m128i*)(codes + 16 * g));
        __m256i even = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(c, low)));
        __m256i odd = _mm256_cvtepi8_epi16(
            _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(c, 4), low)));
        float w = SCALE[scales[g]];
        for (int k = 0; k < M; k++) {
            const int16_t* x = q + k * ld + 32 * g;
            __m256i pe = _mm256_madd_epi16(even, _mm256_loadu_si256((const __m256i*)x));
            __m256i po = _mm256_madd_epi16(odd, _mm256_loadu_si256((const __m256i*)(x + 16)));
            __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(pe, po));
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(w * d[k * ldd + g]), sum, acc[k]);
        }
    }
    for (int k = 0; k < M; k++) {
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[k]), _mm256_extractf128_ps(acc[k], 1));
        r = _mm_hadd_ps(r, r);
        r = _mm_hadd_ps(r, r);
        s[k] = _mm_cvtss_f32(r);
    }
#else
    for (int k = 0; k < M; k++) s[k] = row_dot(codes, scales, q + k * ld, d + k * ldd, groups);
#endif
}
static void dot_rows(const uint8_t* codes, const uint8_t* scales, const int16_t* q, int64_t ld,
                     const float* d, int64_t ldd, int groups, int m, float* s) {
    switch (m) {
        case 4: dot_m(codes, scales, q, ld, d, ldd, groups, s, 4); break;
        case 3: dot_m(codes, scales, q, ld, d, ldd, groups, s, 3); break;
        case 2: dot_m(codes, scales, q, ld, d, ldd, groups, s, 2); break;
        default: dot_m(codes, scales, q, ld, d, ldd, groups, s, 1);
    }
}

static float swiglu(float g, float u, float limit, float alpha) {
    if (limit > 0.f) {  /* (comparisons, not fminf / fmaxf: a NaN stays NaN, as in torch) */
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
        return (u + 1.f) * g / (1.f + expf(-alpha * g));
    }
    return g / (1.f + expf(-g)) * u;
}

/* fp32 scratch (floats) a call needs: decode (rows 0) or prefill's rows call of `rows` rows */
long experts_mxfp4_scratch(int n, int hidden, int inter, int rows) {
    long h = hidden, i = inter;
    if (rows == 0) return h / 2 + h / 32 + (long)n * (3 * i + i / 2 + i / 32);
    return (long)rows * (h / 2 + h / 32 + i + i / 2 + i / 32);
}

/* where the parts of an expert row start (bytes): gate/up's exponents (after its 2I rows of
   H/2 code bytes), down's codes, down's exponents (after its H rows of I/2 code bytes) */
typedef struct { int64_t gu_codes, gu_bytes, dn_codes; int hg, ig; } row_offsets;
static row_offsets offsets_of(int hidden, int inter) {
    row_offsets o = {(int64_t)inter * hidden, 0, (int64_t)hidden * inter / 2, hidden / 32,
                     inter / 32};
    o.gu_bytes = o.gu_codes + (int64_t)2 * inter * o.hg;
    return o;
}

/* A decode call: out[hidden] = (accumulate ? out : 0) + sum_e weights[e] * (down_e @ act_e +
   dn_bias[e]), act_e = swiglu(gate_up_e @ x + gu_bias[e]): silu(g) * u, or with limit > 0
   gpt-oss's (u + 1) * g * sigmoid(alpha * g), g clamped above at limit and u to +-limit.
   Biases may be NULL. Its items in three phases: every expert's gate and up rows (row major,
   so a pool thread's share is about the same rows of every expert, whatever their number:
   those experts_mxfp4_warm reads for it), then blocks of 32 activations (computed and
   quantized), then the output rows; the OpenMP path (experts_mxfp4) and the pool
   (experts_mxfp4_start) compute the same items alike. */
typedef struct {
    const uint8_t** rows; const float* weights; int n; float* out; int hidden, inter;
    const float** gu_bias; const float** dn_bias; float limit, alpha; int accumulate;
    float *xd, *h, *act, *ad; int16_t *xq, *aq;
} decode_t;
static decode_t posted;

/* lay out scratch (experts_mxfp4_scratch(n, hidden, inter, 0) floats) and quantize x */
static decode_t decode_job(const uint8_t** rows, const float* weights, int n, const float* x,
                           float* out, int hidden, int inter, const float** gu_bias,
                           const float** dn_bias, float limit, float alpha, int accumulate,
                           float* scratch) {
    tables();
    decode_t j = {rows, weights, n, out, hidden, inter, gu_bias, dn_bias, limit, alpha,
                  accumulate};
    j.xd = scratch;
    j.h = j.xd + hidden / 32;
    j.act = j.h + (long)n * 2 * inter;
    j.ad = j.act + (long)n * inter;
    j.xq = (int16_t*)(j.ad + (long)n * (inter / 32));
    j.aq = j.xq + hidden;
    quantize(x, hidden / 32, j.xq, j.xd);
    return j;
}
static void decode_items(const void* arg, int phase, long lo, long hi) {
    const decode_t* j = (const decode_t*)arg;
    int hidden = j->hidden, inter = j->inter;
    row_offsets o = offsets_of(hidden, inter);
    int hg = o.hg, ig = o.ig;
    int64_t gu_codes = o.gu_codes, gu_bytes = o.gu_bytes, dn_codes = o.dn_codes;
    for (long p = lo; p < hi; p++) {
        if (phase == 0) {  /* item: (gate/up row, expert) */
            int e = (int)(p % j->n), r = (int)(p / j->n);
            const uint8_t* row = j->rows[e];
            j->h[(int64_t)e * 2 * inter + r] =
                row_dot(row + (int64_t)r * hidden / 2, row + gu_codes + (int64_t)r * hg, j->xq,
                        j->xd, hg) + (j->gu_bias ? j->gu_bias[e][r] : 0.f);
        } else if (phase == 1) {  /* item: (expert, block of 32 activations) */
            long e = p / ig, i0 = (p % ig) * 32;
            const float* h = j->h + e * 2 * inter;
            float* a = j->act + e * inter + i0;
            for (int k = 0; k < 32; k++)
                a[k] = swiglu(h[i0 + k], h[inter + i0 + k], j->limit, j->alpha);
            quantize(a, 1, j->aq + e * inter + i0, j->ad + p);
        } else {  /* item: output row */
            float s = j->accumulate ? j->out[p] : 0.f;
            for (int e = 0; e < j->n; e++) {
                const uint8_t* down = j->rows[e] + gu_bytes;
                float y = row_dot(down + (int64_t)p * inter / 2, down + dn_codes + (int64_t)p * ig,
                                  j->aq + (int64_t)e * inter, j->ad + (int64_t)e * ig, ig);
                s += j->weights[e] * (y + (j->dn_bias ? j->dn_bias[e][p] : 0.f));
            }
            j->out[p] = s;
        }
    }
}
static void decode_counts(const decode_t* j, long* items) {
    items[0] = (long)j->n * 2 * j->inter;
    items[1] = (long)j->n * (j->inter / 32);
    items[2] = j->hidden;
}

/* the decode call on the calling thread's OpenMP team */
void experts_mxfp4(const uint8_t** rows, const float* weights, int n, const float* x,
                   float* out, int hidden, int inter, const float** gu_bias,
                   const float** dn_bias, float limit, float alpha, int accumulate,
                   float* scratch) {
    decode_t j = decode_job(rows, weights, n, x, out, hidden, inter, gu_bias, dn_bias, limit,
                            alpha, accumulate, scratch);
    long items[3];
    decode_counts(&j, items);
    #pragma omp parallel
    for (int phase = 0; phase < 3; phase++) {
        #pragma omp for schedule(dynamic, 16)
        for (long p = 0; p < items[phase]; p++) decode_items(&j, phase, p, p + 1);
    }
}

/* the same call posted to the pool of threadpool.c (built in front of this file); the arrays
   and buffers must stay unchanged until agentrt_pool_wait. threads: the pool's size, at its
   first call; active: the threads that take part in this one. Returns 0, or -2 while a call
   runs, -1 where the pool cannot be made. */
int experts_mxfp4_start(const uint8_t** rows, const float* weights, int n, const float* x,
                        float* out, int hidden, int inter, const float** gu_bias,
                        const float** dn_bias, float limit, float alpha, int accumulate,
                        float* scratch, int threads, int active) {
    if (!pool_idle()) return -2;
    posted = decode_job(rows, weights, n, x, out, hidden, inter, gu_bias, dn_bias, limit, alpha,
                        accumulate, scratch);
    pool_task task = {decode_items, &posted, 3, {0}};
    decode_counts(&posted, task.items);
    return pool_start(task, threads, active);
}

/* A warm-up of n experts a later decode call will likely compute: each pool thread reads the
   bytes of its share of that call's items (codes and exponents of its gate/up rows, then of its
   output rows' down rows: phases 0 and 2 of the call, whose shares these two phases match;
   the same items whatever the number of experts, up to a row at the ends) into its core's
   caches, one load per cache line. */
typedef struct { const uint8_t** rows; int n, hidden, inter; } warm_t;
static warm_t warm_job;
static uint64_t warm_sink;  /* (the loads' sum, so the compiler keeps them) */
static uint64_t touch(const uint8_t* bytes, long count) {
    const volatile uint8_t* b = (const volatile uint8_t*)bytes;
    uint64_t s = 0;
    for (long off = 0; off < count; off += 64) s += b[off];
    return s;
}
static void warm_items(const void* arg, int phase, long lo, long hi) {
    const warm_t* j = (const warm_t*)arg;
    row_offsets o = offsets_of(j->hidden, j->inter);
    uint64_t s = 0;
    for (long p = lo; p < hi; p++) {
        if (phase == 0) {  /* (gate/up row r of expert e: its codes, its exponents) */
            const uint8_t* row = j->rows[p % j->n];
            long r = p / j->n;
            s += touch(row + r * j->hidden / 2, j->hidden / 2);
            s += touch(row + o.gu_codes + r * o.hg, o.hg);
        } else {  /* (down row p of every expert) */
            for (int e = 0; e < j->n; e++) {
                const uint8_t* down = j->rows[e] + o.gu_bytes;
                s += touch(down + p * j->inter / 2, j->inter / 2);
                s += touch(down + o.dn_codes + p * o.ig, o.ig);
            }
        }
    }
    __atomic_fetch_add(&warm_sink, s, __ATOMIC_RELAXED);
}
/* post the warm-up (the array must stay valid until agentrt_pool_wait); as experts_mxfp4_start */
int experts_mxfp4_warm(const uint8_t** rows, int n, int hidden, int inter, int threads,
                       int active) {
    if (!pool_idle()) return -2;
    warm_t j = {rows, n, hidden, inter};
    warm_job = j;
    pool_task task = {warm_items, &warm_job, 2, {(long)n * 2 * inter, hidden}};
    return pool_start(task, threads, active);
}

/* Prefill: rows grouped by expert (rows starts[e] .. starts[e + 1] - 1 of x [R, hidden], fp32,
   for expert e), out[r] = w[r] * (expert_e(x[r]) + its down bias), fp32 [R, hidden]. Work
   items: (expert, activation i: its gate and up rows), then (expert, output column); an item
   dots its weight rows with the expert's rows four at a time (each block's codes decoded once
   for the four), so the weights come from DRAM once (a row of codes stays in L1). scratch: experts_mxfp4_scratch(n, hidden, inter, R)
   floats (the quantized inputs, the activations, theirs). */
void experts_mxfp4_rows(const uint8_t** rows, const int* starts, int n, const float* x,
                        const float* w, float* out, int hidden, int inter,
                        const float** gu_bias, const float** dn_bias, float limit, float alpha,
                        float* scratch) {
    tables();
    row_offsets o = offsets_of(hidden, inter);
    int total = starts[n], hg = o.hg, ig = o.ig;
    float *xd = scratch, *act = xd + (int64_t)total * hg, *ad = act + (int64_t)total * inter;
    int16_t *xq = (int16_t*)(ad + (int64_t)total * ig), *aq = xq + (int64_t)total * hidden;
    int64_t gu_codes = o.gu_codes, gu_bytes = o.gu_bytes, dn_codes = o.dn_codes;
    long acts = (long)n * inter, outs = (long)n * hidden;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < total; r++)
            quantize(x + (int64_t)r * hidden, hg, xq + (int64_t)r * hidden, xd + (int64_t)r * hg);
        #pragma omp for schedule(dynamic, 16)
        for (long p = 0; p < acts; p++) {
            int e = (int)(p / inter), i = (int)(p % inter);
            const uint8_t* row = rows[e];
            const uint8_t *gc = row + (int64_t)i * hidden / 2, *gs = row + gu_codes + (int64_t)i * hg;
            const uint8_t *uc = row + (int64_t)(inter + i) * hidden / 2;
            const uint8_t *us = row + gu_codes + (int64_t)(inter + i) * hg;
            float g[4], u[4];
            for (int r = starts[e]; r < starts[e + 1]; r += 4) {
                int m = starts[e + 1] - r < 4 ? starts[e + 1] - r : 4;
                const int16_t* q = xq + (int64_t)r * hidden;
                const float* d = xd + (int64_t)r * hg;
                dot_rows(gc, gs, q, hidden, d, hg, hg, m, g);
                dot_rows(uc, us, q, hidden, d, hg, hg, m, u);
                for (int k = 0; k < m; k++) {
                    float gk = g[k] + (gu_bias ? gu_bias[e][i] : 0.f);
                    float uk = u[k] + (gu_bias ? gu_bias[e][inter + i] : 0.f);
                    act[(int64_t)(r + k) * inter + i] = swiglu(gk, uk, limit, alpha);
                }
            }
        }
        #pragma omp for schedule(static)
        for (int r = 0; r < total; r++)
            quantize(act + (int64_t)r * inter, ig, aq + (int64_t)r * inter, ad + (int64_t)r * ig);
        #pragma omp for schedule(dynamic, 16)
        for (long p = 0; p < outs; p++) {
            int e = (int)(p / hidden), c = (int)(p % hidden);
            const uint8_t* down = rows[e] + gu_bytes;
            const uint8_t *dc = down + (int64_t)c * inter / 2, *ds = down + dn_codes + (int64_t)c * ig;
            float y[4];
            for (int r = starts[e]; r < starts[e + 1]; r += 4) {
                int m = starts[e + 1] - r < 4 ? starts[e + 1] - r : 4;
                dot_rows(dc, ds, aq + (int64_t)r * inter, inter, ad + (int64_t)r * ig, ig, ig, m, y);
                for (int k = 0; k < m; k++)
                    out[(int64_t)(r + k) * hidden + c] =
                        w[r + k] * (y[k] + (dn_bias ? dn_bias[e][c] : 0.f));
            }
        }
    }
}
