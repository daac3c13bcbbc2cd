/* The AVX-512 intrinsics quant.c uses, from SIMDe (Debian's libsimde-dev: portable
 * implementations), so that its AVX-512 code runs on a CPU without AVX-512
 * (tests/aarch64/test_avx512_emulated.py). The compiler's own header comes first (AVX2, F16C
 * natively); SIMDe's aliases then take over every _mm512_ name, and the few SIMDe 0.7 lacks are
 * written here with GCC vector extensions. */
#include_next <immintrin.h>
#if defined(METALOOM_EMULATE_AVX512) && !defined(METALOOM_SIMDE_SHIM)
#define METALOOM_SIMDE_SHIM
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
typedef int ml_v16si __attribute__((vector_size(64)));
typedef unsigned ml_v16su __attribute__((vector_size(64)));
typedef float ml_v16sf __attribute__((vector_size(64)));
typedef signed char ml_v16qi __attribute__((vector_size(16)));
typedef unsigned char ml_v16qu __attribute__((vector_size(16)));
typedef unsigned short ml_v16hu __attribute__((vector_size(32)));
static inline __m512 ml_cvtepi32_ps(__m512i a) { return (__m512)__builtin_convertvector((ml_v16si)a, ml_v16sf); }
static inline __m512i ml_cvttps_epi32(__m512 a) { return (__m512i)__builtin_convertvector((ml_v16sf)a, ml_v16si); }
static inline float ml_reduce_max_ps(__m512 a) {
    float m = a[0];
    for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
    return m;
}
static inline int ml_reduce_add_epi32(__m512i a) {
    int s = 0;
    for (int i = 0; i < 16; i++) s += ((ml_v16si)a)[i];
    return s;
}
static inline __m128i ml_cvtepi32_epi8(__m512i a) { return (__m128i)__builtin_convertvector((ml_v16si)a, ml_v16qi); }
static inline __m512 ml_cvtepu32_ps(__m512i a) { return (__m512)__builtin_convertvector((ml_v16su)a, ml_v16sf); }
static inline __m512i ml_cvtepi8_epi32(__m128i a) { return (__m512i)__builtin_convertvector((ml_v16qi)a, ml_v16si); }
static inline __m512i ml_cvtepu8_epi32(__m128i a) { return (__m512i)__builtin_convertvector((ml_v16qu)a, ml_v16si); }
static inline __m512i ml_cvtepu16_epi32(__m256i a) { return (__m512i)__builtin_convertvector((ml_v16hu)a, ml_v16si); }
static inline __m512i ml_srai_epi32(__m512i a, unsigned n) { return (__m512i)((ml_v16si)a >> (int)(n > 31 ? 31 : n)); }
static inline __m512 ml_cvtph_ps(__m256i a) { /* exact, as F16C's */
    __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(a)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
    __m512 r;
    __builtin_memcpy(&r, &lo, 32);
    __builtin_memcpy((char *)&r + 32, &hi, 32);
    return r;
}
#undef _mm512_cvtepi32_ps
#undef _mm512_cvttps_epi32
#undef _mm512_reduce_max_ps
#undef _mm512_reduce_add_epi32
#undef _mm512_cvtepi32_epi8
#undef _mm512_cvtepu32_ps
#undef _mm512_cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#undef _mm512_cvtepu16_epi32
#undef _mm512_srai_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtepi32_ps ml_cvtepi32_ps
#define _mm512_cvttps_epi32 ml_cvttps_epi32 /* truncation: quant_q8.h's inputs are within int32 */
#define _mm512_reduce_max_ps ml_reduce_max_ps
#define _mm512_reduce_add_epi32 ml_reduce_add_epi32
#define _mm512_cvtepi32_epi8 ml_cvtepi32_epi8 /* truncation, as vpmovdb */
#define _mm512_cvtepu32_ps ml_cvtepu32_ps
#define _mm512_cvtepi8_epi32 ml_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 ml_cvtepu8_epi32
#define _mm512_cvtepu16_epi32 ml_cvtepu16_epi32
#define _mm512_srai_epi32 ml_srai_epi32
#define _mm512_cvtph_ps ml_cvtph_ps
/* SIMDe 0.7.4 aliases _mm512_madd_epi16 with the mask variant's four arguments: its two-argument
 * function is the instruction (quant_q8.h's AVX-512 products widen through it) */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16 simde_mm512_madd_epi16
#endif
