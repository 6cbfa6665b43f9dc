/**
 *  @file   embedding.cu
 *  @brief  out (tokens, hidden) = table (vocabulary, hidden) [ids (tokens)], and its adjoint
 *          d_table += rows of d_out gathered by id. Twin of `ram/embedding.c`.
 *
 *  Forward: a grid-stride copy, one thread per 16 bytes (8 bfloat16) of an output row when the
 *  width and the pointers allow it, one element otherwise. A copy: exact.
 *
 *  Backward: one block per (id, 64 columns). An id's list of tokens (ascending token index) is cut
 *  into 16 contiguous slices, one per row of the block's threads: an id as common as the mask id
 *  (about 15 % of the tokens) would otherwise be one thread's long chain of dependent loads. Each
 *  thread adds its slice's tokens in order in float32; then the slices' sums are added in order
 *  onto the table's gradient, as the CPU adds the whole list. No two blocks share a column of the
 *  table, so the result is the same bits run after run. Ids with no tokens leave their row alone.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_embedding_threads_k = 256;
constexpr unsigned uform_vram_embedding_columns_k = 64;  /* columns of one backward block */
constexpr unsigned uform_vram_embedding_slices_k = 16;   /* slices of an id's list, one per row of its threads */

/** 16-byte copies: `vectors` = hidden / 8 per row. */
__global__ void uform_vram_embedding_forward_vectors(uint4* __restrict__ out, uint4 const* __restrict__ table,
                                                     uint32_t const* __restrict__ ids, size_t tokens, size_t vectors) {
    uform_vram_chain();
    size_t total = tokens * vectors, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < total; index += stride) {
        size_t token = index / vectors, vector = index - token * vectors;
        out[index] = table[(size_t)ids[token] * vectors + vector];
    }
}

__global__ void uform_vram_embedding_forward_scalars(uform_bf16_t* __restrict__ out,
                                                     uform_bf16_t const* __restrict__ table,
                                                     uint32_t const* __restrict__ ids, size_t tokens, size_t hidden) {
    uform_vram_chain();
    size_t total = tokens * hidden, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < total; index += stride) {
        size_t token = index / hidden, column = index - token * hidden;
        out[index] = table[(size_t)ids[token] * hidden + column];
    }
}

/** Grid (vocabulary, column chunks); the id's tokens are order[order_offsets[id] .. order_offsets[id + 1]). */
__global__ void uform_vram_embedding_backward_kernel(float* __restrict__ d_table, uform_bf16_t const* __restrict__ d_out,
                                                     uint32_t const* __restrict__ order,
                                                     uint32_t const* __restrict__ order_offsets, size_t hidden) {
    uform_vram_chain();
    __shared__ float slices[uform_vram_embedding_slices_k][uform_vram_embedding_columns_k];
    size_t id = blockIdx.x;
    size_t column = (size_t)blockIdx.y * uform_vram_embedding_columns_k + threadIdx.x;
    uint32_t begin = order_offsets[id], end = order_offsets[id + 1];
    if (begin >= end) return; /* the whole block: the id has no tokens */
    uint32_t share = (end - begin + uform_vram_embedding_slices_k - 1) / uform_vram_embedding_slices_k;
    uint32_t from = begin + share * threadIdx.y, to = from + share;
    from = from < end ? from : end, to = to < end ? to : end;
    float sum = 0;
    if (column < hidden) {
        uform_bf16_t const* column_base = d_out + column;
        uint32_t index = from;
        /* Sixteen independent loads in flight, then sixteen additions in list order. */
        for (; index + 16 <= to; index += 16) {
            float values[16];
#pragma unroll
            for (int k = 0; k != 16; ++k) values[k] = __bfloat162float(column_base[(size_t)order[index + k] * hidden]);
#pragma unroll
            for (int k = 0; k != 16; ++k) sum += values[k];
        }
        for (; index < to; ++index) sum += __bfloat162float(column_base[(size_t)order[index] * hidden]);
    }
    slices[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y || column >= hidden) return;
    float* row = d_table + id * hidden + column;
    float total = *row;
    for (unsigned slice = 0; slice != uform_vram_embedding_slices_k; ++slice) total += slices[slice][threadIdx.x];
    *row = total;
}

unsigned uform_vram_embedding_grid(void* context, size_t work) {
    size_t cap = (size_t)(uform_vram(context)->multiprocessors > 0 ? uform_vram(context)->multiprocessors : 1) * 16;
    size_t blocks = uform_vram_blocks(work, uform_vram_embedding_threads_k);
    return (unsigned)(blocks < cap ? blocks : cap);
}

} // namespace

uform_status_t uform_vram_embedding_forward(void* context, void* out, void const* table, uint32_t const* ids,
                                            size_t tokens, size_t hidden) {
    if (!tokens || !hidden) return uform_status_success_k;
    cudaStream_t stream = uform_vram(context)->stream;
    bool vectors = hidden % 8 == 0 && (uintptr_t)out % 16 == 0 && (uintptr_t)table % 16 == 0;
    if (vectors) {
        size_t per_row = hidden / 8;
        uform_vram_launch(uform_vram_embedding_forward_vectors, uform_vram_embedding_grid(context, tokens * per_row),
            uform_vram_embedding_threads_k, 0, stream, (uint4*)out, (uint4 const*)table, ids, tokens, per_row);
    } else {
        uform_vram_launch(uform_vram_embedding_forward_scalars, uform_vram_embedding_grid(context, tokens * hidden),
            uform_vram_embedding_threads_k, 0, stream, (uform_bf16_t*)out, (uform_bf16_t const*)table, ids, tokens,
            hidden);
    }
    return uform_vram_launched("uform_vram_embedding_forward");
}

uform_status_t uform_vram_embedding_backward(void* context, float* d_table, void const* d_out, uint32_t const* order,
                                             uint32_t const* order_offsets, size_t tokens, size_t hidden,
                                             size_t vocabulary) {
    if (!tokens || !hidden || !vocabulary) return uform_status_success_k;
    size_t chunks = (hidden + uform_vram_embedding_columns_k - 1) / uform_vram_embedding_columns_k;
    if (vocabulary > 0x7FFFFFFFu || chunks > 65535)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "embedding backward: vocabulary %zu or hidden %zu is too large", vocabulary, hidden);
    dim3 grid((unsigned)vocabulary, (unsigned)chunks);
    dim3 threads(uform_vram_embedding_columns_k, uform_vram_embedding_slices_k);
    uform_vram_launch(uform_vram_embedding_backward_kernel, grid, threads, 0, uform_vram(context)->stream, d_table,
        (uform_bf16_t const*)d_out, order, order_offsets, hidden);
    return uform_vram_launched("uform_vram_embedding_backward");
}
