/* The vector store fused.c and quant.c share: W floats to p[i..] as float32, or as bfloat16
 * rounded to nearest even with NaN kept a (quiet) NaN. Included after the includer has defined
 * W, INLINE and the vector types vec, veci, vecu (W x 32 bits) and vecu16 (W x 16 bits). */
#ifndef METALOOM_VEC_STORE_H
#define METALOOM_VEC_STORE_H

INLINE void st(void *p, int64_t i, vec v, const int bf) {
    if (!bf) {
        memcpy((float *)p + i, &v, sizeof v);
        return;
    }
    vecu bits = (vecu)v;
    vecu up = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    veci nan = v != v;
    up = (vecu)(((veci)up & ~nan) | (nan & 0x7FC0));
    vecu16 h = __builtin_convertvector(up, vecu16);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

#endif
