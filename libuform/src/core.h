/**
 *  @file   core.h
 *  @brief  The shared core's own types: executors, meshes, trainers, the derived config,
 *          packed batches, and the verbs' building blocks. Backends never see these.
 */
#ifndef UFORM_CORE_H_
#define UFORM_CORE_H_

#include <pthread.h>
#include <stdbool.h>

#include "backend.h"
#include "media/media.h"

/** A float as a message prints it with `%g`: NaN unsigned, since C libraries print a NaN whose sign bit is set
 *  (the one `0.0 / 0.0` makes) as `-nan`, a sign that means nothing. */
static inline double uform_printed(double value) { return isnan(value) ? (double)NAN : value; }

/* ---------------------------------------------------------------------------------------------- */
/*  Handles                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

typedef enum uform_handle_kind_t {
    uform_handle_executor_k = 1,
    uform_handle_mesh_k = 2,
    uform_handle_trainer_k = 3,
    uform_handle_encoder_k = 4,
    uform_handle_decoded_k = 5,
} uform_handle_kind_t;

/** Every object behind a handle starts with this; the table of live handles sets and guards it. */
typedef struct uform_handle_t {
    uform_handle_kind_t kind;
    size_t borrowers; /* trainers borrowing this executor or mesh, or calls running on this trainer or encoder */
} uform_handle_t;

/** Adds `object` to the table of live handles and answers the handle callers will know it by: a token
 *  never issued before, not the object's address, so a freed handle stays refused after its memory is reused. */
uform_status_t uform_handles_add(void* object, uform_handle_kind_t kind, void** handle, char const** error);
/** Checks a handle is live and of `kind`; `what` names it in the message. Says nothing of its object,
 *  which another thread may free right after: take it with `uform_handles_acquire` to use it. */
uform_status_t uform_handles_check(void const* handle, uform_handle_kind_t kind, char const* what,
                                   char const** error);
/** Removes a handle and answers its object, unless something borrows it; NULL, freed or foreign handles are refused. */
uform_status_t uform_handles_remove(void* handle, uform_handle_kind_t kind, char const* what, void** object,
                                    char const** error);
/** Checks a handle like `uform_handles_check` and, when live, answers its object and counts one more borrower
 *  of it, so it cannot be freed until `uform_handles_release(object)`: a trainer holds its executor and mesh
 *  this way for its life, and verbs hold their trainer or encoder for their call. */
uform_status_t uform_handles_acquire(void* handle, uform_handle_kind_t kind, char const* what, void** object,
                                     char const** error);
/** Drops one borrower of an object taken with `uform_handles_acquire`; NULL is ignored. */
void uform_handles_release(void* object);

/** The head of a trainer or an encoder: its handle, and the lock that runs its verbs one at a time. */
typedef struct uform_serial_t {
    uform_handle_t handle;
    pthread_mutex_t lock;
} uform_serial_t;

/** Takes a trainer or an encoder (an object headed by `uform_serial_t`) for one verb: acquired like
 *  `uform_handles_acquire`, so it cannot be freed meanwhile, then locked, so its verbs never interleave. */
uform_status_t uform_handles_enter(void* handle, uform_handle_kind_t kind, char const* what, void** object,
                                   char const** error);
/** Unlocks and releases an object taken with `uform_handles_enter`. */
void uform_handles_leave(void* object);

typedef struct uform_executor_s {
    uform_handle_t handle;
    uform_backend_t const* backend;
    void* device; /* the backend's open device: replicas make their contexts on it */
    uint32_t devices; /* devices a trainer spreads its steps over: more than one only as the RAM simulation */
} uform_executor_s;

/**
 *  What carries a mesh's collectives between its processes: sockets between RAM executors' processes (`mesh.c`); a
 *  GPU mesh would put NCCL's collectives behind the same calls. Each call is collective: every process makes it, in
 *  the same order. A failed call may leave a stream midway through a message, so the mesh breaks for good.
 */
typedef struct uform_transport_t {
    /** Every process's `bytes` bytes, in host-domain order, into `*gathered` (malloc'd, freed by the caller), and
     *  each process's size into `sizes` (one per process). */
    uform_status_t (*all_gather)(void* link, void const* mine, size_t bytes, uint8_t** gathered, size_t* sizes,
                                 char const** error);
    /** Host domain 0's `bytes` bytes into every process's `data`. */
    uform_status_t (*broadcast)(void* link, void* data, size_t bytes, char const** error);
    /** The sum of every process's `parts` (`length` floats each) into every process's `sum`: in host-domain order, then
     *  in each process's order of parts, the first copied and each other added, as one process sums its devices.
     *  `scratch` holds `length` floats. */
    uform_status_t (*sum)(void* link, float* sum, float* scratch, float const* const* parts, size_t parts_count,
                          size_t length, char const** error);
    void (*close)(void* link);
} uform_transport_t;

typedef struct uform_mesh_s {
    uform_handle_t handle;
    uform_executor_s* executor; /* borrowed until the mesh is freed */
    uint32_t host_domain_index, host_domain_count;
    uform_transport_t const* transport; /* NULL for a mesh of one process */
    void* link;                         /* the transport's own state; NULL once broken */
    bool broken;                        /* a collective failed: the processes are out of step for good */
    uint32_t trainers;                  /* trainers made on it so far: each step names its own */
    pthread_mutex_t lock;               /* one collective at a time, whichever trainer calls it */
} uform_mesh_s;

/** The transport's collectives on a mesh of several processes, one at a time; a failure breaks the mesh, and tells
 *  the peers at once by hanging up on them. Refused with `uform_status_peer_k` once the mesh is broken. */
uform_status_t uform_mesh_all_gather(uform_mesh_s* mesh, void const* mine, size_t bytes, uint8_t** gathered,
                                     size_t* sizes, char const** error);
uform_status_t uform_mesh_broadcast(uform_mesh_s* mesh, void* data, size_t bytes, char const** error);
uform_status_t uform_mesh_sum(uform_mesh_s* mesh, float* sum, float* scratch, float const* const* parts,
                              size_t parts_count, size_t length, char const** error);
/** Takes this process's part in the collective its peers are in with a failed `status` and `reason`, as the verbs'
 *  first exchanges carry one, so that every process fails that verb alike and the mesh stays in step. */
uform_status_t uform_mesh_refused(uform_mesh_s* mesh, uform_status_t status, char const* reason, char const** error);
/** Breaks the mesh: a process that fails between collectives hangs up, so its peers fail rather than wait. */
void uform_mesh_break(uform_mesh_s* mesh);
/** Breaks the mesh and fails naming `peer`, found in another exchange (`theirs`) while this process `doing`. */
uform_status_t uform_mesh_out_of_step(uform_mesh_s* mesh, uint32_t peer, char const* theirs, char const* doing,
                                      char const** error);

/** The CUDA backend, loaded from `libuform_vram.so` beside this library on first use; NULL with the
 *  message set when the build has none or no GPU answers. */
uform_backend_t const* uform_vram_backend(void);

/* ---------------------------------------------------------------------------------------------- */
/*  Config                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/** The config with every default derived and every field checked, plus owned copies of its arrays. */
typedef struct uform_config_t {
    uform_trainer_init_vram_t given; /* with derived values filled in; pointers below are owned */
    uint32_t matryoshka[UFORM_MAX_MATRYOSHKA_DIMENSIONS];
    char resume[4096];
    float beta1, beta2, epsilon, weight_decay, clip_norm; /* AdamW, fixed and documented */
} uform_config_t;

/** The longest row a run may train with: an encoder packs at most this many tokens a pass, so a longer row
 *  would train a model no encoder could load. */
enum { uform_longest_row_k = 16384 };

uform_status_t uform_config_derive(uform_config_t* config, uform_trainer_init_vram_t const* given,
                                   char const** error);
/** Derives and checks a batch shape alone, as `uform_config_derive` does, naming its fields from `path`. */
uform_status_t uform_batch_shape_derive(uform_batch_shape_t* batch, char const* path, char const** error);
/** Writes the config as JSON into `out` (NUL-terminated), for the checkpoint's metadata. */
size_t uform_config_to_json(uform_config_t const* config, char* out, size_t capacity);
/** The learning rate the update to step `step` (counted from 1) uses. */
float uform_schedule_rate(uform_schedule_t const* schedule, uint64_t step);

/* ---------------------------------------------------------------------------------------------- */
/*  Packed batches                                                                                 */
/* ---------------------------------------------------------------------------------------------- */

/**
 *  One device's share of a step, packed on the host as the device will read it: the token
 *  stream, each token's position inside its item, the segments, the masked positions and their
 *  targets, the tokens ordered by id, and the contrastive cells. Sized for the geometry's
 *  capacity once, in host memory the backend copies from fastest, reused every step.
 */
typedef struct uform_packed_t {
    size_t tokens_count, segments_count, rows_count, masked_count, truncated, longest;
    size_t contrastive_rows; /* anchor rows with at least one counted cell under the pair-loss form */
    uint32_t* ids;       /* (capacity tokens) the ids the model reads, after corruption */
    uint32_t* positions; /* (capacity tokens) each token's position within its item */
    uint32_t* masked;    /* (capacity tokens) indices of the positions the masked term scores */
    uint32_t* targets;   /* (capacity tokens) the original bytes at those positions */
    uint32_t* order;     /* (capacity tokens) tokens sorted by the id the model reads, stably */
    uint32_t* order_offsets; /* (vocabulary + 1) where each id's run starts in `order` */
    uform_segment_t* segments; /* (capacity segments) */
    uint32_t* groups;    /* (capacity segments) temperature group of each item */
    uint8_t* cells;      /* (segments x segments) uform_cell_t of each contrastive cell */
    float* weights;      /* (segments x segments) weight of each cell */
    uint32_t* row_fill;  /* (capacity rows) positions used in each row while packing */
    uint64_t* offsets;   /* (capacity segments + 1) the contents' offsets, read once and checked */
    /* Choices: the items that offer some, in item order, each with a choice position after its content. */
    size_t choices_count;        /* items offering choices; their positions follow the masked ones in `masked` */
    uint64_t* choice_snapshot;   /* (capacity segments + 1) the choices tape's offsets, read once */
    uint64_t* target_snapshot;   /* (capacity segments + 1) the targets tape's offsets, read once */
    uint32_t* choice_offsets;    /* (capacity segments + 1) where each offering item's bytes and targets start */
    uint8_t* choice_bytes;       /* (capacity segments x max choices) the offered bytes, item after item */
    float* choice_targets;       /* (capacity segments x max choices) their target probabilities */
    uint32_t* content_lengths;   /* (capacity segments) each item's content after cutting: what masking reads */
    /* Late interaction: the rows of query-side and document-side items, and who scores whom. */
    size_t late_rows_count, late_spans_count, late_queries_count, late_pairs_count;
    size_t late_rows_counted;    /* query rows that count under the pair-loss form */
    uint32_t* late_rows;         /* (capacity tokens) the token of each scored row, item after item */
    uform_span_t* late_spans;    /* (capacity segments) each scored item's run of late_rows */
    uint32_t* late_item_span;    /* (capacity segments) each item's span, or UINT32_MAX */
    uint32_t* late_queries;      /* (capacity segments) the span of each query row */
    uint32_t* late_offsets;      /* (capacity segments + 1) each query row's run of the three below */
    uint32_t* late_documents;    /* (capacity edges) the span of each document a query names */
    float* late_weights;         /* (capacity edges) */
    uint8_t* late_cells;         /* (capacity edges) attract or repel */
    uint8_t* sides;              /* (capacity segments) each item's side, read once; none without late interaction */
    /* Media tokens (patches, tubelets, chunks), as the device reads them: the shown ones of each kind, in kind
       order, from the front of `media_values` and `media_rows`, the hidden ones (the targets, which the patch loss
       normalizes) from the back, so each kind's shown and hidden tokens are contiguous runs. */
    size_t media_shown[uform_media_kinds_k], media_hidden[uform_media_kinds_k]; /* tokens of each kind */
    size_t widths[uform_media_kinds_k], widest; /* floats in a token of each kind, and the most */
    size_t tokens_capacity;      /* rows x columns: where the back of `media_rows` ends */
    float* media_values;         /* (capacity tokens x widest) */
    uint32_t* media_rows;        /* (capacity tokens) the token of each */
    void* memory;        /* the one host allocation behind the arrays above */
    uform_backend_t const* backend;
    void* context;
} uform_packed_t;

/** Where kind `kind`'s runs start, in tokens (`rows`) and floats (`values`), of arrays holding `capacity` tokens
 *  of `widest` floats: shown ones from the front, hidden ones from the back. */
typedef struct uform_media_runs_t {
    size_t shown_rows, shown_values, hidden_rows, hidden_values;
} uform_media_runs_t;
uform_media_runs_t uform_media_runs(uform_packed_t const* packed, int kind);

/**
 *  A batch's media decoded into tokens, as a config shapes them: each media item's grid and its tokens (`grid`
 *  many, each of its kind's width, in token order), nothing for text. Made before the packing, by the step on
 *  its own or ahead of it by `uform_trainer_decode`; read-only once made, so steps may share it.
 */
typedef struct uform_decoded_s {
    uform_handle_t handle;
    void const* owner;             /* the trainer whose config shaped the tokens, when made ahead */
    size_t count;
    uint8_t const* data;           /* the contents' bytes, and their offsets as read: a step must bring the same */
    uint64_t* offsets;             /* (count + 1) */
    uform_modality_t* modalities;  /* (count) */
    uform_media_grid_t* grids;     /* (count) */
    float** values;                /* (count) each media item's tokens; NULL for text */
} uform_decoded_s;

/** Decodes the media among `count` items on every core, from contents whose offsets were checked into
 *  `offsets`; messages name an item `name[first + i]`, as the caller knows it (`batch.contents`, `contents`).
 *  Answers NULL in `decoded` when no item is media. */
uform_status_t uform_decoded_make(uform_config_t const* config, size_t count, uform_modality_t const* modalities,
                                  uform_tape_t const* contents, uint64_t const* offsets, size_t first,
                                  char const* name, uform_decoded_s** decoded, char const** error);
/** Frees what `uform_decoded_make` made; NULL is ignored. */
void uform_decoded_release(uform_decoded_s* decoded);

uform_status_t uform_packed_init(uform_packed_t* packed, uform_config_t const* config, uform_backend_t const* backend,
                                 void* context, char const** error);
void uform_packed_free(uform_packed_t* packed);

/**
 *  Checks every field of a step's inputs against the config, then packs it for the update to
 *  step `step_number` (counted from 1): truncation, rows, masking draws, contrastive cells.
 *  Every value the packing trusts is read from the caller's memory once, so memory changed
 *  meanwhile cannot steer it outside a buffer. Writes only `packed`, which is scratch: a refused
 *  batch leaves the run as it was. Draws are keyed on `first_key` + the item's index, its index
 *  within the whole step of every process, so they do not depend on how a step is split over devices
 *  or processes; messages name items by `first_item` + the index, within this process's step. `decoded`,
 *  when not NULL, holds the step's media decoded ahead: the items must be the ones it was made from.
 */
uform_status_t uform_batch_pack(uform_packed_t* packed, uform_config_t const* config,
                                uform_trainer_step_t const* step, uform_decoded_s const* decoded,
                                uint64_t step_number, size_t first_item, size_t first_key, char const** error);
/** Checks a step's relations alone (ids, order, weights, one relation per pair), their count against no capacity. */
uform_status_t uform_batch_check_relations(uform_trainer_step_t const* step, char const** error);
/** Fills `packed`'s contrastive cells, their weights and `contrastive_rows` over every item of a step whose relations
 *  were checked. */
void uform_batch_cells(uform_packed_t* packed, uform_config_t const* config, uform_trainer_step_t const* step);
/** Lists each query's documents, as `packed`'s late-interaction lists, from its `sides` and `late_item_span` over
 *  every item of a step whose relations were checked. */
void uform_batch_late_pairs(uform_packed_t* packed, uform_config_t const* config, uform_trainer_step_t const* step);
/** Checks a step's item count, modalities and contents alone, the offsets read once into `offsets` (count + 1). */
uform_status_t uform_batch_check_items(uform_config_t const* config, uform_trainer_step_t const* step,
                                      uint64_t* offsets, char const** error);
/** Packs texts with the bytes each may choose, as `uform_encoder_choose` reads them; messages count items from
 *  `first_item`. */
uform_status_t uform_batch_pack_choose(uform_packed_t* packed, uform_config_t const* config,
                                       uform_modality_t const* modalities, uform_tape_t const* texts,
                                       uform_tape_t const* choices, size_t first_item, char const** error);
/** Checks a tape of `count` entries named `name`: its offsets never fall, end within its size, and point into data
 *  where there is any. Each offset is read once, into `snapshot` (count + 1) where not NULL, which a packing then
 *  reads instead; messages count offsets from `first`, where the caller's tape starts this one. */
uform_status_t uform_tape_check(uform_tape_t const* tape, size_t count, char const* name, size_t first,
                                uint64_t* snapshot, char const** error);
/** Packs the items of a tape, without masking, as inference reads them; messages count items from `first_item`.
 *  `decoded`, when not NULL, holds their media decoded ahead. */
uform_status_t uform_batch_pack_plain(uform_packed_t* packed, uform_config_t const* config,
                                      uform_modality_t const* modalities, uform_tape_t const* contents,
                                      uform_late_interaction_side_t const* sides, uform_decoded_s const* decoded,
                                      size_t first_item, char const** error);

/* ---------------------------------------------------------------------------------------------- */
/*  The model on one device                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/** Activations of one block, each sized for the device's token capacity; `void*` ones hold activations. */
typedef struct uform_block_activations_t {
    void* input;       /* (tokens, hidden) the residual stream entering the block */
    float* rstd1;      /* (tokens) */
    void* normed1;     /* (tokens, hidden) */
    void* qkv;         /* (tokens, 3 hidden) queries and keys after rotation */
    void* attended;    /* (tokens, hidden) */
    float* statistics; /* the backend's attention statistics */
    void* middle;      /* (tokens, hidden) the residual stream after attention */
    float* rstd2;      /* (tokens) */
    void* normed2;     /* (tokens, hidden) */
    void* up;          /* (tokens, 4 hidden) before GELU */
    void* activated;   /* (tokens, 4 hidden) after GELU */
} uform_block_activations_t;

/* Steps a trainer holds begun and not ended, at most (`uform_trainer_step_begin`). */
enum { uform_flights_k = 2 };

/**
 *  One replica: weights, gradients, moments and activations in one backend's memory. A replica for inference
 *  takes only what the forward pass and pooling read: the weights (and their compute copy), one block's
 *  activations that every block reuses, the final states, the pooled means and the uploaded items; the
 *  other buffers stay NULL.
 */
typedef struct uform_replica_t {
    uform_backend_t const* backend;
    void* context;
    size_t capacity_tokens, capacity_segments;
    uint32_t depth;
    uint32_t late_width; /* the token vectors' width; 0 without late interaction */
    float *weights, *gradients, *first, *second; /* (layout.total) float32 each */
    void* compute;  /* (layout.total) the weights as matrix products read them: `weights` itself on float32 backends */
    uform_block_activations_t* blocks; /* (depth) */
    void* output;      /* (tokens, hidden) residual stream after the last block */
    float* final_rstd; /* (tokens) */
    void* final;       /* (tokens, hidden) final-norm states: every head reads these */
    void* d_final;     /* (tokens, hidden) */
    void* d_stream;    /* (tokens, hidden) gradient of the residual stream */
    void* d_hidden;    /* (tokens, hidden) scratch */
    void* d_qkv;       /* (tokens, 3 hidden) */
    void* d_wide;      /* (tokens, 4 hidden) */
    void* masked_states; /* (tokens, hidden) final states at masked positions, then at choice positions */
    void* logits;      /* (tokens, 256) decoder logits at those positions */
    void* d_logits;    /* (tokens, 256) */
    float* pooled;     /* (segments, hidden) */
    float* d_pooled;   /* (segments, hidden) */
    float* normalized; /* (segments, hidden) unit-norm embeddings */
    double* scalars;   /* (uform_scalars_k) the step's losses and squared norm */
    int32_t* verdicts; /* (uform_flights_k) whether each step in flight applied its update */
    float* scored;     /* (2 x groups) the inverse temperatures' logarithms and biases the step scored with */
    float* probabilities; /* (segments x max choices) each offered byte's probability */
    /* the packed batch, uploaded */
    uint32_t *ids, *positions, *masked, *targets, *groups, *order, *order_offsets;
    uform_segment_t* segments;
    uint8_t* cells;
    float* cell_weights;
    uint32_t *late_rows, *late_queries, *late_offsets, *late_documents; /* the packed lists of late interaction */
    uform_span_t* late_spans;
    uint8_t* late_cells;
    float* late_weights;
    void* late_vectors;       /* (tokens, width) the token head's outputs */
    float* late_unit;         /* (tokens, width) the same at unit length: the token vectors */
    float* d_late_unit;       /* (tokens, width) */
    void* d_late_vectors;     /* (tokens, width) */
    uint32_t* choice_offsets; /* (segments + 1) */
    uint8_t* choice_bytes;    /* (segments x max choices) */
    float* choice_targets;    /* (segments x max choices) */
    /* Media tokens, laid out as packed (`uform_packed_t.media_values`): shown from the front, hidden from the back. */
    float* media_values;      /* (tokens x widest) float32 */
    void* media_compute;      /* (tokens x widest) the shown ones as activations; `media_values` on float32 backends */
    uint32_t* media_rows;     /* (tokens) the token of each */
    void* media_predictions;  /* (tokens x widest) a decoder's outputs at one kind's hidden tokens */
    void* d_media_predictions;
    struct uform_buffer_t* buffers; /* every buffer above, as taken, so they are released alike */
    size_t buffers_count;
} uform_replica_t;

/** Makes the backend's context for the config's capacities and takes every buffer a training step needs, or
 *  with `training` 0 what `uform_model_embed` needs. */
uform_status_t uform_replica_init(uform_replica_t* replica, uform_executor_s const* executor,
                                  uform_layout_t const* layout, uform_config_t const* config, int training,
                                  char const** error);
void uform_replica_free(uform_replica_t* replica);
/** Bytes of the backend's memory the replica's buffers take: not the backend's own scratch. */
size_t uform_replica_bytes(uform_replica_t const* replica);
/** Queues the upload of `layout.total` float32 weights and refreshes the compute copy from them: keep `weights`
 *  unchanged until the backend synchronizes. */
uform_status_t uform_replica_upload_weights(uform_replica_t* replica, uform_layout_t const* layout,
                                            float const* weights);

/** What a trainer and an encoder both start from: the config derived from `given`, its layout, a replica (for
 *  training, or with `training` 0 for inference) and the packed batch's host buffers. On failure the caller
 *  still closes what was made. */
uform_status_t uform_model_open(uform_executor_s const* executor, uform_trainer_init_vram_t const* given, int training,
                                uform_config_t* config, uform_layout_t* layout, uform_replica_t* replica,
                                uform_packed_t* packed, char const** error);
void uform_model_close(uform_layout_t* layout, uform_replica_t* replica, uform_packed_t* packed);

/** Uploads a packed batch, runs the forward pass and pools each item's final states. */
uform_status_t uform_model_embed(uform_replica_t* replica, uform_layout_t const* layout, uform_packed_t const* packed);
/** Uploads a packed batch and runs the forward pass and the token head over every token: `replica->late_unit`
 *  holds the unit token vectors after the backend synchronizes. */
uform_status_t uform_model_embed_tokens(uform_replica_t* replica, uform_layout_t const* layout,
                                        uform_packed_t const* packed);
/** Uploads texts packed with their choices and runs the forward pass and the byte decoder at the choice positions:
 *  `replica->probabilities` holds each offered byte's probability after the backend synchronizes. */
uform_status_t uform_model_choose(uform_replica_t* replica, uform_layout_t const* layout, uform_packed_t const* packed);

/** Which losses a packed step runs under the config, and their weights. */
uform_terms_t uform_model_terms(uform_config_t const* config, uform_packed_t const* packed);

/** Queues a packed batch's upload; `training` adds what the losses and the backward pass read. */
uform_status_t uform_model_upload(uform_replica_t* replica, uform_packed_t const* packed, int training);

/**
 *  Queues forward, losses and backward over the uploaded batch (gradients are overwritten) and
 *  the squared norm. The scalars land after the backend synchronizes.
 */
uform_status_t uform_model_gradients(uform_replica_t* replica, uform_layout_t const* layout,
                                     uform_config_t const* config, uform_packed_t const* packed);
/** Queues the copy of the temperatures and biases the step scored with and the gradients' squared norm. */
uform_status_t uform_model_finish(uform_replica_t* replica, uform_layout_t const* layout);

/**
 *  One device's share of a step spread over several (`devices.c`), in two halves around the gathered terms. The
 *  first zeroes the gradients, runs the forward pass, the terms scored where their positions are (the decoder's and
 *  the patch decoders', weighed by `terms`, which carry the device's share of each mean) and pools; with
 *  `terms->late_ran` it leaves the token vectors in `late_unit`. The second takes the gathered terms' gradients from
 *  `d_pooled` (with `terms->contrastive_ran`) and `d_late_unit` (with `terms->late_ran`) and runs the backward pass.
 */
uform_status_t uform_model_device_forward(uform_replica_t* replica, uform_layout_t const* layout,
                                          uform_config_t const* config, uform_packed_t const* packed,
                                          uform_terms_t const* terms);
uform_status_t uform_model_device_backward(uform_replica_t* replica, uform_layout_t const* layout,
                                           uform_packed_t const* packed, uform_terms_t const* terms);

/** The contrastive term over `count` pooled embeddings (items, hidden) and their cells, run on `context`; the
 *  temperatures and biases are read from, and their gradients added into, `replica`'s. `d_pooled` is written. */
uform_status_t uform_model_contrastive_term(uform_replica_t* replica, void* context, uform_layout_t const* layout,
                                            uform_config_t const* config, double* loss, float* d_pooled,
                                            float* normalized, float const* pooled, uint8_t const* cells,
                                            float const* cell_weights, uint32_t const* groups, size_t count);
/** The late-interaction term over `rows` token vectors and the lists of `setup` (its form filled here), run on
 *  `context`, its temperature and bias `replica`'s, as above. `d_vectors` is written. */
uform_status_t uform_model_late_term(uform_replica_t* replica, void* context, uform_layout_t const* layout,
                                     uform_config_t const* config, double* loss, float* d_vectors,
                                     float const* vectors, size_t rows, uform_late_interaction_setup_t setup);

/** Lands `items` float32 embeddings (items, hidden) from the replica's `source` in the caller's `out` as `scalar`,
 *  normalizing them on the way when `normalize`: a step's scored embeddings and an encoder's alike. */
uform_status_t uform_embeddings_export(uform_replica_t const* replica, float const* source, size_t items,
                                       size_t hidden, int normalize, void* out, uform_scalar_t scalar,
                                       char const** error);

/* ---------------------------------------------------------------------------------------------- */
/*  A step spread over the simulated devices of one RAM executor (`devices.c`)                      */
/* ---------------------------------------------------------------------------------------------- */

/**
 *  The devices past the first of a trainer, and the step as the gathered terms see it. Device 0's replica and
 *  packed batch are the trainer's own; every replica holds the same weights and moments.
 */
typedef struct uform_spread_t {
    uform_backend_t const* backend;
    uint32_t devices;           /* this process's */
    uform_replica_t** replicas; /* (devices) */
    uform_packed_t** packs;     /* (devices) */
    /* On a mesh of several processes, every process's devices in host-domain order; one process alone is all. */
    uform_mesh_s* mesh;         /* NULL for one process */
    uint32_t trainer;           /* the trainer's place among the mesh's, in the order they were made */
    uint32_t processes, first_device, all_devices; /* this process's first device among all */
    uint32_t* process_devices;  /* (processes + 1) each process's first device */
    size_t first_item, items;   /* this process's items in the step */
    size_t* firsts;             /* (all devices + 1) each device's first item; a device whose run is empty idles */
    size_t* rows;               /* (all devices + 1) each device's first row of the gathered token vectors */
    size_t* sizes;              /* (processes) bytes each process sent in the last exchange */
    float* parts;               /* (devices x layout.total) a mesh's host copy of each device's gradients, or NULL */
    uform_terms_t* terms;       /* (devices) what each device scores, each mean weighed by the device's share */
    /* The step over every device, in item order: the counts of every device summed, the groups, cells and sides of
       every item, and the late-interaction lists over the gathered token vectors. */
    uform_packed_t whole;
    void* context;              /* the backend's scratch for every device's items: where the gathered terms run */
    float *pooled, *d_pooled, *normalized; /* (all devices x segments, hidden) every device's items, in item order */
    float *late_unit, *d_late_unit;        /* (all devices x tokens, width) every device's token vectors, in item order */
    float* sum;                 /* (2 x layout.total) host memory the gradients are summed in */
    double scalars[uform_scalars_k]; /* the step's losses over every device */
    void* taken[24];            /* the arrays above and `whole`'s, each taken from the backend, released alike */
    size_t taken_count;
    uform_replica_t* owned_replicas; /* (devices - 1) */
    uform_packed_t* owned_packs;     /* (devices - 1) */
} uform_spread_t;

/** Makes the devices past the first for a trainer whose `replica` and `packed` serve device 0, on an executor of
 *  `devices` simulated devices; on a `mesh` of several processes, whose devices `devices_of` counts, beside theirs. */
uform_status_t uform_spread_init(uform_spread_t** spread, uform_executor_s const* executor, uform_config_t const* config,
                                 uform_layout_t const* layout, uform_replica_t* replica, uform_packed_t* packed,
                                 uform_mesh_s* mesh, uint32_t const* devices_of, char const** error);
void uform_spread_free(uform_spread_t* spread);
/** Splits a step over the devices and packs each device's run, as `uform_batch_pack` does for one; then `whole`
 *  holds the step's counts and gathered lists, over every process's items on a mesh. Writes only scratch: a refused
 *  batch leaves the run as it was, on every process of a mesh, which all refuse it. `refused`, where not success,
 *  is the caller's own refusal (its message the thread's), which the step's exchange passes on as its own. */
uform_status_t uform_spread_pack(uform_spread_t* spread, uform_config_t const* config, uform_trainer_step_t const* step,
                                 uform_decoded_s const* decoded, uint64_t step_number, uform_status_t refused,
                                 char const** error);
/** Runs the packed step on every device, the gathered terms over all of them, and the all-reduce: every replica
 *  then holds the summed gradients, and scalars of the whole step, ready for one update. */
uform_status_t uform_spread_gradients(uform_spread_t* spread, uform_layout_t const* layout,
                                      uform_config_t const* config, char const** error);

/* ---------------------------------------------------------------------------------------------- */
/*  Checkpoints                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/** Writes weights and moments, the step, the config's JSON and the caller's `note` (NULL or empty: none) into
 *  `path`, atomically; with `first` and `second` NULL, the weights alone, marked weights-only. */
uform_status_t uform_checkpoint_save(char const* path, uform_layout_t const* layout, float const* weights,
                                     float const* first, float const* second, uint64_t step,
                                     char const* config_json, char const* note, char const** error);
/** Reads a checkpoint written for `layout` to resume it; refuses other geometries, and weights-only files, by name.
 *  With `first` and `second` NULL reads the weights alone, of either kind of file, for an encoder. */
uform_status_t uform_checkpoint_load(char const* path, uform_layout_t const* layout, float* weights, float* first,
                                     float* second, uint64_t* step, char const** error);

/** Reads the geometry a checkpoint was trained with out of its metadata. */
uform_status_t uform_checkpoint_config(char const* path, uform_trainer_init_vram_t* config, char const** error);

#endif /* UFORM_CORE_H_ */
