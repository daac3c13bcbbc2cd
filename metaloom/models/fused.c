/* Fused float32 CPU kernels for the glue of a one-token decode step (metaloom/models/fused.py).
 *
 * A batch-1 decode step of a small model reads its weights in ~30 matmuls' worth of time, and
 * spends another third of the step in ~20 small PyTorch ops per layer (norms, RoPE, cache
 * writes, attention over one query, SwiGLU, residual adds), each a few microseconds of
 * dispatch for a few hundred floats of work. These three kernels do that glue in three calls
 * per layer. The matmuls stay PyTorch's (MKL / oneDNN).
 *
 * The arithmetic is the one transformers does (fp-contract off, so RoPE and the norm round
 * like PyTorch's separate ops); only summation orders differ. Vectors are GCC/Clang vector
 * extensions, so this compiles on any target those compilers know. Sizes must be multiples of
 * 16 floats (head_dim of 32, for RoPE's halves); fused.py checks before calling.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ABI_VERSION 1
#define MAX_VECTORS 16 /* head_dim up to 256 */

/* 16 floats per vector: one AVX-512 register, two AVX2 or four NEON ones */
#define W 16
typedef float vec __attribute__((vector_size(4 * W)));
typedef int32_t veci __attribute__((vector_size(4 * W)));
typedef float half_vec __attribute__((vector_size(2 * W)));

static inline vec ld(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vec v) { memcpy(p, &v, sizeof v); }
static inline vec splat(float x) { return (vec){0} + x; }
static inline float hsum(vec v) {
    half_vec a, b;
    memcpy(&a, &v, sizeof a);
    memcpy(&b, (const char *)&v + sizeof a, sizeof b);
    a += b;  /* 8 lanes */
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}
static inline vec pick(veci mask, vec a, vec b) { return (vec)(((veci)a & mask) | ((veci)b & ~mask)); }

/* e^x to ~2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the
 * exponent bits). Inputs are clamped to the float range; NaN stays NaN. */
static inline vec vexp(vec x) {
    x = pick(x < splat(-87.33654f), splat(-87.33654f), x);
    x = pick(x > splat(88.72283f), splat(88.72283f), x);
    vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    veci bits = (__builtin_convertvector(n, veci) + 127) << 23;
    return p * (vec)bits;
}

int metaloom_fused_abi(void) { return ABI_VERSION; }

/* Per row: x += delta (when delta is not NULL, in place: the residual add), then
 * y = x * rsqrt(mean(x^2) + eps) * w. x, delta, y [rows, d]; w [d]. */
void residual_rms_norm(float *x, const float *delta, const float *w, float *y,
                       int64_t rows, int64_t d, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * d, *yr = y + r * d;
        vec ss = splat(0.0f);
        for (int64_t i = 0; i < d; i += W) {
            vec v = ld(xr + i);
            if (delta) { v += ld(delta + r * d + i); st(xr + i, v); }
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(hsum(ss) / (float)d + eps);
        for (int64_t i = 0; i < d; i += W) st(yr + i, (ld(xr + i) * inv) * ld(w + i));
    }
}

/* SwiGLU's product: y = silu(gate) * up, from gu [rows, 2 * inter] = [gate | up]. */
void silu_mul(const float *gu, float *y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += W) {
            vec gv = ld(g + i);
            st(y + r * inter + i, gv / (1.0f + vexp(-gv)) * ld(u + i));
        }
    }
}

/* Rotate-half RoPE of one head: out = x * cos + rotate_half(x) * sin. */
static void rope(const float *x, const float *c, const float *s, float *out, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += W) {
        vec a = ld(x + i), b = ld(x + half + i);
        st(out + i, a * ld(c + i) + -b * ld(s + i));
        st(out + half + i, b * ld(c + half + i) + a * ld(s + half + i));
    }
}

/* One query head against its cached keys and values, positions lo..pos:
 * out = softmax(q . K^T * scale) V. nv = dim / W is a compile-time constant at each call site
 * (see head_attend), so q and the output stay in registers. */
static inline __attribute__((always_inline)) void head_attend_n(
        const float *q, const float *K, const float *V, float *scores, float *out,
        int64_t lo, int64_t pos, float scale, const int nv) {
    vec qv[MAX_VECTORS], acc[MAX_VECTORS];
    for (int i = 0; i < nv; i++) qv[i] = ld(q + W * i);
    float mx = -INFINITY;
    for (int64_t t = lo; t <= pos; t++) {
        vec d = qv[0] * ld(K + t * W * nv);
        for (int i = 1; i < nv; i++) d += qv[i] * ld(K + t * W * nv + W * i);
        float x = hsum(d) * scale;
        scores[t] = x;
        mx = x > mx ? x : mx;
    }
    memset(scores + pos + 1, 0, W * sizeof(float));  /* the last block's tail: not summed */
    vec sums = splat(0.0f);
    for (int64_t t = lo; t <= pos; t += W) {  /* softmax numerators, W at a time */
        vec e = vexp(ld(scores + t) - mx);
        if (pos + 1 - t < W)
            for (int64_t k = pos + 1 - t; k < W; k++) e[k] = 0.0f;
        st(scores + t, e);
        sums += e;
    }
    for (int i = 0; i < nv; i++) acc[i] = splat(0.0f);
    for (int64_t t = lo; t <= pos; t++)
        for (int i = 0; i < nv; i++) acc[i] += scores[t] * ld(V + t * W * nv + W * i);
    float inv = 1.0f / hsum(sums);
    for (int i = 0; i < nv; i++) st(out + W * i, acc[i] * inv);
}

static void head_attend(const float *q, const float *K, const float *V, float *scores, float *out,
                        int64_t lo, int64_t pos, float scale, int64_t nv) {
    switch (nv) {  /* head_dim 64, 128, 256 unrolled; other multiples of 32 generic */
    case 4: head_attend_n(q, K, V, scores, out, lo, pos, scale, 4); break;
    case 8: head_attend_n(q, K, V, scores, out, lo, pos, scale, 8); break;
    case 16: head_attend_n(q, K, V, scores, out, lo, pos, scale, 16); break;
    default: head_attend_n(q, K, V, scores, out, lo, pos, scale, (int)nv);
    }
}

/* One new token per row, at position lengths[r]:
 *   qkv [rows, (h + 2 hk) * dim]: q heads, then k heads, then v heads (the fused projection);
 *   cos_t, sin_t [positions, dim]; kc, vc [rows, hk, cap, dim] (the layer's cache).
 * Writes the rotated k and the v at that position, then for every query head g (kv head
 * g / (h / hk)) out[r, g] = softmax(q . K^T / sqrt(dim)) V over positions lo..pos (lo > 0 only
 * with a sliding window). out [rows, h * dim]. Returns 0; -1 out of memory; -2 dim > 256. */
int rope_attend(const float *qkv, const float *cos_t, const float *sin_t, const int64_t *lengths,
                float *kc, float *vc, float *out, int64_t rows, int64_t h, int64_t hk, int64_t dim,
                int64_t cap, int64_t window) {
    int64_t stride = (h + 2 * hk) * dim, group = h / hk;
    if (dim > W * MAX_VECTORS) return -2;
    float scale = 1.0f / sqrtf((float)dim);
    float *scores = malloc(sizeof(float) * (size_t)(cap + W + dim));  /* scores [cap + W], q [dim] */
    if (!scores) return -1;
    float *q = scores + cap + W;
    for (int64_t r = 0; r < rows; r++) {
        int64_t pos = lengths[r];
        int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
        const float *row = qkv + r * stride, *c = cos_t + pos * dim, *s = sin_t + pos * dim;
        for (int64_t j = 0; j < hk; j++) {
            int64_t at = ((r * hk + j) * cap + pos) * dim;
            rope(row + (h + j) * dim, c, s, kc + at, dim);
            memcpy(vc + at, row + (h + hk + j) * dim, sizeof(float) * (size_t)dim);
        }
        for (int64_t g = 0; g < h; g++) {
            int64_t at = (r * hk + g / group) * cap * dim;
            rope(row + g * dim, c, s, q, dim);
            head_attend(q, kc + at, vc + at, scores, out + (r * h + g) * dim, lo, pos, scale, dim / W);
        }
    }
    free(scores);
    return 0;
}
