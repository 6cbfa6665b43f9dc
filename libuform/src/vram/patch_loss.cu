/**
 *  @file   patch_loss.cu
 *  @brief  Masked reconstruction's mean squared error over predicted patches (count, width)
 *          against their targets, each row of the hidden token's values normalized over the row
 *          here (`uform_patch_normalizer`), into a device double, and its gradient, written. Twin of
 *          `ram/patch_loss.c`.
 *
 *  One warp per row (8 rows a block): lane l takes elements l, l + 32, ... It sums the row's
 *  values and their squares in double, the lanes meeting in a fixed butterfly, then keeps its sum
 *  of squared differences in float32; those meet the same way, the row's sum lands in double in
 *  the reduce scratch, and `uform_vram_mean_of_rows` adds the rows in a fixed order. No atomics.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_patch_threads_k = 256;
constexpr unsigned uform_vram_patch_rows_k = uform_vram_patch_threads_k / 32;

__global__ void uform_vram_patch_rows(double* __restrict__ sums, uform_bf16_t* d_predictions,
                                      uform_bf16_t const* predictions, float const* __restrict__ targets,
                                      size_t count, size_t width, float factor) {
    uform_vram_chain();
    size_t row = (size_t)blockIdx.x * uform_vram_patch_rows_k + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    if (row >= count) return; /* whole warps leave together */
    double values = 0, squares = 0, mean, scale;
    for (size_t j = lane; j < width; j += 32) {
        double value = targets[row * width + j];
        values += value, squares += value * value;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        values += __shfl_xor_sync(0xFFFFFFFFu, values, offset);
        squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
    }
    uform_patch_normalizer(values, squares, width, &mean, &scale);
    float sum = 0;
    for (size_t j = lane; j < width; j += 32) {
        size_t at = row * width + j;
        float difference = __bfloat162float(predictions[at]) - (float)(((double)targets[at] - mean) * scale);
        sum += difference * difference;
        d_predictions[at] = __float2bfloat16_rn(factor * difference);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
    if (lane == 0) sums[row] = sum;
}

__global__ void uform_vram_patch_empty(double* loss) {
    uform_vram_chain(); *loss = __longlong_as_double(0x7FF8000000000000ll); }

} // namespace

uform_status_t uform_vram_patch_loss(void* context, double* loss, void* d_predictions, void const* predictions,
                                     float const* targets, size_t count, size_t width, float scale) {
    uform_vram_context_t* vram = uform_vram(context);
    if (!count || !width) {
        uform_vram_launch(uform_vram_patch_empty, 1, 1, 0, vram->stream, loss);
        return uform_vram_launched("uform_vram_patch_loss (no rows)");
    }
    if (count * sizeof(double) > vram->scratch_bytes[uform_vram_scratch_reduce_k])
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "uform_vram_patch_loss: %zu rows are past the plan's %zu tokens", count, vram->plan.tokens);
    double divisor = (double)count * (double)width;
    double* sums = (double*)vram->scratch[uform_vram_scratch_reduce_k];
    size_t blocks = (count + uform_vram_patch_rows_k - 1) / uform_vram_patch_rows_k;
    uform_vram_launch(uform_vram_patch_rows, (unsigned)blocks, uform_vram_patch_threads_k, 0, vram->stream, sums,
        (uform_bf16_t*)d_predictions, (uform_bf16_t const*)predictions, targets, count, width,
        (float)(2.0 * scale / divisor));
    uform_status_t status = uform_vram_launched("uform_vram_patch_loss (rows)");
    return status == uform_status_success_k
               ? uform_vram_mean_of_rows(vram, loss, sums, count, divisor, "uform_vram_patch_loss (mean)")
               : status;
}
