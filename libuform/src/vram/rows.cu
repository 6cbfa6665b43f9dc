/**
 *  @file   rows.cu
 *  @brief  Moving whole rows: gathering chosen rows, scattering their gradients back, and
 *          mean-pooling each item's rows into one. Twin of `ram/rows.c`.
 *
 *  Gather and scatter: grid-stride loops, one thread per 8 bfloat16 (16 bytes) of a row when the
 *  width and the pointers allow it, one element otherwise. Rows are distinct, so each element of
 *  the output has one writer; scatter adds in float32 and rounds once.
 *
 *  Pool forward: one block per (item, 128 columns), one thread per column, adding the item's rows
 *  in token order in float32 and multiplying by 1 / length as the CPU does; empty items pool to
 *  zero. Pool backward: one block per (item, 128 columns, slice of 64 tokens); items never share
 *  a token, so every element has one writer. Both are the same bits run after run.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_rows_threads_k = 256;
constexpr unsigned uform_vram_rows_columns_k = 128; /* columns (threads) of a pooling block */
constexpr unsigned uform_vram_rows_slice_k = 64;    /* tokens of a pooling backward block */

/** out[i] = in[rows[i]], in units `T` of which a row holds `width`: uint4 (8 values) or one value. */
template <typename T>
__global__ void uform_vram_gather_kernel(T* __restrict__ out, T const* __restrict__ in, uint32_t const* __restrict__ rows,
                                         size_t count, size_t width) {
    uform_vram_chain();
    size_t total = count * width, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < total; index += stride) {
        size_t row = index / width, column = index - row * width;
        out[index] = in[(size_t)rows[row] * width + column];
    }
}

/** d_in[rows[i]] += d_out[i], 8 values at a time: `width` counts 16-byte vectors. */
__global__ void uform_vram_scatter_vectors(uint4* __restrict__ d_in, uint4 const* __restrict__ d_out,
                                           uint32_t const* __restrict__ rows, size_t count, size_t width) {
    uform_vram_chain();
    size_t total = count * width, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < total; index += stride) {
        size_t row = index / width, column = index - row * width;
        uint4* target = d_in + (size_t)rows[row] * width + column;
        float sums[8], values[8];
        uform_vram_unpack8(*target, sums);
        uform_vram_unpack8(d_out[index], values);
#pragma unroll
        for (int k = 0; k != 8; ++k) sums[k] += values[k];
        *target = uform_vram_pack8(sums);
    }
}

__global__ void uform_vram_scatter_scalars(uform_bf16_t* __restrict__ d_in, uform_bf16_t const* __restrict__ d_out,
                                           uint32_t const* __restrict__ rows, size_t count, size_t width) {
    uform_vram_chain();
    size_t total = count * width, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < total; index += stride) {
        size_t row = index / width, column = index - row * width;
        uform_bf16_t* target = d_in + (size_t)rows[row] * width + column;
        *target = __float2bfloat16_rn(__bfloat162float(*target) + __bfloat162float(d_out[index]));
    }
}

/** Grid (items, column chunks): pooled[item][column] = the mean of the item's rows, summed in token order. */
__global__ void uform_vram_pool_forward_kernel(float* __restrict__ pooled, uform_bf16_t const* __restrict__ states,
                                               uform_segment_t const* __restrict__ segments, size_t hidden) {
    uform_vram_chain();
    size_t item = blockIdx.x;
    size_t column = (size_t)blockIdx.y * uform_vram_rows_columns_k + threadIdx.x;
    if (column >= hidden) return;
    size_t start = segments[item].start, length = segments[item].length, end = start + length;
    uform_bf16_t const* column_base = states + column;
    float sum = 0;
    size_t token = start;
    /* Sixteen independent loads in flight (a long list is latency-bound), then sixteen additions in token order. */
    for (; token + 16 <= end; token += 16) {
        float values[16];
#pragma unroll
        for (int k = 0; k != 16; ++k) values[k] = __bfloat162float(column_base[(token + k) * hidden]);
#pragma unroll
        for (int k = 0; k != 16; ++k) sum += values[k];
    }
    for (; token < end; ++token) sum += __bfloat162float(column_base[token * hidden]);
    float inverse = length ? 1.0f / (float)length : 0.0f;
    pooled[item * hidden + column] = sum * inverse;
}

/** Grid (items, column chunks, token slices): d_states += d_pooled / length over the item's rows. */
__global__ void uform_vram_pool_backward_kernel(uform_bf16_t* __restrict__ d_states, float const* __restrict__ d_pooled,
                                                uform_segment_t const* __restrict__ segments, size_t hidden) {
    uform_vram_chain();
    size_t item = blockIdx.x;
    size_t column = (size_t)blockIdx.y * uform_vram_rows_columns_k + threadIdx.x;
    if (column >= hidden) return;
    size_t start = segments[item].start, length = segments[item].length;
    if (!length) return;
    float term = d_pooled[item * hidden + column] * (1.0f / (float)length);
    for (size_t offset = (size_t)blockIdx.z * uform_vram_rows_slice_k; offset < length;
         offset += (size_t)gridDim.z * uform_vram_rows_slice_k) {
        size_t end = offset + uform_vram_rows_slice_k < length ? offset + uform_vram_rows_slice_k : length;
        for (size_t token = offset; token < end; ++token) {
            uform_bf16_t* at = d_states + (start + token) * hidden + column;
            *at = __float2bfloat16_rn(__bfloat162float(*at) + term);
        }
    }
}

unsigned uform_vram_rows_grid(void* context, size_t work) {
    size_t cap = (size_t)(uform_vram(context)->multiprocessors > 0 ? uform_vram(context)->multiprocessors : 1) * 16;
    size_t blocks = uform_vram_blocks(work, uform_vram_rows_threads_k);
    return (unsigned)(blocks < cap ? blocks : cap);
}

bool uform_vram_rows_vectors(void const* a, void const* b, size_t width) {
    return width % 8 == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0;
}

} // namespace

uform_status_t uform_vram_gather_rows(void* context, void* out, void const* in, uint32_t const* rows, size_t count,
                                      size_t width) {
    if (!count || !width) return uform_status_success_k;
    cudaStream_t stream = uform_vram(context)->stream;
    if (uform_vram_rows_vectors(out, in, width))
        uform_vram_launch(uform_vram_gather_kernel<uint4>, uform_vram_rows_grid(context, count * (width / 8)),
            uform_vram_rows_threads_k, 0, stream, (uint4*)out, (uint4 const*)in, rows, count, width / 8);
    else
        uform_vram_launch(uform_vram_gather_kernel<uform_bf16_t>, uform_vram_rows_grid(context, count * width),
            uform_vram_rows_threads_k, 0, stream, (uform_bf16_t*)out, (uform_bf16_t const*)in, rows, count, width);
    return uform_vram_launched("uform_vram_gather_rows");
}

uform_status_t uform_vram_scatter_rows(void* context, void* d_in, void const* d_out, uint32_t const* rows,
                                       size_t count, size_t width) {
    if (!count || !width) return uform_status_success_k;
    cudaStream_t stream = uform_vram(context)->stream;
    if (uform_vram_rows_vectors(d_in, d_out, width))
        uform_vram_launch(uform_vram_scatter_vectors, uform_vram_rows_grid(context, count * (width / 8)),
            uform_vram_rows_threads_k, 0, stream, (uint4*)d_in, (uint4 const*)d_out, rows, count, width / 8);
    else
        uform_vram_launch(uform_vram_scatter_scalars, uform_vram_rows_grid(context, count * width),
            uform_vram_rows_threads_k, 0, stream, (uform_bf16_t*)d_in, (uform_bf16_t const*)d_out, rows, count, width);
    return uform_vram_launched("uform_vram_scatter_rows");
}

uform_status_t uform_vram_pool_forward(void* context, float* pooled, void const* states, uform_items_t const* items,
                                       size_t hidden) {
    if (!items->count || !hidden) return uform_status_success_k;
    size_t chunks = (hidden + uform_vram_rows_columns_k - 1) / uform_vram_rows_columns_k;
    if (items->count > 0x7FFFFFFFu || chunks > 65535)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "pool forward: %zu items of %zu", items->count,
                               hidden);
    dim3 grid((unsigned)items->count, (unsigned)chunks);
    uform_vram_launch(uform_vram_pool_forward_kernel, grid, uform_vram_rows_columns_k, 0, uform_vram(context)->stream,
        pooled, (uform_bf16_t const*)states, items->segments, hidden);
    return uform_vram_launched("uform_vram_pool_forward");
}

uform_status_t uform_vram_pool_backward(void* context, void* d_states, float const* d_pooled,
                                        uform_items_t const* items, size_t hidden) {
    if (!items->count || !hidden) return uform_status_success_k;
    size_t chunks = (hidden + uform_vram_rows_columns_k - 1) / uform_vram_rows_columns_k;
    if (items->count > 0x7FFFFFFFu || chunks > 65535)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "pool backward: %zu items of %zu", items->count,
                               hidden);
    /* Slices cover the longest item; the kernel's stride covers any longer one all the same. */
    size_t slices = (items->longest + uform_vram_rows_slice_k - 1) / uform_vram_rows_slice_k;
    slices = slices ? (slices < 65535 ? slices : 65535) : 1;
    dim3 grid((unsigned)items->count, (unsigned)chunks, (unsigned)slices);
    uform_vram_launch(uform_vram_pool_backward_kernel, grid, uform_vram_rows_columns_k, 0, uform_vram(context)->stream,
        (uform_bf16_t*)d_states, d_pooled, items->segments, hidden);
    return uform_vram_launched("uform_vram_pool_backward");
}
