/**
 *  @file   internal.h
 *  @brief  What the shared core and the backends agree on: errors, keyed draws, the model's
 *          tensor layout, packed batches and the table of operations a backend provides.
 *
 *  The core (the C files of `libuform/src/`) validates, packs, draws, runs the model's sequence of
 *  operations and writes checkpoints, once. A backend (`ram/`, later `vram/`) is a table of
 *  operations over its own memory; the core never touches a backend's buffers directly.
 */
#ifndef UFORM_INTERNAL_H_
#define UFORM_INTERNAL_H_

#include <math.h>
#include <stdint.h>
#include <stddef.h>

#include "uform.h"

/* ---------------------------------------------------------------------------------------------- */
/*  Errors                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/** Formats the message into thread-local storage, stores it in `*error` when given, returns `status`. */
uform_status_t uform_fail(char const** error, uform_status_t status, char const* format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

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
    uform_vocabulary_k = 260,     /* 256 bytes, the mask id and three ids reserved for choices and queries */
    uform_mlp_ratio_k = 4,        /* the MLP's inner width is 4 x hidden */
};

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
    size_t total;                 /* floats in each flat buffer */
} uform_layout_t;

uform_status_t uform_layout_init(uform_layout_t* layout, uint32_t depth, uint32_t hidden, uint32_t groups,
                                 float inverse_temperature, float bias, char const** error);
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

/** How a contrastive cell counts. */
typedef enum uform_cell_t {
    uform_cell_ignored_k = 0,
    uform_cell_attract_k = 1,
    uform_cell_repel_k = 2, /* named repel edges and ambient negatives alike */
} uform_cell_t;

/* ---------------------------------------------------------------------------------------------- */
/*  Backends                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/** The contrastive term's settings, as the backend's loss operation reads them. */
typedef struct uform_contrastive_setup_t {
    uform_pair_loss_form_t form; /* never `derived`: the core resolves it */
    size_t dimensions_count;
    uint32_t dimensions[UFORM_MAX_MATRYOSHKA_DIMENSIONS];
} uform_contrastive_setup_t;

/**
 *  The operations a backend provides, over pointers into its own memory. Shapes are named
 *  where they are used: `tokens` rows of the packed stream, `hidden` wide, `segments` items.
 *  Backward operations accumulate (`+=`) into gradients unless they say otherwise, so the core
 *  may sum contributions from several heads without extra buffers.
 */
typedef struct uform_backend_t {
    char const* name;
    void* (*allocate)(void* context, size_t bytes); /* zeroed; NULL when out of memory */
    void (*release)(void* context, void* pointer);
    void (*upload)(void* context, void* destination, void const* source, size_t bytes);
    void (*download)(void* context, void* destination, void const* source, size_t bytes);
    void (*zero)(void* context, void* destination, size_t bytes);
    void (*copy)(void* context, void* destination, void const* source, size_t bytes); /* within the backend */

    /* c (m, n) = a (m, k) x b (k, n) + beta c, either input read transposed when asked */
    void (*matmul)(void* context, float* c, float const* a, float const* b, size_t m, size_t n, size_t k,
                   int a_transposed, int b_transposed, float beta);
    /* out (tokens, hidden) = table[ids] */
    void (*embedding_forward)(void* context, float* out, float const* table, uint32_t const* ids, size_t tokens,
                              size_t hidden);
    void (*embedding_backward)(void* context, float* d_table, float const* d_out, uint32_t const* ids,
                               size_t tokens, size_t hidden, size_t vocabulary);
    /* out = x / rms(x) * gain; rstd (tokens) keeps 1 / rms(x) for the backward pass */
    void (*rmsnorm_forward)(void* context, float* out, float* rstd, float const* x, float const* gain, size_t tokens,
                            size_t hidden);
    void (*rmsnorm_backward)(void* context, float* d_x, float* d_gain, float const* d_out, float const* x,
                             float const* gain, float const* rstd, size_t tokens, size_t hidden);
    /* rotates the query and key thirds of qkv (tokens, 3 hidden) in place by each token's position */
    void (*rope_forward)(void* context, float* qkv, uint32_t const* positions, size_t tokens, size_t hidden);
    /* the inverse rotation, applied to their gradients in place */
    void (*rope_backward)(void* context, float* d_qkv, uint32_t const* positions, size_t tokens, size_t hidden);
    /* out (tokens, hidden), lse (heads, tokens): softmax(q k^T / 8) v within each segment only */
    void (*attention_forward)(void* context, float* out, float* lse, float const* qkv, uform_segment_t const* segments,
                              size_t segments_count, size_t tokens, size_t hidden);
    /* d_qkv is written, not accumulated */
    void (*attention_backward)(void* context, float* d_qkv, float const* d_out, float const* out, float const* lse,
                               float const* qkv, uform_segment_t const* segments, size_t segments_count,
                               size_t tokens, size_t hidden);
    /* tanh-approximated GELU, element-wise; the backward pass writes d_in, which may alias d_out */
    void (*gelu_forward)(void* context, float* out, float const* in, size_t count);
    void (*gelu_backward)(void* context, float* d_in, float const* d_out, float const* in, size_t count);
    /* out[i] = in[rows[i]] and its adjoint d_in[rows[i]] += d_out[i] (rows distinct) */
    void (*gather_rows)(void* context, float* out, float const* in, uint32_t const* rows, size_t count, size_t width);
    void (*scatter_rows)(void* context, float* d_in, float const* d_out, uint32_t const* rows, size_t count,
                         size_t width);
    /* mean cross-entropy of logits (count, classes) against targets, scaled; writes d_logits * scale */
    double (*cross_entropy)(void* context, float* d_logits, float const* logits, uint32_t const* targets,
                            size_t count, size_t classes, float scale);
    /* pooled (segments, hidden) = mean of each segment's rows; the backward pass accumulates */
    void (*pool_forward)(void* context, float* pooled, float const* states, uform_segment_t const* segments,
                         size_t segments_count, size_t hidden);
    void (*pool_backward)(void* context, float* d_states, float const* d_pooled, uform_segment_t const* segments,
                          size_t segments_count, size_t hidden);
    /*
     *  The contrastive loss over pooled (items, hidden) embeddings, SPEC section 5: cells
     *  (items x items) say how each cell counts and weights weigh it. Writes the unit-norm
     *  embeddings, accumulates d_pooled, d_log_inverse_temperature and d_bias scaled by `scale`,
     *  returns the loss, or NaN when no row counted.
     */
    double (*contrastive)(void* context, float* d_pooled, float* d_log_inverse_temperature, float* d_bias,
                          float* normalized, float const* pooled, float const* log_inverse_temperature,
                          float const* bias, uint8_t const* cells, float const* weights, uint32_t const* groups,
                          size_t items, size_t hidden, uform_contrastive_setup_t const* setup, float scale);
    /* sum of squares, in double, in an order that does not depend on the thread count */
    double (*sum_squares)(void* context, float const* x, size_t count);
    /* one AdamW update of a tensor: gradients scaled by `gradient_scale` (clipping) first */
    void (*adamw)(void* context, float* weights, float const* gradients, float* first, float* second, size_t count,
                  float learning_rate, float beta1, float beta2, float epsilon, float weight_decay,
                  float gradient_scale, uint64_t step);
} uform_backend_t;

/** The CPU reference backend; its context is a `uform_ram_context_t`. */
typedef struct uform_ram_context_t {
    int threads;
} uform_ram_context_t;

extern uform_backend_t const uform_ram_backend;

/* ---------------------------------------------------------------------------------------------- */
/*  Hooks for the tests                                                                            */
/* ---------------------------------------------------------------------------------------------- */

/** Runs a step's forward, loss and backward passes without updating: `gradients` gets `layout.total` floats. */
uform_status_t uform_trainer_probe(uform_trainer_t trainer, uform_trainer_step_t* step, float* gradients,
                                   char const** error);
/** Copies the flat weights out (`*total` floats, in layout order); with `weights == NULL` tells `*total`. */
uform_status_t uform_trainer_weights(uform_trainer_t trainer, float* weights, size_t* total, char const** error);

#endif /* UFORM_INTERNAL_H_ */
