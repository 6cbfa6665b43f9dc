/**
 *  @file   choices.cu
 *  @brief  The choices term: a softmax over each row's offered bytes only, its probabilities, and
 *          the cross-entropy against the row's targets with its gradient. Twin of `ram/choices.c`.
 *
 *  Rows are few (one per item that offers choices) and short (at most 256 bytes): one block of 32
 *  warps, warp w taking rows w, w + 32, ... in order and lane l the offered bytes l, l + 32, ...
 *  A row's maximum and sums meet in a fixed butterfly of shuffles; each warp adds its rows' losses
 *  in row order in double, and warp 0 adds the 32 warps' sums in warp order. No atomics, no
 *  scratch: the same bits run after run.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_choices_warps_k = 32;

__device__ __forceinline__ float uform_vram_choices_max(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
    return value;
}

template <typename scalar_t> __device__ __forceinline__ scalar_t uform_vram_choices_sum(scalar_t value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
    return value;
}

__global__ void __launch_bounds__(uform_vram_choices_warps_k * 32)
    uform_vram_choices_kernel(double* __restrict__ loss, uform_bf16_t* __restrict__ d_logits,
                              float* __restrict__ probabilities, uform_bf16_t const* __restrict__ logits,
                              uint32_t const* __restrict__ offsets, uint8_t const* __restrict__ choices,
                              float const* __restrict__ targets, size_t count, float factor) {
    uform_vram_chain();
    __shared__ double warp_losses[uform_vram_choices_warps_k];
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    double warp_loss = 0;
    for (size_t row = warp; row < count; row += uform_vram_choices_warps_k) {
        uform_bf16_t const* logit = logits + row * uform_bytes_k;
        uint32_t first = offsets[row], k = offsets[row + 1] - first;
        float largest = -INFINITY;
        for (uint32_t j = lane; j < k; j += 32) largest = fmaxf(largest, __bfloat162float(logit[choices[first + j]]));
        largest = uform_vram_choices_max(largest);
        float sum = 0;
        for (uint32_t j = lane; j < k; j += 32) sum += expf(__bfloat162float(logit[choices[first + j]]) - largest);
        sum = uform_vram_choices_sum(sum);
        if (probabilities)
            for (uint32_t j = lane; j < k; j += 32)
                probabilities[first + j] = expf(__bfloat162float(logit[choices[first + j]]) - largest) / sum;
        if (!targets) continue;
        /* -sum t log q, with log q = logit - largest - log(sum); the targets sum to one within 1e-3. */
        double row_loss = 0;
        float mass = 0;
        for (uint32_t j = lane; j < k; j += 32) {
            float target = targets[first + j];
            row_loss += (double)target * (log((double)sum) - ((double)__bfloat162float(logit[choices[first + j]]) -
                                                              (double)largest));
            mass += target;
        }
        row_loss = uform_vram_choices_sum(row_loss), mass = uform_vram_choices_sum(mass);
        warp_loss += row_loss;
        uform_bf16_t* gradient = d_logits + row * uform_bytes_k;
        for (unsigned c = lane; c < uform_bytes_k; c += 32) gradient[c] = __float2bfloat16_rn(0.0f);
        __syncwarp(); /* the zeros land before the offered bytes' gradients, which other lanes may write */
        for (uint32_t j = lane; j < k; j += 32) {
            float q = expf(__bfloat162float(logit[choices[first + j]]) - largest) / sum;
            gradient[choices[first + j]] = __float2bfloat16_rn(factor * (q * mass - targets[first + j]));
        }
    }
    if (!targets) return;
    if (lane == 0) warp_losses[warp] = warp_loss;
    __syncthreads();
    if (threadIdx.x != 0) return;
    double total = 0;
    for (unsigned w = 0; w != uform_vram_choices_warps_k; ++w) total += warp_losses[w];
    *loss = count ? total / (double)count : __longlong_as_double(0x7FF8000000000000ll);
}

} // namespace

uform_status_t uform_vram_choices(void* context, double* loss, void* d_logits, float* probabilities,
                                  void const* logits, uint32_t const* offsets, uint8_t const* choices,
                                  float const* targets, size_t count, float scale) {
    if (!count && !targets) return uform_status_success_k;
    float factor = count ? (float)((double)scale / (double)count) : 0.0f;
    uform_vram_launch(uform_vram_choices_kernel, 1, uform_vram_choices_warps_k * 32, 0, uform_vram(context)->stream,
        loss, (uform_bf16_t*)d_logits, probabilities, (uform_bf16_t const*)logits, offsets, choices, targets, count,
        factor);
    return uform_vram_launched("uform_vram_choices");
}
