/* screen.c: the argmax of the lm_head's logits, bit for bit, from an int8 estimate and a proven bound
   (screen_argmax), with the int8 tile products it uses (qtile; ptile and quad_tile with AVX512-VNNI; screen_tile
   on AMX-INT8 tiles), which int8.c's drafts use too. */
#include "kernels.h"

/* Greedy tokens read a quarter of the lm_head. Q holds W [out, in] in int8, packed as P is ([ceil(out / NB)][in][NB],
   q = round(w / s) with one scale s per output); C bounds, per output and per unit of |x|, how far the kernel's
   float32 logit L[o] (rows_linear: one FMA per input, in order) can lie from the int8 estimate A[o] = s[o] q[o] . x
   (Cauchy-Schwarz on w - s q, plus both sums' float rounding; `screen_tables` in Python). For each row x of X:
   1. A[o] for every output (int8 weights, any summation order: only the bounds below depend on it);
   2. every o with A[o] + |x| C[o] >= max_o' (A[o'] - |x| C[o']) is a candidate: the argmax of L is one of them;
   3. L[o] of the candidates only, from W's float32 rows [out, in], summed as the product kernel sums.
   Y[m] is then the argmax of the kernel's logits, the first index among equal values; -1 where the caller must
   compute the whole row (a NaN or infinity in x or among the candidates' logits, logits that could overflow, or
   more candidates than are worth summing one by one); the return value counts those rows.
   n_max / w_max: the largest |s q| / |w| of an output.
   A is scratch [M, out]; lo_all [nthreads M], best_all [nthreads M + 3 M] floats; at_all [nthreads M]; Xq [M, in]. */

#if !SCREEN_PAIRS  /* without AVX512-VNNI: the estimate by FMAs on the int8 weights loaded as floats */
/* sizeof(vw) / 4 int8 weights as floats (exactly) */
static inline vw loadq(const int8_t *p) {
#if defined(__AVX512F__)
    return (vw)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vw)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vw v;
    for (int k = 0; k < (int)(sizeof(vw) / sizeof(float)); k++) v[k] = (float)p[k];
    return v;
#endif
}

static inline __attribute__((always_inline)) void qtile(const int8_t *Q, const float *X, int64_t in_f, int R,
                                                         float *acc, const int8_t *ahead) {
    vw a[RMAX][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) a[r][j] = (vw){0};
    int64_t i = 0;
    if (R == 1) {  /* one row: odd inputs into a second set of sums, for twice the independent FMA chains */
        vw b[NV];
        for (int j = 0; j < NV; j++) b[j] = (vw){0};
        for (; i + 1 < in_f; i += 2) {
            if (ahead) __builtin_prefetch(ahead + i * NB, 0, 2);  /* the next block: a line per two inputs */
            const vw x0 = splatw(X[i]), x1 = splatw(X[i + 1]);
            for (int j = 0; j < NV; j++) {
                a[0][j] = maddw(a[0][j], loadq(Q + i * NB + j * (NB / NV)), x0);
                b[j] = maddw(b[j], loadq(Q + (i + 1) * NB + j * (NB / NV)), x1);
            }
        }
        for (int j = 0; j < NV; j++) a[0][j] += b[j];
    }
    for (; i < in_f; i++) {
        if (ahead && !(i & 1)) __builtin_prefetch(ahead + i * NB, 0, 2);  /* the next block, as tile() does */
        vw w[NV];
        for (int j = 0; j < NV; j++) w[j] = loadq(Q + i * NB + j * (NB / NV));
        for (int r = 0; r < R; r++) {
            const vw x = splatw(X[r * in_f + i]);
            for (int j = 0; j < NV; j++) a[r][j] = maddw(a[r][j], w[j], x);
        }
    }
    for (int r = 0; r < R; r++) memcpy(acc + r * NB, a[r], sizeof a[r]);
}

#define QTILE(R) static __attribute__((noinline)) void qtile##R(const int8_t *Q, const float *X, int64_t in_f, \
                                                                 float *acc, const int8_t *ahead) { \
    qtile(Q, X, in_f, R < RMAX ? R : RMAX, acc, ahead); }
QTILE(1) QTILE(2) QTILE(3) QTILE(4) QTILE(5) QTILE(6) QTILE(7) QTILE(8) QTILE(9) QTILE(10) QTILE(11) QTILE(12)
#undef QTILE
typedef void (*qtile_fn)(const int8_t *, const float *, int64_t, float *, const int8_t *);
static const qtile_fn QTILES[13] = {0, qtile1, qtile2, qtile3, qtile4, qtile5, qtile6, qtile7, qtile8, qtile9,
                                    qtile10, qtile11, qtile12};

#endif
#if SCREEN_PAIRS
/* With AVX512-VNNI the estimate is exact integer arithmetic on x rounded to int16 (x = sx xq + d, |d| <= sx / 2),
   32 products a dot-product instruction instead of 16 an FMA, no int8-to-float conversion: Q packed by input pairs,
   [ceil(out / NB)][in / 2][NB][2]. acc[r * NB + j] = sum_i q[j, i] xq[r, i], exactly (in int32: |xq| is kept small
   enough that no sum overflows). */
static inline __attribute__((always_inline)) void ptile(const int8_t *Q, const int16_t *Xq, int64_t in_f, int R,
                                                         float *acc, const int8_t *ahead) {
    __m512i a[RMAX][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
    for (int64_t k = 0; k < in_f / 2; k++) {
        /* the next block, one line per input pair, from one row on: without it a one-row call read the int8
           weights at 2/3 of the float kernel's speed (measured: 1.9 against 2.7 ms for SmolLM2's lm_head) */
        if (ahead) __builtin_prefetch(ahead + k * 2 * NB, 0, 2);
        const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(Q + k * 2 * NB)));
        const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(Q + k * 2 * NB + NB)));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, Xq + r * in_f + 2 * k, sizeof pair);
            const __m512i x = _mm512_set1_epi32(pair);
            a[r][0] = _mm512_dpwssd_epi32(a[r][0], w0, x);
            a[r][1] = _mm512_dpwssd_epi32(a[r][1], w1, x);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(acc + r * NB, _mm512_cvtepi32_ps(a[r][0]));
        _mm512_storeu_ps(acc + r * NB + 16, _mm512_cvtepi32_ps(a[r][1]));
    }
}
#define PTILE(R) static __attribute__((noinline)) void ptile##R(const int8_t *Q, const int16_t *Xq, int64_t in_f, \
                                                                 float *acc, const int8_t *ahead) { \
    ptile(Q, Xq, in_f, R < RMAX ? R : RMAX, acc, ahead); }
PTILE(1) PTILE(2) PTILE(3) PTILE(4) PTILE(5) PTILE(6) PTILE(7) PTILE(8) PTILE(9) PTILE(10) PTILE(11) PTILE(12)
#undef PTILE
typedef void (*ptile_fn)(const int8_t *, const int16_t *, int64_t, float *, const int8_t *);
static const ptile_fn PTILES[13] = {0, ptile1, ptile2, ptile3, ptile4, ptile5, ptile6, ptile7, ptile8, ptile9,
                                    ptile10, ptile11, ptile12};
#endif

/* whether screen_argmax reads Q packed by input pairs (AVX512-VNNI) or as `pack` packs */
int screen_pairs(void) { return SCREEN_PAIRS; }

/* With AMX-INT8 the same integer sums come from tiles, whatever the row count at about the one-row cost: xq = 256 hi
   + lo (hi signed, lo unsigned bytes), sum_i q xq = 256 sum_i q hi + sum_i q lo, each sum exact in int32 (|hi| <=
   64, and the whole fits as for ptile), so acc holds the VNNI path's values bit for bit. Q (address tagged 2): for each
   block of NB outputs and chunk of 64 inputs (inputs padded with zeros to in_p, a multiple of 64), two 1 KB tiles
   (outputs 0-15 and 16-31), row t holding inputs 4 t .. 4 t + 3 of each output side by side. */
#if SCREEN_TILES
/* tiles 0-3: R rows of int32 sums (hi and lo parts times the two halves); 4, 5: the hi and lo bytes of R rows, 64
   inputs; 6, 7: the two halves' int8 weights. Marked -R. */
static void screen_config(int R) { load_tiles(R, 6, 8, -R); }
/* acc[r * NB + j] = sum_i q[j, i] xq[r, i] for r < R <= 16: Q one block, XH / XL [R][in_p] the bytes of xq */
static void screen_tile(const int8_t *Q, const int8_t *XH, const uint8_t *XL, int64_t in_p, int R, float *acc,
                        const int8_t *ahead) {
    int32_t S[4][16 * 16] __attribute__((aligned(64)));
    screen_config(R);
    for (int64_t c = 0; c < in_p / 64; c++) {
        if (c == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
        prefetch_group((const unsigned char *)ahead, c, 2048);
        _tile_loadd(6, Q + c * 2048, 64);
        _tile_loadd(7, Q + c * 2048 + 1024, 64);
        _tile_loadd(4, XH + c * 64, in_p);
        _tile_loadd(5, XL + c * 64, in_p);
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7);
        _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, S[0], 64); _tile_stored(1, S[1], 64); _tile_stored(2, S[2], 64); _tile_stored(3, S[3], 64);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {  /* integer adds wrap: the sum is exact as it fits in int32 */
            const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(S[h] + 16 * r), 8),
                                               _mm512_load_si512(S[2 + h] + 16 * r));
            _mm512_storeu_ps(acc + r * NB + 16 * h, _mm512_cvtepi32_ps(v));
        }
}
#endif
#if SCREEN_PAIRS
/* The same sums for R <= 4 rows with AVX512-VNNI on the tiles' layout (tile loads from memory read a one-row call's
   weights slower than vector loads: 1.06 against 0.85 ms for SmolLM2's lm_head). Byte products take an unsigned and
   a signed operand: lo q directly, hi q as (q + 128) hi - 128 hi, so the sums need H[r] = sum_i hi[r, i]. */
static inline __attribute__((always_inline)) void quad_tile(const int8_t *Q, const int8_t *XH, const uint8_t *XL,
                                                             const int32_t *H, int64_t in_p, int R, float *acc,
                                                             const int8_t *ahead) {
    __m512i sh[4][2], sl[4][2];
    for (int r = 0; r < R; r++) sh[r][0] = sh[r][1] = sl[r][0] = sl[r][1] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8(-128);
    for (int64_t c = 0; c < in_p / 64; c++) {
        prefetch_group((const unsigned char *)ahead, c, 2048);
        for (int t = 0; t < 16; t++)
            for (int h = 0; h < 2; h++) {
                const __m512i w = _mm512_loadu_si512(Q + c * 2048 + h * 1024 + t * 64), wu = _mm512_xor_si512(w, flip);
                for (int r = 0; r < R; r++) {
                    int32_t hq, lq;
                    memcpy(&hq, XH + r * in_p + c * 64 + 4 * t, 4);
                    memcpy(&lq, XL + r * in_p + c * 64 + 4 * t, 4);
                    sh[r][h] = _mm512_dpbusd_epi32(sh[r][h], wu, _mm512_set1_epi32(hq));
                    sl[r][h] = _mm512_dpbusd_epi32(sl[r][h], _mm512_set1_epi32(lq), w);
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {  /* 256 (sum (q + 128) hi - 128 H) + sum q lo, wrapping: the sum fits */
            const __m512i hi = _mm512_sub_epi32(sh[r][h], _mm512_set1_epi32(128 * H[r]));
            _mm512_storeu_ps(acc + r * NB + 16 * h,
                             _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), sl[r][h])));
        }
}
#define QUAD(R) static __attribute__((noinline)) void quad##R(const int8_t *Q, const int8_t *XH, const uint8_t *XL, \
        const int32_t *H, int64_t in_p, float *acc, const int8_t *ahead) { \
    quad_tile(Q, XH, XL, H, in_p, R, acc, ahead); }
QUAD(1) QUAD(2) QUAD(3) QUAD(4)
#undef QUAD
typedef void (*quad_fn)(const int8_t *, const int8_t *, const uint8_t *, const int32_t *, int64_t, float *,
                        const int8_t *);
static const quad_fn QUADS[5] = {0, quad1, quad2, quad3, quad4};
#endif
/* whether screen_argmax can read Q in the tiles' layout (address tagged 2) */
int screen_tiles(void) { return SCREEN_TILES; }

#if SCREEN_PAIRS
/* x [in_f] rounded to int16 as the screen rounds it: xq = round(x / sx) within +-kq, sx = max |x| / kq (1 for a
   zero or non-finite row); returns sx */
static float round_row(const float *x, int64_t in_f, int64_t kq, int16_t *xq) {
    float mx = 0.0f;
    for (int64_t i = 0; i < in_f; i++) mx = fabsf(x[i]) > mx ? fabsf(x[i]) : mx;
    const float sx = mx > 0.0f && isfinite(mx) ? mx / (float)kq : 1.0f;
    for (int64_t i = 0; i < in_f; i++) xq[i] = (int16_t)fminf(fmaxf(nearbyintf(x[i] / sx), (float)-kq), (float)kq);
    return sx;
}
/* the high (signed) and low (unsigned) bytes of xq [in_f], zeros up to in_p; returns the sum of the high bytes */
static int32_t split_row(const int16_t *xq, int64_t in_f, int64_t in_p, int8_t *XH, uint8_t *XL) {
    int32_t h = 0;
    for (int64_t i = 0; i < in_p; i++) {
        const int v = i < in_f ? xq[i] : 0;
        XH[i] = (int8_t)(v >> 8);
        XL[i] = (uint8_t)(v & 255);
        h += v >> 8;
    }
    return h;
}
#endif

/* the kernel's sum for one output: tile()'s lane, one multiply-add per input in order from 0 */
#if defined(__FMA__) || defined(__AVX512F__)  /* maddw and madd fuse exactly then */
#define KERNEL_MADD(a, w, x) fmaf(w, x, a)
#else
#define KERNEL_MADD(a, w, x) ((a) + (w) * (x))
#endif
/* v[k] = the kernel's sum for output o[k], k < n <= 8: tile()'s lane, one multiply-add per input in order from 0;
   eight outputs side by side, so eight independent chains run at once */
static void kernel_dots(const float *W, const int64_t *o, int n, const float *x, int64_t in_f, float *v) {
    const float *w[8];
    float a[8];
    for (int k = 0; k < 8; k++) {
        w[k] = W + o[k < n ? k : n - 1] * in_f;
        a[k] = 0.0f;
    }
    for (int64_t i = 0; i < in_f; i++)
        for (int k = 0; k < 8; k++) a[k] = KERNEL_MADD(a[k], w[k][i], x[i]);
    for (int k = 0; k < n; k++) v[k] = a[k];
}

/* max over o in lo .. hi - 1 of a[o] - nx C[o] (-inf for none; NaNs are skipped) */
static float lower_max(const float *a, const float *C, float nx, int64_t lo, int64_t hi) {
    float top = -INFINITY;
    int64_t o = lo;
#ifdef __AVX2__
    __m256 t0 = _mm256_set1_ps(-INFINITY), t1 = t0;
    const __m256 n = _mm256_set1_ps(nx);
    for (; o + 16 <= hi; o += 16) {  /* max_ps(v, t) returns t when v is NaN */
        t0 = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(a + o), _mm256_mul_ps(n, _mm256_loadu_ps(C + o))), t0);
        t1 = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(a + o + 8), _mm256_mul_ps(n, _mm256_loadu_ps(C + o + 8))),
                           t1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(t0, t1));
    for (int k = 0; k < 8; k++) top = lanes[k] > top ? lanes[k] : top;
#endif
    for (; o < hi; o++) {
        const float v = a[o] - nx * C[o];
        top = v > top ? v : top;
    }
    return top;
}

#define SCREEN_CAP 512  /* candidates per thread and row beyond which the whole product is cheaper */
int64_t screen_argmax(const int8_t *Q, const float *S, const float *C, double n_max, double w_max,
                   const float *W, const float *X,
                   int64_t out_f, int64_t in_f, int64_t M, float *A, float *lo_all, float *best_all,
                   int64_t *at_all, int16_t *Xq, int64_t *Y, int nthreads) {
    /* per row: |x| rounded up, and a bound added to every output's: the rounding of products and sums that
       underflow (up to 2^-126 each, with denormals flushed), and the int16 rounding of x below. NaN for a row that
       the screen leaves to the caller (Y = -1): a NaN or infinity in x, or logits that could overflow. */
    float *nx = best_all + (int64_t)nthreads * M, *extra = nx + M, *sx = extra + M;
#if SCREEN_TILES
    const int64_t in_p = (in_f + 63) / 64 * 64;
    int8_t *XH = on_tiles((const float *)Q) ? amx_buffer(2 * M * in_p + 4 * M) : 0;
    uint8_t *XL = (uint8_t *)XH + M * in_p;
    int32_t *HS = (int32_t *)(XL + M * in_p);  /* sum of each row's hi bytes (quad_tile) */
    const int8_t *QT = (const int8_t *)untag((const float *)Q);
#endif
    for (int64_t m = 0; m < M; m++) {
        const float *x = X + m * in_f;
        double s = 0.0;
        for (int64_t i = 0; i < in_f; i++) s += (double)x[i] * x[i];
        nx[m] = (float)(sqrt(s) * (1.0 + 1e-6));
        extra[m] = isfinite(s) && sqrt(s) * w_max < 1e36 ? (float)(4.0 * (double)(in_f + 2) * 0x1p-126) : NAN;
#if SCREEN_PAIRS
        /* x = sx xq + d: |x . w - A| grows by at most |d| |s q| <= |d| n_max (n_max: the largest |s q| of a row) */
        const int64_t lim = (INT32_MAX / 127) / in_f, kq = lim < 16383 ? lim : 16383;
        sx[m] = round_row(x, in_f, kq, Xq + m * in_f);
        double d = 0.0;
        for (int64_t i = 0; i < in_f; i++) {
            const double e = (double)x[i] - (double)sx[m] * Xq[m * in_f + i];
            d += e * e;
        }
        extra[m] += (float)(sqrt(d) * n_max * 1.001);
#if SCREEN_TILES
        if (XH) HS[m] = split_row(Xq + m * in_f, in_f, in_p, XH + m * in_p, XL + m * in_p);
#endif
#else
        (void)Xq; (void)n_max; (void)sx;
#endif
    }
    for (int64_t k = 0; k < (int64_t)nthreads * M; k++) {
        lo_all[k] = best_all[k] = -INFINITY;
        at_all[k] = -1;
    }
    const int64_t nblk = (out_f + NB - 1) / NB;
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num();
        int64_t lo, hi;
        share(nblk, &lo, &hi);
        const int64_t o_lo = lo * NB, o_hi = hi * NB < out_f ? hi * NB : out_f;
        float acc[16 * NB];  /* up to 16 rows: the tiles' */
#if SCREEN_TILES
        amx_rows_loaded = 0;  /* loaded again in each call, as amx_prepare says */
#endif
        /* 1. the int8 estimates of this thread's outputs */
        for (int64_t b = lo; b < hi; b++)
            for (int64_t m0 = 0; m0 < M;) {
                const int R = tile_rows(M - m0);
                const int8_t *ahead = m0 == 0 && b + 1 < hi ? Q + (b + 1) * in_f * NB : 0;
                const int64_t o0 = b * NB, n = out_f - o0 < NB ? out_f - o0 : NB;
#if SCREEN_TILES
                if (XH) {
                    const int RT = M - m0 < 16 ? (int)(M - m0) : 16;
                    const int8_t *at = QT + b * in_p * NB, *next = m0 == 0 && b + 1 < hi ? at + in_p * NB : 0;
                    if (RT <= QUAD_ROWS)
                        QUADS[RT](at, XH + m0 * in_p, XL + m0 * in_p, HS + m0, in_p, acc, next);
                    else
                        screen_tile(at, XH + m0 * in_p, XL + m0 * in_p, in_p, RT, acc, next);
                    for (int r = 0; r < RT; r++)
                        for (int64_t o = 0; o < n; o++)
                            A[(m0 + r) * out_f + o0 + o] = S[o0 + o] * (sx[m0 + r] * acc[r * NB + o]);
                    m0 += RT;
                    continue;
                }
#endif
#if SCREEN_PAIRS
                PTILES[R](Q + b * in_f * NB, Xq + m0 * in_f, in_f, acc, ahead);
                for (int r = 0; r < R; r++)
                    for (int64_t o = 0; o < n; o++)
                        A[(m0 + r) * out_f + o0 + o] = S[o0 + o] * (sx[m0 + r] * acc[r * NB + o]);
#else
                QTILES[R](Q + b * in_f * NB, X + m0 * in_f, in_f, acc, ahead);
                for (int r = 0; r < R; r++)
                    for (int64_t o = 0; o < n; o++) A[(m0 + r) * out_f + o0 + o] = S[o0 + o] * acc[r * NB + o];
#endif
                m0 += R;
            }
        /* 2. the largest lower bound among them, per row; after the barrier the largest of all threads' */
        for (int64_t m = 0; m < M; m++)
            lo_all[t * M + m] = lower_max(A + m * out_f, C, nx[m], o_lo, o_hi) - extra[m];
        #pragma omp barrier
        /* 3. the exact logits of this thread's candidates, the first largest kept */
        for (int64_t m = 0; m < M; m++) {
            float thr = -INFINITY;
            for (int k = 0; k < nthreads; k++) thr = lo_all[k * M + m] > thr ? lo_all[k * M + m] : thr;
            thr -= extra[m];  /* a + nx C + extra >= thr, as a + nx C >= thr - extra */
            const float *a = A + m * out_f;
            float best = -INFINITY;
            int64_t at = -1, count = 0, cand[SCREEN_CAP];
            for (int64_t o0 = o_lo; o0 < o_hi && count <= SCREEN_CAP; o0 += 8) {
                /* the 8 outputs from o0 that reach the threshold, as bits */
                unsigned bits = 0;
#ifdef __AVX2__
                if (o0 + 8 <= o_hi) {
                    const __m256 hi8 = _mm256_add_ps(_mm256_loadu_ps(a + o0),
                                                     _mm256_mul_ps(_mm256_set1_ps(nx[m]), _mm256_loadu_ps(C + o0)));
                    bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(hi8, _mm256_set1_ps(thr), _CMP_GE_OQ));
                } else
#endif
                    for (int64_t o = o0; o < o0 + 8 && o < o_hi; o++) bits |= (a[o] + nx[m] * C[o] >= thr) << (o - o0);
                for (; bits && count <= SCREEN_CAP; bits &= bits - 1, count++)
                    if (count < SCREEN_CAP) cand[count] = o0 + __builtin_ctz(bits);
            }
            if (count > SCREEN_CAP) at = -2;  /* too many to sum one by one: the caller's whole product */
            for (int64_t k0 = 0; k0 < count && at > -2; k0 += 8) {
                const int n = count - k0 < 8 ? (int)(count - k0) : 8;
                float v[8];
                kernel_dots(W, cand + k0, n, X + m * in_f, in_f, v);
                for (int k = 0; k < n; k++) {
                    if (!isfinite(v[k])) { at = -2; break; }  /* NaN / inf: the caller, as torch orders them */
                    if (at < 0 || v[k] > best) { best = v[k]; at = cand[k0 + k]; }
                }
            }
            best_all[t * M + m] = best;
            at_all[t * M + m] = at;
        }
    }
    int64_t left = 0;  /* rows left to the caller */
    for (int64_t m = 0; m < M; m++) {  /* threads hold ascending ranges of outputs: a tie keeps the earlier */
        float best = -INFINITY;
        int64_t at = -1;
        for (int k = 0; k < nthreads && at > -2; k++) {
            const int64_t o = at_all[k * M + m];
            if (o == -2) at = -2;
            else if (o >= 0 && (at < 0 || best_all[k * M + m] > best)) { best = best_all[k * M + m]; at = o; }
        }
        Y[m] = at < 0 ? -1 : at;
        left += at < 0;
    }
    return left;
}
