/* The descriptions of packed weights and of a mixture of experts that decode_layers.c and moe.c share
 * (their ctypes mirrors: QWeight and MoELayer in models/layers/native_weights.py). */
#ifndef ORCA_LAYERS_H
#define ORCA_LAYERS_H

#include <stdint.h>

#define MAX_SEGMENTS 4

/* One packed weight [N, K]: its row segments (each one block format), as PackedWeight.kernel_args. */
typedef struct {
    const uint8_t *tiles[MAX_SEGMENTS];
    int32_t fmt[MAX_SEGMENTS];
    int64_t rows[MAX_SEGMENTS];
    int64_t row_start[MAX_SEGMENTS];
    int32_t num_segments;
    int32_t precision; /* 0 float32 activations, 1 int8 */
    int64_t N, K;
    const float *bias; /* [N] or NULL */
} orca_qweight;

/* A mixture of experts (models/layers/moe.py, SparseMoE): a float32 router, every expert's packed
 * gate_up [2I, H] and down [H, I], and optionally a shared expert that every token takes (Qwen2-MoE's),
 * scaled per token by sigmoid(x . shared_gate) where it has a gate. */
typedef struct {
    const float *router;                /* [E, H] */
    const orca_qweight *gate_up, *down; /* [E] each */
    int64_t num_experts, top_k, hidden, inter;
    int32_t normalize;     /* divide the top k weights by their sum (norm_topk_prob) */
    int32_t softmax_first; /* softmax over all E, then the top k; 0: the top k logits, then their softmax */
    const orca_qweight *shared_gate_up, *shared_down; /* [2S, H], [H, S]; NULL: no shared expert */
    int64_t shared_inter;                             /* S */
    const float *shared_gate;                         /* [H], or NULL: the shared expert ungated */
} orca_moe_layer;

/* y [T, N] = x [T, K] W^T (+ bias). 0, or nonzero if a kernel refused its shapes. */
int orca_qweight_linear(const orca_qweight *w, const float *x, int64_t T, float *y);

/* A gated MLP over x [T, H]: y [T, H] = down(act(gate) * up), gate | up = x W_gate_up^T [T, 2I], act SiLU
 * (gelu 0) or GELU-tanh; gate_up [T, 2I] and act [T, I] are the caller's workspace. 0, or nonzero if a
 * kernel refused its shapes. The dense layer's MLP, each expert's and the shared expert's. */
int orca_gated_mlp(const orca_qweight *gate_up, const orca_qweight *down, int64_t I, int gelu, const float *x,
                   int64_t T, float *gu, float *act, float *y);

/* out [T, H] += the experts' weighted outputs for x [T, H]. 0, or nonzero on a refused shape or no memory. */
int orca_moe(const orca_moe_layer *m, const float *x, int64_t T, float *out);

#endif
