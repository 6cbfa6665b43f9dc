/**
 *  @file   formats.c
 *  @brief  Which format an item's bytes hold, which formats this build decodes, and the shared
 *          refusals, limits and patch grid of the decoders.
 *
 *  A format is recognized by its magic bytes alone, so an item is decoded by the one decoder its
 *  bytes call for, never by a library's own guessing over every format it knows.
 */
#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "media.h"

/** One format: its name, what the user calls it, and what a build needs to decode it. */
typedef struct uform_media_format_info_t {
    char const* name;
    char const* what;    /* "JPEG images" */
    char const* kind;    /* "image", "audio" or "video": the modality that reads it */
    uint32_t capability; /* 0 where this build lacks the library */
    char const* library; /* what decodes it */
    char const* package; /* the Debian packages that add the library */
} uform_media_format_info_t;

#if defined(UFORM_MEDIA_JPEG)
#define UFORM_MEDIA_JPEG_BIT uform_capability_jpeg_k
#else
#define UFORM_MEDIA_JPEG_BIT 0
#endif
#if defined(UFORM_MEDIA_PNG)
#define UFORM_MEDIA_PNG_BIT uform_capability_png_k
#else
#define UFORM_MEDIA_PNG_BIT 0
#endif
#if defined(UFORM_MEDIA_WEBP)
#define UFORM_MEDIA_WEBP_BIT uform_capability_webp_k
#else
#define UFORM_MEDIA_WEBP_BIT 0
#endif
#if defined(UFORM_MEDIA_FFMPEG)
#define UFORM_MEDIA_AV_BIT(bit) (bit)
#else
#define UFORM_MEDIA_AV_BIT(bit) 0
#endif

#define UFORM_MEDIA_FFMPEG_AUDIO "FFmpeg's libavformat, libavcodec and libswresample"
#define UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN "libavformat-dev libavcodec-dev libswresample-dev libswscale-dev"
#define UFORM_MEDIA_FFMPEG_VIDEO "FFmpeg's libavformat, libavcodec and libswscale"

/* Indexed by `uform_media_format_t`. */
static uform_media_format_info_t const uform_media_table[uform_media_formats_count_k] = {
    {"unknown", "unknown", "", 0, "", ""},
    {"jpeg", "JPEG images", "image", UFORM_MEDIA_JPEG_BIT, "libjpeg-turbo", "libjpeg62-turbo-dev"},
    {"png", "PNG images", "image", UFORM_MEDIA_PNG_BIT, "libpng", "libpng-dev"},
    {"webp", "WebP images", "image", UFORM_MEDIA_WEBP_BIT, "libwebp", "libwebp-dev"},
    {"wav", "WAV audio", "audio", UFORM_MEDIA_AV_BIT(uform_capability_wav_k), UFORM_MEDIA_FFMPEG_AUDIO,
     UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN},
    {"flac", "FLAC audio", "audio", UFORM_MEDIA_AV_BIT(uform_capability_flac_k), UFORM_MEDIA_FFMPEG_AUDIO,
     UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN},
    {"mp3", "MP3 audio", "audio", UFORM_MEDIA_AV_BIT(uform_capability_mp3_k), UFORM_MEDIA_FFMPEG_AUDIO,
     UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN},
    {"ogg", "Ogg audio", "audio", UFORM_MEDIA_AV_BIT(uform_capability_ogg_k), UFORM_MEDIA_FFMPEG_AUDIO,
     UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN},
    {"mp4", "MP4 video", "video", UFORM_MEDIA_AV_BIT(uform_capability_mp4_k), UFORM_MEDIA_FFMPEG_VIDEO,
     UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN},
    {"webm", "WebM video", "video", UFORM_MEDIA_AV_BIT(uform_capability_webm_k), UFORM_MEDIA_FFMPEG_VIDEO,
     UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN},
    {"mkv", "Matroska video", "video", UFORM_MEDIA_AV_BIT(uform_capability_mkv_k), UFORM_MEDIA_FFMPEG_VIDEO,
     UFORM_MEDIA_FFMPEG_AUDIO_DEBIAN},
};

static int uform_starts(uint8_t const* bytes, size_t length, size_t at, char const* magic, size_t size) {
    return length >= at + size && memcmp(bytes + at, magic, size) == 0;
}

/* MPEG audio without an ID3 tag starts on a frame header: 11 set sync bits, a layer other than the
 * reserved 0 (which ADTS AAC uses), a bitrate index other than 15 and a sample rate index other than 3. */
static int uform_mpeg_audio_frame(uint8_t const* bytes, size_t length) {
    return length >= 3 && bytes[0] == 0xFF && (bytes[1] & 0xE0) == 0xE0 && (bytes[1] & 0x06) != 0 &&
           (bytes[2] & 0xF0) != 0xF0 && (bytes[2] & 0x0C) != 0x0C;
}

/* Matroska and WebM share the EBML header; its DocType, within the first few dozen bytes, tells them apart. */
static uform_media_format_t uform_ebml_doctype(uint8_t const* bytes, size_t length) {
    size_t end = length < 64 ? length : 64;
    for (size_t i = 4; i + 4 <= end; ++i)
        if (!memcmp(bytes + i, "webm", 4)) return uform_media_webm_k;
    return uform_media_mkv_k;
}

uform_media_format_t uform_media_sniff(uint8_t const* bytes, size_t length) {
    if (!bytes) return uform_media_unknown_k;
    if (uform_starts(bytes, length, 0, "\xFF\xD8\xFF", 3)) return uform_media_jpeg_k;
    if (uform_starts(bytes, length, 0, "\x89PNG\r\n\x1A\n", 8)) return uform_media_png_k;
    if (uform_starts(bytes, length, 0, "RIFF", 4) && uform_starts(bytes, length, 8, "WEBP", 4)) return uform_media_webp_k;
    if (uform_starts(bytes, length, 0, "RIFF", 4) && uform_starts(bytes, length, 8, "WAVE", 4)) return uform_media_wav_k;
    if (uform_starts(bytes, length, 0, "fLaC", 4)) return uform_media_flac_k;
    if (uform_starts(bytes, length, 0, "ID3", 3) || uform_mpeg_audio_frame(bytes, length)) return uform_media_mp3_k;
    if (uform_starts(bytes, length, 0, "OggS", 4)) return uform_media_ogg_k;
    if (uform_starts(bytes, length, 4, "ftyp", 4)) return uform_media_mp4_k;
    if (uform_starts(bytes, length, 0, "\x1A\x45\xDF\xA3", 4)) return uform_ebml_doctype(bytes, length);
    return uform_media_unknown_k;
}

char const* uform_media_format_name(uform_media_format_t format) {
    return format < uform_media_formats_count_k ? uform_media_table[format].name : "unknown";
}

char const* uform_media_format_what(uform_media_format_t format) {
    return uform_media_table[format < uform_media_formats_count_k ? format : 0].what;
}

uint32_t uform_media_format_capability(uform_media_format_t format) {
    return format < uform_media_formats_count_k ? uform_media_table[format].capability : 0;
}

uint32_t uform_media_capabilities(void) {
    uint32_t bits = 0;
    for (size_t i = 0; i != uform_media_formats_count_k; ++i) bits |= uform_media_table[i].capability;
    return bits;
}

static char uform_media_formats_text[128];
static pthread_once_t uform_media_formats_once = PTHREAD_ONCE_INIT;

static void uform_media_formats_list(void) {
    size_t used = 0;
    for (size_t i = 1; i != uform_media_formats_count_k; ++i)
        if (uform_media_table[i].capability)
            used += (size_t)snprintf(uform_media_formats_text + used, sizeof(uform_media_formats_text) - used, "%s%s",
                                     used ? "," : "", uform_media_table[i].name);
}

char const* uform_media_formats(void) {
    pthread_once(&uform_media_formats_once, uform_media_formats_list);
    return uform_media_formats_text;
}

uform_status_t uform_media_refuse_missing(uform_media_format_t format, char const* field, char const** error) {
    uform_media_format_info_t const* info = &uform_media_table[format < uform_media_formats_count_k ? format : 0];
    return uform_fail(error, uform_status_unsupported_k, "%s: %s need a build with %s (Debian: %s)", field,
                      info->what, info->library, info->package);
}

/* Whether the bytes read like a file's path ("photos/cat.jpg"): short printable text ending in an extension. */
static int uform_media_looks_like_path(uint8_t const* bytes, size_t length) {
    if (!bytes || length < 3 || length > 4096) return 0;
    for (size_t i = 0; i != length; ++i)
        if (bytes[i] < 0x20 || bytes[i] == 0x7F) return 0;
    size_t dot = length;
    while (dot && bytes[dot - 1] != '.' && length - dot < 5) --dot;
    if (!dot || bytes[dot - 1] != '.' || dot == length) return 0;
    for (size_t i = dot; i != length; ++i)
        if (!isalnum(bytes[i])) return 0;
    return 1;
}

uform_status_t uform_media_refuse_kind(uform_media_format_t found, char const* expected, uint8_t const* bytes,
                                       size_t length, char const* field, char const** error) {
    int audio = !strcmp(expected, "audio");
    if (found == uform_media_unknown_k)
        return uform_fail(error, uform_status_invalid_argument_k, "%s: not %s file: its first bytes match no format "
                          "uform reads (%s)%s", field, audio ? "an audio" : expected, uform_media_formats(),
                          uform_media_looks_like_path(bytes, length)
                              ? "; they read like a file's path, and an item's contents are the file's bytes"
                              : "");
    uform_media_format_info_t const* info = &uform_media_table[found < uform_media_formats_count_k ? found : 0];
    /* A container of video formats may hold sound alone; uform reads audio from audio formats only. */
    int boxed = audio && (found == uform_media_mp4_k || found == uform_media_webm_k || found == uform_media_mkv_k);
    return uform_fail(error, uform_status_invalid_argument_k, "%s: declared %s, but the bytes are %s (%s)%s", field,
                      expected, info->kind, info->name,
                      boxed ? "; audio is read from WAV, FLAC, MP3 and Ogg files, not from a video container" : "");
}

uform_status_t uform_media_check_size(size_t height, size_t width, char const* what, char const* field,
                                      char const** error) {
    if (!height || !width)
        return uform_fail(error, uform_status_invalid_argument_k, "%s: %s of %zu x %zu pixels is empty", field, what,
                          width, height);
    if (height > uform_media_max_side_k || width > uform_media_max_side_k ||
        (uint64_t)height * width > uform_media_max_pixels_k)
        return uform_fail(error, uform_status_invalid_argument_k,
                          "%s: %s of %zu x %zu pixels is over the limit of %d pixels a side and %d in all", field,
                          what, width, height, (int)uform_media_max_side_k, (int)uform_media_max_pixels_k);
    return uform_status_success_k;
}

void uform_media_fit(size_t height, size_t width, uint32_t patch_side, size_t max_tokens, uform_media_grid_t* grid) {
    /* Rounded to the nearest whole patch, half away from zero, at least one. */
    size_t rows = (height + patch_side / 2) / patch_side, columns = (width + patch_side / 2) / patch_side;
    rows = rows ? rows : 1, columns = columns ? columns : 1;
    grid->frames = 1, grid->truncated = 0;
    if (rows * columns > max_tokens) {
        double factor = sqrt((double)max_tokens / ((double)rows * (double)columns));
        size_t fit_rows = (size_t)floor((double)rows * factor), fit_columns = (size_t)floor((double)columns * factor);
        fit_rows = fit_rows ? fit_rows : 1, fit_columns = fit_columns ? fit_columns : 1;
        /* Where one side stopped at 1, the other takes what is left; the rounding of `factor` may also overshoot. */
        if (fit_rows * fit_columns > max_tokens) {
            if (fit_rows >= fit_columns) fit_rows = max_tokens / fit_columns;
            else fit_columns = max_tokens / fit_rows;
        }
        rows = fit_rows, columns = fit_columns, grid->truncated = 1;
    }
    grid->rows = (uint32_t)rows, grid->columns = (uint32_t)columns;
}
