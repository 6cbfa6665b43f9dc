/**
 *  @file   model.c
 *  @brief  The model's sequence of operations on one replica, written once for every backend:
 *          forward over the packed tokens, the losses at the final-norm states, backward.
 *
 *  Each projection is one matrix product over all of the device's tokens; weights are stored
 *  (out, in), so a projection reads them transposed: y (tokens, out) = x (tokens, in) W^T.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define UFORM_ALLOCATE(pointer, count)                                                                                \
    do {                                                                                                              \
        (pointer) = backend->allocate(context, (size_t)(count) * sizeof(*(pointer)));                                 \
        if (!(pointer)) goto out_of_memory;                                                                           \
    } while (0)

uform_status_t uform_replica_init(uform_replica_t* replica, uform_executor_s const* executor,
                                  uform_layout_t const* layout, uform_config_t const* config, char const** error) {
    uform_backend_t const* backend = executor->backend;
    void* context = executor->context;
    uform_batch_shape_t const* batch = &config->given.batch;
    size_t tokens = (size_t)batch->max_rows_per_device * batch->max_columns_per_row;
    size_t segments = batch->max_segments_per_device, h = layout->hidden, wide = uform_mlp_ratio_k * h;
    memset(replica, 0, sizeof(*replica));
    replica->backend = backend, replica->context = context;
    replica->capacity_tokens = tokens, replica->capacity_segments = segments;
    replica->depth = layout->depth;
    replica->blocks = calloc(layout->depth, sizeof(uform_block_activations_t));
    if (!replica->blocks) goto out_of_memory;
    UFORM_ALLOCATE(replica->weights, layout->total);
    UFORM_ALLOCATE(replica->gradients, layout->total);
    UFORM_ALLOCATE(replica->first, layout->total);
    UFORM_ALLOCATE(replica->second, layout->total);
    for (uint32_t l = 0; l != layout->depth; ++l) {
        uform_block_activations_t* a = &replica->blocks[l];
        UFORM_ALLOCATE(a->input, tokens * h);
        UFORM_ALLOCATE(a->rstd1, tokens);
        UFORM_ALLOCATE(a->normed1, tokens * h);
        UFORM_ALLOCATE(a->qkv, tokens * 3 * h);
        UFORM_ALLOCATE(a->attended, tokens * h);
        UFORM_ALLOCATE(a->lse, tokens * layout->heads);
        UFORM_ALLOCATE(a->middle, tokens * h);
        UFORM_ALLOCATE(a->rstd2, tokens);
        UFORM_ALLOCATE(a->normed2, tokens * h);
        UFORM_ALLOCATE(a->up, tokens * wide);
        UFORM_ALLOCATE(a->activated, tokens * wide);
    }
    UFORM_ALLOCATE(replica->output, tokens * h);
    UFORM_ALLOCATE(replica->final_rstd, tokens);
    UFORM_ALLOCATE(replica->final, tokens * h);
    UFORM_ALLOCATE(replica->d_final, tokens * h);
    UFORM_ALLOCATE(replica->d_stream, tokens * h);
    UFORM_ALLOCATE(replica->d_hidden, tokens * h);
    UFORM_ALLOCATE(replica->d_qkv, tokens * 3 * h);
    UFORM_ALLOCATE(replica->d_wide, tokens * wide);
    UFORM_ALLOCATE(replica->masked_states, tokens * h);
    UFORM_ALLOCATE(replica->logits, tokens * uform_bytes_k);
    UFORM_ALLOCATE(replica->d_logits, tokens * uform_bytes_k);
    UFORM_ALLOCATE(replica->pooled, segments * h);
    UFORM_ALLOCATE(replica->d_pooled, segments * h);
    UFORM_ALLOCATE(replica->normalized, segments * h);
    UFORM_ALLOCATE(replica->ids, tokens);
    UFORM_ALLOCATE(replica->positions, tokens);
    UFORM_ALLOCATE(replica->masked, tokens);
    UFORM_ALLOCATE(replica->targets, tokens);
    UFORM_ALLOCATE(replica->groups, segments);
    UFORM_ALLOCATE(replica->segments, segments);
    UFORM_ALLOCATE(replica->cells, segments * segments);
    UFORM_ALLOCATE(replica->cell_weights, segments * segments);
    return uform_status_success_k;
out_of_memory:
    uform_replica_free(replica);
    return uform_fail(error, uform_status_out_of_memory_k,
                      "no memory for a replica of depth %u, hidden %zu over %zu tokens per device", layout->depth, h,
                      tokens);
}

void uform_replica_free(uform_replica_t* replica) {
    if (!replica->backend) return;
    uform_backend_t const* backend = replica->backend;
    void* context = replica->context;
    void* owned[] = {replica->weights, replica->gradients, replica->first, replica->second, replica->output,
                     replica->final_rstd, replica->final, replica->d_final, replica->d_stream, replica->d_hidden,
                     replica->d_qkv, replica->d_wide, replica->masked_states, replica->logits, replica->d_logits,
                     replica->pooled, replica->d_pooled, replica->normalized, replica->ids, replica->positions,
                     replica->masked, replica->targets, replica->groups, replica->segments, replica->cells,
                     replica->cell_weights};
    for (size_t i = 0; i != sizeof(owned) / sizeof(owned[0]); ++i)
        if (owned[i]) backend->release(context, owned[i]);
    if (replica->blocks) {
        for (uform_block_activations_t* a = replica->blocks; a != replica->blocks + replica->depth; ++a) {
            void* activations[] = {a->input, a->rstd1, a->normed1, a->qkv, a->attended, a->lse,
                                   a->middle, a->rstd2, a->normed2, a->up, a->activated};
            for (size_t i = 0; i != sizeof(activations) / sizeof(activations[0]); ++i)
                if (activations[i]) backend->release(context, activations[i]);
        }
        free(replica->blocks);
    }
    memset(replica, 0, sizeof(*replica));
}

/* The packed batch travels to the device once per step; everything after reads the device's copy. */
static void uform_model_upload(uform_replica_t* r, uform_packed_t const* packed, int contrastive) {
    uform_backend_t const* b = r->backend;
    size_t tokens = packed->tokens_count, items = packed->segments_count;
    b->upload(r->context, r->ids, packed->ids, tokens * sizeof(uint32_t));
    b->upload(r->context, r->positions, packed->positions, tokens * sizeof(uint32_t));
    b->upload(r->context, r->segments, packed->segments, items * sizeof(uform_segment_t));
    b->upload(r->context, r->masked, packed->masked, packed->masked_count * sizeof(uint32_t));
    b->upload(r->context, r->targets, packed->targets, packed->masked_count * sizeof(uint32_t));
    if (!contrastive) return;
    b->upload(r->context, r->groups, packed->groups, items * sizeof(uint32_t));
    b->upload(r->context, r->cells, packed->cells, items * items);
    b->upload(r->context, r->cell_weights, packed->weights, items * items * sizeof(float));
}

static void uform_model_forward(uform_replica_t* r, uform_layout_t const* layout, uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    float const* w = r->weights;
    uform_tensor_t const* t = layout->tensors;
    size_t tokens = packed->tokens_count, h = layout->hidden, wide = uform_mlp_ratio_k * h;
    b->embedding_forward(x, r->blocks[0].input, w + t[layout->embedding].offset, r->ids, tokens, h);
    for (uint32_t l = 0; l != layout->depth; ++l) {
        uform_block_activations_t* a = &r->blocks[l];
        uform_block_tensors_t const* block = &layout->blocks[l];
        float* next = l + 1 != layout->depth ? r->blocks[l + 1].input : r->output;
        b->rmsnorm_forward(x, a->normed1, a->rstd1, a->input, w + t[block->attention_norm].offset, tokens, h);
        b->matmul(x, a->qkv, a->normed1, w + t[block->qkv].offset, tokens, 3 * h, h, 0, 1, 0);
        b->rope_forward(x, a->qkv, r->positions, tokens, h);
        b->attention_forward(x, a->attended, a->lse, a->qkv, r->segments, packed->segments_count, tokens, h);
        b->copy(x, a->middle, a->input, tokens * h * sizeof(float));
        b->matmul(x, a->middle, a->attended, w + t[block->out].offset, tokens, h, h, 0, 1, 1);
        b->rmsnorm_forward(x, a->normed2, a->rstd2, a->middle, w + t[block->mlp_norm].offset, tokens, h);
        b->matmul(x, a->up, a->normed2, w + t[block->up].offset, tokens, wide, h, 0, 1, 0);
        b->gelu_forward(x, a->activated, a->up, tokens * wide);
        b->copy(x, next, a->middle, tokens * h * sizeof(float));
        b->matmul(x, next, a->activated, w + t[block->down].offset, tokens, h, wide, 0, 1, 1);
    }
    b->rmsnorm_forward(x, r->final, r->final_rstd, r->output, w + t[layout->final_norm].offset, tokens, h);
}

/* The heads read the final-norm states and leave their gradient in d_final. */
static void uform_model_losses(uform_replica_t* r, uform_layout_t const* layout, uform_config_t const* config,
                               uform_packed_t const* packed, uform_losses_t* losses) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    float const* w = r->weights;
    float* g = r->gradients;
    uform_tensor_t const* t = layout->tensors;
    uform_trainer_init_vram_t const* c = &config->given;
    size_t tokens = packed->tokens_count, items = packed->segments_count, h = layout->hidden;
    size_t masked = packed->masked_count;
    b->zero(x, r->d_final, tokens * h * sizeof(float));
    losses->masked = losses->contrastive = NAN;

    if (c->objective != uform_objective_contrastive_k && masked) {
        float weight = c->masking.text_weight;
        float const* decoder = w + t[layout->decoder].offset;
        b->gather_rows(x, r->masked_states, r->final, r->masked, masked, h);
        b->matmul(x, r->logits, r->masked_states, decoder, masked, uform_bytes_k, h, 0, 1, 0);
        losses->masked = b->cross_entropy(x, r->d_logits, r->logits, r->targets, masked, uform_bytes_k, weight);
        b->matmul(x, g + t[layout->decoder].offset, r->d_logits, r->masked_states, uform_bytes_k, h, masked, 1, 0, 1);
        b->matmul(x, r->d_hidden, r->d_logits, decoder, masked, h, uform_bytes_k, 0, 0, 0);
        b->scatter_rows(x, r->d_final, r->d_hidden, r->masked, masked, h);
    }
    b->pool_forward(x, r->pooled, r->final, r->segments, items, h);
    if (c->objective != uform_objective_masked_k) {
        uform_contrastive_setup_t setup = {.form = c->contrastive.pair_loss,
                                           .dimensions_count = c->contrastive.matryoshka_dimensions_count};
        memcpy(setup.dimensions, config->matryoshka, sizeof(setup.dimensions));
        b->zero(x, r->d_pooled, items * h * sizeof(float));
        losses->contrastive = b->contrastive(
            x, r->d_pooled, g + t[layout->log_inverse_temperature].offset, g + t[layout->bias].offset, r->normalized,
            r->pooled, w + t[layout->log_inverse_temperature].offset, w + t[layout->bias].offset, r->cells,
            r->cell_weights, r->groups, items, h, &setup, 1);
        if (!isnan(losses->contrastive)) b->pool_backward(x, r->d_final, r->d_pooled, r->segments, items, h);
    }
    double total = 0;
    int ran = 0;
    if (!isnan(losses->masked)) total += c->masking.text_weight * losses->masked, ran = 1;
    if (!isnan(losses->contrastive)) total += losses->contrastive, ran = 1;
    losses->total = ran ? total : NAN;
}

static void uform_model_backward(uform_replica_t* r, uform_layout_t const* layout, uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    float const* w = r->weights;
    float* g = r->gradients;
    uform_tensor_t const* t = layout->tensors;
    size_t tokens = packed->tokens_count, h = layout->hidden, wide = uform_mlp_ratio_k * h;
    b->zero(x, r->d_stream, tokens * h * sizeof(float));
    b->rmsnorm_backward(x, r->d_stream, g + t[layout->final_norm].offset, r->d_final, r->output,
                        w + t[layout->final_norm].offset, r->final_rstd, tokens, h);
    for (uint32_t l = layout->depth; l-- != 0;) {
        uform_block_activations_t const* a = &r->blocks[l];
        uform_block_tensors_t const* block = &layout->blocks[l];
        /* d_stream holds the gradient of the block's output; the residual passes it through unchanged. */
        b->matmul(x, g + t[block->down].offset, r->d_stream, a->activated, h, wide, tokens, 1, 0, 1);
        b->matmul(x, r->d_wide, r->d_stream, w + t[block->down].offset, tokens, wide, h, 0, 0, 0);
        b->gelu_backward(x, r->d_wide, r->d_wide, a->up, tokens * wide);
        b->matmul(x, g + t[block->up].offset, r->d_wide, a->normed2, wide, h, tokens, 1, 0, 1);
        b->matmul(x, r->d_hidden, r->d_wide, w + t[block->up].offset, tokens, h, wide, 0, 0, 0);
        b->rmsnorm_backward(x, r->d_stream, g + t[block->mlp_norm].offset, r->d_hidden, a->middle,
                            w + t[block->mlp_norm].offset, a->rstd2, tokens, h);
        /* d_stream now holds the gradient of the middle of the block. */
        b->matmul(x, g + t[block->out].offset, r->d_stream, a->attended, h, h, tokens, 1, 0, 1);
        b->matmul(x, r->d_hidden, r->d_stream, w + t[block->out].offset, tokens, h, h, 0, 0, 0);
        b->attention_backward(x, r->d_qkv, r->d_hidden, a->attended, a->lse, a->qkv, r->segments,
                              packed->segments_count, tokens, h);
        b->rope_backward(x, r->d_qkv, r->positions, tokens, h);
        b->matmul(x, g + t[block->qkv].offset, r->d_qkv, a->normed1, 3 * h, h, tokens, 1, 0, 1);
        b->matmul(x, r->d_hidden, r->d_qkv, w + t[block->qkv].offset, tokens, h, 3 * h, 0, 0, 0);
        b->rmsnorm_backward(x, r->d_stream, g + t[block->attention_norm].offset, r->d_hidden, a->input,
                            w + t[block->attention_norm].offset, a->rstd1, tokens, h);
    }
    b->embedding_backward(x, g + t[layout->embedding].offset, r->d_stream, r->ids, tokens, h, uform_vocabulary_k);
}

void uform_model_embed(uform_replica_t* replica, uform_layout_t const* layout, uform_packed_t const* packed) {
    uform_model_upload(replica, packed, 0);
    uform_model_forward(replica, layout, packed);
    replica->backend->pool_forward(replica->context, replica->pooled, replica->final, replica->segments,
                                   packed->segments_count, layout->hidden);
}

void uform_model_gradients(uform_replica_t* replica, uform_layout_t const* layout, uform_config_t const* config,
                           uform_packed_t const* packed, uform_losses_t* losses) {
    int contrastive = config->given.objective != uform_objective_masked_k;
    replica->backend->zero(replica->context, replica->gradients, layout->total * sizeof(float));
    uform_model_upload(replica, packed, contrastive);
    uform_model_forward(replica, layout, packed);
    uform_model_losses(replica, layout, config, packed, losses);
    uform_model_backward(replica, layout, packed);
}
