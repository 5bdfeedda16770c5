/* The element types of the paged KV cache, as the kernels read and write them (--kv-cache-dtype).
 *
 *   KV_F32   float32
 *   KV_F16   IEEE half (F16C's vcvtph2ps / vcvtps2ph: exact widening, round-to-nearest-even narrowing)
 *   KV_BF16  bfloat16: the top 16 bits of a float32 (widening is a shift; narrowing rounds to nearest
 *            even in integer arithmetic, as torch's .to(torch.bfloat16) does for finite values)
 *   KV_Q8_0  llama.cpp's block_q8_0 (`-ctk q8_0`): each run of 32 values of a head's row is 34 bytes,
 *            an IEEE half scale d followed by 32 int8 codes q; the value is q * d. Quantizing a block:
 *            d = max|x| / 127, q = round-half-even(x * (1 / d)) (0 where d is 0), d stored as half.
 *            A head's row of D values (D a multiple of 32) is D / 32 blocks, back to back.
 *
 * A cache row (one token, one KV head) is kv_row_bytes(type, D) bytes; token t's heads are contiguous
 * in the slot, as in the float32 layout. Loads widen 8 values at a time to float32 in registers, so the
 * attention kernel reads the cache in place in its own type: no float32 copy of the cache is made.
 * The torch side (models/layers/kv_format.py) quantizes and dequantizes with the same IEEE operations,
 * so a cache written by either is bit-identical. */
#ifndef ORCA_KV_TYPES_H
#define ORCA_KV_TYPES_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

#define Q8_0_VALUES 32
#define Q8_0_BYTES 34 /* half scale + 32 int8 */

/* Whether the kernels take this type for rows of D values. */
static inline int kv_type_ok(int type, int64_t D) {
    return type == KV_F32 || type == KV_F16 || type == KV_BF16 || (type == KV_Q8_0 && D % Q8_0_VALUES == 0);
}

/* Bytes of one head's row of D values. */
static inline int64_t kv_row_bytes(int type, int64_t D) {
    switch (type) {
    case KV_F32:
        return 4 * D;
    case KV_F16:
    case KV_BF16:
        return 2 * D;
    default:
        return D / Q8_0_VALUES * Q8_0_BYTES;
    }
}

/* Values e .. e + 7 of a row (e a multiple of 8) as float32. Called with a constant type, so each
 * caller's loop is specialised to one type. */
static inline __attribute__((always_inline)) __m256 kv_load8(const uint8_t *row, int64_t e, int type) {
    switch (type) {
    case KV_F32:
        return _mm256_loadu_ps((const float *)row + e);
    case KV_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * e)));
    case KV_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * e))), 16));
    default: {
        const uint8_t *block = row + e / Q8_0_VALUES * Q8_0_BYTES;
        uint16_t d;
        memcpy(&d, block, 2);
        int64_t codes;
        memcpy(&codes, block + 2 + e % Q8_0_VALUES, 8);
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(codes)));
        return _mm256_mul_ps(q, _mm256_set1_ps(_cvtsh_ss(d)));
    }
    }
}

#if defined(__AVX512F__)
/* Values e .. e + 15 of a row (e a multiple of 16) as float32, each lane as kv_load8 widens it. */
static inline __attribute__((always_inline)) __m512 kv_load16(const uint8_t *row, int64_t e, int type) {
    switch (type) {
    case KV_F32:
        return _mm512_loadu_ps((const float *)row + e);
    case KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * e)));
    case KV_BF16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * e))), 16));
    default: {
        const uint8_t *block = row + e / Q8_0_VALUES * Q8_0_BYTES; /* 16 values lie in one 32-value block */
        uint16_t d;
        memcpy(&d, block, 2);
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2 + e % Q8_0_VALUES))));
        return _mm512_mul_ps(q, _mm512_set1_ps(_cvtsh_ss(d)));
    }
    }
}
#endif

#if defined(__AVX512DQ__)
/* Values e .. e + 7 of two rows a and b (e a multiple of 8) as float32, a's in the low half: each lane as
 * kv_load8 widens it. */
static inline __attribute__((always_inline)) __m512 kv_load8x2(const uint8_t *a, const uint8_t *b, int64_t e, int type) {
    switch (type) {
    case KV_F32:
    case KV_F16: /* kv_load8's two widenings side by side: for float16 10% faster scores on Zen 5 than
                  * one 512-bit widening of the two rows' halves */
        return _mm512_insertf32x8(_mm512_castps256_ps512(kv_load8(a, e, type)), kv_load8(b, e, type), 1);
    case KV_BF16: {
        const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 2 * e))),
                                                  _mm_loadu_si128((const __m128i *)(b + 2 * e)), 1);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    default: {
        const uint8_t *ba = a + e / Q8_0_VALUES * Q8_0_BYTES, *bb = b + e / Q8_0_VALUES * Q8_0_BYTES;
        uint16_t da, db;
        memcpy(&da, ba, 2);
        memcpy(&db, bb, 2);
        int64_t ca, cb;
        memcpy(&ca, ba + 2 + e % Q8_0_VALUES, 8);
        memcpy(&cb, bb + 2 + e % Q8_0_VALUES, 8);
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x(cb, ca)));
        const __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(_cvtsh_ss(da))),
                                                _mm256_set1_ps(_cvtsh_ss(db)), 1);
        return _mm512_mul_ps(q, scale);
    }
    }
}
#endif

/* float32 -> bfloat16 bits, round to nearest even (finite inputs). */
static inline __m128i bf16_round8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    return _mm256_castsi256_si128(packed);
}

/* One q8_0 block of 32 values from x. */
static inline void q8_0_block(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int i = 0; i < Q8_0_VALUES; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    memcpy(out, &dh, 2);
    for (int i = 0; i < Q8_0_VALUES; i++) out[2 + i] = (uint8_t)(int8_t)nearbyintf(x[i] * id);
}

/* A row of D float32 values (D a multiple of 8; of 32 for q8_0) stored as `type`. */
static inline void kv_store_row(const float *x, int64_t D, uint8_t *row, int type) {
    switch (type) {
    case KV_F32:
        memcpy(row, x, (size_t)D * 4);
        break;
    case KV_F16:
        for (int64_t i = 0; i < D; i += 8)
            _mm_storeu_si128((__m128i *)(row + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        break;
    case KV_BF16:
        for (int64_t i = 0; i < D; i += 8) _mm_storeu_si128((__m128i *)(row + 2 * i), bf16_round8(_mm256_loadu_ps(x + i)));
        break;
    default:
        for (int64_t b = 0; b < D / Q8_0_VALUES; b++) q8_0_block(x + b * Q8_0_VALUES, row + b * Q8_0_BYTES);
    }
}

#endif
