/* Row-wise and elementwise ops of a decoder layer, fused: on a small CPU, decode at small batch is
 * dominated by per-op dispatch (torch's CPU rms_norm alone is six ops, ~45 us a call at 576 floats),
 * not by arithmetic. One call each here. AVX2 + FMA; rows split by OpenMP when there are many. */
#include <math.h>
#include <stdint.h>

#include "kv_types.h"
#include "simd.h"

/* Rows per thread below which OpenMP's fork costs more than it saves. */
#define PARALLEL_MIN_ROWS 16

/* One row: out = src / sqrt(mean(src^2) + eps) * w, with src = x, or, with rr != NULL, x + rr (also
 * written to rr). out may be x itself. H must be a multiple of 8. */
static inline void rms_row(const float *xr, float *rr, const float *w, float eps, int64_t H, float *orow) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        if (rr) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(rr + i));
            _mm256_storeu_ps(rr + i, v);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)H + eps));
    const float *src = rr ? rr : xr;
    for (int64_t i = 0; i < H; i += 8)
        _mm256_storeu_ps(orow + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i), inv), _mm256_loadu_ps(w + i)));
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. With residual != NULL, x[t] is first replaced by
 * x[t] + residual[t], and that sum is also written to residual (vLLM's fused_add_rms_norm).
 * H must be a multiple of 8. */
void orca_rms_norm(float *x, float *residual, const float *w, float eps, int64_t T, int64_t H, float *out) {
#pragma omp parallel for schedule(static) if (T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++) rms_row(x + t * H, residual ? residual + t * H : 0, w, eps, H, out + t * H);
}

/* Per-head RMSNorm of the q and k heads of a fused qkv projection [T, (Hq + 2 Hkv) * D], in place:
 * every q head with q_w [D], every k head with k_w [D] (Qwen3's q_norm / k_norm, before rotary); v
 * is left alone. Each head is one rms_row, as orca_rms_norm computes it. D a multiple of 8. */
void orca_qk_norm(float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *q_w, const float *k_w,
                  float eps) {
    const int64_t width = (Hq + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) if (T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *x = qkv + t * width + h * D;
            rms_row(x, 0, h < Hq ? q_w : k_w, eps, D, x);
        }
}

/* out[t] = silu(x[t, :d]) * x[t, d:] for x [T, 2d] (gate | up), d a multiple of 8. */
void orca_silu_and_mul(const float *x, int64_t T, int64_t d, float *out) {
#pragma omp parallel for schedule(static) if (T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                             _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
    }
}

/* The attention prologue of a rotary model in one call: rotate the q and k heads of the fused qkv
 * projection in place (neox layout over the first R dims of each head: pairs (i, i + R/2);
 * cos_sin[pos] = [cos | sin], R/2 each; dims R..D-1 pass unchanged: partial rotary), then copy each
 * token's k and v heads into the paged cache at its slot, stored as the cache's kv_type (kv_types.h:
 * float32, float16, bfloat16 or q8_0). qkv is [T, (Hq + 2 Hkv) * D], caches [num_slots, Hkv, row].
 * D and R must be multiples of 16 (of 32 for q8_0), R <= D. */
void orca_rope_and_cache(float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t R,
                         const int64_t *positions, const float *cos_sin, const int64_t *slots, void *k_cache,
                         void *v_cache, int kv_type) {
    const int64_t width = (Hq + 2 * Hkv) * D, half = R / 2, row_bytes = kv_row_bytes(kv_type, D);
#pragma omp parallel for schedule(static) if (T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *cs = cos_sin + positions[t] * R;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float *x = row + h * D;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(cs + half + i);
                const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
                _mm256_storeu_ps(x + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
                _mm256_storeu_ps(x + half + i, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
            }
        }
        uint8_t *kd = (uint8_t *)k_cache + slots[t] * Hkv * row_bytes, *vd = (uint8_t *)v_cache + slots[t] * Hkv * row_bytes;
        const float *ks = row + Hq * D, *vs = row + (Hq + Hkv) * D;
        for (int64_t h = 0; h < Hkv; h++) {
            kv_store_row(ks + h * D, D, kd + h * row_bytes, kv_type);
            kv_store_row(vs + h * D, D, vd + h * row_bytes, kv_type);
        }
    }
}

/* out[t] = gelu_tanh(x[t, :d]) * x[t, d:] for x [T, 2d] (gate | up), d a multiple of 8: Gemma's MLP.
 * gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), computed as its equal
 * g / (1 + e^(-2u)): one exp, and exp8's clamp gives the right limits at both ends. */
void orca_gelu_tanh_and_mul(const float *x, int64_t T, int64_t d, float *out) {
#pragma omp parallel for schedule(static) if (T >= PARALLEL_MIN_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        const __m256 minus_2c = _mm256_set1_ps(-2.0f * 0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
        const __m256 one = _mm256_set1_ps(1.0f);
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 inner = _mm256_mul_ps(gv, _mm256_add_ps(one, _mm256_mul_ps(k, _mm256_mul_ps(gv, gv))));
            const __m256 e = exp8(_mm256_mul_ps(minus_2c, inner));
            const __m256 gelu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
        }
    }
}
