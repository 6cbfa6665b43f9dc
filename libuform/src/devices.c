/**
 *  @file   devices.c
 *  @brief  A step spread over the simulated devices of one RAM executor (SPEC section 6): the CPU reference of the
 *          mesh, so any machine can check that a run's losses and weights do not depend on how its items were spread.
 *
 *  Devices meet at four points, each a function below and here a copy in memory, in device order; a mesh of GPUs
 *  replaces exactly these with collectives:
 *
 *  - split: the items go to the devices as contiguous runs, in item order. Each device in turn takes an equal share
 *    of the items still unplaced (rounded up), at most `max_segments_per_device`, and a run ends only where no bag
 *    has items on both sides: a bag's items, and any items between them, share a device. The run ends at the first
 *    such place past the share, else at the last one within the capacity. A device left without items idles. Keyed
 *    draws read each item's index in the whole step, so every item is masked as it would be on one device.
 *  - gather: every device's pooled embeddings, and its token vectors, side by side in item order, so that the
 *    contrastive and late-interaction terms score every item against every other as one device would.
 *  - scatter: those terms' gradients back to the devices that own the rows.
 *  - all-reduce: the gradients summed in device order; every device holds the sum, so all update alike.
 *
 *  The masked, patch and choices terms run where their positions are, each device's mean weighed by its share of the
 *  step's positions, so that the devices' terms add up to the mean over the whole step.
 *
 *  The simulated devices share the host's memory, so the gathered terms run on one context planned for every
 *  device's items, reading the gathered lists where the host wrote them.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

static size_t uform_spread_items(uform_spread_t const* s, uint32_t device) {
    return s->firsts[device + 1] - s->firsts[device];
}

static uform_status_t uform_spread_take(uform_spread_t* s, size_t bytes, void* pointer, char const** error) {
    uform_status_t status = s->backend->allocate(s->context, bytes, (void**)pointer);
    if (status != uform_status_success_k) return uform_fail(error, status, "%s", uform_message());
    s->taken[s->taken_count++] = *(void**)pointer;
    return status;
}

uform_status_t uform_spread_init(uform_spread_t** spread, uform_executor_s const* executor, uform_config_t const* config,
                                 uform_layout_t const* layout, uform_replica_t* replica, uform_packed_t* packed,
                                 char const** error) {
    uint32_t devices = executor->devices;
    uform_spread_t* s = *spread = calloc(1, sizeof(uform_spread_t));
    if (!s) return uform_fail(error, uform_status_out_of_memory_k, "no memory for %u devices", devices);
    s->devices = devices, s->backend = executor->backend;
    s->replicas = calloc(devices, sizeof(uform_replica_t*));
    s->packs = calloc(devices, sizeof(uform_packed_t*));
    s->firsts = calloc(devices + 1, sizeof(size_t));
    s->terms = calloc(devices, sizeof(uform_terms_t));
    s->owned_replicas = calloc(devices - 1, sizeof(uform_replica_t));
    s->owned_packs = calloc(devices - 1, sizeof(uform_packed_t));
    if (!s->replicas || !s->packs || !s->firsts || !s->terms || !s->owned_replicas || !s->owned_packs)
        return uform_fail(error, uform_status_out_of_memory_k, "no memory for %u devices", devices);
    s->replicas[0] = replica, s->packs[0] = packed;
    uform_status_t status = uform_status_success_k;
    for (uint32_t d = 1; d != devices && status == uform_status_success_k; ++d) {
        s->replicas[d] = &s->owned_replicas[d - 1], s->packs[d] = &s->owned_packs[d - 1];
        status = uform_replica_init(s->replicas[d], executor, layout, config, 1, error);
        if (status == uform_status_success_k)
            status = uform_packed_init(s->packs[d], config, s->backend, s->replicas[d]->context, error);
    }
    if (status != uform_status_success_k) return status;

    uform_trainer_init_vram_t const* c = &config->given;
    int contrastive = c->objective != uform_objective_masked_k, late = c->late_interaction.weight > 0;
    size_t items = (size_t)devices * c->batch.max_segments_per_device, h = layout->hidden;
    size_t tokens = (size_t)devices * c->batch.max_rows_per_device * c->batch.max_columns_per_row;
    size_t edges = late * (size_t)devices * c->contrastive.max_edges_per_device, width = late * c->late_interaction.width;
    size_t cells = contrastive * items * items, listed = late * items, words = sizeof(uint32_t);
    uform_plan_t plan = {.tokens = tokens, .segments = items, .columns = c->batch.max_columns_per_row, .hidden = h,
                         .heads = layout->heads, .contrastive = contrastive, .widest = layout->widest};
    status = s->backend->context_create(executor->device, &plan, &s->context);
    if (status != uform_status_success_k) return uform_fail(error, status, "%s", uform_message());
    uform_packed_t* whole = &s->whole;
    size_t sizes[] = {items * words, cells, cells * sizeof(float), listed, listed * words, listed * sizeof(uform_span_t),
                      listed * words, (listed + 1) * words, edges * words, edges, edges * sizeof(float),
                      items * h * sizeof(float), items * h * sizeof(float), items * h * sizeof(float),
                      tokens * width * sizeof(float), tokens * width * sizeof(float),
                      2 * layout->total * sizeof(float)};
    void* arrays[] = {&whole->groups, &whole->cells, &whole->weights, &whole->sides, &whole->late_item_span,
                      &whole->late_spans, &whole->late_queries, &whole->late_offsets, &whole->late_documents,
                      &whole->late_cells, &whole->late_weights, &s->pooled, &s->d_pooled, &s->normalized,
                      &s->late_unit, &s->d_late_unit, &s->sum};
    for (size_t i = 0; i != sizeof(sizes) / sizeof(sizes[0]) && status == uform_status_success_k; ++i)
        status = uform_spread_take(s, sizes[i], arrays[i], error);
    return status;
}

void uform_spread_free(uform_spread_t* s) {
    if (!s) return;
    for (size_t i = 0; i != s->taken_count; ++i) s->backend->release(s->context, s->taken[i]);
    if (s->context) s->backend->context_destroy(s->context);
    for (uint32_t d = 1; d < s->devices && s->owned_packs && s->owned_replicas; ++d)
        uform_packed_free(&s->owned_packs[d - 1]), uform_replica_free(&s->owned_replicas[d - 1]);
    free(s->replicas), free(s->packs), free(s->firsts), free(s->terms), free(s->owned_replicas), free(s->owned_packs);
    free(s);
}

static int uform_compare_u64(void const* a, void const* b) {
    uint64_t x = *(uint64_t const*)a, y = *(uint64_t const*)b;
    return (x > y) - (x < y);
}

/* Splits the step's items into the devices' runs, `firsts`, by the rule the file's comment states. */
static uform_status_t uform_spread_split(uform_spread_t* s, uform_config_t const* config,
                                         uform_trainer_step_t const* step, char const** error) {
    size_t count = step->count, capacity = config->given.batch.max_segments_per_device;
    uint32_t devices = s->devices;
    if (count > devices * capacity) /* refused before anything is sized by the count */
        return UFORM_INVALID("batch.contents: %zu items exceed %u devices of config.batch.max_segments_per_device = "
                             "%zu", count, devices, capacity);
    /* Each bag opens at its first item and closes at its last; a run may end after item i where none is open. */
    uint64_t* keyed = malloc(count * (sizeof(uint64_t) + sizeof(int64_t) + 1));
    if (!keyed) return uform_fail(error, uform_status_out_of_memory_k, "no memory to split %zu items", count);
    int64_t* opened = (int64_t*)(keyed + count);
    uint8_t* ends = (uint8_t*)(opened + count);
    memset(opened, 0, count * sizeof(int64_t));
    for (size_t i = 0; step->bags && i != count; ++i) keyed[i] = (uint64_t)step->bags[i] << 32 | i;
    if (step->bags) qsort(keyed, count, sizeof(uint64_t), uform_compare_u64);
    for (size_t i = 0; step->bags && i != count; ++i) {
        size_t last = i;
        while (last + 1 != count && keyed[last + 1] >> 32 == keyed[i] >> 32) ++last;
        ++opened[(uint32_t)keyed[i]], --opened[(uint32_t)keyed[last]];
        i = last;
    }
    int64_t open = 0;
    for (size_t i = 0; i != count; ++i) open += opened[i], ends[i] = open == 0;
    uform_status_t status = uform_status_success_k;
    size_t start = 0;
    for (uint32_t d = 0; d != devices && status == uform_status_success_k; ++d) {
        s->firsts[d] = start;
        if (start == count) continue;
        size_t share = (count - start + (devices - d) - 1) / (devices - d), end = 0;
        for (size_t i = start; i != count && i - start < capacity; ++i)
            if (ends[i] && (end = i + 1) - start >= share) break;
        if (!end) {
            size_t last = start;
            while (!ends[last]) ++last;
            status = UFORM_INVALID("batch.bags: items %zu to %zu share one device, as a bag's items and those between "
                                   "them do, more than config.batch.max_segments_per_device = %zu hold",
                                   start, last, capacity);
        }
        start = end;
    }
    s->firsts[devices] = start;
    free(keyed);
    if (status == uform_status_success_k && start != count)
        status = UFORM_INVALID("batch.bags: %zu items do not fit %u devices of config.batch.max_segments_per_device = "
                               "%zu once a bag's items, and those between them, share a device", count, devices,
                               capacity);
    return status;
}

/* Each device's edges are its items' runs; they count against its own capacity. */
static uform_status_t uform_spread_edges(uform_spread_t const* s, uform_config_t const* config,
                                         uform_trainer_step_t const* step, char const** error) {
    uform_edges_view_t const* relations[3] = {&step->attract, &step->repel, &step->ignore};
    uint32_t capacity = config->given.contrastive.max_edges_per_device;
    for (uint32_t d = 0; d != s->devices; ++d) {
        size_t edges = 0, first = s->firsts[d], end = s->firsts[d + 1];
        for (int r = 0; r != 3; ++r)
            if (relations[r]->offsets) edges += relations[r]->offsets[end] - relations[r]->offsets[first];
        if (edges > capacity)
            return UFORM_INVALID("batch.relations: %zu edges of items %zu to %zu, on device %u, exceed "
                                 "config.contrastive.max_edges_per_device = %u", edges, first, end - 1, d, capacity);
    }
    return uform_status_success_k;
}

static uform_status_t uform_tape_entries(uform_tape_t const* tape, int required, size_t count, char const* name,
                                         char const** error) {
    int given = required || tape->offsets || tape->data;
    return given && tape->count != count ? UFORM_INVALID("%s: %zu entries for %zu items", name, tape->count, count)
                                         : uform_status_success_k;
}

static uform_tape_t uform_tape_slice(uform_tape_t const* tape, size_t first, size_t count) {
    uform_tape_t slice = *tape;
    if (slice.offsets) slice.offsets += first;
    if (slice.offsets || slice.data) slice.count = count;
    return slice;
}

/* A device's run of the step: its items, without relations, which the gathered terms read from the whole step. */
static uform_trainer_step_t uform_step_slice(uform_trainer_step_t const* step, size_t first, size_t count) {
    uform_trainer_step_t slice = {.count = count};
    slice.modalities = step->modalities ? step->modalities + first : NULL;
    slice.contents = uform_tape_slice(&step->contents, first, count);
    slice.contents.count = count;
    slice.bags = step->bags ? step->bags + first : NULL;
    slice.temperature_groups = step->temperature_groups ? step->temperature_groups + first : NULL;
    slice.sides = step->sides ? step->sides + first : NULL;
    slice.choices = uform_tape_slice(&step->choices, first, count);
    slice.choice_targets = uform_tape_slice(&step->choice_targets, first, count);
    return slice;
}

/* The step over every device: counts summed, and every item's group, cells and late-interaction lists, the token
   vectors' rows numbered as the gather lays them out. */
static void uform_spread_whole(uform_spread_t* s, uform_config_t const* config, uform_trainer_step_t const* step) {
    uform_packed_t* whole = &s->whole;
    int late = config->given.late_interaction.weight > 0;
    whole->segments_count = step->count;
    whole->tokens_count = whole->truncated = whole->masked_count = whole->choices_count = whole->longest = 0;
    whole->contrastive_rows = whole->late_rows_counted = 0;
    size_t rows = 0, spans = 0;
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) whole->media_shown[kind] = whole->media_hidden[kind] = 0;
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_packed_t const* p = s->packs[d];
        size_t first = s->firsts[d], items = uform_spread_items(s, d);
        if (!items) continue;
        whole->tokens_count += p->tokens_count, whole->truncated += p->truncated;
        whole->masked_count += p->masked_count, whole->choices_count += p->choices_count;
        whole->longest = p->longest > whole->longest ? p->longest : whole->longest;
        for (int kind = 0; kind != uform_media_kinds_k; ++kind)
            whole->media_shown[kind] += p->media_shown[kind], whole->media_hidden[kind] += p->media_hidden[kind];
        memcpy(whole->groups + first, p->groups, items * sizeof(uint32_t));
        if (!late) continue;
        memcpy(whole->sides + first, p->sides, items);
        for (size_t i = 0; i != items; ++i)
            whole->late_item_span[first + i] =
                p->late_item_span[i] == UINT32_MAX ? UINT32_MAX : (uint32_t)(spans + p->late_item_span[i]);
        for (size_t j = 0; j != p->late_spans_count; ++j)
            whole->late_spans[spans + j] = (uform_span_t){(uint32_t)(rows + p->late_spans[j].start), p->late_spans[j].length};
        rows += p->late_rows_count, spans += p->late_spans_count;
    }
    whole->late_rows_count = rows, whole->late_spans_count = spans;
    if (config->given.objective != uform_objective_masked_k) uform_batch_cells(whole, config, step);
    if (late) uform_batch_late_pairs(whole, config, step);
}

uform_status_t uform_spread_pack(uform_spread_t* s, uform_config_t const* config, uform_trainer_step_t const* step,
                                 uform_decoded_s const* decoded, uint64_t step_number, char const** error) {
    if (!step) return UFORM_INVALID("batch: NULL");
    if (!step->count) return uform_batch_pack(s->packs[0], config, step, decoded, step_number, 0, error);
    size_t count = step->count;
    UFORM_TRY(uform_tape_entries(&step->contents, 1, count, "batch.contents", error));
    UFORM_TRY(uform_tape_entries(&step->choices, 0, count, "batch.choices", error));
    UFORM_TRY(uform_tape_entries(&step->choice_targets, 0, count, "batch.choice_targets", error));
    if (decoded && decoded->count != count)
        return UFORM_INVALID("step.decoded: made from %zu items, not this batch's %zu", decoded->count, count);
    UFORM_TRY(uform_spread_split(s, config, step, error));
    UFORM_TRY(uform_batch_check_relations(step, error));
    UFORM_TRY(uform_spread_edges(s, config, step, error));
    for (uint32_t d = 0; d != s->devices; ++d) {
        size_t first = s->firsts[d], items = uform_spread_items(s, d);
        if (!items) continue;
        uform_trainer_step_t slice = uform_step_slice(step, first, items);
        uform_decoded_s run;
        if (decoded) {
            run = *decoded;
            run.count = items, run.offsets += first, run.modalities += first, run.grids += first, run.values += first;
        }
        uform_status_t status = uform_batch_pack(s->packs[d], config, &slice, decoded ? &run : NULL, step_number,
                                                 first, error);
        /* A device's capacity is what the message quotes; where the items went is what the split decided. */
        if (status != uform_status_success_k)
            return uform_fail(error, status, "%s (on device %u of %u, given items %zu to %zu by the split, which "
                              "shares the items out by count and keeps bags whole)",
                              error && *error ? *error : uform_message(), d, s->devices, first, first + items - 1);
    }
    uform_spread_whole(s, config, step);
    return uform_status_success_k;
}

/* Lays every device's pooled embeddings, and its token vectors where late interaction runs, side by side in item
   order: the all-gather. */
static uform_status_t uform_spread_gather(uform_spread_t* s, uform_layout_t const* layout, uform_terms_t const* step) {
    size_t h = layout->hidden, rows = 0;
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t const* r = s->replicas[d];
        size_t items = uform_spread_items(s, d), count = s->packs[d]->late_rows_count, width = r->late_width;
        if (!items) continue;
        UFORM_TRY(s->backend->copy(r->context, s->pooled + s->firsts[d] * h, r->pooled, items * h * sizeof(float)));
        if (!step->late_ran) continue;
        UFORM_TRY(s->backend->copy(r->context, s->late_unit + rows * width, r->late_unit, count * width * sizeof(float)));
        rows += count;
    }
    return uform_status_success_k;
}

/* Hands each device the gathered terms' gradients of its own rows: the adjoint of the gather. */
static uform_status_t uform_spread_scatter(uform_spread_t* s, uform_layout_t const* layout, uform_terms_t const* step) {
    size_t h = layout->hidden, rows = 0;
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t* r = s->replicas[d];
        size_t items = uform_spread_items(s, d), count = s->packs[d]->late_rows_count, width = r->late_width;
        if (!items) continue;
        if (step->contrastive_ran)
            UFORM_TRY(s->backend->copy(r->context, r->d_pooled, s->d_pooled + s->firsts[d] * h, items * h * sizeof(float)));
        if (!step->late_ran) continue;
        UFORM_TRY(s->backend->copy(r->context, r->d_late_unit, s->d_late_unit + rows * width, count * width * sizeof(float)));
        rows += count;
    }
    return uform_status_success_k;
}

/* Adds a device's mean of a term into the step's, weighed by the device's share of the term's positions. */
static void uform_spread_mean(double* step, double device, size_t positions, size_t total, int ran) {
    if (ran) *step += device * (double)positions / (double)total;
}

/* Sums every device's gradients in device order, and the terms each scored where its positions are; every device
   then holds both: the all-reduce. */
static uform_status_t uform_spread_all_reduce(uform_spread_t* s, uform_layout_t const* layout) {
    size_t total = layout->total;
    float *sum = s->sum, *part = s->sum + total;
    uform_packed_t const* whole = &s->whole;
    double* scalars = s->scalars;
    scalars[uform_scalar_masked_loss_k] = scalars[uform_scalar_choices_loss_k] = 0;
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) scalars[uform_scalar_media_loss_k + kind] = 0;
    int summed = 0;
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t const* r = s->replicas[d];
        uform_packed_t const* p = s->packs[d];
        uform_terms_t const* t = &s->terms[d];
        double own[uform_scalars_k];
        if (!uform_spread_items(s, d)) continue;
        UFORM_TRY(s->backend->download(r->context, summed ? part : sum, r->gradients, total * sizeof(float)));
        UFORM_TRY(s->backend->download(r->context, own, r->scalars, sizeof(own)));
        for (size_t k = 0; summed && k != total; ++k) sum[k] += part[k];
        summed = 1;
        uform_spread_mean(&scalars[uform_scalar_masked_loss_k], own[uform_scalar_masked_loss_k], p->masked_count,
                          whole->masked_count, t->masked_ran);
        uform_spread_mean(&scalars[uform_scalar_choices_loss_k], own[uform_scalar_choices_loss_k], p->choices_count,
                          whole->choices_count, t->choices_ran);
        for (int kind = 0; kind != uform_media_kinds_k; ++kind)
            uform_spread_mean(&scalars[uform_scalar_media_loss_k + kind], own[uform_scalar_media_loss_k + kind],
                              p->media_hidden[kind], whole->media_hidden[kind], t->media_ran[kind]);
    }
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t* r = s->replicas[d];
        UFORM_TRY(s->backend->upload(r->context, r->gradients, sum, total * sizeof(float)));
        UFORM_TRY(s->backend->upload(r->context, r->scalars, scalars, uform_scalars_k * sizeof(double)));
        UFORM_TRY(uform_model_finish(r, layout));
    }
    return uform_status_success_k;
}

/* A device's weight of a mean over the step's positions: the term's weight times its share of them. */
static float uform_spread_share(float weight, size_t positions, size_t total) {
    return total ? (float)((double)weight * (double)positions / (double)total) : weight;
}

uform_status_t uform_spread_gradients(uform_spread_t* s, uform_layout_t const* layout, uform_config_t const* config) {
    uform_packed_t const* whole = &s->whole;
    uform_terms_t step = uform_model_terms(config, whole);
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t* r = s->replicas[d];
        uform_packed_t const* p = s->packs[d];
        uform_terms_t* t = &s->terms[d];
        if (!uform_spread_items(s, d)) continue;
        *t = uform_model_terms(config, p);
        t->text_weight = uform_spread_share(step.text_weight, p->masked_count, whole->masked_count);
        t->choices_weight = uform_spread_share(step.choices_weight, p->choices_count, whole->choices_count);
        for (int kind = 0; kind != uform_media_kinds_k; ++kind)
            t->media_weight[kind] = uform_spread_share(step.media_weight[kind], p->media_hidden[kind],
                                                       whole->media_hidden[kind]);
        t->contrastive_ran = step.contrastive_ran;
        t->late_ran = step.late_ran && p->late_rows_count;
        UFORM_TRY(uform_model_upload(r, p, 1));
        UFORM_TRY(uform_model_device_forward(r, layout, config, p, t));
    }
    UFORM_TRY(uform_spread_gather(s, layout, &step));
    /* The gathered terms' temperature and bias gradients join device 0's, before the all-reduce sums them. */
    uform_replica_t* first = s->replicas[0];
    if (step.contrastive_ran)
        UFORM_TRY(uform_model_contrastive_term(first, s->context, layout, config,
                                               &s->scalars[uform_scalar_contrastive_loss_k], s->d_pooled, s->normalized,
                                               s->pooled, whole->cells, whole->weights, whole->groups,
                                               whole->segments_count));
    if (step.late_ran) {
        uform_late_interaction_setup_t setup = {.spans = whole->late_spans,
                                                .queries = whole->late_queries,
                                                .offsets = whole->late_offsets,
                                                .documents = whole->late_documents,
                                                .cells = whole->late_cells,
                                                .weights = whole->late_weights,
                                                .count = whole->late_queries_count,
                                                .pairs = whole->late_pairs_count};
        UFORM_TRY(uform_model_late_term(first, s->context, layout, config,
                                        &s->scalars[uform_scalar_late_interaction_loss_k], s->d_late_unit,
                                        s->late_unit, whole->late_rows_count, setup));
    }
    UFORM_TRY(uform_spread_scatter(s, layout, &step));
    for (uint32_t d = 0; d != s->devices; ++d)
        if (uform_spread_items(s, d))
            UFORM_TRY(uform_model_device_backward(s->replicas[d], layout, s->packs[d], &s->terms[d]));
    return uform_spread_all_reduce(s, layout);
}
