# Declarations of `libuform/include/uform.h`, the C ABI this package wraps, and of the two test
# hooks at the end of `libuform/src/internal.h`. Kept in the header's order, so the two read side
# by side; every function here is safe to call without the GIL.

from libc.stdint cimport uint32_t, uint64_t


cdef extern from "uform.h" nogil:

    enum:
        UFORM_VERSION_MAJOR
        UFORM_VERSION_MINOR
        UFORM_VERSION_PATCH
        UFORM_MAX_TEMPERATURE_GROUPS
        UFORM_MAX_MATRYOSHKA_DIMENSIONS
        UFORM_MAX_NOTE_BYTES

    ctypedef enum uform_status_t:
        uform_status_success_k
        uform_status_invalid_argument_k
        uform_status_invalid_handle_k
        uform_status_busy_k
        uform_status_unsupported_k
        uform_status_out_of_memory_k
        uform_status_io_k
        uform_status_invalid_checkpoint_k
        uform_status_device_k
        uform_status_peer_k

    ctypedef enum uform_modality_t:
        uform_modality_text_k
        uform_modality_image_k
        uform_modality_video_k
        uform_modality_audio_k

    ctypedef enum uform_objective_t:
        uform_objective_masked_k
        uform_objective_contrastive_k
        uform_objective_joint_k

    ctypedef enum uform_determinism_t:
        uform_determinism_derived_k
        uform_determinism_bitwise_k
        uform_determinism_fast_k

    ctypedef enum uform_negatives_t:
        uform_negatives_derived_k
        uform_negatives_ambient_k
        uform_negatives_named_k

    ctypedef enum uform_pair_loss_form_t:
        uform_pair_loss_derived_k
        uform_pair_loss_balanced_k
        uform_pair_loss_ranked_k
        uform_pair_loss_sigmoid_k

    ctypedef enum uform_late_interaction_side_t:
        uform_late_interaction_none_k
        uform_late_interaction_query_k
        uform_late_interaction_document_k
        uform_late_interaction_query_and_document_k

    ctypedef enum uform_scalar_t:
        uform_scalar_f32_k
        uform_scalar_f16_k
        uform_scalar_bf16_k
        uform_scalar_i8_k

    ctypedef enum uform_capability_t:
        uform_capability_ram_k
        uform_capability_vram_k
        uform_capability_mesh_k
        uform_capability_jpeg_k
        uform_capability_png_k
        uform_capability_webp_k
        uform_capability_wav_k
        uform_capability_flac_k
        uform_capability_mp3_k
        uform_capability_ogg_k
        uform_capability_mp4_k
        uform_capability_webm_k
        uform_capability_mkv_k

    ctypedef void* uform_executor_t
    ctypedef void* uform_mesh_t
    ctypedef void* uform_trainer_t
    ctypedef void* uform_encoder_t
    ctypedef void* uform_decoded_t

    ctypedef struct uform_image_shape_t:
        uint32_t patch_side
        uint32_t channels

    ctypedef struct uform_video_shape_t:
        uint32_t patch_side
        uint32_t tube_frames
        uint32_t frame_stride
        uint32_t channels

    ctypedef struct uform_audio_shape_t:
        uint32_t chunk_samples
        uint32_t sample_rate

    ctypedef struct uform_batch_shape_t:
        uint32_t max_rows_per_device
        uint32_t max_segments_per_device
        uint32_t max_columns_per_row
        uint32_t max_bags_per_device
        uint32_t max_choices_per_item
        uform_image_shape_t image
        uform_video_shape_t video
        uform_audio_shape_t audio

    ctypedef struct uform_masking_t:
        float token_mask_probability
        float token_mean_span
        float replace_fraction
        float random_fraction
        float image_mask_ratio
        float video_mask_ratio
        float audio_mask_ratio
        float text_weight
        float image_weight
        float video_weight
        float audio_weight

    ctypedef struct uform_contrastive_t:
        const uint32_t* matryoshka_dimensions
        size_t matryoshka_dimensions_count
        uint32_t temperature_groups
        float inverse_temperature
        float bias
        uform_negatives_t negatives
        float ambient_repulsion_weight
        uint32_t max_edges_per_device
        uform_pair_loss_form_t pair_loss

    ctypedef struct uform_late_interaction_t:
        float weight
        uint32_t width
        float inverse_temperature
        float bias
        uint32_t max_query_span
        uint32_t max_query_tokens_per_device
        uint32_t max_documents_per_device
        uint32_t max_document_tokens_per_device
        uform_pair_loss_form_t pair_loss

    ctypedef struct uform_choices_t:
        float weight

    ctypedef struct uform_schedule_t:
        float learning_rate
        float min_learning_rate
        uint64_t warmup_steps
        uint64_t steps

    ctypedef struct uform_trainer_init_vram_t:
        const char* resume
        uint32_t depth
        uint32_t hidden
        uform_batch_shape_t batch
        uform_objective_t objective
        uform_masking_t masking
        uform_contrastive_t contrastive
        uform_late_interaction_t late_interaction
        uform_choices_t choices
        uform_schedule_t schedule
        uint64_t seed
        uform_determinism_t determinism

    ctypedef struct uform_tape_t:
        const void* data
        const uint64_t* offsets
        size_t count
        uint64_t size

    ctypedef struct uform_edges_view_t:
        const uint32_t* offsets
        const uint32_t* ids
        const float* weights
        size_t ids_count

    ctypedef struct uform_trainer_stats_t:
        uint64_t step
        float learning_rate
        float loss
        float masked_loss
        float contrastive_loss
        float late_interaction_loss
        float image_loss
        float video_loss
        float audio_loss
        float choices_loss
        float grad_norm
        uint64_t items
        uint64_t tokens
        uint64_t truncated_items
        uint64_t masked_positions
        uint64_t contrastive_rows
        uint64_t choice_items
        uint64_t query_rows
        uint64_t masked_patches
        double host_seconds
        uint32_t skipped
        uint32_t temperature_groups
        float inverse_temperatures[UFORM_MAX_TEMPERATURE_GROUPS]
        float biases[UFORM_MAX_TEMPERATURE_GROUPS]

    ctypedef struct uform_trainer_step_t:
        size_t count
        const uform_modality_t* modalities
        uform_tape_t contents
        const uint32_t* bags
        const uint32_t* temperature_groups
        const uform_late_interaction_side_t* sides
        uform_tape_t choices
        uform_tape_t choice_targets
        uform_edges_view_t attract
        uform_edges_view_t repel
        uform_edges_view_t ignore
        uform_decoded_t decoded
        void* embeddings
        uform_scalar_t embeddings_scalar
        uform_trainer_stats_t stats

    ctypedef struct uform_mesh_bootstrap_t:
        uint32_t host_domain_index
        uint32_t host_domain_count
        const char* directory
        const char* job
        double timeout_seconds

    const char* uform_version()
    uint32_t uform_capabilities()

    uform_status_t uform_executor_init_ram(size_t threads, uform_executor_t* executor, const char** error)
    uform_status_t uform_executor_init_ram_devices(size_t threads, size_t devices, uform_executor_t* executor,
                                                   const char** error)
    uform_status_t uform_executor_init_vram(const uint32_t* devices, size_t count, uform_executor_t* executor,
                                            const char** error)
    uform_status_t uform_executor_free(uform_executor_t executor, const char** error)

    uform_status_t uform_mesh_bootstrap(uform_executor_t executor, const uform_mesh_bootstrap_t* config,
                                        uform_mesh_t* mesh, const char** error)
    uform_status_t uform_mesh_free(uform_mesh_t mesh, const char** error)
    uform_status_t uform_mesh_gather(uform_mesh_t mesh, const void* data, size_t bytes, void** gathered,
                                     uint64_t* sizes, const char** error)
    void uform_mesh_gathered_free(void* gathered)
    void uform_mesh_abandon() nogil
    uform_status_t uform_mesh_refuse(uform_mesh_t mesh, const char* reason, const char** error) nogil

    uform_status_t uform_trainer_init_ram(uform_executor_t executor, const uform_trainer_init_vram_t* config,
                                          uform_mesh_t mesh, uform_trainer_t* trainer, const char** error)
    uform_status_t uform_trainer_init_vram(uform_executor_t executor, const uform_trainer_init_vram_t* config,
                                           uform_mesh_t mesh, uform_trainer_t* trainer, const char** error)
    uform_status_t uform_trainer_step(uform_trainer_t trainer, uform_trainer_step_t* step, const char** error)
    uform_status_t uform_trainer_step_begin(uform_trainer_t trainer, uform_trainer_step_t* step, const char** error)
    uform_status_t uform_trainer_step_end(uform_trainer_t trainer, uform_trainer_step_t* step, const char** error)
    uform_status_t uform_trainer_decode(uform_trainer_t trainer, const uform_trainer_step_t* step,
                                        uform_decoded_t* decoded, const char** error)
    uform_status_t uform_decoded_free(uform_decoded_t decoded, const char** error)
    uform_status_t uform_trainer_save(uform_trainer_t trainer, const char* path, const char** error)
    uform_status_t uform_trainer_save_weights(uform_trainer_t trainer, const char* path, const char** error)
    uform_status_t uform_trainer_save_noted(uform_trainer_t trainer, const char* path, const char* note,
                                            const char** error)
    uform_status_t uform_trainer_save_weights_noted(uform_trainer_t trainer, const char* path, const char* note,
                                                    const char** error)
    uform_status_t uform_trainer_free(uform_trainer_t trainer, const char** error)
    uform_status_t uform_checkpoint_note(const char* path, char* note, size_t capacity, size_t* length,
                                         const char** error)

    ctypedef struct uform_encoder_tokens_t:
        size_t count
        const uform_modality_t* modalities
        uform_tape_t contents
        const uform_late_interaction_side_t* sides
        uint64_t* offsets
        float* vectors
        size_t width
        uint64_t truncated_items

    uform_status_t uform_encoder_embed_tokens(uform_encoder_t encoder, uform_encoder_tokens_t* tokens,
                                              const char** error)

    ctypedef struct uform_encoder_choose_t:
        size_t count
        uform_tape_t texts
        uform_tape_t choices
        float* probabilities
        uint64_t truncated_items

    uform_status_t uform_encoder_choose(uform_encoder_t encoder, uform_encoder_choose_t* choose, const char** error)

    ctypedef struct uform_encoder_embed_t:
        size_t count
        const uform_modality_t* modalities
        uform_tape_t contents
        void* embeddings
        uform_scalar_t embeddings_scalar
        uint64_t truncated_items

    uform_status_t uform_encoder_load(uform_executor_t executor, const char* path, uform_encoder_t* encoder,
                                      size_t* hidden, const char** error)
    uform_status_t uform_encoder_embed(uform_encoder_t encoder, uform_encoder_embed_t* embed, const char** error)
    uform_status_t uform_encoder_free(uform_encoder_t encoder, const char** error)

    uform_status_t uform_media_tokens_fitted(const uform_batch_shape_t* shape, uform_modality_t modality,
                                             const void* bytes, size_t length, float* tokens, size_t capacity,
                                             uint32_t* grid, size_t* count, size_t* width, int* truncated,
                                             const char** error)


cdef extern from "internal.h" nogil:

    uform_status_t uform_trainer_probe(uform_trainer_t trainer, uform_trainer_step_t* step, float* gradients,
                                       const char** error)
    uform_status_t uform_trainer_weights(uform_trainer_t trainer, float* weights, size_t* total, const char** error)
    uform_status_t uform_trainer_memory(uform_trainer_t trainer, size_t* bytes, const char** error)
    uform_status_t uform_encoder_memory(uform_encoder_t encoder, size_t* bytes, const char** error)
