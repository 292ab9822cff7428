/*
 * Weight-only quantized projections for bfloat16 activations: out = x @ w.T with w held as
 * 4-bit codes in groups of 32 inputs (scale and zero per group and row) or as 8-bit codes
 * (one scale per row), read straight from their packed bytes.
 *
 * The products run on AVX-512 BF16's dot instruction (vdpbf16ps: 32 bf16 pairs into 16 float
 * sums), which needs the weights as bfloat16. A code c (0..15) becomes the bfloat16 of 128 + c
 * with one OR: 0x4300 is 128.0 and the code fills the low mantissa bits, exactly. So a group's
 * sum is taken over 128 + c, and 128 times the group's sum of x comes off afterwards, in
 * float32, where the scale and zero are applied:
 *
 *   sum_k w[n,k] x[k] = sum_g scale[n,g] * (S'[n,g] - 136 X[g]) + zero[n,g] * X[g]
 *   S'[n,g] = sum_{k in g} (128 + c[n,k]) x[k],   X[g] = sum_{k in g} x[k],
 *   w[n,k] = scale[n,g] (c[n,k] - 8) + zero[n,g]
 *
 * The products are exact in float32 (8 significant bits times 8), the sums round in float32,
 * and each group's bias is removed before the next group is added, so the result is the
 * dequantized weights' product up to float32 rounding (then rounded to bfloat16 once).
 * 8-bit codes (v in -128..127) are stored as u = v + 128 and split into two nibbles, the high
 * one multiplied with 16 x (exact in bfloat16) and the low one with x, into the same sums.
 *
 * Layout (packed once by actors.model.quant): rows in blocks of 16 (the 16 float lanes of a
 * sum are 16 output rows; a block past the last row is zero-padded), inputs in pairs (a lane
 * of vdpbf16ps multiplies two adjacent inputs). For 4-bit codes, each 32-byte chunk holds four
 * inputs k..k+3 of the block's 16 rows: byte j is row j/2, the low nibble input k + j%2, the
 * high nibble input k + 2 + j%2; a group is 8 chunks; a block's groups follow each other.
 * Scales and zeros: per block and group, 16 bfloat16 scales then 16 zeros. 8-bit codes: each
 * 32-byte chunk holds inputs k, k+1 of the 16 rows (byte j: row j/2, input k + j%2); one
 * bfloat16 scale per row.
 *
 * Blocks of rows are split over OpenMP threads; rows of x are taken four at a time, each
 * block's codes decoded once per four rows (they stay in L1 between the passes).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "common.h"
#include "kernels.h"


#define ROWS_PER_BLOCK 16
#define GROUP 32
#define MAX_M 4
#define PARALLEL_MIN_CODES (1 << 15)

/* Built with the instructions and running on a CPU that has them. */
int quant_gemm_available(void) { return bf16_dot_runs(); }

#if HAVE_BF16_DOT

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 32 bytes of codes as two vectors of bf16 pairs, 128 + each byte's low nibble and 128 + its
 * high nibble (one byte per 16-bit lane, OR-ed into 0x4300: 128.0). */
static inline void nibbles(const uint8_t *p, __m512bh *lo, __m512bh *hi) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i mask = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
    *lo = as_bh(_mm512_ternarylogic_epi32(v, mask, bias, 0xEA)); /* (v & mask) | bias */
    *hi = as_bh(_mm512_or_si512(_mm512_srli_epi16(v, 4), bias));
}

/* Inputs 2p and 2p + 1 of a row, broadcast to every lane (rows need not be 4-byte aligned). */
static inline __m512bh pair_of(const uint16_t *row, int64_t p) {
    uint32_t v;
    memcpy(&v, row + 2 * p, sizeof v);
    return as_bh(_mm512_set1_epi32((int)v));
}

/* One block of 16 rows against MB rows of x (compile-time MB: the compiler keeps every sum in
 * a register). xs: rows of x; sums: [MB][G] group sums of x. */
static inline __attribute__((always_inline)) void int4_block(
    const uint16_t *const *xs, const float *sums, int64_t groups, const uint8_t *codes,
    const uint16_t *sz, float *res, const int MB) {
    __m512 out[MAX_M];
    for (int m = 0; m < MB; ++m) out[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *c = codes + g * (GROUP / 4) * 32;
        /* Four sums per row (two chunks x low/high nibbles), so that one row's chain of dot
         * instructions is not latency-bound; every index is a constant after unrolling. */
        __m512 a[MAX_M][4];
        for (int m = 0; m < MB; ++m)
            for (int i = 0; i < 4; ++i) a[m][i] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int chunk = 0; chunk < GROUP / 4; chunk += 2) {
#pragma GCC unroll 2
            for (int half = 0; half < 2; ++half) {
                __m512bh lo, hi;
                nibbles(c + (chunk + half) * 32, &lo, &hi);
                const int64_t pair = g * (GROUP / 2) + (chunk + half) * 2; /* inputs k, k+1 */
#pragma GCC unroll 4
                for (int m = 0; m < MB; ++m) {
                    __m512 *lo_sum = &a[m][2 * half], *hi_sum = &a[m][2 * half + 1];
                    *lo_sum = _mm512_dpbf16_ps(*lo_sum, lo, pair_of(xs[m], pair));
                    *hi_sum = _mm512_dpbf16_ps(*hi_sum, hi, pair_of(xs[m], pair + 1));
                }
            }
        }
        const __m512 scale = bf16x16_to_f32(sz + g * 2 * ROWS_PER_BLOCK);
        const __m512 zero = bf16x16_to_f32(sz + g * 2 * ROWS_PER_BLOCK + ROWS_PER_BLOCK);
        const __m512 corr = _mm512_fmadd_ps(_mm512_set1_ps(-136.0f), scale, zero);
        for (int m = 0; m < MB; ++m) {
            const __m512 s =
                _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3]));
            out[m] = _mm512_fmadd_ps(scale, s, out[m]);
            out[m] = _mm512_fmadd_ps(corr, _mm512_set1_ps(sums[m * groups + g]), out[m]);
        }
    }
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(res + m * ROWS_PER_BLOCK, out[m]);
}

/* 8-bit codes: inputs k, k+1 per chunk; x16s: rows of 16 x. The bias comes off per
 * group of 32 inputs (2176 = 128 * 17 from the two nibbles, 128 from u = v + 128). */
static inline __attribute__((always_inline)) void int8_block(
    const uint16_t *const *xs, const uint16_t *const *x16s, const float *sums, int64_t groups,
    const uint8_t *codes, const uint16_t *scales, float *res, const int MB) {
    __m512 out[MAX_M];
    for (int m = 0; m < MB; ++m) out[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *c = codes + g * (GROUP / 2) * 32;
        __m512 a[MAX_M][2];
        for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int chunk = 0; chunk < GROUP / 2; chunk += 2) {
#pragma GCC unroll 2
            for (int half = 0; half < 2; ++half) {
                __m512bh lo, hi;
                nibbles(c + (chunk + half) * 32, &lo, &hi);
                const int64_t pair = g * (GROUP / 2) + chunk + half;
#pragma GCC unroll 4
                for (int m = 0; m < MB; ++m) {
                    __m512 *sum = &a[m][half];
                    *sum = _mm512_dpbf16_ps(*sum, hi, pair_of(x16s[m], pair));
                    *sum = _mm512_dpbf16_ps(*sum, lo, pair_of(xs[m], pair));
                }
            }
        }
        for (int m = 0; m < MB; ++m) {
            const __m512 s = _mm512_add_ps(a[m][0], a[m][1]);
            const __m512 x_sum = _mm512_set1_ps(sums[m * groups + g]);
            out[m] = _mm512_add_ps(out[m], _mm512_fmadd_ps(_mm512_set1_ps(-2304.0f), x_sum, s));
        }
    }
    const __m512 scale = bf16x16_to_f32(scales);
    for (int m = 0; m < MB; ++m)
        _mm512_storeu_ps(res + m * ROWS_PER_BLOCK, _mm512_mul_ps(scale, out[m]));
}

static void store_rows(const float *res, int mb, int64_t n0, int64_t n, uint16_t *out,
                       int64_t out_stride, int64_t m0) {
    const int64_t rows = n - n0 < ROWS_PER_BLOCK ? n - n0 : ROWS_PER_BLOCK;
    for (int m = 0; m < mb; ++m)
        for (int64_t r = 0; r < rows; ++r)
            out[(m0 + m) * out_stride + n0 + r] = f32_to_bf16(res[m * ROWS_PER_BLOCK + r]);
}

/* Group sums of each row of x (float32). */
static float *group_sums(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t groups = k / GROUP;
    float *sums = malloc(sizeof(float) * (size_t)(m * groups));
    if (sums == NULL) return NULL;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t g = 0; g < groups; ++g) {
            float s = 0.f;
            for (int64_t j = 0; j < GROUP; ++j)
                s += bf16_to_f32(x[i * x_stride + g * GROUP + j]);
            sums[i * groups + g] = s;
        }
    return sums;
}

/* Both entry points: bits 4 (scales: scale and zero per block and group) or 8 (one scale per
 * row; x is also needed as 16 x, exact in bfloat16: a power of two). */
static int quant_gemm(int bits, const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                      const uint8_t *codes, const uint16_t *scales, int64_t n, uint16_t *out,
                      int64_t out_stride, int num_threads) {
    if (!quant_gemm_available()) return -1;
    if (k % GROUP) return -2;
    if (m <= 0) return 0;
    const int64_t groups = k / GROUP, blocks = (n + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
    float *sums = group_sums(x, x_stride, m, k);
    uint16_t *x16 = bits == 8 ? malloc(sizeof(uint16_t) * (size_t)(m * k)) : NULL;
    if (sums == NULL || (bits == 8 && x16 == NULL)) {
        free(sums);
        free(x16);
        return -3;
    }
    if (bits == 8)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < k; ++j)
                x16[i * k + j] = f32_to_bf16(16.0f * bf16_to_f32(x[i * x_stride + j]));
    /* Per block of 16 rows: its codes (half a byte or a byte a weight) and its scales. */
    const int64_t block_codes = groups * GROUP * ROWS_PER_BLOCK * bits / 8;
    const int64_t block_scales = bits == 4 ? groups * 2 * ROWS_PER_BLOCK : ROWS_PER_BLOCK;
    const int parallel = blocks * block_codes * (m < MAX_M ? m : MAX_M) >= PARALLEL_MIN_CODES;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t b = 0; b < blocks; ++b) {
        float res[MAX_M * ROWS_PER_BLOCK];
        for (int64_t m0 = 0; m0 < m; m0 += MAX_M) {
            const int mb = (int)(m - m0 < MAX_M ? m - m0 : MAX_M);
            const uint16_t *xs[MAX_M], *x16s[MAX_M];
            for (int i = 0; i < mb; ++i) {
                xs[i] = x + (m0 + i) * x_stride;
                x16s[i] = x16 == NULL ? NULL : x16 + (m0 + i) * k;
            }
            const float *s = sums + m0 * groups;
            const uint8_t *c = codes + b * block_codes;
            const uint16_t *sc = scales + b * block_scales;
            if (bits == 4) {
                switch (mb) {
                case 1: int4_block(xs, s, groups, c, sc, res, 1); break;
                case 2: int4_block(xs, s, groups, c, sc, res, 2); break;
                case 3: int4_block(xs, s, groups, c, sc, res, 3); break;
                default: int4_block(xs, s, groups, c, sc, res, 4); break;
                }
            } else {
                switch (mb) {
                case 1: int8_block(xs, x16s, s, groups, c, sc, res, 1); break;
                case 2: int8_block(xs, x16s, s, groups, c, sc, res, 2); break;
                case 3: int8_block(xs, x16s, s, groups, c, sc, res, 3); break;
                default: int8_block(xs, x16s, s, groups, c, sc, res, 4); break;
                }
            }
            store_rows(res, mb, b * ROWS_PER_BLOCK, n, out, out_stride, m0);
        }
    }
    free(sums);
    free(x16);
    return 0;
}

#endif /* HAVE_BF16_DOT */

/* x: [m, k] bfloat16 rows x_stride apart; codes, sz: the packed weight of [n, k]; out: [m, n]
 * bfloat16 rows out_stride apart. Returns 0, or -1 without the instructions, -2 for a k that
 * is not a multiple of 32, -3 when out of memory. */
int int4_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                   const uint8_t *codes, const uint16_t *sz, int64_t n, uint16_t *out,
                   int64_t out_stride, int num_threads) {
#if HAVE_BF16_DOT
    return quant_gemm(4, x, x_stride, m, k, codes, sz, n, out, out_stride, num_threads);
#else
    (void)x; (void)x_stride; (void)m; (void)k; (void)codes; (void)sz; (void)n; (void)out;
    (void)out_stride; (void)num_threads;
    return -1;
#endif
}

/* The same for 8-bit codes: scales [blocks * 16] bfloat16. */
int int8_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                   const uint8_t *codes, const uint16_t *scales, int64_t n, uint16_t *out,
                   int64_t out_stride, int num_threads) {
#if HAVE_BF16_DOT
    return quant_gemm(8, x, x_stride, m, k, codes, scales, n, out, out_stride, num_threads);
#else
    (void)x; (void)x_stride; (void)m; (void)k; (void)codes; (void)scales; (void)n; (void)out;
    (void)out_stride; (void)num_threads;
    return -1;
#endif
}
