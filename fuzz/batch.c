/**
 *  @file   batch.c
 *  @brief  libFuzzer target: arbitrary bytes decoded into one `uform_trainer_step_t`, stepped
 *          through the public ABI on a tiny trainer.
 *
 *  The decoder hands the library every pointer and length the ABI's contract allows (a tape's
 *  offsets are `count + 1` long, modalities `count`, edge ids `ids_count`, the embeddings
 *  `count x hidden` scalars), each array allocated to exactly that length so AddressSanitizer sees
 *  one element too far, but the values inside are the input's: invalid modalities, offsets that
 *  fall, ids out of range, NaN and negative weights, unknown scalar types. The only thing the
 *  decoder keeps within the contract is memory the caller must own: a tape whose offsets ascend
 *  past what it can allocate is given NULL data.
 *
 *  Findings abort: a status other than success, invalid_argument or unsupported; a failure without
 *  a message; a refused batch that wrote its stats or embeddings or moved the step counter; a
 *  step that trained a different number of items than it was given.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "uform.h"

enum {
    fuzz_hidden_k = 128,
    fuzz_max_items_k = 24,    /* above the trainers' 16 segments, so capacity is tried too */
    fuzz_max_array_k = 4096,  /* the most ids or choice entries the decoder allocates */
    fuzz_max_data_k = 1 << 20 /* the most tape bytes the decoder allocates */
};

void scipy_openblas_set_num_threads(int threads);

/* ---------------------------------------------------------------------------------------------- */
/*  Reading the input                                                                              */
/* ---------------------------------------------------------------------------------------------- */

/* Bytes past the end read as zeros, so every input decodes to some batch. */
typedef struct fuzz_reader_t {
    uint8_t const* at;
    size_t left;
} fuzz_reader_t;

static uint8_t fuzz_u8(fuzz_reader_t* in) {
    if (!in->left) return 0;
    --in->left;
    return *in->at++;
}

static uint64_t fuzz_bytes(fuzz_reader_t* in, int count) {
    uint64_t value = 0;
    for (int i = 0; i != count; ++i) value |= (uint64_t)fuzz_u8(in) << (8 * i);
    return value;
}

static uint32_t fuzz_u32(fuzz_reader_t* in) { return (uint32_t)fuzz_bytes(in, 4); }
static uint64_t fuzz_u64(fuzz_reader_t* in) { return fuzz_bytes(in, 8); }

/* A weight: mostly ordinary, often one of the values validation must think about. */
static float fuzz_weight(fuzz_reader_t* in) {
    static float const palette[] = {1.0f, 0.5f, 0.0f, -0.0f, -1.0f, 1e-45f, 3.4e38f, 2.0f};
    uint8_t pick = fuzz_u8(in);
    if (pick < 160) return palette[pick % 8];
    if (pick < 176) return NAN;
    if (pick < 192) return pick & 1 ? INFINITY : -INFINITY;
    uint32_t bits = fuzz_u32(in);
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
}

/* Every allocation of one input, freed together. */
typedef struct fuzz_arena_t {
    void* blocks[64];
    size_t count;
} fuzz_arena_t;

static void* fuzz_alloc(fuzz_arena_t* arena, size_t bytes) {
    if (arena->count == sizeof(arena->blocks) / sizeof(arena->blocks[0])) abort();
    void* block = malloc(bytes ? bytes : 1);
    if (!block) abort();
    arena->blocks[arena->count++] = block;
    return block;
}

static void fuzz_arena_free(fuzz_arena_t* arena) {
    for (size_t i = 0; i != arena->count; ++i) free(arena->blocks[i]);
    arena->count = 0;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Decoding a batch                                                                               */
/* ---------------------------------------------------------------------------------------------- */

/* The count a tape claims: usually the batch's, sometimes one off or anything small. */
static size_t fuzz_tape_count(fuzz_reader_t* in, size_t count) {
    uint8_t pick = fuzz_u8(in);
    if (pick < 224) return count;
    if (pick < 240) return pick & 1 ? count + 1 : count ? count - 1 : 0;
    return pick % 32;
}

/* `count + 1` offsets in units of `element` bytes: mostly ascending by small steps, sometimes
   falling, jumping far or huge; data as long as the highest offset needs, or NULL past our means.
   `mode` 0 leaves the tape empty (both NULL), 1 gives offsets alone, 2 data alone, 3 both. */
static uform_tape_t fuzz_tape(fuzz_reader_t* in, fuzz_arena_t* arena, size_t count, size_t element, int mode) {
    uform_tape_t tape = {NULL, NULL, count, 0};
    if (mode == 0) return tape;
    uint64_t* offsets = fuzz_alloc(arena, (count + 1) * sizeof(uint64_t));
    offsets[0] = fuzz_u8(in) % 4;
    uint64_t highest = offsets[0];
    int ascending = 1;
    for (size_t i = 0; i != count; ++i) {
        uint8_t step = fuzz_u8(in);
        uint64_t next = offsets[i];
        if (step < 232) next += step % 48;                             /* 0 is an empty item */
        else if (step < 240) next += fuzz_bytes(in, 2);                /* longer than a row */
        else if (step < 248) next -= next ? 1 + fuzz_u8(in) % (next < 8 ? next : 8) : 0; /* falls */
        else if (step < 252) next = fuzz_u64(in);                      /* anywhere */
        else next = UINT64_MAX - fuzz_u8(in);                          /* near the top */
        offsets[i + 1] = next;
        if (next < offsets[i]) ascending = 0;
        if (next > highest) highest = next;
    }
    if (mode & 1) tape.offsets = offsets;
    if (mode & 2) {
        size_t bytes = highest * element;
        if (highest <= fuzz_max_data_k) {
            uint8_t* data = fuzz_alloc(arena, bytes);
            for (size_t i = 0; i != bytes; ++i) data[i] = (uint8_t)(i * 131 + highest);
            tape.data = data;
            /* Now and then the tape says it holds less than its offsets reach: refused by its size. */
            tape.size = fuzz_u8(in) < 16 && highest ? highest - 1 : highest;
        } else if (!ascending) { /* the library must refuse the falling offsets before it reads data */
            tape.data = fuzz_alloc(arena, 1), tape.size = 1;
        }
    }
    return tape;
}

/* Compressed sparse rows over `count` items, mostly well formed, sometimes not at all. */
static uform_edges_view_t fuzz_edges(fuzz_reader_t* in, fuzz_arena_t* arena, size_t count) {
    uform_edges_view_t edges = {NULL, NULL, NULL, 0};
    uint8_t mode = fuzz_u8(in);
    if (mode < 96) return edges;
    if (mode < 104) { /* ids without offsets */
        edges.ids_count = 1 + fuzz_u8(in) % 4;
        edges.ids = fuzz_alloc(arena, edges.ids_count * sizeof(uint32_t));
        memset((void*)edges.ids, 0, edges.ids_count * sizeof(uint32_t));
        return edges;
    }
    uint32_t* offsets = fuzz_alloc(arena, (count + 1) * sizeof(uint32_t));
    int arbitrary = mode >= 232;
    offsets[0] = arbitrary ? fuzz_u8(in) % 3 : 0;
    for (size_t i = 0; i != count; ++i) {
        uint8_t run = fuzz_u8(in);
        if (!arbitrary || run < 160) offsets[i + 1] = offsets[i] + run % 4;
        else if (run < 208) offsets[i + 1] = offsets[i] - run % 3;
        else offsets[i + 1] = fuzz_u32(in);
    }
    uint64_t claimed = offsets[count];
    uint8_t pick = fuzz_u8(in);
    if (pick >= 240) claimed = pick & 1 ? claimed + 1 : claimed ? claimed - 1 : 0;
    if (claimed > fuzz_max_array_k) claimed = fuzz_u8(in) % 8;
    edges.offsets = offsets;
    edges.ids_count = claimed;
    uint32_t* ids = fuzz_alloc(arena, claimed * sizeof(uint32_t));
    /* Each item's run ascends from a small start, so most runs are valid; some name the item itself,
       some run past the items, and raw values say anything. Ids no run reaches come last. */
    size_t k = 0;
    for (size_t i = 0; i != count; ++i) {
        uint32_t id = fuzz_u8(in) % 8;
        uint64_t end = offsets[i + 1] < claimed ? offsets[i + 1] : claimed;
        for (; k < end; ++k) {
            uint8_t gap = fuzz_u8(in);
            ids[k] = gap < 240 ? id : fuzz_u32(in);
            id += 1 + gap % 3;
        }
    }
    for (; k < claimed; ++k) ids[k] = fuzz_u8(in) % 8;
    edges.ids = ids;
    if (fuzz_u8(in) >= 128) {
        float* weights = fuzz_alloc(arena, claimed * sizeof(float));
        for (size_t k = 0; k != claimed; ++k) weights[k] = fuzz_weight(in);
        edges.weights = weights;
    }
    return edges;
}

/* Small unsigned values, sometimes any 32 bits. */
static uint32_t* fuzz_labels(fuzz_reader_t* in, fuzz_arena_t* arena, size_t count, uint8_t common, uint8_t modulus) {
    uint32_t* labels = fuzz_alloc(arena, count * sizeof(uint32_t));
    for (size_t i = 0; i != count; ++i) {
        uint8_t pick = fuzz_u8(in);
        labels[i] = pick < common ? pick % modulus : fuzz_u32(in);
    }
    return labels;
}

/* ---------------------------------------------------------------------------------------------- */
/*  The trainers                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

static uform_executor_t fuzz_cpu;
static uform_trainer_t fuzz_trainers[3];
static uint64_t fuzz_steps[3]; /* each trainer's step counter as the stats have reported it */

static void fuzz_die(char const* what, uform_status_t status, char const* error) {
    fprintf(stderr, "fuzz/batch: %s (status %d): %s\n", what, (int)status, error ? error : "(no message)");
    abort();
}

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    (void)argc, (void)argv;
    scipy_openblas_set_num_threads(1);
    char const* error = NULL;
    uform_status_t status = uform_executor_init_ram(1, &fuzz_cpu, &error);
    if (status != uform_status_success_k) fuzz_die("executor", status, error);
    static uint32_t const widths[2] = {64, 128};
    /* Small enough that a step takes about a millisecond: 4 rows of 32 columns, 16 items. */
    uform_trainer_init_vram_t config = {
        .depth = 1,
        .hidden = fuzz_hidden_k,
        .batch = {.max_rows_per_device = 4, .max_columns_per_row = 32, .max_segments_per_device = 16,
                  .max_bags_per_device = 6, .max_choices_per_item = 4},
        .contrastive = {.temperature_groups = 2, .max_edges_per_device = 48},
        .choices = {.weight = 1},
        .schedule = {.steps = 1000000000},
        .seed = 7,
    };
    uform_objective_t objectives[3] = {uform_objective_joint_k, uform_objective_contrastive_k, uform_objective_masked_k};
    for (int t = 0; t != 3; ++t) {
        config.objective = objectives[t];
        /* The contrastive-only trainer takes the other branches: named negatives, ranked pairs, widths. */
        if (t == 1) {
            config.contrastive.negatives = uform_negatives_named_k;
            config.contrastive.pair_loss = uform_pair_loss_ranked_k;
            config.contrastive.matryoshka_dimensions = widths;
            config.contrastive.matryoshka_dimensions_count = 2;
        }
        status = uform_trainer_init_ram(fuzz_cpu, &config, NULL, &fuzz_trainers[t], &error);
        if (status != uform_status_success_k) fuzz_die("trainer", status, error);
    }
    return 0;
}

/* One item of one byte: a step that always trains, to read the step counter through the ABI. */
static void fuzz_check_counter(int t) {
    static uform_modality_t const text[1] = {uform_modality_text_k};
    static uint64_t const offsets[2] = {0, 1};
    uform_trainer_step_t step = {.count = 1, .modalities = text, .contents = {"x", offsets, 1, 1}};
    char const* error = NULL;
    uform_status_t status = uform_trainer_step(fuzz_trainers[t], &step, &error);
    if (status != uform_status_success_k) fuzz_die("a one-byte batch was refused", status, error);
    if (step.stats.step != fuzz_steps[t] + !step.stats.skipped) {
        fprintf(stderr, "fuzz/batch: the step counter moved from %llu to %llu over a refused batch\n",
                (unsigned long long)fuzz_steps[t], (unsigned long long)step.stats.step);
        abort();
    }
    fuzz_steps[t] = step.stats.step;
}

int LLVMFuzzerTestOneInput(uint8_t const* data, size_t size) {
    fuzz_reader_t in = {data, size};
    fuzz_arena_t arena = {{0}, 0};
    uform_trainer_step_t step;
    memset(&step, 0, sizeof(step));

    uint8_t head = fuzz_u8(&in), flags = fuzz_u8(&in);
    int t = head % 3;
    size_t count = fuzz_u8(&in) % (fuzz_max_items_k + 1);
    int huge = head >= 252; /* a count no array could hold: refused before any array is read */
    step.count = huge ? (size_t)fuzz_u64(&in) | ((size_t)1 << 40) : count;
    if (!huge) {
        if (!(flags & 0x01)) {
            uform_modality_t* modalities = fuzz_alloc(&arena, count * sizeof(uform_modality_t));
            for (size_t i = 0; i != count; ++i) {
                uint8_t pick = fuzz_u8(&in);
                static int const odd[8] = {0, 2, 3, 4, 5, -1, 1 << 30, 1};
                modalities[i] = pick < 224 ? uform_modality_text_k
                                : pick < 248 ? (uform_modality_t)odd[pick % 8]
                                             : (uform_modality_t)fuzz_u32(&in);
            }
            step.modalities = modalities;
        }
        uint8_t shape = fuzz_u8(&in);
        step.contents = fuzz_tape(&in, &arena, fuzz_tape_count(&in, count), 1, shape < 16 ? shape % 4 : 3);
        if (flags & 0x02) step.bags = fuzz_labels(&in, &arena, count, 232, 14);
        if (flags & 0x04) step.temperature_groups = fuzz_labels(&in, &arena, count, 232, 3);
        if (flags & 0x08) step.sides = (uform_late_interaction_side_t const*)fuzz_labels(&in, &arena, count, 16, 5);
        if (flags & 0x10) {
            uint8_t modes = fuzz_u8(&in);
            step.choices = fuzz_tape(&in, &arena, fuzz_tape_count(&in, count), 1, modes % 4);
            step.choice_targets = fuzz_tape(&in, &arena, fuzz_tape_count(&in, count), sizeof(float), (modes >> 2) % 4);
        }
        step.attract = fuzz_edges(&in, &arena, count);
        step.repel = fuzz_edges(&in, &arena, count);
        step.ignore = fuzz_edges(&in, &arena, count);
    }
    size_t embeddings_bytes = 0;
    if (flags & 0x20) {
        uint8_t pick = fuzz_u8(&in);
        step.embeddings_scalar = pick < 240 ? (uform_scalar_t)(pick % 4) : (uform_scalar_t)(int32_t)fuzz_u32(&in);
        size_t scalar = step.embeddings_scalar == uform_scalar_f32_k ? 4 : step.embeddings_scalar == uform_scalar_i8_k ? 1 : 2;
        embeddings_bytes = (huge ? 1 : count) * fuzz_hidden_k * scalar;
        step.embeddings = fuzz_alloc(&arena, embeddings_bytes);
        memset(step.embeddings, 0xA5, embeddings_bytes);
    }

    uform_trainer_stats_t untouched;
    memset(&untouched, 0xA5, sizeof(untouched));
    step.stats = untouched;
    char const* error = NULL;
    uform_status_t status = uform_trainer_step(fuzz_trainers[t], &step, &error);
    if (status == uform_status_success_k) {
        if (step.stats.items != step.count) {
            fprintf(stderr, "fuzz/batch: %zu items given, %llu trained\n", step.count,
                    (unsigned long long)step.stats.items);
            abort();
        }
        if (step.stats.step != fuzz_steps[t] + !step.stats.skipped) {
            fprintf(stderr, "fuzz/batch: the step counter went from %llu to %llu over one step (skipped: %u)\n",
                    (unsigned long long)fuzz_steps[t], (unsigned long long)step.stats.step, step.stats.skipped);
            abort();
        }
        fuzz_steps[t] = step.stats.step;
    } else if (status == uform_status_invalid_argument_k || status == uform_status_unsupported_k) {
        if (!error || !*error) fuzz_die("a refusal without a message", status, error);
        if (memcmp(&step.stats, &untouched, sizeof(untouched)) != 0) fuzz_die("a refused batch wrote stats", status, error);
        for (size_t i = 0; i != embeddings_bytes; ++i)
            if (((uint8_t*)step.embeddings)[i] != 0xA5) fuzz_die("a refused batch wrote embeddings", status, error);
        /* Every sixteenth refusal, one tiny step shows whether the refused batch moved the counter. */
        if (head % 16 == 0) fuzz_check_counter(t);
    } else {
        fuzz_die("unexpected status", status, error);
    }
    fuzz_arena_free(&arena);
    return 0;
}
