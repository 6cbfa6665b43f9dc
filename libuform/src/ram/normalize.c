/**
 *  @file   normalize.c
 *  @brief  Rows scaled to unit length (the late-interaction token vectors), and the adjoint.
 *          Twin of `vram/normalize.cu`. Each row in double, its own thread: the same bits whatever
 *          the thread count.
 */
#include "ram.h"

static double uform_ram_row_norm(float const* row, size_t width) {
    double squares = 0;
    for (size_t column = 0; column < width; ++column) squares += (double)row[column] * row[column];
    return sqrt(squares);
}

uform_status_t uform_ram_normalize_rows(void* context, float* out, void const* in_, size_t rows, size_t width) {
    float const* in = in_;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t row = 0; row < rows; ++row) {
        float const* values = in + row * width;
        double norm = uform_ram_row_norm(values, width), inverse = norm > 0 ? 1.0 / norm : 0.0;
        for (size_t column = 0; column < width; ++column) out[row * width + column] = (float)(values[column] * inverse);
    }
    return uform_status_success_k;
}

uform_status_t uform_ram_normalize_rows_backward(void* context, void* d_in_, float const* d_out, float const* out,
                                                 void const* in_, size_t rows, size_t width) {
    float* d_in = d_in_;
    float const* in = in_;
#pragma omp parallel for num_threads(uform_ram_threads(context)) schedule(static)
    for (size_t row = 0; row < rows; ++row) {
        float const *gradient = d_out + row * width, *unit = out + row * width;
        double norm = uform_ram_row_norm(in + row * width, width), inverse = norm > 0 ? 1.0 / norm : 0.0;
        double radial = 0;
        for (size_t column = 0; column < width; ++column) radial += (double)gradient[column] * unit[column];
        for (size_t column = 0; column < width; ++column)
            d_in[row * width + column] = (float)((gradient[column] - radial * unit[column]) * inverse);
    }
    return uform_status_success_k;
}
