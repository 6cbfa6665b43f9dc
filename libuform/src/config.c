/**
 *  @file   config.c
 *  @brief  Derives every default a zero asks for and checks every field, naming the one at fault.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h> /* strtof */
#include <string.h>

#include "config_fields.h"
#include "core.h"

#define UFORM_FIELD(member, kind, derived, most, checkpoint)                                                          \
    {#member, offsetof(uform_trainer_init_vram_t, member), uform_field_##kind##_k, derived, most, checkpoint},
uform_field_t const uform_fields[uform_fields_count_k] = {UFORM_CONFIG_FIELDS(UFORM_FIELD)};

/* The code here and in `checkpoint.c` reads each field as its kind's C type, and what a checkpoint reads back as a
   count: a row of the wrong kind fails to compile. */
#define UFORM_FIELD_TYPE_count uint32_t
#define UFORM_FIELD_TYPE_steps uint64_t
#define UFORM_FIELD_TYPE_real float
#define UFORM_FIELD_TYPE_fraction float
#define UFORM_FIELD_TYPE_weight float
#define UFORM_FIELD_TYPE_choice int /* every enumeration of `uform.h` is an int's size */
#define UFORM_FIELD_TYPE_dimensions uint32_t const*
#define UFORM_FIELD_MISTYPED(member, kind, derived, most, checkpoint)                                                 \
    +(sizeof(((uform_trainer_init_vram_t*)0)->member) != sizeof(UFORM_FIELD_TYPE_##kind) ||                          \
      ((checkpoint) && uform_field_##kind##_k != uform_field_count_k))
typedef char uform_fields_typed[(0 UFORM_CONFIG_FIELDS(UFORM_FIELD_MISTYPED)) ? -1 : 1];

/* Each field of a config inside `[begin, end)` by its row alone, `base` pointing at `begin`: zero takes what it
   derives, and the value is checked as its kind asks. Messages name `path`, then the row's name past `skip` bytes. */
static uform_status_t uform_fields_derive(void* base, size_t begin, size_t end, char const* path, size_t skip,
                                          char const** error) {
    for (size_t i = 0; i != uform_fields_count_k; ++i) {
        uform_field_t const* field = &uform_fields[i];
        if (field->offset < begin || field->offset >= end) continue;
        void* at = (char*)base + (field->offset - begin);
        char const* name = field->name + skip;
        switch (field->kind) {
        case uform_field_count_k: {
            uint32_t* value = at;
            if (field->most && *value > field->most)
                return UFORM_INVALID("%s.%s: %u is over %u", path, name, *value, field->most);
            if (!*value) *value = (uint32_t)field->derived;
            break;
        }
        case uform_field_real_k:
        case uform_field_fraction_k:
        case uform_field_weight_k: {
            float* value = at;
            if (!isfinite(*value) || (field->kind != uform_field_real_k && *value < 0) ||
                (field->kind == uform_field_fraction_k && *value > 1))
                return UFORM_INVALID("%s.%s: %g is %s", path, name, uform_printed(*value),
                                     field->kind == uform_field_fraction_k ? "not in [0, 1]"
                                     : field->kind == uform_field_weight_k ? "not a finite non-negative number"
                                                                           : "not finite");
            if (*value == 0) *value = (float)field->derived;
            break;
        }
        case uform_field_choice_k:
            if (!*(int*)at) *(int*)at = (int)field->derived;
            break;
        case uform_field_steps_k:
        case uform_field_dimensions_k: break;
        }
    }
    return uform_status_success_k;
}

/* What the batch shape's fields ask of each other, once its rows have derived and checked each alone. */
static uform_status_t uform_batch_shape_check(uform_batch_shape_t* batch, char const* path, char const** error) {
    int derived = !batch->max_segments_per_device;
    if (derived) batch->max_segments_per_device = 8 * batch->max_rows_per_device;
    if (!batch->max_bags_per_device) batch->max_bags_per_device = batch->max_segments_per_device;
    if (batch->max_columns_per_row > uform_longest_row_k)
        return UFORM_INVALID("%s.max_columns_per_row: %u is over %d, the longest row an encoder embeds in "
                             "one pass", path, batch->max_columns_per_row, uform_longest_row_k);
    if ((uint64_t)batch->max_rows_per_device * batch->max_columns_per_row > (1u << 24))
        return UFORM_INVALID("%s: %u rows x %u columns is over 2^24 tokens per device", path,
                             batch->max_rows_per_device, batch->max_columns_per_row);
    if (batch->max_segments_per_device > 4096)
        return UFORM_INVALID("%s.max_segments_per_device: %u is over 4096%s", path, batch->max_segments_per_device,
                             derived ? " (derived as 8 per row: give it, 4096 or fewer)" : "");
    if (batch->image.channels != 1 && batch->image.channels != 3 && batch->image.channels != 4)
        return UFORM_INVALID("%s.image.channels: %u is not 1 (gray), 3 (RGB) or 4 (RGBA)", path, batch->image.channels);
    if (batch->video.channels != 1 && batch->video.channels != 3 && batch->video.channels != 4)
        return UFORM_INVALID("%s.video.channels: %u is not 1 (gray), 3 (RGB) or 4 (RGBA)", path, batch->video.channels);
    if (batch->audio.sample_rate < 1000 || batch->audio.sample_rate > 192000)
        return UFORM_INVALID("%s.audio.sample_rate: %u is not in [1000, 192000]", path, batch->audio.sample_rate);
    return uform_status_success_k;
}

/* The batch shape's defaults and limits, written once for a trainer's config and for `uform_media_tokens`, whose
   messages name its fields from `path` ("config.batch", "shape"). */
uform_status_t uform_batch_shape_derive(uform_batch_shape_t* batch, char const* path, char const** error) {
    size_t begin = offsetof(uform_trainer_init_vram_t, batch);
    UFORM_TRY(uform_fields_derive(batch, begin, begin + sizeof(*batch), path, strlen("batch."), error));
    return uform_batch_shape_check(batch, path, error);
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
    if ((unsigned)c->determinism > uform_determinism_fast_k)
        return UFORM_INVALID("config.determinism: %d is not bitwise (1) or fast (2)", (int)c->determinism);

    UFORM_TRY(uform_fields_derive(c, 0, sizeof(*c), "config", 0, error));
    uform_batch_shape_t* batch = &c->batch;
    UFORM_TRY(uform_batch_shape_check(batch, "config.batch", error));

    uform_masking_t* masking = &c->masking;
    if (masking->token_mean_span < 1)
        return UFORM_INVALID("config.masking.token_mean_span: %g is below 1", (double)masking->token_mean_span);
    if (given->masking.token_mean_span > batch->max_columns_per_row) /* cut at items' ends: too few chosen; given only */
        return UFORM_INVALID("config.masking.token_mean_span: %g is over config.batch.max_columns_per_row = %u, so "
                             "spans would be cut at items' ends and fewer positions chosen than token_mask_probability",
                             (double)masking->token_mean_span, batch->max_columns_per_row);
    if (masking->replace_fraction + masking->random_fraction > 1)
        return UFORM_INVALID("config.masking: replace_fraction %g + random_fraction %g is over 1%s",
                             (double)masking->replace_fraction, (double)masking->random_fraction,
                             given->masking.random_fraction == 0 || given->masking.replace_fraction == 0
                                 ? " (a fraction given 0 derives its default; 1e-30 asks for nearly none)"
                                 : "");

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
    if (contrastive->negatives > uform_negatives_named_k)
        return UFORM_INVALID("config.contrastive.negatives: %d is not ambient (1) or named (2)",
                             (int)contrastive->negatives);
    if (!contrastive->max_edges_per_device) contrastive->max_edges_per_device = 64 * batch->max_segments_per_device;
    if (contrastive->pair_loss > uform_pair_loss_sigmoid_k)
        return UFORM_INVALID("config.contrastive.pair_loss: %d is not a pair-loss form (0 to 3)",
                             (int)contrastive->pair_loss);

    uform_late_interaction_t* late = &c->late_interaction;
    if (late->width % 8 || late->width > 4096)
        return UFORM_INVALID("config.late_interaction.width: %u is not a multiple of 8 up to 4096", late->width);
    if ((unsigned)late->pair_loss > uform_pair_loss_sigmoid_k)
        return UFORM_INVALID("config.late_interaction.pair_loss: %d is not a pair-loss form (0 to 3)",
                             (int)late->pair_loss);
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
    if (c->choices.weight > 0 && !batch->max_choices_per_item)
        return UFORM_INVALID("config.choices.weight: %g needs config.batch.max_choices_per_item",
                             (double)c->choices.weight);

    uform_schedule_t* schedule = &c->schedule;
    if (!schedule->steps)
        return UFORM_INVALID("config.schedule.steps: missing (0 or absent); the cosine schedule must span a run of a step or more");
    if (schedule->min_learning_rate < 0 || schedule->min_learning_rate > schedule->learning_rate)
        return UFORM_INVALID("config.schedule.min_learning_rate: %g is not in [0, learning_rate = %g]",
                             (double)schedule->min_learning_rate, (double)schedule->learning_rate);
    if (schedule->min_learning_rate == 0) schedule->min_learning_rate = schedule->learning_rate / 10;
    if (schedule->warmup_steps > schedule->steps)
        return UFORM_INVALID("config.schedule.warmup_steps: %llu is over steps = %llu",
                             (unsigned long long)schedule->warmup_steps, (unsigned long long)schedule->steps);
    if (!schedule->warmup_steps) schedule->warmup_steps = schedule->steps / 20;

    if (c->resume) {
        if (!c->resume[0])
            return UFORM_INVALID("config.resume: empty; leave it NULL (None in Python) to start a new run");
        if (strlen(c->resume) >= sizeof(config->resume))
            return UFORM_INVALID("config.resume: the path is over %zu bytes", sizeof(config->resume) - 1);
        strcpy(config->resume, c->resume);
        c->resume = config->resume;
    }
    config->beta1 = 0.9f, config->beta2 = 0.95f, config->epsilon = 1e-8f;
    config->weight_decay = 0.1f, config->clip_norm = 1.0f;
    return uform_status_success_k;
}

/* JSON written into a caller's buffer as snprintf writes: cut to fit, with `length` counting all of it. */
typedef struct uform_json_text_t {
    char* data;
    size_t capacity, length;
} uform_json_text_t;

static void uform_json_print(uform_json_text_t* text, char const* format, ...) {
    va_list arguments;
    va_start(arguments, format);
    int fits = text->length < text->capacity;
    int length = vsnprintf(fits ? text->data + text->length : NULL, fits ? text->capacity - text->length : 0, format,
                           arguments);
    va_end(arguments);
    if (length > 0) text->length += (size_t)length;
}

/* A float32 in the fewest digits that read back as the same float: 0.001, not 0.00100000005. */
static void uform_json_float(uform_json_text_t* text, char const* before, float value) {
    char digits[32];
    for (int precision = 6; precision <= 9; ++precision) {
        snprintf(digits, sizeof(digits), "%.*g", precision, (double)value);
        if (strtof(digits, NULL) == value) break;
    }
    uform_json_print(text, "%s%s", before, digits);
}

size_t uform_config_to_json(uform_config_t const* config, char* out, size_t capacity) {
    uform_json_text_t text = {out, capacity, 0};
    char const* scope = ""; /* the objects the previous row sits in: "batch.image." is two */
    size_t scope_length = 0;
    int first = 1; /* nothing written yet in the innermost open object */
    uform_json_print(&text, "{");
    for (size_t i = 0; i != uform_fields_count_k; ++i) {
        uform_field_t const* field = &uform_fields[i];
        char const* dot = strrchr(field->name, '.');
        size_t length = dot ? (size_t)(dot - field->name) + 1 : 0, shared = 0;
        for (size_t k = 0; k != length && k != scope_length && field->name[k] == scope[k]; ++k)
            if (scope[k] == '.') shared = k + 1;
        for (size_t k = shared; k != scope_length; ++k) /* close the previous row's objects this one is not in */
            if (scope[k] == '.') uform_json_print(&text, "}"), first = 0;
        for (size_t k = shared, start = shared; k != length; ++k) /* and open those it is in */
            if (field->name[k] == '.') {
                uform_json_print(&text, "%s\"%.*s\": {", first ? "" : ", ", (int)(k - start), field->name + start);
                start = k + 1, first = 1;
            }
        uform_json_print(&text, "%s\"%s\": ", first ? "" : ", ", field->name + length);
        scope = field->name, scope_length = length, first = 0;
        void const* at = (char const*)&config->given + field->offset;
        switch (field->kind) {
        case uform_field_count_k: uform_json_print(&text, "%u", *(uint32_t const*)at); break;
        case uform_field_steps_k: uform_json_print(&text, "%llu", (unsigned long long)*(uint64_t const*)at); break;
        case uform_field_choice_k: uform_json_print(&text, "%d", *(int const*)at); break;
        case uform_field_real_k:
        case uform_field_fraction_k:
        case uform_field_weight_k: uform_json_float(&text, "", *(float const*)at); break;
        case uform_field_dimensions_k:
            uform_json_print(&text, "[");
            for (size_t k = 0; k != config->given.contrastive.matryoshka_dimensions_count; ++k)
                uform_json_print(&text, "%s%u", k ? ", " : "", config->matryoshka[k]);
            uform_json_print(&text, "]");
            break;
        }
    }
    for (size_t k = 0; k != scope_length; ++k)
        if (scope[k] == '.') uform_json_print(&text, "}");
    uform_json_float(&text, ", \"optimizer\": {\"beta1\": ", config->beta1);
    uform_json_float(&text, ", \"beta2\": ", config->beta2);
    uform_json_float(&text, ", \"epsilon\": ", config->epsilon);
    uform_json_float(&text, ", \"weight_decay\": ", config->weight_decay);
    uform_json_float(&text, ", \"clip_norm\": ", config->clip_norm);
    uform_json_print(&text, "}}");
    return text.length;
}

float uform_schedule_rate(uform_schedule_t const* schedule, uint64_t step) {
    double peak = schedule->learning_rate, floor = schedule->min_learning_rate;
    if (step <= schedule->warmup_steps) return (float)(peak * (double)step / (double)schedule->warmup_steps);
    if (step >= schedule->steps) return (float)floor;
    double progress = (double)(step - schedule->warmup_steps) / (double)(schedule->steps - schedule->warmup_steps);
    return (float)(floor + 0.5 * (peak - floor) * (1 + cos(3.141592653589793 * progress)));
}
