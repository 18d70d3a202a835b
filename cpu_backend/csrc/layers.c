/* layers.c: a whole attention module (attention_block), decoder layer (decoder_layer) or stack of decoder layers
   (decoder_stack) in one call, made of the other parts' functions; and rms_norm. */
#include "kernels.h"

/* A Llama-style attention module for M rows of one sequence, in one call: the q / k / v products (one parallel
   loop over their stacked outputs), the rotary embedding of q and k, the new keys and values written into the
   cache buffers at positions past .. past + M - 1 (K / V [H_kv, capacity, D], head stride kv_sh), attention over
   the past + M keys, and the o product into Y [M, hidden]. Every number is computed by the same code, in the same
   order, as the separate calls (rows_linear, rope, attend), so the results are theirs bit for bit. With q_norm
   and k_norm (Qwen3's, Gemma-3's), each head's query and key is normed (rms_norm over D, epsilon eps_qk) before
   the rotation. w: the layer's wq .. bo, q_norm, k_norm, eps_qk, k_cache, v_cache, kv_sh (the rest unread). work
   holds M (2 H + 2 H_kv) D floats. */
void attention_block(const float *X, int64_t M, int64_t hid, const layer_args *w,
                     int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin, int64_t past,
                     const void *mask, int mask_kind, int64_t mask_sm, float scale,
                     float *work, float *Y, int nthreads) {
    const float *Wq = w->wq, *Bq = w->bq, *Wk = w->wk, *Bk = w->bk, *Wv = w->wv, *Bv = w->bv, *Wo = w->wo;
    const float *Bo = w->bo, *Wqn = w->q_norm, *Wkn = w->k_norm;
    const float eps_qk = w->eps_qk;
    float *K = w->k_cache, *V = w->v_cache;
    const int64_t kv_sh = w->kv_sh;
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
   results are those of the separate calls bit for bit. Gemma-3's layers also norm the attention's output (out_norm1)
   and the MLP's (out_norm2) before their residual sums, norm each head's query and key (q_norm, k_norm:
   attention_block), and gate by GELU (act 1: rows_gated); NULL weights and act 0 for Llama's. work holds
   M (3 hid + inter + (2 H + 2 H_kv) D) floats. */
void decoder_layer(const float *X, int64_t M, int64_t hid, const layer_args *w,
                   int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin, int64_t past,
                   const void *mask, int mask_kind, int64_t mask_sm, float scale,
                   float *work, float *Y, int nthreads) {
    const int64_t inter = w->inter;
    float *N = work, *Hs = N + M * hid, *T = Hs + M * hid, *Mid = T + M * hid, *aw = Mid + M * inter;
    if (w->norm1) rms_norm(X, w->norm1, N, M, hid, w->eps1);  /* none: the input goes to attention as it is */
    attention_block(w->norm1 ? N : X, M, hid, w, H, Hkv, D, cos, sin, past, mask, mask_kind, mask_sm, scale, aw, T,
                    nthreads);
    if (w->out_norm1) rms_norm(T, w->out_norm1, T, M, hid, w->eps_out1);
    for (int64_t i = 0; i < M * hid; i++) Hs[i] = X[i] + T[i];
    rms_norm(Hs, w->norm2, N, M, hid, w->eps2);
    rows_gated(w->gate, w->up, N, Mid, inter, hid, M, nthreads, w->act);
    rows_linear(w->down, Mid, 0, T, hid, inter, M, nthreads);
    if (w->out_norm2) rms_norm(T, w->out_norm2, T, M, hid, w->eps_out2);
    for (int64_t i = 0; i < M * hid; i++) Y[i] = Hs[i] + T[i];
}

/* Every decoder layer of a model in one call: layer l runs decoder_layer on layer l - 1's output with its own
   layer_args (layers[l]: weights and cache buffers). The outputs alternate between A (scratch [M, hid]) and Y so
   that the last layer's lands in Y; with Keep ([L - 1, M, hid]), every other layer's output is copied there too. work
   as decoder_layer's for the largest intermediate size. */
void decoder_stack(const float *X, int64_t M, int64_t hid, int64_t L, const layer_args *layers,
                   int64_t H, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                   int64_t past, const void *mask, int mask_kind, int64_t mask_sm, float scale,
                   float *work, float *A, float *Y, float *Keep, int nthreads) {
    const float *in = X;
    for (int64_t l = 0; l < L; l++) {
        float *out = (L - 1 - l) % 2 == 0 ? Y : A;
        decoder_layer(in, M, hid, layers + l, H, Hkv, D, cos, sin, past, mask, mask_kind, mask_sm, scale, work, out,
                      nthreads);
        if (Keep && l < L - 1) memcpy(Keep + l * M * hid, out, sizeof(float) * M * hid);
        in = out;
    }
}

/* layer_args as this compiler lays it out: out[0] its size, out[1 + i] the offset of its i-th field; returns the
   field count. With layer_args_fields (the names, comma-separated), what tests/test_backend_modules.py compares with
   the ctypes mirror. */
int64_t layer_args_layout(int64_t *out) {
    int64_t n = 0;
    out[n++] = (int64_t)sizeof(layer_args);
#define LAYER_ARGS_OFFSET(type, name) out[n++] = (int64_t)offsetof(layer_args, name);
    LAYER_ARGS(LAYER_ARGS_OFFSET)
#undef LAYER_ARGS_OFFSET
    return n - 1;
}

const char *layer_args_fields(void) {
#define LAYER_ARGS_NAME(type, name) #name ","
    return LAYER_ARGS(LAYER_ARGS_NAME);
#undef LAYER_ARGS_NAME
}
