/**
 *  @file   layout.c
 *  @brief  Names, shapes and places of every parameter in the flat buffers of weights, gradients
 *          and moments. The order here is the checkpoint's order; `docs/model.md` lists it.
 */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

static size_t uform_layout_push(uform_layout_t* layout, char const* name, size_t rows, size_t cols, float init_std,
                                float init_value) {
    uform_tensor_t* tensor = &layout->tensors[layout->count];
    snprintf(tensor->name, sizeof(tensor->name), "%s", name);
    tensor->offset = layout->total;
    tensor->rows = rows, tensor->cols = cols;
    tensor->decays = rows > 1;
    tensor->init_std = init_std, tensor->init_value = init_value;
    /* Each tensor starts on a 16-float boundary so every backend may read it with aligned vectors. */
    layout->total += (rows * cols + 15) / 16 * 16;
    return layout->count++;
}

void uform_media_widths(uform_batch_shape_t const* b, size_t widths[uform_media_kinds_k]) {
    widths[uform_media_image_k] = (size_t)b->image.patch_side * b->image.patch_side * b->image.channels;
    widths[uform_media_video_k] = (size_t)b->video.tube_frames * b->video.patch_side * b->video.patch_side * b->video.channels;
    widths[uform_media_audio_k] = b->audio.chunk_samples;
}

uform_status_t uform_layout_init(uform_layout_t* layout, uform_trainer_init_vram_t const* config, char const** error) {
    uint32_t depth = config->depth, hidden = config->hidden, groups = config->contrastive.temperature_groups;
    uform_late_interaction_t const* late = &config->late_interaction;
    *layout = (uform_layout_t){.depth = depth, .hidden = hidden, .heads = hidden / uform_head_width_k,
                               .temperature_groups = groups, .token_head = SIZE_MAX};
    layout->tensors = calloc(6 * (size_t)depth + 14, sizeof(uform_tensor_t));
    layout->blocks = calloc(depth, sizeof(uform_block_tensors_t));
    if (!layout->tensors || !layout->blocks) {
        uform_layout_free(layout);
        return uform_fail(error, uform_status_out_of_memory_k, "no memory for the model's layout");
    }
    size_t h = hidden, wide = uform_mlp_ratio_k * (size_t)hidden;
    float std = 0.02f, residual_std = 0.02f / sqrtf(2.0f * (float)depth); /* GPT-2's scaled residual init */
    char name[64];
    layout->embedding = uform_layout_push(layout, "text.embedding", uform_vocabulary_k, h, std, 0);
    for (uint32_t l = 0; l != depth; ++l) {
        uform_block_tensors_t* block = &layout->blocks[l];
        snprintf(name, sizeof(name), "blocks.%u.attention_norm", l);
        block->attention_norm = uform_layout_push(layout, name, 1, h, 0, 1);
        snprintf(name, sizeof(name), "blocks.%u.qkv", l);
        block->qkv = uform_layout_push(layout, name, 3 * h, h, std, 0);
        snprintf(name, sizeof(name), "blocks.%u.out", l);
        block->out = uform_layout_push(layout, name, h, h, residual_std, 0);
        snprintf(name, sizeof(name), "blocks.%u.mlp_norm", l);
        block->mlp_norm = uform_layout_push(layout, name, 1, h, 0, 1);
        snprintf(name, sizeof(name), "blocks.%u.up", l);
        block->up = uform_layout_push(layout, name, wide, h, std, 0);
        snprintf(name, sizeof(name), "blocks.%u.down", l);
        block->down = uform_layout_push(layout, name, h, wide, residual_std, 0);
    }
    layout->final_norm = uform_layout_push(layout, "final_norm", 1, h, 0, 1);
    layout->decoder = uform_layout_push(layout, "text.decoder", uform_bytes_k, h, std, 0);
    uform_media_widths(&config->batch, layout->media_width);
    layout->image = config->batch.image, layout->video = config->batch.video, layout->audio = config->batch.audio;
    char const* kinds[uform_media_kinds_k] = {"image", "video", "audio"};
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) {
        size_t width = layout->media_width[kind];
        if (width > layout->widest) layout->widest = width;
        snprintf(name, sizeof(name), "%s.projection", kinds[kind]);
        layout->media_projection[kind] = uform_layout_push(layout, name, h, width, std, 0);
        snprintf(name, sizeof(name), "%s.decoder", kinds[kind]);
        layout->media_decoder[kind] = uform_layout_push(layout, name, width, h, std, 0);
    }
    layout->log_inverse_temperature = uform_layout_push(layout, "contrastive.log_inverse_temperature", 1, groups, 0,
                                                        logf(config->contrastive.inverse_temperature));
    layout->bias = uform_layout_push(layout, "contrastive.bias", 1, groups, 0, config->contrastive.bias);
    if (late->weight > 0) { /* the token head exists where a run trains it */
        layout->token_head = uform_layout_push(layout, "late_interaction.token_head", late->width, h, std, 0);
        layout->late_log_inverse_temperature = uform_layout_push(layout, "late_interaction.log_inverse_temperature", 1,
                                                                 1, 0, logf(late->inverse_temperature));
        layout->late_bias = uform_layout_push(layout, "late_interaction.bias", 1, 1, 0, late->bias);
    }
    return uform_status_success_k;
}

void uform_layout_free(uform_layout_t* layout) {
    free(layout->tensors);
    free(layout->blocks);
    layout->tensors = NULL, layout->blocks = NULL;
}
