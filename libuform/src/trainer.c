/**
 *  @file   trainer.c
 *  @brief  The trainer's verbs: start or resume a run, step, save (whole, or the weights alone), free.
 *
 *  A step is four passes over device-sized buffers: pack (host), forward, losses, backward
 *  (`model.c`, on the backend), then the update: one global gradient norm, a skip when anything
 *  is not finite, clipping, AdamW per tensor. Steps on one trainer are serialized by its lock; on a backend
 *  that queues (a GPU), a step may begin, packed and queued, before the one ahead of it lands. On a RAM
 *  executor of several simulated devices, `devices.c` spreads the passes over them and sums their gradients first.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"

/* A step begun and not yet ended (`uform_trainer_step_begin`): what its end needs once the device has run it. */
typedef struct uform_flight_t {
    uform_trainer_step_t* step;  /* the caller's, borrowed until its end */
    uform_trainer_stats_t stats; /* its counts once queued, the rest once settled */
    uform_terms_t terms;
    uint64_t next;               /* its update's number, if it applies */
    float rate;
    int settled;                 /* run and read back: `stats` is whole and `trainer.step` counts it */
    int guessed;                 /* queued before the step ahead of it landed, as if that one applies */
} uform_flight_t;

/* The step's scalars and its scored temperatures and biases, as the replica's buffer lays them out. */
typedef struct uform_read_t {
    double scalars[uform_scalars_k];
    float scored[2 * UFORM_MAX_TEMPERATURE_GROUPS];
} uform_read_t;

typedef struct uform_trainer_s {
    uform_serial_t serial;
    uform_executor_s* executor;
    uform_mesh_s* mesh;
    uform_config_t config;
    uform_layout_t layout;
    uform_packed_t packed;
    uform_replica_t replica;
    uform_spread_t* spread; /* the other simulated devices of a RAM executor of several; NULL on one device */
    uform_trainer_t self; /* the handle callers know it by: what decoded media name as their trainer */
    uint64_t step; /* updates applied so far */
    uform_flight_t flights[uform_flights_k]; /* the steps begun and not ended: `flying` of them from `oldest` */
    unsigned flying, oldest;
    int fenced;           /* the backend queues: a step may begin before the one ahead of it lands */
    uform_read_t* reads;  /* (uform_flights_k) where each flight's scalars are fetched: pinned on a GPU */
    uint64_t fingerprint; /* a hash of the weights and moments it started from, for a mesh's processes to compare */
    char config_json[4096];
} uform_trainer_s;

/* An operation's failure carries its message in this thread's storage: hand it to the caller. */
static uform_status_t uform_trainer_failed(uform_status_t status, char const** error) {
    if (error) *error = uform_message();
    return status;
}

/* Device `d`'s replica: the trainer's own is device 0's. */
static uform_replica_t* uform_trainer_replica(uform_trainer_s* trainer, uint32_t d) {
    return trainer->spread ? trainer->spread->replicas[d] : &trainer->replica;
}

static uint32_t uform_trainer_devices(uform_trainer_s const* trainer) {
    return trainer->spread ? trainer->spread->devices : 1;
}

static void uform_trainer_release(uform_trainer_s* trainer) {
    if (trainer->reads) trainer->replica.backend->host_release(trainer->replica.context, trainer->reads);
    uform_spread_free(trainer->spread);
    uform_model_close(&trainer->layout, &trainer->replica, &trainer->packed);
    pthread_mutex_destroy(&trainer->serial.lock);
    free(trainer);
}

/* Fills the weights from keyed draws, or from the checkpoint to resume, then moves them to the device. */
static uform_status_t uform_trainer_start(uform_trainer_s* trainer, char const** error) {
    uform_layout_t const* layout = &trainer->layout;
    uform_replica_t* replica = &trainer->replica;
    uform_backend_t const* backend = replica->backend;
    size_t bytes = layout->total * sizeof(float);
    float* host = calloc(3 * layout->total, sizeof(float));
    if (!host)
        return uform_fail(error, uform_status_out_of_memory_k, "no memory to initialize %zu weights (%zu bytes)",
                          layout->total, 3 * bytes);
    float *weights = host, *first = host + layout->total, *second = host + 2 * layout->total;
    uform_status_t status = uform_status_success_k;
    if (trainer->config.given.resume) {
        status = uform_checkpoint_load(trainer->config.given.resume, layout, weights, first, second, &trainer->step,
                                       error);
    } else {
        uint64_t seed = trainer->config.given.seed;
        for (size_t i = 0; i != layout->count; ++i) {
            uform_tensor_t const* tensor = &layout->tensors[i];
            float* values = weights + tensor->offset;
            for (size_t k = 0, n = tensor->rows * tensor->cols; k != n; ++k)
                values[k] = tensor->init_std ? tensor->init_std * uform_normal(uform_key(seed, uform_stream_init_k, 0, i, k))
                                             : tensor->init_value;
        }
    }
    uint64_t fingerprint = 0; /* only a mesh's processes compare it: a trainer alone spends nothing on it */
    int compared = trainer->mesh && trainer->mesh->transport;
    for (size_t i = 0; compared && i != 3 * layout->total && status == uform_status_success_k; ++i) {
        uint32_t bits;
        memcpy(&bits, &host[i], sizeof(bits));
        fingerprint = uform_mix(fingerprint ^ bits);
    }
    trainer->fingerprint = fingerprint;
    /* Every device starts from the same weights and moments, and the same summed updates keep them equal. */
    for (uint32_t d = 0; d != uform_trainer_devices(trainer) && status == uform_status_success_k; ++d) {
        replica = uform_trainer_replica(trainer, d);
        void* context = replica->context;
        status = uform_replica_upload_weights(replica, layout, weights);
        if (status == uform_status_success_k) status = backend->upload(context, replica->first, first, bytes);
        if (status == uform_status_success_k) status = backend->upload(context, replica->second, second, bytes);
        if (status == uform_status_success_k) status = backend->synchronize(context); /* before `host` goes */
    }
    if (status != uform_status_success_k && error && !*error) *error = uform_message();
    free(host);
    return status;
}

/* Shares `payload` with every process of the trainer's mesh, or where this process failed, its message: all fail when
   any failed, naming it. Each process's block lands in `*gathered` (freed by the caller) as its status, then its
   payload, `sizes` bytes in all. */
static uform_status_t uform_trainer_share(uform_trainer_s* trainer, uform_status_t status, void const* payload,
                                          size_t bytes, uint8_t** gathered, size_t* sizes, char const** error) {
    uint32_t code = (uint32_t)status;
    char const* message = uform_message();
    size_t length = status == uform_status_success_k ? bytes : strlen(message);
    char* mine = malloc(4 + length);
    *gathered = NULL;
    if (!mine) return uform_fail(error, uform_status_out_of_memory_k, "no memory to agree with the mesh");
    memcpy(mine, &code, 4), memcpy(mine + 4, status == uform_status_success_k ? payload : message, length);
    uform_status_t shared = uform_mesh_all_gather(trainer->mesh, mine, 4 + length, gathered, sizes, error);
    free(mine);
    if (shared != uform_status_success_k || status != uform_status_success_k)
        return shared != uform_status_success_k ? shared : uform_fail(error, status, "%s", message);
    size_t at = 0;
    for (uint32_t p = 0; p != trainer->mesh->host_domain_count; at += sizes[p++]) {
        if (sizes[p] >= 4) memcpy(&code, *gathered + at, 4);
        if (sizes[p] >= 4 && code > uform_status_peer_k) /* no status: another exchange's bytes */
            return uform_mesh_out_of_step(trainer->mesh, p, "a gather?", "makes its trainer", error);
        if (sizes[p] < 4 || code != uform_status_success_k)
            return uform_fail(error, sizes[p] < 4 ? uform_status_peer_k : (uform_status_t)code,
                              "host domain %u could not make its trainer: %.*s", p, (int)(sizes[p] > 4 ? sizes[p] - 4 : 0),
                              (char const*)*gathered + at + 4);
    }
    return uform_status_success_k;
}

/* The value at `at` in a config's JSON, up to the next comma or brace, as text. */
static void uform_json_value(char const* json, size_t length, size_t at, char* value, size_t capacity) {
    while (at < length && json[at] == ' ') ++at;
    size_t end = at, depth = 0;
    while (end != length && (depth || (json[end] != ',' && json[end] != '}'))) {
        depth += json[end] == '[', depth -= json[end] == ']' && depth;
        ++end;
    }
    snprintf(value, capacity, "%.*s", (int)(end - at), json + at);
}

/* Where two configs' JSON first differ: the field's path (`schedule.learning_rate`) and both values, so that a
   refusal names the field rather than quote a config whole. */
static void uform_config_difference(char const* ours, size_t our_length, char const* theirs, size_t their_length,
                                    char* field, char* our_value, char* their_value) {
    size_t at = 0;
    while (at != our_length && at != their_length && ours[at] == theirs[at]) ++at;
    /* Walk to the difference keeping each object's current key: the path is the keys of the objects open there. */
    char keys[8][48] = {{0}};
    size_t value = 0, depth = 0;
    for (size_t i = 0; i < at; ++i) {
        if (ours[i] == '{') ++depth;
        else if (ours[i] == '}' && depth) --depth;
        else if (ours[i] == '"') {
            size_t start = ++i;
            while (i < our_length && ours[i] != '"') i += ours[i] == '\\' ? 2 : 1;
            if (i + 1 < our_length && ours[i + 1] == ':' && depth && depth <= 8) {
                snprintf(keys[depth - 1], sizeof(keys[0]), "%.*s", (int)(i - start), ours + start);
                value = i + 2;
            }
        }
    }
    size_t used = 0;
    field[0] = 0;
    for (size_t d = 0; d != depth && d != 8 && used < 128; ++d)
        used += (size_t)snprintf(field + used, 128 - used, "%s%s", d ? "." : "", keys[d]);
    uform_json_value(ours, our_length, value, our_value, 64);
    uform_json_value(theirs, their_length, value, their_value, 64);
}

/* On a mesh of several processes, every process's trainer must train the same model: the processes share their
   configs (or why they could not make one) and the devices each brings. */
static uform_status_t uform_trainer_agree(uform_trainer_s* trainer, uform_status_t status, uint32_t* devices_of,
                                          char const** error) {
    uform_mesh_s* mesh = trainer->mesh;
    size_t length = strlen(trainer->config_json), at = 0, *sizes = calloc(mesh->host_domain_count, sizeof(size_t));
    char* mine = malloc(4 + length);
    if (!mine || !sizes) {
        free(mine), free(sizes);
        return uform_fail(error, uform_status_out_of_memory_k, "no memory to agree on the config");
    }
    memcpy(mine, &trainer->executor->devices, 4), memcpy(mine + 4, trainer->config_json, length);
    uint8_t* gathered = NULL;
    status = uform_trainer_share(trainer, status, mine, 4 + length, &gathered, sizes, error);
    for (uint32_t p = 0; p != mesh->host_domain_count && status == uform_status_success_k; at += sizes[p++]) {
        char const* theirs = (char const*)gathered + at + 4;
        size_t their_length = sizes[p] >= 8 ? sizes[p] - 8 : 0;
        if (sizes[p] >= 8) memcpy(&devices_of[p], theirs, 4);
        if (sizes[p] < 8 || !devices_of[p] || devices_of[p] > 64)
            status = uform_fail(error, uform_status_peer_k, "mesh: host domain %u sent %zu bytes of its config", p,
                                sizes[p]);
        else if (their_length != length || memcmp(theirs + 4, trainer->config_json, length)) {
            char field[128], ours[64], others[64];
            uform_config_difference(trainer->config_json, length, theirs + 4, their_length, field, ours, others);
            int first = mesh->host_domain_index < p; /* the lower host domain first, alike on every process */
            status = uform_fail(error, uform_status_invalid_argument_k, "config.%s: %s on host domain %u, %s on host "
                                "domain %u; every process of a mesh trains one model", field, first ? ours : others,
                                first ? mesh->host_domain_index : p, first ? others : ours,
                                first ? p : mesh->host_domain_index);
        }
    }
    free(mine), free(sizes), free(gathered);
    return status;
}

/* Once started, the processes compare where they start from: the same step, weights and moments, which a run resumed
   from different checkpoints would not have. */
static uform_status_t uform_trainer_agree_start(uform_trainer_s* trainer, uform_status_t status, char const** error) {
    uform_mesh_s* mesh = trainer->mesh;
    uint64_t mine[2] = {trainer->step, trainer->fingerprint};
    size_t at = 0, *sizes = calloc(mesh->host_domain_count, sizeof(size_t));
    if (!sizes) return uform_fail(error, uform_status_out_of_memory_k, "no memory to agree on the start");
    uint8_t* gathered = NULL;
    status = uform_trainer_share(trainer, status, mine, sizeof(mine), &gathered, sizes, error);
    for (uint32_t p = 0; p != mesh->host_domain_count && status == uform_status_success_k; at += sizes[p++]) {
        uint64_t theirs[2] = {0, 0};
        if (sizes[p] == 4 + sizeof(theirs)) memcpy(theirs, gathered + at + 4, sizeof(theirs));
        if (sizes[p] != 4 + sizeof(theirs) || theirs[0] != mine[0] || theirs[1] != mine[1])
            status = uform_fail(error, uform_status_invalid_argument_k, "config.resume: host domain %u starts at step "
                                "%llu, host domain %u at step %llu%s; every process of a mesh starts from the same "
                                "checkpoint", p, (unsigned long long)theirs[0], mesh->host_domain_index,
                                (unsigned long long)mine[0], theirs[0] == mine[0] ? ", from other weights" : "");
    }
    free(sizes), free(gathered);
    return status;
}

/* Makes a trainer on an executor (and mesh) the caller has acquired; the trainer keeps those borrows
   for its life, and only joins the table of handles once whole. */
static uform_status_t uform_trainer_make(uform_executor_s* executor, uform_mesh_s* mesh,
                                         uform_trainer_init_vram_t const* config, uform_trainer_t* trainer,
                                         char const** error) {
    if (!trainer) return uform_fail(error, uform_status_invalid_argument_k, "trainer: NULL output pointer");
    uform_trainer_s* made = calloc(1, sizeof(uform_trainer_s));
    if (!made) return uform_fail(error, uform_status_out_of_memory_k, "no memory for a trainer");
    pthread_mutex_init(&made->serial.lock, NULL);
    made->executor = executor, made->mesh = mesh;
    uform_status_t status = uform_model_open(executor, config, 1, &made->config, &made->layout, &made->replica,
                                             &made->packed, error);
    if (status == uform_status_success_k)
        uform_config_to_json(&made->config, made->config_json, sizeof(made->config_json));
    /* On a mesh of several processes, every process meets every other twice, whatever failed on its own side, so
       that all fail alike and none waits for a trainer another process gave up on. */
    int several = mesh && mesh->transport, agreed = 0;
    uint32_t* devices_of = several ? calloc(mesh->host_domain_count, sizeof(uint32_t)) : NULL;
    if (several && !devices_of)
        status = uform_fail(error, uform_status_out_of_memory_k, "no memory for %u processes", mesh->host_domain_count);
    if (several) status = uform_trainer_agree(made, status, devices_of, error), agreed = status == uform_status_success_k;
    if (status == uform_status_success_k && (executor->devices > 1 || several))
        status = uform_spread_init(&made->spread, executor, &made->config, &made->layout, &made->replica,
                                   &made->packed, several ? mesh : NULL, devices_of, error);
    free(devices_of);
    uform_backend_t const* backend = made->replica.backend;
    made->fenced = backend && backend->fence && !made->spread;
    if (status == uform_status_success_k && made->fenced) {
        status = backend->host_allocate(made->replica.context, uform_flights_k * sizeof(uform_read_t),
                                        (void**)&made->reads);
        if (status != uform_status_success_k) uform_trainer_failed(status, error);
    }
    if (status == uform_status_success_k) status = uform_trainer_start(made, error);
    if (agreed) status = uform_trainer_agree_start(made, status, error), agreed = status == uform_status_success_k;
    if (status == uform_status_success_k) {
        status = uform_handles_add(made, uform_handle_trainer_k, trainer, error);
        if (status == uform_status_success_k) made->self = *trainer;
    }
    /* Past the agreements every process counts on every other's trainer: one that fails hangs up on them. */
    if (status != uform_status_success_k && agreed) uform_mesh_break(mesh);
    if (status != uform_status_success_k) uform_trainer_release(made);
    return status;
}

/* Both verbs share one path: the executor's kind decides the backend, and the verb only checks it was the one meant. */
static uform_status_t uform_trainer_init(uform_executor_t executor, int vram, uform_trainer_init_vram_t const* config,
                                         uform_mesh_t mesh, uform_trainer_t* trainer, char const** error) {
    /* Both are borrowed before anything reads them, so a free racing this call answers busy, never
       frees them under it. */
    void *devices = NULL, *peers = NULL;
    uform_status_t status = uform_handles_acquire(executor, uform_handle_executor_k, "executor", &devices, error);
    if (status == uform_status_success_k) {
        int is_vram = ((uform_executor_s*)devices)->backend != &uform_ram_backend;
        if (is_vram != vram)
            status = uform_fail(error, uform_status_invalid_argument_k, "executor: a %s executor; use uform_trainer_init_%s",
                                is_vram ? "VRAM" : "RAM", is_vram ? "vram" : "ram");
    }
    if (status == uform_status_success_k && mesh)
        status = uform_handles_acquire(mesh, uform_handle_mesh_k, "mesh", &peers, error);
    /* The mesh's processes meet with the executors they joined with, whose devices they count. */
    if (status == uform_status_success_k && peers && ((uform_mesh_s*)peers)->executor != devices) {
        char const* reason = "mesh: joined with another executor than this one";
        /* Its peers wait for this trainer: they fail making theirs too, and the mesh stays whole for the next try. */
        uform_mesh_refused(peers, uform_status_invalid_argument_k, reason, NULL);
        status = uform_fail(error, uform_status_invalid_argument_k, "%s", reason);
    }
    if (status == uform_status_success_k) status = uform_trainer_make(devices, peers, config, trainer, error);
    if (status != uform_status_success_k) uform_handles_release(devices), uform_handles_release(peers);
    return status;
}

uform_status_t uform_trainer_init_ram(uform_executor_t executor, uform_trainer_init_vram_t const* config,
                                      uform_mesh_t mesh, uform_trainer_t* trainer, char const** error) {
    return uform_trainer_init(executor, 0, config, mesh, trainer, error);
}

uform_status_t uform_trainer_init_vram(uform_executor_t executor, uform_trainer_init_vram_t const* config,
                                       uform_mesh_t mesh, uform_trainer_t* trainer, char const** error) {
    return uform_trainer_init(executor, 1, config, mesh, trainer, error);
}

/* Takes the trainer for one verb: checked live, counted as borrowed so it cannot be freed meanwhile, locked. */
static uform_status_t uform_trainer_enter(uform_trainer_t handle, uform_trainer_s** trainer, char const** error) {
    void* object = NULL;
    uform_status_t status = uform_handles_enter(handle, uform_handle_trainer_k, "trainer", &object, error);
    *trainer = object;
    return status;
}

static void uform_trainer_leave(uform_trainer_s* trainer) { uform_handles_leave(trainer); }

/* A step's counts, known once it is packed. */
static void uform_stats_count(uform_trainer_stats_t* stats, uform_terms_t terms, uform_packed_t const* counted,
                              uint32_t groups) {
    memset(stats, 0, sizeof(*stats));
    for (int kind = 0; kind != uform_media_kinds_k; ++kind)
        stats->masked_patches += terms.media_ran[kind] ? counted->media_hidden[kind] : 0;
    stats->items = counted->segments_count;
    stats->tokens = counted->tokens_count;
    stats->truncated_items = counted->truncated;
    stats->masked_positions = terms.masked_ran ? counted->masked_count : 0;
    stats->contrastive_rows = terms.contrastive_ran ? counted->contrastive_rows : 0;
    stats->choice_items = terms.choices_ran ? counted->choices_count : 0;
    stats->query_rows = terms.late_ran ? counted->late_rows_counted : 0;
    stats->temperature_groups = groups;
}

/* A step's losses, norm and scored temperatures, from its read scalars. */
static void uform_stats_score(uform_trainer_stats_t* stats, uform_terms_t terms, uform_read_t const* read) {
    double const* scalars = read->scalars;
    uint32_t groups = stats->temperature_groups;
    stats->loss = uform_terms_ran(terms) ? (float)uform_total_loss(scalars, terms) : NAN;
    stats->masked_loss = terms.masked_ran ? (float)scalars[uform_scalar_masked_loss_k] : NAN;
    stats->contrastive_loss = terms.contrastive_ran ? (float)scalars[uform_scalar_contrastive_loss_k] : NAN;
    stats->choices_loss = terms.choices_ran ? (float)scalars[uform_scalar_choices_loss_k] : NAN;
    stats->late_interaction_loss = terms.late_ran ? (float)scalars[uform_scalar_late_interaction_loss_k] : NAN;
    float* media_losses[uform_media_kinds_k] = {&stats->image_loss, &stats->video_loss, &stats->audio_loss};
    for (int kind = 0; kind != uform_media_kinds_k; ++kind)
        *media_losses[kind] = terms.media_ran[kind] ? (float)scalars[uform_scalar_media_loss_k + kind] : NAN;
    stats->grad_norm = (float)sqrt(scalars[uform_scalar_norm_squared_k]);
    for (uint32_t g = 0; g != groups; ++g)
        stats->inverse_temperatures[g] = expf(read->scored[g]), stats->biases[g] = read->scored[groups + g];
}

static uint16_t uform_f32_to_f16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t sign = (bits >> 16) & 0x8000, exponent = (bits >> 23) & 0xFF, mantissa = bits & 0x7FFFFF;
    if (exponent == 0xFF) return (uint16_t)(sign | 0x7C00 | (mantissa ? 0x200 : 0));
    int e = (int)exponent - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7C00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        mantissa |= 0x800000;
        uint32_t shift = (uint32_t)(14 - e), half = mantissa >> shift, rest = mantissa & ((1u << shift) - 1);
        uint32_t midpoint = 1u << (shift - 1);
        if (rest > midpoint || (rest == midpoint && (half & 1))) ++half;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)e << 10) | (mantissa >> 13), rest = mantissa & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half; /* round to nearest even; may carry into the exponent */
    return (uint16_t)half;
}

static uint16_t uform_f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

uform_status_t uform_embeddings_export(uform_replica_t const* replica, float const* source, size_t items,
                                       size_t hidden, int normalize, void* out, uform_scalar_t scalar,
                                       char const** error) {
    size_t count = items * hidden;
    float* values = malloc(count * sizeof(float) + 1);
    if (!values)
        return uform_fail(error, uform_status_out_of_memory_k, "no memory to export %zu embeddings (%zu bytes)", items,
                          count * sizeof(float));
    uform_status_t status = replica->backend->download(replica->context, values, source, count * sizeof(float));
    if (status != uform_status_success_k) {
        free(values);
        return uform_fail(error, status, "%s", uform_message());
    }
    if (normalize)
        for (size_t i = 0; i != items; ++i) {
            double norm = 0;
            for (size_t k = 0; k != hidden; ++k) norm += (double)values[i * hidden + k] * values[i * hidden + k];
            float scale = norm > 0 ? (float)(1 / sqrt(norm)) : 0;
            for (size_t k = 0; k != hidden; ++k) values[i * hidden + k] *= scale;
        }
    for (size_t i = 0; i != count; ++i) switch (scalar) {
        case uform_scalar_f32_k: ((float*)out)[i] = values[i]; break;
        case uform_scalar_f16_k: ((uint16_t*)out)[i] = uform_f32_to_f16(values[i]); break;
        case uform_scalar_bf16_k: ((uint16_t*)out)[i] = uform_f32_to_bf16(values[i]); break;
        case uform_scalar_i8_k: {
            float scaled = roundf(values[i] * 127.0f);
            ((int8_t*)out)[i] = (int8_t)(scaled > 127 ? 127 : scaled < -127 ? -127 : scaled);
            break;
        }
        }
    free(values);
    return uform_status_success_k;
}

static double uform_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Validates and packs the flight's step as update `flight->next`, then queues its passes and, when `update`, its
   update. On a backend that queues, the step's scalars are fetched behind them and fences mark both ends. */
static uform_status_t uform_trainer_queue(uform_trainer_s* trainer, uform_flight_t* flight, int update,
                                          char const** error) {
    uform_trainer_step_t* step = flight->step;
    double start = uform_seconds(), prepared = start;
    uint64_t next = flight->next;
    void* decoded = NULL;
    uform_status_t status = uform_status_success_k;
    if (step->embeddings && (unsigned)step->embeddings_scalar > uform_scalar_i8_k)
        status = uform_fail(error, uform_status_invalid_argument_k, "step.embeddings_scalar: %d is not a scalar type",
                            (int)step->embeddings_scalar);
    if (status == uform_status_success_k && step->decoded)
        status = uform_handles_acquire(step->decoded, uform_handle_decoded_k, "step.decoded", &decoded, error);
    if (status == uform_status_success_k && decoded && ((uform_decoded_s*)decoded)->owner != trainer->self)
        status = uform_fail(error, uform_status_invalid_argument_k, "step.decoded: decoded by another trainer");
    uform_spread_t* spread = trainer->spread;
    if (spread) /* on a mesh, a step this process refuses still takes its part, so that every process refuses it */
        status = uform_spread_pack(spread, &trainer->config, step, decoded, next, status, error);
    else if (status == uform_status_success_k)
        status = uform_batch_pack(&trainer->packed, &trainer->config, step, decoded, next, 0, 0, error);
    uform_handles_release(decoded);
    if (status != uform_status_success_k) return status;

    uform_replica_t* replica = &trainer->replica;
    uform_layout_t const* layout = &trainer->layout;
    uform_backend_t const* backend = replica->backend;
    uform_config_t const* config = &trainer->config;
    uform_packed_t const* counted = spread ? &spread->whole : &trainer->packed;
    uform_terms_t terms = uform_model_terms(config, counted);
    float rate = uform_schedule_rate(&config->given.schedule, next);
    unsigned slot = (unsigned)(flight - trainer->flights);
    void* context = replica->context;
    if (spread) {
        prepared = uform_seconds();
        status = uform_spread_gradients(spread, layout, config, error);
    } else {
        status = uform_model_upload(replica, &trainer->packed, 1);
        if (status == uform_status_success_k && trainer->fenced) status = backend->fence(context, 2 * slot);
        prepared = uform_seconds();
        if (status == uform_status_success_k) status = uform_model_gradients(replica, layout, config, &trainer->packed);
    }
    /* A step that scores nothing changes nothing, like a poisoned one: the update is not even queued. Every device
       holds the same summed gradients and updates alike. */
    uint32_t devices = uform_trainer_devices(trainer);
    int updating = update && uform_terms_ran(terms);
    for (uint32_t d = 0; d != devices && status == uform_status_success_k && updating; ++d) {
        uform_replica_t* device = uform_trainer_replica(trainer, d);
        uform_update_t adamw = {.weights = device->weights,
                                .compute = backend->convert ? device->compute : NULL,
                                .gradients = device->gradients,
                                .first = device->first,
                                .second = device->second,
                                .scalars = device->scalars,
                                .learning_rate = rate,
                                .beta1 = config->beta1,
                                .beta2 = config->beta2,
                                .epsilon = config->epsilon,
                                .weight_decay = config->weight_decay,
                                .clip_norm = config->clip_norm,
                                .terms = terms,
                                .step = next,
                                .after = flight->guessed ? replica->verdicts + (slot ^ 1) : NULL,
                                .verdict = trainer->fenced ? replica->verdicts + slot : NULL};
        status = backend->adamw(device->context, &adamw);
    }
    if (trainer->fenced) { /* a step queued behind this one reads its verdict: none queued is a skip */
        if (status == uform_status_success_k && update && !updating)
            status = backend->zero(context, replica->verdicts + slot, sizeof(int32_t));
        if (status == uform_status_success_k)
            status = backend->fetch(context, &trainer->reads[slot], replica->scalars,
                                    sizeof(double) * uform_scalars_k + 2 * layout->temperature_groups * sizeof(float));
        if (status == uform_status_success_k) status = backend->fence(context, 2 * slot + 1);
    }
    if (status != uform_status_success_k) {
        if (trainer->mesh && trainer->mesh->transport) uform_mesh_break(trainer->mesh); /* the peers would wait */
        return uform_trainer_failed(status, error);
    }
    flight->terms = terms, flight->rate = rate, flight->settled = 0;
    uform_stats_count(&flight->stats, terms, counted, layout->temperature_groups);
    if (spread) flight->stats.items = spread->items; /* this process's; the other counts are the whole step's */
    flight->stats.host_seconds = prepared - start;
    return uform_status_success_k;
}

/* Waits for the flight's step to land, reads its scalars, hands back its embeddings and counts its update. When the
   update was skipped, a step queued behind it on the guess that it applied is queued again, as the next update. */
static uform_status_t uform_trainer_settle(uform_trainer_s* trainer, uform_flight_t* flight, int update,
                                           char const** error) {
    uform_replica_t* replica = &trainer->replica;
    uform_backend_t const* backend = replica->backend;
    uform_layout_t const* layout = &trainer->layout;
    uform_spread_t* spread = trainer->spread;
    unsigned slot = (unsigned)(flight - trainer->flights);
    uform_read_t read;
    uform_status_t status = uform_status_success_k;
    if (trainer->fenced) {
        status = backend->fence_wait(replica->context, 2 * slot + 1);
        if (status == uform_status_success_k) memcpy(&read, &trainer->reads[slot], sizeof(read));
    } else {
        for (uint32_t d = 0; d != uform_trainer_devices(trainer) && status == uform_status_success_k; ++d)
            status = backend->synchronize(uform_trainer_replica(trainer, d)->context);
        if (status == uform_status_success_k)
            status = backend->download(replica->context, &read, replica->scalars,
                                       sizeof(read.scalars) + 2 * layout->temperature_groups * sizeof(float));
    }
    if (status != uform_status_success_k) {
        if (trainer->mesh && trainer->mesh->transport) uform_mesh_break(trainer->mesh);
        return uform_trainer_failed(status, error);
    }
    flight->settled = 1;
    uform_trainer_step_t* step = flight->step;
    uform_terms_t terms = flight->terms;
    uform_stats_score(&flight->stats, terms, &read);
    if (step->embeddings) {
        /* Spread over devices, the gathered embeddings are in item order; this process's run of them is the caller's. */
        int contrastive = terms.contrastive_ran;
        size_t first = spread ? spread->first_item * layout->hidden : 0;
        float const* normalized = (spread ? spread->normalized : replica->normalized) + first;
        float const* pooled = (spread ? spread->pooled : replica->pooled) + first;
        status = uform_embeddings_export(replica, contrastive ? normalized : pooled, flight->stats.items, layout->hidden,
                                         !contrastive, step->embeddings, step->embeddings_scalar, error);
        if (status != uform_status_success_k) return status;
    }
    flight->stats.learning_rate = flight->rate;
    flight->stats.step = trainer->step;
    if (!update) return uform_status_success_k;
    /* The backend judged the same scalars with the same rule, so the update it skipped is the one reported. */
    int skipped = !uform_terms_ran(terms) || uform_update_poisoned(read.scalars, terms);
    if (skipped) flight->stats.skipped = 1;
    else trainer->step = flight->next, flight->stats.step = flight->next;
    uform_flight_t* behind = trainer->flying == uform_flights_k && flight == &trainer->flights[trainer->oldest]
                                 ? &trainer->flights[trainer->oldest ^ 1]
                                 : NULL;
    if (!behind || !behind->guessed) return uform_status_success_k;
    behind->guessed = 0;
    if (!skipped) return uform_status_success_k; /* the guess held */
    /* The device skipped its update too, having read this one's verdict: run it again as the update it is. */
    behind->next = trainer->step + 1;
    status = backend->fence_wait(replica->context, 2 * (unsigned)(behind - trainer->flights)); /* packed is free */
    if (status != uform_status_success_k) return uform_trainer_failed(status, error);
    return uform_trainer_queue(trainer, behind, 1, error);
}

/* Queues a step behind those in flight; on a backend that does not queue, runs it whole. */
static uform_status_t uform_trainer_begin(uform_trainer_s* trainer, uform_trainer_step_t* step, char const** error) {
    if (!step) return uform_fail(error, uform_status_invalid_argument_k, "step: NULL");
    if (trainer->flying == uform_flights_k)
        return uform_fail(error, uform_status_busy_k,
                          "step: %d steps begun and not ended already; end the earliest (uform_trainer_step_end) "
                          "before beginning another", (int)uform_flights_k);
    uform_flight_t* ahead = trainer->flying ? &trainer->flights[trainer->oldest] : NULL;
    if (ahead && ahead->step == step) /* its stats and buffers are the one in flight's */
        return uform_fail(error, uform_status_invalid_argument_k,
                          "step: begun already and not ended; each step in flight needs its own uform_trainer_step_t");
    uform_status_t status = uform_status_success_k;
    /* Its embeddings lie in buffers this step overwrites: hand them back first. */
    if (ahead && !ahead->settled && ahead->step->embeddings) status = uform_trainer_settle(trainer, ahead, 1, error);
    if (status != uform_status_success_k) return status;
    uform_flight_t* flight = &trainer->flights[(trainer->oldest + trainer->flying) % uform_flights_k];
    memset(flight, 0, sizeof(*flight));
    flight->step = step;
    flight->guessed = ahead && !ahead->settled; /* queued as if the step ahead applies: `settle` corrects a miss */
    flight->next = trainer->step + 1 + (uint64_t)flight->guessed;
    if (ahead && trainer->fenced) { /* the packed batch is uploaded from until the fence behind its copies */
        status = trainer->replica.backend->fence_wait(trainer->replica.context, 2 * (unsigned)(ahead - trainer->flights));
        if (status != uform_status_success_k) return uform_trainer_failed(status, error);
    }
    status = uform_trainer_queue(trainer, flight, 1, error);
    if (status == uform_status_success_k && !trainer->fenced) status = uform_trainer_settle(trainer, flight, 1, error);
    if (status == uform_status_success_k) ++trainer->flying;
    return status;
}

/* Ends the earliest step in flight: waits for it and answers its stats. */
static uform_status_t uform_trainer_end(uform_trainer_s* trainer, uform_trainer_step_t* step, char const** error) {
    if (!step) return uform_fail(error, uform_status_invalid_argument_k, "step: NULL");
    if (!trainer->flying)
        return uform_fail(error, uform_status_invalid_argument_k, "step: no step begun (uform_trainer_step_begin) to end");
    uform_flight_t* flight = &trainer->flights[trainer->oldest];
    int later = trainer->flying > 1 && trainer->flights[trainer->oldest ^ 1].step == step;
    if (flight->step != step)
        return uform_fail(error, uform_status_invalid_argument_k,
                          later ? "step: not the earliest step begun; steps end in the order they began"
                                : "step: not begun (uform_trainer_step_begin), or ended already");
    uform_status_t status = flight->settled ? uform_status_success_k : uform_trainer_settle(trainer, flight, 1, error);
    trainer->oldest = (trainer->oldest + 1) % uform_flights_k, --trainer->flying;
    if (status == uform_status_success_k) step->stats = flight->stats;
    return status;
}

/* Verbs that read the weights or run a step of their own are refused while a step begun has not ended. */
static uform_status_t uform_trainer_idle(uform_trainer_s const* trainer, char const* verb, char const** error) {
    if (!trainer->flying) return uform_status_success_k;
    return uform_fail(error, uform_status_busy_k,
                      "trainer: %u step%s begun and not ended; end %s (uform_trainer_step_end) before %s",
                      trainer->flying, trainer->flying > 1 ? "s" : "", trainer->flying > 1 ? "them" : "it", verb);
}

/* Runs a step alone: validated, packed, run and read back before it returns; `update` decides whether it applies. */
static uform_status_t uform_trainer_run(uform_trainer_s* trainer, uform_trainer_step_t* step, int update,
                                        char const** error) {
    if (!step) return uform_fail(error, uform_status_invalid_argument_k, "step: NULL");
    uform_flight_t* flight = &trainer->flights[trainer->oldest];
    memset(flight, 0, sizeof(*flight));
    flight->step = step, flight->next = trainer->step + 1;
    uform_status_t status = uform_trainer_queue(trainer, flight, update, error);
    if (status == uform_status_success_k) status = uform_trainer_settle(trainer, flight, update, error);
    if (status == uform_status_success_k) step->stats = flight->stats; /* a refused step writes nothing */
    return status;
}

/* A blocking step waits for no step begun: it would end out of order. */
static uform_status_t uform_trainer_alone(uform_trainer_s* trainer, uform_trainer_step_t* step, char const** error) {
    uform_status_t status = uform_trainer_idle(trainer, "a blocking step", error);
    return status == uform_status_success_k ? uform_trainer_run(trainer, step, 1, error) : status;
}

/* Takes the trainer for one of the step's verbs. */
static uform_status_t uform_trainer_stepping(uform_trainer_t handle, uform_trainer_step_t* step, char const** error,
                                             uform_status_t (*verb)(uform_trainer_s*, uform_trainer_step_t*,
                                                                    char const**)) {
    uform_trainer_s* trainer;
    uform_status_t status = uform_trainer_enter(handle, &trainer, error);
    if (status != uform_status_success_k) return status;
    status = verb(trainer, step, error);
    uform_trainer_leave(trainer);
    return status;
}

uform_status_t uform_trainer_step(uform_trainer_t handle, uform_trainer_step_t* step, char const** error) {
    return uform_trainer_stepping(handle, step, error, uform_trainer_alone);
}

uform_status_t uform_trainer_step_begin(uform_trainer_t handle, uform_trainer_step_t* step, char const** error) {
    return uform_trainer_stepping(handle, step, error, uform_trainer_begin);
}

uform_status_t uform_trainer_step_end(uform_trainer_t handle, uform_trainer_step_t* step, char const** error) {
    return uform_trainer_stepping(handle, step, error, uform_trainer_end);
}

uform_status_t uform_trainer_decode(uform_trainer_t handle, uform_trainer_step_t const* step, uform_decoded_t* decoded,
                                    char const** error) {
    if (!decoded) return uform_fail(error, uform_status_invalid_argument_k, "decoded: NULL output pointer");
    *decoded = NULL;
    if (!step) return uform_fail(error, uform_status_invalid_argument_k, "step: NULL");
    /* Borrowed, not locked: the config is fixed at init, so a running step may keep the lock meanwhile. */
    void* object;
    uform_status_t status = uform_handles_acquire(handle, uform_handle_trainer_k, "trainer", &object, error);
    if (status != uform_status_success_k) return status;
    uform_trainer_s* trainer = object;
    uform_decoded_s* made = NULL;
    uint64_t* offsets = malloc((step->count + 1) * sizeof(uint64_t));
    if (!offsets) status = uform_fail(error, uform_status_out_of_memory_k, "no memory to read %zu offsets", step->count);
    else status = uform_batch_check_items(&trainer->config, step, offsets, error);
    if (status == uform_status_success_k)
        status = uform_decoded_make(&trainer->config, step->count, step->modalities, &step->contents, offsets, 0,
                                    "batch.contents", &made, error);
    free(offsets);
    /* The step packs text beside these tokens too; media alone past the batch's room need not wait for it. */
    uform_batch_shape_t const* shape = &trainer->config.given.batch;
    size_t devices = uform_trainer_devices(trainer);
    size_t tokens = 0, room = devices * shape->max_rows_per_device * shape->max_columns_per_row;
    for (size_t i = 0; made && i != made->count; ++i)
        tokens += uform_grid_tokens(&made->grids[i]);
    if (status == uform_status_success_k && tokens > room) {
        status = uform_fail(error, uform_status_invalid_argument_k,
                            "batch.contents: the media alone take %zu tokens, more than %zu device%s of "
                            "config.batch.max_rows_per_device = %u rows of %u columns hold (%zu)", tokens, devices,
                            devices > 1 ? "s" : "", shape->max_rows_per_device, shape->max_columns_per_row, room);
        uform_decoded_release(made), made = NULL;
    }
    if (status == uform_status_success_k && made) {
        made->owner = handle;
        status = uform_handles_add(made, uform_handle_decoded_k, decoded, error);
        if (status != uform_status_success_k) uform_decoded_release(made);
    }
    uform_handles_release(trainer);
    return status;
}

uform_status_t uform_decoded_free(uform_decoded_t handle, char const** error) {
    if (!handle) return uform_status_success_k;
    void* object;
    uform_status_t status = uform_handles_remove(handle, uform_handle_decoded_k, "decoded", &object, error);
    if (status == uform_status_success_k) uform_decoded_release(object);
    return status;
}

uform_status_t uform_trainer_probe(uform_trainer_t handle, uform_trainer_step_t* step, float* gradients,
                                   char const** error) {
    uform_trainer_s* trainer;
    uform_status_t status = uform_trainer_enter(handle, &trainer, error);
    if (status != uform_status_success_k) return status;
    status = uform_trainer_idle(trainer, "a probe", error);
    if (status == uform_status_success_k) status = uform_trainer_run(trainer, step, 0, error);
    if (status == uform_status_success_k && gradients) {
        status = trainer->replica.backend->download(trainer->replica.context, gradients, trainer->replica.gradients,
                                                    trainer->layout.total * sizeof(float));
        if (status != uform_status_success_k) uform_trainer_failed(status, error);
    }
    uform_trainer_leave(trainer);
    return status;
}

uform_status_t uform_trainer_weights(uform_trainer_t handle, float* weights, size_t* total, char const** error) {
    uform_trainer_s* trainer;
    uform_status_t status = uform_trainer_enter(handle, &trainer, error);
    if (status != uform_status_success_k) return status;
    if (total) *total = trainer->layout.total;
    if (weights) status = uform_trainer_idle(trainer, "reading the weights", error);
    if (weights && status == uform_status_success_k) {
        status = trainer->replica.backend->download(trainer->replica.context, weights, trainer->replica.weights,
                                                    trainer->layout.total * sizeof(float));
        if (status != uform_status_success_k) uform_trainer_failed(status, error);
    }
    uform_trainer_leave(trainer);
    return status;
}

/* Writes the weights, and the moments when `moments`, beside the step, the config and the caller's note. */
static uform_status_t uform_trainer_write(uform_trainer_t handle, char const* path, int moments, char const* note,
                                          char const** error) {
    uform_trainer_s* trainer;
    uform_status_t status = uform_trainer_enter(handle, &trainer, error);
    if (status != uform_status_success_k) return status;
    status = uform_trainer_idle(trainer, "saving", error);
    if (status != uform_status_success_k) {
        uform_trainer_leave(trainer);
        return status;
    }
    if (trainer->mesh && trainer->mesh->host_domain_index != 0) { /* only process zero writes */
        uform_trainer_leave(trainer);
        return uform_status_success_k;
    }
    size_t total = trainer->layout.total, families = moments ? 3 : 1;
    float* host = malloc(families * total * sizeof(float));
    if (!host) status = uform_fail(error, uform_status_out_of_memory_k, "no memory to stage %zu weights", total);
    else {
        uform_replica_t const* replica = &trainer->replica;
        uform_backend_t const* backend = replica->backend;
        float *first = moments ? host + total : NULL, *second = moments ? host + 2 * total : NULL;
        status = backend->download(replica->context, host, replica->weights, total * sizeof(float));
        if (status == uform_status_success_k && moments)
            status = backend->download(replica->context, first, replica->first, total * sizeof(float));
        if (status == uform_status_success_k && moments)
            status = backend->download(replica->context, second, replica->second, total * sizeof(float));
        if (status != uform_status_success_k) uform_trainer_failed(status, error);
        else status = uform_checkpoint_save(path, &trainer->layout, host, first, second, trainer->step,
                                            trainer->config_json, note, error);
        free(host);
    }
    uform_trainer_leave(trainer);
    return status;
}

uform_status_t uform_trainer_save(uform_trainer_t handle, char const* path, char const** error) {
    return uform_trainer_write(handle, path, 1, NULL, error);
}

uform_status_t uform_trainer_save_weights(uform_trainer_t handle, char const* path, char const** error) {
    return uform_trainer_write(handle, path, 0, NULL, error);
}

uform_status_t uform_trainer_save_noted(uform_trainer_t handle, char const* path, char const* note, char const** error) {
    return uform_trainer_write(handle, path, 1, note, error);
}

uform_status_t uform_trainer_save_weights_noted(uform_trainer_t handle, char const* path, char const* note,
                                                char const** error) {
    return uform_trainer_write(handle, path, 0, note, error);
}

uform_status_t uform_trainer_memory(uform_trainer_t handle, size_t* bytes, char const** error) {
    uform_trainer_s* trainer;
    uform_status_t status = uform_trainer_enter(handle, &trainer, error);
    if (status != uform_status_success_k) return status;
    size_t sum = 0; /* every simulated device's replica: each holds its own weights and moments */
    for (uint32_t d = 0; d != uform_trainer_devices(trainer); ++d)
        sum += uform_replica_bytes(uform_trainer_replica(trainer, d));
    if (bytes) *bytes = sum;
    uform_trainer_leave(trainer);
    return status;
}

uform_status_t uform_trainer_free(uform_trainer_t handle, char const** error) {
    void* object;
    uform_status_t status = uform_handles_acquire(handle, uform_handle_trainer_k, "trainer", &object, error);
    if (status != uform_status_success_k) return status;
    /* Steps begun hold the caller's buffers until they end. A call on another thread holds the lock: then the
       removal below answers busy. */
    uform_trainer_s* held = object;
    if (pthread_mutex_trylock(&held->serial.lock) == 0) {
        status = uform_trainer_idle(held, "freeing the trainer", error);
        pthread_mutex_unlock(&held->serial.lock);
    }
    uform_handles_release(held);
    if (status != uform_status_success_k) return status;
    status = uform_handles_remove(handle, uform_handle_trainer_k, "trainer", &object, error);
    if (status != uform_status_success_k) return status;
    uform_trainer_s* trainer = object;
    uform_handles_release(trainer->executor);
    uform_handles_release(trainer->mesh);
    uform_trainer_release(trainer);
    return uform_status_success_k;
}
