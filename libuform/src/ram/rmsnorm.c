/**
 *  @file   rmsnorm.c
 *  @brief  out (tokens, hidden) = x * rstd * gain (hidden), rstd (tokens) = 1 / sqrt(mean(x^2) + 1e-6).
 */
#include "ram.h"

uform_status_t uform_ram_rmsnorm_forward(void* context, void* out_, float* rstd, void const* x_, float const* gain,
                                         size_t tokens, size_t hidden) {
    float* out = out_;
    float const* x = x_;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t token = 0; token < tokens; ++token) {
        float const* restrict row = x + token * hidden;
        float* restrict result = out + token * hidden;
        double squares = 0;
#pragma omp simd reduction(+ : squares)
        for (size_t column = 0; column < hidden; ++column) squares += (double)row[column] * row[column];
        float inverse = (float)(1.0 / sqrt(squares / (double)hidden + 1e-6));
        rstd[token] = inverse;
        for (size_t column = 0; column < hidden; ++column) result[column] = row[column] * inverse * gain[column];
    }
    return uform_status_success_k;
}

/**
 *  d_x += rstd * (gain * d_out - x * rstd^2 * mean(gain * d_out * x)); d_gain += sum over tokens
 *  of d_out * x * rstd. The gain's sum runs over tokens, so threads split its columns in whole
 *  cache lines and walk the tokens in order, keeping one order whatever the thread count.
 */
uform_status_t uform_ram_rmsnorm_backward(void* context, void* d_x_, float* d_gain, void const* d_out_, void const* x_,
                                          float const* gain, float const* rstd, size_t tokens, size_t hidden) {
    float* d_x = d_x_;
    float const *d_out = d_out_, *x = x_;
    int threads = uform_ram_threads(context);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t token = 0; token < tokens; ++token) {
        float const* restrict row = x + token * hidden;
        float const* restrict gradient = d_out + token * hidden;
        float* restrict result = d_x + token * hidden;
        double projection = 0;
#pragma omp simd reduction(+ : projection)
        for (size_t column = 0; column < hidden; ++column)
            projection += (double)gradient[column] * gain[column] * row[column];
        float inverse = rstd[token];
        float correction = (float)(projection / (double)hidden) * inverse * inverse;
        for (size_t column = 0; column < hidden; ++column)
            result[column] += inverse * (gain[column] * gradient[column] - row[column] * correction);
    }

    enum { line = 16 };
    size_t lines = (hidden + line - 1) / line;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t index = 0; index < lines; ++index) {
        size_t first = index * line, width = hidden - first < line ? hidden - first : line;
        double sums[line] = {0};
        for (size_t token = 0; token < tokens; ++token) {
            float const* restrict row = x + token * hidden + first;
            float const* restrict gradient = d_out + token * hidden + first;
            float inverse = rstd[token];
            for (size_t column = 0; column < width; ++column)
                sums[column] += (double)(gradient[column] * row[column] * inverse);
        }
        for (size_t column = 0; column < width; ++column) d_gain[first + column] += (float)sums[column];
    }
    return uform_status_success_k;
}
