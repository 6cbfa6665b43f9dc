/**
 *  @file   cross_entropy.cu
 *  @brief  Mean cross-entropy of logits (count, classes) against targets (count) into a device
 *          double, and d_logits (count, classes) = scale (softmax - one-hot) / count, written.
 *          Twin of `ram/cross_entropy.c`.
 *
 *  One warp per row (8 rows a block): lane l takes classes l, l + 32, ...; the row's maximum and
 *  its sum of exponentials (float32, each lane in class order) meet in a fixed butterfly of
 *  shuffles. The row's loss, max + log(sum) - logit[target], goes in double into the reduce
 *  scratch; a second kernel, one block of 1024 threads, adds the rows in a fixed order (thread t
 *  takes rows t, t + 1024, ... in order, then a fixed tree) and writes the mean. No atomics: the
 *  same bits run after run. A call past the plan's capacities, whose row losses would not fit in
 *  the scratch, runs both steps in one block in the same order: slower, the same bits. With no
 *  rows the loss is NaN and nothing else is touched.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_cross_entropy_threads_k = 256; /* 8 warps, 8 rows a block */
constexpr unsigned uform_vram_cross_entropy_rows_k = uform_vram_cross_entropy_threads_k / 32;
constexpr unsigned uform_vram_reduce_threads_k = 1024;

/**
 *  One row, by one whole warp: writes its gradient and returns its loss (in every lane). Each lane
 *  has read all its logits before any gradient lands, and lanes touch their own classes only, so
 *  d_logits may share memory with logits.
 */
__device__ __forceinline__ double uform_vram_cross_entropy_row(uform_bf16_t* d_logits, uform_bf16_t const* logits,
                                                               uint32_t const* __restrict__ targets, size_t row,
                                                               size_t classes, float factor, unsigned lane) {
    uform_bf16_t const* logit = logits + row * classes;
    uform_bf16_t* gradient = d_logits + row * classes;
    size_t target = targets[row];
    float target_logit = __bfloat162float(logit[target]);

    float largest = -INFINITY;
    for (size_t c = lane; c < classes; c += 32) largest = fmaxf(largest, __bfloat162float(logit[c]));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xFFFFFFFFu, largest, offset));

    float sum = 0;
    for (size_t c = lane; c < classes; c += 32) sum += expf(__bfloat162float(logit[c]) - largest);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);

    double loss = (double)largest + log((double)sum) - (double)target_logit;
    __syncwarp(); /* the target's logit is read by every lane before any gradient lands */
    float normalizer = (float)((double)factor / (double)sum);
    for (size_t c = lane; c < classes; c += 32) {
        float value = expf(__bfloat162float(logit[c]) - largest) * normalizer;
        if (c == target) value -= factor;
        gradient[c] = __float2bfloat16_rn(value);
    }
    return loss;
}

/**
 *  The last step of a 1024-thread block: thread t holds the sum of rows t, t + 1024, ... in order;
 *  warps add theirs by a butterfly of shuffles, then warp 0 adds the 32 warps' sums the same way.
 */
__device__ __forceinline__ double uform_vram_cross_entropy_total(double sum) {
    __shared__ double warps[uform_vram_reduce_threads_k / 32];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = sum;
    __syncthreads();
    sum = threadIdx.x < 32 ? warps[threadIdx.x] : 0.0;
    if (threadIdx.x < 32) {
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
    }
    return sum; /* valid in thread 0 */
}

/** One warp per row: the gradient, and the row's loss into losses[row]. */
__global__ void uform_vram_cross_entropy_rows(double* __restrict__ losses, uform_bf16_t* d_logits,
                                              uform_bf16_t const* logits, uint32_t const* __restrict__ targets,
                                              size_t count, size_t classes, float factor) {
    uform_vram_chain();
    size_t row = (size_t)blockIdx.x * uform_vram_cross_entropy_rows_k + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    if (row >= count) return; /* whole warps leave together */
    double loss = uform_vram_cross_entropy_row(d_logits, logits, targets, row, classes, factor, lane);
    if (lane == 0) losses[row] = loss;
}

/** One block of 1024 threads: *loss = (the rows' losses added in the fixed order) / divisor. */
__global__ void __launch_bounds__(uform_vram_reduce_threads_k) uform_vram_cross_entropy_mean(double* __restrict__ loss, double const* __restrict__ losses,
                                              size_t count, double divisor) {
    uform_vram_chain();
    double sum = 0;
    for (size_t index = threadIdx.x; index < count; index += uform_vram_reduce_threads_k) sum += losses[index];
    sum = uform_vram_cross_entropy_total(sum);
    if (threadIdx.x == 0) *loss = sum / divisor;
}

/**
 *  Both steps in one block of 1024 threads, for calls past the plan's capacities whose row losses
 *  would not fit in the scratch: warp w takes rows 32 w .. 32 w + 31 of every 1024, and lane l
 *  keeps the sum of row 32 w + l of each, so thread t adds the same rows in the same order as in
 *  `uform_vram_cross_entropy_mean`. Slower, the same bits.
 */
__global__ void __launch_bounds__(uform_vram_reduce_threads_k) uform_vram_cross_entropy_alone(double* __restrict__ loss, uform_bf16_t* d_logits,
                                               uform_bf16_t const* logits, uint32_t const* __restrict__ targets,
                                               size_t count, size_t classes, float factor) {
    uform_vram_chain();
    unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    double sum = 0;
    for (size_t base = 32 * (size_t)warp; base < count; base += uform_vram_reduce_threads_k)
        for (unsigned offset = 0; offset != 32 && base + offset < count; ++offset) {
            double row_loss = uform_vram_cross_entropy_row(d_logits, logits, targets, base + offset, classes, factor, lane);
            if (lane == offset) sum += row_loss;
        }
    sum = uform_vram_cross_entropy_total(sum);
    if (threadIdx.x == 0) *loss = sum / (double)count;
}

__global__ void uform_vram_cross_entropy_empty(double* loss) {
    uform_vram_chain(); *loss = __longlong_as_double(0x7FF8000000000000ll); }

} // namespace

size_t uform_vram_reduce_scratch(uform_plan_t const* plan) {
    /* adamw.cu's sum of squares: one double per 4096 floats of the layout (its block), see there. */
    size_t rows = plan->tokens;
    size_t partials = plan->layout ? (plan->layout->total + 4095) / 4096 : 0;
    return (rows > partials ? rows : partials) * sizeof(double);
}

uform_status_t uform_vram_cross_entropy(void* context, double* loss, void* d_logits, void const* logits,
                                        uint32_t const* targets, size_t count, size_t classes, float scale) {
    uform_vram_context_t* vram = uform_vram(context);
    if (!count || !classes) {
        uform_vram_launch(uform_vram_cross_entropy_empty, 1, 1, 0, vram->stream, loss);
        return uform_vram_launched("uform_vram_cross_entropy (no rows)");
    }
    float factor = (float)((double)scale / (double)count);
    size_t blocks = (count + uform_vram_cross_entropy_rows_k - 1) / uform_vram_cross_entropy_rows_k;
    if (blocks > 0x7FFFFFFFu || count * sizeof(double) > vram->scratch_bytes[uform_vram_scratch_reduce_k]) {
        uform_vram_launch(uform_vram_cross_entropy_alone, 1, uform_vram_reduce_threads_k, 0, vram->stream, loss,
            (uform_bf16_t*)d_logits, (uform_bf16_t const*)logits, targets, count, classes, factor);
        return uform_vram_launched("uform_vram_cross_entropy (past the plan)");
    }
    double* losses = (double*)vram->scratch[uform_vram_scratch_reduce_k];
    uform_vram_launch(uform_vram_cross_entropy_rows, (unsigned)blocks, uform_vram_cross_entropy_threads_k, 0,
        vram->stream, losses, (uform_bf16_t*)d_logits, (uform_bf16_t const*)logits, targets, count, classes, factor);
    uform_status_t status = uform_vram_launched("uform_vram_cross_entropy (rows)");
    if (status != uform_status_success_k) return status;
    return uform_vram_mean_of_rows(vram, loss, losses, count, (double)count, "uform_vram_cross_entropy (mean)");
}

uform_status_t uform_vram_mean_of_rows(uform_vram_context_t* context, double* loss, double const* losses, size_t count,
                                       double divisor, char const* name) {
    uform_vram_launch(uform_vram_cross_entropy_mean, 1, uform_vram_reduce_threads_k, 0, context->stream, loss, losses,
        count, divisor);
    return uform_vram_launched(name);
}
