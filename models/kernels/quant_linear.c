/* y[M, N] = x[M, K] @ W^T for a block-quantized weight in the tiled layout of quant_tiles.h.
 *
 * Two precisions:
 *   int8     (the fast path, llama.cpp's route) each row of x is quantized to int8 with one float
 *            scale (dx = max|x| / 127) per block of 32 (Q8_0's grouping) for the formats with one
 *            scale a block, per super-block of 256 (Q8_K's) for the K-quants; every dot product with
 *            the weight codes is an exact integer (vpdpbusd, vpmaddubsw, or AMX tiles); then per
 *            block, one float multiply-add:  y = fma(float(isum), a * dx, y)  [+ fma(z, dx * sum(xq), y)],
 *            or for a K-quant the sub-scales weigh the integers and one per super-block
 *            (int_tile_super)
 *   float32  (the reference) the weights are dequantized exactly (w = fma(a, q, z), bit-identical
 *            to gguf-py and so to transformers) and y = fma(x_k, w_k, y) runs over k in order.
 *
 * Batch invariance by construction: every output element is computed by the same sequence of
 * floating-point operations whatever the number of rows of x and whichever loop runs it (the float
 * work is vectorized across output columns, never across k, and no path sums in another order).
 * A request's output never depends on what shares its batch, and every ISA variant (quant_tiles.h,
 * vec.h) gives bit-identical results.
 *
 * Work is split over 16-row weight tiles by OpenMP; rows of x go in blocks (the int8 x of a block
 * stays in L2 across tiles) and register-tiled micro-kernels of up to MR rows reuse each weight
 * vector for all of them.
 */
#include <math.h>
#include <stdlib.h>

#include "quant_tiles.h"
#include "vec.h"

#if defined(__AVX512F__)
#define MR_INT 8  /* rows of x per int8 micro-kernel: 8 isum + 8 acc + 4 work vectors */
/* Rows per pass for the formats with a code bias (biased): with no correction pairs to keep, 12 rows'
 * sums fit the registers, and each unit's unpacking (two planes, the offset: the part of a Q6_K pass
 * that is not dot products) serves half as many rows again. 2-core Zen 5, Q6_K at 32-96 rows against 8:
 * 1.07-1.10x; 16 rows spill (0.69x). */
#if defined(__AVX512VNNI__)
#define MR_BIASED 12
#else
#define MR_BIASED MR_INT
#endif
#define MR_FLT 12 /* rows of x per float micro-kernel: 12 acc + weight + broadcast */
#else
#define MR_INT 4 /* 4-bit codes: 2 x 4 16-bit sums + 2 weight vectors + x (the 8 float accumulators wait in L1) */
#define MR_FLT 6 /* the BLIS-style 6 x 16: 12 accumulators */
/* The formats with a code bias (biased: Q6_K, Q3_K): each unit's unpacking (two planes, the offset) serves
 * 8 rows (Q6_K: 8 sums in 32 bits and a 16-bit temporary, biased_super16). 2-core Zen 3, against 4 rows,
 * Q6_K 8192 x 2048 at 8-128 rows 1.14-1.21x; Q3_K (the other biased format) even. */
#define MR_BIASED 8
#endif
#define MR_MAX (MR_BIASED > MR_INT ? MR_BIASED : MR_INT)
/* Rows of x from which tiles go in pairs (pair_tile, pair_tile_super: AVX-512 VNNI): PAIR_MIN_ROWS, or
 * PAIR_MIN_ROWS_LONG for weights of K >= PAIR_LONG_K. Below, one tile a pass. A pair kernel takes 4 rows
 * a pass where the one-tile kernel takes 8, so at few rows a pair streams its weights from memory with
 * half the work to hide it behind, then passes over them again from cache: with weights streamed from
 * memory (more of them than the L3 holds), Q4_1 3072 x 576 ran 0.78x at 8 rows and 0.91x at 16, 1.04x
 * at 32; with K 2048 pairs won from 16 rows (Q4_K 1.10x, Q4_1 1.12x, Q8_0 1.11x), Q4_1 lost at 3 (0.89x)
 * and 8 (0.96x). Compute-bound (prompts, large batches) every row count gained. */
#ifndef PAIR_MIN_ROWS
#define PAIR_MIN_ROWS 32
#endif
#ifndef PAIR_MIN_ROWS_LONG
#define PAIR_MIN_ROWS_LONG 16
#endif
#define PAIR_LONG_K 2048
#define M_BLOCK 256 /* rows of x per block (int8 x of 256 rows x K = 1536: 384 KB, in L2) */
#define KC_FLT 512  /* columns per dequantized float chunk: 16 x 512 floats = 32 KB */
/* Rows x tiles x K below which one thread does it all. 1 << 13: a batch-1 decode step's smallest
 * linear (SmolLM2's o projection, 576 x 576, 36 tiles) is split too; at 1 << 15 it ran on one thread
 * at ~11 GB/s, 0.46 -> 0.31 ms of a 4 ms native decode call (30 layers, 2-core AVX2 EPYC). */
#define PARALLEL_MIN_WORK (1 << 13)
/* Bytes ahead of the current block that the int8 path prefetches: a tile is one stream, and at few
 * rows of x the loop is bound by how fast that stream arrives, not by arithmetic. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2048
#endif
/* Rows of x from which the int8 micro-kernels prefetch codes that the hardware prefetcher alone
 * streams faster at fewer rows (hw_streamed). At one or two rows such a loop does little but read the
 * tile: on the AVX-512 kernels (2-core Zen 4) the software prefetches made a Q4_K GEMM over weights from
 * memory 10-27% slower at one row and 5-10% at two, Q8_0 1-4% and 12-16%. Codes that take more work a
 * byte to unpack (two planes: 3, 5 and 6 bits; a codebook's) want the prefetches at every row count:
 * without them Q6_K ran 9-12% slower at one row, 23-28% at two, IQ4_XS 16% at two, Q3_K 3-11% faster at
 * one row but 11-17% slower at two. The AVX2 kernels (2-core Zen 3, weights from memory, in-process A/B,
 * fastest of 20-25 interleaved rounds, bit-identical) want them for 4-bit codes too: with them Q4_K ran
 * 1.11-1.30x faster at one row and 1.19-1.49x at two (K 2048 and 14336), Q4_0 and Q4_1 1.05x and
 * 1.17-1.25x; bytes from two rows (Q8_0 0.92-0.93x at one row, 1.14-1.28x at two). */
#ifndef PREFETCH_MIN_ROWS
#if DOT_US16
#define PREFETCH_MIN_ROWS 2
#else
#define PREFETCH_MIN_ROWS 3
#endif
#endif
/* Rows of x from which the AVX2 kernels pin their integer sums (16- or 32-bit) after each unit (vec.h's
 * vi_keep). At one row GCC's own schedule is as fast. */
#ifndef KEEP_MIN_ROWS
#define KEEP_MIN_ROWS 2
#endif
/* Codes that take one or two instructions a unit to unpack: one plane of 2 or 4 bits, or bytes. */
static inline int cheap_codes(const int fmt) {
    return qf_bits(fmt) == 8 || (qf_bits(fmt) == qf_low_bits(fmt) && !qf_codebook(fmt));
}
/* Codes that the hardware prefetcher streams faster alone below PREFETCH_MIN_ROWS rows (above). */
static inline int hw_streamed(const int fmt) { return DOT_US16 ? qf_bits(fmt) == 8 : cheap_codes(fmt); }
static inline int prefetches(const int fmt, const int mr) { return mr >= PREFETCH_MIN_ROWS || !hw_streamed(fmt); }
/* A block's codes and sub-scales PREFETCH_AHEAD bytes on, into L1. */
static inline __attribute__((always_inline)) void prefetch_ahead(const qblock blk, const int fmt) {
#if PREFETCH_AHEAD
    for (const uint8_t *pf = blk.codes + PREFETCH_AHEAD; pf < blk.sub + qf_sub_bytes(fmt) + PREFETCH_AHEAD; pf += 64)
        _mm_prefetch((const char *)pf, _MM_HINT_T0);
#else
    (void)blk, (void)fmt;
#endif
}

/* ------------------------------------------------------------------------------------------------
 * The activations, quantized. */

typedef struct {
    int8_t *q;      /* [M, K], rows ld bytes apart */
    float *d;       /* [M, G] the scale of each block's values (with SUPER_GROUP: its super-block's) */
    float *s;       /* [M, G] d * sum(q) over the block (the min term of Q4_1, Q5_1) */
    int16_t *sum16; /* [M, 2G] sum(q) per 16 k (|sum| <= 16 * 127): two neighbours are a vpdpwssd pair */
    int16_t *sum32; /* [M, G] sum(q) per block of 32, in 16 bits likewise */
    uint8_t *u;     /* [M, K] q + 128 (unsigned), for the formats with a code bias (biased), else NULL; rows ld
                       bytes apart */
    int64_t K, G;
    int64_t ld; /* x_row_bytes(K) */
} qx_t;

/* The formats with a code bias in their header (quant_tiles.h: Q6_K, Q3_K) take x + 128 (unsigned)
 * against their codes made signed, and their integer sums start at the bias: the offset correction over
 * x's sums (8 vpdpwssd a row and super-block, and their broadcasts) is gone. Bit-identical (the same
 * integers); 2-core Zen 5, against the correction: Q6_K 2048 x 8192 1.06-1.16x at 1-96 rows (with
 * MR_BIASED's 12 rows a pass), a 128k-vocab head from DRAM 1.15x at 32-64 rows. */
static inline int biased(const int fmt) { return qf_has_bias(fmt); }

/* Values of x per scale for the K-quants (the K and K16 kinds): one super-block, llama.cpp's Q8_K.
 * With x's scale constant over a super-block, the sub-scales multiply the integer dot products as
 * integers and one float step per super-block remains (int_tile_super), where a scale per 32 values
 * took three or four float steps per sub-group and row. */
#define SUPER_GROUP 256

/* Bytes between rows of the int8 x: K, made an odd multiple of 64 where it is not. A micro-kernel
 * broadcasts 4 bytes from each of its rows in turn, at the same offset; with rows a power of two apart
 * (K 2048, 4096, 8192: most hidden and intermediate sizes) those loads conflict in the L1 (2-core Zen 3,
 * 8 rows' vpbroadcastd + vpmaddubsw from a C loop: rows 2048 or 8192 bytes apart 2-3x slower than 2112
 * or 8256, 4096 3-4x slower than 4160; the kernels, whose loops do more beside: Q4_K and Q6_K 2048 x 8192
 * 1.04-1.08x at 8-128 rows, even at K 2048). */
static inline int64_t x_row_bytes(int64_t K) {
    const int64_t ld = (K + 63) / 64 * 64;
    return ld / 64 % 2 ? ld : ld + 64;
}

static void quantize_row(const float *x, int64_t K, int group, int8_t *q, float *d, float *s, int16_t *sum16,
                         int16_t *sum32) {
    for (int64_t g0 = 0; g0 < K / QBLOCK; g0 += group / QBLOCK) {
        vf m = vf_zero();
        for (int k = 0; k < group; k += LANES) m = vf_max(m, vf_abs(vf_loadu(x + g0 * QBLOCK + k)));
        const float amax = vf_hmax(m);
        const float dg = amax / 127.0f, id = dg != 0.0f ? 1.0f / dg : 0.0f;
        for (int64_t g = g0; g < g0 + group / QBLOCK; g++) {
            const float *xb = x + g * QBLOCK;
            int32_t half[2];
            for (int h = 0; h < 2; h++) {
                vi acc = vi_zero();
                for (int k = 16 * h; k < 16 * h + 16; k += LANES) {
                    const vi v = vf_to_i(vf_mul(vf_loadu(xb + k), vf_set1(id)));
                    vi_store_i8(q + g * QBLOCK + k, v);
                    acc = vi_add(acc, v);
                }
                half[h] = vi_hsum(acc);
            }
            d[g] = dg;
            sum16[2 * g] = (int16_t)half[0];
            sum16[2 * g + 1] = (int16_t)half[1];
            sum32[g] = (int16_t)(half[0] + half[1]);
            s[g] = dg * (float)(half[0] + half[1]);
        }
    }
}

static int quantize_x(const float *x, int64_t M, int64_t K, int group, int unsigned_too, qx_t *out) {
    const int64_t G = K / QBLOCK;
    const int64_t ld = x_row_bytes(K);
    char *buf = malloc((size_t)((1 + unsigned_too) * M * ld + M * G * (2 * sizeof(float) + 3 * sizeof(int16_t)) + 64));
    if (!buf) return 1;
    out->K = K;
    out->G = G;
    out->ld = ld;
    out->d = (float *)buf;
    out->s = out->d + M * G;
    out->sum16 = (int16_t *)(out->s + M * G);
    out->sum32 = out->sum16 + 2 * M * G;
    out->q = (int8_t *)(out->sum32 + M * G);
    out->u = unsigned_too ? (uint8_t *)(out->q + M * ld) : NULL;
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_MIN_WORK)
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * K, K, group, out->q + m * ld, out->d + m * G, out->s + m * G, out->sum16 + 2 * m * G,
                     out->sum32 + m * G);
        if (unsigned_too) /* q + 128 = q ^ 0x80 as bytes */
            for (int64_t k = 0; k < K; k += UNIT_BYTES)
                vi_storeu(out->u + m * ld + k, vi_xor(vi_loadu(out->q + m * ld + k), vi_set1_8((char)0x80)));
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Scales of one block of a tile, for half h of its 16 rows: a and z of its first 16 k (a0, z0) and of
 * its last 16 (a1, z1); the same for formats with one scale per block. */

typedef struct {
    vf a0, a1, z0, z1;
} bscale;

static inline __attribute__((always_inline)) vf sub_scale_f(const uint8_t *sub, const int fmt, int h) {
    return qf_sub_signed(fmt) ? load_s8f(sub, h) : load_u8f(sub, h);
}

static inline __attribute__((always_inline)) bscale block_scales(const uint8_t *hdr, const uint8_t *sub, const int fmt,
                                                                 int h) {
    bscale r;
    const int kind = qf_kind(fmt), has_min = qf_has_min(fmt);
    if (kind == KIND_F16) {
        r.a0 = r.a1 = load_f16(hdr, h);
        r.z0 = r.z1 = has_min ? load_f16(hdr + 32, h) : vf_zero();
    } else if (kind == KIND_K) {
        r.a0 = r.a1 = vf_mul(load_f16(hdr, h), sub_scale_f(sub, fmt, h));
        r.z0 = r.z1 = has_min ? vf_neg(vf_mul(load_f16(hdr + 32, h), load_u8f(sub + 16, h))) : vf_zero();
    } else {
        const vf d = load_f16(hdr, h);
        r.a0 = vf_mul(d, sub_scale_f(sub, fmt, h));
        r.a1 = vf_mul(d, sub_scale_f(sub + 16, fmt, h));
        if (has_min) { /* Q2_K: a minimum per 16 k too */
            const vf dmin = load_f16(hdr + 32, h);
            r.z0 = vf_neg(vf_mul(dmin, load_u8f(sub + 32, h)));
            r.z1 = vf_neg(vf_mul(dmin, load_u8f(sub + 48, h)));
        } else
            r.z0 = r.z1 = vf_zero();
    }
    return r;
}

/* Unit u (k = 4u..4u+3) of half h of a block's codes, as bytes: codes below 8 bits unpacked to their
 * unsigned value (the low bits from their plane and, for codes wider than it, the high bits from theirs),
 * or, for a codebook format, to the codebook's int8 values. */
static inline __attribute__((always_inline)) vi code_unit(const uint8_t *codes, const int fmt, int u, int h) {
    const int bits = qf_bits(fmt);
    if (bits == 8) return vi_loadu(codes + 64 * u + UNIT_BYTES * h);
    const int lb = qf_low_bits(fmt), ls = lb * (u / lb);
    /* The shifts are 16-bit: the neighbouring byte's bits move in at bits 8 - ls .. 7, above the mask. */
    const vi p = vi_loadu(codes + 64 * (u % lb) + UNIT_BYTES * h);
    vi n = vi_and(ls ? vi_srli16(p, ls) : p, vi_set1_8((char)((1 << lb) - 1)));
    if (bits > lb) {
        const int hb = bits - lb, per = 8 / hb; /* high bits a code; units a byte of the plane holds */
        const vi hp = vi_loadu(codes + 64 * lb + 64 * (u / per) + UNIT_BYTES * h);
        /* Unit u's high bits (at bit hb * (u % per)) moved to bit lb. Bits of the neighbouring byte
         * move in only at bits 0..sh-1 (left) or 8-sh..7 (right, sh <= 5), never at the lb .. lb + hb - 1
         * that the mask keeps. */
        const int sh = lb - hb * (u % per);
        const vi hs = sh > 0 ? vi_slli16(hp, sh) : sh < 0 ? vi_srli16(hp, -sh) : hp;
        n = vi_or_and(n, hs, vi_set1_8((char)(((1 << hb) - 1) << lb)));
    }
    return qf_codebook(fmt) ? vi_table16(n, IQ4_NL_VALUES) : n;
}

/* Sub-groups per block: K16's two halves of 16 k, or the K kind's whole block. */
static inline int sub_groups(const int fmt) { return qf_kind(fmt) == KIND_K16 ? 2 : 1; }

/* Units whose vpmaddubsw products one 16-bit sum holds exactly (AVX2's dot_us16; 1 where there is no
 * such sum, or for signed units, whose products reach 2 * 128 * 127). A product lane is at most
 * 2 * max|unsigned operand| * max|signed operand|: 5-bit codes (0..31) against int8 x 7874, so 4 units;
 * Q6_K's codes made signed (-32..31) against x + 128 (0..255) 16320, so 2. */
static inline int us16_units(const int fmt) {
    if (!DOT_US16 || qf_signed_units(fmt)) return 1;
    const int lane = biased(fmt) ? 2 * 255 * -qf_offset(fmt) : 2 * ((1 << qf_bits(fmt)) - 1) * 127;
    int n = 1;
    while (2 * n * lane <= 32767) n *= 2;
    return n;
}

#if DOT_US16
/* AVX2: sub_group_dots' integer dot products, each weighed by its output row's weight (w16: the weight in
 * both int16 halves of the row's lane; the sub-scale, or 1), added to acc. The units' products are summed
 * chunk by chunk in 16 bits (us16_units), and one vpmaddwd widens and weighs each chunk's sums: where a
 * sum widened by vpmaddwd against ones and then weighed by vpmulld took two multiplies. Exact: |16-bit
 * sum| * |weight| * 2 < 2^23. The formats with a code bias never come here on AVX2 (Q3_K's small codes take
 * their own branch, Q6_K biased_super16). */
static inline __attribute__((always_inline)) void weighed_dots16(const uint8_t *codes, const int fmt, const qx_t *x,
                                                                 int64_t m0, const int mr, int64_t g, int p, int h,
                                                                 vi w16, vi acc[MR_MAX]) {
    const int64_t ld = x->ld;
    const int8_t *xs = x->q + m0 * ld + g * QBLOCK;
    const int units = 8 / sub_groups(fmt), chunk = us16_units(fmt) < units ? us16_units(fmt) : units;
#pragma GCC unroll 8
    for (int c = units * p; c < units * (p + 1); c += chunk) {
        vi s16[MR_MAX];
        for (int m = 0; m < mr; m++) s16[m] = vi_zero();
        for (int u = c; u < c + chunk; u++) {
            const vi w = code_unit(codes, fmt, u, h);
            for (int m = 0; m < mr; m++) s16[m] = dot_us16(s16[m], w, vi_bcast32(xs + m * ld + 4 * u));
            if (mr >= KEEP_MIN_ROWS)
                for (int m = 0; m < mr; m++) vi_keep(&s16[m]);
        }
        for (int m = 0; m < mr; m++) acc[m] = dot_pairs16(acc[m], s16[m], w16);
    }
}
#endif

/* Integer dot products of sub-group p of block g (its units), half h, against mr rows of x. The unit
 * loop is unrolled: without it the 8 row pointers and the unit index cost more than the dot products.
 * A format with a code bias takes x + 128 (unsigned) against its codes made signed (the offset added),
 * which together exceed the true dot products by what the bias (the sums' start) takes off. */
static inline __attribute__((always_inline)) void sub_group_dots(const uint8_t *codes, const int fmt, const qx_t *x,
                                                                 int64_t m0, const int mr, int64_t g, int p, int h,
                                                                 vi is[MR_MAX]) {
    const int64_t ld = x->ld;
    const int8_t *xq = x->q + m0 * ld + g * QBLOCK;
    const int units = 8 / sub_groups(fmt);
#if DOT_US16
    if (us16_units(fmt) > 1) { /* AVX2 */
        for (int m = 0; m < mr; m++) is[m] = vi_zero();
        weighed_dots16(codes, fmt, x, m0, mr, g, p, h, vi_set1(0x00010001), is);
        return;
    }
#endif
    if (biased(fmt)) {
        const uint8_t *xu = x->u + m0 * ld + g * QBLOCK;
        for (int m = 0; m < mr; m++) is[m] = vi_zero();
#pragma GCC unroll 8
        for (int u = units * p; u < units * (p + 1); u++) {
            const vi w = vi_add8(code_unit(codes, fmt, u, h), vi_set1_8((char)qf_offset(fmt)));
            for (int m = 0; m < mr; m++) is[m] = dot_us(is[m], vi_bcast32(xu + m * ld + 4 * u), w);
        }
        return;
    }
    for (int m = 0; m < mr; m++) is[m] = vi_zero();
#pragma GCC unroll 8
    for (int u = units * p; u < units * (p + 1); u++) {
        const vi w = code_unit(codes, fmt, u, h);
        if (qf_signed_units(fmt)) {
            const sunit su = prep_signed(w);
            for (int m = 0; m < mr; m++) is[m] = dot_ss(is[m], su, vi_bcast32(xq + m * ld + 4 * u));
        } else {
            for (int m = 0; m < mr; m++) is[m] = dot_us(is[m], w, vi_bcast32(xq + m * ld + 4 * u));
        }
#if DOT_US16
        if (mr >= KEEP_MIN_ROWS)
            for (int m = 0; m < mr; m++) vi_keep(&is[m]);
#endif
    }
}

/* ------------------------------------------------------------------------------------------------
 * int8 path for the F16 kind (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL): one 16-row tile against mr rows of x,
 * x quantized per block of 32 (the K-quants: int_tile_super, below). */

/* The float steps of block g for row r of x, from the block's integer dot products `is`: the integer
 * correction (the unsigned codes' offsets, VNNI's bias, over the sum of x's codes), then
 * y += is * a * dx [+ z * dx * sum(xq)]. Every path of the int8 kernels (and AMX's) ends a block with
 * exactly these operations. */
static inline __attribute__((always_inline)) vf group_epilogue(vf acc, vi is, vf a, vf z, const int fmt, const qx_t *x,
                                                               int64_t r, int64_t g, int32_t per_sum) {
    const float dx = x->d[r * x->G + g];
    const vi t = per_sum ? vi_add(is, vi_set1(per_sum * x->sum32[r * x->G + g])) : is;
    acc = vf_fma(vi_to_f(t), vf_mul(a, vf_set1(dx)), acc);
    if (qf_has_min(fmt)) acc = vf_fma(z, vf_set1(x->s[r * x->G + g]), acc);
    return acc;
}

static inline __attribute__((always_inline)) void int_tile(const uint8_t *tile, const int fmt, const qx_t *x,
                                                           int64_t m0, const int mr, float *y, int64_t ldy,
                                                           int nvalid) {
    const int64_t G = x->G;
    const int sgn = qf_signed_units(fmt);
    /* Integer corrections per block: the unsigned codes' offsets (Q4_0, Q5_0), VNNI's +128 bias of signed
     * codes. */
    const int32_t per_sum = sgn ? -SIGNED_BIAS : qf_offset(fmt);
    vf acc[MR_INT][HALVES];
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++) acc[m][h] = vf_zero();
    for (int64_t g = 0; g < G; g++) {
        const qblock blk = qf_block(tile, fmt, g);
        const uint8_t *hdr = blk.hdr, *codes = blk.codes, *sub = blk.sub;
        if (prefetches(fmt, mr)) prefetch_ahead(blk, fmt);
#if DOT_US16 && HALVES == 2
        if (qf_small_codes(fmt)) { /* one broadcast of x feeds both halves; codes of up to 4 bits keep 8
                                      units' sums within 16 bits (vec.h) */
            const bscale sc[2] = {block_scales(hdr, sub, fmt, 0), block_scales(hdr, sub, fmt, 1)};
            const int64_t ld = x->ld;
            vi s16[MR_INT][2];
            for (int m = 0; m < mr; m++) s16[m][0] = s16[m][1] = vi_zero();
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const vi w0 = code_unit(codes, fmt, u, 0), w1 = code_unit(codes, fmt, u, 1);
                for (int m = 0; m < mr; m++) {
                    const vi xb = vi_bcast32(x->q + (m0 + m) * ld + g * QBLOCK + 4 * u);
                    s16[m][0] = dot_us16(s16[m][0], w0, xb);
                    s16[m][1] = dot_us16(s16[m][1], w1, xb);
                }
                if (mr >= KEEP_MIN_ROWS)
                    for (int m = 0; m < mr; m++) vi_keep(&s16[m][0]), vi_keep(&s16[m][1]);
            }
            for (int h = 0; h < 2; h++)
                for (int m = 0; m < mr; m++)
                    acc[m][h] = group_epilogue(acc[m][h], widen_us16(s16[m][h]), sc[h].a0, sc[h].z0, fmt, x, m0 + m,
                                               g, per_sum);
            continue;
        }
#endif
        for (int h = 0; h < HALVES; h++) {
            const bscale sc = block_scales(hdr, sub, fmt, h);
            vi is[MR_MAX];
            sub_group_dots(codes, fmt, x, m0, mr, g, 0, h, is);
            for (int m = 0; m < mr; m++)
                acc[m][h] = group_epilogue(acc[m][h], is[m], sc.a0, sc.z0, fmt, x, m0 + m, g, per_sum);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++) {
            vf_store_upto(y + (m0 + m) * ldy + h * LANES, acc[m][h], nvalid - h * LANES);
        }
}

/* ------------------------------------------------------------------------------------------------
 * int8 path for the K-quants (the K and K16 kinds), x quantized per super-block (SUPER_GROUP).
 *
 * With one scale of x per super-block, the integer dot products is_j of a super-block's sub-groups
 * (8 of 32 k for the K kind, 16 of 16 k for K16; one row of x against 16 output rows) are weighed by
 * their sub-scales sc_j as integers:
 *   isum = sum_j sc_j * is_j       (vpmulld; exact, |isum| < 2^31 for every format)
 *   corr = sum_j c_j * n_j         (vpdpwssd over pairs of sub-groups; n_j = sum of x's codes over
 *                                   sub-group j; c_j = m_j for the formats with minimums (Q4_K, Q5_K,
 *                                   Q2_K), else sc_j for an integer correction per code: VNNI's +128
 *                                   bias of signed codes (IQ4_XS); none for Q6_K and Q3_K, whose
 *                                   codes' offset (-32, -4) the packed code bias takes care of: isum
 *                                   starts there, over x + 128 and the signed codes (sub_group_dots))
 *   y += float(isum + per_code * corr) * (d * dx)               (the others)
 *   y += float(isum) * (d * dx) + float(corr) * -(dmin * dx)    (minimums)
 * two float steps per super-block and row where per-32 scales of x took three or four per sub-group.
 * Every path (the vector kernels, AMX) ends a super-block with `super_epilogue`, so they stay
 * bit-identical. */

/* One lane's two int32 values (each within int16) as the int16 pair (lo, hi) of a vpdpwssd operand. */
static inline vi pair16(vi lo, vi hi) { return vi_or(vi_and(lo, vi_set1(0xffff)), vi_slli32(hi, 16)); }

/* The sub-scale of sub-group p of a block (as int32), for half h of the tile. */
static inline __attribute__((always_inline)) vi sub_scale_i(const uint8_t *sub, const int fmt, int p, int h) {
    return qf_sub_signed(fmt) ? load_s8i(sub + 16 * p, h) : load_u8i(sub + 16 * p, h);
}

/* c_j of sub-group p of a block: its minimum (after the sub-scales: 16 bytes a sub-group), or its
 * sub-scale. */
static inline __attribute__((always_inline)) vi corr_weight(const uint8_t *sub, const int fmt, int p, int h) {
    return qf_has_min(fmt) ? load_u8i(sub + 16 * (sub_groups(fmt) + p), h) : sub_scale_i(sub, fmt, p, h);
}

/* The correction pair vector that starts at block g (even for the K kind, whose pairs span two
 * blocks; any block for K16, whose pair is the block's two halves). */
static inline __attribute__((always_inline)) vi corr_pair(const uint8_t *tile, const int fmt, int64_t g, int h) {
    if (sub_groups(fmt) == 2) {
        const uint8_t *sub = qf_block(tile, fmt, g).sub;
        return pair16(corr_weight(sub, fmt, 0, h), corr_weight(sub, fmt, 1, h));
    }
    return pair16(corr_weight(qf_block(tile, fmt, g).sub, fmt, 0, h),
                  corr_weight(qf_block(tile, fmt, g + 1).sub, fmt, 0, h));
}

/* x's codes summed per sub-group, as int16 pairs (K16: per 16 k; K: per 32). */
static inline const int16_t *sub_sums(const int fmt, const qx_t *x) {
    return sub_groups(fmt) == 2 ? x->sum16 : x->sum32;
}

/* corr of row r over super-block s, from its 8 pair vectors cp [8][LANES]. */
static inline __attribute__((always_inline)) vi super_corr(const int32_t *cp, const int fmt, const qx_t *x, int64_t r,
                                                           int64_t s) {
    const int64_t per_row = x->G * sub_groups(fmt); /* sub-groups a row */
    const int16_t *n = sub_sums(fmt, x) + r * per_row + 8 * sub_groups(fmt) * s;
    vi corr = vi_zero();
    for (int i = 0; i < 4 * sub_groups(fmt); i++)
        corr = dot_pairs16(corr, vi_loadu(cp + i * LANES), vi_bcast32(n + 2 * i));
    return corr;
}

/* per_code: the integer correction each of x's codes contributes (0: none, or the corr is minimums). */
static inline __attribute__((always_inline)) vf super_epilogue(vf acc, vi isum, vi corr, vf d, vf dmin, const int fmt,
                                                               int32_t per_code, const qx_t *x, int64_t r, int64_t s) {
    const float dx = x->d[r * x->G + 8 * s];
    if (qf_has_min(fmt)) {
        acc = vf_fma(vi_to_f(isum), vf_mul(d, vf_set1(dx)), acc);
        return vf_fma(vi_to_f(corr), vf_neg(vf_mul(dmin, vf_set1(dx))), acc);
    }
    const vi t = per_code ? vi_add(isum, vi_mullo(corr, vi_set1(per_code))) : isum;
    return vf_fma(vi_to_f(t), vf_mul(d, vf_set1(dx)), acc);
}

#if DOT_US16
/* AVX2, a biased format with chunks of units (Q6_K): super-block s for mr rows of x, one half of the tile
 * at a time, added to acc as int_tile_super does (the same integers and super_epilogue). Rows go
 * inside each chunk: a row's chunk is summed in a temporary 16-bit vector and weighed into its 32-bit
 * sum right away, so the mr 32-bit sums stay in registers through the super-block (where the unit-major
 * order of weighed_dots16 keeps mr 16-bit sums there and spills the 32-bit ones, a load and a store a
 * row and chunk), and every unit's position is a constant. 2-core Zen 3, bit-identical: Q6_K 1.03-1.19x at
 * 8-128 rows (the 128k-vocab head 1.15-1.17x at 8-32), 1.2-1.5x at 1-2 rows from cache. The 32-bit sums
 * are not pinned (vi_keep) as the other AVX2 kernels' sums are: a row's chunk is one product chain into
 * a temporary, so there is nothing for GCC to reassociate, and the pin made it keep a copy of each sum
 * on the stack (105 stack operands in the loop over one half of a block, against 62). Without it,
 * bit-identical: Q6_K 1.19-1.29x at 8-128 rows, the head from DRAM 1.28-1.38x at 8-32. */
static inline __attribute__((always_inline)) void biased_super16(const uint8_t *tile, const int fmt, const qx_t *x,
                                                                 int64_t m0, const int mr, int64_t s,
                                                                 float acc[MR_MAX][16]) {
    const int chunk = us16_units(fmt), units = 8 / sub_groups(fmt);
    const vi off = vi_set1_8((char)qf_offset(fmt));
    const uint8_t *xr[MR_MAX];
    for (int m = 0; m < mr; m++) xr[m] = x->u + (m0 + m) * x->ld + 8 * s * QBLOCK;
    const uint8_t *hdr = qf_block(tile, fmt, 8 * s).hdr;
    for (int h = 0; h < HALVES; h++) {
        vi is[MR_MAX];
        const vi start = vi_loadu(hdr + qf_scale_bytes(fmt) + 4 * LANES * h); /* the code bias */
        for (int m = 0; m < mr; m++) is[m] = start;
        for (int b = 0; b < 8; b++) {
            const qblock blk = qf_block(tile, fmt, 8 * s + b);
            if (h == 0) prefetch_ahead(blk, fmt);
#pragma GCC unroll 2
            for (int p = 0; p < sub_groups(fmt); p++) {
                const vi sc = sub_scale_i(blk.sub, fmt, p, h), w16 = pair16(sc, sc);
#pragma GCC unroll 8
                for (int c = units * p; c < units * (p + 1); c += chunk) {
                    vi w[8];
                    for (int u = 0; u < chunk; u++) w[u] = vi_add8(code_unit(blk.codes, fmt, c + u, h), off);
                    for (int m = 0; m < mr; m++) { /* x + 128 (unsigned) first */
                        const uint8_t *xb = xr[m] + b * QBLOCK + 4 * c;
                        vi t = _mm256_maddubs_epi16(vi_bcast32(xb), w[0]);
                        for (int u = 1; u < chunk; u++) t = dot_us16(t, vi_bcast32(xb + 4 * u), w[u]);
                        is[m] = dot_pairs16(is[m], t, w16);
                    }
                }
            }
        }
        const vf d = load_f16(hdr, h);
        for (int m = 0; m < mr; m++)
            vf_store(acc[m] + h * LANES, super_epilogue(vf_load(acc[m] + h * LANES), is[m], vi_zero(), d, vf_zero(), fmt,
                                                        0, x, m0 + m, s));
    }
}

/* int_tile_super for those formats (kept apart: a branch to it inside int_tile_super, even where it folds
 * away, changed the register allocation of the other formats' kernels). */
static inline __attribute__((always_inline)) void int_tile_rows_inside(const uint8_t *tile, const int fmt,
                                                                       const qx_t *x, int64_t m0, const int mr,
                                                                       float *y, int64_t ldy, int nvalid) {
    float acc[MR_MAX][16] __attribute__((aligned(64)));
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++) vf_store(acc[m] + h * LANES, vf_zero());
    for (int64_t s = 0; s < x->G / 8; s++) biased_super16(tile, fmt, x, m0, mr, s, acc);
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++)
            vf_store_upto(y + (m0 + m) * ldy + h * LANES, vf_load(acc[m] + h * LANES), nvalid - h * LANES);
}
#define ROWS_INSIDE(fmt) (biased(fmt) && !qf_small_codes(fmt))
#else
#define ROWS_INSIDE(fmt) 0
#endif

static inline __attribute__((always_inline)) void int_tile_super(const uint8_t *tile, const int fmt, const qx_t *x,
                                                                 int64_t m0, const int mr, float *y, int64_t ldy,
                                                                 int nvalid) {
    const int32_t per_code = biased(fmt) ? 0 : qf_signed_units(fmt) ? -SIGNED_BIAS : qf_offset(fmt);
    const int need_corr = qf_has_min(fmt) || per_code;
    float acc[MR_MAX][16] __attribute__((aligned(64)));
    int32_t cp[HALVES][8 * LANES] __attribute__((aligned(64)));
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++) vf_store(acc[m] + h * LANES, vf_zero());
    for (int64_t s = 0; s < x->G / 8; s++) {
        vi isum[MR_MAX][HALVES];
        for (int h = 0; h < HALVES; h++) {
            const uint8_t *bias = qf_block(tile, fmt, 8 * s).hdr + qf_scale_bytes(fmt);
            const vi start = biased(fmt) ? vi_loadu(bias + 4 * LANES * h) : vi_zero();
            for (int m = 0; m < mr; m++) isum[m][h] = start;
        }
        for (int b = 0; b < 8; b++) {
            const int64_t g = 8 * s + b;
            const qblock blk = qf_block(tile, fmt, g);
            if (prefetches(fmt, mr)) prefetch_ahead(blk, fmt);
#if DOT_US16 && HALVES == 2
            if (qf_small_codes(fmt)) { /* AVX2: one broadcast of x feeds both halves (Q3_K biased: x + 128
                                             against codes of -4..3, 4 units' sums within 16 bits too) */
                const int units = 8 / sub_groups(fmt);
                const vi off = vi_set1_8((char)qf_offset(fmt));
                for (int p = 0; p < sub_groups(fmt); p++) {
                    vi s16[MR_MAX][2];
                    for (int m = 0; m < mr; m++) s16[m][0] = s16[m][1] = vi_zero();
#pragma GCC unroll 8
                    for (int u = units * p; u < units * (p + 1); u++) {
                        vi w0 = code_unit(blk.codes, fmt, u, 0), w1 = code_unit(blk.codes, fmt, u, 1);
                        if (biased(fmt)) w0 = vi_add8(w0, off), w1 = vi_add8(w1, off);
                        const uint8_t *xs = biased(fmt) ? x->u : (const uint8_t *)x->q;
                        for (int m = 0; m < mr; m++) { /* the unsigned operand first: x + 128, or the codes */
                            const vi xb = vi_bcast32(xs + (m0 + m) * x->ld + g * QBLOCK + 4 * u);
                            s16[m][0] = biased(fmt) ? dot_us16(s16[m][0], xb, w0) : dot_us16(s16[m][0], w0, xb);
                            s16[m][1] = biased(fmt) ? dot_us16(s16[m][1], xb, w1) : dot_us16(s16[m][1], w1, xb);
                        }
                        if (mr >= KEEP_MIN_ROWS)
                            for (int m = 0; m < mr; m++) vi_keep(&s16[m][0]), vi_keep(&s16[m][1]);
                    }
                    for (int h = 0; h < 2; h++) { /* weighed by the sub-scale as weighed_dots16 does */
                        const vi sc = sub_scale_i(blk.sub, fmt, p, h), sc2 = pair16(sc, sc);
                        for (int m = 0; m < mr; m++) isum[m][h] = dot_pairs16(isum[m][h], s16[m][h], sc2);
                    }
                }
                for (int h = 0; h < 2; h++)
                    if (need_corr && (sub_groups(fmt) == 2 || b % 2 == 0))
                        vi_storeu(cp[h] + (sub_groups(fmt) == 2 ? b : b / 2) * LANES, corr_pair(tile, fmt, g, h));
                continue;
            }
#endif
            for (int h = 0; h < HALVES; h++) {
                for (int p = 0; p < sub_groups(fmt); p++) {
                    const vi sc = sub_scale_i(blk.sub, fmt, p, h);
#if DOT_US16
                    if (us16_units(fmt) > 1) {
                        vi col[MR_MAX];
                        for (int m = 0; m < mr; m++) col[m] = isum[m][h];
                        weighed_dots16(blk.codes, fmt, x, m0, mr, g, p, h, pair16(sc, sc), col);
                        for (int m = 0; m < mr; m++) isum[m][h] = col[m];
                        continue;
                    }
#endif
                    vi is[MR_MAX];
                    sub_group_dots(blk.codes, fmt, x, m0, mr, g, p, h, is);
                    for (int m = 0; m < mr; m++) isum[m][h] = vi_add(isum[m][h], vi_mullo(is[m], sc));
                }
                if (need_corr && (sub_groups(fmt) == 2 || b % 2 == 0))
                    vi_storeu(cp[h] + (sub_groups(fmt) == 2 ? b : b / 2) * LANES, corr_pair(tile, fmt, g, h));
            }
        }
        const uint8_t *hdr = qf_block(tile, fmt, 8 * s).hdr;
        for (int h = 0; h < HALVES; h++) {
            const vf d = load_f16(hdr, h), dmin = qf_has_min(fmt) ? load_f16(hdr + 32, h) : vf_zero();
            for (int m = 0; m < mr; m++) {
                const vi corr = need_corr ? super_corr(cp[h], fmt, x, m0 + m, s) : vi_zero();
                vf_store(acc[m] + h * LANES, super_epilogue(vf_load(acc[m] + h * LANES), isum[m][h], corr, d, dmin,
                                                            fmt, per_code, x, m0 + m, s));
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++) {
            vf_store_upto(y + (m0 + m) * ldy + h * LANES, vf_load(acc[m] + h * LANES), nvalid - h * LANES);
        }
}

/* A micro-kernel: a tile (and, for a pair, the next one at tile + tb) against rows m0.. of x, each tile's
 * valid output rows in nvalid[]. One type for both, so one loop (tile_pass) hands out their rows. */
typedef void (*int_fn)(const uint8_t *tile, int64_t tb, const qx_t *x, int64_t m0, float *y, int64_t ldy,
                       const int *nvalid);

#if defined(__AVX512VNNI__) && LANES == 16
/* Two neighbouring tiles (tile + tb) a pass against mr (<= PAIR_ROWS) rows of x, for a core that issues
 * two vpdpbusd a cycle (Zen 5), where one tile a pass waits on its loads: each broadcast of x feeds both
 * tiles, and each row's broadcasts come from a pointer of its own (addresses recomputed from m * ld cost a
 * stack load a broadcast). pair_tile_super has int_tile_super's integer sums (exact in any order) and
 * float steps (super_epilogue), pair_tile int_tile's (group_epilogue): the results are theirs to the bit.
 * 2-core Zen 5, weights in cache, against one tile a pass at 3 to 512 rows (PAIR_MIN_ROWS says where
 * they run): Q4_K 1.09-1.29x (a
 * 512-token prefill of Llama-3.2-1B 1.09x), Q5_K 1.07-1.22x, IQ4_XS 1.04-1.15x, Q4_0 1.21-1.29x, Q8_0
 * 1.13-1.26x, Q4_1 1.05-1.19x (SmolLM2-135M's shapes 1.07-1.19x), Q5_0/Q5_1/IQ4_NL 1.08-1.15x. Not the
 * K16 kind (Q6_K, Q2_K, Q3_K): with a scale per 16 k, twice the integer scaling a block, its pairs ran
 * 0.88-0.95x. */
#ifndef PAIR_ROWS
#define PAIR_ROWS 4
#endif
/* Block g's integer dot products on the two tiles (codes at blk_codes and blk_codes + tb) against mr rows
 * of x (a pointer each), into is; the block's codes (and scales) PREFETCH_AHEAD bytes on are prefetched. */
static inline __attribute__((always_inline)) void pair_block_dots(const uint8_t *blk_codes, int64_t tb, const int fmt,
                                                                  const int8_t *const xrow[PAIR_ROWS], const int mr,
                                                                  int64_t g, vi is[PAIR_ROWS][2]) {
    const int lines = (int)((qf_code_bytes(fmt) + qf_sub_bytes(fmt) + 63) / 64);
    const uint8_t *codes[2] = {blk_codes, blk_codes + tb};
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < lines; i++) _mm_prefetch((const char *)(codes[t] + PREFETCH_AHEAD + 64 * i), _MM_HINT_T0);
    /* Cheap codes (one plane: Q4_0, Q4_1, Q4_K; bytes: Q8_0) sum odd units apart from even ones: 4 rows
     * x 2 tiles are 8 chains of dependent vpdpbusd, and at its ~5-cycle latency a core issuing two a
     * cycle needs 10 (an 8-chain loop alone ran at 83% of the peak). 2-core Zen 5, 16-64 rows: Q4_K
     * 1.03-1.05x (Llama-3.2-3B's decode step at 32 streams 205 -> 196 ms), Q4_1 1.03-1.05x, Q8_0 and
     * Q4_0 0.97-1.04x (noise). The codes that take more unpacking (Q5_K, IQ4_XS) lost 3-4% with the
     * registers it takes and keep one chain, as do Q6_K's biased passes (split at 8 rows: 0.76-0.94x).
     * Six rows a pass in one chain each (12 chains) gained less than this (1.0-1.03x). */
    const int split = cheap_codes(fmt);
    vi odd[PAIR_ROWS][2];
    for (int m = 0; m < mr; m++) is[m][0] = is[m][1] = odd[m][0] = odd[m][1] = vi_zero();
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {
        vi w[2];
        for (int t = 0; t < 2; t++) {
            const vi c = code_unit(codes[t], fmt, u, 0);
            w[t] = qf_signed_units(fmt) ? prep_signed(c).w : c; /* vpdpbusd's unsigned operand */
        }
        for (int m = 0; m < mr; m++) {
            const vi xb = vi_bcast32(xrow[m] + g * QBLOCK + 4 * u);
            for (int t = 0; t < 2; t++) {
                if (split && u % 2)
                    odd[m][t] = _mm512_dpbusd_epi32(odd[m][t], w[t], xb);
                else
                    is[m][t] = _mm512_dpbusd_epi32(is[m][t], w[t], xb);
            }
        }
    }
    if (split)
        for (int m = 0; m < mr; m++)
            for (int t = 0; t < 2; t++) is[m][t] = vi_add(is[m][t], odd[m][t]);
}

static inline __attribute__((always_inline)) void pair_tile_super(const uint8_t *tile, int64_t tb, const int fmt,
                                                                  const qx_t *x, int64_t m0, const int mr, float *y,
                                                                  int64_t ldy, const int nvalid[2]) {
    const int32_t per_code = qf_signed_units(fmt) ? -SIGNED_BIAS : qf_offset(fmt);
    const int need_corr = qf_has_min(fmt) || per_code;
    const int8_t *xrow[PAIR_ROWS];
    for (int m = 0; m < mr; m++) xrow[m] = x->q + (m0 + m) * x->ld;
    float acc[PAIR_ROWS][2][16] __attribute__((aligned(64)));
    int32_t cp[2][4 * LANES] __attribute__((aligned(64)));
    for (int m = 0; m < mr; m++)
        for (int t = 0; t < 2; t++) vf_store(acc[m][t], vf_zero());
    for (int64_t s = 0; s < x->G / 8; s++) {
        vi isum[PAIR_ROWS][2];
        for (int m = 0; m < mr; m++) isum[m][0] = isum[m][1] = vi_zero();
        for (int b = 0; b < 8; b++) {
            const int64_t g = 8 * s + b;
            const qblock blk = qf_block(tile, fmt, g);
            vi is[PAIR_ROWS][2];
            pair_block_dots(blk.codes, tb, fmt, xrow, mr, g, is);
            for (int t = 0; t < 2; t++) {
                const vi sc = sub_scale_i(blk.sub + t * tb, fmt, 0, 0);
                for (int m = 0; m < mr; m++) isum[m][t] = vi_add(isum[m][t], vi_mullo(is[m][t], sc));
            }
            if (need_corr && b % 2 == 0)
                for (int t = 0; t < 2; t++) vi_storeu(cp[t] + b / 2 * LANES, corr_pair(tile + t * tb, fmt, g, 0));
        }
        for (int t = 0; t < 2; t++) {
            const uint8_t *hdr = qf_block(tile + t * tb, fmt, 8 * s).hdr;
            const vf d = load_f16(hdr, 0), dmin = qf_has_min(fmt) ? load_f16(hdr + 32, 0) : vf_zero();
            for (int m = 0; m < mr; m++) {
                const vi corr = need_corr ? super_corr(cp[t], fmt, x, m0 + m, s) : vi_zero();
                vf_store(acc[m][t],
                         super_epilogue(vf_load(acc[m][t]), isum[m][t], corr, d, dmin, fmt, per_code, x, m0 + m, s));
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int t = 0; t < 2; t++) vf_store_upto(y + (m0 + m) * ldy + t * TILE_ROWS, vf_load(acc[m][t]), nvalid[t]);
}
/* The F16 kind (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL): int_tile on two tiles. */
static inline __attribute__((always_inline)) void pair_tile(const uint8_t *tile, int64_t tb, const int fmt,
                                                            const qx_t *x, int64_t m0, const int mr, float *y,
                                                            int64_t ldy, const int nvalid[2]) {
    const int32_t per_sum = qf_signed_units(fmt) ? -SIGNED_BIAS : qf_offset(fmt);
    const int8_t *xrow[PAIR_ROWS];
    for (int m = 0; m < mr; m++) xrow[m] = x->q + (m0 + m) * x->ld;
    vf acc[PAIR_ROWS][2];
    for (int m = 0; m < mr; m++) acc[m][0] = acc[m][1] = vf_zero();
    for (int64_t g = 0; g < x->G; g++) {
        const qblock blk = qf_block(tile, fmt, g);
        vi is[PAIR_ROWS][2];
        pair_block_dots(blk.codes, tb, fmt, xrow, mr, g, is);
        for (int t = 0; t < 2; t++) {
            const bscale sc = block_scales(blk.hdr + t * tb, blk.sub + t * tb, fmt, 0);
            for (int m = 0; m < mr; m++)
                acc[m][t] = group_epilogue(acc[m][t], is[m][t], sc.a0, sc.z0, fmt, x, m0 + m, g, per_sum);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int t = 0; t < 2; t++) vf_store_upto(y + (m0 + m) * ldy + t * TILE_ROWS, acc[m][t], nvalid[t]);
}
#define PAIR_FN(F, R)                                                                                    \
    static void pair_##F##_##R(const uint8_t *t, int64_t tb, const qx_t *x, int64_t m0, float *y, int64_t ldy, \
                               const int *nv) {                                                          \
        if (qf_kind(F) == KIND_F16)                                                                      \
            pair_tile(t, tb, F, x, m0, R, y, ldy, nv);                                                   \
        else                                                                                             \
            pair_tile_super(t, tb, F, x, m0, R, y, ldy, nv);                                             \
    }
#define PAIR_FNS(F) PAIR_FN(F, 1) PAIR_FN(F, 2) PAIR_FN(F, 3) PAIR_FN(F, 4)
#define PAIR_ROW(F) {pair_##F##_1, pair_##F##_2, pair_##F##_3, pair_##F##_4}
PAIR_FNS(0) PAIR_FNS(1) PAIR_FNS(2) PAIR_FNS(3) PAIR_FNS(4) PAIR_FNS(5) PAIR_FNS(6) PAIR_FNS(10) PAIR_FNS(11)
/* PAIR_TABLE[fmt][r - 1]: two tiles against r rows of x (NULL: none, the K16 kind and 16-bit floats). */
static const int_fn PAIR_TABLE[QF_COUNT][PAIR_ROWS] = {
    PAIR_ROW(0), PAIR_ROW(1), PAIR_ROW(2), PAIR_ROW(3),  PAIR_ROW(4),  PAIR_ROW(5), PAIR_ROW(6),
    {NULL},      {NULL},      {NULL},      PAIR_ROW(10), PAIR_ROW(11), {NULL},      {NULL}};
#else
#define PAIR_ROWS 1
static const int_fn PAIR_TABLE[QF_COUNT][PAIR_ROWS]; /* none: all NULL */
#endif

/* ------------------------------------------------------------------------------------------------
 * float32 path: a tile's blocks [g_begin, g_end) dequantized k-major into wbuf [k][16], then an
 * outer-product micro-kernel over mr rows of x. */

static inline __attribute__((always_inline)) void dequant_chunk(const uint8_t *tile, const int fmt, int64_t g_begin,
                                                                int64_t g_end, float *wbuf) {
    const int sgn = qf_signed_units(fmt);
    const vi offset = vi_set1(qf_offset(fmt));
    for (int64_t g = g_begin; g < g_end; g++) {
        const qblock blk = qf_block(tile, fmt, g);
        const uint8_t *hdr = blk.hdr, *codes = blk.codes, *sub = blk.sub;
        for (int h = 0; h < HALVES; h++) {
            const bscale sc = block_scales(hdr, sub, fmt, h);
            for (int u = 0; u < 8; u++) {
                vi q[4];
                unit_by_k(code_unit(codes, fmt, u, h), sgn, q);
                const vf a = u < 4 ? sc.a0 : sc.a1, z = u < 4 ? sc.z0 : sc.z1;
                for (int t = 0; t < 4; t++) {
                    const vf qf = vi_to_f(qf_offset(fmt) ? vi_add(q[t], offset) : q[t]);
                    const vf w = qf_has_min(fmt) ? vf_fma(a, qf, z) : vf_mul(a, qf);
                    vf_store(wbuf + ((g - g_begin) * QBLOCK + 4 * u + t) * TILE_ROWS + h * LANES, w);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void float_tile(const float *x, int64_t K, const float *wbuf,
                                                             int64_t kc, const int mr, float *y, int64_t ldy,
                                                             int first, int nvalid) {
    vf acc[MR_FLT][HALVES];
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++) {
            const int n = nvalid - h * LANES;
            if (first || n <= 0)
                acc[m][h] = vf_zero();
            else if (n >= LANES)
                acc[m][h] = vf_loadu(y + m * ldy + h * LANES);
            else {
                float tmp[LANES] = {0};
                memcpy(tmp, y + m * ldy + h * LANES, (size_t)n * sizeof(float));
                acc[m][h] = vf_loadu(tmp);
            }
        }
    for (int64_t k = 0; k < kc; k++) {
        vf w[HALVES];
        for (int h = 0; h < HALVES; h++) w[h] = vf_load(wbuf + k * TILE_ROWS + h * LANES);
        for (int m = 0; m < mr; m++) {
            const vf xb = vf_set1(x[m * K + k]);
            for (int h = 0; h < HALVES; h++) acc[m][h] = vf_fma(xb, w[h], acc[m][h]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < HALVES; h++) {
            vf_store_upto(y + m * ldy + h * LANES, acc[m][h], nvalid - h * LANES);
        }
}

/* ------------------------------------------------------------------------------------------------
 * Specializations: one function per (format, rows of x), so the format's branches and the row loops
 * fold away. The int8 path has one for every row count up to the micro-kernel's (1..MR_INT), so a
 * block of rows is one pass over a tile: a speculative verification's 3, 5, 6 or 7 rows (or a batch's
 * remainder) cut into 2 + 1, 4 + 1, 4 + 2, 4 + 2 + 1 unpacked the tile's codes once per piece, and at
 * a few rows that unpacking costs as much as the dot products (a 3-row step of the default model took
 * longer than a 4-row one). The float path covers the rest by halving: MR, 4, 2, 1. */

typedef void (*flt_fn)(const uint8_t *, int64_t, int64_t, float *);
typedef void (*ftile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, int);

#define INT_FN(F, R)                                                                                         \
    static void int_##F##_##R(const uint8_t *t, int64_t tb, const qx_t *x, int64_t m0, float *y, int64_t ldy, \
                              const int *nv) {                                                           \
        (void)tb;                                                                                        \
        if (ROWS_INSIDE(F))                                                                              \
            int_tile_rows_inside(t, F, x, m0, R, y, ldy, nv[0]);                                         \
        else if (qf_kind(F) != KIND_F16)                                                                 \
            int_tile_super(t, F, x, m0, R, y, ldy, nv[0]);                                               \
        else                                                                                             \
            int_tile(t, F, x, m0, R, y, ldy, nv[0]);                                                     \
    }
#if MR_INT == 8
#define INT_FNS(F) \
    INT_FN(F, 1) INT_FN(F, 2) INT_FN(F, 3) INT_FN(F, 4) INT_FN(F, 5) INT_FN(F, 6) INT_FN(F, 7) INT_FN(F, 8)
#define INT_ROW(F) {int_##F##_1, int_##F##_2, int_##F##_3, int_##F##_4, int_##F##_5, int_##F##_6, int_##F##_7, int_##F##_8}
#else
#define INT_FNS(F) INT_FN(F, 1) INT_FN(F, 2) INT_FN(F, 3) INT_FN(F, 4)
#define INT_ROW(F) {int_##F##_1, int_##F##_2, int_##F##_3, int_##F##_4}
#endif
#if MR_BIASED == 12 /* the formats with a code bias: up to 12 rows */
#define BIASED_FNS(F) INT_FNS(F) INT_FN(F, 9) INT_FN(F, 10) INT_FN(F, 11) INT_FN(F, 12)
#define BIASED_ROW(F)                                                                                         \
    {int_##F##_1, int_##F##_2, int_##F##_3, int_##F##_4,  int_##F##_5,  int_##F##_6,                          \
     int_##F##_7, int_##F##_8, int_##F##_9, int_##F##_10, int_##F##_11, int_##F##_12}
#elif MR_BIASED == 8 && MR_INT == 4 /* AVX2 */
#define BIASED_FNS(F) INT_FNS(F) INT_FN(F, 5) INT_FN(F, 6) INT_FN(F, 7) INT_FN(F, 8)
#define BIASED_ROW(F) \
    {int_##F##_1, int_##F##_2, int_##F##_3, int_##F##_4, int_##F##_5, int_##F##_6, int_##F##_7, int_##F##_8}
#else
#define BIASED_FNS(F) INT_FNS(F)
#define BIASED_ROW(F) INT_ROW(F)
#endif
#define DQ_FN(F) \
    static void dq_##F(const uint8_t *t, int64_t g0, int64_t g1, float *w) { dequant_chunk(t, F, g0, g1, w); }
#define FT_FN(R)                                                                                               \
    static void ft_##R(const float *x, int64_t K, const float *w, int64_t kc, float *y, int64_t ldy, int f, \
                       int nv) {                                                                               \
        float_tile(x, K, w, kc, R, y, ldy, f, nv);                                                            \
    }

/* F16 and BF16 (12, 13) have neither an int8 path nor the float path's chunk dequantization: raw_gemm
 * multiplies them, whatever the precision asked (orca_qlinear). */
INT_FNS(0) INT_FNS(1) INT_FNS(2) INT_FNS(3) INT_FNS(4) INT_FNS(5) INT_FNS(6) BIASED_FNS(7) INT_FNS(8) BIASED_FNS(9)
INT_FNS(10) INT_FNS(11)
DQ_FN(0) DQ_FN(1) DQ_FN(2) DQ_FN(3) DQ_FN(4) DQ_FN(5) DQ_FN(6) DQ_FN(7) DQ_FN(8) DQ_FN(9) DQ_FN(10) DQ_FN(11)
FT_FN(MR_FLT) FT_FN(4) FT_FN(2) FT_FN(1)

/* INT_FNS_TABLE[fmt][r - 1]: r rows of x (up to int_mr(fmt)). */
static const int_fn INT_FNS_TABLE[QF_COUNT][MR_MAX] = {INT_ROW(0), INT_ROW(1), INT_ROW(2),    INT_ROW(3),
                                                       INT_ROW(4), INT_ROW(5), INT_ROW(6),    BIASED_ROW(7),
                                                       INT_ROW(8), BIASED_ROW(9), INT_ROW(10), INT_ROW(11),
                                                       {NULL},     {NULL}};
static const flt_fn DQ_TABLE[QF_COUNT] = {dq_0, dq_1, dq_2, dq_3, dq_4, dq_5,
                                          dq_6, dq_7, dq_8, dq_9, dq_10, dq_11, NULL,  NULL};
static const ftile_fn FT_TABLE[4] = {ft_MR_FLT, ft_4, ft_2, ft_1};

/* Rows of a format's int8 micro-kernel: MR_BIASED for the formats with a code bias, else MR_INT. */
static inline int int_mr(int fmt) { return biased(fmt) ? MR_BIASED : MR_INT; }
/* Rows of the int8 micro-kernel for r remaining rows: all of them, up to int_mr(fmt). */
static inline int int_rows(int64_t r, int fmt) { return r < int_mr(fmt) ? (int)r : int_mr(fmt); }

/* The largest float specialization for r remaining rows: its index in FT_TABLE (MR, 4, 2, 1) and rows. */
static inline int pick_rows(int64_t r, int full, int *rows) {
    const int i = r >= full ? 0 : r >= 4 ? 1 : r >= 2 ? 2 : 3;
    static const int small[4] = {0, 4, 2, 1};
    *rows = i ? small[i] : full;
    return i;
}

static inline int tile_rows(int64_t N, int64_t t) {
    return N - t * TILE_ROWS < TILE_ROWS ? (int)(N - t * TILE_ROWS) : TILE_ROWS;
}

#if defined(__AMX_INT8__)
/* ------------------------------------------------------------------------------------------------
 * AMX path for 16-row blocks of x (prompts, large batches): the integer dot product of 16 rows of
 * x with a 16-row weight tile over one block is one tile multiply (A: x, 16 x 32 int8; B: the codes,
 * already in the VNNI layout tiles want; C: 16 x 16 int32), and the float steps after it are the
 * int8 path's, lane for lane: the results are bit-identical to int_tile's.
 *
 * Per block: C = A B in tmm0/tmm1 alternately, stored to L1 and folded into 16 accumulators while
 * the next block's multiply runs. The K16 formats' 16-k scales take two multiplies of K = 16; 4-bit
 * codes (and 5-, 6-bit) are unpacked to bytes (codebook values for IQ4_XS) once per tile. */

#define AMX_ROWS 16

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* tmm0, tmm1: C; tmm2, tmm4: A (16 rows x gs bytes); tmm3, tmm5: B (gs / 4 rows x 64 bytes). */
static void amx_configure(int gs) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int i = 0; i < 6; i++) {
        const int is_a = i == 2 || i == 4, is_b = i == 3 || i == 5;
        c.rows[i] = is_b ? (uint8_t)(gs / 4) : AMX_ROWS;
        c.colsb[i] = is_a ? (uint16_t)gs : 64;
    }
    _tile_loadconfig(&c);
}

/* One tile's scales and, for codes below 8 bits, its codes unpacked to bytes (8-bit codes are used in
 * place). The scales: a and z per block for the F16 kind; for the K-quants int_tile_super's integer
 * sub-scales per sub-group (abuf), correction pairs (zbuf) and d, dmin per super-block (after them). */
static inline __attribute__((always_inline)) void amx_prepare(const uint8_t *tile, const int fmt, int64_t G,
                                                              float *abuf, float *zbuf, uint8_t *bbuf) {
    for (int64_t g = 0; g < G; g++) {
        const qblock blk = qf_block(tile, fmt, g);
        const uint8_t *hdr = blk.hdr, *codes = blk.codes, *sub = blk.sub;
        if (qf_kind(fmt) != KIND_F16) {
            const int P = sub_groups(fmt);
            int32_t *scbuf = (int32_t *)abuf, *cpbuf = (int32_t *)zbuf;
            float *dbuf = zbuf + G * 16;
            for (int p = 0; p < P; p++) vi_storeu(scbuf + (P * g + p) * 16, sub_scale_i(sub, fmt, p, 0));
            if (P == 2 || g % 2 == 0) vi_storeu(cpbuf + (P == 2 ? g : g / 2) * 16, corr_pair(tile, fmt, g, 0));
            if (g % 8 == 0) {
                vf_storeu(dbuf + g / 8 * 32, load_f16(hdr, 0));
                vf_storeu(dbuf + g / 8 * 32 + 16, qf_has_min(fmt) ? load_f16(hdr + 32, 0) : vf_zero());
            }
        } else {
            const bscale sc = block_scales(hdr, sub, fmt, 0);
            vf_storeu(abuf + g * 16, sc.a0);
            vf_storeu(zbuf + g * 16, sc.z0);
        }
        if (qf_bits(fmt) < 8)
            for (int u = 0; u < 8; u++) _mm512_storeu_si512(bbuf + g * 512 + 64 * u, code_unit(codes, fmt, u, 0));
    }
}

/* Pointer to scale group j's B operand (8-bit codes: in the tile stream; narrower: the unpacked copy). */
static inline const uint8_t *amx_b(const uint8_t *tile, const uint8_t *bbuf, const int fmt, int64_t j) {
    const int k16 = qf_kind(fmt) == KIND_K16;
    const int64_t g = k16 ? j / 2 : j, half = k16 ? j % 2 : 0;
    return qf_bits(fmt) < 8 ? bbuf + g * 512 + half * 256 : qf_block(tile, fmt, g).codes + half * 256;
}

/* acc[i] += the float steps of block g for rows m0 + i, from its int32 products c [16][16]. */
static inline __attribute__((always_inline)) void amx_fold(vf acc[AMX_ROWS], const int32_t *c, const int fmt,
                                                           const qx_t *x, int64_t m0, int64_t g, const float *abuf,
                                                           const float *zbuf) {
    /* Signed units multiply signed x directly (tdpbssd): no bias to take back. */
    const int32_t per_sum = qf_signed_units(fmt) ? 0 : qf_offset(fmt);
    const vf a = vf_loadu(abuf + g * 16), z = vf_loadu(zbuf + g * 16);
    for (int i = 0; i < AMX_ROWS; i++)
        acc[i] = group_epilogue(acc[i], vi_loadu(c + i * 16), a, z, fmt, x, m0 + i, g, per_sum);
}

/* acc[i] += super-block s of a K-quant for rows m0 + i, from the int32 products c [J][16][16] of its
 * sub-groups: int_tile_super's integer sums and super_epilogue, lane for lane. */
static inline __attribute__((always_inline)) void amx_fold_super(vf acc[AMX_ROWS], const int32_t *c, const int fmt,
                                                                 const qx_t *x, int64_t m0, int64_t s,
                                                                 const float *abuf, const float *zbuf) {
    /* Signed units multiply signed x directly (tdpbssd): no bias to take back. */
    const int32_t per_code = qf_signed_units(fmt) ? 0 : qf_offset(fmt);
    const int P = sub_groups(fmt), need_corr = qf_has_min(fmt) || per_code;
    const int32_t *scbuf = (const int32_t *)abuf, *cpbuf = (const int32_t *)zbuf;
    const float *dbuf = zbuf + x->G * 16;
    const vf d = vf_loadu(dbuf + s * 32), dmin = vf_loadu(dbuf + s * 32 + 16);
    for (int i = 0; i < AMX_ROWS; i++) {
        vi isum = vi_zero();
        for (int64_t j = 8 * P * s; j < 8 * P * (s + 1); j++)
            isum = vi_add(isum, vi_mullo(vi_loadu(c + j * 256 + i * 16), vi_loadu(scbuf + j * 16)));
        const vi corr = need_corr ? super_corr(cpbuf + s * 4 * P * 16, fmt, x, m0 + i, s) : vi_zero();
        acc[i] = super_epilogue(acc[i], isum, corr, d, dmin, fmt, per_code, x, m0 + i, s);
    }
}

#define AMX_DP(C, A, B, SIGNED)             \
    do {                                    \
        if (SIGNED)                         \
            _tile_dpbssd(C, A, B);          \
        else                                \
            _tile_dpbsud(C, A, B);          \
    } while (0)

/* 16 rows of x (from m0) against one weight tile: every sub-group's tile product first (alternating
 * two C tiles, so consecutive multiplies do not wait on each other), stored to cbuf; then the float
 * steps, reading products stored long before (a vector load right after a tile store stalls). */
static inline __attribute__((always_inline)) void amx_tile(const uint8_t *tile, const uint8_t *bbuf, const int fmt,
                                                           const qx_t *x, int64_t m0, const float *abuf,
                                                           const float *zbuf, int32_t *cbuf, float *y, int64_t ldy,
                                                           int nvalid) {
    const int k16 = qf_kind(fmt) == KIND_K16, sgn = qf_signed_units(fmt);
    const int64_t ld = x->ld, J = k16 ? 2 * x->G : x->G, gs = k16 ? 16 : 32;
    const int8_t *xa = x->q + m0 * ld;
    int64_t j = 0;
    for (; j + 1 < J; j += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, xa + j * gs, ld);
        _tile_loadd(3, amx_b(tile, bbuf, fmt, j), 64);
        _tile_loadd(4, xa + (j + 1) * gs, ld);
        _tile_loadd(5, amx_b(tile, bbuf, fmt, j + 1), 64);
        AMX_DP(0, 2, 3, sgn);
        AMX_DP(1, 4, 5, sgn);
        _tile_stored(0, cbuf + j * 256, 64);
        _tile_stored(1, cbuf + (j + 1) * 256, 64);
    }
    if (j < J) {
        _tile_zero(0);
        _tile_loadd(2, xa + j * gs, ld);
        _tile_loadd(3, amx_b(tile, bbuf, fmt, j), 64);
        AMX_DP(0, 2, 3, sgn);
        _tile_stored(0, cbuf + j * 256, 64);
    }
    vf acc[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i++) acc[i] = vf_zero();
    if (qf_kind(fmt) != KIND_F16)
        for (int64_t s = 0; s < x->G / 8; s++) amx_fold_super(acc, cbuf, fmt, x, m0, s, abuf, zbuf);
    else
        for (j = 0; j < J; j++) amx_fold(acc, cbuf + j * 256, fmt, x, m0, j, abuf, zbuf);
    for (int i = 0; i < AMX_ROWS; i++) {
        if (nvalid >= 16)
            vf_storeu(y + (m0 + i) * ldy, acc[i]);
        else
            vf_store_n(y + (m0 + i) * ldy, acc[i], nvalid);
    }
}

typedef void (*amx_fn)(const uint8_t *, const uint8_t *, const qx_t *, int64_t, const float *, const float *,
                       int32_t *, float *, int64_t, int);
typedef void (*amx_prep_fn)(const uint8_t *, int64_t, float *, float *, uint8_t *);
#define AMX_FN(F)                                                                                             \
    static void amx_##F(const uint8_t *t, const uint8_t *b, const qx_t *x, int64_t m0, const float *a,       \
                        const float *z, int32_t *c, float *y, int64_t ldy, int nv) {                           \
        amx_tile(t, b, F, x, m0, a, z, c, y, ldy, nv);                                                        \
    }                                                                                                         \
    static void amx_prep_##F(const uint8_t *t, int64_t G, float *a, float *z, uint8_t *b) {                   \
        amx_prepare(t, F, G, a, z, b);                                                                        \
    }
AMX_FN(0) AMX_FN(1) AMX_FN(2) AMX_FN(3) AMX_FN(4) AMX_FN(5) AMX_FN(6) AMX_FN(7) AMX_FN(8) AMX_FN(9) AMX_FN(10)
AMX_FN(11)
static const amx_fn AMX_TABLE[QF_COUNT] = {amx_0, amx_1, amx_2, amx_3, amx_4, amx_5,
                                           amx_6, amx_7, amx_8, amx_9, amx_10, amx_11, NULL, NULL};
static const amx_prep_fn AMX_PREP_TABLE[QF_COUNT] = {amx_prep_0, amx_prep_1, amx_prep_2, amx_prep_3,
                                                     amx_prep_4, amx_prep_5, amx_prep_6, amx_prep_7,
                                                     amx_prep_8, amx_prep_9, amx_prep_10, amx_prep_11, NULL, NULL};

/* Rows of x from which the AMX path runs (below, the vpdpbusd micro-kernels are as fast). */
#define AMX_MIN_ROWS 16

static void amx_gemm(const uint8_t *w, int fmt, int64_t N, const qx_t *x, int64_t M, float *y, int64_t ldy) {
    const int64_t T = (N + TILE_ROWS - 1) / TILE_ROWS, tb = qf_tile_bytes(fmt, x->K), G = x->G;
    const int_fn *fns = INT_FNS_TABLE[fmt];
    const int gs = qf_kind(fmt) == KIND_K16 ? 16 : 32;
#pragma omp parallel
    {
        float *abuf = malloc((size_t)(2 * G * 16 + 2 * G * 16) * sizeof(float)); /* a, z per scale group */
        uint8_t *bbuf = qf_bits(fmt) < 8 ? aligned_alloc(64, (size_t)G * 512) : NULL;
        int32_t *cbuf = aligned_alloc(64, (size_t)(2 * G) * 256 * sizeof(int32_t)); /* one 16 x 16 product per sub-group */
        float *zbuf = abuf + 2 * G * 16;
        amx_configure(gs);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const uint8_t *tile = w + t * tb;
            const int nvalid = tile_rows(N, t);
            AMX_PREP_TABLE[fmt](tile, G, abuf, zbuf, bbuf);
            for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK) {
                const int64_t m1 = m0 + M_BLOCK < M ? m0 + M_BLOCK : M;
                int64_t m = m0;
                for (; m + AMX_ROWS <= m1; m += AMX_ROWS)
                    AMX_TABLE[fmt](tile, bbuf, x, m, abuf, zbuf, cbuf, y + t * TILE_ROWS, ldy, nvalid);
                while (m < m1) {
                    const int rows = int_rows(m1 - m, fmt);
                    fns[rows - 1](tile, tb, x, m, y + t * TILE_ROWS, ldy, &nvalid);
                    m += rows;
                }
            }
        }
        _tile_release();
        free(abuf);
        free(bbuf);
        free(cbuf);
    }
}
#endif

/* Whether the tiles go two at a time: a format with pair kernels, enough rows of x for a weight of K. */
static inline int pairs(int fmt, int64_t M, int64_t K, int64_t T) {
    return PAIR_TABLE[fmt][0] != NULL && M >= (K >= PAIR_LONG_K ? PAIR_MIN_ROWS_LONG : PAIR_MIN_ROWS) && T >= 2;
}

/* The work item after this one (the next nt tiles, usually this thread's next: tiles go out in runs) is
 * prefetched into L1 while this one's later passes run from cache, a slice before each, where a tile
 * of at most NEXT_TILE_BYTES is read more than once: the first pass over a tile otherwise waits on DRAM
 * while the others leave it idle. 2-core Zen 5, weights rotating through more memory than the L3
 * holds: a 128k-vocab Q6_K head (K 2048) 1.03-1.07x at 16-64 rows, Q4_K pairs at K 2048 1.02-1.09x,
 * Q4_1 3072 x 576 1.04-1.17x; pairs at K 8192 (147 KB) lost 4-7% (into L1 or L2 alike), hence the bound. */
#define NEXT_TILE_BYTES (64 << 10)

/* Rows m0..m1 of x against nt tiles from tile t (1, or 2 for a pair), with micro-kernels fns of up to mr
 * rows. */
static inline void tile_pass(const uint8_t *w, int64_t tb, const int_fn *fns, int mr, int nt, int64_t N,
                             const qx_t *x, int64_t m0, int64_t m1, int64_t t, float *y, int64_t ldy) {
    const int nvalid[2] = {tile_rows(N, t), nt == 2 ? tile_rows(N, t + 1) : 0};
    const int64_t passes = (m1 - m0 + mr - 1) / mr, left = (N + TILE_ROWS - 1) / TILE_ROWS - t - nt;
    const int64_t next_lines = left > 0 && nt * tb <= NEXT_TILE_BYTES ? (left < nt ? left : nt) * tb / 64 : 0;
    const uint8_t *next = w + (t + nt) * tb;
    for (int64_t pass = 0; pass < passes; pass++) {
        const int64_t m = m0 + pass * mr;
        const int rows = m1 - m < mr ? (int)(m1 - m) : mr;
        if (pass > 0 && next_lines)
            for (int64_t l = next_lines * (pass - 1) / (passes - 1); l < next_lines * pass / (passes - 1); l++)
                _mm_prefetch((const char *)(next + 64 * l), _MM_HINT_T0);
        fns[rows - 1](w + t * tb, tb, x, m, y + t * TILE_ROWS, ldy, nvalid);
    }
}

/* Tiles are handed out guided (halves first, then ever smaller runs to whichever thread is free)
 * rather than in two fixed halves: on a 2-core machine the server's event loop takes turns on one of
 * the cores, and with fixed halves the other thread then waits at the end of every call (at 8 streams
 * guided gave +20% tok/s). A decode step's one or two rows gain too, on a quiet machine: weights read
 * from memory at one row 0-10% faster (Q6_K 8-10%), at two 4-13% (2-core Zen 4, in-process A/B). A pair
 * of tiles is one work item. */
static void int_gemm(const uint8_t *w, int fmt, int64_t N, const qx_t *x, int64_t M, float *y, int64_t ldy) {
    const int64_t T = (N + TILE_ROWS - 1) / TILE_ROWS, tb = qf_tile_bytes(fmt, x->K);
    const int64_t per = pairs(fmt, M, x->K, T) ? 2 : 1; /* tiles a work item: two, the odd last one alone */
    for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK) {
        const int64_t m1 = m0 + M_BLOCK < M ? m0 + M_BLOCK : M;
#pragma omp parallel for schedule(guided) if ((m1 - m0) * T * x->K >= PARALLEL_MIN_WORK)
        for (int64_t i = 0; i < (T + per - 1) / per; i++) {
            if (per == 2 && per * i + 1 < T)
                tile_pass(w, tb, PAIR_TABLE[fmt], PAIR_ROWS, 2, N, x, m0, m1, per * i, y, ldy);
            else
                tile_pass(w, tb, INT_FNS_TABLE[fmt], int_mr(fmt), 1, N, x, m0, m1, per * i, y, ldy);
        }
    }
}

#define M_BLOCK_FLT 128 /* rows of x per block in the float path: 128 x KC_FLT floats = 256 KB */

static void float_gemm(const uint8_t *w, int fmt, int64_t K, int64_t N, const float *x, int64_t M, float *y,
                       int64_t ldy) {
    const int64_t T = (N + TILE_ROWS - 1) / TILE_ROWS, tb = qf_tile_bytes(fmt, K), G = K / QBLOCK;
    const int64_t gc = KC_FLT / QBLOCK;
    for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK_FLT) {
        const int64_t m1 = m0 + M_BLOCK_FLT < M ? m0 + M_BLOCK_FLT : M;
#pragma omp parallel for schedule(static) if ((m1 - m0) * T * K >= PARALLEL_MIN_WORK)
        for (int64_t t = 0; t < T; t++) {
            float wbuf[KC_FLT * TILE_ROWS] __attribute__((aligned(64)));
            const int nvalid = tile_rows(N, t);
            for (int64_t g0 = 0; g0 < G; g0 += gc) {
                const int64_t g1 = g0 + gc < G ? g0 + gc : G;
                DQ_TABLE[fmt](w + t * tb, g0, g1, wbuf);
                for (int64_t m = m0; m < m1;) {
                    int rows;
                    const int i = pick_rows(m1 - m, MR_FLT, &rows);
                    FT_TABLE[i](x + m * K + g0 * QBLOCK, K, wbuf, (g1 - g0) * QBLOCK, y + m * ldy + t * TILE_ROWS,
                                ldy, g0 == 0, nvalid);
                    m += rows;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * F16 / BF16 weights (the raw kind): every weight widened exactly and each output summed
 * fma(x_k, w_k, y) over k in order from 0, straight from the tiles (no float32 copy of a chunk), RAW_NT
 * tiles at a time: one row of x then keeps RAW_NT independent chains of multiply-adds in flight,
 * where one tile's single chain waited on the FMA's latency (13 GB/s at one row, through the float
 * path's chunk buffer, against ~28 GB/s for the block formats). Each output's chain is the same
 * whatever the number of rows and whichever variant runs it: batch-invariant, bit-identical. */
#if defined(__AVX512F__)
#define RAW_MR 4 /* 4 rows x 4 tiles: 16 accumulators + 4 weight vectors */
#define RAW_NT 4
#else
#define RAW_MR 2 /* 2 rows x 2 tiles x 2 halves: 8 accumulators + 4 weight vectors */
#define RAW_NT 2
#endif

static inline __attribute__((always_inline)) void raw_tiles(const uint8_t *w, int64_t tb, const int fmt, int64_t K,
                                                            const float *x, const int mr, const int nt, float *y,
                                                            int64_t ldy, int last_valid) {
    vf acc[RAW_MR][RAW_NT][HALVES];
    for (int m = 0; m < mr; m++)
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < HALVES; h++) acc[m][t][h] = vf_zero();
    for (int64_t k = 0; k < K; k++) {
        const int64_t at = k * TILE_ROWS * 2; /* blocks follow each other with no header: k's 16 values */
        vf wv[RAW_NT][HALVES];
        for (int t = 0; t < nt; t++) {
            const uint8_t *p = w + t * tb + at;
#if PREFETCH_AHEAD
            if (k % 2 == 0) _mm_prefetch((const char *)(p + PREFETCH_AHEAD), _MM_HINT_T0);
#endif
            for (int h = 0; h < HALVES; h++) wv[t][h] = fmt == QF_F16 ? load_f16(p, h) : load_bf16(p, h);
        }
        for (int m = 0; m < mr; m++) {
            const vf xb = vf_set1(x[m * K + k]);
            for (int t = 0; t < nt; t++)
                for (int h = 0; h < HALVES; h++) acc[m][t][h] = vf_fma(xb, wv[t][h], acc[m][t][h]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < HALVES; h++) {
                vf_store_upto(y + m * ldy + t * TILE_ROWS + h * LANES, acc[m][t][h],
                              (t == nt - 1 ? last_valid : TILE_ROWS) - h * LANES);
            }
}

typedef void (*raw_fn)(const uint8_t *, int64_t, int64_t, const float *, float *, int64_t, int);
#define RAW_FN(F, R, T)                                                                                  \
    static void raw_##F##_##R##_##T(const uint8_t *w, int64_t tb, int64_t K, const float *x, float *y, \
                                    int64_t ldy, int lv) {                                              \
        raw_tiles(w, tb, F, K, x, R, T, y, ldy, lv);                                                    \
    }
#if RAW_NT == 4
#define RAW_FNS(F, R) RAW_FN(F, R, 1) RAW_FN(F, R, 2) RAW_FN(F, R, 3) RAW_FN(F, R, 4)
#define RAW_ROW(F, R) {raw_##F##_##R##_1, raw_##F##_##R##_2, raw_##F##_##R##_3, raw_##F##_##R##_4}
RAW_FNS(12, 1) RAW_FNS(12, 2) RAW_FNS(12, 3) RAW_FNS(12, 4) RAW_FNS(13, 1) RAW_FNS(13, 2) RAW_FNS(13, 3) RAW_FNS(13, 4)
/* RAW_TABLE[bf16][rows - 1][tiles - 1] */
static const raw_fn RAW_TABLE[2][RAW_MR][RAW_NT] = {
    {RAW_ROW(12, 1), RAW_ROW(12, 2), RAW_ROW(12, 3), RAW_ROW(12, 4)},
    {RAW_ROW(13, 1), RAW_ROW(13, 2), RAW_ROW(13, 3), RAW_ROW(13, 4)}};
#else
#define RAW_FNS(F, R) RAW_FN(F, R, 1) RAW_FN(F, R, 2)
#define RAW_ROW(F, R) {raw_##F##_##R##_1, raw_##F##_##R##_2}
RAW_FNS(12, 1) RAW_FNS(12, 2) RAW_FNS(13, 1) RAW_FNS(13, 2)
static const raw_fn RAW_TABLE[2][RAW_MR][RAW_NT] = {{RAW_ROW(12, 1), RAW_ROW(12, 2)},
                                                    {RAW_ROW(13, 1), RAW_ROW(13, 2)}};
#endif

static void raw_gemm(const uint8_t *w, int fmt, int64_t K, int64_t N, const float *x, int64_t M, float *y,
                     int64_t ldy) {
    const int64_t T = (N + TILE_ROWS - 1) / TILE_ROWS, tb = qf_tile_bytes(fmt, K);
    const int64_t groups = (T + RAW_NT - 1) / RAW_NT;
    const int bf16 = fmt == QF_BF16;
#pragma omp parallel for schedule(static) if (M * T * K >= PARALLEL_MIN_WORK)
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t t0 = gi * RAW_NT;
        const int nt = T - t0 < RAW_NT ? (int)(T - t0) : RAW_NT;
        const int last_valid = tile_rows(N, t0 + nt - 1);
        for (int64_t m = 0; m < M;) {
            const int rows = M - m < RAW_MR ? (int)(M - m) : RAW_MR;
            RAW_TABLE[bf16][rows - 1][nt - 1](w + t0 * tb, tb, K, x + m * K, y + m * ldy + t0 * TILE_ROWS, ldy,
                                              last_valid);
            m += rows;
        }
    }
}

static inline int bad_weight(int fmt, int64_t K, int64_t N) {
    return fmt < 0 || fmt >= QF_COUNT || K <= 0 || K % qf_super_k(fmt) != 0 || N <= 0;
}

int64_t orca_qtile_bytes(int fmt, int64_t K) { return bad_weight(fmt, K, 1) ? -1 : qf_tile_bytes(fmt, K); }

/* y[m, n] (row stride ldy) = x[m, :] . W[n, :] for W [N, K] tiled as quant_tiles.h describes.
 * precision 0: float32, 1: int8 activations. Returns nonzero for bad arguments or no memory. */
int orca_qlinear(const float *x, int64_t M, int64_t K, const uint8_t *w, int fmt, int64_t N, float *y, int64_t ldy,
                 int precision) {
    if (bad_weight(fmt, K, N) || M < 0 || ldy < N) return 1;
    if (M == 0) return 0;
    if (qf_kind(fmt) == KIND_RAW) { /* floats: no int8 path, whatever the precision asked */
        raw_gemm(w, fmt, K, N, x, M, y, ldy);
        return 0;
    }
    if (precision == 0) {
        float_gemm(w, fmt, K, N, x, M, y, ldy);
        return 0;
    }
    qx_t qx;
    if (quantize_x(x, M, K, qf_kind(fmt) == KIND_F16 ? QBLOCK : SUPER_GROUP, biased(fmt), &qx)) return 2;
#if defined(__AMX_INT8__)
    if (M >= AMX_MIN_ROWS)
        amx_gemm(w, fmt, N, &qx, M, y, ldy);
    else
#endif
        int_gemm(w, fmt, N, &qx, M, y, ldy);
    free(qx.d);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Whole rows back as float32 (embedding lookups of a quantized table, tests): the same exact
 * w = fma(a, q, z) as the float path. */

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

static inline float bf16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int orca_qdequant_rows(const uint8_t *w, int fmt, int64_t K, int64_t N, const int64_t *rows, int64_t n, float *out) {
    if (bad_weight(fmt, K, N) || n < 0) return 1;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= N) return 2;
    const int64_t tb = qf_tile_bytes(fmt, K), G = K / QBLOCK;
    const int kind = qf_kind(fmt), has_min = qf_has_min(fmt), sub_signed = qf_sub_signed(fmt);
#pragma omp parallel for schedule(static) if (n * K >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = rows[i];
        const int l = (int)(r % TILE_ROWS);
        const uint8_t *tile = w + r / TILE_ROWS * tb;
        float *o = out + i * K;
        for (int64_t g = 0; g < G; g++) {
            const qblock blk = qf_block(tile, fmt, g);
            const uint8_t *hdr = blk.hdr, *codes = blk.codes, *sub = blk.sub;
            if (kind == KIND_RAW) { /* k-major 16-bit floats: row l's value of k at 32 k + 2 l */
                for (int k = 0; k < QBLOCK; k++)
                    o[g * QBLOCK + k] = fmt == QF_F16 ? f16_at(codes + 32 * k + 2 * l) : bf16_at(codes + 32 * k + 2 * l);
                continue;
            }
            for (int k = 0; k < QBLOCK; k++) {
                const int u = k / 4, t = k % 4, part = k < 16 ? 0 : 1;
                int c;
                const int bits = qf_bits(fmt);
                if (bits == 8)
                    c = (int8_t)codes[64 * u + 4 * l + t];
                else { /* the low bits' plane, then the high bits' (quant_tiles.h) */
                    const int lb = qf_low_bits(fmt);
                    int q = (codes[64 * (u % lb) + 4 * l + t] >> (lb * (u / lb))) & ((1 << lb) - 1);
                    if (bits > lb) {
                        const int hb = bits - lb, per = 8 / hb;
                        q |= ((codes[64 * lb + 64 * (u / per) + 4 * l + t] >> (hb * (u % per))) & ((1 << hb) - 1))
                             << lb;
                    }
                    c = qf_codebook(fmt) ? IQ4_NL_VALUES[q] : q + qf_offset(fmt);
                }
                float a, z = 0.0f;
                if (kind == KIND_F16) {
                    a = f16_at(hdr + 2 * l);
                    if (has_min) z = f16_at(hdr + 32 + 2 * l);
                } else {
                    /* K: one sub-scale (and minimum) per block; K16: per 16 k */
                    const int at = kind == KIND_K ? l : 16 * part + l, mins = kind == KIND_K ? 16 : 32;
                    a = f16_at(hdr + 2 * l) * (sub_signed ? (float)(int8_t)sub[at] : (float)sub[at]);
                    if (has_min) z = -(f16_at(hdr + 32 + 2 * l) * (float)sub[mins + at]);
                }
                o[g * QBLOCK + k] = has_min ? fmaf(a, (float)c, z) : a * (float)c;
            }
        }
    }
    return 0;
}
