/**
 *  @file   config_fields.h
 *  @brief  Every field of `uform_trainer_init_vram_t`, once: where it sits, the kind of value it holds,
 *          what zero derives, and what a checkpoint does with it.
 *
 *  `config.c` derives and checks each field by its row and writes the rows as the JSON a checkpoint's
 *  metadata records; `checkpoint.c` reads the recorded rows back, refuses a checkpoint lacking a needed
 *  one and a resume that changes a fixed one. What one field alone cannot say (defaults derived from
 *  other fields, limits between fields, enumerations' names) `config.c` says by hand.
 *
 *  The rows are in the order checkpoints have always written them. Two members have none: `resume`, a
 *  path no checkpoint records, and `contrastive.matryoshka_dimensions_count`, the length of the array
 *  before it. `tests/test_config.py` checks the rows, `uform.h`, `uform.pxd` and the Python
 *  dataclasses name the same fields.
 */
#ifndef UFORM_CONFIG_FIELDS_H_
#define UFORM_CONFIG_FIELDS_H_

#include "uform.h"

/*  X(member, kind, derived, most, checkpoint):
 *  - member:     its path in `uform_trainer_init_vram_t`, as messages and the JSON name it;
 *  - kind:       `uform_field_kind_t` without its prefix and suffix;
 *  - derived:    what zero derives; 0 where nothing does, or where `config.c` derives it from other fields;
 *  - most:       a count's largest value; 0 where `config.c` bounds it, or nothing does;
 *  - checkpoint: `uform_field_checkpoint_t` bits. */
#define UFORM_CONFIG_FIELDS(X)                                                                                        \
    X(depth, count, 0, 0, uform_field_needed_k | uform_field_fixed_k)                                                 \
    X(hidden, count, 0, 0, uform_field_needed_k | uform_field_fixed_k)                                                \
    X(objective, choice, 0, 0, 0)                                                                                     \
    X(seed, steps, 0, 0, 0)                                                                                           \
    X(batch.max_rows_per_device, count, 64, 0, uform_field_recorded_k)                                                \
    X(batch.max_segments_per_device, count, 0, 0, uform_field_recorded_k)                                             \
    X(batch.max_columns_per_row, count, 512, 0, uform_field_recorded_k)                                               \
    X(batch.max_bags_per_device, count, 0, 0, 0)                                                                      \
    X(batch.max_choices_per_item, count, 0, 256, 0)                                                                   \
    X(batch.image.patch_side, count, 16, 64, uform_field_fixed_k)                                                     \
    X(batch.image.channels, count, 3, 0, uform_field_fixed_k)                                                         \
    X(batch.video.patch_side, count, 16, 64, uform_field_fixed_k)                                                     \
    X(batch.video.tube_frames, count, 2, 16, uform_field_fixed_k)                                                     \
    X(batch.video.frame_stride, count, 1, 64, uform_field_recorded_k)                                                 \
    X(batch.video.channels, count, 3, 0, uform_field_fixed_k)                                                         \
    X(batch.audio.chunk_samples, count, 400, 65536, uform_field_fixed_k)                                              \
    X(batch.audio.sample_rate, count, 16000, 0, uform_field_recorded_k)                                               \
    X(masking.token_mask_probability, fraction, 0.15f, 0, 0)                                                          \
    X(masking.token_mean_span, real, 3, 0, 0)                                                                         \
    X(masking.replace_fraction, fraction, 0.8f, 0, 0)                                                                 \
    X(masking.random_fraction, fraction, 0.1f, 0, 0)                                                                  \
    X(masking.text_weight, weight, 1, 0, 0)                                                                           \
    X(masking.image_mask_ratio, fraction, 0.75f, 0, 0)                                                                \
    X(masking.image_weight, weight, 1, 0, 0)                                                                          \
    X(masking.video_mask_ratio, fraction, 0.9f, 0, 0)                                                                 \
    X(masking.video_weight, weight, 1, 0, 0)                                                                          \
    X(masking.audio_mask_ratio, fraction, 0.5f, 0, 0)                                                                 \
    X(masking.audio_weight, weight, 1, 0, 0)                                                                          \
    X(contrastive.matryoshka_dimensions, dimensions, 0, 0, 0)                                                         \
    X(contrastive.temperature_groups, count, 1, UFORM_MAX_TEMPERATURE_GROUPS, uform_field_needed_k | uform_field_fixed_k) \
    X(contrastive.inverse_temperature, weight, 10, 0, 0)                                                              \
    X(contrastive.bias, real, -10, 0, 0)                                                                              \
    X(contrastive.negatives, choice, uform_negatives_ambient_k, 0, 0)                                                 \
    X(contrastive.ambient_repulsion_weight, weight, 1, 0, 0)                                                          \
    X(contrastive.max_edges_per_device, count, 0, 1u << 24, 0)                                                        \
    X(contrastive.pair_loss, choice, uform_pair_loss_sigmoid_k, 0, 0)                                                 \
    X(late_interaction.weight, weight, 0, 0, 0)                                                                       \
    X(late_interaction.width, count, 128, 0, uform_field_recorded_k)                                                  \
    X(late_interaction.inverse_temperature, weight, 1, 0, 0)                                                          \
    X(late_interaction.bias, real, 0, 0, 0)                                                                           \
    X(late_interaction.max_query_span, count, 0, 0, uform_field_recorded_k)                                           \
    X(late_interaction.max_query_tokens_per_device, count, 0, 0, 0)                                                   \
    X(late_interaction.max_documents_per_device, count, 0, 0, 0)                                                      \
    X(late_interaction.max_document_tokens_per_device, count, 0, 0, 0)                                                \
    X(late_interaction.pair_loss, choice, uform_pair_loss_ranked_k, 0, 0)                                             \
    X(choices.weight, weight, 0, 0, 0)                                                                                \
    X(schedule.learning_rate, fraction, 1e-3f, 0, 0)                                                                  \
    X(schedule.min_learning_rate, real, 0, 0, 0)                                                                      \
    X(schedule.warmup_steps, steps, 0, 0, 0)                                                                          \
    X(schedule.steps, steps, 0, 0, 0)                                                                                 \
    X(determinism, choice, uform_determinism_bitwise_k, 0, 0)

/** What a field holds, and the check its kind alone makes. */
typedef enum uform_field_kind_t {
    uform_field_count_k,      /* uint32_t, at most `most` where that is given */
    uform_field_steps_k,      /* uint64_t */
    uform_field_real_k,       /* float, finite */
    uform_field_fraction_k,   /* float in [0, 1] */
    uform_field_weight_k,     /* float, finite and not negative */
    uform_field_choice_k,     /* an enumeration, whose members `config.c` names */
    uform_field_dimensions_k, /* uint32_t const*, counted by the member after it */
} uform_field_kind_t;

/** What a checkpoint does with a field beside writing it: any of these bits reads it back, a count. */
typedef enum uform_field_checkpoint_t {
    uform_field_recorded_k = 1, /* read back: it shapes the model an encoder builds */
    uform_field_needed_k = 2,   /* a checkpoint lacking it is refused */
    uform_field_fixed_k = 4,    /* a resumed run must ask for it as recorded, or, absent, as zero derives */
} uform_field_checkpoint_t;

typedef struct uform_field_t {
    char const* name;
    size_t offset; /* in `uform_trainer_init_vram_t` */
    uform_field_kind_t kind;
    double derived;
    uint32_t most;
    unsigned checkpoint;
} uform_field_t;

#define UFORM_FIELD_COUNT(member, kind, derived, most, checkpoint) +1
enum { uform_fields_count_k = 0 UFORM_CONFIG_FIELDS(UFORM_FIELD_COUNT) };

/** The rows, defined in `config.c`. */
extern uform_field_t const uform_fields[uform_fields_count_k];

#endif /* UFORM_CONFIG_FIELDS_H_ */
