/**
 *  @file   patch_loss.c
 *  @brief  Masked reconstruction's mean squared error over predicted patches (count, width)
 *          against their targets, and its gradient, written. Each target row is the hidden token's
 *          values as decoded, normalized here over the row (`(v - mean) / sqrt(var + 1e-6)`, in
 *          double, each value rounded once to float32), so the host only copies them.
 */
#include "ram.h"

uform_status_t uform_ram_patch_loss(void* context, double* loss, void* d_predictions_, void const* predictions_,
                                    float const* targets, size_t count, size_t width, float scale) {
    float* d_predictions = d_predictions_;
    float const* predictions = predictions_;
    if (!count || !width) {
        *loss = NAN;
        return uform_status_success_k;
    }
    /* Rows run in parallel a round at a time, their sums added in row order: one order whatever the threads. */
    enum { round = 1024 };
    double sums[round], total = 0;
    float factor = (float)(2.0 * scale / ((double)count * (double)width));
    for (size_t first = 0; first < count; first += round) {
        size_t rows = count - first < round ? count - first : round;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
        for (size_t index = 0; index < rows; ++index) {
            size_t at = (first + index) * width;
            double mean, scale, sum = 0, squares = 0;
            for (size_t j = 0; j < width; ++j) sum += targets[at + j], squares += (double)targets[at + j] * targets[at + j];
            uform_patch_normalizer(sum, squares, width, &mean, &scale);
            sum = 0;
            for (size_t j = 0; j < width; ++j) {
                float difference = predictions[at + j] - (float)(((double)targets[at + j] - mean) * scale);
                sum += (double)difference * difference;
                d_predictions[at + j] = factor * difference;
            }
            sums[index] = sum;
        }
        for (size_t index = 0; index < rows; ++index) total += sums[index];
    }
    *loss = total / ((double)count * (double)width);
    return uform_status_success_k;
}
