/* Helpers shared by the CPU kernels: bfloat16 conversions and an exp that vectorizes. */
#ifndef TANDEM_CSRC_COMMON_H
#define TANDEM_CSRC_COMMON_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)h) << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}

/* Rounds a float32 value to bfloat16 and back: the value torch keeps after a bf16 op. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float f32_id(float x) { return x; }

/* e^x within about 2 ulp, branch-free so that gcc vectorizes the loops calling it (glibc's
 * expf is a scalar call without -ffast-math). x = n ln2 + r with |r| <= ln2/2; e^r is the
 * Cephes minimax polynomial, 2^n is built in the exponent bits. The input is clamped to the
 * range where the result is a normal float: the softmax's arguments are <= 0, and silu's
 * clamped e^88 makes silu(x) about x * 6e-39 for x < -88 instead of x * e^x (both ~0).
 * The range reduction is two explicit FMAs: written as sums, -fassociative-math folds the
 * two halves of ln2 back into one constant (68 ulp at |x| = 87 instead of 1.5). */
static inline float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f;
    const int n = (int)(t + (t >= 0.f ? 0.5f : -0.5f));
    const float nf = (float)n;
    const float r = fmaf(nf, 2.12194440e-4f, fmaf(nf, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)(n + 127) << 23;
    return p * scale.f;
}

/* AVX-512 BF16's dot instruction (vdpbf16ps): compiled in where the build targets it
 * (-march=native), and checked at run time as well -- a library cached by one machine can be
 * loaded by another (libgcc fills in the CPU's features when the library loads; reading them
 * is a few loads). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
static inline int bf16_dot_runs(void) {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
#else
#define HAVE_BF16_DOT 0
static inline int bf16_dot_runs(void) { return 0; }
#endif

#endif
