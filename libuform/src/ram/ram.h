/**
 *  @file   ram.h
 *  @brief  The CPU reference backend's operations, one file each, wired into `uform_ram_backend`.
 *
 *  Every `void* context` is a `uform_ram_context_t`. Parallel loops split work so that each
 *  output element is computed by one thread in a fixed order: results never depend on the
 *  thread count, except the matrix products' last bits (`matmul.c` says why).
 */
#ifndef UFORM_RAM_H_
#define UFORM_RAM_H_

#include <string.h>

#include "internal.h"

/** Threads a parallel loop may use; a context asking for none still gets one. */
static inline int uform_ram_threads(void* context) {
    int threads = ((uform_ram_context_t const*)context)->threads;
    return threads > 0 ? threads : 1;
}

/**
 *  e^x in float, written so that loops over it vectorize (libm's `expf` does not): 2^n from
 *  the exponent bits times a degree-6 Taylor polynomial on |r| <= ln2 / 2, relative error below
 *  3e-7. Inputs are clamped to [-87, 88] so it neither overflows nor goes subnormal; NaN stays
 *  NaN. The clamp selects with integer masks because gcc keeps a float `?:` next to arithmetic
 *  that may trap as a branch, and a branch stops vectorization.
 */
static inline float uform_ram_exp(float x) {
    float const low = -87.0f, high = 88.0f;
    int32_t value, low_bits, high_bits, below = -(int32_t)(x < low), above = -(int32_t)(x > high);
    memcpy(&value, &x, sizeof value);
    memcpy(&low_bits, &low, sizeof low_bits);
    memcpy(&high_bits, &high, sizeof high_bits);
    value = (value & ~(below | above)) | (low_bits & below) | (high_bits & above);
    memcpy(&x, &value, sizeof x);
    float shifted = x * 1.44269504f + 12582912.0f; /* + 1.5 * 2^23 rounds: n lands in the low mantissa bits */
    float n = shifted - 12582912.0f;
    float r = (x - n * 0.693145752f) - n * 1.42860682e-6f; /* ln 2 split in two keeps r exact */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits - 0x4B400000 + 127) << 23; /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/** Makes OpenBLAS single-threaded, once: our own threads split every product. */
void uform_ram_blas_init(void);

void* uform_ram_allocate(void* context, size_t bytes);
void uform_ram_release(void* context, void* pointer);
void uform_ram_upload(void* context, void* destination, void const* source, size_t bytes);
void uform_ram_download(void* context, void* destination, void const* source, size_t bytes);
void uform_ram_zero(void* context, void* destination, size_t bytes);

void uform_ram_matmul(void* context, float* c, float const* a, float const* b, size_t m, size_t n, size_t k,
                      int a_transposed, int b_transposed, float beta);

void uform_ram_embedding_forward(void* context, float* out, float const* table, uint32_t const* ids, size_t tokens,
                                 size_t hidden);
void uform_ram_embedding_backward(void* context, float* d_table, float const* d_out, uint32_t const* ids,
                                  size_t tokens, size_t hidden, size_t vocabulary);

void uform_ram_rmsnorm_forward(void* context, float* out, float* rstd, float const* x, float const* gain,
                               size_t tokens, size_t hidden);
void uform_ram_rmsnorm_backward(void* context, float* d_x, float* d_gain, float const* d_out, float const* x,
                                float const* gain, float const* rstd, size_t tokens, size_t hidden);

void uform_ram_rope_forward(void* context, float* qkv, uint32_t const* positions, size_t tokens, size_t hidden);
void uform_ram_rope_backward(void* context, float* d_qkv, uint32_t const* positions, size_t tokens, size_t hidden);

void uform_ram_attention_forward(void* context, float* out, float* lse, float const* qkv,
                                 uform_segment_t const* segments, size_t segments_count, size_t tokens,
                                 size_t hidden);
void uform_ram_attention_backward(void* context, float* d_qkv, float const* d_out, float const* out, float const* lse,
                                  float const* qkv, uform_segment_t const* segments, size_t segments_count,
                                  size_t tokens, size_t hidden);

void uform_ram_gelu_forward(void* context, float* out, float const* in, size_t count);
void uform_ram_gelu_backward(void* context, float* d_in, float const* d_out, float const* in, size_t count);

void uform_ram_gather_rows(void* context, float* out, float const* in, uint32_t const* rows, size_t count,
                           size_t width);
void uform_ram_scatter_rows(void* context, float* d_in, float const* d_out, uint32_t const* rows, size_t count,
                            size_t width);
void uform_ram_pool_forward(void* context, float* pooled, float const* states, uform_segment_t const* segments,
                            size_t segments_count, size_t hidden);
void uform_ram_pool_backward(void* context, float* d_states, float const* d_pooled, uform_segment_t const* segments,
                             size_t segments_count, size_t hidden);

double uform_ram_cross_entropy(void* context, float* d_logits, float const* logits, uint32_t const* targets,
                               size_t count, size_t classes, float scale);

double uform_ram_contrastive(void* context, float* d_pooled, float* d_log_inverse_temperature, float* d_bias,
                             float* normalized, float const* pooled, float const* log_inverse_temperature,
                             float const* bias, uint8_t const* cells, float const* weights, uint32_t const* groups,
                             size_t items, size_t hidden, uform_contrastive_setup_t const* setup, float scale);

double uform_ram_sum_squares(void* context, float const* x, size_t count);
void uform_ram_adamw(void* context, float* weights, float const* gradients, float* first, float* second, size_t count,
                     float learning_rate, float beta1, float beta2, float epsilon, float weight_decay,
                     float gradient_scale, uint64_t step);

#endif /* UFORM_RAM_H_ */
