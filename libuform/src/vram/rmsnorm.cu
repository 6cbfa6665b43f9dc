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
 *  The backward pass reads x and d_out once: the same kernel writes d_x and keeps each column's
 *  sum of the gain's terms. Its blocks (two a multiprocessor) stride over the tokens, each warp
 *  summing its tokens' terms in float, so a block adds its warps' sums (in double, as the CPU sums)
 *  once for the whole call rather than once per few tokens; a second kernel adds the blocks'
 *  partials in a fixed order into d_gain. No atomics, and the tokens each warp takes depend only
 *  on the token count and the GPU's multiprocessors: the same bits on the same GPU. Rows not in
 *  16-byte vectors, or calls past the plan whose partials would not fit, take a slower path: d_x
 *  as above, then one thread per column over every token in order, in double.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_rmsnorm_threads_k = 256;           /* 8 warps, a token each */
constexpr unsigned uform_vram_rmsnorm_warps_k = uform_vram_rmsnorm_threads_k / 32;
constexpr size_t uform_vram_rmsnorm_tile_k = 1024;              /* columns of one block of the fused backward */
constexpr unsigned uform_vram_rmsnorm_blocks_per_sm_k = 2;       /* the fused backward's grid, measured best */
constexpr size_t uform_vram_rmsnorm_most_blocks_k = 1024;        /* partials planned: 512 multiprocessors' worth */

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
    uform_vram_chain();
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
    uform_vram_chain();
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

/**
 *  The backward pass in one read of x and d_out, for rows in 8-wide vectors. A block takes one
 *  tile of up to 1024 columns (blockIdx.y); its warps take tokens warp, warp + every warp of the
 *  grid, and so on. For each token the warp sums the projection over the whole row, as the kernel
 *  above does, then writes its tile of d_x and adds to each of its lanes' columns' sum of the
 *  gain's terms d_out * x * rstd (each term rounded to float32 as the CPU rounds it; a warp's
 *  tokens added in float). The block's warps then add their sums in warp order, in double, into
 *  one partial per block and column. `Lanes`, the vectors each lane holds, is ceil(tile columns /
 *  256); a row of one tile (`Whole`) keeps its loads in registers between the two halves, a wider
 *  one reads its tile twice. Measured at 32768 tokens of 512 on an H200: 40 us, against 61 us
 *  when each block took 32 tokens and added its warps' sums for them alone.
 */
template <int Lanes, bool Whole>
__global__ __launch_bounds__(uform_vram_rmsnorm_threads_k, Lanes <= 2 ? 3 : 2) void uform_vram_rmsnorm_backward_fused_kernel(
    uform_bf16_t* __restrict__ d_x, double* __restrict__ partials, uform_bf16_t const* __restrict__ d_out,
    uform_bf16_t const* __restrict__ x, float const* __restrict__ gain, float const* __restrict__ rstd, unsigned tokens,
    unsigned hidden) {
    uform_vram_chain();
    __shared__ float warp_sums[uform_vram_rmsnorm_warps_k][Lanes * 256];
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned row_vectors = hidden / 8, tile = blockIdx.y * (unsigned)(uform_vram_rmsnorm_tile_k / 8);
    unsigned vectors = min(row_vectors - tile, (unsigned)(uform_vram_rmsnorm_tile_k / 8));
    float gains[Lanes][8], sums[Lanes][8];
#pragma unroll
    for (int v = 0; v != Lanes; ++v) {
#pragma unroll
        for (int k = 0; k != 8; ++k) sums[v][k] = 0, gains[v][k] = 0;
        if (lane + 32 * v < vectors) uform_vram_gain8(gain, tile + lane + 32 * v, gains[v]);
    }
    unsigned stride = gridDim.x * uform_vram_rmsnorm_warps_k;
    for (unsigned token = blockIdx.x * uform_vram_rmsnorm_warps_k + warp; token < tokens; token += stride) {
        uint4 const* row = reinterpret_cast<uint4 const*>(x) + (size_t)token * row_vectors;
        uint4 const* gradient = reinterpret_cast<uint4 const*>(d_out) + (size_t)token * row_vectors;
        uint4* result = reinterpret_cast<uint4*>(d_x) + (size_t)token * row_vectors + tile;
        uint4 row_bits[Lanes], gradient_bits[Lanes], results[Lanes]; /* every load of the tile in flight at once */
#pragma unroll
        for (int v = 0; v != Lanes; ++v)
            if (lane + 32 * v < vectors) {
                results[v] = result[lane + 32 * v];
                if (Whole) row_bits[v] = row[lane + 32 * v], gradient_bits[v] = gradient[lane + 32 * v];
            }
        float projection = 0;
        if (Whole) {
#pragma unroll
            for (int v = 0; v != Lanes; ++v) {
                if (lane + 32 * v >= vectors) break;
                float values[8], gradients[8];
                uform_vram_unpack8(row_bits[v], values);
                uform_vram_unpack8(gradient_bits[v], gradients);
#pragma unroll
                for (int k = 0; k != 8; ++k) projection += gradients[k] * gains[v][k] * values[k];
            }
        } else {
            for (unsigned vector = lane; vector < row_vectors; vector += 32) {
                float values[8], gradients[8], row_gains[8];
                uform_vram_unpack8(row[vector], values);
                uform_vram_unpack8(gradient[vector], gradients);
                uform_vram_gain8(gain, vector, row_gains);
#pragma unroll
                for (int k = 0; k != 8; ++k) projection += gradients[k] * row_gains[k] * values[k];
            }
        }
        projection = uform_vram_warp_sum(projection);
        float inverse = rstd[token];
        float correction = (float)((double)projection / (double)hidden) * inverse * inverse;
#pragma unroll
        for (int v = 0; v != Lanes; ++v) {
            unsigned vector = lane + 32 * v;
            if (vector >= vectors) break;
            if (!Whole) row_bits[v] = row[tile + vector], gradient_bits[v] = gradient[tile + vector];
            float values[8], gradients[8], accumulated[8];
            uform_vram_unpack8(row_bits[v], values);
            uform_vram_unpack8(gradient_bits[v], gradients);
            uform_vram_unpack8(results[v], accumulated);
#pragma unroll
            for (int k = 0; k != 8; ++k) {
                accumulated[k] += inverse * (gains[v][k] * gradients[k] - values[k] * correction);
                sums[v][k] += __fmul_rn(gradients[k] * values[k], inverse);
            }
            result[vector] = uform_vram_pack8(accumulated);
        }
    }
#pragma unroll
    for (int v = 0; v != Lanes; ++v) {
        unsigned vector = lane + 32 * v;
        if (vector >= vectors) break;
#pragma unroll
        for (int k = 0; k != 8; ++k) warp_sums[warp][vector * 8 + k] = sums[v][k];
    }
    __syncthreads();
    for (unsigned column = threadIdx.x; column < vectors * 8; column += blockDim.x) {
        double total = 0;
        for (unsigned w = 0; w != uform_vram_rmsnorm_warps_k; ++w) total += (double)warp_sums[w][column];
        partials[(size_t)blockIdx.x * hidden + tile * 8 + column] = total;
    }
}

constexpr unsigned uform_vram_rmsnorm_gain_columns_k = 8, uform_vram_rmsnorm_gain_slices_k = 64;

/** d_gain[column] += the blocks' partials: each of 64 slices adds every 64th block's, then the
 *  slices are added in order. Eight columns a block, so a 512-wide row spreads over 64 blocks. */
__global__ void uform_vram_rmsnorm_gain_kernel(float* __restrict__ d_gain, double const* __restrict__ partials,
                                               size_t blocks, size_t hidden) {
    uform_vram_chain();
    __shared__ double slices[uform_vram_rmsnorm_gain_slices_k][uform_vram_rmsnorm_gain_columns_k];
    size_t column = (size_t)blockIdx.x * uform_vram_rmsnorm_gain_columns_k + threadIdx.x;
    double sum = 0;
    if (column < hidden)
        for (size_t block = threadIdx.y; block < blocks; block += uform_vram_rmsnorm_gain_slices_k)
            sum += partials[block * hidden + column];
    slices[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y || column >= hidden) return;
    double total = 0;
    for (unsigned slice = 0; slice != uform_vram_rmsnorm_gain_slices_k; ++slice) total += slices[slice][threadIdx.x];
    d_gain[column] += (float)total;
}

/** The gain's gradient where the fused kernel does not apply (rows not in 16-byte vectors, or
 *  past the plan): one thread per column, its tokens in order, in double. */
__global__ void uform_vram_rmsnorm_gain_direct_kernel(float* __restrict__ d_gain, uform_bf16_t const* __restrict__ d_out,
                                                      uform_bf16_t const* __restrict__ x,
                                                      float const* __restrict__ rstd, size_t tokens, size_t hidden) {
    uform_vram_chain();
    size_t column = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (column >= hidden) return;
    double sum = 0;
    for (size_t token = 0; token != tokens; ++token) {
        size_t at = token * hidden + column;
        sum += (double)__fmul_rn(__bfloat162float(d_out[at]) * __bfloat162float(x[at]), rstd[token]);
    }
    d_gain[column] += (float)sum;
}

bool uform_vram_rmsnorm_aligned(void const* pointer) { return (uintptr_t)pointer % 16 == 0; }

} // namespace

/** The fused backward's grid: two blocks a multiprocessor, no more than its tokens fill or its partials fit. */
static size_t uform_vram_rmsnorm_blocks(size_t tokens, size_t multiprocessors, size_t most) {
    size_t blocks = (tokens + uform_vram_rmsnorm_warps_k - 1) / uform_vram_rmsnorm_warps_k;
    size_t grid = (multiprocessors ? multiprocessors : 1) * uform_vram_rmsnorm_blocks_per_sm_k;
    return blocks < grid ? (blocks < most ? blocks : most) : (grid < most ? grid : most);
}

size_t uform_vram_rmsnorm_scratch(uform_plan_t const* plan) {
    size_t blocks = uform_vram_rmsnorm_blocks(plan->tokens, uform_vram_rmsnorm_most_blocks_k, uform_vram_rmsnorm_most_blocks_k);
    return blocks * plan->hidden * sizeof(double);
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
        uform_vram_launch(uform_vram_rmsnorm_forward_kernel<true>, (unsigned)blocks, uform_vram_rmsnorm_threads_k, 0,
            stream, (uform_bf16_t*)out, rstd, (uform_bf16_t const*)x, gain, tokens, hidden);
    else
        uform_vram_launch(uform_vram_rmsnorm_forward_kernel<false>, (unsigned)blocks, uform_vram_rmsnorm_threads_k, 0,
            stream, (uform_bf16_t*)out, rstd, (uform_bf16_t const*)x, gain, tokens, hidden);
    return uform_vram_launched("uform_vram_rmsnorm_forward");
}

uform_status_t uform_vram_rmsnorm_backward(void* context, void* d_x, float* d_gain, void const* d_out, void const* x,
                                           float const* gain, float const* rstd, size_t tokens, size_t hidden) {
    if (!tokens || !hidden) return uform_status_success_k;
    uform_vram_context_t* vram = uform_vram(context);
    size_t blocks = (tokens + uform_vram_rmsnorm_warps_k - 1) / uform_vram_rmsnorm_warps_k;
    size_t most = vram->scratch_bytes[uform_vram_scratch_rmsnorm_k] / (hidden * sizeof(double));
    size_t fused_blocks = uform_vram_rmsnorm_blocks(tokens, (size_t)vram->multiprocessors, most);
    if (blocks > 0x7FFFFFFFu)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "rmsnorm backward: %zu tokens of %zu", tokens,
                               hidden);
    cudaStream_t stream = vram->stream;
    bool vectors = hidden % 8 == 0 && uform_vram_rmsnorm_aligned(d_x) && uform_vram_rmsnorm_aligned(d_out) &&
                   uform_vram_rmsnorm_aligned(x) && uform_vram_rmsnorm_aligned(gain);
    size_t tiles = (hidden + uform_vram_rmsnorm_tile_k - 1) / uform_vram_rmsnorm_tile_k;
    bool fused = vectors && tokens <= 0xFFFFFFFFu && fused_blocks != 0;
    if (fused) {
        double* partials = (double*)vram->scratch[uform_vram_scratch_rmsnorm_k];
        size_t widest = hidden < uform_vram_rmsnorm_tile_k ? hidden : uform_vram_rmsnorm_tile_k;
        unsigned lanes = (unsigned)((widest / 8 + 31) / 32);
        auto kernel = tiles > 1    ? uform_vram_rmsnorm_backward_fused_kernel<4, false>
                      : lanes == 1 ? uform_vram_rmsnorm_backward_fused_kernel<1, true>
                      : lanes == 2 ? uform_vram_rmsnorm_backward_fused_kernel<2, true>
                      : lanes == 3 ? uform_vram_rmsnorm_backward_fused_kernel<3, true>
                                   : uform_vram_rmsnorm_backward_fused_kernel<4, true>;
        uform_vram_launch(kernel, dim3((unsigned)fused_blocks, (unsigned)tiles), uform_vram_rmsnorm_threads_k, 0,
            stream, (uform_bf16_t*)d_x, partials, (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, gain, rstd,
            (unsigned)tokens, (unsigned)hidden);
        uform_status_t status = uform_vram_launched("uform_vram_rmsnorm_backward (fused)");
        if (status != uform_status_success_k) return status;
        uform_vram_launch(uform_vram_rmsnorm_gain_kernel, uform_vram_blocks(hidden, uform_vram_rmsnorm_gain_columns_k),
            dim3(uform_vram_rmsnorm_gain_columns_k, uform_vram_rmsnorm_gain_slices_k), 0, stream, d_gain, partials,
            fused_blocks, hidden);
        return uform_vram_launched("uform_vram_rmsnorm_backward (gain)");
    }
    if (vectors)
        uform_vram_launch(uform_vram_rmsnorm_backward_kernel<true>, (unsigned)blocks, uform_vram_rmsnorm_threads_k, 0,
            stream, (uform_bf16_t*)d_x, (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, gain, rstd, tokens, hidden);
    else
        uform_vram_launch(uform_vram_rmsnorm_backward_kernel<false>, (unsigned)blocks, uform_vram_rmsnorm_threads_k, 0,
            stream, (uform_bf16_t*)d_x, (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, gain, rstd, tokens, hidden);
    uform_status_t status = uform_vram_launched("uform_vram_rmsnorm_backward (d_x)");
    if (status != uform_status_success_k) return status;
    uform_vram_launch(uform_vram_rmsnorm_gain_direct_kernel, uform_vram_blocks(hidden, 128), 128, 0, stream, d_gain,
        (uform_bf16_t const*)d_out, (uform_bf16_t const*)x, rstd, tokens, hidden);
    return uform_vram_launched("uform_vram_rmsnorm_backward (gain, unfused)");
}
