/**
 *  @file   embedding.c
 *  @brief  out (tokens, hidden) = table (vocabulary, hidden) [ids (tokens)], and its adjoint.
 */
#include "ram.h"

uform_status_t uform_ram_embedding_forward(void* context, void* out, void const* table, uint32_t const* ids,
                                           size_t tokens, size_t hidden) {
    float* rows = out;
    float const* vectors = table;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t token = 0; token < tokens; ++token)
        memcpy(rows + token * hidden, vectors + (size_t)ids[token] * hidden, hidden * sizeof(float));
    return uform_status_success_k;
}

/**
 *  Threads split the vocabulary's rows; each row adds its tokens' gradients in the order the core
 *  listed them (ascending token index), whatever the thread count.
 */
uform_status_t uform_ram_embedding_backward(void* context, float* d_table, void const* d_out, uint32_t const* order,
                                            uint32_t const* order_offsets, size_t tokens, size_t hidden,
                                            size_t vocabulary) {
    float const* gradients = d_out;
    (void)tokens;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(dynamic, 4)
    for (size_t id = 0; id < vocabulary; ++id) {
        float* restrict row = d_table + id * hidden;
        for (uint32_t index = order_offsets[id]; index < order_offsets[id + 1]; ++index) {
            float const* restrict gradient = gradients + (size_t)order[index] * hidden;
            for (size_t column = 0; column < hidden; ++column) row[column] += gradient[column];
        }
    }
    return uform_status_success_k;
}
