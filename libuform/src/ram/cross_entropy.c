/**
 *  @file   cross_entropy.c
 *  @brief  Mean cross-entropy of logits (count, classes) against targets (count), and its
 *          gradient d_logits (count, classes) = scale (softmax - one-hot) / count, written.
 */
#include "ram.h"

uform_status_t uform_ram_cross_entropy(void* context, double* loss, void* d_logits_, void const* logits_,
                                       uint32_t const* targets, size_t count, size_t classes, float scale) {
    float* d_logits = d_logits_;
    float const* logits = logits_;
    if (!count) {
        *loss = NAN;
        return uform_status_success_k;
    }
    /* Rows run in parallel a round at a time and their losses are summed in row order after
     * each round: one order of addition whatever the thread count, and no allocation. */
    enum { round = 1024 };
    double losses[round], total = 0;
    float factor = (float)((double)scale / (double)count);
    for (size_t first = 0; first < count; first += round) {
        size_t rows = count - first < round ? count - first : round;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
        for (size_t index = 0; index < rows; ++index) {
            size_t row = first + index;
            float const* restrict logit = logits + row * classes;
            float* restrict gradient = d_logits + row * classes;
            float largest = logit[0];
#pragma omp simd reduction(max : largest)
            for (size_t class = 1; class < classes; ++class) largest = logit[class] > largest ? logit[class] : largest;
            double sum = 0;
#pragma omp simd reduction(+ : sum)
            for (size_t class = 0; class < classes; ++class) {
                gradient[class] = uform_ram_exp(logit[class] - largest);
                sum += gradient[class];
            }
            losses[index] = (double)largest + log(sum) - (double)logit[targets[row]];
            float normalizer = (float)((double)factor / sum);
            for (size_t class = 0; class < classes; ++class) gradient[class] *= normalizer;
            gradient[targets[row]] -= factor;
        }
        for (size_t index = 0; index < rows; ++index) total += losses[index];
    }
    *loss = total / (double)count;
    return uform_status_success_k;
}
