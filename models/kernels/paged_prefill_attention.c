/* Prefill attention straight from the paged KV cache: the prompt chunks of a step (many query rows a
 * sequence), each row over its causal, optionally windowed, history.
 *
 * Row j of sequence i sits at position p = seq_len_i - query_len_i + j (a chunk's queries are the last
 * query_len of its seq_len positions, the rest cached before) and sees keys [lo, p], lo = 0, or
 * p - window + 1 with a sliding window. The torch path (sdpa) gathers each request's history, widens
 * it and runs torch's CPU flash kernel: 75-120 GFLOP/s on a 2-core Zen 4, which could not skip
 * anything under an explicit mask (a chunk after a cached prefix, a window).
 *
 * Flash attention as GEMM micro-kernels. A task is one KV head and a tile of up to TILE_QUERIES
 * (row, query head) queries of one sequence: the GQA group's heads of consecutive rows, so every K and
 * V value is widened once per task and serves all of them. It walks key tiles of KEY_TILE positions,
 * aligned to absolute positions, from the first one any of its rows sees to the last row's own:
 *   K tile, widened to float32 and transposed [D][KEY_TILE]; V tile [KEY_TILE][D] (keys outside the
 *   history: zeros)
 *   S = Q K^T      register-tiled (tile_gemm): REG_ROWS queries x CW vectors of keys, multiply-adds over d
 *   online softmax per query (running max m, sum l; the tile's keys outside [lo, p] weigh exactly 0)
 *   O = O * alpha + P V   register-tiled: the same shape over the head's values
 * and ends with O / l. OpenMP over tasks, largest (last rows) first.
 *
 * A query's arithmetic depends on its own position and keys only: the key tiles are absolute, the
 * multiply-adds of a score run over d in order and those of an output over the tile's keys in order,
 * whichever queries share its micro-kernel, and a tile it sees nothing of leaves it untouched. So a
 * row's result is the same bits whether its prompt came in one chunk or several, after a cached
 * prefix or not, alone in the step or batched with others.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_types.h"
#include "vec.h"

#define PF_MAX_HEAD_DIM 256
#define KEY_TILE 64      /* keys a tile: 4 vectors of 16, 8 of 8 */
#define TILE_QUERIES 256 /* (row, head) queries a task: Q, O, S of 64-256 KB stay in L2 */
#define KV_VECS (KEY_TILE / LANES)
#if LANES == 16
#define REG_ROWS 6 /* 6 x 4 accumulators + 4 key vectors + a broadcast: 29 of 32 registers */
#define CW 4
#else
#define REG_ROWS 3 /* 3 x 4 accumulators + 4 key vectors + a broadcast: 17 of 16 (one reloaded) */
#define CW 4
#endif

/* The first key a query at position p sees: 0, or with a sliding window W its window's start. */
static inline int64_t first_key(int64_t p, int64_t W) { return W > 0 && p - W + 1 > 0 ? p - W + 1 : 0; }

/* C[r][c0 * LANES ..] (cw vectors) = C * alpha[r] (0 without alpha) + sum over k < K of A[r][k] B[k] for
 * rr rows: one register tile of both products, S = Q K^T (A = Q, B = K^T, K = D) and O = O * alpha + P V
 * (A = P, B = V, K = KEY_TILE). Each output's multiply-adds run over k in order whatever rr is. */
static inline __attribute__((always_inline)) void tile_kernel(const float *A, int64_t lda, const float *B, int64_t ldb,
                                                              int64_t K, const int rr, const int cw, int64_t c0,
                                                              const float *alpha, float *C, int64_t ldc) {
    vf acc[REG_ROWS][CW];
    for (int r = 0; r < rr; r++)
        for (int c = 0; c < cw; c++)
            acc[r][c] = alpha ? vf_mul(vf_load(C + r * ldc + (c0 + c) * LANES), vf_set1(alpha[r])) : vf_zero();
    for (int64_t k = 0; k < K; k++) {
        vf b[CW];
        for (int c = 0; c < cw; c++) b[c] = vf_load(B + k * ldb + (c0 + c) * LANES);
        for (int r = 0; r < rr; r++) {
            const vf a = vf_set1(A[r * lda + k]);
            for (int c = 0; c < cw; c++) acc[r][c] = vf_fma(a, b[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rr; r++)
        for (int c = 0; c < cw; c++) vf_store(C + r * ldc + (c0 + c) * LANES, acc[r][c]);
}

#define TILE_COLS(n)                                                                                           \
    case n:                                                                                                    \
        switch (cw) {                                                                                          \
        case 1: tile_kernel(A + i * lda, lda, B, ldb, K, n, 1, c0, alpha ? alpha + i : NULL, C + i * ldc, ldc); break; \
        case 2: tile_kernel(A + i * lda, lda, B, ldb, K, n, 2, c0, alpha ? alpha + i : NULL, C + i * ldc, ldc); break; \
        case 3: tile_kernel(A + i * lda, lda, B, ldb, K, n, 3, c0, alpha ? alpha + i : NULL, C + i * ldc, ldc); break; \
        default: tile_kernel(A + i * lda, lda, B, ldb, K, n, CW, c0, alpha ? alpha + i : NULL, C + i * ldc, ldc); \
        }                                                                                                      \
        break;
/* C [rows][width] (= C * alpha, or from 0) += A [rows][K] B [K][width] in register tiles (tile_kernel);
 * width a multiple of LANES. */
static void tile_gemm(const float *A, int64_t lda, const float *B, int64_t ldb, int64_t K, int64_t rows,
                      int64_t width, const float *alpha, float *C, int64_t ldc) {
    const int64_t vecs = width / LANES;
    for (int64_t i = 0; i < rows; i += REG_ROWS)
        for (int64_t c0 = 0; c0 < vecs; c0 += CW) {
            const int cw = vecs - c0 < CW ? (int)(vecs - c0) : CW;
            switch (rows - i < REG_ROWS ? rows - i : REG_ROWS) {
                TILE_COLS(1)
                TILE_COLS(2)
#if REG_ROWS > 3
                TILE_COLS(3)
                TILE_COLS(4)
                TILE_COLS(5)
                TILE_COLS(6)
#else
                TILE_COLS(3)
#endif
            }
        }
}

/* A tile of scores S [nq][KEY_TILE] in place to weights e^(s - m'), query i seeing the tile's keys
 * [a, b) of its row (ab[2 * (i / G)] ..; the others weigh 0): m' = max(m, the tile's largest),
 * alpha = e^(m - m'), and l = l * alpha + the weights (l kept as LANES partial sums a query, summed
 * once at the end). A query that sees none of the tile keeps m, l and (alpha 1) O. Three passes: the
 * maxima, every query's alpha LANES at a time, the weights. */
static void tile_softmax(float *S, int64_t nq, int64_t G, const int64_t *ab, float *m, float *mt, float *alpha,
                         float *lv) {
    for (int64_t i = 0; i < nq; i++) {
        const int64_t a = ab[2 * (i / G)], b = ab[2 * (i / G) + 1];
        float *s = S + i * KEY_TILE;
        if (a >= b) {
            mt[i] = -INFINITY;
            continue;
        }
        for (int64_t k = 0; k < a; k++) s[k] = -INFINITY;
        for (int64_t k = b; k < KEY_TILE; k++) s[k] = -INFINITY;
        vf mx = vf_load(s);
        for (int v = 1; v < KV_VECS; v++) mx = vf_max(mx, vf_load(s + v * LANES));
        mt[i] = vf_hmax(mx);
    }
    for (int64_t i = 0; i < nq; i += LANES) { /* m = -inf (nothing seen yet): alpha is e^-88 times O = 0 */
        const vf mo = vf_load(m + i), mn = vf_max(mo, vf_load(mt + i));
        vf_store(alpha + i, vf_exp(vf_sub(mo, mn)));
        vf_store(mt + i, mn);
    }
    for (int64_t i = 0; i < nq; i++) {
        const int64_t a = ab[2 * (i / G)], b = ab[2 * (i / G) + 1];
        float *s = S + i * KEY_TILE;
        if (a >= b) {
            for (int v = 0; v < KV_VECS; v++) vf_store(s + v * LANES, vf_zero());
            alpha[i] = 1.0f;
            continue;
        }
        const vf mb = vf_set1(mt[i]);
        for (int v = 0; v < KV_VECS; v++) vf_store(s + v * LANES, vf_exp(vf_sub(vf_load(s + v * LANES), mb)));
        for (int64_t k = 0; k < a; k++) s[k] = 0.0f; /* exp clamps at e^-88: unseen keys are zeroed */
        for (int64_t k = b; k < KEY_TILE; k++) s[k] = 0.0f;
        vf sum = vf_load(s);
        for (int v = 1; v < KV_VECS; v++) sum = vf_add(sum, vf_load(s + v * LANES));
        vf_store(lv + i * LANES, vf_add(vf_mul(vf_load(lv + i * LANES), vf_set1(alpha[i])), sum));
        m[i] = mt[i];
    }
}

/* r[0..7] (8 rows of 8 floats) transposed in registers. */
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* Keys t0 .. t0 + KEY_TILE - 1 of KV head kvh: K transposed into KT [D][KEY_TILE], V into [KEY_TILE][D],
 * both widened to float32; positions outside [klo, khi) are zeros (never read from the cache). Eight
 * keys at a time: their rows' 8-value pieces transposed in registers. */
static inline __attribute__((always_inline)) void load_tile(const uint8_t *kc, const uint8_t *vc, const int32_t *table,
                                                            int64_t bs, int64_t token_stride, int64_t t0, int64_t klo,
                                                            int64_t khi, int64_t D, const int kvt, float *KT,
                                                            float *V) {
    static const uint8_t zeros[PF_MAX_HEAD_DIM * 4] = {0};
    for (int64_t j0 = 0; j0 < KEY_TILE; j0 += 8) {
        const uint8_t *kr[8];
        for (int64_t j = j0; j < j0 + 8; j++) {
            const int64_t pos = t0 + j;
            if (pos < klo || pos >= khi) { /* zeros (a q8_0 block of zeros: scale 0, codes 0) */
                kr[j - j0] = zeros;
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(V + j * D + d, _mm256_setzero_ps());
                continue;
            }
            const int64_t slot = (int64_t)table[pos / bs] * bs + pos % bs;
            kr[j - j0] = kc + slot * token_stride;
            const uint8_t *vr = vc + slot * token_stride;
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(V + j * D + d, kv_load8(vr, d, kvt));
        }
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int e = 0; e < 8; e++) r[e] = kv_load8(kr[e], d, kvt);
            transpose8(r);
            for (int e = 0; e < 8; e++) _mm256_storeu_ps(KT + (d + e) * KEY_TILE + j0, r[e]);
        }
    }
}

typedef struct {
    int64_t seq, kvh, r0, rows;
} pf_task;

typedef struct {
    const float *q;
    const uint8_t *k_cache, *v_cache;
    const int32_t *block_tables, *query_lens, *seq_lens;
    const int64_t *q_starts;
    int64_t Hq, Hkv, D, block_size, max_blocks, window;
    int kv_type;
    float scale;
    float *out;
} pf_args;

static void run_task(const pf_args *A, const pf_task *t, float *buf) {
    const int64_t D = A->D, G = A->Hq / A->Hkv, nq = t->rows * G;
    const int64_t row_bytes = kv_row_bytes(A->kv_type, D), token_stride = A->Hkv * row_bytes;
    const int64_t ctx = A->seq_lens[t->seq] - A->query_lens[t->seq]; /* position of the chunk's row 0 */
    const int32_t *table = A->block_tables + t->seq * A->max_blocks;
    const uint8_t *kc = A->k_cache + t->kvh * row_bytes, *vc = A->v_cache + t->kvh * row_bytes; /* head kvh's rows */
    float *Q = buf, *O = Q + TILE_QUERIES * D, *S = O + TILE_QUERIES * D, *KT = S + TILE_QUERIES * KEY_TILE;
    float *V = KT + D * KEY_TILE, *m = V + KEY_TILE * D, *mt = m + TILE_QUERIES, *alpha = mt + TILE_QUERIES;
    float *lv = alpha + TILE_QUERIES; /* [TILE_QUERIES][LANES] */
    int64_t ab[2 * TILE_QUERIES];
    const vf sc = vf_set1(A->scale);
    for (int64_t r = 0; r < t->rows; r++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t i = r * G + g;
            const float *src = A->q + ((A->q_starts[t->seq] + t->r0 + r) * A->Hq + t->kvh * G + g) * D;
            for (int64_t d = 0; d < D; d += LANES) {
                vf_store(Q + i * D + d, vf_mul(vf_loadu(src + d), sc));
                vf_store(O + i * D + d, vf_zero());
            }
            m[i] = -INFINITY;
            vf_store(lv + i * LANES, vf_zero());
        }
    for (int64_t i = nq; i < (nq + LANES - 1) / LANES * LANES; i++) m[i] = mt[i] = 0.0f; /* lanes of no query */
    const int64_t p_first = ctx + t->r0, p_last = p_first + t->rows - 1, W = A->window;
    const int64_t klo = first_key(p_first, W);
    for (int64_t t0 = klo / KEY_TILE * KEY_TILE; t0 <= p_last; t0 += KEY_TILE) {
        switch (A->kv_type) {
        case KV_F32:
            load_tile(kc, vc, table, A->block_size, token_stride, t0, klo, p_last + 1, D, KV_F32, KT, V);
            break;
        case KV_F16:
            load_tile(kc, vc, table, A->block_size, token_stride, t0, klo, p_last + 1, D, KV_F16, KT, V);
            break;
        case KV_BF16:
            load_tile(kc, vc, table, A->block_size, token_stride, t0, klo, p_last + 1, D, KV_BF16, KT,
                      V);
            break;
        default:
            load_tile(kc, vc, table, A->block_size, token_stride, t0, klo, p_last + 1, D, KV_Q8_0, KT,
                      V);
        }
        tile_gemm(Q, D, KT, KEY_TILE, D, nq, KEY_TILE, NULL, S, KEY_TILE); /* S = Q K^T */
        for (int64_t r = 0; r < t->rows; r++) {
            const int64_t p = p_first + r, lo = first_key(p, W);
            ab[2 * r] = lo > t0 ? lo - t0 : 0;
            ab[2 * r + 1] = p + 1 < t0 + KEY_TILE ? p + 1 - t0 : KEY_TILE;
        }
        tile_softmax(S, nq, G, ab, m, mt, alpha, lv);
        tile_gemm(S, KEY_TILE, V, D, KEY_TILE, nq, D, alpha, O, D); /* O = O * alpha + P V */
    }
    for (int64_t r = 0; r < t->rows; r++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t i = r * G + g;
            float *dst = A->out + ((A->q_starts[t->seq] + t->r0 + r) * A->Hq + t->kvh * G + g) * D;
            const vf inv = vf_set1(1.0f / vf_hsum(vf_load(lv + i * LANES)));
            for (int64_t d = 0; d < D; d += LANES) vf_storeu(dst + d, vf_mul(vf_load(O + i * D + d), inv));
        }
}

/* q, out: [T, Hq, D] float32, the step's prompt rows, sequences back to back (query_lens[i] rows each);
 * caches: [num_blocks, block_size, Hkv, row] with rows of D values of kv_type (kv_types.h);
 * block_tables: [n, max_blocks] int32; query_lens, seq_lens: [n] int32 (0 < query_len <= seq_len);
 * window: the sliding window (0: every key). Returns nonzero for shapes it does not handle (D not a
 * multiple of 16 or over 256; of 32 for q8_0; Hq not a multiple of Hkv; a group over TILE_QUERIES) or
 * when memory runs out. */
int orca_paged_prefill_attention(const float *q, const void *k_cache, const void *v_cache,
                                 const int32_t *block_tables, const int32_t *query_lens, const int32_t *seq_lens,
                                 int64_t n, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                                 int64_t max_blocks, float scale, int64_t window, int kv_type, float *out) {
    if (D % 16 != 0 || D > PF_MAX_HEAD_DIM || Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > TILE_QUERIES || n <= 0 ||
        window < 0 || !kv_type_ok(kv_type, D))
        return 1;
    const int64_t G = Hq / Hkv, tile_rows = TILE_QUERIES / G;
    int64_t *q_starts = malloc(sizeof(int64_t) * (size_t)n);
    if (!q_starts) return 2;
    int64_t num_tasks = 0, rows = 0;
    for (int64_t i = 0; i < n; i++) {
        if (query_lens[i] <= 0 || query_lens[i] > seq_lens[i]) {
            free(q_starts);
            return 1;
        }
        q_starts[i] = rows;
        rows += query_lens[i];
        num_tasks += Hkv * ((query_lens[i] + tile_rows - 1) / tile_rows);
    }
    pf_task *tasks = malloc(sizeof(pf_task) * (size_t)num_tasks);
    if (!tasks) {
        free(q_starts);
        return 2;
    }
    /* Each sequence's last tiles of rows first: they see the most keys, so the threads end together. */
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t r0 = (query_lens[i] - 1) / tile_rows * tile_rows; r0 >= 0; r0 -= tile_rows)
            for (int64_t h = 0; h < Hkv; h++)
                tasks[k++] = (pf_task){i, h, r0, query_lens[i] - r0 < tile_rows ? query_lens[i] - r0 : tile_rows};
    const pf_args args = {q,          k_cache,     v_cache, block_tables, query_lens, seq_lens, q_starts, Hq, Hkv,
                          D,          block_size, max_blocks, window,       kv_type,    scale,    out};
    const size_t buf_floats = (size_t)(2 * TILE_QUERIES * D + TILE_QUERIES * KEY_TILE + 2 * KEY_TILE * D + (3 + LANES) * TILE_QUERIES);
    int failed = 0;
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, (buf_floats * sizeof(float) + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < num_tasks; j++)
            if (buf) run_task(&args, &tasks[j], buf);
        free(buf);
    }
    free(tasks);
    free(q_starts);
    return failed ? 2 : 0;
}
