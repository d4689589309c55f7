/* The native CPU kernel for packed MXFP4 experts (see cpu_mxfp4.py, which builds and loads it;
   row layout: mxfp4_rows.py). One expert row: gate_up's codes [2I, H/2] and exponents
   [2I, H/32], then down's codes [H, I/2] and exponents [H, I/32]; a code byte holds two E2M1
   values (low nibble first), each block of 32 values shares a power-of-two exponent (bias 127).
   Inputs are split into even and odd positions once, so each code byte's two values meet
   their inputs without shuffles; fp32 throughout. */
#include <stdint.h>
#include <math.h>
#include <immintrin.h>

static float POW2[256];  /* 2^(e - 127) */

static void tables(void) {
    static int done = 0;
    if (done) return;
    for (int e = 0; e < 256; e++) POW2[e] = ldexpf(1.f, e - 127);
    done = 1;
}

static const float FP4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                              -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

#if defined(__AVX2__) && defined(__FMA__)
/* 8 codes (low 4 bits of each int32 lane) -> their values: magnitude from an 8-entry table,
   sign from bit 3 */
static inline __m256 fp4x8(__m256i q, __m256 magnitudes) {
    __m256 v = _mm256_permutevar8x32_ps(magnitudes, q);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
}
#endif

/* one row's dot product with an input split into even (xe) and odd (xo) positions */
static float row_dot(const uint8_t* codes, const uint8_t* scales, const float* xe,
                     const float* xo, int groups) {
    float total = 0.f;
    int g = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 magnitudes = _mm256_loadu_ps(FP4);
    const __m256i low = _mm256_set1_epi32(15);
    __m256 acc = _mm256_setzero_ps();
    for (; g < groups; g++) {
        const uint8_t* c = codes + 16 * g;
        __m256 s = _mm256_setzero_ps();
        for (int half = 0; half < 2; half++) {
            __m128i bytes = _mm_loadl_epi64((const __m128i*)(c + 8 * half));
            __m256i q = _mm256_cvtepu8_epi32(bytes);
            __m256 lo = fp4x8(_mm256_and_si256(q, low), magnitudes);
            __m256 hi = fp4x8(_mm256_srli_epi32(q, 4), magnitudes);
            s = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xe + 16 * g + 8 * half), s);
            s = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xo + 16 * g + 8 * half), s);
        }
        acc = _mm256_fmadd_ps(s, _mm256_set1_ps(POW2[scales[g]]), acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_hadd_ps(r, r);
    r = _mm_hadd_ps(r, r);
    total = _mm_cvtss_f32(r);
#endif
    for (; g < groups; g++) {
        const uint8_t* c = codes + 16 * g;
        const float* e = xe + 16 * g;
        const float* o = xo + 16 * g;
        float s = 0.f;
        for (int b = 0; b < 16; b++) s += FP4[c[b] & 15] * e[b] + FP4[c[b] >> 4] * o[b];
        total += s * POW2[scales[g]];
    }
    return total;
}

static void split_pairs(const float* v, int n, float* even, float* odd) {
    for (int k = 0; k < n / 2; k++) { even[k] = v[2 * k]; odd[k] = v[2 * k + 1]; }
}

/* out[hidden] = (accumulate ? out : 0) + sum_e weights[e] * (down_e @ act_e + dn_bias[e]),
   act_e = swiglu(gate_up_e @ x + gu_bias[e]): silu(g) * u, or with limit > 0 gpt-oss's
   (u + 1) * g * sigmoid(alpha * g), g clamped above at limit and u to +-limit. Biases may be
   NULL. scratch: fp32 [hidden + (3 + n) * inter] (the split input, h, act, the split acts). */
void experts_mxfp4(const uint8_t** rows, const float* weights, int n, const float* x,
                   float* out, int hidden, int inter, const float** gu_bias,
                   const float** dn_bias, float limit, float alpha, int accumulate,
                   float* scratch) {
    tables();
    float *xe = scratch, *xo = xe + hidden / 2, *h = xo + hidden / 2;
    float *act = h + 2 * inter, *ae = act + inter;  /* ae: every expert's split act [n][I] */
    int hg = hidden / 32, ig = inter / 32;
    int64_t gu_codes = (int64_t)2 * inter * hidden / 2, gu_bytes = gu_codes + 2 * inter * hg;
    int64_t dn_codes = (int64_t)hidden * inter / 2;
    split_pairs(x, hidden, xe, xo);
    for (int e = 0; e < n; e++) {
        const uint8_t* row = rows[e];
        #pragma omp parallel for schedule(dynamic, 16)
        for (int j = 0; j < 2 * inter; j++)
            h[j] = row_dot(row + (int64_t)j * hidden / 2, row + gu_codes + (int64_t)j * hg, xe,
                           xo, hg) + (gu_bias ? gu_bias[e][j] : 0.f);
        for (int i = 0; i < inter; i++) {
            float g = h[i], u = h[inter + i];
            if (limit > 0.f) {
                g = fminf(g, limit);
                u = fmaxf(fminf(u, limit), -limit);
                act[i] = (u + 1.f) * g / (1.f + expf(-alpha * g));
            } else {
                act[i] = g / (1.f + expf(-g)) * u;
            }
        }
        split_pairs(act, inter, ae + (int64_t)e * inter, ae + (int64_t)e * inter + inter / 2);
    }
    #pragma omp parallel for schedule(dynamic, 16)
    for (int r = 0; r < hidden; r++) {
        float s = accumulate ? out[r] : 0.f;
        for (int e = 0; e < n; e++) {
            const uint8_t* down = rows[e] + gu_bytes;
            const float* a = ae + (int64_t)e * inter;
            float y = row_dot(down + (int64_t)r * inter / 2, down + dn_codes + (int64_t)r * ig, a,
                              a + inter / 2, ig);
            s += weights[e] * (y + (dn_bias ? dn_bias[e][r] : 0.f));
        }
        out[r] = s;
    }
}

/* Prefill: rows grouped by expert (rows starts[e] .. starts[e + 1] - 1 of x [R, hidden], fp32,
   for expert e), out[r] = w[r] * (expert_e(x[r]) + its down bias), fp32 [R, hidden]. Work
   items: (expert, activation i: its gate and up rows), then (expert, output column); an item
   dots its weight rows with each of the expert's rows in turn, so the weights come from DRAM
   once (a row of codes stays in L1). scratch: fp32 [R * (hidden + 2 * inter)] (the split
   inputs, the activations, their split). */
void experts_mxfp4_rows(const uint8_t** rows, const int* starts, int n, const float* x,
                        const float* w, float* out, int hidden, int inter,
                        const float** gu_bias, const float** dn_bias, float limit, float alpha,
                        float* scratch) {
    tables();
    int total = starts[n], hg = hidden / 32, ig = inter / 32;
    float *xs = scratch, *act = xs + (int64_t)total * hidden, *as = act + (int64_t)total * inter;
    int64_t gu_codes = (int64_t)inter * hidden, gu_bytes = gu_codes + 2 * inter * hg;
    int64_t dn_codes = (int64_t)hidden * inter / 2;
    for (int r = 0; r < total; r++)  /* row r split: xs[r*H .. +H/2) even, then odd */
        split_pairs(x + (int64_t)r * hidden, hidden, xs + (int64_t)r * hidden,
                    xs + (int64_t)r * hidden + hidden / 2);
    long acts = (long)n * inter, outs = (long)n * hidden;
    #pragma omp parallel
    {
        #pragma omp for schedule(dynamic, 16)
        for (long p = 0; p < acts; p++) {
            int e = (int)(p / inter), i = (int)(p % inter);
            const uint8_t* row = rows[e];
            const uint8_t *gc = row + (int64_t)i * hidden / 2, *gs = row + gu_codes + (int64_t)i * hg;
            const uint8_t *uc = row + (int64_t)(inter + i) * hidden / 2;
            const uint8_t *us = row + gu_codes + (int64_t)(inter + i) * hg;
            for (int r = starts[e]; r < starts[e + 1]; r++) {
                const float* xe = xs + (int64_t)r * hidden;
                float g = row_dot(gc, gs, xe, xe + hidden / 2, hg);
                float u = row_dot(uc, us, xe, xe + hidden / 2, hg);
                if (gu_bias) { g += gu_bias[e][i]; u += gu_bias[e][inter + i]; }
                float a;
                if (limit > 0.f) {
                    g = fminf(g, limit);
                    u = fmaxf(fminf(u, limit), -limit);
                    a = (u + 1.f) * g / (1.f + expf(-alpha * g));
                } else {
                    a = g / (1.f + expf(-g)) * u;
                }
                act[(int64_t)r * inter + i] = a;
            }
        }
        #pragma omp for schedule(static)
        for (int r = 0; r < total; r++)
            split_pairs(act + (int64_t)r * inter, inter, as + (int64_t)r * inter,
                        as + (int64_t)r * inter + inter / 2);
        #pragma omp for schedule(dynamic, 16)
        for (long p = 0; p < outs; p++) {
            int e = (int)(p / hidden), c = (int)(p % hidden);
            const uint8_t* down = rows[e] + gu_bytes;
            const uint8_t *dc = down + (int64_t)c * inter / 2, *ds = down + dn_codes + (int64_t)c * ig;
            for (int r = starts[e]; r < starts[e + 1]; r++) {
                const float* a = as + (int64_t)r * inter;
                float y = row_dot(dc, ds, a, a + inter / 2, ig);
                out[(int64_t)r * hidden + c] = w[r] * (y + (dn_bias ? dn_bias[e][c] : 0.f));
            }
        }
    }
}
