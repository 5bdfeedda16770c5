/* Decode attention straight from the paged KV cache: one query token per sequence.
 *
 * out[i, h] = softmax(scale * q[i, h] . K[i, :len_i]) @ V[i, :len_i], where token t of sequence i
 * lives in block block_tables[i, t / block_size] at offset t % block_size, and query head h reads KV
 * head h / (Hq / Hkv) (GQA). The torch fallback gathers every sequence's whole history into a padded
 * tensor per layer and runs a masked SDPA over it; here K and V are read in place.
 *
 * Work: the query heads that share a KV head are computed together, so each K and V row is fetched
 * from memory once for all of them, not once per query head (3x fewer row fetches for SmolLM2's 9/3
 * heads: the old per-head split ran at 5-8 GB/s, far under what the cores can read). A sequence's
 * history is cut into spans of SPAN_TOKENS, a fixed length, so that one sequence keeps both threads
 * busy and long histories spread over all of them; each span's partial softmax (running max, sum,
 * weighted V) is merged in span order as flash-decoding does (rescaled by e^(m_span - m)). The split
 * depends only on the sequence's own length, never on the batch or the thread count, so a request's
 * output never depends on what shares its batch.
 *
 * Sliding-window attention (window > 0): the query, at position len_i - 1, sees only the last `window`
 * keys (transformers' convention: itself and the window - 1 before it). The spans stay aligned to
 * absolute positions (span c covers [64c, 64c + 64)); the first one is cut at the window's start and
 * spans wholly before it are skipped, so the split still depends on the sequence alone.
 *
 * The cache's element type (--kv-cache-dtype: float32, float16, bfloat16 or q8_0, kv_types.h) is read in
 * place: a span's rows are read from memory in that type and widened to float32 once, into a buffer
 * that stays in L1/L2 (q8_0: int8 codes times the block's half scale), so a 16-bit cache moves half
 * the bytes of float32 and q8_0 about 0.27 of them, and the result equals this kernel run on the same
 * values stored as float32, bit for bit. (Widening in the inner loops instead converted each K and V
 * row once per query head of the group: 0.7x float32's time at a third to half of its bytes.)
 *
 * Within a span: the scores of every head (8 tokens at a time, as 8 independent multiply-add chains),
 * the softmax (max, exp, sum), then the weighted V rows; nothing grows with the context. AVX2 + FMA;
 * OpenMP over (span, group of query heads) tasks. Measured on a 2-core AVX2 EPYC, 30 layers from
 * DRAM: 1.3-1.4x faster than the per-head online softmax it replaced at batch 1, 8 and 32.
 *
 * Tasks over every KV head (heads_span; AVX-512VL, a 16-bit or q8_0 cache, up to 4 query heads a KV
 * head, from HEADS_MIN_SPANS spans a call): the cache puts a token's rows of all KV heads side by side,
 * so a task per KV head reads 128-byte pieces a row apart (1 KB for Llama-3.2-1B's 8 heads of 64), and
 * DRAM delivered those at 6-8 GB/s where block-sized runs come at 25-30. One task per span walks its
 * rows in address order instead: 16 tokens of every head's scores, then the softmaxes, then the
 * weighted V rows likewise, each row's arithmetic fetching the row 16 tokens on (heads_span), so the
 * next task (taken one ahead) has its first rows on the way. Each head's arithmetic is direct_span's
 * (on 512-bit registers, with the 256-bit code's lanes), so the bits do not move. 2-core Zen 5,
 * Llama-3.2-1B's heads, a float16 or bfloat16 cache in shuffled blocks, 16 layers from DRAM: batch 32 at 144 tokens 1.19-1.53 ->
 * 0.56-0.62 ms a layer, batch 1 at 4,096 tokens 1.06-1.32 -> 0.46-0.55 ms (6-8 -> 15-18 GB/s).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_types.h"
#include "simd.h"

/* The 8 horizontal sums of a[0..7], in order, as one vector. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The direct path and heads_span: AVX-512 (VL for 32 vector registers, DQ for 256-bit halves of 512-bit ones). */
#if defined(__AVX512VL__) && defined(__AVX512DQ__)
#define DIRECT_PATH 1
#else
#define DIRECT_PATH 0
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 8      /* query heads computed together (a larger GQA group is cut into sub-groups) */
#define MAX_QUERIES 32   /* (row, head) queries of one task: a run's rows times its heads */
#define SPAN_TOKENS 64   /* tokens of history per task; fixed, so the split is batch-invariant */
#define PREFETCH_TOKENS 16

/* One query's scores s [nh rounded up to 8] (the first nh real) turned into e^(s - m): m the largest,
 * l their sum; the masked tail is -inf for the max and 0 after (exp8 clamps at e^-88, not 0). Both
 * paths below run this same code, so a query's softmax is the same bits in either. */
static inline __attribute__((always_inline)) void softmax_row(float *sh, int64_t nh, float *mh, float *lh) {
    const int64_t nh8 = (nh + 7) & ~(int64_t)7;
    for (int64_t j = nh; j < nh8; j++) sh[j] = -INFINITY;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t t0 = 0; t0 < nh8; t0 += 8) mv = _mm256_max_ps(mv, _mm256_load_ps(sh + t0));
    *mh = hmax8(mv);
    const __m256 mb = _mm256_set1_ps(*mh);
    __m256 lv = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < nh8; t0 += 8) _mm256_store_ps(sh + t0, exp8(_mm256_sub_ps(_mm256_load_ps(sh + t0), mb)));
    for (int64_t j = nh; j < nh8; j++) sh[j] = 0.0f;
    for (int64_t t0 = 0; t0 < nh8; t0 += 8) lv = _mm256_add_ps(lv, _mm256_load_ps(sh + t0));
    *lh = hsum8(lv);
}

#if DIRECT_PATH
/* The 4 horizontal sums of a[0..3], each summed as hsum8x8 sums it ((l0 + l1) + (l2 + l3)) + ((l4 + l5)
 * + (l6 + l7)), so a score is the same bits from either tile width. */
static inline __m128 hsum4x8(const __m256 *a) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

#define DIRECT_QUERIES 4 /* queries the direct path takes: 4 x 4 score and 4 x 4 V accumulators */

/* group_span for at most DIRECT_QUERIES queries over a narrow cache (16-bit, q8_0), reading the rows
 * in their own type straight into registers: widening a span into a float32 buffer first costs one
 * store per 8 values, which for one row's 3-4 heads took as long as its multiply-adds. With AVX-512VL's
 * 32 vector registers one load and conversion of a K or V row serves every query. Each query's
 * arithmetic is the buffered path's, operation for operation (same FMA order, hsum4x8 = hsum8x8 per
 * token, the shared softmax_row; tokens past a query's own are weighted by exactly 0), so a row
 * gives the same bits whichever path its task took. */
/* Lines [from, from + count) of the cache lines a row of `bytes` bytes at `row` touches (those past its
 * end skipped), on their way into L1. */
static inline __attribute__((always_inline)) void prefetch_row_lines(const uint8_t *row, int64_t bytes, int64_t from,
                                                                     int64_t count) {
    const uintptr_t first = (uintptr_t)row & ~(uintptr_t)63, last = ((uintptr_t)row + bytes - 1) & ~(uintptr_t)63;
    for (uintptr_t p = first + 64 * (uintptr_t)from; p <= last && count > 0; p += 64, count--)
        _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* The most cache lines a row of `bytes` bytes touches, wherever it starts. */
static inline int64_t row_lines(int64_t bytes) { return (bytes + 63) / 64 + (bytes % 64 != 0); }

/* The scores of NQ queries (q [NQ, D], scaled) against tokens [j0, j1) of a span of n (j0 a multiple of 8),
 * 8 tokens a tile, into s[h][j] (a short last tile reads token 0 for its missing rows: masked later).
 * Two tokens a 512-bit register (the same 8 values of each row side by side) against the query's 8 values
 * twice, so each token's 8 lanes are the chains a 256-bit register of its own would hold, summed by
 * hsum4x8: the bits of 256-bit tiles, at half the multiply-adds. 8 tokens, not 4, so that 3-4 queries
 * keep 12-16 independent chains in flight (4 tokens' 6-8 waited on the multiply-add's latency: no
 * faster than 256-bit tiles). pf (or NULL): with token j's tile, the row pf[j] (row_bytes, NULL for none)
 * is fetched into L1. */
static inline __attribute__((always_inline)) void direct_scores(const float *q, const uint8_t *const *kr, int64_t j0,
                                                                int64_t j1, int64_t n, const int64_t DV, const int kvt,
                                                                const int NQ, float (*s)[SPAN_TOKENS],
                                                                const uint8_t *const *pf, int64_t row_bytes) {
    const int64_t D = DV * 8;
    for (int64_t t0 = j0; t0 < j1; t0 += 8) {
        const uint8_t *kt[8];
        for (int j = 0; j < 8; j++) kt[j] = kr[t0 + j < n ? t0 + j : 0]; /* a short tile reads token 0 */
        if (pf)
            for (int64_t j = t0; j < t0 + 8 && j < j1; j++)
                if (pf[j]) prefetch_row_lines(pf[j], row_bytes, 0, row_lines(row_bytes));
        __m512 dots[DIRECT_QUERIES][4];
        for (int h = 0; h < NQ; h++)
            for (int p = 0; p < 4; p++) dots[h][p] = _mm512_setzero_ps();
        for (int64_t d = 0; d < DV; d++) {
            __m512 kv[4];
            for (int p = 0; p < 4; p++) kv[p] = kv_load8x2(kt[2 * p], kt[2 * p + 1], 8 * d, kvt);
            for (int h = 0; h < NQ; h++) {
                const __m512 qd = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + h * D + 8 * d));
                for (int p = 0; p < 4; p++) dots[h][p] = _mm512_fmadd_ps(qd, kv[p], dots[h][p]);
            }
        }
        for (int h = 0; h < NQ; h++)
            for (int p = 0; p < 4; p += 2) {
                const __m256 tiles[4] = {_mm512_castps512_ps256(dots[h][p]), _mm512_extractf32x8_ps(dots[h][p], 1),
                                         _mm512_castps512_ps256(dots[h][p + 1]),
                                         _mm512_extractf32x8_ps(dots[h][p + 1], 1)};
                _mm_store_ps(s[h] + t0 + 2 * p, hsum4x8(tiles));
            }
    }
}

/* acc [NQ, D] (+)= sum over tokens [j0, j1) of s[h][j] v_j, from zero when `first`: per element the same
 * multiply-adds in token order however the span's tokens are cut into ranges, and whatever the vector
 * width (an element's chain is its own lane's), so 512-bit vectors where the row splits into them (16
 * values each: on Zen 5 as many multiply-adds a cycle as 256-bit ones, each twice the work) give the
 * bits of 256-bit ones. Chunks of 4 vectors a pass over the tokens, their accumulators in registers.
 * pf (or NULL): while token j's chunk c is weighted, the row pf[j] (row_bytes) is fetched into L1, its
 * c-th share of lines a chunk. */
#define VALUES_PASS(VEC, WIDTH, ZERO, LOADU, STOREU, SET1, FMADD, LOAD_ROW)                                    \
    do {                                                                                                      \
        const int64_t DW = DV * 8 / (WIDTH), chunks = (DW + 3) / 4;                                           \
        const int64_t per_chunk = (row_lines(row_bytes) + chunks - 1) / chunks;                               \
        for (int64_t d0 = 0; d0 < DW; d0 += 4) {                                                              \
            const int64_t dn = DW - d0 < 4 ? DW - d0 : 4;                                                     \
            VEC a[DIRECT_QUERIES][4];                                                                         \
            for (int h = 0; h < NQ; h++)                                                                      \
                for (int64_t d = 0; d < 4; d++)                                                               \
                    a[h][d] = first || d >= dn ? ZERO() : LOADU(acc + h * D + (WIDTH) * (d0 + d));            \
            for (int64_t j = j0; j < j1; j++) {                                                               \
                if (pf && pf[j]) prefetch_row_lines(pf[j], row_bytes, d0 / 4 * per_chunk, per_chunk);        \
                VEC vv[4];                                                                                    \
                for (int64_t d = 0; d < dn; d++) vv[d] = LOAD_ROW(vr[j], (WIDTH) * (d0 + d), kvt);            \
                for (int h = 0; h < NQ; h++) {                                                                \
                    const VEC pj = SET1(s[h][j]);                                                             \
                    for (int64_t d = 0; d < dn; d++) a[h][d] = FMADD(pj, vv[d], a[h][d]);                     \
                }                                                                                             \
            }                                                                                                 \
            for (int h = 0; h < NQ; h++)                                                                      \
                for (int64_t d = 0; d < dn; d++) STOREU(acc + h * D + (WIDTH) * (d0 + d), a[h][d]);           \
        }                                                                                                     \
    } while (0)
static inline __attribute__((always_inline)) void direct_values(const float (*s)[SPAN_TOKENS], const uint8_t *const *vr,
                                                                int64_t j0, int64_t j1, const int64_t DV,
                                                                const int kvt, const int NQ, int first, float *acc,
                                                                const uint8_t *const *pf, int64_t row_bytes) {
    const int64_t D = DV * 8;
    if (DV % 2 == 0)
        VALUES_PASS(__m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps,
                    _mm512_fmadd_ps, kv_load16);
    else
        VALUES_PASS(__m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps,
                    _mm256_fmadd_ps, kv_load8);
}

/* The softmax of each query's scores over its nv[h] tokens; tiles past a query's own weighted 0. */
static inline __attribute__((always_inline)) void direct_softmax(float (*s)[SPAN_TOKENS], int64_t n, const int64_t *nv,
                                                                 const int NQ, float *m, float *l) {
    for (int h = 0; h < NQ; h++) {
        softmax_row(s[h], nv[h], m + h, l + h);
        for (int64_t j = (nv[h] + 7) & ~(int64_t)7; j < n; j++) s[h][j] = 0.0f;
    }
}

static inline __attribute__((always_inline)) void direct_span(const float *q, const uint8_t *const *kr,
                                                              const uint8_t *const *vr, int64_t n,
                                                              const int64_t *nv, const int64_t DV, const int kvt,
                                                              const int NQ, float *acc, float *m, float *l) {
    float s[DIRECT_QUERIES][SPAN_TOKENS] __attribute__((aligned(32)));
    direct_scores(q, kr, 0, n, n, DV, kvt, NQ, s, NULL, 0);
    direct_softmax(s, n, nv, NQ, m, l);
    direct_values((const float(*)[SPAN_TOKENS])s, vr, 0, n, DV, kvt, NQ, 1, acc, NULL, 0);
}

/* Tokens a range of a span that heads_span walks all KV heads over before the next: a block's worth,
 * so that its rows (contiguous in the cache: every head's row of a token side by side) are read together. */
#define RANGE_TOKENS 16
/* How far ahead heads_span fetches rows, in tokens of the same head: one range. (8 tokens lost 20% from
 * DRAM, 24 tied, 32 lost 3-10%: fetched further ahead, rows are evicted from L1 before they are read.) */
#define FETCH_AHEAD 16
#define HEADS_MAX_QUERIES 64 /* query heads heads_span takes */
#define HEADS_MAX_FLOATS (HEADS_MAX_QUERIES * MAX_HEAD_DIM / 2) /* and their values: Hq x D */

/* A span of one sequence for every KV head (NQ query heads each), the span's K and V rows walked in
 * address order: the scores of every head over a range of tokens, range after range, then the softmaxes,
 * then the weighted V rows likewise. Each head's arithmetic is direct_span's, so the bits are the same.
 * Per KV head the rows lie in 128-byte pieces a token apart (row bytes x KV heads); reading one head's
 * pieces over a whole span before the next head's (one task per head) read DRAM at a third of the
 * bandwidth a block-sized run gets. tok [n]: the byte offset of each token's rows in the caches.
 *
 * Fetching: the rows are read as one stream, K of tokens 0..n-1, V of tokens 0..n-1, then K of the next
 * task's first tokens (next_tok [next_n], offsets as tok's; none when next_n is 0), and the arithmetic on
 * one row of the stream fetches the row FETCH_AHEAD tokens after it (same head) into L1: a line a chunk of
 * weighted V, a row a tile of scores. Spread so, the fetches keep memory busy while the arithmetic runs.
 * Issued in bursts (a slice of the next range's rows, every head's, before each head's work) they did
 * not: the burst filled the core's miss buffers and the arithmetic behind it waited for DRAM, so the two
 * took the sum of their times (2-core Zen 5, 3B's heads from DRAM at batch 32, 160 tokens: 0.87-0.93 ms
 * a layer; spread 0.67-0.69, with the next task's first rows fetched the same way rather than at its
 * start; 1B's heads 0.55 -> 0.33 ms, 4,096 tokens at batch 1 0.42 -> 0.26-0.29). */
static inline __attribute__((always_inline)) void heads_span(const float *qs, const uint8_t *k_cache,
                                                             const uint8_t *v_cache, const int64_t *tok, int64_t n,
                                                             const int64_t *next_tok, int64_t next_n, int64_t Hkv,
                                                             const int64_t DV, const int kvt, const int NQ,
                                                             float *acc, float *m, float *l) {
    const int64_t D = DV * 8, row_bytes = kv_row_bytes(kvt, D);
    float s[HEADS_MAX_QUERIES][SPAN_TOKENS] __attribute__((aligned(32)));
    const uint8_t *kr[SPAN_TOKENS], *vr[SPAN_TOKENS], *ahead[SPAN_TOKENS];
    int64_t nv[DIRECT_QUERIES];
    for (int h = 0; h < NQ; h++) nv[h] = n;
    for (int64_t j0 = 0; j0 < n; j0 += RANGE_TOKENS) {
        const int64_t j1 = j0 + RANGE_TOKENS < n ? j0 + RANGE_TOKENS : n;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const int64_t head = kvh * row_bytes;
            kr[0] = k_cache + tok[0] + head; /* what a short tile's missing rows read */
            for (int64_t j = j0; j < j1; j++) {
                const int64_t a = j + FETCH_AHEAD; /* K rows, then the first V rows */
                kr[j] = k_cache + tok[j] + head;
                ahead[j] = a < n ? k_cache + tok[a] + head : a - n < n ? v_cache + tok[a - n] + head : NULL;
            }
            direct_scores(qs + kvh * NQ * D, kr, j0, j1, n, DV, kvt, NQ, s + kvh * NQ, ahead, row_bytes);
        }
    }
    for (int64_t kvh = 0; kvh < Hkv; kvh++) direct_softmax(s + kvh * NQ, n, nv, NQ, m + kvh * NQ, l + kvh * NQ);
    for (int64_t j0 = 0; j0 < n; j0 += RANGE_TOKENS) {
        const int64_t j1 = j0 + RANGE_TOKENS < n ? j0 + RANGE_TOKENS : n;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const int64_t head = kvh * row_bytes;
            for (int64_t j = j0; j < j1; j++) {
                const int64_t a = j + FETCH_AHEAD; /* V rows, then the next task's first K rows */
                vr[j] = v_cache + tok[j] + head;
                ahead[j] = a < n ? v_cache + tok[a] + head : a - n < next_n ? k_cache + next_tok[a - n] + head : NULL;
            }
            direct_values((const float(*)[SPAN_TOKENS])(s + kvh * NQ), vr, j0, j1, DV, kvt, NQ, j0 == 0,
                          acc + kvh * NQ * D, ahead, row_bytes);
        }
    }
}
#endif

/* off [n]: where tokens t_begin.. of a history (block table `table`) lie, as multiples of token_stride
 * bytes from the cache's start; the block table walked without a division per token. */
static inline void token_offsets(const int32_t *table, int64_t t_begin, int64_t n, int64_t block_size,
                                 int64_t token_stride, int64_t *off) {
    int64_t block = t_begin / block_size, offset = t_begin % block_size;
    for (int64_t j = 0; j < n; j++) {
        off[j] = ((int64_t)table[block] * block_size + offset) * token_stride;
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
}

/* Attention of nq queries (q [nq, D], already scaled) sharing one KV head over tokens [t_begin,
 * t_begin + n) of one history (n at most SPAN_TOKENS), query i seeing the first nv[i] of them (a run's
 * earlier rows see fewer: their positions come before the later rows'): acc [nq, D] gets
 * sum_j e^(s_j - m) v_j, m[i] the largest score and l[i] the sum of e^(s_j - m). Three passes over the
 * span, each a tight loop: the scores (a K row read once into L1 serves every query), the softmax, the
 * weighted V rows. Each query's arithmetic is exactly what it would be alone over its nv[i] tokens
 * (same tiles, same order, its masked tail set to -inf and then 0), so grouping changes no bit. */
static inline __attribute__((always_inline)) void group_span(
    const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table, int64_t t_begin,
    const int64_t *nv, int64_t block_size, int64_t token_stride, const int64_t DV, const int kvt, int64_t nq,
    float *acc, float *m, float *l) {
    int64_t n = 0;
    for (int64_t h = 0; h < nq; h++) n = nv[h] > n ? nv[h] : n;
    const int64_t n8 = (n + 7) & ~(int64_t)7, row_bytes = kv_row_bytes(kvt, DV * 8);
    const uint8_t *kr[SPAN_TOKENS], *vr[SPAN_TOKENS];
    int64_t off[SPAN_TOKENS];
    token_offsets(table, t_begin, n, block_size, token_stride, off);
    for (int64_t j = 0; j < n; j++) {
        kr[j] = k_cache + off[j];
        vr[j] = v_cache + off[j];
    }
#if DIRECT_PATH
    if (kvt != KV_F32 && nq <= DIRECT_QUERIES) {
        switch (nq) { /* constant query counts: the accumulators stay in registers */
        case 1: direct_span(q, kr, vr, n, nv, DV, kvt, 1, acc, m, l); return;
        case 2: direct_span(q, kr, vr, n, nv, DV, kvt, 2, acc, m, l); return;
        case 3: direct_span(q, kr, vr, n, nv, DV, kvt, 3, acc, m, l); return;
        default: direct_span(q, kr, vr, n, nv, DV, kvt, 4, acc, m, l); return;
        }
    }
#endif
    const int64_t D = DV * 8;
    const float *kf[SPAN_TOKENS], *vf[SPAN_TOKENS];
    /* A narrow cache (16-bit, q8_0) is widened once per span into float32 rows that stay in L1/L2
     * (64 tokens x D floats for K and for V), so each row is converted once, not once per query head
     * of the group; the passes below then run exactly as over a float32 cache. The rows are read
     * from memory in their own type, in token order, fetched PREFETCH_TOKENS ahead. */
    float wide[kvt == KV_F32 ? 1 : 2 * SPAN_TOKENS * DV * 8] __attribute__((aligned(32)));
    if (kvt == KV_F32) {
        for (int64_t j = 0; j < n; j++) {
            kf[j] = (const float *)kr[j];
            vf[j] = (const float *)vr[j];
        }
        /* Rows are scattered over blocks: while the first head's scores read K, the V rows of the
         * same tokens are fetched for the last pass, and the K rows a few tiles ahead. */
        for (int64_t j = 0; j < n && j < PREFETCH_TOKENS; j++)
            for (int64_t c = 0; c < D; c += 16) _mm_prefetch((const char *)(kf[j] + c), _MM_HINT_T0);
    } else {
        for (int64_t j = 0; j < n && j < PREFETCH_TOKENS; j++)
            for (int64_t c = 0; c < row_bytes; c += 64) {
                _mm_prefetch((const char *)(kr[j] + c), _MM_HINT_T0);
                _mm_prefetch((const char *)(vr[j] + c), _MM_HINT_T0);
            }
        for (int64_t j = 0; j < n; j++) {
            if (j + PREFETCH_TOKENS < n)
                for (int64_t c = 0; c < row_bytes; c += 64) {
                    _mm_prefetch((const char *)(kr[j + PREFETCH_TOKENS] + c), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vr[j + PREFETCH_TOKENS] + c), _MM_HINT_T0);
                }
            float *kw = wide + j * D, *vw = wide + (SPAN_TOKENS + j) * D;
            for (int64_t d = 0; d < DV; d++) {
                _mm256_store_ps(kw + 8 * d, kv_load8(kr[j], 8 * d, kvt));
                _mm256_store_ps(vw + 8 * d, kv_load8(vr[j], 8 * d, kvt));
            }
            kf[j] = kw;
            vf[j] = vw;
        }
    }
    /* Tiles of 8 tokens; the last one's missing rows point at the first (their scores are masked). */
    for (int64_t j = n; j < n8; j++) kf[j] = kf[0];
    float s[MAX_QUERIES][SPAN_TOKENS] __attribute__((aligned(32)));
    for (int64_t h = 0; h < nq; h++) {
        const float *qh = q + h * D;
        const int64_t nh = nv[h], nh8 = (nh + 7) & ~(int64_t)7;
        const float *kh[SPAN_TOKENS];
        for (int64_t j = 0; j < nh8; j++) kh[j] = j < nh ? kf[j] : kf[0];
        for (int64_t t0 = 0; t0 < nh; t0 += 8) {
            if (h == 0 && kvt == KV_F32)
                for (int64_t j = t0; j < t0 + 8 && j < n; j++)
                    for (int64_t c = 0; c < D; c += 16) {
                        if (j + PREFETCH_TOKENS < n) _mm_prefetch((const char *)(kf[j + PREFETCH_TOKENS] + c), _MM_HINT_T0);
                        _mm_prefetch((const char *)(vf[j] + c), _MM_HINT_T1);
                    }
            /* k outer, token inner: 8 independent multiply-add chains, not one chain per token. */
            const float *const *kt = kh + t0;
            __m256 dots[8];
            for (int j = 0; j < 8; j++) dots[j] = _mm256_setzero_ps();
            for (int64_t d = 0; d < DV; d++) {
                const __m256 qd = _mm256_loadu_ps(qh + 8 * d);
                for (int j = 0; j < 8; j++) dots[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt[j] + 8 * d), dots[j]);
            }
            _mm256_store_ps(s[h] + t0, hsum8x8(dots));
        }
        softmax_row(s[h], nh, m + h, l + h);
    }
    /* Weighted V rows, 8 vectors of the head at a time (more would not stay in registers). */
    for (int64_t h = 0; h < nq; h++)
        for (int64_t d0 = 0; d0 < DV; d0 += 8) {
            const int64_t dn = DV - d0 < 8 ? DV - d0 : 8;
            __m256 a[8];
            for (int64_t d = 0; d < dn; d++) a[d] = _mm256_setzero_ps();
            for (int64_t j = 0; j < nv[h]; j++) {
                const __m256 pj = _mm256_set1_ps(s[h][j]);
                for (int64_t d = 0; d < dn; d++) a[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vf[j] + 8 * (d0 + d)), a[d]);
            }
            for (int64_t d = 0; d < dn; d++) _mm256_storeu_ps(acc + h * DV * 8 + 8 * (d0 + d), a[d]);
        }
}

/* A run: rows first..first + rows - 1 of the batch that read one history (a verification's rows:
 * consecutive positions over the same block table), so one task per span and head group serves them
 * all. Row r's query is at position lens[r] - 1 and sees keys [lo, lens[r]). */
typedef struct {
    int64_t first, rows;
    int64_t lo;          /* the first key any row sees (0, or a lone row's window start) */
    int64_t span_begin;  /* the run's first span among all tasks' spans */
} run_t;

/* The absolute span (positions [64 abs, 64 abs + 64)) of the call's span c, which belongs to `run`. */
static inline int64_t abs_span_of(const run_t *run, int64_t c) { return run->lo / SPAN_TOKENS + (c - run->span_begin); }

/* The first key of span abs_span that a row of `run` sees, and the end of a history of len tokens there. */
static inline int64_t span_first(const run_t *run, int64_t abs_span) {
    return abs_span * SPAN_TOKENS > run->lo ? abs_span * SPAN_TOKENS : run->lo;
}
static inline int64_t span_end(int64_t abs_span, int64_t len) {
    return (abs_span + 1) * SPAN_TOKENS < len ? (abs_span + 1) * SPAN_TOKENS : len;
}

/* Query (row i, head h)'s result over span abs_span (acc [D], m, l): its output (acc / l) if the row has
 * one span, else its partial, at the span's index among the row's. */
static inline __attribute__((always_inline)) void store_query(const float *acc, float m, float l, const run_t *run,
                                                              int64_t abs_span, int64_t i, int64_t h, int64_t Hq,
                                                              const int64_t DV, const int64_t *part_start,
                                                              float *out, float *part, int64_t span_stride) {
    const int64_t D = DV * 8;
    if (part_start[i + 1] == part_start[i]) { /* a row of one span: its output directly */
        const __m256 inv = _mm256_set1_ps(1.0f / l);
        for (int64_t d = 0; d < DV; d++)
            _mm256_storeu_ps(out + (i * Hq + h) * D + 8 * d, _mm256_mul_ps(_mm256_load_ps(acc + 8 * d), inv));
        return;
    }
    float *ph = part + (part_start[i] + abs_span - run->lo / SPAN_TOKENS) * span_stride + h * (D + 2);
    for (int64_t d = 0; d < D; d++) ph[d] = acc[d];
    ph[D] = m;
    ph[D + 1] = l;
}

/* One task: heads h0..h0 + g - 1 of every row of `run` whose history reaches span `abs_span` (absolute:
 * positions [64 abs_span, 64 abs_span + 64), cut to the run's first key and each row's length). A row
 * of one span writes its output (acc / l) directly; otherwise its span's partial goes to part (per
 * head: acc [D], m, l) at its own span index. */
static inline __attribute__((always_inline)) void run_task(
    const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table, const run_t *run,
    const int32_t *seq_lens, const int64_t *part_start, int64_t abs_span, int64_t h0, int64_t g, int64_t Hq,
    int64_t group, int64_t Hkv, int64_t block_size, const int64_t DV, const int kvt, float scale, float *out,
    float *part, int64_t span_stride) {
    const int64_t D = DV * 8, kvh = h0 / group, row_bytes = kv_row_bytes(kvt, D);
    const int64_t t_begin = span_first(run, abs_span);
    float qs[MAX_QUERIES * MAX_HEAD_DIM] __attribute__((aligned(32)));
    float acc[MAX_QUERIES * MAX_HEAD_DIM] __attribute__((aligned(32)));
    float m[MAX_QUERIES], l[MAX_QUERIES];
    int64_t nv[MAX_QUERIES], row_of[MAX_QUERIES];
    int64_t nq = 0;
    for (int64_t r = 0; r < run->rows; r++) {
        const int64_t i = run->first + r, len = seq_lens[i];
        if (len <= t_begin) continue; /* an earlier row of the run, whose history ends before this span */
        const int64_t t_end = span_end(abs_span, len);
        for (int64_t h = 0; h < g; h++, nq++) {
            nv[nq] = t_end - t_begin;
            row_of[nq] = i;
            for (int64_t d = 0; d < DV; d++)
                _mm256_store_ps(qs + nq * D + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(q + (i * Hq + h0 + h) * D + 8 * d),
                                                                   _mm256_set1_ps(scale)));
        }
    }
    group_span(qs, k_cache + kvh * row_bytes, v_cache + kvh * row_bytes, table, t_begin, nv, block_size,
               Hkv * row_bytes, DV, kvt, nq, acc, m, l);
    for (int64_t k = 0; k < nq; k++)
        store_query(acc + k * D, m[k], l[k], run, abs_span, row_of[k], h0 + k % g, Hq, DV, part_start, out, part,
                    span_stride);
}

#if DIRECT_PATH
/* run_task for a one-row run over all query heads at once (heads_span): group (<= DIRECT_QUERIES) query
 * heads a KV head, a 16-bit or q8_0 cache. */
static inline __attribute__((always_inline)) void run_heads_task(
    const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table, const run_t *run,
    const int32_t *seq_lens, const int64_t *part_start, int64_t abs_span, int64_t Hq, int64_t Hkv,
    int64_t block_size, const int64_t DV, const int kvt, const int NQ, float scale, float *out, float *part,
    int64_t span_stride, const int64_t *next_tok, int64_t next_n) {
    const int64_t D = DV * 8, i = run->first, len = seq_lens[i], token_bytes = Hkv * kv_row_bytes(kvt, D);
    const int64_t t_begin = span_first(run, abs_span), n = span_end(abs_span, len) - t_begin;
    float qs[HEADS_MAX_FLOATS] __attribute__((aligned(32)));
    float acc[HEADS_MAX_FLOATS] __attribute__((aligned(32)));
    float m[HEADS_MAX_QUERIES], l[HEADS_MAX_QUERIES];
    int64_t tok[SPAN_TOKENS];
    token_offsets(table, t_begin, n, block_size, token_bytes, tok);
    for (int64_t h = 0; h < Hq; h++)
        for (int64_t d = 0; d < DV; d++)
            _mm256_store_ps(qs + h * D + 8 * d,
                            _mm256_mul_ps(_mm256_loadu_ps(q + (i * Hq + h) * D + 8 * d), _mm256_set1_ps(scale)));
    heads_span(qs, k_cache, v_cache, tok, n, next_tok, next_n, Hkv, DV, kvt, NQ, acc, m, l);
    for (int64_t h = 0; h < Hq; h++)
        store_query(acc + h * D, m[h], l[h], run, abs_span, i, h, Hq, DV, part_start, out, part, span_stride);
}

#endif

/* The spans' partials of one query head merged in span order: out = sum_c acc_c e^(m_c - M) /
 * sum_c l_c e^(m_c - M), M the largest m_c. part: the first span's [D + 2] of this head; spans are
 * span_stride floats apart. */
static void merge_spans(const float *part, int64_t num_spans, int64_t span_stride, int64_t D, float *out) {
    float m = -INFINITY;
    for (int64_t c = 0; c < num_spans; c++) m = fmaxf(m, part[c * span_stride + D]);
    float l = 0.0f;
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t c = 0; c < num_spans; c++) {
        const float *pc = part + c * span_stride, w = expf(pc[D] - m);
        l += pc[D + 1] * w;
        for (int64_t d = 0; d < D; d++) out[d] += pc[d] * w;
    }
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* Tasks of a span for every KV head from this many spans in a call; below, the spans alone would leave
 * threads idle and a task per span and group of query heads runs instead (the same bits either way). */
#define HEADS_MIN_SPANS 8

/* off: where span c's first tokens lie (at most `limit` <= SPAN_TOKENS of them, as token_offsets gives
 * them: the tokens of the span any row of its run reads); returns how many. */
static int64_t span_token_offsets(const int32_t *tables, const run_t *runs, const int64_t *span_run,
                                  const int32_t *seq_lens, int64_t c, int64_t max_blocks, int64_t block_size,
                                  int64_t token_bytes, int64_t limit, int64_t *off) {
    const run_t *run = &runs[span_run[c]];
    const int64_t abs_span = abs_span_of(run, c), s0 = span_first(run, abs_span);
    int64_t len = 0;
    for (int64_t r = 0; r < run->rows; r++) len = seq_lens[run->first + r] > len ? seq_lens[run->first + r] : len;
    int64_t n = span_end(abs_span, len) - s0;
    n = n < limit ? n : limit;
    token_offsets(tables + run->first * max_blocks, s0, n, block_size, token_bytes, off);
    return n;
}

/* Slice `part` of `parts` of the first `tokens` tokens of span c: their rows of every KV head (contiguous:
 * token_bytes a token) in K, and in V unless v_cache is NULL, on their way into L1 (to_l2: L2), in
 * address order. */
static void prefetch_span(const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *tables, const run_t *runs,
                          const int64_t *span_run, const int32_t *seq_lens, int64_t c, int64_t max_blocks,
                          int64_t block_size, int64_t token_bytes, int64_t tokens, int64_t part, int64_t parts,
                          int to_l2) {
    int64_t off[SPAN_TOKENS];
    const int64_t n = span_token_offsets(tables, runs, span_run, seq_lens, c, max_blocks, block_size, token_bytes,
                                         tokens, off);
    for (int64_t t = n * part / parts; t < n * (part + 1) / parts; t++)
        for (int64_t x = 0; x < token_bytes; x += 64) {
            if (to_l2) {
                _mm_prefetch((const char *)(k_cache + off[t] + x), _MM_HINT_T1);
                if (v_cache) _mm_prefetch((const char *)(v_cache + off[t] + x), _MM_HINT_T1);
            } else {
                _mm_prefetch((const char *)(k_cache + off[t] + x), _MM_HINT_T0);
                if (v_cache) _mm_prefetch((const char *)(v_cache + off[t] + x), _MM_HINT_T0);
            }
        }
}

/* The largest divisor of the GQA group that is at most MAX_GROUP: the heads of one task. */
static int64_t heads_per_task(int64_t group) {
    int64_t g = group < MAX_GROUP ? group : MAX_GROUP;
    while (group % g) g--;
    return g;
}

/* The first key a query at position seq_len - 1 sees: 0, or the window's start. */
static inline int64_t window_start(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* One task, specialised on the head size (64 and 128 unrolled) and the cache's element type (each type
 * its own loops, with the widening to float32 inlined). */
#define RUN_TYPES(DV)                                                                                         \
    switch (kvt) {                                                                                            \
    case KV_F32:                                                                                              \
        run_task(q, k, v, table, run, lens, part_start, abs_span, h0, g, Hq, group, Hkv, bs, DV, KV_F32, scale, \
                 out, part, span_stride);                                                                     \
        break;                                                                                                \
    case KV_F16:                                                                                              \
        run_task(q, k, v, table, run, lens, part_start, abs_span, h0, g, Hq, group, Hkv, bs, DV, KV_F16, scale, \
                 out, part, span_stride);                                                                     \
        break;                                                                                                \
    case KV_BF16:                                                                                             \
        run_task(q, k, v, table, run, lens, part_start, abs_span, h0, g, Hq, group, Hkv, bs, DV, KV_BF16,       \
                 scale, out, part, span_stride);                                                              \
        break;                                                                                                \
    default:                                                                                                  \
        run_task(q, k, v, table, run, lens, part_start, abs_span, h0, g, Hq, group, Hkv, bs, DV, KV_Q8_0,       \
                 scale, out, part, span_stride);                                                              \
    }
static void run_typed(const float *q, const uint8_t *k, const uint8_t *v, const int32_t *table, const run_t *run,
                      const int32_t *lens, const int64_t *part_start, int64_t abs_span, int64_t h0, int64_t g,
                      int64_t Hq, int64_t group, int64_t Hkv, int64_t bs, int64_t D, int kvt, float scale,
                      float *out, float *part, int64_t span_stride) {
    if (D == 64) {
        RUN_TYPES(8)
    } else if (D == 128) {
        RUN_TYPES(16)
    } else {
        RUN_TYPES(D / 8)
    }
}

#if DIRECT_PATH /* heads_span is the direct path's */
/* run_heads_task specialised on the head size (64, 128 unrolled), the cache's type and the group. */
#define HEADS_TASK(DV, KVT, NQ)                                                                                \
    run_heads_task(q, k, v, table, run, lens, part_start, abs_span, Hq, Hkv, bs, DV, KVT, NQ, scale, out, part, \
                   span_stride, next_tok, next_n)
#define HEADS_NQ(DV, KVT)                                                                                      \
    switch (group) {                                                                                           \
    case 1: HEADS_TASK(DV, KVT, 1); break;                                                                     \
    case 2: HEADS_TASK(DV, KVT, 2); break;                                                                     \
    case 3: HEADS_TASK(DV, KVT, 3); break;                                                                     \
    default: HEADS_TASK(DV, KVT, 4);                                                                           \
    }
#define HEADS_TYPES(DV)                                                                                        \
    switch (kvt) {                                                                                             \
    case KV_F16: HEADS_NQ(DV, KV_F16) break;                                                                   \
    case KV_BF16: HEADS_NQ(DV, KV_BF16) break;                                                                 \
    default: HEADS_NQ(DV, KV_Q8_0)                                                                             \
    }
static void run_heads_typed(const float *q, const uint8_t *k, const uint8_t *v, const int32_t *table,
                            const run_t *run, const int32_t *lens, const int64_t *part_start, int64_t abs_span,
                            int64_t Hq, int64_t group, int64_t Hkv, int64_t bs, int64_t D, int kvt, float scale,
                            float *out, float *part, int64_t span_stride, const int64_t *next_tok,
                            int64_t next_n) {
    if (D == 64) {
        HEADS_TYPES(8)
    } else if (D == 128) {
        HEADS_TYPES(16)
    } else {
        HEADS_TYPES(D / 8)
    }
}
#endif

/* Whether row i + 1 extends row i's run: the next position over the same blocks (every block its
 * history touches), with no sliding window (a window would give the rows different first keys). */
static int same_history(const int32_t *block_tables, const int32_t *seq_lens, int64_t i, int64_t max_blocks,
                        int64_t block_size, int64_t window) {
    if (window > 0 || seq_lens[i + 1] != seq_lens[i] + 1) return 0;
    const int64_t blocks = (seq_lens[i + 1] + block_size - 1) / block_size;
    const int32_t *a = block_tables + i * max_blocks, *b = a + max_blocks;
    for (int64_t j = 0; j < blocks; j++)
        if (a[j] != b[j]) return 0;
    return 1;
}

/* q, out: [n, Hq, D] float32; caches: [num_blocks, block_size, Hkv, row] with rows of D values of
 * kv_type (kv_types.h: float32, float16, bfloat16 or q8_0); block_tables: [n, max_blocks] int32;
 * seq_lens: [n] int32 (>= 1); window: the sliding window (0: every key). Returns nonzero for shapes it
 * does not handle (D not a multiple of 8 or > 256; of 32 for q8_0) or when memory runs out.
 *
 * Consecutive rows over one history (same_history: a speculative verification's rows) form a run that
 * reads each span of K and V once for all its rows, up to MAX_QUERIES (row, head) queries a task; each
 * row's result is bit for bit what it would be alone. */
int orca_paged_decode_attention(const float *q, const void *k_cache_, const void *v_cache_,
                                const int32_t *block_tables, const int32_t *seq_lens, int64_t n, int64_t Hq,
                                int64_t Hkv, int64_t D, int64_t block_size, int64_t max_blocks, float scale,
                                int64_t window, int kv_type, float *out) {
    if (D % 8 != 0 || D > MAX_HEAD_DIM || Hq % Hkv != 0 || n <= 0 || window < 0 || !kv_type_ok(kv_type, D)) return 1;
    const uint8_t *k_cache = k_cache_, *v_cache = v_cache_;
    const int64_t group = Hq / Hkv, g = heads_per_task(group), groups = Hq / g, max_rows = MAX_QUERIES / g;
    /* part_start[i]: where row i's span partials go (rows of one span need none: their count is 0). */
    int64_t *part_start = malloc(sizeof(int64_t) * (size_t)(n + 1));
    run_t *runs = malloc(sizeof(run_t) * (size_t)n);
    if (!part_start || !runs) {
        free(part_start);
        free(runs);
        return 2;
    }
    int64_t parts = 0, num_runs = 0, spans = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t lo = window_start(seq_lens[i], window);
        const int64_t c = (seq_lens[i] - 1) / SPAN_TOKENS - lo / SPAN_TOKENS + 1;
        part_start[i] = parts;
        if (c > 1) parts += c;
        run_t *last = num_runs ? &runs[num_runs - 1] : NULL;
        if (last && last->first + last->rows == i && last->rows < max_rows &&
            same_history(block_tables, seq_lens, i - 1, max_blocks, block_size, window)) {
            last->rows++;
            spans++; /* at most one span more than the run's previous row: only if it crosses a boundary */
            spans -= (seq_lens[i] - 1) / SPAN_TOKENS == (seq_lens[i - 1] - 1) / SPAN_TOKENS;
            continue;
        }
        runs[num_runs++] = (run_t){i, 1, lo, spans};
        spans += c;
    }
    part_start[n] = parts;
    const int64_t span_stride = Hq * (D + 2); /* one span's partials: every head's acc, m, l */
    float *part = parts ? malloc(sizeof(float) * (size_t)(parts * span_stride)) : NULL;
    int64_t *span_run = malloc(sizeof(int64_t) * (size_t)spans);
    if ((parts && !part) || !span_run) {
        free(part);
        free(span_run);
        free(runs);
        free(part_start);
        return 2;
    }
    for (int64_t r = 0; r < num_runs; r++) {
        const int64_t end = r + 1 < num_runs ? runs[r + 1].span_begin : spans;
        for (int64_t c = runs[r].span_begin; c < end; c++) span_run[c] = r;
    }
    /* With HEADS_MIN_SPANS spans or more, a task is a span for every KV head: one heads_span where the
     * direct path serves them all, else the per-group tasks in turn, the next task's rows prefetched
     * meanwhile (its first rows' K into L1 for heads_span, which prefetches the rest as it goes; all its
     * rows into L2 a slice per group otherwise: each group still reads pieces a token apart, but from
     * L2; 16 layers of Llama-3.2-1B's heads from DRAM, batch 32 at 144 tokens: the AVX2 build's 16-bit
     * cache 1.04-1.07x, a float32 cache 1.05x). Tasks are claimed one ahead, so the next one is known. */
    const int by_span = spans >= HEADS_MIN_SPANS;
#if DIRECT_PATH
    const int all_heads = by_span && kv_type != KV_F32 && group <= DIRECT_QUERIES && Hq <= HEADS_MAX_QUERIES &&
                          Hq * D <= HEADS_MAX_FLOATS && num_runs == n;
#else
    const int all_heads = 0;
#endif
    const int64_t token_bytes = Hkv * kv_row_bytes(kv_type, D);
    int64_t next_task = 0;
#pragma omp parallel
    {
        if (all_heads || (by_span && groups > 1)) {
            int64_t c = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
#if DIRECT_PATH
            /* heads_span fetches the next task's first rows as it ends; a thread's first task's are fetched here. */
            if (all_heads && c < spans)
                prefetch_span(k_cache, NULL, block_tables, runs, span_run, seq_lens, c, max_blocks, block_size,
                              token_bytes, FETCH_AHEAD, 0, 1, 0);
#endif
            while (c < spans) {
                const int64_t cn = __atomic_fetch_add(&next_task, 1, __ATOMIC_RELAXED);
                const run_t *run = &runs[span_run[c]];
                const int32_t *table = block_tables + run->first * max_blocks;
                const int64_t abs_span = abs_span_of(run, c);
#if DIRECT_PATH
                if (all_heads) {
                    int64_t next_tok[FETCH_AHEAD], next_n = 0;
                    if (cn < spans)
                        next_n = span_token_offsets(block_tables, runs, span_run, seq_lens, cn, max_blocks, block_size,
                                                    token_bytes, FETCH_AHEAD, next_tok);
                    run_heads_typed(q, k_cache, v_cache, table, run, seq_lens, part_start, abs_span, Hq, group, Hkv,
                                    block_size, D, kv_type, scale, out, part, span_stride, next_tok, next_n);
                } else
#endif
                    for (int64_t i = 0; i < groups; i++) {
                        if (cn < spans)
                            prefetch_span(k_cache, v_cache, block_tables, runs, span_run, seq_lens, cn, max_blocks,
                                          block_size, token_bytes, SPAN_TOKENS, i, groups, 1);
                        run_typed(q, k_cache, v_cache, table, run, seq_lens, part_start, abs_span, i * g, g, Hq,
                                  group, Hkv, block_size, D, kv_type, scale, out, part, span_stride);
                    }
                c = cn;
            }
#pragma omp barrier
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < spans * groups; task++) {
                const int64_t c = task / groups, h0 = task % groups * g;
                const run_t *run = &runs[span_run[c]];
                run_typed(q, k_cache, v_cache, block_tables + run->first * max_blocks, run, seq_lens, part_start,
                          abs_span_of(run, c), h0, g, Hq, group, Hkv, block_size, D, kv_type, scale, out, part,
                          span_stride);
            }
        }
        if (parts) {
#pragma omp for schedule(static)
            for (int64_t ih = 0; ih < n * Hq; ih++) {
                const int64_t i = ih / Hq, h = ih % Hq, c = part_start[i + 1] - part_start[i];
                if (c > 1) merge_spans(part + part_start[i] * span_stride + h * (D + 2), c, span_stride, D, out + ih * D);
            }
        }
    }
    free(span_run);
    free(part);
    free(runs);
    free(part_start);
    return 0;
}
