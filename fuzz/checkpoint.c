/**
 *  @file   checkpoint.c
 *  @brief  libFuzzer target: arbitrary bytes as a checkpoint file, read by `uform_encoder_load`
 *          (which takes its geometry from the file), by `uform_trainer_init_ram` with `resume`
 *          (which brings its own geometry) and by `uform_checkpoint_note`, through the one reader
 *          all three share.
 *
 *  Every outcome must be success or `invalid_checkpoint` with a message. A file that loads must
 *  embed an item. Crashes, reads out of bounds and leaks are AddressSanitizer's to report;
 *  allocations the file does not justify are libFuzzer's (`-malloc_limit_mb`, `-rss_limit_mb`).
 *
 *  An input is the file, byte for byte, unless it starts with 'Z': then the rest is the file's
 *  beginning (its length and header) and the file goes on with `fuzz_zeros_k` zero bytes, the size
 *  of the tensors of the seeds' tiny model. A real checkpoint is 3 MB of weights behind a 4 KB
 *  header, so mutations of a whole file almost never touch the header; in this form every
 *  mutation does, and a header the seeds' geometry fits still loads (zeros are finite weights).
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "uform.h"

void scipy_openblas_set_num_threads(int threads);

/* The tensors of a model of depth 1, hidden 128, one temperature group: three families of 955266 floats. */
enum { fuzz_zeros_k = 3 * 955266 * 4 };

static uform_executor_t fuzz_cpu;
static char fuzz_folder[64], fuzz_path[96];

static void fuzz_die(char const* what, uform_status_t status, char const* error) {
    fprintf(stderr, "fuzz/checkpoint: %s (status %d): %s\n", what, (int)status, error ? error : "(no message)");
    abort();
}

static void fuzz_clean(void) {
    unlink(fuzz_path);
    rmdir(fuzz_folder);
}

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    (void)argc, (void)argv;
    scipy_openblas_set_num_threads(1);
    /* Memory-backed when the machine has it: the file is rewritten for every input. */
    snprintf(fuzz_folder, sizeof(fuzz_folder), "%s", access("/dev/shm", W_OK) == 0 ? "/dev/shm/uform-fuzz-XXXXXX"
                                                                                     : "/tmp/uform-fuzz-XXXXXX");
    if (!mkdtemp(fuzz_folder)) {
        perror("fuzz/checkpoint: mkdtemp");
        abort();
    }
    snprintf(fuzz_path, sizeof(fuzz_path), "%s/input.safetensors", fuzz_folder);
    atexit(fuzz_clean);
    char const* error = NULL;
    uform_status_t status = uform_executor_init_ram(1, &fuzz_cpu, &error);
    if (status != uform_status_success_k) fuzz_die("executor", status, error);
    return 0;
}

static void fuzz_write(uint8_t const* data, size_t size) {
    int file = open(fuzz_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (file < 0) {
        perror("fuzz/checkpoint: open");
        abort();
    }
    size_t zeros = size && data[0] == 'Z' ? fuzz_zeros_k : 0;
    if (zeros) ++data, --size;
    for (size_t left = size; left;) {
        ssize_t written = write(file, data, left);
        if (written <= 0) {
            perror("fuzz/checkpoint: write");
            abort();
        }
        data += written, left -= (size_t)written;
    }
    if (zeros && ftruncate(file, (off_t)(size + zeros)) != 0) { /* a hole reads as zeros */
        perror("fuzz/checkpoint: ftruncate");
        abort();
    }
    close(file);
}

/* A refusal must be the checkpoint's and must say what is wrong. */
static void fuzz_expect_refusal(char const* verb, uform_status_t status, char const* error) {
    if (status != uform_status_invalid_checkpoint_k) fuzz_die(verb, status, error);
    if (!error || !*error) fuzz_die("a refusal without a message", status, error);
}

int LLVMFuzzerTestOneInput(uint8_t const* data, size_t size) {
    fuzz_write(data, size);
    char const* error = NULL;

    uform_encoder_t encoder = NULL;
    size_t hidden = 0;
    uform_status_t status = uform_encoder_load(fuzz_cpu, fuzz_path, &encoder, &hidden, &error);
    if (status == uform_status_success_k) {
        static uform_modality_t const text[2] = {uform_modality_text_k, uform_modality_text_k};
        static uint64_t const offsets[3] = {0, 5, 9};
        float* embeddings = malloc(2 * hidden * sizeof(float));
        if (!embeddings) abort();
        uform_encoder_embed_t embed = {2, text, {"fuzz items", offsets, 2, 10}, embeddings, uform_scalar_f32_k};
        status = uform_encoder_embed(encoder, &embed, &error);
        if (status != uform_status_success_k) fuzz_die("a loaded encoder failed to embed", status, error);
        free(embeddings);
        status = uform_encoder_free(encoder, &error);
        if (status != uform_status_success_k) fuzz_die("encoder_free", status, error);
    } else
        fuzz_expect_refusal("encoder_load", status, error);

    /* The seeds' geometry, so a well-formed file gets as far as its tensors. */
    uform_trainer_init_vram_t config = {
        .resume = fuzz_path,
        .depth = 1,
        .hidden = 128,
        .objective = uform_objective_joint_k,
        .batch = {.max_rows_per_device = 2, .max_columns_per_row = 16, .max_segments_per_device = 4},
        .schedule = {.steps = 100},
    };
    uform_trainer_t trainer = NULL;
    status = uform_trainer_init_ram(fuzz_cpu, &config, NULL, &trainer, &error);
    if (status == uform_status_success_k) {
        status = uform_trainer_free(trainer, &error);
        if (status != uform_status_success_k) fuzz_die("trainer_free", status, error);
    } else
        fuzz_expect_refusal("trainer_init_ram with resume", status, error);

    /* The note's length, then the note in exactly that room: the two calls must agree. */
    size_t length = 0, found = 0;
    status = uform_checkpoint_note(fuzz_path, NULL, 0, &length, &error);
    if (status == uform_status_success_k) {
        char* note = malloc(length + 1);
        if (!note) abort();
        status = uform_checkpoint_note(fuzz_path, note, length + 1, &found, &error);
        if (status != uform_status_success_k || found != length || note[length] != 0)
            fuzz_die("a note read back unlike its length", status, error);
        free(note);
    } else
        fuzz_expect_refusal("checkpoint_note", status, error);
    return 0;
}
