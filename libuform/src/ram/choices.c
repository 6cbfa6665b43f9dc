/**
 *  @file   choices.c
 *  @brief  The choices term: a softmax over each row's offered bytes only, its probabilities, and
 *          the cross-entropy against the row's targets with its gradient. Twin of `vram/choices.cu`.
 *
 *  Rows are few (one per item that offers choices) and short (at most 256 bytes), so they run one
 *  after another, in row order: one order of addition, whatever the thread count.
 */
#include <string.h>

#include "ram.h"

uform_status_t uform_ram_choices(void* context, double* loss, void* d_logits_, float* probabilities,
                                 void const* logits_, uint32_t const* offsets, uint8_t const* choices,
                                 float const* targets, size_t count, float scale) {
    (void)context;
    float* d_logits = d_logits_;
    float const* logits = logits_;
    if (targets && !count) *loss = NAN;
    if (!count) return uform_status_success_k;
    float q[uform_bytes_k];
    double total = 0;
    float factor = (float)((double)scale / (double)count);
    for (size_t row = 0; row != count; ++row) {
        float const* logit = logits + row * uform_bytes_k;
        uint8_t const* offered = choices + offsets[row];
        size_t k = offsets[row + 1] - offsets[row];
        float largest = -INFINITY;
        for (size_t j = 0; j != k; ++j) largest = logit[offered[j]] > largest ? logit[offered[j]] : largest;
        double sum = 0;
        for (size_t j = 0; j != k; ++j) sum += q[j] = uform_ram_exp(logit[offered[j]] - largest);
        for (size_t j = 0; j != k; ++j) q[j] = (float)((double)q[j] / sum);
        if (probabilities) memcpy(probabilities + offsets[row], q, k * sizeof(float));
        if (!targets) continue;
        /* -sum t log q, with log q = logit - largest - log(sum); the targets sum to one within 1e-3. */
        float const* t = targets + offsets[row];
        double row_loss = 0, mass = 0;
        for (size_t j = 0; j != k; ++j)
            row_loss += (double)t[j] * (log(sum) - ((double)logit[offered[j]] - (double)largest)), mass += t[j];
        total += row_loss;
        float* gradient = d_logits + row * uform_bytes_k;
        memset(gradient, 0, uform_bytes_k * sizeof(float));
        for (size_t j = 0; j != k; ++j) gradient[offered[j]] = factor * (q[j] * (float)mass - t[j]);
    }
    if (targets) *loss = total / (double)count;
    return uform_status_success_k;
}
