/*
 * Paged decode attention for CPUs: one query token per sequence, keys/values read straight
 * from the block-paged cache (no gather copy), grouped-query heads sharing each K/V load.
 *
 *   q        [num_seqs, num_heads, head_dim], sequence s's heads q_stride elements after s-1's
 *            (num_heads * head_dim packed; more: the q part of a fused qkv row)
 *   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   (v_cache: same)
 *            each block contiguous; block b starts block_stride elements after block b-1
 *            (the cache is block first: a block of every layer lies between two of one layer)
 *   tables   [num_seqs, max_blocks]  int64 block ids
 *   seq_lens [num_seqs]              int64 keys to attend (this step's token included)
 *   out      [num_seqs, num_heads, head_dim]
 *
 * Work is split over (sequence, kv head) pairs with OpenMP, one pair at a time (a batch of one has
 * as few pairs as kv heads); below PARALLEL_MIN_KEYS keys in all, the caller's thread does it
 * alone (a thread team's wake-up costs more). For one pair, pass 1 computes q.k
 * for every key (block by block: no division per key), pass 2 the softmax, pass 3 sums the
 * values. Each K/V row is converted to float32 once and used by all heads of its group.
 * Common head sizes (64, 128) get loops with a compile-time trip count, which gcc vectorizes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "common.h"

#define MAX_GROUP 16
#define PARALLEL_MIN_KEYS 1024 /* (key, kv head) rows in a call: about 5 us of work */
#define MAX_HEAD_DIM 256

/* One (sequence, kv head) pair. HD is a literal at the call sites below, so the d-loops have
 * a constant trip count once this is inlined. */
#define DEFINE_PAIR(NAME, T, LOAD, STORE)                                                      \
static inline __attribute__((always_inline)) void NAME(                                        \
    const int HD, const T *q, const T *k_cache, const T *v_cache, const int64_t *table,        \
    int64_t len, T *out, int group, int block_size, int64_t kv_stride, int64_t block_stride,   \
    float scale,                                                                               \
    float *scores) {                                                                           \
    float qf[MAX_GROUP][MAX_HEAD_DIM];                                                         \
    float row[MAX_HEAD_DIM];                                                                   \
    float accum[MAX_GROUP][MAX_HEAD_DIM];                                                      \
    float maxs[MAX_GROUP], sums[MAX_GROUP];                                                    \
    for (int g = 0; g < group; ++g) {                                                          \
        for (int d = 0; d < HD; ++d) qf[g][d] = LOAD(q[g * HD + d]) * scale;                   \
        maxs[g] = -FLT_MAX; /* not -INFINITY: built with -ffast-math (finite math only) */     \
    }                                                                                          \
    int64_t l = 0;                                                                             \
    for (int64_t b = 0; l < len; ++b) {                                                        \
        const T *kb = k_cache + table[b] * block_stride;                                       \
        const int64_t n = len - l < block_size ? len - l : block_size;                         \
        for (int64_t i = 0; i < n; ++i, ++l) {                                                 \
            const T *kp = kb + i * kv_stride;                                                  \
            for (int d = 0; d < HD; ++d) row[d] = LOAD(kp[d]);                                 \
            for (int g = 0; g < group; ++g) {                                                  \
                float acc = 0.f;                                                               \
                for (int d = 0; d < HD; ++d) acc += qf[g][d] * row[d];                         \
                scores[g * len + l] = acc;                                                     \
                maxs[g] = acc > maxs[g] ? acc : maxs[g];                                       \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int g = 0; g < group; ++g) {                                                          \
        float sum = 0.f, *sc = scores + g * len;                                               \
        for (int64_t j = 0; j < len; ++j) { sc[j] = fast_expf(sc[j] - maxs[g]); sum += sc[j]; } \
        sums[g] = sum;                                                                         \
        for (int d = 0; d < HD; ++d) accum[g][d] = 0.f;                                        \
    }                                                                                          \
    l = 0;                                                                                     \
    for (int64_t b = 0; l < len; ++b) {                                                        \
        const T *vb = v_cache + table[b] * block_stride;                                       \
        const int64_t n = len - l < block_size ? len - l : block_size;                         \
        for (int64_t i = 0; i < n; ++i, ++l) {                                                 \
            const T *vp = vb + i * kv_stride;                                                  \
            for (int d = 0; d < HD; ++d) row[d] = LOAD(vp[d]);                                 \
            for (int g = 0; g < group; ++g) {                                                  \
                const float w = scores[g * len + l];                                           \
                for (int d = 0; d < HD; ++d) accum[g][d] += w * row[d];                        \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int g = 0; g < group; ++g) {                                                          \
        const float inv = 1.f / sums[g];                                                       \
        for (int d = 0; d < HD; ++d) out[g * HD + d] = STORE(accum[g][d] * inv);               \
    }                                                                                          \
}

#define DEFINE_KERNEL(NAME, PAIR, T)                                                           \
int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                    \
         const int64_t *tables, const int64_t *seq_lens, T *out, int num_seqs, int num_heads,  \
         int num_kv_heads, int head_dim, int block_size, int max_blocks, int64_t block_stride, \
         float scale, int num_threads) {                                                       \
    const int group = num_heads / num_kv_heads;                                                \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return 1;                                \
    int64_t max_len = 0, keys = 0;                                                             \
    for (int s = 0; s < num_seqs; ++s) {                                                       \
        if (seq_lens[s] > max_len) max_len = seq_lens[s];                                      \
        keys += seq_lens[s] * num_kv_heads;                                                    \
    }                                                                                          \
    const int64_t kv_stride = (int64_t)num_kv_heads * head_dim;                                \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(num_threads) if(keys >= PARALLEL_MIN_KEYS)")             \
    {                                                                                          \
        float *scores = (float *)malloc(sizeof(float) * (size_t)(max_len * group + 1));        \
        if (scores == NULL) { _Pragma("omp atomic write") failed = 1; }                        \
        _Pragma("omp for schedule(dynamic, 1)")                                                \
        for (int64_t pair = 0; pair < (int64_t)num_seqs * num_kv_heads; ++pair) {              \
            if (scores == NULL) continue;                                                      \
            const int s = (int)(pair / num_kv_heads), kvh = (int)(pair % num_kv_heads);        \
            const int64_t off = ((int64_t)s * num_heads + (int64_t)kvh * group) * head_dim;    \
            const T *qp = q + s * q_stride + (int64_t)kvh * group * head_dim;                  \
            const T *kc = k_cache + (int64_t)kvh * head_dim;                                   \
            const T *vc = v_cache + (int64_t)kvh * head_dim;                                   \
            const int64_t *table = tables + (int64_t)s * max_blocks;                           \
            if (head_dim == 64)                                                                \
                PAIR(64, qp, kc, vc, table, seq_lens[s], out + off, group, block_size,         \
                     kv_stride, block_stride, scale, scores);                                  \
            else if (head_dim == 128)                                                          \
                PAIR(128, qp, kc, vc, table, seq_lens[s], out + off, group, block_size,        \
                     kv_stride, block_stride, scale, scores);                                  \
            else                                                                               \
                PAIR(head_dim, qp, kc, vc, table, seq_lens[s], out + off, group, block_size,   \
                     kv_stride, block_stride, scale, scores);                                  \
        }                                                                                      \
        free(scores);                                                                          \
    }                                                                                          \
    return failed;                                                                             \
}

DEFINE_PAIR(pair_f32, float, f32_id, f32_id)
DEFINE_PAIR(pair_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_KERNEL(paged_decode_attention_f32, pair_f32, float)
DEFINE_KERNEL(paged_decode_attention_bf16, pair_bf16, uint16_t)
