/**
 *  @file   encoder.c
 *  @brief  Checkpoints loaded for inference, on a RAM or VRAM executor.
 *
 *  An encoder runs `model.c`'s forward pass, as training does, so both score items identically. It holds
 *  only what that pass reads: the weights (and on a bfloat16 backend their compute copy) and one block's
 *  activations that every block reuses, not the gradients, moments and saved activations of a trainer.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

typedef struct uform_encoder_s {
    uform_serial_t serial; /* embeds on one encoder share its packed batch and activations: one at a time */
    uform_executor_s* executor; /* borrowed until the encoder is freed */
    uform_config_t config;
    uform_layout_t layout;
    uform_packed_t packed;
    uform_replica_t replica;
} uform_encoder_s;

static void uform_encoder_release(uform_encoder_s* encoder) {
    uform_model_close(&encoder->layout, &encoder->replica, &encoder->packed);
    pthread_mutex_destroy(&encoder->serial.lock);
    free(encoder);
}

/* Reads the weights, whichever kind of checkpoint holds them, and moves them to the device. */
static uform_status_t uform_encoder_start(uform_encoder_s* encoder, char const* path, char const** error) {
    uform_replica_t* replica = &encoder->replica;
    uint64_t step;
    float* weights = calloc(encoder->layout.total, sizeof(float)); /* zero between tensors, as a trainer's are */
    if (!weights)
        return uform_fail(error, uform_status_out_of_memory_k, "no memory to read %zu weights", encoder->layout.total);
    uform_status_t status = uform_checkpoint_load(path, &encoder->layout, weights, NULL, NULL, &step, error);
    if (status == uform_status_success_k) {
        status = uform_replica_upload_weights(replica, &encoder->layout, weights);
        if (status == uform_status_success_k) status = replica->backend->synchronize(replica->context);
        if (status != uform_status_success_k && error) *error = uform_message();
    }
    free(weights);
    return status;
}

/* Makes an encoder on an executor the caller has acquired, for the geometry the checkpoint records. */
static uform_status_t uform_encoder_make(uform_executor_s* executor, char const* path,
                                         uform_trainer_init_vram_t const* geometry, uform_encoder_s** encoder,
                                         char const** error) {
    uform_encoder_s* made = calloc(1, sizeof(uform_encoder_s));
    if (!made) return uform_fail(error, uform_status_out_of_memory_k, "no memory for an encoder");
    pthread_mutex_init(&made->serial.lock, NULL);
    made->executor = executor;
    uform_status_t status = uform_model_open(executor, geometry, 0, &made->config, &made->layout, &made->replica,
                                             &made->packed, error);
    if (status == uform_status_success_k) status = uform_encoder_start(made, path, error);
    if (status != uform_status_success_k) uform_encoder_release(made);
    else *encoder = made;
    return status;
}

uform_status_t uform_encoder_load(uform_executor_t executor, char const* path, uform_encoder_t* encoder,
                                  size_t* hidden, char const** error) {
    if (!path) return uform_fail(error, uform_status_invalid_argument_k, "path: NULL");
    if (!*path) return uform_fail(error, uform_status_invalid_argument_k, "path: empty");
    if (!encoder) return uform_fail(error, uform_status_invalid_argument_k, "encoder: NULL output pointer");
    uform_trainer_init_vram_t geometry;
    memset(&geometry, 0, sizeof(geometry));
    uform_status_t status = uform_checkpoint_config(path, &geometry, error);
    if (status != uform_status_success_k) return status;
    /* Borrowed for the encoder's life, so freeing the executor meanwhile answers busy. */
    void* devices = NULL;
    uform_encoder_s* made = NULL;
    status = uform_handles_acquire(executor, uform_handle_executor_k, "executor", &devices, error);
    if (status == uform_status_success_k) status = uform_encoder_make(devices, path, &geometry, &made, error);
    if (status == uform_status_success_k) status = uform_handles_add(made, uform_handle_encoder_k, encoder, error);
    if (status != uform_status_success_k) {
        if (made) uform_encoder_release(made);
        uform_handles_release(devices);
        return status;
    }
    if (hidden) *hidden = made->layout.hidden;
    return uform_status_success_k;
}

static size_t uform_scalar_bytes(uform_scalar_t scalar) {
    return scalar == uform_scalar_f32_k ? 4 : scalar == uform_scalar_i8_k ? 1 : 2;
}

/*
 *  How many items from `first` one pass takes: first fit never leaves two rows half empty, so items
 *  filling at most half the rows always fit. Each item takes `extra` positions beside its content.
 */
static size_t uform_encoder_chunk(uform_encoder_s const* encoder, uint64_t const* offsets, size_t first, size_t count,
                                  uint64_t extra) {
    uform_batch_shape_t const* shape = &encoder->config.given.batch;
    uint64_t budget = (uint64_t)shape->max_rows_per_device * shape->max_columns_per_row / 2, tokens = 0;
    size_t chunk = 0;
    while (first + chunk < count && chunk < shape->max_segments_per_device) {
        uint64_t begin = offsets[first + chunk], end = offsets[first + chunk + 1];
        uint64_t length = (end > begin ? end - begin : 0) + extra; /* the packing refuses what does not ascend */
        if (length > shape->max_columns_per_row) length = shape->max_columns_per_row;
        if (chunk && tokens + length > budget) break;
        tokens += length, ++chunk;
    }
    return chunk;
}

/* Decodes the media among items [first, first + count) on every core, from offsets read once; NULL when none is
   media. The offsets are checked as they are read: out of order or past the tape, they are refused when `strict`,
   else left for the packing to name, which then decodes nothing ahead. */
static uform_status_t uform_encoder_decode(uform_encoder_s const* encoder, uform_modality_t const* modalities,
                                           uform_tape_t const* contents, size_t first, size_t count, int strict,
                                           uform_decoded_s** decoded, char const** error) {
    *decoded = NULL;
    uint64_t* offsets = malloc((count + 1) * sizeof(uint64_t));
    if (!offsets) return uform_fail(error, uform_status_out_of_memory_k, "no memory to read %zu offsets", count);
    uform_tape_t part = {contents->data, contents->offsets + first, count, contents->size};
    for (size_t i = 0; i <= count; ++i) offsets[i] = part.offsets[i]; /* read once: the decoder trusts them */
    size_t bad = count;
    for (size_t i = 0; i != count && bad == count; ++i)
        if (offsets[i + 1] <= offsets[i] || offsets[i + 1] > part.size) bad = i;
    uform_status_t status = uform_status_success_k;
    if (bad == count)
        status = uform_decoded_make(&encoder->config, count, modalities + first, &part, offsets, first, "contents",
                                    decoded, error);
    else if (strict)
        status = uform_fail(error, uform_status_invalid_argument_k,
                            "contents.offsets[%zu] or [%zu]: changed while the encoder read them (no longer rising "
                            "within contents.size)", first + bad, first + bad + 1);
    free(offsets);
    return status;
}

/* Embeds the items in chunks that fit the replica, landing each chunk's rows where they belong in `embed`. The next
   chunk's media decode on the host while the device embeds this one. */
static uform_status_t uform_encoder_chunks(uform_encoder_s* encoder, uform_encoder_embed_t* embed, char const** error) {
    size_t hidden = encoder->layout.hidden, count = embed->count;
    size_t chunk = count ? uform_encoder_chunk(encoder, embed->contents.offsets, 0, count, 0) : 0;
    uform_decoded_s *ahead = NULL, *behind = NULL;
    uform_status_t status =
        uform_encoder_decode(encoder, embed->modalities, &embed->contents, 0, chunk, 0, &ahead, error);
    embed->truncated_items = 0;
    for (size_t first = 0; first < count && status == uform_status_success_k;) {
        uform_tape_t part = {embed->contents.data, embed->contents.offsets + first, chunk, embed->contents.size};
        status = uform_batch_pack_plain(&encoder->packed, &encoder->config, embed->modalities + first, &part, NULL,
                                        ahead, first, error);
        if (status != uform_status_success_k) break;
        embed->truncated_items += encoder->packed.truncated;
        status = uform_model_embed(&encoder->replica, &encoder->layout, &encoder->packed);
        if (status != uform_status_success_k) {
            if (error) *error = uform_message();
            break;
        }
        size_t next = first + chunk, following = next < count ? uform_encoder_chunk(encoder, embed->contents.offsets,
                                                                                    next, count, 0) : 0;
        behind = ahead, ahead = NULL;
        status = uform_encoder_decode(encoder, embed->modalities, &embed->contents, next, following, 0, &ahead, error);
        if (status == uform_status_success_k)
            status = uform_embeddings_export(&encoder->replica, encoder->replica.pooled, chunk, hidden, 1,
                                             (char*)embed->embeddings +
                                                 first * hidden * uform_scalar_bytes(embed->embeddings_scalar),
                                             embed->embeddings_scalar, error);
        uform_decoded_release(behind), behind = NULL;
        first = next, chunk = following;
    }
    uform_decoded_release(ahead);
    return status;
}

/* Refuses a tape meant to hold one entry per item of `count`, naming its field `name`; `none_may_be_null`: an empty
   tape may have no offsets, as an empty array's pointer may be NULL. */
static uform_status_t uform_tape_per_item(uform_tape_t const* tape, size_t count, int none_may_be_null,
                                          char const* name, char const** error) {
    if (tape->count != count)
        return uform_fail(error, uform_status_invalid_argument_k, "%s.count: %zu, expected %zu, one entry per item", name,
                          tape->count, count);
    if (!tape->offsets && (count || !none_may_be_null))
        return uform_fail(error, uform_status_invalid_argument_k, "%s.offsets: NULL", name);
    return uform_status_success_k;
}

uform_status_t uform_encoder_embed(uform_encoder_t handle, uform_encoder_embed_t* embed, char const** error) {
    if (!embed) return uform_fail(error, uform_status_invalid_argument_k, "embed: NULL");
    if ((unsigned)embed->embeddings_scalar > uform_scalar_i8_k)
        return uform_fail(error, uform_status_invalid_argument_k, "embed.embeddings_scalar: %d is not a scalar type",
                          (int)embed->embeddings_scalar);
    /* No items embed into nothing: their arrays may be NULL, as an empty array's pointer may be. */
    if (embed->count && !embed->embeddings)
        return uform_fail(error, uform_status_invalid_argument_k, "embed.embeddings: NULL");
    if (embed->count && !embed->modalities)
        return uform_fail(error, uform_status_invalid_argument_k, "embed.modalities: NULL where embed.count is %zu",
                          embed->count);
    UFORM_TRY(uform_tape_per_item(&embed->contents, embed->count, 1, "embed.contents", error));
    void* encoder;
    uform_status_t status = uform_handles_enter(handle, uform_handle_encoder_k, "encoder", &encoder, error);
    if (status != uform_status_success_k) return status;
    embed->truncated_items = 0;
    if (embed->count) status = uform_encoder_chunks(encoder, embed, error);
    uform_handles_leave(encoder);
    return status;
}

/* Chooses in chunks that fit the replica, landing each chunk's probabilities where its choices sit. */
static uform_status_t uform_encoder_choices(uform_encoder_s* encoder, uform_encoder_choose_t* choose,
                                            char const** error) {
    uform_replica_t* replica = &encoder->replica;
    uform_packed_t* packed = &encoder->packed;
    size_t count = choose->count;
    uint64_t base = choose->choices.offsets[0];
    /* Every item is text: one list of modalities serves every chunk, which holds at most a pass's items. */
    size_t most = encoder->config.given.batch.max_segments_per_device;
    uform_modality_t* modalities = malloc((count < most ? count : most) * sizeof(uform_modality_t) + 1);
    if (!modalities) return uform_fail(error, uform_status_out_of_memory_k, "no memory for %zu texts", most);
    for (size_t i = 0; i != (count < most ? count : most); ++i) modalities[i] = uform_modality_text_k;
    uform_status_t status = uform_status_success_k;
    choose->truncated_items = 0;
    for (size_t first = 0; first < count && status == uform_status_success_k;) {
        size_t chunk = uform_encoder_chunk(encoder, choose->texts.offsets, first, count, 1);
        uform_tape_t texts = {choose->texts.data, choose->texts.offsets + first, chunk, choose->texts.size};
        uform_tape_t choices = {choose->choices.data, choose->choices.offsets + first, chunk, choose->choices.size};
        status = uform_batch_pack_choose(packed, &encoder->config, modalities, &texts, &choices, first, error);
        if (status != uform_status_success_k) break;
        if (packed->choice_snapshot[0] < base) {
            status = uform_fail(error, uform_status_invalid_argument_k, "choices.offsets[%zu]: below choices.offsets[0]",
                                first);
            break;
        }
        choose->truncated_items += packed->truncated;
        size_t offered = packed->choice_offsets[packed->choices_count];
        status = uform_model_choose(replica, &encoder->layout, packed);
        if (status == uform_status_success_k)
            status = replica->backend->download(replica->context,
                                                choose->probabilities + (packed->choice_snapshot[0] - base),
                                                replica->probabilities, offered * sizeof(float));
        if (status != uform_status_success_k && error) *error = uform_message();
        first += chunk;
    }
    free(modalities);
    return status;
}

uform_status_t uform_encoder_choose(uform_encoder_t handle, uform_encoder_choose_t* choose, char const** error) {
    if (!choose) return uform_fail(error, uform_status_invalid_argument_k, "choose: NULL");
    /* No items choose nothing: their arrays may be NULL, as `embed`'s may. */
    if (!choose->probabilities && choose->count)
        return uform_fail(error, uform_status_invalid_argument_k, "choose.probabilities: NULL");
    UFORM_TRY(uform_tape_per_item(&choose->texts, choose->count, 1, "choose.texts", error));
    UFORM_TRY(uform_tape_per_item(&choose->choices, choose->count, 1, "choose.choices", error));
    void* encoder;
    uform_status_t status = uform_handles_enter(handle, uform_handle_encoder_k, "encoder", &encoder, error);
    if (status != uform_status_success_k) return status;
    choose->truncated_items = 0;
    if (choose->count) status = uform_encoder_choices(encoder, choose, error);
    uform_handles_leave(encoder);
    return status;
}

/* Counts the tokens of the media among items [first, first + count) into `rows` (`count`, left alone for text),
   decoding them as the filling call will again. Only a chunk at a time is held decoded. */
static uform_status_t uform_encoder_media_rows(uform_encoder_s const* encoder, uform_encoder_tokens_t const* tokens,
                                               size_t first, size_t count, uint64_t* rows, uint64_t* truncated,
                                               char const** error) {
    uform_decoded_s* decoded = NULL;
    uform_status_t status = uform_encoder_decode(encoder, tokens->modalities, &tokens->contents, first, count, 1,
                                                 &decoded, error);
    for (size_t i = 0; decoded && i != count; ++i)
        if (decoded->values[i]) {
            rows[i] = uform_grid_tokens(&decoded->grids[i]);
            *truncated += decoded->grids[i].truncated != 0;
        }
    uform_decoded_release(decoded);
    return status;
}

/* Each item's rows as training reads it: a query its span, a media item its tokens, a text its bytes up to a row. */
static uform_status_t uform_encoder_token_rows(uform_encoder_s const* encoder, uform_encoder_tokens_t* tokens,
                                               char const** error) {
    uform_trainer_init_vram_t const* c = &encoder->config.given;
    uint64_t const* contents = tokens->contents.offsets;
    tokens->truncated_items = 0;
    if (!tokens->count) return uform_status_success_k;
    tokens->offsets[0] = 0;
    for (size_t i = 0; i != tokens->count; ++i) {
        int side = tokens->sides ? (int)tokens->sides[i] : uform_late_interaction_document_k;
        uform_modality_t modality = tokens->modalities[i];
        if (modality < uform_modality_text_k || modality > uform_modality_audio_k)
            return uform_fail(error, uform_status_invalid_argument_k, "modalities[%zu]: %d is not a modality", i,
                              (int)modality);
        if (side == uform_late_interaction_none_k)
            return uform_fail(error, uform_status_invalid_argument_k,
                              "sides[%zu]: none has no token vectors; read an item as a query, a document or both", i);
        if (side < 0 || side > uform_late_interaction_query_and_document_k)
            return uform_fail(error, uform_status_invalid_argument_k, "sides[%zu]: %d is not a late-interaction side",
                              i, side);
        if (modality != uform_modality_text_k && side != uform_late_interaction_document_k)
            return uform_fail(error, uform_status_invalid_argument_k,
                              "sides[%zu]: only text items are queries; this media item may be a document", i);
        uint64_t length = contents[i + 1] > contents[i] ? contents[i + 1] - contents[i] : 0;
        if (!length)
            return uform_fail(error, uform_status_invalid_argument_k,
                              "contents[%zu]: empty; every item needs at least one byte", i);
        /* Both calls, the one that sizes and the one that fills, answer the same count. */
        uint64_t rows = side != uform_late_interaction_document_k ? c->late_interaction.max_query_span
                                                                  : c->batch.max_columns_per_row;
        tokens->truncated_items += modality == uform_modality_text_k && length > rows;
        if (length > rows || side != uform_late_interaction_document_k) length = rows;
        tokens->offsets[i + 1] = length; /* media's tokens replace it below */
    }
    /* Media items count the tokens they decode to; a chunk of items at a time, so memory stays bounded. */
    size_t chunk = encoder->config.given.batch.max_segments_per_device;
    for (size_t first = 0; first < tokens->count; first += chunk) {
        size_t part = tokens->count - first < chunk ? tokens->count - first : chunk, media = 0;
        for (size_t i = first; i != first + part; ++i) media += tokens->modalities[i] != uform_modality_text_k;
        if (!media) continue;
        uform_status_t status = uform_encoder_media_rows(encoder, tokens, first, part, tokens->offsets + first + 1,
                                                         &tokens->truncated_items, error);
        if (status != uform_status_success_k) return status;
    }
    for (size_t i = 0; i != tokens->count; ++i) tokens->offsets[i + 1] += tokens->offsets[i];
    return uform_status_success_k;
}

/* Reads the items in chunks that fit the replica, landing each chunk's rows where `offsets` places them. */
static uform_status_t uform_encoder_tokens(uform_encoder_s* encoder, uform_encoder_tokens_t* tokens,
                                           char const** error) {
    uform_replica_t* replica = &encoder->replica;
    size_t count = tokens->count, width = tokens->width = replica->late_width;
    if (!width)
        return uform_fail(error, uform_status_invalid_argument_k,
                          "encoder: this checkpoint has no token head; a run trains one with late_interaction.weight > 0");
    uform_status_t status = uform_encoder_token_rows(encoder, tokens, error);
    for (size_t first = 0; first < count && status == uform_status_success_k && tokens->vectors;) {
        size_t chunk = uform_encoder_chunk(encoder, tokens->offsets, first, count, 0);
        uform_tape_t part = {tokens->contents.data, tokens->contents.offsets + first, chunk, tokens->contents.size};
        status = uform_batch_pack_plain(&encoder->packed, &encoder->config, tokens->modalities + first, &part,
                                        tokens->sides ? tokens->sides + first : NULL, NULL, first, error);
        if (status != uform_status_success_k) break;
        if (encoder->packed.tokens_count != tokens->offsets[first + chunk] - tokens->offsets[first])
            return uform_fail(error, uform_status_invalid_argument_k,
                              "contents.offsets: changed while the encoder read them (items %zu to %zu)", first,
                              first + chunk);
        status = uform_model_embed_tokens(replica, &encoder->layout, &encoder->packed);
        if (status == uform_status_success_k)
            status = replica->backend->download(replica->context, tokens->vectors + tokens->offsets[first] * width,
                                                replica->late_unit,
                                                encoder->packed.tokens_count * width * sizeof(float));
        if (status != uform_status_success_k && error) *error = uform_message();
        first += chunk;
    }
    return status;
}

uform_status_t uform_encoder_embed_tokens(uform_encoder_t handle, uform_encoder_tokens_t* tokens, char const** error) {
    if (!tokens) return uform_fail(error, uform_status_invalid_argument_k, "tokens: NULL");
    /* No items have no rows: their arrays may be NULL, as `embed`'s may. */
    if (!tokens->offsets && tokens->count) return uform_fail(error, uform_status_invalid_argument_k, "tokens.offsets: NULL");
    if (!tokens->modalities && tokens->count)
        return uform_fail(error, uform_status_invalid_argument_k, "tokens.modalities: NULL");
    UFORM_TRY(uform_tape_per_item(&tokens->contents, tokens->count, 1, "tokens.contents", error));
    /* The call that sizes reads the contents' lengths, so it checks their tape as the filling call does. */
    if (tokens->count) UFORM_TRY(uform_tape_check(&tokens->contents, tokens->count, "tokens.contents", 0, NULL, error));
    void* encoder;
    uform_status_t status = uform_handles_enter(handle, uform_handle_encoder_k, "encoder", &encoder, error);
    if (status != uform_status_success_k) return status;
    status = uform_encoder_tokens(encoder, tokens, error);
    uform_handles_leave(encoder);
    return status;
}

uform_status_t uform_encoder_memory(uform_encoder_t handle, size_t* bytes, char const** error) {
    void* encoder;
    uform_status_t status = uform_handles_enter(handle, uform_handle_encoder_k, "encoder", &encoder, error);
    if (status != uform_status_success_k) return status;
    if (bytes) *bytes = uform_replica_bytes(&((uform_encoder_s*)encoder)->replica);
    uform_handles_leave(encoder);
    return status;
}

uform_status_t uform_encoder_free(uform_encoder_t handle, char const** error) {
    void* object;
    uform_status_t status = uform_handles_remove(handle, uform_handle_encoder_k, "encoder", &object, error);
    if (status != uform_status_success_k) return status;
    uform_encoder_s* encoder = object;
    uform_handles_release(encoder->executor);
    uform_encoder_release(encoder);
    return uform_status_success_k;
}
