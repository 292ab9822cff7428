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
 *
 * bfloat16 caches with head sizes that are a multiple of 32, on CPUs with AVX-512 BF16, take
 * a faster path (pair_bf16_dot): q.k with the bf16 dot instruction on the cache's own bytes
 * (no conversion; products exact in float32, then scaled), sixteen keys' sums reduced together,
 * and the value sum also on the dot instruction, two keys at a time, with the softmax weights
 * rounded to bfloat16 (their normalizing sum taken over the rounded weights) -- what a bf16
 * attention kernel on a GPU does; 1.8-2.4x faster than the float32 loops above (SmolLM2's
 * heads, 200-1,024 keys).
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


#if HAVE_BF16_DOT
/* The lane sums of v[0..15], lane i holding v[i]'s: a transposing tree (shuffles of 128-bit
 * lanes, then of elements) leaves them in the order 0 4 8 12 1 5 ..., put back at the end. */
static inline __m512 sum16(const __m512 *v) {
    __m512 u[8], w[4], x[2];
    for (int i = 0; i < 8; ++i)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    const __m512 y =
        _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, y);
}

/* The cache offset of one key after another (no division per key). */
struct walk {
    const int64_t *table;
    int64_t block, slot;
    int block_size;
};

static inline int64_t offset_of(struct walk *w, int64_t block_stride, int64_t kv_stride) {
    const int64_t off = w->table[w->block] * block_stride + w->slot * kv_stride;
    if (++w->slot == w->block_size) {
        w->slot = 0;
        ++w->block;
    }
    return off;
}

/* One (sequence, kv head) pair, bfloat16, HD a multiple of 32 (at most MAX_HEAD_DIM).
 * scores: [group][len] floats, then [group][len + 1] bfloat16 weights. */
static inline __attribute__((always_inline)) void pair_bf16_dot(
    const int HD, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *table, int64_t len, uint16_t *out, int group, int block_size,
    int64_t kv_stride, int64_t block_stride, float scale, float *scores) {
    const int chunks = HD / 32;
    uint16_t *weights = (uint16_t *)(scores + (int64_t)group * len);
    float maxs[MAX_GROUP], sums[MAX_GROUP];
    for (int g = 0; g < group; ++g) maxs[g] = -FLT_MAX;
    struct walk walk_k = {table, 0, 0, block_size};
    /* q.k, sixteen keys at a time. */
    for (int64_t l0 = 0; l0 < len; l0 += 16) {
        const int n = len - l0 < 16 ? (int)(len - l0) : 16;
        const uint16_t *rows[16];
        for (int i = 0; i < n; ++i) rows[i] = k_cache + offset_of(&walk_k, block_stride, kv_stride);
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int g = 0; g < group; ++g) {
            const uint16_t *qg = q + g * HD;
            __m512 acc[16];
            for (int i = 0; i < 16; ++i) {
                acc[i] = _mm512_setzero_ps();
                if (i >= n) continue;
                for (int c = 0; c < chunks; ++c)
                    acc[i] = _mm512_dpbf16_ps(acc[i], as_bh(_mm512_loadu_si512(rows[i] + 32 * c)),
                                              as_bh(_mm512_loadu_si512(qg + 32 * c)));
            }
            const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + g * len + l0, valid, s);
            const float m = _mm512_mask_reduce_max_ps(valid, s);
            maxs[g] = m > maxs[g] ? m : maxs[g];
        }
    }
    /* The softmax's weights, rounded to bfloat16; the sum is the rounded weights'. */
    for (int g = 0; g < group; ++g) {
        float *sc = scores + g * len;
        uint16_t *wg = weights + g * (len + 1);
        for (int64_t j = 0; j < len; ++j) sc[j] = fast_expf(sc[j] - maxs[g]); /* vectorizes */
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j += 16) {
            const __mmask16 m = len - j >= 16 ? 0xFFFF : (__mmask16)((1u << (len - j)) - 1u);
            const __m256i w = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, sc + j));
            _mm256_mask_storeu_epi16(wg + j, m, w);
            const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, _mm512_castsi512_ps(wide)));
        }
        wg[len] = 0; /* the partner of an odd last key */
        sums[g] = _mm512_reduce_add_ps(sum);
    }
    /* The weighted sum of values, two keys at a time: their rows interleaved element by
     * element (within 128-bit lanes), so each dot lane sums one element of both. One head at
     * a time, so that its sums stay in registers (HD is a literal at the call sites). Lane
     * 4j + t of a low sum is element 8j + t of its 32 elements, of a high sum 8j + 4 + t. */
    for (int g = 0; g < group; ++g) {
        __m512 lo_acc[MAX_HEAD_DIM / 32], hi_acc[MAX_HEAD_DIM / 32];
        for (int c = 0; c < chunks; ++c) lo_acc[c] = hi_acc[c] = _mm512_setzero_ps();
        const uint16_t *wg = weights + g * (len + 1);
        struct walk walk_v = {table, 0, 0, block_size};
        for (int64_t l = 0; l < len; l += 2) {
            const uint16_t *a = v_cache + offset_of(&walk_v, block_stride, kv_stride);
            const uint16_t *b =
                l + 1 < len ? v_cache + offset_of(&walk_v, block_stride, kv_stride) : a;
            uint32_t pair;
            memcpy(&pair, wg + l, sizeof pair);
            const __m512bh p = as_bh(_mm512_set1_epi32((int)pair));
            for (int c = 0; c < chunks; ++c) {
                const __m512i va = _mm512_loadu_si512(a + 32 * c);
                const __m512i vb = _mm512_loadu_si512(b + 32 * c);
                lo_acc[c] = _mm512_dpbf16_ps(lo_acc[c], as_bh(_mm512_unpacklo_epi16(va, vb)), p);
                hi_acc[c] = _mm512_dpbf16_ps(hi_acc[c], as_bh(_mm512_unpackhi_epi16(va, vb)), p);
            }
        }
        const float inv = 1.f / sums[g];
        for (int c = 0; c < chunks; ++c) {
            float lo[16], hi[16];
            _mm512_storeu_ps(lo, lo_acc[c]);
            _mm512_storeu_ps(hi, hi_acc[c]);
            uint16_t *o = out + g * HD + 32 * c;
            for (int j = 0; j < 4; ++j)
                for (int t = 0; t < 4; ++t) {
                    o[8 * j + t] = f32_to_bf16(lo[4 * j + t] * inv);
                    o[8 * j + 4 + t] = f32_to_bf16(hi[4 * j + t] * inv);
                }
        }
    }
}
#define BF16_DOT_OK(T, head_dim) (sizeof(T) == 2 && (head_dim) % 32 == 0 && bf16_dot_runs())
static void pair_bf16_dot_64(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *table, int64_t len, uint16_t *out, int group,
                             int block_size, int64_t kv_stride, int64_t block_stride, float scale,
                             float *scores) {
    pair_bf16_dot(64, q, k_cache, v_cache, table, len, out, group, block_size, kv_stride,
                  block_stride, scale, scores);
}

static void pair_bf16_dot_128(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *table, int64_t len, uint16_t *out, int group,
                              int block_size, int64_t kv_stride, int64_t block_stride, float scale,
                              float *scores) {
    pair_bf16_dot(128, q, k_cache, v_cache, table, len, out, group, block_size, kv_stride,
                  block_stride, scale, scores);
}

static void pair_bf16_dot_any(int hd, const uint16_t *q, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *table, int64_t len,
                              uint16_t *out, int group, int block_size, int64_t kv_stride,
                              int64_t block_stride, float scale, float *scores) {
    if (hd == 64)
        pair_bf16_dot_64(q, k_cache, v_cache, table, len, out, group, block_size, kv_stride,
                         block_stride, scale, scores);
    else if (hd == 128)
        pair_bf16_dot_128(q, k_cache, v_cache, table, len, out, group, block_size, kv_stride,
                          block_stride, scale, scores);
    else
        pair_bf16_dot(hd, q, k_cache, v_cache, table, len, out, group, block_size, kv_stride,
                      block_stride, scale, scores);
}
#define FAST_PAIR pair_bf16_dot_any
#else
#define BF16_DOT_OK(T, head_dim) 0
#define FAST_PAIR(...) ((void)0)
#endif

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
    const int fast = BF16_DOT_OK(T, head_dim);                                                 \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(num_threads) if(keys >= PARALLEL_MIN_KEYS)")             \
    {                                                                                          \
        /* float scores, then (the bf16 dot path) bf16 weights, one pad per head */             \
        const size_t floats = (size_t)(2 * max_len * group + group + 1);                       \
        float *scores = (float *)malloc(sizeof(float) * floats);                               \
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
            if (fast)                                                                          \
                FAST_PAIR(head_dim, (const uint16_t *)qp, (const uint16_t *)kc,                \
                          (const uint16_t *)vc, table, seq_lens[s], (uint16_t *)(out + off),   \
                          group, block_size, kv_stride, block_stride, scale, scores);          \
            else if (head_dim == 64)                                                           \
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
