/**
 *  @file   ram.h
 *  @brief  The CPU reference backend's operations, one file each, wired into `uform_ram_backend`.
 *
 *  Every `void* context` is a `uform_ram_context_t`; activations are float32, so every `void*`
 *  buffer holds floats. Parallel loops split work so that each
 *  output element is computed by one thread in a fixed order: results never depend on the
 *  thread count, except the matrix products' last bits (`matmul.c` says why).
 */
#ifndef UFORM_RAM_H_
#define UFORM_RAM_H_

#include <string.h>

#include "backend.h"

/** A RAM device is a thread count. */
typedef struct uform_ram_device_t {
    int threads;
} uform_ram_device_t;

/** One replica's context: its threads and the scratch its operations were planned with. */
typedef struct uform_ram_context_t {
    int threads;
    uform_layout_t const* layout;
    float* attention;         /* (threads, attention_floats) one query block's scores per thread, twice */
    size_t attention_floats;
    double* contrastive;      /* the contrastive term's rows, sized for `items` x `hidden` */
    uint32_t* lists;          /* (threads, 2 items) positives and negatives of a row */
    size_t items, hidden;
} uform_ram_context_t;

/** Threads a parallel loop may use; a context asking for none still gets one. */
static inline int uform_ram_threads(void* context) {
    int threads = ((uform_ram_context_t const*)context)->threads;
    return threads > 0 ? threads : 1;
}

enum { uform_ram_query_block_k = 128 }; /* queries one attention pass scores at once */

/** Floats of one attention buffer: a query block's scores against the longest item, in whole lines. */
static inline size_t uform_ram_attention_block(size_t columns) { return uform_ram_query_block_k * ((columns + 15) / 16 * 16); }

/** Doubles of the contrastive term's scratch for `items` x `hidden` and `threads` threads. */
static inline size_t uform_ram_contrastive_doubles(size_t items, size_t hidden, int threads) {
    size_t row_width = items > hidden ? items : hidden;
    return 2 * items * hidden + items * items + 6 * items + (size_t)threads * row_width;
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
    uint32_t bits; /* unsigned: a NaN's bits shift without undefined behaviour, and its p stays NaN */
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits - 0x4B400000u + 127u) << 23; /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/** Makes OpenBLAS single-threaded, once: our own threads split every product. */
void uform_ram_blas_init(void);

uform_status_t uform_ram_matmul(void* context, void* d, void const* c, void const* a, void const* b, size_t m,
                                size_t n, size_t k, int a_transposed, int b_transposed, uform_element_t d_element);
uform_status_t uform_ram_embedding_forward(void* context, void* out, void const* table, uint32_t const* ids,
                                           size_t tokens, size_t hidden);
uform_status_t uform_ram_embedding_backward(void* context, float* d_table, void const* d_out, uint32_t const* order,
                                            uint32_t const* order_offsets, size_t tokens, size_t hidden,
                                            size_t vocabulary);
uform_status_t uform_ram_rmsnorm_forward(void* context, void* out, float* rstd, void const* x, float const* gain,
                                         size_t tokens, size_t hidden);
uform_status_t uform_ram_rmsnorm_backward(void* context, void* d_x, float* d_gain, void const* d_out, void const* x,
                                          float const* gain, float const* rstd, size_t tokens, size_t hidden);
uform_status_t uform_ram_rope_forward(void* context, void* qkv, uint32_t const* positions, size_t tokens, size_t hidden);
uform_status_t uform_ram_rope_backward(void* context, void* d_qkv, uint32_t const* positions, size_t tokens,
                                       size_t hidden);
uform_status_t uform_ram_attention_forward(void* context, void* out, float* lse, void const* qkv,
                                           uform_items_t const* items, size_t tokens, size_t hidden);
uform_status_t uform_ram_attention_backward(void* context, void* d_qkv, void const* d_out, void const* out,
                                            float const* lse, void const* qkv, uint32_t const* positions,
                                            int same_positions, uform_items_t const* items, size_t tokens,
                                            size_t hidden);
uform_status_t uform_ram_gelu_forward(void* context, void* out, void const* in, size_t count);
uform_status_t uform_ram_gelu_backward(void* context, void* d_in, void const* d_out, void const* in, size_t count);
uform_status_t uform_ram_gather_rows(void* context, void* out, void const* in, uint32_t const* rows, size_t count,
                                     size_t width);
uform_status_t uform_ram_scatter_rows(void* context, void* d_in, void const* d_out, uint32_t const* rows, size_t count,
                                      size_t width);
uform_status_t uform_ram_pool_forward(void* context, float* pooled, void const* states, uform_items_t const* items,
                                      size_t hidden);
uform_status_t uform_ram_pool_backward(void* context, void* d_states, float const* d_pooled,
                                       uform_items_t const* items, size_t hidden);
uform_status_t uform_ram_cross_entropy(void* context, double* loss, void* d_logits, void const* logits,
                                       uint32_t const* targets, size_t count, size_t classes, float scale);
uform_status_t uform_ram_choices(void* context, double* loss, void* d_logits, float* probabilities, void const* logits,
                                 uint32_t const* offsets, uint8_t const* choices, float const* targets, size_t count,
                                 float scale);
double uform_ram_pair_row(uform_pair_loss_form_t form, double const* cosines, double* gradient, uint8_t const* cells,
                          float const* weights, size_t items, double temperature, double bias, double attract,
                          double repel, uint32_t* lists);
uform_status_t uform_ram_normalize_rows(void* context, float* out, void const* in, size_t rows, size_t width);
uform_status_t uform_ram_normalize_rows_backward(void* context, void* d_in, float const* d_out, float const* out,
                                                 void const* in, size_t rows, size_t width);
uform_status_t uform_ram_late_interaction(void* context, double* loss, float* d_vectors, float* d_log_inverse_temperature,
                                          float* d_bias, float const* vectors, size_t rows, size_t width,
                                          float const* log_inverse_temperature, float const* bias,
                                          uform_late_interaction_setup_t const* setup, float scale);
uform_status_t uform_ram_patch_loss(void* context, double* loss, void* d_predictions, void const* predictions,
                                    float const* targets, size_t count, size_t width, float scale);
uform_status_t uform_ram_contrastive(void* context, double* loss, float* d_pooled, float* d_log_inverse_temperature,
                                     float* d_bias, float* normalized, float const* pooled,
                                     float const* log_inverse_temperature, float const* bias, uint8_t const* cells,
                                     float const* weights, uint32_t const* groups, size_t items, size_t hidden,
                                     uform_contrastive_setup_t const* setup, float scale);
uform_status_t uform_ram_sum_squares(void* context, double* sum, float const* x, size_t count);
uform_status_t uform_ram_adamw(void* context, uform_update_t const* update);

#endif /* UFORM_RAM_H_ */
