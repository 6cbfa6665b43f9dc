/**
 *  Handles misused from C: NULL, foreign and freed pointers, double frees, frees of borrowed
 *  handles, one trainer stepped from several threads at once, frees racing the verbs, and config
 *  values no Python caller passes. Every misuse must be answered with a status and a message, never
 *  a crash. Exits 0 when every check holds; the test suite also runs it under AddressSanitizer.
 *
 *      cc -std=c99 -pthread misuse.c $(python -m uform --cflags --libs) -o misuse && ./misuse /tmp/m.safetensors
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uform.h>

static int failures = 0;

#define CHECK(condition)                                                                                              \
    do {                                                                                                              \
        if (!(condition)) {                                                                                           \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #condition,             \
                    error ? error : "none");                                                                          \
            ++failures;                                                                                               \
        }                                                                                                             \
    } while (0)

/* A refusal must carry a message that says what was wrong. */
#define REFUSED(call, expected, words)                                                                                \
    do {                                                                                                              \
        error = NULL;                                                                                                 \
        uform_status_t refused_ = (call);                                                                             \
        CHECK(refused_ == (expected));                                                                                \
        CHECK(error != NULL && strstr(error, (words)) != NULL);                                                       \
    } while (0)

static uform_trainer_init_vram_t small_config(uint64_t seed) {
    uform_trainer_init_vram_t config;
    memset(&config, 0, sizeof(config));
    config.depth = 1, config.hidden = 128, config.objective = uform_objective_joint_k;
    config.batch.max_rows_per_device = 4, config.batch.max_columns_per_row = 32;
    config.schedule.steps = 1000, config.seed = seed;
    /* Small media tokens: at this width the default ones would triple the parameters every step updates, and
       the races below need steps short beside the pauses between them, sanitizers included. */
    config.batch.image.patch_side = 4, config.batch.image.channels = 1;
    config.batch.video.patch_side = 4, config.batch.video.tube_frames = 1, config.batch.video.channels = 1;
    config.batch.audio.chunk_samples = 16;
    return config;
}

static char const text[] = "a small red pandared pandas eat bamboothe sun is a starstars shine at night";
static uint64_t const offsets[] = {0, 17, 38, 55, 75};
static uform_modality_t const modalities[4] = {uform_modality_text_k, uform_modality_text_k, uform_modality_text_k,
                                               uform_modality_text_k};
static uint32_t const attract_offsets[] = {0, 1, 2, 3, 4}, attract_ids[] = {1, 0, 3, 2};

static uform_trainer_step_t small_step(void) {
    uform_trainer_step_t step;
    memset(&step, 0, sizeof(step));
    step.count = 4, step.modalities = modalities;
    step.contents = (uform_tape_t){text, offsets, 4, sizeof(text) - 1};
    step.attract = (uform_edges_view_t){attract_offsets, attract_ids, NULL, 4};
    return step;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Several threads stepping one trainer                                                           */
/* ---------------------------------------------------------------------------------------------- */

enum { stepping_threads = 4, steps_per_thread = 12 };

typedef struct stepper_t {
    uform_trainer_t trainer;
    uint64_t seen[steps_per_thread];
    int failed;
} stepper_t;

static void* step_many(void* argument) {
    stepper_t* stepper = argument;
    uform_trainer_step_t step = small_step();
    for (int i = 0; i != steps_per_thread; ++i) {
        char const* error = NULL;
        if (uform_trainer_step(stepper->trainer, &step, &error) != uform_status_success_k || step.stats.skipped) {
            fprintf(stderr, "a concurrent step failed: %s\n", error ? error : "skipped");
            stepper->failed = 1;
            return NULL;
        }
        stepper->seen[i] = step.stats.step;
    }
    return NULL;
}

static int compare_steps(void const* a, void const* b) {
    uint64_t x = *(uint64_t const*)a, y = *(uint64_t const*)b;
    return x < y ? -1 : x > y;
}

static void steps_are_serialized(uform_executor_t executor) {
    char const* error = NULL;
    uform_trainer_init_vram_t config = small_config(1);
    uform_trainer_t trainer = NULL;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_success_k);
    stepper_t steppers[stepping_threads];
    pthread_t threads[stepping_threads];
    memset(steppers, 0, sizeof(steppers));
    for (int t = 0; t != stepping_threads; ++t) {
        steppers[t].trainer = trainer;
        CHECK(pthread_create(&threads[t], NULL, step_many, &steppers[t]) == 0);
    }
    uint64_t all[stepping_threads * steps_per_thread];
    for (int t = 0; t != stepping_threads; ++t) {
        pthread_join(threads[t], NULL);
        CHECK(!steppers[t].failed);
        for (int i = 0; i != steps_per_thread; ++i) {
            all[t * steps_per_thread + i] = steppers[t].seen[i];
            /* each thread's own steps come out in the order it made them */
            CHECK(i == 0 || steppers[t].seen[i] > steppers[t].seen[i - 1]);
        }
    }
    qsort(all, stepping_threads * steps_per_thread, sizeof(uint64_t), compare_steps);
    for (int i = 0; i != stepping_threads * steps_per_thread; ++i) CHECK(all[i] == (uint64_t)i + 1);
    CHECK(uform_trainer_free(trainer, &error) == uform_status_success_k);
}

/* ---------------------------------------------------------------------------------------------- */
/*  Frees racing verbs                                                                             */
/* ---------------------------------------------------------------------------------------------- */

typedef struct racer_t {
    uform_trainer_t trainer;
    int steps, refusals, wrong;
} racer_t;

/* Steps until the trainer is gone; every answer must be success or invalid_handle, and once one
   step is refused as freed, every later one is too. */
static void* step_until_freed(void* argument) {
    racer_t* racer = argument;
    uform_trainer_step_t step = small_step();
    for (int i = 0; i != 400; ++i) {
        char const* error = NULL;
        uform_status_t status = uform_trainer_step(racer->trainer, &step, &error);
        if (status == uform_status_success_k) {
            if (racer->refusals) racer->wrong = 1; /* a freed trainer stepped again */
            ++racer->steps;
        } else if (status == uform_status_invalid_handle_k && error && strstr(error, "trainer"))
            ++racer->refusals;
        else
            racer->wrong = 1;
        if (racer->refusals >= 3) break;
        struct timespec pause = {0, 3 * 1000 * 1000}; /* leave moments when no step runs, so a free can land */
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static void free_races_steps(uform_executor_t executor) {
    char const* error = NULL;
    for (int round = 0; round != 4; ++round) {
        uform_trainer_init_vram_t config = small_config(2 + (uint64_t)round);
        uform_trainer_t trainer = NULL;
        CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_success_k);
        enum { racing = 2 };
        racer_t racers[racing];
        pthread_t threads[racing];
        memset(racers, 0, sizeof(racers));
        for (int t = 0; t != racing; ++t) {
            racers[t].trainer = trainer;
            CHECK(pthread_create(&threads[t], NULL, step_until_freed, &racers[t]) == 0);
        }
        /* Let them step a little, then free: busy while a step runs, success once none does. */
        struct timespec pause = {0, 20 * 1000 * 1000};
        nanosleep(&pause, NULL);
        int busy = 0, freed = 0;
        for (int attempt = 0; attempt != 100000 && !freed; ++attempt) {
            error = NULL;
            uform_status_t status = uform_trainer_free(trainer, &error);
            if (status == uform_status_success_k) freed = 1;
            else if (status == uform_status_busy_k) {
                ++busy;
                CHECK(error && strstr(error, "trainer"));
                struct timespec moment = {0, 20 * 1000};
                nanosleep(&moment, NULL);
            } else
                CHECK(!"a free racing steps answers success or busy");
        }
        CHECK(freed);
        int steps = 0;
        for (int t = 0; t != racing; ++t) {
            pthread_join(threads[t], NULL);
            CHECK(!racers[t].wrong);
            steps += racers[t].steps;
        }
        REFUSED(uform_trainer_free(trainer, &error), uform_status_invalid_handle_k, "trainer");
        CHECK(steps > 0);
        if (getenv("UFORM_MISUSE_VERBOSE")) printf("round %d: %d steps, %d busy answers before the free\n", round, steps, busy);
    }
}

typedef struct maker_t {
    uform_executor_t executor;
    int made, refused, wrong;
} maker_t;

static pthread_mutex_t executor_freed_lock = PTHREAD_MUTEX_INITIALIZER;
static int executor_freed = 0;

static int executor_is_freed(void) {
    pthread_mutex_lock(&executor_freed_lock);
    int freed = executor_freed;
    pthread_mutex_unlock(&executor_freed_lock);
    return freed;
}

/* Makes and frees trainers on an executor another thread is trying to free. A trainer made on it
   borrows it until freed, so no trainer can still be made once its free has succeeded. */
static void* make_until_refused(void* argument) {
    maker_t* maker = argument;
    uform_trainer_init_vram_t config = small_config(9);
    for (int i = 0; i != 100; ++i) {
        char const* error = NULL;
        uform_trainer_t trainer = NULL;
        uform_status_t status = uform_trainer_init_ram(maker->executor, &config, NULL, &trainer, &error);
        if (status == uform_status_success_k) {
            if (maker->refused || executor_is_freed()) maker->wrong = 1;
            ++maker->made;
            if (uform_trainer_free(trainer, &error) != uform_status_success_k) maker->wrong = 1;
            struct timespec pause = {0, 1000 * 1000}; /* moments when no trainer borrows the executor */
            nanosleep(&pause, NULL);
        } else if (status == uform_status_invalid_handle_k && error && strstr(error, "executor")) {
            ++maker->refused;
            break;
        } else
            maker->wrong = 1;
    }
    return NULL;
}

static void executor_free_races_trainer_init(void) {
    char const* error = NULL;
    for (int round = 0; round != 4; ++round) {
        uform_executor_t executor = NULL;
        CHECK(uform_executor_init_ram(1, &executor, &error) == uform_status_success_k);
        executor_freed = 0;
        maker_t makers[2];
        pthread_t threads[2];
        memset(makers, 0, sizeof(makers));
        for (int t = 0; t != 2; ++t) {
            makers[t].executor = executor;
            CHECK(pthread_create(&threads[t], NULL, make_until_refused, &makers[t]) == 0);
        }
        struct timespec pause = {0, 5 * 1000 * 1000}; /* let the makers start, so the free lands among them */
        nanosleep(&pause, NULL);
        int freed = 0;
        for (long attempt = 0; attempt != 1000000 && !freed; ++attempt) {
            error = NULL;
            uform_status_t status = uform_executor_free(executor, &error);
            if (status == uform_status_success_k) freed = 1;
            else {
                CHECK(status == uform_status_busy_k && error && strstr(error, "executor"));
                struct timespec moment = {0, 10 * 1000};
                nanosleep(&moment, NULL);
            }
        }
        CHECK(freed);
        pthread_mutex_lock(&executor_freed_lock);
        executor_freed = 1;
        pthread_mutex_unlock(&executor_freed_lock);
        int made = 0;
        for (int t = 0; t != 2; ++t) {
            pthread_join(threads[t], NULL);
            CHECK(!makers[t].wrong);
            made += makers[t].made;
        }
        if (getenv("UFORM_MISUSE_VERBOSE")) printf("round %d: %d trainers made before the executor's free\n", round, made);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/*  One thread                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

/* ---------------------------------------------------------------------------------------------- */
/*  Media decoded ahead, handed to the wrong step                                                  */
/* ---------------------------------------------------------------------------------------------- */

/* A 4 x 4 gray PNG: one patch of the small config's images. */
static unsigned char const gray_png[] = {
    137, 80,  78,  71, 13,  10,  26,  10, 0,  0,   0,   13, 73,  72,  68,  82,  0,   0,   0,   4,  0,   0,
    0,   4,   8,   0,  0,   0,   0,   140, 154, 193, 162, 0,   0,   0,   29,  73,  68,  65,  84,  120, 156, 99,
    96,  16,  80,  48, 96,  112, 8,   72, 40,  96,  104, 152, 176, 96,  3,   195, 129, 11,  15,  62,  0,   0,
    48,  212, 7,   129, 162, 251, 157, 147, 0,   0,   0,   0,  73,  69,  78,  68,  174, 66,  96,  130};

static void decoded_misuse(uform_executor_t executor) {
    char const* error = NULL;
    if (!(uform_capabilities() & uform_capability_png_k)) return; /* a build without libpng decodes no PNG */
    uform_trainer_init_vram_t config = small_config(7);
    uform_trainer_t trainer = NULL, other = NULL;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_success_k);
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &other, &error) == uform_status_success_k);
    char contents[sizeof(text) + sizeof(gray_png)];
    memcpy(contents, text, 17), memcpy(contents + 17, gray_png, sizeof(gray_png));
    uint64_t const media_offsets[] = {0, 17, 17 + sizeof(gray_png)}, shifted[] = {0, 16, 17 + sizeof(gray_png)};
    uform_modality_t const kinds[] = {uform_modality_text_k, uform_modality_image_k};
    uform_trainer_step_t step;
    memset(&step, 0, sizeof(step));
    step.count = 2, step.modalities = kinds, step.contents = (uform_tape_t){contents, media_offsets, 2, sizeof(contents)};

    uform_decoded_t decoded = NULL, none = (void*)1;
    REFUSED(uform_trainer_decode(trainer, NULL, &decoded, &error), uform_status_invalid_argument_k, "step: NULL");
    REFUSED(uform_trainer_decode(trainer, &step, NULL, &error), uform_status_invalid_argument_k, "decoded: NULL");
    REFUSED(uform_trainer_decode(executor, &step, &decoded, &error), uform_status_invalid_handle_k, "not a trainer");
    uform_trainer_step_t words = small_step();
    CHECK(uform_trainer_decode(trainer, &words, &none, &error) == uform_status_success_k && none == NULL);
    CHECK(uform_trainer_decode(trainer, &step, &decoded, &error) == uform_status_success_k && decoded != NULL);

    /* The decoded media name their trainer and their items: any other step is refused, and changes nothing. */
    step.decoded = decoded;
    REFUSED(uform_trainer_step(other, &step, &error), uform_status_invalid_argument_k, "another trainer");
    uform_trainer_step_t fewer = step;
    fewer.count = 1, fewer.contents.count = 1;
    REFUSED(uform_trainer_step(trainer, &fewer, &error), uform_status_invalid_argument_k, "made from 2 items");
    uform_trainer_step_t moved = step;
    moved.contents.offsets = shifted;
    REFUSED(uform_trainer_step(trainer, &moved, &error), uform_status_invalid_argument_k, "item 0 differs");
    uform_trainer_step_t wrong = step;
    wrong.decoded = trainer;
    REFUSED(uform_trainer_step(trainer, &wrong, &error), uform_status_invalid_handle_k, "not decoded media");
    CHECK(uform_trainer_step(trainer, &step, &error) == uform_status_success_k && step.stats.step == 1);
    CHECK(uform_trainer_step(trainer, &step, &error) == uform_status_success_k && step.stats.step == 2);

    REFUSED(uform_trainer_free(decoded, &error), uform_status_invalid_handle_k, "not a trainer");
    CHECK(uform_decoded_free(decoded, &error) == uform_status_success_k);
    CHECK(uform_decoded_free(NULL, &error) == uform_status_success_k);
    REFUSED(uform_decoded_free(decoded, &error), uform_status_invalid_handle_k, "decoded");
    REFUSED(uform_trainer_step(trainer, &step, &error), uform_status_invalid_handle_k, "step.decoded");
    CHECK(uform_trainer_free(trainer, &error) == uform_status_success_k);
    CHECK(uform_trainer_free(other, &error) == uform_status_success_k);
}

/* ---------------------------------------------------------------------------------------------- */
/*  Configs only C can pass                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* Refused with the exact message: the field, the value as it was given, and what it may be. */
#define REFUSED_EXACTLY(call, expected, words)                                                                        \
    do {                                                                                                              \
        error = NULL;                                                                                                 \
        CHECK((call) == (expected));                                                                                  \
        CHECK(error != NULL && strcmp(error, (words)) == 0);                                                          \
    } while (0)

static void config_misuse(uform_executor_t executor) {
    char const* error = NULL;
    uform_trainer_t trainer = NULL;
    uform_trainer_init_vram_t config = small_config(3);
    config.hidden = 200; /* the example uform.h's Errors section quotes */
    REFUSED_EXACTLY(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error), uform_status_invalid_argument_k,
                    "config.hidden: 200 is not a positive multiple of 128 up to 16384");
    /* A NaN prints without the sign its bits may carry. */
    float const nans[2] = {NAN, -NAN};
    for (int i = 0; i != 2; ++i) {
        config = small_config(3), config.schedule.learning_rate = nans[i];
        REFUSED_EXACTLY(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error),
                        uform_status_invalid_argument_k, "config.schedule.learning_rate: nan is not in [0, 1]");
    }
    config = small_config(3), config.contrastive.pair_loss = (uform_pair_loss_form_t)9;
    REFUSED_EXACTLY(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error), uform_status_invalid_argument_k,
                    "config.contrastive.pair_loss: 9 is not a pair-loss form (0 to 3)");
    config = small_config(3), config.late_interaction.pair_loss = (uform_pair_loss_form_t)9;
    REFUSED_EXACTLY(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error), uform_status_invalid_argument_k,
                    "config.late_interaction.pair_loss: 9 is not a pair-loss form (0 to 3)");
    config = small_config(3), config.contrastive.max_edges_per_device = UINT32_MAX; /* would take ~40 GB */
    REFUSED_EXACTLY(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error), uform_status_invalid_argument_k,
                    "config.contrastive.max_edges_per_device: 4294967295 is over 16777216");
    config = small_config(3), config.masking.replace_fraction = 1;
    REFUSED_EXACTLY(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error), uform_status_invalid_argument_k,
                    "config.masking: replace_fraction 1 + random_fraction 0.1 is over 1 (a fraction given 0 derives "
                    "its default; 1e-30 asks for nearly none)");
    config.masking.random_fraction = 1e-30f;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_success_k);
    CHECK(uform_trainer_free(trainer, &error) == uform_status_success_k);
    trainer = NULL;
    uform_mesh_bootstrap_t crowd;
    memset(&crowd, 0, sizeof(crowd));
    crowd.host_domain_count = UINT32_MAX;
    uform_mesh_t mesh = NULL;
    REFUSED_EXACTLY(uform_mesh_bootstrap(executor, &crowd, &mesh, &error), uform_status_invalid_argument_k,
                    "host_domain_count: 4294967295 is over 65536");
    CHECK(mesh == NULL);
    config = small_config(3), config.resume = "";
    REFUSED_EXACTLY(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error), uform_status_invalid_argument_k,
                    "config.resume: empty; leave it NULL (None in Python) to start a new run");
    CHECK(trainer == NULL);
}

/* Steps begun end in order, two at most; verbs that read the weights wait for none, they are refused. */
static void steps_in_flight_misuse(uform_executor_t executor, char const* path) {
    char const* error = NULL;
    uform_trainer_init_vram_t config = small_config(11);
    uform_trainer_t trainer = NULL;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_success_k);
    uform_trainer_step_t first = small_step(), second = small_step(), third = small_step();
    REFUSED(uform_trainer_step_begin(trainer, NULL, &error), uform_status_invalid_argument_k, "step: NULL");
    REFUSED(uform_trainer_step_end(trainer, &first, &error), uform_status_invalid_argument_k, "no step begun");
    CHECK(uform_trainer_step_begin(trainer, &first, &error) == uform_status_success_k);
    REFUSED(uform_trainer_step_begin(trainer, &first, &error), uform_status_invalid_argument_k, "begun already");
    CHECK(uform_trainer_step_begin(trainer, &second, &error) == uform_status_success_k);
    REFUSED(uform_trainer_step_begin(trainer, &third, &error), uform_status_busy_k, "end the earliest");
    REFUSED(uform_trainer_step_end(trainer, &second, &error), uform_status_invalid_argument_k, "not the earliest");
    REFUSED(uform_trainer_step(trainer, &third, &error), uform_status_busy_k, "before a blocking step");
    REFUSED(uform_trainer_save(trainer, path, &error), uform_status_busy_k, "before saving");
    REFUSED(uform_trainer_free(trainer, &error), uform_status_busy_k, "before freeing the trainer");
    REFUSED(uform_trainer_step_end(trainer, &third, &error), uform_status_invalid_argument_k, "not begun");
    CHECK(uform_trainer_step_end(trainer, &first, &error) == uform_status_success_k && first.stats.step == 1);
    CHECK(uform_trainer_step_end(trainer, &second, &error) == uform_status_success_k && second.stats.step == 2);
    CHECK(uform_trainer_step(trainer, &third, &error) == uform_status_success_k && third.stats.step == 3);
    CHECK(uform_trainer_free(trainer, &error) == uform_status_success_k);
}

int main(int argc, char** argv) {
    char const* path = argc > 1 ? argv[1] : "misuse.safetensors";
    char const* error = NULL;
    uform_trainer_step_t step = small_step();
    uform_trainer_init_vram_t config = small_config(7);
    float embeddings[128];
    uform_encoder_embed_t embed;
    memset(&embed, 0, sizeof(embed));
    embed.count = 1, embed.modalities = modalities, embed.contents = (uform_tape_t){text, offsets, 1, sizeof(text) - 1};
    embed.embeddings = embeddings;

    /* NULL handles, for every verb that takes one. */
    uform_trainer_t trainer = NULL;
    REFUSED(uform_executor_free(NULL, &error), uform_status_invalid_handle_k, "executor: NULL");
    REFUSED(uform_mesh_free(NULL, &error), uform_status_invalid_handle_k, "mesh: NULL");
    REFUSED(uform_trainer_free(NULL, &error), uform_status_invalid_handle_k, "trainer: NULL");
    REFUSED(uform_encoder_free(NULL, &error), uform_status_invalid_handle_k, "encoder: NULL");
    REFUSED(uform_trainer_step(NULL, &step, &error), uform_status_invalid_handle_k, "trainer: NULL");
    REFUSED(uform_trainer_save(NULL, path, &error), uform_status_invalid_handle_k, "trainer: NULL");
    REFUSED(uform_encoder_embed(NULL, &embed, &error), uform_status_invalid_handle_k, "encoder: NULL");
    /* A request's arrays and tapes are checked before its handle, each by its name. */
    uform_encoder_embed_t bad = embed;
    bad.modalities = NULL;
    REFUSED(uform_encoder_embed(NULL, &bad, &error), uform_status_invalid_argument_k,
            "embed.modalities: NULL where embed.count is 1");
    bad = embed, bad.contents.offsets = NULL;
    REFUSED(uform_encoder_embed(NULL, &bad, &error), uform_status_invalid_argument_k, "embed.contents.offsets: NULL");
    bad = embed, bad.contents.count = 2;
    REFUSED(uform_encoder_embed(NULL, &bad, &error), uform_status_invalid_argument_k,
            "embed.contents.count: 2, expected 1, one entry per item");
    REFUSED(uform_trainer_init_ram(NULL, &config, NULL, &trainer, &error), uform_status_invalid_handle_k,
            "executor: NULL");
    CHECK(trainer == NULL);
    uform_mesh_bootstrap_t alone;
    memset(&alone, 0, sizeof(alone));
    uform_mesh_t mesh = NULL;
    REFUSED(uform_mesh_bootstrap(NULL, &alone, &mesh, &error), uform_status_invalid_handle_k, "executor: NULL");

    /* Foreign pointers: the stack, the heap, and a handle of another kind. */
    uint64_t on_stack[64];
    memset(on_stack, 0, sizeof(on_stack));
    on_stack[0] = 3; /* looks like a trainer's kind to a library that would read it */
    void* on_heap = calloc(1, 4096);
    REFUSED(uform_trainer_step(on_stack, &step, &error), uform_status_invalid_handle_k, "not a uform handle");
    REFUSED(uform_trainer_free(on_stack, &error), uform_status_invalid_handle_k, "not a uform handle");
    REFUSED(uform_trainer_step(on_heap, &step, &error), uform_status_invalid_handle_k, "not a uform handle");
    REFUSED(uform_executor_free(on_heap, &error), uform_status_invalid_handle_k, "not a uform handle");
    REFUSED(uform_trainer_init_ram(on_stack, &config, NULL, &trainer, &error), uform_status_invalid_handle_k,
            "executor");
    REFUSED(uform_encoder_embed(on_stack, &embed, &error), uform_status_invalid_handle_k, "encoder");
    REFUSED(uform_trainer_step((void*)(uintptr_t)1, &step, &error), uform_status_invalid_handle_k, "trainer");
    REFUSED(uform_trainer_step((void*)(uintptr_t)-1, &step, &error), uform_status_invalid_handle_k, "trainer");

    uform_executor_t executor = NULL;
    CHECK(uform_executor_init_ram(1, &executor, &error) == uform_status_success_k);
    CHECK(uform_mesh_bootstrap(executor, &alone, &mesh, &error) == uform_status_success_k);
    CHECK(uform_trainer_init_ram(executor, &config, mesh, &trainer, &error) == uform_status_success_k);
    /* Kinds are checked: each handle is refused where another kind is expected. */
    REFUSED(uform_trainer_step(executor, &step, &error), uform_status_invalid_handle_k, "not a trainer");
    REFUSED(uform_trainer_free(mesh, &error), uform_status_invalid_handle_k, "not a trainer");
    REFUSED(uform_executor_free(trainer, &error), uform_status_invalid_handle_k, "not an executor");
    REFUSED(uform_mesh_free(executor, &error), uform_status_invalid_handle_k, "not a mesh");
    void* gathered = NULL;
    uint64_t sizes[1] = {0};
    REFUSED(uform_mesh_gather(trainer, "x", 1, &gathered, sizes, &error), uform_status_invalid_handle_k, "not a mesh");
    REFUSED(uform_mesh_gather(mesh, NULL, 1, &gathered, sizes, &error), uform_status_invalid_argument_k, "data: NULL");
    REFUSED(uform_mesh_gather(mesh, "x", 1, NULL, sizes, &error), uform_status_invalid_argument_k, "NULL output");
    CHECK(uform_mesh_gather(mesh, "alone", 5, &gathered, sizes, &error) == uform_status_success_k && sizes[0] == 5 &&
          !memcmp(gathered, "alone", 5));
    uform_mesh_gathered_free(gathered);
    uform_mesh_gathered_free(NULL);
    REFUSED(uform_encoder_embed(trainer, &embed, &error), uform_status_invalid_handle_k, "not an encoder");
    uform_trainer_t other = NULL;
    REFUSED(uform_trainer_init_ram(trainer, &config, NULL, &other, &error), uform_status_invalid_handle_k,
            "not an executor");
    REFUSED(uform_trainer_init_ram(executor, &config, executor, &other, &error), uform_status_invalid_handle_k,
            "not a mesh");
    CHECK(other == NULL);

    /* Borrowed handles cannot be freed while the trainer lives; the trainer still works after. */
    REFUSED_EXACTLY(uform_executor_free(executor, &error), uform_status_busy_k,
                    "executor: 2 live trainer(s), encoder(s) or mesh(es) borrow it; free them first"); /* and its mesh */
    REFUSED_EXACTLY(uform_mesh_free(mesh, &error), uform_status_busy_k,
                    "mesh: 1 live trainer(s) borrow it; free them first"); /* only a trainer borrows a mesh */
    CHECK(uform_trainer_step(trainer, &step, &error) == uform_status_success_k && step.stats.step == 1);
    REFUSED_EXACTLY(uform_trainer_save(trainer, NULL, &error), uform_status_invalid_argument_k, "path: NULL");
    REFUSED_EXACTLY(uform_trainer_save(trainer, "", &error), uform_status_invalid_argument_k, "path: empty");
    /* A message past its buffer keeps the field and the reason, around an ellipsis. */
    char long_path[5000];
    memset(long_path, 'b', sizeof(long_path) - 1), long_path[sizeof(long_path) - 1] = 0;
    REFUSED(uform_trainer_save(trainer, long_path, &error), uform_status_io_k, "File name too long");
    CHECK(error && !strncmp(error, "path: cannot write bbb", 22) && strstr(error, "\xE2\x80\xA6") &&
          strlen(error) <= 1023);
    /* Asking what the build can do keeps the last message. */
    REFUSED(uform_executor_free(NULL, &error), uform_status_invalid_handle_k, "executor: NULL");
    (void)uform_capabilities();
    CHECK(error && !strcmp(error, "executor: NULL"));
    /* A note that does not fit leaves none, not its first bytes. */
    CHECK(uform_trainer_save_noted(trainer, path, "a note of some length", &error) == uform_status_success_k);
    char note[8] = "unset";
    size_t note_length = 0;
    REFUSED(uform_checkpoint_note(path, note, sizeof(note), &note_length, &error), uform_status_invalid_argument_k,
            "capacity: 8 bytes");
    CHECK(note[0] == 0 && note_length == 21);
    REFUSED_EXACTLY(uform_checkpoint_note("", note, sizeof(note), &note_length, &error),
                    uform_status_invalid_argument_k, "path: empty");
    CHECK(uform_trainer_save(trainer, path, &error) == uform_status_success_k);
    steps_in_flight_misuse(executor, path);

    uform_encoder_t encoder = NULL;
    CHECK(uform_encoder_load(executor, path, &encoder, NULL, &error) == uform_status_success_k);
    CHECK(uform_encoder_embed(encoder, &embed, &error) == uform_status_success_k);
    uform_encoder_embed_t none; /* no items embed into nothing, their arrays NULL */
    memset(&none, 0, sizeof(none));
    none.truncated_items = 9;
    CHECK(uform_encoder_embed(encoder, &none, &error) == uform_status_success_k && none.truncated_items == 0);
    none.count = 1;
    REFUSED_EXACTLY(uform_encoder_embed(encoder, &none, &error), uform_status_invalid_argument_k,
                    "embed.embeddings: NULL");
    uform_encoder_choose_t nothing; /* nor choose they any */
    memset(&nothing, 0, sizeof(nothing));
    nothing.truncated_items = 9;
    CHECK(uform_encoder_choose(encoder, &nothing, &error) == uform_status_success_k && nothing.truncated_items == 0);
    /* The call that sizes token vectors checks the contents' tape as the filling call does, before the handle. */
    uint64_t const past[] = {0, 17, 38, 55, 99}, backwards[] = {0, 17, 10, 55, 75};
    uint64_t rows[5];
    uform_encoder_tokens_t sizing;
    memset(&sizing, 0, sizeof(sizing));
    sizing.count = 4, sizing.modalities = modalities, sizing.offsets = rows;
    sizing.contents = (uform_tape_t){text, past, 4, sizeof(text) - 1};
    REFUSED_EXACTLY(uform_encoder_embed_tokens(encoder, &sizing, &error), uform_status_invalid_argument_k,
                    "tokens.contents.offsets[4]: 99 is past the tape's size, 75");
    sizing.contents.offsets = backwards;
    REFUSED_EXACTLY(uform_encoder_embed_tokens(encoder, &sizing, &error), uform_status_invalid_argument_k,
                    "tokens.contents.offsets[2]: 10 is below the offset before it, 17");
    sizing.contents = (uform_tape_t){NULL, offsets, 4, sizeof(text) - 1};
    REFUSED_EXACTLY(uform_encoder_embed_tokens(encoder, &sizing, &error), uform_status_invalid_argument_k,
                    "tokens.contents: NULL data");
    uform_encoder_t unnamed = NULL;
    REFUSED_EXACTLY(uform_encoder_load(executor, "", &unnamed, NULL, &error), uform_status_invalid_argument_k,
                    "path: empty");

    /* Double frees, and use after free, of every kind. */
    CHECK(uform_trainer_free(trainer, &error) == uform_status_success_k);
    REFUSED(uform_trainer_free(trainer, &error), uform_status_invalid_handle_k, "trainer");
    REFUSED(uform_trainer_step(trainer, &step, &error), uform_status_invalid_handle_k, "freed");
    REFUSED(uform_trainer_save(trainer, path, &error), uform_status_invalid_handle_k, "freed");
    CHECK(uform_mesh_free(mesh, &error) == uform_status_success_k);
    REFUSED(uform_mesh_free(mesh, &error), uform_status_invalid_handle_k, "mesh");
    REFUSED(uform_trainer_init_ram(executor, &config, mesh, &other, &error), uform_status_invalid_handle_k, "mesh");
    CHECK(other == NULL);
    /* The encoder borrows the executor too. */
    REFUSED(uform_executor_free(executor, &error), uform_status_busy_k, "executor");
    CHECK(uform_encoder_free(encoder, &error) == uform_status_success_k);
    REFUSED(uform_encoder_free(encoder, &error), uform_status_invalid_handle_k, "encoder");
    REFUSED(uform_encoder_embed(encoder, &embed, &error), uform_status_invalid_handle_k, "freed");

    /* A freed handle stays refused even when a new handle of its kind takes over its memory. */
    uform_trainer_t first = NULL, second = NULL;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &first, &error) == uform_status_success_k);
    CHECK(uform_trainer_free(first, &error) == uform_status_success_k);
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &second, &error) == uform_status_success_k);
    REFUSED(uform_trainer_step(first, &step, &error), uform_status_invalid_handle_k, "freed");
    REFUSED(uform_trainer_free(first, &error), uform_status_invalid_handle_k, "freed");
    CHECK(uform_trainer_step(second, &step, &error) == uform_status_success_k && step.stats.step == 1);
    CHECK(uform_trainer_free(second, &error) == uform_status_success_k);

    steps_are_serialized(executor);
    free_races_steps(executor);
    decoded_misuse(executor);
    config_misuse(executor);

    CHECK(uform_executor_free(executor, &error) == uform_status_success_k);
    REFUSED(uform_executor_free(executor, &error), uform_status_invalid_handle_k, "executor");
    REFUSED(uform_trainer_init_ram(executor, &config, NULL, &other, &error), uform_status_invalid_handle_k, "executor");
    REFUSED(uform_mesh_bootstrap(executor, &alone, &mesh, &error), uform_status_invalid_handle_k, "executor");
    CHECK(other == NULL);

    executor_free_races_trainer_init();
    free(on_heap);

    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("every misuse was refused\n");
    return 0;
}
