/* The inverse-CDF draw of metaloom.sampling.counter, without the running sum's float64 tensor.
 *
 * The draw (counter.inverse_cdf): with p [V] a row's probabilities (float32) and C their running
 * sum accumulated in float64 in index order (C[i] = ((0 + p[0]) + p[1]) + ... + p[i]), the token
 * is the first i with C[i] > u C[V-1], or V - 1 when there is none (an all-zero or NaN row).
 * PyTorch computes it as cumsum(p, dtype=float64) then searchsorted: on a CPU the cumsum first
 * copies p into a float64 tensor and then writes C, two [B, V] float64 tensors (16 rows of
 * Gemma 3's 262,144 tokens: 34 MB each), and that was 20-25 ms of a 16-row decode step.
 *
 * Here the same sums are formed in the same order, so every C[i] has the same bits and the same
 * token comes out, with nothing of size V written:
 *   1. one pass adds a row up in index order, keeping the running sum at the end of every
 *      CHUNK entries (`ends`);
 *   2. the first chunk whose end passes u C[V-1] holds the token: that chunk alone is summed
 *      again from the sum before it, which repeats pass 1's additions exactly.
 * Four rows are summed side by side: one row's additions form a chain of dependent float64
 * adds (their latency, not their count, bounds a single row), and four chains fill the gaps.
 * Rows are shared among the threads; a row's token does not depend on the threads. */

#include <stdint.h>
#include <stdlib.h>

#define ABI_VERSION 1
#define CHUNK 256
#define SIDE 4 /* rows summed side by side */

int metaloom_draw_abi(void) { return ABI_VERSION; }

/* pass 1 for n <= SIDE rows: ends[r][c] = C_r at the last index of chunk c */
static void chunk_ends(const float *p, int64_t v, int n, int64_t chunks, double *ends) {
    double s[SIDE] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t lo = c * CHUNK, hi = lo + CHUNK < v ? lo + CHUNK : v;
        if (n == SIDE) {
            for (int64_t i = lo; i < hi; i++)
                for (int r = 0; r < SIDE; r++) s[r] += (double)p[r * v + i];
        } else {
            for (int64_t i = lo; i < hi; i++)
                for (int r = 0; r < n; r++) s[r] += (double)p[r * v + i];
        }
        for (int r = 0; r < n; r++) ends[r * chunks + c] = s[r];
    }
}

/* pass 2 for one row: the first i with C[i] > target, v - 1 when none */
static int64_t find(const float *p, int64_t v, int64_t chunks, const double *ends, double target) {
    for (int64_t c = 0; c < chunks; c++) {
        if (!(ends[c] > target)) continue;
        double s = c ? ends[c - 1] : 0.0;
        const int64_t lo = c * CHUNK, hi = lo + CHUNK < v ? lo + CHUNK : v;
        for (int64_t i = lo; i < hi; i++) {
            s += (double)p[i];
            if (s > target) return i;
        }
        return hi - 1; /* not reached: the chunk's last sum is ends[c] */
    }
    return v - 1;
}

/* tokens[b] = the draw of row b of p [rows, v] (float32, contiguous) at u[b] (float64 in
 * [0, 1)). Returns 0; -1 when v < 1; -2 when out of memory. */
int inverse_cdf(const float *p, int64_t rows, int64_t v, const double *u, int64_t *tokens, int64_t threads) {
    if (v < 1) return -1;
    const int64_t chunks = (v + CHUNK - 1) / CHUNK, groups = (rows + SIDE - 1) / SIDE;
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        double *ends = malloc((size_t)(SIDE * chunks) * sizeof(double));
        if (!ends) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (!ends) continue;
            const int64_t r0 = g * SIDE;
            const int n = (int)(rows - r0 < SIDE ? rows - r0 : SIDE);
            chunk_ends(p + r0 * v, v, n, chunks, ends);
            for (int r = 0; r < n; r++) {
                const double *e = ends + r * chunks;
                tokens[r0 + r] = find(p + (r0 + r) * v, v, chunks, e, u[r0 + r] * e[chunks - 1]);
            }
        }
        free(ends);
    }
    return failed ? -2 : 0;
}
