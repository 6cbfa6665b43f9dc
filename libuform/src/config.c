/**
 *  @file   config.c
 *  @brief  Derives every default a zero asks for and checks every field, naming the one at fault.
 */
#include <stdio.h>
#include <string.h>

#include "core.h"

#define UFORM_INVALID(...) uform_fail(error, uform_status_invalid_argument_k, __VA_ARGS__)

static int uform_finite(float x) { return isfinite(x); }

/* A fraction that zero derives: must lie in [0, 1]. */
static uform_status_t uform_derive_fraction(float* value, float derived, char const* name, char const** error) {
    if (!uform_finite(*value) || *value < 0 || *value > 1)
        return UFORM_INVALID("%s: %g is not in [0, 1]", name, (double)*value);
    if (*value == 0) *value = derived;
    return uform_status_success_k;
}

/* A non-negative weight that zero derives. */
static uform_status_t uform_derive_weight(float* value, float derived, char const* name, char const** error) {
    if (!uform_finite(*value) || *value < 0)
        return UFORM_INVALID("%s: %g is not a finite non-negative number", name, (double)*value);
    if (*value == 0) *value = derived;
    return uform_status_success_k;
}

#define UFORM_TRY(expression)                                                                                         \
    do {                                                                                                              \
        uform_status_t status_ = (expression);                                                                        \
        if (status_ != uform_status_success_k) return status_;                                                        \
    } while (0)

/* The batch shape's defaults and limits, written once for a trainer's config and for `uform_media_tokens`, whose
   messages name its fields from `path` ("config.batch", "shape"). */
uform_status_t uform_batch_shape_derive(uform_batch_shape_t* batch, char const* path, char const** error) {
    if (!batch->max_rows_per_device) batch->max_rows_per_device = 64;
    if (!batch->max_columns_per_row) batch->max_columns_per_row = 512;
    if (!batch->max_segments_per_device) batch->max_segments_per_device = 8 * batch->max_rows_per_device;
    if (!batch->max_bags_per_device) batch->max_bags_per_device = batch->max_segments_per_device;
    if (batch->max_columns_per_row > uform_longest_row_k)
        return UFORM_INVALID("%s.max_columns_per_row: %u is over %d, the longest row an encoder embeds in "
                             "one pass", path, batch->max_columns_per_row, uform_longest_row_k);
    if ((uint64_t)batch->max_rows_per_device * batch->max_columns_per_row > (1u << 24))
        return UFORM_INVALID("%s: %u rows x %u columns is over 2^24 tokens per device", path,
                             batch->max_rows_per_device, batch->max_columns_per_row);
    if (batch->max_segments_per_device > 4096)
        return UFORM_INVALID("%s.max_segments_per_device: %u is over 4096", path, batch->max_segments_per_device);
    if (batch->max_choices_per_item > 256)
        return UFORM_INVALID("%s.max_choices_per_item: %u is over 256 bytes", path, batch->max_choices_per_item);
    if (!batch->image.patch_side) batch->image.patch_side = 16;
    if (batch->image.patch_side > 64)
        return UFORM_INVALID("%s.image.patch_side: %u is over 64 pixels", path, batch->image.patch_side);
    if (!batch->image.channels) batch->image.channels = 3;
    if (batch->image.channels != 1 && batch->image.channels != 3 && batch->image.channels != 4)
        return UFORM_INVALID("%s.image.channels: %u is not 1 (gray), 3 (RGB) or 4 (RGBA)", path, batch->image.channels);
    uform_video_shape_t* video = &batch->video;
    if (!video->patch_side) video->patch_side = 16;
    if (!video->tube_frames) video->tube_frames = 2;
    if (!video->frame_stride) video->frame_stride = 1;
    if (!video->channels) video->channels = 3;
    if (video->patch_side > 64)
        return UFORM_INVALID("%s.video.patch_side: %u is over 64 pixels", path, video->patch_side);
    if (video->tube_frames > 16) return UFORM_INVALID("%s.video.tube_frames: %u is over 16", path, video->tube_frames);
    if (video->frame_stride > 64)
        return UFORM_INVALID("%s.video.frame_stride: %u is over 64", path, video->frame_stride);
    if (video->channels != 1 && video->channels != 3 && video->channels != 4)
        return UFORM_INVALID("%s.video.channels: %u is not 1 (gray), 3 (RGB) or 4 (RGBA)", path, video->channels);
    uform_audio_shape_t* audio = &batch->audio;
    if (!audio->chunk_samples) audio->chunk_samples = 400;
    if (!audio->sample_rate) audio->sample_rate = 16000;
    if (audio->chunk_samples > 65536)
        return UFORM_INVALID("%s.audio.chunk_samples: %u is over 65536", path, audio->chunk_samples);
    if (audio->sample_rate < 1000 || audio->sample_rate > 192000)
        return UFORM_INVALID("%s.audio.sample_rate: %u is not in [1000, 192000]", path, audio->sample_rate);
    return uform_status_success_k;
}

uform_status_t uform_config_derive(uform_config_t* config, uform_trainer_init_vram_t const* given,
                                   char const** error) {
    if (!given) return UFORM_INVALID("config: NULL");
    memset(config, 0, sizeof(*config));
    uform_trainer_init_vram_t* c = &config->given;
    *c = *given;

    if (c->depth == 0 || c->depth > 256) return UFORM_INVALID("config.depth: %u is not in [1, 256]", c->depth);
    if (c->hidden == 0 || c->hidden % 128 || c->hidden > 16384)
        return UFORM_INVALID("config.hidden: %u is not a positive multiple of 128 up to 16384", c->hidden);
    if (c->objective < uform_objective_masked_k || c->objective > uform_objective_joint_k)
        return UFORM_INVALID("config.objective: %d is not masked (1), contrastive (2) or joint (3)", (int)c->objective);

    uform_batch_shape_t* batch = &c->batch;
    UFORM_TRY(uform_batch_shape_derive(batch, "config.batch", error));

    uform_masking_t* masking = &c->masking;
    UFORM_TRY(uform_derive_fraction(&masking->token_mask_probability, 0.15f, "config.masking.token_mask_probability",
                                    error));
    if (!uform_finite(masking->token_mean_span) || (masking->token_mean_span != 0 && masking->token_mean_span < 1))
        return UFORM_INVALID("config.masking.token_mean_span: %g is below 1", (double)masking->token_mean_span);
    if (masking->token_mean_span == 0) masking->token_mean_span = 3;
    UFORM_TRY(uform_derive_fraction(&masking->replace_fraction, 0.8f, "config.masking.replace_fraction", error));
    UFORM_TRY(uform_derive_fraction(&masking->random_fraction, 0.1f, "config.masking.random_fraction", error));
    if (masking->replace_fraction + masking->random_fraction > 1)
        return UFORM_INVALID("config.masking: replace_fraction %g + random_fraction %g is over 1",
                             (double)masking->replace_fraction, (double)masking->random_fraction);
    UFORM_TRY(uform_derive_fraction(&masking->image_mask_ratio, 0.75f, "config.masking.image_mask_ratio", error));
    UFORM_TRY(uform_derive_fraction(&masking->video_mask_ratio, 0.9f, "config.masking.video_mask_ratio", error));
    UFORM_TRY(uform_derive_fraction(&masking->audio_mask_ratio, 0.5f, "config.masking.audio_mask_ratio", error));
    UFORM_TRY(uform_derive_weight(&masking->text_weight, 1, "config.masking.text_weight", error));
    UFORM_TRY(uform_derive_weight(&masking->image_weight, 1, "config.masking.image_weight", error));
    UFORM_TRY(uform_derive_weight(&masking->video_weight, 1, "config.masking.video_weight", error));
    UFORM_TRY(uform_derive_weight(&masking->audio_weight, 1, "config.masking.audio_weight", error));

    uform_contrastive_t* contrastive = &c->contrastive;
    if (contrastive->matryoshka_dimensions_count > UFORM_MAX_MATRYOSHKA_DIMENSIONS)
        return UFORM_INVALID("config.contrastive.matryoshka_dimensions: %zu entries, at most %d",
                             contrastive->matryoshka_dimensions_count, UFORM_MAX_MATRYOSHKA_DIMENSIONS);
    if (contrastive->matryoshka_dimensions_count && !contrastive->matryoshka_dimensions)
        return UFORM_INVALID("config.contrastive.matryoshka_dimensions: NULL with a count of %zu",
                             contrastive->matryoshka_dimensions_count);
    for (size_t i = 0; i != contrastive->matryoshka_dimensions_count; ++i) {
        uint32_t dimension = contrastive->matryoshka_dimensions[i];
        if (dimension == 0 || dimension > c->hidden)
            return UFORM_INVALID("config.contrastive.matryoshka_dimensions[%zu]: %u is not in [1, hidden = %u]", i,
                                 dimension, c->hidden);
        for (size_t j = 0; j != i; ++j)
            if (dimension == config->matryoshka[j])
                return UFORM_INVALID("config.contrastive.matryoshka_dimensions[%zu]: %u is given twice", i, dimension);
        config->matryoshka[i] = dimension;
    }
    if (!contrastive->matryoshka_dimensions_count) config->matryoshka[0] = c->hidden, contrastive->matryoshka_dimensions_count = 1;
    contrastive->matryoshka_dimensions = config->matryoshka;
    if (contrastive->temperature_groups > UFORM_MAX_TEMPERATURE_GROUPS)
        return UFORM_INVALID("config.contrastive.temperature_groups: %u is over %d", contrastive->temperature_groups,
                             UFORM_MAX_TEMPERATURE_GROUPS);
    if (!contrastive->temperature_groups) contrastive->temperature_groups = 1;
    if (!uform_finite(contrastive->inverse_temperature) || contrastive->inverse_temperature < 0)
        return UFORM_INVALID("config.contrastive.inverse_temperature: %g is not a positive finite number",
                             (double)contrastive->inverse_temperature);
    if (contrastive->inverse_temperature == 0) contrastive->inverse_temperature = 10;
    if (!uform_finite(contrastive->bias))
        return UFORM_INVALID("config.contrastive.bias: %g is not finite", (double)contrastive->bias);
    if (contrastive->bias == 0) contrastive->bias = -10;
    if (contrastive->negatives > uform_negatives_named_k)
        return UFORM_INVALID("config.contrastive.negatives: %d is not ambient (1) or named (2)",
                             (int)contrastive->negatives);
    if (contrastive->negatives == uform_negatives_derived_k) contrastive->negatives = uform_negatives_ambient_k;
    UFORM_TRY(uform_derive_weight(&contrastive->ambient_repulsion_weight, 1,
                                  "config.contrastive.ambient_repulsion_weight", error));
    if (!contrastive->max_edges_per_device) contrastive->max_edges_per_device = 64 * batch->max_segments_per_device;
    if (contrastive->pair_loss > uform_pair_loss_sigmoid_k)
        return UFORM_INVALID("config.contrastive.pair_loss: %d is not a pair-loss form (0 to 3)",
                             (int)contrastive->pair_loss);
    if (contrastive->pair_loss == uform_pair_loss_derived_k) contrastive->pair_loss = uform_pair_loss_sigmoid_k;

    uform_late_interaction_t* late = &c->late_interaction;
    if (!uform_finite(late->weight) || late->weight < 0)
        return UFORM_INVALID("config.late_interaction.weight: %g is not a finite non-negative number",
                             (double)late->weight);
    if (late->width % 8 || late->width > 4096)
        return UFORM_INVALID("config.late_interaction.width: %u is not a multiple of 8 up to 4096", late->width);
    if (!late->width) late->width = 128;
    if (!uform_finite(late->inverse_temperature) || late->inverse_temperature < 0)
        return UFORM_INVALID("config.late_interaction.inverse_temperature: %g is not a finite positive number",
                             (double)late->inverse_temperature);
    if (!late->inverse_temperature) late->inverse_temperature = 1;
    if (!uform_finite(late->bias))
        return UFORM_INVALID("config.late_interaction.bias: %g is not finite", (double)late->bias);
    if ((unsigned)late->pair_loss > uform_pair_loss_sigmoid_k)
        return UFORM_INVALID("config.late_interaction.pair_loss: %d is not a pair-loss form", (int)late->pair_loss);
    if (late->pair_loss == uform_pair_loss_derived_k) late->pair_loss = uform_pair_loss_ranked_k;
    /* A query's rows, and its choice position, fit in one row of the batch. */
    uint32_t room = batch->max_columns_per_row - (c->choices.weight > 0 && batch->max_columns_per_row > 1);
    if (late->weight > 0 && !late->max_query_span) late->max_query_span = room < 32 ? room : 32;
    if (late->weight > 0 && late->max_query_span > room)
        return UFORM_INVALID("config.late_interaction.max_query_span: %u does not fit config.batch.max_columns_per_row "
                             "= %u%s",
                             late->max_query_span, batch->max_columns_per_row,
                             room < batch->max_columns_per_row ? ", one column of which is the choice position" : "");
    /* The span marks a run with a token head in the config a checkpoint records: none without the term. */
    if (!(late->weight > 0)) late->max_query_span = 0;
    if (!late->max_query_tokens_per_device)
        late->max_query_tokens_per_device = batch->max_segments_per_device * late->max_query_span;
    if (late->weight > 0 && late->max_query_tokens_per_device < late->max_query_span)
        return UFORM_INVALID("config.late_interaction.max_query_tokens_per_device: %u is below max_query_span = %u, "
                             "so no query would fit",
                             late->max_query_tokens_per_device, late->max_query_span);
    if (!late->max_documents_per_device) late->max_documents_per_device = batch->max_segments_per_device;
    if (!late->max_document_tokens_per_device)
        late->max_document_tokens_per_device = batch->max_rows_per_device * batch->max_columns_per_row;
    if (!uform_finite(c->choices.weight) || c->choices.weight < 0)
        return UFORM_INVALID("config.choices.weight: %g is not a finite non-negative number", (double)c->choices.weight);
    if (c->choices.weight > 0 && !batch->max_choices_per_item)
        return UFORM_INVALID("config.choices.weight: %g needs config.batch.max_choices_per_item",
                             (double)c->choices.weight);

    uform_schedule_t* schedule = &c->schedule;
    if (!schedule->steps) return UFORM_INVALID("config.schedule.steps: missing; the cosine schedule must span a run");
    if (!uform_finite(schedule->learning_rate) || schedule->learning_rate < 0 || schedule->learning_rate > 1)
        return UFORM_INVALID("config.schedule.learning_rate: %g is not in [0, 1]", (double)schedule->learning_rate);
    if (schedule->learning_rate == 0) schedule->learning_rate = 1e-3f;
    if (!uform_finite(schedule->min_learning_rate) || schedule->min_learning_rate < 0 ||
        schedule->min_learning_rate > schedule->learning_rate)
        return UFORM_INVALID("config.schedule.min_learning_rate: %g is not in [0, learning_rate = %g]",
                             (double)schedule->min_learning_rate, (double)schedule->learning_rate);
    if (schedule->min_learning_rate == 0) schedule->min_learning_rate = schedule->learning_rate / 10;
    if (schedule->warmup_steps > schedule->steps)
        return UFORM_INVALID("config.schedule.warmup_steps: %llu is over steps = %llu",
                             (unsigned long long)schedule->warmup_steps, (unsigned long long)schedule->steps);
    if (!schedule->warmup_steps) schedule->warmup_steps = schedule->steps / 20;

    if (c->resume) {
        if (strlen(c->resume) >= sizeof(config->resume))
            return UFORM_INVALID("config.resume: the path is over %zu bytes", sizeof(config->resume) - 1);
        strcpy(config->resume, c->resume);
        c->resume = config->resume;
    }
    config->beta1 = 0.9f, config->beta2 = 0.95f, config->epsilon = 1e-8f;
    config->weight_decay = 0.1f, config->clip_norm = 1.0f;
    return uform_status_success_k;
}

size_t uform_config_to_json(uform_config_t const* config, char* out, size_t capacity) {
    uform_trainer_init_vram_t const* c = &config->given;
    char dimensions[256] = "";
    size_t used = 0;
    for (size_t i = 0; i != c->contrastive.matryoshka_dimensions_count; ++i)
        used += snprintf(dimensions + used, sizeof(dimensions) - used, "%s%u", i ? ", " : "", config->matryoshka[i]);
    return (size_t)snprintf(
        out, capacity,
        "{\"depth\": %u, \"hidden\": %u, \"objective\": %d, \"seed\": %llu, "
        "\"batch\": {\"max_rows_per_device\": %u, \"max_segments_per_device\": %u, \"max_columns_per_row\": %u, "
        "\"max_bags_per_device\": %u, \"max_choices_per_item\": %u, "
        "\"image\": {\"patch_side\": %u, \"channels\": %u}, "
        "\"video\": {\"patch_side\": %u, \"tube_frames\": %u, \"frame_stride\": %u, \"channels\": %u}, "
        "\"audio\": {\"chunk_samples\": %u, \"sample_rate\": %u}}, "
        "\"masking\": {\"token_mask_probability\": %.9g, \"token_mean_span\": %.9g, \"replace_fraction\": %.9g, "
        "\"random_fraction\": %.9g, \"text_weight\": %.9g, \"image_mask_ratio\": %.9g, \"image_weight\": %.9g, "
        "\"video_mask_ratio\": %.9g, \"video_weight\": %.9g, \"audio_mask_ratio\": %.9g, \"audio_weight\": %.9g}, "
        "\"contrastive\": {\"matryoshka_dimensions\": [%s], \"temperature_groups\": %u, "
        "\"inverse_temperature\": %.9g, \"bias\": %.9g, \"negatives\": %d, \"ambient_repulsion_weight\": %.9g, "
        "\"max_edges_per_device\": %u, \"pair_loss\": %d}, "
        "\"late_interaction\": {\"weight\": %.9g, \"width\": %u, \"inverse_temperature\": %.9g, \"bias\": %.9g, "
        "\"max_query_span\": %u, \"max_query_tokens_per_device\": %u, \"max_documents_per_device\": %u, "
        "\"max_document_tokens_per_device\": %u, \"pair_loss\": %d}, \"choices\": {\"weight\": %.9g}, "
        "\"schedule\": {\"learning_rate\": %.9g, \"min_learning_rate\": %.9g, \"warmup_steps\": %llu, \"steps\": %llu}, "
        "\"optimizer\": {\"beta1\": %.9g, \"beta2\": %.9g, \"epsilon\": %.9g, \"weight_decay\": %.9g, "
        "\"clip_norm\": %.9g}}",
        c->depth, c->hidden, (int)c->objective, (unsigned long long)c->seed, c->batch.max_rows_per_device,
        c->batch.max_segments_per_device, c->batch.max_columns_per_row, c->batch.max_bags_per_device,
        c->batch.max_choices_per_item, c->batch.image.patch_side, c->batch.image.channels, c->batch.video.patch_side,
        c->batch.video.tube_frames, c->batch.video.frame_stride, c->batch.video.channels, c->batch.audio.chunk_samples,
        c->batch.audio.sample_rate,
        (double)c->masking.token_mask_probability, (double)c->masking.token_mean_span,
        (double)c->masking.replace_fraction, (double)c->masking.random_fraction, (double)c->masking.text_weight,
        (double)c->masking.image_mask_ratio, (double)c->masking.image_weight, (double)c->masking.video_mask_ratio,
        (double)c->masking.video_weight, (double)c->masking.audio_mask_ratio, (double)c->masking.audio_weight,
        dimensions, c->contrastive.temperature_groups, (double)c->contrastive.inverse_temperature,
        (double)c->contrastive.bias, (int)c->contrastive.negatives, (double)c->contrastive.ambient_repulsion_weight,
        c->contrastive.max_edges_per_device, (int)c->contrastive.pair_loss, (double)c->late_interaction.weight,
        c->late_interaction.width, (double)c->late_interaction.inverse_temperature, (double)c->late_interaction.bias,
        c->late_interaction.max_query_span, c->late_interaction.max_query_tokens_per_device,
        c->late_interaction.max_documents_per_device, c->late_interaction.max_document_tokens_per_device,
        (int)c->late_interaction.pair_loss, (double)c->choices.weight, (double)c->schedule.learning_rate,
        (double)c->schedule.min_learning_rate, (unsigned long long)c->schedule.warmup_steps,
        (unsigned long long)c->schedule.steps, (double)config->beta1, (double)config->beta2, (double)config->epsilon,
        (double)config->weight_decay, (double)config->clip_norm);
}

float uform_schedule_rate(uform_schedule_t const* schedule, uint64_t step) {
    double peak = schedule->learning_rate, floor = schedule->min_learning_rate;
    if (step <= schedule->warmup_steps) return (float)(peak * (double)step / (double)schedule->warmup_steps);
    if (step >= schedule->steps) return (float)floor;
    double progress = (double)(step - schedule->warmup_steps) / (double)(schedule->steps - schedule->warmup_steps);
    return (float)(floor + 0.5 * (peak - floor) * (1 + cos(3.141592653589793 * progress)));
}
