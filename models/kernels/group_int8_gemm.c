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
 * Three paths, by the number of rows of x:
 *   - up to 8 (decode at small batch, memory-bound): gemv_row streams each weight row once and
 *     applies it to every row of x, at close to the machine's memory bandwidth;
 *   - more (large decode batches, prompts): rows_outer, a BLIS-style micro-kernel over 16 weight rows
 *     dequantized into an L1 buffer, at about MKL's float32 GEMM speed; the last N % 16 weight rows,
 *     too few for a tile, take the streaming path, 8 rows of x at a time.
 */
#include <stdint.h>

#include "simd.h"

#define GROUP 32
/* Up to this many rows of x, the streaming path (gemv_row); from one more on, rows_outer. */
#define GEMV_MAX_ROWS 8

/* 8 int8 codes as floats. */
static inline __m256 load8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline __m256 dequant8(const int8_t *q, __m256 s, __m256 z) {
    return _mm256_add_ps(_mm256_mul_ps(load8(q), s), z);
}

/* The main path from 9 rows of x on: a BLIS-style outer-product micro-kernel. 16 weight rows x KC_OUT
 * columns are dequantized once into an L1 buffer laid out k-major (w[k][0..15]); then every block of
 * MR rows of x runs y[m, 16 cols] += x[m, k] * w[k, :] over the chunk: 2 vector loads and MR
 * broadcasts feed 2 * MR FMAs, and the 12 accumulators stay in registers for the whole chunk (no
 * horizontal sums). The last N % 16 weight rows go through the streaming path instead. */
#define NT_OUT 16
#define KC_OUT 256
#define MR 6
#define M_BLOCK 96 /* rows of x per block (see orca_group_int8_linear) */

/* In-place transpose of an 8x8 block of floats held in 8 registers. */
static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

static inline __attribute__((always_inline)) void outer_tile(
    const float *x, int64_t K, const float *w, float *y, int64_t ldy, int64_t kc, int first, const int mr) {
    __m256 acc[MR][2];
#pragma GCC unroll 8
    for (int m = 0; m < mr; m++) {
        acc[m][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * ldy);
        acc[m][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * ldy + 8);
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_load_ps(w + k * NT_OUT), w1 = _mm256_load_ps(w + k * NT_OUT + 8);
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < mr; m++) {
        _mm256_storeu_ps(y + m * ldy, acc[m][0]);
        _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    }
}

static void rows_outer(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                       const float *z, int64_t G, float *y, int64_t N) {
    float w[KC_OUT * NT_OUT] __attribute__((aligned(32)));
    for (int64_t k0 = 0; k0 < K; k0 += KC_OUT) {
        const int64_t kc = K - k0 < KC_OUT ? K - k0 : KC_OUT;
        for (int j0 = 0; j0 < NT_OUT; j0 += 8)
            for (int64_t k = 0; k < kc; k += 8) {
                /* 8 weight rows x 8 columns, dequantized, transposed in registers, stored k-major. */
                const int64_t g = (k0 + k) / GROUP;
                __m256 r[8];
                for (int j = 0; j < 8; j++) {
                    const int64_t row = j0 + j;
                    r[j] = dequant8(q + row * K + k0 + k, _mm256_set1_ps(s[row * G + g]),
                                    _mm256_set1_ps(z[row * G + g]));
                }
                transpose8(r);
                for (int i = 0; i < 8; i++) _mm256_store_ps(w + (k + i) * NT_OUT + j0, r[i]);
            }
        const int first = k0 == 0;
        int64_t m = 0;
        for (; m + MR <= M; m += MR) outer_tile(x + m * K + k0, K, w, y + m * N, N, kc, first, MR);
        switch (M - m) {
            case 5: outer_tile(x + m * K + k0, K, w, y + m * N, N, kc, first, 5); break;
            case 4: outer_tile(x + m * K + k0, K, w, y + m * N, N, kc, first, 4); break;
            case 3: outer_tile(x + m * K + k0, K, w, y + m * N, N, kc, first, 3); break;
            case 2: outer_tile(x + m * K + k0, K, w, y + m * N, N, kc, first, 2); break;
            case 1: outer_tile(x + m * K + k0, K, w, y + m * N, N, kc, first, 1); break;
            default: break;
        }
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


/* Weight rows [n0, n1) against M <= GEMV_MAX_ROWS rows of x, on the streaming path. */
static void gemv_range(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s, const float *z,
                       float *y, int64_t N, int64_t n0, int64_t n1, int parallel) {
    const int64_t G = K / GROUP;
    float xsum[GEMV_MAX_ROWS * G];
    for (int64_t i = 0; i < M * G; i++) {
        float t = 0.0f;
        for (int k = 0; k < GROUP; k++) t += x[i * GROUP + k];
        xsum[i] = t;
    }
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n = n0; n < n1; n++) {
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
}

int orca_group_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                           const float *z, int64_t N, float *y) {
    if (K % GROUP != 0 || M <= 0 || N <= 0) return 1;
    if (M <= GEMV_MAX_ROWS) {
        gemv_range(x, M, K, q, s, z, y, N, 0, N, 1);
        return 0;
    }
    /* Rows of x in blocks of M_BLOCK, every weight tile against one block before the next: a block's
     * column slice (M_BLOCK x KC_OUT floats, 96 KB) stays in L2 across the tiles. Without the blocking a
     * prompt of 1024 tokens streamed x from L3 once per 4 weight rows (115 against MKL's 170 GFLOP/s). */
    const int64_t G = K / GROUP, tiled = N / NT_OUT * NT_OUT;
    for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK) {
        const int64_t mb = M - m0 < M_BLOCK ? M - m0 : M_BLOCK;
        const float *xb = x + m0 * K;
        float *yb = y + m0 * N;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < tiled; n += NT_OUT) rows_outer(xb, mb, K, q + n * K, s + n * G, z + n * G, G, yb + n, N);
        for (int64_t m = 0; m < mb && tiled < N; m += GEMV_MAX_ROWS) {
            const int64_t rows = mb - m < GEMV_MAX_ROWS ? mb - m : GEMV_MAX_ROWS;
            gemv_range(xb + m * K, rows, K, q, s, z, yb + m * N, N, tiled, N, 0);
        }
    }
    return 0;
}
