/**
 *  @file   media.h
 *  @brief  Images, video and audio from their encoded files to the floats the model reads:
 *          image patches, video tubelets and audio chunks.
 *
 *  Decoding is done by the field's own libraries, each found by `pkg-config` when the library is
 *  built: libjpeg-turbo (JPEG), libpng (PNG), libwebp (WebP), and FFmpeg's libavformat,
 *  libavcodec, libswresample and libswscale (WAV, FLAC, MP3, Ogg Vorbis/Opus; H.264, VP9 and AV1
 *  video in MP4, WebM and Matroska). A build without one of them still knows the format by its
 *  magic bytes, and refuses it with `uform_status_unsupported_k` naming the Debian package that
 *  adds it.
 *
 *  The container is recognized from the bytes, never from a caller's word: an item declared an
 *  image whose bytes are a WAV file is refused as such. Bad bytes of every kind (undecodable,
 *  truncated, corrupt, zero or absurd dimensions, empty audio, channel layouts the model cannot
 *  read) are refused with `uform_status_invalid_argument_k` and a message that starts with
 *  `field`, before anything is written but the output buffers. Dimensions are checked against
 *  the limits below from the file's header, before the pixels are allocated, so a small file that
 *  declares a huge picture costs nothing.
 *
 *  Every function is reentrant: items may be decoded on several threads at once. None reads
 *  past `length`, none keeps a pointer to its inputs, and none prints: FFmpeg's log is dropped
 *  while these functions run on a thread and passed to FFmpeg's default printer otherwise. The
 *  first audio or video decode also caps FFmpeg's single allocations at 256 MiB for the process
 *  (`av.c` says why).
 *
 *  Exactly what the pixels and samples go through (filters, colour conversion, normalization) is
 *  written in `docs/model.md`, "Media preprocessing".
 */
#ifndef UFORM_MEDIA_H_
#define UFORM_MEDIA_H_

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
    uform_media_max_side_k = 1 << 14,    /* pixels on an image's or frame's longer side */
    uform_media_max_pixels_k = 1 << 25,  /* pixels of one image or frame: 33.5 M, 8192 x 4096 */
    uform_media_max_channels_k = 32,     /* audio channels mixed to mono */
    uform_media_max_sample_rate_k = 768000, /* the highest audio sample rate read */
    uform_media_min_sample_rate_k = 1000,   /* the lowest: resampling 1 Hz to 16 kHz takes 16,000 x each frame's room */
};

/** Where an item's tokens came from, after cutting to fit. */
typedef struct uform_media_grid_t {
    uint32_t frames;  /* tubelets along time (video), 1 for images; chunks for audio */
    uint32_t rows;    /* patch rows (images, video); 1 for audio */
    uint32_t columns; /* patch columns (images, video); 1 for audio */
    int truncated;    /* nonzero when the item was shrunk or cut to fit max_tokens */
} uform_media_grid_t;

/** An item's tokens: one per cell of its grid. */
static inline size_t uform_grid_tokens(uform_media_grid_t const* grid) {
    return (size_t)grid->frames * grid->rows * grid->columns;
}

/** Which container or image format the bytes hold, sniffed from magic bytes; 0 = unknown. */
typedef enum uform_media_format_t {
    uform_media_unknown_k = 0,
    uform_media_jpeg_k,
    uform_media_png_k,
    uform_media_webp_k,
    uform_media_wav_k,
    uform_media_flac_k,
    uform_media_mp3_k,
    uform_media_ogg_k,
    uform_media_mp4_k,
    uform_media_webm_k,
    uform_media_mkv_k,
    uform_media_formats_count_k,
} uform_media_format_t;

/** The format the first bytes of an item announce. Reads at most `length` bytes. */
uform_media_format_t uform_media_sniff(uint8_t const* bytes, size_t length);

/** The format's name as `uform_capabilities()` and `uform_media_formats()` list it: "jpeg", "mp4", ... */
char const* uform_media_format_name(uform_media_format_t format);

/** What the user calls the format's files, as messages name them: "JPEG images", "WAV audio", ... */
char const* uform_media_format_what(uform_media_format_t format);

/** Whether this build decodes the format; its `uform_capability_t` bit when it does, else 0. */
uint32_t uform_media_format_capability(uform_media_format_t format);

/** The `uform_capability_t` bits of every format this build decodes: `uform_capabilities()` ORs them in. */
uint32_t uform_media_capabilities(void);

/** The formats this build decodes, as a static comma-separated string, e.g. "jpeg,png,webp,wav,...". */
UFORM_API char const* uform_media_formats(void);

/**
 *  Decodes an encoded image (JPEG, PNG, WebP) and writes its patches into `patches` (room for
 *  `max_tokens` patches), in raster order (patch rows major), each `patch_side x patch_side x
 *  channels` floats laid out (y, x, channel). Pixel values map v -> (v / 255 - 0.5) / 0.5.
 *
 *  The image is resized with Pillow's BILINEAR kernel (a triangle filter, widened by the scale factor
 *  when shrinking, so shrinking averages every pixel) to a grid of whole patches that keeps its aspect:
 *  rows = max(1, round(height / patch_side)), columns = max(1, round(width / patch_side)). When
 *  rows x columns > max_tokens both are scaled down by sqrt(max_tokens / (rows x columns)), rounded
 *  down, each at least 1, and `grid->truncated` is set.
 *
 *  `channels` 1 is gray (ITU-R 601 luma, rounded as Pillow's "L"), 3 is RGB (alpha, where the file
 *  has one, is ignored: the colours are read as stored), 4 is RGBA (opaque where the file has no alpha);
 *  others are refused. `field` names the item in messages, e.g. "batch.contents[3]".
 */
UFORM_API uform_status_t uform_image_patches(uint8_t const* bytes, size_t length, uint32_t patch_side,
                                             uint32_t channels, size_t max_tokens, float* patches,
                                             uform_media_grid_t* grid, char const* field, char const** error);

/**
 *  Decodes a video (H.264, VP9 or AV1 in MP4, WebM or Matroska) and writes its tubelets into
 *  `tubelets` (room for `max_tokens`): frames 0, frame_stride, 2 frame_stride, ... are kept, each
 *  converted to RGB by the stream's own colour matrix and range and resized as an image is (one grid,
 *  from the first frame's size, for all). Kept frames are grouped by `tube_frames`; a tubelet holds
 *  `tube_frames x patch_side x patch_side x channels` floats laid out (t, y, x, channel), tubelets
 *  ordered by time, then patch row, then column. A last group short of `tube_frames` repeats its
 *  last frame. Groups that do not fit in `max_tokens` are dropped from the end (`truncated` set).
 *  A stream whose frames change size is refused.
 */
UFORM_API uform_status_t uform_video_tubelets(uint8_t const* bytes, size_t length, uint32_t patch_side,
                                              uint32_t tube_frames, uint32_t frame_stride, uint32_t channels,
                                              size_t max_tokens, float* tubelets, uform_media_grid_t* grid,
                                              char const* field, char const** error);

/**
 *  Decodes audio (WAV, FLAC, MP3, Ogg Vorbis or Opus) and writes it into `chunks` (room for
 *  `max_tokens` chunks of `chunk_samples` floats): mixed to mono as the mean of its channels,
 *  resampled to `sample_rate` by libswresample's windowed-sinc filter (parameters in docs/model.md),
 *  clamped to [-1, 1], cut into chunks of `chunk_samples`, the last one zero-padded. Chunks past
 *  `max_tokens` are dropped (`truncated` set). No samples at all is refused.
 */
UFORM_API uform_status_t uform_audio_chunks(uint8_t const* bytes, size_t length, uint32_t sample_rate,
                                            uint32_t chunk_samples, size_t max_tokens, float* chunks,
                                            uform_media_grid_t* grid, char const* field, char const** error);

/* ---------------------------------------------------------------------------------------------- */
/*  Shared by the decoders                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/** Refuses a format this build lacks, naming the library and the Debian package that adds it. */
uform_status_t uform_media_refuse_missing(uform_media_format_t format, char const* field, char const** error);

/** Refuses an item whose bytes are not of the modality it was declared as, naming what they are. */
uform_status_t uform_media_refuse_kind(uform_media_format_t found, char const* expected, uint8_t const* bytes,
                                       size_t length, char const* field, char const** error);

/** The patch grid an image of `height x width` pixels is resized to, as `uform_image_patches` says. */
void uform_media_fit(size_t height, size_t width, uint32_t patch_side, size_t max_tokens, uform_media_grid_t* grid);

/** Checks an image's or frame's size against the limits above; `what` is e.g. "JPEG image". */
uform_status_t uform_media_check_size(size_t height, size_t width, char const* what, char const* field,
                                      char const** error);

/** Precomputed filter taps of one axis: for each output coordinate, where its input run starts and its weights. */
typedef struct uform_resize_axis_t {
    size_t outputs, taps; /* taps: the widest run; each output's weights are `taps` long, zero-padded */
    uint32_t* starts;     /* (outputs) first input coordinate */
    uint32_t* counts;     /* (outputs) input coordinates read */
    float* weights;       /* (outputs x taps) normalized weights */
} uform_resize_axis_t;

/** A resize from one picture size to a patch grid, planned once and run on every frame. */
typedef struct uform_resize_t {
    size_t height, width, channels;
    uform_resize_axis_t vertical, horizontal;
    float* row; /* (width x channels) one output row after the vertical pass */
} uform_resize_t;

uform_status_t uform_resize_init(uform_resize_t* resize, size_t height, size_t width, size_t channels,
                                 uform_media_grid_t const* grid, uint32_t patch_side);
void uform_resize_free(uform_resize_t* resize);

/**
 *  Resizes `pixels` (height rows of `stride` bytes, `channels` 8-bit values a pixel) onto the grid
 *  and writes normalized floats into patches: pixel (y, x, c) of the output lands at
 *  `out + patch * patch_stride + ((y % side) * side + x % side) * channels + c`, patch in raster order.
 */
void uform_resize_run(uform_resize_t const* resize, uint8_t const* pixels, size_t stride, uint32_t patch_side,
                      uint32_t columns, float* out, size_t patch_stride);

/** Narrows `count` pixels of 3 or 4 channels to `to` (1 or 3) in place, as `uform_image_patches` describes. */
void uform_media_narrow(uint8_t* pixels, size_t count, size_t from, size_t to);

#ifdef __cplusplus
}
#endif

#endif /* UFORM_MEDIA_H_ */
