/* The tiled block-quantized weight layout shared by the quantized-linear kernels
 * (models/layers/packed_weight.py builds it and mirrors every size here).
 *
 * A weight W [N, K] is cut into tiles of 16 rows (the last one padded with zero rows). A tile is one
 * contiguous stream along K, so a thread reading it gives the hardware prefetcher one stream:
 *
 *   tile  = super-block x (K / (32 * blocks_per_super))
 *   super = header, then blocks_per_super x (codes, sub-scales)
 *   codes = 8 units of 4 k x 16 rows ("unit u" holds k = 4u..4u+3 of the block, bytes row-major:
 *           row r's 4 codes at 4r..4r+3; the VNNI/AMX B-operand layout: one vpdpbusd per unit).
 *           8-bit codes: 8 x 64 bytes, signed. Codes below 8 bits are unsigned, in a plane of their
 *           low L bits (qf_low_bits: L = 4 for 4- to 6-bit codes, 2 for 2- and 3-bit ones), L x 64
 *           bytes, unit u's at bit L * (u / L) of byte group u % L: 4-bit codes (L = 4) have unit u
 *           in the low nibbles of byte group u and unit u + 4 in the high nibbles (GGUF's own nibble
 *           order: k and k + 16 share a byte); 2-bit codes (L = 2) units u and u + 2, u + 4, u + 6
 *           at bits 0, 2, 4, 6 of byte group u (u = 0, 1). Codes of more than L bits (Q5_*, Q6_K,
 *           Q3_K) then have a plane of their high bits, h = bits - L bits a code, h x 64 bytes:
 *           unit u's in byte group u / (8 / h) at bit h * (u % (8 / h)) (6-bit: 2 groups, units
 *           0..3 and 4..7 at bits 0, 2, 4, 6; 5- and 3-bit: 1 group, unit u at bit u). So a block
 *           holds exactly the file's 2, 3, 4, 5 or 6 bits a weight.
 *
 * Every weight is w = a * q + z, with a * q exact in float32 for every format (so fma(a, q, z)
 * rounds once, as gguf-py's (a * q) + z does) and:
 *   kind F16 (Q4_0 Q4_1 Q8_0 Q5_0 Q5_1 IQ4_NL): header = a as 16 x f16 [+ z as 16 x f16]; no sub-scales;
 *                                        one block per super
 *   kind K   (Q4_K Q5_K IQ4_XS): header = d [, dmin] as 16 x f16; sub-scales per block: sc [, m]
 *                         16 x u8 (IQ4_XS: sc s8); a = d * sc, z = -(dmin * m); 8 blocks per super
 *                         (GGUF's 256)
 *   kind RAW (F16 BF16): no header, no scales: a block is its 32 k x 16 rows of 16-bit floats, k-major
 *                         (k's 16 rows together: one vector's conversion to float32), w exact
 *   kind K16 (Q6_K Q3_K Q2_K): header = d [, dmin] as 16 x f16 [Q6_K Q3_K: then the code bias as
 *                         16 x int32, see qf_has_bias]; sub-scales per block: 2 x 16 x s8
 *                         (Q2_K: u8) sc for k 0..15 and 16..31 [+ 2 x 16 x u8 m]; a = d * sc and
 *                         z = -(dmin * m) per 16 k; 8 blocks per super
 * Codes below 8 bits are stored unsigned, as in the file: Q4_0's (0..15) offset by -8, Q3_K's by -4,
 * Q5_0's (0..31) by -16, Q6_K's (0..63) by -32; Q2_K's (0..3) as they are. IQ4_XS's and IQ4_NL's 4-bit codes index a
 * 16-entry codebook of int8 values (IQ4_NL_VALUES: llama.cpp's kvalues_iq4nl); the kernels turn a unit of them into those int8 values
 * with one byte shuffle, and from there on treat them as 8-bit signed codes (llama.cpp's route).
 */
#ifndef ORCA_QUANT_TILES_H
#define ORCA_QUANT_TILES_H

#include <stdint.h>

enum { QF_Q4_0 = 0, QF_Q4_1, QF_Q8_0, QF_Q5_0, QF_Q5_1, QF_Q4_K, QF_Q5_K, QF_Q6_K, QF_Q2_K, QF_Q3_K, QF_IQ4_XS, QF_IQ4_NL, QF_F16, QF_BF16, QF_COUNT };
enum { KIND_F16 = 0, KIND_K, KIND_K16, KIND_RAW };

#define TILE_ROWS 16
#define QBLOCK 32

/* IQ4_NL / IQ4_XS's codebook (ggml's kvalues_iq4nl), in the order of the 4-bit codes. */
static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int qf_bits(int f) {
    return f == QF_F16 || f == QF_BF16                   ? 16
           : f == QF_Q8_0                                ? 8
           : f == QF_Q6_K                                ? 6
           : f == QF_Q5_0 || f == QF_Q5_1 || f == QF_Q5_K ? 5
           : f == QF_Q3_K                                ? 3
           : f == QF_Q2_K                                ? 2
                                                         : 4;
}
/* Bits of a code below 8 bits that its low plane holds (the rest are in the high bits' plane). */
static inline int qf_low_bits(int f) { return qf_bits(f) < 4 ? 2 : 4; }
static inline int qf_kind(int f) {
    return f == QF_Q4_K || f == QF_Q5_K || f == QF_IQ4_XS             ? KIND_K
           : f == QF_Q6_K || f == QF_Q3_K || f == QF_Q2_K ? KIND_K16
           : f == QF_F16 || f == QF_BF16                  ? KIND_RAW
                                                          : KIND_F16;
}
static inline int qf_has_min(int f) {
    return f == QF_Q4_1 || f == QF_Q5_1 || f == QF_Q4_K || f == QF_Q5_K || f == QF_Q2_K;
}
static inline int qf_offset(int f) {
    return f == QF_Q4_0 ? -8 : f == QF_Q3_K ? -4 : f == QF_Q5_0 ? -16 : f == QF_Q6_K ? -32 : 0;
}
/* The 4-bit codes index IQ4_NL_VALUES. */
static inline int qf_codebook(int f) { return f == QF_IQ4_XS || f == QF_IQ4_NL; }
/* Sub-scales stored signed (s8) rather than unsigned (u8). */
static inline int qf_sub_signed(int f) { return f == QF_Q6_K || f == QF_Q3_K || f == QF_IQ4_XS; }
/* A unit of codes, as the kernels use it, holds signed int8 values (8-bit codes, codebook values)
 * rather than unsigned codes of 4 to 6 bits. */
static inline int qf_signed_units(int f) { return qf_bits(f) == 8 || qf_codebook(f); }
/* Unsigned codes of at most 4 bits (0..15): a block's 8 units of products with int8 x sum within 16 bits. */
static inline int qf_small_codes(int f) { return qf_bits(f) <= 4 && !qf_codebook(f); }
static inline int qf_blocks_per_super(int f) { return qf_kind(f) == KIND_F16 || qf_kind(f) == KIND_RAW ? 1 : 8; }
static inline int64_t qf_code_bytes(int f) { return (int64_t)qf_bits(f) * 64; }
static inline int64_t qf_sub_bytes(int f) {
    return qf_kind(f) == KIND_K ? 16 * (1 + qf_has_min(f)) : qf_kind(f) == KIND_K16 ? 32 * (1 + qf_has_min(f)) : 0;
}
/* The K16 kind without minimums (Q6_K, Q3_K) keeps in its header, after d, each row's code bias over the
 * super-block: -128 * sum_j sc_j * sum_{k in j} (q_k + offset), as 16 x int32. A kernel that takes x + 128
 * unsigned against the codes made signed starts its sums there (int_tile_super), and needs no offset
 * correction over the sums of x. */
static inline int qf_has_bias(int f) { return qf_kind(f) == KIND_K16 && !qf_has_min(f); }
/* Bytes of a header's scales (d [, dmin] as 16 x f16): the code bias, where there is one, follows them. */
static inline int64_t qf_scale_bytes(int f) { return qf_kind(f) == KIND_RAW ? 0 : 32 * (1 + qf_has_min(f)); }
static inline int64_t qf_header_bytes(int f) { return qf_scale_bytes(f) + 64 * qf_has_bias(f); }
static inline int64_t qf_super_bytes(int f) {
    return qf_header_bytes(f) + qf_blocks_per_super(f) * (qf_code_bytes(f) + qf_sub_bytes(f));
}
static inline int64_t qf_super_k(int f) { return (int64_t)QBLOCK * qf_blocks_per_super(f); }
static inline int64_t qf_tile_bytes(int f, int64_t K) { return K / qf_super_k(f) * qf_super_bytes(f); }

/* Where block g (k = 32g .. 32g + 31) of a tile lies: its super-block's header, its codes and its
 * sub-scales. With a constant format (the kernels are instantiated per format) this folds to shifts. */
typedef struct {
    const uint8_t *hdr, *codes, *sub;
} qblock;
static inline __attribute__((always_inline)) qblock qf_block(const uint8_t *tile, int f, int64_t g) {
    const int bps = qf_blocks_per_super(f);
    const uint8_t *hdr = tile + g / bps * qf_super_bytes(f);
    const uint8_t *codes = hdr + qf_header_bytes(f) + g % bps * (qf_code_bytes(f) + qf_sub_bytes(f));
    return (qblock){hdr, codes, codes + qf_code_bytes(f)};
}

#endif
