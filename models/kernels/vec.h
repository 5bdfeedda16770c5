/* One vector type per build variant, so the quantized-linear kernels are written once: 16 float lanes
 * in the AVX-512 builds, 8 in the AVX2 build. A 16-row weight tile is HALVES vectors wide.
 *
 * Every helper does the same IEEE operations per lane in both widths (and the library is built with
 * -ffp-contract=off, so no multiply-add is fused behind our back): a weight tile gives bit-identical
 * results whichever variant runs it. */
#ifndef ORCA_VEC_H
#define ORCA_VEC_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_mul _mm512_mul_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_max _mm512_max_ps
#define vf_fma _mm512_fmadd_ps
#define vf_loadu _mm512_loadu_ps
#define vf_load _mm512_load_ps
#define vf_storeu _mm512_storeu_ps
#define vf_store _mm512_store_ps
#define vi_zero _mm512_setzero_si512
#define vi_set1 _mm512_set1_epi32
#define vi_set1_8 _mm512_set1_epi8
#define vi_add _mm512_add_epi32
#define vi_add8 _mm512_add_epi8
#define vi_sub _mm512_sub_epi32
#define vi_and _mm512_and_si512
#define vi_xor _mm512_xor_si512
#define vi_srli16 _mm512_srli_epi16
#define vi_slli16 _mm512_slli_epi16
#define vi_slli32 _mm512_slli_epi32
#define vi_or _mm512_or_si512
#define vi_mullo _mm512_mullo_epi32
/* a | (b & mask) in one instruction */
#define vi_or_and(a, b, mask) _mm512_ternarylogic_epi32(a, b, mask, 0xF8)
#define vi_to_f _mm512_cvtepi32_ps
#define vf_to_i _mm512_cvtps_epi32 /* current rounding mode: to nearest, ties to even */
static inline vi vi_loadu(const void *p) { return _mm512_loadu_si512(p); }
static inline void vi_storeu(void *p, vi v) { _mm512_storeu_si512(p, v); }
static inline vf vf_neg(vf v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}
static inline vf vf_abs(vf v) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
}
static inline float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline int32_t vi_hsum(vi v) { return _mm512_reduce_add_epi32(v); }
/* LANES values starting at p + h * LANES (h: which half of a 16-row tile): f16, u8, s8 -> float. */
static inline vf load_f16(const uint8_t *p, int h) {
    (void)h;
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline vf load_bf16(const uint8_t *p, int h) { /* a bfloat16 is a float32's upper half */
    (void)h;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf load_u8f(const uint8_t *p, int h) {
    (void)h;
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf load_s8f(const uint8_t *p, int h) {
    (void)h;
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* The same, as int32 (h unused: one vector holds all 16 lanes). */
static inline vi load_u8i(const uint8_t *p, int h) { return (void)h, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi load_s8i(const uint8_t *p, int h) { return (void)h, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* Store the first n (< LANES) lanes. */
static inline void vf_store_n(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
/* LANES floats -> LANES int8 (values already in [-127, 127]). */
static inline void vi_store_i8(int8_t *p, vi v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(v)); }

/* Each byte (0..15) replaced by table[byte]: a 16-entry codebook in one shuffle (IQ4_XS's values). */
static inline vi vi_table16(vi idx, const int8_t *table) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table)), idx);
}

/* acc + for each 32-bit lane the dot product of its 4 unsigned bytes of w with the 4 signed of x. */
static inline vi dot_us(vi acc, vi w, vi x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}

/* A unit of signed codes, prepared once for dot_ss against many rows of x. */
typedef struct {
    vi w, aux;
} sunit;
#if defined(__AVX512VNNI__)
/* vpdpbusd wants unsigned weights: w + 128 (a xor), and the caller subtracts 128 * sum(x). */
#define SIGNED_BIAS 128
static inline sunit prep_signed(vi w) { return (sunit){_mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), w}; }
static inline vi dot_ss(vi acc, sunit u, vi x) { return _mm512_dpbusd_epi32(acc, u.w, x); }
#else
/* vpmaddubsw: |w| (unsigned) times x with w's sign; |w| <= 128 and |x| <= 127 cannot saturate. */
#define SIGNED_BIAS 0
static inline sunit prep_signed(vi w) { return (sunit){_mm512_abs_epi8(w), w}; }
static inline vi dot_ss(vi acc, sunit u, vi x) {
    const vi sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(u.aux), _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u.w, sx), _mm512_set1_epi16(1)));
}
#endif

/* Unit (LANES rows x 4 k bytes) -> the 4 vectors of LANES codes, one per k (k-major, for the float
 * path): bytes regrouped by k inside each 128-bit lane, then the lanes' dwords gathered. */
static inline void unit_by_k(vi u, int is_signed, vi q[4]) {
    const vi s = _mm512_shuffle_epi8(u, _mm512_set4_epi32(0x0f0b0703, 0x0e0a0602, 0x0d090501, 0x0c080400));
    for (int t = 0; t < 4; t++) {
        const __m128i b = _mm512_castsi512_si128(
            _mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12 + t, 8 + t, 4 + t, t), s));
        q[t] = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    }
}

#else /* AVX2 */
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_mul _mm256_mul_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_max _mm256_max_ps
#define vf_fma _mm256_fmadd_ps
#define vf_loadu _mm256_loadu_ps
#define vf_load _mm256_load_ps
#define vf_storeu _mm256_storeu_ps
#define vf_store _mm256_store_ps
#define vi_zero _mm256_setzero_si256
#define vi_set1 _mm256_set1_epi32
#define vi_set1_8 _mm256_set1_epi8
#define vi_add _mm256_add_epi32
#define vi_add8 _mm256_add_epi8
#define vi_sub _mm256_sub_epi32
#define vi_and _mm256_and_si256
#define vi_xor _mm256_xor_si256
#define vi_srli16 _mm256_srli_epi16
#define vi_slli16 _mm256_slli_epi16
#define vi_slli32 _mm256_slli_epi32
#define vi_or _mm256_or_si256
#define vi_mullo _mm256_mullo_epi32
#define vi_or_and(a, b, mask) _mm256_or_si256(a, _mm256_and_si256(b, mask))
#define vi_to_f _mm256_cvtepi32_ps
#define vf_to_i _mm256_cvtps_epi32
static inline vi vi_loadu(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_storeu(void *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline vf vf_neg(vf v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
static inline vf vf_abs(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline float vf_hmax(vf v) { return hmax8(v); }
static inline int32_t vi_hsum(vi v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
static inline vf load_f16(const uint8_t *p, int h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h))); }
static inline vf load_bf16(const uint8_t *p, int h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * h))), 16));
}
static inline vf load_u8f(const uint8_t *p, int h) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))));
}
static inline vf load_s8f(const uint8_t *p, int h) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))));
}
static inline vi load_u8i(const uint8_t *p, int h) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))); }
static inline vi load_s8i(const uint8_t *p, int h) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))); }
static inline void vf_store_n(float *p, vf v, int n) {
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    memcpy(p, tmp, (size_t)n * sizeof(float));
}
static inline void vi_store_i8(int8_t *p, vi v) {
    /* 8 int32 in [-127, 127] -> 8 bytes: saturating packs keep them, the permute undoes the lane split. */
    const __m256i w = _mm256_packs_epi32(v, v);                    /* int16: lanes [0-3 0-3 | 4-7 4-7] */
    const __m256i b = _mm256_packs_epi16(w, w);                    /* int8 */
    const __m256i o = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i *)p, _mm256_castsi256_si128(o));
}

static inline vi vi_table16(vi idx, const int8_t *table) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)), idx);
}

static inline vi dot_us(vi acc, vi w, vi x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
#if !defined(__AVXVNNI__)
/* Without vpdpbusd: a block's 8 units of 4-bit codes (0..15) against int8 x (|x| <= 127) summed in 16
 * bits and widened once. Exact: a vpmaddubsw lane is at most 2 * 15 * 127 = 3810 in magnitude, 8 of
 * them 30480 < 32767, so these are dot_us's integers with one vpmaddwd per block instead of per unit. */
#define DOT_US16 1
static inline vi dot_us16(vi acc16, vi w, vi x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x)); }
static inline vi widen_us16(vi acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
/* An opaque use of v that keeps it whole in a register at this point. A micro-kernel's sums are integer
 * adds, which GCC may reassociate: unrolled over a block's units it computed all the products first,
 * spilled them (16 registers hold 8 sums, the codes and x) and added them in a tree. Pinning the sums
 * after each unit keeps one multiply-add chain a sum: 2-core Zen 3, 8192 x 2048 at 2-128 rows of x, Q4_K
 * / Q4_0 / Q4_1 1.33-1.6x (16-bit sums), Q8_0 1.10-1.13x and IQ4_XS 1.17-1.24x (32-bit). */
static inline void vi_keep(vi *v) { __asm__("" : "+x"(*v)); }
#endif

typedef struct {
    vi w, aux;
} sunit;
#define SIGNED_BIAS 0
static inline sunit prep_signed(vi w) { return (sunit){_mm256_abs_epi8(w), w}; }
static inline vi dot_ss(vi acc, sunit u, vi x) {
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u.w, _mm256_sign_epi8(x, u.aux)), _mm256_set1_epi16(1)));
}

static inline void unit_by_k(vi u, int is_signed, vi q[4]) {
    const vi s = _mm256_shuffle_epi8(
        u, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6,
                            10, 14, 3, 7, 11, 15));
    for (int t = 0; t < 4; t++) {
        const __m128i b =
            _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(t, 4 + t, 0, 0, 0, 0, 0, 0)));
        q[t] = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    }
}
#endif

#ifndef DOT_US16
#define DOT_US16 0
#endif

/* acc + for each 32-bit lane the dot product of its two int16 of a with the two of b. */
static inline vi dot_pairs16(vi acc, vi a, vi b) {
#if LANES == 16 && defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#elif LANES == 16
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

#define HALVES (16 / LANES)
/* The first n lanes of v to p: all of them from LANES on, none from 0 down (a tile's short last rows). */
static inline void vf_store_upto(float *p, vf v, int n) {
    if (n >= LANES)
        vf_storeu(p, v);
    else if (n > 0)
        vf_store_n(p, v, n);
}
#define UNIT_BYTES (4 * LANES) /* one vector of codes: LANES rows x 4 k */

static inline int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The 4 bytes at p in every 32-bit lane, broadcast straight from memory (vpbroadcastd v, m32: a load,
 * no ALU op; through a general register it takes a vector ALU slot, a quarter of a unit's work). */
static inline vi vi_bcast32(const void *p) {
#if LANES == 16
    return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
#else
    return _mm256_set1_epi32(load_i32(p)); /* the compiler's own choice: the memory form here */
#endif
}

/* e^x (simd.h's exp8 per 8 lanes) and the sum of the lanes (simd.h's hsum8 per 8, then added). */
static inline vf vf_exp(vf x) {
#if LANES == 16
    const __m256 lo = exp8(_mm512_castps512_ps256(x));
    const __m256 hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
#else
    return exp8(x);
#endif
}

static inline float vf_hsum(vf v) {
#if LANES == 16
    return hsum8(_mm512_castps512_ps256(v)) + hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
    return hsum8(v);
#endif
}

#endif
