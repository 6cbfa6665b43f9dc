/**
 *  @file   embedding.c
 *  @brief  out (tokens, hidden) = table (vocabulary, hidden) [ids (tokens)], and its adjoint.
 */
#include "ram.h"

void uform_ram_embedding_forward(void* context, float* out, float const* table, uint32_t const* ids, size_t tokens,
                                 size_t hidden) {
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t token = 0; token < tokens; ++token)
        memcpy(out + token * hidden, table + (size_t)ids[token] * hidden, hidden * sizeof(float));
}

/**
 *  Many tokens share a vocabulary row, so threads split the columns, in whole cache lines, and
 *  each walks every token in order: each sum has one order whatever the thread count.
 */
void uform_ram_embedding_backward(void* context, float* d_table, float const* d_out, uint32_t const* ids,
                                  size_t tokens, size_t hidden, size_t vocabulary) {
    enum { line = 16 };
    size_t lines = (hidden + line - 1) / line;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < lines; ++index) {
        size_t first = index * line, last = first + line < hidden ? first + line : hidden;
        for (size_t token = 0; token < tokens; ++token) {
            if (ids[token] >= vocabulary) continue; /* never write outside the table */
            float* restrict row = d_table + (size_t)ids[token] * hidden;
            float const* restrict gradient = d_out + token * hidden;
            for (size_t column = first; column < last; ++column) row[column] += gradient[column];
        }
    }
}
