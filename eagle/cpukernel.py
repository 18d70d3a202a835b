"""Small C kernels for decoding on CPU, where a step is a few rows through every weight of the model.

- `rows_linear`: `x @ W.T` for a few rows. At batch 1 a decoder step multiplies every weight by 1-16 rows: bound by
  reading the weights for one row, by arithmetic for 16. The BLAS paths behind `F.linear` read the weights at a
  fraction of this machine's bandwidth for one row and use half its vector width (BENCHMARKS.md). The kernel
  reads each weight in a packed layout (`pack`: blocks of 32 outputs, their weights for each input side by side,
  made once per weight and kept beside it), so a tile of up to 12 input rows multiplies each loaded weight vector
  with every row, with no horizontal sums; blocks are split over the threads `torch.get_num_threads()` names.
  A weight dequantized from GGUF Q4_1 (as transformers loads a `.gguf` file: `d * q + m` in float32 with float16
  d, m per 32 inputs of an output and 4-bit q) is kept as those codes instead (`q4_1_codes`, `pack_q4`: 0.625 bytes
  a weight, 4 before) and decoded in registers to the same float32 values, so every product keeps its bits while a
  one-token step reads a sixth of the bytes (SmolLM2: all 210 decoder weights; BENCHMARKS.md). Where the CPU has
  AMX tiles (Sapphire Rapids and later) those codes are multiplied on them instead (`amx_on`; `EAGLE_NO_AMX=1`
  keeps the FMA path): bfloat16 tile products of the exact codes and of each input split exactly into three
  bfloat16 parts, so float32 accuracy, other bits than the float32 path's, and 16 rows at about twice the cost of
  one instead of four times. Without AMX, where the CPU has AVX512-VNNI and VBMI (Zen 4, Ice Lake and later), calls
  of up to 64 rows multiply the codes (Q4_1, the Q8_0 form's, K-quants') by byte products instead (`vq_linear`;
  `VNNI`, `EAGLE_NO_VNNI=1` keeps the FMA path): each input split exactly enough into three bytes a value for float32
  accuracy, the integer sums exact. Decoding the codes to float32 had bound the FMA path by arithmetic on Zen 4: a
  SmolLM2 pass of 1-16 tokens 1.17-1.35x faster (BENCHMARKS.md, thirty-seventh session).
- `rows_gated`: a gated MLP's `silu(x @ G.T) * (x @ U.T)` in one pass over both weights (or GELU's tanh form,
  Gemma's, for silu).
- `rms_norm`: an RMS norm of each row in one call (the stock module is eight small torch ops).
- `attend`: attention of a few query rows over the KV cache, grouped-query heads read in place.
- `rope_`: the rotary embedding in place.
- `attention_block` and `decoder_layer`: a whole Llama-style attention module (products, q / k norms if any,
  rotary embedding, cache write, attention) or decoder layer (norms, attention, gated MLP, residual sums; Gemma-3's
  norms of the attention's and the MLP's outputs) in one call, made of the functions above: on this CPU each
  Python-level step around a C call costs microseconds, and these calls took about a quarter off a one-token pass
  (BENCHMARKS.md).
- `screen_argmax`: the argmax of `rows_linear`'s logits, bit for bit, for greedy tokens: the weight read in int8
  (`screen_tables`), a proven bound per output on how far the int8 estimate can lie from the float32 logit, and
  float32 sums only for the outputs whose bound reaches the largest lower bound (a few of SmolLM2's 49,152).
  With AVX512-VNNI the int8 estimate is integer arithmetic on x rounded to int16 (its rounding in the bound too).

Every output row is computed alone, in the same order whatever the number of rows (each product summed over the
inputs in order, one FMA each, or on AMX tiles or in byte products group by group; a fixed reduction elsewhere;
masked keys adding exact zeros), so a verification pass over M tokens (up to 64 with byte products) gives each
token exactly the bits a single-token step gives it (tests/test_attention.py checks a
whole model).

The source is compiled once per machine with the system C compiler (`cc -O3 -march=native -fopenmp`) into
`$EAGLE_CACHE/kernels/`. Without a compiler, or on a CPU the build fails on, `available()` is False and callers
keep the stock torch ops. `EAGLE_NO_KERNEL=1` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from eagle import gguf_codes
from eagle.target import cache_root

BLOCK = 32  # input features consumed per inner iteration: in_features must be a multiple

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif
#ifdef __FMA__
/* a + w x with one rounding, written out so that every row's sum is compiled the same way */
static inline v8 madd(v8 a, v8 w, v8 x) { return (v8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)a); }
#else
static inline v8 madd(v8 a, v8 w, v8 x) { return a + w * x; }
#endif

static inline float hsum(v8 a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

/* Lane l of accumulator j summed the products i = 32 t + 8 j + l in order; the lanes are added in a fixed order. */
static inline float reduce(v8 a0, v8 a1, v8 a2, v8 a3) { return hsum((a0 + a1) + (a2 + a3)); }

/* Products read packed weights: W [out, in] is stored as P [ceil(out / NB)][in][NB] (blocks of NB outputs, the
   block's weights for input i side by side, zero rows padding the last block; `pack` in Python). For a tile of R
   input rows and one block, every input i loads the block's NB weights once and adds w * x[r, i] into R x NB
   accumulators with one FMA each: no horizontal sums, and the weights are reused from registers R times. Each
   output value is the sum over i = 0, 1, ..., in - 1 in that order, one rounding per FMA, whatever R and M, so a row
   gets the same bits alone or in a verification pass. Measured (BENCHMARKS.md): the same time as the former
   row-major kernel for one or two rows (both read the weights at memory speed), half of it for 16 rows. */
#define NB 32
#ifdef __AVX512F__
typedef float vw __attribute__((vector_size(64)));
static inline vw maddw(vw a, vw w, vw x) { return (vw)_mm512_fmadd_ps((__m512)w, (__m512)x, (__m512)a); }
static inline vw splatw(float x) { return (vw)_mm512_set1_ps(x); }
#define RMAX 12  /* 12 rows x 2 vectors = 24 of the 32 registers */
#else
typedef v8 vw;
static inline vw maddw(vw a, vw w, vw x) { return madd(a, w, x); }
static inline vw splatw(float x) { return (vw){x, x, x, x, x, x, x, x}; }
#define RMAX 3   /* 3 rows x 4 vectors = 12 of the 16 registers */
#endif
#define NV (NB / (int)(sizeof(vw) / sizeof(float)))
static inline vw loadw(const float *p) { vw v; memcpy(&v, p, sizeof v); return v; }

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

/* rows per tile for the `left` rows still to do: all of them up to RMAX, else halves, else RMAX */
static inline int tile_rows(int64_t left) {
    return left <= RMAX ? (int)left : left < 2 * RMAX ? (int)((left + 1) / 2) : RMAX;
}

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

/* Y[m0 + r, o] = acc[r, o - b NB] (+ B[o]) for r < R and the outputs o of block b */
static inline void store_block(float *Y, const float *acc, const float *B, int64_t b, int64_t out_f, int64_t m0,
                               int R) {
    const int64_t o0 = b * NB, n = out_f - o0 < NB ? out_f - o0 : NB;
    for (int r = 0; r < R; r++)
        for (int64_t o = 0; o < n; o++) Y[(m0 + r) * out_f + o0 + o] = acc[r * NB + o] + (B ? B[o0 + o] : 0.0f);
}

/* this thread's buffer `slot` (0: amx_prepare's and the screen's, 1: i8_prepare's, 2: vq_prepare's) of at least n
   bytes (grown, never shrunk) */
static void *thread_buffer(int slot, size_t n) {
    static __thread void *buf[3];
    static __thread size_t cap[3];
    if (n > cap[slot]) {
        free(buf[slot]);
        cap[slot] = (n + 4095) / 4096 * 4096;
        buf[slot] = aligned_alloc(64, cap[slot]);
    }
    return buf[slot];
}

/* Weights that are GGUF Q4_1 blocks dequantized to float32 (w = fl(fl(d q) + m) for one fp16 d and m per 32
   consecutive inputs of an output, q in 0..15), read in that form: 0.625 bytes a weight instead of 4, decoded to the
   same float32 values, so every product keeps its bits. Layout of block b (outputs 32 b .. 32 b + 31), for each
   group g of 32 inputs, QG bytes: d[32] and m[32] as float16 (as GGUF stores them: exact), then for each input of
   the group 16 bytes, byte j holding output j's q in its low four bits and output 16 + j's in its high four. The
   address of such a weight is tagged 1 (and bit 3, 8, set for the byte products of `vq_linear`). */
#define QG (128 + 32 * 16)
static inline int is_q4(const float *P) { return ((uintptr_t)P & 7) == 1; }
/* the bytes of a weight at tagged address P (any layout but float32's, whose tag is 0; layouts are 64-byte aligned,
   so the three lowest bits are free for tags) */
static inline const unsigned char *untag(const float *P) {
    return (const unsigned char *)((uintptr_t)P & ~(uintptr_t)15);
}
/* block b of the Q4_1 weight at tagged address P */
static inline const unsigned char *q4_block(const float *P, int64_t b, int64_t in_f) {
    return untag(P) + b * (in_f / 32) * QG;
}
/* Weights that are GGUF Q8_0 blocks dequantized to float32 (w = fl(d q) for one fp16 d per 32 consecutive inputs of
   an output, q in -128..127; SmolLM2's tied embedding and lm_head), read in that form on the FMA path: 1.06 bytes a
   weight instead of 4, decoded to the same float32 values, so every product keeps the float32 path's bits (with AMX
   too). Layout of block b, for each group g of 32 inputs, Q8G bytes: d[32] as float16, then for each input of the
   group 32 bytes, byte j holding output j's q. Tagged 5. */
#define Q8G (64 + 32 * 32)
static inline int is_q8(const float *P) { return ((uintptr_t)P & 7) == 5; }
static inline const unsigned char *q8_block(const float *P, int64_t b, int64_t in_f) {
    return untag(P) + b * (in_f / 32) * Q8G;
}
/* Weights in a GGUF K-quant form (Q4_K, Q5_K, Q6_K; their codes found in the GGUF file itself, `eagle.gguf_codes`):
   w = fl(fl(d q) + m) with float32 d and m per 16 consecutive inputs of an output (a float16 times a 6- or 8-bit
   scale: exact in float32; m = 0 for Q6_K) and q in -128..127, read on the FMA path: 1.5 bytes a weight instead of
   4, decoded to the same float32 values, so every product keeps the float32 path's bits. Layout of block b, for each
   group g of 32 inputs, KG bytes: d for the group's inputs 0-15 then 16-31 (32 outputs each), m the same, as
   float32, then for each input of the group 32 bytes, byte j holding output j's q. Tagged 6. */
#define KG (4 * 4 * NB + 32 * 32)
static inline int is_kq(const float *P) { return ((uintptr_t)P & 7) == 6; }
static inline const unsigned char *kq_block(const float *P, int64_t b, int64_t in_f) {
    return untag(P) + b * (in_f / 32) * KG;
}
/* the three code layouts above, as the kernels below name them */
enum { FORM_Q4 = 0, FORM_Q8 = 1, FORM_K = 2 };
static inline int code_form(const float *P) { return is_q8(P) ? FORM_Q8 : is_kq(P) ? FORM_K : FORM_Q4; }
static inline int has_codes(const float *P) { return is_q4(P) || is_q8(P) || is_kq(P); }
/* group g (of `bytes` bytes) of the block at `ahead` into L2, if there is one */
static inline void prefetch_group(const unsigned char *ahead, int64_t g, int bytes) {
    if (ahead)
        for (int l = 0; l < bytes / 64; l++) __builtin_prefetch(ahead + g * bytes + 64 * l, 0, 2);
}

/* Q4_1 weights through AMX (Sapphire Rapids and later): bfloat16 tile products with float32 accuracy. The codes q
   (0..15) are exact in bfloat16, and each input x is split exactly into three bfloat16 parts (x = hi + mid + lo:
   three 8-bit pieces of its 24-bit significand), so a tile product sums exact products x q in float32. For each
   group g of 32 inputs and output o: y[o] += d[g, o] * (sum over the group of x q) + m[g, o] * (sum over the group
   of x), in float32, group after group. Every row is computed alone, in the same order, whatever the row count, so
   a row gets the same bits alone or in a verification pass. (These are not the float32 path's bits: the sums run
   in another order. Measured: closer to float64 than the float32 path.) The weight layout is QG bytes per group as
   above, the code bytes ordered for `amx_decode`; its address is tagged 2 (the second-lowest bit set; 1 tags the
   FMA path's Q4_1 layout, 3 the bfloat16 one below, 0 float32). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define AMX_OK 1
#else
#define AMX_OK 0
#endif
static inline int is_bf16(const float *P) { return ((uintptr_t)P & 7) == 3; }
static inline int on_tiles(const float *P) { return ((uintptr_t)P & 7) == 2 || ((uintptr_t)P & 7) == 3; }
static inline int is_float(const float *P) { return ((uintptr_t)P & 7) == 0; }
/* int8 weights with a scale per output, multiplied as the greedy screen multiplies (`i8_linear`): tag 4 */
static inline int is_i8(const float *P) { return ((uintptr_t)P & 7) == 4; }
static void i8_linear(const float *P, const float *X, const float *B, float *Y, int64_t lo, int64_t hi,
                      int64_t out_f, int64_t in_f, int64_t M);
static void i8_gated(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                     int64_t M, int nthreads, int act);
static void i8_one_block(const float *P, int64_t b, const float *X, int64_t in_f, int R, float *acc);
#if AMX_OK
typedef struct { uint16_t *XS; float *S, *acc; int64_t M, Mp, in_f; int R; } amx_rows;
static amx_rows amx_prepare(const float *X, int64_t M, int64_t in_f);
static void tile_block(const float *P, int64_t b, const amx_rows *a, float *acc, int next);
static void amx_linear(const float *P, const float *X, const float *B, float *Y, int64_t lo, int64_t hi,
                       int64_t out_f, int64_t in_f, int64_t M);
static void amx_gated(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                      int64_t M, int nthreads, int act);
#endif
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
#define Q4_OK 1
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
#define Q4_OK 1
#else
#define Q4_OK 0
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

#define MANY 96  /* rows per pass of q4_many: its sums [MANY][NB] stay in L1 */
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

/* Q4_1, Q8_0-form and K-quant codes multiplied by byte products (AVX512-VNNI; the address's tag 1, 5 or 6 with
   bit 3 set, the same layouts): each input row is split, per group of its 32 inputs, into three bytes a value: with
   s a power of two, max |x| <= 127 s (about), x = s (hi + mid / 256 + lo / 65536) + e, hi = floor(x / s), mid =
   floor of the next 8 bits, lo the next 8 rounded (at most 255), so |e| <= s / 2^17 (s / 2^16 where lo's rounding
   stops at 255): float32's accuracy for the group's largest value. Byte products take an unsigned and a signed
   byte: hi is signed, mid and lo unsigned; Q4_1 codes (0-15) serve as either, the others are signed and go unsigned
   as q + 128, whose extra 128 sum_k hi_k is taken off again. The integer sums are exact; then sum_k w_k x_k =
   d s (H + ML / 65536) (+ m sum_k x_k for Q4_1) with H = sum q hi, ML = sum q (256 mid + lo), in float32 with one
   rounding for the group (K-quants: for each half of it, with its d and m). Each row's sums do not depend on the
   other rows, so a verification pass gives each row a one-row call's bits (other bits than the FMA path's: the
   same float32 accuracy). A row with a non-finite value sends the call to the FMA path. Measured on Zen 4
   (BENCHMARKS.md, thirty-seventh session): whole SmolLM2 passes 1.17-1.35x faster than on the FMA path at 1-16 rows;
   the byte products serve up to VQ_MAX rows, so every verification pass keeps each row's one-row bits. */
#if Q4_OK && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define VQ_OK 1
#define VQ_MAX 64  /* rows up to which the byte products serve; beyond, q4_many decodes each group once for all */
#define VQ_ROWS 3  /* rows a tile: 3 rows x 3 parts x 2 halves = 18 int32 sums in registers (4 rows: no faster) */
static inline int is_vq(const float *P) { return ((uintptr_t)P & 8) != 0; }
/* X [M][G][3][32]: hi, mid, lo; S, SX [M][G]: s and the float32 sum of the group's x; HSh [M][G][2]: the sum of
   its hi over each half, SXh [M][G][2]: of its x (K-quant codes have a d and m per 16 inputs) */
typedef struct { const int8_t *X; const float *S, *SX, *SXh; const int32_t *HSh; int64_t G; } vq_rows;
/* a's bytes of X [M][in_f] in this thread's buffer; 0 if a value is not finite */
static int vq_prepare(const float *X, int64_t M, int64_t in_f, vq_rows *a) {
    const int64_t G = in_f / 32;
    int8_t *P = thread_buffer(2, (size_t)(M * G) * (96 + 6 * sizeof(float)));  /* X; S, SX; HSh, SXh */
    float *S = (float *)(P + M * G * 96), *SX = S + M * G;
    int32_t *HSh = (int32_t *)(SX + M * G);
    float *SXh = (float *)(HSh + 2 * M * G);
    for (int64_t rg = 0; rg < M * G; rg++) {
        const float *x = X + (rg / G) * in_f + (rg % G) * 32;
        const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        if (_mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99)) return 0;  /* NaN or infinity */
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        int e = 0;
        const float f = mx > 1e-30f ? frexpf(mx / 127.0f, &e) : 0.0f;  /* mx / 127 = f 2^e, f in [0.5, 1) */
        const float s = f == 0.0f ? 1.0f : ldexpf(1.0f, f == 0.5f ? e - 1 : e), inv = 1.0f / s;  /* both exact */
        const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(255.0f), k256 = _mm512_set1_ps(256.0f);
        for (int h = 0; h < 2; h++) {
            const __m512 y = f == 0.0f ? zero : _mm512_mul_ps(h ? x1 : x0, _mm512_set1_ps(inv));
            __m512 hi = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            __m512 r1 = _mm512_mul_ps(_mm512_sub_ps(y, hi), k256);  /* [0, 256]: y - hi rounds only for y in ... */
            /* ... (-1, 0), by at most 2^-25, and to 1 for y >= -2^-25: carry there (x = s (hi + 1), off by at most
               2^-25 s); else mid would be 256, whose byte is 0, and x off by s */
            const __mmask16 carry = _mm512_cmp_ps_mask(r1, k256, _CMP_GE_OQ);
            hi = _mm512_mask_add_ps(hi, carry, hi, _mm512_set1_ps(1.0f));
            r1 = _mm512_mask_mov_ps(r1, carry, zero);
            const __m512 mid = _mm512_roundscale_ps(r1, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            const __m512 r2 = _mm512_mul_ps(_mm512_sub_ps(r1, mid), k256);  /* exact: [0, 256) */
            const __m512 lo = _mm512_min_ps(_mm512_roundscale_ps(r2, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                            top);
            int8_t *p = P + rg * 96 + 16 * h;
            const __m512i hq = _mm512_cvtps_epi32(hi);
            HSh[2 * rg + h] = _mm512_reduce_add_epi32(hq);
            SXh[2 * rg + h] = _mm512_reduce_add_ps(h ? x1 : x0);
            _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(hq));
            _mm_storeu_si128((__m128i *)(p + 32), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(mid)));
            _mm_storeu_si128((__m128i *)(p + 64), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(lo)));
        }
        S[rg] = s;
        SX[rg] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
    a->X = P, a->S = S, a->SX = SX, a->SXh = SXh, a->HSh = HSh, a->G = G;
    return 1;
}
/* one input quad t of group g: the sums H, MD, L [R][2] of rows r .. r + R - 1 take codes c [2] (outputs 0-15,
   16-31; each 32-bit lane one output's four codes, signed) and cu [2] (the same as unsigned bytes) */
static inline __attribute__((always_inline)) void vq_quad(const __m512i *c, const __m512i *cu, const vq_rows *a,
                                                           int64_t r, int64_t g, int t, int R, __m512i (*H)[2],
                                                           __m512i (*MD)[2], __m512i (*L)[2]) {
    for (int i = 0; i < R; i++) {
        const int8_t *xp = a->X + ((r + i) * a->G + g) * 96 + 4 * t;
        int32_t xh, xm, xl;
        memcpy(&xh, xp, 4), memcpy(&xm, xp + 32, 4), memcpy(&xl, xp + 64, 4);
        const __m512i bh = _mm512_set1_epi32(xh), bm = _mm512_set1_epi32(xm), bl = _mm512_set1_epi32(xl);
        for (int h = 0; h < 2; h++) {
            H[i][h] = _mm512_dpbusd_epi32(H[i][h], cu[h], bh);
            MD[i][h] = _mm512_dpbusd_epi32(MD[i][h], bm, c[h]);
            L[i][h] = _mm512_dpbusd_epi32(L[i][h], bl, c[h]);
        }
    }
}
/* acc [R][NB] += the sums d s (H + ML / 65536) (+ m sum x for Q4_1 and K-quants) of rows r .. r + R - 1 over
   group g (`half` < 0) or its half `half` (K-quants) */
static inline __attribute__((always_inline)) void vq_scale(__m512i (*H)[2], __m512i (*MD)[2], __m512i (*L)[2],
                                                            const __m512 *d, const __m512 *m, const vq_rows *a,
                                                            int64_t r, int64_t g, int R, float *acc, int form,
                                                            int half) {
    for (int i = 0; i < R; i++) {
        const int64_t rg = (r + i) * a->G + g;
        const __m512 s = _mm512_set1_ps(a->S[rg]);
        const __m512 sx = _mm512_set1_ps(half < 0 ? a->SX[rg] : a->SXh[2 * rg + half]);
        const int32_t hs = half < 0 ? a->HSh[2 * rg] + a->HSh[2 * rg + 1] : a->HSh[2 * rg + half];
        for (int h = 0; h < 2; h++) {  /* |ML| < 2^29: its float32 rounds at 2^-24 of it; the sum once */
            const __m512i hq = form != FORM_Q4 ? _mm512_sub_epi32(H[i][h], _mm512_set1_epi32(128 * hs)) : H[i][h];
            const __m512i ml = _mm512_add_epi32(_mm512_slli_epi32(MD[i][h], 8), L[i][h]);
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ml), _mm512_set1_ps(1.0f / 65536.0f),
                                             _mm512_cvtepi32_ps(hq));
            __m512 y = _mm512_fmadd_ps(v, _mm512_mul_ps(d[h], s), _mm512_loadu_ps(acc + i * NB + 16 * h));
            if (form != FORM_Q8) y = _mm512_fmadd_ps(m[h], sx, y);
            _mm512_storeu_ps(acc + i * NB + 16 * h, y);
        }
    }
}
/* quad t of a group's codes (inputs 4t .. 4t + 3) as c [2] and cu [2] (vq_quad's): a Q4_1 group holds 16 bytes an
   input (outputs j and 16 + j in byte j), a Q8_0-form group 32 (output j in byte j) after its 64 bytes of d, a
   K-quant group 32 after its 512 bytes of d and m */
static inline __attribute__((always_inline)) void vq_codes(const unsigned char *G, int t, const __m512i *perm,
                                                            __m512i *c, __m512i *cu, int form) {
    if (form != FORM_Q4) {
        const unsigned char *C = G + (form == FORM_K ? 4 * 4 * NB : 64) + 128 * t;
        const __m512i a = _mm512_loadu_si512(C), b = _mm512_loadu_si512(C + 64);
        for (int h = 0; h < 2; h++) {
            c[h] = _mm512_permutex2var_epi8(a, perm[h], b);
            cu[h] = _mm512_xor_si512(c[h], _mm512_set1_epi8(-128));
        }
        return;
    }
    const __m512i p = _mm512_permutexvar_epi8(perm[0], _mm512_loadu_si512(G + 128 + 64 * t));
    const __m512i low = _mm512_set1_epi8(15);
    cu[0] = c[0] = _mm512_and_si512(p, low);
    cu[1] = c[1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
}
/* d and m [2] (outputs 0-15, 16-31) of a group G of `form` (Q8_0: m unused), for K-quants of its half `part` */
static inline __attribute__((always_inline)) void vq_scales(const unsigned char *G, int part, int form, __m512 *d,
                                                             __m512 *m) {
    for (int h = 0; h < 2; h++) {
        if (form == FORM_K) {  /* float32 d [2][NB], then m [2][NB] */
            d[h] = _mm512_loadu_ps((const float *)G + part * NB + 16 * h);
            m[h] = _mm512_loadu_ps((const float *)G + (2 + part) * NB + 16 * h);
        } else {  /* float16 d [NB], then (Q4_1) m [NB] */
            d[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(G + 32 * h)));
            m[h] = form == FORM_Q8 ? d[h] : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(G + 64 + 32 * h)));
        }
    }
}
/* acc [R][NB] = rows r .. r + R - 1 (R <= VQ_ROWS) of a against block Q (codes of `form`), each quad's codes
   decoded into registers; the next block's groups fetched ahead */
static inline __attribute__((always_inline)) void vq_rows_block(const unsigned char *Q, const vq_rows *a, int64_t r,
                                                                 int R, float *acc, const unsigned char *ahead,
                                                                 int form) {
    uint8_t index[2][64];  /* lane j's byte k: input k's byte of output j (Q4_1: j of the 16; Q8: 16 h + j) */
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 16; j++)
            for (int k = 0; k < 4; k++)
                index[h][4 * j + k] = (uint8_t)(form != FORM_Q4 ? 32 * k + 16 * h + j : 16 * k + j);
    const __m512i perm[2] = {_mm512_loadu_si512(index[0]), _mm512_loadu_si512(index[1])};
    const int size = form == FORM_Q8 ? Q8G : form == FORM_K ? KG : QG;
    memset(acc, 0, sizeof(float) * R * NB);
    for (int64_t g = 0; g < a->G; g++) {
        const unsigned char *G = Q + g * size;
        prefetch_group(ahead, g, size);
        const int halves = form == FORM_K;  /* K-quants: each half of the group with its own d and m */
        for (int part = 0; part <= halves; part++) {
            __m512i H[VQ_ROWS][2], MD[VQ_ROWS][2], L[VQ_ROWS][2];
            for (int i = 0; i < R; i++)
                for (int h = 0; h < 2; h++) H[i][h] = MD[i][h] = L[i][h] = _mm512_setzero_si512();
            /* the quads unrolled by hand: as a loop (GCC 12 unrolls it only up to 2 rows), some of the 18 sums of
               3 rows live on the stack, and 3-16 rows cost 1.1-1.4x what they cost unrolled */
#define VQ_QUAD(t) do { __m512i c[2], cu[2]; vq_codes(G, t, perm, c, cu, form); \
                        vq_quad(c, cu, a, r, g, t, R, H, MD, L); } while (0)
            const int t0 = halves ? 4 * part : 0;
            VQ_QUAD(t0); VQ_QUAD(t0 + 1); VQ_QUAD(t0 + 2); VQ_QUAD(t0 + 3);
            if (!halves) { VQ_QUAD(4); VQ_QUAD(5); VQ_QUAD(6); VQ_QUAD(7); }
#undef VQ_QUAD
            __m512 d[2], m[2];
            vq_scales(G, part, form, d, m);
            vq_scale(H, MD, L, d, m, a, r, g, R, acc, form, halves ? part : -1);
        }
    }
}
#define VQB(R) static __attribute__((noinline)) void vq_block##R(const unsigned char *Q, const vq_rows *a, int64_t r, \
                                                                  float *acc, const unsigned char *ahead) { \
    vq_rows_block(Q, a, r, R, acc, ahead, FORM_Q4); } \
static __attribute__((noinline)) void vq8_block##R(const unsigned char *Q, const vq_rows *a, int64_t r, float *acc, \
                                                   const unsigned char *ahead) { \
    vq_rows_block(Q, a, r, R, acc, ahead, FORM_Q8); } \
static __attribute__((noinline)) void vqk_block##R(const unsigned char *Q, const vq_rows *a, int64_t r, float *acc, \
                                                   const unsigned char *ahead) { \
    vq_rows_block(Q, a, r, R, acc, ahead, FORM_K); }
VQB(1) VQB(2) VQB(3)
#undef VQB
typedef void (*vq_block_fn)(const unsigned char *, const vq_rows *, int64_t, float *, const unsigned char *);
static const vq_block_fn VQBLOCKS[3][VQ_ROWS + 1] = {{0, vq_block1, vq_block2, vq_block3},  /* by FORM_* */
                                                     {0, vq8_block1, vq8_block2, vq8_block3},
                                                     {0, vqk_block1, vqk_block2, vqk_block3}};
/* acc [R][NB] = rows r0 .. r0 + R - 1 of a against block b of P (codes), by tiles of up to VQ_ROWS rows (the first
   fetches the next block, if `next`) */
static void vq_block(const float *P, int64_t b, int next, int64_t in_f, const vq_rows *a, int64_t r0, int64_t R,
                     float *acc) {
    const int form = code_form(P);
    const unsigned char *Q = codes_block(P, b, in_f, form), *ahead = next ? codes_block(P, b + 1, in_f, form) : 0;
    for (int64_t i = 0; i < R; i += VQ_ROWS)
        VQBLOCKS[form][R - i < VQ_ROWS ? R - i : VQ_ROWS](Q, a, r0 + i, acc + i * NB, i ? 0 : ahead);
}
static void vq_linear(const float *P, const vq_rows *a, const float *B, float *Y, int64_t lo, int64_t hi,
                      int64_t out_f, int64_t in_f, int64_t M) {
    float acc[VQ_MAX * NB];
    for (int64_t b = lo; b < hi; b++) {
        vq_block(P, b, b + 1 < hi, in_f, a, 0, M, acc);
        store_block(Y, acc, B, b, out_f, 0, (int)M);
    }
}
#else
#define VQ_OK 0
static inline int is_vq(const float *P) { (void)P; return 0; }
#endif
int vq_supported(void) { return VQ_OK; }

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

/* this thread's share lo .. hi - 1 of n work items, split as `schedule(static)` would */
static inline void share(int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    *lo = n * t / T;
    *hi = n * (t + 1) / T;
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

static inline v8 vexp(v8 x);
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

#if AMX_OK
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Linux lets a process use AMX tiles once it asks: 1 when it may */
int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
/* the configuration this thread loaded: its mark (see the callers), 0 for none or unknown */
static __thread int amx_rows_loaded;
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

#define AMX_PASS 256  /* input rows per pass of amx_linear */
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

#ifdef __AVX2__
/* exp(x) for x <= 0 (Cephes' polynomial after a reduction by ln 2; about 1 ulp), 0 below -87 */
static inline v8 vexp(v8 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 xm = _mm256_max_ps((__m256)x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xm, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(xm, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return (v8)_mm256_and_ps(out, _mm256_cmp_ps((__m256)x, lo, _CMP_GE_OQ));
}
#else
static inline v8 vexp(v8 x) { v8 y; for (int l = 0; l < 8; l++) y[l] = x[l] < -87.0f ? 0.0f : expf(x[l]); return y; }
#endif

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

/* A Llama-style attention module for M rows of one sequence, in one call: the q / k / v products (one parallel
   loop over their stacked outputs), the rotary embedding of q and k, the new keys and values written into the
   cache buffers at positions past .. past + M - 1 (K / V [H_kv, capacity, D], head stride kv_sh), attention over
   the past + M keys, and the o product into Y [M, hidden]. Every number is computed by the same code, in the same
   order, as the separate calls above (rows_linear, rope, attend), so the results are theirs bit for bit. With Wqn
   and Wkn (Qwen3's, Gemma-3's q and k norms), each head's query and key is normed (rms_norm over D, epsilon
   eps_qk) before the rotation. work holds M (2 H + 2 H_kv) D floats. */
void rms_norm(const float *X, const float *W, float *Y, int64_t M, int64_t n, float eps);
void attention_block(const float *X, int64_t M, int64_t hid,
                     const float *Wq, const float *Bq, const float *Wk, const float *Bk,
                     const float *Wv, const float *Bv, const float *Wo, const float *Bo,
                     const float *Wqn, const float *Wkn, float eps_qk,
                     int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                     float *K, float *V, int64_t kv_sh, int64_t past,
                     const void *mask, int mask_kind, int64_t mask_sm, float scale,
                     float *work, float *Y, int nthreads) {
    const int64_t nq = H * D, nk = Hkv * D;
    float *Q = work, *Kn = Q + M * nq, *Vn = Kn + M * nk, *A = Vn + M * nk;
    const int64_t bq = (nq + NB - 1) / NB, bk = (nk + NB - 1) / NB;
    #pragma omp parallel num_threads(nthreads)
    {   /* the q, k and v blocks in one list, split over the threads */
        int64_t lo, hi;
        share(bq + 2 * bk, &lo, &hi);
#define FIRST(first) (lo > (first) ? lo : (first)) - (first)
#define LAST(first, count) (hi < (first) + (count) ? hi : (first) + (count)) - (first)
#if AMX_OK
        if (M <= AMX_PASS && on_tiles(Wq) && on_tiles(Wk) && on_tiles(Wv)) {  /* the rows made ready once */
            const amx_rows a = amx_prepare(X, M, hid);
#define PART(P, B, Y, n, first, count) if (lo < (first) + (count) && hi > (first)) \
            amx_blocks(P, &a, B, Y, FIRST(first), LAST(first, count), n, 0);
            PART(Wq, Bq, Q, nq, 0, bq) PART(Wk, Bk, Kn, nk, bq, bk) PART(Wv, Bv, Vn, nk, bq + bk, bk)
#undef PART
        } else
#endif
        {
#define PART(P, B, Y, n, first, count) if (lo < (first) + (count) && hi > (first)) \
            linear_blocks(P, X, B, Y, FIRST(first), LAST(first, count), n, hid, M);
            PART(Wq, Bq, Q, nq, 0, bq) PART(Wk, Bk, Kn, nk, bq, bk) PART(Wv, Bv, Vn, nk, bq + bk, bk)
#undef PART
        }
#undef FIRST
#undef LAST
    }
    if (Wqn) rms_norm(Q, Wqn, Q, M * H, D, eps_qk);  /* in place: each row's sum is taken before it is written */
    if (Wkn) rms_norm(Kn, Wkn, Kn, M * Hkv, D, eps_qk);
    rope(Q, cos, sin, 1, M, H, D, 0);
    rope(Kn, cos, sin, 1, M, Hkv, D, 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(K + h * kv_sh + (past + m) * D, Kn + (m * Hkv + h) * D, (size_t)D * sizeof(float));
            memcpy(V + h * kv_sh + (past + m) * D, Vn + (m * Hkv + h) * D, (size_t)D * sizeof(float));
        }
    attend(Q, 0, D, nq, K, V, 0, kv_sh, D, mask, mask_kind, 0, mask_sm, A, 1, H, H / Hkv, M, past + M, D, scale,
           nthreads);
    rows_linear(Wo, A, Bo, Y, hid, nq, M, nthreads);
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

/* RMS norm of each row: Y[m] = W * (X[m] / sqrt(mean(X[m]^2) + eps)); the sum of squares in a fixed order. */
void rms_norm(const float *X, const float *W, float *Y, int64_t M, int64_t n, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = X + m * n;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < n; i += 32) {
            v8 x0 = load8(x + i), x1 = load8(x + i + 8), x2 = load8(x + i + 16), x3 = load8(x + i + 24);
            a0 = madd(a0, x0, x0); a1 = madd(a1, x1, x1); a2 = madd(a2, x2, x2); a3 = madd(a3, x3, x3);
        }
        const float inv = 1.0f / sqrtf(reduce(a0, a1, a2, a3) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) Y[m * n + i] = W[i] * (x[i] * inv);
    }
}

/* A Llama-style decoder layer for M rows of one sequence, in one call:
       h = x + attention(rms_norm(x)),  y = h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))
   with the calls above (rms_norm, attention_block, rows_gated, rows_linear) and plain float sums, so the results
   are those of the separate calls bit for bit. Gemma-3's layers also norm the attention's output (Wpa) and the
   MLP's (Wpf) before their residual sums, norm each head's query and key (Wqn, Wkn: attention_block), and gate by
   GELU (act 1: rows_gated); null weights and act 0 for Llama's. work holds M (3 hid + inter + (2 H + 2 H_kv) D)
   floats. */
void decoder_layer(const float *X, int64_t M, int64_t hid, const float *Wn1, float eps1, const float *Wn2, float eps2,
                   const float *Wpa, float eps_pa, const float *Wpf, float eps_pf,
                   const float *Wq, const float *Bq, const float *Wk, const float *Bk,
                   const float *Wv, const float *Bv, const float *Wo, const float *Bo,
                   const float *Wqn, const float *Wkn, float eps_qk,
                   int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                   float *K, float *V, int64_t kv_sh, int64_t past,
                   const void *mask, int mask_kind, int64_t mask_sm, float scale,
                   const float *G, const float *U, const float *Dn, int64_t inter, int act,
                   float *work, float *Y, int nthreads) {
    float *N = work, *Hs = N + M * hid, *T = Hs + M * hid, *Mid = T + M * hid, *aw = Mid + M * inter;
    if (Wn1) rms_norm(X, Wn1, N, M, hid, eps1);  /* none: the input goes to attention as it is (an EAGLE head's) */
    attention_block(Wn1 ? N : X, M, hid, Wq, Bq, Wk, Bk, Wv, Bv, Wo, Bo, Wqn, Wkn, eps_qk, H, Hkv, D, cos, sin, K, V,
                    kv_sh, past, mask, mask_kind, mask_sm, scale, aw, T, nthreads);
    if (Wpa) rms_norm(T, Wpa, T, M, hid, eps_pa);
    for (int64_t i = 0; i < M * hid; i++) Hs[i] = X[i] + T[i];
    rms_norm(Hs, Wn2, N, M, hid, eps2);
    rows_gated(G, U, N, Mid, inter, hid, M, nthreads, act);
    rows_linear(Dn, Mid, 0, T, hid, inter, M, nthreads);
    if (Wpf) rms_norm(T, Wpf, T, M, hid, eps_pf);
    for (int64_t i = 0; i < M * hid; i++) Y[i] = Hs[i] + T[i];
}

/* Every decoder layer of a model in one call: layer l runs decoder_layer on layer l - 1's output with its own
   weights and cache buffers. P [L][15] holds each layer's addresses: input norm, post-attention norm, Wq, Bq, Wk,
   Bk, Wv, Bv, Wo, Bo, G, U, Dn (packed), K, V; eps [L][2] its norms' epsilons; kv_sh [L] its caches' head strides.
   The outputs alternate between A (scratch [M, hid]) and Y so that the last layer's lands in Y; with Keep
   [L - 1][M, hid] not null, every other layer's output is copied there too. */
void decoder_stack(const float *X, int64_t M, int64_t hid, int64_t L, const int64_t *P, const float *eps,
                   const int64_t *kv_sh, int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                   int64_t past, const void *mask, int mask_kind, int64_t mask_sm, float scale, int64_t inter,
                   float *work, float *A, float *Y, float *Keep, int nthreads) {
#define F_AT(i) ((const float *)(intptr_t)p[i])
    const float *in = X;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *p = P + 15 * l;
        float *out = (L - 1 - l) % 2 == 0 ? Y : A;
        decoder_layer(in, M, hid, F_AT(0), eps[2 * l], F_AT(1), eps[2 * l + 1], 0, 0.0f, 0, 0.0f, F_AT(2), F_AT(3),
                      F_AT(4), F_AT(5), F_AT(6), F_AT(7), F_AT(8), F_AT(9), 0, 0, 0.0f, H, Hkv, D, cos, sin,
                      (float *)(intptr_t)p[13], (float *)(intptr_t)p[14], kv_sh[l], past, mask, mask_kind, mask_sm,
                      scale, F_AT(10), F_AT(11), F_AT(12), inter, 0, work, out, nthreads);
        if (Keep && l < L - 1) memcpy(Keep + l * M * hid, out, sizeof(float) * M * hid);
        in = out;
    }
#undef F_AT
}

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

#ifdef __AVX512VNNI__
/* With AVX512-VNNI the estimate is exact integer arithmetic on x rounded to int16 (x = sx xq + d, |d| <= sx / 2),
   32 products a dot-product instruction instead of 16 an FMA, no int8-to-float conversion: Q packed by input pairs,
   [ceil(out / NB)][in / 2][NB][2]. acc[r * NB + j] = sum_i q[j, i] xq[r, i], exactly (in int32: |xq| is kept small
   enough that no sum overflows). */
#define SCREEN_PAIRS 1
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
#else
#define SCREEN_PAIRS 0
#endif

/* whether screen_argmax reads Q packed by input pairs (AVX512-VNNI) or as `pack` packs */
int screen_pairs(void) { return SCREEN_PAIRS; }

/* With AMX-INT8 the same integer sums come from tiles, whatever the row count at about the one-row cost: xq = 256 hi
   + lo (hi signed, lo unsigned bytes), sum_i q xq = 256 sum_i q hi + sum_i q lo, each sum exact in int32 (|hi| <=
   64, and the whole fits as above), so acc holds the VNNI path's values bit for bit. Q (address tagged 2): for each
   block of NB outputs and chunk of 64 inputs (inputs padded with zeros to in_p, a multiple of 64), two 1 KB tiles
   (outputs 0-15 and 16-31), row t holding inputs 4 t .. 4 t + 3 of each output side by side. */
#if AMX_OK && defined(__AMX_INT8__) && SCREEN_PAIRS
#define SCREEN_TILES 1
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
#else
#define SCREEN_TILES 0
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
#define QUAD_ROWS 4  /* row counts up to which quad_tile serves (and, without AMX, a tile of quad_tile rows) */
#endif
/* whether screen_argmax can read Q in the tiles' layout (address tagged 2) */
int screen_tiles(void) { return SCREEN_TILES; }
/* whether weights in int8 with a scale per output (tag 4, `i8_linear`) can be multiplied here */
int int8_products(void) { return SCREEN_PAIRS; }

/* x [in_f] rounded to int16 as the screen rounds it: xq = round(x / sx) within +-kq, sx = max |x| / kq (1 for a
   zero or non-finite row); returns sx */
static float round_row(const float *x, int64_t in_f, int64_t kq, int16_t *xq) {
    float mx = 0.0f;
    for (int64_t i = 0; i < in_f; i++) mx = fabsf(x[i]) > mx ? fabsf(x[i]) : mx;
    const float sx = mx > 0.0f && isfinite(mx) ? mx / (float)kq : 1.0f;
    for (int64_t i = 0; i < in_f; i++) xq[i] = (int16_t)fminf(fmaxf(nearbyintf(x[i] / sx), (float)-kq), (float)kq);
    return sx;
}
#if SCREEN_PAIRS
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
"""

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None
_tried = False


def library_key() -> str:
    """Names this kernel build: its source, flags and CPU (a change to any of them builds, and plans, anew)."""
    return hashlib.sha1("|".join([SOURCE, *FLAGS, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:12]


def _library_path() -> Path:
    return cache_root() / "kernels" / f"rows_linear-{library_key()}.so"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(path: Path, source: str = SOURCE) -> None:
    """Compile `source` (this module's SOURCE, or another version of it) into `path`, whole or not at all (a
    temporary directory, then a rename)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc / gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "rows_linear.c", Path(tmp) / "rows_linear.so"
        src.write_text(source)
        subprocess.run([cc, *FLAGS, str(src), "-o", str(lib), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(lib, path)


def load(path: Path) -> ctypes.CDLL:
    """A compiled kernel library with the argument types of its functions declared."""
    lib = ctypes.CDLL(str(path))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rows_linear.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int]
    lib.rows_gated.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.rms_norm.argtypes = [vp, vp, vp, i64, i64, ctypes.c_float]
    lib.rope.argtypes = [vp, vp, vp, i64, i64, i64, i64, i64]
    lib.attend.argtypes = [vp, i64, i64, i64, vp, vp, i64, i64, i64, vp, ctypes.c_int, i64, i64,
                           vp, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.attention_block.argtypes = [vp, i64, i64, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_float, i64, i64, i64,
                                    vp, vp, vp, vp, i64, i64, vp, ctypes.c_int, i64, ctypes.c_float, vp, vp,
                                    ctypes.c_int]
    lib.decoder_layer.argtypes = [vp, i64, i64, vp, ctypes.c_float, vp, ctypes.c_float, vp, ctypes.c_float, vp,
                                  ctypes.c_float, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_float,
                                  i64, i64, i64, vp, vp, vp, vp, i64, i64, vp, ctypes.c_int, i64, ctypes.c_float,
                                  vp, vp, vp, i64, ctypes.c_int, vp, vp, ctypes.c_int]
    lib.decoder_stack.argtypes = [vp, i64, i64, i64, vp, vp, vp, i64, i64, i64, vp, vp, i64, vp, ctypes.c_int, i64,
                                  ctypes.c_float, i64, vp, vp, vp, vp, ctypes.c_int]
    lib.screen_argmax.argtypes = [vp, vp, vp, ctypes.c_double, ctypes.c_double, vp, vp, i64, i64, i64, vp, vp,
                                  vp, vp, vp, vp, ctypes.c_int]
    lib.screen_argmax.restype = i64
    lib.kv_compact.argtypes = [vp, i64, i64, vp, i64]
    lib.screen_pairs.argtypes, lib.screen_pairs.restype = [], ctypes.c_int
    lib.screen_tiles.argtypes, lib.screen_tiles.restype = [], ctypes.c_int
    lib.q4_supported.argtypes, lib.q4_supported.restype = [], ctypes.c_int
    lib.vq_supported.argtypes, lib.vq_supported.restype = [], ctypes.c_int
    lib.int8_products.argtypes, lib.int8_products.restype = [], ctypes.c_int
    lib.amx_enable.argtypes, lib.amx_enable.restype = [], ctypes.c_int
    for fn in (lib.rows_linear, lib.rows_gated, lib.rms_norm, lib.rope, lib.attend, lib.attention_block,
               lib.decoder_layer, lib.decoder_stack, lib.kv_compact):
        fn.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be built here (then callers use F.linear)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("EAGLE_NO_KERNEL"):
        return None
    path = _library_path()
    try:
        if not path.exists():
            build(path)
        _lib = load(path)
    except (OSError, subprocess.SubprocessError, AttributeError):  # AttributeError: a library without a function
        return None
    return _lib


def available() -> bool:
    return library() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel handles this weight: float32, contiguous, on the CPU, in_features a multiple of 32."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] % BLOCK == 0)


PACK = 32  # outputs per packed block (NB in the C source)
# read weights dequantized from GGUF Q4_1 in that form (`packed`); EAGLE_NO_Q4=1 keeps them in float32
Q4_1 = not os.environ.get("EAGLE_NO_Q4")
# multiply those codes on AMX tiles where the CPU and the kernel have them (float32 accuracy, other bits than the
# float32 path's); EAGLE_NO_AMX=1 keeps the FMA path, which gives the float32 weights' bits
AMX = not os.environ.get("EAGLE_NO_AMX")
# multiply the weights `draft_precision` marks (an EAGLE head's, while drafting) in int8 with a scale per output where
# the CPU has AMX-INT8 or AVX512-VNNI (`pack_i8`: a quarter of float32's bytes), else on AMX tiles in bfloat16
# (EAGLE_BF16_DRAFTS=1 keeps bfloat16 there)
# without AMX tiles, multiply Q4_1, Q8_0-form and K-quant codes by byte products where the CPU has AVX512-VNNI and
# VBMI (`vq_linear`: float32 accuracy, other bits than the FMA path's, each row's bits the same at every row count
# up to 64; not the weight the greedy screen reads); EAGLE_NO_VNNI=1 keeps the FMA path
VNNI = not os.environ.get("EAGLE_NO_VNNI")
LOW_PRECISION_DRAFTS = True
INT8_DRAFTS = not os.environ.get("EAGLE_BF16_DRAFTS")
# with AMX tiles, greedy screens of fewer rows than this read a second int8 copy in the VNNI pairs layout, faster
# there than the tiles' layout (BENCHMARKS.md, thirty-fifth session); 0 keeps one copy
SCREEN_TILE_ROWS = 5


def pack(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """The product kernels' layout of a weight [out, in]: [ceil(out / PACK), in, PACK], block b holding outputs
    b * PACK .. b * PACK + PACK - 1 side by side for each input, zero rows padding the last block. With `pairs`
    (the VNNI screen's int8 weights): [ceil(out / PACK), in / 2, PACK, 2], each output's two inputs of a pair side
    by side."""
    w = weight.detach()
    out_f, in_f = w.shape
    padded = -(-out_f // PACK) * PACK
    if padded != out_f:
        w = torch.cat([w, w.new_zeros(padded - out_f, in_f)])
    if pairs:
        return w.reshape(padded // PACK, PACK, in_f // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.reshape(padded // PACK, PACK, in_f).transpose(1, 2).contiguous()  # reshape: w may be a transpose


def version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter; -1 for an inference-mode tensor, which has none (it cannot change
    outside that mode)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def kept(weight: torch.Tensor, name: str, make, *key):
    """`make(weight)`, made on first use and kept on the tensor itself under `name` until the weight changes in
    place (an optimizer step) or moves, or `key` changes."""
    full = (version(weight), weight.data_ptr(), *key)
    hit = weight.__dict__.get(name)
    if hit is None or hit[0] != full:
        hit = weight.__dict__[name] = (full, make(weight))
    return hit[1]


def q4_1_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [out, in] uint8, d, m [out, in / 32] float32) with weight[o, i] == fl(fl(d q) + m) bit for bit, d and m of
    the 32-input group of i and q in 0..15: the form of a GGUF Q4_1 tensor dequantized to float32 (as transformers
    loads one: `d * q + m` in float32, two roundings); None for any other weight. Found per group: m is its least
    value, d the float16 nearest (max - m) / 15 or one of its neighbours, q = round((w - m) / d), and every value
    is then checked bit for bit, so the codes always decode to the weight itself."""
    w = weight.detach()
    out_f, in_f = w.shape
    if in_f % 32 or w.dtype != torch.float32:
        return None
    g = w.reshape(out_f, in_f // 32, 32)
    lo = g.amin(-1, keepdim=True)
    if not torch.equal(lo.half().float(), lo):  # m is a float16 (also false for NaN)
        return None
    bits = g.view(torch.int32)
    d16 = ((g.amax(-1, keepdim=True) - lo) / 15).half()
    d_out, q_out = torch.zeros_like(lo), torch.zeros(g.shape, dtype=torch.uint8)
    done = torch.zeros_like(lo, dtype=torch.bool)
    for step in (0, -1, 1, -2, 2):
        d = (d16.view(torch.int16) + step).view(torch.float16).float() if step else d16.float()
        d = torch.where(d > 0, d, 0.0)  # a step below the float16 zero; 0 stands for groups of one value
        q = torch.where(d > 0, ((g - lo) / d).round().clamp(0, 15), 0.0)
        prod = d * q
        ok = ((prod + lo).view(torch.int32) == bits).all(-1, keepdim=True) & ~done
        d_out = torch.where(ok, d, d_out)
        q_out = torch.where(ok, q.to(torch.uint8), q_out)
        done |= ok
        if done.all():
            return q_out.reshape(out_f, in_f), d_out.squeeze(-1), lo.squeeze(-1)
    return None


def q4_1_weight(out_f: int, in_f: int, generator: torch.Generator) -> torch.Tensor:
    """A random weight in the form `q4_1_codes` finds (for tests and benchmarks): float16 d in [0, 0.02) and m in
    (-0.2, 0] per 32 inputs of an output, codes q in 0..15 with 0 and 15 in every group (ggml's quantizer gives a
    group's least value code 0 and its largest 15), then `d * q + m` in float32 as transformers computes it."""
    d = (torch.rand(out_f, in_f // 32, 1, generator=generator) * 0.02).half().float()
    m = (-torch.rand(out_f, in_f // 32, 1, generator=generator) * 0.2).half().float()
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    return (d * q.float() + m).reshape(out_f, in_f)


def q8_0_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [out, in] int8, d [out, in / 32] float32) with weight[o, i] == fl(d q) bit for bit, d a float16 value per
    group of 32 inputs: the form of a GGUF Q8_0 tensor dequantized to float32 (SmolLM2's embedding, tied to its
    lm_head), and of Q5_0 and Q4_0 ones (codes q - 16 and q - 8: Gemma-3's projections); None for any other weight.
    d is the float16 nearest max |w| / 127 (Q8_0; / 16 for Q5_0, / 8 for Q4_0, whose quantizers give the largest
    value the extreme code) or one of its neighbours, q = w / d rounded, and every value is checked; a weight whose
    first row is not in that form is turned down at once. (A Q5_0 or Q4_0 d can be negative: its -0.0 weights come
    back as 0.0, which gives every sum the same bits, the sums starting from 0.0.)"""
    w = weight.detach()
    out_f, in_f = w.shape
    if in_f % 32 or w.dtype != torch.float32 or not out_f:
        return None
    for rows in (w[:1], w):  # the first row alone first: most weights are not in this form
        g = rows.reshape(rows.shape[0], in_f // 32, 32)
        d_out, q_out = torch.zeros_like(g[..., :1]), torch.zeros(g.shape, dtype=torch.int8)
        done = torch.zeros_like(d_out, dtype=torch.bool)
        for top in (127, 16, 8):
            d16 = (g.abs().amax(-1, keepdim=True) / top).half()
            for step in (0, -1, 1, -2, 2):
                d = (d16.view(torch.int16) + step).view(torch.float16).float() if step else d16.float()
                d = torch.where(d > 0, d, 0.0)  # a step below the float16 zero; 0 stands for all-zero groups
                q = torch.where(d > 0, (g / d).round(), 0.0)
                ok = (q.abs() <= 127).all(-1, keepdim=True) & (
                    (d * q).view(torch.int32) == g.view(torch.int32)).all(-1, keepdim=True) & ~done
                d_out, q_out = torch.where(ok, d, d_out), torch.where(ok, q.to(torch.int8), q_out)
                done |= ok
            if bool(done.all()):
                break
        if not bool(done.all()):
            return None
    return q_out.reshape(out_f, in_f), d_out.squeeze(-1)


def q8_0_weight(out_f: int, in_f: int, generator: torch.Generator) -> torch.Tensor:
    """A random weight in the form `q8_0_codes` finds (for tests): float16 d in [0, 0.02) per 32 inputs of an
    output, codes in -127..127 with 127 and -127 in every group (ggml's quantizer gives a group's largest magnitude
    the code 127), then `d * q` in float32 as transformers computes it."""
    d = (torch.rand(out_f, in_f // 32, 1, generator=generator) * 0.02).half().float()
    q = torch.randint(-127, 128, (out_f, in_f // 32, 32), generator=generator)
    q[..., 0], q[..., 1] = 127, -127
    return (d * q.float()).reshape(out_f, in_f)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The FMA kernels' Q8_0 layout (see the C source) of codes q [out, in] (int8) with d [out, in / 32] (float16
    values): [ceil(out / PACK), in / 32, 1088] bytes, for each block of 32 outputs and group of 32 inputs the 32 d
    as float16, then each input's 32 codes; padding outputs decode to zero."""
    out_f, in_f = q.shape
    pad = -out_f % PACK
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    d = torch.nn.functional.pad(d.half(), (0, 0, 0, pad))
    nb, ng = q.shape[0] // PACK, in_f // 32
    codes = q.reshape(nb, PACK, ng, 32).permute(0, 2, 3, 1).reshape(nb, ng, 32 * PACK).view(torch.uint8)
    scales = d.reshape(nb, PACK, ng).permute(0, 2, 1).contiguous().view(torch.uint8)  # [nb, ng, 2 * PACK]
    return torch.cat([scales, codes], dim=-1).contiguous()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, amx: bool = False) -> torch.Tensor:
    """The product kernels' Q4_1 layout (see the C source) of codes q [out, in] with d, m [out, in / 32] (float16
    values, as in a GGUF Q4_1 tensor): [ceil(out / PACK), in / 32, 640] bytes, d and m kept as float16; padding
    outputs decode to zero. With `amx`, the code bytes are ordered for the AMX tiles (`amx_decode` in the C
    source)."""
    out_f, in_f = q.shape
    pad = -out_f % PACK
    if pad:
        q, d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, d, m))
    nb, ng = (out_f + pad) // PACK, in_f // 32
    dm = torch.stack([d, m]).reshape(2, nb, PACK, ng).permute(1, 3, 0, 2).contiguous()  # [nb, ng, 2, 32] floats
    if not torch.equal(dm.half().float(), dm):
        raise ValueError("pack_q4: d and m must hold float16 values (as a GGUF Q4_1 tensor's do)")
    if amx:  # word w of tile row t (half t // 16): output 16 (t // 16) + w // 2, input 2 (t % 16) + w % 2
        t, w = torch.arange(32).view(32, 1), torch.arange(32).view(1, 32)
        words = q.reshape(nb, PACK, ng, 32).permute(0, 2, 1, 3)[:, :, 16 * (t // 16) + w // 2, 2 * (t % 16) + w % 2]
        rows = words.reshape(nb, ng, 8, 4, 4, 8)  # [nb, ng, four rows s, row 4 s + r, j, e]: word 8 j + e
        low = torch.stack([rows[:, :, :, 0], rows[:, :, :, 1]], dim=4)  # byte 16 j + 8 h + e: row 4 s + h
        codes = low | (torch.stack([rows[:, :, :, 2], rows[:, :, :, 3]], dim=4) << 4)  # high bits: rows + 2
    else:
        q = q.reshape(nb, 2, PACK // 2, ng, 32).permute(0, 3, 4, 1, 2)  # [nb, ng, input, half, j]
        codes = q[..., 0, :] | (q[..., 1, :] << 4)  # byte j: output j's code low, output 16 + j's high
    dm = dm.half().view(torch.uint8).reshape(nb, ng, 128)
    return torch.cat([dm, codes.reshape(nb, ng, 512)], dim=-1).contiguous()


def kquant_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [out, in] int8, D, m [out, in / 16] float32) that `gguf_codes.attach` found for a weight dequantized from
    a GGUF K-quant tensor, if they still decode to it (fl(fl(D q) + m); zeros of either sign alike, which gives every
    sum the same bits), else None."""
    codes = weight.__dict__.get("_eagle_kquant")
    if codes is None or codes[0].shape != weight.shape or weight.dtype != torch.float32:
        return None
    return codes if torch.equal(gguf_codes.decode(*codes), weight.detach()) else None


def pack_kq(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The FMA kernels' K-quant layout (see the C source) of codes q [out, in] (int8) with D and m [out, in / 16]
    (float32): [ceil(out / PACK), in / 32, 1536] bytes, for each block of 32 outputs and group of 32 inputs the 32 D
    of the group's first 16 inputs, of its last 16, the same two for m, then each input's 32 codes; padding outputs
    decode to zero."""
    out_f, in_f = q.shape
    pad = -out_f % PACK
    q, d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d.float(), m.float()))
    nb, ng = q.shape[0] // PACK, in_f // 32
    codes = q.reshape(nb, PACK, ng, 32).permute(0, 2, 3, 1).reshape(nb, ng, 32 * PACK).view(torch.uint8)
    dm = torch.stack([d, m]).reshape(2, nb, PACK, ng, 2).permute(1, 3, 0, 4, 2).contiguous()  # [nb, ng, 2, 2, 32]
    return torch.cat([dm.view(torch.uint8).reshape(nb, ng, 16 * PACK), codes], dim=-1).contiguous()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """The tiles' bfloat16 layout of a weight [out, in] (`bf16_block` in the C source): [ceil(out / PACK), in / 32,
    2, 16, 16, 2] bfloat16, for each block of 32 outputs and group of 32 inputs two tiles (outputs 0-15 and 16-31),
    row t holding inputs 2 t and 2 t + 1 of each output side by side; padding outputs are zero."""
    w = weight.detach().to(torch.bfloat16)
    out_f, in_f = w.shape
    if out_f % PACK:
        w = torch.cat([w, w.new_zeros(-out_f % PACK, in_f)])
    nb, ng = w.shape[0] // PACK, in_f // 32
    return w.reshape(nb, 2, 16, ng, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def draft_precision(weights: list[torch.Tensor], on: bool = True) -> None:
    """Mark (or unmark) `weights` to be multiplied in low precision where `packed` can (`LOW_PRECISION_DRAFTS`) and
    no gradient is being recorded: an EAGLE head's while it drafts. In int8 with a scale per output where the CPU has
    AMX-INT8 or AVX512-VNNI (`INT8_DRAFTS`), else on AMX tiles in bfloat16. A draft only has to be likely, not exact
    (the target checks every token), and this reads a quarter (a half) of float32's bytes; measured, the acceptance
    stays (BENCHMARKS.md)."""
    for w in weights:
        if on:
            w.__dict__["_eagle_draft"] = True
        else:
            w.__dict__.pop("_eagle_draft", None)
        w.__dict__.pop("_eagle_address", None)  # `packed` answers again


def in_draft_precision(weight: torch.Tensor) -> bool:
    """Whether `packed` gives `weight` in low precision now (`draft_precision`)."""
    return (LOW_PRECISION_DRAFTS and "_eagle_draft" in weight.__dict__ and not torch.is_grad_enabled()
            and supports(weight) and (amx_on() or (INT8_DRAFTS and bool((_lib or library()).int8_products()))))


def _pack_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    layout = pack_bf16(weight)
    return layout, layout.data_ptr() | 3


def pack_i8(weight: torch.Tensor) -> torch.Tensor:
    """The int8 draft layout of a weight [out, in] (`i8_linear` in the C source): q = round(w / s) with s = max |w| /
    127 per output, laid out as `pack_screen_tiles` lays the screen's, each block of 32 outputs followed by its 32
    scales (float32): [ceil(out / PACK), in_p * 32 + 128] bytes."""
    w = weight.detach().float()
    s = w.abs().amax(1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    tiles = pack_screen_tiles(q)
    nb = tiles.shape[0]
    scales = torch.nn.functional.pad(s, (0, nb * PACK - s.shape[0]), value=1.0).view(nb, PACK)
    return torch.cat([tiles.view(nb, -1), scales.view(torch.int8)], dim=1).contiguous()


def _pack_i8(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    layout = pack_i8(weight)
    return layout, layout.data_ptr() | 4


def _pack_any(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the kept layout, the address the kernels take): Q4_1 codes where the weight has that form and the kernel
    decodes it (the address tagged 2 for AMX tiles, else 1), Q8_0 codes where it has that one (tagged 5: the FMA
    path, the float32 layout's bits), K-quant codes found in its GGUF file (tagged 6: the same), else `pack`'s
    float32 layout."""
    if Q4_1 and _q4_ok():
        form = q4_1_codes(weight)
        if form is not None:
            amx = amx_on()
            layout = pack_q4(*form, amx=amx)
            return layout, layout.data_ptr() | (2 if amx else 1)
        form8 = q8_0_codes(weight)
        if form8 is not None:
            layout = pack_q8(*form8)
            return layout, layout.data_ptr() | 5
        formk = kquant_codes(weight)
        if formk is not None:
            layout = pack_kq(*formk)
            return layout, layout.data_ptr() | 6
    layout = pack(weight)
    return layout, layout.data_ptr()


def _q4_ok() -> bool:
    lib = _lib or library()
    return bool(lib is not None and lib.q4_supported())


_amx: bool | None = None


def amx_on() -> bool:
    """Whether Q4_1 codes are multiplied on AMX tiles: the `AMX` switch, a kernel built with them, and the OS's
    leave to use them (asked once per process)."""
    global _amx
    if _amx is None:
        lib = _lib or library()
        _amx = bool(lib is not None and lib.amx_enable())
    return AMX and _amx


def vnni_on() -> bool:
    """Whether GGUF codes are multiplied by byte products (`vq_linear`): the `VNNI` switch, no AMX tiles in use
    (`amx_on`), a kernel built with them."""
    lib = _lib or library()
    return VNNI and not amx_on() and bool(lib is not None and lib.vq_supported())


def packed(weight: torch.Tensor) -> int:
    """Address of `weight` in the kernels' layout, made on first use and kept on the tensor itself until the weight
    changes in place (an optimizer step) or moves: Q4_1 codes for a weight dequantized from GGUF Q4_1 (0.625 bytes a
    weight; on the FMA path decoded to the same float32 values, so every product keeps its bits; on AMX tiles
    (`amx_on`) summed in another order with float32 accuracy, and so without them in byte products where `VNNI` and
    the kernel allow: the same layout, bit 3 of the address set, as for Q8_0-form codes, except for a weight the
    greedy screen reads), else `pack`'s float32 copy (twice the weight's memory). Each setting of `Q4_1` and `AMX`
    keeps its own copy, so a benchmark can switch between them. A weight `draft_precision` marked is read in int8
    (`pack_i8`, tag 4) or bfloat16 (`pack_bf16`, tag 3) instead where `in_draft_precision` says so. The answer is
    kept on the weight with every setting it depends on, so a decoding step's ~100 calls cost a dictionary lookup
    each."""
    return kept(weight, "_eagle_address", _packed_address, Q4_1, AMX, VNNI, LOW_PRECISION_DRAFTS, INT8_DRAFTS,
                 torch.is_grad_enabled())


def _packed_address(weight: torch.Tensor) -> int:
    if in_draft_precision(weight):
        if INT8_DRAFTS and (_lib or library()).int8_products():
            return kept(weight, "_eagle_packed_i8", _pack_i8)[1]
        return kept(weight, "_eagle_packed_bf16", _pack_bf16)[1]
    amx = amx_on()
    name = ("_eagle_packed_amx" if amx else "_eagle_packed_q4") if Q4_1 else "_eagle_packed"
    address = kept(weight, name, _pack_any, Q4_1, amx)[1]
    # bit 3: byte products; not for a weight the greedy screen reads, whose argmax is the float32 products' bit for
    # bit (the lm_head: its logits and greedy tokens agree)
    if address & 7 in (1, 5, 6) and "_eagle_screened" not in weight.__dict__ and vnni_on():
        assert address & 8 == 0, "a layout's address not 16-byte aligned"
        return address | 8
    return address


def unpack(weight: torch.Tensor) -> None:
    """Drop the copies the kernels keep on `weight` (`packed`, `screen_tables`, a norm's 1 + weight), and their
    memory."""
    weight.__dict__.pop("_eagle_packed", None)
    weight.__dict__.pop("_eagle_packed_q4", None)
    weight.__dict__.pop("_eagle_packed_amx", None)
    weight.__dict__.pop("_eagle_packed_bf16", None)
    weight.__dict__.pop("_eagle_packed_i8", None)
    weight.__dict__.pop("_eagle_screen", None)
    weight.__dict__.pop("_eagle_screen_few", None)
    weight.__dict__.pop("_eagle_screened", None)
    weight.__dict__.pop("_eagle_address", None)
    weight.__dict__.pop("_eagle_plus_offset", None)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a few rows x [..., in] through the kernel (the caller checked
    `supports(weight)` and that x is float32). Lean on purpose: a decoding step makes ~150 of these calls, and on
    this machine each torch or Python operation around the C call costs about as much as a small product."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = weight.shape
    y = x.new_empty(*x.shape[:-1], out_f)
    b = None if bias is None else bias.contiguous().data_ptr()
    (_lib or library()).rows_linear(packed(weight), x.data_ptr(), b, y.data_ptr(), out_f, in_f, x.numel() // in_f,
                                    torch.get_num_threads())
    return y


class _Linear(torch.autograd.Function):
    """`F.linear` with its gradients, every product through `rows_linear`: y = x W^T, and in the backward pass
    dx = dy W (W^T packed) and dW = dy^T x (x^T packed as the "weight"): the three products of a training step."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return rows_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = rows_linear(gy2, weight.t(), None).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = rows_linear(gy2.t(), x.reshape(-1, x.shape[-1]).t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy2.sum(0)
        return gx, gw, gb


def linear_with_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for training: forward and backward products through the packed kernel (float32
    on the CPU; the caller checked). About twice MKL's speed at a training batch's thousands of rows here."""
    if x.is_inference():  # features computed under inference_mode (online training): autograd may not keep those
        x = x.clone()
    return _Linear.apply(x, weight, bias)


GELU_TANH = 1  # `rows_gated`'s act for GELU's tanh form (Gemma's gelu_pytorch_tanh); 0: SiLU


def rows_gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int = 0) -> torch.Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` for a few rows x [..., in], the first half of a gated MLP, in one pass over
    both weights (the caller checked `supports` for both and that x is float32); `act` GELU_TANH for GELU's tanh
    form instead of SiLU (as g sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)), within a few float32 ulps of torch's)."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = gate.shape
    y = x.new_empty(*x.shape[:-1], out_f)
    (_lib or library()).rows_gated(packed(gate), packed(up), x.data_ptr(), y.data_ptr(), out_f, in_f,
                                   x.numel() // in_f, torch.get_num_threads(), act)
    return y


def screen_tables(weight: torch.Tensor, rows: int = 16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
    """`screen_argmax`'s tables for weight [out, in] (float32, `supports`): the int8 weights q = round(w / s),
    packed as `pack` packs or, where the kernel multiplies input pairs (AVX512-VNNI), as [ceil(out / 32)][in / 2]
    [32][2]; the scales s [out] (float32); the bounds C [out]: |L - A| <= |x| C for any x, L the kernel's float32
    logit w . x and A = s (q . x) in float32; and the largest |s q| and |w| of a row. By Cauchy-Schwarz
    |w . x - s q . x| <= |x| |w - s q|, and a float32 sum of n products lies within gamma_n = n u / (1 - n u)
    (u = 2^-24) of the exact one, relative to sum |w_i x_i| <= |w| |x| (Higham, Accuracy and Stability of
    Numerical Algorithms, 3.1; underflow is the C code's absolute term). C is that sum, from float64, times 1.001
    for the float32 arithmetic of the test itself, rounded up to float32. None for a weight with a NaN or an
    infinity. Made on first use and kept on the weight like `packed`'s copy (a quarter of its memory more). With
    AMX tiles (`amx_on` and a kernel with AMX-INT8) q is laid out for them instead (`pack_screen_tiles`): the same
    integer sums, at about one row's cost for up to 16 rows; for fewer than `SCREEN_TILE_ROWS` `rows` a second copy
    in the pairs layout, kept beside it."""
    lib = _lib or library()
    tiles = bool(lib.screen_tiles()) and amx_on()
    form = "tiles" if tiles and rows >= SCREEN_TILE_ROWS else "pairs" if lib.screen_pairs() else "rows"
    return kept(weight, "_eagle_screen_few" if tiles and form != "tiles" else "_eagle_screen",
                 lambda w: _screened(w, form), form)


def _screened(weight: torch.Tensor, form: str) -> tuple | None:
    """`screen_tables`' tables, made once; the weight marked so that its products keep the float32 path's bits
    (`_packed_address`: the screen's argmax is theirs)."""
    if "_eagle_screened" not in weight.__dict__:
        weight.__dict__["_eagle_screened"] = True
        weight.__dict__.pop("_eagle_address", None)
    return _screen_tables(weight.detach(), form) if bool(torch.isfinite(weight).all()) else None


def pack_screen_tiles(q8: torch.Tensor) -> torch.Tensor:
    """The AMX screen's layout of int8 weights [out, in] (C `screen_tile`): [ceil(out / PACK), in_p / 64, 2, 16, 16, 4]
    with in_p = in rounded up to 64: for each block of 32 outputs and 64 inputs two tiles (outputs 0-15 and 16-31),
    row t holding inputs 4 t .. 4 t + 3 of each output side by side; zeros pad outputs and inputs."""
    out_f, in_f = q8.shape
    q8 = torch.nn.functional.pad(q8, (0, -in_f % 64, 0, -out_f % PACK))
    nb, nc = q8.shape[0] // PACK, q8.shape[1] // 64
    return q8.reshape(nb, 2, 16, nc, 16, 4).permute(0, 3, 1, 4, 2, 5).contiguous()


def _screen_tables(weight: torch.Tensor, form: str) -> tuple:
    out_f, in_f = weight.shape
    n = in_f + 2
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    q8 = torch.empty(out_f, in_f, dtype=torch.int8)
    s, c = torch.empty(out_f), torch.empty(out_f)
    n_max = w_max = 0.0
    for lo in range(0, out_f, 4096):  # float64 in slices: the whole of a large lm_head would take GBs
        w = weight[lo:lo + 4096].double()
        sl = (w.abs().amax(1) / 127).float()
        sl = torch.where(sl > 0, sl, torch.ones_like(sl))  # a zero row: q = 0, A = 0 = L exactly
        q = torch.round(w / sl.double()[:, None]).clamp(-127, 127)
        sq = sl.double()[:, None] * q
        cl = ((w - sq).norm(dim=1) + gamma * (sq.norm(dim=1) + w.norm(dim=1))) * 1.001
        c32 = cl.float()
        c[lo:lo + 4096] = torch.where(c32.double() < cl, torch.nextafter(c32, torch.tensor(float("inf"))), c32)
        s[lo:lo + 4096], q8[lo:lo + 4096] = sl, q.to(torch.int8)
        n_max, w_max = max(n_max, float(sq.norm(dim=1).max())), max(w_max, float(w.norm(dim=1).max()))
    return pack_screen_tiles(q8) if form == "tiles" else pack(q8, form == "pairs"), s, c, n_max, w_max


def screen_weight_args(tables: tuple) -> tuple:
    """C `screen_argmax`'s first five arguments for `screen_tables`' answer: the int8 weights' address (tagged 2 for
    `pack_screen_tiles`'s layout), the scales', the bounds', the largest |s q| and |w|."""
    q, s, c, n_max, w_max = tables
    return q.data_ptr() | (2 if q.dim() == 6 else 0), s.data_ptr(), c.data_ptr(), n_max, w_max


def screen_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows_linear(x, weight, None).argmax(-1)` for rows x [..., in] (float32), bit for bit, reading the weight
    as int8 and only the few rows whose logit may be the largest in float32 (C `screen_argmax`): a quarter of the
    bytes for a greedy token. Rows the screen cannot settle (non-finite values) take the whole product. The caller
    checked `supports(weight)`."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = weight.shape
    m = x.numel() // in_f
    tables = screen_tables(weight, m)
    if tables is None:
        return rows_linear(x, weight, None).argmax(-1)
    threads = torch.get_num_threads()
    a = _scratch(m * out_f + 2 * threads * m + 3 * m)
    at = torch.empty(threads * m, dtype=torch.int64)
    xq = torch.empty(m * in_f, dtype=torch.int16)
    y = torch.empty(m, dtype=torch.int64)
    lo = a[m * out_f:]
    left = (_lib or library()).screen_argmax(*screen_weight_args(tables),
                                             weight.data_ptr(), x.data_ptr(), out_f, in_f, m, a.data_ptr(),
                                             lo.data_ptr(), lo[threads * m:].data_ptr(), at.data_ptr(),
                                             xq.data_ptr(), y.data_ptr(), threads)
    if left:  # rows the screen left: their whole product, argmax as torch orders NaNs
        bad = (y < 0).nonzero().view(-1)
        y[bad] = rows_linear(x.reshape(m, in_f)[bad], weight, None).argmax(-1)
    return y.view(x.shape[:-1])


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """transformers' rotary embedding `x * cos + rotate_half(x) * sin`, bit for bit, in place on x [B, M, H *
    head_dim] (contiguous float32, head_dim even and at most 1024) with cos / sin [B or 1, M, head_dim]; returns x."""
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    (_lib or library()).rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1],
                             x.shape[-1] // head_dim, head_dim, cos.stride(0) if cos.shape[0] > 1 else 0)
    return x


def kv_compact(table: torch.Tensor, start: int, keep: torch.Tensor) -> None:
    """In each buffer of `table` ([n, 5] int64: a float32 buffer [heads, capacity, D] of one sequence, as its address,
    heads, head stride, row stride and D, in floats), row start + keep[i] of every head moved to row start + i, in
    place; keep: ascending int64 offsets with keep[i] >= i (contiguous, on the CPU)."""
    (_lib or library()).kv_compact(table.data_ptr(), table.shape[0], start, keep.data_ptr(), keep.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x^2, -1) + eps))` over the last axis, whose size is a multiple of 32."""
    lib = library()
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                 eps)
    return y


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Scaled dot-product attention for a few query rows, grouped-query heads read in place.

    query [B, H, M, D], key / value [B, H_kv, L, D] (any strides with D contiguous, key and value alike, D a multiple
    of 8), mask None or [B or 1, 1, M, L], bool (True = attend) or additive float. Returns [B, M, H, D]
    (transformers' attention functions' layout). A query row's result does not depend on the other rows."""
    lib = library()
    B, H, M, D = query.shape
    L = key.shape[2]
    kind, mask_sb, mask_sm, mptr = 0, 0, 0, None
    if mask is not None:
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
        kind = 1 if mask.dtype == torch.bool else 2
        mask_sb = mask.stride(0) if mask.shape[0] > 1 else 0
        mask_sm, mptr = mask.stride(2), mask.data_ptr()
    out = query.new_empty(B, M, H, D)
    lib.attend(query.data_ptr(), query.stride(0), query.stride(1), query.stride(2),
               key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
               mptr, kind, mask_sb, mask_sm, out.data_ptr(), B, H, H // key.shape[1], M, L, D, scale,
               torch.get_num_threads())
    return out



def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _projection_ptrs(projs: tuple) -> list:
    """(packed q weight, q bias, packed k weight, ...) addresses of an attention module's products."""
    return [packed(t) if i % 2 == 0 else _ptr(t) for i, t in enumerate(projs)]


def _mask_rows(mask: torch.Tensor | None) -> tuple[int, int]:
    """(mask kind, row stride) of a [1, 1, M, L] attention mask for the C calls: 0 none, 1 bool, 2 additive."""
    return (0, 0) if mask is None else (1 if mask.dtype == torch.bool else 2, mask.stride(2))


_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """A float32 buffer of at least n floats for the C calls' intermediate rows, kept per thread and reused."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.shape[0] < n:
        buf = _local.buf = torch.empty(max(n, 1 << 16))
    return buf


def attention_block(x: torch.Tensor, projs: tuple, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                    sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, past: int,
                    mask: torch.Tensor | None, scale: float, qk_norms: tuple | None = None) -> torch.Tensor:
    """A Llama-style attention module's forward for x [1, M, hidden] in one C call, with the results of
    `rows_linear`, `rms_norm`, `rope_` and `attend` bit for bit. projs = (q weight, q bias, k weight, k bias, v weight,
    v bias, o weight, o bias), biases None or contiguous; qk_norms None or (q norm weight, k norm weight, eps): each
    head's query and key normed before the rotation (Qwen3, Gemma-3). The new keys and values are written into the
    cache buffers k_buf / v_buf [1, kv_heads, capacity >= past + M, head_dim] (contiguous) at positions
    past .. past + M - 1;
    mask is None (M = 1) or [1, 1, M, >= past + M] with its last axis contiguous, bool or additive float32;
    cos / sin [1, M, head_dim] contiguous. The caller checked all of it. Returns [1, M, hidden]."""
    m, hid = x.shape[1], x.shape[2]
    y = x.new_empty(1, m, projs[6].shape[0])
    work = _scratch(m * (2 * heads + 2 * kv_heads) * head_dim)
    kind, mask_sm = _mask_rows(mask)
    (_lib or library()).attention_block(
        x.data_ptr(), m, hid, *_projection_ptrs(projs), *_qk_args(qk_norms), heads, kv_heads, head_dim,
        cos.data_ptr(), sin.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(1), past, _ptr(mask), kind,
        mask_sm, scale, work.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def decoder_layer(x: torch.Tensor, norms: tuple, projs: tuple, mlp: tuple, heads: int, kv_heads: int,
                  head_dim: int, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  past: int, mask: torch.Tensor | None, scale: float, qk_norms: tuple | None = None,
                  out_norms: tuple | None = None, act: int = 0) -> torch.Tensor:
    """A Llama-style decoder layer's forward for x [1, M, hidden] in one C call: `rms_norm`, `attention_block`,
    the residual sum, `rms_norm`, `rows_gated`, `rows_linear`, the residual sum, bit for bit. norms = (input norm
    weight or None for no input norm, eps, the MLP's input norm weight, eps); mlp = (gate, up, down weights); the
    rest as `attention_block`. Gemma-3's layers: out_norms = (attention output norm weight, eps, MLP output norm
    weight, eps), each applied before its residual sum; act = GELU_TANH; qk_norms as `attention_block`'s."""
    m, hid = x.shape[1], x.shape[2]
    inter = mlp[0].shape[0]
    y = x.new_empty(1, m, hid)
    work = _scratch(m * (3 * hid + inter + (2 * heads + 2 * kv_heads) * head_dim))
    kind, mask_sm = _mask_rows(mask)
    (_lib or library()).decoder_layer(
        x.data_ptr(), m, hid, _ptr(norms[0]), norms[1], norms[2].data_ptr(), norms[3],
        *((out_norms[0].data_ptr(), out_norms[1], out_norms[2].data_ptr(), out_norms[3]) if out_norms
          else (None, 0.0, None, 0.0)),
        *_projection_ptrs(projs), *_qk_args(qk_norms), heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(1), past, _ptr(mask), kind, mask_sm, scale,
        packed(mlp[0]), packed(mlp[1]), packed(mlp[2]), inter, act, work.data_ptr(), y.data_ptr(),
        torch.get_num_threads())
    return y


def _qk_args(qk_norms: tuple | None) -> tuple:
    """The C calls' (q norm address, k norm address, eps) for `qk_norms` (None: no q / k norms)."""
    return (qk_norms[0].data_ptr(), qk_norms[1].data_ptr(), qk_norms[2]) if qk_norms else (None, None, 0.0)


STACK_SLOTS = 15  # addresses per layer in a `decoder_stack` table


def stack_weights(norm1: torch.Tensor, norm2: torch.Tensor, projs: tuple, mlp: tuple) -> list:
    """One layer's weight addresses for a `decoder_stack` table (its first 13 slots): input norm, post-attention
    norm, the attention's (packed weight, bias or 0) pairs, the packed gate, up and down weights."""
    return [norm1.data_ptr(), norm2.data_ptr(), *(a or 0 for a in _projection_ptrs(projs)), *(packed(w) for w in mlp)]


def decoder_stack(x: torch.Tensor, table: torch.Tensor, eps: torch.Tensor, kv_strides: torch.Tensor, heads: int,
                  kv_heads: int, head_dim: int, inter: int, cos: torch.Tensor, sin: torch.Tensor, past: int,
                  mask: torch.Tensor | None, scale: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Every layer of a Llama-style decoder in one C call: `decoder_layer` on each in turn, bit for bit.
    table [L, STACK_SLOTS] int64 addresses (`stack_weights` + the layer's key and value buffers), eps [L, 2] float32,
    kv_strides [L] int64 (each key buffer's stride(1)); keep: None or [L - 1, M, hidden], which receives every
    layer's output but the last; the rest as `decoder_layer`. Returns the last layer's output [1, M, hidden]."""
    m, hid = x.shape[1], x.shape[2]
    y, spare = x.new_empty(1, m, hid), x.new_empty(1, m, hid)
    work = _scratch(m * (3 * hid + inter + (2 * heads + 2 * kv_heads) * head_dim))
    kind, mask_sm = _mask_rows(mask)
    (_lib or library()).decoder_stack(
        x.data_ptr(), m, hid, table.shape[0], table.data_ptr(), eps.data_ptr(), kv_strides.data_ptr(), heads,
        kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(), past, _ptr(mask), kind, mask_sm, scale, inter,
        work.data_ptr(), spare.data_ptr(), y.data_ptr(), _ptr(keep), torch.get_num_threads())
    return y
