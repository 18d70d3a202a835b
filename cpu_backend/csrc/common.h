/* common.h: what every part of the CPU kernels shares: the vector types and their inline arithmetic (madd, hsum,
   reduce, loadw, vexp), the packed block size NB and tile height RMAX, the feature tests that pick the instructions
   each part uses (Q4_OK, AMX_OK, VQ_OK, SCREEN_PAIRS, SCREEN_TILES), the weight layouts and the tags on their
   addresses, and the small helpers several parts call (share, tile_rows, store_block, thread_buffer). */
#ifndef EAGLE_CPU_COMMON_H
#define EAGLE_CPU_COMMON_H
#include <math.h>
#include <stddef.h>
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

/* Products read packed weights: W [out, in] is stored as P [ceil(out / NB)][in][NB], blocks of NB outputs
   (products.c). */
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
/* Which instructions the parts use, from the compiler's target (-march=native where the library is built):
   - Q4_OK: weights kept as GGUF codes, decoded to float32 in registers (codes.c): AVX-512, or AVX2 with F16C;
   - AMX_OK: bfloat16 tile products (amx.c): AMX-TILE, AMX-BF16 and AVX512-BW;
   - VQ_OK: the codes multiplied by byte products (byte_products.c): AVX512-VNNI, VBMI, BW and DQ;
   - SCREEN_PAIRS: the screen's int8 estimate, and int8 drafts, in integer arithmetic (screen.c, int8.c):
     AVX512-VNNI;
   - SCREEN_TILES: the same integer sums on AMX-INT8 tiles. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#define Q4_OK 1
#else
#define Q4_OK 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#define AMX_OK 1
#else
#define AMX_OK 0
#endif
#if Q4_OK && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define VQ_OK 1
#else
#define VQ_OK 0
#endif
#ifdef __AVX512VNNI__
#define SCREEN_PAIRS 1
#else
#define SCREEN_PAIRS 0
#endif
#if AMX_OK && defined(__AMX_INT8__) && SCREEN_PAIRS
#define SCREEN_TILES 1
#else
#define SCREEN_TILES 0
#endif

/* rows per tile for the `left` rows still to do: all of them up to RMAX, else halves, else RMAX */
static inline int tile_rows(int64_t left) {
    return left <= RMAX ? (int)left : left < 2 * RMAX ? (int)((left + 1) / 2) : RMAX;
}

/* Y[m0 + r, o] = acc[r, o - b NB] (+ B[o]) for r < R and the outputs o of block b */
static inline void store_block(float *Y, const float *acc, const float *B, int64_t b, int64_t out_f, int64_t m0,
                               int R) {
    const int64_t o0 = b * NB, n = out_f - o0 < NB ? out_f - o0 : NB;
    for (int r = 0; r < R; r++)
        for (int64_t o = 0; o < n; o++) Y[(m0 + r) * out_f + o0 + o] = acc[r * NB + o] + (B ? B[o0 + o] : 0.0f);
}

/* this thread's share lo .. hi - 1 of n work items, split as `schedule(static)` would */
static inline void share(int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    *lo = n * t / T;
    *hi = n * (t + 1) / T;
}

/* this thread's buffer `slot` (0: amx_prepare's and the screen's, 1: i8_prepare's, 2: vq_prepare's) of at least n
   bytes (grown, never shrunk) */
static inline void *thread_buffer(int slot, size_t n) {
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
/* the three code layouts above, as the kernels name them */
enum { FORM_Q4 = 0, FORM_Q8 = 1, FORM_K = 2 };
static inline int code_form(const float *P) { return is_q8(P) ? FORM_Q8 : is_kq(P) ? FORM_K : FORM_Q4; }
static inline int has_codes(const float *P) { return is_q4(P) || is_q8(P) || is_kq(P); }
/* group g (of `bytes` bytes) of the block at `ahead` into L2, if there is one */
static inline void prefetch_group(const unsigned char *ahead, int64_t g, int bytes) {
    if (ahead)
        for (int l = 0; l < bytes / 64; l++) __builtin_prefetch(ahead + g * bytes + 64 * l, 0, 2);
}

/* Weights on AMX tiles (amx.c): tagged 2 (Q4_1 codes in amx_decode's order) or 3 (bfloat16); float32 weights (the
   layout above) are untagged */
static inline int is_bf16(const float *P) { return ((uintptr_t)P & 7) == 3; }
static inline int on_tiles(const float *P) { return ((uintptr_t)P & 7) == 2 || ((uintptr_t)P & 7) == 3; }
static inline int is_float(const float *P) { return ((uintptr_t)P & 7) == 0; }
/* int8 weights with a scale per output, multiplied as the greedy screen multiplies (`i8_linear`): tag 4 */
static inline int is_i8(const float *P) { return ((uintptr_t)P & 7) == 4; }
/* Q4_1, Q8_0-form and K-quant codes for the byte products (byte_products.c): bit 3 of the address set too */
#if VQ_OK
static inline int is_vq(const float *P) { return ((uintptr_t)P & 8) != 0; }
#else
static inline int is_vq(const float *P) { (void)P; return 0; }
#endif

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

#endif
