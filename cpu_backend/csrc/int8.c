/* int8.c: weights in int8 with a scale per output (an EAGLE head's while it drafts), multiplied as the screen
   multiplies (screen.c's tiles). */
#include "kernels.h"

/* whether weights in int8 with a scale per output (tag 4, `i8_linear`) can be multiplied here */
int int8_products(void) { return SCREEN_PAIRS; }

/* Weights in int8 with one scale per output (an EAGLE head's while it drafts: `int8_drafts`), multiplied as the
   screen multiplies: each input row rounded to int16 (x = sx xq + e, |e| <= sx / 2, sx = max |x| / kq) and split into
   two bytes, the integer sums exact, then y = s[o] (sx (q . xq)) + bias. Layout of block b: the screen tiles' int8
   weights ([in_p / 64][2][16][64] bytes, in_p the inputs rounded up to 64), then the block's 32 scales (float32);
   the address is tagged 4. A draft only has to be likely: this reads a quarter of float32's bytes. With AMX-INT8
   on tiles; with AVX512-VNNI alone by quad_tile, four rows at a time. */
#if SCREEN_PAIRS
typedef struct { int8_t *XH; uint8_t *XL; int32_t *HS; float *sx; int64_t in_p; } i8_rows;
static i8_rows i8_prepare(const float *X, int64_t M, int64_t in_f) {
    i8_rows a;
    a.in_p = (in_f + 63) / 64 * 64;
    char *buf = thread_buffer(1, (size_t)M * (4 * a.in_p + 8));
    a.XH = (int8_t *)buf, a.XL = (uint8_t *)(buf + M * a.in_p), a.HS = (int32_t *)(buf + 2 * M * a.in_p);
    a.sx = (float *)(a.HS + M);
    int16_t *xq = (int16_t *)(a.sx + M);  /* one row at a time */
    const int64_t lim = (INT32_MAX / 127) / a.in_p, kq = lim < 16383 ? lim : 16383;  /* no int32 sum overflows */
#if SCREEN_TILES
    amx_rows_loaded = 0;  /* loaded again in each call, as amx_prepare says */
#endif
    for (int64_t m = 0; m < M; m++) {
        a.sx[m] = round_row(X + m * in_f, in_f, kq, xq);
        a.HS[m] = split_row(xq, in_f, a.in_p, a.XH + m * a.in_p, a.XL + m * a.in_p);
    }
    return a;
}
/* acc [R][NB]: rows r0 .. r0 + R - 1 (R <= 16) of a against block W (its scales after it), scaled */
static void i8_block(const int8_t *W, const i8_rows *a, int64_t r0, int R, float *acc, const int8_t *ahead) {
    const int64_t in_p = a->in_p;
#if SCREEN_TILES
    if (R > QUAD_ROWS)
        screen_tile(W, a->XH + r0 * in_p, a->XL + r0 * in_p, in_p, R, acc, ahead);
    else
#endif
        for (int i = 0; i < R; i += QUAD_ROWS) {
            const int n = R - i < QUAD_ROWS ? R - i : QUAD_ROWS;
            QUADS[n](W, a->XH + (r0 + i) * in_p, a->XL + (r0 + i) * in_p, a->HS + r0 + i, in_p, acc + i * NB,
                     i ? 0 : ahead);
        }
    const float *scale = (const float *)(W + in_p * NB);
    for (int r = 0; r < R; r++)
        for (int o = 0; o < NB; o++) acc[r * NB + o] = scale[o] * (a->sx[r0 + r] * acc[r * NB + o]);
}
static inline const int8_t *i8_at(const float *P, int64_t b, int64_t in_p) {
    return (const int8_t *)untag(P) + b * (in_p * NB + NB * (int64_t)sizeof(float));
}
static void i8_linear(const float *P, const float *X, const float *B, float *Y, int64_t lo, int64_t hi,
                      int64_t out_f, int64_t in_f, int64_t M) {
    const i8_rows a = i8_prepare(X, M, in_f);
    float acc[16 * NB];
    for (int64_t b = lo; b < hi; b++)
        for (int64_t r0 = 0; r0 < M; r0 += 16) {
            const int R = M - r0 < 16 ? (int)(M - r0) : 16;
            i8_block(i8_at(P, b, a.in_p), &a, r0, R, acc, r0 == 0 && b + 1 < hi ? i8_at(P, b + 1, a.in_p) : 0);
            store_block(Y, acc, B, b, out_f, r0, R);
        }
}
static void i8_gated(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                     int64_t M, int nthreads, int act) {
    const int64_t nblk = (out_f + NB - 1) / NB;
    #pragma omp parallel num_threads(nthreads)
    {
        int64_t lo, hi;
        share(nblk, &lo, &hi);
        const i8_rows a = i8_prepare(X, M, in_f);
        float g[16 * NB], u[16 * NB];
        for (int64_t b = lo; b < hi; b++)
            for (int64_t r0 = 0; r0 < M; r0 += 16) {
                const int R = M - r0 < 16 ? (int)(M - r0) : 16, first = r0 == 0 && b + 1 < hi;
                i8_block(i8_at(G, b, a.in_p), &a, r0, R, g, first ? i8_at(G, b + 1, a.in_p) : 0);
                i8_block(i8_at(U, b, a.in_p), &a, r0, R, u, first ? i8_at(U, b + 1, a.in_p) : 0);
                store_gated(Y, g, u, out_f, b * NB, out_f - b * NB < NB ? out_f - b * NB : NB, r0, R, act);
            }
    }
}
static void i8_one_block(const float *P, int64_t b, const float *X, int64_t in_f, int R, float *acc) {
    const i8_rows a = i8_prepare(X, R, in_f);
    i8_block(i8_at(P, b, a.in_p), &a, 0, R, acc, 0);
}
#else  /* never tagged 4 here (Python asks `int8_products` first): NaNs, not silent zeros, if it were */
static void i8_fail(float *Y, int64_t n) { for (int64_t i = 0; i < n; i++) Y[i] = NAN; }
static void i8_linear(const float *P, const float *X, const float *B, float *Y, int64_t lo, int64_t hi,
                      int64_t out_f, int64_t in_f, int64_t M) {
    (void)P, (void)X, (void)B, (void)lo, (void)hi, (void)in_f;
    i8_fail(Y, M * out_f);
}
static void i8_gated(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                     int64_t M, int nthreads, int act) {
    (void)G, (void)U, (void)X, (void)in_f, (void)nthreads, (void)act;
    i8_fail(Y, M * out_f);
}
static void i8_one_block(const float *P, int64_t b, const float *X, int64_t in_f, int R, float *acc) {
    (void)P, (void)b, (void)X, (void)in_f;
    i8_fail(acc, R * NB);
}
#endif

