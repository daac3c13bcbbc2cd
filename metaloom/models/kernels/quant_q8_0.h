/* Q8_0 weights under q8 activations, 16 outputs side by side (`--activations q8`; included by
 * quant.c after quant_q8.h, whose quantised inputs `q8rows` and integer helpers it uses).
 *
 * Why: a model's output head is usually Q8_0 (SmolLM2's tied embedding, Qwen2.5-0.5B's head,
 * Gemma 3's), and at 16 rows its float products were a quarter of a q8 step (SmolLM2: 5.8 of
 * 22 ms on a Zen 4), within 1.5x of the CPU's fma bound. In GGUF's layout an output's 32 quants
 * lie along the input, so an integer dot product gives 8 partial sums of one output that must be
 * scaled apart (quant_q8.h's `q8_gguf_output`): as many instructions as the float products. Here
 * 16 outputs' quants sit in the lanes instead, 4 inputs at a time, so one `vpdpbusd` (AVX-512
 * VNNI) does 64 products of 16 outputs against one broadcast word of the row, and each 32 inputs
 * take one scaling per 16 outputs.
 *
 * The layout, per panel p of outputs 16p..16p+15 and block b (32 inputs), at (p nb + b) 544
 * bytes: the 16 outputs' float16 scales (32 bytes), then for each group g of 4 inputs the 16
 * outputs' 4 quants (64 bytes): 16 x 34 bytes, GGUF's size, so a weight keeps its tensor's shape.
 *
 * The arithmetic, per (row, output): isum_b = the exact int32 sum of block b's 32 quant products;
 * acc = fma(float(isum_b), d_b dx_b, acc) over the blocks in order (d_b dx_b one float32 product).
 * Every path computes the same isum (exact) and the same fma chain, so a row's result does not
 * depend on the path, the other rows or the threads (the paths differ only without fma, generic
 * x86, as quant_q8.h's do). vpdpbusd multiplies unsigned bytes by signed ones: the quants go in as
 * q + 128 (q xor 0x80) and the row's int sum over the block, 128 S, comes off; without VNNI the
 * weight's sign moves onto the inputs (|q| <= 128 against |x| <= 127: vpmaddubsw's int16 pair
 * sums cannot saturate). */

#define Q80_PANEL 544 /* one block of a panel: 16 x (2 + 32) bytes */

/* the block 7 ahead of the one at P (all that fit in Q8_PREFETCH_BYTES, as quant_q8.h's
 * `q8_pdist`) into L2, on every path: the head is the largest weight of a step and always comes
 * from memory, and it had no software prefetch. SmolLM2's head from memory (Zen 5, avx512,
 * `scripts/q8_kernel_ab.py --shapes head --from-memory`, 5 blocks ahead): 1 row 900 -> 690 us,
 * 16 rows 2530 -> 1850 us, against 1300 in cache; avx2 1.05x and 1.14x. */
INLINE void q80_prefetch(const uint8_t *P) {
    const uint8_t *ahead = P + Q8_PREFETCH_BYTES / Q80_PANEL * Q80_PANEL;
    /* every line the 544 bytes touch wherever they start in a line (9 or 10 lines): a step of 64
     * bytes never skips one, and the last byte's line ends it */
    UNROLL for (int l = 0; l <= Q80_PANEL / 64; l++) __builtin_prefetch(ahead + 64 * l, 0, 2);
    __builtin_prefetch(ahead + Q80_PANEL - 1, 0, 2);
}

/* panels lo..hi: GGUF rows -> panels (back = 0) or back */
static void q8_0_panel_part(uint8_t *blocks, int64_t nb, uint8_t *panels, int back, int64_t lo, int64_t hi) {
    const int64_t rb = nb * 34;
    for (int64_t p = lo; p < hi; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *P = panels + (p * nb + b) * Q80_PANEL;
            for (int j = 0; j < 16; j++) {
                uint8_t *B = blocks + (p * 16 + j) * rb + b * 34;
                if (back) {
                    memcpy(B, P + 2 * j, 2);
                    for (int g = 0; g < 8; g++) memcpy(B + 2 + 4 * g, P + 32 + 64 * g + 4 * j, 4);
                } else {
                    memcpy(P + 2 * j, B, 2);
                    for (int g = 0; g < 8; g++) memcpy(P + 32 + 64 * g + 4 * j, B + 2 + 4 * g, 4);
                }
            }
        }
}

#ifdef ML_AVX512
#define Q80_RB 16 /* rows whose accumulators stay in registers over a panel */
/* R <= Q80_RB rows of quantised x against panel p */
INLINE void q8_0_prows(const uint8_t *pw, int64_t nb, const q8rows *x, int64_t in, int64_t p, void *y, int64_t out,
                       int ybf, int R) {
    const int64_t n32 = in / 32;
    __m512 acc[Q80_RB];
    UNROLL for (int r = 0; r < Q80_RB; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *P = pw + (p * nb + b) * Q80_PANEL;
        q80_prefetch(P);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)P));
        __m512i w[8];
#ifdef ML_VNNI
        UNROLL for (int g = 0; g < 8; g++)
            w[g] = _mm512_xor_si512(_mm512_loadu_si512(P + 32 + 64 * g), _mm512_set1_epi8((char)0x80));
#else
        __mmask64 neg[8];
        UNROLL for (int g = 0; g < 8; g++) {
            const __m512i q = _mm512_loadu_si512(P + 32 + 64 * g);
            neg[g] = _mm512_movepi8_mask(q);
            w[g] = _mm512_abs_epi8(q);
        }
#endif
        UNROLL for (int r = 0; r < Q80_RB; r++) {
            if (r >= R) continue;
            const int8_t *xq = x->q + r * in + 32 * b;
#ifdef ML_VNNI
            __m512i isum = _mm512_set1_epi32(-128 * x->s[r * 3 * n32 + b]);
            UNROLL for (int g = 0; g < 8; g++) isum = _mm512_dpbusd_epi32(isum, w[g], _mm512_set1_epi32((int)ld_x4(xq + 4 * g)));
#else
            __m512i isum = _mm512_setzero_si512();
            const __m512i one = _mm512_set1_epi16(1);
            UNROLL for (int g = 0; g < 8; g++) {
                __m512i v = _mm512_set1_epi32((int)ld_x4(xq + 4 * g));
                v = _mm512_mask_sub_epi8(v, neg[g], _mm512_setzero_si512(), v);
                isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(w[g], v), one));
            }
#endif
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(x->d[r * n32 + b])), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) st(y, r * out + p * 16, (vec)acc[r], ybf);
}
#else /* 8 lanes: a panel's 16 outputs as two halves */
#define Q80_RB 4
INLINE void q8_0_prows(const uint8_t *pw, int64_t nb, const q8rows *x, int64_t in, int64_t p, void *y, int64_t out,
                       int ybf, int R) {
    const int64_t n32 = in / 32;
    vec acc[2 * Q80_RB];
    UNROLL for (int r = 0; r < 2 * Q80_RB; r++) acc[r] = splat(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *P = pw + (p * nb + b) * Q80_PANEL;
        q80_prefetch(P);
        vec d[2];
        for (int j = 0; j < 16; j++) d[j / 8][j % 8] = f16_to_f32(ld_u16(P + 2 * j));
#if defined(__AVX2__)
        /* group by group: the group's weights and their magnitudes (4 registers) made once for
         * all rows, each row's two int sums in registers over the block (8). Holding all 8
         * groups' weights and magnitudes at once took 32 of AVX2's 16 registers. Per row each
         * broadcast input word takes the weights' signs for both halves. */
        const __m256i one = _mm256_set1_epi16(1);
        __m256i isum[Q80_RB][2];
        UNROLL for (int r = 0; r < Q80_RB; r++) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
        const int8_t *xb = x->q + 32 * b;
        UNROLL for (int g = 0; g < 8; g++) {
            __m256i w[2], a[2];
            UNROLL for (int h = 0; h < 2; h++) {
                w[h] = _mm256_loadu_si256((const __m256i *)(P + 32 + 64 * g + 32 * h));
                a[h] = _mm256_abs_epi8(w[h]);
            }
            UNROLL for (int r = 0; r < Q80_RB; r++) {
                if (r >= R) continue;
                const __m256i v = _mm256_set1_epi32((int)ld_x4(xb + r * in + 4 * g));
                UNROLL for (int h = 0; h < 2; h++)
                    isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(a[h],
                                                                                 _mm256_sign_epi8(v, w[h])), one));
            }
        }
        UNROLL for (int r = 0; r < Q80_RB; r++) {
            if (r >= R) continue;
            const vec dx = splat(x->d[r * n32 + b]);
            UNROLL for (int h = 0; h < 2; h++)
                acc[2 * r + h] = fma8(__builtin_convertvector((i8x)isum[r][h], vec), d[h] * dx, acc[2 * r + h]);
        }
#else
        UNROLL for (int h = 0; h < 2; h++) {
            u8x w[8];
            UNROLL for (int g = 0; g < 8; g++) memcpy(&w[g], P + 32 + 64 * g + 32 * h, 32);
            UNROLL for (int r = 0; r < Q80_RB; r++) {
                if (r >= R) continue;
                const int8_t *xq = x->q + r * in + 32 * b;
                i8x isum = {0};
                UNROLL for (int g = 0; g < 8; g += 2)
                    isum = idot2_8(isum, w[g], ld_x4(xq + 4 * g), w[g + 1], ld_x4(xq + 4 * g + 4), 1);
                acc[2 * r + h] = fma8(__builtin_convertvector(isum, vec), d[h] * splat(x->d[r * n32 + b]), acc[2 * r + h]);
            }
        }
#endif
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) st(y, r * out + p * 16 + 8 * h, acc[2 * r + h], ybf);
}
#endif

/* y [rows, out] = x W^T for a Q8_0 W in panels (`q8_0_panel_part`), x quantised to int8 per 32
 * inputs (natural order). Each thread takes whole panels and walks every row over each, so a
 * panel is read from memory once however many rows there are. Returns 0; -1 `in` not a multiple
 * of 32 or `out` of 16; -2 out of memory. */
static int q8_0_panel_matmul(const uint8_t *pw, int64_t out, int64_t in, const void *x, int xbf, void *y, int ybf,
                             int64_t rows, int64_t threads) {
    if (in % 32 || out % 16 || out <= 0) return -1;
    (void)threads; /* without OpenMP */
    q8rows xr;
    if (q8_alloc(rows, in, &xr)) return -2;
    const int64_t nb = in / 32, np = out / 16, elem = ybf ? 2 : 4;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        q8_fill_share(x, xbf, rows, in, 0, &xr);
        int64_t lo, hi;
        /* equal shares, not quant_q8.h's guided hand-out: with that the SmolLM2 head ran at
         * 0.76-0.87x at 4 rows (scripts/q8_kernel_ab.py --shapes head, 7 runs of 7) */
        thread_share(np, 1, &lo, &hi);
        for (int64_t p = lo; p < hi; p++)
            for (int64_t c = 0; c * Q80_RB < rows; c++) {
                const int R = (int)(rows - c * Q80_RB < Q80_RB ? rows - c * Q80_RB : Q80_RB);
                const q8rows part = {xr.q + c * Q80_RB * in, xr.d + c * Q80_RB * nb, xr.s + c * Q80_RB * 3 * nb, NULL};
                q8_0_prows(pw, nb, &part, in, p, (char *)y + c * Q80_RB * out * elem, out, ybf, R);
            }
    }
    free(xr.mem);
    return 0;
}

/* y [n, in] = rows ids [n] of a Q8_0 weight in panels, dequantised (d q: exact in float32, as
 * `quant_dequantize`'s), float32 or bfloat16: a tied embedding looks its tokens up in the head's
 * panels, so the table is not held twice. Returns 0; -1 `in` not a multiple of 32 or an id out
 * of range. */
#if ML_PART(2)
int quant_q8_0_panel_rows(const uint8_t *pw, int64_t out, int64_t in, const int64_t *ids, int64_t n, void *y,
                          int ybf) {
    if (in % 32) return -1;
    const int64_t nb = in / 32;
    for (int64_t i = 0; i < n; i++) {
        const int64_t o = ids[i];
        if (o < 0 || o >= out) return -1;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *P = pw + ((o / 16) * nb + b) * Q80_PANEL;
            const int j = (int)(o % 16);
            const float d = f16_to_f32(ld_u16(P + 2 * j));
            for (int e = 0; e < 32; e++) {
                const float v = d * (float)(int8_t)P[32 + 64 * (e / 4) + 4 * j + e % 4];
                const int64_t at = i * in + 32 * b + e;
                if (ybf) ((uint16_t *)y)[at] = f32_to_bf16(v);
                else ((float *)y)[at] = v;
            }
        }
    }
    return 0;
}
#endif
