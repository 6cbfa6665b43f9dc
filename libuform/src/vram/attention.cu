/**
 *  @file   attention.cu
 *  @brief  The device side of `attention.cpp`: on Hopper, the library's own attention
 *          (`attention_hopper.cuh`); elsewhere, the kernel that lays the items out for cuDNN's ragged
 *          attention (each item's length and where its rows start in the packed stream).
 */
#include <string.h>

#include "attention_hopper.cuh"
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

/* The attention's scratch: the kernels' unit counter, the backward pass's deltas, then the tokens' rotary cosines and
   sines, which each backward pass fills before it runs (fewer bytes than a pass over d q and d k, and right whatever
   ran before). */
static unsigned* uform_vram_attention_counter(uform_vram_context_t* context) {
    return (unsigned*)context->scratch[uform_vram_scratch_attention_k];
}

static float* uform_vram_attention_deltas(uform_vram_context_t* context) {
    return (float*)((char*)context->scratch[uform_vram_scratch_attention_k] + 256);
}

static size_t uform_vram_attention_deltas_bytes(uform_plan_t const* plan) {
    return (plan->heads * plan->tokens * sizeof(float) + 255) / 256 * 256;
}

static float2* uform_vram_attention_turns(uform_vram_context_t* context) {
    return (float2*)((char*)uform_vram_attention_deltas(context) + uform_vram_attention_deltas_bytes(&context->plan));
}

size_t uform_vram_attention_scratch(uform_plan_t const* plan) {
    return 256 + uform_vram_attention_deltas_bytes(plan) + plan->tokens * uform_head_width_k / 2 * sizeof(float2);
}

static_assert(sizeof(uform_segment_t) == 16, "the kernels read each item as 4 words: start, length, row, column");

void* uform_vram_hopper_attention(uform_vram_context_t* context) {
    /* UFORM_HOPPER_ATTENTION=0 keeps cuDNN's on Hopper too: to compare the two. */
    char const* wanted = getenv("UFORM_HOPPER_ATTENTION");
    if (!uform_hopper_ready(context->ordinal) || (wanted && !strcmp(wanted, "0"))) return nullptr;
    /* UFORM_ATTENTION_TURNS=0 has the forward's warpgroups issue their products without taking turns: to compare. */
    char const* turns = getenv("UFORM_ATTENTION_TURNS");
    context->attention_turns = !(turns && !strcmp(turns, "0"));
    /* The counter starts at zero, and every launch leaves it so. */
    if (cudaMemsetAsync(uform_vram_attention_counter(context), 0, 2 * sizeof(unsigned), context->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return nullptr;
    }
    return (void*)uform_hopper_encoder();
}

uform_status_t uform_vram_hopper_attention_forward(uform_vram_context_t* context, void* encoder, void* out,
                                                   float* statistics, void const* qkv, uform_items_t const* items,
                                                   size_t tokens, size_t hidden) {
    return uform_vram_check(uform_flash_forward((uform_hopper_encoder_t)encoder, context->multiprocessors, context->stream,
                                                uform_vram_dependent_launches, (uform_bf16_t*)out, statistics,
                                                (uform_bf16_t const*)qkv, (uint32_t const*)items->segments,
                                                items->count, items->longest, tokens, hidden, tokens,
                                                uform_vram_attention_counter(context), context->attention_turns),
                            "the attention's forward pass");
}

uform_status_t uform_vram_hopper_attention_backward(uform_vram_context_t* context, void* encoder, void* d_qkv,
                                                    void const* d_out, void const* out, float const* statistics,
                                                    void const* qkv, uint32_t const* positions, int same_positions,
                                                    uform_items_t const* items, size_t tokens, size_t hidden) {
    float2* turns = positions ? uform_vram_attention_turns(context) : nullptr;
    if (turns && !same_positions) UFORM_TRY(uform_vram_rope_turns(context, turns, positions, tokens));
    return uform_vram_check(uform_flash_backward((uform_hopper_encoder_t)encoder, context->multiprocessors, context->stream,
                                                 uform_vram_dependent_launches, (uform_bf16_t*)d_qkv,
                                                 uform_vram_attention_deltas(context),
                                                 (uform_bf16_t const*)d_out, (uform_bf16_t const*)out, statistics,
                                                 (uform_bf16_t const*)qkv, turns, (uint32_t const*)items->segments,
                                                 items->count, items->longest, tokens, hidden, tokens,
                                                 uform_vram_attention_counter(context)),
                            "the attention's backward pass");
}
