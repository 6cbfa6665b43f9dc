/**
 *  @file   embedding.cu
 *  @brief  out (tokens, hidden) = table (vocabulary, hidden) [ids (tokens)], and its adjoint
 *          d_table += rows of d_out gathered by id. Twin of `ram/embedding.c`.
 *
 *  Forward: a grid-stride copy, one thread per 16 bytes (8 bfloat16) of an output row when the
 *  width and the pointers allow it, one element otherwise. A copy: exact.
 *
 *  Backward: one block per (id, 128 columns), one thread per column. Each thread starts from the
 *  table's gradient and adds its id's tokens in the core's list order (ascending token index),
 *  in float32, exactly as the CPU loop does; no two blocks share a column of the table, so the
 *  result is the same bits run after run. Ids with no tokens leave their row untouched.
 */
#include "vram.h"

namespace {

constexpr unsigned uform_vram_embedding_threads_k = 256;
constexpr unsigned uform_vram_embedding_columns_k = 128; /* columns (threads) of one backward block */

/** 16-byte copies: `vectors` = hidden / 8 per row. */
__global__ void uform_vram_embedding_forward_vectors(uint4* __restrict__ out, uint4 const* __restrict__ table,
                                                     uint32_t const* __restrict__ ids, size_t tokens, size_t vectors) {
    size_t total = tokens * vectors, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x; index < total; index += stride) {
        size_t token = index / vectors, vector = index - token * vectors;
        out[index] = table[(size_t)ids[token] * vectors + vector];
    }
}

__global__ void uform_vram_embedding_forward_scalars(uform_bf16_t* __restrict__ out,
                                                     uform_bf16_t const* __restrict__ table,
                                                     uint32_t const* __restrict__ ids, size_t tokens, size_t hidden) {
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
    size_t id = blockIdx.x;
    size_t column = (size_t)blockIdx.y * uform_vram_embedding_columns_k + threadIdx.x;
    uint32_t begin = order_offsets[id], end = order_offsets[id + 1];
    if (column >= hidden || begin >= end) return;
    float* row = d_table + id * hidden + column;
    float sum = *row;
    uform_bf16_t const* column_base = d_out + column;
    uint32_t index = begin;
    /* Sixteen independent loads in flight (a long list is latency-bound), then sixteen additions in list order. */
    for (; index + 16 <= end; index += 16) {
        float values[16];
#pragma unroll
        for (int k = 0; k != 16; ++k) values[k] = __bfloat162float(column_base[(size_t)order[index + k] * hidden]);
#pragma unroll
        for (int k = 0; k != 16; ++k) sum += values[k];
    }
    for (; index < end; ++index) sum += __bfloat162float(column_base[(size_t)order[index] * hidden]);
    *row = sum;
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
        uform_vram_embedding_forward_vectors<<<uform_vram_embedding_grid(context, tokens * per_row),
                                               uform_vram_embedding_threads_k, 0, stream>>>(
            (uint4*)out, (uint4 const*)table, ids, tokens, per_row);
    } else {
        uform_vram_embedding_forward_scalars<<<uform_vram_embedding_grid(context, tokens * hidden),
                                               uform_vram_embedding_threads_k, 0, stream>>>(
            (uform_bf16_t*)out, (uform_bf16_t const*)table, ids, tokens, hidden);
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
    uform_vram_embedding_backward_kernel<<<grid, uform_vram_embedding_columns_k, 0, uform_vram(context)->stream>>>(
        d_table, (uform_bf16_t const*)d_out, order, order_offsets, hidden);
    return uform_vram_launched("uform_vram_embedding_backward");
}
