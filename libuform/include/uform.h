/**
 *  @file   uform.h
 *  @brief  Training multimodal transformer encoders from any language that can call C.
 *
 *  uform trains one pre-norm transformer encoder over text (UTF-8 bytes), images, video and audio
 *  (decoded inside the library), with masked, contrastive, late-interaction and choices objectives.
 *  The model, the losses and the checkpoint format are documented in `docs/model.md`.
 *
 *  @section  Handles and their lifetime
 *
 *  Four opaque handles, each made by an `_init` (or `_bootstrap`) verb and released by `_free`:
 *
 *  - `uform_executor_t`: where work runs. A RAM executor is the CPU reference backend with its
 *    own thread count, simulating one device or several (the mesh's CPU reference); a VRAM executor
 *    is a set of GPUs (absent from builds without CUDA: ask `uform_capabilities()`).
 *  - `uform_mesh_t`: the processes of one run and the communicator that joins their devices. Processes of RAM
 *    executors meet through files and talk over TCP sockets; see `uform_mesh_bootstrap`.
 *  - `uform_trainer_t`: one training run: the weights, the optimizer's moments and the step.
 *    It borrows its executor and mesh until it is freed; freeing either while a trainer borrows
 *    it fails with `uform_status_busy_k`.
 *  - `uform_encoder_t`: a checkpoint loaded for inference: pooled embeddings, late-interaction token
 *    vectors and choice probabilities of any number of items.
 *    It holds the weights and the activations of one pass, not a trainer's moments and gradients.
 *
 *  A fifth, `uform_decoded_t`, is a batch's media decoded ahead of its step by `uform_trainer_decode`
 *  and released by `uform_decoded_free`.
 *
 *  A `_free` fails with `uform_status_busy_k`, freeing nothing, while the handle is in use: an executor
 *  borrowed by a live trainer, encoder or mesh; a mesh borrowed by a live trainer; a trainer, an encoder
 *  or a decoded batch while a call on it runs or waits on another thread. Free it once they return.
 *  `uform_decoded_free` accepts NULL and ignores it, since `uform_trainer_decode` may give NULL; every
 *  other `_free` refuses NULL with `uform_status_invalid_handle_k`.
 *
 *  Every handle is checked against the library's table of live handles before use, so a freed
 *  or foreign handle is answered with `uform_status_invalid_handle_k`, never a crash.
 *
 *  @section  Threads
 *
 *  Any thread may call any verb. Verbs on one trainer (or encoder) are serialized: a second caller waits
 *  until the first returns, so steps never interleave. A RAM executor runs each verb on the
 *  calling thread plus `threads - 1` helpers of its own. `uform_trainer_decode` alone does not wait
 *  for its trainer: decode the next batch's media on another thread while a step runs.
 *
 *  @section  Errors
 *
 *  Every fallible function returns a `uform_status_t` and takes a last argument
 *  `char const** error`, which may be NULL. On failure it receives a human-readable message that
 *  names the offending field and value, e.g.
 *  `"config.hidden: 200 is not a positive multiple of 128 up to 16384"`. The text lives in
 *  thread-local storage until the next failing call on the same thread, and is freed when that
 *  thread exits: copy it to hand it to another thread. A message over 1023 bytes keeps its
 *  beginning (the field) and its end (the reason) around an ellipsis. A failed call changes no
 *  state: the trainer trains the next good batch as if the bad one never came. Its outputs are
 *  another matter: a verb that fails part-way (a bad item among many) may have written some of
 *  them, which are then not to be read. The library never exits, aborts or prints.
 *
 *  @section  Zero means "derive"
 *
 *  Every numeric config field reads zero as "derive the documented default", so a zeroed struct
 *  plus the required fields is a valid config. The defaults are listed beside each field. So a
 *  field whose default is not zero cannot be asked for zero itself (`masking.random_fraction`,
 *  `contrastive.bias`, the masking weights): give the smallest value that serves, such as 1e-30.
 *
 *  @section  Tapes
 *
 *  Variable-length inputs come as tapes: `count` entries concatenated in `data`, entry `i`
 *  spanning bytes (or elements) `[offsets[i], offsets[i + 1])`. The library reads the caller's
 *  memory during the call and keeps no pointer to it afterwards.
 */
#ifndef UFORM_H_
#define UFORM_H_

#include <stddef.h> /* `size_t` */
#include <stdint.h> /* `uint32_t`, `uint64_t` */

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with hidden visibility: what this header declares is all it exports. Windows
 * builds, which would need `dllexport` here, are not made. */
#if defined(__GNUC__) || defined(__clang__)
#define UFORM_API __attribute__((visibility("default")))
#else
#define UFORM_API
#endif

#define UFORM_VERSION_MAJOR 0
#define UFORM_VERSION_MINOR 1
#define UFORM_VERSION_PATCH 0

/** @brief Most temperature groups a contrastive term may have. */
#define UFORM_MAX_TEMPERATURE_GROUPS 64
/** @brief Most Matryoshka prefixes a contrastive term may average over. */
#define UFORM_MAX_MATRYOSHKA_DIMENSIONS 16
/** @brief Most bytes a checkpoint's note may hold: 1 MiB. */
#define UFORM_MAX_NOTE_BYTES (1 << 20)

/* ------------------------------------------------------------------------------------------ */
/*  Status codes                                                                               */
/* ------------------------------------------------------------------------------------------ */

typedef enum uform_status_t {
    uform_status_success_k = 0,
    /** A config or batch field is wrong; the message names it. Nothing changed. */
    uform_status_invalid_argument_k = 1,
    /** A handle is NULL, freed or not one of this library's. */
    uform_status_invalid_handle_k = 2,
    /** The handle is borrowed by a live handle, or a call on another thread is using it, so it cannot be
     *  freed yet; nothing changed. */
    uform_status_busy_k = 3,
    /** This build or this machine lacks what the call needs (a GPU, a modality, a term). */
    uform_status_unsupported_k = 4,
    /** Memory ran out; nothing changed. */
    uform_status_out_of_memory_k = 5,
    /** Reading or writing a file failed; the message names the path and the reason. */
    uform_status_io_k = 6,
    /** A checkpoint is malformed or belongs to another geometry; the message names the field. */
    uform_status_invalid_checkpoint_k = 7,
    /** The GPU failed: a CUDA error or a lost device. The message names the call; the run's
     *  state on that device is unknown, so free the trainer and resume from a checkpoint. */
    uform_status_device_k = 8,
    /** A mesh's peer did not come, or stopped answering, within the mesh's timeout, or hung up; the message names the
     *  host domain. A step that fails this way leaves the processes out of step: the mesh is broken, every later
     *  collective on it fails alike. Free the trainer and the mesh, and resume every process from a checkpoint. */
    uform_status_peer_k = 9,
} uform_status_t;

/* ------------------------------------------------------------------------------------------ */
/*  Enumerations                                                                               */
/* ------------------------------------------------------------------------------------------ */

/** @brief What the bytes of one training item hold. Zero is no modality and is refused. */
typedef enum uform_modality_t {
    uform_modality_text_k = 1,  /**< UTF-8 text, tokenized as bytes. */
    uform_modality_image_k = 2, /**< An encoded image file (JPEG, PNG, WebP). */
    uform_modality_video_k = 3, /**< An encoded video file. */
    uform_modality_audio_k = 4, /**< An encoded audio file. */
} uform_modality_t;

/** @brief Which losses a training step relaxes. Zero is refused: the objective is required. */
typedef enum uform_objective_t {
    uform_objective_masked_k = 1,      /**< Masked reconstruction alone. */
    uform_objective_contrastive_k = 2, /**< The pairwise contrastive loss alone. */
    uform_objective_joint_k = 3,       /**< Both, joined at the final-norm states. */
} uform_objective_t;

/** @brief Which pairs the contrastive loss pushes apart. */
typedef enum uform_negatives_t {
    uform_negatives_derived_k = 0, /**< Derives `uform_negatives_ambient_k`. */
    uform_negatives_ambient_k = 1, /**< Repel edges, and every pair no edge names. */
    uform_negatives_named_k = 2,   /**< Repel edges alone. */
} uform_negatives_t;

/** @brief Whether a run's bits repeat: the same seed and batches, the same bits, on the same GPU. */
typedef enum uform_determinism_t {
    uform_determinism_derived_k = 0, /**< Derives `uform_determinism_bitwise_k`. */
    uform_determinism_bitwise_k = 1, /**< Every sum in a fixed order: runs repeat bit for bit. */
    uform_determinism_fast_k = 2,    /**< cuDNN's attention adds query gradients in the order they land: about 4 %
                                          faster a step, and runs differ in their last bits. The CPU, and the
                                          library's own Hopper attention, are bitwise either way. */
} uform_determinism_t;

/** @brief How a contrastive term turns a row of scores into forces. */
typedef enum uform_pair_loss_form_t {
    uform_pair_loss_derived_k = 0,  /**< Sigmoid for pooled embeddings, ranked for token vectors. */
    uform_pair_loss_balanced_k = 1, /**< Sigmoid per cell, attract and repel halves normalized apart. */
    uform_pair_loss_ranked_k = 2,   /**< Sigmoid of every positive's score over every negative's. */
    uform_pair_loss_sigmoid_k = 3,  /**< SigLIP: sigmoid per cell, every cell weighed alike. */
} uform_pair_loss_form_t;

/** @brief Which side of a late-interaction score an item takes. */
typedef enum uform_late_interaction_side_t {
    uform_late_interaction_none_k = 0,
    uform_late_interaction_query_k = 1,
    uform_late_interaction_document_k = 2,
    uform_late_interaction_query_and_document_k = 3,
} uform_late_interaction_side_t;

/** @brief The scalar type outputs land in. `i8` stores `round(127 * x)` of unit-norm vectors. */
typedef enum uform_scalar_t {
    uform_scalar_f32_k = 0,
    uform_scalar_f16_k = 1,
    uform_scalar_bf16_k = 2,
    uform_scalar_i8_k = 3,
} uform_scalar_t;

/** @brief Bits of `uform_capabilities()`. */
typedef enum uform_capability_t {
    uform_capability_ram_k = 1,  /**< The CPU reference backend. */
    uform_capability_vram_k = 2, /**< The CUDA backend. */
    uform_capability_mesh_k = 4, /**< Meshes of more than one process, of RAM executors. */
    /* Media formats this build decodes, each through a library found when it was built
     * (`docs/model.md`, "Media preprocessing"); an item in a format without its bit is refused
     * with `uform_status_unsupported_k` naming the package that adds it. */
    uform_capability_jpeg_k = 8,    /**< JPEG images, by libjpeg-turbo. */
    uform_capability_png_k = 16,    /**< PNG images, by libpng. */
    uform_capability_webp_k = 32,   /**< WebP images, by libwebp. */
    uform_capability_wav_k = 64,    /**< WAV audio (PCM, A-law, mu-law), by FFmpeg. */
    uform_capability_flac_k = 128,  /**< FLAC audio, by FFmpeg. */
    uform_capability_mp3_k = 256,   /**< MP3 audio, by FFmpeg. */
    uform_capability_ogg_k = 512,   /**< Ogg Vorbis and Ogg Opus audio, by FFmpeg. */
    uform_capability_mp4_k = 1024,  /**< MP4 video, by FFmpeg; H.264, VP9 or AV1 in each container. */
    uform_capability_webm_k = 2048, /**< WebM video, by FFmpeg. */
    uform_capability_mkv_k = 4096,  /**< Matroska video, by FFmpeg. */
} uform_capability_t;

/* ------------------------------------------------------------------------------------------ */
/*  Handles                                                                                    */
/* ------------------------------------------------------------------------------------------ */

typedef void* uform_executor_t;
typedef void* uform_mesh_t;
typedef void* uform_trainer_t;
typedef void* uform_encoder_t;
typedef void* uform_decoded_t;

/* ------------------------------------------------------------------------------------------ */
/*  Configuration                                                                              */
/* ------------------------------------------------------------------------------------------ */

/** @brief How image items are cut into patches: squares of `patch_side` x `patch_side` pixels of `channels` each. */
typedef struct uform_image_shape_t {
    uint32_t patch_side; /**< Pixels on a patch's side, at most 64; 0 derives 16. */
    uint32_t channels;   /**< 1 gray, 3 RGB, 4 RGBA; 0 derives 3. */
} uform_image_shape_t;

/** @brief How video items are cut into tubelets: `tube_frames` kept frames of `patch_side` squares. */
typedef struct uform_video_shape_t {
    uint32_t patch_side;   /**< At most 64; 0 derives 16. */
    uint32_t tube_frames;  /**< Kept frames in one tubelet, at most 16; 0 derives 2. */
    uint32_t frame_stride; /**< Every `frame_stride`-th frame is kept, at most 64; 0 derives 1. */
    uint32_t channels;     /**< 1 gray, 3 RGB, 4 RGBA; 0 derives 3. */
} uform_video_shape_t;

/** @brief How audio items are cut into chunks of mono samples. */
typedef struct uform_audio_shape_t {
    uint32_t chunk_samples; /**< Samples in one chunk, at most 65536; 0 derives 400. */
    uint32_t sample_rate;   /**< Samples per second audio is resampled to, in [1000, 192000]; 0 derives 16000. */
} uform_audio_shape_t;

/**
 *  @brief What one device's step carries at most. A row is one packed sequence of
 *  `max_columns_per_row` token positions; segments are the items packed into rows.
 */
typedef struct uform_batch_shape_t {
    uint32_t max_rows_per_device;     /**< 0 derives 64; rows x columns at most 2^24. */
    uint32_t max_segments_per_device; /**< Items one device takes, up to 4096; 0 derives 8 per row. */
    uint32_t max_columns_per_row;     /**< Token positions in a row, up to 16384; 0 derives 512. Longer items are cut. */
    uint32_t max_bags_per_device;     /**< 0 derives `max_segments_per_device`. */
    uint32_t max_choices_per_item;    /**< Legal bytes one item offers; 0 makes no choices. */
    uform_image_shape_t image;
    uform_video_shape_t video;
    uform_audio_shape_t audio;
} uform_batch_shape_t;

/** @brief How the masked objective corrupts a batch and weighs its heads. */
typedef struct uform_masking_t {
    float token_mask_probability; /**< Share of text positions chosen; 0 derives 0.15. */
    float token_mean_span;        /**< Mean length of a chosen span, in [1, max_columns_per_row]; 0 derives 3. */
    float replace_fraction;       /**< Chosen positions shown as the mask id; 0 derives 0.8. */
    float random_fraction;        /**< Chosen positions shown as a random byte; 0 derives 0.1. */
    float image_mask_ratio;       /**< 0 derives 0.75. */
    float video_mask_ratio;       /**< 0 derives 0.9. */
    float audio_mask_ratio;       /**< 0 derives 0.5. */
    float text_weight;            /**< 0 derives 1. */
    float image_weight;           /**< 0 derives 1. */
    float video_weight;           /**< 0 derives 1. */
    float audio_weight;           /**< 0 derives 1. */
} uform_masking_t;

/** @brief How the contrastive loss scores the pooled embeddings. */
typedef struct uform_contrastive_t {
    /** Prefix widths the loss averages over, each <= hidden; NULL derives `{hidden}`. */
    uint32_t const* matryoshka_dimensions;
    size_t matryoshka_dimensions_count;
    uint32_t temperature_groups;    /**< Learnable (temperature, bias) pairs; 0 derives 1. */
    float inverse_temperature;      /**< Initial inverse temperature; 0 derives 10. */
    float bias;                     /**< Initial bias; 0 derives -10. */
    uform_negatives_t negatives;    /**< 0 derives ambient. */
    float ambient_repulsion_weight; /**< Weight of each ambient negative; 0 derives 1. */
    uint32_t max_edges_per_device;  /**< Attract + repel + ignore edges, at most 2^24; 0 derives 64 per segment. */
    uform_pair_loss_form_t pair_loss; /**< 0 derives sigmoid. */
} uform_contrastive_t;

/**
 *  @brief How the late-interaction loss scores token vectors: each query-side item's rows against
 *  the document-side items its attract and repel runs name, by MaxSim.
 */
typedef struct uform_late_interaction_t {
    float weight;   /**< The loss weight; 0 trains no token head. */
    uint32_t width; /**< Token vectors' width, a multiple of 8 up to 4096; 0 derives 128. */
    float inverse_temperature; /**< The learned scale's start; 0 derives 1. */
    float bias;                /**< The learned bias's start. */
    uint32_t max_query_span;   /**< A query's rows: cut to it, padded up to it; 0 derives 32. */
    uint32_t max_query_tokens_per_device;    /**< 0 derives max_segments_per_device x max_query_span. */
    uint32_t max_documents_per_device;       /**< 0 derives max_segments_per_device. */
    uint32_t max_document_tokens_per_device; /**< 0 derives max_rows_per_device x max_columns_per_row. */
    uform_pair_loss_form_t pair_loss; /**< 0 derives ranked. */
} uform_late_interaction_t;

/** @brief The choices term. */
typedef struct uform_choices_t {
    float weight; /**< Read when positive; needs `batch.max_choices_per_item`. */
} uform_choices_t;

/**
 *  @brief The learning-rate schedule: linear warm-up to `learning_rate` over `warmup_steps`,
 *  then cosine to `min_learning_rate` at `steps`, and the minimum after that.
 */
typedef struct uform_schedule_t {
    float learning_rate;     /**< In [0, 1]; 0 derives 1e-3. */
    float min_learning_rate; /**< 0 derives learning_rate / 10. */
    uint64_t warmup_steps;   /**< 0 derives steps / 20. */
    uint64_t steps;          /**< Required: the steps the cosine spans. */
} uform_schedule_t;

/** @brief A training run's geometry, objectives and schedule, for `uform_trainer_init_vram` and
 *  `uform_trainer_init_ram` alike (the CPU's run is configured as the GPU's). */
typedef struct uform_trainer_init_vram_t {
    char const* resume; /**< A checkpoint to continue from; NULL starts from `seed`; "" is refused. */
    uint32_t depth;     /**< Transformer blocks, 1 to 256; required. */
    uint32_t hidden;    /**< Width, a multiple of 128 up to 16384; required. Heads are `hidden / 64`. */
    uform_batch_shape_t batch;
    uform_objective_t objective; /**< Required. */
    uform_masking_t masking;
    uform_contrastive_t contrastive;
    uform_late_interaction_t late_interaction;
    uform_choices_t choices;
    uform_schedule_t schedule;
    uint64_t seed;                   /**< The base of every keyed draw. */
    uform_determinism_t determinism; /**< 0 derives bitwise. A resumed run may choose again. */
} uform_trainer_init_vram_t;

/* ------------------------------------------------------------------------------------------ */
/*  Steps                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/** @brief `count` entries concatenated in `data`; entry `i` spans `[offsets[i], offsets[i+1])`. */
typedef struct uform_tape_t {
    void const* data;
    uint64_t const* offsets; /**< `count + 1` non-decreasing offsets, in bytes or elements. */
    size_t count;
    uint64_t size; /**< Bytes or elements `data` holds: an offset past it is refused. */
} uform_tape_t;

/**
 *  @brief One edge set over a step's items, as compressed sparse rows: item `i` links to
 *  `ids[offsets[i] .. offsets[i+1])`, strictly ascending, weighed by `weights` (NULL weighs one).
 *  `offsets == NULL` is the empty set.
 */
typedef struct uform_edges_view_t {
    uint32_t const* offsets; /**< Items + 1 offsets into `ids`. */
    uint32_t const* ids;     /**< `ids_count` item indices. */
    float const* weights;    /**< `ids_count` weights, or NULL. */
    size_t ids_count;        /**< Must equal `offsets[items]`. */
} uform_edges_view_t;

/** @brief What one step reports. Terms that did not run read NaN. */
typedef struct uform_trainer_stats_t {
    uint64_t step;        /**< The step count after this update. */
    float learning_rate;  /**< The rate this update used, or would have used when skipped. */
    float loss;           /**< The weighted total. */
    float masked_loss;
    float contrastive_loss;
    float late_interaction_loss;
    float choices_loss;
    float image_loss;     /**< Masked image reconstruction: mean squared error over hidden patches. */
    float video_loss;     /**< The same over hidden video tubelets. */
    float audio_loss;     /**< The same over hidden audio chunks. */
    float grad_norm;      /**< Global gradient norm before clipping. */
    uint64_t items;       /**< Items this process contributed. The other counts, and the losses, are the whole
                               step's, over every process of a mesh. */
    uint64_t tokens;      /**< Token positions after truncation. */
    uint64_t truncated_items;
    uint64_t masked_positions; /**< Positions the masked term scored; 0 when it scored none. */
    uint64_t contrastive_rows; /**< Anchor rows the contrastive term counted; 0 when it counted none. */
    uint64_t choice_items;     /**< Items whose choices the choices term scored. */
    uint64_t query_rows;       /**< Query rows the late-interaction term counted. */
    uint64_t masked_patches;   /**< Media tokens (patches, tubelets, chunks) hidden and reconstructed. */
    /** Seconds from the call until the step's inputs were validated, packed and queued for upload:
     *  the time a GPU waits for the host, beside the step's wall time. */
    double host_seconds;
    /** 1 when the update was skipped: no term scored anything, or a loss or the gradient was not
     *  finite. A skipped step changes nothing: weights, moments and `step` stay as they were. */
    uint32_t skipped;
    uint32_t temperature_groups;
    float inverse_temperatures[UFORM_MAX_TEMPERATURE_GROUPS]; /**< The values this step scored with. */
    float biases[UFORM_MAX_TEMPERATURE_GROUPS];
} uform_trainer_stats_t;

/** @brief The inputs and outputs of one training step. */
typedef struct uform_trainer_step_t {
    /* Inputs: this process's share of the step. */
    size_t count;                                /**< Items. */
    uform_modality_t const* modalities;          /**< `count` modalities. */
    uform_tape_t contents;                       /**< `count` byte entries. */
    uint32_t const* bags;                        /**< NULL puts every item in its own bag. */
    uint32_t const* temperature_groups;          /**< NULL puts every item in group 0. */
    uform_late_interaction_side_t const* sides;  /**< NULL makes every item none. */
    uform_tape_t choices;                        /**< Legal bytes per item; `data == NULL` offers none. */
    uform_tape_t choice_targets;                 /**< float32 entries, offsets in elements. */
    uform_edges_view_t attract;
    uform_edges_view_t repel;
    uform_edges_view_t ignore;
    /** The media of these very items, decoded ahead by `uform_trainer_decode`, or NULL to decode them in the step. */
    uform_decoded_t decoded;
    /* Outputs. */
    void* embeddings;               /**< `count x hidden` scalars the step scored, or NULL. */
    uform_scalar_t embeddings_scalar;
    uform_trainer_stats_t stats;
} uform_trainer_step_t;

/* ------------------------------------------------------------------------------------------ */
/*  Verbs                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/** @brief The library's version, as "MAJOR.MINOR.PATCH". Never fails. */
UFORM_API char const* uform_version(void);

/** @brief The `uform_capability_t` bits this build and machine have. Never fails. */
UFORM_API uint32_t uform_capabilities(void);

/**
 *  @brief Makes a CPU executor: the reference backend.
 *  @param[in] threads Threads a verb uses, the calling one included; 0 uses every core; over 1024 is refused.
 *  @param[out] executor The new handle.
 *  @param[out] error The message on failure; may be NULL.
 */
UFORM_API uform_status_t uform_executor_init_ram(size_t threads, uform_executor_t* executor, char const** error);

/**
 *  @brief Makes a CPU executor that simulates `devices` devices in this process: the CPU reference of the mesh.
 *
 *  A trainer on it spreads each step over the devices as a mesh would, with the split, the gather of embeddings and
 *  token vectors, the scatter of their gradients and the all-reduce of the gradients done in memory, so any machine
 *  can check that a run's losses and weights do not depend on how its items were spread. The capacities of
 *  `uform_batch_shape_t`, `uform_contrastive_t` and `uform_late_interaction_t` are per device, so a step may carry
 *  up to `devices` times as much. The items are split in order into contiguous runs, one per device: each device
 *  in turn takes an equal share of the items still unplaced (rounded up), at most `max_segments_per_device`, and a
 *  run ends only where no bag has items on both sides, so a bag's items, and any between them, share a device; a
 *  device left without items idles that step. The masked, patch and choices terms stay means over the whole step,
 *  and the contrastive and late-interaction terms score every item against every other, so the losses and weights
 *  equal one device's up to the order of float32 sums. Checkpoints carry no trace of the devices: a run may resume
 *  on any number of them. Encoders on such an executor run on one device.
 *
 *  @param[in] threads As for `uform_executor_init_ram`; the devices run one after another on these threads.
 *  @param[in] devices Simulated devices; 0 makes one, which is `uform_executor_init_ram`; over 64 is refused.
 *  @param[out] executor The new handle.
 *  @param[out] error The message on failure; may be NULL.
 */
UFORM_API uform_status_t uform_executor_init_ram_devices(size_t threads, size_t devices, uform_executor_t* executor,
                                                         char const** error);

/**
 *  @brief Makes a GPU executor over some or every visible device.
 *  @param[in] devices Device ordinals; NULL with `count == 0` takes every visible device.
 *  @param[in] count Entries in `devices`.
 *  @param[out] executor The new handle.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_unsupported_k` in builds without CUDA or on machines without a GPU.
 */
UFORM_API uform_status_t uform_executor_init_vram(uint32_t const* devices, size_t count, uform_executor_t* executor,
                                                  char const** error);

/**
 *  @brief Frees an executor.
 *  @return `uform_status_busy_k` while a trainer, an encoder or a mesh borrows it;
 *  `uform_status_invalid_handle_k` for NULL.
 */
UFORM_API uform_status_t uform_executor_free(uform_executor_t executor, char const** error);

/** @brief Where and how the processes of one run meet. */
typedef struct uform_mesh_bootstrap_t {
    uint32_t host_domain_index; /**< This process's index, below `host_domain_count`. */
    uint32_t host_domain_count; /**< Processes in the run, at most 65536; 0 derives 1. */
    char const* directory;      /**< An existing folder every process sees; one process ignores it: may be NULL. */
    char const* job;            /**< The run's name, one folder name (no '/', at most 200 bytes): files live under
                                     `directory/job`, made when absent; one process ignores it too. */
    double timeout_seconds;     /**< How long to wait for peers, at the meeting and at each exchange of a step;
                                     0 derives 300. */
} uform_mesh_bootstrap_t;

/**
 *  @brief Joins this process to a run's mesh. A mesh of one process needs no peers, no `directory` and no `job`:
 *  a zeroed config makes it.
 *
 *  Several processes, each with a RAM executor, meet through files under `directory/job`. Host domain 0 listens on a
 *  TCP port and writes `directory/job/rendezvous` atomically (a temporary file renamed into place) with a fresh random
 *  nonce, its host name and its port; every other host domain reads it, connects and shows the nonce. A file left by
 *  an earlier run of the same job points where nobody listens, or at a listener with another nonce: the peer reads the
 *  file again until this run's appears. Once every index has joined, host domain 0 removes the file and the call
 *  returns on every process; when one never came, it fails on every process that did, naming the missing indices.
 *  The hosts must reach host domain 0's host name on any TCP port, and share a byte order.
 *
 *  A trainer on the mesh numbers every process's devices in host-domain order, and the step's items likewise: each
 *  process's items follow those of the processes before it, its edges index its own items, and ambient negatives
 *  range over every process's items. Each process splits its share over its own devices as
 *  `uform_executor_init_ram_devices` says; the gather of embeddings and token vectors, the scatter of their gradients
 *  and the all-reduce cross processes through host domain 0 in that global order, so processes of one device each,
 *  given shares of a batch, train bit for bit as one process of as many devices given all of it. Every process must
 *  make its trainer with the same config, on the executor it joined with, resuming the same checkpoint if any: a
 *  config that differs, or a start at another step or from other weights, is refused on every process by name, and
 *  so is a trainer any one process could not make.
 *
 *  @param[in] executor The devices this process brings.
 *  @param[in] config Where and how to meet.
 *  @param[out] mesh The new handle.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_invalid_argument_k` naming `host_domain_index`, `directory`, `job` or `timeout_seconds`;
 *  `uform_status_peer_k` when peers did not all join within the timeout, naming which; `uform_status_io_k` when the
 *  folder or the file cannot be written; `uform_status_unsupported_k` for several processes of VRAM executors, which
 *  need the NCCL mesh this build lacks.
 */
UFORM_API uform_status_t uform_mesh_bootstrap(uform_executor_t executor, uform_mesh_bootstrap_t const* config,
                                              uform_mesh_t* mesh, char const** error);

/**
 *  @brief Frees a mesh and lets go of its executor. A mesh of several processes closes its sockets: a peer that
 *  still steps on it fails at its next exchange with `uform_status_peer_k`, naming this host domain.
 *  @return `uform_status_busy_k` while a trainer borrows it; `uform_status_invalid_handle_k` for NULL.
 */
UFORM_API uform_status_t uform_mesh_free(uform_mesh_t mesh, char const** error);

/**
 *  @brief Gathers every process's bytes on every process, in host-domain order: what a training loop shares between
 *  steps, such as a stop one process was asked for, or its share of an evaluation. A collective: every process of the
 *  mesh calls it, in the same order among its trainers' steps; the parts may differ in size. On a mesh of one process
 *  it answers a copy of `data`.
 *  @param[in] mesh The mesh.
 *  @param[in] data This process's part: `bytes` bytes; may be NULL when `bytes` is 0.
 *  @param[out] gathered The parts side by side in host-domain order; release it with `uform_mesh_gathered_free`.
 *  @param[out] sizes The size of each part: room for the mesh's host domain count.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_peer_k` when a peer hung up or stayed silent past the mesh's timeout, naming it (the mesh is
 *  then broken for good); `uform_status_invalid_argument_k` for a NULL output, or NULL `data` with `bytes`.
 */
UFORM_API uform_status_t uform_mesh_gather(uform_mesh_t mesh, void const* data, size_t bytes, void** gathered,
                                           uint64_t* sizes, char const** error);

/** @brief Releases what `uform_mesh_gather` gathered; NULL is harmless. */
UFORM_API void uform_mesh_gathered_free(void* gathered);

/**
 *  @brief Takes this process's part in the collective its peers are in, refusing it with `reason`: for a caller that
 *  refuses a step, a trainer or a gather on its own before calling the verb (a binding's checks of its arguments).
 *  Peers in a step fail it with `uform_status_invalid_argument_k` ("host domain 1 refused its share of the step:
 *  ..."), as for a share the library refuses; peers making a trainer or gathering fail alike ("host domain 1 refused
 *  its part: ..."). The mesh stays whole, and every process goes on to its next verb. On a mesh of one process it
 *  does nothing. Without it, the peers would pair their verb with this process's next one.
 *  @param[in] mesh The mesh.
 *  @param[in] reason What the peers' message quotes.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_peer_k` when a peer hung up or stayed silent past the mesh's timeout.
 */
UFORM_API uform_status_t uform_mesh_refuse(uform_mesh_t mesh, char const* reason, char const** error);

/**
 *  @brief Ends at once every wait for peers in progress in this process: a meeting (`uform_mesh_bootstrap`) or an
 *  exchange of a step or a gather. Each fails within a fifth of a second with `uform_status_peer_k` ("abandoned"),
 *  and a mesh whose exchange it ends is broken, as when a peer hangs up; waits that begin later are not affected.
 *  Safe to call from a signal handler or any thread: what a program calls when asked to stop while its peers are
 *  late or gone.
 */
UFORM_API void uform_mesh_abandon(void);

/**
 *  @brief Starts or resumes a run on a CPU executor.
 *  @param[in] executor A RAM executor.
 *  @param[in] config Geometry, objectives, schedule; `config->resume` continues a checkpoint.
 *  @param[in] mesh The mesh to borrow until freed; NULL runs this process alone.
 *  @param[out] trainer The new handle.
 *  @param[out] error The message on failure; may be NULL.
 */
UFORM_API uform_status_t uform_trainer_init_ram(uform_executor_t executor, uform_trainer_init_vram_t const* config,
                                                uform_mesh_t mesh, uform_trainer_t* trainer, char const** error);

/**
 *  @brief Starts or resumes a run with one replica on each device of a GPU executor.
 *  @return `uform_status_unsupported_k` in builds without CUDA; `invalid_argument` on a RAM executor.
 */
UFORM_API uform_status_t uform_trainer_init_vram(uform_executor_t executor, uform_trainer_init_vram_t const* config,
                                                 uform_mesh_t mesh, uform_trainer_t* trainer, char const** error);

/**
 *  @brief Applies one optimizer step over this process's items and every peer's.
 *  @param[in] trainer The run.
 *  @param[inout] step The batch in; the stats, and the embeddings when asked, out.
 *  @param[out] error The message on failure; may be NULL.
 *
 *  The batch is validated whole before anything changes. A step whose loss or gradient is not
 *  finite changes nothing and reports `stats.skipped = 1`; that is not an error.
 *
 *  On a mesh of several processes every process calls it once a step with its own share: the step is the processes'
 *  batches side by side in host-domain order (`uform_mesh_bootstrap`). A share any process refuses is refused by
 *  every process, each naming the host domain that refused it, and the next step trains as if it never came. A peer
 *  that hangs up or stays silent past the mesh's timeout fails the step with `uform_status_peer_k`.
 *
 *  Refused with `uform_status_busy_k` while a step begun with `uform_trainer_step_begin` has not ended.
 */
UFORM_API uform_status_t uform_trainer_step(uform_trainer_t trainer, uform_trainer_step_t* step, char const** error);

/**
 *  @brief Queues one step and returns before it lands, so the host readies the next while a GPU runs this one.
 *  @param[in] trainer The run.
 *  @param[inout] step The batch in; the stats out at `uform_trainer_step_end`, and the embeddings when asked, by then.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_busy_k` while two steps are begun and not ended; `invalid_argument` for a `step` begun
 *  already and not ended (each step in flight has its own); a refused batch as `uform_trainer_step` refuses it,
 *  with nothing queued.
 *
 *  `uform_trainer_step` is this and `uform_trainer_step_end` at once. A loop that begins step k + 1 before ending
 *  step k keeps a GPU busy between steps: the next batch is validated, packed and uploaded, and its work queued,
 *  while the device runs the one before. Every step still applies in order, exactly as one after another: a step
 *  begun before the one ahead of it lands is queued as if that one applies, and where it is skipped instead (its
 *  loss or gradient not finite) the library runs the step behind it again before either ends. `step`, and every
 *  buffer it points into, stay borrowed until its end. On the CPU, and on meshes and executors of several
 *  devices, the step runs whole before this returns (its embeddings land then). A blocking step, saving and
 *  freeing the trainer are refused (`uform_status_busy_k`) while a step is begun and not ended.
 */
UFORM_API uform_status_t uform_trainer_step_begin(uform_trainer_t trainer, uform_trainer_step_t* step,
                                                  char const** error);

/**
 *  @brief Waits for the earliest step begun to land and writes its stats, and its embeddings when asked.
 *  @return `uform_status_invalid_argument_k` when `step` is not the earliest begun (steps end in the order they
 *  began) or not begun at all. A failure of the device reports here, and the step ends all the same.
 */
UFORM_API uform_status_t uform_trainer_step_end(uform_trainer_t trainer, uform_trainer_step_t* step,
                                                char const** error);

/**
 *  @brief Decodes a batch's media (images, video, audio) into tokens ahead of its step, on every core,
 *  without waiting for the trainer's running step: the host decodes step N + 1 while the device trains step N.
 *  @param[in] trainer The run whose config shapes the tokens.
 *  @param[in] step The batch; only `count`, `modalities` and `contents` are read.
 *  @param[out] decoded The tokens, for `step->decoded` of the step that trains these items; NULL when no
 *              item is media (the step then needs none).
 *  @param[out] error The message on failure; may be NULL.
 *
 *  Bad media are refused here, by item, as the step would refuse them. The step checks that it brings
 *  the items decoded (modalities, contents tape and offsets) and refuses other ones. Media bytes are
 *  read here, not by the step, so bytes changed in between are not seen; text is read by the step.
 *  The tokens take `4 x tokens x width` bytes of host memory until `uform_decoded_free`; a decoded
 *  batch may feed several steps, probes included.
 */
UFORM_API uform_status_t uform_trainer_decode(uform_trainer_t trainer, uform_trainer_step_t const* step,
                                              uform_decoded_t* decoded, char const** error);

/**
 *  @brief Frees what `uform_trainer_decode` made. NULL is accepted and ignored.
 *  @return `uform_status_busy_k` while a step packs its tokens, the start of the step; once packed, a
 *  step needs it no more.
 */
UFORM_API uform_status_t uform_decoded_free(uform_decoded_t decoded, char const** error);

/**
 *  @brief Writes the weights, the optimizer's moments, the step and the config as one
 *  safetensors file: written to `path` + a temporary suffix, flushed, then renamed into place, so
 *  a crash keeps the previous file whole, and whatever `path` named before (a symbolic link, say)
 *  is replaced by the file rather than written through.
 *  @param[in] trainer The run.
 *  @param[in] path The destination.
 *
 *  On a mesh of several processes only host domain 0 writes; the others, which hold the same weights and moments,
 *  return success at once and write nothing, so every process may call it alike. So do the other save verbs.
 */
UFORM_API uform_status_t uform_trainer_save(uform_trainer_t trainer, char const* path, char const** error);

/**
 *  @brief Writes the weights, the step and the config without the optimizer's moments: a third of
 *  `uform_trainer_save`'s file, for release. Its metadata marks it weights-only, so an encoder loads it
 *  and a run refuses to resume from it (`uform_status_invalid_checkpoint_k`). Written atomically, like
 *  `uform_trainer_save`.
 *  @param[in] trainer The run.
 *  @param[in] path The destination.
 *  @param[out] error The message on failure; may be NULL.
 */
UFORM_API uform_status_t uform_trainer_save_weights(uform_trainer_t trainer, char const* path, char const** error);

/**
 *  @brief `uform_trainer_save` with a note of the caller's own, stored in the file's metadata as
 *  `__metadata__.note`: what the caller needs beside the weights to continue, such as where its data
 *  stream stands. The library neither reads nor judges it; `uform_checkpoint_note` reads it back.
 *  @param[in] trainer The run.
 *  @param[in] path The destination.
 *  @param[in] note UTF-8 text of at most `UFORM_MAX_NOTE_BYTES` bytes, JSON or any other, escaped into
 *  the header; NULL or empty stores none, as `uform_trainer_save` does.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_invalid_argument_k` for a longer note, or one that is not UTF-8, naming it.
 */
UFORM_API uform_status_t uform_trainer_save_noted(uform_trainer_t trainer, char const* path, char const* note,
                                                  char const** error);

/** @brief `uform_trainer_save_weights` with a note, stored as `uform_trainer_save_noted` stores it. */
UFORM_API uform_status_t uform_trainer_save_weights_noted(uform_trainer_t trainer, char const* path, char const* note,
                                                          char const** error);

/**
 *  @brief Frees a trainer and lets go of its executor and mesh.
 *  @return `uform_status_busy_k` while a call on the trainer (`uform_trainer_decode` included) runs or waits on
 *  another thread, or while a step begun has not ended: free it once they return, or end them.
 *  `uform_status_invalid_handle_k` for NULL.
 */
UFORM_API uform_status_t uform_trainer_free(uform_trainer_t trainer, char const** error);

/**
 *  @brief Reads the note a checkpoint carries; a file saved without one reads as the empty note. The
 *  header, and how the tensors tile the file, are checked as `uform_encoder_load` checks them; the
 *  tensors' values are not read.
 *  @param[in] path A checkpoint written by any of the save verbs.
 *  @param[out] note Room for `capacity` bytes: the note and a terminating NUL. NULL reads the length
 *  alone: call first with NULL, then pass room for `*length + 1` bytes.
 *  @param[in] capacity Bytes `note` has room for.
 *  @param[out] length The note's length in bytes, without the NUL; set even when `capacity` falls short.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_invalid_argument_k` when `capacity` falls short of `*length + 1` (`note`
 *  then reads empty, no part of the note); `uform_status_invalid_checkpoint_k` for a malformed file.
 */
UFORM_API uform_status_t uform_checkpoint_note(char const* path, char* note, size_t capacity, size_t* length,
                                               char const** error);

/** @brief A batch of items to embed, and where their embeddings land. */
typedef struct uform_encoder_embed_t {
    size_t count;                       /**< Items; any number: the encoder splits them to fit. None
                                             embeds into nothing, and the arrays may then be NULL. */
    uform_modality_t const* modalities; /**< `count` modalities. */
    uform_tape_t contents;              /**< `count` byte entries. */
    void* embeddings;                   /**< Out: `count x hidden` scalars, unit-norm pooled embeddings. */
    uform_scalar_t embeddings_scalar;
    uint64_t truncated_items;           /**< Out: items that did not fit a row of `max_columns_per_row` tokens: text
                                             cut, images shrunk, video and audio cut at the end. */
} uform_encoder_embed_t;

/**
 *  @brief Loads a checkpoint for inference; its geometry comes from the file's own metadata. Only the
 *  weights are read; the encoder takes the weights and one pass's activations, not a trainer's memory.
 *  @param[in] executor A RAM or VRAM executor.
 *  @param[in] path A checkpoint written by `uform_trainer_save` or `uform_trainer_save_weights`.
 *  @param[out] encoder The new handle.
 *  @param[out] hidden The embeddings' width; may be NULL.
 */
UFORM_API uform_status_t uform_encoder_load(uform_executor_t executor, char const* path, uform_encoder_t* encoder,
                                            size_t* hidden, char const** error);

/**
 *  @brief Embeds items as training scores them, without masking: the mean final state, unit-norm.
 *
 *  A Matryoshka prefix of width m is the first m components of a row, re-normalized.
 */
UFORM_API uform_status_t uform_encoder_embed(uform_encoder_t encoder, uform_encoder_embed_t* embed, char const** error);

/** @brief Texts, the bytes each may choose, and where each choice's probability lands. */
typedef struct uform_encoder_choose_t {
    size_t count;             /**< Items; any number: the encoder splits them to fit. */
    uform_tape_t texts;       /**< `count` UTF-8 byte entries. */
    uform_tape_t choices;     /**< `count` entries of distinct legal bytes, one or more each. */
    float* probabilities;     /**< Out: `choices.offsets[count] - choices.offsets[0]` float32s, one per
                                   offered byte: item i's land from `choices.offsets[i] - choices.offsets[0]`,
                                   each item's summing to one: the shape `choice_targets` takes. */
    uint64_t truncated_items; /**< Out: texts cut to fit a row beside their choice position. */
} uform_encoder_choose_t;

/**
 *  @brief The byte decoder's softmax over each text's legal bytes at its choice position, as the
 *  choices term scores it in training: the probabilities a trainer's `choice_targets` can take.
 */
UFORM_API uform_status_t uform_encoder_choose(uform_encoder_t encoder, uform_encoder_choose_t* choose,
                                              char const** error);

/** @brief Items to read as late interaction reads them, and where their token vectors land. */
typedef struct uform_encoder_tokens_t {
    size_t count;                               /**< Items; any number: the encoder splits them to fit. */
    uform_modality_t const* modalities;         /**< `count` modalities. */
    uform_tape_t contents;                      /**< `count` byte entries. */
    uform_late_interaction_side_t const* sides; /**< NULL reads every item as a document; a query (or an item
                                                     that is both) is cut and padded to its span, as training reads it. */
    uint64_t* offsets;       /**< Out: `count + 1` offsets, in rows, of each item's vectors; required. */
    float* vectors;          /**< Out: `offsets[count]` unit rows of `width` float32s, item after item. The
                                  library cannot know its size: call first with NULL, which checks the items
                                  and fills `offsets`, `width` and `truncated_items` alone, then pass
                                  room for `offsets[count] * width` floats. */
    size_t width;            /**< Out: the token vectors' width. */
    uint64_t truncated_items; /**< Out: items cut to fit: a document longer than `max_columns_per_row`, a
                                   query longer than `late_interaction.max_query_span`, media shrunk or cut
                                   to fit a row. */
} uform_encoder_tokens_t;

/**
 *  @brief The token head's unit vectors of each item's rows, as the late-interaction term scores
 *  them in training. Refused (`uform_status_invalid_argument_k`) for a checkpoint trained without
 *  late interaction, which has no head. An image, a video or a sound is a document of one row per
 *  patch, tubelet or chunk, in the order training packs them; only text is a query. The sizing call
 *  decodes media to count their tokens, and the filling call decodes them again.
 */
UFORM_API uform_status_t uform_encoder_embed_tokens(uform_encoder_t encoder, uform_encoder_tokens_t* tokens,
                                                    char const** error);

/**
 *  @brief Frees an encoder and lets go of its executor.
 *  @return `uform_status_busy_k` while a call on the encoder runs or waits on another thread: free it once they
 *  return. `uform_status_invalid_handle_k` for NULL.
 */
UFORM_API uform_status_t uform_encoder_free(uform_encoder_t encoder, char const** error);

/**
 *  @brief Decodes one media item into the tokens a trainer or an encoder of this batch shape reads: an image's
 *  patches, a video's tubelets or a sound's chunks, in the order training packs them (`docs/model.md`, "Media
 *  preprocessing"). It needs no handle, so a model run outside the library reads what uform's reads.
 *  @param[in] shape The batch shape; not NULL: a zeroed struct is every default. Zeros derive as a trainer's config
 *  derives them. A checkpoint records its own as `config.batch` in its metadata. The item is fitted to one row of
 *  `max_columns_per_row` tokens, as a step fits it: an image shrunk, video and audio cut at the end;
 *  `uform_media_tokens_fitted` tells whether it was.
 *  @param[in] modality Image, video or audio; text has no media tokens and is refused.
 *  @param[in] bytes The encoded file, `length` bytes.
 *  @param[out] tokens Room for `capacity` tokens of the kind's width in float32: an image patch's
 *  `image.patch_side x patch_side x channels` values laid out (y, x, channel), a tubelet's
 *  `video.tube_frames x patch_side x patch_side x channels` laid out (t, y, x, channel), or a chunk's
 *  `audio.chunk_samples` samples. NULL sizes alone: call first with NULL, then pass room for `*count` tokens; or
 *  pass room for `max_columns_per_row` tokens and call once. The sizing call decodes the item, as the filling
 *  call does again.
 *  @param[in] capacity Tokens `tokens` has room for.
 *  @param[out] grid Three counts, frames, rows and columns: an image's 1 and its patch rows and columns, a video's
 *  tubelets along time and its patch rows and columns, a sound's chunks and 1 and 1. Token `t` sits at time
 *  `t / (rows x columns)`, row `t % (rows x columns) / columns` and column `t % columns`: the coordinates its
 *  rotary position turns by (a sound's chunk by its index). May be NULL.
 *  @param[out] count The item's tokens, the product of the grid; set even when `capacity` falls short.
 *  @param[out] width Floats in one token, the kind's width under the derived shape; may be NULL.
 *  @param[out] error The message on failure; may be NULL.
 *  @return `uform_status_invalid_argument_k` for a NULL `shape` or `count`, a shape field out of range (named
 *  `shape.image.channels` and so on), a modality that is not a media kind, bytes that do not decode or hold another
 *  modality (named `bytes`), or a `capacity` short of `*count`, which writes no token;
 *  `uform_status_unsupported_k` for a format this build does not decode.
 */
UFORM_API uform_status_t uform_media_tokens(uform_batch_shape_t const* shape, uform_modality_t modality,
                                            void const* bytes, size_t length, float* tokens, size_t capacity,
                                            uint32_t* grid, size_t* count, size_t* width, char const** error);

/**
 *  @brief `uform_media_tokens`, also telling whether the item was fitted to the row: what a step counts in
 *  `truncated_items` and an encoder in its own. Every other argument is `uform_media_tokens`'s.
 *  @param[out] truncated 1 when the item exceeded a row of `max_columns_per_row` tokens and was fitted to it (an
 *  image shrunk, a video or a sound cut at the end), else 0; set on success, even when `capacity` falls short.
 *  May be NULL.
 */
UFORM_API uform_status_t uform_media_tokens_fitted(uform_batch_shape_t const* shape, uform_modality_t modality,
                                                   void const* bytes, size_t length, float* tokens, size_t capacity,
                                                   uint32_t* grid, size_t* count, size_t* width, int* truncated,
                                                   char const** error);

#ifdef __cplusplus
}
#endif

#endif /* UFORM_H_ */
