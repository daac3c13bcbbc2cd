/* A command-line driver for metaloom's C kernels (quant.c, fused.c, draw.c), so that the aarch64 builds
 * run under qemu-aarch64 on an x86 machine (tests/aarch64/test_under_qemu.py).
 *
 *   driver FUNCTION ARG...
 *
 * calls FUNCTION with the arguments in order; each ARG is one of
 *   i:N        an integer (int64_t, or int where the function takes an int)
 *   f:X        a float
 *   null       a NULL pointer
 *   in:PATH    the bytes of PATH, in memory (a const pointer)
 *   out:PATH:N N zeroed bytes, written to PATH after the call
 *   io:PATH    the bytes of PATH, written back to PATH after the call
 * and prints the function's return value (0 for a void one). The Python side builds the same
 * arguments it would pass through ctypes, computes the references with numpy and gguf, and
 * compares; nothing here checks a result. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int quant_matmul(int t, const uint8_t *w, int64_t out, int64_t in, const void *x, int xbf, void *y, int ybf,
                 int64_t rows, int64_t threads);
int quant_dequantize(int t, const uint8_t *w, int64_t out, int64_t in, const int64_t *ids, int64_t n, void *y,
                     int ybf, int64_t threads);
int quant_quantize(int t, const void *x, int xbf, int64_t rows, int64_t in, uint8_t *out, int64_t threads);
int quant_panel(int t, uint8_t *blocks, int64_t out, int64_t in, uint8_t *panels, int back, int64_t threads);
int quant_panel_matmul(int t, const uint8_t *pw, int64_t out, int64_t in, const void *x, int xbf, void *y, int ybf,
                       int64_t rows, int64_t threads);
int quant_panel_types(void);
int quant_panel_matmul_q8(int t, const uint8_t *pw, int64_t out, int64_t in, const void *x, int xbf, void *y,
                          int ybf, int64_t rows, int64_t threads);
int quant_q8_inputs(const void *x, int xbf, int64_t rows, int64_t in, int8_t *q, float *d, int32_t *s);
int quant_q8_0_panel_rows(const uint8_t *pw, int64_t out, int64_t in, const int64_t *ids, int64_t n, void *y,
                          int ybf);
void residual_rms_norm(void *x, const void *delta, const void *w, void *y, int64_t rows, int64_t d, float eps,
                       int bf16);
void silu_mul(const void *gu, void *y, int64_t rows, int64_t inter, int bf16);
int rope_attend(const void *qkv, const void *cs, const void *sn, const int64_t *lengths, const int64_t *table,
                int64_t width, void *kc, void *vc, float *ks, float *vs, void *out, int64_t rows, int64_t h,
                int64_t hk, int64_t dim, int64_t window, int64_t threads, int bf16, const void *sharing,
                const int64_t *shift, const int64_t *sinks, float *probs);

int rows_max(const float *x, int64_t rows, int64_t v, float *values, int64_t *index, int64_t threads);

#define MAX_ARGS 20

typedef struct {
    void *p;
    int64_t i;
    float f;
    const char *path; /* written back after the call */
    size_t size;
} arg;

static void *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "driver: cannot read %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc(*size + 64); /* +64: a kernel's last vector load may run past a short buffer's end */
    if (!p || fread(p, 1, *size, f) != *size) {
        fprintf(stderr, "driver: cannot read %s\n", path);
        exit(2);
    }
    fclose(f);
    return p;
}

static void parse(const char *s, arg *a) {
    memset(a, 0, sizeof *a);
    if (!strncmp(s, "i:", 2)) a->i = strtoll(s + 2, NULL, 10);
    else if (!strncmp(s, "f:", 2)) a->f = strtof(s + 2, NULL);
    else if (!strcmp(s, "null")) a->p = NULL;
    else if (!strncmp(s, "in:", 3)) a->p = read_file(s + 3, &a->size);
    else if (!strncmp(s, "io:", 3)) {
        a->path = s + 3;
        a->p = read_file(a->path, &a->size);
    } else if (!strncmp(s, "out:", 4)) {
        const char *colon = strrchr(s + 4, ':');
        static char paths[MAX_ARGS][4096];
        static int used;
        size_t n = (size_t)(colon - (s + 4));
        memcpy(paths[used], s + 4, n);
        paths[used][n] = 0;
        a->path = paths[used++];
        a->size = (size_t)strtoll(colon + 1, NULL, 10);
        a->p = calloc(a->size + 64, 1);
    } else {
        fprintf(stderr, "driver: bad argument %s\n", s);
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || argc - 2 > MAX_ARGS) {
        fprintf(stderr, "usage: driver FUNCTION ARG...\n");
        return 2;
    }
    arg a[MAX_ARGS];
    for (int k = 2; k < argc; k++) parse(argv[k], &a[k - 2]);
    const char *fn = argv[1];
    long rc = 0;
#define P(k) (a[k].p)
#define I(k) (a[k].i)
    if (!strcmp(fn, "quant_matmul"))
        rc = quant_matmul((int)I(0), P(1), I(2), I(3), P(4), (int)I(5), P(6), (int)I(7), I(8), I(9));
    else if (!strcmp(fn, "quant_panel_matmul"))
        rc = quant_panel_matmul((int)I(0), P(1), I(2), I(3), P(4), (int)I(5), P(6), (int)I(7), I(8), I(9));
    else if (!strcmp(fn, "quant_dequantize"))
        rc = quant_dequantize((int)I(0), P(1), I(2), I(3), P(4), I(5), P(6), (int)I(7), I(8));
    else if (!strcmp(fn, "quant_quantize"))
        rc = quant_quantize((int)I(0), P(1), (int)I(2), I(3), I(4), P(5), I(6));
    else if (!strcmp(fn, "quant_panel"))
        rc = quant_panel((int)I(0), P(1), I(2), I(3), P(4), (int)I(5), I(6));
    else if (!strcmp(fn, "quant_panel_matmul_q8"))
        rc = quant_panel_matmul_q8((int)I(0), P(1), I(2), I(3), P(4), (int)I(5), P(6), (int)I(7), I(8), I(9));
    else if (!strcmp(fn, "quant_q8_inputs"))
        rc = quant_q8_inputs(P(0), (int)I(1), I(2), I(3), P(4), P(5), P(6));
    else if (!strcmp(fn, "quant_q8_0_panel_rows"))
        rc = quant_q8_0_panel_rows(P(0), I(1), I(2), P(3), I(4), P(5), (int)I(6));
    else if (!strcmp(fn, "quant_panel_types"))
        rc = quant_panel_types();
    else if (!strcmp(fn, "residual_rms_norm"))
        residual_rms_norm(P(0), P(1), P(2), P(3), I(4), I(5), a[6].f, (int)I(7));
    else if (!strcmp(fn, "silu_mul"))
        silu_mul(P(0), P(1), I(2), I(3), (int)I(4));
    else if (!strcmp(fn, "rows_max"))
        rc = rows_max(P(0), I(1), I(2), P(3), P(4), I(5));
    else if (!strcmp(fn, "rope_attend"))
        rc = rope_attend(P(0), P(1), P(2), P(3), P(4), I(5), P(6), P(7), P(8), P(9), P(10), I(11), I(12), I(13), I(14),
                         I(15), I(16), (int)I(17), P(18), NULL, NULL, NULL);
    else {
        fprintf(stderr, "driver: unknown function %s\n", fn);
        return 2;
    }
    for (int k = 0; k < argc - 2; k++) {
        if (!a[k].path) continue;
        FILE *f = fopen(a[k].path, "wb");
        if (!f || fwrite(a[k].p, 1, a[k].size, f) != a[k].size) {
            fprintf(stderr, "driver: cannot write %s\n", a[k].path);
            return 2;
        }
        fclose(f);
    }
    printf("%ld\n", rc);
    return 0;
}
