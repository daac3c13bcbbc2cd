/* q8 activations: integer dot products over quantised weights (`--activations q8`; included by
 * quant.c, whose helpers it uses).
 *
 * Why: past a few rows a matmul over a small quantised model is bound by arithmetic, not by the
 * weight's bytes, and float32 fmas do 8 (16 on AVX-512) products an instruction, after each quant
 * was converted to float. Quantising the activations to int8 lets one instruction do 32 (AVX2
 * `vpmaddubsw` + `vpmaddwd`) or 64 (AVX-512 VNNI `vpdpbusd`; NEON `sdot` 16) products of the
 * quants themselves, summed exactly in int32: llama.cpp's scheme, which is why its wide forwards
 * are cheap.
 *
 * The arithmetic (per row of x): each 32 inputs are quantised to int8 with one float32 scale,
 * dx = max|x| / 127, q = round(x / dx) (half away from zero; llama.cpp's Q8_0 keeps dx in float16,
 * here it stays float32), so x ~ dx q with |x - dx q| <= dx / 2. A weight sub-block (16 or 32
 * elements, one scale) meets the int8 inputs in an exact int32 sum of quant products; its float
 * epilogue, in a fixed order, is acc = fma(float(isum), scale * dx, acc), and for the types whose
 * offset is not a multiple of the scale (Q4_1/Q5_1's m, the K types' dmin m) acc = fma(off,
 * c (dx S), acc) with S the inputs' int sum over the sub-block; an integer offset (Q4_0's -8,
 * Q5_0's -16, Q3_K's -4, Q6_K's -32) is folded into isum. So the result is the float64 product of
 * the dequantised weight and the dequantised inputs up to the epilogue's few roundings (no
 * rounding inside a sub-block): the cost is the inputs' quantisation, measured in
 * docs/engine.md. A row's result does not depend on the other rows or the threads, and every
 * path computes the same integers (the paths' epilogues differ only without fma, generic x86).
 *
 * Two kernels, one per layout, with quant_matmul's signature (so that fused.c's decode_layers
 * calls them through the same pointer):
 *   quant_panel_matmul_q8: the panel layout; each lane's quant word gives 4 bytes of even and 4
 *     of odd elements (`pbytes`) against the inputs' bytes broadcast, in the panel order of
 *     `q8_row` (a group's even elements, then its odd ones);
 *   quant_matmul_q8: GGUF's layout; each output's block is unpacked to int8 (`unpack_q8`, Q8_0
 *     read in place) and multiplied 32 inputs at a time, 8 lanes of 4 products each.
 * (quant_panel_matmul_q8 takes Q8_0 too, in panels of its own: quant_q8_0.h.)
 * F16 and BF16 weights have none (-1): q8 is for quantised weights. */

#if defined(__AVX512VNNI__) || defined(METALOOM_EMULATE_VNNI)
#define ML_VNNI 1
#endif

typedef int32_t i8x __attribute__((vector_size(32)));  /* 8 int32 lanes on every path */
typedef uint32_t u8x __attribute__((vector_size(32)));
typedef float f8x __attribute__((vector_size(32)));

/* ---- the inputs, quantised ------------------------------------------------------------------ */

/* A row x [in] (float32, or bfloat16 when xbf) -> q [in] int8 (perm: within each group of 8 the
 * elements 0 2 4 6 1 3 5 7, the panel kernels' order), d [in / 32] float, s [3 in / 32] int32
 * (each 32 quants' sum, then each 16's). A block holding a NaN or an infinity gets d = NaN, so
 * that every output it meets is NaN, as in float arithmetic.
 *
 * Each element's operations are the scalar statement's, one IEEE operation each (no fma:
 * NO_FMA), so every path's bits are the same; the block's max and sums do not depend on their
 * order. The x86 paths write it in intrinsics, the others in GCC's generic 8-lane vectors (NEON,
 * or two SSE halves). Scalar, it was 30% of a 16-row q8 matmul. */
#if defined(ML_AVX512)
/* The same statement in intrinsics, a block in two 16-lane vectors: GCC's generic vectors left
 * the block's max, its two sums and the narrowing to int8 to scalar code (0.65 ns an element on
 * a Zen 5, 7% of a server's samples at 32 clients). Each element's operations are the same IEEE
 * operations (vmulps, vcvttps2dq, vsubps, the comparisons), so the bits are the generic code's. */
INLINE __m512 q8_load16(const void *x, int xbf, int64_t at) {
    if (xbf)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at))), 16));
    return _mm512_loadu_ps((const float *)x + at);
}

/* round(v id) half away from zero, exactly (truncate, then the exact remainder decides), in
 * [-127, 127] */
INLINE __m512i q8_round16(__m512 v, float id) {
    const __m512 t = _mm512_mul_ps(v, _mm512_set1_ps(id));
    __m512i q = _mm512_cvttps_epi32(t);
    const __m512 f = _mm512_sub_ps(t, _mm512_cvtepi32_ps(q));
    const __m512i one = _mm512_set1_epi32(1);
    q = _mm512_mask_sub_epi32(q, _mm512_cmp_ps_mask(f, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), q, one);
    q = _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(f, _mm512_set1_ps(0.5f), _CMP_GE_OQ), q, one);
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

NO_FMA static void q8_blocks(const void *x, int xbf, int64_t in, int64_t b0, int64_t b1, int perm, int8_t *q, float *d,
                             int32_t *s) {
    const int64_t n32 = in / 32;
    const __m512i order = perm ? _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                               : _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512 largest = _mm512_set1_ps(3.4028235e38f);
    for (int64_t b = b0; b < b1; b++) {
        const __m512 v0 = q8_load16(x, xbf, 32 * b), v1 = q8_load16(x, xbf, 32 * b + 16);
        const __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), magnitude));
        const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), magnitude));
        /* bad: a lane not <= the largest float (NaN, infinity) */
        const int bad = (_mm512_cmp_ps_mask(a0, largest, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, largest, _CMP_LE_OQ)) != 0xFFFF;
        const float amax = bad ? 0.0f : _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        const float dd = amax / 127.0f, id = dd != 0.0f && !bad ? 1.0f / dd : 0.0f;
        __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
        if (!bad) {
            q0 = q8_round16(v0, id);
            q1 = q8_round16(v1, id);
        }
        const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, q0)));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, q1)));
        d[b] = bad ? NAN : dd;
        s[b] = s0 + s1;
        s[n32 + 2 * b] = s0;
        s[n32 + 2 * b + 1] = s1;
    }
}
#elif defined(__AVX2__)
/* The AVX-512 code's statement in four 8-lane vectors (see there). */
INLINE __m256 q8_load8(const void *x, int xbf, int64_t at) {
    if (xbf)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at))), 16));
    return _mm256_loadu_ps((const float *)x + at);
}

INLINE __m256i q8_round8(__m256 v, float id) {
    const __m256 t = _mm256_mul_ps(v, _mm256_set1_ps(id));
    __m256i q = _mm256_cvttps_epi32(t);
    const __m256 f = _mm256_sub_ps(t, _mm256_cvtepi32_ps(q));
    /* a true comparison is -1: q + (f <= -0.5) - (f >= 0.5) */
    q = _mm256_add_epi32(q, _mm256_castps_si256(_mm256_cmp_ps(f, _mm256_set1_ps(-0.5f), _CMP_LE_OQ)));
    q = _mm256_sub_epi32(q, _mm256_castps_si256(_mm256_cmp_ps(f, _mm256_set1_ps(0.5f), _CMP_GE_OQ)));
    return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

INLINE int32_t q8_sum8(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}

NO_FMA static void q8_blocks(const void *x, int xbf, int64_t in, int64_t b0, int64_t b1, int perm, int8_t *q, float *d,
                             int32_t *s) {
    const int64_t n32 = in / 32;
    const __m256i order = perm ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7) : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    /* each 128-bit lane's int32 low bytes to its first 4 bytes, then lane 1's next to lane 0's */
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256 largest = _mm256_set1_ps(3.4028235e38f);
    for (int64_t b = b0; b < b1; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        int ok = 0xFF;
        for (int j = 0; j < 4; j++) {
            v[j] = q8_load8(x, xbf, 32 * b + 8 * j);
            const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v[j]), magnitude));
            ok &= _mm256_movemask_ps(_mm256_cmp_ps(a, largest, _CMP_LE_OQ));
            m = _mm256_max_ps(m, a);
        }
        const int bad = ok != 0xFF;
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = bad ? 0.0f : _mm_cvtss_f32(h);
        const float dd = amax / 127.0f, id = dd != 0.0f && !bad ? 1.0f / dd : 0.0f;
        int32_t s16[2] = {0, 0};
        for (int j = 0; j < 4; j++) {
            const __m256i qi = bad ? _mm256_setzero_si256() : q8_round8(v[j], id);
            s16[j / 2] += q8_sum8(qi);
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(qi, order), low_bytes), join);
            _mm_storel_epi64((__m128i *)(q + 32 * b + 8 * j), _mm256_castsi256_si128(bytes));
        }
        d[b] = bad ? NAN : dd;
        s[b] = s16[0] + s16[1];
        s[n32 + 2 * b] = s16[0];
        s[n32 + 2 * b + 1] = s16[1];
    }
}
#else
typedef int8_t q8b8 __attribute__((vector_size(8)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
NO_FMA static void q8_blocks(const void *x, int xbf, int64_t in, int64_t b0, int64_t b1, int perm, int8_t *q, float *d,
                             int32_t *s) {
    const int64_t n32 = in / 32;
    const i8x lim = {127, 127, 127, 127, 127, 127, 127, 127};
    for (int64_t b = b0; b < b1; b++) {
        f8x v[4];
        for (int j = 0; j < 4; j++) {
            if (xbf) {
                u16x8 h;
                memcpy(&h, (const uint16_t *)x + 32 * b + 8 * j, 16);
                v[j] = (f8x)(__builtin_convertvector(h, u8x) << 16);
            } else {
                memcpy(&v[j], (const float *)x + 32 * b + 8 * j, 32);
            }
        }
        /* |v| by clearing the sign bit; bad: a lane not <= the largest float (NaN, infinity) */
        i8x badv = {0};
        f8x m = {0};
        for (int j = 0; j < 4; j++) {
            const f8x a = (f8x)((u8x)v[j] & 0x7FFFFFFFu);
            badv |= ~(a <= 3.4028235e38f);
            m = (f8x)(((i8x)m & ~(a > m)) | ((i8x)a & (a > m)));
        }
        float amax = 0.0f;
        int bad = 0;
        for (int i = 0; i < 8; i++) {
            amax = m[i] > amax ? m[i] : amax;
            bad |= badv[i] != 0;
        }
        const float dd = amax / 127.0f, id = dd != 0.0f && !bad ? 1.0f / dd : 0.0f;
        i8x sum[2] = {{0}, {0}};
        for (int j = 0; j < 4; j++) { /* round(v id) half away from zero, exactly: truncate, then the
                                          exact remainder decides (|v id| <= 127: no overflow) */
            const f8x t = bad ? (f8x){0} : v[j] * id;
            i8x qi = __builtin_convertvector(t, i8x);
            const f8x f = t - __builtin_convertvector(qi, f8x);
            qi += (i8x)(f <= -0.5f) - (i8x)(f >= 0.5f); /* a true comparison is -1 */
            qi = (qi & ~(qi > lim)) | (lim & (qi > lim));
            qi = (qi & ~(qi < -lim)) | (-lim & (qi < -lim));
            sum[j / 2] += qi;
            q8b8 qb = __builtin_convertvector(qi, q8b8);
            if (perm) /* within each group of 8: elements 0 2 4 6 1 3 5 7 */
                qb = __builtin_shuffle(qb, (q8b8){0, 2, 4, 6, 1, 3, 5, 7});
            memcpy(q + 32 * b + 8 * j, &qb, 8);
        }
        int32_t s16[2] = {0, 0};
        for (int i = 0; i < 8; i++) s16[0] += sum[0][i], s16[1] += sum[1][i];
        d[b] = bad ? NAN : dd;
        s[b] = s16[0] + s16[1];
        s[n32 + 2 * b] = s16[0];
        s[n32 + 2 * b + 1] = s16[1];
    }
}
#endif

/* the whole row: blocks 0..in / 32 - 1 */
static void q8_row(const void *x, int xbf, int64_t in, int perm, int8_t *q, float *d, int32_t *s) {
    q8_blocks(x, xbf, in, 0, in / 32, perm, q, d, s);
}

/* rows of x quantised into one buffer: q [rows][in], d [rows][in / 32], s [rows][3 in / 32] */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
    void *mem;
} q8rows;

/* q8_alloc, then q8_fill over rows [lo, hi), or inside a parallel region `q8_fill_share`: each
 * thread quantises its share of the rows' blocks before the products, which need every row: on 2
 * threads the inputs take half the time they took before the region */
static int q8_alloc(int64_t rows, int64_t in, q8rows *r) {
    const int64_t n32 = in / 32;
    const size_t qb = ((size_t)(rows * in) + 63) / 64 * 64, db = (size_t)(rows * n32) * sizeof(float);
    r->mem = aligned_alloc(64, (qb + db + (size_t)(rows * 3 * n32) * sizeof(int32_t) + 63) / 64 * 64);
    if (!r->mem) return -2;
    r->q = r->mem;
    r->d = (float *)((char *)r->mem + qb);
    r->s = (int32_t *)((char *)r->d + db);
    return 0;
}

static void q8_fill(const void *x, int xbf, int64_t lo, int64_t hi, int64_t in, int perm, const q8rows *r) {
    const int64_t n32 = in / 32;
    for (int64_t i = lo; i < hi; i++)
        q8_row((const char *)x + i * in * (xbf ? 2 : 4), xbf, in, perm, r->q + i * in, r->d + i * n32,
               r->s + i * 3 * n32);
}

/* inside a parallel region: this thread's share of the rows' blocks of 32, then a barrier. By
 * blocks, not rows: each block's quants, scale and sums are its own, so one row (a decode step)
 * splits over the threads too, where by rows one thread quantised it while the others waited. */
static void q8_fill_share(const void *x, int xbf, int64_t rows, int64_t in, int perm, const q8rows *r) {
    const int64_t n32 = in / 32;
    int64_t lo, hi;
    thread_share(rows * n32, 1, &lo, &hi);
    while (lo < hi) {
        const int64_t i = lo / n32, b0 = lo % n32, b1 = b0 + (hi - lo) < n32 ? b0 + (hi - lo) : n32;
        q8_blocks((const char *)x + i * in * (xbf ? 2 : 4), xbf, in, b0, b1, perm, r->q + i * in, r->d + i * n32,
                  r->s + i * 3 * n32);
        lo += b1 - b0;
    }
#pragma omp barrier
}

/* ---- integer dot products: per 32-bit lane, 4 bytes of weights (unsigned, or signed when sw)
 *      against 4 int8 inputs, summed into the lane's int32 ------------------------------------ */

INLINE uint32_t ld_x4(const int8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

#if defined(__AVX2__) || defined(ML_AVX512)
/* acc += dot(w, x) lane by lane for two pairs (E with xe, O with xo). Without VNNI: vpmaddubsw
 * sums pairs of u8 x s8 products into int16 (saturating: at most 2 63 127 = 16002 here, and the
 * two pairs' sum 32004 for 6-bit quants), vpmaddwd the int16 pairs into int32. Signed weights (IQ4)
 * take their sign onto the inputs (|w| <= 127), each pair in its own int16. */
INLINE i8x idot2_8(i8x acc, u8x e, uint32_t xe, u8x o, uint32_t xo, const int sw) {
    __m256i a = (__m256i)e, b = (__m256i)o, x = _mm256_set1_epi32((int)xe), y = _mm256_set1_epi32((int)xo);
    if (sw) {
        x = _mm256_sign_epi8(x, a);
        y = _mm256_sign_epi8(y, b);
        a = _mm256_abs_epi8(a);
        b = _mm256_abs_epi8(b);
    }
#if defined(ML_VNNI) && defined(ML_AVX512)
    return (i8x)_mm256_dpbusd_epi32(_mm256_dpbusd_epi32((__m256i)acc, a, x), b, y);
#else
    const __m256i one = _mm256_set1_epi16(1);
    if (sw)
        return acc + (i8x)_mm256_madd_epi16(_mm256_maddubs_epi16(a, x), one) +
               (i8x)_mm256_madd_epi16(_mm256_maddubs_epi16(b, y), one);
    return acc + (i8x)_mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, x), _mm256_maddubs_epi16(b, y)), one);
#endif
}

/* 32 signed int8 weights at w against 32 inputs at x: 8 lanes, lane i the sum of products 4i..4i+3 */
INLINE i8x idot32(const int8_t *w, const int8_t *x) {
    __m256i a = _mm256_loadu_si256((const __m256i *)w), b = _mm256_loadu_si256((const __m256i *)x);
    b = _mm256_sign_epi8(b, a);
    a = _mm256_abs_epi8(a);
#if defined(ML_VNNI) && defined(ML_AVX512)
    return (i8x)_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return (i8x)_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
INLINE int32x4_t sdot4(int32x4_t acc, const void *w, uint32_t xw) {
    int8x16_t a;
    memcpy(&a, w, 16);
    return vdotq_s32(acc, a, vreinterpretq_s8_u32(vdupq_n_u32(xw)));
}
/* sdot multiplies signed bytes: the unsigned quants (at most 63) are signed bytes as they are */
INLINE i8x idot2_8(i8x acc, u8x e, uint32_t xe, u8x o, uint32_t xo, const int sw) {
    (void)sw;
    int32x4_t lo, hi;
    memcpy(&lo, &acc, 16);
    memcpy(&hi, (char *)&acc + 16, 16);
    lo = sdot4(sdot4(lo, &e, xe), &o, xo);
    hi = sdot4(sdot4(hi, (char *)&e + 16, xe), (char *)&o + 16, xo);
    memcpy(&acc, &lo, 16);
    memcpy((char *)&acc + 16, &hi, 16);
    return acc;
}
INLINE i8x idot32(const int8_t *w, const int8_t *x) {
    int8x16_t a0 = vld1q_s8(w), a1 = vld1q_s8(w + 16), b0 = vld1q_s8(x), b1 = vld1q_s8(x + 16);
    int32x4_t lo = vdotq_s32(vdupq_n_s32(0), a0, b0), hi = vdotq_s32(vdupq_n_s32(0), a1, b1);
    i8x r;
    memcpy(&r, &lo, 16);
    memcpy((char *)&r + 16, &hi, 16);
    return r;
}
#else /* portable: byte j of each lane times input byte j */
INLINE i8x idot1_8(i8x acc, u8x w, uint32_t xw, const int sw) {
    UNROLL for (int j = 0; j < 4; j++) {
        const i8x wj = sw ? (i8x)(w << (24 - 8 * j)) >> 24 : (i8x)((w >> (8 * j)) & 0xFFu);
        acc += wj * (int32_t)(int8_t)(xw >> (8 * j));
    }
    return acc;
}
INLINE i8x idot2_8(i8x acc, u8x e, uint32_t xe, u8x o, uint32_t xo, const int sw) {
    return idot1_8(idot1_8(acc, e, xe, sw), o, xo, sw);
}
INLINE i8x idot32(const int8_t *w, const int8_t *x) {
    i8x r = {0};
    for (int i = 0; i < 32; i++) r[i / 4] += (int32_t)w[i] * x[i];
    return r;
}
#endif

/* How far ahead (in a panel's blocks) the q8 products prefetch. AVX-512: as many whole blocks
 * as fit in 4 KB, at least one, not the float products' one block (`pdist`): with integer
 * products a block of 16 rows is done long before one block ahead has come from DRAM. SmolLM2's
 * Q4_1 gate_up at 16 rows, weights from memory, took 101 us against 51 in cache, the sum of its
 * memory and compute times rather than the larger; 8 blocks (2.5 KB) ahead, 68 us (Zen 5,
 * `scripts/q8_kernel_ab.py --from-memory`; 1 row unchanged). Blocks of over 2 KB a panel
 * (Q4_K, Q5_K, Q6_K, IQ4_XS) stay one ahead: two made Qwen2.5-Coder-1.5B's (Q4_K, Q6_K) 16-row
 * step 5% slower though its kernels alone were not. The 8-lane paths keep `pdist` (4 KB rounded up): 2 KB made SmolLM2's
 * one-token step 2.5% slower on avx2. */
#define Q8_PREFETCH_BYTES 4096
INLINE int q8_pdist(const int t) {
#ifdef ML_AVX512
    const int d = Q8_PREFETCH_BYTES / (16 * block_bytes(t));
    return d > 0 ? d : 1;
#else
    return pdist(t);
#endif
}

/* ---- the panel layout ------------------------------------------------------------------------ */

/* a type's weights as scale (q + c) (c an integer, folded into the int sum), scale q + c off
 * (c off a float: Q4_1/Q5_1 m, the K types' -dmin m), or scale q (IQ4) */
INLINE int q8_int_off(const int t) { return t == Q4_0 || t == Q5_0 || t == Q3_K || t == Q6_K; }
INLINE int q8_float_off(const int t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K || t == Q2_K; }
INLINE int32_t q8_c(const int t) { return t == Q4_0 ? -8 : t == Q5_0 ? -16 : t == Q3_K ? -4 : t == Q6_K ? -32 : 0; }
/* the int sum's index into a row's s for sub-block sb of block b (as `pscales`' at) */
INLINE int64_t q8_sat(const int t, int64_t b, int sb, int64_t n32) {
    return psubs(t) == 16 ? n32 + 16 * b + sb : psubs(t) == 8 ? 8 * b + sb : b;
}

#ifdef ML_AVX512
INLINE __m512i idot2_16(__m512i acc, __m512i e, uint32_t xe, __m512i o, uint32_t xo, const int sw) {
    __m512i x = _mm512_set1_epi32((int)xe), y = _mm512_set1_epi32((int)xo);
    if (sw) { /* |w| against x with w's sign (no vpsignb in AVX-512: a masked negation) */
        x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(e), _mm512_setzero_si512(), x);
        y = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(o), _mm512_setzero_si512(), y);
        e = _mm512_abs_epi8(e);
        o = _mm512_abs_epi8(o);
    }
#ifdef ML_VNNI
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, e, x), o, y);
#else
    const __m512i one = _mm512_set1_epi16(1);
    if (sw)
        return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(e, x), one),
                                                      _mm512_madd_epi16(_mm512_maddubs_epi16(o, y), one)));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(e, x),
                                                                     _mm512_maddubs_epi16(o, y)), one));
#endif
}

/* a group's quants as bytes from `pwords`' V, H: E lane j = elements 0 2 4 6 of output j, O = 1 3 5 7 */
INLINE void pbytes(const int t, __m512i V, __m512i H, __m512i *E, __m512i *O) {
    const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F);
    if (t == Q2_K || t == Q3_K) {
        const __m512i m = _mm512_set1_epi32(t == Q2_K ? 0x03030303 : 0x07070707);
        *E = _mm512_and_si512(V, m);
        *O = _mm512_and_si512(_mm512_srli_epi32(V, 4), m);
    } else if (iq4(t)) {
        const __m512i tab = _mm512_broadcast_i32x4((__m128i)IQ4_BYTES);
        *E = _mm512_shuffle_epi8(tab, _mm512_and_si512(V, m4));
        *O = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi32(V, 4), m4));
    } else {
        *E = _mm512_and_si512(V, m4);
        *O = _mm512_and_si512(_mm512_srli_epi32(V, 4), m4);
        if (five_bit(t) || t == Q6_K) { /* element k's high bits at 4k + 4 of H (at 0 for k = 7) */
            const int hm = t == Q6_K ? 0x30303030 : 0x10101010;
            *E = _mm512_or_si512(*E, _mm512_and_si512(H, _mm512_set1_epi32(hm)));
            *O = _mm512_ternarylogic_epi32(*O, _mm512_srli_epi32(H, 4), _mm512_set1_epi32(hm & 0x00FFFFFF), 0xF8);
            *O = _mm512_ternarylogic_epi32(*O, _mm512_slli_epi32(H, 28), _mm512_set1_epi32(hm & (int)0xFF000000), 0xF8);
        }
    }
}

/* sub-block sb's epilogue for one row: acc += float(isum) (scale dx) (+ off c dx S) */
INLINE __m512 q8_epilogue(const int t, __m512 acc, __m512i isum, __m512 scale, __m512 off, float c, float dx,
                          int32_t S) {
    if (q8_int_off(t)) isum = _mm512_add_epi32(isum, _mm512_set1_epi32(q8_c(t) * S));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc);
    if (q8_float_off(t)) acc = _mm512_fmadd_ps(off, _mm512_set1_ps(c * (dx * (float)S)), acc);
    return acc;
}

/* R rows (up to PANEL_ROWS) of quantised x against panel p: each group's bytes made once for all
 * rows (kept in L1 over a sub-block), each row's int sums in registers */
INLINE void q8_prows(const int t, const uint8_t *pw, int64_t nb, const q8rows *x, int64_t in, int64_t p, void *y,
                     int64_t out, int ybf, int R) {
    const int BB16 = 16 * block_bytes(t), SUBS = psubs(t), GROUPS = pgroups(t), SE = 8 * GROUPS;
    const int64_t pb = nb * BB16, n32 = in / 32;
    __m512 acc[PANEL_ROWS];
    __m512i E[4], O[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t g = p * nb + b;
        const uint8_t *P = pw + g * BB16;
        for (int sb = 0; sb < SUBS; sb++) {
            pprefetch_at(t, pw, pb, p, b, sb, 1, q8_pdist(t));
            for (int v = 0; v < GROUPS; v++) {
                __m512i V, H = _mm512_setzero_si512();
                pwords(t, P, g, sb, v, &V, &H);
                pbytes(t, V, H, &E[v], &O[v]);
            }
            __m512 scale, off;
            float c;
            int64_t at;
            pscales(t, P, g, b, sb, n32, &scale, &off, &c, &at);
            const int64_t e0 = b * SUBS * SE + sb * SE, blk = e0 / 32, sat = q8_sat(t, b, sb, n32);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x->q + r * in + e0;
                __m512i isum = _mm512_setzero_si512();
                UNROLL for (int v = 0; v < 4; v++)
                    if (v < GROUPS) isum = idot2_16(isum, E[v], ld_x4(xq + 8 * v), O[v], ld_x4(xq + 8 * v + 4), iq4(t));
                acc[r] = q8_epilogue(t, acc[r], isum, scale, off, c, x->d[r * n32 + blk], x->s[r * 3 * n32 + sat]);
            }
        }
    }
    for (int r = 0; r < R; r++) st(y, r * out + p * 16, (vec)acc[r], ybf);
}
#else /* ---- 8-lane paths: a panel's 16 lanes as two halves -------------------------------------- */

/* a half-group's quants as bytes from `pwords8`' (merged) V, H: E lane j = elements 0 2 4 6, O = 1 3 5 7 */
INLINE void pbytes8(const int t, vecu V, vecu H, u8x *E, u8x *O) {
    if (t == Q2_K || t == Q3_K) {
        const unsigned m = t == Q2_K ? 0x03030303u : 0x07070707u;
        *E = (u8x)(V & m);
        *O = (u8x)((V >> 4) & m);
    } else if (iq4(t)) {
        *E = (u8x)V;
        *O = (u8x)H;
    } else if (five_bit(t) || t == Q6_K) { /* merged: V the even elements' whole quants, H the odd ones' */
        const unsigned m = t == Q6_K ? 0x3F3F3F3Fu : 0x1F1F1F1Fu;
        *E = (u8x)(V & m);
        *O = (u8x)(((H >> 4) & m) | ((H << 28) & (m & 0x30000000u)));
    } else {
        *E = (u8x)(V & 0x0F0F0F0Fu);
        *O = (u8x)((V >> 4) & 0x0F0F0F0Fu);
    }
}

/* a b + c, rounded once on x86 with FMA: written out rather than left to GCC's contraction,
 * which code around an inlined epilogue can undo (a product hoisted out, then added apart) */
INLINE vec fma8(vec a, vec b, vec c) {
#if defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

INLINE vec q8_epilogue8(const int t, vec acc, i8x isum, vec scale, vec off, float c, float dx, int32_t S) {
    if (q8_int_off(t)) isum += q8_c(t) * S;
    acc = fma8(__builtin_convertvector(isum, vec), scale * splat(dx), acc);
    if (q8_float_off(t)) acc = fma8(off, splat(c * (dx * (float)S)), acc);
    return acc;
}

/* Rows in blocks of Q8_RB, each block's int sums in registers over a sub-block. AVX2 without
 * VNNI: vpmaddubsw's int16 pair sums are added up over as many groups as cannot overflow
 * (`q8_run`: 4 groups of 4-bit quants, 16 products of at most 15 127 each = 30480; 2 of 5-bit;
 * 1 of 6-bit) before one vpmaddwd widens them; IQ4's signed values widen each product pair. */
#if defined(__AVX2__) || defined(__ARM_FEATURE_DOTPROD)
#define Q8_RB 4
#else /* the portable products: one row at a time (unrolled over 4 it cost 20 s more to compile) */
#define Q8_RB 1
#endif
#if defined(__AVX2__)
INLINE int q8_run(const int t) { return t == Q6_K ? 1 : five_bit(t) ? 2 : 4; }
#endif

#if defined(__AVX2__) && !defined(ML_VNNI)
/* Up to Q8_FEW - 1 rows (a one-token step, a verify of 2 or 3 tokens) take `q8_few_avx2`: 1.2-1.45x
 * faster there than the loop of `q8_prows` below, and slower at 4 to 16 rows (0.8-0.95x), where
 * that loop stays (scripts/q8_kernel_ab.py, AMD EPYC Zen 3). */
#define Q8_FEW 4

/* NR rows (a constant where it is inlined) of one sub-block: each group's four weight vectors
 * against each row's two broadcast input words, vpmaddubsw's int16 pair sums added up over
 * `q8_run` groups, then widened by vpmaddwd into the int32 sums, then the epilogue. The sums are
 * exact, so they do not depend on the order of the adds. */
INLINE void q8_nrows_avx2(const int t, const int NR, u8x E[4][2], u8x O[4][2], const int8_t *xq, int64_t in,
                          const float *dx, const int32_t *S, int64_t n32, const vec *scale, const vec *off, float c,
                          vec *acc) {
    const int GROUPS = pgroups(t), RUN = q8_run(t);
    const __m256i one = _mm256_set1_epi16(1);
    __m256i s16[3][2];
    i8x isum[3][2];
    UNROLL for (int i = 0; i < NR; i++) s16[i][0] = s16[i][1] = _mm256_setzero_si256(), isum[i][0] = isum[i][1] = (i8x){0};
    UNROLL for (int v = 0; v < 4; v++) {
        if (v >= GROUPS) continue;
        const __m256i e0 = (__m256i)E[v][0], e1 = (__m256i)E[v][1], o0 = (__m256i)O[v][0], o1 = (__m256i)O[v][1];
        UNROLL for (int i = 0; i < NR; i++) {
            const __m256i xe = _mm256_set1_epi32((int)ld_x4(xq + i * in + 8 * v));
            const __m256i xo = _mm256_set1_epi32((int)ld_x4(xq + i * in + 8 * v + 4));
            s16[i][0] = _mm256_add_epi16(s16[i][0], _mm256_add_epi16(_mm256_maddubs_epi16(e0, xe), _mm256_maddubs_epi16(o0, xo)));
            s16[i][1] = _mm256_add_epi16(s16[i][1], _mm256_add_epi16(_mm256_maddubs_epi16(e1, xe), _mm256_maddubs_epi16(o1, xo)));
            /* kept in its register here: else GCC reassociates a run's adds into a tree and
             * spills every product to the stack first (1.25x slower) */
            __asm__("" : "+x"(s16[i][0]), "+x"(s16[i][1]));
        }
        if ((v + 1) % RUN == 0 || v == GROUPS - 1)
            UNROLL for (int i = 0; i < NR; i++) UNROLL for (int h = 0; h < 2; h++) {
                isum[i][h] += (i8x)_mm256_madd_epi16(s16[i][h], one);
                s16[i][h] = _mm256_setzero_si256();
            }
    }
    UNROLL for (int i = 0; i < NR; i++) UNROLL for (int h = 0; h < 2; h++)
        acc[2 * i + h] = q8_epilogue8(t, acc[2 * i + h], isum[i][h], scale[h], off[h], c, dx[i * n32], S[i * 3 * n32]);
}

/* R < Q8_FEW rows of one sub-block (the group bytes E, O from `pbytes8`): all rows in one block,
 * inlined with NR a constant */
INLINE void q8_few_avx2(const int t, u8x E[4][2], u8x O[4][2], const q8rows *x, int64_t in, int64_t e0, int64_t blk,
                        int64_t sat, int64_t n32, const vec *scale, const vec *off, float c, vec *acc, int R) {
    const int8_t *xq = x->q + e0;
    const float *dx = x->d + blk;
    const int32_t *S = x->s + sat;
    if (R == 1) q8_nrows_avx2(t, 1, E, O, xq, in, dx, S, n32, scale, off, c, acc);
    else if (R == 2) q8_nrows_avx2(t, 2, E, O, xq, in, dx, S, n32, scale, off, c, acc);
    else q8_nrows_avx2(t, 3, E, O, xq, in, dx, S, n32, scale, off, c, acc);
}
#endif

INLINE void q8_prows(const int t, const uint8_t *pw, int64_t nb, const q8rows *x, int64_t in, int64_t p, void *y,
                     int64_t out, int ybf, int R) {
    const int BB16 = 16 * block_bytes(t), SUBS = psubs(t), GROUPS = pgroups(t), SE = 8 * GROUPS;
    const int64_t pb = nb * BB16, n32 = in / 32;
    vec acc[2 * PANEL_ROWS];
    u8x E[4][2], O[4][2];
    for (int r = 0; r < 2 * R; r++) acc[r] = splat(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t g = p * nb + b;
        const uint8_t *P = pw + g * BB16;
        for (int sb = 0; sb < SUBS; sb++) {
            pprefetch_at(t, pw, pb, p, b, sb, 1, q8_pdist(t));
            for (int v = 0; v < GROUPS; v++)
                for (int h = 0; h < 2; h++) {
                    vecu V, H = (vecu){0};
                    pwords8(t, P, g, sb, v, h, &V, &H);
                    pbytes8(t, V, H, &E[v][h], &O[v][h]);
                }
            vec scale[2], off[2];
            float c;
            int64_t at;
            for (int h = 0; h < 2; h++) pscales8(t, P, g, b, sb, n32, h, &scale[h], &off[h], &c, &at);
            const int64_t e0 = b * SUBS * SE + sb * SE, blk = e0 / 32, sat = q8_sat(t, b, sb, n32);
#if defined(__AVX2__) && !defined(ML_VNNI)
            if (!iq4(t) && R < Q8_FEW) {
                q8_few_avx2(t, E, O, x, in, e0, blk, sat, n32, scale, off, c, acc, R);
                continue;
            }
#endif
            for (int r0 = 0; r0 < R; r0 += Q8_RB) {
                const int nr = R - r0 < Q8_RB ? R - r0 : Q8_RB;
                i8x isum[Q8_RB][2];
                UNROLL for (int i = 0; i < Q8_RB; i++) isum[i][0] = isum[i][1] = (i8x){0};
#if defined(__AVX2__) && !defined(ML_VNNI)
                if (!iq4(t)) {
                    const __m256i one = _mm256_set1_epi16(1);
                    __m256i s16[Q8_RB][2];
                    UNROLL for (int i = 0; i < Q8_RB; i++) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
                    UNROLL for (int v = 0; v < 4; v++) {
                        if (v >= GROUPS) continue;
                        UNROLL for (int i = 0; i < Q8_RB; i++) {
                            if (i >= nr) continue;
                            const int8_t *xq = x->q + (r0 + i) * in + e0 + 8 * v;
                            const __m256i xe = _mm256_set1_epi32((int)ld_x4(xq)), xo = _mm256_set1_epi32((int)ld_x4(xq + 4));
                            UNROLL for (int h = 0; h < 2; h++)
                                s16[i][h] = _mm256_add_epi16(_mm256_add_epi16(s16[i][h], _mm256_maddubs_epi16((__m256i)E[v][h], xe)),
                                                             _mm256_maddubs_epi16((__m256i)O[v][h], xo));
                        }
                        if ((v + 1) % q8_run(t) == 0 || v == GROUPS - 1)
                            UNROLL for (int i = 0; i < Q8_RB; i++) UNROLL for (int h = 0; h < 2; h++) {
                                isum[i][h] += (i8x)_mm256_madd_epi16(s16[i][h], one);
                                s16[i][h] = _mm256_setzero_si256();
                            }
                    }
                } else
#endif
                {
                    UNROLL for (int v = 0; v < 4; v++) {
                        if (v >= GROUPS) continue;
                        UNROLL for (int i = 0; i < Q8_RB; i++) {
                            if (i >= nr) continue;
                            const int8_t *xq = x->q + (r0 + i) * in + e0 + 8 * v;
                            const uint32_t xe = ld_x4(xq), xo = ld_x4(xq + 4);
                            UNROLL for (int h = 0; h < 2; h++) isum[i][h] = idot2_8(isum[i][h], E[v][h], xe, O[v][h], xo, iq4(t));
                        }
                    }
                }
                UNROLL for (int i = 0; i < Q8_RB; i++) {
                    if (i >= nr) continue;
                    const int r = r0 + i;
                    const float dx = x->d[r * n32 + blk];
                    const int32_t S = x->s[r * 3 * n32 + sat];
                    UNROLL for (int h = 0; h < 2; h++)
                        acc[2 * r + h] = q8_epilogue8(t, acc[2 * r + h], isum[i][h], scale[h], off[h], c, dx, S);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) st(y, r * out + p * 16 + 8 * h, acc[2 * r + h], ybf);
}
#endif

#define Q8_PROWS(TY)                                                                               \
    static __attribute__((noinline)) void q8p_##TY(const uint8_t *pw, int64_t nb, const q8rows *x, int64_t in,         \
                                                   int64_t p, void *y, int64_t out, int ybf, int R) {                \
        q8_prows(TY, pw, nb, x, in, p, y, out, ybf, R);                                            \
    }
PANEL_TYPES(Q8_PROWS)
typedef void (*q8p_fn)(const uint8_t *, int64_t, const q8rows *, int64_t, int64_t, void *, int64_t, int, int);
#define Q8P_CASE(TY) case TY: return q8p_##TY;
static q8p_fn q8p_of(int t) { switch (t) { PANEL_TYPES(Q8P_CASE) default: return NULL; } }

#include "quant_q8_0.h" /* Q8_0 in panels of its own: the output heads */

/* y [rows, out] = x W^T for W in the panel layout, x quantised to int8 per 32 inputs (the
 * module's note). Returns 0; -1 a type without panels, `in` not a multiple of its block or `out`
 * of 16; -2 out of memory. */
#if ML_PART(2)
int quant_panel_matmul_q8(int t, const uint8_t *pw, int64_t out, int64_t in, const void *x, int xbf, void *y,
                          int ybf, int64_t rows, int64_t threads) {
    if (t == Q8_0) return q8_0_panel_matmul(pw, out, in, x, xbf, y, ybf, rows, threads);
    q8p_fn fn = q8p_of(t);
    (void)threads; /* without OpenMP */
    if (!fn || in % block_elems(t) || out % 16 || out <= 0) return -1;
    q8rows xr;
    if (q8_alloc(rows, in, &xr)) return -2;
    const int64_t nb = in / block_elems(t), np = out / 16, n32 = in / 32, elem = ybf ? 2 : 4;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        q8_fill_share(x, xbf, rows, in, 1, &xr);
        for (int64_t c = 0; c * PANEL_ROWS < rows; c++) {
            const int R = (int)(rows - c * PANEL_ROWS < PANEL_ROWS ? rows - c * PANEL_ROWS : PANEL_ROWS);
            const q8rows part = {xr.q + c * PANEL_ROWS * in, xr.d + c * PANEL_ROWS * n32, xr.s + c * PANEL_ROWS * 3 * n32,
                                 NULL};
            /* Panels go to the threads as they come for them (guided: large pieces first, then
             * smaller), not in equal shares fixed beforehand. On 2 cores that also run a server's
             * HTTP loop, one thread loses its core now and then, and with equal shares the other
             * waited for it at the region's end (half the engine thread's samples at 32 clients,
             * in libgomp). A panel's outputs are one thread's whole: the bits do not depend on who
             * took it. `bench serve --clients 32`: 488 -> 504 tok/s with the vector inputs above
             * (docs/performance.md). The head's Q8_0 panels keep equal shares: quant_q8_0.h. */
#pragma omp for schedule(guided) nowait
            for (int64_t p = 0; p < np; p++) fn(pw, nb, &part, in, p, (char *)y + c * PANEL_ROWS * out * elem, out, ybf, R);
        }
    }
    free(xr.mem);
    return 0;
}
#endif

/* ---- GGUF's layout ---------------------------------------------------------------------------- */

/* One block of output row `blk` -> q [elems] int8 (an integer offset folded in: Q4_0 q - 8, ...),
 * sc [elems / 16] each 16 elements' scale, off [elems / 16] their offset term's factor (0 where
 * the type has none): the weight is sc q + off per element. Scalar: GGUF's layout is for shapes
 * the panels do not take (and Q8_0, read in place by the caller). */
INLINE void unpack_q8(const int t, const uint8_t *b, int8_t *q, float *sc, float *off) {
    const int n16 = block_elems(t) / 16;
    for (int i = 0; i < n16; i++) off[i] = 0.0f;
    if (t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == IQ4_NL) {
        const int qs = panel_qs(t);
        const uint32_t qh = five_bit(t) ? ld_u32(b + gguf_qh(t)) : 0;
        for (int e = 0; e < 32; e++) {
            int v = (b[qs + e % 16] >> (4 * (e / 16))) & 15;
            if (five_bit(t)) v |= (int)((qh >> e) & 1) << 4;
            q[e] = (int8_t)(t == IQ4_NL ? (int8_t)IQ4_BYTES[v] : t == Q4_0 ? v - 8 : t == Q5_0 ? v - 16 : v);
        }
        sc[0] = sc[1] = f16_to_f32(ld_u16(b));
        if (t == Q4_1 || t == Q5_1) off[0] = off[1] = f16_to_f32(ld_u16(b + 2));
        return;
    }
    kscales k; /* the K types: per 32 (Q4_K, Q5_K, IQ4_XS) or 16 elements (Q2_K, Q3_K, Q6_K: k.s[e / 16]) */
    prep(t, b, &k);
    for (int e = 0; e < 256; e++) {
        const int s32 = e / 32, l = e % 32, i = e / 16;
        int v;
        if (t == Q4_K || t == Q5_K) {
            v = (b[(t == Q4_K ? 16 : 48) + 32 * (s32 / 2) + l] >> (4 * (s32 & 1))) & 15;
            if (t == Q5_K) v |= ((b[16 + l] >> s32) & 1) << 4;
            sc[i] = k.s[s32];
            off[i] = -k.s[8 + s32];
        } else if (t == IQ4_XS) {
            v = (int8_t)IQ4_BYTES[(b[8 + 16 * s32 + l % 16] >> (4 * (l / 16))) & 15];
            sc[i] = k.s[s32];
        } else if (t == Q6_K) { /* element 128 n + 32 c + l: nibble c / 2 of byte 64 n + 32 (c % 2) + l */
            const int n = e / 128, c = (e % 128) / 32;
            v = (((b[64 * n + 32 * (c & 1) + l] >> (4 * (c >> 1))) & 15) | (((b[128 + 32 * n + l] >> (2 * c)) & 3) << 4)) - 32;
            sc[i] = k.s[i];
        } else { /* Q2_K, Q3_K: element 128 n + 32 jj + l, 2 bits at 2 jj of byte 32 n + l */
            const int n = e / 128, jj = (e % 128) / 32;
            v = (b[(t == Q2_K ? 16 : 32) + 32 * n + l] >> (2 * jj)) & 3;
            if (t == Q3_K) v += (((b[l] >> (4 * n + jj)) & 1) << 2) - 4; /* hmask bit 4 n + jj of byte l */
            sc[i] = k.s[i];
            if (t == Q2_K) off[i] = -k.s[16 + i];
        }
        q[e] = (int8_t)v;
    }
}

/* One output `o` of the R rows in a chunk: each block unpacked (Q8_0: read in place), each 32
 * inputs' 8 lane sums scaled by their 16-element halves' scale times dx into 8 float lanes, the
 * offsets into a scalar; in a fixed order. */
INLINE void q8_gguf_output(const int t, const uint8_t *row, int64_t nb, const q8rows *x, int64_t in, int R,
                           float *res) {
    const int QB = block_elems(t), BB = block_bytes(t);
    const int64_t n32 = in / 32;
    f8x acc[MAX_CHUNK];
    float aoff[MAX_CHUNK];
    UNROLL for (int r = 0; r < MAX_CHUNK; r++) {
        acc[r] = (f8x){0};
        aoff[r] = 0.0f;
    }
    int8_t qbuf[256] __attribute__((aligned(32)));
    float sc[16], off[16];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * BB;
        const int8_t *q = qbuf;
        if (t == Q8_0) {
            q = (const int8_t *)(blk + 2);
            sc[0] = sc[1] = f16_to_f32(ld_u16(blk));
        } else {
            unpack_q8(t, blk, qbuf, sc, off);
        }
        UNROLL for (int r = 0; r < MAX_CHUNK; r++) {
            if (r >= R) continue;
            const int8_t *xq = x->q + r * in + b * QB;
            for (int c = 0; c < QB / 32; c++) {
                const int64_t blk32 = b * (QB / 32) + c;
                const float dx = x->d[r * n32 + blk32];
                const float s0 = sc[2 * c] * dx, s1 = sc[2 * c + 1] * dx;
                const f8x scale = {s0, s0, s0, s0, s1, s1, s1, s1};
                acc[r] = __builtin_convertvector(idot32(q + 32 * c, xq + 32 * c), f8x) * scale + acc[r];
                if (q8_float_off(t))
                    for (int h = 0; h < 2; h++)
                        aoff[r] = off[2 * c + h] * (dx * (float)x->s[r * 3 * n32 + n32 + 2 * blk32 + h]) + aoff[r];
            }
        }
    }
    for (int r = 0; r < R; r++)
        res[r] = hsum8(acc[r][0], acc[r][1], acc[r][2], acc[r][3], acc[r][4], acc[r][5], acc[r][6], acc[r][7]) + aoff[r];
}

INLINE void q8_gguf_part(const int t, const uint8_t *w, int64_t in, const q8rows *x, int64_t rows, void *y,
                         int64_t out, int ybf, int64_t lo, int64_t hi) {
    const int64_t nb = in / block_elems(t), rb = nb * block_bytes(t), n32 = in / 32;
    for (int64_t c = 0; c * MAX_CHUNK < rows; c++) {
        const int R = chunk_size(rows, c);
        const q8rows part = {x->q + c * MAX_CHUNK * in, x->d + c * MAX_CHUNK * n32, x->s + c * MAX_CHUNK * 3 * n32, NULL};
        for (int64_t o = lo; o < hi; o++) {
            float res[MAX_CHUNK];
            q8_gguf_output(t, w + o * rb, nb, &part, in, R, res);
            for (int r = 0; r < R; r++) {
                const int64_t at = (c * MAX_CHUNK + r) * out + o;
                if (ybf) ((uint16_t *)y)[at] = f32_to_bf16(res[r]);
                else ((float *)y)[at] = res[r];
            }
        }
    }
}

/* each type's GGUF-layout q8 kernel, a function of its own (as the tiles) */
typedef void (*q8g_fn)(const uint8_t *, int64_t, const q8rows *, int64_t, void *, int64_t, int, int64_t, int64_t);
#define Q8_TYPES(X) PANEL_TYPES(X) X(Q8_0)
#define Q8G(TY)                                                                                    \
    static __attribute__((noinline)) void q8g_##TY(const uint8_t *w, int64_t in, const q8rows *x, int64_t rows,        \
                                                   void *y, int64_t out, int ybf, int64_t lo, int64_t hi) {          \
        q8_gguf_part(TY, w, in, x, rows, y, out, ybf, lo, hi);                                     \
    }
Q8_TYPES(Q8G)
#define Q8G_CASE(TY) case TY: return q8g_##TY;
static q8g_fn q8g_of(int t) { switch (t) { Q8_TYPES(Q8G_CASE) default: return NULL; } }

/* y [rows, out] = x W^T for W in GGUF's layout, x quantised to int8 per 32 inputs. Returns 0; -1
 * F16, BF16 or an unknown type, or `in` not a multiple of its block; -2 out of memory. */
#if ML_PART(3)
int quant_matmul_q8(int t, const uint8_t *w, int64_t out, int64_t in, const void *x, int xbf, void *y, int ybf,
                    int64_t rows, int64_t threads) {
    q8g_fn fn = q8g_of(t);
    if (!fn || in % block_elems(t)) return -1;
    (void)threads;
    q8rows xr;
    if (q8_alloc(rows, in, &xr)) return -2;
    if (threads <= 1) {
        q8_fill(x, xbf, 0, rows, in, 0, &xr);
        fn(w, in, &xr, rows, y, out, ybf, 0, out);
    } else {
#pragma omp parallel num_threads(threads)
        {
            q8_fill_share(x, xbf, rows, in, 0, &xr);
            int64_t lo, hi;
            thread_share(out, 8, &lo, &hi);
            if (lo < hi) fn(w, in, &xr, rows, y, out, ybf, lo, hi);
        }
    }
    free(xr.mem);
    return 0;
}
#endif

/* 1 << t for each type with a q8 kernel (both layouts; the panel one where `quant_panel_types` says) */
#if ML_PART(3)
int quant_q8_types(void) {
#define Q8_BIT(TY) | 1 << TY
    return 0 Q8_TYPES(Q8_BIT);
}
#endif

/* the inputs' quantisation alone (x [rows, in] -> q, d, s as `q8_row`, natural order), so that
 * tests hold it to a reference. Returns 0, -1 `in` not a multiple of 32. */
#if ML_PART(3)
int quant_q8_inputs(const void *x, int xbf, int64_t rows, int64_t in, int8_t *q, float *d, int32_t *s) {
    if (in % 32) return -1;
    for (int64_t i = 0; i < rows; i++)
        q8_row((const char *)x + i * in * (xbf ? 2 : 4), xbf, in, 0, q + i * in, d + i * (in / 32), s + i * 3 * (in / 32));
    return 0;
}
#endif
