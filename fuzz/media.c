/**
 *  @file   media.c
 *  @brief  libFuzzer target: arbitrary bytes handed to the media decoders of `libuform/src/media/`
 *          as an image, an audio file or a video, with arbitrary shapes.
 *
 *  The first six bytes choose the call and its arguments; the rest is the file. The output buffer
 *  is allocated to exactly `max_tokens` tokens, so AddressSanitizer sees any write past the room the
 *  caller gave. Findings abort: a status other than success, invalid_argument or unsupported; a
 *  failure without a message; a success whose grid is empty or over `max_tokens`, or whose values
 *  are not finite or outside [-1, 1].
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "media/media.h"

enum { fuzz_header_k = 6 };

static void fuzz_finding(char const* what, char const* message) {
    fprintf(stderr, "finding: %s (%s)\n", what, message ? message : "no message");
    abort();
}

int LLVMFuzzerTestOneInput(uint8_t const* data, size_t size) {
    if (size < fuzz_header_k) return 0;
    static uint32_t const channels_choices[] = {3, 1, 4, 3, 3, 2};        /* 2 is refused */
    static uint32_t const rates[] = {16000, 8000, 22050, 44100, 48000, 0}; /* 0 is refused */
    static uint32_t const chunk_choices[] = {400, 1, 160, 1024};
    uint32_t kind = data[0] % 3, patch_side = 1 + data[1] % 32, channels = channels_choices[data[2] % 6];
    size_t max_tokens = data[3] % 64; /* 0 is refused */
    uint32_t tube_frames = 1 + data[4] % 4, frame_stride = 1 + data[4] / 64, sample_rate = rates[data[5] % 6];
    uint32_t chunk_samples = chunk_choices[data[5] / 64];
    uint8_t const* bytes = data + fuzz_header_k;
    size_t length = size - fuzz_header_k;

    /* A copy of exactly `length` bytes, so reading one past the file is caught too. */
    uint8_t* file = malloc(length ? length : 1);
    if (!file) abort();
    memcpy(file, bytes, length);
    size_t token_floats = kind == 0   ? (size_t)patch_side * patch_side * channels
                          : kind == 1 ? chunk_samples
                                      : (size_t)tube_frames * patch_side * patch_side * channels;
    float* out = malloc(max_tokens * token_floats * sizeof(float) + 1);
    if (!out) abort();
    uform_media_grid_t grid;
    memset(&grid, 0, sizeof(grid));
    char const* error = NULL;
    uform_status_t status =
        kind == 0   ? uform_image_patches(file, length, patch_side, channels, max_tokens, out, &grid, "item", &error)
        : kind == 1 ? uform_audio_chunks(file, length, sample_rate, chunk_samples, max_tokens, out, &grid, "item",
                                         &error)
                    : uform_video_tubelets(file, length, patch_side, tube_frames, frame_stride, channels, max_tokens,
                                           out, &grid, "item", &error);
    if (status != uform_status_success_k && status != uform_status_invalid_argument_k &&
        status != uform_status_unsupported_k)
        fuzz_finding("an unexpected status", error);
    if (status != uform_status_success_k && (!error || !error[0])) fuzz_finding("a refusal without a message", error);
    if (status == uform_status_success_k) {
        size_t tokens = (size_t)grid.frames * grid.rows * grid.columns;
        if (!tokens || tokens > max_tokens) fuzz_finding("a grid of no tokens or too many", NULL);
        for (size_t i = 0; i != tokens * token_floats; ++i)
            if (!(out[i] >= -1.0f && out[i] <= 1.0f)) fuzz_finding("a value outside [-1, 1]", NULL);
    }
    free(out);
    free(file);
    return 0;
}
