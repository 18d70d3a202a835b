/* products.c: x @ W.T for a few rows of float32 x against packed float32 weights (tile, tile_pair), and the loops
   over a weight's blocks that send each block to the path its layout takes (block_tile, linear_blocks: float32,
   codes.c, byte_products.c, amx.c, int8.c), split over the threads: rows_linear, and rows_gated for a gated MLP's
   gate and up weights at once (store_gated applies the activation). */
#include "kernels.h"

/* Products read packed weights: W [out, in] is stored as P [ceil(out / NB)][in][NB] (blocks of NB outputs, the
   block's weights for input i side by side, zero rows padding the last block; `pack` in Python). For a tile of R
   input rows and one block, every input i loads the block's NB weights once and adds w * x[r, i] into R x NB
   accumulators with one FMA each: no horizontal sums, and the weights are reused from registers R times. Each
   output value is the sum over i = 0, 1, ..., in - 1 in that order, one rounding per FMA, whatever R and M, so a row
   gets the same bits alone or in a verification pass. Measured (BENCHMARKS.md): the same time as the former
   row-major kernel for one or two rows (both read the weights at memory speed), half of it for 16 rows. */

/* acc[r * NB + j] = sum_i P[i, j] X[r, i] for r < R (a compile-time constant once inlined) */
static inline __attribute__((always_inline)) void tile(const float *P, const float *X, int64_t in_f, int R,
                                                        float *acc, const float *ahead, int lines) {
    vw a[RMAX][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) a[r][j] = (vw){0};
    for (int64_t i = 0; i < in_f; i++) {
        /* `lines` cache lines per input from `ahead` (this tile's share of the next block) into L2 while this block
           is multiplied: without it the FMAs wait for memory (measured: 10-25 % off 8- and 16-row products). The
           test is loop-invariant: the compiler makes one loop per case. */
        if (lines == 2) { __builtin_prefetch(ahead + i * 32, 0, 2); __builtin_prefetch(ahead + i * 32 + 16, 0, 2); }
        else if (lines == 1) __builtin_prefetch(ahead + i * 16, 0, 2);
        vw w[NV];
        for (int j = 0; j < NV; j++) w[j] = loadw(P + i * NB + j * (NB / NV));
        for (int r = 0; r < R; r++) {
            const vw x = splatw(X[r * in_f + i]);
            for (int j = 0; j < NV; j++) a[r][j] = maddw(a[r][j], w[j], x);
        }
    }
    for (int r = 0; r < R; r++) memcpy(acc + r * NB, a[r], sizeof a[r]);
}

#define PREFETCH_FROM 4  /* rows from which tiles prefetch the next block (below, the hardware prefetcher does better) */
#define TILE(R) static __attribute__((noinline)) void tile##R(const float *P, const float *X, int64_t in_f, \
                                                               float *acc, const float *ahead, int lines) { \
    tile(P, X, in_f, R < RMAX ? R : RMAX, acc, ahead, R >= PREFETCH_FROM && ahead ? lines : 0); }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#undef TILE
typedef void (*tile_fn)(const float *, const float *, int64_t, float *, const float *, int);
static const tile_fn TILES[13] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8, tile9, tile10, tile11,
                                  tile12};

/* A few rows against two blocks at once (two blocks of one weight, or a gate and an up block). A one-row tile has
   only NV independent FMA chains, too few to keep both FMA units busy, and tiles of 1-3 rows, which read one
   stream of weights and no software prefetch, read it well below memory speed (measured: 2-3 rows cost 1.2-1.3x one
   row, 1.05x with two streams; 4-6 rows gained nothing from pairs). The sums are tile()'s, bit for bit. */
#ifdef __AVX512F__
#define PAIR_RMAX 3  /* 3 rows x 2 blocks x 2 vectors = 12 accumulators */
#else
#define PAIR_RMAX 1  /* 1 row x 2 blocks x 4 vectors = 8 of the 16 registers */
#endif
static inline __attribute__((always_inline)) void tile_pair(const float *Pa, const float *Pb, const float *X,
                                                             int64_t in_f, int R, float *acc_a, float *acc_b) {
    vw a[PAIR_RMAX][NV], b[PAIR_RMAX][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) a[r][j] = b[r][j] = (vw){0};
    for (int64_t i = 0; i < in_f; i++) {
        vw wa[NV], wb[NV];
        for (int j = 0; j < NV; j++) {
            wa[j] = loadw(Pa + i * NB + j * (NB / NV));
            wb[j] = loadw(Pb + i * NB + j * (NB / NV));
        }
        for (int r = 0; r < R; r++) {
            const vw x = splatw(X[r * in_f + i]);
            for (int j = 0; j < NV; j++) {
                a[r][j] = maddw(a[r][j], wa[j], x);
                b[r][j] = maddw(b[r][j], wb[j], x);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        memcpy(acc_a + r * NB, a[r], sizeof a[r]);
        memcpy(acc_b + r * NB, b[r], sizeof b[r]);
    }
}
#define PAIR(R) static __attribute__((noinline)) void pair##R(const float *Pa, const float *Pb, const float *X, \
                                                               int64_t in_f, float *acc_a, float *acc_b) { \
    tile_pair(Pa, Pb, X, in_f, R < PAIR_RMAX ? R : PAIR_RMAX, acc_a, acc_b); }
PAIR(1) PAIR(2) PAIR(3)
#undef PAIR
typedef void (*pair_fn)(const float *, const float *, const float *, int64_t, float *, float *);
static const pair_fn PAIRS[4] = {0, pair1, pair2, pair3};  /* called up to PAIR_RMAX (<= 3) rows */

/* number of row tiles M rows take */
static inline int tile_count(int64_t M) {
    int n = 0;
    for (int64_t m0 = 0; m0 < M; m0 += tile_rows(M - m0)) n++;
    return n;
}

/* What row tile t of T prefetches of the next block (next: that block, or NULL for none): all of it (two lines per
   input) when it is the only tile, else the first two tiles one half each (one line per input). */
static inline const float *ahead_share(const float *next, int64_t in_f, int t, int T, int *lines) {
    *lines = !next || t > 1 ? 0 : T == 1 ? 2 : 1;
    return next && t == 1 ? next + in_f * 16 : next;
}

/* rows m0 .. m0 + R - 1 of X against block b of weight P (either layout) into acc; `next`: block b + 1 exists */
static inline void block_tile(const float *P, int64_t b, int next, const float *X, int64_t in_f, int R, float *acc,
                              int t, int T) {
    if (is_i8(P)) {  /* a gate or up weight whose partner is not in int8 */
        i8_one_block(P, b, X, in_f, R, acc);
        return;
    }
#if AMX_OK
    if (on_tiles(P)) {  /* a gate or up weight whose partner is not on tiles */
        const amx_rows a = amx_prepare(X, R, in_f);
        tile_block(P, b, &a, acc, 0);
        return;
    }
#endif
#if Q4_OK
    if (is_q4(P)) {
        Q4TILES[R](q4_block(P, b, in_f), X, in_f, acc, next && t == 0 ? q4_block(P, b + 1, in_f) : 0);
        return;
    }
    if (is_q8(P)) {
        Q8TILES[R](q8_block(P, b, in_f), X, in_f, acc, next && t == 0 ? q8_block(P, b + 1, in_f) : 0);
        return;
    }
    if (is_kq(P)) {
        KQTILES[R](kq_block(P, b, in_f), X, in_f, acc, next && t == 0 ? kq_block(P, b + 1, in_f) : 0);
        return;
    }
#endif
    int n;
    const float *ahead = ahead_share(next ? P + (b + 1) * in_f * NB : 0, in_f, t, T, &n);
    TILES[R](P + b * in_f * NB, X, in_f, acc, ahead, n);
}
/* Y[m, o] = sum_i W[o, i] X[m, i] (+ B[o]) for m < M and the outputs o of blocks lo .. hi - 1 (P packed). */
static void linear_blocks(const float *P, const float *X, const float *B, float *Y,
                          int64_t lo, int64_t hi, int64_t out_f, int64_t in_f, int64_t M) {
    float acc[RMAX * NB];
    if (is_i8(P)) {
        i8_linear(P, X, B, Y, lo, hi, out_f, in_f, M);
        return;
    }
#if VQ_OK
    vq_rows a;
    if (is_vq(P) && M <= VQ_MAX && vq_prepare(X, M, in_f, &a)) {
        vq_linear(P, &a, B, Y, lo, hi, out_f, in_f, M);
        return;
    }
#endif
#if AMX_OK
    if (on_tiles(P)) {
        amx_linear(P, X, B, Y, lo, hi, out_f, in_f, M);
        return;
    }
#endif
    for (int64_t b = lo; b < hi;) {
        if (M <= PAIR_RMAX && b + 1 < hi && is_float(P)) {
            PAIRS[M](P + b * in_f * NB, P + (b + 1) * in_f * NB, X, in_f, acc, acc + PAIR_RMAX * NB);
            store_block(Y, acc, B, b, out_f, 0, (int)M);
            store_block(Y, acc + PAIR_RMAX * NB, B, b + 1, out_f, 0, (int)M);
            b += 2;
            continue;
        }
#if Q4_OK
        if (has_codes(P) && M > RMAX) {
            float many[MANY * NB] __attribute__((aligned(64)));
            const int form = code_form(P);
            for (int64_t m0 = 0; m0 < M; m0 += MANY) {
                const int64_t R = M - m0 < MANY ? M - m0 : MANY;
                q4_many(codes_block(P, b, in_f, form), X + m0 * in_f, in_f, R, many,
                        b + 1 < hi && m0 == 0 ? codes_block(P, b + 1, in_f, form) : 0, form);
                store_block(Y, many, B, b, out_f, m0, (int)R);
            }
            b++;
            continue;
        }
#endif
        const int T = tile_count(M);
        int t = 0;
        for (int64_t m0 = 0; m0 < M; t++) {
            const int R = tile_rows(M - m0);
            block_tile(P, b, b + 1 < hi, X + m0 * in_f, in_f, R, acc, t, T);
            store_block(Y, acc, B, b, out_f, m0, R);
            m0 += R;
        }
        b++;
    }
}

static void gated_chunk(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                        int64_t M, int nthreads, int act);

/* rows per chunk of a long input: about 1 MB of input rows, which stay in L2 while every block of the weight passes
   over them (else each block would read all the rows from memory again); a multiple of RMAX */
static inline int64_t row_chunk(int64_t in_f) {
    const int64_t rows = (1 << 18) / in_f / RMAX * RMAX;
    return rows > RMAX ? rows : RMAX;
}

/* Y[m, o] = sum_i W[o, i] X[m, i] (+ B[o]) for m < M, W packed as P. Output blocks are split over the threads. */
void rows_linear(const float *P, const float *X, const float *B, float *Y,
                 int64_t out_f, int64_t in_f, int64_t M, int nthreads) {
    const int64_t chunk = row_chunk(in_f);
    for (int64_t c = 0; c < M; c += chunk) {
        const int64_t rows = M - c < chunk ? M - c : chunk;
        #pragma omp parallel num_threads(nthreads)
        {
            int64_t lo, hi;
            share((out_f + NB - 1) / NB, &lo, &hi);
            linear_blocks(P, X + c * in_f, B, Y + c * out_f, lo, hi, out_f, in_f, rows);
        }
    }
}

/* A gated MLP's first half: Y[m, o] = act(G[o] . X[m]) * (U[o] . X[m]), G and U packed, block by block; act is
   SiLU (0) or GELU's tanh form (1, as store_gated computes them). */
void rows_gated(const float *G, const float *U, const float *X, float *Y,
                int64_t out_f, int64_t in_f, int64_t M, int nthreads, int act) {
    const int64_t chunk = row_chunk(in_f);
    for (int64_t c = 0; c < M; c += chunk)
        gated_chunk(G, U, X + c * in_f, Y + c * out_f, out_f, in_f, M - c < chunk ? M - c : chunk, nthreads, act);
}

/* Y[m0 + r, o0 + o] = act(g[r, o]) * u[r, o] for r < R, o < n (g and u: R rows of NB sums), 8 at a time. Both
   activations are g sigmoid(s): SiLU (act 0) with s = g, GELU's tanh form (act 1: 0.5 g (1 + tanh(z)) with
   z = sqrt(2 / pi) (g + 0.044715 g^3), and 0.5 (1 + tanh(z)) = sigmoid(2 z)) with s = 2 z. Then
   g sigmoid(s) = (s >= 0 ? g : g e) / (1 + e) with e = exp(-|s|) <= 1. */
#define GELU_2C 1.5957691216057308f  /* 2 sqrt(2 / pi) */
static inline void store_gated(float *Y, const float *g, const float *u, int64_t out_f, int64_t o0, int64_t n,
                               int64_t m0, int64_t R, int act) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t o = 0; o < n; o += 8) {
            const v8 gv = load8(g + r * NB + o), uv = load8(u + r * NB + o);
#ifdef __AVX2__
            const __m256 x = (__m256)gv;
            const __m256 s = act ? _mm256_mul_ps(_mm256_set1_ps(GELU_2C),
                                                 _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f),
                                                                                _mm256_mul_ps(_mm256_mul_ps(x, x), x))))
                                 : x;
            const __m256 e = (__m256)vexp((v8)_mm256_or_ps(s, _mm256_set1_ps(-0.0f)));
            const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(x, e), x,
                                                _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GE_OQ));
            const v8 y = (v8)_mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), (__m256)uv);
#else
            v8 sv, na, y;
            for (int l = 0; l < 8; l++) {
                sv[l] = act ? GELU_2C * (gv[l] + 0.044715f * (gv[l] * gv[l] * gv[l])) : gv[l];
                na[l] = -fabsf(sv[l]);
            }
            const v8 e = vexp(na);
            for (int l = 0; l < 8; l++) y[l] = (sv[l] >= 0.0f ? gv[l] : gv[l] * e[l]) / (1.0f + e[l]) * uv[l];
#endif
            memcpy(Y + (m0 + r) * out_f + o0 + o, &y, sizeof(float) * (size_t)(n - o < 8 ? n - o : 8));
        }
}

static void gated_chunk(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                        int64_t M, int nthreads, int act) {
    if (is_i8(G) && is_i8(U)) {
        i8_gated(G, U, X, Y, out_f, in_f, M, nthreads, act);
        return;
    }
#if AMX_OK
    if (on_tiles(G) && on_tiles(U)) {
        amx_gated(G, U, X, Y, out_f, in_f, M, nthreads, act);
        return;
    }
#endif
    const int64_t nblk = (out_f + NB - 1) / NB;
#if VQ_OK
    vq_rows a;  /* the rows' bytes made once, in this thread's buffer, for all threads */
    if (is_vq(G) && is_vq(U) && M <= VQ_MAX && vq_prepare(X, M, in_f, &a)) {
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t b = 0; b < nblk; b++) {
            float g[VQ_MAX * NB], u[VQ_MAX * NB];
            vq_block(G, b, b + 1 < nblk, in_f, &a, 0, M, g);
            vq_block(U, b, b + 1 < nblk, in_f, &a, 0, M, u);
            store_gated(Y, g, u, out_f, b * NB, out_f - b * NB < NB ? out_f - b * NB : NB, 0, M, act);
        }
        return;
    }
#endif
    const int T = tile_count(M);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblk; b++) {
        float g[RMAX * NB], u[RMAX * NB];
        const int64_t o0 = b * NB, n = out_f - o0 < NB ? out_f - o0 : NB;
#if Q4_OK
        if (is_q4(G) && is_q4(U) && M > RMAX) {  /* each group decoded once for all row tiles (q4_many) */
            float gm[MANY * NB] __attribute__((aligned(64))), um[MANY * NB] __attribute__((aligned(64)));
            for (int64_t m0 = 0; m0 < M; m0 += MANY) {
                const int64_t R = M - m0 < MANY ? M - m0 : MANY;
                const int first = b + 1 < nblk && m0 == 0;
                q4_many(q4_block(G, b, in_f), X + m0 * in_f, in_f, R, gm, first ? q4_block(G, b + 1, in_f) : 0, 0);
                q4_many(q4_block(U, b, in_f), X + m0 * in_f, in_f, R, um, first ? q4_block(U, b + 1, in_f) : 0, 0);
                store_gated(Y, gm, um, out_f, o0, n, m0, R, act);
            }
            continue;
        }
#endif
        int t = 0;
        for (int64_t m0 = 0; m0 < M; t++) {
            const int R = tile_rows(M - m0);
            if (R <= PAIR_RMAX && is_float(G) && is_float(U)) {
                PAIRS[R](G + b * in_f * NB, U + b * in_f * NB, X + m0 * in_f, in_f, g, u);
            } else {
                block_tile(G, b, b + 1 < nblk, X + m0 * in_f, in_f, R, g, t, T);
                block_tile(U, b, b + 1 < nblk, X + m0 * in_f, in_f, R, u, t, T);
            }
            store_gated(Y, g, u, out_f, o0, n, m0, R, act);
            m0 += R;
        }
    }
}

