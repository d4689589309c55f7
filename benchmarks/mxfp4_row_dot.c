/* The packed MXFP4 CPU kernel's inner loop on its own: one quantized input dotted with ROWS
   random rows of gpt-oss-120b's width (2,880 values: 90 blocks of 32, 1,530 bytes of codes
   and exponents a row), the rows split over the OpenMP threads; best of REPS passes. Small
   ROWS keep the rows in a core's caches (the loop's compute rate); large ones stream them from
   memory (with every core: whether the kernel or the host's memory bounds it). Prints JSON:
   nanoseconds per block per thread and GB/s of packed rows. SRC selects the kernel source
   (default: the package's).

       gcc -O3 -march=native -fopenmp benchmarks/mxfp4_row_dot.c -o /tmp/row_dot -lm -lpthread
       OMP_NUM_THREADS=1 /tmp/row_dot 64 200; OMP_NUM_THREADS=16 /tmp/row_dot 400000 5 */
#include "../agentrt/offload/threadpool.c"
#ifndef SRC
#define SRC "../agentrt/offload/experts_mxfp4.c"
#endif
#include SRC
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s ROWS REPS\n", argv[0]);
        return 2;
    }
    tables();
    const int groups = 90;
    long rows = atol(argv[1]);
    int reps = atoi(argv[2]);
    uint8_t* codes = malloc((size_t)rows * 16 * groups);
    uint8_t* scales = malloc((size_t)rows * groups);
    if (!codes || !scales || rows <= 0 || reps <= 0) return 1;
    #pragma omp parallel for  /* (each thread first touches the rows it reads) */
    for (long r = 0; r < rows; r++) {
        unsigned s = (unsigned)r * 2654435761u;
        for (int i = 0; i < 16 * groups; i++) {
            s = s * 1103515245u + 12345u;
            codes[r * 16 * groups + i] = (uint8_t)(s >> 16);
        }
        for (int i = 0; i < groups; i++) scales[r * groups + i] = (uint8_t)(120 + i % 8);
    }
    float x[32 * 90], d[90];
    int16_t q[32 * 90];
    for (int i = 0; i < 32 * groups; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    quantize(x, groups, q, d);
    double best = 1e9;
    float total = 0.f;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = now();
        float s = 0.f;
        #pragma omp parallel for reduction(+ : s) schedule(static)
        for (long r = 0; r < rows; r++)
            s += row_dot(codes + r * 16 * groups, scales + r * groups, q, d, groups);
        total += s;
        double t = now() - t0;
        if (t < best) best = t;
    }
    int threads = omp_get_max_threads();
    printf("{\"rows\": %ld, \"threads\": %d, \"ns_per_block_thread\": %.3f, \"gb_s\": %.1f, "
           "\"checksum\": %g}\n", rows, threads, best / rows / groups * 1e9 * threads,
           (double)rows * 17 * groups / best / 1e9, total);
    free(codes);
    free(scales);
    return 0;
}
