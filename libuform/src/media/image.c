/**
 *  @file   image.c
 *  @brief  JPEG (libjpeg-turbo), PNG (libpng) and WebP (libwebp) images decoded to 8-bit pixels,
 *          then resized onto patches.
 *
 *  Each decoder reads the file's header, checks the size it declares against the limits of
 *  `media.h`, and only then allocates the pixels. libjpeg and libpng report errors by calling a
 *  handler that must not return: ours jump back to the decoder with `longjmp`, so they never
 *  reach the default handlers, which print and exit. Warnings are errors too: libjpeg warns, and
 *  fills gray, where a file ends early or its entropy-coded data is corrupt.
 *
 *  Every decoder hands back RGB or RGBA (JPEG also gray, where gray was asked of a gray file) and
 *  `uform_media_narrow` makes the channels asked for, so one formula makes gray of every format.
 *  The `setjmp` of each decoder sits in a function of its own that changes nothing but the state
 *  its caller passed in, as C requires of what a `longjmp` comes back to.
 */
#include <setjmp.h>
#include <stdio.h> /* jpeglib.h needs FILE */
#include <stdlib.h>
#include <string.h>

#include "media.h"

#if defined(UFORM_MEDIA_JPEG)
#include <jpeglib.h>
#endif
#if defined(UFORM_MEDIA_PNG)
#include <png.h>
#endif
#if defined(UFORM_MEDIA_WEBP)
#include <webp/decode.h>
#endif

/** Decoded pixels: `height` rows of `width x channels` bytes, no padding. */
typedef struct uform_picture_t {
    uint8_t* pixels;
    size_t height, width, channels;
} uform_picture_t;

/** What a decoder reads and what it answers, kept in the caller's frame across a `longjmp`. */
typedef struct uform_decode_t {
    uint8_t const* bytes;
    size_t length;
    size_t read;             /* PNG: bytes handed to libpng so far */
    size_t channels;         /* asked for: 1, 3 or 4 */
    char const* field;
    char const** error;
    uform_status_t status;   /* set where a check of ours refused, before jumping */
    char message[200];       /* the library's own words, when it refused */
    char warning[100];       /* PNG: the last warning, which often says why an error came */
    jmp_buf jump;
    uform_picture_t picture; /* freed by the caller, whatever happened */
    void* rows;              /* PNG: the row pointers */
} uform_decode_t;

#if defined(UFORM_MEDIA_JPEG) || defined(UFORM_MEDIA_PNG) || defined(UFORM_MEDIA_WEBP)
static uform_status_t uform_picture_alloc(uform_decode_t* decode, size_t height, size_t width, size_t channels) {
    decode->picture.pixels = malloc(height * width * channels);
    if (!decode->picture.pixels)
        return uform_fail(decode->error, uform_status_out_of_memory_k, "%s: no memory for %zu x %zu pixels",
                          decode->field, width, height);
    decode->picture.height = height, decode->picture.width = width, decode->picture.channels = channels;
    return uform_status_success_k;
}
#endif

/* ---------------------------------------------------------------------------------------------- */
/*  JPEG                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

#if defined(UFORM_MEDIA_JPEG)

enum { uform_jpeg_max_scans_k = 100 }; /* progressive files use about 10; each scan is a pass over the picture */

typedef struct uform_jpeg_errors_t {
    struct jpeg_error_mgr manager; /* first: libjpeg hands back a pointer to it */
    uform_decode_t* decode;
} uform_jpeg_errors_t;

static void uform_jpeg_exit(j_common_ptr jpeg) {
    uform_decode_t* decode = ((uform_jpeg_errors_t*)jpeg->err)->decode;
    char text[JMSG_LENGTH_MAX];
    jpeg->err->format_message(jpeg, text);
    snprintf(decode->message, sizeof(decode->message), "%s", text);
    longjmp(decode->jump, 1);
}

/* Level -1 is a warning: corrupt or missing data that libjpeg would paper over. Higher levels are traces. */
static void uform_jpeg_emit(j_common_ptr jpeg, int level) {
    if (level < 0) uform_jpeg_exit(jpeg);
}

static void uform_jpeg_silent(j_common_ptr jpeg) { (void)jpeg; }

/* A file with thousands of tiny scans would take a pass over the whole picture for each. */
static void uform_jpeg_progress(j_common_ptr jpeg) {
    j_decompress_ptr decompress = (j_decompress_ptr)jpeg;
    if (decompress->input_scan_number > uform_jpeg_max_scans_k) {
        uform_decode_t* decode = ((uform_jpeg_errors_t*)jpeg->err)->decode;
        snprintf(decode->message, sizeof(decode->message), "more than %d progressive scans",
                 (int)uform_jpeg_max_scans_k);
        longjmp(decode->jump, 1);
    }
}

static void uform_jpeg_run(uform_decode_t* decode, struct jpeg_decompress_struct* jpeg,
                           struct jpeg_progress_mgr* progress) {
    if (setjmp(decode->jump)) return;
    jpeg_create_decompress(jpeg);
    jpeg->progress = progress; /* after creation, which clears every field but the error manager */
    jpeg_mem_src(jpeg, decode->bytes, (unsigned long)decode->length);
    jpeg_read_header(jpeg, TRUE);
    decode->status = uform_media_check_size(jpeg->image_height, jpeg->image_width, "JPEG image", decode->field,
                                            decode->error);
    if (decode->status != uform_status_success_k) return;
    if (jpeg->jpeg_color_space != JCS_GRAYSCALE && jpeg->jpeg_color_space != JCS_YCbCr &&
        jpeg->jpeg_color_space != JCS_RGB) {
        decode->status = uform_fail(decode->error, uform_status_invalid_argument_k,
                                    "%s: JPEG image in CMYK or YCCK (%d components); uform reads gray and colour ones",
                                    decode->field, jpeg->num_components);
        return;
    }
    /* libjpeg-turbo makes RGB and RGBA of gray files too; gray of a gray file is the same as its luma. */
    jpeg->out_color_space = decode->channels == 4 ? JCS_EXT_RGBA
                            : decode->channels == 1 && jpeg->jpeg_color_space == JCS_GRAYSCALE ? JCS_GRAYSCALE
                                                                                              : JCS_RGB;
    jpeg->dct_method = JDCT_ISLOW; /* the exact one; also djpeg's default */
    jpeg_start_decompress(jpeg);
    decode->status = uform_picture_alloc(decode, jpeg->output_height, jpeg->output_width,
                                         (size_t)jpeg->output_components);
    if (decode->status != uform_status_success_k) return;
    size_t stride = decode->picture.width * decode->picture.channels;
    while (jpeg->output_scanline < jpeg->output_height) {
        JSAMPROW row = decode->picture.pixels + (size_t)jpeg->output_scanline * stride;
        jpeg_read_scanlines(jpeg, &row, 1);
    }
    jpeg_finish_decompress(jpeg);
}

static uform_status_t uform_jpeg_decode(uform_decode_t* decode) {
    struct jpeg_decompress_struct jpeg;
    uform_jpeg_errors_t errors;
    struct jpeg_progress_mgr progress;
    memset(&jpeg, 0, sizeof(jpeg));
    jpeg.err = jpeg_std_error(&errors.manager);
    errors.manager.error_exit = uform_jpeg_exit;
    errors.manager.emit_message = uform_jpeg_emit;
    errors.manager.output_message = uform_jpeg_silent;
    errors.decode = decode;
    memset(&progress, 0, sizeof(progress));
    progress.progress_monitor = uform_jpeg_progress;
    uform_jpeg_run(decode, &jpeg, &progress);
    jpeg_destroy_decompress(&jpeg);
    if (decode->message[0])
        return uform_fail(decode->error, uform_status_invalid_argument_k, "%s: not a readable JPEG image: %s",
                          decode->field, decode->message);
    return decode->status;
}

#endif

/* ---------------------------------------------------------------------------------------------- */
/*  PNG                                                                                            */
/* ---------------------------------------------------------------------------------------------- */

#if defined(UFORM_MEDIA_PNG)

/* libpng often warns with the cause, then fails in general words ("Invalid IHDR data"): the message names both. */
static void uform_png_error(png_structp png, png_const_charp text) {
    uform_decode_t* decode = png_get_error_ptr(png);
    if (decode->warning[0]) snprintf(decode->message, sizeof(decode->message), "%s (%s)", text, decode->warning);
    else snprintf(decode->message, sizeof(decode->message), "%s", text);
    longjmp(decode->jump, 1);
}

/* Warnings alone are about ancillary chunks (colour profiles, text, CRCs of ones libpng skips): the pixels stand. */
static void uform_png_warning(png_structp png, png_const_charp text) {
    uform_decode_t* decode = png_get_error_ptr(png);
    snprintf(decode->warning, sizeof(decode->warning), "%s", text);
}

static void uform_png_read(png_structp png, png_bytep out, size_t size) {
    uform_decode_t* decode = png_get_io_ptr(png);
    if (size > decode->length - decode->read) png_error(png, "the file ends early");
    memcpy(out, decode->bytes + decode->read, size);
    decode->read += size;
}

static void uform_png_run(uform_decode_t* decode, png_structp png, png_infop info) {
    if (setjmp(decode->jump)) return;
    png_set_read_fn(png, decode, uform_png_read);
    /* The header alone is read before our limits are checked, so libpng's are left at PNG's own (2^31 - 1),
     * and an oversized image is refused by ours, in our words, before any pixel is allocated. */
    png_set_user_limits(png, 0x7fffffff, 0x7fffffff);
    png_set_chunk_malloc_max(png, 8u << 20);
    png_read_info(png, info);
    png_uint_32 width, height;
    int depth, color, interlace;
    png_get_IHDR(png, info, &width, &height, &depth, &color, &interlace, NULL, NULL);
    decode->status = uform_media_check_size(height, width, "PNG image", decode->field, decode->error);
    if (decode->status != uform_status_success_k) return;
    /* Everything becomes 8-bit RGBA: 16-bit samples are scaled with rounding, palettes and low depths
     * expanded, transparency chunks made alpha, gray copied into the three colours, opaque alpha added. */
    if (depth == 16) png_set_scale_16(png);
    if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
    if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
    if (png_get_valid(png, info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(png);
    if (color == PNG_COLOR_TYPE_GRAY || color == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
    png_set_add_alpha(png, 0xFF, PNG_FILLER_AFTER);
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    if (png_get_rowbytes(png, info) != (size_t)width * 4) png_error(png, "rows are not 8-bit RGBA after expansion");
    decode->status = uform_picture_alloc(decode, height, width, 4);
    if (decode->status != uform_status_success_k) return;
    png_bytep* rows = decode->rows = malloc(height * sizeof(png_bytep));
    if (!rows) {
        decode->status = uform_fail(decode->error, uform_status_out_of_memory_k, "%s: no memory for %u row pointers",
                                    decode->field, (unsigned)height);
        return;
    }
    for (size_t y = 0; y != height; ++y) rows[y] = decode->picture.pixels + y * width * 4;
    png_read_image(png, rows);
    png_read_end(png, NULL); /* a file cut after its pixels still lacks IEND: truncated all the same */
}

static uform_status_t uform_png_decode(uform_decode_t* decode) {
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, decode, uform_png_error, uform_png_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!info) {
        png_destroy_read_struct(png ? &png : NULL, NULL, NULL);
        return uform_fail(decode->error, uform_status_out_of_memory_k, "%s: no memory to read a PNG image",
                          decode->field);
    }
    uform_png_run(decode, png, info);
    png_destroy_read_struct(&png, &info, NULL);
    free(decode->rows);
    if (decode->message[0])
        return uform_fail(decode->error, uform_status_invalid_argument_k, "%s: not a readable PNG image: %s",
                          decode->field, decode->message);
    return decode->status;
}

#endif

/* ---------------------------------------------------------------------------------------------- */
/*  WebP                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

#if defined(UFORM_MEDIA_WEBP)

static uform_status_t uform_webp_decode(uform_decode_t* decode) {
    WebPBitstreamFeatures features;
    VP8StatusCode code = WebPGetFeatures(decode->bytes, decode->length, &features);
    if (code != VP8_STATUS_OK)
        return uform_fail(decode->error, uform_status_invalid_argument_k, "%s: not a readable WebP image: %s",
                          decode->field, code == VP8_STATUS_NOT_ENOUGH_DATA ? "the file ends early" : "a bad header");
    if (features.has_animation)
        return uform_fail(decode->error, uform_status_invalid_argument_k,
                          "%s: an animated WebP image; uform reads still ones (send clips as video)", decode->field);
    uform_status_t status = uform_media_check_size((size_t)features.height, (size_t)features.width, "WebP image",
                                                   decode->field, decode->error);
    if (status != uform_status_success_k) return status;
    size_t channels = decode->channels == 4 ? 4 : 3;
    status = uform_picture_alloc(decode, (size_t)features.height, (size_t)features.width, channels);
    if (status != uform_status_success_k) return status;
    size_t stride = decode->picture.width * channels, size = stride * decode->picture.height;
    uint8_t* done = channels == 4 ? WebPDecodeRGBAInto(decode->bytes, decode->length, decode->picture.pixels, size,
                                                       (int)stride)
                                  : WebPDecodeRGBInto(decode->bytes, decode->length, decode->picture.pixels, size,
                                                      (int)stride);
    if (!done)
        return uform_fail(decode->error, uform_status_invalid_argument_k,
                          "%s: not a readable WebP image: its compressed data is truncated or corrupt", decode->field);
    return uform_status_success_k;
}

#endif

/* ---------------------------------------------------------------------------------------------- */
/*  Patches                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static uform_status_t uform_image_decode(uform_media_format_t format, uform_decode_t* decode) {
    switch (format) {
#if defined(UFORM_MEDIA_JPEG)
    case uform_media_jpeg_k: return uform_jpeg_decode(decode);
#endif
#if defined(UFORM_MEDIA_PNG)
    case uform_media_png_k: return uform_png_decode(decode);
#endif
#if defined(UFORM_MEDIA_WEBP)
    case uform_media_webp_k: return uform_webp_decode(decode);
#endif
    default: return uform_media_refuse_missing(format, decode->field, decode->error);
    }
}

uform_status_t uform_image_patches(uint8_t const* bytes, size_t length, uint32_t patch_side, uint32_t channels,
                                   size_t max_tokens, float* patches, uform_media_grid_t* grid, char const* field,
                                   char const** error) {
    if (!field) field = "image";
    if (channels != 1 && channels != 3 && channels != 4)
        return uform_fail(error, uform_status_invalid_argument_k, "%s: channels = %u; images have 1, 3 or 4", field,
                          channels);
    if (!patch_side || patch_side > uform_media_max_side_k || !max_tokens || !patches || !grid)
        return uform_fail(error, uform_status_invalid_argument_k,
                          "%s: patch_side = %u, max_tokens = %zu: both must be positive, with room for the patches",
                          field, patch_side, max_tokens);
    if (!bytes || !length) return uform_fail(error, uform_status_invalid_argument_k, "%s: an empty image", field);
    uform_media_format_t format = uform_media_sniff(bytes, length);
    if (format != uform_media_jpeg_k && format != uform_media_png_k && format != uform_media_webp_k)
        return uform_media_refuse_kind(format, "an image", bytes, length, field, error);

    uform_decode_t decode;
    memset(&decode, 0, sizeof(decode));
    decode.bytes = bytes, decode.length = length, decode.channels = channels, decode.field = field;
    decode.error = error;
    uform_status_t status = uform_image_decode(format, &decode);
    uform_picture_t* picture = &decode.picture;
    if (status == uform_status_success_k) {
        uform_media_narrow(picture->pixels, picture->height * picture->width, picture->channels, channels);
        uform_media_grid_t fitted;
        uform_media_fit(picture->height, picture->width, patch_side, max_tokens, &fitted);
        uform_resize_t resize;
        status = uform_resize_init(&resize, picture->height, picture->width, channels, &fitted, patch_side);
        if (status == uform_status_success_k) {
            uform_resize_run(&resize, picture->pixels, picture->width * channels, patch_side, fitted.columns, patches,
                             (size_t)patch_side * patch_side * channels);
            uform_resize_free(&resize);
            *grid = fitted;
        } else {
            status = uform_fail(error, status, "%s: no memory to resize %zu x %zu pixels", field, picture->width,
                                picture->height);
        }
    }
    free(picture->pixels);
    return status;
}
