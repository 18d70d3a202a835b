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
/* One decoder layer (or attention module) for attention_block, decoder_layer and decoder_stack: its weights in the
   kernels' layouts (packed and tagged addresses; NULL where a layer has no such part), sizes, epsilons and cache
   buffers. Declared once, here, as a list of (type, name) that makes the struct, layer_args_layout's offsets and
   layer_args_fields' names: cpu_backend/kernels.py mirrors it as the ctypes Structure LayerArgs, and
   tests/test_backend_modules.py checks the two agree. */
#define LAYER_ARGS(X) \
    X(const float *, norm1)      /* input norm (NULL: none, an EAGLE head's first layer) */ \
    X(const float *, norm2)      /* the MLP's input norm (post-attention) */ \
    X(const float *, out_norm1)  /* Gemma-3's norm of the attention's output, or NULL */ \
    X(const float *, out_norm2)  /* Gemma-3's norm of the MLP's output, or NULL */ \
    X(const float *, wq) X(const float *, bq) X(const float *, wk) X(const float *, bk) \
    X(const float *, wv) X(const float *, bv) X(const float *, wo) X(const float *, bo) \
    X(const float *, q_norm)     /* Qwen3's, Gemma-3's per-head query norm, or NULL */ \
    X(const float *, k_norm)     /* ... key norm */ \
    X(const float *, gate) X(const float *, up) X(const float *, down) \
    X(float *, k_cache)          /* [H_kv, capacity, D] */ \
    X(float *, v_cache) \
    X(int64_t, kv_sh)            /* the caches' head stride */ \
    X(int64_t, inter)            /* the MLP's intermediate size */ \
    X(float, eps1) X(float, eps2) X(float, eps_out1) X(float, eps_out2) X(float, eps_qk) \
    X(int32_t, act)              /* rows_gated's: 0 SiLU, 1 GELU's tanh form */
#define LAYER_ARGS_FIELD(type, name) type name;
typedef struct { LAYER_ARGS(LAYER_ARGS_FIELD) } layer_args;
#undef LAYER_ARGS_FIELD

void attention_block(const float *X, int64_t M, int64_t hid, const layer_args *w,
                     int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin, int64_t past,
                     const void *mask, int mask_kind, int64_t mask_sm, float scale,
                     float *work, float *Y, int nthreads);
void decoder_layer(const float *X, int64_t M, int64_t hid, const layer_args *w,
                   int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin, int64_t past,
                   const void *mask, int mask_kind, int64_t mask_sm, float scale,
                   float *work, float *Y, int nthreads);
void decoder_stack(const float *X, int64_t M, int64_t hid, int64_t L, const layer_args *layers,
                   int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                   int64_t past, const void *mask, int mask_kind, int64_t mask_sm, float scale,
                   float *work, float *A, float *Y, float *Keep, int nthreads);
int64_t layer_args_layout(int64_t *out);
const char *layer_args_fields(void);
int64_t screen_argmax(const int8_t *Q, const float *S, const float *C, double n_max, double w_max,
                      const float *W, const float *X,
                      int64_t out_f, int64_t in_f, int64_t M, float *A, float *lo_all, float *best_all,
                      int64_t *at_all, int16_t *Xq, int64_t *Y, int nthreads);

#endif
