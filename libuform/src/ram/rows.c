/**
 *  @file   rows.c
 *  @brief  Moving whole rows: gathering chosen rows, scattering their gradients back, and
 *          mean-pooling each segment's rows into one.
 */
#include "ram.h"

/** out (count, width) = in [rows (count)] */
uform_status_t uform_ram_gather_rows(void* context, void* out_, void const* in_, uint32_t const* rows, size_t count,
                                     size_t width) {
    float* out = out_;
    float const* in = in_;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < count; ++index)
        memcpy(out + index * width, in + (size_t)rows[index] * width, width * sizeof(float));
    return uform_status_success_k;
}

/** d_in [rows (count)] += d_out (count, width); rows are distinct, so threads never share one. */
uform_status_t uform_ram_scatter_rows(void* context, void* d_in_, void const* d_out_, uint32_t const* rows, size_t count,
                                      size_t width) {
    float* d_in = d_in_;
    float const* d_out = d_out_;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < count; ++index) {
        float* restrict target = d_in + (size_t)rows[index] * width;
        float const* restrict source = d_out + index * width;
        for (size_t column = 0; column < width; ++column) target[column] += source[column];
    }
    return uform_status_success_k;
}

/** pooled (segments, hidden) = mean of each segment's rows of states (tokens, hidden); empty ones pool to zero. */
uform_status_t uform_ram_pool_forward(void* context, float* pooled, void const* states_, uform_items_t const* items,
                                      size_t hidden) {
    float const* states = states_;
    uform_segment_t const* segments = items->segments;
    size_t segments_count = items->count;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t segment = 0; segment < segments_count; ++segment) {
        float* restrict mean = pooled + segment * hidden;
        size_t start = segments[segment].start, length = segments[segment].length;
        memset(mean, 0, hidden * sizeof(float));
        for (size_t token = start; token < start + length; ++token) {
            float const* restrict row = states + token * hidden;
            for (size_t column = 0; column < hidden; ++column) mean[column] += row[column];
        }
        float inverse = length ? 1.0f / (float)length : 0.0f;
        for (size_t column = 0; column < hidden; ++column) mean[column] *= inverse;
    }
    return uform_status_success_k;
}

/** d_states (tokens, hidden) += d_pooled (segments, hidden) / length over each segment's rows. */
uform_status_t uform_ram_pool_backward(void* context, void* d_states_, float const* d_pooled,
                                       uform_items_t const* items, size_t hidden) {
    float* d_states = d_states_;
    uform_segment_t const* segments = items->segments;
    size_t segments_count = items->count;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t segment = 0; segment < segments_count; ++segment) {
        float const* restrict gradient = d_pooled + segment * hidden;
        size_t start = segments[segment].start, length = segments[segment].length;
        float inverse = length ? 1.0f / (float)length : 0.0f;
        for (size_t token = start; token < start + length; ++token) {
            float* restrict row = d_states + token * hidden;
            for (size_t column = 0; column < hidden; ++column) row[column] += gradient[column] * inverse;
        }
    }
    return uform_status_success_k;
}
