/**
 *  @file   attention.c
 *  @brief  Bidirectional attention within each segment of the packed token stream.
 *
 *  qkv (tokens, 3 hidden) holds queries, keys and values side by side; head h takes columns
 *  h * 64 .. h * 64 + 63 of each third. out (tokens, hidden) = softmax(q k^T / 8) v per head and
 *  segment, lse (heads, tokens) keeps each row's log-sum-exp so that the backward pass rebuilds
 *  the probabilities without storing them, as FlashAttention does.
 *
 *  Threads take (segment, head) pairs. Each walks its queries in blocks, so its scratch, planned
 *  with the context, is one block of scores against the longest item's keys, and every product goes through single-threaded
 *  sgemm straight on the strided rows of qkv: a pair's numbers never depend on the thread count.
 */
#include <math.h>
#include <omp.h>

#include <cblas.h>

#include "ram.h"

static float const uform_ram_attention_scale = 0.125f; /* 1 / sqrt(64) */

uform_status_t uform_ram_attention_forward(void* context, void* out_, float* lse, void const* qkv_,
                                           uform_items_t const* items, size_t tokens, size_t hidden) {
    uform_ram_blas_init();
    uform_ram_context_t const* planned = context;
    float* out = out_;
    float const* qkv = qkv_;
    uform_segment_t const* segments = items->segments;
    size_t segments_count = items->count;
    int threads = uform_ram_threads(context);
    size_t heads = hidden / uform_head_width_k, stride = 3 * hidden;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t pair = 0; pair < segments_count * heads; ++pair) {
        size_t head = pair % heads, start = segments[pair / heads].start, length = segments[pair / heads].length;
        float* scores = planned->attention + (size_t)omp_get_thread_num() * planned->attention_floats; /* (block, length) */
        float const* queries = qkv + start * stride + head * uform_head_width_k;
        float const* keys = queries + hidden;
        float const* values = queries + 2 * hidden;
        for (size_t first = 0; first < length; first += uform_ram_query_block_k) {
            size_t rows = length - first < uform_ram_query_block_k ? length - first : uform_ram_query_block_k;
            float* result = out + (start + first) * hidden + head * uform_head_width_k;
            scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)rows, (blasint)length,
                              uform_head_width_k, uform_ram_attention_scale, queries + first * stride,
                              (blasint)stride, keys, (blasint)stride, 0.0f, scores, (blasint)length);
            float sums[uform_ram_query_block_k];
            for (size_t row = 0; row < rows; ++row) {
                float* restrict score = scores + row * length;
                float largest = score[0], sum = 0;
#pragma omp simd reduction(max : largest)
                for (size_t key = 1; key < length; ++key) largest = score[key] > largest ? score[key] : largest;
#pragma omp simd reduction(+ : sum)
                for (size_t key = 0; key < length; ++key) {
                    score[key] = uform_ram_exp(score[key] - largest);
                    sum += score[key];
                }
                sums[row] = sum;
                lse[head * tokens + start + first + row] = largest + logf(sum);
            }
            scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)rows, uform_head_width_k,
                              (blasint)length, 1.0f, scores, (blasint)length, values, (blasint)stride, 0.0f, result,
                              (blasint)hidden);
            /* Normalizing the 64 outputs is cheaper than normalizing the `length` weights. */
            for (size_t row = 0; row < rows; ++row) {
                float inverse = 1.0f / sums[row];
                for (int column = 0; column < uform_head_width_k; ++column) result[row * hidden + column] *= inverse;
            }
        }
    }
    return uform_status_success_k;
}

/**
 *  With P = exp(S - lse): dV = P^T dO, dP = dO V^T, dS = P (dP - D) where D_t = <dO_t, O_t>,
 *  dQ = dS K / 8 and dK = dS^T Q / 8. Keys and values collect over query blocks, so d_qkv is
 *  zeroed first and every product adds; rows no segment covers stay zero. Given positions, dQ and
 *  dK then take the inverse rotary turn (`rope.c`).
 */
uform_status_t uform_ram_attention_backward(void* context, void* d_qkv_, void const* d_out_, void const* out_,
                                            float const* lse, void const* qkv_, uint32_t const* positions,
                                            int same_positions, uform_items_t const* items, size_t tokens,
                                            size_t hidden) {
    (void)same_positions; /* the CPU turns each gradient from its position afresh */
    uform_ram_blas_init();
    uform_ram_context_t const* planned = context;
    float* d_qkv = d_qkv_;
    float const *d_out = d_out_, *out = out_, *qkv = qkv_;
    uform_segment_t const* segments = items->segments;
    size_t segments_count = items->count;
    int threads = uform_ram_threads(context);
    size_t heads = hidden / uform_head_width_k, stride = 3 * hidden;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t token = 0; token < tokens; ++token) memset(d_qkv + token * stride, 0, stride * sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t pair = 0; pair < segments_count * heads; ++pair) {
        size_t head = pair % heads, start = segments[pair / heads].start, length = segments[pair / heads].length;
        float* probabilities = planned->attention + (size_t)omp_get_thread_num() * planned->attention_floats;
        float* d_scores = probabilities + planned->attention_floats / 2; /* each (block, length) */
        size_t offset = start * stride + head * uform_head_width_k;
        float const* queries = qkv + offset;
        float const* keys = queries + hidden;
        float const* values = queries + 2 * hidden;
        float* d_queries = d_qkv + offset;
        float* d_keys = d_queries + hidden;
        float* d_values = d_queries + 2 * hidden;
        for (size_t first = 0; first < length; first += uform_ram_query_block_k) {
            size_t rows = length - first < uform_ram_query_block_k ? length - first : uform_ram_query_block_k;
            float const* outputs = out + (start + first) * hidden + head * uform_head_width_k;
            float const* d_outputs = d_out + (start + first) * hidden + head * uform_head_width_k;
            float const* block_queries = queries + first * stride;
            scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)rows, (blasint)length,
                              uform_head_width_k, uform_ram_attention_scale, block_queries, (blasint)stride, keys,
                              (blasint)stride, 0.0f, probabilities, (blasint)length);
            scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)rows, (blasint)length,
                              uform_head_width_k, 1.0f, d_outputs, (blasint)hidden, values, (blasint)stride, 0.0f,
                              d_scores, (blasint)length);
            for (size_t row = 0; row < rows; ++row) {
                float const* restrict output = outputs + row * hidden;
                float const* restrict d_output = d_outputs + row * hidden;
                float* restrict probability = probabilities + row * length;
                float* restrict d_score = d_scores + row * length;
                float log_sum = lse[head * tokens + start + first + row], agreement = 0;
#pragma omp simd reduction(+ : agreement)
                for (int column = 0; column < uform_head_width_k; ++column)
                    agreement += d_output[column] * output[column];
#pragma omp simd
                for (size_t key = 0; key < length; ++key) {
                    probability[key] = uform_ram_exp(probability[key] - log_sum);
                    d_score[key] = probability[key] * (d_score[key] - agreement);
                }
            }
            scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)length, uform_head_width_k,
                              (blasint)rows, 1.0f, probabilities, (blasint)length, d_outputs, (blasint)hidden, 1.0f,
                              d_values, (blasint)stride);
            scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)rows, uform_head_width_k,
                              (blasint)length, uform_ram_attention_scale, d_scores, (blasint)length, keys,
                              (blasint)stride, 1.0f, d_queries + first * stride, (blasint)stride);
            scipy_cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)length, uform_head_width_k,
                              (blasint)rows, uform_ram_attention_scale, d_scores, (blasint)length, block_queries,
                              (blasint)stride, 1.0f, d_keys, (blasint)stride);
        }
    }
    return positions ? uform_ram_rope_backward(context, d_qkv_, positions, tokens, hidden) : uform_status_success_k;
}
