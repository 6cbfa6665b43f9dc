/**
 *  @file   encoder.c
 *  @brief  Checkpoints loaded for inference, on a RAM or VRAM executor. An encoder is a trainer
 *          resumed from the file's own geometry that only ever runs the forward pass, so training and inference share one
 *          sequence of operations and score items identically.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

typedef struct uform_encoder_s {
    uform_handle_t handle;
    uform_trainer_t trainer;
    size_t hidden;
} uform_encoder_s;

uform_status_t uform_encoder_load(uform_executor_t executor, char const* path, uform_encoder_t* encoder,
                                  size_t* hidden, char const** error) {
    if (!path) return uform_fail(error, uform_status_invalid_argument_k, "path: NULL");
    if (!encoder) return uform_fail(error, uform_status_invalid_argument_k, "encoder: NULL output pointer");
    uform_trainer_init_vram_t config;
    memset(&config, 0, sizeof(config));
    uform_status_t status = uform_checkpoint_config(path, &config, error);
    if (status != uform_status_success_k) return status;
    config.resume = path;
    config.objective = uform_objective_contrastive_k; /* no masking: inference sees items whole */
    config.schedule.steps = 1;
    uform_encoder_s* made = calloc(1, sizeof(uform_encoder_s));
    if (!made) return uform_fail(error, uform_status_out_of_memory_k, "no memory for an encoder");
    made->hidden = config.hidden;
    status = uform_trainer_init(executor, -1, &config, NULL, &made->trainer, error);
    if (status == uform_status_success_k) status = uform_handles_add(made, uform_handle_encoder_k, encoder, error);
    if (status != uform_status_success_k) {
        if (made->trainer) uform_trainer_free(made->trainer, NULL);
        free(made);
        return status;
    }
    if (hidden) *hidden = made->hidden;
    return uform_status_success_k;
}

uform_status_t uform_encoder_embed(uform_encoder_t encoder, uform_encoder_embed_t* embed, char const** error) {
    void* object;
    uform_status_t status = uform_handles_acquire(encoder, uform_handle_encoder_k, "encoder", &object, error);
    if (status != uform_status_success_k) return status;
    status = uform_trainer_embed(((uform_encoder_s*)object)->trainer, embed, error);
    uform_handles_release(object);
    return status;
}

uform_status_t uform_encoder_free(uform_encoder_t encoder, char const** error) {
    void* object;
    uform_status_t status = uform_handles_remove(encoder, uform_handle_encoder_k, "encoder", &object, error);
    if (status != uform_status_success_k) return status;
    uform_trainer_free(((uform_encoder_s*)object)->trainer, NULL);
    free(object);
    return uform_status_success_k;
}
