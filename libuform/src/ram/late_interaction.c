/**
 *  @file   late_interaction.c
 *  @brief  The late-interaction term (SPEC section 5): MaxSim scores of each query against the
 *          documents it names, the pair loss over each query's row, and the gradient of the unit
 *          token vectors. Twin of `vram/late_interaction.cu`.
 *
 *  S(q, d) = sum over q's rows t of max over d's rows u of <q_t, d_u>; the first largest wins a
 *  tie, in the forward pass and the backward alike, so the gradient flows to one row u per t.
 *  Query rows run one after another and each adds into d_vectors in a fixed order: the same bits
 *  whatever the thread count. All dot products and sums in double.
 */
#include <stdlib.h>
#include <string.h>

#include "ram.h"

static double uform_ram_dot(float const* a, float const* b, size_t width) {
    double dot = 0;
    for (size_t column = 0; column < width; ++column) dot += (double)a[column] * b[column];
    return dot;
}

/* The row of `document` nearest to `query_row`, and their dot product. */
static size_t uform_ram_nearest(float const* vectors, float const* query_row, uform_span_t document, size_t width,
                                double* best) {
    size_t nearest = document.start;
    *best = -INFINITY;
    for (size_t u = document.start; u < (size_t)document.start + document.length; ++u) {
        double dot = uform_ram_dot(query_row, vectors + u * width, width);
        if (dot > *best) *best = dot, nearest = u;
    }
    return nearest;
}

uform_status_t uform_ram_late_interaction(void* context, double* loss, float* d_vectors, float* d_log_inverse_temperature,
                                          float* d_bias, float const* vectors, size_t rows, size_t width,
                                          float const* log_inverse_temperature, float const* bias,
                                          uform_late_interaction_setup_t const* setup, float scale) {
    (void)context;
    memset(d_vectors, 0, rows * width * sizeof(float));
    uform_span_t const* spans = setup->spans;
    size_t count = setup->count, longest = 0, counting = 0;
    for (size_t r = 0; r != count; ++r) {
        size_t named = setup->offsets[r + 1] - setup->offsets[r];
        longest = named > longest ? named : longest;
        double attract = 0, repel = 0;
        for (size_t j = setup->offsets[r]; j != setup->offsets[r + 1]; ++j)
            *(setup->cells[j] == uform_cell_attract_k ? &attract : &repel) += setup->weights[j];
        counting += (size_t)uform_row_counts(setup->form, attract, repel);
    }
    if (!counting) {
        *loss = NAN;
        return uform_status_success_k;
    }
    /* One row's scores and their gradients, and the ranked form's lists. */
    double* scores = malloc(longest * 2 * sizeof(double) + longest * 2 * sizeof(uint32_t) + 1);
    if (!scores)
        return uform_fail(NULL, uform_status_out_of_memory_k, "late interaction: no memory for a row of %zu documents",
                          longest);
    double* gradient = scores + longest;
    uint32_t* lists = (uint32_t*)(gradient + longest);
    double temperature = exp((double)log_inverse_temperature[0]), coefficient = (double)scale / (double)counting;
    double total = 0, d_temperature = 0, d_bias_sum = 0;
    for (size_t r = 0; r != count; ++r) {
        uint32_t first = setup->offsets[r];
        size_t named = setup->offsets[r + 1] - first;
        double attract = 0, repel = 0;
        for (size_t j = 0; j != named; ++j)
            *(setup->cells[first + j] == uform_cell_attract_k ? &attract : &repel) += setup->weights[first + j];
        if (!uform_row_counts(setup->form, attract, repel)) continue;
        uform_span_t query = spans[setup->queries[r]];
        for (size_t j = 0; j != named; ++j) {
            double sum = 0, best;
            for (size_t t = query.start; t < (size_t)query.start + query.length; ++t)
                uform_ram_nearest(vectors, vectors + t * width, spans[setup->documents[first + j]], width, &best),
                    sum += best;
            scores[j] = sum;
            gradient[j] = 0;
        }
        total += uform_ram_pair_row(setup->form, scores, gradient, setup->cells + first, setup->weights + first, named,
                                    temperature, (double)bias[0], attract, repel, lists);
        for (size_t j = 0; j != named; ++j) {
            d_temperature += gradient[j] * temperature * scores[j]; /* ds / dlog t = t S */
            d_bias_sum += gradient[j];
            double d_score = gradient[j] * coefficient * temperature;
            if (d_score == 0) continue;
            uform_span_t document = spans[setup->documents[first + j]];
            for (size_t t = query.start; t < (size_t)query.start + query.length; ++t) {
                double best;
                size_t u = uform_ram_nearest(vectors, vectors + t * width, document, width, &best);
                for (size_t column = 0; column < width; ++column) {
                    d_vectors[t * width + column] += (float)(d_score * vectors[u * width + column]);
                    d_vectors[u * width + column] += (float)(d_score * vectors[t * width + column]);
                }
            }
        }
    }
    free(scores);
    *loss = total / (double)counting;
    d_log_inverse_temperature[0] += (float)(coefficient * d_temperature);
    if (setup->form != uform_pair_loss_ranked_k) d_bias[0] += (float)(coefficient * d_bias_sum);
    return uform_status_success_k;
}
