/* kernels.h: what one part of the CPU kernels offers the others, declared once: the shared types and constants and
   the static functions a later part calls (all parts are one translation unit, kernels.c, so these stay static and
   the library exports only the functions at the end: cpu_backend/kernels.py's `load` gives those their ctypes
   signatures). Tables one part reads from an earlier one (codes.c's Q4TILES / Q8TILES / KQTILES in products.c,
   screen.c's QUADS in int8.c) come with the part that defines them: kernels.c includes the parts in that order. */
#ifndef EAGLE_CPU_KERNELS_H
#define EAGLE_CPU_KERNELS_H
#include "common.h"

/* products.c */
static void linear_blocks(const float *P, const float *X, const float *B, float *Y,
                          int64_t lo, int64_t hi, int64_t out_f, int64_t in_f, int64_t M);
static inline void store_gated(float *Y, const float *g, const float *u, int64_t out_f, int64_t o0, int64_t n,
                               int64_t m0, int64_t R, int act);

/* codes.c */
#if Q4_OK
#define MANY 96  /* rows per pass of q4_many: its sums [MANY][NB] stay in L1 */
static void q4_many(const unsigned char *Q, const float *X, int64_t in_f, int64_t M, float *acc,
                    const unsigned char *ahead, int form);
#endif

/* byte_products.c */
#if VQ_OK
#define VQ_MAX 64  /* rows up to which the byte products serve; beyond, q4_many decodes each group once for all */
/* X [M][G][3][32]: hi, mid, lo; S, SX [M][G]: s and the float32 sum of the group's x; HSh [M][G][2]: the sum of
   its hi over each half, SXh [M][G][2]: of its x (K-quant codes have a d and m per 16 inputs) */
typedef struct { const int8_t *X; const float *S, *SX, *SXh; const int32_t *HSh; int64_t G; } vq_rows;
static int vq_prepare(const float *X, int64_t M, int64_t in_f, vq_rows *a);
static void vq_block(const float *P, int64_t b, int next, int64_t in_f, const vq_rows *a, int64_t r0, int64_t R,
                     float *acc);
static void vq_linear(const float *P, const vq_rows *a, const float *B, float *Y, int64_t lo, int64_t hi,
                      int64_t out_f, int64_t in_f, int64_t M);
#endif

/* amx.c */
#if AMX_OK
#define AMX_PASS 256  /* input rows per pass of amx_linear */
typedef struct { uint16_t *XS; float *S, *acc; int64_t M, Mp, in_f; int R; } amx_rows;
/* the configuration this thread loaded: its mark (see the callers), 0 for none or unknown */
static __thread int amx_rows_loaded;
static void load_tiles(int R, int with_r, int tiles, int mark);
static void *amx_buffer(size_t n);
static amx_rows amx_prepare(const float *X, int64_t M, int64_t in_f);
static void tile_block(const float *P, int64_t b, const amx_rows *a, float *acc, int next);
static void amx_linear(const float *P, const float *X, const float *B, float *Y, int64_t lo, int64_t hi,
                       int64_t out_f, int64_t in_f, int64_t M);
static void amx_gated(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                      int64_t M, int nthreads, int act);
static void amx_blocks(const float *P, const amx_rows *a, const float *B, float *Y, int64_t lo, int64_t hi,
                       int64_t out_f, int64_t c);
#endif

/* screen.c */
#if SCREEN_PAIRS
#define QUAD_ROWS 4  /* row counts up to which quad_tile serves (and, without AMX, a tile of quad_tile rows) */
static float round_row(const float *x, int64_t in_f, int64_t kq, int16_t *xq);
static int32_t split_row(const int16_t *xq, int64_t in_f, int64_t in_p, int8_t *XH, uint8_t *XL);
#endif
#if SCREEN_TILES
static void screen_tile(const int8_t *Q, const int8_t *XH, const uint8_t *XL, int64_t in_p, int R, float *acc,
                        const int8_t *ahead);
#endif

/* int8.c */
static void i8_linear(const float *P, const float *X, const float *B, float *Y, int64_t lo, int64_t hi,
                      int64_t out_f, int64_t in_f, int64_t M);
static void i8_gated(const float *G, const float *U, const float *X, float *Y, int64_t out_f, int64_t in_f,
                     int64_t M, int nthreads, int act);
static void i8_one_block(const float *P, int64_t b, const float *X, int64_t in_f, int R, float *acc);

/* The library's functions (`load` in cpu_backend/kernels.py declares their argument types) */
int q4_supported(void);
int vq_supported(void);
int amx_enable(void);
int screen_pairs(void);
int screen_tiles(void);
int int8_products(void);
void rows_linear(const float *P, const float *X, const float *B, float *Y,
                 int64_t out_f, int64_t in_f, int64_t M, int nthreads);
void rows_gated(const float *G, const float *U, const float *X, float *Y,
                int64_t out_f, int64_t in_f, int64_t M, int nthreads, int act);
void rms_norm(const float *X, const float *W, float *Y, int64_t M, int64_t n, float eps);
void rope(float *X, const float *cos, const float *sin, int64_t B, int64_t M, int64_t H, int64_t D, int64_t cs_b);
void attend(const float *Q, int64_t q_sb, int64_t q_sh, int64_t q_sm,
            const float *K, const float *V, int64_t kv_sb, int64_t kv_sh, int64_t kv_sj,
            const void *mask, int mask_kind, int64_t mask_sb, int64_t mask_sm,
            float *O, int64_t B, int64_t H, int64_t rep, int64_t M, int64_t L, int64_t D, float scale, int nthreads);
void kv_compact(const int64_t *B, int64_t n, int64_t start, const int64_t *keep, int64_t m);
void attention_block(const float *X, int64_t M, int64_t hid,
                     const float *Wq, const float *Bq, const float *Wk, const float *Bk,
                     const float *Wv, const float *Bv, const float *Wo, const float *Bo,
                     const float *Wqn, const float *Wkn, float eps_qk,
                     int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                     float *K, float *V, int64_t kv_sh, int64_t past,
                     const void *mask, int mask_kind, int64_t mask_sm, float scale,
                     float *work, float *Y, int nthreads);
void decoder_layer(const float *X, int64_t M, int64_t hid, const float *Wn1, float eps1, const float *Wn2, float eps2,
                   const float *Wpa, float eps_pa, const float *Wpf, float eps_pf,
                   const float *Wq, const float *Bq, const float *Wk, const float *Bk,
                   const float *Wv, const float *Bv, const float *Wo, const float *Bo,
                   const float *Wqn, const float *Wkn, float eps_qk,
                   int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                   float *K, float *V, int64_t kv_sh, int64_t past,
                   const void *mask, int mask_kind, int64_t mask_sm, float scale,
                   const float *G, const float *U, const float *Dn, int64_t inter, int act,
                   float *work, float *Y, int nthreads);
void decoder_stack(const float *X, int64_t M, int64_t hid, int64_t L, const int64_t *P, const float *eps,
                   const int64_t *kv_sh, int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                   int64_t past, const void *mask, int mask_kind, int64_t mask_sm, float scale, int64_t inter,
                   float *work, float *A, float *Y, float *Keep, int nthreads);
int64_t screen_argmax(const int8_t *Q, const float *S, const float *C, double n_max, double w_max,
                      const float *W, const float *X,
                      int64_t out_f, int64_t in_f, int64_t M, float *A, float *lo_all, float *best_all,
                      int64_t *at_all, int16_t *Xq, int64_t *Y, int nthreads);

#endif
