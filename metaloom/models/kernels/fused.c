/* Fused CPU kernels for the glue of a one-token decode step (metaloom/models/kernels/fused.py).
 *
 * A batch-1 decode step of a small model reads its weights in ~30 matmuls' worth of time, and
 * spends another third of the step in ~20 small PyTorch ops per layer (norms, RoPE, cache
 * writes, attention over one query, SwiGLU, residual adds), each a few microseconds of
 * dispatch for a few hundred floats of work. These kernels do that glue in three calls per
 * layer. The matmuls stay PyTorch's (MKL / oneDNN).
 *
 * Tensors are float32 or bfloat16 (the `bf16` argument); arithmetic is float32 either way, and
 * a bfloat16 result is rounded to nearest-even where PyTorch's separate ops would round it
 * (the residual stream, the rotated q and k, each kernel's output). The formulas are
 * transformers'; only summation orders differ. Vectors are GCC/Clang vector extensions, so
 * this compiles on any target those compilers know. Sizes must be multiples of 16 elements
 * (head_dim of 32, for RoPE's halves); fused.py checks before calling.
 *
 * The KV pool stores keys and values in the activations' type, or as int8 codes with a float32
 * scale per slot and kv head (`q8`; metaloom/models/engine/kv_int8.py): the attention then
 * multiplies each key's dot product and each value's weight by its scale, and the new key and
 * value are quantised here exactly as the Python pool's write does (absmax / 127, round half to
 * even, so the same key gets the same codes on either path).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#define ABI_VERSION 9
#define INLINE static inline __attribute__((always_inline))

/* W lanes per vector: one AVX-512 register; 8 on every other path, one AVX2 register or two NEON
 * or SSE2 ones (GCC lowers a generic vector wider than the machine's registers through memory:
 * 16 lanes on AVX2 kept the attention's query and output on the stack) */
#ifdef __AVX512F__
#define W 16
#else
#define W 8
#endif
#define MAX_VECTORS (256 / W) /* head_dim up to 256 */
typedef float vec __attribute__((vector_size(4 * W)));
typedef int32_t veci __attribute__((vector_size(4 * W)));
typedef uint32_t vecu __attribute__((vector_size(4 * W)));
typedef uint16_t vecu16 __attribute__((vector_size(2 * W)));
typedef int8_t vec8 __attribute__((vector_size(W)));

INLINE vec splat(float x) { return (vec){0} + x; }
INLINE vec pick(veci mask, vec a, vec b) { return (vec)((mask & (veci)a) | (~mask & (veci)b)); }
/* the lanes' sum in a fixed order: halves added until 8 lanes, then ((0+4)+(1+5))+((2+6)+(3+7)) */
INLINE float hsum(vec v) {
#if W == 16
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = v[i] + v[i + 8];
#else
    const vec a = v;
#endif
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* the largest lane */
INLINE float hmax(vec v) {
    float m = v[0];
    for (int i = 1; i < W; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* W elements at p[i..], as floats: float32 storage, or bfloat16 (the top half of a float) */
INLINE vec ld(const void *p, int64_t i, const int bf) {
    if (!bf) {
        vec v;
        memcpy(&v, (const float *)p + i, sizeof v);
        return v;
    }
    vecu16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (vec)(__builtin_convertvector(h, vecu) << 16);
}

/* W int8 codes at p[i..], as floats. Intrinsics where the target has a widening load: GCC 12
 * lowers __builtin_convertvector of an int8 vector to one scalar conversion a lane (seen in its
 * AVX2 output), which made the int8 attention half as fast as float32's */
INLINE vec ld8(const void *p, int64_t i) {
    const int8_t *s = (const int8_t *)p + i;
#if defined(__AVX512F__)
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s)));
#elif defined(__AVX2__)
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s)));
#elif defined(__aarch64__)
    int16x8_t h = vmovl_s8(vld1_s8(s));
    float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)));
    vec v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
    return v;
#else
    veci c;
    for (int k = 0; k < W; k++) c[k] = s[k];
    return __builtin_convertvector(c, vec);
#endif
}

/* W stored keys or values at p[i..], as floats: the activations' type, or int8 codes (q8: the
 * caller applies the slot's scale) */
INLINE vec ldkv(const void *p, int64_t i, const int bf, const int q8) { return q8 ? ld8(p, i) : ld(p, i, bf); }

#include "vec_store.h" /* st: store W floats, float32 or bfloat16 */

/* e^x to ~2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the
 * exponent bits). Inputs are clamped to the float range; NaN stays NaN. */
INLINE vec vexp(vec x) {
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

/* 1 when compiled with OpenMP (attention then splits over threads), else 0 */
int metaloom_fused_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---- residual add + RMSNorm ------------------------------------------------------------ */

INLINE void residual_rms_norm_t(void *x, const void *delta, const void *w, void *y, int64_t rows, int64_t d,
                                float eps, const int bf) {
    for (int64_t r = 0; r < rows; r++) {
        vec ss = splat(0.0f);
        for (int64_t i = r * d; i < (r + 1) * d; i += W) {
            vec v = ld(x, i, bf);
            if (delta) {
                st(x, i, v + ld(delta, i, bf), bf);
                v = ld(x, i, bf); /* the stored (rounded) sum, as the next op would read it */
            }
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(hsum(ss) / (float)d + eps);
        for (int64_t i = 0; i < d; i += W) st(y, r * d + i, (ld(x, r * d + i, bf) * inv) * ld(w, i, bf), bf);
    }
}

/* Per row: x += delta (when delta is not NULL, in place: the residual add), then
 * y = x * rsqrt(mean(x^2) + eps) * w. x, delta, y [rows, d]; w [d]. */
void residual_rms_norm(void *x, const void *delta, const void *w, void *y, int64_t rows, int64_t d, float eps,
                       int bf16) {
    if (bf16) residual_rms_norm_t(x, delta, w, y, rows, d, eps, 1);
    else residual_rms_norm_t(x, delta, w, y, rows, d, eps, 0);
}

/* ---- SwiGLU ---------------------------------------------------------------------------- */

INLINE void silu_mul_t(const void *gu, void *y, int64_t rows, int64_t inter, const int bf) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i += W) {
            vec g = ld(gu, r * 2 * inter + i, bf), u = ld(gu, r * 2 * inter + inter + i, bf);
            st(y, r * inter + i, g / (1.0f + vexp(-g)) * u, bf);
        }
}

/* y = silu(gate) * up, from gu [rows, 2 * inter] = [gate | up]; y [rows, inter]. */
void silu_mul(const void *gu, void *y, int64_t rows, int64_t inter, int bf16) {
    if (bf16) silu_mul_t(gu, y, rows, inter, 1);
    else silu_mul_t(gu, y, rows, inter, 0);
}

/* GeGLU (Gemma): gelu(gate) * up with GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g +
 * 0.044715 g^3))); tanh(z) = 1 - 2 / (e^(2z) + 1), whose e^(2z) saturates to 0 or inf and gives
 * -1 or 1 there (vexp clamps its input, so no NaN from inf / inf). */
INLINE void gelu_mul_t(const void *gu, void *y, int64_t rows, int64_t inter, const int bf) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i += W) {
            vec g = ld(gu, r * 2 * inter + i, bf), u = ld(gu, r * 2 * inter + inter + i, bf);
            vec z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            vec t = 1.0f - 2.0f / (vexp(2.0f * z) + 1.0f);
            st(y, r * inter + i, 0.5f * g * (1.0f + t) * u, bf);
        }
}

/* y = act(gate) * up: act 0 silu (SwiGLU), 1 tanh-approximated GELU (GeGLU). */
void glu_mul(const void *gu, void *y, int64_t rows, int64_t inter, int act, int bf16) {
    if (act == 1) {
        if (bf16) gelu_mul_t(gu, y, rows, inter, 1);
        else gelu_mul_t(gu, y, rows, inter, 0);
    } else silu_mul(gu, y, rows, inter, bf16);
}

/* ---- per-head q/k RMSNorm (Qwen3, Gemma 3) ------------------------------------------------- */

/* In place, before RoPE: each query head of qkv [rows, (h + 2 hk) dim] normalised and scaled by
 * qw [dim], each key head by kw [dim]; the value heads are left alone. */
void head_rms_norm(void *qkv, const void *qw, const void *kw, int64_t rows, int64_t h, int64_t hk, int64_t dim,
                   float eps, int bf16) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < h + hk; g++) {
            void *head = (char *)qkv + ((r * (h + 2 * hk) + g) * dim) * (bf16 ? 2 : 4);
            residual_rms_norm(head, NULL, g < h ? qw : kw, head, 1, dim, eps, bf16);
        }
}

/* ---- RoPE, cache write, attention -------------------------------------------------------- */

/* Rotate-half RoPE of one head: out = x * cos + rotate_half(x) * sin. */
INLINE void rope(const void *x, int64_t xi, const void *cs, const void *sn, int64_t ci, void *out, int64_t oi,
                 int64_t dim, const int bf) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += W) {
        vec a = ld(x, xi + i, bf), b = ld(x, xi + half + i, bf);
        st(out, oi + i, a * ld(cs, ci + i, bf) + -b * ld(sn, ci + i, bf), bf);
        st(out, oi + half + i, b * ld(cs, ci + half + i, bf) + a * ld(sn, ci + half + i, bf), bf);
    }
}

/* One new key or value x [dim] (the activations' type) into the int8 pool: codes [dim] at
 * codes[0..] and its scale at *scale, as kv_int8.quantize does: scale = max|x| / 127 (0 for a
 * zero vector, whose codes are then 0), codes = x / scale rounded half to even (the float
 * add-and-subtract of 1.5 * 2^23 rounds as the FPU's default mode does: to nearest, ties to
 * even; |x / scale| <= 127 is far below 2^22), clamped to [-127, 127]. Division, not a product
 * by the reciprocal: torch divides, and the codes must be the same bits. */
INLINE void put_q8(const void *x, int64_t xi, int8_t *codes, float *scale, int64_t dim, const int bf) {
    vec mx = splat(0.0f);
    for (int64_t i = 0; i < dim; i += W) {
        vec v = ld(x, xi + i, bf);
        v = pick(v < splat(0.0f), -v, v);
        mx = pick(v > mx, v, mx);
    }
    float s = hmax(mx) / 127.0f;
    vec safe = splat(s > 0.0f ? s : 1.0f);
    for (int64_t i = 0; i < dim; i += W) {
        vec y = ld(x, xi + i, bf) / safe;
        y = (y + 12582912.0f) - 12582912.0f;
        y = pick(y > splat(127.0f), splat(127.0f), y);
        y = pick(y < splat(-127.0f), splat(-127.0f), y);
        vec8 c = __builtin_convertvector(__builtin_convertvector(y, veci), vec8);
        memcpy(codes + i, &c, sizeof c);
    }
    *scale = s;
}

/* Write row r's new key (rotated, at position `at` of the RoPE tables) and value of kv head j
 * into the pool at element `slot` (= its slot * hk * dim + j * dim; scale index si = its slot
 * * hk + j). tmp [dim] of the activations' type: the rotated key before it is quantised, rounded
 * as PyTorch's RoPE output is. */
INLINE void put_kv(const void *qkv, int64_t ki, int64_t vi, const void *cs, const void *sn, int64_t at, void *kc,
                   void *vc, float *ks, float *vs, int64_t slot, int64_t si, int64_t dim, void *tmp, const int bf,
                   const int q8) {
    if (!q8) {
        const int64_t elem = bf ? 2 : 4;
        rope(qkv, ki, cs, sn, at, kc, slot, dim, bf);
        memcpy((char *)vc + slot * elem, (const char *)qkv + vi * elem, (size_t)(dim * elem));
        return;
    }
    rope(qkv, ki, cs, sn, at, tmp, 0, dim, bf);
    put_q8(tmp, 0, (int8_t *)kc + slot, ks + si, dim, bf);
    put_q8(qkv, vi, (int8_t *)vc + slot, vs + si, dim, bf);
}

/* Software prefetch of one position's key or value of one head (`lines` cache lines from element
 * `at` of elem bytes), PREFETCH_KEYS positions ahead: a row's positions live in slots of the
 * pool (a slot holds every kv head), so the hardware prefetchers see short strided runs, not a
 * stream. */
#define PREFETCH_KEYS 16
INLINE void prefetch_kv(const void *p, int64_t at, int64_t elem, int64_t lines) {
    const char *c = (const char *)p + at * elem;
    for (int64_t l = 0; l < lines; l++) __builtin_prefetch(c + 64 * l, 0, 3);
}

/* One query head against its cached keys and values, positions lo..pos, unnormalised: returns
 * the largest score m and l = sum e^(score - m), and leaves acc = sum e^(score - m) V (what
 * shared-prefix attention merges with other parts of the same row). Position t of the row lives
 * in slot slots[t]; this head's key is at element slots[t] * stride + off of K (and likewise V).
 * nv = dim / W is a compile-time constant at each call site (see head_attend), so q and acc
 * stay in registers. */
INLINE void head_partial_n(const void *q, int64_t qi, const void *K, const void *V, const float *KS,
                           const float *VS, const int64_t *slots, int64_t stride, int64_t off, int64_t sst,
                           int64_t sof, float *scores, int64_t lo, int64_t pos, float scale, float cap, vec *acc,
                           float *m_out, float *l_out, const int nv, const int bf, const int q8) {
    vec qv[MAX_VECTORS];
    for (int i = 0; i < nv; i++) qv[i] = ld(q, qi + W * i, bf);
    float mx = -INFINITY;
    const int64_t elem = q8 ? 1 : bf ? 2 : 4, lines = (nv * W * elem + 63) / 64;
    for (int64_t t = lo; t <= pos; t++) {
        int64_t at = slots[t] * stride + off;
        if (t + PREFETCH_KEYS <= pos) /* a row's keys sit a slot apart, not in one stream */
            prefetch_kv(K, slots[t + PREFETCH_KEYS] * stride + off, elem, lines);
        vec d = qv[0] * ldkv(K, at, bf, q8);
        for (int i = 1; i < nv; i++) d += qv[i] * ldkv(K, at + W * i, bf, q8);
        float x = hsum(d) * (q8 ? KS[slots[t] * sst + sof] * scale : scale);
        if (cap > 0.0f) x = cap * tanhf(x / cap); /* soft-capped scores (Gemma 2) */
        scores[t] = x;
        mx = x > mx ? x : mx;
    }
    vec sums = splat(0.0f);
    for (int64_t t = lo; t <= pos; t += W) { /* softmax numerators, W at a time */
        vec e = vexp(ld(scores, t, 0) - mx);
        for (int64_t k = pos + 1 - t; k < W; k++) e[k] = 0.0f; /* past pos: not summed */
        memcpy(scores + t, &e, sizeof e);
        sums += e;
    }
    for (int i = 0; i < nv; i++) acc[i] = splat(0.0f);
    for (int64_t t = lo; t <= pos; t++) {
        int64_t at = slots[t] * stride + off;
        if (t + PREFETCH_KEYS <= pos) prefetch_kv(V, slots[t + PREFETCH_KEYS] * stride + off, elem, lines);
        float p = q8 ? scores[t] * VS[slots[t] * sst + sof] : scores[t];
        for (int i = 0; i < nv; i++) acc[i] += p * ldkv(V, at + W * i, bf, q8);
    }
    *m_out = mx;
    *l_out = hsum(sums);
}

/* out = softmax(q . K^T * scale) V over positions lo..pos (head_partial_n, normalised); returns
 * the softmax's sum l (scores[t] / l is then position t's attention probability) */
INLINE float head_attend_n(const void *q, const void *K, const void *V, const float *KS, const float *VS,
                          const int64_t *slots, int64_t stride, int64_t off, int64_t sst, int64_t sof, float *scores,
                          void *out, int64_t oi, int64_t lo, int64_t pos, float scale, float cap, const int nv,
                          const int bf, const int q8) {
    vec acc[MAX_VECTORS];
    float m, l;
    head_partial_n(q, 0, K, V, KS, VS, slots, stride, off, sst, sof, scores, lo, pos, scale, cap, acc, &m, &l, nv, bf,
                   q8);
    float inv = 1.0f / l;
    for (int i = 0; i < nv; i++) st(out, oi + W * i, acc[i] * inv, bf);
    return l;
}

/* head_attend_n for a row with `sinks` leading entries attended at their in-cache positions
 * (StreamingLLM, metaloom/models/engine/kv_policy.py): qs is the query rotated at its in-cache
 * position for entries 0..sinks-1, q rotated at its own position for sinks..pos; the two
 * partial softmaxes are merged by their log-sum-exp, as shared-prefix attention merges. */
INLINE void head_attend_sinks_n(const void *q, const void *qs, const void *K, const void *V, const float *KS,
                                const float *VS, const int64_t *slots, int64_t stride, int64_t off, int64_t sst,
                                int64_t sof, float *scores, void *out, int64_t oi, int64_t sinks, int64_t pos,
                                float scale, float cap, const int nv, const int bf, const int q8) {
    vec a[MAX_VECTORS], b[MAX_VECTORS];
    float ma, la, mb, lb;
    head_partial_n(qs, 0, K, V, KS, VS, slots, stride, off, sst, sof, scores, 0, sinks - 1, scale, cap, a, &ma, &la, nv,
                   bf, q8);
    head_partial_n(q, 0, K, V, KS, VS, slots, stride, off, sst, sof, scores, sinks, pos, scale, cap, b, &mb, &lb, nv,
                   bf, q8);
    float m = ma > mb ? ma : mb;
    float ca = vexp(splat(ma - m))[0], cb = vexp(splat(mb - m))[0];
    float inv = 1.0f / (la * ca + lb * cb);
    for (int i = 0; i < nv; i++) st(out, oi + W * i, (a[i] * ca + b[i] * cb) * inv, bf);
}

#define HEAD_ATTEND(NV) \
    return head_attend_n(q, K, V, KS, VS, slots, stride, off, sst, sof, scores, out, oi, lo, pos, scale, cap, NV, bf, q8)
#define HEAD_SINKS(NV) \
    head_attend_sinks_n(q, qs, K, V, KS, VS, slots, stride, off, sst, sof, scores, out, oi, sinks, pos, scale, cap, NV, \
                        bf, q8)

INLINE void head_attend_sinks(const void *q, const void *qs, const void *K, const void *V, const float *KS,
                              const float *VS, const int64_t *slots, int64_t stride, int64_t off, int64_t sst,
                              int64_t sof, float *scores, void *out, int64_t oi, int64_t sinks, int64_t pos,
                              float scale, float cap, int64_t nv, const int bf, const int q8) {
    switch (nv * W) {
    case 64: HEAD_SINKS(64 / W); break;
    case 128: HEAD_SINKS(128 / W); break;
    case 256: HEAD_SINKS(256 / W); break;
    default: HEAD_SINKS((int)nv);
    }
}

INLINE float head_attend(const void *q, const void *K, const void *V, const float *KS, const float *VS,
                        const int64_t *slots, int64_t stride, int64_t off, int64_t sst, int64_t sof, float *scores,
                        void *out, int64_t oi, int64_t lo, int64_t pos, float scale, float cap, int64_t nv,
                        const int bf, const int q8) {
    switch (nv * W) { /* head_dim 64, 128, 256 unrolled; other multiples of 32 generic */
    case 64: HEAD_ATTEND(64 / W);
    case 128: HEAD_ATTEND(128 / W);
    case 256: HEAD_ATTEND(256 / W);
    default: HEAD_ATTEND((int)nv);
    }
}

/* ---- decode attention, one kv head's whole group of query heads at once ----------------------
 *
 * Under grouped-query attention the G query heads of a group share one kv head. Attending them
 * one after another (head_attend) reads each of the row's keys and values G times: at 4,000
 * positions a head's keys are a megabyte, more than L2, so every re-read comes from L3 or memory
 * and long-context steps grew with G (SmolLM2, G = 3: 30.7 ms a step at 4,000 positions against
 * 6.4 at 400; Qwen2.5, G = 6-7). Here each position's key is loaded once and dotted with all G
 * queries, and each value loaded once and added into G accumulators. Every head's arithmetic is
 * head_partial_n's, in the same order (the same dot, the same softmax, the same running sums): a
 * head's output does not depend on how many heads share its kv head (tested against the model
 * with its kv heads repeated), and differs from the head-at-a-time loop (kept for the sinks) only
 * where the compiler fuses a multiply-add differently. */
#define MAX_GROUP 16

/* Scores come in blocks of 8 keys: each key's dot is a vector of lane sums (8 lanes, after
 * hsum's first fold on 16), and the 8 are summed across lanes together by shuffles (a transpose
 * in three rounds of pairwise adds) rather than one hsum a key: 7 vector adds and 15 shuffles for
 * 8 scores, where 8 hsums take 56 scalar adds and the lane extracts between them. Each sum is
 * taken in hsum's order, so a score has the bits the key-at-a-time loop gives it. */
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

INLINE f8 fold8(vec d) { /* hsum's first step: W lanes to 8 */
#if W == 16
    f8 lo, hi;
    memcpy(&lo, &d, sizeof lo);
    memcpy(&hi, (const char *)&d + sizeof lo, sizeof hi);
    return lo + hi;
#else
    return d;
#endif
}

/* out[t] = ((a[t][0] + a[t][4]) + (a[t][1] + a[t][5])) + ((a[t][2] + a[t][6]) + (a[t][3] + a[t][7])) */
INLINE f8 hsum8x8(const f8 *a) {
    const i8v lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const i8v ev = {0, 2, 8, 10, 4, 6, 12, 14}, od = {1, 3, 9, 11, 5, 7, 13, 15};
    f8 u[4], v[2];
    for (int p = 0; p < 4; p++) /* lanes 0-3: key 2p's a[i] + a[i + 4]; 4-7: key 2p + 1's */
        u[p] = __builtin_shuffle(a[2 * p], a[2 * p + 1], lo4) + __builtin_shuffle(a[2 * p], a[2 * p + 1], hi4);
    for (int q = 0; q < 2; q++) /* lane pairs of keys 4q, 4q + 2, 4q + 1, 4q + 3: (h0 + h1), (h2 + h3) */
        v[q] = __builtin_shuffle(u[2 * q], u[2 * q + 1], ev) + __builtin_shuffle(u[2 * q], u[2 * q + 1], od);
    f8 w = __builtin_shuffle(v[0], v[1], ev) + __builtin_shuffle(v[0], v[1], od); /* keys 0 2 4 6 1 3 5 7 */
    return __builtin_shuffle(w, (i8v){0, 4, 1, 5, 2, 6, 3, 7});
}

INLINE void group_attend_n(const void *q, int64_t G, const void *K, const void *V, const float *KS, const float *VS,
                           const int64_t *slots, int64_t stride, int64_t off, int64_t sst, int64_t sof, float *scores,
                           int64_t span, float *sums_out, void *out, int64_t oi, int64_t dim, int64_t lo, int64_t pos,
                           float scale, float cap, float *part, const int nv, const int bf, const int q8) {
    vec qf[MAX_GROUP][MAX_VECTORS], acc[MAX_GROUP][MAX_VECTORS], kv[MAX_VECTORS];
    float mx[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        for (int i = 0; i < nv; i++) qf[g][i] = ld(q, g * dim + W * i, bf);
        mx[g] = -INFINITY;
    }
    const int64_t elem = q8 ? 1 : bf ? 2 : 4, lines = (nv * W * elem + 63) / 64;
    f8 vmx[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) vmx[g] = (f8){0} - INFINITY;
    /* a block's keys as float32 when the pool holds bfloat16: converted once, read by G heads */
    float kb[8 * MAX_VECTORS * W] __attribute__((aligned(64)));
    int64_t t = lo;
    for (; !q8 && t + 8 <= pos + 1; t += 8) { /* float keys in blocks of 8 (int8 keys: one at a time, below) */
        const float *kp[8];
        for (int b = 0; b < 8; b++) {
            int64_t at = slots[t + b] * stride + off;
            if (t + b + PREFETCH_KEYS <= pos) prefetch_kv(K, slots[t + b + PREFETCH_KEYS] * stride + off, elem, lines);
            if (!bf) {
                kp[b] = (const float *)K + at;
                continue;
            }
            for (int i = 0; i < nv; i++) {
                vec x = ld(K, at + W * i, 1);
                memcpy(kb + b * nv * W + W * i, &x, sizeof x);
            }
            kp[b] = kb + b * nv * W;
        }
        const f8 ks8 = (f8){0} + scale;
        for (int64_t g = 0; g < G; g++) {
            f8 a[8];
            for (int b = 0; b < 8; b++) {
                vec d = qf[g][0] * ld(kp[b], 0, 0);
                for (int i = 1; i < nv; i++) d += qf[g][i] * ld(kp[b], W * i, 0);
                a[b] = fold8(d);
            }
            f8 x = hsum8x8(a) * ks8;
            if (cap > 0.0f)
                for (int b = 0; b < 8; b++) x[b] = cap * tanhf(x[b] / cap);
            memcpy(scores + g * span + t, &x, sizeof x);
            i8v up = x > vmx[g];
            vmx[g] = (f8)((up & (i8v)x) | (~up & (i8v)vmx[g]));
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int b = 0; b < 8; b++) mx[g] = vmx[g][b] > mx[g] ? vmx[g][b] : mx[g];
    for (; t <= pos; t++) { /* the last keys, one at a time */
        int64_t at = slots[t] * stride + off;
        if (t + PREFETCH_KEYS <= pos) prefetch_kv(K, slots[t + PREFETCH_KEYS] * stride + off, elem, lines);
        for (int i = 0; i < nv; i++) kv[i] = ldkv(K, at + W * i, bf, q8);
        float ks = q8 ? KS[slots[t] * sst + sof] * scale : scale;
        for (int64_t g = 0; g < G; g++) {
            vec d = qf[g][0] * kv[0];
            for (int i = 1; i < nv; i++) d += qf[g][i] * kv[i];
            float x = hsum(d) * ks;
            if (cap > 0.0f) x = cap * tanhf(x / cap);
            scores[g * span + t] = x;
            mx[g] = x > mx[g] ? x : mx[g];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sc = scores + g * span;
        vec sums = splat(0.0f);
        for (int64_t t = lo; t <= pos; t += W) {
            vec e = vexp(ld(sc, t, 0) - mx[g]);
            for (int64_t k = pos + 1 - t; k < W; k++) e[k] = 0.0f;
            memcpy(sc + t, &e, sizeof e);
            sums += e;
        }
        sums_out[g] = hsum(sums);
        for (int i = 0; i < nv; i++) acc[g][i] = splat(0.0f);
    }
    if (q8) { /* int8 values: each converted once for the G heads (blocks measured no faster) */
        for (int64_t t = lo; t <= pos; t++) {
            int64_t at = slots[t] * stride + off;
            if (t + PREFETCH_KEYS <= pos) prefetch_kv(V, slots[t + PREFETCH_KEYS] * stride + off, elem, lines);
            for (int i = 0; i < nv; i++) kv[i] = ld8(V, at + W * i);
            const float vsc = VS[slots[t] * sst + sof];
            for (int64_t g = 0; g < G; g++) {
                float p = scores[g * span + t] * vsc;
                for (int i = 0; i < nv; i++) acc[g][i] += p * kv[i];
            }
        }
    } else {
        /* float values in blocks of VB positions, head by head within a block: a head's nv
         * accumulators stay in registers (all G heads' do not: 3 x 8 on AVX2 spilled every add
         * to the stack), and the block, read G times, stays in L1. Each accumulator still adds
         * its positions in order. */
        enum { VB = 32 };
        float vb[VB * MAX_VECTORS * W] __attribute__((aligned(64))); /* bfloat16 values as float32 */
        for (int64_t t0 = lo; t0 <= pos; t0 += VB) {
            const int64_t n = pos + 1 - t0 < VB ? pos + 1 - t0 : VB;
            const float *vp[VB];
            for (int64_t b = 0; b < n; b++) {
                int64_t at = slots[t0 + b] * stride + off;
                if (!bf) {
                    vp[b] = (const float *)V + at;
                    continue;
                }
                if (t0 + b + PREFETCH_KEYS <= pos) prefetch_kv(V, slots[t0 + b + PREFETCH_KEYS] * stride + off, elem, lines);
                for (int i = 0; i < nv; i++) {
                    vec x = ld(V, at + W * i, 1);
                    memcpy(vb + b * nv * W + W * i, &x, sizeof x);
                }
                vp[b] = vb + b * nv * W;
            }
            for (int64_t g = 0; g < G; g++) {
                vec a[MAX_VECTORS];
                for (int i = 0; i < nv; i++) a[i] = acc[g][i];
                const float *sc = scores + g * span + t0;
                for (int64_t b = 0; b < n; b++) {
                    /* float32 prefetched between the adds: a block's prefetches at once overflowed the miss buffers */
                    if (!bf && g == 0 && t0 + b + PREFETCH_KEYS <= pos)
                        prefetch_kv(V, slots[t0 + b + PREFETCH_KEYS] * stride + off, elem, lines);
                    for (int i = 0; i < nv; i++) a[i] += sc[b] * ld(vp[b], W * i, 0);
                }
                for (int i = 0; i < nv; i++) acc[g][i] = a[i];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        if (part) { /* a part of the row's positions: its max, sum and unnormalised acc, merged later */
            float *p = part + g * (dim + 2);
            p[0] = mx[g];
            p[1] = sums_out[g];
            for (int i = 0; i < nv; i++) memcpy(p + 2 + W * i, &acc[g][i], sizeof(vec));
            continue;
        }
        float inv = 1.0f / sums_out[g];
        for (int i = 0; i < nv; i++) st(out, oi + g * dim + W * i, acc[g][i] * inv, bf);
    }
}

#define GROUP_ATTEND(NV) \
    group_attend_n(q, G, K, V, KS, VS, slots, stride, off, sst, sof, scores, span, sums, out, oi, dim, lo, pos, scale, \
                   cap, part, NV, bf, q8)

/* part: NULL, or [G][dim + 2] for (max, sum, acc) of each head over lo..pos, unnormalised */
INLINE void group_attend(const void *q, int64_t G, const void *K, const void *V, const float *KS, const float *VS,
                         const int64_t *slots, int64_t stride, int64_t off, int64_t sst, int64_t sof, float *scores,
                         int64_t span, float *sums, void *out, int64_t oi, int64_t dim, int64_t lo, int64_t pos,
                         float scale, float cap, float *part, const int bf, const int q8) {
    switch (dim) {
    case 64: GROUP_ATTEND(64 / W); break;
    case 128: GROUP_ATTEND(128 / W); break;
    case 256: GROUP_ATTEND(256 / W); break;
    default: GROUP_ATTEND((int)(dim / W));
    }
}

/* The dropped-positions state of a step (--kv-policy, metaloom/models/engine/dropping.py), each
 * pointer NULL when unused: row r's next token is at position lengths[r] + shift[r] (its entry is
 * lengths[r]); its first sinks[r] entries are attended at their in-cache positions; probs
 * [rows, hk, width] accumulates each entry's attention probability, summed over the group's
 * query heads (and over layers, call after call). */
typedef struct {
    const int64_t *shift, *sinks;
    float *probs;
} drop_args;

/* A row of at least ATTEND_HALVES positions is attended in two halves (the first ends at a
 * multiple of 32 positions from lo), each a task, and the halves' partial softmaxes merged
 * (merge_parts): so one row's attention at a long context splits over two threads evenly, where
 * (row, kv head) tasks alone split SmolLM2's 3 kv heads 2 : 1 and Gemma 3's one not at all.
 * Two halves, not parts of a fixed size: every part adds tasks and merges that a batch of rows,
 * already split evenly, pays for (scripts/attend_step_ab.py, SmolLM2 at 1,000-4,000 positions:
 * halves 1.07-1.11x faster than parts of 512 for 4 rows, 1.01-1.06x for one). The halves depend
 * only on the row's lo and pos, never on the threads or the other rows, so a position's output
 * has the same bits in a decode step and in a verify (a verify's drafted tokens are rows of
 * their own). Rows with dropped positions (shift, sinks, probs) are attended whole. */
#define ATTEND_HALVES 512

INLINE int64_t attend_lo(int64_t pos, int64_t window) { return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0; }

INLINE int64_t attend_parts(int64_t pos, int64_t window, const drop_args *dr) {
    if (dr->shift || dr->sinks || dr->probs) return 1;
    return pos - attend_lo(pos, window) + 1 >= ATTEND_HALVES ? 2 : 1;
}

/* One (row, kv head) task: attend every query head of kv head j's group over the row's
 * positions (its new key and value already written by write_new). scores: [group, span] scratch,
 * q: [(group + 1) * dim] for the rotated queries. Without sinks the group goes through
 * group_attend, MAX_GROUP heads at a time (each key and value read once per part); sinks rotate
 * the query twice and take the head-at-a-time path. With `part` (not NULL): only the row's half
 * `chunk` (0, 1) of its positions, each head's (max, sum, acc) into part [group][dim + 2]. */
INLINE void attend_task(const void *qkv, const void *cs, const void *sn, const int64_t *lengths,
                        const int64_t *table, int64_t width, void *kc, void *vc, float *ks, float *vs, void *out,
                        int64_t r, int64_t j, int64_t h, int64_t hk, int64_t dim, int64_t window, float scale,
                        float cap, float *scores, int64_t span, float *q, const drop_args *dr, int64_t chunk,
                        float *part, const int bf, const int q8) {
    int64_t stride = (h + 2 * hk) * dim, group = h / hk;
    int64_t pos = lengths[r];
    int64_t lo = attend_lo(pos, window);
    int64_t row = r * stride, at = (pos + (dr->shift ? dr->shift[r] : 0)) * dim;
    int64_t sinks = dr->sinks ? dr->sinks[r] : 0;
    const int64_t *slots = table + r * width;
    if (!(sinks > 0 && at != pos * dim)) {
        float sums[MAX_GROUP];
        int64_t a = lo, b = pos; /* the positions of this task */
        if (part) {
            const int64_t half = ((pos - lo + 1) / 2) & ~(int64_t)31;
            a = chunk ? lo + half : lo;
            b = chunk ? pos : lo + half - 1;
        }
        for (int64_t c = 0; c < group; c += MAX_GROUP) { /* a group of more than MAX_GROUP heads: in parts */
            int64_t n = group - c < MAX_GROUP ? group - c : MAX_GROUP, g0 = j * group + c;
            for (int64_t g = 0; g < n; g++) rope(qkv, row + (g0 + g) * dim, cs, sn, at, q, g * dim, dim, bf);
            group_attend(q, n, kc, vc, ks, vs, slots, hk * dim, j * dim, hk, j, scores, span, sums, out,
                         (r * h + g0) * dim, dim, a, b, scale, cap, part ? part + c * (dim + 2) : NULL, bf, q8);
            if (dr->probs) /* scores hold e^(score - max) for lo..pos, head by head */
                for (int64_t g = 0; g < n; g++) {
                    float inv = 1.0f / sums[g], *p = dr->probs + (r * hk + j) * width;
                    for (int64_t t = lo; t <= pos; t++) p[t] += scores[g * span + t] * inv;
                }
        }
        return;
    }
    float *qs = q + dim; /* the query at its in-cache position, for the sinks */
    for (int64_t g = j * group; g < (j + 1) * group; g++) {
        rope(qkv, row + g * dim, cs, sn, at, q, 0, dim, bf);
        if (sinks > 0 && at != pos * dim) {
            rope(qkv, row + g * dim, cs, sn, pos * dim, qs, 0, dim, bf);
            head_attend_sinks(q, qs, kc, vc, ks, vs, slots, hk * dim, j * dim, hk, j, scores, out, (r * h + g) * dim,
                              sinks, pos, scale, cap, dim / W, bf, q8);
            continue;
        }
        float l = head_attend(q, kc, vc, ks, vs, slots, hk * dim, j * dim, hk, j, scores, out, (r * h + g) * dim, lo,
                              pos, scale, cap, dim / W, bf, q8);
        if (dr->probs) { /* scores hold e^(score - max) for lo..pos */
            float inv = 1.0f / l, *p = dr->probs + (r * hk + j) * width;
            for (int64_t t = lo; t <= pos; t++) p[t] += scores[t] * inv;
        }
    }
}

/* out [G heads, dim] of one (row, kv head) from its np parts (position order), each part
 * [G][dim + 2] = (max m, sum l, acc): softmax over the concatenation = sum_c e^(m_c - M) acc_c /
 * sum_c e^(m_c - M) l_c with M the largest m_c, summed in part order (the log-sum-exp merge of
 * shared-prefix attention and of the sinks, above). */
INLINE void merge_parts(const float *parts, int64_t np, int64_t G, int64_t dim, void *out, int64_t oi, const int bf) {
    const int64_t ps = G * (dim + 2), nv = dim / W;
    for (int64_t g = 0; g < G; g++) {
        float m = -INFINITY, l = 0.0f;
        for (int64_t c = 0; c < np; c++) m = parts[c * ps + g * (dim + 2)] > m ? parts[c * ps + g * (dim + 2)] : m;
        vec acc[MAX_VECTORS];
        for (int64_t i = 0; i < nv; i++) acc[i] = splat(0.0f);
        for (int64_t c = 0; c < np; c++) {
            const float *p = parts + c * ps + g * (dim + 2);
            const float w = vexp(splat(p[0] - m))[0];
            l += p[1] * w;
            for (int64_t i = 0; i < nv; i++) acc[i] += ld(p + 2, W * i, 0) * w;
        }
        const float inv = 1.0f / l;
        for (int64_t i = 0; i < nv; i++) st(out, oi + g * dim + W * i, acc[i] * inv, bf);
    }
}

INLINE int rope_attend_t(const void *qkv, const void *cs, const void *sn, const int64_t *lengths,
                         const int64_t *table, int64_t width, void *kc, void *vc, float *ks, float *vs, void *out,
                         int64_t rows, int64_t h, int64_t hk, int64_t dim, int64_t window, int64_t threads,
                         float scale, float cap, const drop_args *dr, const int bf, const int q8) {
    if (dim > W * MAX_VECTORS) return -2;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = lengths[r] > longest ? lengths[r] : longest;
    /* per thread: scores [group, longest + 1 + W] (the last block of W may run past pos), then
     * the group's rotated queries [group * dim] and one more [dim] (a query at its in-cache
     * position, for the sinks) */
    int64_t span = longest + 1 + W, group = h / hk, part = group < MAX_GROUP ? group : MAX_GROUP;
    size_t scratch = (size_t)(part * span + (group + 1) * dim);
    int failed = 0;
    /* row r's tasks are first[r]..first[r + 1] - 1: hk kv heads x its parts, a kv head's parts
     * adjacent; a row in parts leaves each task's partial softmax in parts [task][group][dim + 2] */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(rows + 1)), split = 0;
    if (!first) return -1;
    first[0] = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t np = attend_parts(lengths[r], window, dr);
        first[r + 1] = first[r] + hk * np;
        split |= np > 1;
    }
    const int64_t tasks = first[rows], pstride = group * (dim + 2);
    float *parts = split ? malloc(sizeof(float) * (size_t)(tasks * pstride)) : NULL;
    if (split && !parts) {
        free(first);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        float *scores = malloc(sizeof(float) * scratch);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores) continue;
            int64_t lo = 0, hi = rows - 1; /* the row: the last r with first[r] <= task */
            while (lo < hi) {
                int64_t mid = (lo + hi + 1) / 2;
                if (first[mid] <= task) lo = mid;
                else hi = mid - 1;
            }
            const int64_t r = lo, np = (first[r + 1] - first[r]) / hk, k = task - first[r];
            attend_task(qkv, cs, sn, lengths, table, width, kc, vc, ks, vs, out, r, k / np, h, hk, dim, window, scale,
                        cap, scores, span, scores + part * span, dr, k % np, np > 1 ? parts + task * pstride : NULL,
                        bf, q8);
        }
        int bad; /* set before the loop's barrier, so every thread reads the same */
#pragma omp atomic read
        bad = failed;
        if (split && !bad) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t rj = 0; rj < rows * hk; rj++) {
                const int64_t r = rj / hk, j = rj % hk, np = (first[r + 1] - first[r]) / hk;
                if (np > 1)
                    merge_parts(parts + (first[r] + j * np) * pstride, np, group, dim, out, (r * h + j * group) * dim,
                                bf);
            }
        }
        free(scores);
    }
    free(parts);
    free(first);
    return failed ? -1 : 0;
}

/* ---- shared-prefix attention (Hydragen) ---------------------------------------------------- *
 * Rows forked from one prompt hold the same slots for the prompt's positions. Per row, the
 * attention above reads every shared key and value once per row and step: 64 samples of a
 * 4,000-token prompt read the prompt's KV 64 times per layer. Here the positions a group of rows
 * shares (a span, metaloom/models/engine/sharing.py) are read once for all their queries: the
 * span's keys and values go through the cache in blocks of KB positions, and every query of
 * every row of the group is scored against a block while it is in L1 (Juravsky et al. 2024,
 * "Hydragen", a matrix-matrix product per kv head instead of a matrix-vector product per row).
 * Each part (a span, the row's own private positions) leaves an unnormalised partial softmax
 * (max m, sum l, acc); a row's parts are merged by their log-sum-exp, which gives the row's full
 * softmax to float rounding (§3: attention over a concatenation of keys decomposes exactly). */

typedef struct {
    int64_t spans;                 /* spans of shared positions */
    const int64_t *lo, *hi, *ptr;  /* span s: positions lo[s]..hi[s]-1 of rows[ptr[s]..ptr[s+1]-1] */
    const int64_t *rows;           /* the rows of every span, one (span, row) pair each */
    int64_t npairs;                /* = ptr[spans] */
    const int64_t *private_from;   /* row r attends private_from[r]..lengths[r] on its own */
    const int64_t *row_ptr, *pairs; /* row r's pairs: pairs[row_ptr[r]..row_ptr[r+1]-1] */
} sharing_desc;

#define KB 32       /* positions of a span's key block (32 x 256 floats of keys and of values at most) */
#define SPAN_ROWS 64 /* rows of a span task: a span is read (and its key blocks transposed) once per 64 rows */

/* One query's running partial softmax state s = (m, l, acc[dim]) after a block of n <= KB
 * keys whose scores (unscaled) are dots and whose values are vb [KB][dim] (float32). */
INLINE void block_update(float *s, const vec *dots, int64_t n, float scale, const float *vb, const int nv) {
    const int64_t dim = nv * W;
    float sc[KB] __attribute__((aligned(64)));
    vec acc[MAX_VECTORS];
    vec vmax = splat(-INFINITY);
    for (int u = 0; u < KB / W; u++) {
        vec x = dots[u] * scale;
        memcpy(sc + u * W, &x, sizeof x);
        if ((u + 1) * W <= n) vmax = pick(x > vmax, x, vmax);
    }
    float bm = hmax(vmax);
    for (int64_t t = (n / W) * W; t < n; t++) bm = sc[t] > bm ? sc[t] : bm; /* a last partial vector */
    float m = s[0], l = s[1];
    for (int v = 0; v < nv; v++) memcpy(&acc[v], s + 2 + W * v, sizeof(vec));
    if (bm > m) { /* a new maximum: rescale what was summed under the old one */
        float c = vexp(splat(m - bm))[0] * (m > -INFINITY);
        l *= c;
        for (int v = 0; v < nv; v++) acc[v] *= c;
        m = bm;
    }
    vec sums = splat(0.0f);
    for (int64_t t = 0; t < n; t += W) {
        vec e = vexp(ld(sc, t, 0) - m);
        for (int64_t k = n - t; k < W; k++) e[k] = 0.0f; /* past the block: not summed */
        memcpy(sc + t, &e, sizeof e);
        sums += e;
    }
    for (int64_t t = 0; t < n; t++) {
        const float e = sc[t];
        for (int v = 0; v < nv; v++) acc[v] += e * ld(vb, t * dim + W * v, 0);
    }
    s[0] = m;
    s[1] = l + hsum(sums);
    for (int v = 0; v < nv; v++) memcpy(s + 2 + W * v, &acc[v], sizeof(vec));
}

/* The partial softmax of every query head of kv head j of `nrows` rows (rows[0..nrows-1],
 * their pairs k0 + i) over the span's positions lo..hi-1, blocked by KB positions:
 * state[(pair * h + g) * (dim + 2)] = m, l, acc[dim]. q [rows, h, dim] holds the rotated queries.
 * A block's keys are first transposed into kt [dim][KB] (and its values converted to float32),
 * once for all the task's queries: a query's KB scores are then dim vector multiply-adds across
 * keys, with no horizontal sum per key as the per-row kernel needs. */
INLINE void span_partial_n(const void *q, const void *K, const void *V, const float *KS, const float *VS,
                           const int64_t *slots, int64_t stride, int64_t off, int64_t sst, int64_t sof, int64_t lo,
                           int64_t hi, const int64_t *rows, int64_t nrows, int64_t k0, int64_t h, int64_t j,
                           int64_t group, float *state, float scale, const int nv, const int bf, const int q8) {
    const int64_t dim = nv * W, sw = dim + 2;
    for (int64_t i = 0; i < nrows; i++)
        for (int64_t g = j * group; g < (j + 1) * group; g++) {
            float *s = state + ((k0 + i) * h + g) * sw;
            s[0] = -INFINITY;
            s[1] = 0.0f;
            memset(s + 2, 0, sizeof(float) * (size_t)dim);
        }
    float kt[MAX_VECTORS * W * KB] __attribute__((aligned(64)));
    float vb[KB * MAX_VECTORS * W] __attribute__((aligned(64)));
    for (int64_t t0 = lo; t0 < hi; t0 += KB) {
        const int64_t n = hi - t0 < KB ? hi - t0 : KB;
        for (int64_t t = 0; t < KB; t++) {
            if (t < n) {
                int64_t at = slots[t0 + t] * stride + off;
                /* an int8 pool's keys and values dequantised here, once per block for every query */
                const float kscale = q8 ? KS[slots[t0 + t] * sst + sof] : 1.0f;
                const float vscale = q8 ? VS[slots[t0 + t] * sst + sof] : 1.0f;
                for (int v = 0; v < nv; v++) {
                    vec kv = ldkv(K, at + W * v, bf, q8);
                    if (q8) kv *= kscale;
                    for (int e = 0; e < W; e++) kt[(W * v + e) * KB + t] = kv[e];
                    vec vv = ldkv(V, at + W * v, bf, q8);
                    if (q8) vv *= vscale;
                    memcpy(vb + t * dim + W * v, &vv, sizeof vv);
                }
            } else {
                for (int64_t d = 0; d < dim; d++) kt[d * KB + t] = 0.0f;
            }
        }
        /* queries two at a time: each key vector loaded serves two of them */
        const int64_t nq = nrows * group;
        for (int64_t a = 0; a < nq; a += 2) {
            const int two = a + 1 < nq;
            vec d0[KB / W], d1[KB / W];
            float q0[MAX_VECTORS * W], q1[MAX_VECTORS * W];
            int64_t qa = a * dim, qb = two ? (a + 1) * dim : qa; /* q: this task's rotated queries */
            for (int v = 0; v < nv; v++) {
                vec x = ld(q, qa + W * v, bf), y = ld(q, qb + W * v, bf);
                memcpy(q0 + W * v, &x, sizeof x);
                memcpy(q1 + W * v, &y, sizeof y);
            }
            for (int u = 0; u < KB / W; u++) d0[u] = d1[u] = splat(0.0f);
            for (int64_t d = 0; d < dim; d++) {
                const float x = q0[d], y = q1[d];
                for (int u = 0; u < KB / W; u++) {
                    const vec kv = ld(kt, d * KB + u * W, 0);
                    d0[u] += x * kv;
                    d1[u] += y * kv;
                }
            }
            block_update(state + ((k0 + a / group) * h + j * group + a % group) * sw, d0, n, scale, vb, nv);
            if (two) block_update(state + ((k0 + (a + 1) / group) * h + j * group + (a + 1) % group) * sw, d1, n, scale,
                                  vb, nv);
        }
    }
}

#define SPAN_PARTIAL(NV) \
    span_partial_n(q, K, V, KS, VS, slots, stride, off, sst, sof, lo, hi, rows, nrows, k0, h, j, group, state, scale, \
                   NV, bf, q8)

INLINE void span_partial(const void *q, const void *K, const void *V, const float *KS, const float *VS,
                         const int64_t *slots, int64_t stride, int64_t off, int64_t sst, int64_t sof, int64_t lo,
                         int64_t hi, const int64_t *rows, int64_t nrows, int64_t k0, int64_t h, int64_t j,
                         int64_t group, float *state, float scale, int64_t nv, const int bf, const int q8) {
    switch (nv * W) {
    case 64: SPAN_PARTIAL(64 / W); break;
    case 128: SPAN_PARTIAL(128 / W); break;
    case 256: SPAN_PARTIAL(256 / W); break;
    default: SPAN_PARTIAL((int)nv);
    }
}

#define HEAD_PARTIAL(NV) \
    head_partial_n(q, qi, K, V, KS, VS, slots, stride, off, hk, j, scores, lo, pos, scale, 0.0f, acc, &s[0], &s[1], NV, \
                   bf, q8)

/* Row r, kv head j (its new key and value already written by write_new): rotate its query heads
 * into q [rows, h, dim], and leave each query head's partial softmax over the row's private
 * positions private_from[r]..pos in state [rows, h, dim + 2]. */
INLINE void private_task(const void *qkv, const void *cs, const void *sn, const int64_t *lengths,
                         const int64_t *table, int64_t width, void *kc, void *vc, float *ks, float *vs, void *q,
                         float *state, const sharing_desc *sh, int64_t r, int64_t j, int64_t h, int64_t hk,
                         int64_t dim, float scale, float *scores, const int64_t *shift, const int bf, const int q8) {
    int64_t stride_qkv = (h + 2 * hk) * dim, group = h / hk, nv = dim / W;
    int64_t pos = lengths[r], lo = sh->private_from[r];
    int64_t row = r * stride_qkv, at = (pos + (shift ? shift[r] : 0)) * dim;
    const int64_t *slots = table + r * width;
    const void *K = kc, *V = vc;
    const float *KS = ks, *VS = vs;
    int64_t stride = hk * dim, off = j * dim;
    for (int64_t g = j * group; g < (j + 1) * group; g++) {
        int64_t qi = (r * h + g) * dim;
        rope(qkv, row + g * dim, cs, sn, at, q, qi, dim, bf);
        float *s = state + (r * h + g) * (dim + 2);
        vec acc[MAX_VECTORS];
        switch (dim) {
        case 64: HEAD_PARTIAL(64 / W); break;
        case 128: HEAD_PARTIAL(128 / W); break;
        case 256: HEAD_PARTIAL(256 / W); break;
        default: HEAD_PARTIAL((int)nv);
        }
        for (int64_t v = 0; v < nv; v++) memcpy(s + 2 + W * v, &acc[v], sizeof(vec));
    }
}

/* out[r, g] = the merge of row r's private part and its spans' parts for query head g */
INLINE void merge_task(const float *priv, const float *pstate, const sharing_desc *sh, void *out, int64_t r,
                       int64_t g, int64_t h, int64_t dim, const int bf) {
    const int64_t sw = dim + 2, nv = dim / W;
    const float *p = priv + (r * h + g) * sw;
    float m = p[0];
    for (int64_t e = sh->row_ptr[r]; e < sh->row_ptr[r + 1]; e++) {
        float mk = pstate[(sh->pairs[e] * h + g) * sw];
        m = mk > m ? mk : m;
    }
    vec acc[MAX_VECTORS];
    float c = vexp(splat(p[0] - m))[0], l = p[1] * c;
    for (int64_t v = 0; v < nv; v++) {
        memcpy(&acc[v], p + 2 + W * v, sizeof(vec));
        acc[v] *= c;
    }
    for (int64_t e = sh->row_ptr[r]; e < sh->row_ptr[r + 1]; e++) {
        const float *s = pstate + (sh->pairs[e] * h + g) * sw;
        float ck = vexp(splat(s[0] - m))[0];
        l += s[1] * ck;
        for (int64_t v = 0; v < nv; v++) {
            vec a;
            memcpy(&a, s + 2 + W * v, sizeof(vec));
            acc[v] += a * ck;
        }
    }
    float inv = 1.0f / l;
    for (int64_t v = 0; v < nv; v++) st(out, (r * h + g) * dim + W * v, acc[v] * inv, bf);
}

INLINE int rope_attend_shared_t(const void *qkv, const void *cs, const void *sn, const int64_t *lengths,
                                const int64_t *table, int64_t width, void *kc, void *vc, float *ks, float *vs,
                                void *out, int64_t rows, int64_t h, int64_t hk, int64_t dim, int64_t threads,
                                float scale, const sharing_desc *sh, const int64_t *shift, const int bf, const int q8) {
    int64_t longest = 0, group = h / hk, sw = dim + 2;
    for (int64_t r = 0; r < rows; r++) longest = lengths[r] > longest ? lengths[r] : longest;
    /* q [rows, h, dim] in the activations' dtype (4 bytes an element is room for either), the
     * private parts' states [rows, h, dim + 2], the spans' [pairs, h, dim + 2] */
    size_t nq = (size_t)(rows * h * dim), npriv = (size_t)(rows * h * sw), npairs = (size_t)(sh->npairs * h * sw);
    float *buf = malloc(sizeof(float) * (nq + npriv + npairs));
    if (!buf) return -1;
    float *q = buf, *priv = buf + nq, *pstate = priv + npriv;
    /* span tasks: (span, kv head, block of SPAN_ROWS rows); long spans come in pieces (sharing.py) */
    int64_t chunks = 0;
    for (int64_t s = 0; s < sh->spans; s++) chunks += (sh->ptr[s + 1] - sh->ptr[s] + SPAN_ROWS - 1) / SPAN_ROWS;
    int failed = 0;
    /* per thread: scores, then a span task's rotated queries */
    size_t scratch = (size_t)(longest + 1 + W + dim), qspan = (size_t)(SPAN_ROWS * group * dim);
    const int64_t privates = rows * hk;
    /* One loop of independent tasks, so a call has a single barrier (a thread descheduled by a busy
     * machine stalls every barrier a time slice): a row's private task writes its new key and
     * value and reads positions from private_from on; a span task reads only shared positions,
     * below every private_from, and rotates its rows' queries itself. */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scores = malloc(sizeof(float) * (scratch + qspan));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < privates + chunks * hk; task++) {
            if (!scores) continue;
            if (task < privates) {
                private_task(qkv, cs, sn, lengths, table, width, kc, vc, ks, vs, q, priv, sh, task / hk, task % hk, h,
                             hk, dim, scale, scores, shift, bf, q8);
                continue;
            }
            int64_t c = (task - privates) / hk, j = (task - privates) % hk, s = 0;
            for (;; s++) { /* the span of chunk c */
                int64_t n = (sh->ptr[s + 1] - sh->ptr[s] + SPAN_ROWS - 1) / SPAN_ROWS;
                if (c < n) break;
                c -= n;
            }
            int64_t k0 = sh->ptr[s] + c * SPAN_ROWS, end = sh->ptr[s + 1];
            int64_t nrows = end - k0 < SPAN_ROWS ? end - k0 : SPAN_ROWS;
            float *qt = scores + scratch;
            for (int64_t i = 0; i < nrows; i++) { /* the rows' query heads of kv head j, rotated as private_task does */
                int64_t r = sh->rows[k0 + i];
                for (int64_t g = 0; g < group; g++)
                    rope(qkv, r * (h + 2 * hk) * dim + (j * group + g) * dim, cs, sn,
                         (lengths[r] + (shift ? shift[r] : 0)) * dim, qt,
                         (i * group + g) * dim, dim, bf);
            }
            const int64_t *slots = table + sh->rows[sh->ptr[s]] * width; /* the span's slots: any of its rows' */
            span_partial(qt, kc, vc, ks, vs, slots, hk * dim, j * dim, hk, j, sh->lo[s], sh->hi[s], sh->rows + k0,
                         nrows, k0, h, j, group, pstate, scale, dim / W, bf, q8);
        }
        free(scores);
    }
    /* the merge: a few vector operations per (row, head, part), on this thread */
    if (!failed)
        for (int64_t task = 0; task < rows * h; task++) merge_task(priv, pstate, sh, out, task / h, task % h, h, dim, bf);
    free(buf);
    return failed ? -1 : 0;
}

/* One new token per row, at position lengths[r]:
 *   qkv [rows, (h + 2 hk) * dim]: q heads, then k heads, then v heads (the fused projection);
 *   cs, sn [positions, dim] (cos, sin); table [rows, width]: the KV slot of each position of each row;
 *   kc, vc [slots, hk, dim] (the layer's KV pool): the activations' type, or int8 codes when ks, vs
 *   (their scales, [slots, hk] float32) are not NULL.
 * Writes every row's rotated k and its v in slot table[r, lengths[r]] first (write_new: a row's
 * table may list another row's new slot, as a verify's drafted tokens do), then for every query head g (kv
 * head g / (h / hk)) out[r, g] = softmax(q . K^T / sqrt(dim)) V over positions lo..pos (lo > 0
 * only with a sliding window). out [rows, h * dim]. Work is split over up to `threads` OpenMP
 * threads by (row, kv head) when compiled with OpenMP. With `sh` (not NULL; no sliding window),
 * the positions rows share are attended once for all of them (shared-prefix attention, above).
 * shift, sinks, probs: dropped positions (drop_args above; each may be NULL; sinks and probs not
 * with sharing or a sliding window, shift not with a sliding window).
 * scale: what q . k is multiplied by (<= 0: 1 / sqrt(dim)); cap > 0: scores soft-capped to
 * cap * tanh(score / cap) before the softmax (Gemma 2; not with sharing).
 * Returns 0; -1 out of memory; -2 dim > 256; -3 sharing with a sliding window; -4 sinks or probs
 * with sharing, or dropped positions with a sliding window; -5 sharing with soft-capping. */
#define SHARED(BF, Q8) \
    rope_attend_shared_t(qkv, cs, sn, lengths, table, width, kc, vc, ks, vs, out, rows, h, hk, dim, threads, scale, sh, \
                         shift, BF, Q8)
#define PER_ROW(BF, Q8) \
    rope_attend_t(qkv, cs, sn, lengths, table, width, kc, vc, ks, vs, out, rows, h, hk, dim, window, threads, scale, cap, \
                  &dr, BF, Q8)

/* Every row's rotated new key and its value, every kv head, into slot table[r, lengths[r]]:
 * all of them before any row attends, so a row may attend another row's new key in the same
 * call. A speculative verify relies on it: each drafted token is a row of its own whose table
 * lists its ancestors' new slots (LlamaModel._verify_fused). On this thread: rows x kv heads
 * RoPEs and copies of head_dim elements, microseconds beside the attention that follows. */
INLINE void write_new(const void *qkv, const void *cs, const void *sn, const int64_t *lengths, const int64_t *table,
                      int64_t width, void *kc, void *vc, float *ks, float *vs, int64_t rows, int64_t h, int64_t hk,
                      int64_t dim, const int64_t *shift, const int bf, const int q8) {
    float tmp[W * MAX_VECTORS] __attribute__((aligned(64))); /* a rotated key before it is quantised */
    const int64_t stride = (h + 2 * hk) * dim;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = lengths[r], slot = table[r * width + pos];
        const int64_t at = (pos + (shift ? shift[r] : 0)) * dim;
        for (int64_t j = 0; j < hk; j++)
            put_kv(qkv, r * stride + (h + j) * dim, r * stride + (h + hk + j) * dim, cs, sn, at, kc, vc, ks, vs,
                   slot * hk * dim + j * dim, slot * hk + j, dim, tmp, bf, q8);
    }
}

int rope_attend_ex(const void *qkv, const void *cs, const void *sn, const int64_t *lengths, const int64_t *table,
                   int64_t width, void *kc, void *vc, float *ks, float *vs, void *out, int64_t rows, int64_t h,
                   int64_t hk, int64_t dim, int64_t window, int64_t threads, int bf16, const sharing_desc *sh,
                   const int64_t *shift, const int64_t *sinks, float *probs, float scale, float cap) {
    if (dim > W * MAX_VECTORS) return -2;
    const int q8 = ks != NULL;
    const drop_args dr = {shift, sinks, probs};
    if (scale <= 0.0f) scale = 1.0f / sqrtf((float)dim);
    if (window > 0 && (shift || sinks || probs)) return -4;
    if (sh && sh->spans && window > 0) return -3;
    if (sh && sh->spans && cap > 0.0f) return -5;
    if (sh && sh->spans && (sinks || probs)) return -4;
    if (bf16) write_new(qkv, cs, sn, lengths, table, width, kc, vc, ks, vs, rows, h, hk, dim, shift, 1, q8);
    else write_new(qkv, cs, sn, lengths, table, width, kc, vc, ks, vs, rows, h, hk, dim, shift, 0, q8);
    if (sh && sh->spans) {
        if (q8) return bf16 ? SHARED(1, 1) : SHARED(0, 1);
        return bf16 ? SHARED(1, 0) : SHARED(0, 0);
    }
    if (q8) return bf16 ? PER_ROW(1, 1) : PER_ROW(0, 1);
    return bf16 ? PER_ROW(1, 0) : PER_ROW(0, 0);
}

/* rope_attend_ex with the Llama layer's attention: scale 1 / sqrt(dim), no soft-capping */
int rope_attend(const void *qkv, const void *cs, const void *sn, const int64_t *lengths, const int64_t *table,
                int64_t width, void *kc, void *vc, float *ks, float *vs, void *out, int64_t rows, int64_t h,
                int64_t hk, int64_t dim, int64_t window, int64_t threads, int bf16, const sharing_desc *sh,
                const int64_t *shift, const int64_t *sinks, float *probs) {
    return rope_attend_ex(qkv, cs, sn, lengths, table, width, kc, vc, ks, vs, out, rows, h, hk, dim, window, threads,
                          bf16, sh, shift, sinks, probs, 0.0f, 0.0f);
}

/* ---- every layer of a one-token step in one call ----------------------------------------------- *
 * A batch-1 step of a small quantised model is a few hundred kernel calls of microseconds each;
 * driven from Python each cost several microseconds more than its work (argument conversion, a
 * tensor allocation, the model's loop), about a third of a SmolLM2 step on a Zen 3. When every
 * linear weight of every layer is one the quantised kernels multiply (`metaloom.models.kernels.quant`),
 * the model hands the whole stack of layers to `decode_layers`: the same kernels in the same order
 * on the same buffers as its Python loop (`LlamaModel._step_fused`), so the results are the same
 * bits. The matmuls are quant.c's own functions, reached through the pointers in each weight's
 * descriptor (the two files are built as two libraries). */

typedef int (*matmul_fn)(int t, const void *w, int64_t out, int64_t in, const void *x, int xbf, void *y, int ybf,
                         int64_t rows, int64_t threads);

typedef struct {
    matmul_fn fn;     /* quant_matmul or quant_panel_matmul, for this part's layout */
    const void *w;    /* the blocks */
    int64_t type;     /* ggml type id */
    int64_t out, in;  /* the dense weight's shape */
    int64_t parallel; /* 1: split over the step's threads (large enough), 0: one thread */
} part_desc;

#define MAX_PARTS 3 /* q, k and v of three types */

/* A linear weight: one part, or parts of different types stacked along the outputs (a GGUF may
 * keep v in Q8_0 beside q and k in Q5_0: `metaloom.models.engine.llama.Concat`), and an optional bias */
typedef struct {
    part_desc part[MAX_PARTS];
    int64_t parts, out; /* out: the parts' outputs together */
    const void *bias;   /* [out] in the activations' dtype, or NULL */
} weight_desc;

typedef struct {
    const void *attn_norm, *mlp_norm; /* [d] */
    weight_desc qkv, o, gate_up, down;
    const void *cs, *sn;              /* this layer's RoPE tables [positions, dim] */
    int64_t window;                   /* its sliding window (0: none) */
    const void *q_norm, *k_norm;      /* [dim] per-head norms before RoPE, or NULL */
    const void *post_attn, *post_mlp; /* [d] norms of the attention's and the MLP's outputs, or NULL */
} layer_desc;

/* y [rows, out] += bias, rounded as PyTorch's add of two tensors of the activations' dtype */
INLINE void add_bias_t(void *y, const void *bias, int64_t rows, int64_t out, const int bf) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i + W <= out; i += W) st(y, r * out + i, ld(y, r * out + i, bf) + ld(bias, i, bf), bf);
}

/* y [rows, w->out] = x W^T (+ bias). Parts write their outputs side by side: straight into y for
 * one row, through a scratch buffer and a copy per row for more (each part's kernel writes rows
 * of its own width), as torch.cat of the parts' products does. */
static int matmul(const weight_desc *w, const void *x, void *y, int64_t rows, int64_t threads, int bf16) {
    const size_t elem = bf16 ? 2 : 4;
    int64_t at = 0;
    for (int64_t p = 0; p < w->parts; p++) {
        const part_desc *q = w->part + p;
        int64_t nt = q->parallel ? threads : 1;
        if (w->parts == 1 || rows == 1) {
            int rc = q->fn((int)q->type, q->w, q->out, q->in, x, bf16, (char *)y + at * elem, bf16, rows, nt);
            if (rc) return rc;
        } else {
            char *tmp = malloc((size_t)(rows * q->out) * elem);
            if (!tmp) return -2;
            int rc = q->fn((int)q->type, q->w, q->out, q->in, x, bf16, tmp, bf16, rows, nt);
            for (int64_t r = 0; rc == 0 && r < rows; r++)
                memcpy((char *)y + (r * w->out + at) * elem, tmp + r * q->out * elem, (size_t)q->out * elem);
            free(tmp);
            if (rc) return rc;
        }
        at += q->out;
    }
    if (w->bias) {
        if (bf16) add_bias_t(y, w->bias, rows, w->out, 1);
        else add_bias_t(y, w->bias, rows, w->out, 0);
    }
    return 0;
}

/* Every layer of a one-token step, for `rows` rows (one new token each, at position lengths[r]),
 * each layer with its own RoPE tables, window and optional norms (layer_desc):
 *   x [rows, d]: the residual stream (the embeddings in; the stream before the last sublayer's
 *   output is added, out), delta [rows, d]: that last output (the caller's final norm adds it);
 *   y [rows, d], qkv [rows, (h + 2 hk) dim], attn [rows, h dim], gu [rows, 2 inter], act [rows,
 *   inter]: scratch; keys[i], values[i]: layer i's KV pool [slots, hk, dim] (int8 codes when
 *   kscales and vscales are not NULL: kscales[i], vscales[i] [slots, hk]); the rest as
 *   `rope_attend_ex` and `residual_rms_norm` (sh: shared-prefix attention, or NULL, used by the
 *   layers without a window only; shift, sinks, probs: dropped positions, each may be NULL; probs
 *   sums over layers); act: the gate's activation (glu_mul); scale, cap: the attention's. Returns
 *   0, or the first failing kernel's code (a matmul's -1 or -2 plus -10, rope_attend's -1 or -2). */
int decode_layers(const layer_desc *layers, int64_t n_layers, void *x, void *delta, void *y, void *qkv, void *attn,
                  void *gu, void *act, const int64_t *lengths, const int64_t *table, int64_t width,
                  void *const *keys, void *const *values, int64_t rows, int64_t d, int64_t h, int64_t hk, int64_t dim,
                  int64_t inter, int64_t attn_threads, int64_t threads, float eps, int bf16, const sharing_desc *sh,
                  void *const *kscales, void *const *vscales, const int64_t *shift, const int64_t *sinks,
                  float *probs, int glu, float scale, float cap) {
    for (int64_t i = 0; i < n_layers; i++) {
        const layer_desc *l = layers + i;
        int rc;
        residual_rms_norm(x, i ? delta : NULL, l->attn_norm, y, rows, d, eps, bf16);
        if ((rc = matmul(&l->qkv, y, qkv, rows, threads, bf16))) return rc - 10;
        if (l->q_norm) head_rms_norm(qkv, l->q_norm, l->k_norm, rows, h, hk, dim, eps, bf16);
        if ((rc = rope_attend_ex(qkv, l->cs, l->sn, lengths, table, width, keys[i], values[i],
                                 kscales ? kscales[i] : NULL, vscales ? vscales[i] : NULL, attn, rows, h, hk, dim,
                                 l->window, attn_threads, bf16, l->window > 0 ? NULL : sh, shift, sinks, probs, scale,
                                 cap)))
            return rc;
        if ((rc = matmul(&l->o, attn, delta, rows, threads, bf16))) return rc - 10;
        if (l->post_attn) residual_rms_norm(delta, NULL, l->post_attn, delta, rows, d, eps, bf16);
        residual_rms_norm(x, delta, l->mlp_norm, y, rows, d, eps, bf16);
        if ((rc = matmul(&l->gate_up, y, gu, rows, threads, bf16))) return rc - 10;
        glu_mul(gu, act, rows, inter, glu, bf16);
        if ((rc = matmul(&l->down, act, delta, rows, threads, bf16))) return rc - 10;
        if (l->post_mlp) residual_rms_norm(delta, NULL, l->post_mlp, delta, rows, d, eps, bf16);
    }
    return 0;
}
