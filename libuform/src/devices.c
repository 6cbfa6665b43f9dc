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
 *
 *  A mesh of several processes numbers every process's devices in host-domain order: process p's come after those of
 *  processes 0 to p - 1, and its items after theirs, so the step is the processes' batches side by side and its
 *  edges are each process's own, moved by the items before it. Each process splits its own items over its own
 *  devices by the rule above; the meeting points then also cross processes (`mesh.c`'s collectives): the processes
 *  first agree on every batch's item count (so draws are keyed on an item's index in the whole step) and then share
 *  what each device packed (counts, groups, sides, spans, edges), so every process knows the whole step; the gather
 *  sends every process's embeddings and token vectors to every other; host domain 0, which holds the step's device 0,
 *  runs the gathered terms and sends their gradients to all; the all-reduce sums every device's gradients in the
 *  same global order as one process would. So two processes of one device each, given halves of a batch, train as one
 *  process of two devices given all of it, bit for bit.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

/* Items of this process's device `device`. */
static size_t uform_spread_items(uform_spread_t const* s, uint32_t device) {
    return s->firsts[s->first_device + device + 1] - s->firsts[s->first_device + device];
}

/* This process's device `device`'s first item in the whole step. */
static size_t uform_spread_first(uform_spread_t const* s, uint32_t device) { return s->firsts[s->first_device + device]; }

static uform_status_t uform_spread_take(uform_spread_t* s, size_t bytes, void* pointer, char const** error) {
    uform_status_t status = s->backend->allocate(s->context, bytes, (void**)pointer);
    if (status != uform_status_success_k) return uform_fail(error, status, "%s", uform_message());
    s->taken[s->taken_count++] = *(void**)pointer;
    return status;
}

uform_status_t uform_spread_init(uform_spread_t** spread, uform_executor_s const* executor, uform_config_t const* config,
                                 uform_layout_t const* layout, uform_replica_t* replica, uform_packed_t* packed,
                                 uform_mesh_s* mesh, uint32_t const* devices_of, char const** error) {
    uint32_t devices = executor->devices, processes = mesh ? mesh->host_domain_count : 1, all = 0, first = 0;
    for (uint32_t p = 0; p != processes; ++p)
        first += p < (mesh ? mesh->host_domain_index : 0) ? devices_of[p] : 0, all += mesh ? devices_of[p] : devices;
    uform_spread_t* s = *spread = calloc(1, sizeof(uform_spread_t));
    if (!s) return uform_fail(error, uform_status_out_of_memory_k, "no memory for %u devices", devices);
    s->devices = devices, s->backend = executor->backend;
    s->mesh = mesh, s->processes = processes, s->first_device = first, s->all_devices = all;
    s->trainer = mesh ? mesh->trainers++ : 0; /* every process makes its trainers in one order, or steps go astray */
    s->replicas = calloc(devices, sizeof(uform_replica_t*));
    s->packs = calloc(devices, sizeof(uform_packed_t*));
    s->firsts = calloc(all + 1, sizeof(size_t));
    s->rows = calloc(all + 1, sizeof(size_t));
    s->process_devices = calloc(processes + 1, sizeof(uint32_t));
    s->terms = calloc(devices, sizeof(uform_terms_t));
    s->owned_replicas = calloc(devices, sizeof(uform_replica_t)); /* one spare: calloc(0) may answer NULL */
    s->owned_packs = calloc(devices, sizeof(uform_packed_t));
    s->sizes = calloc(processes, sizeof(size_t));
    /* A mesh sums every device's gradients through host memory, as the transport sends them from there. */
    s->parts = mesh ? malloc((size_t)devices * layout->total * sizeof(float)) : NULL;
    if ((mesh && !s->parts) || !s->sizes || !s->replicas || !s->packs || !s->firsts || !s->rows ||
        !s->process_devices || !s->terms || !s->owned_replicas || !s->owned_packs)
        return uform_fail(error, uform_status_out_of_memory_k, "no memory for %u devices", devices);
    for (uint32_t p = 0; p != processes; ++p)
        s->process_devices[p + 1] = s->process_devices[p] + (mesh ? devices_of[p] : devices);
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
    size_t items = (size_t)all * c->batch.max_segments_per_device, h = layout->hidden;
    size_t tokens = (size_t)all * c->batch.max_rows_per_device * c->batch.max_columns_per_row;
    size_t edges = late * (size_t)all * c->contrastive.max_edges_per_device, width = late * c->late_interaction.width;
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
    free(s->replicas), free(s->packs), free(s->firsts), free(s->rows), free(s->process_devices), free(s->terms);
    free(s->owned_replicas), free(s->owned_packs), free(s->parts), free(s->sizes);
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
    size_t start = 0, *firsts = s->firsts + s->first_device; /* this process's devices, counting its items from 0 */
    for (uint32_t d = 0; d != devices && status == uform_status_success_k; ++d) {
        firsts[d] = start;
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
    firsts[devices] = start;
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
        size_t edges = 0, first = uform_spread_first(s, d), end = first + uform_spread_items(s, d);
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
    return given && tape->count != count ? UFORM_INVALID("%s: %zu %s for %zu items", name, tape->count,
                                                         tape->count == 1 ? "entry" : "entries", count)
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

/* ---------------------------------------------------------------------------------------------- */
/*  What each process tells the others of its share                                               */
/* ---------------------------------------------------------------------------------------------- */

/* One device's packed run as the other processes need it: its counts, then its items' groups, and with late
   interaction their sides, spans and the spans' rows. An idle device's counts are zero. */
typedef struct uform_summary_t {
    uint64_t items, tokens, truncated, masked, choices, longest, late_rows, late_spans;
    uint64_t media_shown[uform_media_kinds_k], media_hidden[uform_media_kinds_k];
} uform_summary_t;

/* Bytes written one after another into a buffer that grows; `failed` once memory ran out. */
typedef struct uform_bytes_t {
    uint8_t* data;
    size_t size, capacity;
    int failed;
} uform_bytes_t;

static void uform_bytes_put(uform_bytes_t* b, void const* data, size_t bytes) {
    if (b->failed || !bytes) return;
    if (b->size + bytes > b->capacity) {
        size_t capacity = (b->size + bytes) * 2;
        uint8_t* grown = realloc(b->data, capacity);
        if (!grown) {
            b->failed = 1;
            return;
        }
        b->data = grown, b->capacity = capacity;
    }
    memcpy(b->data + b->size, data, bytes);
    b->size += bytes;
}

/* Reads what another process wrote, copying, as its bytes are not aligned; `bad` once they ran short. */
typedef struct uform_reader_t {
    uint8_t const* data;
    size_t size, at;
    int bad;
} uform_reader_t;

static void uform_bytes_get(uform_reader_t* r, void* out, size_t bytes) {
    if (r->bad || bytes > r->size - r->at) {
        r->bad = 1;
        return;
    }
    if (out) memcpy(out, r->data + r->at, bytes);
    r->at += bytes;
}

/* Every process's bytes, in host-domain order, or this process's alone without a mesh; each starts with a status,
   and a failed one's message follows it. When any failed, every process fails: with its own message, or else the
   first failed peer's. `*gathered` is freed by the caller. */
static uform_status_t uform_spread_share(uform_spread_t* s, uform_status_t status, uform_bytes_t* mine,
                                         uint8_t** gathered, char const** error) {
    char own[1024];
    snprintf(own, sizeof(own), "%s", status != uform_status_success_k ? uform_message() : "");
    if (status != uform_status_success_k) { /* the message replaces what was written */
        uint32_t code = (uint32_t)status;
        mine->size = 0, mine->failed = 0;
        uform_bytes_put(mine, &code, sizeof(code));
        uform_bytes_put(mine, own, strlen(own));
    }
    if (mine->failed) return uform_fail(error, uform_status_out_of_memory_k, "no memory to describe the step");
    *gathered = mine->data, s->sizes[0] = mine->size;
    if (s->mesh) {
        *gathered = NULL;
        UFORM_TRY(uform_mesh_all_gather(s->mesh, mine->data, mine->size, gathered, s->sizes, error));
    }
    if (status != uform_status_success_k) return uform_fail(error, status, "%s", own);
    size_t at = 0;
    for (uint32_t p = 0; p != s->processes; at += s->sizes[p++]) {
        uint32_t code = 0;
        if (s->sizes[p] >= sizeof(code)) memcpy(&code, *gathered + at, sizeof(code));
        if (s->sizes[p] >= sizeof(code) && code > uform_status_peer_k) /* no status: another exchange's bytes */
            return uform_mesh_out_of_step(s->mesh, p, "a gather?", "steps", error);
        if (s->sizes[p] < sizeof(code) || code != uform_status_success_k)
            return uform_fail(error, code ? (uform_status_t)code : uform_status_peer_k,
                              "host domain %u refused its share of the step: %.*s", p,
                              (int)(s->sizes[p] > 4 ? s->sizes[p] - 4 : 0), (char const*)*gathered + at + 4);
    }
    return uform_status_success_k;
}

/* Where every process's items start in the whole step: the processes agree on their counts before any packs, since
   the draws read each item's index in the whole step. Each names its trainer (its place among the mesh's) and the
   step it takes, so that processes stepping different trainers, or one at different steps, fail on every process
   rather than mix their gradients. */
static uform_status_t uform_spread_count(uform_spread_t* s, uform_status_t status, size_t count, uint64_t step,
                                         char const** error) {
    uform_bytes_t mine = {0};
    uint32_t code = 0, trainer = s->trainer, their_trainer = 0;
    uint64_t items = count, their_step = 0;
    uform_bytes_put(&mine, &code, sizeof(code));
    uform_bytes_put(&mine, &items, sizeof(items));
    uform_bytes_put(&mine, &trainer, sizeof(trainer));
    uform_bytes_put(&mine, &step, sizeof(step));
    size_t const expected = mine.size;
    uint8_t* gathered = NULL;
    status = uform_spread_share(s, status, &mine, &gathered, error);
    s->first_item = 0;
    size_t at = 0;
    for (uint32_t p = 0; status == uform_status_success_k && p != s->processes; at += s->sizes[p++]) {
        if (s->sizes[p] != expected) {
            status = uform_fail(error, uform_status_peer_k, "mesh: host domain %u counted its items in %zu bytes", p,
                                s->sizes[p]);
            break;
        }
        memcpy(&items, gathered + at + sizeof(code), sizeof(items));
        memcpy(&their_trainer, gathered + at + sizeof(code) + sizeof(items), sizeof(their_trainer));
        memcpy(&their_step, gathered + at + sizeof(code) + sizeof(items) + sizeof(their_trainer), sizeof(their_step));
        if (their_trainer != trainer || their_step != step)
            status = uform_fail(error, uform_status_peer_k,
                                "mesh: host domain %u steps its trainer %u (in the order its trainers were made on the "
                                "mesh) to step %llu, this process its trainer %u to step %llu: every process steps the "
                                "same trainer to the same step", p, their_trainer, (unsigned long long)their_step,
                                trainer, (unsigned long long)step);
        else if (p < s->mesh->host_domain_index) s->first_item += items;
    }
    if (gathered != mine.data) free(gathered);
    free(mine.data);
    return status;
}

static void uform_spread_describe_edges(uform_bytes_t* b, uform_edges_view_t const* edges, size_t count) {
    uint8_t present = edges->offsets != NULL, weighted = present && edges->weights;
    uform_bytes_put(b, &present, 1);
    if (!present) return;
    uint64_t first = edges->offsets[0], ids = edges->offsets[count] - first;
    uform_bytes_put(b, &ids, sizeof(ids));
    for (size_t i = 0; i != count + 1; ++i) {
        uint32_t offset = (uint32_t)(edges->offsets[i] - first);
        uform_bytes_put(b, &offset, sizeof(offset));
    }
    if (ids) uform_bytes_put(b, edges->ids + first, ids * sizeof(uint32_t));
    uform_bytes_put(b, &weighted, 1);
    if (weighted && ids) uform_bytes_put(b, edges->weights + first, ids * sizeof(float));
}

/* This process's share as the others need it: every device's summary, then, on a mesh, its edges. */
static void uform_spread_describe(uform_spread_t const* s, uform_config_t const* config,
                                  uform_trainer_step_t const* step, uform_bytes_t* b) {
    int late = config->given.late_interaction.weight > 0;
    uint32_t code = 0, devices = s->devices;
    uint64_t count = step->count;
    uform_bytes_put(b, &code, sizeof(code));
    uform_bytes_put(b, &count, sizeof(count));
    uform_bytes_put(b, &devices, sizeof(devices));
    for (uint32_t d = 0; d != devices; ++d) {
        uform_packed_t const* p = s->packs[d];
        size_t items = uform_spread_items(s, d);
        uform_summary_t summary = {0};
        if (items) {
            summary = (uform_summary_t){.items = items, .tokens = p->tokens_count, .truncated = p->truncated,
                                        .masked = p->masked_count, .choices = p->choices_count, .longest = p->longest,
                                        .late_rows = late ? p->late_rows_count : 0,
                                        .late_spans = late ? p->late_spans_count : 0};
            for (int kind = 0; kind != uform_media_kinds_k; ++kind)
                summary.media_shown[kind] = p->media_shown[kind], summary.media_hidden[kind] = p->media_hidden[kind];
        }
        uform_bytes_put(b, &summary, sizeof(summary));
        uform_bytes_put(b, p->groups, items * sizeof(uint32_t));
        if (!late) continue;
        uform_bytes_put(b, p->sides, items);
        uform_bytes_put(b, p->late_item_span, items * sizeof(uint32_t));
        uform_bytes_put(b, p->late_spans, summary.late_spans * sizeof(uform_span_t));
    }
    if (!s->mesh) return; /* one process reads its edges from the step itself */
    uform_edges_view_t const* relations[3] = {&step->attract, &step->repel, &step->ignore};
    for (int r = 0; r != 3; ++r) uform_spread_describe_edges(b, relations[r], step->count);
}

/* One process's edges, moved by the items before it, appended to the step's: `offsets` of the whole step's items
   (for each relation, `offsets[total]` counts its edges so far), `ids`, `weights`; a relation no process names is
   left without offsets. */
typedef struct uform_whole_edges_t {
    uint32_t* offsets[3];
    uint32_t* ids[3];
    float* weights[3];
    size_t edges[3];
    int present[3];
} uform_whole_edges_t;

static void uform_spread_read_edges(uform_reader_t* r, uform_whole_edges_t* whole, size_t first, size_t count,
                                    size_t capacity, int sizing) {
    for (int k = 0; k != 3; ++k) {
        uint8_t present = 0, weighted = 0;
        uint64_t ids = 0;
        uform_bytes_get(r, &present, 1);
        if (present) uform_bytes_get(r, &ids, sizeof(ids));
        if (r->bad || (present && ids > capacity)) {
            r->bad = 1;
            return;
        }
        size_t base = whole->edges[k];
        whole->present[k] |= present;
        for (size_t i = 0; i != count + 1; ++i) {
            uint32_t offset = 0;
            if (present) uform_bytes_get(r, &offset, sizeof(offset));
            /* The last offset of one process is the first of the next, which writes it again alike. */
            if (!sizing) whole->offsets[k][first + i] = (uint32_t)(base + offset);
        }
        if (sizing) uform_bytes_get(r, NULL, ids * sizeof(uint32_t));
        else uform_bytes_get(r, whole->ids[k] + base, ids * sizeof(uint32_t));
        for (size_t e = 0; !sizing && !r->bad && e != ids; ++e) whole->ids[k][base + e] += (uint32_t)first;
        if (present) uform_bytes_get(r, &weighted, 1);
        if (sizing || !weighted) uform_bytes_get(r, NULL, weighted ? ids * sizeof(float) : 0);
        else uform_bytes_get(r, whole->weights[k] + base, ids * sizeof(float));
        for (size_t e = 0; !sizing && !weighted && e != ids; ++e) whole->weights[k][base + e] = 1;
        whole->edges[k] += ids;
    }
}

/* Reads every process's share into the step over every device: counts summed, every device's first item and first
   token-vector row, every item's group, cells and late-interaction lists, the rows numbered as the gather lays them
   out. With `sizing`, only counts the items and edges, for `edges` to be sized. */
static uform_status_t uform_spread_read(uform_spread_t* s, uform_config_t const* config, uint8_t const* gathered,
                                        uform_whole_edges_t* edges, int sizing, char const** error) {
    uform_packed_t* whole = &s->whole;
    int late = config->given.late_interaction.weight > 0;
    size_t item = 0, rows = 0, spans = 0, at = 0;
    size_t capacity = (size_t)s->all_devices * config->given.batch.max_segments_per_device;
    size_t edge_capacity = (size_t)s->all_devices * config->given.contrastive.max_edges_per_device;
    whole->tokens_count = whole->truncated = whole->masked_count = whole->choices_count = whole->longest = 0;
    whole->contrastive_rows = whole->late_rows_counted = 0;
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) whole->media_shown[kind] = whole->media_hidden[kind] = 0;
    for (uint32_t p = 0; p != s->processes; at += s->sizes[p++]) {
        uform_reader_t r = {.data = gathered + at, .size = s->sizes[p]};
        uint32_t code = 0, devices = 0;
        uint64_t count = 0;
        uform_bytes_get(&r, &code, sizeof(code));
        uform_bytes_get(&r, &count, sizeof(count));
        uform_bytes_get(&r, &devices, sizeof(devices));
        size_t first = item;
        if (devices != s->process_devices[p + 1] - s->process_devices[p]) r.bad = 1;
        for (uint32_t d = s->process_devices[p]; !r.bad && d != s->process_devices[p + 1]; ++d) {
            uform_summary_t summary;
            uform_bytes_get(&r, &summary, sizeof(summary));
            if (r.bad || summary.items > capacity - item || summary.late_spans > summary.items) {
                r.bad = 1;
                break;
            }
            s->firsts[d] = item, s->rows[d] = rows;
            whole->tokens_count += summary.tokens, whole->truncated += summary.truncated;
            whole->masked_count += summary.masked, whole->choices_count += summary.choices;
            whole->longest = summary.longest > whole->longest ? summary.longest : whole->longest;
            for (int kind = 0; kind != uform_media_kinds_k; ++kind)
                whole->media_shown[kind] += summary.media_shown[kind],
                    whole->media_hidden[kind] += summary.media_hidden[kind];
            uform_bytes_get(&r, sizing ? NULL : whole->groups + item, summary.items * sizeof(uint32_t));
            if (late) {
                uform_bytes_get(&r, sizing ? NULL : whole->sides + item, summary.items);
                uform_bytes_get(&r, sizing ? NULL : whole->late_item_span + item, summary.items * sizeof(uint32_t));
                for (size_t i = 0; !sizing && !r.bad && i != summary.items; ++i)
                    if (whole->late_item_span[item + i] != UINT32_MAX) whole->late_item_span[item + i] += (uint32_t)spans;
                uform_bytes_get(&r, sizing ? NULL : whole->late_spans + spans, summary.late_spans * sizeof(uform_span_t));
                for (size_t j = 0; !sizing && !r.bad && j != summary.late_spans; ++j)
                    whole->late_spans[spans + j].start += (uint32_t)rows;
            }
            item += summary.items, rows += summary.late_rows, spans += summary.late_spans;
        }
        if (!r.bad && item - first != count) r.bad = 1;
        if (!r.bad && s->mesh) uform_spread_read_edges(&r, edges, first, count, edge_capacity, sizing);
        if (r.bad)
            return uform_fail(error, uform_status_peer_k, "mesh: host domain %u described its share of the step in "
                              "%zu bytes that do not add up", p, s->sizes[p]);
    }
    s->firsts[s->all_devices] = item, s->rows[s->all_devices] = rows;
    whole->segments_count = item, whole->late_rows_count = rows, whole->late_spans_count = spans;
    return uform_status_success_k;
}

/* The step over every process's items, for the cells and the late-interaction lists: on one process the caller's
   own; on a mesh, every process's edges side by side. */
static uform_status_t uform_spread_whole(uform_spread_t* s, uform_config_t const* config,
                                         uform_trainer_step_t const* step, uint8_t const* gathered,
                                         char const** error) {
    uform_whole_edges_t edges = {0};
    UFORM_TRY(uform_spread_read(s, config, gathered, &edges, 1, error));
    uform_trainer_step_t all = *step;
    void* memory = NULL;
    if (s->mesh) {
        size_t items = s->whole.segments_count, ids = edges.edges[0] + edges.edges[1] + edges.edges[2];
        memory = malloc(3 * (items + 1) * sizeof(uint32_t) + ids * (sizeof(uint32_t) + sizeof(float)) + 1);
        if (!memory) return uform_fail(error, uform_status_out_of_memory_k, "no memory for the step's %zu edges", ids);
        uint32_t* cursor = memory;
        for (int k = 0; k != 3; ++k) edges.offsets[k] = cursor, cursor += items + 1;
        for (int k = 0; k != 3; ++k) edges.ids[k] = cursor, cursor += edges.edges[k];
        for (int k = 0; k != 3; ++k) edges.weights[k] = (float*)cursor, cursor += edges.edges[k];
        for (int k = 0; k != 3; ++k) edges.edges[k] = 0, edges.offsets[k][0] = 0;
    }
    uform_status_t status = uform_spread_read(s, config, gathered, &edges, 0, error);
    if (s->mesh) {
        all = (uform_trainer_step_t){.count = s->whole.segments_count};
        uform_edges_view_t* relations[3] = {&all.attract, &all.repel, &all.ignore};
        for (int k = 0; k != 3; ++k)
            if (edges.present[k])
                *relations[k] = (uform_edges_view_t){edges.offsets[k], edges.ids[k], edges.weights[k], edges.edges[k]};
    }
    if (status == uform_status_success_k && config->given.objective != uform_objective_masked_k)
        uform_batch_cells(&s->whole, config, &all);
    if (status == uform_status_success_k && config->given.late_interaction.weight > 0)
        uform_batch_late_pairs(&s->whole, config, &all);
    free(memory);
    return status;
}

/* Checks what one process can check of its share alone, and splits it over its devices. */
static uform_status_t uform_spread_check(uform_spread_t* s, uform_config_t const* config, uform_trainer_step_t const* step,
                                         uform_decoded_s const* decoded, char const** error) {
    if (!step) return UFORM_INVALID("batch: NULL");
    if (!step->count) return uform_batch_pack(s->packs[0], config, step, decoded, 0, 0, 0, error); /* names it */
    size_t count = step->count;
    UFORM_TRY(uform_tape_entries(&step->contents, 1, count, "batch.contents", error));
    UFORM_TRY(uform_tape_entries(&step->choices, 0, count, "batch.choices", error));
    UFORM_TRY(uform_tape_entries(&step->choice_targets, 0, count, "batch.choice_targets", error));
    if (decoded && decoded->count != count)
        return UFORM_INVALID("step.decoded: made from %zu items, not this batch's %zu", decoded->count, count);
    UFORM_TRY(uform_spread_split(s, config, step, error));
    UFORM_TRY(uform_batch_check_relations(step, error));
    return uform_spread_edges(s, config, step, error);
}

uform_status_t uform_spread_pack(uform_spread_t* s, uform_config_t const* config, uform_trainer_step_t const* step,
                                 uform_decoded_s const* decoded, uint64_t step_number, uform_status_t refused,
                                 char const** error) {
    uform_status_t status = refused != uform_status_success_k ? refused : uform_spread_check(s, config, step, decoded, error);
    /* On a mesh every process takes part in every exchange, so that a share refused anywhere fails the step
       everywhere, and nobody waits for a peer that gave up. */
    size_t count = status == uform_status_success_k ? step->count : 0;
    s->first_item = 0, s->items = count;
    if (s->mesh) status = uform_spread_count(s, status, count, step_number, error);
    if (s->mesh && status != uform_status_success_k) return status; /* every process failed alike */
    for (uint32_t d = 0; d != s->devices && status == uform_status_success_k; ++d) {
        size_t first = uform_spread_first(s, d), items = uform_spread_items(s, d); /* within this process's items */
        if (!items) continue;
        uform_trainer_step_t slice = uform_step_slice(step, first, items);
        uform_decoded_s run;
        if (decoded) {
            run = *decoded;
            run.count = items, run.offsets += first, run.modalities += first, run.grids += first, run.values += first;
        }
        status = uform_batch_pack(s->packs[d], config, &slice, decoded ? &run : NULL, step_number, first,
                                  s->first_item + first, error);
        /* A device's capacity is what the message quotes; where the items went is what the split decided. */
        if (status != uform_status_success_k)
            status = uform_fail(error, status, "%s (on device %u of %u, given items %zu to %zu by the split, which "
                                "shares the items out by count and keeps bags whole)",
                                error && *error ? *error : uform_message(), d, s->devices, first, first + items - 1);
    }
    if (!s->mesh && status != uform_status_success_k) return status;
    uform_bytes_t mine = {0};
    if (status == uform_status_success_k) uform_spread_describe(s, config, step, &mine);
    uint8_t* gathered = NULL;
    status = uform_spread_share(s, status, &mine, &gathered, error);
    if (status == uform_status_success_k) status = uform_spread_whole(s, config, step, gathered, error);
    if (gathered != mine.data) free(gathered);
    free(mine.data);
    return status;
}

/* ---------------------------------------------------------------------------------------------- */
/*  The step's meeting points                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* Hands every process the others' rows of `all` (`width` floats a row, process p's from row `firsts[p]`), in
   backend memory, where this process's own rows already are. */
static uform_status_t uform_spread_exchange(uform_spread_t* s, void* context, float* all, size_t const* firsts,
                                            size_t width, char const** error) {
    uint32_t me = s->mesh->host_domain_index;
    size_t first = firsts[s->process_devices[me]], end = firsts[s->process_devices[me + 1]];
    size_t bytes = (end - first) * width * sizeof(float);
    float* mine = malloc(bytes + 1);
    if (!mine) return uform_fail(error, uform_status_out_of_memory_k, "no memory to gather %zu bytes", bytes);
    uform_status_t status = s->backend->download(context, mine, all + first * width, bytes);
    if (status != uform_status_success_k) status = uform_fail(error, status, "%s", uform_message());
    uint8_t* gathered = NULL;
    if (status == uform_status_success_k) status = uform_mesh_all_gather(s->mesh, mine, bytes, &gathered, s->sizes, error);
    size_t at = 0;
    for (uint32_t p = 0; p != s->processes && status == uform_status_success_k; at += s->sizes[p++]) {
        size_t start = firsts[s->process_devices[p]], end = firsts[s->process_devices[p + 1]];
        if (s->sizes[p] != (end - start) * width * sizeof(float))
            status = uform_fail(error, uform_status_peer_k, "mesh: host domain %u gathered %zu bytes, not %zu", p,
                                s->sizes[p], (end - start) * width * sizeof(float));
        else if (p != me) status = s->backend->upload(context, all + start * width, gathered + at, s->sizes[p]);
    }
    free(mine), free(gathered);
    return status;
}

/* Lays every device's pooled embeddings, and its token vectors where late interaction runs, side by side in item
   order: the all-gather. */
static uform_status_t uform_spread_gather(uform_spread_t* s, uform_layout_t const* layout, uform_terms_t const* step,
                                          char const** error) {
    size_t h = layout->hidden;
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t const* r = s->replicas[d];
        size_t items = uform_spread_items(s, d), count = s->packs[d]->late_rows_count, width = r->late_width;
        if (!items) continue;
        UFORM_TRY(s->backend->copy(r->context, s->pooled + uform_spread_first(s, d) * h, r->pooled,
                                   items * h * sizeof(float)));
        if (!step->late_ran) continue;
        UFORM_TRY(s->backend->copy(r->context, s->late_unit + s->rows[s->first_device + d] * width, r->late_unit,
                                   count * width * sizeof(float)));
    }
    if (!s->mesh) return uform_status_success_k;
    for (uint32_t d = 0; d != s->devices; ++d) UFORM_TRY(s->backend->synchronize(s->replicas[d]->context));
    if (step->contrastive_ran) UFORM_TRY(uform_spread_exchange(s, s->context, s->pooled, s->firsts, h, error));
    if (step->late_ran)
        UFORM_TRY(uform_spread_exchange(s, s->context, s->late_unit, s->rows, s->replicas[0]->late_width, error));
    return uform_status_success_k;
}

/* Host domain 0 ran the gathered terms: every other process takes their losses, the gradients of every row and the
   unit embeddings (its own rows of which a step hands back) from it. */
static uform_status_t uform_spread_terms_broadcast(uform_spread_t* s, uform_layout_t const* layout,
                                                   uform_terms_t const* step, char const** error) {
    size_t h = layout->hidden, items = s->whole.segments_count, rows = s->whole.late_rows_count;
    size_t width = s->replicas[0]->late_width, pooled = step->contrastive_ran ? items * h : 0;
    size_t late = step->late_ran ? rows * width : 0, scalars = 2 * sizeof(double) / sizeof(float);
    size_t bytes = (scalars + 2 * pooled + late) * sizeof(float);
    float* host = malloc(bytes);
    if (!host) return uform_fail(error, uform_status_out_of_memory_k, "no memory to send %zu bytes", bytes);
    int first = s->mesh->host_domain_index == 0;
    float *d_pooled = host + scalars, *normalized = d_pooled + pooled, *d_late = normalized + pooled;
    uform_backend_t const* b = s->backend;
    uform_status_t status = uform_status_success_k;
    if (first) {
        double terms[2] = {s->scalars[uform_scalar_contrastive_loss_k], s->scalars[uform_scalar_late_interaction_loss_k]};
        memcpy(host, terms, sizeof(terms));
        if (pooled) status = b->download(s->context, d_pooled, s->d_pooled, pooled * sizeof(float));
        if (pooled && status == uform_status_success_k)
            status = b->download(s->context, normalized, s->normalized, pooled * sizeof(float));
        if (late && status == uform_status_success_k)
            status = b->download(s->context, d_late, s->d_late_unit, late * sizeof(float));
        if (status != uform_status_success_k) status = uform_fail(error, status, "%s", uform_message());
    }
    if (status == uform_status_success_k) status = uform_mesh_broadcast(s->mesh, host, bytes, error);
    if (!first && status == uform_status_success_k) {
        double terms[2];
        memcpy(terms, host, sizeof(terms));
        s->scalars[uform_scalar_contrastive_loss_k] = terms[0], s->scalars[uform_scalar_late_interaction_loss_k] = terms[1];
        if (pooled) status = b->upload(s->context, s->d_pooled, d_pooled, pooled * sizeof(float));
        if (pooled && status == uform_status_success_k)
            status = b->upload(s->context, s->normalized, normalized, pooled * sizeof(float));
        if (late && status == uform_status_success_k)
            status = b->upload(s->context, s->d_late_unit, d_late, late * sizeof(float));
        if (status == uform_status_success_k) status = b->synchronize(s->context); /* before `host` goes */
        if (status != uform_status_success_k) status = uform_fail(error, status, "%s", uform_message());
    }
    free(host);
    return status;
}

/* Hands each device the gathered terms' gradients of its own rows: the adjoint of the gather. */
static uform_status_t uform_spread_scatter(uform_spread_t* s, uform_layout_t const* layout, uform_terms_t const* step) {
    size_t h = layout->hidden;
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t* r = s->replicas[d];
        size_t items = uform_spread_items(s, d), count = s->packs[d]->late_rows_count, width = r->late_width;
        if (!items) continue;
        if (step->contrastive_ran)
            UFORM_TRY(s->backend->copy(r->context, r->d_pooled, s->d_pooled + uform_spread_first(s, d) * h,
                                       items * h * sizeof(float)));
        if (!step->late_ran) continue;
        UFORM_TRY(s->backend->copy(r->context, r->d_late_unit, s->d_late_unit + s->rows[s->first_device + d] * width,
                                   count * width * sizeof(float)));
    }
    return uform_status_success_k;
}

/* A device's share of the means of the terms scored where their positions are: its mean weighed by its share of
   the term's positions, or nothing where the term did not run on it. */
enum { uform_shared_masked_k = 0, uform_shared_choices_k = 1, uform_shared_media_k = 2,
       uform_shared_k = 2 + uform_media_kinds_k };

static double uform_spread_mean(double device, size_t positions, size_t total, int ran) {
    return ran ? device * (double)positions / (double)total : 0;
}

/* Sums every device's gradients in device order, and the terms each scored where its positions are; every device
   then holds both: the all-reduce. On a mesh, the order is every process's devices in host-domain order. */
static uform_status_t uform_spread_all_reduce(uform_spread_t* s, uform_layout_t const* layout, char const** error) {
    size_t total = layout->total, parts = 0;
    float *sum = s->sum, *part = s->sum + total;
    uform_packed_t const* whole = &s->whole;
    double* scalars = s->scalars;
    double shares[64][uform_shared_k];
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t const* r = s->replicas[d];
        uform_packed_t const* p = s->packs[d];
        uform_terms_t const* t = &s->terms[d];
        double own[uform_scalars_k];
        for (int k = 0; k != uform_shared_k; ++k) shares[d][k] = 0;
        if (!uform_spread_items(s, d)) continue;
        float* landing = s->mesh ? s->parts + parts * total : parts ? part : sum;
        UFORM_TRY(s->backend->download(r->context, landing, r->gradients, total * sizeof(float)));
        UFORM_TRY(s->backend->download(r->context, own, r->scalars, sizeof(own)));
        for (size_t k = 0; !s->mesh && parts && k != total; ++k) sum[k] += part[k];
        ++parts;
        shares[d][uform_shared_masked_k] = uform_spread_mean(own[uform_scalar_masked_loss_k], p->masked_count,
                                                             whole->masked_count, t->masked_ran);
        shares[d][uform_shared_choices_k] = uform_spread_mean(own[uform_scalar_choices_loss_k], p->choices_count,
                                                              whole->choices_count, t->choices_ran);
        for (int kind = 0; kind != uform_media_kinds_k; ++kind)
            shares[d][uform_shared_media_k + kind] = uform_spread_mean(own[uform_scalar_media_loss_k + kind],
                                                                       p->media_hidden[kind], whole->media_hidden[kind],
                                                                       t->media_ran[kind]);
    }
    uint8_t* gathered = (uint8_t*)shares;
    if (s->mesh) {
        float const* pointers[64];
        for (size_t k = 0; k != parts; ++k) pointers[k] = s->parts + k * total;
        UFORM_TRY(uform_mesh_sum(s->mesh, sum, part, pointers, parts, total, error));
        UFORM_TRY(uform_mesh_all_gather(s->mesh, shares, s->devices * sizeof(shares[0]), &gathered, s->sizes, error));
        size_t bytes = 0;
        for (uint32_t p = 0; p != s->processes; ++p) bytes += s->sizes[p];
        if (bytes != s->all_devices * sizeof(shares[0])) {
            free(gathered);
            return uform_fail(error, uform_status_peer_k, "mesh: the processes sent %zu bytes of losses for %u devices",
                              bytes, s->all_devices);
        }
    }
    scalars[uform_scalar_masked_loss_k] = scalars[uform_scalar_choices_loss_k] = 0;
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) scalars[uform_scalar_media_loss_k + kind] = 0;
    for (uint32_t d = 0; d != s->all_devices; ++d) { /* in device order, whichever process each is in */
        double share[uform_shared_k];
        memcpy(share, gathered + d * sizeof(share), sizeof(share));
        scalars[uform_scalar_masked_loss_k] += share[uform_shared_masked_k];
        scalars[uform_scalar_choices_loss_k] += share[uform_shared_choices_k];
        for (int kind = 0; kind != uform_media_kinds_k; ++kind)
            scalars[uform_scalar_media_loss_k + kind] += share[uform_shared_media_k + kind];
    }
    if (gathered != (uint8_t*)shares) free(gathered);
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t* r = s->replicas[d];
        UFORM_TRY(s->backend->upload(r->context, r->gradients, sum, total * sizeof(float)));
        UFORM_TRY(s->backend->upload(r->context, r->scalars, scalars, uform_scalars_k * sizeof(double)));
        UFORM_TRY(uform_model_finish(r, layout));
    }
    return uform_status_success_k;
}

/* A device's weight of a mean over the step's positions: the term's weight times its share of them. */
static float uform_spread_share_of(float weight, size_t positions, size_t total) {
    return total ? (float)((double)weight * (double)positions / (double)total) : weight;
}

static uform_status_t uform_spread_run(uform_spread_t* s, uform_layout_t const* layout, uform_config_t const* config,
                                       char const** error) {
    uform_packed_t const* whole = &s->whole;
    uform_terms_t step = uform_model_terms(config, whole);
    for (uint32_t d = 0; d != s->devices; ++d) {
        uform_replica_t* r = s->replicas[d];
        uform_packed_t const* p = s->packs[d];
        uform_terms_t* t = &s->terms[d];
        if (!uform_spread_items(s, d)) continue;
        *t = uform_model_terms(config, p);
        t->text_weight = uform_spread_share_of(step.text_weight, p->masked_count, whole->masked_count);
        t->choices_weight = uform_spread_share_of(step.choices_weight, p->choices_count, whole->choices_count);
        for (int kind = 0; kind != uform_media_kinds_k; ++kind)
            t->media_weight[kind] = uform_spread_share_of(step.media_weight[kind], p->media_hidden[kind],
                                                          whole->media_hidden[kind]);
        t->contrastive_ran = step.contrastive_ran;
        t->late_ran = step.late_ran && p->late_rows_count;
        UFORM_TRY(uform_model_upload(r, p, 1));
        UFORM_TRY(uform_model_device_forward(r, layout, config, p, t));
    }
    UFORM_TRY(uform_spread_gather(s, layout, &step, error));
    /* The gathered terms run where the step's device 0 is; their temperature and bias gradients join that device's,
       before the all-reduce sums them. */
    uform_replica_t* first = s->replicas[0];
    int running = !s->mesh || s->mesh->host_domain_index == 0;
    if (step.contrastive_ran && running)
        UFORM_TRY(uform_model_contrastive_term(first, s->context, layout, config,
                                               &s->scalars[uform_scalar_contrastive_loss_k], s->d_pooled, s->normalized,
                                               s->pooled, whole->cells, whole->weights, whole->groups,
                                               whole->segments_count));
    if (step.late_ran && running) {
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
    if (s->mesh && (step.contrastive_ran || step.late_ran)) {
        UFORM_TRY(s->backend->synchronize(s->context));
        UFORM_TRY(uform_spread_terms_broadcast(s, layout, &step, error));
    }
    UFORM_TRY(uform_spread_scatter(s, layout, &step));
    for (uint32_t d = 0; d != s->devices; ++d)
        if (uform_spread_items(s, d))
            UFORM_TRY(uform_model_device_backward(s->replicas[d], layout, s->packs[d], &s->terms[d]));
    return uform_spread_all_reduce(s, layout, error);
}

uform_status_t uform_spread_gradients(uform_spread_t* s, uform_layout_t const* layout, uform_config_t const* config,
                                      char const** error) {
    uform_status_t status = uform_spread_run(s, layout, config, error);
    /* Past the packing, the processes must meet at every point: one that fails hangs up, so the others fail too. */
    if (status != uform_status_success_k && s->mesh) uform_mesh_break(s->mesh);
    return status;
}
