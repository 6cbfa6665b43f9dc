/**
 *  @file   attention.cu
 *  @brief  The kernel behind `attention.cpp`: each item's length and where its rows start in the
 *          packed stream, in the form cuDNN's ragged attention reads, from the items' segments.
 */
#include "vram.h"

/* The item lengths and ragged offsets, from the items' segments on the device. */
static __global__ void uform_vram_attention_metadata_kernel(int32_t* lengths, int64_t* ragged_qkv, int64_t* ragged_o,
                                                     uform_segment_t const* segments, unsigned count, int64_t hidden) {
    uform_vram_chain();
    unsigned item = blockIdx.x * blockDim.x + threadIdx.x;
    if (item > count) return;
    uform_segment_t last = segments[count - 1];
    int64_t start = item < count ? (int64_t)segments[item].start : (int64_t)last.start + last.length;
    if (item < count) lengths[item] = (int32_t)segments[item].length;
    ragged_qkv[item] = start * 3 * hidden;
    ragged_o[item] = start * hidden;
}

uform_status_t uform_vram_attention_items(uform_vram_context_t* context, int32_t* lengths, int64_t* ragged_qkv,
                                         int64_t* ragged_o, uform_items_t const* items, size_t hidden) {
    unsigned count = (unsigned)items->count;
    uform_vram_launch(uform_vram_attention_metadata_kernel, uform_vram_blocks(count + 1, 256), 256, 0, context->stream,
        lengths, ragged_qkv, ragged_o, items->segments, count, (int64_t)hidden);
    return uform_vram_launched("uform_vram_attention_metadata_kernel");
}
