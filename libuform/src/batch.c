/**
 *  @file   batch.c
 *  @brief  Validating a step's inputs and packing them as one device reads them: items cut to a
 *          row, packed first-fit into rows, text masked by keyed draws, and the contrastive cells.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"


/* How messages name the items a verb's caller passed: a trainer's step as `batch.contents[3]`, an encoder's verbs
   as the `contents[3]` (or `texts[3]`) given to them. `decoded` names media a caller decoded ahead; NULL where the
   verb decoded them itself, from the very items it packs. */
typedef struct uform_item_names_t {
    char const* modalities;
    char const* contents;
    char const* decoded;
} uform_item_names_t;

static uform_item_names_t const uform_batch_names = {"batch.modalities", "batch.contents", "step.decoded"};
static uform_item_names_t const uform_encoder_names = {"modalities", "contents", NULL};
static uform_item_names_t const uform_choose_names = {"modalities", "texts", NULL};

uform_status_t uform_packed_init(uform_packed_t* packed, uform_config_t const* config, uform_backend_t const* backend,
                                 void* context, char const** error) {
    uform_batch_shape_t const* batch = &config->given.batch;
    size_t tokens = (size_t)batch->max_rows_per_device * batch->max_columns_per_row;
    size_t segments = batch->max_segments_per_device, words = sizeof(uint32_t);
    size_t choices = segments * batch->max_choices_per_item, snapshot = (segments + 1) * sizeof(uint64_t);
    size_t late = config->given.late_interaction.weight > 0, edges = late * config->given.contrastive.max_edges_per_device;
    size_t widths[uform_media_kinds_k], widest = 0;
    uform_media_widths(&config->given.batch, widths);
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) widest = widths[kind] > widest ? widths[kind] : widest;
    memset(packed, 0, sizeof(*packed));
    /* One block, each array starting on a 64-byte line: the 64-bit offsets first, bytes last. */
    size_t sizes[] = {snapshot, snapshot, snapshot, tokens * words, tokens * words, tokens * words, tokens * words,
                      tokens * words, (uform_vocabulary_k + 1) * words, segments * sizeof(uform_segment_t),
                      segments * words, segments * segments * sizeof(float), batch->max_rows_per_device * words,
                      (segments + 1) * words, choices * sizeof(float), segments * words,
                      late * tokens * words, late * segments * sizeof(uform_span_t), late * segments * words,
                      late * segments * words, late * (segments + 1) * words, edges * words, edges * sizeof(float),
                      tokens * widest * sizeof(float), tokens * words, segments * segments, choices, edges, segments};
    void** arrays[] = {(void**)&packed->offsets, (void**)&packed->choice_snapshot, (void**)&packed->target_snapshot,
                       (void**)&packed->ids, (void**)&packed->positions, (void**)&packed->masked,
                       (void**)&packed->targets, (void**)&packed->order, (void**)&packed->order_offsets,
                       (void**)&packed->segments, (void**)&packed->groups, (void**)&packed->weights,
                       (void**)&packed->row_fill, (void**)&packed->choice_offsets, (void**)&packed->choice_targets,
                       (void**)&packed->content_lengths, (void**)&packed->late_rows, (void**)&packed->late_spans,
                       (void**)&packed->late_item_span, (void**)&packed->late_queries, (void**)&packed->late_offsets,
                       (void**)&packed->late_documents, (void**)&packed->late_weights, (void**)&packed->media_values,
                       (void**)&packed->media_rows, (void**)&packed->cells,
                       (void**)&packed->choice_bytes, (void**)&packed->late_cells, (void**)&packed->sides};
    size_t total = 0, count = sizeof(sizes) / sizeof(sizes[0]);
    for (size_t i = 0; i != count; ++i) total += (sizes[i] + 63) / 64 * 64;
    uform_status_t status = backend->host_allocate(context, total, &packed->memory);
    if (status != uform_status_success_k)
        return uform_fail(error, status, "no host memory to pack batches of %zu tokens: %zu bytes", tokens, total);
    packed->backend = backend, packed->context = context, packed->tokens_capacity = tokens, packed->widest = widest;
    memcpy(packed->widths, widths, sizeof(widths));
    char* cursor = packed->memory;
    for (size_t i = 0; i != count; ++i) *arrays[i] = cursor, cursor += (sizes[i] + 63) / 64 * 64;
    return uform_status_success_k;
}

void uform_packed_free(uform_packed_t* packed) {
    if (packed->memory) packed->backend->host_release(packed->context, packed->memory);
    memset(packed, 0, sizeof(*packed));
}

uform_status_t uform_tape_check(uform_tape_t const* tape, size_t count, char const* name, size_t first,
                                uint64_t* snapshot, char const** error) {
    if (tape->count != count)
        return UFORM_INVALID("%s: %zu %s for %zu items", name, tape->count, tape->count == 1 ? "entry" : "entries", count);
    if (!tape->offsets) return UFORM_INVALID("%s: NULL offsets", name);
    uint64_t before = tape->offsets[0];
    if (snapshot) snapshot[0] = before;
    for (size_t i = 0; i != count; ++i) {
        uint64_t offset = tape->offsets[i + 1];
        if (snapshot) snapshot[i + 1] = offset;
        if (offset < before)
            return UFORM_INVALID("%s.offsets[%zu]: %llu is below the offset before it, %llu", name, first + i + 1,
                                 (unsigned long long)offset, (unsigned long long)before);
        before = offset;
    }
    if (before > tape->size)
        return UFORM_INVALID("%s.offsets[%zu]: %llu is past the tape's size, %llu", name, first + count,
                             (unsigned long long)before, (unsigned long long)tape->size);
    if (before && !tape->data) return UFORM_INVALID("%s: NULL data", name);
    return uform_status_success_k;
}

static uform_status_t uform_edges_check(uform_edges_view_t const* edges, size_t count, char const* name,
                                        int self_allowed, char const** error) {
    if (!edges->offsets) {
        if (edges->ids_count) return UFORM_INVALID("batch.relations.%s: %zu ids but no offsets", name, edges->ids_count);
        return uform_status_success_k;
    }
    if (edges->offsets[0] != 0)
        return UFORM_INVALID("batch.relations.%s.offsets[0]: %u, not 0", name, edges->offsets[0]);
    for (size_t i = 0; i != count; ++i)
        if (edges->offsets[i + 1] < edges->offsets[i])
            return UFORM_INVALID("batch.relations.%s.offsets[%zu]: %u is below the offset before it, %u", name, i + 1,
                                 edges->offsets[i + 1], edges->offsets[i]);
    if (edges->offsets[count] != edges->ids_count)
        return UFORM_INVALID("batch.relations.%s.offsets[%zu]: %u, but there are %zu ids", name, count,
                             edges->offsets[count], edges->ids_count);
    if (edges->ids_count && !edges->ids) return UFORM_INVALID("batch.relations.%s.ids: NULL", name);
    for (size_t i = 0; i != count; ++i)
        for (uint32_t k = edges->offsets[i]; k != edges->offsets[i + 1]; ++k) {
            uint32_t id = edges->ids[k];
            if (id >= count) return UFORM_INVALID("batch.relations.%s.ids[%u]: %u is not below %zu items", name, k, id, count);
            if (k > edges->offsets[i] && id <= edges->ids[k - 1])
                return UFORM_INVALID("batch.relations.%s.ids[%u]: %u is not above %u before it in item %zu's run",
                                     name, k, id, edges->ids[k - 1], i);
            if (!self_allowed && id == i)
                return UFORM_INVALID("batch.relations.%s.ids[%u]: item %zu names itself", name, k, i);
            if (edges->weights && (!isfinite(edges->weights[k]) || edges->weights[k] < 0))
                return UFORM_INVALID("batch.relations.%s.weights[%u]: %g is not a finite non-negative weight", name, k,
                                     uform_printed(edges->weights[k]));
        }
    return uform_status_success_k;
}

/* Does item `i`'s run in `a` share an id with its run in `b`? Both runs ascend, so one merge walk tells. */
static int uform_runs_overlap(uform_edges_view_t const* a, uform_edges_view_t const* b, size_t i, uint32_t* shared) {
    if (!a->offsets || !b->offsets) return 0;
    uint32_t x = a->offsets[i], y = b->offsets[i];
    while (x < a->offsets[i + 1] && y < b->offsets[i + 1]) {
        if (a->ids[x] == b->ids[y]) return *shared = a->ids[x], 1;
        if (a->ids[x] < b->ids[y]) ++x;
        else ++y;
    }
    return 0;
}

static int uform_compare_u32(void const* a, void const* b) {
    uint32_t x = *(uint32_t const*)a, y = *(uint32_t const*)b;
    return (x > y) - (x < y);
}

/* How many items, and their modalities. Messages count items from `first`, the caller's numbering. */
static uform_status_t uform_items_count(uform_config_t const* config, size_t count, uform_modality_t const* modalities,
                                        size_t first, uform_item_names_t const* names, char const** error) {
    if (!count) return UFORM_INVALID("%s: no items", names->contents);
    if (count > config->given.batch.max_segments_per_device)
        return UFORM_INVALID("%s: %zu items exceed config.batch.max_segments_per_device = %u", names->contents, count,
                             config->given.batch.max_segments_per_device);
    if (!modalities) return UFORM_INVALID("%s: NULL", names->modalities);
    for (size_t i = 0; i != count; ++i) {
        uform_modality_t modality = modalities[i];
        if (modality >= uform_modality_text_k && modality <= uform_modality_audio_k) continue;
        return UFORM_INVALID("%s[%zu]: %d is not a modality", names->modalities, first + i, (int)modality);
    }
    return uform_status_success_k;
}

/* The items' bytes, their offsets kept in `offsets` (count + 1) for the packing. */
static uform_status_t uform_contents_check(uint64_t* offsets, uform_tape_t const* contents, size_t count,
                                           size_t first, uform_item_names_t const* names, char const** error) {
    uform_status_t status = uform_tape_check(contents, count, names->contents, first, offsets, error);
    if (status != uform_status_success_k) return status;
    for (size_t i = 0; i != count; ++i)
        if (offsets[i + 1] == offsets[i])
            return UFORM_INVALID("%s[%zu]: empty; every item needs at least one byte", names->contents, first + i);
    return uform_status_success_k;
}

uform_status_t uform_batch_check_items(uform_config_t const* config, uform_trainer_step_t const* step,
                                      uint64_t* offsets, char const** error) {
    uform_status_t status = uform_items_count(config, step->count, step->modalities, 0, &uform_batch_names, error);
    return status == uform_status_success_k
               ? uform_contents_check(offsets, &step->contents, step->count, 0, &uform_batch_names, error)
               : status;
}

static int uform_tape_given(uform_tape_t const* tape) { return tape->offsets || tape->data; }

/* The bytes an item offers to choose from, from the checked snapshot. */
static size_t uform_choices_of(uform_packed_t const* packed, size_t item) {
    return packed->choices_count ? (size_t)(packed->choice_snapshot[item + 1] - packed->choice_snapshot[item]) : 0;
}

/*
 *  Checks the items' choices and, when `targets` is given, their targets, reading each value once
 *  into `packed`. Training needs targets and the choices term; inference (`targets` NULL) reads the
 *  bytes alone. Only text items carry a choice position.
 */
static uform_status_t uform_choices_check(uform_packed_t* packed, uform_config_t const* config, size_t count,
                                          uform_modality_t const* modalities, uform_tape_t const* choices,
                                          uform_tape_t const* targets, size_t first, char const* field,
                                          char const** error) {
    uform_trainer_init_vram_t const* c = &config->given;
    int training = targets != NULL;
    packed->choices_count = 0;
    if (!uform_tape_given(choices)) {
        if (training && uform_tape_given(targets) && targets->offsets && targets->count &&
            targets->offsets[targets->count] != targets->offsets[0])
            return UFORM_INVALID("batch.choice_targets: given without batch.choices");
        return uform_status_success_k;
    }
    uint64_t* snapshot = packed->choice_snapshot;
    uform_status_t status = uform_tape_check(choices, count, field, first, snapshot, error);
    if (status != uform_status_success_k) return status;
    int offered_any = snapshot[count] != snapshot[0];
    if (training && offered_any && !(c->choices.weight > 0))
        return UFORM_INVALID("batch.choices: items offer choices, which need config.choices.weight");
    if (training && offered_any && !uform_tape_given(targets))
        return UFORM_INVALID("batch.choice_targets: required with batch.choices");
    training = training && uform_tape_given(targets);
    if (training)
        status = uform_tape_check(targets, count, "batch.choice_targets", first, packed->target_snapshot, error);
    if (status != uform_status_success_k) return status;
    uint8_t const* bytes = (uint8_t const*)choices->data;
    char const* values = training ? (char const*)targets->data : NULL; /* float32s, read by copy: any alignment */
    size_t cursor = 0, offering = 0;
    for (size_t i = 0; i != count; ++i) {
        size_t offered = (size_t)(snapshot[i + 1] - snapshot[i]);
        size_t aimed = training ? (size_t)(packed->target_snapshot[i + 1] - packed->target_snapshot[i]) : 0;
        if (training && aimed != offered)
            return UFORM_INVALID("batch.choice_targets[%zu]: %zu targets for %zu choices", first + i, aimed, offered);
        if (!offered) continue;
        if (modalities[i] != uform_modality_text_k)
            return UFORM_INVALID("%s[%zu]: only text items offer choices; this one is modality %d", field, first + i,
                                 (int)modalities[i]);
        if (offered > c->batch.max_choices_per_item)
            return UFORM_INVALID("%s[%zu]: %zu choices exceed config.batch.max_choices_per_item = %u", field,
                                 first + i, offered, c->batch.max_choices_per_item);
        uint32_t seen[8] = {0};
        double sum = 0;
        packed->choice_offsets[offering] = (uint32_t)cursor;
        for (size_t j = 0; j != offered; ++j) {
            uint8_t byte = packed->choice_bytes[cursor + j] = bytes[snapshot[i] + j];
            if (seen[byte / 32] & (1u << (byte % 32)))
                return UFORM_INVALID("%s[%zu]: byte %u is offered twice", field, first + i, (unsigned)byte);
            seen[byte / 32] |= 1u << (byte % 32);
            if (!training) continue;
            float target;
            memcpy(&target, values + (packed->target_snapshot[i] + j) * sizeof(float), sizeof(float));
            packed->choice_targets[cursor + j] = target;
            if (!isfinite(target) || target < 0)
                return UFORM_INVALID("batch.choice_targets[%zu][%zu]: %g is not a finite non-negative probability",
                                     first + i, j, uform_printed(target));
            sum += target;
        }
        if (training && fabs(sum - 1.0) > 1e-3)
            return UFORM_INVALID("batch.choice_targets[%zu]: the targets sum to %g, not 1 (within 1e-3)", first + i,
                                 sum);
        cursor += offered, ++offering;
    }
    packed->choice_offsets[offering] = (uint32_t)cursor;
    packed->choices_count = offering;
    return uform_status_success_k;
}

static int uform_side_queries(uint8_t side) {
    return side == uform_late_interaction_query_k || side == uform_late_interaction_query_and_document_k;
}

static int uform_side_documents(uint8_t side) {
    return side == uform_late_interaction_document_k || side == uform_late_interaction_query_and_document_k;
}

/* Checks a step's relations, ids bounded by its items, capacity aside: the edges of every run, then whether one item
   names another in two relations. `edges` receives how many there are in all. */
static uform_status_t uform_relations_check(uform_trainer_step_t const* step, size_t* edges, char const** error) {
    size_t count = step->count;
    uform_edges_view_t const* relations[3] = {&step->attract, &step->repel, &step->ignore};
    char const* names[3] = {"attract", "repel", "ignore"};
    *edges = 0;
    for (int r = 0; r != 3; ++r) {
        uform_status_t status = uform_edges_check(relations[r], count, names[r], r == 2, error);
        if (status != uform_status_success_k) return status;
        *edges += relations[r]->ids_count;
    }
    return uform_status_success_k;
}

static uform_status_t uform_relations_overlap(uform_trainer_step_t const* step, char const** error) {
    uform_edges_view_t const* relations[3] = {&step->attract, &step->repel, &step->ignore};
    char const* names[3] = {"attract", "repel", "ignore"};
    for (size_t i = 0; i != step->count; ++i)
        for (int a = 0; a != 3; ++a)
            for (int b = a + 1; b != 3; ++b) {
                uint32_t shared;
                if (uform_runs_overlap(relations[a], relations[b], i, &shared))
                    return UFORM_INVALID("batch.relations: item %zu names item %u in both %s and %s", i, shared,
                                         names[a], names[b]);
            }
    return uform_status_success_k;
}

uform_status_t uform_batch_check_relations(uform_trainer_step_t const* step, char const** error) {
    size_t edges;
    uform_status_t status = uform_relations_check(step, &edges, error);
    return status == uform_status_success_k ? uform_relations_overlap(step, error) : status;
}

/* Messages count items from `first`, where the caller's step starts this one. */
static uform_status_t uform_batch_validate(uform_packed_t* packed, uform_config_t const* config,
                                           uform_trainer_step_t const* step, size_t first, char const** error) {
    uform_trainer_init_vram_t const* c = &config->given;
    size_t count = step->count;
    uform_status_t status = uform_items_count(config, count, step->modalities, first, &uform_batch_names, error);
    if (status != uform_status_success_k) return status;
    status = uform_choices_check(packed, config, count, step->modalities, &step->choices, &step->choice_targets, first,
                                 "batch.choices", error);
    if (status != uform_status_success_k) return status;
    status = uform_contents_check(packed->offsets, &step->contents, count, first, &uform_batch_names, error);
    if (status != uform_status_success_k) return status;
    if (step->bags) {
        uint32_t* sorted = malloc(count * sizeof(uint32_t));
        if (!sorted) return uform_fail(error, uform_status_out_of_memory_k, "no memory to count bags");
        memcpy(sorted, step->bags, count * sizeof(uint32_t));
        qsort(sorted, count, sizeof(uint32_t), uform_compare_u32);
        size_t distinct = 1;
        for (size_t i = 1; i != count; ++i) distinct += sorted[i] != sorted[i - 1];
        free(sorted);
        if (distinct > c->batch.max_bags_per_device)
            return UFORM_INVALID("batch.bags: %zu bags exceed config.batch.max_bags_per_device = %u", distinct,
                                 c->batch.max_bags_per_device);
    }
    for (size_t i = 0; i != count; ++i) {
        int side = step->sides ? (int)step->sides[i] : uform_late_interaction_none_k;
        if (side < 0 || side > uform_late_interaction_query_and_document_k)
            return UFORM_INVALID("batch.sides[%zu]: %d is not a late-interaction side", first + i, side);
        if (uform_side_queries((uint8_t)side) && step->modalities[i] != uform_modality_text_k)
            return UFORM_INVALID("batch.sides[%zu]: only text items are queries; this %s item may be a document",
                                 first + i,
                                 step->modalities[i] == uform_modality_image_k   ? "image"
                                 : step->modalities[i] == uform_modality_video_k ? "video"
                                                                                 : "audio");
        if (side != uform_late_interaction_none_k && !(c->late_interaction.weight > 0))
            return UFORM_INVALID("batch.sides[%zu]: %s needs config.late_interaction.weight", first + i,
                                 side == uform_late_interaction_query_k      ? "query"
                                 : side == uform_late_interaction_document_k ? "document"
                                                                             : "query_and_document");
        packed->sides[i] = (uint8_t)side;
    }
    size_t edges;
    status = uform_relations_check(step, &edges, error);
    if (status != uform_status_success_k) return status;
    if (edges > c->contrastive.max_edges_per_device)
        return UFORM_INVALID("batch.relations: %zu edges exceed config.contrastive.max_edges_per_device = %u", edges,
                             c->contrastive.max_edges_per_device);
    return uform_relations_overlap(step, error);
}

/* Marks the positions of one text item that the masked term scores and corrupts what the model sees. */
static void uform_mask_text(uform_packed_t* packed, uform_config_t const* config, uint64_t step_number, size_t item,
                            uint32_t start, uint32_t length) {
    uform_masking_t const* masking = &config->given.masking;
    uint64_t seed = config->given.seed;
    double mean_span = masking->token_mean_span;
    /* Spans start with probability p / mean and last a geometric number of positions with that mean, so
       about a share p of positions is chosen, in runs. */
    float start_probability = masking->token_mask_probability / (float)mean_span;
    double continue_log = mean_span > 1 ? log(1.0 - 1.0 / mean_span) : 0;
    uint32_t span_left = 0;
    for (uint32_t p = 0; p != length; ++p) {
        uint64_t key = uform_key(seed, uform_stream_span_k, step_number, item, p);
        if (!span_left && uform_uniform(key) < start_probability) {
            double u = ((double)(key & 0xFFFFFF) + 1.0) / 16777217.0;
            span_left = mean_span > 1 ? 1 + (uint32_t)fmin(floor(log(u) / continue_log), 1e6) : 1;
        }
        if (!span_left) continue;
        --span_left;
        uint32_t token = start + p;
        packed->masked[packed->masked_count] = token;
        packed->targets[packed->masked_count++] = packed->ids[token];
        float draw = uform_uniform(uform_key(seed, uform_stream_corrupt_k, step_number, item, p));
        if (draw < masking->replace_fraction) packed->ids[token] = uform_mask_id_k;
        else if (draw < masking->replace_fraction + masking->random_fraction)
            packed->ids[token] = (uint32_t)(uform_key(seed, uform_stream_byte_k, step_number, item, p) >> 56);
    }
}

/* The cells were validated from the caller's edges; read again here, every index is bounded anew. */
void uform_batch_cells(uform_packed_t* packed, uform_config_t const* config, uform_trainer_step_t const* step) {
    size_t count = step->count;
    uform_contrastive_t const* contrastive = &config->given.contrastive;
    int ambient = contrastive->negatives == uform_negatives_ambient_k;
    for (size_t i = 0; i != count; ++i)
        for (size_t j = 0; j != count; ++j) {
            int counted = ambient && i != j;
            packed->cells[i * count + j] = counted ? uform_cell_repel_k : uform_cell_ignored_k;
            packed->weights[i * count + j] = counted ? contrastive->ambient_repulsion_weight : 0;
        }
    uform_edges_view_t const* relations[3] = {&step->attract, &step->repel, &step->ignore};
    uint8_t kinds[3] = {uform_cell_attract_k, uform_cell_repel_k, uform_cell_ignored_k};
    for (int r = 0; r != 3; ++r) {
        uform_edges_view_t const* edges = relations[r];
        if (!edges->offsets) continue;
        for (size_t i = 0; i != count; ++i)
            for (uint32_t k = edges->offsets[i], end = edges->offsets[i + 1]; k < end && k < edges->ids_count; ++k) {
                uint32_t id = edges->ids[k];
                if (id >= count) continue;
                float weight = r == 2 ? 0 : edges->weights ? edges->weights[k] : 1;
                packed->cells[i * count + id] = kinds[r];
                packed->weights[i * count + id] = isfinite(weight) && weight > 0 ? weight : 0;
            }
    }
    packed->contrastive_rows = 0;
    for (size_t i = 0; i != count; ++i) {
        double attract = 0, repel = 0;
        for (size_t j = 0; j != count; ++j) {
            if (packed->cells[i * count + j] == uform_cell_attract_k) attract += packed->weights[i * count + j];
            if (packed->cells[i * count + j] == uform_cell_repel_k) repel += packed->weights[i * count + j];
        }
        packed->contrastive_rows += (size_t)uform_row_counts(contrastive->pair_loss, attract, repel);
    }
}

/* Lists the tokens by the id the model reads, stably, so a backward pass can sum each id's rows in one order. */
static void uform_order_fill(uform_packed_t* packed) {
    uint32_t* starts = packed->order_offsets;
    memset(starts, 0, (uform_vocabulary_k + 1) * sizeof(uint32_t));
    for (size_t t = 0; t != packed->tokens_count; ++t) ++starts[packed->ids[t] + 1];
    for (size_t id = 0; id != uform_vocabulary_k; ++id) starts[id + 1] += starts[id];
    /* Each id's start serves as its cursor while placing; the cursors end at the next id's start, so shift back. */
    for (size_t t = 0; t != packed->tokens_count; ++t) packed->order[starts[packed->ids[t]]++] = (uint32_t)t;
    for (size_t id = uform_vocabulary_k; id != 0; --id) starts[id] = starts[id - 1];
    starts[0] = 0;
}

/* Which media tokens a training step hides: keyed draws per (step, item, token); NULL shows them all. */
typedef struct uform_hiding_t {
    uint64_t step_number;
    size_t first_item; /* the key of the step's first item */
} uform_hiding_t;

/* The media kind of a modality, or -1 for text. */
static int uform_media_kind(uform_modality_t modality) {
    return modality == uform_modality_image_k   ? uform_media_image_k
           : modality == uform_modality_video_k ? uform_media_video_k
           : modality == uform_modality_audio_k ? uform_media_audio_k
                                                : -1;
}

static int uform_media_hides(uform_config_t const* config, uform_hiding_t const* hiding, int kind, size_t item,
                             uint32_t token) {
    uform_masking_t const* m = &config->given.masking;
    float ratio = kind == uform_media_image_k ? m->image_mask_ratio
                  : kind == uform_media_video_k ? m->video_mask_ratio
                                                : m->audio_mask_ratio;
    return hiding && uform_uniform(uform_key(config->given.seed, uform_stream_patch_k, hiding->step_number,
                                             hiding->first_item + item, token)) < ratio;
}

uform_media_runs_t uform_media_runs(uform_packed_t const* packed, int kind) {
    uform_media_runs_t runs = {0, 0, packed->tokens_capacity, packed->tokens_capacity * packed->widest};
    for (int k = 0; k != uform_media_kinds_k; ++k)
        runs.hidden_rows -= packed->media_hidden[k], runs.hidden_values -= packed->media_hidden[k] * packed->widths[k];
    for (int k = 0; k != kind; ++k) {
        runs.shown_rows += packed->media_shown[k], runs.shown_values += packed->media_shown[k] * packed->widths[k];
        runs.hidden_rows += packed->media_hidden[k], runs.hidden_values += packed->media_hidden[k] * packed->widths[k];
    }
    return runs;
}

/* A media token's position word: an image patch's (row, column), a tubelet's (time, row, column), a chunk's index. */
static uint32_t uform_media_position(int kind, uform_media_grid_t const* grid, uint32_t token) {
    uint32_t plane = grid->rows * grid->columns, within = token % plane;
    if (kind == uform_media_image_k) return uform_position_grid(within / grid->columns, within % grid->columns);
    if (kind == uform_media_video_k) return uform_position_volume(token / plane, within / grid->columns, within % grid->columns);
    return token;
}

/* Places an item's decoded tokens from token `start` on: a shown one at its kind's front cursor under the media id,
   a hidden one at its kind's back cursor under the mask id (the patch loss normalizes it as its target). Items write
   apart from each other, so they are placed on every core at once. */
static void uform_place_media(uform_packed_t* packed, uform_config_t const* config, uform_hiding_t const* hiding,
                              uform_decoded_s const* decoded, size_t item, int kind, size_t start,
                              uform_media_runs_t cursor) {
    uform_media_grid_t const* grid = &decoded->grids[item];
    size_t width = packed->widths[kind];
    size_t tokens = uform_grid_tokens(grid);
    for (uint32_t p = 0; p != tokens; ++p) {
        float const* values = decoded->values[item] + (size_t)p * width;
        int hidden = uform_media_hides(config, hiding, kind, item, p);
        size_t row = hidden ? cursor.hidden_rows++ : cursor.shown_rows++;
        float* to = packed->media_values + (hidden ? cursor.hidden_values : cursor.shown_values);
        *(hidden ? &cursor.hidden_values : &cursor.shown_values) += width;
        memcpy(to, values, width * sizeof(float));
        packed->media_rows[row] = (uint32_t)(start + p);
        packed->ids[start + p] = hidden ? uform_mask_id_k : uform_media_id_k;
        packed->positions[start + p] = uform_media_position(kind, grid, p);
    }
}

/* Decodes one media item into its tokens with the decoder of its kind, as a derived batch shape shapes them. */
static uform_status_t uform_media_decode(uform_batch_shape_t const* b, int kind, uint8_t const* bytes, size_t length,
                                         size_t room, float* out, uform_media_grid_t* grid, char const* field,
                                         char const** error) {
    if (kind == uform_media_image_k)
        return uform_image_patches(bytes, length, b->image.patch_side, b->image.channels, room, out, grid, field, error);
    if (kind == uform_media_video_k)
        return uform_video_tubelets(bytes, length, b->video.patch_side, b->video.tube_frames, b->video.frame_stride,
                                    b->video.channels, room, out, grid, field, error);
    return uform_audio_chunks(bytes, length, b->audio.sample_rate, b->audio.chunk_samples, room, out, grid, field, error);
}

uform_status_t uform_media_tokens(uform_batch_shape_t const* shape, uform_modality_t modality, void const* bytes,
                                  size_t length, float* tokens, size_t capacity, uint32_t* grid, size_t* count,
                                  size_t* width, char const** error) {
    return uform_media_tokens_fitted(shape, modality, bytes, length, tokens, capacity, grid, count, width, NULL, error);
}

uform_status_t uform_media_tokens_fitted(uform_batch_shape_t const* shape, uform_modality_t modality,
                                         void const* bytes, size_t length, float* tokens, size_t capacity,
                                         uint32_t* grid, size_t* count, size_t* width, int* truncated,
                                         char const** error) {
    if (!shape) return UFORM_INVALID("shape: NULL");
    if (!count) return UFORM_INVALID("count: NULL output pointer");
    if (!bytes && length) return UFORM_INVALID("bytes: NULL with a length of %zu", length);
    int kind = uform_media_kind(modality);
    if (kind < 0)
        return UFORM_INVALID("modality: %d is not image (2), video (3) or audio (4); text has no media tokens",
                             (int)modality);
    uform_batch_shape_t derived = *shape;
    uform_status_t status = uform_batch_shape_derive(&derived, "shape", error);
    if (status != uform_status_success_k) return status;
    /* The decoder fits the item to a whole row, as a step does, whatever room the caller gave: a smaller room
       would shrink an image rather than refuse it. Only a caller with room for a row is written to directly. */
    size_t room = derived.max_columns_per_row, widths[uform_media_kinds_k];
    uform_media_widths(&derived, widths);
    float* out = tokens && capacity >= room ? tokens : malloc(room * widths[kind] * sizeof(float));
    if (!out) return uform_fail(error, uform_status_out_of_memory_k, "no memory to decode %zu tokens", room);
    uform_media_grid_t fitted;
    status = uform_media_decode(&derived, kind, (uint8_t const*)bytes, length, room, out, &fitted, "bytes", error);
    if (status == uform_status_success_k) {
        *count = uform_grid_tokens(&fitted);
        if (grid) grid[0] = fitted.frames, grid[1] = fitted.rows, grid[2] = fitted.columns;
        if (width) *width = widths[kind];
        if (truncated) *truncated = fitted.truncated != 0;
        if (tokens && capacity < *count)
            status = UFORM_INVALID("capacity: %zu tokens, but the item decodes to %zu", capacity, *count);
        else if (tokens && out != tokens)
            memcpy(tokens, out, *count * widths[kind] * sizeof(float));
    }
    if (out != tokens) free(out);
    return status;
}

void uform_decoded_release(uform_decoded_s* decoded) {
    if (!decoded) return;
    for (size_t i = 0; decoded->values && i != decoded->count; ++i) free(decoded->values[i]);
    free(decoded->values), free(decoded->grids), free(decoded->modalities), free(decoded->offsets);
    free(decoded);
}

/*
 *  Decodes every media item on every core, each into a buffer of its own sized for a row and then trimmed to its
 *  tokens, so nothing the threads do depends on their order. A failure is reported for the first failing item in
 *  the batch's order, decoded again on the calling thread, where its message is kept.
 */
uform_status_t uform_decoded_make(uform_config_t const* config, size_t count, uform_modality_t const* modalities,
                                  uform_tape_t const* contents, uint64_t const* offsets, size_t first,
                                  char const* name, uform_decoded_s** made, char const** error) {
    uform_batch_shape_t const* shape = &config->given.batch;
    size_t room = shape->max_columns_per_row, widths[uform_media_kinds_k];
    uform_media_widths(shape, widths);
    int media = 0;
    for (size_t i = 0; i != count; ++i) media |= uform_media_kind(modalities[i]) >= 0;
    *made = NULL;
    if (!media) return uform_status_success_k;
    uform_decoded_s* decoded = calloc(1, sizeof(uform_decoded_s));
    uform_status_t* statuses = malloc(count * sizeof(uform_status_t));
    if (decoded) {
        decoded->count = count, decoded->data = (uint8_t const*)contents->data;
        decoded->offsets = malloc((count + 1) * sizeof(uint64_t));
        decoded->modalities = malloc(count * sizeof(uform_modality_t));
        decoded->grids = calloc(count, sizeof(uform_media_grid_t));
        decoded->values = calloc(count, sizeof(float*));
    }
    if (!decoded || !statuses || !decoded->offsets || !decoded->modalities || !decoded->grids || !decoded->values) {
        uform_decoded_release(decoded), free(statuses);
        return uform_fail(error, uform_status_out_of_memory_k, "no memory to decode the media of %zu items", count);
    }
    memcpy(decoded->offsets, offsets, (count + 1) * sizeof(uint64_t));
    memcpy(decoded->modalities, modalities, count * sizeof(uform_modality_t));
    uint8_t const* bytes = decoded->data;
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t i = 0; i < count; ++i) {
        int kind = uform_media_kind(decoded->modalities[i]);
        statuses[i] = uform_status_success_k;
        if (kind < 0) continue;
        float* values = malloc(room * widths[kind] * sizeof(float));
        uform_status_t status = values ? uform_media_decode(shape, kind, bytes + offsets[i], offsets[i + 1] - offsets[i],
                                                            room, values, &decoded->grids[i], "media", NULL)
                                       : uform_status_out_of_memory_k;
        if (status == uform_status_success_k) {
            float* trimmed = realloc(values, (uform_grid_tokens(&decoded->grids[i]) * widths[kind] + 1) * sizeof(float));
            values = trimmed ? trimmed : values;
        }
        decoded->values[i] = values, statuses[i] = status;
    }
    uform_status_t status = uform_status_success_k;
    for (size_t i = 0; i != count && status == uform_status_success_k; ++i) {
        if (statuses[i] == uform_status_success_k) continue;
        if (statuses[i] == uform_status_out_of_memory_k) {
            status = uform_fail(error, uform_status_out_of_memory_k, "%s[%zu]: no memory to decode it", name, first + i);
            break;
        }
        char field[64];
        snprintf(field, sizeof(field), "%s[%zu]", name, first + i);
        uform_media_grid_t grid;
        status = uform_media_decode(shape, uform_media_kind(decoded->modalities[i]), bytes + offsets[i],
                                    offsets[i + 1] - offsets[i], room, decoded->values[i], &grid, field, error);
        if (status == uform_status_success_k) /* failed on its first try only: say so rather than pass it */
            status = uform_fail(error, uform_status_invalid_argument_k,
                                "%s[%zu]: decoded differently on a second try (its bytes changed?)", name, first + i);
    }
    free(statuses);
    if (status != uform_status_success_k) uform_decoded_release(decoded);
    else *made = decoded;
    return status;
}

/* Checks the items are the ones their media were decoded from: the same modalities, bytes and offsets. Media the
   verb decoded itself differ only where the caller changed its items while the verb read them. */
static uform_status_t uform_decoded_check(uform_decoded_s const* decoded, size_t count,
                                          uform_modality_t const* modalities, uform_tape_t const* contents,
                                          uint64_t const* offsets, size_t first, uform_item_names_t const* names,
                                          char const** error) {
    char const* ahead = names->decoded ? names->decoded : "the media decoded ahead";
    if (decoded->count != count)
        return UFORM_INVALID("%s: made from %zu items, not this batch's %zu", ahead, decoded->count, count);
    if (decoded->data != (uint8_t const*)contents->data)
        return UFORM_INVALID("%s: made from another contents tape than %s", ahead, names->contents);
    for (size_t i = 0; i != count; ++i)
        if (decoded->modalities[i] != modalities[i] || decoded->offsets[i] != offsets[i] ||
            decoded->offsets[i + 1] != offsets[i + 1])
            return names->decoded ? UFORM_INVALID("%s: batch item %zu differs from the one decoded (its modality or "
                                                  "offsets)", names->decoded, first + i)
                                  : UFORM_INVALID("%s[%zu]: its modality or offsets changed while they were read",
                                                  names->contents, first + i);
    return uform_status_success_k;
}

/* Counts each kind's shown and hidden tokens, so that each kind's runs can be placed contiguously, and each media
   item's hidden ones in `hidden` (count), where its placement starts each kind's runs. */
static void uform_media_count(uform_packed_t* packed, uform_config_t const* config, uform_decoded_s const* decoded,
                              uform_hiding_t const* hiding, size_t* hidden) {
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) packed->media_shown[kind] = packed->media_hidden[kind] = 0;
    for (size_t i = 0; decoded && i != decoded->count; ++i) {
        int kind = uform_media_kind(decoded->modalities[i]);
        if (kind < 0) continue;
        size_t tokens = uform_grid_tokens(&decoded->grids[i]);
        hidden[i] = 0;
        for (uint32_t p = 0; p != tokens; ++p) hidden[i] += uform_media_hides(config, hiding, kind, i, p);
        packed->media_hidden[kind] += hidden[i], packed->media_shown[kind] += tokens - hidden[i];
    }
}

/* Where a media item's tokens go: its first token, and its kind's cursors before it. */
typedef struct uform_placement_t {
    size_t item, start;
    int kind;
    uform_media_runs_t cursor;
} uform_placement_t;

/* Cuts items to a row and packs them first-fit into rows, in item order, from the checked offsets' snapshot and
   the decoded media. Each temperature group is read once, into the packed copy, and checked there. */
static uform_status_t uform_pack_decoded(uform_packed_t* packed, uform_config_t const* config, size_t count,
                                         uform_tape_t const* contents, uint32_t const* groups,
                                         uform_hiding_t const* hiding, uform_decoded_s const* decoded, size_t first,
                                         uform_item_names_t const* names, char const** error) {
    uform_batch_shape_t const* shape = &config->given.batch;
    uint32_t group_count = config->given.contrastive.temperature_groups;
    uint8_t const* bytes = (uint8_t const*)contents->data;
    uint64_t const* offsets = packed->offsets;
    packed->tokens_count = packed->masked_count = packed->rows_count = packed->truncated = packed->longest = 0;
    packed->contrastive_rows = 0;
    packed->segments_count = count;
    uint32_t span = config->given.late_interaction.max_query_span;
    size_t* hidden = decoded ? malloc(count * (sizeof(size_t) + sizeof(uform_placement_t))) : NULL;
    uform_placement_t* placements = hidden ? (uform_placement_t*)(hidden + count) : NULL;
    if (decoded && !hidden) return uform_fail(error, uform_status_out_of_memory_k, "no memory to place %zu items", count);
    uform_media_count(packed, config, decoded, hiding, hidden);
    uform_media_runs_t cursors[uform_media_kinds_k];
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) cursors[kind] = uform_media_runs(packed, kind);
    size_t placed = 0;
    uform_status_t status = uform_status_success_k;
    for (size_t i = 0; i != count && status == uform_status_success_k; ++i) {
        /* An item offering choices ends with its choice position, so its content fits in one column less;
           a query's content is cut to max_query_span and padded up to it. */
        uint64_t choosing = uform_choices_of(packed, i) != 0, room = shape->max_columns_per_row - choosing;
        int query = packed->sides[i] == uform_late_interaction_query_k ||
                    packed->sides[i] == uform_late_interaction_query_and_document_k;
        if (query) room = span;
        uint64_t begin = offsets[i], content = offsets[i + 1] - begin;
        int kind = decoded ? uform_media_kind(decoded->modalities[i]) : -1; /* the modalities as read once */
        if (kind >= 0) {
            content = uform_grid_tokens(&decoded->grids[i]);
            packed->truncated += decoded->grids[i].truncated != 0;
        } else if (content > room)
            content = room, ++packed->truncated;
        uint64_t padded = query ? span : content, length = padded + choosing;
        packed->content_lengths[i] = kind >= 0 ? 0 : (uint32_t)content; /* what text masking reads */
        size_t row = 0;
        while (row != packed->rows_count && packed->row_fill[row] + length > shape->max_columns_per_row) ++row;
        if (row == packed->rows_count) {
            if (row == shape->max_rows_per_device) {
                /* The batch's fault as a whole: not named as the entry `contents[i]`, which marks a bad item. */
                status = UFORM_INVALID("%s: item %zu does not fit; the items need more than "
                                       "config.batch.max_rows_per_device = %u rows of %u columns",
                                       names->contents, first + i, shape->max_rows_per_device,
                                       shape->max_columns_per_row);
                break;
            }
            packed->row_fill[packed->rows_count++] = 0;
        }
        uform_segment_t* segment = &packed->segments[i];
        segment->start = (uint32_t)packed->tokens_count;
        segment->length = (uint32_t)length;
        segment->row = (uint32_t)row;
        segment->column = packed->row_fill[row];
        packed->row_fill[row] += (uint32_t)length;
        if (length > packed->longest) packed->longest = length;
        if (kind >= 0) {
            placements[placed++] = (uform_placement_t){i, packed->tokens_count, kind, cursors[kind]};
            size_t width = packed->widths[kind], shown = content - hidden[i];
            cursors[kind].shown_rows += shown, cursors[kind].shown_values += shown * width;
            cursors[kind].hidden_rows += hidden[i], cursors[kind].hidden_values += hidden[i] * width;
        } else
            for (uint32_t p = 0; p != length; ++p) {
                packed->ids[packed->tokens_count + p] = p < content ? bytes[begin + p]
                                                        : p < padded  ? uform_query_pad_id_k
                                                                      : uform_choice_id_k;
                packed->positions[packed->tokens_count + p] = p;
            }
        packed->tokens_count += length;
        uint32_t group = packed->groups[i] = groups ? groups[i] : 0;
        if (group >= group_count)
            status = UFORM_INVALID("batch.temperature_groups[%zu]: %u is not below "
                                   "config.contrastive.temperature_groups = %u", first + i, group, group_count);
    }
    if (status == uform_status_success_k && placed) { /* a team woken for nothing spins beside the launches */
#pragma omp parallel for schedule(dynamic, 1)
        for (size_t k = 0; k < placed; ++k)
            uform_place_media(packed, config, hiding, decoded, placements[k].item, placements[k].kind,
                              placements[k].start, placements[k].cursor);
    }
    free(hidden);
    return status;
}

/* Packs the items with their media decoded ahead (`ahead`, checked to be theirs), or decoded here. */
static uform_status_t uform_pack_rows(uform_packed_t* packed, uform_config_t const* config, size_t count,
                                      uform_modality_t const* modalities, uform_tape_t const* contents,
                                      uint32_t const* groups, uform_hiding_t const* hiding,
                                      uform_decoded_s const* ahead, size_t first, uform_item_names_t const* names,
                                      char const** error) {
    uform_decoded_s* made = NULL;
    uform_status_t status =
        ahead ? uform_decoded_check(ahead, count, modalities, contents, packed->offsets, first, names, error)
              : uform_decoded_make(config, count, modalities, contents, packed->offsets, first, names->contents, &made,
                                   error);
    if (status == uform_status_success_k)
        status = uform_pack_decoded(packed, config, count, contents, groups, hiding, ahead ? ahead : made, first, names,
                                    error);
    uform_decoded_release(made);
    return status;
}

/*
 *  Lists the rows late interaction scores (each side-taking item's tokens, its choice position
 *  aside) and each query's row of the documents its attract and repel runs name, attracts first,
 *  each run in id order; named items that take no document side are left to the other terms.
 *  The edges were validated; read again here, every index is bounded anew.
 */
static uform_status_t uform_late_fill(uform_packed_t* packed, uform_config_t const* config,
                                      uform_trainer_step_t const* step, char const** error) {
    uform_late_interaction_t const* late = &config->given.late_interaction;
    size_t count = step->count, rows = 0, spans = 0, query_tokens = 0, documents = 0, document_tokens = 0;
    for (size_t i = 0; i != count; ++i) {
        uint8_t side = packed->sides[i];
        packed->late_item_span[i] = UINT32_MAX;
        if (side == uform_late_interaction_none_k) continue;
        uform_segment_t const* segment = &packed->segments[i];
        uint32_t scored = segment->length - (uform_choices_of(packed, i) != 0);
        packed->late_spans[spans].start = (uint32_t)rows, packed->late_spans[spans].length = scored;
        for (uint32_t p = 0; p != scored; ++p) packed->late_rows[rows++] = segment->start + p;
        packed->late_item_span[i] = (uint32_t)spans++;
        if (uform_side_queries(side)) query_tokens += scored;
        if (uform_side_documents(side)) ++documents, document_tokens += scored;
    }
    if (query_tokens > late->max_query_tokens_per_device)
        return UFORM_INVALID("batch.sides: %zu query tokens exceed config.late_interaction.max_query_tokens_per_device "
                             "= %u", query_tokens, late->max_query_tokens_per_device);
    if (documents > late->max_documents_per_device)
        return UFORM_INVALID("batch.sides: %zu documents exceed config.late_interaction.max_documents_per_device = %u",
                             documents, late->max_documents_per_device);
    if (document_tokens > late->max_document_tokens_per_device)
        return UFORM_INVALID("batch.sides: %zu document tokens exceed "
                             "config.late_interaction.max_document_tokens_per_device = %u",
                             document_tokens, late->max_document_tokens_per_device);
    packed->late_rows_count = rows, packed->late_spans_count = spans;
    uform_batch_late_pairs(packed, config, step);
    return uform_status_success_k;
}

void uform_batch_late_pairs(uform_packed_t* packed, uform_config_t const* config, uform_trainer_step_t const* step) {
    uform_late_interaction_t const* late = &config->given.late_interaction;
    size_t count = step->count;
    uform_edges_view_t const* relations[2] = {&step->attract, &step->repel};
    size_t queries = 0, pairs = 0, counted = 0;
    for (size_t i = 0; i != count; ++i) {
        if (!uform_side_queries(packed->sides[i])) continue;
        size_t first = pairs;
        double sums[2] = {0, 0};
        for (int r = 0; r != 2; ++r) {
            uform_edges_view_t const* edges = relations[r];
            if (!edges->offsets) continue;
            for (uint32_t k = edges->offsets[i], end = edges->offsets[i + 1]; k < end && k < edges->ids_count; ++k) {
                uint32_t id = edges->ids[k];
                if (id >= count || !uform_side_documents(packed->sides[id])) continue;
                float weight = edges->weights ? edges->weights[k] : 1;
                weight = isfinite(weight) && weight > 0 ? weight : 0;
                packed->late_documents[pairs] = packed->late_item_span[id];
                packed->late_cells[pairs] = r == 0 ? uform_cell_attract_k : uform_cell_repel_k;
                packed->late_weights[pairs++] = weight;
                sums[r] += weight;
            }
        }
        if (pairs == first) continue;
        packed->late_offsets[queries] = (uint32_t)first;
        packed->late_queries[queries++] = packed->late_item_span[i];
        counted += (size_t)uform_row_counts(late->pair_loss, sums[0], sums[1]);
    }
    packed->late_offsets[queries] = (uint32_t)pairs;
    packed->late_queries_count = queries, packed->late_pairs_count = pairs, packed->late_rows_counted = counted;
}

/* The choice positions, each its item's last, follow the masked positions: one decoder pass reads both. */
static void uform_choice_positions(uform_packed_t* packed) {
    size_t offering = 0;
    for (size_t i = 0; i != packed->segments_count; ++i)
        if (uform_choices_of(packed, i))
            packed->masked[packed->masked_count + offering++] = packed->segments[i].start + packed->segments[i].length - 1;
}

uform_status_t uform_batch_pack(uform_packed_t* packed, uform_config_t const* config,
                                uform_trainer_step_t const* step, uform_decoded_s const* decoded,
                                uint64_t step_number, size_t first_item, size_t first_key, char const** error) {
    if (!step) return UFORM_INVALID("batch: NULL");
    uform_hiding_t hiding = {step_number, first_key};
    uform_status_t status = uform_batch_validate(packed, config, step, first_item, error);
    if (status == uform_status_success_k)
        status = uform_pack_rows(packed, config, step->count, step->modalities, &step->contents,
                                 step->temperature_groups,
                                 config->given.objective != uform_objective_contrastive_k ? &hiding : NULL, decoded,
                                 first_item, &uform_batch_names, error);
    if (status != uform_status_success_k) return status;
    if (config->given.objective != uform_objective_contrastive_k)
        for (size_t i = 0; i != step->count; ++i)
            uform_mask_text(packed, config, step_number, first_key + i, packed->segments[i].start,
                            packed->content_lengths[i]);
    uform_choice_positions(packed);
    if (config->given.late_interaction.weight > 0) status = uform_late_fill(packed, config, step, error);
    if (status != uform_status_success_k) return status;
    if (config->given.objective != uform_objective_masked_k) uform_batch_cells(packed, config, step);
    uform_order_fill(packed);
    return uform_status_success_k;
}

uform_status_t uform_batch_pack_choose(uform_packed_t* packed, uform_config_t const* config,
                                       uform_modality_t const* modalities, uform_tape_t const* texts,
                                       uform_tape_t const* choices, size_t first_item, char const** error) {
    size_t count = texts->count;
    uform_status_t status = uform_items_count(config, count, modalities, first_item, &uform_choose_names, error);
    if (status != uform_status_success_k) return status;
    memset(packed->sides, 0, count);
    status = uform_choices_check(packed, config, count, modalities, choices, NULL, first_item, "choices", error);
    for (size_t i = 0; status == uform_status_success_k && i != count; ++i)
        if (!uform_choices_of(packed, i))
            status = UFORM_INVALID("choices[%zu]: empty; every text needs at least one byte to choose from", first_item + i);
    if (status == uform_status_success_k)
        status = uform_contents_check(packed->offsets, texts, count, first_item, &uform_choose_names, error);
    if (status == uform_status_success_k)
        status = uform_pack_rows(packed, config, count, modalities, texts, NULL, NULL, NULL, first_item,
                                 &uform_choose_names, error);
    if (status == uform_status_success_k) uform_choice_positions(packed);
    return status;
}

uform_status_t uform_batch_pack_plain(uform_packed_t* packed, uform_config_t const* config,
                                      uform_modality_t const* modalities, uform_tape_t const* contents,
                                      uform_late_interaction_side_t const* sides, uform_decoded_s const* decoded,
                                      size_t first_item, char const** error) {
    size_t count = contents->count;
    uform_status_t status = uform_items_count(config, count, modalities, first_item, &uform_encoder_names, error);
    if (status == uform_status_success_k)
        status = uform_contents_check(packed->offsets, contents, count, first_item, &uform_encoder_names, error);
    if (status != uform_status_success_k) return status;
    packed->choices_count = 0;
    for (size_t i = 0; i != count; ++i) packed->sides[i] = sides ? (uint8_t)sides[i] : 0; /* checked by the caller */
    return uform_pack_rows(packed, config, count, modalities, contents, NULL, NULL, decoded, first_item,
                           &uform_encoder_names, error);
}
