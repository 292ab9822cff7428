/* A step of decodes through every decoder layer of a stage in one call, for bfloat16 models
 * whose four projections per layer run on the quantized kernels (quant_gemm.c). The layer is
 * the one actors/model/llama.py runs op by op -- input norm (adding the residual), qkv
 * projection, rotary + cache write + paged attention, o projection, post-attention norm
 * (adding the residual), gate/up projection, silu * up, down projection -- with the same
 * kernels in the same order, so the result is the same bits; what goes is the Python between
 * the kernels (about 8 calls a layer, a few microseconds each). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

enum { QKV, O, GATE_UP, DOWN };

/* One layer's weights: its two norms' weights and its four packed projections (codes,
 * scales, 4 or 8 bits), in the order of the enum above. */
typedef struct {
    const uint16_t *input_norm;
    const uint16_t *post_norm;
    const uint8_t *codes[4];
    const uint16_t *scales[4];
    int32_t bits[4];
} decode_layer;

static int project(const decode_layer *layer, int which, const uint16_t *x, int64_t m,
                   int64_t k, int64_t n, uint16_t *out, int num_threads) {
    if (layer->bits[which] == 4)
        return int4_gemm_bf16(x, k, m, k, layer->codes[which], layer->scales[which], n, out, n,
                              num_threads);
    if (layer->bits[which] == 8)
        return int8_gemm_bf16(x, k, m, k, layer->codes[which], layer->scales[which], n, out, n,
                              num_threads);
    return -4;
}

/* x: [m, hidden] the stage's input (an embedding, or the previous stage's hidden states);
 * residual: [m, hidden] or NULL (none yet: x is the residual stream). out: [m, hidden] the
 * last layer's MLP output; res_out: [m, hidden] the residual stream before it (the caller
 * adds the two, in its final norm). Layer l's K cache starts kv_cache + l * layer_stride
 * elements, its V cache v_offset elements after its K. Rows are packed (stride = width).
 * Returns 0, a kernel's error code, -5 for no layers, or -6 when out of memory. */
int decode_layers_bf16(const decode_layer *layers, int num_layers, const uint16_t *x,
                       const uint16_t *residual, uint16_t *out, uint16_t *res_out, int64_t m,
                       int64_t hidden, int64_t inter, float eps, const int64_t *positions,
                       const uint16_t *cos_table, const uint16_t *sin_table, uint16_t *kv_cache,
                       int64_t layer_stride, int64_t v_offset, const int64_t *blocks,
                       const int64_t *offsets, const int64_t *tables, const int64_t *seq_lens,
                       int num_heads, int num_kv_heads, int head_dim, int block_size,
                       int max_blocks, int64_t block_stride, float scale, int num_threads) {
    if (num_layers <= 0 || m <= 0) return -5;
    const int64_t q_size = (int64_t)num_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * (int64_t)num_kv_heads * head_dim;
    const int64_t elems = m * (hidden + qkv_size + q_size + 3 * inter);
    uint16_t *scratch = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)elems);
    if (scratch == NULL) return -6;
    uint16_t *h = scratch, *qkv = h + m * hidden, *attn = qkv + m * qkv_size;
    uint16_t *gate_up = attn + m * q_size, *act = gate_up + m * 2 * inter;
    int rc = 0;
    const uint16_t *input = x; /* what the next input norm adds to the residual */
    if (residual != NULL) memcpy(res_out, residual, sizeof(uint16_t) * (size_t)(m * hidden));
    for (int l = 0; l < num_layers && rc == 0; ++l) {
        const decode_layer *layer = &layers[l];
        if (l == 0 && residual == NULL) { /* no residual yet: normalise x, which becomes it */
            rc = add_rms_norm_bf16(input, NULL, layer->input_norm, h, NULL, m, hidden, hidden,
                                   eps, num_threads);
            memcpy(res_out, input, sizeof(uint16_t) * (size_t)(m * hidden));
        } else {
            rc = add_rms_norm_bf16(input, res_out, layer->input_norm, h, res_out, m, hidden,
                                   hidden, eps, num_threads);
        }
        if (rc == 0) rc = project(layer, QKV, h, m, hidden, qkv_size, qkv, num_threads);
        if (rc == 0) {
            uint16_t *k_cache = kv_cache + (int64_t)l * layer_stride;
            rc = decode_attention_bf16(qkv, qkv_size, positions, cos_table, sin_table, k_cache,
                                       k_cache + v_offset, blocks, offsets, tables, seq_lens,
                                       attn, (int)m, num_heads, num_kv_heads, head_dim,
                                       block_size, max_blocks, block_stride, scale, num_threads);
        }
        if (rc == 0) rc = project(layer, O, attn, m, q_size, hidden, out, num_threads);
        if (rc == 0)
            rc = add_rms_norm_bf16(out, res_out, layer->post_norm, h, res_out, m, hidden, hidden,
                                   eps, num_threads);
        if (rc == 0) rc = project(layer, GATE_UP, h, m, hidden, 2 * inter, gate_up, num_threads);
        if (rc == 0) rc = silu_mul_bf16(gate_up, act, m, inter, num_threads);
        if (rc == 0) rc = project(layer, DOWN, act, m, inter, hidden, out, num_threads);
        input = out;
    }
    free(scratch);
    return rc;
}
