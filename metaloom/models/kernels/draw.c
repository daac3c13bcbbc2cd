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
 * Rows are shared among the threads; a row's token does not depend on the threads.
 *
 * Also `rows_topk`, the k largest entries of each row (Token Recycling's candidates after every
 * verified token): torch.topk sorts its way through all of Qwen2.5's 151,936 logits in about
 * 270 us, a step's 0.7% to 1.2% spent each step. Here one pass compares blocks of TOPK_BLOCK
 * entries with the k-th largest so far (a vectorised test) and looks inside a block only when
 * some entry beats it, which after the first blocks is rare.
 *
 * And `rows_max`, each row's maximum and the first index holding it in one call: what the
 * decode loop needs of every verified position's log-probabilities, which `amax` and the top-1
 * search had read in two calls of their own (each dear right after a forward, whose weights
 * have pushed the caller's code and data out of the caches). */

#include <stdint.h>
#include <stdlib.h>

#define ABI_VERSION 3
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

#define TOPK_BLOCK 64
#define TOPK_MAX 64

/* idx [k]: the k largest entries of x [v] in descending order, equal values in index order; NaN
 * never taken (-1 left only where a row has fewer than k other entries) */
static void row_topk(const float *x, int64_t v, int k, int64_t *idx) {
    float best[TOPK_MAX];
    int n = 0;
    for (int j = 0; j < k; j++) best[j] = -__builtin_inff(), idx[j] = -1;
    for (int64_t lo = 0; lo < v; lo += TOPK_BLOCK) {
        const int64_t hi = lo + TOPK_BLOCK < v ? lo + TOPK_BLOCK : v;
        if (n == k) { /* full: skip a block none of whose entries beats the k-th */
            const float t = best[k - 1];
            int beats = 0;
            for (int64_t i = lo; i < hi; i++) beats |= x[i] > t;
            if (!beats) continue;
        }
        for (int64_t i = lo; i < hi; i++) {
            const float y = x[i];
            if (y != y || (n == k && !(y > best[k - 1]))) continue;
            int j = n < k ? n++ : k - 1; /* the slot it takes, then moved up past smaller entries */
            while (j > 0 && best[j - 1] < y) best[j] = best[j - 1], idx[j] = idx[j - 1], j--;
            best[j] = y, idx[j] = i;
        }
    }
}

/* idx [rows, k] (int64): the k largest of each row of x [rows, v] (float32, contiguous) as
 * `row_topk`. Returns 0; -1 when k is not in [1, min(v, TOPK_MAX)]. */
int rows_topk(const float *x, int64_t rows, int64_t v, int64_t k, int64_t *idx, int64_t threads) {
    if (k < 1 || k > v || k > TOPK_MAX) return -1;
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) row_topk(x + r * v, v, (int)k, idx + r * k);
    return 0;
}

typedef float f8v __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
#define MAX_LANES 8
#define MAX_CHAINS 4 /* independent running maxima: a compare-and-blend chain's latency, not its count */

/* the maximum of x [v] (NaN when it holds one, as torch.amax) and the first index holding the
 * largest entry that is not NaN (0 in an all-NaN row), in one pass: each lane of each chain
 * keeps its largest entry and where it first saw it (a strict > never moves it to a later
 * equal), and the first index of the largest is then the least of those lanes' that hold it */
static void row_max(const float *x, int64_t v, float *value, int64_t *index) {
    const float ninf = -__builtin_inff();
    f8v m[MAX_CHAINS];
    i8v at[MAX_CHAINS], nan = {0};
    const i8v lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int c = 0; c < MAX_CHAINS; c++) m[c] = (f8v){ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf}, at[c] = lane;
    const int64_t step = MAX_LANES * MAX_CHAINS, whole = v / step * step;
    for (int64_t i = 0; i < whole; i += step)
        for (int c = 0; c < MAX_CHAINS; c++) {
            f8v y;
            __builtin_memcpy(&y, x + i + c * MAX_LANES, sizeof y);
            nan |= y != y;
            const i8v gt = y > m[c], here = lane + (int32_t)(i + c * MAX_LANES);
            m[c] = (f8v)(((i8v)y & gt) | ((i8v)m[c] & ~gt));
            at[c] = (here & gt) | (at[c] & ~gt);
        }
    float best = ninf;
    int64_t first = 0;
    int found_nan = 0;
    for (int c = 0; c < MAX_CHAINS; c++)
        for (int l = 0; l < MAX_LANES; l++) {
            found_nan |= nan[l] != 0;
            if (m[c][l] > best || (m[c][l] == best && at[c][l] < first)) best = m[c][l], first = at[c][l];
        }
    if (!(best > ninf)) first = 0; /* nothing above -inf in the vectors: the first -inf (or NaN) entry */
    for (int64_t i = whole; i < v; i++) { /* the tail, after every vector's entries */
        found_nan |= x[i] != x[i];
        if (x[i] > best) best = x[i], first = i;
    }
    if (!(best > ninf)) /* an all -inf (or NaN) row: the first -inf entry, or 0 */
        for (int64_t i = 0; i < v; i++)
            if (x[i] == ninf) {
                first = i;
                break;
            }
    *value = found_nan ? __builtin_nanf("") : best;
    *index = first;
}

/* values [rows] (float32), index [rows] (int64): `row_max` of each row of x [rows, v] (float32,
 * contiguous). Returns 0; -1 when v < 1. */
int rows_max(const float *x, int64_t rows, int64_t v, float *values, int64_t *index, int64_t threads) {
    if (v < 1) return -1;
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) row_max(x + r * v, v, values + r, index + r);
    return 0;
}
