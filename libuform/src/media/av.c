/**
 *  @file   av.c
 *  @brief  Audio and video through FFmpeg's libraries: libavformat reads the container,
 *          libavcodec decodes, libswresample mixes and resamples audio, libswscale turns video
 *          frames into RGB, which `resize.c` puts on patches as it does images.
 *
 *  The container is the one the magic bytes named, opened with that demuxer alone, so FFmpeg never
 *  probes the bytes against its hundreds of other formats; and each demuxer may hand over only the
 *  codecs listed below. Decoders run strict (`AV_EF_EXPLODE`: a damaged frame is an error, not a
 *  concealed one) and single-threaded, since the caller already decodes items in parallel. A
 *  packet the demuxer read short (a file cut in the middle) is refused rather than decoded in part.
 *
 *  Two settings of FFmpeg's are process-wide, and the first decode makes them. Its log goes through a
 *  callback that drops messages on a thread while it decodes here and passes every other message to
 *  FFmpeg's default printer, so the library prints nothing, and a host program that uses FFmpeg itself
 *  keeps its log (unless it installs a callback of its own, which then sees ours too). And one
 *  allocation is capped at 256 MiB (`av_max_alloc`; FFmpeg's own cap is 2 GiB): demuxers size their
 *  tables by the counts a header declares, so a 300-byte MP4 asked for 1.6 GB (fuzz/RESULTS.md,
 *  finding 11). What uform decodes needs far less: a frame's plane is at most 2^25 pixels of 2 bytes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "media.h"

#if defined(UFORM_MEDIA_FFMPEG)

#include <pthread.h>

#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/channel_layout.h>
#include <libavutil/mem.h>
#include <libavutil/opt.h>
#include <libavutil/pixdesc.h>
#include <libswresample/swresample.h>
#include <libswscale/swscale.h>

enum {
    uform_av_buffer_k = 1 << 16, /* bytes libavformat reads at once from the item */
    uform_av_max_alloc_k = 1 << 28, /* the most FFmpeg allocates at once, process-wide, once media is decoded */
    uform_av_max_streams_k = 16, /* a container declaring more is not one we read */
};

/* ---------------------------------------------------------------------------------------------- */
/*  The log                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static pthread_once_t uform_av_once = PTHREAD_ONCE_INIT;
static pthread_key_t uform_av_quiet; /* non-NULL on a thread while it decodes here */
static int uform_av_keyed;

static void uform_av_log(void* context, int level, char const* format, va_list arguments) {
    if (uform_av_keyed && pthread_getspecific(uform_av_quiet)) return;
    av_log_default_callback(context, level, format, arguments);
}

static void uform_av_setup(void) {
    uform_av_keyed = pthread_key_create(&uform_av_quiet, NULL) == 0;
    av_log_set_callback(uform_av_log);
    av_max_alloc(uform_av_max_alloc_k);
}

static void uform_av_hush(int quiet) {
    pthread_once(&uform_av_once, uform_av_setup);
    if (uform_av_keyed) pthread_setspecific(uform_av_quiet, quiet ? (void*)&uform_av_keyed : NULL);
}

/* ---------------------------------------------------------------------------------------------- */
/*  Reading the item from memory                                                                   */
/* ---------------------------------------------------------------------------------------------- */

typedef struct uform_av_source_t {
    uint8_t const* bytes;
    size_t length, at;
} uform_av_source_t;

static int uform_av_read(void* opaque, uint8_t* out, int size) {
    uform_av_source_t* source = opaque;
    size_t left = source->length - source->at, taken = size < 0 ? 0 : (size_t)size;
    if (!left) return AVERROR_EOF;
    if (taken > left) taken = left;
    memcpy(out, source->bytes + source->at, taken);
    source->at += taken;
    return (int)taken;
}

static int64_t uform_av_seek(void* opaque, int64_t offset, int whence) {
    uform_av_source_t* source = opaque;
    whence &= ~AVSEEK_FORCE;
    if (whence == AVSEEK_SIZE) return (int64_t)source->length;
    int64_t base = whence == SEEK_SET ? 0 : whence == SEEK_CUR ? (int64_t)source->at
                 : whence == SEEK_END ? (int64_t)source->length : -1;
    if (base < 0 || offset < -base || offset > (int64_t)source->length - base) return AVERROR(EINVAL);
    source->at = (size_t)(base + offset);
    return base + offset;
}

/* ---------------------------------------------------------------------------------------------- */
/*  One stream of one item, open for decoding                                                      */
/* ---------------------------------------------------------------------------------------------- */

typedef struct uform_av_t {
    uform_av_source_t source;
    AVIOContext* io;
    AVFormatContext* container;
    AVCodecContext* codec;
    AVPacket* packet;
    AVFrame* frame;
    int stream;
    char const* field;
    char const** error;
} uform_av_t;

static void uform_av_close(uform_av_t* av) {
    av_frame_free(&av->frame);
    av_packet_free(&av->packet);
    avcodec_free_context(&av->codec);
    avformat_close_input(&av->container);
    if (av->io) av_freep(&av->io->buffer);
    avio_context_free(&av->io);
    uform_av_hush(0);
}

/* FFmpeg answers ENOMEM also where a file declares a size past what it will allocate (2 GiB): a fault of the
 * bytes more often than of the machine, so that too is refused as bad input. */
static uform_status_t uform_av_refuse(uform_av_t* av, char const* what, int code) {
    char reason[AV_ERROR_MAX_STRING_SIZE] = "";
    av_strerror(code, reason, sizeof(reason));
    return uform_fail(av->error, uform_status_invalid_argument_k, "%s: %s: %s%s", av->field, what, reason,
                      code == AVERROR(ENOMEM) ? " (for the sizes the file declares)" : "");
}

/* The codecs each container may carry; anything else is refused by name. */
static int uform_av_codec_allowed(uform_media_format_t format, enum AVCodecID codec) {
    switch (format) {
    case uform_media_wav_k:
        return codec == AV_CODEC_ID_PCM_U8 || codec == AV_CODEC_ID_PCM_S16LE || codec == AV_CODEC_ID_PCM_S24LE ||
               codec == AV_CODEC_ID_PCM_S32LE || codec == AV_CODEC_ID_PCM_F32LE || codec == AV_CODEC_ID_PCM_F64LE ||
               codec == AV_CODEC_ID_PCM_ALAW || codec == AV_CODEC_ID_PCM_MULAW;
    case uform_media_flac_k: return codec == AV_CODEC_ID_FLAC;
    case uform_media_mp3_k: return codec == AV_CODEC_ID_MP3;
    case uform_media_ogg_k: return codec == AV_CODEC_ID_VORBIS || codec == AV_CODEC_ID_OPUS || codec == AV_CODEC_ID_FLAC;
    case uform_media_mp4_k:
    case uform_media_webm_k:
    case uform_media_mkv_k: return codec == AV_CODEC_ID_H264 || codec == AV_CODEC_ID_VP9 || codec == AV_CODEC_ID_AV1;
    default: return 0;
    }
}

/*
 *  libavformat's WAV demuxer allocates what a chunk declares before it reads it (a `LIST` of 1 GiB
 *  in a 2 KB file: fuzz/RESULTS.md, finding 10). Every chunk but the samples must lie inside the
 *  file; `data` may run past its end, which is a truncation the decode refuses as such.
 */
static uform_status_t uform_wav_check(uform_av_t* av) {
    uint8_t const* bytes = av->source.bytes;
    size_t length = av->source.length;
    for (size_t at = 12; at + 8 <= length;) {
        size_t size = (size_t)bytes[at + 4] | (size_t)bytes[at + 5] << 8 | (size_t)bytes[at + 6] << 16 |
                      (size_t)bytes[at + 7] << 24;
        int samples = !memcmp(bytes + at, "data", 4);
        if (size > length - at - 8) {
            if (samples) return uform_status_success_k;
            return uform_fail(av->error, uform_status_invalid_argument_k,
                              "%s: unreadable WAV audio: its chunk '%.4s' declares %zu bytes where %zu remain",
                              av->field, (char const*)(bytes + at), size, length - at - 8);
        }
        at += 8 + size + (size & 1); /* chunks are padded to even sizes */
    }
    return uform_status_success_k;
}

static uform_status_t uform_av_open(uform_av_t* av, uform_media_format_t format, enum AVMediaType type) {
    static char const* const demuxers[uform_media_formats_count_k] = {
        [uform_media_wav_k] = "wav", [uform_media_flac_k] = "flac", [uform_media_mp3_k] = "mp3",
        [uform_media_ogg_k] = "ogg", [uform_media_mp4_k] = "mov", [uform_media_webm_k] = "matroska",
        [uform_media_mkv_k] = "matroska"};
    char const* kind = type == AVMEDIA_TYPE_AUDIO ? "audio" : "video";
    uform_av_hush(1);
    if (format == uform_media_wav_k) {
        uform_status_t status = uform_wav_check(av);
        if (status != uform_status_success_k) return status;
    }
    AVInputFormat const* demuxer = av_find_input_format(demuxers[format]);
    if (!demuxer)
        return uform_fail(av->error, uform_status_unsupported_k, "%s: this build's libavformat has no %s demuxer",
                          av->field, demuxers[format]);
    unsigned char* buffer = av_malloc(uform_av_buffer_k);
    av->io = buffer ? avio_alloc_context(buffer, uform_av_buffer_k, 0, &av->source, uform_av_read, NULL, uform_av_seek)
                    : NULL;
    if (!av->io) av_free(buffer);
    av->container = av->io ? avformat_alloc_context() : NULL;
    av->packet = av_packet_alloc(), av->frame = av_frame_alloc();
    if (!av->container || !av->packet || !av->frame)
        return uform_fail(av->error, uform_status_out_of_memory_k, "%s: no memory to open the %s", av->field, kind);
    av->container->pb = av->io;
    av->container->max_streams = uform_av_max_streams_k;
    av->container->error_recognition = AV_EF_CRCCHECK | AV_EF_BITSTREAM | AV_EF_BUFFER | AV_EF_EXPLODE;
    int code = avformat_open_input(&av->container, NULL, demuxer, NULL); /* frees the context on failure */
    if (code < 0) {
        char what[64];
        snprintf(what, sizeof(what), "unreadable %s", uform_media_format_what(format));
        return uform_av_refuse(av, what, code);
    }

    av->stream = -1;
    for (unsigned i = 0; i != av->container->nb_streams && av->stream < 0; ++i)
        if (av->container->streams[i]->codecpar->codec_type == type) av->stream = (int)i;
    if (av->stream < 0)
        return uform_fail(av->error, uform_status_invalid_argument_k, "%s: the %s file holds no %s stream", av->field,
                          uform_media_format_name(format), kind);
    AVCodecParameters const* parameters = av->container->streams[av->stream]->codecpar;
    if (!uform_av_codec_allowed(format, parameters->codec_id))
        return uform_fail(av->error, uform_status_invalid_argument_k,
                          "%s: a %s stream of codec %s in %s; uform reads %s", av->field, kind,
                          avcodec_get_name(parameters->codec_id), uform_media_format_name(format),
                          type == AVMEDIA_TYPE_AUDIO ? "PCM, A-law and mu-law WAV, FLAC, MP3, and Vorbis, Opus or FLAC in Ogg"
                                                     : "H.264, VP9 and AV1");
    if (type == AVMEDIA_TYPE_VIDEO && parameters->width && parameters->height) {
        uform_status_t status = uform_media_check_size((size_t)parameters->height, (size_t)parameters->width,
                                                       "a video frame", av->field, av->error);
        if (status != uform_status_success_k) return status;
    }
    AVCodec const* decoder = avcodec_find_decoder(parameters->codec_id);
    if (!decoder)
        return uform_fail(av->error, uform_status_unsupported_k, "%s: this build's libavcodec has no %s decoder",
                          av->field, avcodec_get_name(parameters->codec_id));
    av->codec = avcodec_alloc_context3(decoder);
    if (!av->codec) return uform_fail(av->error, uform_status_out_of_memory_k, "%s: no memory for a decoder", av->field);
    code = avcodec_parameters_to_context(av->codec, parameters);
    if (code < 0) return uform_av_refuse(av, "unusable codec parameters", code);
    av->codec->thread_count = 1;
    av->codec->err_recognition = AV_EF_CRCCHECK | AV_EF_BITSTREAM | AV_EF_BUFFER | AV_EF_EXPLODE;
    av->codec->max_pixels = uform_media_max_pixels_k;
    code = avcodec_open2(av->codec, decoder, NULL);
    return code < 0 ? uform_av_refuse(av, "the decoder refused the stream", code) : uform_status_success_k;
}

/* FFmpeg 5.1 (Debian 12) names a frame's duration `pkt_duration`; later versions `duration`. */
static int64_t uform_av_frame_duration(AVFrame const* frame) {
#if LIBAVUTIL_VERSION_INT >= AV_VERSION_INT(57, 30, 100)
    return frame->duration;
#else
    return frame->pkt_duration;
#endif
}

/** What a frame's consumer answers: go on, stop (it has all it takes), or a failure it already reported. */
typedef enum uform_av_taken_t { uform_av_more_k, uform_av_enough_k, uform_av_failed_k } uform_av_taken_t;
typedef uform_av_taken_t (*uform_av_take_t)(void* state, AVFrame const* frame, uform_status_t* status);

/*
 *  Demuxers read a file cut short as if it ended there: Matroska drops the cluster it was in, MP3 its
 *  last frame. Where the container states the stream's length (MP4, Matroska and WebM of one stream,
 *  FLAC, MP3 with a Xing or Info header, WAV), a stream that ends well before it is refused.
 */
static uform_status_t uform_av_check_length(uform_av_t* av, int64_t end) {
    AVStream const* stream = av->container->streams[av->stream];
    double unit = av_q2d(stream->time_base), declared = -1;
    if (stream->duration > 0 && stream->duration != AV_NOPTS_VALUE) declared = (double)stream->duration * unit;
    else if (av->container->nb_streams == 1 && av->container->duration > 0)
        declared = (double)av->container->duration / AV_TIME_BASE;
    if (declared < 0) return uform_status_success_k;
    double start = stream->start_time != AV_NOPTS_VALUE ? (double)stream->start_time * unit : 0;
    double decoded = end != AV_NOPTS_VALUE ? (double)end * unit - start : 0;
    double slack = declared * 0.02 > 0.25 ? declared * 0.02 : 0.25; /* rounding, encoder delay, a last short frame */
    if (decoded + slack >= declared) return uform_status_success_k;
    return uform_fail(av->error, uform_status_invalid_argument_k,
                      "%s: truncated: the file says its stream lasts %.3f s, but it ends after %.3f s", av->field,
                      declared, decoded);
}

/** Decodes the stream to its end, or until `take` has enough, handing it each frame. */
static uform_status_t uform_av_decode(uform_av_t* av, uform_av_take_t take, void* state) {
    uform_status_t status = uform_status_success_k;
    AVRational const unit = av->container->streams[av->stream]->time_base;
    int64_t end = AV_NOPTS_VALUE; /* where the latest frame decoded ends, in the stream's time base */
    int ended = 0;
    while (!ended) {
        int code = av_read_frame(av->container, av->packet);
        if (code == AVERROR_EOF) code = avcodec_send_packet(av->codec, NULL), ended = 1; /* drains the decoder */
        else if (code < 0) return uform_av_refuse(av, "a damaged container", code);
        else if (av->packet->stream_index != av->stream) {
            av_packet_unref(av->packet);
            continue;
        } else if (av->packet->flags & AV_PKT_FLAG_CORRUPT) {
            av_packet_unref(av->packet);
            return uform_fail(av->error, uform_status_invalid_argument_k, "%s: the file ends inside a packet: truncated",
                              av->field);
        } else {
            code = avcodec_send_packet(av->codec, av->packet);
            av_packet_unref(av->packet);
        }
        if (code < 0) return uform_av_refuse(av, "undecodable data", code);
        while ((code = avcodec_receive_frame(av->codec, av->frame)) == 0) {
            AVFrame const* frame = av->frame;
            if (frame->best_effort_timestamp != AV_NOPTS_VALUE) {
                int64_t length = frame->sample_rate > 0
                                     ? av_rescale_q(frame->nb_samples, (AVRational){1, frame->sample_rate}, unit)
                                     : uform_av_frame_duration(frame);
                if (end == AV_NOPTS_VALUE || frame->best_effort_timestamp + length > end)
                    end = frame->best_effort_timestamp + length;
            }
            uform_av_taken_t taken = av->frame->flags & AV_FRAME_FLAG_CORRUPT
                                         ? (status = uform_fail(av->error, uform_status_invalid_argument_k,
                                                                "%s: a corrupt frame", av->field), uform_av_failed_k)
                                         : take(state, av->frame, &status);
            av_frame_unref(av->frame);
            if (taken != uform_av_more_k) return status;
        }
        if (code == AVERROR_EOF) break;
        if (code != AVERROR(EAGAIN)) return uform_av_refuse(av, "undecodable data", code);
    }
    return status == uform_status_success_k ? uform_av_check_length(av, end) : status;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Audio                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

typedef struct uform_audio_t {
    uform_av_t* av;
    SwrContext* resampler;
    int rate, format, channels; /* the input's, fixed by the first frame */
    uint32_t sample_rate;
    float* samples;             /* the caller's chunks, filled in order */
    size_t capacity, count;     /* samples that fit, samples written */
    float* scratch;             /* one frame's resampled output */
    int scratch_capacity;
    int truncated;
} uform_audio_t;

static uform_status_t uform_audio_resampler(uform_audio_t* audio, AVFrame const* frame) {
    uform_av_t* av = audio->av;
    int channels = frame->ch_layout.nb_channels;
    if (channels < 1 || channels > uform_media_max_channels_k)
        return uform_fail(av->error, uform_status_invalid_argument_k, "%s: audio of %d channels; uform mixes 1 to %d",
                          av->field, channels, (int)uform_media_max_channels_k);
    if (frame->sample_rate < uform_media_min_sample_rate_k || frame->sample_rate > uform_media_max_sample_rate_k)
        return uform_fail(av->error, uform_status_invalid_argument_k, "%s: audio at %d samples a second; uform reads %d "
                          "to %d", av->field, frame->sample_rate, (int)uform_media_min_sample_rate_k,
                          (int)uform_media_max_sample_rate_k);
    AVChannelLayout input = {0}, mono = AV_CHANNEL_LAYOUT_MONO;
    if (frame->ch_layout.order == AV_CHANNEL_ORDER_UNSPEC) av_channel_layout_default(&input, channels);
    else if (av_channel_layout_copy(&input, &frame->ch_layout) < 0)
        return uform_fail(av->error, uform_status_out_of_memory_k, "%s: no memory for a channel layout", av->field);
    int code = swr_alloc_set_opts2(&audio->resampler, &mono, AV_SAMPLE_FMT_FLT, (int)audio->sample_rate, &input,
                                   (enum AVSampleFormat)frame->format, frame->sample_rate, 0, NULL);
    av_channel_layout_uninit(&input);
    if (code < 0) return uform_av_refuse(av, "audio the resampler cannot take", code);
    /* The mean of the channels, whatever they are: not FFmpeg's downmix, which weighs them by position. */
    double weights[uform_media_max_channels_k];
    for (int i = 0; i != channels; ++i) weights[i] = 1.0 / channels;
    /* The filter's parameters set rather than left to the version's defaults: docs/model.md names them. */
    if ((code = swr_set_matrix(audio->resampler, weights, channels)) < 0 ||
        (code = av_opt_set_int(audio->resampler, "filter_size", 32, 0)) < 0 ||
        (code = av_opt_set_int(audio->resampler, "phase_shift", 10, 0)) < 0 ||
        (code = av_opt_set_int(audio->resampler, "linear_interp", 1, 0)) < 0 ||
        (code = av_opt_set_double(audio->resampler, "cutoff", 0.97, 0)) < 0 ||
        (code = av_opt_set_int(audio->resampler, "filter_type", SWR_FILTER_TYPE_KAISER, 0)) < 0 ||
        (code = av_opt_set_int(audio->resampler, "kaiser_beta", 9, 0)) < 0 ||
        (code = swr_init(audio->resampler)) < 0)
        return uform_av_refuse(av, "audio the resampler cannot take", code);
    audio->rate = frame->sample_rate, audio->format = frame->format, audio->channels = channels;
    return uform_status_success_k;
}

/* Resamples `frame` (NULL drains the filter's delay) and appends what fits; past the room, the item is cut. */
static uform_av_taken_t uform_audio_append(uform_audio_t* audio, AVFrame const* frame, uform_status_t* status) {
    uform_av_t* av = audio->av;
    int inputs = frame ? frame->nb_samples : 0;
    int room = swr_get_out_samples(audio->resampler, inputs);
    if (room < 0) return *status = uform_av_refuse(av, "resampling", room), uform_av_failed_k;
    if (room > audio->scratch_capacity) {
        av_freep(&audio->scratch);
        audio->scratch = av_malloc_array((size_t)room, sizeof(float));
        audio->scratch_capacity = audio->scratch ? room : 0;
        if (!audio->scratch) {
            *status = uform_fail(av->error, uform_status_out_of_memory_k, "%s: no memory to resample", av->field);
            return uform_av_failed_k;
        }
    }
    uint8_t* out = (uint8_t*)audio->scratch;
    int made = swr_convert(audio->resampler, &out, room, frame ? (uint8_t const**)frame->extended_data : NULL, inputs);
    if (made < 0) return *status = uform_av_refuse(av, "resampling", made), uform_av_failed_k;
    for (int i = 0; i != made; ++i) {
        float sample = audio->scratch[i];
        if (!isfinite(sample)) { /* float WAV files can hold anything */
            *status = uform_fail(av->error, uform_status_invalid_argument_k, "%s: audio with non-finite samples",
                                 av->field);
            return uform_av_failed_k;
        }
        if (audio->count == audio->capacity) {
            audio->truncated = 1;
            return uform_av_enough_k;
        }
        audio->samples[audio->count++] = sample < -1 ? -1 : sample > 1 ? 1 : sample;
    }
    return uform_av_more_k;
}

static uform_av_taken_t uform_audio_take(void* state, AVFrame const* frame, uform_status_t* status) {
    uform_audio_t* audio = state;
    if (!audio->resampler) {
        *status = uform_audio_resampler(audio, frame);
        if (*status != uform_status_success_k) return uform_av_failed_k;
    } else if (frame->sample_rate != audio->rate || frame->format != audio->format ||
               frame->ch_layout.nb_channels != audio->channels) {
        *status = uform_fail(audio->av->error, uform_status_invalid_argument_k,
                             "%s: audio whose sample rate, format or channels change midway", audio->av->field);
        return uform_av_failed_k;
    }
    return uform_audio_append(audio, frame, status);
}

uform_status_t uform_audio_chunks(uint8_t const* bytes, size_t length, uint32_t sample_rate, uint32_t chunk_samples,
                                  size_t max_tokens, float* chunks, uform_media_grid_t* grid, char const* field,
                                  char const** error) {
    if (!field) field = "audio";
    if (!sample_rate || sample_rate > uform_media_max_sample_rate_k || !chunk_samples || !max_tokens || !chunks ||
        !grid)
        return uform_fail(error, uform_status_invalid_argument_k,
                          "%s: sample_rate = %u, chunk_samples = %u, max_tokens = %zu: each must be positive, the rate "
                          "at most %d", field, sample_rate, chunk_samples, max_tokens,
                          (int)uform_media_max_sample_rate_k);
    if (!bytes || !length) return uform_fail(error, uform_status_invalid_argument_k, "%s: an empty audio file", field);
    uform_media_format_t format = uform_media_sniff(bytes, length);
    if (format < uform_media_wav_k || format > uform_media_ogg_k)
        return uform_media_refuse_kind(format, "audio", bytes, length, field, error);

    uform_av_t av = {.source = {bytes, length, 0}, .field = field, .error = error};
    uform_audio_t audio = {.av = &av, .sample_rate = sample_rate, .samples = chunks,
                           .capacity = max_tokens * chunk_samples};
    uform_status_t status = uform_av_open(&av, format, AVMEDIA_TYPE_AUDIO);
    if (status == uform_status_success_k) status = uform_av_decode(&av, uform_audio_take, &audio);
    if (status == uform_status_success_k && audio.resampler && !audio.truncated)
        uform_audio_append(&audio, NULL, &status); /* the samples still inside the filter */
    if (status == uform_status_success_k && !audio.count)
        status = uform_fail(error, uform_status_invalid_argument_k, "%s: audio without a single sample", field);
    if (status == uform_status_success_k) {
        size_t used = (audio.count + chunk_samples - 1) / chunk_samples;
        memset(chunks + audio.count, 0, (used * chunk_samples - audio.count) * sizeof(float));
        grid->frames = (uint32_t)used, grid->rows = 1, grid->columns = 1, grid->truncated = audio.truncated;
    }
    swr_free(&audio.resampler);
    av_freep(&audio.scratch);
    uform_av_close(&av);
    return status;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Video                                                                                          */
/* ---------------------------------------------------------------------------------------------- */

typedef struct uform_video_t {
    uform_av_t* av;
    uint32_t patch_side, tube_frames, frame_stride, channels;
    size_t max_tokens;
    float* tubelets;
    uform_media_grid_t grid;      /* of one tubelet; `frames` counts tubelets */
    size_t height, width;         /* of the first frame, which every other must share */
    size_t kept, limit, decoded;  /* frames kept, the most that fit, frames seen */
    uform_resize_t resize;
    struct SwsContext* converter;
    uint8_t* pixels;              /* one frame as 8-bit RGB or RGBA */
    int started;
} uform_video_t;

static uform_status_t uform_video_start(uform_video_t* video, AVFrame const* frame) {
    uform_av_t* av = video->av;
    uform_status_t status = uform_media_check_size((size_t)frame->height, (size_t)frame->width, "a video frame",
                                                   av->field, av->error);
    if (status != uform_status_success_k) return status;
    video->height = (size_t)frame->height, video->width = (size_t)frame->width;
    uform_media_fit(video->height, video->width, video->patch_side, video->max_tokens, &video->grid);
    video->limit = video->max_tokens / ((size_t)video->grid.rows * video->grid.columns) * video->tube_frames;
    size_t converted = video->channels == 4 ? 4 : 3;
    video->pixels = malloc(video->height * video->width * converted);
    if (!video->pixels)
        return uform_fail(av->error, uform_status_out_of_memory_k, "%s: no memory for a frame of %zu x %zu", av->field,
                          video->width, video->height);
    status = uform_resize_init(&video->resize, video->height, video->width, video->channels, &video->grid,
                               video->patch_side);
    if (status != uform_status_success_k)
        return uform_fail(av->error, status, "%s: no memory to resize frames of %zu x %zu", av->field, video->width,
                          video->height);
    video->started = 1;
    return uform_status_success_k;
}

/* The frame as 8-bit RGB (RGBA for 4 channels) by the stream's colour matrix and range, then the channels asked for. */
static uform_status_t uform_video_convert(uform_video_t* video, AVFrame const* frame) {
    uform_av_t* av = video->av;
    size_t converted = video->channels == 4 ? 4 : 3;
    video->converter = sws_getCachedContext(video->converter, frame->width, frame->height,
                                            (enum AVPixelFormat)frame->format, frame->width, frame->height,
                                            converted == 4 ? AV_PIX_FMT_RGBA : AV_PIX_FMT_RGB24,
                                            SWS_BILINEAR | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT, NULL, NULL, NULL);
    if (!video->converter)
        return uform_fail(av->error, uform_status_invalid_argument_k, "%s: video frames in pixel format %s", av->field,
                          av_get_pix_fmt_name((enum AVPixelFormat)frame->format)
                              ? av_get_pix_fmt_name((enum AVPixelFormat)frame->format) : "unknown");
    int const* matrix = sws_getCoefficients(frame->colorspace); /* unspecified and unknown ones read as BT.601 */
    sws_setColorspaceDetails(video->converter, matrix, frame->color_range == AVCOL_RANGE_JPEG, matrix, 1, 0, 1 << 16,
                             1 << 16);
    uint8_t* planes[4] = {video->pixels, NULL, NULL, NULL};
    int strides[4] = {(int)(video->width * converted), 0, 0, 0};
    if (sws_scale(video->converter, (uint8_t const* const*)frame->data, frame->linesize, 0, frame->height, planes,
                  strides) != frame->height)
        return uform_fail(av->error, uform_status_invalid_argument_k, "%s: a video frame that would not convert to RGB",
                          av->field);
    uform_media_narrow(video->pixels, video->height * video->width, converted, video->channels);
    return uform_status_success_k;
}

static uform_av_taken_t uform_video_take(void* state, AVFrame const* frame, uform_status_t* status) {
    uform_video_t* video = state;
    uform_av_t* av = video->av;
    if (video->decoded++ % video->frame_stride) return uform_av_more_k;
    if (!video->started) {
        *status = uform_video_start(video, frame);
        if (*status != uform_status_success_k) return uform_av_failed_k;
    } else if ((size_t)frame->height != video->height || (size_t)frame->width != video->width) {
        *status = uform_fail(av->error, uform_status_invalid_argument_k,
                             "%s: video whose frames change size, from %zu x %zu to %d x %d", av->field, video->width,
                             video->height, frame->width, frame->height);
        return uform_av_failed_k;
    }
    if (video->kept == video->limit) { /* a frame that would start one tubelet too many */
        video->grid.truncated = 1;
        return uform_av_enough_k;
    }
    *status = uform_video_convert(video, frame);
    if (*status != uform_status_success_k) return uform_av_failed_k;
    size_t side = video->patch_side, patch = side * side * video->channels, tubelet = video->tube_frames * patch;
    size_t patches = (size_t)video->grid.rows * video->grid.columns;
    float* slot = video->tubelets + video->kept / video->tube_frames * patches * tubelet +
                  video->kept % video->tube_frames * patch;
    uform_resize_run(&video->resize, video->pixels, video->width * video->channels, video->patch_side,
                     video->grid.columns, slot, tubelet);
    ++video->kept;
    return uform_av_more_k;
}

uform_status_t uform_video_tubelets(uint8_t const* bytes, size_t length, uint32_t patch_side, uint32_t tube_frames,
                                    uint32_t frame_stride, uint32_t channels, size_t max_tokens, float* tubelets,
                                    uform_media_grid_t* grid, char const* field, char const** error) {
    if (!field) field = "video";
    if (channels != 1 && channels != 3 && channels != 4)
        return uform_fail(error, uform_status_invalid_argument_k, "%s: channels = %u; video has 1, 3 or 4", field,
                          channels);
    if (!patch_side || patch_side > uform_media_max_side_k || !tube_frames || !frame_stride || !max_tokens ||
        !tubelets || !grid)
        return uform_fail(error, uform_status_invalid_argument_k,
                          "%s: patch_side = %u, tube_frames = %u, frame_stride = %u, max_tokens = %zu: each must be "
                          "positive, with room for the tubelets", field, patch_side, tube_frames, frame_stride,
                          max_tokens);
    if (!bytes || !length) return uform_fail(error, uform_status_invalid_argument_k, "%s: an empty video file", field);
    uform_media_format_t format = uform_media_sniff(bytes, length);
    if (format < uform_media_mp4_k || format > uform_media_mkv_k)
        return uform_media_refuse_kind(format, "a video", bytes, length, field, error);

    uform_av_t av = {.source = {bytes, length, 0}, .field = field, .error = error};
    uform_video_t video = {.av = &av, .patch_side = patch_side, .tube_frames = tube_frames,
                           .frame_stride = frame_stride, .channels = channels, .max_tokens = max_tokens,
                           .tubelets = tubelets};
    uform_status_t status = uform_av_open(&av, format, AVMEDIA_TYPE_VIDEO);
    if (status == uform_status_success_k) status = uform_av_decode(&av, uform_video_take, &video);
    if (status == uform_status_success_k && !video.kept)
        status = uform_fail(error, uform_status_invalid_argument_k, "%s: video without a single frame", field);
    if (status == uform_status_success_k) {
        /* A last tubelet short of frames repeats its last one: a still ending reads as still. */
        size_t side = patch_side, patch = side * side * channels, tubelet = (size_t)tube_frames * patch;
        size_t patches = (size_t)video.grid.rows * video.grid.columns, count = (video.kept + tube_frames - 1) / tube_frames;
        size_t filled = video.kept - (count - 1) * tube_frames;
        for (size_t p = 0; p != patches; ++p) {
            float* last = tubelets + ((count - 1) * patches + p) * tubelet;
            for (size_t t = filled; t != tube_frames; ++t)
                memcpy(last + t * patch, last + (filled - 1) * patch, patch * sizeof(float));
        }
        *grid = video.grid;
        grid->frames = (uint32_t)count;
    }
    sws_freeContext(video.converter);
    uform_resize_free(&video.resize);
    free(video.pixels);
    uform_av_close(&av);
    return status;
}

#else /* no FFmpeg: each audio and video format is refused naming the packages that add it */

uform_status_t uform_audio_chunks(uint8_t const* bytes, size_t length, uint32_t sample_rate, uint32_t chunk_samples,
                                  size_t max_tokens, float* chunks, uform_media_grid_t* grid, char const* field,
                                  char const** error) {
    (void)sample_rate, (void)chunk_samples, (void)max_tokens, (void)chunks, (void)grid;
    uform_media_format_t format = uform_media_sniff(bytes, length);
    if (format < uform_media_wav_k || format > uform_media_ogg_k)
        return uform_media_refuse_kind(format, "audio", bytes, length, field ? field : "audio", error);
    return uform_media_refuse_missing(format, field ? field : "audio", error);
}

uform_status_t uform_video_tubelets(uint8_t const* bytes, size_t length, uint32_t patch_side, uint32_t tube_frames,
                                    uint32_t frame_stride, uint32_t channels, size_t max_tokens, float* tubelets,
                                    uform_media_grid_t* grid, char const* field, char const** error) {
    (void)patch_side, (void)tube_frames, (void)frame_stride, (void)channels, (void)max_tokens, (void)tubelets;
    (void)grid;
    uform_media_format_t format = uform_media_sniff(bytes, length);
    if (format < uform_media_mp4_k || format > uform_media_mkv_k)
        return uform_media_refuse_kind(format, "a video", bytes, length, field ? field : "video", error);
    return uform_media_refuse_missing(format, field ? field : "video", error);
}

#endif
