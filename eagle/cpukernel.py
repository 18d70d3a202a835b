"""Small C kernels for decoding on CPU, where a step is a few rows through every weight of the model.

- `rows_linear`: `x @ W.T` for a few rows, reading each weight row once. At batch 1 a decoder step multiplies every
  weight by 1-16 rows, so it is bound by reading the weights; the BLAS paths behind `F.linear` read them at a
  fraction of this machine's bandwidth for one row (BENCHMARKS.md). This kernel streams each weight row once and
  multiplies it with every input row while it sits in L1, splitting the output rows over the threads
  `torch.get_num_threads()` names.
- `rows_gated`: a gated MLP's `silu(x @ G.T) * (x @ U.T)` in one pass over both weights.
- `rms_norm`: an RMS norm of each row in one call (the stock module is eight small torch ops).
- `attend`: attention of a few query rows over the KV cache, grouped-query heads read in place.
- `rope_`: the rotary embedding in place.
- `attention_block` and `decoder_layer`: a whole Llama-style attention module (products, rotary embedding, cache
  write, attention) or decoder layer (norms, attention, gated MLP, residual sums) in one call, made of the
  functions above: on this CPU each Python-level step around a C call costs microseconds, and these calls took
  about a quarter off a one-token pass (BENCHMARKS.md).

Every output row is computed alone, in the same order whatever the number of rows (fixed accumulators, a fixed
reduction, masked keys adding exact zeros), so a verification pass over M tokens gives each token exactly the bits
a single-token step gives it (tests/test_attention.py checks a whole model).

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

from eagle.target import cache_root

BLOCK = 32  # input features consumed per inner iteration: in_features must be a multiple

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* keeps a loaded vector in a register: without it the compiler folds the load into every FMA that uses it, and a
   weight vector used for two rows is loaded twice */
#ifdef __AVX__
#define IN_REG(v) __asm__("" : "+x"(v))
#else
#define IN_REG(v) ((void)0)
#endif

/* three input rows against one weight row, twelve accumulators: each weight vector is loaded once for three FMAs
   (16 loads per 12 FMAs, against 12 per 8 in the two-row loop below). The sums are the two-row loop's, bit for
   bit. Measured (benchmarks/kernel.py): 10-15 % off 16-row products, ~3 % off 8-row ones, a loss below that. */
static __attribute__((noinline)) void three_rows(const float *w, const float *X, int64_t in_f, float *acc) {
    const float *x0 = X, *x1 = X + in_f, *x2 = x1 + in_f;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
    for (int64_t i = 0; i < in_f; i += 32) {
        __builtin_prefetch(w + i + 512, 0, 3); __builtin_prefetch(w + i + 528, 0, 3);
        /* accumulator j of each row takes the products i + 8 j .. i + 8 j + 7 */
#define THREE(j, a, b, c) { v8 u = load8(w + i + 8 * j); IN_REG(u); a = madd(a, u, load8(x0 + i + 8 * j)); \
                            b = madd(b, u, load8(x1 + i + 8 * j)); c = madd(c, u, load8(x2 + i + 8 * j)); }
        THREE(0, a0, b0, c0) THREE(1, a1, b1, c1) THREE(2, a2, b2, c2) THREE(3, a3, b3, c3)
#undef THREE
    }
    acc[0] = reduce(a0, a1, a2, a3); acc[1] = reduce(b0, b1, b2, b3); acc[2] = reduce(c0, c1, c2, c3);
}

/* acc[m] = sum_i w[i] X[m, i] for m < M (at most CHUNK), each summed in the same order whatever M; the weight
   row w is read from memory once and reused from L1 for every pair (from 8 rows on, every triple) of input rows.
   in_f % 32 == 0. */
#define CHUNK 64
#define THREE_FROM 8
static inline void dot_rows(const float *w, const float *X, int64_t in_f, int64_t M, float *acc) {
    int64_t m = 0;
    for (; M >= THREE_FROM && m + 2 < M; m += 3) three_rows(w, X + m * in_f, in_f, acc + m);
    for (; m + 1 < M; m += 2) {
        const float *x0 = X + m * in_f, *x1 = x0 + in_f;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t i = 0; i < in_f; i += 32) {
            /* 2 KB ahead: with two or more rows the loop is slow enough for the hardware prefetcher to fall
               behind (measured: 7-8 % off a 4- or 8-token pass; no gain for one row, so none there) */
            __builtin_prefetch(w + i + 512, 0, 3); __builtin_prefetch(w + i + 528, 0, 3);
            v8 w0 = load8(w + i), w1 = load8(w + i + 8), w2 = load8(w + i + 16), w3 = load8(w + i + 24);
            IN_REG(w0); IN_REG(w1); IN_REG(w2); IN_REG(w3);
            a0 = madd(a0, w0, load8(x0 + i)); a1 = madd(a1, w1, load8(x0 + i + 8));
            a2 = madd(a2, w2, load8(x0 + i + 16)); a3 = madd(a3, w3, load8(x0 + i + 24));
            b0 = madd(b0, w0, load8(x1 + i)); b1 = madd(b1, w1, load8(x1 + i + 8));
            b2 = madd(b2, w2, load8(x1 + i + 16)); b3 = madd(b3, w3, load8(x1 + i + 24));
        }
        acc[m] = reduce(a0, a1, a2, a3);
        acc[m + 1] = reduce(b0, b1, b2, b3);
    }
    if (m < M) {
        const float *x0 = X + m * in_f;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < in_f; i += 32) {
            a0 = madd(a0, load8(w + i), load8(x0 + i)); a1 = madd(a1, load8(w + i + 8), load8(x0 + i + 8));
            a2 = madd(a2, load8(w + i + 16), load8(x0 + i + 16)); a3 = madd(a3, load8(w + i + 24), load8(x0 + i + 24));
        }
        acc[m] = reduce(a0, a1, a2, a3);
    }
}

/* Y[m, o] = sum_i W[o, i] X[m, i] (+ B[o]) for m < M and one output o. */
static inline void linear_out(const float *W, const float *X, const float *B, float *Y,
                              int64_t o, int64_t out_f, int64_t in_f, int64_t M) {
    float acc[CHUNK];
    const float bias = B ? B[o] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
        int64_t n = M - m0 < CHUNK ? M - m0 : CHUNK;
        dot_rows(W + o * in_f, X + m0 * in_f, in_f, n, acc);
        for (int64_t m = 0; m < n; m++) Y[(m0 + m) * out_f + o] = acc[m] + bias;
    }
}

/* Y[m, o] = sum_i W[o, i] X[m, i] (+ B[o]) for m < M. Output rows are split over the threads. */
void rows_linear(const float *W, const float *X, const float *B, float *Y,
                 int64_t out_f, int64_t in_f, int64_t M, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < out_f; o++) linear_out(W, X, B, Y, o, out_f, in_f, M);
}

/* A gated MLP's first half: Y[m, o] = silu(G[o] . X[m]) * (U[o] . X[m]), reading rows o of G and U together. */
void rows_gated(const float *G, const float *U, const float *X, float *Y,
                int64_t out_f, int64_t in_f, int64_t M, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < out_f; o++) {
        float g[CHUNK], u[CHUNK];
        for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
            int64_t n = M - m0 < CHUNK ? M - m0 : CHUNK;
            dot_rows(G + o * in_f, X + m0 * in_f, in_f, n, g);
            dot_rows(U + o * in_f, X + m0 * in_f, in_f, n, u);
            for (int64_t m = 0; m < n; m++) Y[(m0 + m) * out_f + o] = g[m] / (1.0f + expf(-g[m])) * u[m];
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

/* Attention of M query rows over L keys, one task per (batch b, query head h, row m), head h reading key/value
   head h / rep: O[b, m, h] = sum_j softmax_j(scale Q[b, h, m] . K[b, h / rep, j] + mask[b, m, j]) V[b, h / rep, j].
   Strides are in floats; the last axis (D, a multiple of 8) is contiguous. mask_kind 0: none, 1: bool (keep where
   nonzero), 2: additive float. Masked keys are skipped, and every row is computed alone in the same order, so a
   query row gets the same bits whatever the other rows of its pass. */
void attend(const float *Q, int64_t q_sb, int64_t q_sh, int64_t q_sm,
            const float *K, const float *V, int64_t kv_sb, int64_t kv_sh, int64_t kv_sj,
            const void *mask, int mask_kind, int64_t mask_sb, int64_t mask_sm,
            float *O, int64_t B, int64_t H, int64_t rep, int64_t M, int64_t L, int64_t D, float scale, int nthreads) {
    const int64_t L8 = (L + 7) / 8 * 8;
    #pragma omp parallel num_threads(nthreads)
    {
        float *s = (float *)malloc((size_t)L8 * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < B * H * M; t++) {
            const int64_t b = t / (H * M), h = (t / M) % H, m = t % M;
            const float *q = Q + b * q_sb + h * q_sh + m * q_sm;
            const float *k = K + b * kv_sb + (h / rep) * kv_sh, *v = V + b * kv_sb + (h / rep) * kv_sh;
            const unsigned char *bm = mask_kind == 1 ? (const unsigned char *)mask + b * mask_sb + m * mask_sm : 0;
            const float *fm = mask_kind == 2 ? (const float *)mask + b * mask_sb + m * mask_sm : 0;
            /* scores, four keys in flight; each key's sum runs over d in the same order */
            int64_t j = 0;
            for (; j + 3 < L; j += 4) {
                const float *k0 = k + j * kv_sj, *k1 = k0 + kv_sj, *k2 = k1 + kv_sj, *k3 = k2 + kv_sj;
                v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t d = 0; d < D; d += 8) {
                    v8 qd = load8(q + d);
                    a0 = madd(a0, qd, load8(k0 + d)); a1 = madd(a1, qd, load8(k1 + d));
                    a2 = madd(a2, qd, load8(k2 + d)); a3 = madd(a3, qd, load8(k3 + d));
                }
                s[j] = hsum(a0) * scale; s[j + 1] = hsum(a1) * scale;
                s[j + 2] = hsum(a2) * scale; s[j + 3] = hsum(a3) * scale;
            }
            for (; j < L; j++) {
                v8 a0 = {0};
                for (int64_t d = 0; d < D; d += 8) a0 = madd(a0, load8(q + d), load8(k + j * kv_sj + d));
                s[j] = hsum(a0) * scale;
            }
            float mx = -INFINITY;
            for (j = 0; j < L; j++) {
                if (fm) s[j] += fm[j];
                if (bm && !bm[j]) s[j] = -INFINITY;
                if (s[j] > mx) mx = s[j];
            }
            for (j = L; j < L8; j++) s[j] = -INFINITY;
            float *o = O + ((b * M + m) * H + h) * D;
            if (mx == -INFINITY) {  /* a row that sees nothing (padding): zeros */
                memset(o, 0, (size_t)D * sizeof(float));
                continue;
            }
            const v8 mxv = {mx, mx, mx, mx, mx, mx, mx, mx};
            for (j = 0; j < L8; j += 8) {  /* exp of every key alike */
                v8 e = vexp(load8(s + j) - mxv);
                memcpy(s + j, &e, sizeof e);
            }
            /* masked keys have weight exp(-inf) = 0 here, so adding them changes no sum: no branches below */
            float sum = 0.0f;
            for (j = 0; j < L; j++) sum += s[j];
            const float inv = 1.0f / sum;
            const v8 iv = {inv, inv, inv, inv, inv, inv, inv, inv};
            int64_t d0 = 0;
            for (; d0 + 64 <= D; d0 += 64) {  /* 64 output values at a time in registers */
                v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, c4 = {0}, c5 = {0}, c6 = {0}, c7 = {0};
                for (j = 0; j < L; j++) {
                    const v8 pv = {s[j], s[j], s[j], s[j], s[j], s[j], s[j], s[j]};
                    const float *vj = v + j * kv_sj + d0;
                    c0 = madd(c0, pv, load8(vj)); c1 = madd(c1, pv, load8(vj + 8));
                    c2 = madd(c2, pv, load8(vj + 16)); c3 = madd(c3, pv, load8(vj + 24));
                    c4 = madd(c4, pv, load8(vj + 32)); c5 = madd(c5, pv, load8(vj + 40));
                    c6 = madd(c6, pv, load8(vj + 48)); c7 = madd(c7, pv, load8(vj + 56));
                }
                v8 r[8] = {c0 * iv, c1 * iv, c2 * iv, c3 * iv, c4 * iv, c5 * iv, c6 * iv, c7 * iv};
                memcpy(o + d0, r, sizeof r);
            }
            for (; d0 < D; d0 += 8) {
                v8 c0 = {0};
                for (j = 0; j < L; j++) {
                    const v8 pv = {s[j], s[j], s[j], s[j], s[j], s[j], s[j], s[j]};
                    c0 = madd(c0, pv, load8(v + j * kv_sj + d0));
                }
                c0 = c0 * iv;
                memcpy(o + d0, &c0, sizeof c0);
            }
        }
        free(s);
    }
}

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
   order, as the separate calls above (rows_linear, rope, attend), so the results are theirs bit for bit. work holds
   M (2 H + 2 H_kv) D floats. */
void attention_block(const float *X, int64_t M, int64_t hid,
                     const float *Wq, const float *Bq, const float *Wk, const float *Bk,
                     const float *Wv, const float *Bv, const float *Wo, const float *Bo,
                     int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                     float *K, float *V, int64_t kv_sh, int64_t past,
                     const void *mask, int mask_kind, int64_t mask_sm, float scale,
                     float *work, float *Y, int nthreads) {
    const int64_t nq = H * D, nk = Hkv * D;
    float *Q = work, *Kn = Q + M * nq, *Vn = Kn + M * nk, *A = Vn + M * nk;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < nq + 2 * nk; o++) {
        if (o < nq) linear_out(Wq, X, Bq, Q, o, nq, hid, M);
        else if (o < nq + nk) linear_out(Wk, X, Bk, Kn, o - nq, nk, hid, M);
        else linear_out(Wv, X, Bv, Vn, o - nq - nk, nk, hid, M);
    }
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
   are those of the separate calls bit for bit. work holds M (3 hid + inter + (2 H + 2 H_kv) D) floats. */
void decoder_layer(const float *X, int64_t M, int64_t hid, const float *Wn1, float eps1, const float *Wn2, float eps2,
                   const float *Wq, const float *Bq, const float *Wk, const float *Bk,
                   const float *Wv, const float *Bv, const float *Wo, const float *Bo,
                   int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                   float *K, float *V, int64_t kv_sh, int64_t past,
                   const void *mask, int mask_kind, int64_t mask_sm, float scale,
                   const float *G, const float *U, const float *Dn, int64_t inter,
                   float *work, float *Y, int nthreads) {
    float *N = work, *Hs = N + M * hid, *T = Hs + M * hid, *Mid = T + M * hid, *aw = Mid + M * inter;
    rms_norm(X, Wn1, N, M, hid, eps1);
    attention_block(N, M, hid, Wq, Bq, Wk, Bk, Wv, Bv, Wo, Bo, H, Hkv, D, cos, sin, K, V, kv_sh, past,
                    mask, mask_kind, mask_sm, scale, aw, T, nthreads);
    for (int64_t i = 0; i < M * hid; i++) Hs[i] = X[i] + T[i];
    rms_norm(Hs, Wn2, N, M, hid, eps2);
    rows_gated(G, U, N, Mid, inter, hid, M, nthreads);
    rows_linear(Dn, Mid, 0, T, hid, inter, M, nthreads);
    for (int64_t i = 0; i < M * hid; i++) Y[i] = Hs[i] + T[i];
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
    lib.rows_gated.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int]
    lib.rms_norm.argtypes = [vp, vp, vp, i64, i64, ctypes.c_float]
    lib.rope.argtypes = [vp, vp, vp, i64, i64, i64, i64, i64]
    lib.attend.argtypes = [vp, i64, i64, i64, vp, vp, i64, i64, i64, vp, ctypes.c_int, i64, i64,
                           vp, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.attention_block.argtypes = [vp, i64, i64, vp, vp, vp, vp, vp, vp, vp, vp, i64, i64, i64, vp, vp, vp, vp, i64,
                                    i64, vp, ctypes.c_int, i64, ctypes.c_float, vp, vp, ctypes.c_int]
    lib.decoder_layer.argtypes = [vp, i64, i64, vp, ctypes.c_float, vp, ctypes.c_float, vp, vp, vp, vp, vp, vp, vp, vp,
                                  i64, i64, i64, vp, vp, vp, vp, i64, i64, vp, ctypes.c_int, i64, ctypes.c_float,
                                  vp, vp, vp, i64, vp, vp, ctypes.c_int]
    for fn in (lib.rows_linear, lib.rows_gated, lib.rms_norm, lib.rope, lib.attend, lib.attention_block,
               lib.decoder_layer):
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


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a few rows x [..., in] through the kernel (the caller checked
    `supports(weight)` and that x is float32). Lean on purpose: a decoding step makes ~150 of these calls, and on
    this machine each torch or Python operation around the C call costs about as much as a small product."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = weight.shape
    y = x.new_empty(*x.shape[:-1], out_f)
    b = None if bias is None else bias.contiguous().data_ptr()
    (_lib or library()).rows_linear(weight.data_ptr(), x.data_ptr(), b, y.data_ptr(), out_f, in_f, x.numel() // in_f,
                                    torch.get_num_threads())
    return y


def rows_gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` for a few rows x [..., in], the first half of a gated MLP, in one pass over
    both weights (the caller checked `supports` for both and that x is float32)."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = gate.shape
    y = x.new_empty(*x.shape[:-1], out_f)
    (_lib or library()).rows_gated(gate.data_ptr(), up.data_ptr(), x.data_ptr(), y.data_ptr(), out_f, in_f,
                                   x.numel() // in_f, torch.get_num_threads())
    return y


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """transformers' rotary embedding `x * cos + rotate_half(x) * sin`, bit for bit, in place on x [B, M, H *
    head_dim] (contiguous float32, head_dim even and at most 1024) with cos / sin [B or 1, M, head_dim]; returns x."""
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    (_lib or library()).rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1],
                             x.shape[-1] // head_dim, head_dim, cos.stride(0) if cos.shape[0] > 1 else 0)
    return x


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
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A Llama-style attention module's forward for x [1, M, hidden] in one C call, with the results of
    `rows_linear`, `rope_` and `attend` bit for bit. projs = (q weight, q bias, k weight, k bias, v weight, v bias,
    o weight, o bias), biases None or contiguous. The new keys and values are written into the cache buffers
    k_buf / v_buf [1, kv_heads, capacity >= past + M, head_dim] (contiguous) at positions past .. past + M - 1;
    mask is None (M = 1) or [1, 1, M, >= past + M] with its last axis contiguous, bool or additive float32;
    cos / sin [1, M, head_dim] contiguous. The caller checked all of it. Returns [1, M, hidden]."""
    m, hid = x.shape[1], x.shape[2]
    y = x.new_empty(1, m, projs[6].shape[0])
    work = _scratch(m * (2 * heads + 2 * kv_heads) * head_dim)
    kind, mask_sm = _mask_rows(mask)
    (_lib or library()).attention_block(
        x.data_ptr(), m, hid, *[_ptr(t) for t in projs], heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(1), past, _ptr(mask), kind, mask_sm, scale,
        work.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def decoder_layer(x: torch.Tensor, norms: tuple, projs: tuple, mlp: tuple, heads: int, kv_heads: int,
                  head_dim: int, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  past: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A Llama-style decoder layer's forward for x [1, M, hidden] in one C call: `rms_norm`, `attention_block`,
    the residual sum, `rms_norm`, `rows_gated`, `rows_linear`, the residual sum, bit for bit. norms = (input norm
    weight, eps, post-attention norm weight, eps); mlp = (gate, up, down weights); the rest as `attention_block`."""
    m, hid = x.shape[1], x.shape[2]
    inter = mlp[0].shape[0]
    y = x.new_empty(1, m, hid)
    work = _scratch(m * (3 * hid + inter + (2 * heads + 2 * kv_heads) * head_dim))
    kind, mask_sm = _mask_rows(mask)
    (_lib or library()).decoder_layer(
        x.data_ptr(), m, hid, norms[0].data_ptr(), norms[1], norms[2].data_ptr(), norms[3],
        *[_ptr(t) for t in projs], heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(1), past, _ptr(mask), kind, mask_sm, scale,
        mlp[0].data_ptr(), mlp[1].data_ptr(), mlp[2].data_ptr(), inter, work.data_ptr(), y.data_ptr(),
        torch.get_num_threads())
    return y
