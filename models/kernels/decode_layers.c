/* A decode step's decoder layers (Llama family) in one call: for T sequences of one new token each,
 *
 *   normed = rms_norm(hidden)                    qkv = normed W_qkv^T [+ b]
 *   [q, k = rms_norm per head (q_norm, k_norm)]  [q, k = rms_norm over the whole projection; q, k, v clipped]
 *   rope on q and k (their first R dims), k and v into the paged cache
 *   attn = paged decode attention of q [in a window]
 *   o = attn W_o^T                               [o = rms_norm(o) (attn_out_norm)]
 *   normed, hidden = rms_norm(o, residual = hidden)
 *   m = down(act(gate) * up),                    gate | up = normed W_gate_up^T, act SiLU or GELU-tanh
 *       [or m = the mixture of experts of normed (moe.c's orca_moe)]
 *   [m = rms_norm(m) (mlp_out_norm)]             hidden = hidden + m
 *
 * layer after layer, calling the same kernels the Python layers call one by one (quant_linear.c,
 * elementwise.c, paged_decode_attention.c) on the same values in the same order: the result is
 * bit-identical to the module-by-module forward. What it removes is everything between those kernels:
 * at batch 1 on a 2-core CPU a decode step makes ~300 small calls, and each one's Python (module
 * call, checks, a fresh output tensor, ctypes) cost more than its arithmetic (issue #12).
 *
 * The bracketed steps are what some families add: per-head q/k norms (Qwen3's, and Gemma 3's with
 * their (1 + w) folded into the weight), OLMoE's norms over the whole q and k projections and its
 * clipping, Gemma 3's "sandwich" norms around attention and MLP, GELU and local layers' windows, and
 * a mixture of experts in place of the MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE); a layer without
 * them leaves their pointers NULL (window 0, clip 0). Each layer names its rotary table (Gemma 3's
 * local and global layers turn differently); R < D is partial rotary (Phi-4-mini), the same for every
 * layer.
 *
 * Still selective batching: every linear, norm and activation runs once over the flat [T, hidden]
 * tokens; only attention is per sequence. Tensor parallelism is not handled here (no all-reduce):
 * the caller runs this only where one process holds whole layers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h"

/* Kernels of the same library (quant_linear.c, elementwise.c, paged_decode_attention.c). */
int orca_qlinear(const float *x, int64_t M, int64_t K, const uint8_t *w, int fmt, int64_t N, float *y, int64_t ldy,
                 int precision);
void orca_rms_norm(float *x, float *residual, const float *w, float eps, int64_t T, int64_t H, float *out);
void orca_silu_and_mul(const float *x, int64_t T, int64_t d, float *out);
void orca_gelu_tanh_and_mul(const float *x, int64_t T, int64_t d, float *out);
void orca_qk_norm(float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *q_w, const float *k_w,
                  float eps);
void orca_rope_and_cache(float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t R,
                         const int64_t *positions, const float *cos_sin, const int64_t *slots, void *k_cache,
                         void *v_cache, int kv_type);
int orca_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                                const int32_t *block_tables, const int32_t *seq_lens, int64_t n, int64_t Hq,
                                int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, float scale,
                                int64_t window, int kv_type, float *out);

/* One decoder layer's weights and its KV cache ([num_blocks, block_size, Hkv, row] each, rows of D values
 * in the shape's kv_type). */
typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    orca_qweight qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    const float *cos_sin; /* [max_pos, R]: this layer's rotary table, cos | sin */
    /* What not every family has (NULL / 0: none). */
    int64_t window;                           /* sliding window; 0: full attention */
    const float *q_norm, *k_norm;             /* [D], on every q / k head before rotary */
    const float *attn_out_norm, *mlp_out_norm; /* [H], on the attention / MLP output before its residual add */
    int32_t gelu;                             /* the MLP's activation: 0 SiLU, 1 GELU (tanh) */
    /* OLMoE's: an RMSNorm over the whole q ([Hq * D]) and k ([Hkv * D]) projections, both or neither,
     * and q, k and v clipped to [-clip, clip] after them (0: no clipping). */
    const float *q_proj_norm, *k_proj_norm;
    float clip;
    const orca_moe_layer *moe; /* a mixture of experts in place of gate_up / down; NULL: the dense MLP */
} orca_decode_layer;

/* The model's shape, the same for every layer. */
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t block_size;
    int64_t rotary_dim; /* R: the leading dims of a head that rotary turns (R <= D; every layer's table) */
    int32_t kv_type;    /* the KV cache's element type (kv_types.h), the same for every layer */
} orca_decode_shape;

int orca_qweight_linear(const orca_qweight *w, const float *x, int64_t T, float *y) {
    for (int s = 0; s < w->num_segments; s++)
        if (orca_qlinear(x, T, w->K, w->tiles[s], w->fmt[s], w->rows[s], y + w->row_start[s], w->N, w->precision))
            return 1;
    if (w->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < w->N; n++) y[t * w->N + n] += w->bias[n];
    return 0;
}

int orca_gated_mlp(const orca_qweight *gate_up, const orca_qweight *down, int64_t I, int gelu, const float *x,
                   int64_t T, float *gu, float *act, float *y) {
    if (orca_qweight_linear(gate_up, x, T, gu)) return 1;
    if (gelu)
        orca_gelu_tanh_and_mul(gu, T, I, act);
    else
        orca_silu_and_mul(gu, T, I, act);
    return orca_qweight_linear(down, act, T, y);
}

/* hidden [T, H] (in: the layers' input; out: their output, the residual stream); positions and slots
 * [T] int64; block_tables [T, max_blocks] and seq_lens [T] int32, the lengths counting this token.
 * Returns 0, or nonzero (with hidden partly updated) if a kernel refused its shapes or memory ran out;
 * the caller checks the shapes first, so that means a bug. */
int orca_decode_layers(const orca_decode_layer *layers, int64_t num_layers, const orca_decode_shape *shape,
                       float *hidden, int64_t T, const int64_t *positions, const int64_t *slots,
                       const int32_t *block_tables, const int32_t *seq_lens, int64_t max_blocks) {
    const int64_t H = shape->hidden, Hq = shape->num_heads, Hkv = shape->num_kv_heads, D = shape->head_dim;
    const int64_t I = shape->intermediate, qkv_width = (Hq + 2 * Hkv) * D, q_width = Hq * D;
    /* One workspace for the whole call: normed [T, H], qkv, q (contiguous for attention), attn, o,
     * gate_up [T, 2I], act [T, I], down [T, H]. */
    const int64_t floats = T * (H + qkv_width + 2 * q_width + H + 2 * I + I + H);
    float *buf = malloc((size_t)floats * sizeof(float));
    if (!buf) return 2;
    float *normed = buf, *qkv = normed + T * H, *q = qkv + T * qkv_width, *attn = q + T * q_width;
    float *o = attn + T * q_width, *gate_up = o + T * H, *act = gate_up + T * 2 * I, *down = act + T * I;
    int rc = 0;
    for (int64_t l = 0; l < num_layers && !rc; l++) {
        const orca_decode_layer *L = layers + l;
        orca_rms_norm(hidden, NULL, L->input_norm, shape->eps, T, H, normed);
        if ((rc = orca_qweight_linear(&L->qkv, normed, T, qkv))) break;
        if (L->q_norm) orca_qk_norm(qkv, T, Hq, Hkv, D, L->q_norm, L->k_norm, shape->eps);
        if (L->q_proj_norm)
            for (int64_t t = 0; t < T; t++) {
                float *row = qkv + t * qkv_width;
                orca_rms_norm(row, NULL, L->q_proj_norm, shape->eps, 1, q_width, row);
                orca_rms_norm(row + q_width, NULL, L->k_proj_norm, shape->eps, 1, Hkv * D, row + q_width);
            }
        if (L->clip > 0)
            for (int64_t i = 0; i < T * qkv_width; i++)
                qkv[i] = qkv[i] < -L->clip ? -L->clip : (qkv[i] > L->clip ? L->clip : qkv[i]);
        orca_rope_and_cache(qkv, T, Hq, Hkv, D, shape->rotary_dim, positions, L->cos_sin, slots, L->k_cache,
                            L->v_cache, shape->kv_type);
        /* Attention reads q as [T, Hq, D]: one token's q heads already are; more are gathered. */
        if (T > 1)
            for (int64_t t = 0; t < T; t++)
                memcpy(q + t * q_width, qkv + t * qkv_width, (size_t)q_width * sizeof(float));
        if ((rc = orca_paged_decode_attention(T > 1 ? q : qkv, L->k_cache, L->v_cache, block_tables, seq_lens, T, Hq, Hkv, D,
                                              shape->block_size, max_blocks, shape->scale, L->window, shape->kv_type, attn)))
            break;
        if ((rc = orca_qweight_linear(&L->o, attn, T, o))) break;
        if (L->attn_out_norm) orca_rms_norm(o, NULL, L->attn_out_norm, shape->eps, T, H, o);
        orca_rms_norm(o, hidden, L->post_norm, shape->eps, T, H, normed); /* hidden += o */
        if (L->moe) {
            memset(down, 0, (size_t)(T * H) * sizeof(float));
            if ((rc = orca_moe(L->moe, normed, T, down))) break;
        } else {
            if ((rc = orca_gated_mlp(&L->gate_up, &L->down, I, L->gelu, normed, T, gate_up, act, down))) break;
        }
        if (L->mlp_out_norm) orca_rms_norm(down, NULL, L->mlp_out_norm, shape->eps, T, H, down);
        for (int64_t i = 0; i < T * H; i++) hidden[i] += down[i];
    }
    free(buf);
    return rc;
}
