/* layers.c: a whole attention module (attention_block), decoder layer (decoder_layer) or stack of decoder layers
   (decoder_stack) in one call, made of the other parts' functions; and rms_norm. */
#include "kernels.h"

/* A Llama-style attention module for M rows of one sequence, in one call: the q / k / v products (one parallel
   loop over their stacked outputs), the rotary embedding of q and k, the new keys and values written into the
   cache buffers at positions past .. past + M - 1 (K / V [H_kv, capacity, D], head stride kv_sh), attention over
   the past + M keys, and the o product into Y [M, hidden]. Every number is computed by the same code, in the same
   order, as the separate calls (rows_linear, rope, attend), so the results are theirs bit for bit. With Wqn
   and Wkn (Qwen3's, Gemma-3's q and k norms), each head's query and key is normed (rms_norm over D, epsilon
   eps_qk) before the rotation. work holds M (2 H + 2 H_kv) D floats. */
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
   with the calls rms_norm, attention_block, rows_gated and rows_linear (products.c) and plain float sums, so the
   results are those of the separate calls bit for bit. Gemma-3's layers also norm the attention's output (Wpa) and
   the MLP's (Wpf) before their residual sums, norm each head's query and key (Wqn, Wkn: attention_block), and gate by
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

