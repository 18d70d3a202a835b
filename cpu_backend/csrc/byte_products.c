/* byte_products.c: the codes of codes.c multiplied by AVX512-VNNI byte products (vq_linear), each input split
   exactly into three bytes a value. */
#include "kernels.h"

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
   (BENCHMARKS.md): whole SmolLM2 passes 1.17-1.35x faster than on the FMA path at 1-16 rows;
   the byte products serve up to VQ_MAX rows, so every verification pass keeps each row's one-row bits. */
#if VQ_OK
#define VQ_ROWS 3  /* rows a tile: 3 rows x 3 parts x 2 halves = 18 int32 sums in registers (4 rows: no faster) */
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
#endif
int vq_supported(void) { return VQ_OK; }
