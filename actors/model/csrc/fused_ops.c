/*
 * The small element-wise steps of a decoder layer, fused: each one reads its inputs once and
 * writes its output once, where torch runs three to eight ops (and as many allocations) for it.
 * At decode batch sizes these ops move a few KiB each and their cost is dispatch, not arithmetic.
 *
 * Every kernel rounds where torch rounds, so the results equal the torch path's (and Hugging
 * Face's) bit for bit in bfloat16, up to the order of one float32 sum in the norm:
 *
 *   add_rms_norm   residual = x + r (rounded to the dtype), out = w * dtype(rms_norm_f32(residual))
 *                  (Hugging Face's LlamaRMSNorm; float32: out = (x * rsqrt(mean(x^2) + eps)) * w)
 *   rotary         q and k heads rotated in place: x * cos + rotate_half(x) * sin, each product
 *                  rounded, as Hugging Face's apply_rotary_pos_emb
 *   silu_mul       out = dtype(silu(gate)) * up (SwiGLU)
 *   kv_write       each new token's K and V row copied into its cache slot
 *
 * Rows are independent: a row's result does not depend on the other rows of the batch. Large
 * calls (prefill) split rows over OpenMP threads; small ones (decode) run on the caller's
 * thread, where waking a thread team would cost more than the work.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "common.h"
#include "kernels.h"

#define PARALLEL_MIN_ELEMS (1 << 16)

#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                        \
int NAME(const T *x, const T *r, const T *w, T *out, T *res_out, int64_t rows, int64_t hidden,  \
         int64_t x_stride, float eps, int num_threads) {                                        \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * hidden >= PARALLEL_MIN_ELEMS)") \
    for (int64_t t = 0; t < rows; ++t) {                                                        \
        const T *xp = x + t * x_stride;                                                         \
        T *op = out + t * hidden;                                                               \
        float sum = 0.f;                                                                        \
        if (r != NULL) {                                                                        \
            const T *rp = r + t * hidden;                                                       \
            T *sp = res_out + t * hidden;                                                       \
            for (int64_t i = 0; i < hidden; ++i) {                                              \
                const float s = ROUND(LOAD(xp[i]) + LOAD(rp[i]));                               \
                sp[i] = STORE(s);                                                               \
                sum += s * s;                                                                   \
            }                                                                                   \
            xp = sp;                                                                            \
        } else {                                                                                \
            for (int64_t i = 0; i < hidden; ++i) {                                              \
                const float s = LOAD(xp[i]);                                                    \
                sum += s * s;                                                                   \
            }                                                                                   \
        }                                                                                       \
        const float inv = 1.f / sqrtf(sum / (float)hidden + eps);                               \
        for (int64_t i = 0; i < hidden; ++i)                                                    \
            op[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xp[i]) * inv));                               \
    }                                                                                           \
    return 0;                                                                                   \
}

/* qk: [rows] rows of row_stride elements; the first num_heads * head_dim of each are rotated. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                              \
int NAME(T *qk, const int64_t *positions, const T *cos_table, const T *sin_table,               \
         int64_t rows, int64_t row_stride, int num_heads, int head_dim, int num_threads) {      \
    const int half = head_dim / 2;                                                              \
    if (head_dim > 512 || head_dim % 2) return 1;                                               \
    const int64_t elems = rows * row_stride;                                                    \
    _Pragma("omp parallel for num_threads(num_threads) if(elems >= PARALLEL_MIN_ELEMS)")        \
    for (int64_t t = 0; t < rows; ++t) {                                                        \
        const T *c = cos_table + positions[t] * head_dim;                                       \
        const T *s = sin_table + positions[t] * head_dim; /* rotate_half's sign folded in */    \
        float cf[512], sf[512];                                                                 \
        for (int d = 0; d < head_dim; ++d) { cf[d] = LOAD(c[d]); sf[d] = LOAD(s[d]); }          \
        for (int h = 0; h < num_heads; ++h) {                                                   \
            T *x = qk + t * row_stride + (int64_t)h * head_dim;                                 \
            for (int d = 0; d < half; ++d) {                                                    \
                const float x1 = LOAD(x[d]), x2 = LOAD(x[d + half]);                            \
                x[d] = STORE(ROUND(x1 * cf[d]) + ROUND(x2 * sf[d]));                            \
                x[d + half] = STORE(ROUND(x2 * cf[d + half]) + ROUND(x1 * sf[d + half]));       \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    return 0;                                                                                   \
}

/* gate_up: [rows, 2 * inter] (gate then up); out: [rows, inter]. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                            \
int NAME(const T *gate_up, T *out, int64_t rows, int64_t inter, int num_threads) {              \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * inter >= PARALLEL_MIN_ELEMS)") \
    for (int64_t t = 0; t < rows; ++t) {                                                        \
        const T *g = gate_up + t * 2 * inter, *u = g + inter;                                   \
        T *o = out + t * inter;                                                                 \
        for (int64_t i = 0; i < inter; ++i) {                                                   \
            const float gf = LOAD(g[i]);                                                        \
            o[i] = STORE(ROUND(gf / (1.f + fast_expf(-gf))) * LOAD(u[i]));                      \
        }                                                                                       \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32_id, f32_id, f32_id)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_id, f32_id, f32_id)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_SILU_MUL(silu_mul_f32, float, f32_id, f32_id, f32_id)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)

/* Token t's K row (row_bytes, k_stride bytes after token t-1's) goes to block blocks[t], offset
 * offsets[t] of the cache, whose blocks are block_stride bytes apart and whose rows are
 * row_bytes apart within a block; V likewise. */
int kv_write(const char *k, const char *v, int64_t k_stride, int64_t v_stride, char *k_cache,
             char *v_cache, const int64_t *blocks, const int64_t *offsets, int64_t rows,
             int64_t row_bytes, int64_t block_stride) {
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t dst = blocks[t] * block_stride + offsets[t] * row_bytes;
        memcpy(k_cache + dst, k + t * k_stride, (size_t)row_bytes);
        memcpy(v_cache + dst, v + t * v_stride, (size_t)row_bytes);
    }
    return 0;
}

/* A decode step's attention in one call, for batches of decodes only: rotate q and k of each
 * fused qkv row in place, write k and v to their cache slots, attend over the paged cache
 * (paged_attention.c) straight from the rows. The same three kernels the separate calls run,
 * in the same order, so the results are the same bits. */
#define DEFINE_DECODE_ATTENTION(NAME, T, ROTARY, ATTEND)                                        \
int ATTEND(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                   \
           const int64_t *tables, const int64_t *seq_lens, T *out, int num_seqs, int num_heads, \
           int num_kv_heads, int head_dim, int block_size, int max_blocks,                      \
           int64_t block_stride, float scale, int num_threads);                                 \
int NAME(T *qkv, int64_t row_stride, const int64_t *positions, const T *cos_table,             \
         const T *sin_table, T *k_cache, T *v_cache, const int64_t *blocks,                     \
         const int64_t *offsets, const int64_t *tables, const int64_t *seq_lens, T *out,        \
         int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,           \
         int max_blocks, int64_t block_stride, float scale, int num_threads) {                  \
    const int rc = ROTARY(qkv, positions, cos_table, sin_table, num_seqs, row_stride,          \
                          num_heads + num_kv_heads, head_dim, num_threads);                     \
    if (rc != 0) return rc;                                                                     \
    const int64_t q_size = (int64_t)num_heads * head_dim;                                       \
    const int64_t kv_size = (int64_t)num_kv_heads * head_dim;                                   \
    kv_write((const char *)(qkv + q_size), (const char *)(qkv + q_size + kv_size),              \
             row_stride * (int64_t)sizeof(T), row_stride * (int64_t)sizeof(T),                  \
             (char *)k_cache, (char *)v_cache, blocks, offsets, num_seqs,                       \
             kv_size * (int64_t)sizeof(T), block_stride * (int64_t)sizeof(T));                  \
    return ATTEND(qkv, row_stride, k_cache, v_cache, tables, seq_lens, out, num_seqs,          \
                  num_heads, num_kv_heads, head_dim, block_size, max_blocks, block_stride,      \
                  scale, num_threads);                                                          \
}

DEFINE_DECODE_ATTENTION(decode_attention_f32, float, rotary_f32, paged_decode_attention_f32)
DEFINE_DECODE_ATTENTION(decode_attention_bf16, uint16_t, rotary_bf16, paged_decode_attention_bf16)
