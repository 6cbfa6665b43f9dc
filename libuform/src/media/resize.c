/**
 *  @file   resize.c
 *  @brief  Resizing a decoded picture onto a grid of patches, normalized on the way out.
 *
 *  The filter is Pillow's BILINEAR, so a model trained here sees what one trained on Pillow's
 *  resize saw: a triangle of radius 1 output pixel, widened by the scale factor when shrinking
 *  (so every input pixel counts, none is skipped), weights normalized per output pixel, windows
 *  placed as Pillow places them. Unlike Pillow it keeps float32 between the two passes instead
 *  of rounding to 8 bits, so values agree with Pillow's to about one 8-bit step.
 *
 *  The vertical pass runs first, one output row at a time, into a single row of floats: the only
 *  memory a resize takes besides the decoded picture, however large the picture.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "media.h"

static void uform_resize_axis_free(uform_resize_axis_t* axis) {
    free(axis->starts), free(axis->counts), free(axis->weights);
    memset(axis, 0, sizeof(*axis));
}

static double uform_triangle(double x) {
    x = fabs(x);
    return x < 1 ? 1 - x : 0;
}

/* Pillow's `precompute_coeffs` for the triangle filter, in double, from `inputs` to `outputs` coordinates. */
static uform_status_t uform_resize_axis_init(uform_resize_axis_t* axis, size_t inputs, size_t outputs) {
    double scale = (double)inputs / (double)outputs, filter_scale = scale < 1 ? 1 : scale;
    double support = filter_scale; /* the triangle's radius, 1, times the filter's scale */
    size_t taps = (size_t)ceil(support) * 2 + 1;
    memset(axis, 0, sizeof(*axis));
    axis->outputs = outputs, axis->taps = taps;
    axis->starts = malloc(outputs * sizeof(uint32_t));
    axis->counts = malloc(outputs * sizeof(uint32_t));
    axis->weights = calloc(outputs * taps, sizeof(float));
    if (!axis->starts || !axis->counts || !axis->weights) {
        uform_resize_axis_free(axis);
        return uform_status_out_of_memory_k;
    }
    for (size_t out = 0; out != outputs; ++out) {
        double center = ((double)out + 0.5) * scale;
        /* C's truncation toward zero, as Pillow's `(int)` casts, then clamped to the input. */
        double first = center - support + 0.5, last = center + support + 0.5;
        size_t start = first < 0 ? 0 : (size_t)first, end = (size_t)last;
        if (end > inputs) end = inputs;
        if (end - start > taps) end = start + taps; /* cannot happen with the radius above; keeps writes in bounds */
        double total = 0;
        for (size_t i = start; i != end; ++i) total += uform_triangle(((double)i - center + 0.5) / filter_scale);
        for (size_t i = start; i != end; ++i)
            axis->weights[out * taps + i - start] =
                total > 0 ? (float)(uform_triangle(((double)i - center + 0.5) / filter_scale) / total) : 0;
        axis->starts[out] = (uint32_t)start, axis->counts[out] = (uint32_t)(end - start);
    }
    return uform_status_success_k;
}

uform_status_t uform_resize_init(uform_resize_t* resize, size_t height, size_t width, size_t channels,
                                 uform_media_grid_t const* grid, uint32_t patch_side) {
    memset(resize, 0, sizeof(*resize));
    resize->height = height, resize->width = width, resize->channels = channels;
    uform_status_t status = uform_resize_axis_init(&resize->vertical, height, (size_t)grid->rows * patch_side);
    if (status == uform_status_success_k)
        status = uform_resize_axis_init(&resize->horizontal, width, (size_t)grid->columns * patch_side);
    if (status == uform_status_success_k && !(resize->row = malloc(width * channels * sizeof(float))))
        status = uform_status_out_of_memory_k;
    if (status != uform_status_success_k) uform_resize_free(resize);
    return status;
}

void uform_resize_free(uform_resize_t* resize) {
    uform_resize_axis_free(&resize->vertical);
    uform_resize_axis_free(&resize->horizontal);
    free(resize->row);
    resize->row = NULL;
}

void uform_resize_run(uform_resize_t const* resize, uint8_t const* pixels, size_t stride, uint32_t patch_side,
                      uint32_t columns, float* out, size_t patch_stride) {
    size_t const channels = resize->channels, span = resize->width * channels, side = patch_side;
    uform_resize_axis_t const* vertical = &resize->vertical;
    uform_resize_axis_t const* horizontal = &resize->horizontal;
    float* row = resize->row;
    if (vertical->outputs == resize->height && horizontal->outputs == resize->width) {
        /* The same size: every weight is one or zero, so the filter is the identity, bit for bit. */
        for (size_t y = 0; y != resize->height; ++y) {
            uint8_t const* source = pixels + y * stride;
            float* patch_row = out + (y / side) * columns * patch_stride + (y % side) * side * channels;
            for (size_t x = 0; x != resize->width; ++x) {
                float* to = patch_row + (x / side) * patch_stride + (x % side) * channels;
                for (size_t c = 0; c != channels; ++c) to[c] = (float)source[x * channels + c] * (2.0f / 255.0f) - 1.0f;
            }
        }
        return;
    }
    for (size_t y = 0; y != vertical->outputs; ++y) {
        float const* weights = vertical->weights + y * vertical->taps;
        uint8_t const* source = pixels + (size_t)vertical->starts[y] * stride;
        memset(row, 0, span * sizeof(float));
        for (size_t k = 0; k != vertical->counts[y]; ++k, source += stride)
            for (size_t i = 0; i != span; ++i) row[i] += weights[k] * (float)source[i];
        /* (v / 255 - 0.5) / 0.5 */
        float* patch_row = out + (y / side) * columns * patch_stride + (y % side) * side * channels;
        for (size_t x = 0; x != horizontal->outputs; ++x) {
            float const* taps = horizontal->weights + x * horizontal->taps;
            float const* from = row + (size_t)horizontal->starts[x] * channels;
            float* to = patch_row + (x / side) * patch_stride + (x % side) * channels;
            for (size_t c = 0; c != channels; ++c) {
                float sum = 0;
                for (size_t k = 0; k != horizontal->counts[x]; ++k) sum += taps[k] * from[k * channels + c];
                float value = sum * (2.0f / 255.0f) - 1.0f; /* the weights are positive: only rounding leaves [-1, 1] */
                to[c] = value < -1.0f ? -1.0f : value > 1.0f ? 1.0f : value;
            }
        }
    }
}

void uform_media_narrow(uint8_t* pixels, size_t count, size_t from, size_t to) {
    if (from == to) return;
    for (size_t i = 0; i != count; ++i) {
        uint8_t const* pixel = pixels + i * from;
        uint8_t* target = pixels + i * to; /* never past `pixel`: narrowing in place reads ahead of its writes */
        if (to == 1) /* ITU-R 601 luma in 16-bit fixed point, rounded, as Pillow's "L" conversion */
            target[0] = (uint8_t)((pixel[0] * 19595u + pixel[1] * 38470u + pixel[2] * 7471u + 0x8000u) >> 16);
        else
            target[0] = pixel[0], target[1] = pixel[1], target[2] = pixel[2];
    }
}
