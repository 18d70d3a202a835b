/* codes.c: products of weights kept as the codes of their GGUF form (Q4_1, Q8_0, K-quants; layouts and tags in
   common.h), decoded in registers to the float32 values they stand for, so every product keeps the float32 path's
   bits: the decoders (AVX-512, or AVX2 with F16C), one tile of up to RMAX rows against a block (q4tile1-12, q8tile,
   kqtile), and q4_many, which decodes each group once for many rows. */
#include "kernels.h"

#if defined(__AVX512F__)
/* sizeof(vw) / 4 float16 values as floats (exactly) */
static inline vw load_half(const unsigned char *p) {
    return (vw)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void q4_decode(const unsigned char *c, const vw *d, const vw *m, vw *w) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    vw p0 = (vw)_mm512_mul_ps((__m512)d[0], _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))));
    vw p1 = (vw)_mm512_mul_ps((__m512)d[1], _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)));
    w[0] = (vw)_mm512_add_ps((__m512)p0, (__m512)m[0]);
    w[1] = (vw)_mm512_add_ps((__m512)p1, (__m512)m[1]);
}
static inline void q8_decode(const unsigned char *c, const vw *d, vw *w) {
    for (int j = 0; j < NV; j++)
        w[j] = (vw)_mm512_mul_ps((__m512)d[j], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(c + 16 * j)))));
}
#elif defined(__AVX2__) && defined(__F16C__)
static inline vw load_half(const unsigned char *p) { return (vw)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void q4_decode(const unsigned char *c, const vw *d, const vw *m, vw *w) {
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h)));
        vw lo = (vw)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        vw hi = (vw)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        w[h] = (vw)_mm256_add_ps(_mm256_mul_ps((__m256)d[h], (__m256)lo), (__m256)m[h]);
        w[2 + h] = (vw)_mm256_add_ps(_mm256_mul_ps((__m256)d[2 + h], (__m256)hi), (__m256)m[2 + h]);
    }
}
static inline void q8_decode(const unsigned char *c, const vw *d, vw *w) {
    for (int j = 0; j < NV; j++)
        w[j] = (vw)_mm256_mul_ps((__m256)d[j], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(c + 8 * j)))));
}
#endif
int q4_supported(void) { return Q4_OK; }
#if Q4_OK
/* weight k of a K-quant group for the block's 32 outputs: fl(fl(d q) + m) with the d and m of its half */
static inline void kq_decode(const unsigned char *G, int k, vw *w) {
    const float *d = (const float *)G + (k >> 4) * NB, *m = d + 2 * NB;
    vw dv[NV];
    for (int j = 0; j < NV; j++) dv[j] = loadw(d + j * (NB / NV));
    q8_decode(G + 4 * 4 * NB + 32 * k, dv, w);
    for (int j = 0; j < NV; j++) w[j] += loadw(m + j * (NB / NV));
}
/* group g of a block: its d and m loaded, the same group of the next block (ahead, if any) prefetched; its codes */
static inline const unsigned char *q4_group(const unsigned char *Q, int64_t g, const unsigned char *ahead, vw *d,
                                            vw *m) {
    const unsigned char *G = Q + g * QG;
    prefetch_group(ahead, g, QG);
    for (int j = 0; j < NV; j++) {
        d[j] = load_half(G + 2 * j * (NB / NV));
        m[j] = load_half(G + 2 * (NB + j * (NB / NV)));
    }
    return G;
}
/* the same for a Q8_0 block (d only) */
static inline const unsigned char *q8_group(const unsigned char *Q, int64_t g, const unsigned char *ahead, vw *d) {
    const unsigned char *G = Q + g * Q8G;
    prefetch_group(ahead, g, Q8G);
    for (int j = 0; j < NV; j++) d[j] = load_half(G + 2 * j * (NB / NV));
    return G;
}
/* weight k of a group (its input g * 32 + k) for the block's 32 outputs, decoded from the codes of `form` */
static inline __attribute__((always_inline)) void decode_codes(const unsigned char *G, int k, const vw *d,
                                                                const vw *m, vw *w, int form) {
    if (form == FORM_Q8)
        q8_decode(G + 64 + 32 * k, d, w);
    else if (form == FORM_K)
        kq_decode(G, k, w);
    else
        q4_decode(G + 128 + 16 * k, d, m, w);
}
/* block b of a weight in the codes of `form` */
static inline const unsigned char *codes_block(const float *P, int64_t b, int64_t in_f, int form) {
    return form == FORM_Q8 ? q8_block(P, b, in_f) : form == FORM_K ? kq_block(P, b, in_f) : q4_block(P, b, in_f);
}
/* group g of a block: its codes, d and m loaded (a K-quant group's: in kq_decode, by half); the next block's fetched */
static inline __attribute__((always_inline)) const unsigned char *codes_group(const unsigned char *Q, int64_t g,
                                                                               const unsigned char *ahead, vw *d,
                                                                               vw *m, int form) {
    if (form == FORM_K) {
        prefetch_group(ahead, g, KG);
        return Q + g * KG;
    }
    return form == FORM_Q8 ? q8_group(Q, g, ahead, d) : q4_group(Q, g, ahead, d, m);
}
static inline __attribute__((always_inline)) void tile_q4(const unsigned char *Q, const float *X, int64_t in_f, int R,
                                                           float *acc, const unsigned char *ahead, int form) {
    vw a[RMAX][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) a[r][j] = (vw){0};
    for (int64_t g = 0; g < in_f / 32; g++) {
        vw d[NV], m[NV];
        const unsigned char *G = codes_group(Q, g, ahead, d, m, form);
        for (int k = 0; k < 32; k++) {
            vw w[NV];
            decode_codes(G, k, d, m, w, form);
            const int64_t i = g * 32 + k;
            for (int r = 0; r < R; r++) {
                const vw x = splatw(X[r * in_f + i]);
                for (int j = 0; j < NV; j++) a[r][j] = maddw(a[r][j], w[j], x);
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(acc + r * NB, a[r], sizeof a[r]);
}
#define QT4(R) static __attribute__((noinline)) void q4tile##R(const unsigned char *Q, const float *X, int64_t in_f, \
                                                               float *acc, const unsigned char *ahead) { \
    tile_q4(Q, X, in_f, R < RMAX ? R : RMAX, acc, ahead, 0); } \
static __attribute__((noinline)) void q8tile##R(const unsigned char *Q, const float *X, int64_t in_f, float *acc, \
                                                const unsigned char *ahead) { \
    tile_q4(Q, X, in_f, R < RMAX ? R : RMAX, acc, ahead, FORM_Q8); } \
static __attribute__((noinline)) void kqtile##R(const unsigned char *Q, const float *X, int64_t in_f, float *acc, \
                                                const unsigned char *ahead) { \
    tile_q4(Q, X, in_f, R < RMAX ? R : RMAX, acc, ahead, FORM_K); }
QT4(1) QT4(2) QT4(3) QT4(4) QT4(5) QT4(6) QT4(7) QT4(8) QT4(9) QT4(10) QT4(11) QT4(12)
#undef QT4
typedef void (*q4tile_fn)(const unsigned char *, const float *, int64_t, float *, const unsigned char *);
static const q4tile_fn Q4TILES[13] = {0, q4tile1, q4tile2, q4tile3, q4tile4, q4tile5, q4tile6, q4tile7, q4tile8,
                                      q4tile9, q4tile10, q4tile11, q4tile12};
static const q4tile_fn Q8TILES[13] = {0, q8tile1, q8tile2, q8tile3, q8tile4, q8tile5, q8tile6, q8tile7, q8tile8,
                                      q8tile9, q8tile10, q8tile11, q8tile12};
static const q4tile_fn KQTILES[13] = {0, kqtile1, kqtile2, kqtile3, kqtile4, kqtile5, kqtile6, kqtile7, kqtile8,
                                      kqtile9, kqtile10, kqtile11, kqtile12};
#endif
#if Q4_OK
/* acc[r * NB + j] += sum over the 32 inputs of a group (decoded into S [32][NB]) of S[k, j] X[r, k], for r < R,
   one FMA per input in order: a tile's sums carried from group to group in acc */
static inline __attribute__((always_inline)) void tile_carry(const float *S, const float *X, int64_t in_f, int R,
                                                              float *acc) {
    vw a[RMAX][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) a[r][j] = loadw(acc + r * NB + j * (NB / NV));
    for (int k = 0; k < 32; k++) {
        vw w[NV];
        for (int j = 0; j < NV; j++) w[j] = loadw(S + k * NB + j * (NB / NV));
        for (int r = 0; r < R; r++) {
            const vw x = splatw(X[r * in_f + k]);
            for (int j = 0; j < NV; j++) a[r][j] = maddw(a[r][j], w[j], x);
        }
    }
    for (int r = 0; r < R; r++) memcpy(acc + r * NB, a[r], sizeof a[r]);
}
#define TC(R) static __attribute__((noinline)) void carry##R(const float *S, const float *X, int64_t in_f, float *acc) { \
    tile_carry(S, X, in_f, R < RMAX ? R : RMAX, acc); }
TC(1) TC(2) TC(3) TC(4) TC(5) TC(6) TC(7) TC(8) TC(9) TC(10) TC(11) TC(12)
#undef TC
typedef void (*carry_fn)(const float *, const float *, int64_t, float *);
static const carry_fn CARRIES[13] = {0, carry1, carry2, carry3, carry4, carry5, carry6, carry7, carry8, carry9,
                                     carry10, carry11, carry12};

/* acc [M][NB] for M <= MANY rows (more than one tile) against block Q of a weight in the codes of `form`: each
   group is decoded once into S, then every row tile multiplies it, its sums carried in acc (the same sums, in the
   same order, as tile_q4) */
static void q4_many(const unsigned char *Q, const float *X, int64_t in_f, int64_t M, float *acc,
                    const unsigned char *ahead, int form) {
    float S[32 * NB] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * M * NB);
    for (int64_t g = 0; g < in_f / 32; g++) {
        vw d[NV], m[NV];
        const unsigned char *G = codes_group(Q, g, ahead, d, m, form);
        for (int k = 0; k < 32; k++) {
            vw w[NV];
            decode_codes(G, k, d, m, w, form);
            memcpy(S + k * NB, w, sizeof w);
        }
        for (int64_t m0 = 0; m0 < M;) {
            const int R = tile_rows(M - m0);
            CARRIES[R](S, X + m0 * in_f + g * 32, in_f, acc + m0 * NB);
            m0 += R;
        }
    }
}
#endif
