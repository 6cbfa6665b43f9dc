/**
 *  @file   adamw.c
 *  @brief  One AdamW update of a flat tensor, and the sum of squares behind gradient clipping.
 */
#include "ram.h"

/**
 *  weights, gradients, first and second moments are all (count). `step` >= 1 counts this
 *  update, so the bias corrections 1 - beta^step never vanish. Weight decay is decoupled and
 *  scaled by the learning rate; the core passes 0 for tensors that do not decay.
 */
static void uform_ram_adamw_tensor(void* context, float* weights, float const* gradients, float* first, float* second,
                                   size_t count, float learning_rate, float beta1, float beta2, float epsilon,
                                   float weight_decay, float gradient_scale, uint64_t step) {
    float first_correction = (float)(1.0 / (1.0 - pow((double)beta1, (double)step)));
    float second_correction = (float)(1.0 / (1.0 - pow((double)beta2, (double)step)));
#pragma omp parallel for simd num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t index = 0; index < count; ++index) {
        float gradient = gradients[index] * gradient_scale;
        float mean = beta1 * first[index] + (1.0f - beta1) * gradient;
        float variance = beta2 * second[index] + (1.0f - beta2) * gradient * gradient;
        first[index] = mean;
        second[index] = variance;
        float update = (mean * first_correction) / (sqrtf(variance * second_correction) + epsilon);
        weights[index] -= learning_rate * (update + weight_decay * weights[index]);
    }
}

/**
 *  Sums 4096-element blocks in parallel, in double, and adds the blocks' sums in block order,
 *  a round of blocks at a time so the partial sums live on the stack.
 */
uform_status_t uform_ram_adamw(void* context, uform_update_t const* u) {
    int skip = uform_update_poisoned(u->scalars, u->terms) || (u->after && !*u->after);
    if (u->verdict) *u->verdict = !skip;
    if (skip) return uform_status_success_k;
    double norm = sqrt(u->scalars[uform_scalar_norm_squared_k]);
    float scale = norm > u->clip_norm ? (float)(u->clip_norm / norm) : 1.0f;
    uform_layout_t const* layout = ((uform_ram_context_t const*)context)->layout;
    for (size_t i = 0; i != layout->count; ++i) {
        uform_tensor_t const* tensor = &layout->tensors[i];
        size_t at = tensor->offset;
        uform_ram_adamw_tensor(context, u->weights + at, u->gradients + at, u->first + at, u->second + at,
                               tensor->rows * tensor->cols, u->learning_rate, u->beta1, u->beta2, u->epsilon,
                               tensor->decays ? u->weight_decay : 0, scale, u->step);
    }
    return uform_status_success_k;
}

uform_status_t uform_ram_sum_squares(void* context, double* sum, float const* x, size_t count) {
    enum { block = 4096, round = 1024 };
    double partials[round], total = 0;
    size_t blocks = (count + block - 1) / block;
    for (size_t first = 0; first < blocks; first += round) {
        size_t active = blocks - first < round ? blocks - first : round;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
        for (size_t index = 0; index < active; ++index) {
            size_t begin = (first + index) * block, end = begin + block < count ? begin + block : count;
            double sum = 0;
#pragma omp simd reduction(+ : sum)
            for (size_t element = begin; element < end; ++element) sum += (double)x[element] * x[element];
            partials[index] = sum;
        }
        for (size_t index = 0; index < active; ++index) total += partials[index];
    }
    *sum = total;
    return uform_status_success_k;
}
