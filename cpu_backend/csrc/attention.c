/* attention.c: attention of a few query rows over the KV cache (attend), the rotary embedding in place (rope), and
   the cache's rows moved down after a verification (kv_compact). */
#include "kernels.h"

#ifdef __AVX2__
static inline v8 vmax(v8 a, v8 b) { return (v8)_mm256_max_ps((__m256)a, (__m256)b); }
/* x with -inf where the 8 mask bytes at m are zero */
static inline v8 drop_masked(v8 x, const unsigned char *m) {
    int64_t bytes;
    memcpy(&bytes, m, sizeof bytes);
    const __m256i keep = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
    const __m256 drop = _mm256_castsi256_ps(_mm256_cmpeq_epi32(keep, _mm256_setzero_si256()));
    return (v8)_mm256_blendv_ps((__m256)x, _mm256_set1_ps(-INFINITY), drop);
}
#else
static inline v8 vmax(v8 a, v8 b) { for (int l = 0; l < 8; l++) a[l] = b[l] > a[l] ? b[l] : a[l]; return a; }
static inline v8 drop_masked(v8 x, const unsigned char *m) {
    for (int l = 0; l < 8; l++) x[l] = m[l] ? x[l] : -INFINITY;
    return x;
}
#endif
static inline float hmax(v8 a) {
    float m = a[0];
    for (int l = 1; l < 8; l++) m = a[l] > m ? a[l] : m;
    return m;
}

/* Attention of M query rows over L keys: O[b, m, h] = sum_j softmax_j(scale Q[b, h, m] . K[b, h / rep, j] +
   mask[b, m, j]) V[b, h / rep, j]. Strides are in floats; the last axis (D, a multiple of 8) is contiguous.
   mask_kind 0: none, 1: bool (keep where nonzero), 2: additive float. The rep x M query vectors that read one
   key/value head are taken up to QT at a time, so each key and value vector loaded serves all of them (a 16-row
   verification pass has 48 queries per key head). Every query's numbers are still computed alone and in the same
   order whatever the others: each score summed over d in 8-wide lanes, then the lanes added as hsum adds them;
   each output summed over the keys in order; masked keys weigh exp(-inf) = 0. So a query row gets the same bits
   whatever the other rows of its pass, and the same bits with 8- or 16-wide vectors. */
#define QT 4
/* keys and values prefetched this many positions ahead, never past the last key: a prefetch into a page not yet
   written (the rest of a cache buffer) is dropped only after a page walk, every time, and that cost a verification
   pass more than the attention itself */
#define KEYS_AHEAD 32

#ifdef __AVX512F__
/* k0[d .. d + 7] in the low half, k1[d .. d + 7] in the high half */
static inline __m512 halves(const float *k0, const float *k1) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(k0))),
                                               _mm256_castps_pd(_mm256_loadu_ps(k1)), 1));
}
static inline __m512 twice(const float *x) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x))));
}
/* [a0 + a1, a2 + a3, b0 + b1, b2 + b3] in each 128-bit lane */
static inline __m512 pair_sums(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
#endif

/* S[i, j .. j + 7] = scale q_i . k_j.. for the nq queries of a tile; 8-wide lanes over d, each reduced as hsum;
   `ahead`: prefetch the keys KEYS_AHEAD on */
static inline __attribute__((always_inline)) void scores8(const float *const *q, int nq, const float *k,
                                                          int64_t kv_sj, int64_t j, int64_t D, float scale,
                                                          float *S, int64_t L8, int ahead) {
#ifdef __AVX512F__
    /* four accumulators per query, each two keys (j + c in the low half, j + 4 + c in the high half) */
    __m512 a[QT][4];
    for (int i = 0; i < nq; i++)
        for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        if (ahead && d % 16 == 0)  /* the keys KEYS_AHEAD on, a line each: the hardware prefetcher falls behind */
            for (int c = 0; c < 8; c++) __builtin_prefetch(k + (j + KEYS_AHEAD + c) * kv_sj + d, 0, 3);
        __m512 kp[4];
        for (int c = 0; c < 4; c++) kp[c] = halves(k + (j + c) * kv_sj + d, k + (j + 4 + c) * kv_sj + d);
        for (int i = 0; i < nq; i++) {
            const __m512 qd = twice(q[i] + d);
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(qd, kp[c], a[i][c]);
        }
    }
    for (int i = 0; i < nq; i++) {
        /* 128-bit lanes of r: keys j .. j + 3 lanes 0-3 summed, the same keys lanes 4-7, keys j + 4 .. j + 7 alike */
        const __m512 r = pair_sums(pair_sums(a[i][0], a[i][1]), pair_sums(a[i][2], a[i][3]));
        const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(r, r, 0x88), _mm512_shuffle_f32x4(r, r, 0xDD));
        _mm256_storeu_ps(S + i * L8 + j, _mm256_mul_ps(_mm512_castps512_ps256(s), _mm256_set1_ps(scale)));
    }
#else
    (void)ahead;  /* this path does not prefetch */
    for (int i = 0; i < nq; i++)
        for (int64_t c = 0; c < 8; c += 2) {
            v8 a0 = {0}, a1 = {0};
            for (int64_t d = 0; d < D; d += 8) {
                const v8 qd = load8(q[i] + d);
                a0 = madd(a0, qd, load8(k + (j + c) * kv_sj + d));
                a1 = madd(a1, qd, load8(k + (j + c + 1) * kv_sj + d));
            }
            S[i * L8 + j + c] = hsum(a0) * scale;
            S[i * L8 + j + c + 1] = hsum(a1) * scale;
        }
#endif
}

/* o_i[d0 .. d0 + 8 W - 1] = inv_i sum_j P[i, j] v_j[...] for the nq queries of a tile, W vectors of 8 at a time */
static inline __attribute__((always_inline)) void values8(const float *P, int nq, const float *v, int64_t kv_sj,
                                                          int64_t L, int64_t L8, int64_t d0, const float *inv,
                                                          float *const *o) {
#ifdef __AVX512F__
    __m512 c[QT][4];
    for (int i = 0; i < nq; i++)
        for (int e = 0; e < 4; e++) c[i][e] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        const float *vj = v + j * kv_sj + d0;
        if (j + KEYS_AHEAD < L)
            for (int e = 0; e < 4; e++) __builtin_prefetch(vj + KEYS_AHEAD * kv_sj + 16 * e, 0, 3);
        const __m512 w0 = _mm512_loadu_ps(vj), w1 = _mm512_loadu_ps(vj + 16), w2 = _mm512_loadu_ps(vj + 32),
                     w3 = _mm512_loadu_ps(vj + 48);
        for (int i = 0; i < nq; i++) {
            const __m512 p = _mm512_set1_ps(P[i * L8 + j]);
            c[i][0] = _mm512_fmadd_ps(p, w0, c[i][0]); c[i][1] = _mm512_fmadd_ps(p, w1, c[i][1]);
            c[i][2] = _mm512_fmadd_ps(p, w2, c[i][2]); c[i][3] = _mm512_fmadd_ps(p, w3, c[i][3]);
        }
    }
    for (int i = 0; i < nq; i++)
        for (int e = 0; e < 4; e++)
            _mm512_storeu_ps(o[i] + d0 + 16 * e, _mm512_mul_ps(c[i][e], _mm512_set1_ps(inv[i])));
#else
    for (int64_t h = 0; h < 64; h += 32) {  /* 2 queries x 4 vectors of accumulators fit 16 registers */
        for (int i0 = 0; i0 < nq; i0 += 2) {
            const int n2 = nq - i0 < 2 ? nq - i0 : 2;
            v8 c[2][4];
            for (int i = 0; i < n2; i++)
                for (int e = 0; e < 4; e++) c[i][e] = (v8){0};
            for (int64_t j = 0; j < L; j++) {
                const float *vj = v + j * kv_sj + d0 + h;
                const v8 w0 = load8(vj), w1 = load8(vj + 8), w2 = load8(vj + 16), w3 = load8(vj + 24);
                for (int i = 0; i < n2; i++) {
                    const float p = P[(i0 + i) * L8 + j];
                    const v8 pv = {p, p, p, p, p, p, p, p};
                    c[i][0] = madd(c[i][0], pv, w0); c[i][1] = madd(c[i][1], pv, w1);
                    c[i][2] = madd(c[i][2], pv, w2); c[i][3] = madd(c[i][3], pv, w3);
                }
            }
            for (int i = 0; i < n2; i++) {
                const float s = inv[i0 + i];
                const v8 iv = {s, s, s, s, s, s, s, s};
                v8 r[4] = {c[i][0] * iv, c[i][1] * iv, c[i][2] * iv, c[i][3] * iv};
                memcpy(o[i0 + i] + d0 + h, r, sizeof r);
            }
        }
    }
#endif
}

/* one tile: nq queries (q_i, output o_i, mask row mb_i / mf_i) over one key/value head; S holds QT x L8 floats */
static inline __attribute__((always_inline)) void attend_tile(const float *const *q, float *const *o,
                                                              const unsigned char *const *mb, const float *const *mf,
                                                              int nq, const float *k, const float *v, int64_t kv_sj,
                                                              int64_t L, int64_t D, float scale, float *S) {
    const int64_t L8 = (L + 7) / 8 * 8;
    float inv[QT];
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) scores8(q, nq, k, kv_sj, j, D, scale, S, L8, j + KEYS_AHEAD + 8 <= L);
    for (; j < L; j++)  /* the last keys one at a time, the same sums */
        for (int i = 0; i < nq; i++) {
            v8 a0 = {0};
            for (int64_t d = 0; d < D; d += 8) a0 = madd(a0, load8(q[i] + d), load8(k + j * kv_sj + d));
            S[i * L8 + j] = hsum(a0) * scale;
        }
    for (int i = 0; i < nq; i++) {
        float *s = S + i * L8;
        v8 mxv = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        for (j = 0; j + 8 <= L; j += 8) {  /* the mask, and the largest score: 8 keys at a time */
            v8 x = load8(s + j);
            if (mf[i]) x = x + load8(mf[i] + j);
            if (mb[i]) x = drop_masked(x, mb[i] + j);
            memcpy(s + j, &x, sizeof x);
            mxv = vmax(mxv, x);
        }
        float mx = hmax(mxv);
        for (; j < L; j++) {
            if (mf[i]) s[j] += mf[i][j];
            if (mb[i] && !mb[i][j]) s[j] = -INFINITY;
            if (s[j] > mx) mx = s[j];
        }
        for (j = L; j < L8; j++) s[j] = -INFINITY;
        if (mx == -INFINITY) {  /* a row that sees nothing (padding): weights 0, zeros out (written below) */
            for (j = 0; j < L8; j++) s[j] = 0.0f;
            inv[i] = 0.0f;
            continue;
        }
        const v8 mxv1 = {mx, mx, mx, mx, mx, mx, mx, mx};
        v8 sum = {0};
        for (j = 0; j < L8; j += 8) {  /* exp of every key alike (the keys past L give 0), summed in 8 lanes */
            v8 e = vexp(load8(s + j) - mxv1);
            memcpy(s + j, &e, sizeof e);
            sum += e;
        }
        inv[i] = 1.0f / hsum(sum);
    }
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) values8(S, nq, v, kv_sj, L, L8, d0, inv, o);
    for (; d0 < D; d0 += 8)  /* the last values 8 at a time, the same sums */
        for (int i = 0; i < nq; i++) {
            v8 c0 = {0};
            for (j = 0; j < L; j++) {
                const float p = S[i * L8 + j];
                c0 = madd(c0, (v8){p, p, p, p, p, p, p, p}, load8(v + j * kv_sj + d0));
            }
            const v8 iv = {inv[i], inv[i], inv[i], inv[i], inv[i], inv[i], inv[i], inv[i]};
            c0 = c0 * iv;
            memcpy(o[i] + d0, &c0, sizeof c0);
        }
    for (int i = 0; i < nq; i++)
        if (inv[i] == 0.0f) memset(o[i], 0, (size_t)D * sizeof(float));
}

#define TILE_N(n) static __attribute__((noinline)) void attend_tile##n( \
    const float *const *q, float *const *o, const unsigned char *const *mb, const float *const *mf, const float *k, \
    const float *v, int64_t kv_sj, int64_t L, int64_t D, float scale, float *S) { \
    attend_tile(q, o, mb, mf, n, k, v, kv_sj, L, D, scale, S); }
TILE_N(1) TILE_N(2) TILE_N(3) TILE_N(4)
#undef TILE_N
typedef void (*attend_tile_fn)(const float *const *, float *const *, const unsigned char *const *,
                               const float *const *, const float *, const float *, int64_t, int64_t, int64_t, float,
                               float *);
static const attend_tile_fn ATTEND_TILES[QT + 1] = {0, attend_tile1, attend_tile2, attend_tile3, attend_tile4};

void attend(const float *Q, int64_t q_sb, int64_t q_sh, int64_t q_sm,
            const float *K, const float *V, int64_t kv_sb, int64_t kv_sh, int64_t kv_sj,
            const void *mask, int mask_kind, int64_t mask_sb, int64_t mask_sm,
            float *O, int64_t B, int64_t H, int64_t rep, int64_t M, int64_t L, int64_t D, float scale, int nthreads) {
    const int64_t L8 = (L + 7) / 8 * 8, Hkv = H / rep, G = rep * M;
    /* queries per task: QT, or fewer where that would leave fewer than four tasks per thread */
    int64_t qt = (B * Hkv * G + 4 * nthreads - 1) / (4 * nthreads);
    qt = qt < 1 ? 1 : qt > QT ? QT : qt;
    const int64_t per = (G + qt - 1) / qt;
    #pragma omp parallel num_threads(nthreads)
    {
        float *S = (float *)malloc((size_t)QT * L8 * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * Hkv * per; t++) {
            const int64_t b = t / (Hkv * per), g = (t / per) % Hkv, u0 = (t % per) * qt;
            const int n = (int)(G - u0 < qt ? G - u0 : qt);
            const float *q[QT], *mf[QT];
            const unsigned char *mb[QT];
            float *o[QT];
            for (int i = 0; i < n; i++) {  /* query u is head g rep + u / M, row u % M */
                const int64_t u = u0 + i, h = g * rep + u / M, m = u % M;
                q[i] = Q + b * q_sb + h * q_sh + m * q_sm;
                o[i] = O + ((b * M + m) * H + h) * D;
                mb[i] = mask_kind == 1 ? (const unsigned char *)mask + b * mask_sb + m * mask_sm : 0;
                mf[i] = mask_kind == 2 ? (const float *)mask + b * mask_sb + m * mask_sm : 0;
            }
            ATTEND_TILES[n](q, o, mb, mf, K + b * kv_sb + g * kv_sh, V + b * kv_sb + g * kv_sh, kv_sj, L, D, scale,
                            S);
        }
        free(S);
    }
}
#undef QT

/* Rotary position embedding in place, as transformers' `q * cos + rotate_half(q) * sin` computes it (two
   products and a sum, each rounded; rotate_half(x) = cat(-x[D/2:], x[:D/2])): X is [B, M, H, D] contiguous, cos and
   sin are [B or 1, M, D] with batch stride cs_b (0 when shared) and rows contiguous. */
void rope(float *X, const float *cos, const float *sin, int64_t B, int64_t M, int64_t H, int64_t D, int64_t cs_b) {
    const int64_t half = D / 2;
    float t[1024];
    for (int64_t b = 0; b < B; b++)
        for (int64_t m = 0; m < M; m++) {
            const float *c = cos + b * cs_b + m * D, *s = sin + b * cs_b + m * D;
            for (int64_t h = 0; h < H; h++) {
                float *x = X + ((b * M + m) * H + h) * D;
                for (int64_t d = 0; d < D; d++) t[d] = x[d];
                for (int64_t d = 0; d < half; d++) x[d] = t[d] * c[d] + (-t[d + half]) * s[d];
                for (int64_t d = half; d < D; d++) x[d] = t[d] * c[d] + t[d - half] * s[d];
            }
        }
}

/* Cached rows moved down in place: in each of n buffers (B[b] = address, heads, head stride, row stride, row length,
   in floats), row start + keep[i] of every head goes to row start + i, for i < m in order. keep is ascending with
   keep[i] >= i (an accepted path's offsets), so no row is overwritten before it is read. */
void kv_compact(const int64_t *B, int64_t n, int64_t start, const int64_t *keep, int64_t m) {
    for (int64_t b = 0; b < n; b++) {
        const int64_t *e = B + 5 * b, H = e[1], sh = e[2], sr = e[3], D = e[4];
        for (int64_t h = 0; h < H; h++) {
            float *x = (float *)(intptr_t)e[0] + h * sh + start * sr;
            for (int64_t i = 0; i < m; i++)
                if (keep[i] != i) memcpy(x + i * sr, x + keep[i] * sr, (size_t)D * sizeof(float));
        }
    }
}

