/* A mixture of experts' MLP over a step's flat tokens (models/layers/moe.py, SparseMoE), in one call:
 *
 *   logits = x R^T (float32)      weights, experts = the top k of softmax(logits) [renormalised]
 *   the (token, expert) pairs grouped by expert, tokens in order within each group
 *   for each chosen expert e, over its tokens:  m = down_e(silu(gate_e) * up_e)   out[t] += w * m
 *   [a shared expert over every token:  s = down_s(silu(gate_s) * up_s) [* sigmoid(x . g)]   out += s]
 *
 * Each chosen expert's weights are read once per step however many tokens chose it (selective
 * batching), and an expert no token chose is never read. The module (SparseMoE) and the fused decode
 * layers (decode_layers.c) both run this function, so a token's output does not depend on which of
 * them ran its step; the router and routing are also exported for the module's own loop, which must
 * route exactly as this does. Every sum here runs in a fixed order per token (a router logit is one
 * dot product, whatever T or the thread count), so routing does not depend on the batch. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h"
#include "simd.h"

/* Router dot products per thread below which OpenMP's fork costs more than it saves. */
#define PARALLEL_MIN_DOTS (1 << 16)

/* a . b over H floats (H a multiple of 8): four chains of 8 lanes, then their sum, in a fixed order. */
static float dot(const float *a, const float *b, int64_t H) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= H; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i < H; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* logits [T, E] = x [T, H] w^T for the router w [E, H]; H a multiple of 8. */
void orca_router_logits(const float *x, int64_t T, int64_t H, const float *w, int64_t E, float *logits) {
#pragma omp parallel for collapse(2) schedule(static) if (T * E * H >= 2 * PARALLEL_MIN_DOTS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) logits[t * E + e] = dot(x + t * H, w + e * H, H);
}

/* Each token's k experts (highest first, ties to the lower index) and their weights, from its
 * logits [T, E]: softmax over all E then the top k, renormalised over the k where `normalize`; or
 * (softmax_first 0) the top k logits, then a softmax over those k. weights, experts: [T, k]. */
void orca_moe_route(const float *logits, int64_t T, int64_t E, int64_t k, int normalize, int softmax_first,
                    float *weights, int64_t *experts) {
    if (T <= 0 || E <= 0 || k <= 0) return; /* nothing to route (and no negative sizes for malloc/memset) */
    float *p = malloc((size_t)E * sizeof(float));
    char *taken = malloc((size_t)E);
    if (!p || !taken) abort(); /* E floats: only a broken process fails here */
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float *w = weights + t * k;
        int64_t *chosen = experts + t * k;
        memcpy(p, l, (size_t)E * sizeof(float));
        if (softmax_first) {
            float m = p[0], s = 0.0f;
            for (int64_t e = 1; e < E; e++) m = p[e] > m ? p[e] : m;
            for (int64_t e = 0; e < E; e++) s += (p[e] = expf(p[e] - m));
            for (int64_t e = 0; e < E; e++) p[e] /= s;
        }
        memset(taken, 0, (size_t)E);
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            chosen[j] = best;
            w[j] = p[best];
        }
        if (!softmax_first) {
            float s = 0.0f;
            const float m = w[0];
            for (int64_t j = 0; j < k; j++) s += (w[j] = expf(w[j] - m));
            for (int64_t j = 0; j < k; j++) w[j] /= s;
        } else if (normalize) {
            float s = 0.0f;
            for (int64_t j = 0; j < k; j++) s += w[j];
            for (int64_t j = 0; j < k; j++) w[j] /= s;
        }
    }
    free(p);
    free(taken);
}

/* Pairs (tokens times k) up to which the threads take whole experts rather than splitting each one.
 * Interleaved on a 2-core AVX-512 EPYC, OLMoE-1B-7B Q4_K_M (k = 8 of 64): 12% less time at 1 token,
 * 15% at 8, 12% at 32, 19% at 64, even at 256 tokens (2048 pairs); past that the rows' buffer
 * (pairs x hidden floats) grows with the prompt for a few percent. */
#define EXPERT_PARALLEL_MAX_PAIRS 2048

/* Expert e over its n tokens' rows of x: y [n, H] = down(silu(gate) * up), scratch [n, H + 3I]. */
static int expert_rows(const orca_moe_layer *m, int64_t e, const float *x, const int64_t *token, int64_t n,
                       float *scratch, float *y) {
    const int64_t H = m->hidden, I = m->inter;
    float *rows = scratch, *gu = rows + n * H, *act = gu + n * 2 * I;
    for (int64_t i = 0; i < n; i++) memcpy(rows + i * H, x + token[i] * H, (size_t)H * sizeof(float));
    return orca_gated_mlp(m->gate_up + e, m->down + e, I, 0, rows, n, gu, act, y);
}

/* out[token[i]] += w[i] * y[i] for n rows y [n, H], in order. */
static void add_weighted(const float *y, const int64_t *token, const float *w, int64_t n, int64_t H, float *out) {
    for (int64_t i = 0; i < n; i++) {
        float *o = out + token[i] * H;
        const float *yi = y + i * H;
        for (int64_t h = 0; h < H; h++) o[h] += yi[h] * w[i];
    }
}

/* out += the shared expert of x [T, H] (none: nothing), each token's row times sigmoid(x . gate) where
 * it has a gate: the module's order (the product rounded, then added). */
static int shared_expert(const orca_moe_layer *m, const float *x, int64_t T, float *out) {
    if (!m->shared_gate_up) return 0;
    const int64_t H = m->hidden, S = m->shared_inter;
    float *buf = malloc((size_t)(T * (2 * S + S + H)) * sizeof(float));
    if (!buf) return 2;
    float *gu = buf, *act = gu + T * 2 * S, *y = act + T * S;
    const int rc = orca_gated_mlp(m->shared_gate_up, m->shared_down, S, 0, x, T, gu, act, y);
    if (!rc)
        for (int64_t t = 0; t < T; t++) {
            const float g = m->shared_gate ? 1.0f / (1.0f + expf(-dot(x + t * H, m->shared_gate, H))) : 1.0f;
            float *o = out + t * H;
            const float *yt = y + t * H;
            if (m->shared_gate)
                for (int64_t h = 0; h < H; h++) o[h] += yt[h] * g;
            else
                for (int64_t h = 0; h < H; h++) o[h] += yt[h];
        }
    free(buf);
    return rc;
}

int orca_moe(const orca_moe_layer *m, const float *x, int64_t T, float *out) {
    const int64_t E = m->num_experts, k = m->top_k, H = m->hidden, I = m->inter, pairs = T * k;
    if (T <= 0) return 0;
    /* Routing: logits [T, E], weights [pairs], experts [pairs]; the groups: start [E + 1], cursor [E],
     * each grouped pair's token and weight [pairs]. */
    char *route = malloc((size_t)(T * E + 2 * pairs) * sizeof(float) + (size_t)(2 * pairs + 2 * E + 1) * sizeof(int64_t));
    if (!route) return 2;
    int64_t *experts = (int64_t *)route, *start = experts + pairs, *cursor = start + E + 1, *token = cursor + E;
    float *logits = (float *)(token + pairs), *weights = logits + T * E, *pair_weight = weights + pairs;
    orca_router_logits(x, T, H, m->router, E, logits);
    orca_moe_route(logits, T, E, k, m->normalize, m->softmax_first, weights, experts);
    /* Grouped by expert, ascending; within a group in pair order, so in token order. */
    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++) start[experts[p] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < E; e++) {
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
        cursor[e] = start[e];
    }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t at = cursor[experts[p]]++;
        token[at] = p / k;
        pair_weight[at] = weights[p];
    }
    /* A step's few rows per expert are too little work to split each expert's matmuls over the
     * threads (a fork and join per matmul, half a small weight each): there the threads take whole
     * experts, each streaming its weights from start to end, into y [pairs, H]; the rows are then
     * added into their tokens in group order. Many rows: the experts in turn, each split over the
     * threads as any linear is, each added as it ends (y [most, H]). A token's sum runs in the same
     * order either way, and each matmul's result is the same (quant_linear.c computes every output
     * element in one fixed order whichever thread runs it). */
    const int by_expert = pairs <= EXPERT_PARALLEL_MAX_PAIRS;
    float *y = malloc((size_t)((by_expert ? pairs : most) * H) * sizeof(float));
    if (!y) {
        free(route);
        return 2;
    }
    int rc = 0;
    if (by_expert) {
#pragma omp parallel
        {
            float *scratch = malloc((size_t)(most * (H + 3 * I)) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
            for (int64_t e = 0; e < E; e++) {
                const int64_t p0 = start[e], n = start[e + 1] - p0;
                if (n == 0) continue;
                const int r = scratch ? expert_rows(m, e, x, token + p0, n, scratch, y + p0 * H) : 2;
                if (r) {
#pragma omp atomic write
                    rc = r;
                }
            }
            free(scratch);
        }
        if (!rc) add_weighted(y, token, pair_weight, pairs, H, out);
    } else {
        float *scratch = malloc((size_t)(most * (H + 3 * I)) * sizeof(float));
        rc = scratch ? 0 : 2;
        for (int64_t e = 0; e < E && !rc; e++) {
            const int64_t p0 = start[e], n = start[e + 1] - p0;
            if (n == 0) continue;
            if (!(rc = expert_rows(m, e, x, token + p0, n, scratch, y)))
                add_weighted(y, token + p0, pair_weight + p0, n, H, out);
        }
        free(scratch);
    }
    free(y);
    free(route);
    return rc ? rc : shared_expert(m, x, T, out);
}
