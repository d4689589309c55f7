/* The native CPU kernel for packed MXFP4 experts (see cpu_mxfp4.py, which builds and loads it;
   row layout: mxfp4_rows.py). One expert row: gate_up's codes [2I, H/2] and exponents
   [2I, H/32], then down's codes [H, I/2] and exponents [H, I/32]; a code byte holds two E2M1
   values (low nibble first), each block of 32 values shares a power-of-two exponent (bias 127).
   Integer dot products: an input is quantized once per call to int16 per block of 32 (a scale
   of the block's largest magnitude / 32767, so each value within 1/65534 of it), laid out per
   block as its 16 even positions then its 16 odd ones, so each code byte's two values meet
   their inputs without shuffles; the codes decode (by a byte shuffle) to twice their E2M1
   values, small integers, and a block's 32 products sum exactly in int32 before its two scales
   (weights' exponent, input's) apply in fp32. */
#include <stdint.h>
#include <math.h>
#include <immintrin.h>

static float SCALE[256];  /* 2^(e - 128): a block exponent, halved for the doubled codes */

static void tables(void) {
    static int done = 0;
    if (done) return;
    for (int e = 0; e < 256; e++) SCALE[e] = ldexpf(1.f, e - 128);
    done = 1;
}

static const int8_t FP4X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* x [32 * groups] -> q (per block: 16 even positions, then 16 odd ones) and d (the block's
   scale: q * d ~ x); an all-zero block gets scale 0 */
static void quantize(const float* x, int groups, int16_t* q, float* d) {
    for (int g = 0; g < groups; g++) {
        const float* b = x + 32 * g;
        float amax = 0.f;
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(b[k]));
        float scale = amax / 32767.f, inv = scale > 0.f ? 1.f / scale : 0.f;
        d[g] = scale;
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
    if (limit > 0.f) {
        g = fminf(g, limit);
        u = fmaxf(fminf(u, limit), -limit);
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

/* out[hidden] = (accumulate ? out : 0) + sum_e weights[e] * (down_e @ act_e + dn_bias[e]),
   act_e = swiglu(gate_up_e @ x + gu_bias[e]): silu(g) * u, or with limit > 0 gpt-oss's
   (u + 1) * g * sigmoid(alpha * g), g clamped above at limit and u to +-limit. Biases may be
   NULL. scratch: experts_mxfp4_scratch(n, hidden, inter, 0) floats. One parallel region: every
   expert's gate and up rows, their activations and quantization, then the output rows. */
void experts_mxfp4(const uint8_t** rows, const float* weights, int n, const float* x,
                   float* out, int hidden, int inter, const float** gu_bias,
                   const float** dn_bias, float limit, float alpha, int accumulate,
                   float* scratch) {
    tables();
    int hg = hidden / 32, ig = inter / 32;
    float *xd = scratch, *h = xd + hg, *act = h + (long)n * 2 * inter, *ad = act + (long)n * inter;
    int16_t *xq = (int16_t*)(ad + (long)n * ig), *aq = xq + hidden;
    int64_t gu_codes = (int64_t)2 * inter * hidden / 2, gu_bytes = gu_codes + 2 * inter * hg;
    int64_t dn_codes = (int64_t)hidden * inter / 2;
    long gate_rows = (long)n * 2 * inter, acts = (long)n * inter, blocks = (long)n * ig;
    quantize(x, hg, xq, xd);
    #pragma omp parallel
    {
        #pragma omp for schedule(dynamic, 16)
        for (long p = 0; p < gate_rows; p++) {
            int e = (int)(p / (2 * inter)), j = (int)(p % (2 * inter));
            const uint8_t* row = rows[e];
            h[p] = row_dot(row + (int64_t)j * hidden / 2, row + gu_codes + (int64_t)j * hg, xq,
                           xd, hg) + (gu_bias ? gu_bias[e][j] : 0.f);
        }
        #pragma omp for schedule(static)
        for (long p = 0; p < acts; p++) {
            long e = p / inter, i = p % inter;
            act[p] = swiglu(h[e * 2 * inter + i], h[e * 2 * inter + inter + i], limit, alpha);
        }
        #pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) quantize(act + 32 * b, 1, aq + 32 * b, ad + b);
        #pragma omp for schedule(dynamic, 16)
        for (int r = 0; r < hidden; r++) {
            float s = accumulate ? out[r] : 0.f;
            for (int e = 0; e < n; e++) {
                const uint8_t* down = rows[e] + gu_bytes;
                float y = row_dot(down + (int64_t)r * inter / 2, down + dn_codes + (int64_t)r * ig,
                                  aq + (int64_t)e * inter, ad + (int64_t)e * ig, ig);
                s += weights[e] * (y + (dn_bias ? dn_bias[e][r] : 0.f));
            }
            out[r] = s;
        }
    }
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
    int total = starts[n], hg = hidden / 32, ig = inter / 32;
    float *xd = scratch, *act = xd + (int64_t)total * hg, *ad = act + (int64_t)total * inter;
    int16_t *xq = (int16_t*)(ad + (int64_t)total * ig), *aq = xq + (int64_t)total * hidden;
    int64_t gu_codes = (int64_t)inter * hidden, gu_bytes = gu_codes + 2 * inter * hg;
    int64_t dn_codes = (int64_t)hidden * inter / 2;
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
