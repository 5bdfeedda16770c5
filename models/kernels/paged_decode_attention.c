/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * out[i, h] = softmax(scale * q[i, h] . K[i, :len_i]) @ V[i, :len_i], where token t of sequence i
 * lives in block block_tables[i, t / block_size] at offset t % block_size, and query head h reads KV
 * head h / (Hq / Hkv) (GQA). The torch fallback gathers every sequence's whole history into a padded
 * tensor per layer and runs a masked SDPA over it; at batch 64 on a 2-core CPU that copy and the
 * padded SDPA took a quarter of each decode step. Here K and V are read in place, once.
 *
 * Softmax is computed online (running max and sum, as flash attention does) over tiles of 8 tokens,
 * so no per-sequence score buffer is needed whatever the context length. AVX2 + FMA; OpenMP over
 * (sequence, query head) pairs.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* The 8 horizontal sums of a[0..7], in order, as one vector. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define MAX_HEAD_DIM 256
#define PREFETCH_TOKENS 16

/* DV = head_dim / 8, a compile-time constant in the common cases so q and the output accumulator
 * stay in registers. */
static inline __attribute__((always_inline)) void one_head(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t seq_len,
    int64_t block_size, int64_t token_stride, const int64_t DV, float scale, float *out) {
    __m256 qv[MAX_HEAD_DIM / 8], acc[MAX_HEAD_DIM / 8];
    for (int64_t d = 0; d < DV; d++) {
        qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * d), _mm256_set1_ps(scale));
        acc[d] = _mm256_setzero_ps();
    }
    float m = -INFINITY, l = 0.0f;
    int64_t block = 0, offset = 0;
    int64_t pf_t = 0, pf_block = 0, pf_offset = 0; /* the prefetch cursor */
    for (int64_t t0 = 0; t0 < seq_len; t0 += 8) {
        const int n = seq_len - t0 < 8 ? (int)(seq_len - t0) : 8;
        const float *kr[8], *vr[8];
        for (int j = 0; j < n; j++) {
            /* Walk the block table without a division per token. */
            const int64_t slot = (int64_t)table[block] * block_size + offset;
            kr[j] = k_cache + slot * token_stride;
            vr[j] = v_cache + slot * token_stride;
            if (++offset == block_size) {
                offset = 0;
                block++;
            }
        }
        /* Long histories are bound by memory latency (rows scattered over blocks): keep the K and V
         * rows PREFETCH_TOKENS ahead of this tile on their way in while it computes. */
        for (const int64_t end = t0 + 8 + PREFETCH_TOKENS < seq_len ? t0 + 8 + PREFETCH_TOKENS : seq_len;
             pf_t < end; pf_t++) {
            const int64_t slot = (int64_t)table[pf_block] * block_size + pf_offset;
            for (int64_t c = 0; c < DV * 8; c += 16) {
                _mm_prefetch((const char *)(k_cache + slot * token_stride + c), _MM_HINT_T0);
                _mm_prefetch((const char *)(v_cache + slot * token_stride + c), _MM_HINT_T0);
            }
            if (++pf_offset == block_size) {
                pf_offset = 0;
                pf_block++;
            }
        }
        __m256 dots[8];
        for (int j = 0; j < 8; j++) dots[j] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++)
            for (int64_t d = 0; d < DV; d++) dots[j] = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kr[j] + 8 * d), dots[j]);
        float s[8] __attribute__((aligned(32)));
        _mm256_store_ps(s, hsum8x8(dots));
        for (int j = n; j < 8; j++) s[j] = -INFINITY;  /* padding: exp gives 0 */
        const __m256 sv = _mm256_load_ps(s);
        const float m_new = fmaxf(m, hmax8(sv));
        const float correction = expf(m - m_new);  /* 0 on the first tile (m = -inf) */
        float p[8] __attribute__((aligned(32)));
        _mm256_store_ps(p, exp8(_mm256_sub_ps(sv, _mm256_set1_ps(m_new))));
        for (int j = n; j < 8; j++) p[j] = 0.0f;
        l = l * correction + hsum8(_mm256_load_ps(p));
        const __m256 c = _mm256_set1_ps(correction);
        for (int64_t d = 0; d < DV; d++) acc[d] = _mm256_mul_ps(acc[d], c);
        for (int j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int64_t d = 0; d < DV; d++) acc[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr[j] + 8 * d), acc[d]);
        }
        m = m_new;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / l);
    for (int64_t d = 0; d < DV; d++) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inv));
}

/* q, out: [n, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [n, max_blocks] int32;
 * seq_lens: [n] int32. Returns nonzero for shapes it does not handle (D not a multiple of 8 or > 256). */
int orca_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *block_tables, const int32_t *seq_lens, int64_t n, int64_t Hq,
                                int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, float scale,
                                float *out) {
    if (D % 8 != 0 || D > MAX_HEAD_DIM || Hq % Hkv != 0 || n <= 0) return 1;
    const int64_t group = Hq / Hkv;
    const int64_t token_stride = Hkv * D;
    /* A thread takes all the heads of a sequence in a row, so the rest of each K/V row it fetches for
     * one KV head is still in its cache for the next (8-10% faster at batch >= 8 from DRAM); a
     * batch too small to keep both threads busy that way is split by head. */
    const int64_t chunk = n >= 4 ? Hq : 1;
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t task = 0; task < n * Hq; task++) {
        const int64_t i = task / Hq, h = task % Hq, kvh = h / group;
        const float *qh = q + task * D, *kh = k_cache + kvh * D, *vh = v_cache + kvh * D;
        const int32_t *table = block_tables + i * max_blocks;
        if (D == 64)
            one_head(qh, kh, vh, table, seq_lens[i], block_size, token_stride, 8, scale, out + task * D);
        else if (D == 128)
            one_head(qh, kh, vh, table, seq_lens[i], block_size, token_stride, 16, scale, out + task * D);
        else
            one_head(qh, kh, vh, table, seq_lens[i], block_size, token_stride, D / 8, scale, out + task * D);
    }
    return 0;
}
