/**
 *  @file   normalize.cu
 *  @brief  Rows scaled to unit length (the late-interaction token vectors), and the adjoint.
 *          Twin of `ram/normalize.c`.
 *
 *  One warp per row, 8 rows a block: each lane sums its columns (lane, lane + 32, ...) in order in
 *  float32 and the lanes meet in a fixed butterfly of shuffles. No atomics: the same bits run
 *  after run.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_normalize_threads_k = 256;
constexpr unsigned uform_vram_normalize_rows_k = uform_vram_normalize_threads_k / 32;

__device__ __forceinline__ float uform_vram_normalize_sum(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
    return value;
}

/** 1 / |row|, or 0 for a zero row, which then stays zero and passes no gradient. */
__device__ __forceinline__ float uform_vram_normalize_inverse(uform_bf16_t const* row, size_t width, unsigned lane) {
    float squares = 0;
    for (size_t column = lane; column < width; column += 32) {
        float value = __bfloat162float(row[column]);
        squares += value * value;
    }
    squares = uform_vram_normalize_sum(squares);
    return squares > 0 ? (float)(1.0 / sqrt((double)squares)) : 0.0f;
}

__global__ void uform_vram_normalize_forward_kernel(float* __restrict__ out, uform_bf16_t const* __restrict__ in,
                                                    size_t rows, size_t width) {
    uform_vram_chain();
    size_t row = (size_t)blockIdx.x * uform_vram_normalize_rows_k + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    if (row >= rows) return; /* whole warps leave together */
    uform_bf16_t const* values = in + row * width;
    float inverse = uform_vram_normalize_inverse(values, width, lane);
    for (size_t column = lane; column < width; column += 32)
        out[row * width + column] = __bfloat162float(values[column]) * inverse;
}

__global__ void uform_vram_normalize_backward_kernel(uform_bf16_t* __restrict__ d_in, float const* __restrict__ d_out,
                                                     float const* __restrict__ out, uform_bf16_t const* __restrict__ in,
                                                     size_t rows, size_t width) {
    uform_vram_chain();
    size_t row = (size_t)blockIdx.x * uform_vram_normalize_rows_k + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    if (row >= rows) return;
    float inverse = uform_vram_normalize_inverse(in + row * width, width, lane);
    float radial = 0;
    for (size_t column = lane; column < width; column += 32) radial += d_out[row * width + column] * out[row * width + column];
    radial = uform_vram_normalize_sum(radial);
    for (size_t column = lane; column < width; column += 32) {
        size_t at = row * width + column;
        d_in[at] = __float2bfloat16_rn((d_out[at] - radial * out[at]) * inverse);
    }
}

} // namespace

uform_status_t uform_vram_normalize_rows(void* context, float* out, void const* in, size_t rows, size_t width) {
    if (!rows || !width) return uform_status_success_k;
    size_t blocks = (rows + uform_vram_normalize_rows_k - 1) / uform_vram_normalize_rows_k;
    if (blocks > 0x7FFFFFFFu)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "normalize rows: %zu rows", rows);
    uform_vram_launch(uform_vram_normalize_forward_kernel, (unsigned)blocks, uform_vram_normalize_threads_k, 0,
        uform_vram(context)->stream, out, (uform_bf16_t const*)in, rows, width);
    return uform_vram_launched("uform_vram_normalize_rows");
}

uform_status_t uform_vram_normalize_rows_backward(void* context, void* d_in, float const* d_out, float const* out,
                                                  void const* in, size_t rows, size_t width) {
    if (!rows || !width) return uform_status_success_k;
    size_t blocks = (rows + uform_vram_normalize_rows_k - 1) / uform_vram_normalize_rows_k;
    if (blocks > 0x7FFFFFFFu)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "normalize rows backward: %zu rows", rows);
    uform_vram_launch(uform_vram_normalize_backward_kernel, (unsigned)blocks, uform_vram_normalize_threads_k, 0,
        uform_vram(context)->stream, (uform_bf16_t*)d_in, d_out, out, (uform_bf16_t const*)in, rows, width);
    return uform_vram_launched("uform_vram_normalize_rows_backward");
}
