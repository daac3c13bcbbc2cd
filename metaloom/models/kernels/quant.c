/* Matmuls over GGUF block-quantised weights, as stored in the file (metaloom/models/kernels/quant.py).
 *
 * A weight [out, in] is `out` rows of bytes, each row that output's blocks along `in` (GGUF's
 * own layout). A batch-1 decode step reads every weight once, so it is memory-bound: reading
 * 4.5 bits per weight instead of 32 (or 16) is the whole speed-up, provided decoding keeps up
 * with memory. Each block is decoded in registers into the exact float32 values that
 * gguf.quants.dequantize gives (see `decode`: every product of a scale and a quant is exact in
 * float32, and Q4_1 / Q4_K's offset is added with one rounding, as the reference does), and
 * multiplied into float32 accumulators. So a result differs from the float64 product of the
 * dequantised weight only by float32 summation rounding; the activations are never quantised
 * (llama.cpp quantises them to 8 bits; we must match a float32 reference).
 *
 * This part runs GGUF's own layout; a model's Q4_0, Q4_1, Q5_0, Q4_K and Q6_K weights are
 * regrouped into panels (the last part of this file), which decode reads 1.2-1.7x as fast.
 *
 * Work: rows of x in chunks of up to MAX_CHUNK = 8, each chunk one pass over the weight; a pass
 * walks tiles of NO outputs (for one row of x 8 on AVX-512, 4 elsewhere; fewer for more rows: NO
 * outputs share each load of x, NO x rows accumulators fill half the vector registers), decoding
 * each block once per tile. Threads (OpenMP) take contiguous ranges of outputs.
 *
 * Summation order, per (x row, output): one W-lane accumulator (W = 16 on AVX-512, 8 elsewhere)
 * over the blocks in order, one fused multiply-add per W elements (8 lanes, Q8_0: each block's
 * products summed afresh, then one fma by its scale), then a fixed horizontal sum. It does not
 * depend on how many rows are in the call, which chunk or tile a row lands in, or the thread
 * count: a row's result is the same alone or in a batch (speculative verification can compare
 * with plain steps exactly). The paths sum in different orders, each within the same bound.
 *
 * Types (ggml ids): F16=1, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, Q3_K=11, Q4_K=12,
 * Q5_K=13, Q6_K=14, IQ4_NL=20, IQ4_XS=23, BF16=30 (`block_bytes` says how each block is laid out).
 * F16 and BF16 are raw values; here they are walked in "blocks" of 32 (64 bytes), so `in` must be
 * a multiple of 32 for every type (256 for the K types and IQ4_XS). quant.py checks before calling.
 * Every decoded value is an exact product (a float16 scale of 11 significant bits times integers
 * of at most 13 more: Q3_K's 6-bit scale and 3-bit quant, IQ4_XS's 6-bit scale and 7-bit value)
 * with at most one rounding for an offset (Q4_1/Q5_1's m, the K types' dmin m), as gguf's numpy
 * code computes it, so every path decodes gguf's values bit for bit.
 *
 * Vectors are GCC/Clang vector extensions, so this compiles on any target those compilers know;
 * it is built once per instruction-set path (metaloom/models/kernels/isa.py: avx512, avx2, neon,
 * generic), and `#ifdef` blocks give each path its own widening instructions and, on AVX-512,
 * its own decoders: a 4-bit quant's 16 possible values are computed once per block and looked up
 * per lane (vpermps), where converting and scaling each lane costs more (on Zen 4 the decode, not
 * memory, bounds a 4-bit matvec on one core). Every path's decoded values are gguf's, bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
/* the AVX-512 code: built for CPUs with it, or under emulation (METALOOM_EMULATE_AVX512: its
 * intrinsics from SIMDe, so that a test runs this path on a CPU without AVX-512) */
#if defined(__AVX512F__) || defined(METALOOM_EMULATE_AVX512)
#define ML_AVX512 1
#endif
#if defined(ML_AVX512) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __aarch64__
#include <arm_neon.h>
#endif

#define ABI_VERSION 4
/* Built as one translation unit, or (metaloom/models/kernels/cbuild.py) as QUANT_PARTS units
 * compiled in parallel and linked, METALOOM_PART = 0 .. QUANT_PARTS - 1 each defining a share of
 * the exported functions: the compiler discards the static functions a unit does not reach before
 * optimising them, so each part costs its own kernels' compile time (the generic path's whole
 * file took 90 s of a core). 0: GGUF-layout matmul, dequantise, quantise; 1: panels; 2: q8 over
 * panels; 3: q8 over GGUF's layout. */
#define QUANT_PARTS 4
#ifdef METALOOM_PART
#define ML_PART(n) (METALOOM_PART == (n))
#else
#define ML_PART(n) 1
#endif
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")
/* Tiles (NO outputs x RMAX rows of x) sized to the register file: an accumulator is a vector of W
 * lanes (below), AVX-512 has 32 registers and AVX2 16 (NEON 32 of half the width). Tiles: one row,
 * T_ONE outputs; up to T_FEW_ROWS rows, T_FEW_NO outputs; more (up to MAX_CHUNK), T_PAIR_NO
 * outputs, then one at a time. */
#ifdef ML_AVX512
#define MAX_CHUNK 8 /* rows of x per pass over the weight */
#define MAX_ACC 16  /* accumulators of a tile (NO x RMAX) */
#define T_ONE 8
#define T_FEW_NO 4
#define T_FEW_ROWS 4
#define T_PAIR_NO 2
#define TILE_AHEAD 1
#else /* 16 registers of 8 lanes (AVX2; NEON's 32 of 4 lanes alike) */
#define MAX_CHUNK 8
#define MAX_ACC 8
#define T_ONE 4
#define T_FEW_NO 4
#define T_FEW_ROWS 2
#define T_PAIR_NO 1
#define TILE_AHEAD 4
/* A Q8_0 weight of this size or more (a model's head: 30-180 MB) is read from memory, not the
 * caches, at batch 1: one output at a time (its blocks one contiguous run) then read 1.4-1.8x
 * faster than T_ONE outputs side by side on an AMD EPYC Zen 3 (Gemma 3's 178 MB head: 19.5 ms ->
 * 13 ms, 2 threads), while weights the caches hold (a layer's) ran 10-30% faster with T_ONE
 * chains. scripts/quant_kernel_speed.py --types Q8_0 measures both. Each output's arithmetic is
 * the same either way (a tile's outputs are independent), so the choice changes no bit. */
#define STREAM_BYTES (16 << 20)
#endif

enum {
    F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ4_NL = 20, IQ4_XS = 23, BF16 = 30
};
/* the super-block types: 256 elements a block */
#define IS_K(t) ((t) == Q2_K || (t) == Q3_K || (t) == Q4_K || (t) == Q5_K || (t) == Q6_K || (t) == IQ4_XS)

/* W lanes per vector: one AVX-512 register; on every other path 8 lanes, one AVX2 register or two
 * NEON or SSE2 ones (GCC lowers a generic vector wider than the machine's registers through
 * memory: with 16 lanes on AVX2 every accumulator went to the stack and back each block, and a
 * Q8_0 matvec ran at 4 GB/s on a Zen 3 core). NV vectors hold the 32 elements of a sub-block. */
#ifdef ML_AVX512
#define W 16
#else
#define W 8
#endif
#define NV (32 / W)
typedef float vec __attribute__((vector_size(4 * W)));
typedef int32_t veci __attribute__((vector_size(4 * W)));
typedef uint32_t vecu __attribute__((vector_size(4 * W)));
typedef uint16_t vecu16 __attribute__((vector_size(2 * W)));
typedef uint8_t bytes16 __attribute__((vector_size(16)));

/* x in every lane (a broadcast: `(vec){0} + x` is an add, and turns -0 into +0) */
#if W == 16
INLINE vec splat(float x) { return (vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
INLINE vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }
#endif
/* A fixed order of 16 lanes' sum: lanes i and i + 8 first, then ((0+4)+(1+5))+((2+6)+(3+7)). With
 * 8-lane vectors the 16 lanes are two vectors (lo, hi) and the first step is lo + hi, so every path
 * sums 16 values in the same order (lanes, not a memcpy: a memcpy out of an accumulator array keeps
 * GCC from holding the array in registers). */
INLINE float hsum8(float a0, float a1, float a2, float a3, float a4, float a5, float a6, float a7) {
    return ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7));
}
#if W == 16
INLINE float hsum(vec v) {
    return hsum8(v[0] + v[8], v[1] + v[9], v[2] + v[10], v[3] + v[11], v[4] + v[12], v[5] + v[13], v[6] + v[14],
                 v[7] + v[15]);
}
#else
INLINE float hsum(vec v) { return hsum8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]); }
#endif
/* the sum of 16 values held as 16 / W vectors, in hsum's order */
INLINE float sum16(const vec *v) {
#if W == 16
    return hsum(v[0]);
#else
    return hsum(v[0] + v[1]);
#endif
}
#if W == 16
static const vecu LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
static const vecu LANE = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
/* ggml's kvalues_iq4nl: IQ4_NL's and IQ4_XS's 16 values, as bytes for a table lookup */
static const bytes16 IQ4_BYTES = {(uint8_t)-127, (uint8_t)-104, (uint8_t)-83, (uint8_t)-65, (uint8_t)-49, (uint8_t)-35,
                                  (uint8_t)-22, (uint8_t)-10, 1, 13, 25, 38, 53, 69, 89, 113};
INLINE uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint16_t ld_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
INLINE uint32_t ld_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
INLINE bytes16 ld_b16(const uint8_t *p) { bytes16 v; memcpy(&v, p, 16); return v; }
INLINE vec i32_to_vec(veci v) { return __builtin_convertvector(v, vec); }
INLINE vec ldf(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Widening into W int32 lanes: bytes W j .. W j + W - 1 of 16 (zx: zero-, sx: sign-extended), or
 * W uint16 at p (zx16). With one instruction each on AVX-512, AVX2 and NEON: GCC turns a generic
 * char or short vector conversion into a byte at a time through general registers there (a Q4_1
 * matvec at 1 GB/s). */
#if defined(ML_AVX512)
INLINE veci zx(bytes16 b, int j) { (void)j; return (veci)_mm512_cvtepu8_epi32((__m128i)b); }
INLINE veci sx(bytes16 b, int j) { (void)j; return (veci)_mm512_cvtepi8_epi32((__m128i)b); }
INLINE vecu zx16(const uint8_t *p) { return (vecu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__AVX2__)
INLINE veci sx8(const uint8_t *p) { return (veci)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
INLINE veci zx(bytes16 b, int j) { return (veci)_mm256_cvtepu8_epi32(j ? _mm_srli_si128((__m128i)b, 8) : (__m128i)b); }
INLINE veci sx(bytes16 b, int j) { return (veci)_mm256_cvtepi8_epi32(j ? _mm_srli_si128((__m128i)b, 8) : (__m128i)b); }
INLINE vecu zx16(const uint8_t *p) { return (vecu)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)); }
#elif defined(__aarch64__)
INLINE veci join4(uint32x4_t a, uint32x4_t b) {
    veci v;
    memcpy(&v, &a, 16);
    memcpy((char *)&v + 16, &b, 16);
    return v;
}
INLINE veci zx(bytes16 b, int j) {
    uint8x16_t x = (uint8x16_t)b;
    uint16x8_t h = j ? vmovl_high_u8(x) : vmovl_u8(vget_low_u8(x));
    return join4(vmovl_u16(vget_low_u16(h)), vmovl_high_u16(h));
}
INLINE veci sx(bytes16 b, int j) {
    int8x16_t x = (int8x16_t)b;
    int16x8_t h = j ? vmovl_high_s8(x) : vmovl_s8(vget_low_s8(x));
    return join4(vreinterpretq_u32_s32(vmovl_s16(vget_low_s16(h))), vreinterpretq_u32_s32(vmovl_high_s16(h)));
}
INLINE vecu zx16(const uint8_t *p) {
    uint16x8_t h = vld1q_u16((const uint16_t *)p);
    return (vecu)join4(vmovl_u16(vget_low_u16(h)), vmovl_high_u16(h));
}
#else /* the portable path: whatever the compiler makes of it */
typedef uint8_t bytes8 __attribute__((vector_size(8)));
INLINE veci zx(bytes16 b, int j) {
    bytes8 h;
    memcpy(&h, (const char *)&b + 8 * j, 8);
    return __builtin_convertvector(h, veci);
}
/* through a zero extension: GCC 12 turns a signed-char vector conversion into scalar code */
INLINE veci sx(bytes16 b, int j) { return (zx(b, j) ^ 0x80) - 0x80; }
INLINE vecu zx16(const uint8_t *p) {
    vecu16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vecu);
}
#endif
/* tab[idx[i]] for 16 indices below 16 (one shuffle on x86 with SSSE3 and on aarch64) */
#if defined(__AVX2__) || defined(ML_AVX512)
INLINE bytes16 tbl16(bytes16 tab, bytes16 idx) { return (bytes16)_mm_shuffle_epi8((__m128i)tab, (__m128i)idx); }
#elif defined(__aarch64__)
INLINE bytes16 tbl16(bytes16 tab, bytes16 idx) { return (bytes16)vqtbl1q_u8((uint8x16_t)tab, (uint8x16_t)idx); }
#else
INLINE bytes16 tbl16(bytes16 tab, bytes16 idx) {
    bytes16 r;
    for (int i = 0; i < 16; i++) r[i] = tab[idx[i] & 15];
    return r;
}
#endif
#if !defined(ML_AVX512) && !defined(__AVX2__)
/* 8 int8 at p (and no byte past them) as int32 lanes; AVX2 loads and widens them in one instruction */
INLINE veci sx8(const uint8_t *p) {
    bytes16 b = {0};
    memcpy(&b, p, 8);
    return sx(b, 0);
}
#endif

#ifdef ML_AVX512
/* tab[idx & 15] per lane (one vpermps): a 4-bit quant's 16 possible values, computed once per
 * block, replace a convert and a multiply per lane */
INLINE vec lookup(veci idx, vec tab) { return (vec)_mm512_permutexvar_ps((__m512i)idx, (__m512)tab); }
/* lanes whose bit in `high` is set from tab_hi, the others from tab_lo */
INLINE vec lookup2(veci idx, vec tab_lo, vec tab_hi, uint32_t high) {
    return (vec)_mm512_mask_permutexvar_ps(_mm512_permutexvar_ps((__m512i)idx, (__m512)tab_lo), (__mmask16)high,
                                           (__m512i)idx, (__m512)tab_hi);
}
static const vec NIBBLE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const vec IQ4_VALUES = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#endif

/* IEEE half -> float, exact (subnormals, infinities, NaN); M. Dukhan's FP16 library method */
INLINE float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normal = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormal = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormal) : f32_bits(normal)));
#endif
}

/* float -> IEEE half, round to nearest even (as numpy's astype(float16) and ggml) */
INLINE uint16_t f32_to_f16(float f) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, 0); /* imm 0: round to nearest even */
#else
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u, bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = f32_bits(base), nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

/* W halves at p -> W floats, exact */
INLINE vec f16_to_vec(const uint8_t *p) {
#ifdef ML_AVX512
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif defined(__aarch64__)
    float16x8_t h = vreinterpretq_f16_u16(vld1q_u16((const uint16_t *)p));
    float32x4_t lo = vcvt_f32_f16(vget_low_f16(h)), hi = vcvt_high_f32_f16(h);
    return (vec)join4(vreinterpretq_u32_f32(lo), vreinterpretq_u32_f32(hi));
#else
    vecu w = zx16(p) << 16, sign = w & 0x80000000u, two_w = w + w;
    vec normal = (vec)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    vec denormal = (vec)((two_w >> 17) | (126u << 23)) - 0.5f;
    veci small = (veci)(two_w < (1u << 27));
    return (vec)(sign | (vecu)((small & (veci)denormal) | (~small & (veci)normal)));
#endif
}

/* the half at p, in every lane */
INLINE vec bcast_f16(const uint8_t *p) {
#if defined(ML_AVX512) /* a conversion of one half and a broadcast: fewer 512-bit shuffles */
    return (vec)_mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(ld_u16(p))));
#else
    return splat(f16_to_f32(ld_u16(p)));
#endif
}

/* float -> bfloat16, round to nearest even, NaN stays a (quiet) NaN (as vec_store.h's `st`) */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#include "vec_store.h" /* st: store W floats, float32 or bfloat16 */

/* ---- block formats ------------------------------------------------------------------------ */

/* elements and bytes of one block as the kernels walk them (F16 / BF16: 32 values) */
INLINE int block_elems(const int t) { return IS_K(t) ? 256 : 32; }
INLINE int block_bytes(const int t) {
    switch (t) {
    case Q4_0: return 18;  /* f16 d; 16 bytes: element j low nibble of byte j, 16 + j high nibble */
    case Q4_1: return 20;  /* f16 d, f16 m; nibbles as Q4_0; x = d q + m */
    case Q5_0: return 22;  /* f16 d; uint32 qh: bit j the 5th bit of element j; nibbles; x = d (q - 16) */
    case Q5_1: return 24;  /* f16 d, f16 m; uint32 qh; nibbles; x = d q + m */
    case Q8_0: return 34;  /* f16 d; 32 int8 */
    case Q2_K: return 84;  /* scales[16] (4-bit scale low, min high), 64 bytes of 2-bit quants, f16 d, f16 dmin */
    case Q3_K: return 110; /* hmask[32], 64 bytes of 2-bit quants, 12 bytes of 6-bit scales, f16 d */
    case Q5_K: return 176; /* f16 d, f16 dmin, 12 bytes of scales and mins (as Q4_K), qh[32], 128 bytes of nibbles */
    case IQ4_NL: return 18; /* f16 d; nibbles as Q4_0, each an index into IQ4_BYTES */
    case IQ4_XS: return 136; /* f16 d, uint16 scales_h, scales_l[4], 128 bytes of nibbles (16 a sub-block) */
    case Q4_K: return 144; /* f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles */
    case Q6_K: return 210; /* ql[128], qh[64], int8 scales[16], f16 d */
    case F16: case BF16: return 64;
    default: return 0;
    }
}

/* A K super-block's scales, decoded once per block and row into memory (a sub-block then reads
 * its scale with a broadcast load): Q4_K s[j] = d sc_j and s[8 + j] = dmin m_j for sub-block j
 * (elements 32j..32j+31); Q6_K s[j] = d scale_j (elements 16j..16j+15). Each product is exact. */
typedef struct {
    float s[32];
} kscales;

INLINE void prep(const int t, const uint8_t *b, kscales *k) {
    if (t == Q4_K || t == Q5_K) { /* 12 bytes: sc_j, m_j = low 6 bits of bytes j, j + 4 for j < 4; for j >= 4 the
                        nibbles of byte j + 4 with the top 2 bits of bytes j - 4, j on top */
        const uint8_t *q = b + 4;
        const float d = f16_to_f32(ld_u16(b)), dmin = f16_to_f32(ld_u16(b + 2));
#if W == 16
        static const veci shift = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4};
        static const veci low = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15};
        static const veci high = {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48};
        static const veci first = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
        /* (lanes by element: __builtin_shufflevector needs GCC 12) */
        veci lo = {q[0], q[1], q[2], q[3], q[8], q[9], q[10], q[11], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11]};
        veci hi = {0, 0, 0, 0, q[0], q[1], q[2], q[3], 0, 0, 0, 0, q[4], q[5], q[6], q[7]};
        veci v = ((lo >> shift) & low) | (((hi >> 6) << 4) & high);
        vec r = i32_to_vec(v) * (vec)((first & (veci)splat(d)) | (~first & (veci)splat(dmin))); /* d: scales, dmin: mins */
        memcpy(k->s, &r, sizeof r);
#else
        for (int j = 0; j < 8; j++) { /* GGUF's get_scale_min_k4 */
            int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
            int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
            k->s[j] = d * (float)sc;
            k->s[8 + j] = dmin * (float)mn;
        }
#endif
    } else if (t == Q6_K) {
        const float d = f16_to_f32(ld_u16(b + 208));
        for (int j = 0; j < 16 / W; j++) {
            vec r = i32_to_vec(sx(ld_b16(b + 192), j)) * d;
            memcpy(k->s + W * j, &r, sizeof r);
        }
    } else if (t == Q2_K) { /* s[i] = d sc_i, s[16 + i] = dmin m_i for sub-block i of 16 */
        const float d = f16_to_f32(ld_u16(b + 80)), dmin = f16_to_f32(ld_u16(b + 82));
        for (int i = 0; i < 16; i++) {
            k->s[i] = d * (float)(b[i] & 15);
            k->s[16 + i] = dmin * (float)(b[i] >> 4);
        }
    } else if (t == Q3_K) { /* s[i] = d (sc_i - 32): 4 low bits from bytes 0-7, 2 high from bytes 8-11 */
        const float d = f16_to_f32(ld_u16(b + 108));
        const uint8_t *q = b + 96;
        for (int i = 0; i < 16; i++) {
            int low = i < 8 ? q[i] & 15 : q[i - 8] >> 4, high = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
            k->s[i] = d * (float)((low | high << 4) - 32);
        }
    } else if (t == IQ4_XS) { /* s[j] = d (ls_j - 32) for sub-block j of 32 */
        const float d = f16_to_f32(ld_u16(b));
        const unsigned sh = ld_u16(b + 2);
        for (int j = 0; j < 8; j++) {
            int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            k->s[j] = d * (float)(ls - 32);
        }
    }
}

/* 32 elements as W-lane float vectors w[0..NV): q0 holds elements 0-15 and q1 16-31 as bytes
 * (zero-extended), each q - sub converted exactly and scaled (the first half's lanes by a0, b0:
 * a q + b, the second's by a1, b1; b only when `add`, so that a product -0 stays -0 as in the
 * reference) with one rounding (a q is exact) */
INLINE void widen32(bytes16 q0, bytes16 q1, int sub, vec a0, vec a1, vec b0, vec b1, const int add, vec *w) {
    UNROLL for (int i = 0; i < NV; i++) {
        vec f = i32_to_vec(zx(i < NV / 2 ? q0 : q1, i % (NV / 2)) - sub);
        w[i] = add ? f * (i < NV / 2 ? a0 : a1) + (i < NV / 2 ? b0 : b1) : f * (i < NV / 2 ? a0 : a1);
    }
}

/* the same for signed bytes (IQ4's values): elements 0-15 in q0, 16-31 in q1, times d (exact) */
INLINE void widen32s(bytes16 q0, bytes16 q1, vec d, vec *w) {
    UNROLL for (int i = 0; i < NV; i++) w[i] = i32_to_vec(sx(i < NV / 2 ? q0 : q1, i % (NV / 2))) * d;
}

/* Sub-block `s` (elements 32s..32s+31 of the block at b) as exact float32 values: w[i] holds
 * elements W i .. W i + W - 1. */
INLINE void decode(const int t, const uint8_t *b, const kscales *k, const int s, vec *w) {
    switch (t) {
    case Q4_0: {
        vec d = bcast_f16(b);
#ifdef ML_AVX512
        veci q = (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
        vec tab = (NIBBLE - 8.0f) * d; /* exact: 11-bit d times a 4-bit integer */
        w[0] = lookup(q, tab);
        w[1] = lookup(q >> 4, tab);
#else
        bytes16 q = ld_b16(b + 2), lo = q & 15, hi = q >> 4;
        UNROLL for (int i = 0; i < NV; i++) w[i] = i32_to_vec(zx(i < NV / 2 ? lo : hi, i % (NV / 2)) - 8) * d;
#endif
        break;
    }
    case Q4_1: {
#ifdef ML_AVX512
        /* both halves in one conversion, then two broadcasts */
        __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)ld_u32(b)));
        vec d = (vec)_mm512_broadcastss_ps(dm), m = (vec)_mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        veci q = (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 4)));
        vec tab = NIBBLE * d + m; /* d q is exact: one rounding, with or without an fma, as the reference */
        w[0] = lookup(q, tab);
        w[1] = lookup(q >> 4, tab);
#else
        vec d = bcast_f16(b), m = bcast_f16(b + 2);
        bytes16 q = ld_b16(b + 4), lo = q & 15, hi = q >> 4;
        UNROLL for (int i = 0; i < NV; i++) w[i] = i32_to_vec(zx(i < NV / 2 ? lo : hi, i % (NV / 2))) * d + m;
#endif
        break;
    }
    case Q5_0: {
        vec d = bcast_f16(b);
        uint32_t qh = ld_u32(b + 2);
#ifdef ML_AVX512
        veci q = (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 6)));
        vec lo = (NIBBLE - 16.0f) * d, hi = NIBBLE * d; /* 5th bit clear, set (two tables keep -0 exact) */
        w[0] = lookup2(q, lo, hi, qh & 0xFFFF);
        w[1] = lookup2(q >> 4, lo, hi, qh >> 16);
#else
        static const vecu lane = {0, 1, 2, 3, 4, 5, 6, 7};
        bytes16 q = ld_b16(b + 6), lo = q & 15, hi = q >> 4;
        UNROLL for (int i = 0; i < NV; i++) {
            veci h = (veci)((((vecu){0} + (qh >> (W * i))) >> lane) & 1u) << 4;
            w[i] = i32_to_vec((zx(i < NV / 2 ? lo : hi, i % (NV / 2)) | h) - 16) * d;
        }
#endif
        break;
    }
    case Q8_0: {
        vec d = bcast_f16(b);
        UNROLL for (int i = 0; i < NV; i++) w[i] = i32_to_vec(sx(ld_b16(b + 2 + 16 * (i / (NV / 2))), i % (NV / 2))) * d;
        break;
    }
    case Q4_K: { /* sub-block s: nibbles of bytes 32 (s / 2) .. + 31, low for even s, high for odd */
        const uint8_t *q = b + 16 + 32 * (s >> 1);
        vec sc = splat(k->s[s]), mn = splat(k->s[8 + s]);
#ifdef ML_AVX512
        veci lo = (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        veci hi = (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        vec tab = NIBBLE * sc - mn; /* sc q is exact: one rounding, as the reference's */
        w[0] = lookup(s & 1 ? lo >> 4 : lo, tab);
        w[1] = lookup(s & 1 ? hi >> 4 : hi, tab);
#else
        bytes16 lo = ld_b16(q), hi = ld_b16(q + 16);
        if (s & 1) {
            lo >>= 4;
            hi >>= 4;
        } else {
            lo &= 15;
            hi &= 15;
        }
        UNROLL for (int i = 0; i < NV; i++) w[i] = i32_to_vec(zx(i < NV / 2 ? lo : hi, i % (NV / 2))) * sc - mn;
#endif
        break;
    }
    case Q6_K: { /* half n = s / 4 of 128 elements; quarter c = s % 4 of it */
        const int n = s >> 2, c = s & 3;
        const uint8_t *ql = b + 64 * n + 32 * (c & 1), *qh = b + 128 + 32 * n;
        vec s0 = splat(k->s[8 * n + 2 * c]), s1 = splat(k->s[8 * n + 2 * c + 1]);
#ifdef ML_AVX512 /* the 32 quants as bytes in one 256-bit register, minus 32 there: fewer 512-bit ops */
        __m256i lo = _mm256_loadu_si256((const __m256i *)ql), hi = _mm256_loadu_si256((const __m256i *)qh);
        lo = _mm256_and_si256(_mm256_srli_epi16(lo, 4 * (c >> 1)), _mm256_set1_epi8(15));
        hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hi, 2 * c), 4), _mm256_set1_epi8(48));
        __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32)); /* -32..31 */
        w[0] = i32_to_vec((veci)_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))) * s0;
        w[1] = i32_to_vec((veci)_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))) * s1;
#else
        bytes16 l0 = ld_b16(ql), l1 = ld_b16(ql + 16), h0 = ld_b16(qh), h1 = ld_b16(qh + 16);
        l0 = (l0 >> (4 * (c >> 1))) & 15;
        l1 = (l1 >> (4 * (c >> 1))) & 15;
        l0 |= ((h0 >> (2 * c)) & 3) << 4;
        l1 |= ((h1 >> (2 * c)) & 3) << 4;
        UNROLL for (int i = 0; i < NV; i++)
            w[i] = i32_to_vec(zx(i < NV / 2 ? l0 : l1, i % (NV / 2)) - 32) * (i < NV / 2 ? s0 : s1);
#endif
        break;
    }
    case Q5_1: { /* d (nibble | 5th bit << 4) + m: the 5th bits of elements 0-15 and 16-31 from qh */
        const uint32_t qh = ld_u32(b + 4);
        bytes16 q = ld_b16(b + 8), lo = q & 15, hi = q >> 4;
        vec d = bcast_f16(b), m = bcast_f16(b + 2);
        UNROLL for (int i = 0; i < NV; i++) {
            veci h = (veci)((((vecu){0} + (qh >> (W * i))) >> LANE) & 1u) << 4;
            w[i] = i32_to_vec(zx(i < NV / 2 ? lo : hi, i % (NV / 2)) | h) * d + m;
        }
        break;
    }
    case Q5_K: { /* Q4_K's nibbles (at byte 48) with a 5th bit: bit s of qh[0..31] */
        const uint8_t *q = b + 48 + 32 * (s >> 1);
        bytes16 lo = ld_b16(q), hi = ld_b16(q + 16);
        if (s & 1) {
            lo >>= 4;
            hi >>= 4;
        } else {
            lo &= 15;
            hi &= 15;
        }
        lo |= ((ld_b16(b + 16) >> s) & 1) << 4;
        hi |= ((ld_b16(b + 32) >> s) & 1) << 4;
        vec sc = splat(k->s[s]), mn = splat(-k->s[8 + s]);
        widen32(lo, hi, 0, sc, sc, mn, mn, 1, w);
        break;
    }
    case Q2_K: { /* half n = s / 4, shift 2 (s % 4); sub-blocks 2s (elements 0-15), 2s + 1 (16-31) */
        const uint8_t *q = b + 16 + 32 * (s >> 2);
        const int sh = 2 * (s & 3);
        bytes16 q0 = (ld_b16(q) >> sh) & 3, q1 = (ld_b16(q + 16) >> sh) & 3;
        widen32(q0, q1, 0, splat(k->s[2 * s]), splat(k->s[2 * s + 1]), splat(-k->s[16 + 2 * s]),
                splat(-k->s[17 + 2 * s]), 1, w);
        break;
    }
    case Q3_K: { /* Q2_K's 2 bits (at byte 32) and a third from bit s of hmask[0..31]: q = low + 4 h - 4 */
        const uint8_t *q = b + 32 + 32 * (s >> 2);
        const int sh = 2 * (s & 3);
        bytes16 q0 = ((ld_b16(q) >> sh) & 3) | (((ld_b16(b) >> s) & 1) << 2);
        bytes16 q1 = ((ld_b16(q + 16) >> sh) & 3) | (((ld_b16(b + 16) >> s) & 1) << 2);
        vec zero = splat(0.0f);
        widen32(q0, q1, 4, splat(k->s[2 * s]), splat(k->s[2 * s + 1]), zero, zero, 0, w);
        break;
    }
    case IQ4_NL: case IQ4_XS: { /* d IQ4_VALUES[nibble]: each product exact (at most 24 bits) */
        const uint8_t *q = t == IQ4_NL ? b + 2 : b + 8 + 16 * s;
#ifdef ML_AVX512
        vec tab = IQ4_VALUES * (t == IQ4_NL ? bcast_f16(b) : splat(k->s[s]));
        veci idx = (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        w[0] = lookup(idx, tab);
        w[1] = lookup(idx >> 4, tab);
#else
        bytes16 qs = ld_b16(q);
        widen32s(tbl16(IQ4_BYTES, qs & 15), tbl16(IQ4_BYTES, qs >> 4), t == IQ4_NL ? bcast_f16(b) : splat(k->s[s]), w);
#endif
        break;
    }
    case F16:
        UNROLL for (int i = 0; i < NV; i++) w[i] = f16_to_vec(b + 2 * W * i);
        break;
    case BF16:
        UNROLL for (int i = 0; i < NV; i++) w[i] = (vec)(zx16(b + 2 * W * i) << 16);
        break;
    }
}

/* ---- matmul -------------------------------------------------------------------------------- */

/* sub-block s of block b of NO outputs from `row`, into acc[o * RMAX + r] for rows r < R of x:
 * the rows' 32 inputs of this sub-block are at xs + 32 r (see `pack`) */
INLINE void sub_block(const int t, const uint8_t *row, int64_t rb, int64_t b, const kscales *k, int s, const float *xs,
                      vec *acc, const int NO, const int RMAX, int R) {
    UNROLL for (int o = 0; o < NO; o++) {
#if W == 8
        if (t == Q8_0) { /* sum q x over the block (each product exact inside its fma), then one fma
                            by d: 3 operations per 8 weights where d q, then q x took 4 */
            const uint8_t *blk = row + o * rb + b * 34;
            const vec d = bcast_f16(blk);
            vec q[NV];
            UNROLL for (int i = 0; i < NV; i++) q[i] = i32_to_vec(sx8(blk + 2 + 8 * i));
            UNROLL for (int r = 0; r < RMAX; r++) {
                if (r < R) {
                    vec sum = q[0] * ldf(xs + 32 * r);
                    UNROLL for (int i = 1; i < NV; i++) sum = q[i] * ldf(xs + 32 * r + W * i) + sum;
                    acc[o * RMAX + r] = sum * d + acc[o * RMAX + r];
                }
            }
            continue;
        }
#endif
        vec w[NV];
        decode(t, row + o * rb + b * block_bytes(t), &k[o], s, w);
        UNROLL for (int r = 0; r < RMAX; r++) {
            if (r < R) UNROLL for (int i = 0; i < NV; i++) acc[o * RMAX + r] += w[i] * ldf(xs + 32 * r + W * i);
        }
    }
}

/* NO outputs o0.. of R <= RMAX rows of x: y[r, o0 + o] = sum_i W[o0 + o, i] x[r, i]. x is packed
 * (`pack`): sub-block j's 32 inputs of row r at x + j * xsub + 32 r. Each block of each output is
 * decoded once for the R rows. NO and RMAX are compile-time, so the NO * RMAX accumulators live in
 * registers; rows past R are skipped by branches that predict perfectly (one instantiation serves
 * every R, where one per R made the file slow to compile). NO outputs at a time give NO * R
 * independent chains of fmas, to hide their latency. */
INLINE void tile(const int t, const uint8_t *w, int64_t rb, int64_t nb, const float *x, int64_t xsub, int64_t o0,
                 void *y, int64_t out, int ybf, const int NO, const int RMAX, int R) {
    const int BB = block_bytes(t), SUBS = block_elems(t) / 32;
    vec acc[MAX_ACC]; /* NO * RMAX of them (TILE checks) */
    UNROLL for (int i = 0; i < NO * RMAX; i++) acc[i] = splat(0.0f);
    const uint8_t *row = w + o0 * rb;
    for (int64_t b = 0; b < nb; b++) {
        kscales k[8];
        const float *xb = x + b * SUBS * xsub;
        /* the rows TILE_AHEAD tiles on, into L2: with short rows (576 inputs: 10 to 20 cache
         * lines) the hardware prefetcher sees NO short streams and falls behind (a 30 MB Q8_0
         * head went from 7 to 17 GB/s on one Zen 4 core, one tile ahead; on a Zen 3 with 4-row
         * tiles Qwen2.5-0.5B's 145 MB Q8_0 head streamed at 10.8 GB/s one tile ahead, 11.8 four) */
        UNROLL for (int o = 0; o < NO; o++) __builtin_prefetch(row + (o + NO * TILE_AHEAD) * rb + b * BB, 0, 2);
        UNROLL for (int o = 0; o < NO; o++) prep(t, row + o * rb + b * BB, &k[o]);
        /* Q6_K's sub-blocks unrolled (constant shifts: twice as fast); Q4_K's a loop (as fast, and
         * half the code) */
        if (t == Q6_K) {
            UNROLL for (int s = 0; s < SUBS; s++) sub_block(t, row, rb, b, k, s, xb + s * xsub, acc, NO, RMAX, R);
        } else {
            _Pragma("GCC unroll 1") for (int s = 0; s < SUBS; s++)
                sub_block(t, row, rb, b, k, s, xb + s * xsub, acc, NO, RMAX, R);
        }
    }
    UNROLL for (int o = 0; o < NO; o++) UNROLL for (int r = 0; r < RMAX; r++) {
        if (r < R) {
            float v = hsum(acc[o * RMAX + r]);
            if (ybf) ((uint16_t *)y)[r * out + o0 + o] = f32_to_bf16(v);
            else ((float *)y)[r * out + o0 + o] = v;
        }
    }
}

/* Each (type, NO, RMAX) tile is a function of its own: in one big function per type, GCC's
 * register allocation and data-flow passes took most of a ~10 s compile. */
typedef void (*tile_fn)(const uint8_t *w, int64_t rb, int64_t nb, const float *x, int64_t xsub, int64_t o0,
                        void *y, int64_t out, int ybf, int R);
typedef struct {
    tile_fn eight, one, quad, pair, any; /* NO x RMAX: T_ONE x 1, 1 x 1, T_FEW_NO x T_FEW_ROWS,
                                            T_PAIR_NO x MAX_CHUNK, 1 x MAX_CHUNK */
} tile_set;

#define TILE_ARGS                                                                                  \
    const uint8_t *w, int64_t rb, int64_t nb, const float *x, int64_t xsub, int64_t o0, void *y, int64_t out,     \
        int ybf, int R
#define TILE(T, NAME, NO, RMAX)                                                                    \
    _Static_assert((NO) * (RMAX) <= MAX_ACC, "a tile's accumulators");                             \
    static __attribute__((noinline)) void T##_##NAME(TILE_ARGS) {                                  \
        tile(T, w, rb, nb, x, xsub, o0, y, out, ybf, NO, RMAX, R);                                 \
    }
#define TILE_SET(T)                                                                                \
    TILE(T, eight, T_ONE, 1)                                                                       \
    TILE(T, one, 1, 1)                                                                             \
    TILE(T, quad, T_FEW_NO, T_FEW_ROWS)                                                            \
    TILE(T, pair, T_PAIR_NO, MAX_CHUNK)                                                            \
    TILE(T, any, 1, MAX_CHUNK)                                                                     \
    static const tile_set T##_tiles = {T##_eight, T##_one, T##_quad, T##_pair, T##_any};

TILE_SET(Q4_0)
TILE_SET(Q4_1)
TILE_SET(Q5_0)
TILE_SET(Q8_0)
TILE_SET(Q4_K)
TILE_SET(Q6_K)
TILE_SET(Q5_1)
TILE_SET(Q2_K)
TILE_SET(Q3_K)
TILE_SET(Q5_K)
TILE_SET(IQ4_NL)
TILE_SET(IQ4_XS)
TILE_SET(F16)
TILE_SET(BF16)

static const tile_set *tiles_of(int t) {
    switch (t) {
    case Q4_0: return &Q4_0_tiles;
    case Q4_1: return &Q4_1_tiles;
    case Q5_0: return &Q5_0_tiles;
    case Q8_0: return &Q8_0_tiles;
    case Q4_K: return &Q4_K_tiles;
    case Q6_K: return &Q6_K_tiles;
    case Q5_1: return &Q5_1_tiles;
    case Q2_K: return &Q2_K_tiles;
    case Q3_K: return &Q3_K_tiles;
    case Q5_K: return &Q5_K_tiles;
    case IQ4_NL: return &IQ4_NL_tiles;
    case IQ4_XS: return &IQ4_XS_tiles;
    case F16: return &F16_tiles;
    case BF16: return &BF16_tiles;
    default: return NULL;
    }
}

/* outputs lo..hi of R <= MAX_CHUNK rows of x (packed with sub-block stride xsub) */
static void chunk(const tile_set *ts, const uint8_t *w, int64_t rb, int64_t nb, const float *x, int64_t xsub, void *y,
                  int64_t out, int ybf, int64_t lo, int64_t hi, int R) {
    int64_t o = lo;
    if (R == 1) { /* batch 1: 8 outputs at a time for 8 chains */
#if !defined(ML_AVX512)
        if (ts == &Q8_0_tiles && out * rb >= STREAM_BYTES) { /* a head streamed from memory: see STREAM_BYTES */
            for (; o < hi; o++) ts->one(w, rb, nb, x, xsub, o, y, out, ybf, 1);
            return;
        }
#endif
        for (; o + T_ONE <= hi; o += T_ONE) ts->eight(w, rb, nb, x, xsub, o, y, out, ybf, 1);
        for (; o < hi; o++) ts->one(w, rb, nb, x, xsub, o, y, out, ybf, 1);
        return;
    }
    /* NO outputs share each load of x: the rows of x come from L2 for long inputs, and that
     * traffic, not the fmas, was the limit with one output and 16 rows */
    if (R <= T_FEW_ROWS)
        for (; o + T_FEW_NO <= hi; o += T_FEW_NO) ts->quad(w, rb, nb, x, xsub, o, y, out, ybf, R);
    for (; o + T_PAIR_NO <= hi; o += T_PAIR_NO) ts->pair(w, rb, nb, x, xsub, o, y, out, ybf, R);
    for (; o < hi; o++) ts->any(w, rb, nb, x, xsub, o, y, out, ybf, R);
}

/* rows of x in chunks of MAX_CHUNK: chunk c holds rows MAX_CHUNK c.. */
INLINE int chunk_size(int64_t rows, int64_t c) {
    return rows - c * MAX_CHUNK < MAX_CHUNK ? (int)(rows - c * MAX_CHUNK) : MAX_CHUNK;
}

/* one thread's share: outputs lo..hi of every row of x. One row: x as given (float32 [in]);
 * more: packed, chunk c at xp + c * in * MAX_CHUNK (see `pack`). */
static void matmul_part(int t, const uint8_t *w, int64_t in, const float *xp, int64_t rows, void *y, int64_t out,
                        int ybf, int64_t lo, int64_t hi) {
    const tile_set *ts = tiles_of(t);
    int64_t nb = in / block_elems(t), rb = nb * block_bytes(t), elem = ybf ? 2 : 4;
    if (rows == 1) {
        chunk(ts, w, rb, nb, xp, 32, y, out, ybf, lo, hi, 1);
        return;
    }
    for (int64_t c = 0; c * MAX_CHUNK < rows; c++)
        chunk(ts, w, rb, nb, xp + c * in * MAX_CHUNK, 32 * MAX_CHUNK, (char *)y + c * MAX_CHUNK * out * elem, out, ybf,
              lo, hi, chunk_size(rows, c));
}

/* x [rows, in] (float32, or bfloat16: converted exactly) -> xp: per chunk of MAX_CHUNK rows, per
 * sub-block of 32 inputs, the chunk's rows one after the other ([chunks][in / 32][MAX_CHUNK][32]),
 * so a tile finds every row of a sub-block at a constant offset from one pointer (one address
 * register instead of one per row). One row: [in] float32. */
static void pack(const void *x, int xbf, int64_t rows, int64_t in, float *xp) {
    if (rows == 1) { /* one row is its own layout (bfloat16 here: converted) */
        for (int64_t i = 0; i < in; i++) xp[i] = bits_f32((uint32_t)((const uint16_t *)x)[i] << 16);
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = xp + (r / MAX_CHUNK) * in * MAX_CHUNK + (r % MAX_CHUNK) * 32;
        for (int64_t j = 0; j < in; j += 32, dst += 32 * MAX_CHUNK) {
            if (xbf)
                for (int i = 0; i < 32; i++) dst[i] = bits_f32((uint32_t)((const uint16_t *)x)[r * in + j + i] << 16);
            else
                memcpy(dst, (const float *)x + r * in + j, 32 * sizeof(float));
        }
    }
}

#if ML_PART(0)
int metaloom_quant_abi(void) { return ABI_VERSION; }
#endif

/* 1 when compiled with OpenMP (threads > 1 then splits outputs over threads), else 0 */
#if ML_PART(0)
int metaloom_quant_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
#endif

/* y [rows, out] = x [rows, in] W^T for W [out, in] of type t stored as blocks [out, row bytes].
 * x and y float32, or bfloat16 (xbf, ybf; bfloat16 y is rounded to nearest even once, from the
 * float32 sum). Outputs are split over `threads` OpenMP threads (1: this thread, no parallel
 * region). Returns 0; -1 unknown type or `in` not a multiple of its block; -2 out of memory. */
/* This thread's rows [lo, hi) of n inside an OpenMP parallel region: equal shares, each a whole
 * number of ``tile`` rows (the last share may be short or empty). */
static void thread_share(int64_t n, int64_t tile, int64_t *lo, int64_t *hi) {
    int64_t id = 0, nt = 1;
#ifdef _OPENMP
    id = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    int64_t share = (n + nt - 1) / nt;
    share = (share + tile - 1) / tile * tile;
    *lo = id * share;
    *hi = *lo + share < n ? *lo + share : n;
}

#if ML_PART(0)
int quant_matmul(int t, const uint8_t *w, int64_t out, int64_t in, const void *x, int xbf, void *y, int ybf,
                 int64_t rows, int64_t threads) {
    if (!tiles_of(t) || in % block_elems(t)) return -1;
    const float *xf = x;
    void *tmp = NULL;
    if (xbf || rows > 1) { /* one format (float32, exact) and the packed layout of `pack` */
        size_t size = sizeof(float) * (size_t)(((rows + MAX_CHUNK - 1) / MAX_CHUNK) * MAX_CHUNK * in);
        tmp = malloc(size + 64);
        if (!tmp) return -2;
        /* 64-byte aligned: a 64-byte load that straddles two cache lines costs two */
        float *xp = (float *)(((uintptr_t)tmp + 63) & ~(uintptr_t)63);
        pack(x, xbf, rows, in, xp);
        xf = xp;
    }
    if (threads <= 1) {
        matmul_part(t, w, in, xf, rows, y, out, ybf, 0, out);
    } else {
#pragma omp parallel num_threads(threads)
        {
            int64_t lo, hi;
            thread_share(out, 8, &lo, &hi); /* whole tiles of T_ONE (8 or 4) outputs */
            if (lo < hi) matmul_part(t, w, in, xf, rows, y, out, ybf, lo, hi);
        }
    }
    free(tmp);
    return 0;
}
#endif

/* ---- dequantize ------------------------------------------------------------------------------ */

INLINE void dequantize_row(const int t, const uint8_t *row, int64_t nb, void *y, int ybf) {
    const int QB = block_elems(t), BB = block_bytes(t);
    for (int64_t b = 0; b < nb; b++) {
        kscales k;
        prep(t, row + b * BB, &k);
        UNROLL for (int s = 0; s < QB / 32; s++) {
            vec w[NV];
            decode(t, row + b * BB, &k, s, w);
            UNROLL for (int i = 0; i < NV; i++) st(y, b * QB + 32 * s + W * i, w[i], ybf);
        }
    }
}

INLINE void dequantize_part(const int t, const uint8_t *w, int64_t in, const int64_t *ids, int64_t i0, int64_t i1,
                            void *y, int ybf) {
    int64_t nb = in / block_elems(t), rb = nb * block_bytes(t), elem = ybf ? 2 : 4;
    for (int64_t i = i0; i < i1; i++) dequantize_row(t, w + (ids ? ids[i] : i) * rb, nb, (char *)y + i * in * elem, ybf);
}

static void dequantize_any(int t, const uint8_t *w, int64_t in, const int64_t *ids, int64_t i0, int64_t i1, void *y,
                           int ybf) {
    switch (t) {
    case Q4_0: dequantize_part(Q4_0, w, in, ids, i0, i1, y, ybf); break;
    case Q4_1: dequantize_part(Q4_1, w, in, ids, i0, i1, y, ybf); break;
    case Q5_0: dequantize_part(Q5_0, w, in, ids, i0, i1, y, ybf); break;
    case Q8_0: dequantize_part(Q8_0, w, in, ids, i0, i1, y, ybf); break;
    case Q4_K: dequantize_part(Q4_K, w, in, ids, i0, i1, y, ybf); break;
    case Q6_K: dequantize_part(Q6_K, w, in, ids, i0, i1, y, ybf); break;
    case Q5_1: dequantize_part(Q5_1, w, in, ids, i0, i1, y, ybf); break;
    case Q2_K: dequantize_part(Q2_K, w, in, ids, i0, i1, y, ybf); break;
    case Q3_K: dequantize_part(Q3_K, w, in, ids, i0, i1, y, ybf); break;
    case Q5_K: dequantize_part(Q5_K, w, in, ids, i0, i1, y, ybf); break;
    case IQ4_NL: dequantize_part(IQ4_NL, w, in, ids, i0, i1, y, ybf); break;
    case IQ4_XS: dequantize_part(IQ4_XS, w, in, ids, i0, i1, y, ybf); break;
    case F16: dequantize_part(F16, w, in, ids, i0, i1, y, ybf); break;
    case BF16: dequantize_part(BF16, w, in, ids, i0, i1, y, ybf); break;
    }
}

/* y [n, in] = rows ids[0..n) of W (all rows 0..n-1 when ids is NULL), float32 or bfloat16 (ybf,
 * rounded to nearest even). The values are gguf.quants.dequantize's, bit for bit, in float32.
 * Returns 0; -1 unknown type or `in` not a multiple of its block; -3 an id outside 0..out-1. */
#if ML_PART(0)
int quant_dequantize(int t, const uint8_t *w, int64_t out, int64_t in, const int64_t *ids, int64_t n, void *y,
                     int ybf, int64_t threads) {
    if (block_bytes(t) == 0 || in % block_elems(t)) return -1;
    if (ids)
        for (int64_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= out) return -3;
    if (threads <= 1 || n < 2) {
        dequantize_any(t, w, in, ids, 0, n, y, ybf);
    } else {
#pragma omp parallel num_threads(threads)
        {
            int64_t lo, hi;
            thread_share(n, 1, &lo, &hi);
            if (lo < hi) dequantize_any(t, w, in, ids, lo, hi, y, ybf);
        }
    }
    return 0;
}
#endif

/* ---- quantize (ggml's reference rounding, as gguf.quants.quantize) ---------------------------- *
 * Bit-exactness needs each float operation rounded where the reference rounds it: GCC would
 * otherwise fuse x * id + 8.5 into one fma (-ffp-contract=fast is its default for GNU C);
 * Clang fuses only within one expression, so the products below are separate statements. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define NO_FMA
#endif

NO_FMA static void quantize_q8_0(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t h = f32_to_f16(d);
    memcpy(out, &h, 2);
    for (int j = 0; j < 32; j++) {
        float v = x[j] * id;
        out[2 + j] = (uint8_t)(int8_t)roundf(v); /* half away from zero, as np_roundf */
    }
}

NO_FMA static void quantize_q4_0(const float *x, uint8_t *out) {
    float amax = fabsf(x[0]), mx = x[0]; /* the first element of largest magnitude, sign kept */
    for (int j = 1; j < 32; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            mx = x[j];
        }
    float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t h = f32_to_f16(d);
    memcpy(out, &h, 2);
    uint8_t q[32];
    for (int j = 0; j < 32; j++) {
        float v = x[j] * id;
        v = truncf(v + 8.5f);
        q[j] = v >= 15.0f ? 15 : (uint8_t)v;
    }
    for (int j = 0; j < 16; j++) out[2 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
}

NO_FMA static void quantize_q4_1(const float *x, uint8_t *out) {
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; j++) {
        mn = x[j] < mn ? x[j] : mn;
        mx = x[j] > mx ? x[j] : mx;
    }
    float d = (mx - mn) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t hd = f32_to_f16(d), hm = f32_to_f16(mn);
    memcpy(out, &hd, 2);
    memcpy(out + 2, &hm, 2);
    uint8_t q[32];
    for (int j = 0; j < 32; j++) {
        float v = x[j] - mn;
        v = v * id;
        v = truncf(v + 0.5f);
        q[j] = v >= 15.0f ? 15 : (uint8_t)v;
    }
    for (int j = 0; j < 16; j++) out[4 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
}

/* blocks [rows, in / 32 * block bytes] = x [rows, in] (float32, or bfloat16 when xbf) quantised
 * to Q8_0, Q4_0 or Q4_1 exactly as gguf.quants.quantize does (finite inputs). Rows are split
 * over `threads`. Returns 0; -1 another type or `in` not a multiple of 32. */
#if ML_PART(0)
int quant_quantize(int t, const void *x, int xbf, int64_t rows, int64_t in, uint8_t *out, int64_t threads) {
    (void)threads; /* without OpenMP */
    if ((t != Q8_0 && t != Q4_0 && t != Q4_1) || in % 32) return -1;
    int64_t nb = in / 32, bb = block_bytes(t);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            float blk[32];
            if (xbf)
                for (int j = 0; j < 32; j++) blk[j] = bits_f32((uint32_t)((const uint16_t *)x)[r * in + b * 32 + j] << 16);
            else
                memcpy(blk, (const float *)x + r * in + b * 32, sizeof blk);
            uint8_t *o = out + (r * nb + b) * bb;
            if (t == Q8_0) quantize_q8_0(blk, o);
            else if (t == Q4_0) quantize_q4_0(blk, o);
            else quantize_q4_1(blk, o);
        }
    return 0;
}
#endif

/* ---- panels: 16 outputs side by side, for batch-1 decode -------------------------------------- *
 *
 * Why: in GGUF's layout a block's 32 quants sit along the input, so a 16-lane kernel must widen
 * bytes into lanes with cross-lane shuffles and sum each output's lanes at the end; on Zen 4
 * those shuffles, not memory, bound a 4-bit matvec (about 7 cycles per block per core). Putting
 * 16 outputs in the 16 lanes instead, each lane's quants come out of one 32-bit word with an
 * AND (and for Q5_0 and Q6_K one more bitwise op), an exact integer-to-float conversion and one
 * fma against a broadcast input: no shuffles, no horizontal sums. A panel is a permutation of
 * the same bits (the file's quantisation, the same size); the converted cache keeps GGUF's own
 * layout, and weights are regrouped in memory when a model is built (`QuantWeight.panelled`;
 * quant.py's `_panel_sources` states the same layout bit by bit, and the tests hold the two to
 * each other).
 *
 * Layout (out a multiple of 16): panel p holds outputs 16p..16p+15; its blocks b = 0..nb-1
 * follow each other, each the 16 outputs' block b regrouped into a head and nib:
 *   Q4_0: head d[16] f16 (32 bytes)                 + nib[4][16] u32 (256): 288 bytes = 16 x 18
 *   Q4_1: head d[16] f16, m[16] f16 (64)            + nib: 320 bytes = 16 x 20
 *   Q5_0: head d[16] f16, hi[16] u32 (96)           + nib: 352 bytes = 16 x 22
 * nib[v][j]: output j's 4-bit quants of elements 8v..8v+7, element 8v+k in bits 4k..4k+3;
 * hi[j]: output j's 5th bits, element 8v+k's at bit v + (k < 7 ? 4k + 4 : 0) (shifted down v
 * bits, AND with one constant puts a group's bit where its quant's 5th bit goes: see `pquant`).
 * nib comes first, except in the odd panel blocks (counting from the weight's start) of Q4_0
 * and Q5_0, which start at 32 mod 64: there the head comes first, so that every 64-byte load of
 * nib is aligned (a load across two cache lines costs two). The K super-blocks (256 elements):
 *   Q4_K: nib[8 sub-blocks][4][16] u32 (2048) | d[16] | dmin[16] | scales[3][16] u32 (GGUF's 12
 *         scale bytes of each output, 4 to a word): 2304 bytes = 16 x 144
 *   Q6_K: nib[32][16] u32 (low 4 bits) | hi[16][16] u32 (2 high bits: groups 2w and 2w + 1 in
 *         word w, element 8g+k's at 4k + 4 + 2 (g % 2), at 2 (g % 2) for k = 7) | scales[4][16]
 *         u32 (the int8 scales, 4 to a word) | d[16]: 3360 bytes = 16 x 210; the odd ones put d
 *         first (see `q6k_at`)
 * The types added later follow the same patterns:
 *   Q5_1: nib | head d[16], m[16], hi[16] u32 (128; hi as Q5_0's): 384 bytes = 16 x 24
 *   IQ4_NL: as Q4_0 (each nibble an index into IQ4_VALUES)
 *   Q5_K: nib (as Q4_K) | hi[8 sub-blocks][16] u32 (as Q5_0's) | d[16] | dmin[16] | scales[3][16]:
 *         2816 bytes = 16 x 176
 *   IQ4_XS: nib (as Q4_K) | d[16] | scales_h[16] u16 | scales_l[16] u32: 2176 bytes = 16 x 136
 *   Q2_K: q[16 sub-blocks of 16][16] u32 (2-bit quants: element k of the sub-block's first 8 at
 *         bits 4k, 4k + 1, of its last 8 at 4k + 2, 4k + 3) | scales[4][16] u32 (GGUF's 16 scale
 *         bytes, 4 to a word) | d[16] | dmin[16]: 1344 bytes = 16 x 84
 *   Q3_K: q[16][16] u32 (the 2 low bits, as Q2_K) | hi[8][16] u32 (the third bits of sub-blocks
 *         2w and 2w + 1 in word w: element k of a sub-block's first 8 at 4k + 2 (i % 2), of its
 *         last 8 at 4k + 1 + 2 (i % 2), for sub-block i) | scales[3][16] u32 | d[16]: 1760 bytes
 *         = 16 x 110; the odd ones put d first (see `q3k_at`)
 *
 * Arithmetic (per row of x and output): a (sub-)block's weights are scale q + c off with q the
 * unsigned quant: Q4_1 d q + m, Q4_0 d (q - 8), Q5_0 d (q - 16), Q4_K (d sc) q - dmin m, Q6_K
 * (d sc) (q - 32); Q5_1 as Q4_1, Q5_K and Q2_K as Q4_K, Q3_K (d (sc - 32)) (q - 4) with q its
 * 3 bits; IQ4_NL and IQ4_XS have no offset (q a value of IQ4_VALUES, read from a table). So y = sum over (sub-)blocks of [scale (sum_i q_i x_i) + c off S] with S the
 * (sub-)block's input sum. Lane k of a word is converted as q 2^e(k) (exact: at most 6
 * significant bits) against x prescaled by 2^-e(k) (exact but for inputs below ~2^-98), so each
 * product q x is exact inside its fma. Order, the same for every row count, tile and thread:
 * each (sub-)block's products in element order into a fresh sum, then acc = fma(sum, scale, acc)
 * and acc = fma(off, c S, acc), in order; S sums its inputs in a fixed order. The offset terms
 * make the error bound (n + 2 blocks + 2) u sum_i (|scale q_i| + |c off|) |x_i| (n elements a
 * sub-block) rather than the GGUF kernel's; tests/test_quant_panels.py holds every type to it. */

/* the 32-element types' panels: a head and nib; the head's size, whether the odd blocks swap the
 * two (their 16 blocks are not a whole number of cache lines), where m and hi sit in the head */
INLINE int panel_head(const int t) { return t == Q4_0 || t == IQ4_NL ? 32 : t == Q4_1 ? 64 : t == Q5_0 ? 96 : 128; }
INLINE int panel_swaps(const int t) { return t == Q4_0 || t == Q5_0 || t == IQ4_NL; }
INLINE int head_hi(const int t) { return t == Q5_0 ? 32 : 64; }
/* offsets of nib and of the head in panel block g (counted from the weight's first) */
INLINE int64_t nib_at(const int t, int64_t g) { return panel_swaps(t) && (g & 1) ? panel_head(t) : 0; }
INLINE int64_t head_at(const int t, int64_t g) { return panel_swaps(t) && (g & 1) ? 0 : 256; }
/* Q5_0, Q5_1, Q5_K: the bit of a panel's hi word holding element i's 5th bit */
INLINE int q5_hi_bit(int i) { return i / 8 + (i % 8 < 7 ? 4 * (i % 8) + 4 : 0); }
/* GGUF: the first quant byte, and Q5_0 / Q5_1's qh */
INLINE int panel_qs(const int t) { return t == Q4_0 || t == IQ4_NL ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8; }
INLINE int gguf_qh(const int t) { return t == Q5_0 ? 2 : 4; }
INLINE int small_panel(const int t) { return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == IQ4_NL; }
INLINE int five_bit(const int t) { return t == Q5_0 || t == Q5_1 || t == Q5_K; }
INLINE int iq4(const int t) { return t == IQ4_NL || t == IQ4_XS; }

static int panel_type(int t) { return small_panel(t) || IS_K(t); }

/* Q6_K panel super-blocks: where d, nib, hi and the scales start; the odd ones (which start at
 * 32 mod 64) put d first so that nib and hi stay aligned */
typedef struct {
    int d, nib, hi, sc;
} k6_at;
INLINE k6_at q6k_at(int64_t g) { return g & 1 ? (k6_at){0, 32, 2080, 3104} : (k6_at){3328, 0, 2048, 3072}; }
/* Q3_K panel super-blocks alike: d, q (the low bits), hi, scales */
typedef struct {
    int d, q, hi, sc;
} k3_at;
INLINE k3_at q3k_at(int64_t g) { return g & 1 ? (k3_at){0, 32, 1056, 1568} : (k3_at){1728, 0, 1024, 1536}; }
/* the fixed offsets of the other K types' panel blocks (-1: none) */
typedef struct {
    int hi, d, dmin, sc;
} kk_at;
INLINE kk_at kk(const int t) {
    return t == Q4_K ? (kk_at){-1, 2048, 2080, 2112} : t == Q5_K ? (kk_at){2048, 2560, 2592, 2624}
         : t == IQ4_XS ? (kk_at){-1, 2048, 2080, 2112} : (kk_at){-1, 1280, 1312, 1024}; /* Q2_K */
}

/* the `width` bits at bit `fs` of byte *f to bit `ts` of byte *to (whose bits there are 0) */
INLINE void move_bits(const uint8_t *f, int fs, uint8_t *to, int ts, int width) {
    *to |= (uint8_t)(((*f >> fs) & ((1u << width) - 1)) << ts);
}
/* one field between a GGUF block (g) and a panel (P): forward g -> P, back P -> g */
#define MOVE(gp, gs, pp, ps, width) (back ? move_bits(pp, ps, gp, gs, width) : move_bits(gp, gs, pp, ps, width))
#define COPY(gp, pp, n) (back ? memcpy(gp, pp, n) : memcpy(pp, gp, n))

/* GGUF block of output j (g) <-> lane j of panel block P, number g_index (the layouts above) */
static void panel_block(int t, uint8_t *g, uint8_t *P, int64_t g_index, int j, int back) {
    if (small_panel(t)) {
        const int qs = panel_qs(t);
        uint8_t *head = P + head_at(t, g_index), *nib = P + nib_at(t, g_index);
        COPY(g, head + 2 * j, 2); /* d */
        if (t == Q4_1 || t == Q5_1) COPY(g + 2, head + 32 + 2 * j, 2); /* m */
        for (int e = 0; e < 32; e++) /* GGUF: element e low nibble of byte e, 16 + e its high one */
            MOVE(g + qs + e % 16, 4 * (e / 16), nib + 64 * (e / 8) + 4 * j + (e % 8) / 2, 4 * (e & 1), 4);
        if (five_bit(t))
            for (int i = 0; i < 32; i++) {
                int hb = q5_hi_bit(i);
                MOVE(g + gguf_qh(t) + i / 8, i % 8, head + head_hi(t) + 4 * j + hb / 8, hb % 8, 1);
            }
    } else if (t == Q4_K || t == Q5_K || t == IQ4_XS) { /* nib [8 sub-blocks][4][16] u32, then kk(t)'s */
        const kk_at at = kk(t);
        COPY(g, P + at.d + 2 * j, 2);
        if (t == IQ4_XS) {
            COPY(g + 2, P + at.dmin + 2 * j, 2); /* scales_h (at dmin's place) */
            COPY(g + 4, P + at.sc + 4 * j, 4);   /* scales_l */
        } else {
            COPY(g + 2, P + at.dmin + 2 * j, 2);
            for (int w = 0; w < 3; w++) COPY(g + 4 + 4 * w, P + at.sc + 64 * w + 4 * j, 4);
        }
        for (int e = 0; e < 256; e++) {
            int sb = e / 32, l = e % 32, k = l % 8;
            uint8_t *to = P + 256 * sb + 64 * (l / 8) + 4 * j + k / 2;
            if (t == IQ4_XS) /* sub-block sb: 16 bytes at 8 + 16 sb, elements l and l + 16 in one */
                MOVE(g + 8 + 16 * sb + l % 16, 4 * (l / 16), to, 4 * (k & 1), 4);
            else /* sub-blocks 2i, 2i + 1: the low and high nibbles of 32 bytes */
                MOVE(g + (t == Q4_K ? 16 : 48) + 32 * (sb / 2) + l, 4 * (sb & 1), to, 4 * (k & 1), 4);
            if (t == Q5_K) { /* the 5th bit: bit sb of qh[l] */
                int hb = q5_hi_bit(l);
                MOVE(g + 16 + l, sb, P + at.hi + 64 * sb + 4 * j + hb / 8, hb % 8, 1);
            }
        }
    } else if (t == Q2_K || t == Q3_K) { /* element 128 n + 32 jj + 16 h + l: sub-block 8 n + 2 jj + h */
        const k3_at a3 = q3k_at(g_index);
        const int qo = t == Q2_K ? 0 : a3.q, qs = t == Q2_K ? 16 : 32;
        if (t == Q2_K) {
            const kk_at at = kk(t);
            for (int w = 0; w < 4; w++) COPY(g + 4 * w, P + at.sc + 64 * w + 4 * j, 4);
            COPY(g + 80, P + at.d + 2 * j, 2);
            COPY(g + 82, P + at.dmin + 2 * j, 2);
        } else {
            for (int w = 0; w < 3; w++) COPY(g + 96 + 4 * w, P + a3.sc + 64 * w + 4 * j, 4);
            COPY(g + 108, P + a3.d + 2 * j, 2);
        }
        for (int e = 0; e < 256; e++) {
            int n = e / 128, jj = (e % 128) / 32, h = (e % 32) / 16, l = e % 16, i = 8 * n + 2 * jj + h;
            int qb = 4 * (l % 8) + 2 * (l / 8); /* the 2 low bits in word i */
            MOVE(g + qs + 32 * n + 16 * h + l, 2 * jj, P + qo + 64 * i + 4 * j + qb / 8, qb % 8, 2);
            if (t == Q3_K) { /* the third: bit 4 n + jj of hmask[16 h + l] */
                int hb = 4 * (l % 8) + l / 8 + 2 * (i & 1);
                MOVE(g + 16 * h + l, 4 * n + jj, P + a3.hi + 64 * (i / 2) + 4 * j + hb / 8, hb % 8, 1);
            }
        }
    } else { /* Q6_K: nib [32][16] u32, hi [16][16] u32, scales [4][16] u32, d[16] (q6k_at) */
        k6_at at = q6k_at(g_index);
        COPY(g + 208, P + at.d + 2 * j, 2);
        for (int w = 0; w < 4; w++) COPY(g + 192 + 4 * w, P + at.sc + 64 * w + 4 * j, 4);
        for (int e = 0; e < 256; e++) {
            int n = e / 128, c = (e % 128) / 32, l = e % 32, gg = e / 8, k = e % 8;
            MOVE(g + 64 * n + l + 32 * (c & 1), 4 * (c >> 1), P + at.nib + 64 * gg + 4 * j + k / 2, 4 * (k & 1), 4);
            int hs = (k < 7 ? 4 * k + 4 : 0) + 2 * (gg & 1); /* bit of the hi word */
            MOVE(g + 128 + 32 * n + l, 2 * c, P + at.hi + 64 * (gg / 2) + 4 * j + hs / 8, hs % 8, 2);
        }
    }
}

/* GGUF blocks w [out, nb * BB] <-> panels p (the same bytes regrouped); back = 1: panels -> blocks */
static void panel_part(int t, uint8_t *w, int64_t nb, uint8_t *p, int back, int64_t p_lo, int64_t p_hi) {
    const int BB = block_bytes(t);
    for (int64_t pn = p_lo; pn < p_hi; pn++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *P = p + (pn * nb + b) * 16 * BB;
            if (!back) memset(P, 0, 16 * (size_t)BB); /* moves OR into zeroed bytes */
            for (int j = 0; j < 16; j++) {
                uint8_t *g = w + ((pn * 16 + j) * nb + b) * BB;
                if (back) memset(g, 0, (size_t)BB);
                panel_block(t, g, P, pn * nb + b, j, back);
            }
        }
}

/* 1 << t for each type with a panel matmul in this build (every path has them) */
#if ML_PART(1)
int quant_panel_types(void) {
    return 1 << Q4_0 | 1 << Q4_1 | 1 << Q5_0 | 1 << Q5_1 | 1 << Q2_K | 1 << Q3_K | 1 << Q4_K | 1 << Q5_K | 1 << Q6_K |
           1 << IQ4_NL | 1 << IQ4_XS;
}
#endif

/* blocks [out, in / 32 * BB] -> panels (back = 0) or panels -> blocks (back = 1), the same
 * size. Q8_0 has panels of its own, for q8 activations only (quant_q8_0.h). Returns 0; -1 not a
 * panel type, `in` not a multiple of 32 or `out` of 16. */
static void q8_0_panel_part(uint8_t *blocks, int64_t nb, uint8_t *panels, int back, int64_t lo, int64_t hi);
#if ML_PART(1)
int quant_panel(int t, uint8_t *blocks, int64_t out, int64_t in, uint8_t *panels, int back, int64_t threads) {
    (void)threads;
    if (!(panel_type(t) || t == Q8_0) || in % block_elems(t) || out % 16 || out <= 0) return -1;
    int64_t np = out / 16, nb = in / block_elems(t);
#pragma omp parallel num_threads(threads) if (threads > 1 && np > 1)
    {
        int64_t lo, hi;
        thread_share(np, 1, &lo, &hi);
        if (lo < hi && t == Q8_0) q8_0_panel_part(blocks, nb, panels, back, lo, hi);
        else if (lo < hi) panel_part(t, blocks, nb, panels, back, lo, hi);
    }
    return 0;
}
#endif

/* lane k of a quant word is converted as q 2^pshift(k). AVX-512 converts unsigned: only Q5_0's
 * and Q6_K's lane 7 (5, 6 bits) is first shifted down 4 so that q 2^28 stays below 2^32; the
 * portable kernel converts signed, so every lane 7 is shifted down (q 2^24 < 2^31). */
/* IQ4 types: their values are looked up (vpermps) as floats on AVX-512 (no scaling, 0), and
 * elsewhere from a byte table into the top byte of a lane (2^24, `pquant8`) */
#ifdef ML_AVX512
INLINE int pshift(const int t, const int k) { return iq4(t) ? 0 : (five_bit(t) || t == Q6_K) && k == 7 ? 24 : 4 * k; }
#else
INLINE int pshift(const int t, const int k) { return iq4(t) || k == 7 ? 24 : 4 * k; }
#endif

/* Per row of x, prepared once per call: xs [in] = x 2^-pshift(i % 8) (exact but below ~2^-98);
 * S [3 nb]: each 32 inputs' sum, then each 16 inputs' sum (in a fixed order, the same on every
 * path: `sum16`, the 32 as elements i and i + 16 first) */
static void panel_prep(int t, const void *x, int xbf, int64_t in, float *xs, float *S) {
    vec scale;
    const int64_t nb = in / 32;
    for (int i = 0; i < W; i++) scale[i] = ldexpf(1.0f, -pshift(t, i % 8));
    for (int64_t b = 0; b < nb; b++) {
        vec v[NV], both[16 / W];
        for (int i = 0; i < NV; i++) {
            v[i] = xbf ? (vec)(zx16((const uint8_t *)((const uint16_t *)x + 32 * b + W * i)) << 16)
                       : ldf((const float *)x + 32 * b + W * i);
            vec scaled = v[i] * scale;
            memcpy(xs + 32 * b + W * i, &scaled, sizeof scaled);
        }
        for (int h = 0; h < 2; h++) S[nb + 2 * b + h] = sum16(v + h * (NV / 2));
        for (int i = 0; i < NV / 2; i++) both[i] = v[i] + v[i + NV / 2];
        S[b] = sum16(both);
    }
}

/* A panel block holds SUBS(t) sub-blocks, each with its own scale: Q4_0/Q4_1/Q5_0 one of 32
 * elements, Q4_K eight of 32, Q6_K sixteen of 16; a sub-block is GROUPS(t) words of 8 quants */
INLINE int psubs(const int t) { return t == Q6_K || t == Q2_K || t == Q3_K ? 16 : IS_K(t) ? 8 : 1; }
INLINE int pgroups(const int t) { return psubs(t) == 16 ? 2 : 4; }
/* whether a sub-block's weights have an offset term (c off S): all but the IQ4 types */
INLINE int poff(const int t) { return !iq4(t); }

/* every cache line of each of T panels' block b + dist, into L2 (prefetcht1): T streams of short
 * blocks are more than the hardware prefetchers keep ahead of. On AVX-512 one block ahead:
 * measured on 24 distinct 6 MB Q5_0 weights streamed from DRAM, 2 threads (Zen 4): 12 GB/s with
 * no software prefetch or with prefetches into L1, 18 GB/s with this (distance 1, 2 or 3 blocks
 * into L2 or L3: 16-18). The 8-lane paths take a panel's blocks more slowly, and gain from
 * reaching further: about 4 KB ahead (Zen 3, 2 threads, SmolLM2's Q4_1 layers streamed from
 * DRAM: 13.4 GB/s one block ahead, 14-15.7 at 2-8 KB; Q4_K and Q6_K best at 2 blocks) */
INLINE int pdist(const int t) {
#ifdef ML_AVX512
    (void)t;
    return 1;
#else
    return (4096 + 16 * block_bytes(t) - 1) / (16 * block_bytes(t));
#endif
}
INLINE void pprefetch_at(const int t, const uint8_t *pw, int64_t pb, int64_t p0, int64_t b, int sb, const int T,
                         const int dist) {
    /* spread over the block's sub-blocks: a K block is 36-53 lines a panel, too many at once */
    const int BB16 = 16 * block_bytes(t), lines = (BB16 + 63) / 64, from = sb * lines / psubs(t),
              to = (sb + 1) * lines / psubs(t);
    UNROLL for (int tt = 0; tt < T; tt++) for (int l = from; l < to; l++)
        __builtin_prefetch(pw + (p0 + tt) * pb + (b + dist) * BB16 + 64 * l, 0, 2);
}
INLINE void pprefetch(const int t, const uint8_t *pw, int64_t pb, int64_t p0, int64_t b, int sb, const int T) {
    pprefetch_at(t, pw, pb, p0, b, sb, T, pdist(t));
}

/* Each (type, tile) of the panel kernels below is a function of its own (`ptile`, `prows` are
 * each path's), as the GGUF-layout tiles are */
typedef void (*ptile_fn)(const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, int64_t p0,
                         void *y, int64_t out, int ybf);
typedef void (*prows_fn)(const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, int64_t p,
                         void *y, int64_t out, int ybf, int R);
/* a type's panel kernels: one row against 8, 4, 2, 1 panels (AVX-512; 1 and 2 elsewhere, 2 NULL
 * where one panel was fastest), and `prows` */
typedef struct {
    ptile_fn tile[4];
    prows_fn rows;
    prows_fn few; /* AVX-512: `pfew`, 2 to PFEW_ROWS rows against PFEW_PANELS panels; NULL elsewhere */
} ptile_set;
#define PANEL_TYPES(X) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(IQ4_NL) X(IQ4_XS)
#define PSET_CASE(TY) case TY: return &p##TY##_set;
#define PSET_OF static const ptile_set *pset(int t) { switch (t) { PANEL_TYPES(PSET_CASE) default: return NULL; } }
#define PTILE(TY, T)                                                                               \
    static __attribute__((noinline)) void p##TY##_##T(const uint8_t *pw, int64_t nb, const float *xs, const float *S,  \
                                                      int64_t in, int64_t p0, void *y, int64_t out, int ybf) {       \
        ptile(TY, pw, nb, xs, S, in, p0, y, out, ybf, T);                                          \
    }
#define PROWS(TY)                                                                                  \
    static __attribute__((noinline)) void p##TY##_rows(const uint8_t *pw, int64_t nb, const float *xs, const float *S, \
                                                       int64_t in, int64_t p, void *y, int64_t out, int ybf, int R) {  \
        prows(TY, pw, nb, xs, S, in, p, y, out, ybf, R);                                           \
    }

#ifdef ML_AVX512
/* The exact quant q 2^pshift(k) of element k of a group of 8, in each lane, from the lanes'
 * quant word V and (Q5_0, Q6_K) the group's hi word H */
INLINE __m512i pquant(const int t, const int k, __m512i V, __m512i H) {
    const int e = pshift(t, k);
    if (t == Q2_K || t == Q3_K) /* 2 or 3 bits at 4k (Q3_K's merged by `pwords`): at most 7 2^28 */
        return _mm512_and_si512(V, _mm512_set1_epi32((int)((t == Q2_K ? 3u : 7u) << e)));
    const int high = five_bit(t) || t == Q6_K;
    __m512i q = k == 7 && high ? _mm512_and_si512(_mm512_srli_epi32(V, 4), _mm512_set1_epi32(15 << 24))
                               : _mm512_and_si512(V, _mm512_set1_epi32((int)(15u << e)));
    if (high) { /* the 1 or 2 high bits sit at 4k + 4 in H (at 0 for k = 7, moved to 28) */
        __m512i h = k == 7 ? _mm512_slli_epi32(H, 28) : H;
        const unsigned bits = t == Q6_K ? 3u : 1u;
        q = _mm512_ternarylogic_epi32(q, h, _mm512_set1_epi32((int)(bits << (e + 4))), 0xF8); /* q | (h & mask) */
    }
    return q;
}

/* element k's value as a float: q 2^pshift(k) converted exactly, or (IQ4) looked up */
INLINE __m512 pquantf(const int t, const int k, __m512i V, __m512i H) {
    if (iq4(t)) return _mm512_permutexvar_ps(k ? _mm512_srli_epi32(V, 4 * k) : V, (__m512)IQ4_VALUES);
    return _mm512_cvtepu32_ps(pquant(t, k, V, H));
}

/* group v of sub-block sb of panel block P (number g): the quant word V, the hi word H (Q5_0,
 * Q6_K: shifted so that the group's bits sit at 4k + 4, and at 0 for k = 7) */
INLINE void pwords(const int t, const uint8_t *P, int64_t g, int sb, int v, __m512i *V, __m512i *H) {
    if (t == Q4_K || t == Q5_K || t == IQ4_XS) {
        *V = _mm512_loadu_si512(P + 256 * sb + 64 * v);
        if (t == Q5_K) *H = _mm512_srl_epi32(_mm512_loadu_si512(P + kk(t).hi + 64 * sb), _mm_cvtsi32_si128(v));
    } else if (t == Q6_K) {
        const k6_at at = q6k_at(g);
        *V = _mm512_loadu_si512(P + at.nib + 64 * (2 * sb + v));
        __m512i h = _mm512_loadu_si512(P + at.hi + 64 * sb); /* groups 2 sb, 2 sb + 1 */
        *H = v ? _mm512_srli_epi32(h, 2) : h;
    } else if (t == Q2_K) { /* group v of sub-block sb: its 2 bits at 4k + 2v */
        __m512i q = _mm512_loadu_si512(P + 64 * sb);
        *V = v ? _mm512_srli_epi32(q, 2) : q;
    } else if (t == Q3_K) { /* the 2 low bits at 4k and the third (moved to 4k + 2) in one word */
        const k3_at at = q3k_at(g);
        __m512i q = _mm512_srl_epi32(_mm512_loadu_si512(P + at.q + 64 * sb), _mm_cvtsi32_si128(2 * v));
        __m512i h = _mm512_loadu_si512(P + at.hi + 64 * (sb / 2));
        h = _mm512_srl_epi32(sb & 1 ? h : _mm512_slli_epi32(h, 2), _mm_cvtsi32_si128(v));
        *V = _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x33333333), q, h, 0xCA); /* mask ? q : h */
    } else {
        *V = _mm512_loadu_si512(P + nib_at(t, g) + 64 * v);
        if (five_bit(t))
            *H = _mm512_srl_epi32(_mm512_loadu_si512(P + head_at(t, g) + head_hi(t)), _mm_cvtsi32_si128(v));
    }
}

/* sub-block sb's scale and offset vectors: its weights are scale q + c off, off times the
 * sub-block's input sum S[at] (at: into a row's S) */
INLINE __m512 ph16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

INLINE void pscales(const int t, const uint8_t *P, int64_t g, int64_t b, int sb, int64_t n32, __m512 *scale,
                    __m512 *off, float *c, int64_t *at) {
    const __m128i by = _mm_cvtsi32_si128(8 * (sb % 4));
    if (t == Q2_K) { /* d sc q - dmin m: scale byte sb, sc its low 4 bits, m its high */
        const kk_at k2 = kk(t);
        __m512i w = _mm512_srl_epi32(_mm512_loadu_si512(P + k2.sc + 64 * (sb / 4)), by);
        *scale = _mm512_mul_ps(ph16(P + k2.d), _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15))));
        *off = _mm512_mul_ps(ph16(P + k2.dmin),
                             _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 4), _mm512_set1_epi32(15))));
        *c = -1.0f;
        *at = n32 + 16 * b + sb;
    } else if (t == Q3_K) { /* d (sc - 32) (q - 4) */
        const k3_at k3 = q3k_at(g);
        const int i = sb % 8;
        __m512i lo = _mm512_srl_epi32(_mm512_loadu_si512(P + k3.sc + 64 * (i / 4)), _mm_cvtsi32_si128(8 * (i % 4) + 4 * (sb / 8)));
        __m512i hi = _mm512_srl_epi32(_mm512_loadu_si512(P + k3.sc + 128), _mm_cvtsi32_si128(8 * (sb % 4) + 2 * (sb / 4)));
        __m512i sc = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(15)),
                                     _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4));
        *scale = *off = _mm512_mul_ps(ph16(P + k3.d), _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))));
        *c = -4.0f;
        *at = n32 + 16 * b + sb;
    } else if (t == IQ4_XS) { /* d (ls - 32): ls's 4 low bits in scales_l, 2 high in scales_h */
        const kk_at kx = kk(t);
        __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(P + kx.dmin)));
        __m512i sl = _mm512_loadu_si512(P + kx.sc);
        __m512i ls = _mm512_or_si512(
            _mm512_and_si512(_mm512_srl_epi32(sl, _mm_cvtsi32_si128(4 * sb)), _mm512_set1_epi32(15)),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(sh, _mm_cvtsi32_si128(2 * sb)), _mm512_set1_epi32(3)), 4));
        *scale = _mm512_mul_ps(ph16(P + kx.d), _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
        *off = _mm512_setzero_ps();
        *c = 0.0f;
        *at = 0;
    } else if (t == Q4_K || t == Q5_K) { /* d sc q - dmin m (GGUF's get_scale_min_k4 for the 6-bit sc, m) */
        const kk_at k4 = kk(t);
        __m512 d = ph16(P + k4.d), dmin = ph16(P + k4.dmin);
        __m512i q0 = _mm512_loadu_si512(P + k4.sc), q1 = _mm512_loadu_si512(P + k4.sc + 64),
                q2 = _mm512_loadu_si512(P + k4.sc + 128);
        const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
        __m512i sc, mn;
        if (sb < 4) {
            sc = _mm512_and_si512(_mm512_srl_epi32(q0, _mm_cvtsi32_si128(8 * sb)), m63);
            mn = _mm512_and_si512(_mm512_srl_epi32(q1, _mm_cvtsi32_si128(8 * sb)), m63);
        } else {
            __m128i lo = _mm_cvtsi32_si128(8 * (sb - 4)), hi = _mm_cvtsi32_si128(8 * (sb - 4) + 6),
                    mid = _mm_cvtsi32_si128(8 * (sb - 4) + 4);
            sc = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi32(q2, lo), m15),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(q0, hi), m3), 4));
            mn = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi32(q2, mid), m15),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(q1, hi), m3), 4));
        }
        *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        *off = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
        *c = -1.0f;
        *at = 8 * b + sb;
    } else if (t == Q6_K) { /* d scale (q - 32), the int8 scale byte sb % 4 of word sb / 4 */
        const k6_at k6 = q6k_at(g);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(P + k6.d)));
        __m512i w = _mm512_loadu_si512(P + k6.sc + 64 * (sb / 4));
        __m512i sc = _mm512_srai_epi32(_mm512_sll_epi32(w, _mm_cvtsi32_si128(24 - 8 * (sb % 4))), 24);
        *scale = *off = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        *c = -32.0f;
        *at = n32 + 16 * b + sb;
    } else {
        const uint8_t *head = P + head_at(t, g);
        const int m = t == Q4_1 || t == Q5_1;
        *scale = ph16(head);
        *off = m ? ph16(head + 32) : t == IQ4_NL ? _mm512_setzero_ps() : *scale;
        *c = m ? 1.0f : t == Q4_0 ? -8.0f : t == Q5_0 ? -16.0f : 0.0f;
        *at = b;
    }
}

/* the 8 quants of a group as exact floats q 2^pshift(k) */
INLINE void pdecode(const int t, __m512i V, __m512i H, __m512 *f) {
    UNROLL for (int k = 0; k < 8; k++) f[k] = pquantf(t, k, V, H);
}

/* R <= RMAX rows of prepared x against T panels p0..: per (row, lane), each sub-block's products
 * in element order into a fresh sum, then acc = fma(sum, scale, acc) and acc = fma(off, c S, acc),
 * as `prows` does, so a row's result is the same alone or in a batch. Why T panels: `prows` walks
 * one panel, so R rows give it R fma chains, each 8 fmas a group long; at 2-4 rows they wait on
 * the fma's latency (SmolLM2's Q4_1 gate_up [3072, 576] at 2 rows took 85-127 us, 3.4x one row, on
 * an AMD EPYC Zen 4). T panels make T R chains and share each input's broadcast among them. Rows
 * past R are skipped by branches that predict perfectly, as in `tile`. */
INLINE void pfew(const int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, int64_t p0,
                 void *y, int64_t out, int ybf, const int T, const int RMAX, int R) {
    const int BB16 = 16 * block_bytes(t), SUBS = psubs(t), GROUPS = pgroups(t), SE = 8 * GROUPS;
    const int64_t pb = nb * BB16, n32 = in / 32, stride = 3 * n32;
    __m512 acc[T * RMAX];
    UNROLL for (int i = 0; i < T * RMAX; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        _Pragma("GCC unroll 1") for (int sb = 0; sb < SUBS; sb++) {
            pprefetch(t, pw, pb, p0, b, sb, T);
            __m512 sum[T * RMAX];
            UNROLL for (int i = 0; i < T * RMAX; i++) sum[i] = _mm512_setzero_ps();
            UNROLL for (int v = 0; v < GROUPS; v++) {
                const float *xv = xs + b * SUBS * SE + sb * SE + 8 * v;
                UNROLL for (int tt = 0; tt < T; tt++) {
                    const int64_t g = (p0 + tt) * nb + b;
                    __m512i V, H = _mm512_setzero_si512();
                    pwords(t, pw + g * BB16, g, sb, v, &V, &H);
                    UNROLL for (int k = 0; k < 8; k++) {
                        const __m512 f = pquantf(t, k, V, H);
                        UNROLL for (int r = 0; r < RMAX; r++)
                            if (r < R) sum[tt * RMAX + r] = _mm512_fmadd_ps(f, _mm512_set1_ps(xv[r * in + k]),
                                                                            sum[tt * RMAX + r]);
                    }
                }
            }
            UNROLL for (int tt = 0; tt < T; tt++) {
                const int64_t g = (p0 + tt) * nb + b;
                __m512 scale, off;
                float c;
                int64_t at;
                pscales(t, pw + g * BB16, g, b, sb, n32, &scale, &off, &c, &at);
                UNROLL for (int r = 0; r < RMAX; r++) {
                    if (r < R) {
                        acc[tt * RMAX + r] = _mm512_fmadd_ps(sum[tt * RMAX + r], scale, acc[tt * RMAX + r]);
                        if (poff(t))
                            acc[tt * RMAX + r] = _mm512_fmadd_ps(off, _mm512_set1_ps(c * S[r * stride + at]),
                                                                 acc[tt * RMAX + r]);
                    }
                }
            }
        }
    }
    UNROLL for (int tt = 0; tt < T; tt++) UNROLL for (int r = 0; r < RMAX; r++)
        if (r < R) st(y, r * out + (p0 + tt) * 16, (vec)acc[tt * RMAX + r], ybf);
}

/* One row of prepared x (xs, S) against panels p0..p0+T-1: per lane (output), each sub-block's
 * products in element order into a fresh sum, then acc = fma(sum, scale, acc) and
 * acc = fma(off, c S, acc) (c S exact: c a power of 2). T panels give T independent fma chains.
 * `pfew` with one row. */
INLINE void ptile(const int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, int64_t p0,
                  void *y, int64_t out, int ybf, const int T) {
    pfew(t, pw, nb, xs, S, in, p0, y, out, ybf, T, 1, 1);
}

/* R rows (any number up to PANEL_ROWS) of prepared x against panel p: the same operations per
 * (row, lane) in the same order as `ptile`, so a row's result is the same alone or in a batch.
 * Each group's 8 quants are decoded once for all rows; a row's sums stay in registers over the
 * group and in L1 between groups. */
#define PANEL_ROWS 32
static void prows(int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, int64_t p, void *y,
                  int64_t out, int ybf, int R) {
    const int BB16 = 16 * block_bytes(t), SUBS = psubs(t), GROUPS = pgroups(t), SE = 8 * GROUPS;
    const int64_t pb = nb * BB16, n32 = in / 32, stride = 3 * n32;
    __m512 acc[PANEL_ROWS], sum[PANEL_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t g = p * nb + b;
        const uint8_t *P = pw + g * BB16;
        for (int sb = 0; sb < SUBS; sb++) {
            pprefetch(t, pw, pb, p, b, sb, 1);
            for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_ps();
            for (int v = 0; v < GROUPS; v++) {
                __m512i V, H = _mm512_setzero_si512();
                __m512 f[8];
                pwords(t, P, g, sb, v, &V, &H);
                pdecode(t, V, H, f);
                const float *xv = xs + b * SUBS * SE + sb * SE + 8 * v;
                for (int r = 0; r < R; r++) {
                    __m512 s = sum[r];
                    UNROLL for (int k = 0; k < 8; k++) s = _mm512_fmadd_ps(f[k], _mm512_set1_ps(xv[r * in + k]), s);
                    sum[r] = s;
                }
            }
            __m512 scale, off;
            float c;
            int64_t at;
            pscales(t, P, g, b, sb, n32, &scale, &off, &c, &at);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_fmadd_ps(sum[r], scale, acc[r]);
                if (poff(t)) acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(c * S[r * stride + at]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) st(y, r * out + p * 16, (vec)acc[r], ybf);
}

/* `few`: PFEW_PANELS panels of up to PFEW_ROWS rows, as 4 panels x 2 rows or twice 2 panels x 4
 * rows (4 x 4 spilled its 32 sums and sums of scales: slower than `prows`; 2 x 8 too). Rows up to
 * PFEW_SPLIT go through it in groups of at most PFEW_ROWS, more through `prows`. SmolLM2's Q4_1
 * weights on an AMD EPYC Zen 4, 2 threads, medians of 41 calls, two processes each way in turn
 * (scripts/quant_kernel_speed.py's blocks), `prows` -> `few`:
 *   gate_up [3072, 576]: 2 rows 85-127 us -> 53-56 (one row: 32-38), 3 rows 96-140 -> 73-78, 4 rows
 *   105-147 -> 92-98, 5 rows 163-167 -> 127, 6 rows 176-183 -> 146-152;
 *   qkv [960, 576] 2 rows 29-43 -> 20-24, 4 rows 37-49 -> 33-38; down [576, 1536] 2 rows 45-62 ->
 *   29-36, 4 rows 57-82 -> 47-59; at 8 rows the groups were slower on these two (64-68 against
 *   57-71, 103-107 against 90-117): `prows` keeps 8 rows and more. */
#define PFEW_PANELS 4
#define PFEW_ROWS 4
#define PFEW_SPLIT 6

/* one row: 8 panels at a time (8 independent fma chains), then 4, 2, 1 for those left over (one
 * chain waits on the fma latency); 2 to PFEW_SPLIT rows: `few`; more rows: `prows`, panel by panel */
#define PFEW(TY)                                                                                   \
    static __attribute__((noinline)) void p##TY##_few(const uint8_t *pw, int64_t nb, const float *xs, const float *S,  \
                                                      int64_t in, int64_t p, void *y, int64_t out, int ybf, int R) {   \
        if (R <= 2) pfew(TY, pw, nb, xs, S, in, p, y, out, ybf, 4, 2, R);                          \
        else {                                                                                     \
            pfew(TY, pw, nb, xs, S, in, p, y, out, ybf, 2, 4, R);                                  \
            pfew(TY, pw, nb, xs, S, in, p + 2, y, out, ybf, 2, 4, R);                              \
        }                                                                                          \
    }
#define PTILE_SET(TY)                                                                              \
    PTILE(TY, 8) PTILE(TY, 4) PTILE(TY, 2) PTILE(TY, 1) PROWS(TY) PFEW(TY)                          \
    static const ptile_set p##TY##_set = {{p##TY##_8, p##TY##_4, p##TY##_2, p##TY##_1}, p##TY##_rows, p##TY##_few};
PANEL_TYPES(PTILE_SET)
PSET_OF

/* panels lo..hi of one prepared row */
static void panel_row(int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, void *y,
                      int64_t out, int ybf, int64_t lo, int64_t hi) {
    int64_t p = lo;
    const ptile_fn *f = pset(t)->tile;
    for (; p + 8 <= hi; p += 8) f[0](pw, nb, xs, S, in, p, y, out, ybf);
    if (p + 4 <= hi) f[1](pw, nb, xs, S, in, p, y, out, ybf), p += 4;
    if (p + 2 <= hi) f[2](pw, nb, xs, S, in, p, y, out, ybf), p += 2;
    if (p < hi) f[3](pw, nb, xs, S, in, p, y, out, ybf);
}
#else /* ---- the panel matmul on every other path: vectors of 8 lanes ---------------------------- *
 * One AVX2 register, two NEON or SSE2 ones (`vec`, W = 8 here). A panel group's 16 lanes are two
 * halves (outputs 0-7 and 8-15) taken one after the other, each quant exact as in the AVX-512
 * kernel above; with FMA (AVX2, NEON) every `a * b + c` below is one fused multiply-add (GNU C
 * contracts them), so each product q x is exact inside it, as there. The order differs (`ptile`
 * says how), within the same bound. Without FMA (the generic x86 path) each product is rounded
 * before it is added: twice the rounding steps, which tests/test_quant_panels.py allows there.
 * Lane k = 7 is shifted down 4 (pshift 24, not 28): the conversion is signed here, and q 2^28
 * reaches 2^31. */
_Static_assert(W == 8, "the portable panel kernel is written for 8 lanes");
INLINE vecu ldu(const uint8_t *p) { vecu v; memcpy(&v, p, sizeof v); return v; }
INLINE vec cvt8(vecu q) { return __builtin_convertvector((veci)q, vec); }

/* each of the 32 bytes of v (each below 16) replaced by IQ4_BYTES[it] */
INLINE vecu tbl32(vecu v) {
#if defined(__AVX2__)
    return (vecu)_mm256_shuffle_epi8(_mm256_broadcastsi128_si256((__m128i)IQ4_BYTES), (__m256i)v);
#else
    bytes16 h[2];
    memcpy(h, &v, sizeof v);
    h[0] = tbl16(IQ4_BYTES, h[0]);
    h[1] = tbl16(IQ4_BYTES, h[1]);
    memcpy(&v, h, sizeof v);
    return v;
#endif
}

/* the exact quant q 2^pshift(k) of element k of a group of 8, in each lane, from the lanes'
 * quant word V (Q5_0, Q5_1, Q5_K, Q6_K: the merged words of `pwords8`; Q3_K: the merged word;
 * IQ4: V the even elements' values as bytes, H the odd ones', each taken into the top byte) */
INLINE vec pquant8(const int t, const int k, vecu V, vecu H) {
    const int e = pshift(t, k);
    if (iq4(t)) return cvt8(((k & 1 ? H : V) << (24 - 8 * (k / 2))) & 0xFF000000u);
    if (t == Q2_K || t == Q3_K) {
        const unsigned bits = t == Q2_K ? 3u : 7u;
        return cvt8(k == 7 ? (V >> 4) & (bits << 24) : V & (bits << e));
    }
    if (!five_bit(t) && t != Q6_K) return cvt8(k == 7 ? (V >> 4) & (15u << 24) : V & (15u << e));
    const unsigned bits = t == Q6_K ? 63u : 31u; /* 5 or 6 bits: the nibble and its high bits above it */
    if (k == 7) return cvt8(((H >> 4) & (15u << 24)) | ((H << 28) & ((bits >> 4) << 28)));
    return cvt8((k & 1 ? H : V) & (bits << e));
}

/* half `h` (outputs 8h..8h+7) of group v of sub-block sb of panel block P (number g): V, H.
 * Q5_0 and Q6_K: a quant's 1 or 2 high bits sit right above its nibble in the hi word (at 4k + 4,
 * where the quant word holds the next element's low bits), so two merged words hold whole quants:
 * V the even elements' (the hi bits at 4k + 4 for k = 0, 2, 4, 6 put in), H the odd ones' (at 8,
 * 16, 24 for k = 1, 3, 5, and element 7's at 0, below its nibble at 28). Each quant is then one
 * AND, where taking its nibble and its high bits apart was three (Qwen2.5-0.5B's Q5_0
 * weights streamed at 2 threads on a Zen 3: 10.3 -> 11.8 GB/s). */
INLINE void pwords8(const int t, const uint8_t *P, int64_t g, int sb, int v, int h, vecu *V, vecu *H) {
    vecu hi = {0};
    if (t == Q4_K || t == Q5_K || t == IQ4_XS) {
        *V = ldu(P + 256 * sb + 64 * v + 32 * h);
        if (t == Q5_K) hi = ldu(P + kk(t).hi + 64 * sb + 32 * h) >> (unsigned)v;
    } else if (t == Q6_K) {
        const k6_at at = q6k_at(g);
        *V = ldu(P + at.nib + 64 * (2 * sb + v) + 32 * h);
        vecu hh = ldu(P + at.hi + 64 * sb + 32 * h);
        hi = v ? hh >> 2 : hh;
    } else if (t == Q2_K) {
        *V = ldu(P + 64 * sb + 32 * h) >> (unsigned)(2 * v);
    } else if (t == Q3_K) { /* the 2 low bits at 4k, the third moved to 4k + 2 */
        const k3_at at = q3k_at(g);
        vecu hh = ldu(P + at.hi + 64 * (sb / 2) + 32 * h);
        hh = (sb & 1 ? hh : hh << 2) >> (unsigned)v;
        *V = ((ldu(P + at.q + 64 * sb + 32 * h) >> (unsigned)(2 * v)) & 0x33333333u) | (hh & 0x44444444u);
    } else {
        *V = ldu(P + nib_at(t, g) + 64 * v + 32 * h);
        if (five_bit(t)) hi = ldu(P + head_at(t, g) + head_hi(t) + 32 * h) >> (unsigned)v;
    }
    if (iq4(t)) { /* the values as bytes: even elements' in V, odd ones' in H */
        *H = tbl32((*V >> 4) & 0x0F0F0F0Fu);
        *V = tbl32(*V & 0x0F0F0F0Fu);
    }
    if (five_bit(t) || t == Q6_K) {
        const unsigned even = t == Q6_K ? 0x30303030u : 0x10101010u, odd = t == Q6_K ? 0x03030303u : 0x01010101u;
        vecu diff = *V ^ hi;
        *H = *V ^ (diff & odd);
        *V = *V ^ (diff & even);
    }
}

/* half h of sub-block sb's scale and offset (as `pscales` above) */
INLINE void pscales8(const int t, const uint8_t *P, int64_t g, int64_t b, int sb, int64_t n32, int h, vec *scale,
                     vec *off, float *c, int64_t *at) {
    if (t == Q2_K) {
        const kk_at k2 = kk(t);
        vecu w = ldu(P + k2.sc + 64 * (sb / 4) + 32 * h) >> (8 * (sb % 4));
        *scale = f16_to_vec(P + k2.d + 16 * h) * cvt8(w & 15u);
        *off = f16_to_vec(P + k2.dmin + 16 * h) * cvt8((w >> 4) & 15u);
        *c = -1.0f;
        *at = n32 + 16 * b + sb;
    } else if (t == Q3_K) {
        const k3_at k3 = q3k_at(g);
        const int i = sb % 8;
        vecu lo = ldu(P + k3.sc + 64 * (i / 4) + 32 * h) >> (8 * (i % 4) + 4 * (sb / 8));
        vecu hi = ldu(P + k3.sc + 128 + 32 * h) >> (8 * (sb % 4) + 2 * (sb / 4));
        *scale = *off = f16_to_vec(P + k3.d + 16 * h) * cvt8(((lo & 15u) | ((hi & 3u) << 4)) - 32u);
        *c = -4.0f;
        *at = n32 + 16 * b + sb;
    } else if (t == IQ4_XS) {
        const kk_at kx = kk(t);
        vecu sh = zx16(P + kx.dmin + 16 * h), sl = ldu(P + kx.sc + 32 * h);
        vecu ls = ((sl >> (4 * sb)) & 15u) | (((sh >> (2 * sb)) & 3u) << 4);
        *scale = f16_to_vec(P + kx.d + 16 * h) * cvt8(ls - 32u);
        *off = splat(0.0f);
        *c = 0.0f;
        *at = 0;
    } else if (t == Q4_K || t == Q5_K) {
        const kk_at k4 = kk(t);
        vec d = f16_to_vec(P + k4.d + 16 * h), dmin = f16_to_vec(P + k4.dmin + 16 * h);
        vecu q0 = ldu(P + k4.sc + 32 * h), q1 = ldu(P + k4.sc + 64 + 32 * h), q2 = ldu(P + k4.sc + 128 + 32 * h);
        vecu sc, mn;
        if (sb < 4) {
            sc = (q0 >> (8 * sb)) & 63u;
            mn = (q1 >> (8 * sb)) & 63u;
        } else {
            const int s = 8 * (sb - 4);
            sc = ((q2 >> s) & 15u) | (((q0 >> (s + 6)) & 3u) << 4);
            mn = ((q2 >> (s + 4)) & 15u) | (((q1 >> (s + 6)) & 3u) << 4);
        }
        *scale = d * cvt8(sc);
        *off = dmin * cvt8(mn);
        *c = -1.0f;
        *at = 8 * b + sb;
    } else if (t == Q6_K) {
        const k6_at k6 = q6k_at(g);
        vec d = f16_to_vec(P + k6.d + 16 * h);
        veci sc = (veci)(ldu(P + k6.sc + 64 * (sb / 4) + 32 * h) << (24 - 8 * (sb % 4))) >> 24;
        *scale = *off = d * __builtin_convertvector(sc, vec);
        *c = -32.0f;
        *at = n32 + 16 * b + sb;
    } else {
        const uint8_t *head = P + head_at(t, g);
        const int m = t == Q4_1 || t == Q5_1;
        *scale = f16_to_vec(head + 16 * h);
        *off = m ? f16_to_vec(head + 32 + 16 * h) : t == IQ4_NL ? splat(0.0f) : *scale;
        *c = m ? 1.0f : t == Q4_0 ? -8.0f : t == Q5_0 ? -16.0f : 0.0f;
        *at = b;
    }
}

/* One row of prepared x against panels p0..p0+T-1 (as `ptile` above, but for the order): per lane,
 * a sub-block's even elements into one sum and its odd ones into another, added at its end: 4T
 * chains of fmas. With 16 registers a tile holds few panels, and one chain per lane left the
 * fma latency, not the decode, the limit (streaming Q4_1 from DRAM at 2 threads on a Zen 3:
 * 8.4 GB/s with 2 panels and one chain, 10.4 with one panel and two). */
INLINE void ptile(const int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, int64_t p0,
                  void *y, int64_t out, int ybf, const int T) {
    const int BB16 = 16 * block_bytes(t), SUBS = psubs(t), GROUPS = pgroups(t), SE = 8 * GROUPS;
    const int64_t pb = nb * BB16, n32 = in / 32;
    (void)out;
    vec acc[2 * T];
    UNROLL for (int i = 0; i < 2 * T; i++) acc[i] = splat(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        _Pragma("GCC unroll 1") for (int sb = 0; sb < SUBS; sb++) {
            pprefetch(t, pw, pb, p0, b, sb, T);
            vec sum[2][2 * T];
            UNROLL for (int i = 0; i < 2 * T; i++) sum[0][i] = sum[1][i] = splat(0.0f);
            UNROLL for (int v = 0; v < GROUPS; v++) {
                const float *xv = xs + b * SUBS * SE + sb * SE + 8 * v;
                vecu V[2 * T], H[2 * T];
                UNROLL for (int i = 0; i < 2 * T; i++) {
                    const int64_t g = (p0 + i / 2) * nb + b;
                    H[i] = (vecu){0};
                    pwords8(t, pw + g * BB16, g, sb, v, i % 2, &V[i], &H[i]);
                }
                UNROLL for (int k = 0; k < 8; k++) {
                    const vec xk = splat(xv[k]);
                    UNROLL for (int i = 0; i < 2 * T; i++) sum[k & 1][i] = pquant8(t, k, V[i], H[i]) * xk + sum[k & 1][i];
                }
            }
            UNROLL for (int i = 0; i < 2 * T; i++) {
                const int64_t g = (p0 + i / 2) * nb + b;
                vec scale, off;
                float c;
                int64_t at;
                pscales8(t, pw + g * BB16, g, b, sb, n32, i % 2, &scale, &off, &c, &at);
                acc[i] = (sum[0][i] + sum[1][i]) * scale + acc[i];
                if (poff(t)) acc[i] = off * splat(c * S[at]) + acc[i];
            }
        }
    }
    UNROLL for (int i = 0; i < 2 * T; i++) st(y, (p0 + i / 2) * 16 + 8 * (i % 2), acc[i], ybf);
}

/* R rows against panel p (as `prows` above, in `ptile`'s order: even and odd elements apart).
 * A sub-block's quants are decoded once into `w` (both halves, every group: at most 2 KB, in
 * L1), then rows go through it PROWS_NR at a time with every sum in a register: per element,
 * two weight vectors and PROWS_NR inputs feed 2 PROWS_NR fmas. Decoding group by group and
 * running every row through each group instead kept the rows' sums in memory, a load and a
 * store per 4 fmas beside a load per input, and ran the fmas at about 60% of their peak on an
 * AMD EPYC Zen 3 at 16 rows. Each sum takes the same products in the same order either way. */
#define PANEL_ROWS 32
#define PROWS_NR 3 /* 2 halves x (even, odd) x 3 rows: 12 sums, 2 weights and an input in 16 registers */

/* rows r0 .. r0 + NR - 1 (NR a constant where inlined) of one sub-block: their even and odd sums */
INLINE void prows_block(const int t, const vec *w, const float *x, int64_t in, const int NR, vec *even, vec *odd) {
    const int GROUPS = pgroups(t);
    vec e[PROWS_NR][2], o[PROWS_NR][2];
    UNROLL for (int i = 0; i < NR; i++) e[i][0] = e[i][1] = o[i][0] = o[i][1] = splat(0.0f);
    UNROLL for (int v = 0; v < 4; v++) {
        if (v >= GROUPS) continue;
        UNROLL for (int k = 0; k < 8; k++) {
            const vec w0 = w[(0 * 4 + v) * 8 + k], w1 = w[(1 * 4 + v) * 8 + k];
            UNROLL for (int i = 0; i < NR; i++) {
                const vec xk = splat(x[i * in + 8 * v + k]);
                if (k & 1) {
                    o[i][0] = w0 * xk + o[i][0];
                    o[i][1] = w1 * xk + o[i][1];
                } else {
                    e[i][0] = w0 * xk + e[i][0];
                    e[i][1] = w1 * xk + e[i][1];
                }
            }
        }
    }
    UNROLL for (int i = 0; i < NR; i++) UNROLL for (int h = 0; h < 2; h++) {
        even[2 * i + h] = e[i][h];
        odd[2 * i + h] = o[i][h];
    }
}

INLINE void prows(const int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, int64_t p,
                  void *y, int64_t out, int ybf, int R) {
    const int BB16 = 16 * block_bytes(t), SUBS = psubs(t), GROUPS = pgroups(t), SE = 8 * GROUPS;
    const int64_t pb = nb * BB16, n32 = in / 32, stride = 3 * n32;
    vec acc[2 * PANEL_ROWS], even[2 * PANEL_ROWS], odd[2 * PANEL_ROWS], w[2 * 4 * 8];
    for (int r = 0; r < 2 * R; r++) acc[r] = splat(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t g = p * nb + b;
        const uint8_t *P = pw + g * BB16;
        for (int sb = 0; sb < SUBS; sb++) {
            pprefetch(t, pw, pb, p, b, sb, 1);
            for (int h = 0; h < 2; h++)
                for (int v = 0; v < GROUPS; v++) {
                    vecu V, H = (vecu){0};
                    pwords8(t, P, g, sb, v, h, &V, &H);
                    UNROLL for (int k = 0; k < 8; k++) w[(h * 4 + v) * 8 + k] = pquant8(t, k, V, H);
                }
            const float *x = xs + b * SUBS * SE + sb * SE;
            int r = 0; /* threes, then the last 4 as two pairs (one row alone leaves its 4 chains short) */
            for (; R - r >= PROWS_NR && R - r != 4; r += PROWS_NR)
                prows_block(t, w, x + r * in, in, PROWS_NR, even + 2 * r, odd + 2 * r);
            for (; R - r >= 2; r += 2) prows_block(t, w, x + r * in, in, 2, even + 2 * r, odd + 2 * r);
            if (R - r == 1) prows_block(t, w, x + r * in, in, 1, even + 2 * r, odd + 2 * r);
            for (int h = 0; h < 2; h++) {
                vec scale, off;
                float c;
                int64_t at;
                pscales8(t, P, g, b, sb, n32, h, &scale, &off, &c, &at);
                for (int r = 0; r < R; r++) {
                    acc[2 * r + h] = (even[2 * r + h] + odd[2 * r + h]) * scale + acc[2 * r + h];
                    if (poff(t)) acc[2 * r + h] = off * splat(c * S[r * stride + at]) + acc[2 * r + h];
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) st(y, r * out + p * 16 + 8 * h, acc[2 * r + h], ybf);
}

/* one row: NP panels at a time (4 NP chains), then 1 for those left over. One panel (4 chains)
 * was fastest streaming from DRAM on a Zen 3 for every type but Q4_K, whose sub-blocks' scales
 * cost more per group and which took two (13.2 -> 14.4 GB/s; Q5_0 7.3 with one, 5.9 with two) */
#define PTILE_SET(TY) PTILE(TY, 1) PROWS(TY) static const ptile_set p##TY##_set = {{p##TY##_1, NULL}, p##TY##_rows, NULL};
#define PTILE_SET2(TY)                                                                             \
    PTILE(TY, 1) PTILE(TY, 2) PROWS(TY) static const ptile_set p##TY##_set = {{p##TY##_1, p##TY##_2}, p##TY##_rows, NULL};
PTILE_SET(Q4_0)
PTILE_SET(Q4_1)
PTILE_SET(Q5_0)
PTILE_SET(Q5_1)
PTILE_SET(Q2_K)
PTILE_SET(Q3_K)
PTILE_SET2(Q4_K)
PTILE_SET2(Q5_K)
PTILE_SET(Q6_K)
PTILE_SET(IQ4_NL)
PTILE_SET2(IQ4_XS)
PSET_OF

static void panel_row(int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, void *y,
                      int64_t out, int ybf, int64_t lo, int64_t hi) {
    int64_t p = lo;
    const ptile_set *f = pset(t);
    if (f->tile[1])
        for (; p + 2 <= hi; p += 2) f->tile[1](pw, nb, xs, S, in, p, y, out, ybf);
    for (; p < hi; p++) f->tile[0](pw, nb, xs, S, in, p, y, out, ybf);
}
#endif

/* Up to this many rows go through the one-row tiles one row at a time, more panel by panel
 * (`prows`, each sub-block's quants decoded once for all rows). On an AMD EPYC Zen 3 (AVX2),
 * with `prows` keeping every sum in a register, both builds in one process called in turn (2
 * threads, median of 28 calls): 3 rows through `prows` against 3 passes of the one-row tiles,
 * Qwen2.5-0.5B's Q5_0 gate_up [9728, 896] 1.16 ms against 1.45, Qwen2.5-1.5B's Q4_K gate_up
 * [17920, 1536] 3.5 against 4.7; 4 rows 1.46 against 1.98 and 4.4 against 6.8. At 2 rows the
 * one-row passes stay ahead on small weights (SmolLM2's Q4_1 gate_up [3072, 576]: 154 us against
 * 171) and behind on large ones (Qwen2.5-1.5B's gate_up: 3.3 ms against 2.7). The results are
 * the same bits either way. On AVX-512 every count above one goes to `few` (up to PFEW_SPLIT rows)
 * or `prows`. */
#ifdef ML_AVX512
#define ROW_BY_ROW 1
#else
#define ROW_BY_ROW 2
#endif

/* panels lo..hi of R <= PANEL_ROWS prepared rows: one row through the tiles; more panel by panel,
 * up to PFEW_SPLIT (AVX-512) through `few` */
static void panel_chunk(int t, const uint8_t *pw, int64_t nb, const float *xs, const float *S, int64_t in, void *y,
                        int64_t out, int ybf, int64_t lo, int64_t hi, int R) {
    if (R <= ROW_BY_ROW) { /* each row through the one-row tiles: the same arithmetic as `prows` */
        const int64_t n32 = in / 32, elem = ybf ? 2 : 4;
        for (int r = 0; r < R; r++)
            panel_row(t, pw, nb, xs + r * in, S + r * 3 * n32, in, (char *)y + r * out * elem, out, ybf, lo, hi);
        return;
    }
    prows_fn rows = pset(t)->rows;
#ifdef PFEW_ROWS
    if (R <= PFEW_SPLIT) { /* in groups of at most PFEW_ROWS rows, as even as can be: rows are independent */
        const int64_t n32 = in / 32, elem = ybf ? 2 : 4;
        const int groups = (R + PFEW_ROWS - 1) / PFEW_ROWS;
        for (int i = 0, r0 = 0; i < groups; i++) {
            const int n = R / groups + (i < R % groups);
            const float *xg = xs + r0 * in, *Sg = S + r0 * 3 * n32;
            void *yg = (char *)y + r0 * out * elem;
            int64_t p = lo;
            for (prows_fn few = pset(t)->few; p + PFEW_PANELS <= hi; p += PFEW_PANELS) few(pw, nb, xg, Sg, in, p, yg, out, ybf, n);
            /* the 1-3 panels left (a thread's share of SmolLM2's qkv, o and down: 30, 18, 18) row by
             * row through the one-row tiles: `prows` there ran them on n chains */
            for (int r = 0; p < hi && r < n; r++)
                panel_row(t, pw, nb, xg + r * in, Sg + r * 3 * n32, in, (char *)yg + r * out * elem, out, ybf, p, hi);
            r0 += n;
        }
        return;
    }
#endif
    for (int64_t p = lo; p < hi; p++) rows(pw, nb, xs, S, in, p, y, out, ybf, R);
}

/* y [rows, out] = x [rows, in] W^T for W in the panel layout of type t (float32 or bfloat16 x
 * and y, as quant_matmul). Returns 0; -1 a type without panels in this build, `in` not a
 * multiple of 32 or `out` of 16; -2 out of memory. */
#if ML_PART(1)
int quant_panel_matmul(int t, const uint8_t *pw, int64_t out, int64_t in, const void *x, int xbf, void *y, int ybf,
                       int64_t rows, int64_t threads) {
    if (!(quant_panel_types() >> t & 1) || in % block_elems(t) || out % 16 || out <= 0) return -1;
    int64_t nb = in / block_elems(t), n32 = in / 32, np = out / 16;
    float *xs = aligned_alloc(64, ((size_t)(rows * (in + 3 * n32)) * sizeof(float) + 63) / 64 * 64);
    if (!xs) return -2;
    float *S = xs + rows * in;
    for (int64_t r = 0; r < rows; r++)
        panel_prep(t, (const char *)x + r * in * (xbf ? 2 : 4), xbf, in, xs + r * in, S + r * 3 * n32);
    int64_t elem = ybf ? 2 : 4;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t lo, hi;
        thread_share(np, 1, &lo, &hi); /* equal shares: the tiles above take any count */
        for (int64_t c = 0; c * PANEL_ROWS < rows; c++) /* chunks of PANEL_ROWS rows */
            if (lo < hi)
                panel_chunk(t, pw, nb, xs + c * PANEL_ROWS * in, S + c * PANEL_ROWS * 3 * n32, in,
                            (char *)y + c * PANEL_ROWS * out * elem, out, ybf, lo, hi,
                            (int)(rows - c * PANEL_ROWS < PANEL_ROWS ? rows - c * PANEL_ROWS : PANEL_ROWS));
    }
    free(xs);
    return 0;
}
#endif

#include "quant_q8.h" /* q8 activations: integer dot products over both layouts */
