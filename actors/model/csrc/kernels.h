/* The bfloat16 entry points that decode_layers.c chains, declared once: the sources that
 * define them include this too, so a changed signature fails to compile instead of passing
 * arguments wrongly. */
#ifndef TANDEM_CSRC_KERNELS_H
#define TANDEM_CSRC_KERNELS_H

#include <stdint.h>

int add_rms_norm_bf16(const uint16_t *x, const uint16_t *r, const uint16_t *w, uint16_t *out,
                      uint16_t *res_out, int64_t rows, int64_t hidden, int64_t x_stride,
                      float eps, int num_threads);
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                  int num_threads);
int decode_attention_bf16(uint16_t *qkv, int64_t row_stride, const int64_t *positions,
                          const uint16_t *cos_table, const uint16_t *sin_table,
                          uint16_t *k_cache, uint16_t *v_cache, const int64_t *blocks,
                          const int64_t *offsets, const int64_t *tables, const int64_t *seq_lens,
                          uint16_t *out, int num_seqs, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, int max_blocks, int64_t block_stride,
                          float scale, int num_threads);
int int4_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                   const uint8_t *codes, const uint16_t *sz, int64_t n, uint16_t *out,
                   int64_t out_stride, int num_threads);
int int8_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                   const uint8_t *codes, const uint16_t *scales, int64_t n, uint16_t *out,
                   int64_t out_stride, int num_threads);

#endif
