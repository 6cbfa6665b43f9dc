/**
 *  @file   rows.c
 *  @brief  Moving whole rows: gathering chosen rows, scattering their gradients back, and
 *          mean-pooling each segment's rows into one.
 */
#include "ram.h"

/** out (count, width) = in [rows (count)] */
void uform_ram_gather_rows(void* context, float* out, float const* in, uint32_t const* rows, size_t count,
                           size_t width) {
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < count; ++index)
        memcpy(out + index * width, in + (size_t)rows[index] * width, width * sizeof(float));
}

/** d_in [rows (count)] += d_out (count, width); rows are distinct, so threads never share one. */
void uform_ram_scatter_rows(void* context, float* d_in, float const* d_out, uint32_t const* rows, size_t count,
                            size_t width) {
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < count; ++index) {
        float* restrict target = d_in + (size_t)rows[index] * width;
        float const* restrict source = d_out + index * width;
        for (size_t column = 0; column < width; ++column) target[column] += source[column];
    }
}

/** pooled (segments, hidden) = mean of each segment's rows of states (tokens, hidden); empty ones pool to zero. */
void uform_ram_pool_forward(void* context, float* pooled, float const* states, uform_segment_t const* segments,
                            size_t segments_count, size_t hidden) {
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
}

/** d_states (tokens, hidden) += d_pooled (segments, hidden) / length over each segment's rows. */
void uform_ram_pool_backward(void* context, float* d_states, float const* d_pooled, uform_segment_t const* segments,
                             size_t segments_count, size_t hidden) {
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
}
