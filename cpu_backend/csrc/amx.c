/* amx.c: Q4_1 codes and bfloat16 weights multiplied on AMX tiles (amx_linear, amx_gated, amx_blocks for a module's
   products; the tile configuration, load_tiles, shared with screen.c), and amx_enable, which asks Linux for the
   tiles. */
#include "kernels.h"
#if AMX_OK
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Q4_1 weights through AMX (Sapphire Rapids and later): bfloat16 tile products with float32 accuracy. The codes q
   (0..15) are exact in bfloat16, and each input x is split exactly into three bfloat16 parts (x = hi + mid + lo:
   three 8-bit pieces of its 24-bit significand), so a tile product sums exact products x q in float32. For each
   group g of 32 inputs and output o: y[o] += d[g, o] * (sum over the group of x q) + m[g, o] * (sum over the group
   of x), in float32, group after group. Every row is computed alone, in the same order, whatever the row count, so
   a row gets the same bits alone or in a verification pass. (These are not the float32 path's bits: the sums run
   in another order. Measured: closer to float64 than the float32 path.) The weight layout is QG bytes per group as
   Q4_1's (common.h), the code bytes ordered for `amx_decode`; its address is tagged 2 (the second-lowest bit set;
   1 tags the FMA path's Q4_1 layout, 3 the bfloat16 one below, 0 float32). */
#if AMX_OK
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Linux lets a process use AMX tiles once it asks: 1 when it may */
int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
/* tiles 0 .. with_r - 1 of R rows, with_r .. tiles - 1 of 16, all rows 64 bytes; loaded unless `mark` is */
static void load_tiles(int R, int with_r, int tiles, int mark) {
    if (amx_rows_loaded == mark) return;
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < tiles; t++) {
        c.rows[t] = t < with_r ? R : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
    amx_rows_loaded = mark;
}
/* tiles 0, 1: sums of the two halves (16 outputs each) of a block, R rows; 2, 3, 4: the three parts of R input
   rows (32 inputs); 5, 6: the two halves' codes as bfloat16, pairs of inputs side by side. Marked R. */
static void amx_config(int R) { load_tiles(R, 5, 7, R); }

/* a group's 512 code bytes into T: two 1 KB tiles (16 pairs of inputs x 16 outputs x 2) of bfloat16 codes. Each 64
   bytes hold four tile rows: the low four bits of bytes 16 j .. 16 j + 7 are words 8 j .. 8 j + 7 of the first
   row, of bytes 16 j + 8 .. 16 j + 15 those of the second, and the high four bits the third and the fourth. */
static inline void amx_decode(const unsigned char *C, uint16_t *T) {
    const __m512i lo_byte = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -128, 0, 64, -128, -96, -64, -32,
                                                                 0, 16, 32, 48, 64, 80, 96, 112));
    const __m512i hi_byte = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 63, 64, 64, 64, 64, 64, 64,
                                                                 65, 65, 65, 65, 65, 65, 65, 65));
    const __m512i f = _mm512_set1_epi8(15);
    for (int s = 0; s < 8; s++) {
        const __m512i v = _mm512_loadu_si512(C + 64 * s);
        const __m512i n[2] = {_mm512_and_si512(v, f), _mm512_and_si512(_mm512_srli_epi16(v, 4), f)};
        for (int h = 0; h < 2; h++) {
            const __m512i L = _mm512_shuffle_epi8(lo_byte, n[h]), H = _mm512_shuffle_epi8(hi_byte, n[h]);
            _mm512_store_si512(T + 128 * s + 64 * h, _mm512_unpacklo_epi8(L, H));
            _mm512_store_si512(T + 128 * s + 64 * h + 32, _mm512_unpackhi_epi8(L, H));
        }
    }
}

static void *amx_buffer(size_t n) { return thread_buffer(0, n); }

#define AMX_RUN 4  /* blocks whose products share their input rows' tiles (amx_run), from RUN_ROWS rows */
/* Below RUN_ROWS rows, a block at a time: in decoding, where the weights come from memory, four blocks' streams at
   once read them slower (passes of 1 / 2 / 4 / 6 rows 3.4 / 2.9 / 1.2 / 0.2 % faster one block at a time), while
   from 8 rows on the tile loads that four blocks share are worth more (8 / 12 / 16 rows 0.8 / 1.8 / 3.3 % faster). */
#define RUN_ROWS 8
/* M input rows made ready for tile products: XS [3][Mp][in] their bfloat16 parts (rows past M zero), S [M][in /
   32] each group's float32 sum (in order), acc [AMX_RUN][Mp][NB] room for the sums of AMX_RUN blocks; tiles of R
   rows */
static amx_rows amx_prepare(const float *X, int64_t M, int64_t in_f) {
    /* the tile configuration is loaded again in each call: another library on this thread (oneDNN's bfloat16
       products in torch, or another build of this kernel) may have changed or released it since */
    amx_rows_loaded = 0;
    amx_rows a;
    const int64_t tiles = (M + 15) / 16;
    a.R = (int)((M + tiles - 1) / tiles);
    a.M = M, a.Mp = tiles * a.R, a.in_f = in_f;
    const int64_t ng = in_f / 32;
    char *buf = amx_buffer(a.Mp * (6 * in_f + 4 * ng + 4 * AMX_RUN * NB) + 64);
    a.acc = (float *)buf;
    a.XS = (uint16_t *)(a.acc + AMX_RUN * a.Mp * NB);
    a.S = (float *)(a.XS + 3 * a.Mp * in_f);
    for (int64_t r = 0; r < a.Mp; r++)
        for (int64_t g = 0; g < ng; g++) {
            __m512 x[2];
            for (int h = 0; h < 2; h++) {
                x[h] = r < M ? _mm512_loadu_ps(X + r * in_f + 32 * g + 16 * h) : _mm512_setzero_ps();
                for (int p = 0; p < 3; p++) {
                    const __m512i top = _mm512_and_si512(_mm512_castps_si512(x[h]),
                                                         _mm512_set1_epi32((int)0xFFFF0000u));
                    _mm256_storeu_si256((__m256i *)(a.XS + (p * a.Mp + r) * in_f + 32 * g + 16 * h),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(top, 16)));
                    x[h] = _mm512_sub_ps(x[h], _mm512_castsi512_ps(top));  /* exact: the bits below the top 16 */
                }
            }
            /* the group's sum: its two halves added lane by lane, then the lanes in a fixed tree (the same for
               every row, so a row's sums do not depend on the row count) */
            if (r < M)
                a.S[r * ng + g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(X + r * in_f + 32 * g),
                                                                     _mm512_loadu_ps(X + r * in_f + 32 * g + 16)));
        }
    return a;
}

/* tiles 2, 3, 4: the three parts of rows r0 .. r0 + R - 1 of a, inputs of group g */
static inline void load_parts(const amx_rows *a, int64_t r0, int64_t g) {
    const int64_t row = a->in_f * 2;
    _tile_loadd(2, a->XS + r0 * a->in_f + g * 32, row);
    _tile_loadd(3, a->XS + (a->Mp + r0) * a->in_f + g * 32, row);
    _tile_loadd(4, a->XS + (2 * a->Mp + r0) * a->in_f + g * 32, row);
}
/* tiles 0 and 1 += the three parts (tiles 2, 3, 4) times tiles 5 and 6 */
static inline void dot_parts(void) {
    _tile_dpbf16ps(0, 2, 5); _tile_dpbf16ps(1, 2, 6);
    _tile_dpbf16ps(0, 3, 5); _tile_dpbf16ps(1, 3, 6);
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6);
}
/* tiles 0 and 1 += the three parts of rows r0 .. r0 + R - 1 of a, inputs of group g, times tiles 5 and 6 */
static inline void tile_parts(const amx_rows *a, int64_t r0, int64_t g) {
    load_parts(a, r0, g);
    dot_parts();
}

/* group g of block Q (the same group of the next block, ahead, prefetched if any): its codes decoded through T into
   tiles 5 and 6 */
static inline __attribute__((always_inline)) void amx_group(const unsigned char *Q, int64_t g,
                                                            const unsigned char *ahead, uint16_t *T) {
    prefetch_group(ahead, g, QG);
    amx_decode(Q + g * QG + 128, T);
    _tile_loadd(5, T, 64);
    _tile_loadd(6, T + 512, 64);
}

/* C [2][16 x 16]: rows r0 .. r0 + R - 1 of a, inputs of group g, times tiles 5 and 6 (its codes) */
static inline __attribute__((always_inline)) void group_sums(const amx_rows *a, int64_t r0, int64_t g,
                                                             float C[2][16 * 16]) {
    _tile_zero(0);
    _tile_zero(1);
    tile_parts(a, r0, g);
    _tile_stored(0, C[0], 64);
    _tile_stored(1, C[1], 64);
}

/* rows r0 .. r0 + n - 1 of acc += the sums C (rows 0 .. n - 1) of a group g whose d and m (outputs 0-15 and 16-31)
   are at G: y += d (the group's sum of x q), then y += m (the group's sum of x) */
static inline __attribute__((always_inline)) void amx_scale(const float C[2][16 * 16], const unsigned char *G,
                                                            const amx_rows *a, int64_t r0, int64_t n, int64_t g,
                                                            float *acc) {
    const int64_t ng = a->in_f / 32;
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)G));
    const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(G + 32)));
    const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(G + 64)));
    const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(G + 96)));
    for (int64_t r = 0; r < n; r++) {
        float *y = acc + (r0 + r) * NB;
        const __m512 s = _mm512_set1_ps(a->S[(r0 + r) * ng + g]);
        const __m512 y0 = _mm512_fmadd_ps(_mm512_load_ps(C[0] + 16 * r), d0, _mm512_loadu_ps(y));
        const __m512 y1 = _mm512_fmadd_ps(_mm512_load_ps(C[1] + 16 * r), d1, _mm512_loadu_ps(y + 16));
        _mm512_storeu_ps(y, _mm512_fmadd_ps(m0, s, y0));
        _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(m1, s, y1));
    }
}

/* acc [M][NB]: the rows of a against block Q (the next block, ahead, prefetched if any), a tile of rows at a time;
   amx_run does the same, with the same bits, for up to 16 rows of a run of blocks, faster */
static void amx_block(const unsigned char *Q, const amx_rows *a, float *acc, const unsigned char *ahead) {
    uint16_t T[2 * 512] __attribute__((aligned(64)));
    float C[2][16 * 16] __attribute__((aligned(64)));
    const int64_t ng = a->in_f / 32;
    amx_config(a->R);
    memset(acc, 0, sizeof(float) * a->M * NB);
    for (int64_t g = 0; g < ng; g++) {
        amx_group(Q, g, ahead, T);
        for (int64_t r0 = 0; r0 < a->M; r0 += a->R) {
            group_sums(a, r0, g, C);
            amx_scale(C, Q + g * QG, a, r0, a->M - r0 < a->R ? a->M - r0 : a->R, g, acc);
        }
    }
}

/* acc[j] [M][NB] for j < n <= AMX_RUN: the rows of a (M <= 16: one tile of rows) against the Q4_1 blocks Q[j], by
   the operations of amx_block in its order (so with its bits), in units of one block's group, group by group.
   - The rows' three parts go on tiles once a group for all n blocks (amx_block loads them for each block).
   - A unit's codes are decoded while the unit before it is on the tiles, into the other of two buffers.
   - A unit's sums are scaled a unit later, from the other of two buffers.
   So the tiles do not wait for the decoding's stores, nor the scaling for the tiles. ahead[j]: a block whose
   same groups to prefetch, or 0. */
static void amx_run(const unsigned char *const *Q, const unsigned char *const *ahead, int n, const amx_rows *a,
                    float *const *acc) {
    uint16_t T[2][2 * 512] __attribute__((aligned(64)));
    float C[2][2][16 * 16] __attribute__((aligned(64)));
    const int64_t ng = a->in_f / 32, units = ng * n;
    amx_config(a->R);
    for (int j = 0; j < n; j++) memset(acc[j], 0, sizeof(float) * a->M * NB);
    prefetch_group(ahead[0], 0, QG);
    amx_decode(Q[0] + 128, T[0]);
    for (int64_t u = 0; u < units; u++) {  /* unit u: group u / n of block u % n */
        if (u % n == 0) load_parts(a, 0, u / n);
        _tile_loadd(5, T[u & 1], 64);
        _tile_loadd(6, T[u & 1] + 512, 64);
        _tile_zero(0);
        _tile_zero(1);
        dot_parts();
        if (u + 1 < units) {
            const int64_t g = (u + 1) / n;
            const int j = (int)((u + 1) % n);
            prefetch_group(ahead[j], g, QG);
            amx_decode(Q[j] + g * QG + 128, T[(u + 1) & 1]);
        }
        if (u > 0) {
            const int64_t g = (u - 1) / n;
            const int j = (int)((u - 1) % n);
            amx_scale(C[(u - 1) & 1], Q[j] + g * QG, a, 0, a->M, g, acc[j]);
        }
        _tile_stored(0, C[u & 1][0], 64);
        _tile_stored(1, C[u & 1][1], 64);
    }
    amx_scale(C[(units - 1) & 1], Q[n - 1] + (ng - 1) * QG, a, 0, a->M, ng - 1, acc[n - 1]);
}

/* amx_run for any row count (the tiles of R rows of a in turn): units of one block's group and one tile of rows, the
   row tiles fastest, by amx_block's operations in its order (so with its bits). A block's group is decoded once for
   all row tiles, while the group before it is on the tiles; a unit's sums are scaled a unit later. */
static void amx_tall(const unsigned char *const *Q, const unsigned char *const *ahead, int n, const amx_rows *a,
                     float *const *acc) {
    uint16_t T[2][2 * 512] __attribute__((aligned(64)));
    float C[2][2][16 * 16] __attribute__((aligned(64)));
    const int64_t ng = a->in_f / 32, nr = a->Mp / a->R, groups = ng * n, units = groups * nr;
    amx_config(a->R);
    for (int j = 0; j < n; j++) memset(acc[j], 0, sizeof(float) * a->M * NB);
    prefetch_group(ahead[0], 0, QG);
    amx_decode(Q[0] + 128, T[0]);
    for (int64_t u = 0; u <= units; u++) {
        if (u < units) {  /* unit u: row tile u % nr of group v / n of block v % n, v = u / nr */
            const int64_t v = u / nr, r = u % nr;
            if (r == 0) {
                _tile_loadd(5, T[v & 1], 64);
                _tile_loadd(6, T[v & 1] + 512, 64);
            }
            _tile_zero(0);
            _tile_zero(1);
            tile_parts(a, r * a->R, v / n);
            if (r == 0 && v + 1 < groups) {
                const int64_t g = (v + 1) / n;
                const int j = (int)((v + 1) % n);
                prefetch_group(ahead[j], g, QG);
                amx_decode(Q[j] + g * QG + 128, T[(v + 1) & 1]);
            }
        }
        if (u > 0) {  /* the unit before: its rows of acc */
            const int64_t v = (u - 1) / nr, r0 = (u - 1) % nr * a->R, g = v / n;
            const int j = (int)(v % n);
            if (r0 < a->M)
                amx_scale(C[(u - 1) & 1], Q[j] + g * QG, a, r0, a->M - r0 < a->R ? a->M - r0 : a->R, g, acc[j]);
        }
        if (u < units) {
            _tile_stored(0, C[u & 1][0], 64);
            _tile_stored(1, C[u & 1][1], 64);
        }
    }
}

/* Weights kept in bfloat16 (an EAGLE head's, when drafting without AMX-INT8: `draft_precision`): for each group of 32
   inputs of a block, two 1 KB tiles (16 pairs of inputs x 16 outputs x 2), loaded as they are. The inputs keep their
   three exact parts, and every group's products go into the same sums, so the only rounding beyond float32 sums is
   the weights'. The address of such a weight is tagged 3. */
#define BG 2048  /* bytes per group of a block */
static void bf16_block(const unsigned char *W, const amx_rows *a, float *acc, const unsigned char *ahead) {
    float C[2][16 * 16] __attribute__((aligned(64)));
    const int64_t ng = a->in_f / 32;
    amx_config(a->R);
    for (int64_t r0 = 0; r0 < a->M; r0 += a->R) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t g = 0; g < ng; g++) {
            prefetch_group(r0 == 0 ? ahead : 0, g, BG);
            _tile_loadd(5, W + g * BG, 64);
            _tile_loadd(6, W + g * BG + 1024, 64);
            tile_parts(a, r0, g);
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        const int64_t n = a->M - r0 < a->R ? a->M - r0 : a->R;
        for (int64_t r = 0; r < n; r++) {
            memcpy(acc + (r0 + r) * NB, C[0] + 16 * r, 16 * sizeof(float));
            memcpy(acc + (r0 + r) * NB + 16, C[1] + 16 * r, 16 * sizeof(float));
        }
    }
}

/* acc [M][NB]: the rows of a against block b of a weight on tiles (Q4_1 codes or bfloat16); `next`: prefetch
   block b + 1 */
static void tile_block(const float *P, int64_t b, const amx_rows *a, float *acc, int next) {
    const int64_t size = (a->in_f / 32) * (is_bf16(P) ? BG : QG);
    const unsigned char *W = untag(P) + b * size;
    if (is_bf16(P))
        bf16_block(W, a, acc, next ? W + size : 0);
    else
        amx_block(W, a, acc, next ? W + size : 0);
}

/* The n = min(R, hi - b) blocks from block b of each of the k Q4_1 weights W[0 .. k - 1] (a block's k weights side by
   side), as amx_run takes them: Q, the same blocks of the next run (if below hi) to prefetch, and room for their
   sums in a; returns n */
static int amx_run_blocks(const float *const *W, int k, int64_t b, int64_t hi, int R, const amx_rows *a,
                          const unsigned char **Q, const unsigned char **ahead, float **acc) {
    const int64_t size = (a->in_f / 32) * QG;
    const int n = (int)(hi - b < R ? hi - b : R);
    for (int j = 0; j < k * n; j++) {
        Q[j] = untag(W[j % k]) + (b + j / k) * size;
        ahead[j] = b + n + j / k < hi ? Q[j] + n * size : 0;
        acc[j] = a->acc + j * a->Mp * NB;
    }
    return n;
}

/* blocks lo .. hi - 1 of a weight on tiles against the rows of a, into rows c .. c + a->M - 1 of Y */
static void amx_blocks(const float *P, const amx_rows *a, const float *B, float *Y, int64_t lo, int64_t hi,
                       int64_t out_f, int64_t c) {
    if (a->M <= 16 && !is_bf16(P)) {  /* runs of blocks through amx_run (AMX_RUN from RUN_ROWS rows, else one) */
        const int R = a->M < RUN_ROWS ? 1 : AMX_RUN;
        for (int64_t b = lo; b < hi; b += R) {
            const unsigned char *Q[AMX_RUN], *ahead[AMX_RUN];
            float *acc[AMX_RUN];
            const int n = amx_run_blocks(&P, 1, b, hi, R, a, Q, ahead, acc);
            amx_run(Q, ahead, n, a, acc);
            for (int j = 0; j < n; j++) store_block(Y, acc[j], B, b + j, out_f, c, (int)a->M);
        }
        return;
    }
    for (int64_t b = lo; b < hi; b++) {
        if (!is_bf16(P)) {  /* more rows than a tile: a block at a time through amx_tall */
            const unsigned char *Q[1], *ahead[1];
            float *acc[1];
            amx_run_blocks(&P, 1, b, hi, 1, a, Q, ahead, acc);
            amx_tall(Q, ahead, 1, a, acc);
        } else
            tile_block(P, b, a, a->acc, b + 1 < hi);
        store_block(Y, a->acc, B, b, out_f, c, (int)a->M);
    }
}
/* linear_blocks for a weight on tiles */
static void amx_linear(const float *P, const float *X, const float *B, float *Y, int64_t lo, int64_t hi,
                       int64_t out_f, int64_t in_f, int64_t M) {
    for (int64_t c = 0; c < M; c += AMX_PASS) {
        const amx_rows a = amx_prepare(X + c * in_f, M - c < AMX_PASS ? M - c : AMX_PASS, in_f);
        amx_blocks(P, &a, B, Y, lo, hi, out_f, c);
    }
}

/* gated_chunk for gate and up weights on tiles */
static void amx_gated(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                      int64_t M, int nthreads, int act) {
    const int64_t nblk = (out_f + NB - 1) / NB;
    #pragma omp parallel num_threads(nthreads)
    {
        int64_t lo, hi;
        share(nblk, &lo, &hi);
        for (int64_t c = 0; c < M; c += AMX_PASS) {
            const int64_t rows = M - c < AMX_PASS ? M - c : AMX_PASS;
            const amx_rows a = amx_prepare(X + c * in_f, rows, in_f);
            if (rows <= 16 && !is_bf16(G) && !is_bf16(U)) {  /* gate and up blocks in runs through amx_run */
                const float *GU[2] = {G, U};
                const int R = rows < RUN_ROWS ? 1 : AMX_RUN / 2;  /* blocks a run, each its gate and up */
                for (int64_t b = lo; b < hi; b += R) {
                    const unsigned char *Q[AMX_RUN], *ahead[AMX_RUN];
                    float *acc[AMX_RUN];
                    const int n = amx_run_blocks(GU, 2, b, hi, R, &a, Q, ahead, acc);
                    amx_run(Q, ahead, 2 * n, &a, acc);
                    for (int j = 0; j < n; j++)
                        store_gated(Y, acc[2 * j], acc[2 * j + 1], out_f, (b + j) * NB,
                                    out_f - (b + j) * NB < NB ? out_f - (b + j) * NB : NB, c, rows, act);
                }
                continue;
            }
            float *g = a.acc, *u = a.acc + a.Mp * NB;
            for (int64_t b = lo; b < hi; b++) {
                if (!is_bf16(G) && !is_bf16(U)) {  /* a block's gate and up through amx_tall */
                    const float *GU[2] = {G, U};
                    const unsigned char *Q[2], *ahead[2];
                    float *acc[2];
                    amx_run_blocks(GU, 2, b, hi, 1, &a, Q, ahead, acc);
                    amx_tall(Q, ahead, 2, &a, acc);
                } else {
                    tile_block(G, b, &a, g, b + 1 < hi);
                    tile_block(U, b, &a, u, b + 1 < hi);
                }
                store_gated(Y, g, u, out_f, b * NB, out_f - b * NB < NB ? out_f - b * NB : NB, c, rows, act);
            }
        }
    }
}
#else
int amx_enable(void) { return 0; }
#endif
