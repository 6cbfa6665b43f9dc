/**
 *  A C program that knows only `uform.h`: it trains a few steps on the CPU, checks the errors it
 *  is promised, saves a checkpoint with a note, reads the note back and resumes from the checkpoint.
 *  Exits 0 when every check holds.
 *
 *      cc -std=c99 train.c $(python -m uform --cflags --libs) -lm -o train && ./train /tmp/c.safetensors
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <uform.h>

#define CHECK(condition)                                                                                              \
    do {                                                                                                              \
        if (!(condition)) {                                                                                           \
            fprintf(stderr, "%s:%d: check failed: %s (%s)\n", __FILE__, __LINE__, #condition, error ? error : "");    \
            return 1;                                                                                                 \
        }                                                                                                             \
    } while (0)

int main(int argc, char** argv) {
    char const* path = argc > 1 ? argv[1] : "train-c.safetensors";
    char const* error = NULL;
    CHECK(strcmp(uform_version(), "") != 0);
    CHECK(uform_capabilities() & uform_capability_ram_k);

    uform_executor_t executor = NULL;
    CHECK(uform_executor_init_ram(2, &executor, &error) == uform_status_success_k);

    uform_trainer_init_vram_t config;
    memset(&config, 0, sizeof(config)); /* zero derives every default */
    config.depth = 1, config.hidden = 128, config.objective = uform_objective_joint_k;
    config.batch.max_rows_per_device = 4, config.batch.max_columns_per_row = 64;
    config.schedule.steps = 10, config.seed = 42;

    config.hidden = 200; /* refused, and named */
    uform_trainer_t trainer = NULL;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_invalid_argument_k);
    CHECK(strstr(error, "hidden") != NULL);
    config.hidden = 128;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_success_k);

    char const text[] = "a small red pandared pandas eat bamboothe sun is a starstars shine at night";
    uint64_t offsets[] = {0, 17, 38, 55, 75};
    uform_modality_t modalities[4] = {uform_modality_text_k, uform_modality_text_k, uform_modality_text_k,
                                      uform_modality_text_k};
    uint32_t attract_offsets[] = {0, 1, 2, 3, 4}, attract_ids[] = {1, 0, 3, 2};
    float embeddings[4 * 128];

    uform_trainer_step_t step;
    memset(&step, 0, sizeof(step));
    step.count = 4, step.modalities = modalities;
    step.contents = (uform_tape_t){text, offsets, 4, sizeof(text) - 1};
    step.attract = (uform_edges_view_t){attract_offsets, attract_ids, NULL, 4};
    step.embeddings = embeddings, step.embeddings_scalar = uform_scalar_f32_k;

    attract_ids[0] = 7; /* out of range: refused, the step count unchanged */
    CHECK(uform_trainer_step(trainer, &step, &error) == uform_status_invalid_argument_k);
    CHECK(strstr(error, "attract") != NULL);
    attract_ids[0] = 1;

    float first_loss = 0, last_loss = 0;
    for (int i = 0; i != 5; ++i) {
        CHECK(uform_trainer_step(trainer, &step, &error) == uform_status_success_k);
        CHECK(step.stats.step == (uint64_t)i + 1 && !step.stats.skipped && isfinite(step.stats.loss));
        if (i == 0) first_loss = step.stats.loss;
        last_loss = step.stats.loss;
    }
    CHECK(last_loss < first_loss);
    double norm = 0;
    for (int k = 0; k != 128; ++k) norm += embeddings[k] * embeddings[k];
    CHECK(fabs(norm - 1) < 1e-4);
    /* The note is the caller's text, escaped into the header and read back byte for byte. */
    char const note[] = "{\"cursor\": \"caf\xc3\xa9\", \"path\": \"C:\\\\runs\"}\n\t\x01";
    CHECK(uform_trainer_save_noted(trainer, path, "caf\xc3", &error) == uform_status_invalid_argument_k);
    CHECK(strstr(error, "note: not UTF-8 at byte 3") != NULL);
    static char longer[UFORM_MAX_NOTE_BYTES + 2]; /* one byte over the limit, and the NUL */
    memset(longer, 'x', UFORM_MAX_NOTE_BYTES + 1);
    CHECK(uform_trainer_save_noted(trainer, path, longer, &error) == uform_status_invalid_argument_k);
    CHECK(strstr(error, "note: 1048577 bytes, over the 1048576 a checkpoint holds") != NULL);
    CHECK(uform_trainer_save_noted(trainer, path, note, &error) == uform_status_success_k);
    size_t length = 0;
    char back[sizeof(note)];
    CHECK(uform_checkpoint_note(path, NULL, 0, &length, &error) == uform_status_success_k);
    CHECK(length == sizeof(note) - 1);
    CHECK(uform_checkpoint_note(path, back, length, &length, &error) == uform_status_invalid_argument_k);
    CHECK(strstr(error, "capacity") != NULL);
    CHECK(uform_checkpoint_note(path, back, sizeof(back), &length, &error) == uform_status_success_k);
    CHECK(length == sizeof(note) - 1 && memcmp(back, note, sizeof(note)) == 0);

    /* Freeing the executor while the trainer borrows it is refused; a freed trainer is refused too. */
    CHECK(uform_executor_free(executor, &error) == uform_status_busy_k);
    CHECK(uform_trainer_free(trainer, &error) == uform_status_success_k);
    CHECK(uform_trainer_step(trainer, &step, &error) == uform_status_invalid_handle_k);

    config.resume = path;
    CHECK(uform_trainer_init_ram(executor, &config, NULL, &trainer, &error) == uform_status_success_k);
    CHECK(uform_trainer_step(trainer, &step, &error) == uform_status_success_k);
    CHECK(step.stats.step == 6);
    CHECK(uform_trainer_free(trainer, &error) == uform_status_success_k);
    CHECK(uform_executor_free(executor, &error) == uform_status_success_k);
    printf("trained 6 steps in C: loss %.4f -> %.4f\n", first_loss, last_loss);
    return 0;
}
