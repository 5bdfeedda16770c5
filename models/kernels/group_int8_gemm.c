/* y[M, N] = x[M, K] @ W^T for a weight stored as int8 codes with one float scale and zero per group
 * of 32 along K:  W[n, k] = s[n, k / 32] * q[n, k] + z[n, k / 32]  (float32 multiply, then add).
 *
 * This is the form of GGUF's Q4_1 (q in 0..15) and, with z = 0, Q8_0 / Q4_0 weights. Reading 1.25
 * bytes per weight instead of float32's 4 is what makes small-batch decode fast on a CPU, where every
 * step streams all the weights from memory. Each weight is dequantized in registers exactly as
 * gguf-py dequantizes it (same two roundings), so the weights the kernel multiplies are bit-identical
 * to the float32 checkpoint's; only the summation order differs from a float32 GEMM.
 *
 * AVX2 + FMA. Work is split over output rows by OpenMP (torch's own libgomp once torch is loaded).
 * A tile is NT output rows x MC input rows: the NT weight vectors are dequantized once per 8 columns
 * and reused for all MC rows of x, so larger batches cost FMAs, not more dequantization.
 */
#include <stdint.h>

#include "simd.h"

#define GROUP 32
/* Up to this many rows of x, the streaming path (gemv_row); from one more on, the L1 buffer. */
#define GEMV_MAX_ROWS 8

/* 8 int8 codes as floats. */
static inline __m256 load8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline __m256 dequant8(const int8_t *q, __m256 s, __m256 z) {
    return _mm256_add_ps(_mm256_mul_ps(load8(q), s), z);
}

static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t K, const int8_t *q, const float *s, const float *z, int64_t G,
    float *y, int64_t ldy, const int nt, const int mc) {
    __m256 acc[4][4];
#pragma GCC unroll 8
    for (int m = 0; m < mc; m++)
#pragma GCC unroll 8
        for (int j = 0; j < nt; j++) acc[m][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 sv[4], zv[4];
#pragma GCC unroll 8
        for (int j = 0; j < nt; j++) {
            sv[j] = _mm256_set1_ps(s[j * G + g]);
            zv[j] = _mm256_set1_ps(z[j * G + g]);
        }
#pragma GCC unroll 8
        for (int kk = 0; kk < GROUP; kk += 8) {
            const int64_t k = g * GROUP + kk;
            __m256 w[4];
#pragma GCC unroll 8
            for (int j = 0; j < nt; j++) w[j] = dequant8(q + j * K + k, sv[j], zv[j]);
#pragma GCC unroll 8
            for (int m = 0; m < mc; m++) {
                const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
                for (int j = 0; j < nt; j++) acc[m][j] = _mm256_fmadd_ps(xv, w[j], acc[m][j]);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mc; m++)
#pragma GCC unroll 8
        for (int j = 0; j < nt; j++) y[m * ldy + j] = hsum8(acc[m][j]);
}

/* All rows of x against NT weight rows starting at q (a tile column of the output). */
#define ROWS(NT)                                                                                  \
    static void rows_##NT(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,  \
                          const float *z, int64_t G, float *y, int64_t N) {                       \
        int64_t m = 0;                                                                            \
        for (; m + 3 <= M; m += 3) tile(x + m * K, K, q, s, z, G, y + m * N, N, NT, 3);           \
        if (M - m == 2) tile(x + m * K, K, q, s, z, G, y + m * N, N, NT, 2);                      \
        if (M - m == 1) tile(x + m * K, K, q, s, z, G, y + m * N, N, NT, 1);                      \
    }
ROWS(1)

/* Larger batches: dequantize NT rows x KC columns once into a float buffer that stays in L1, then run
 * every row of x against it, so the dequantization is paid once per weight instead of once per three
 * rows of x. Partial dot products over each KC chunk are added into y. */
#define KC 512
#define M_BLOCK 96
#define NT_BUF 4
#define MC_BUF 3

static inline __attribute__((always_inline)) void dot_buffered(
    const float *x, int64_t K, const float *w, float *y, int64_t ldy, int64_t kc, const int mc) {
    __m256 acc[MC_BUF][NT_BUF];
#pragma GCC unroll 8
    for (int m = 0; m < mc; m++)
#pragma GCC unroll 8
        for (int j = 0; j < NT_BUF; j++) acc[m][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k += 8) {
#pragma GCC unroll 8
        for (int m = 0; m < mc; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < NT_BUF; j++)
                acc[m][j] = _mm256_fmadd_ps(xv, _mm256_load_ps(w + j * KC + k), acc[m][j]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mc; m++)
#pragma GCC unroll 8
        for (int j = 0; j < NT_BUF; j++) y[m * ldy + j] += hsum8(acc[m][j]);
}

static void rows_buffered(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                          const float *z, int64_t G, float *y, int64_t N) {
    float w[NT_BUF * KC] __attribute__((aligned(32)));
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < NT_BUF; j++) y[m * N + j] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int j = 0; j < NT_BUF; j++)
            for (int64_t k = 0; k < kc; k += 8) {
                const int64_t g = (k0 + k) / GROUP;
                _mm256_store_ps(w + j * KC + k, dequant8(q + j * K + k0 + k, _mm256_set1_ps(s[j * G + g]),
                                                         _mm256_set1_ps(z[j * G + g])));
            }
        int64_t m = 0;
        for (; m + 3 <= M; m += 3) dot_buffered(x + m * K + k0, K, w, y + m * N, N, kc, 3);
        if (M - m == 2) dot_buffered(x + m * K + k0, K, w, y + m * N, N, kc, 2);
        if (M - m == 1) dot_buffered(x + m * K + k0, K, w, y + m * N, N, kc, 1);
    }
}

/* One row of x (batch-1 decode), where the kernel must keep up with memory: per group of 32,
 * sum_k x_k (s q_k + z) = s * sum_k x_k q_k + z * sum_k x_k, so the codes go straight into FMAs and
 * the scale is applied once per group. The weights are never materialized, so this rounds differently
 * from the float32 matmul (as any change of summation order does), not more.
 * One weight row at a time: reading several rows side by side (each with its scale and zero arrays)
 * gives the hardware prefetchers too many streams; on a 2-core Zen 3 that halved the bandwidth
 * (11 against 24 GB/s). */
static inline __attribute__((always_inline)) void gemv_row(
    const float *x, const float *xsum, int64_t K, const int8_t *q, const float *s, const float *z,
    int64_t G, float *y, int64_t ldy, const int mc) {
    __m256 acc[GEMV_MAX_ROWS];
    float zacc[GEMV_MAX_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < mc; m++) {
        acc[m] = _mm256_setzero_ps();
        zacc[m] = 0.0f;
    }
    for (int64_t g = 0; g < G; g++) {
        const int8_t *qg = q + g * GROUP;
        const __m256 w0 = load8(qg), w1 = load8(qg + 8), w2 = load8(qg + 16), w3 = load8(qg + 24);
        const __m256 sg = _mm256_set1_ps(s[g]);
        const float zg = z[g];
#pragma GCC unroll 8
        for (int m = 0; m < mc; m++) {
            const float *xg = x + m * K + g * GROUP;
            __m256 p0 = _mm256_mul_ps(_mm256_loadu_ps(xg), w0);
            __m256 p1 = _mm256_mul_ps(_mm256_loadu_ps(xg + 8), w1);
            p0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w2, p0);
            p1 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w3, p1);
            acc[m] = _mm256_fmadd_ps(sg, _mm256_add_ps(p0, p1), acc[m]);
            zacc[m] += zg * xsum[m * G + g];
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mc; m++) y[m * ldy] = hsum8(acc[m]) + zacc[m];
}


int orca_group_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                           const float *z, int64_t N, float *y) {
    if (K % GROUP != 0 || M <= 0 || N <= 0) return 1;
    const int64_t G = K / GROUP;
    if (M <= GEMV_MAX_ROWS) {
        float xsum[GEMV_MAX_ROWS * G];
        for (int64_t i = 0; i < M * G; i++) {
            float t = 0.0f;
            for (int k = 0; k < GROUP; k++) t += x[i * GROUP + k];
            xsum[i] = t;
        }
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const int8_t *qn = q + n * K;
            const float *sn = s + n * G, *zn = z + n * G;
            switch (M) {
                case 1: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 1); break;
                case 2: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 2); break;
                case 3: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 3); break;
                case 4: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 4); break;
                case 5: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 5); break;
                case 6: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 6); break;
                case 7: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 7); break;
                default: gemv_row(x, xsum, K, qn, sn, zn, G, y + n, N, 8); break;
            }
        }
        return 0;
    }
    /* Rows of x in blocks of M_BLOCK, every weight tile against one block before the next: a block's
     * KC-column slice (M_BLOCK x KC floats, 192 KB) stays in L2 across the tiles. Without the blocking a
     * prompt of 1024 tokens streamed x from L3 once per 4 weight rows (115 against MKL's 170 GFLOP/s). */
    const int64_t full = N / 4;
    for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK) {
        const int64_t mb = M - m0 < M_BLOCK ? M - m0 : M_BLOCK;
        const float *xb = x + m0 * K;
        float *yb = y + m0 * N;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < full; t++) {
            const int64_t n = t * 4;
            rows_buffered(xb, mb, K, q + n * K, s + n * G, z + n * G, G, yb + n, N);
        }
        for (int64_t n = full * 4; n < N; n++) rows_1(xb, mb, K, q + n * K, s + n * G, z + n * G, G, yb + n, N);
    }
    return 0;
}
