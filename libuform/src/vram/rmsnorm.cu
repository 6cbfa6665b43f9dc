/**
 *  @file   rmsnorm.cu
 *  @brief  out (tokens, hidden) = x * rstd * gain, rstd (tokens) = 1 / sqrt(mean(x^2) + 1e-6), and
 *          its adjoint. Twin of `ram/rmsnorm.c`.
 *
 *  Forward and the backward's d_x: one warp per token (8 per block). Each lane sums its columns
 *  (lane, lane + 32, ... or 8-wide vectors of them) in column order in float32, and the lanes'
 *  sums meet in a fixed butterfly of shuffles: the same bits run after run. bfloat16 is read
 *  into float32 and each written value is rounded once.
 *
 *  The gain's gradient sums over tokens: one block per (128 columns, 128 tokens) adds its tokens'
 *  float32 terms in order, in double as the CPU does, into a partial in the planned scratch; then
 *  one thread per column adds the partials in token-chunk order (in double) and adds the sum,
 *  rounded to float, into d_gain. No atomics. A call past the plan's capacities, whose partials
 *  would not fit, computes the same chunks one after the other in each column's thread: slower,
 *  the same bits.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_rmsnorm_threads_k = 256;           /* 8 warps, 8 tokens a block */
constexpr unsigned uform_vram_rmsnorm_warps_k = uform_vram_rmsnorm_threads_k / 32;
constexpr unsigned uform_vram_rmsnorm_columns_k = 128;          /* columns (threads) of a partials block */
constexpr size_t uform_vram_rmsnorm_chunk_k = 128;              /* tokens of a partials block */

__device__ __forceinline__ float uform_vram_warp_sum(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
    return value;
}

__device__ __forceinline__ void uform_vram_gain8(float const* gain, size_t vector, float (&values)[8]) {
    float4 low = reinterpret_cast<float4 const*>(gain)[2 * vector];
    float4 high = reinterpret_cast<float4 const*>(gain)[2 * vector + 1];
    values[0] = low.x, values[1] = low.y, values[2] = low.z, values[3] = low.w;
    values[4] = high.x, values[5] = high.y, values[6] = high.z, values[7] = high.w;
}

/** `Vectors`: hidden % 8 == 0 and every pointer 16-byte aligned, so lanes move 8 columns at a time. */
template <bool Vectors>
__global__ void uform_vram_rmsnorm_forward_kernel(uform_bf16_t* __restrict__ out, float* __restrict__ rstd,
                                                  uform_bf16_t const* __restrict__ x, float const* __restrict__ gain,
                                                  size_t tokens, size_t hidden) {
    size_t token = (size_t)blockIdx.x * uform_vram_rmsnorm_warps_k + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    if (token >= tokens) return; /* whole warps leave together */
    uform_bf16_t const* row = x + token * hidden;
    uform_bf16_t* result = out + token * hidden;
    float squares = 0;
    if (Vectors) {
        size_t vectors = hidden / 8;
        uint4 const* row8 = reinterpret_cast<uint4 const*>(row);
        for (size_t vector = lane; vector < vectors; vector += 32) {
            float values[8];
            uform_vram_unpack8(row8[vector], values);
#pragma unroll
            for (int k = 0; k != 8; ++k) squares += values[k] * values[k];
        }
    } else {
        for (size_t column = lane; column < hidden; column += 32) {
            float value = __bfloat162float(row[column]);
            squares += value * value;
        }
    }
    squares = uform_vram_warp_sum(squares);
    float inverse = (float)(1.0 / sqrt((double)squares / (double)hidden + 1e-6));
    if (lane == 0) rstd[token] = inverse;
    if (Vectors) {
        size_t vectors = hidden / 8;
        uint4 const* row8 = reinterpret_cast<uint4 const*>(row);
        uint4* result8 = reinterpret_cast<uint4*>(result);
        for (size_t vector = lane; vector < vectors; vector += 32) {
            float values[8], gains[8];
            uform_vram_unpack8(row8[vector], values);
            uform_vram_gain8(gain, vector, gains);
#pragma unroll
            for (int k = 0; k != 8; ++k) values[k] = values[k] * inverse * gains[k];
            result8[vector] = uform_vram_pack8(values);
        }
    } else {
        for (size_t column = lane; column < hidden; column += 32)
            result[column] = __float2bfloat16_rn(__bfloat162float(row[column]) * inverse * gain[column]);
    }
}

/** d_x += rstd * (gain * d_out - x * rstd^2 * mean(gain * d_out * x)), one warp per token. */
template <bool Vectors>
__global__ void uform_vram_rmsnorm_backward_kernel(uform_bf16_t* __restrict__ d_x, uform_bf16_t const* __restrict__ d_out,
                                                   uform_bf16_t const* __restrict__ x, float const* __restrict__ gain,
                                                   float const* __restrict__ rstd, size_t tokens, size_t hidden) {
    size_t token = (size_t)blockIdx.x * uform_vram_rmsnorm_warps_k + threadIdx.x / 32;
    unsigned lane = threadIdx.x % 32;
    if (token >= tokens) return;
    uform_bf16_t const* row = x + token * hidden;
    uform_bf16_t const* gradient = d_out + token * hidden;
    uform_bf16_t* result = d_x + token * hidden;
    float projection = 0;
    if (Vectors) {
        size_t vectors = hidden / 8;
        for (size_t vector = lane; vector < vectors; vector += 32) {
            float values[8], gradients[8], gains[8];
            uform_vram_unpack8(reinterpret_cast<uint4 const*>(row)[vector], values);
            uform_vram_unpack8(reinterpret_cast<uint4 const*>(gradient)[vector], gradients);
            uform_vram_gain8(gain, vector, gains);
#pragma unroll
            for (int k = 0; k != 8; ++k) projection += gradients[k] * gains[k] * values[k];
        }
    } else {
        for (size_t column = lane; column < hidden; column += 32)
            projection += __bfloat162float(gradient[column]) * gain[column] * __bfloat162float(row[column]);
    }
    projection = uform_vram_warp_sum(projection);
    float inverse = rstd[token];
    float correction = (float)((double)projection / (double)hidden) * inverse * inverse;
    if (Vectors) {
        size_t vectors = hidden / 8;
        for (size_t vector = lane; vector < vectors; vector += 32) {
            float values[8], gradients[8], gains[8], sums[8];
            uform_vram_unpack8(reinterpret_cast<uint4 const*>(row)[vector], values);
            uform_vram_unpack8(reinterpret_cast<uint4 const*>(gradient)[vector], gradients);
            uform_vram_unpack8(reinterpret_cast<uint4 const*>(result)[vector], sums);
            uform_vram_gain8(gain, vector, gains);
#pragma unroll
            for (int k = 0; k != 8; ++k) sums[k] += inverse * (gains[k] * gradients[k] - values[k] * correction);
            reinterpret_cast<uint4*>(result)[vector] = uform_vram_pack8(sums);
        }
    } else {
        for (size_t column = lane; column < hidden; column += 32) {
            float sum = __bfloat162float(result[column]);
            sum += inverse * (gain[column] * __bfloat162float(gradient[column]) -
                              __bfloat162float(row[column]) * correction);
            result[column] = __float2bfloat16_rn(sum);
        }
    }
}

/** sum over the chunk's tokens, in order, of d_out * x * rstd at one column: each term in float32
 *  as the CPU rounds it, added in double. `__fmul_rn` keeps each term rounded before its addition
 *  (no fused multiply-add), so both kernels below that inline this get the same bits. */
__device__ __forceinline__ double uform_vram_rmsnorm_chunk(uform_bf16_t const* __restrict__ d_out,
                                                          uform_bf16_t const* __restrict__ x,
                                                          float const* __restrict__ rstd, size_t tokens, size_t hidden,
                                                          size_t column, size_t chunk) {
    size_t begin = chunk * uform_vram_rmsnorm_chunk_k;
    size_t end = begin + uform_vram_rmsnorm_chunk_k < tokens ? begin + uform_vram_rmsnorm_chunk_k : tokens;
    double sum = 0;
    size_t token = begin;
    /* Four independent loads in flight, then four additions in token order. */
    for (; token + 4 <= end; token += 4) {
        float terms[4];
#pragma unroll
        for (int k = 0; k != 4; ++k) {
            size_t at = (token + k) * hidden + column;
            terms[k] = __fmul_rn(__bfloat162float(d_out[at]) * __bfloat162float(x[at]), rstd[token + k]);
        }
#pragma unroll
        for (int k = 0; k != 4; ++k) sum += (double)terms[k];
    }
    for (; token < end; ++token) {
        size_t at = token * hidden + column;
        sum += (double)__fmul_rn(__bfloat162float(d_out[at]) * __bfloat162float(x[at]), rstd[token]);
    }
    return sum;
}

/** Grid (column chunks, token chunks): partials[chunk][column]. */
__global__ void uform_vram_rmsnorm_partials_kernel(double* __restrict__ partials, uform_bf16_t const* __restrict__ d_out,
                                                   uform_bf16_t const* __restrict__ x, float const* __restrict__ rstd,
                                                   size_t tokens, size_t hidden) {
    size_t column = (size_t)blockIdx.x * uform_vram_rmsnorm_columns_k + threadIdx.x;
    if (column >= hidden) return;
    partials[blockIdx.y * hidden + column] = uform_vram_rmsnorm_chunk(d_out, x, rstd, tokens, hidden, column, blockIdx.y);
}

/** d_gain[column] += the partials of every token chunk, added in chunk order in double. */
__global__ void uform_vram_rmsnorm_gain_kernel(float* __restrict__ d_gain, double const* __restrict__ partials,
                                               size_t chunks, size_t hidden) {
    size_t column = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (column >= hidden) return;
    double sum = 0;
    for (size_t chunk = 0; chunk != chunks; ++chunk) sum += partials[chunk * hidden + column];
    d_gain[column] += (float)sum;
}

/**
 *  The same sums for calls past the plan's capacities, where the partials would not fit in the
 *  scratch: each column's thread computes its chunks one after the other. Slower, same bits.
 */
__global__ void uform_vram_rmsnorm_gain_direct_kernel(float* __restrict__ d_gain, uform_bf16_t const* __restrict__ d_out,
                                                      uform_bf16_t const* __restrict__ x,
                                                      float const* __restrict__ rstd, size_t tokens, size_t hidden,
                                                      size_t chunks) {
    size_t column = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (column >= hidden) return;
    double sum = 0;
    for (size_t chunk = 0; chunk != chunks; ++chunk)
        sum += uform_vram_rmsnorm_chunk(d_out, x, rstd, tokens, hidden, column, chunk);
    d_gain[column] += (float)sum;
}

bool uform_vram_rmsnorm_aligned(void const* pointer) { return (uintptr_t)pointer % 16 == 0; }

} // namespace

size_t uform_vram_rmsnorm_scratch(uform_plan_t const* plan) {
    size_t chunks = (plan->tokens + uform_vram_rmsnorm_chunk_k - 1) / uform_vram_rmsnorm_chunk_k;
    return chunks * plan->hidden * sizeof(double);
}

uform_status_t uform_vram_rmsnorm_forward(void* context, void* out, float* rstd, void const* x, float const* gain,
                                          size_t tokens, size_t hidden) {
    if (!tokens || !hidden) return uform_status_success_k;
    size_t blocks = (tokens + uform_vram_rmsnorm_warps_k - 1) / uform_vram_rmsnorm_warps_k;
    if (blocks > 0x7FFFFFFFu)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "rmsnorm forward: %zu tokens", tokens);
    cudaStream_t stream = uform_vram(context)->stream;
    bool vectors = hidden % 8 == 0 && uform_vram_rmsnorm_aligned(out) && uform_vram_rmsnorm_aligned(x) &&
                   uform_vram_rmsnorm_aligned(gain);
    if (vectors)
        uform_vram_rmsnorm_forward_kernel<true><<<(unsigned)blocks, uform_vram_rmsnorm_threads_k, 0, stream>>>(
            (uform_bf16_t*)out, rstd, (uform_bf16_t const*)x, gain, tokens, hidden);
    else
        uform_vram_rmsnorm_forward_kernel<false><<<(unsigned)blocks, uform_vram_rmsnorm_threads_k, 0, stream>>>(
            (uform_bf16_t*)out, rstd, (uform_bf16_t const*)x, gain, tokens, hidden);
    return uform_vram_launched("uform_vram_rmsnorm_forward");
}

uform_status_t uform_vram_rmsnorm_backward(void* context, void* d_x, float* d_gain, void const* d_out, void const* x,
                                           float const* gain, float const* rstd, size_t tokens, size_t hidden) {
    if (!tokens || !hidden) return uform_status_success_k;
    uform_vram_context_t* vram = uform_vram(context);
    size_t blocks = (tokens + uform_vram_rmsnorm_warps_k - 1) / uform_vram_rmsnorm_warps_k;
    size_t chunks = (tokens + uform_vram_rmsnorm_chunk_k - 1) / uform_vram_rmsnorm_chunk_k;
    size_t column_blocks = (hidden + uform_vram_rmsnorm_columns_k - 1) / uform_vram_rmsnorm_columns_k;
    if (blocks > 0x7FFFFFFFu || column_blocks > 0x7FFFFFFFu)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "rmsnorm backward: %zu tokens of %zu", tokens,
                               hidden);
    cudaStream_t stream = vram->stream;
    bool vectors = hidden % 8 == 0 && uform_vram_rmsnorm_aligned(d_x) && uform_vram_rmsnorm_aligned(d_out) &&
                   uform_vram_rmsnorm_aligned(x) && uform_vram_rmsnorm_aligned(gain);
    if (vectors)
        uform_vram_rmsnorm_backward_kernel<true><<<(unsigned)blocks, uform_vram_rmsnorm_threads_k, 0, stream>>>(
            (uform_bf16_t*)d_x, (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, gain, rstd, tokens, hidden);
    else
        uform_vram_rmsnorm_backward_kernel<false><<<(unsigned)blocks, uform_vram_rmsnorm_threads_k, 0, stream>>>(
            (uform_bf16_t*)d_x, (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, gain, rstd, tokens, hidden);
    uform_status_t status = uform_vram_launched("uform_vram_rmsnorm_backward (d_x)");
    if (status != uform_status_success_k) return status;

    if (chunks > 65535 || chunks * hidden * sizeof(double) > vram->scratch_bytes[uform_vram_scratch_rmsnorm_k]) {
        uform_vram_rmsnorm_gain_direct_kernel<<<uform_vram_blocks(hidden, uform_vram_rmsnorm_columns_k),
                                                uform_vram_rmsnorm_columns_k, 0, stream>>>(
            d_gain, (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, rstd, tokens, hidden, chunks);
        return uform_vram_launched("uform_vram_rmsnorm_backward (gain, past the plan)");
    }
    double* partials = (double*)vram->scratch[uform_vram_scratch_rmsnorm_k];
    dim3 grid((unsigned)column_blocks, (unsigned)chunks);
    uform_vram_rmsnorm_partials_kernel<<<grid, uform_vram_rmsnorm_columns_k, 0, stream>>>(
        partials, (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, rstd, tokens, hidden);
    status = uform_vram_launched("uform_vram_rmsnorm_backward (gain partials)");
    if (status != uform_status_success_k) return status;
    uform_vram_rmsnorm_gain_kernel<<<uform_vram_blocks(hidden, 256), 256, 0, stream>>>(d_gain, partials, chunks,
                                                                                        hidden);
    return uform_vram_launched("uform_vram_rmsnorm_backward (gain)");
}
