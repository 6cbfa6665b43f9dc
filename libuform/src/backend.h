/**
 *  @file   backend.h
 *  @brief  The contract between the shared core and a backend: what a backend's table of
 *          operations takes, in which precision, and how it fails.
 *
 *  The core (`model.c`) describes the model once as a sequence of these operations; a backend
 *  (`ram/`, the CPU reference, or `vram/`, CUDA) implements them over its own memory. The core
 *  never reads a backend's buffers except through `download`.
 *
 *  @section  Precision
 *
 *  Master weights, their gradients and AdamW's moments are float32 everywhere. Activations, and
 *  the "compute" copy of the weights that matrix products read, are of the backend's
 *  `activations` element type: float32 on the CPU, bfloat16 on the GPU. Statistics that a
 *  backward pass rereads (RMSNorm's reciprocal roots, attention's log-sum-exps), pooled
 *  embeddings and their gradients are float32. Losses and the gradient's squared norm are
 *  reduced on the device into `double` scalars that the core reads once, after the step.
 *  Buffers of the activation type are `void*`; `float*` is always float32.
 *
 *  @section  Failures
 *
 *  Every operation returns a status. On failure it has formatted its message with `uform_fail`
 *  (the core's, handed to a backend loaded at run time), and the core stops the pass and hands
 *  the message to the verb's caller. A backend that runs asynchronously may report a kernel's
 *  failure later, from `synchronize`.
 *
 *  @section  Scratch
 *
 *  A context is made for one replica with the capacities it will ever see (`uform_plan_t`), and
 *  takes every scratch buffer its operations need then: no operation allocates, so a step never
 *  runs out of memory half-way.
 */
#ifndef UFORM_BACKEND_H_
#define UFORM_BACKEND_H_

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum uform_element_t {
    uform_element_f32_k = 0,
    uform_element_bf16_k = 1,
} uform_element_t;

static inline size_t uform_element_bytes(uform_element_t element) { return element == uform_element_f32_k ? 4 : 2; }

/** The capacities a replica's context is planned for, and the model it runs. */
typedef struct uform_plan_t {
    size_t tokens;   /* token positions per step: rows x columns */
    size_t segments; /* items per step */
    size_t columns;  /* the longest an item can be */
    size_t hidden, heads;
    int contrastive;              /* whether the contrastive term runs, and needs its scratch */
    size_t pairs, query_span;     /* late interaction: (query, document) pairs per step, a query's rows at most */
    size_t widest;                /* floats in the widest media token */
    int nondeterministic;         /* may give up run-to-run bit equality for speed: attention's backward */
    uform_layout_t const* layout; /* the parameters AdamW walks; NULL for an encoder's replica, which never updates */
} uform_plan_t;

/** The items of one step: where each sits in the packed stream, on the device and on the host. */
typedef struct uform_items_t {
    uform_segment_t const* segments;      /* (count) in the backend's memory */
    uform_segment_t const* host_segments; /* (count) the same, in host memory */
    size_t count;
    size_t longest; /* tokens of the longest item */
} uform_items_t;

/** Slots of the step's `double` scalars, reduced on the device and read once per step. */
enum {
    uform_scalar_masked_loss_k = 0,      /* mean cross-entropy over masked positions, unweighted */
    uform_scalar_contrastive_loss_k = 1, /* the contrastive term; NaN when no row counted */
    uform_scalar_norm_squared_k = 2,     /* the global gradient's squared norm */
    uform_scalar_choices_loss_k = 3,     /* mean cross-entropy over the items that offer choices, unweighted */
    uform_scalar_late_interaction_loss_k = 4, /* the late-interaction term; NaN when no query row counted */
    uform_scalar_media_loss_k = 5,       /* + kind: mean squared error over hidden media tokens of the kind, unweighted */
    uform_scalars_k = 5 + uform_media_kinds_k,
};

/** The contrastive term's settings, as the backend's loss operation reads them. */
typedef struct uform_contrastive_setup_t {
    uform_pair_loss_form_t form; /* never `derived`: the core resolves it */
    size_t dimensions_count;
    uint32_t dimensions[UFORM_MAX_MATRYOSHKA_DIMENSIONS];
} uform_contrastive_setup_t;

/** Which losses ran this step and how the total weighs them. */
typedef struct uform_terms_t {
    int masked_ran, contrastive_ran, choices_ran, late_ran, media_ran[uform_media_kinds_k];
    float text_weight, choices_weight, late_weight, media_weight[uform_media_kinds_k]; /* the contrastive one's is one */
} uform_terms_t;

/** One AdamW update of every tensor of a layout, or none when the step is poisoned. */
typedef struct uform_update_t {
    float* weights;       /* (layout.total) float32 master weights */
    void* compute;        /* (layout.total) activation-typed copy refreshed after the update; NULL when the
                             backend's activations are float32 and matrix products read `weights` itself */
    float const* gradients;
    float *first, *second;
    double const* scalars; /* the step's scalars: the norm and the losses judged below */
    float learning_rate, beta1, beta2, epsilon, weight_decay; /* decay applies to tensors that decay */
    float clip_norm;       /* gradients scale by clip_norm / norm when the norm exceeds it */
    uform_terms_t terms;   /* which losses count toward the total, and their weights */
    uint64_t step;         /* this update's number, from 1: AdamW's bias corrections */
    /* A step queued before the one ahead of it has landed applies only where that one did: `after` is the earlier
       update's verdict (NULL when the host knew it), and `verdict` receives this one's, 1 where it applied. */
    int32_t const* after;
    int32_t* verdict;
} uform_update_t;

/* The rules below are written once, for the host and the device alike, so they never disagree. */
#if defined(__CUDACC__)
#define UFORM_HOST_DEVICE __host__ __device__
#else
#define UFORM_HOST_DEVICE
#endif

/** A hidden media token's target is its values less their mean, over their spread (MAE's normalized pixels):
 *  `(v - mean) * scale`, from the values' sum and sum of squares in double, the variance the population's. */
UFORM_HOST_DEVICE static inline void uform_patch_normalizer(double sum, double squares, size_t width, double* mean,
                                                            double* scale) {
    *mean = sum / (double)width;
    double variance = squares / (double)width - *mean * *mean;
    *scale = 1.0 / sqrt((variance > 0 ? variance : 0) + 1e-6);
}

/** Whether any loss ran: a step where none did changes nothing. */
UFORM_HOST_DEVICE static inline int uform_terms_ran(uform_terms_t terms) {
    int media = 0;
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) media |= terms.media_ran[kind];
    return terms.masked_ran || terms.contrastive_ran || terms.choices_ran || terms.late_ran || media;
}

/** The step's total loss, as the core reports it: the weighted sum of the losses that ran. */
UFORM_HOST_DEVICE static inline double uform_total_loss(double const* scalars, uform_terms_t terms) {
    double total = 0;
    if (terms.masked_ran) total += (double)terms.text_weight * scalars[uform_scalar_masked_loss_k];
    if (terms.contrastive_ran) total += scalars[uform_scalar_contrastive_loss_k];
    if (terms.choices_ran) total += (double)terms.choices_weight * scalars[uform_scalar_choices_loss_k];
    if (terms.late_ran) total += (double)terms.late_weight * scalars[uform_scalar_late_interaction_loss_k];
    for (int kind = 0; kind != uform_media_kinds_k; ++kind)
        if (terms.media_ran[kind]) total += (double)terms.media_weight[kind] * scalars[uform_scalar_media_loss_k + kind];
    return total;
}

/** Whether an update must be skipped: the float total loss and the float norm must both be finite. */
UFORM_HOST_DEVICE static inline int uform_update_poisoned(double const* scalars, uform_terms_t terms) {
    float loss = (float)uform_total_loss(scalars, terms);
    float norm = (float)sqrt(scalars[uform_scalar_norm_squared_k]);
    return !isfinite(loss) || !isfinite(norm);
}

/**
 *  The coordinate rotary pair `pair` of a head turns with, and in `*frequency` the pair whose text
 *  frequency it turns at. A text token's pair i turns with its position at 10000^(-2i/64). An image
 *  patch's even pairs turn with its row and its odd pairs with its column, pairs 2k and 2k + 1 both
 *  at text's frequency of pair 2k. A video tubelet's pairs 3k, 3k + 1 and 3k + 2 turn with its
 *  time, row and column at text's frequency of pair 3k. Each axis gets an even share of the
 *  frequencies, spread over the same span of scales.
 */
UFORM_HOST_DEVICE static inline uint32_t uform_rope_coordinate(uint32_t position, int pair, int* frequency) {
    if (!(position & UFORM_POSITION_GRID)) return *frequency = pair, position;
    if (!(position & UFORM_POSITION_VOLUME)) {
        *frequency = pair & ~1;
        return pair & 1 ? position & 0x7FFF : (position >> 15) & 0x7FFF;
    }
    int axis = pair % 3;
    *frequency = pair - axis;
    return axis == 0 ? (position >> 18) & 0xFFF : (position >> (18 - 9 * axis)) & 0x1FF;
}

/** Whether a contrastive row with these attract and repel weight sums takes part in the mean. */
UFORM_HOST_DEVICE static inline int uform_row_counts(uform_pair_loss_form_t form, double attract, double repel) {
    if (form == uform_pair_loss_ranked_k) return attract > 0 && repel > 0;
    if (form == uform_pair_loss_balanced_k) return attract > 0 || repel > 0;
    return attract + repel > 0;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Lifetime and memory                                                                            */
/* ---------------------------------------------------------------------------------------------- */

/** Opens a device: `ordinal` is a GPU's ordinal, or for the CPU the threads a verb uses. */
typedef uform_status_t (*uform_device_open_t)(uint32_t ordinal, void** device);
typedef void (*uform_device_close_t)(void* device);
/** Makes a replica's context on an open device, with every scratch buffer `plan` asks for. */
typedef uform_status_t (*uform_context_create_t)(void* device, uform_plan_t const* plan, void** context);
typedef void (*uform_context_destroy_t)(void* context);
/** Waits for every operation queued on the context; reports an asynchronous failure. */
typedef uform_status_t (*uform_synchronize_t)(void* context);
/** Floats of attention statistics one block keeps for its backward pass, at the plan's capacities. */
typedef size_t (*uform_statistics_floats_t)(uform_plan_t const* plan);

/** Device memory, zeroed. */
typedef uform_status_t (*uform_allocate_t)(void* context, size_t bytes, void** pointer);
typedef void (*uform_release_t)(void* context, void* pointer);
/** Host memory the device copies from fastest (pinned on a GPU). */
typedef uform_status_t (*uform_host_allocate_t)(void* context, size_t bytes, void** pointer);
typedef void (*uform_host_release_t)(void* context, void* pointer);
/** Copies between host and device. An upload may run after it returns: keep the source unchanged
 *  until the next `synchronize`. A download has landed when it returns. */
typedef uform_status_t (*uform_transfer_t)(void* context, void* destination, void const* source, size_t bytes);
/** Fences let the host queue the next step's work before the last one lands (`uform_trainer_step_begin`). A
 *  fence marks the queue's end as it is now, in one of `uform_fences_k` slots (a slot set again moves on);
 *  waiting on it returns once everything queued before it has run, reporting an asynchronous failure as
 *  `synchronize` does. `fetch` is a download that has landed once a fence set after it is waited on. Backends
 *  that run each operation before returning (the CPU) leave all three NULL: nothing of theirs is ever in flight. */
enum { uform_fences_k = 4 };
typedef uform_status_t (*uform_fence_t)(void* context, unsigned slot);
typedef uform_status_t (*uform_zero_t)(void* context, void* destination, size_t bytes);
/** float32 (count) to activations (count): the compute copy of freshly loaded weights. */
typedef uform_status_t (*uform_convert_t)(void* context, void* activations, float const* source, size_t count);

/* ---------------------------------------------------------------------------------------------- */
/*  Operations: shapes are named where used: `tokens` rows of the packed stream, `hidden` wide.   */
/*  Backward operations accumulate (+=) into parameter gradients and into `d_x` unless they say   */
/*  they write.                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

/**
 *  d (m, n) = a (m, k) x b (k, n) [+ c], a stored (k, m) when `a_transposed`, b stored (n, k)
 *  when `b_transposed`. `a` and `b` are activations; `c` and `d` are of `d_element` (float32 for
 *  weight gradients, activations otherwise). `c` may be NULL, equal `d` (accumulate) or be
 *  another buffer (a residual added on the way).
 */
typedef uform_status_t (*uform_matmul_t)(void* context, void* d, void const* c, void const* a, void const* b,
                                         size_t m, size_t n, size_t k, int a_transposed, int b_transposed,
                                         uform_element_t d_element);
/** Optional fusion: up (m, n) = a x b^T and activated = gelu(up), both activations. */
typedef uform_status_t (*uform_matmul_gelu_t)(void* context, void* activated, void* up, void const* a, void const* b,
                                              size_t m, size_t n, size_t k);
/** Optional fusion: d_up (m, n) = (a x b) * gelu'(up), written; a (m, k) and b (k, n) untransposed. */
typedef uform_status_t (*uform_matmul_gelu_backward_t)(void* context, void* d_up, void const* up, void const* a,
                                                       void const* b, size_t m, size_t n, size_t k);

/** out (tokens, hidden) = table (vocabulary, hidden) [ids]; the table is the compute copy. */
typedef uform_status_t (*uform_embedding_forward_t)(void* context, void* out, void const* table, uint32_t const* ids,
                                                    size_t tokens, size_t hidden);
/**
 *  d_table (vocabulary, hidden) += rows of d_out by id. `order` (tokens) lists the tokens sorted
 *  by id, stably, and `order_offsets` (vocabulary + 1) where each id's run starts: each row of
 *  the table sums its tokens in one fixed order.
 */
typedef uform_status_t (*uform_embedding_backward_t)(void* context, float* d_table, void const* d_out,
                                                     uint32_t const* order, uint32_t const* order_offsets,
                                                     size_t tokens, size_t hidden, size_t vocabulary);
/** out = x / rms(x) * gain; rstd (tokens) keeps 1 / rms(x). `gain` is float32. */
typedef uform_status_t (*uform_rmsnorm_forward_t)(void* context, void* out, float* rstd, void const* x,
                                                  float const* gain, size_t tokens, size_t hidden);
typedef uform_status_t (*uform_rmsnorm_backward_t)(void* context, void* d_x, float* d_gain, void const* d_out,
                                                   void const* x, float const* gain, float const* rstd,
                                                   size_t tokens, size_t hidden);
/** Rotates the query and key thirds of qkv (tokens, 3 hidden) in place by each token's position;
 *  the backward pass applies the inverse rotation to their gradients (attention's backward pass
 *  does it for the model). */
typedef uform_status_t (*uform_rope_t)(void* context, void* qkv, uint32_t const* positions, size_t tokens,
                                       size_t hidden);
/** out (tokens, hidden) = softmax(q k^T / 8) v within each item; `statistics` is the backend's own. */
typedef uform_status_t (*uform_attention_forward_t)(void* context, void* out, float* statistics, void const* qkv,
                                                    uform_items_t const* items, size_t tokens, size_t hidden);
/** d_qkv (tokens, 3 hidden) is written, not accumulated. Given the `positions` that turned qkv's
 *  queries and keys (`uform_rope_t`), it is the gradient of qkv before that turn: the inverse turn
 *  fused into the write where the backend can, so no pass of its own reads and writes d_qkv again.
 *  `same_positions`: 1 when they are the positions of this context's last call, so that what the
 *  backend derived from them then (the Hopper kernels' table of cosines and sines) still holds. */
typedef uform_status_t (*uform_attention_backward_t)(void* context, void* d_qkv, void const* d_out, void const* out,
                                                     float const* statistics, void const* qkv,
                                                     uint32_t const* positions, int same_positions,
                                                     uform_items_t const* items, size_t tokens, size_t hidden);
/** Tanh-approximated GELU, element-wise; the backward pass writes d_in, which may alias d_out. */
typedef uform_status_t (*uform_gelu_forward_t)(void* context, void* out, void const* in, size_t count);
typedef uform_status_t (*uform_gelu_backward_t)(void* context, void* d_in, void const* d_out, void const* in,
                                                size_t count);
/** out[i] = in[rows[i]]; the adjoint d_in[rows[i]] += d_out[i] (rows distinct). Activations. */
typedef uform_status_t (*uform_gather_rows_t)(void* context, void* out, void const* in, uint32_t const* rows,
                                              size_t count, size_t width);
typedef uform_status_t (*uform_scatter_rows_t)(void* context, void* d_in, void const* d_out, uint32_t const* rows,
                                               size_t count, size_t width);
/**
 *  Mean cross-entropy of logits (count, classes) against targets into `*loss` (a device scalar,
 *  written; NaN for count 0), and d_logits = scale (softmax - one-hot) / count, written. Logits
 *  and their gradient are activations; the arithmetic is float32.
 */
typedef uform_status_t (*uform_cross_entropy_t)(void* context, double* loss, void* d_logits, void const* logits,
                                                uint32_t const* targets, size_t count, size_t classes, float scale);
/**
 *  The choices term over `count` rows of byte logits (count, 256), activations: row i offers the
 *  bytes choices[offsets[i] .. offsets[i + 1]) (distinct) and softmax runs over those only, q.
 *  Writes, each when not NULL: `probabilities` (float32, as `choices`), q; with `targets`
 *  (float32, as `choices`), the mean over rows of -sum t log q into `*loss` (a device scalar; NaN
 *  for count 0) and d_logits (count, 256) = scale (q sum(t) - t) / count at the offered bytes, zero
 *  elsewhere, written.
 */
typedef uform_status_t (*uform_choices_op_t)(void* context, double* loss, void* d_logits, float* probabilities,
                                             void const* logits, uint32_t const* offsets, uint8_t const* choices,
                                             float const* targets, size_t count, float scale);
/**
 *  Masked reconstruction: the mean over `count` rows x `width` of (predictions - targets)^2 into
 *  `*loss` (a device scalar, written; NaN for count 0), and d_predictions = scale 2 (predictions -
 *  targets) / (count width), written. Predictions and their gradient are activations, targets
 *  float32; the rows' sums are added in double, in a fixed order.
 */
typedef uform_status_t (*uform_patch_loss_t)(void* context, double* loss, void* d_predictions, void const* predictions,
                                             float const* targets, size_t count, size_t width, float scale);
/** out (rows, width) float32 = each row of `in` (activations) over its norm; a zero row stays zero. */
typedef uform_status_t (*uform_normalize_rows_t)(void* context, float* out, void const* in, size_t rows, size_t width);
/** d_in (rows, width; activations, written) = (d_out - out <out, d_out>) / |in| per row, the adjoint of the above. */
typedef uform_status_t (*uform_normalize_rows_backward_t)(void* context, void* d_in, float const* d_out,
                                                          float const* out, void const* in, size_t rows, size_t width);

/** A run of rows: an item's token vectors. */
typedef struct uform_span_t {
    uint32_t start, length;
} uform_span_t;

/** The late-interaction term's inputs beside the token vectors: who scores whom, and how. */
typedef struct uform_late_interaction_setup_t {
    uform_span_t const* spans;     /* (spans) each scored item's rows of `vectors` */
    uint32_t const* queries;       /* (count) the span of each query row */
    uint32_t const* offsets;       /* (count + 1) each query row's run of the arrays below */
    uint32_t const* documents;     /* the span of each document a query names */
    uint8_t const* cells;          /* uform_cell_t of each: attract or repel */
    float const* weights;          /* the weight of each */
    size_t count;                  /* query rows */
    size_t pairs;                  /* entries of documents, cells and weights */
    uform_pair_loss_form_t form;   /* never `derived`: the core resolves it */
} uform_late_interaction_setup_t;

/**
 *  The late-interaction term, SPEC section 5, over `vectors` (rows, width) of float32 unit token
 *  vectors. S(q, d) = the sum over q's rows of the largest <q_t, d_u> over d's rows (the first
 *  largest when several tie), s = exp(log_inverse_temperature) S + bias, and each query row's
 *  pair loss over the documents it names (counting rows as `uform_row_counts` says). Writes the
 *  mean over counted rows into `*loss` (NaN when none counts) and d_vectors (rows, width) =
 *  scale dL/dvectors, and adds scale dL/d into the temperature's and bias's gradients.
 */
typedef uform_status_t (*uform_late_interaction_op_t)(void* context, double* loss, float* d_vectors,
                                                      float* d_log_inverse_temperature, float* d_bias,
                                                      float const* vectors, size_t rows, size_t width,
                                                      float const* log_inverse_temperature, float const* bias,
                                                      uform_late_interaction_setup_t const* setup, float scale);
/** pooled (items, hidden), float32, = mean of each item's rows of states (activations). */
typedef uform_status_t (*uform_pool_forward_t)(void* context, float* pooled, void const* states,
                                               uform_items_t const* items, size_t hidden);
/** d_states (tokens, hidden) += d_pooled / length over each item's rows. */
typedef uform_status_t (*uform_pool_backward_t)(void* context, void* d_states, float const* d_pooled,
                                                uform_items_t const* items, size_t hidden);
/**
 *  The contrastive loss over pooled (items, hidden) embeddings, SPEC section 5: cells (items x
 *  items) say how each cell counts and weights weigh it. Writes the unit-norm embeddings and the
 *  loss into `*loss` (NaN when no row counted), and accumulates d_pooled, d_log_inverse_temperature
 *  and d_bias scaled by `scale`. All float32 in memory, double inside.
 */
typedef uform_status_t (*uform_contrastive_loss_t)(void* context, double* loss, float* d_pooled,
                                              float* d_log_inverse_temperature, float* d_bias, float* normalized,
                                              float const* pooled, float const* log_inverse_temperature,
                                              float const* bias, uint8_t const* cells, float const* weights,
                                              uint32_t const* groups, size_t items, size_t hidden,
                                              uform_contrastive_setup_t const* setup, float scale);
/** `*sum` (written) = the sum of squares of x (count, float32), in double, in one fixed order. */
typedef uform_status_t (*uform_sum_squares_t)(void* context, double* sum, float const* x, size_t count);
/** AdamW over the plan's layout with clipping, unless `uform_update_poisoned` says skip. */
typedef uform_status_t (*uform_adamw_t)(void* context, uform_update_t const* update);

/** A backend: its name, its precision and its table of operations. Optional slots may be NULL. */
typedef struct uform_backend_t {
    char const* name;
    uform_element_t activations;

    uform_device_open_t device_open;
    uform_device_close_t device_close;
    uform_context_create_t context_create;
    uform_context_destroy_t context_destroy;
    uform_synchronize_t synchronize;
    uform_statistics_floats_t statistics_floats;
    uform_allocate_t allocate;
    uform_release_t release;
    uform_host_allocate_t host_allocate;
    uform_host_release_t host_release;
    uform_transfer_t upload, download, copy; /* host to device, device to host, device to device */
    uform_fence_t fence, fence_wait;         /* optional, with `fetch` */
    uform_transfer_t fetch;
    uform_zero_t zero;
    uform_convert_t convert; /* NULL when activations are float32 */

    uform_matmul_t matmul;
    uform_matmul_gelu_t matmul_gelu;                   /* optional */
    uform_matmul_gelu_backward_t matmul_gelu_backward; /* optional */
    uform_embedding_forward_t embedding_forward;
    uform_embedding_backward_t embedding_backward;
    uform_rmsnorm_forward_t rmsnorm_forward;
    uform_rmsnorm_backward_t rmsnorm_backward;
    uform_rope_t rope_forward, rope_backward;
    uform_attention_forward_t attention_forward;
    uform_attention_backward_t attention_backward;
    uform_gelu_forward_t gelu_forward;
    uform_gelu_backward_t gelu_backward;
    uform_gather_rows_t gather_rows;
    uform_scatter_rows_t scatter_rows;
    uform_cross_entropy_t cross_entropy;
    uform_choices_op_t choices;
    uform_pool_forward_t pool_forward;
    uform_pool_backward_t pool_backward;
    uform_contrastive_loss_t contrastive;
    uform_normalize_rows_t normalize_rows;
    uform_normalize_rows_backward_t normalize_rows_backward;
    uform_late_interaction_op_t late_interaction;
    uform_patch_loss_t patch_loss;
    uform_sum_squares_t sum_squares;
    uform_adamw_t adamw;
} uform_backend_t;

/** The CPU reference backend, always built in. */
extern uform_backend_t const uform_ram_backend;

/** A backend by name ("ram" or "vram", loading the latter), for the operation tests; NULL with the
 *  message set when the build or the machine lacks it. */
UFORM_API uform_backend_t const* uform_testing_backend(char const* name);

/** The CUDA backend's entry point, looked up in `libuform_vram.so` when a VRAM executor is asked for:
 *  it keeps `fail` to format its messages and answers its table, or NULL when no GPU answers. */
typedef uform_backend_t const* (*uform_vram_backend_load_t)(uform_fail_t fail);
#define UFORM_VRAM_BACKEND_LOAD "uform_vram_backend_load"

#ifdef __cplusplus
}
#endif

#endif /* UFORM_BACKEND_H_ */
