/**
 *  @file   internal.h
 *  @brief  What the shared core and the backends agree on: errors, keyed draws, the model's
 *          tensor layout, packed batches and the table of operations a backend provides.
 *
 *  The core (the C files of `libuform/src/`) validates, packs, draws, runs the model's sequence of
 *  operations and writes checkpoints, once. A backend (`ram/`, later `vram/`) is a table of
 *  operations over its own memory (`backend.h`); the core never touches a backend's buffers directly.
 */
#ifndef UFORM_INTERNAL_H_
#define UFORM_INTERNAL_H_

#include <math.h>
#include <stdint.h>
#include <stddef.h>

#include "uform.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifndef UFORM_API /* uform.h defines it; these headers also serve builds of the plug-in */
#define UFORM_API
#endif

/* ---------------------------------------------------------------------------------------------- */
/*  Errors                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/** Formats the message into thread-local storage, stores it in `*error` when given, returns `status`. */
uform_status_t uform_fail(char const** error, uform_status_t status, char const* format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/** Refuses a caller's value: `uform_fail` with `invalid_argument`, in a function that has `char const** error`. */
#define UFORM_INVALID(...) uform_fail(error, uform_status_invalid_argument_k, __VA_ARGS__)

/** Returns the status of `expression` from the calling function unless it succeeded. */
#define UFORM_TRY(expression)                                                                                         \
    do {                                                                                                              \
        uform_status_t status_ = (expression);                                                                        \
        if (status_ != uform_status_success_k) return status_;                                                        \
    } while (0)

/** `uform_fail`'s type, for backends loaded at run time, which format their messages through the core's. */
typedef uform_status_t (*uform_fail_t)(char const** error, uform_status_t status, char const* format, ...);

/** The message of the last failure on this thread: what a verb hands its caller when an operation failed.
 *  Exported beside `uform.h`'s verbs for the library's own test module. */
UFORM_API char const* uform_message(void);

/* ---------------------------------------------------------------------------------------------- */
/*  Keyed draws                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/**
 *  Every random number is a pure function of a key: (seed, stream, step, item, index) hashed by
 *  chained SplitMix64 finalizers. No generator state exists, so the numbers never depend on how
 *  items were spread over threads, devices or processes, and a resumed run draws what the
 *  uninterrupted one would have.
 */
typedef enum uform_stream_t {
    uform_stream_init_k = 1,     /* (seed, init, 0, tensor, element) */
    uform_stream_span_k = 2,     /* (seed, span, step, item, position): starts and lengths of spans */
    uform_stream_corrupt_k = 3,  /* (seed, corrupt, step, item, position): mask / random / keep */
    uform_stream_byte_k = 4,     /* (seed, byte, step, item, position): the random byte */
    uform_stream_patch_k = 5,    /* (seed, patch, step, item, token): whether a media token is hidden */
} uform_stream_t;

static inline uint64_t uform_mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline uint64_t uform_key(uint64_t seed, uint64_t stream, uint64_t step, uint64_t item, uint64_t index) {
    return uform_mix(uform_mix(uform_mix(uform_mix(uform_mix(seed) ^ stream) ^ step) ^ item) ^ index);
}

/** A uniform draw in [0, 1) from the top 24 bits, exact in float32. */
static inline float uform_uniform(uint64_t key) { return (float)(key >> 40) * (1.0f / 16777216.0f); }

/** A standard normal draw by Box-Muller from two halves of one key. */
static inline float uform_normal(uint64_t key) {
    double u1 = ((double)(key >> 40) + 1.0) / 16777217.0; /* (0, 1]: the logarithm stays finite */
    double u2 = (double)(key & 0xFFFFFF) / 16777216.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ---------------------------------------------------------------------------------------------- */
/*  The model                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

enum {
    uform_head_width_k = 64,      /* every attention head is 64 wide */
    uform_bytes_k = 256,          /* byte values a text token takes */
    uform_mask_id_k = 256,        /* the id a masked position shows */
    uform_choice_id_k = 257,      /* the id of the position, after an item's content, whose logits choose */
    uform_query_pad_id_k = 258,   /* the id that pads a query's rows up to max_query_span */
    uform_media_id_k = 259,       /* a media token's id: its row of the table adds to the token's projection */
    uform_vocabulary_k = 260,     /* 256 bytes, the mask id, the choice and query-padding ids, the media id */
    uform_mlp_ratio_k = 4,        /* the MLP's inner width is 4 x hidden */
};

/**
 *  The modalities read as tokens of values rather than ids: image patches, video tubelets, audio
 *  chunks. Each has its own input projection and decoder; they are listed in this order everywhere.
 */
enum { uform_media_image_k = 0, uform_media_video_k = 1, uform_media_audio_k = 2, uform_media_kinds_k = 3 };

/** One named tensor inside the flat parameter buffer. */
typedef struct uform_tensor_t {
    char name[64];
    size_t offset; /* in floats from the buffer's start */
    size_t rows;   /* 1 for vectors */
    size_t cols;
    int decays;    /* matrices take weight decay, gains and scalars do not */
    float init_std; /* 0 initializes to `init_value` */
    float init_value;
} uform_tensor_t;

/** Indices of one block's tensors in `uform_layout_t.tensors`. */
typedef struct uform_block_tensors_t {
    size_t attention_norm, qkv, out, mlp_norm, up, down;
} uform_block_tensors_t;

/** Where every parameter lives in the flat buffers of weights, gradients and moments. */
typedef struct uform_layout_t {
    uint32_t depth, hidden, heads, temperature_groups;
    size_t count;                 /* tensors */
    uform_tensor_t* tensors;      /* `count` tensors, in checkpoint order */
    uform_block_tensors_t* blocks; /* `depth` blocks */
    size_t embedding, final_norm, decoder, log_inverse_temperature, bias;
    size_t token_head, late_log_inverse_temperature, late_bias; /* SIZE_MAX: no late interaction */
    size_t media_projection[uform_media_kinds_k]; /* (hidden, width) per media kind */
    size_t media_decoder[uform_media_kinds_k];    /* (width, hidden) */
    size_t media_width[uform_media_kinds_k];      /* floats in one token of each kind */
    uform_image_shape_t image;                    /* what a projection's columns mean: a resumed run must */
    uform_video_shape_t video;                    /*   cut media the same way, not merely into as many values */
    uform_audio_shape_t audio;
    size_t widest;                                /* the largest of them */
    size_t total;                 /* floats in each flat buffer */
} uform_layout_t;

/** Floats in one token of each media kind, from a validated batch shape. */
void uform_media_widths(uform_batch_shape_t const* batch, size_t widths[uform_media_kinds_k]);

/** The layout of a validated config's model; the token head's tensors only where it trains late interaction. */
uform_status_t uform_layout_init(uform_layout_t* layout, uform_trainer_init_vram_t const* config, char const** error);
void uform_layout_free(uform_layout_t* layout);

/* ---------------------------------------------------------------------------------------------- */
/*  Packed batches                                                                                 */
/* ---------------------------------------------------------------------------------------------- */

/** One item's tokens inside the packed token stream, and the row it was packed into. */
typedef struct uform_segment_t {
    uint32_t start;  /* first token in the device's packed token stream */
    uint32_t length; /* tokens, after truncation */
    uint32_t row;    /* the row of `max_columns_per_row` positions it occupies */
    uint32_t column; /* its first position in that row */
} uform_segment_t;

/**
 *  A token's position word. A text token's, or an audio chunk's, is its position in the item. An
 *  image patch's sets bit 31 and holds its row in bits 15 to 29 and its column in bits 0 to 14. A
 *  video tubelet's sets bits 31 and 30 and holds its time in bits 18 to 29, its row in bits 9 to
 *  17 and its column in bits 0 to 8.
 */
#define UFORM_POSITION_GRID 0x80000000u
#define UFORM_POSITION_VOLUME 0x40000000u

static inline uint32_t uform_position_grid(uint32_t row, uint32_t column) {
    return UFORM_POSITION_GRID | (row & 0x7FFF) << 15 | (column & 0x7FFF);
}

static inline uint32_t uform_position_volume(uint32_t time, uint32_t row, uint32_t column) {
    return UFORM_POSITION_GRID | UFORM_POSITION_VOLUME | (time & 0xFFF) << 18 | (row & 0x1FF) << 9 | (column & 0x1FF);
}

/** How a contrastive cell counts. */
typedef enum uform_cell_t {
    uform_cell_ignored_k = 0,
    uform_cell_attract_k = 1,
    uform_cell_repel_k = 2, /* named repel edges and ambient negatives alike */
} uform_cell_t;

/* ---------------------------------------------------------------------------------------------- */
/*  Hooks for the tests                                                                            */
/* ---------------------------------------------------------------------------------------------- */

/* The library exports these beside `uform.h`'s verbs for its own test module; they are no promise. */
/** Runs a step's forward, loss and backward passes without updating: `gradients` gets `layout.total` floats. */
UFORM_API uform_status_t uform_trainer_probe(uform_trainer_t trainer, uform_trainer_step_t* step, float* gradients,
                                   char const** error);
/** Copies the flat weights out (`*total` floats, in layout order); with `weights == NULL` tells `*total`. */
UFORM_API uform_status_t uform_trainer_weights(uform_trainer_t trainer, float* weights, size_t* total, char const** error);
/** Bytes of backend memory a trainer's (every simulated device's) or an encoder's buffers take, the backend's own
 *  scratch aside. */
UFORM_API uform_status_t uform_trainer_memory(uform_trainer_t trainer, size_t* bytes, char const** error);
UFORM_API uform_status_t uform_encoder_memory(uform_encoder_t encoder, size_t* bytes, char const** error);

#ifdef __cplusplus
}
#endif

#endif /* UFORM_INTERNAL_H_ */
