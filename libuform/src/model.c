/**
 *  @file   model.c
 *  @brief  The model's sequence of operations on one replica, written once for every backend:
 *          forward over the packed tokens, the losses at the final-norm states, backward.
 *
 *  Each projection is one matrix product over all of the device's tokens; weights are stored
 *  (out, in), so a projection reads them transposed: y (tokens, out) = x (tokens, in) W^T.
 *  Matrix products read the compute copy of the weights (`cw`), norms and the contrastive
 *  scalars the float32 masters (`w`); gradients (`g`) are float32.
 */
#include <stdlib.h>
#include <string.h>

#include "core.h"

/* Every buffer of a replica, with its size in bytes, in one list: taken and released alike. */
struct uform_buffer_t {
    void** pointer;
    size_t bytes;
};
typedef struct uform_buffer_t uform_buffer_t;

/* What the forward pass and pooling read comes first: inference takes that alone, with one block's activations. */
static size_t uform_replica_buffers(uform_replica_t* r, uform_layout_t const* layout, uform_plan_t const* plan,
                                    size_t choices, size_t statistics, int training, uform_buffer_t* list) {
    size_t act = uform_element_bytes(r->backend->activations), n = 0;
    size_t tokens = plan->tokens, segments = plan->segments, h = plan->hidden, wide = uform_mlp_ratio_k * h;
    size_t floats = sizeof(float), words = sizeof(uint32_t), total = layout->total;
#define UFORM_BUFFER(field, size) list[n].pointer = (void**)&(field), list[n++].bytes = (size)
    UFORM_BUFFER(r->weights, total * floats);
    if (r->backend->activations != uform_element_f32_k) UFORM_BUFFER(r->compute, total * act);
    for (uint32_t l = 0; l != (training ? r->depth : 1); ++l) {
        uform_block_activations_t* a = &r->blocks[l];
        UFORM_BUFFER(a->input, tokens * h * act);
        UFORM_BUFFER(a->rstd1, tokens * floats);
        UFORM_BUFFER(a->normed1, tokens * h * act);
        UFORM_BUFFER(a->qkv, tokens * 3 * h * act);
        UFORM_BUFFER(a->attended, tokens * h * act);
        UFORM_BUFFER(a->statistics, statistics * floats);
        UFORM_BUFFER(a->middle, tokens * h * act);
        UFORM_BUFFER(a->rstd2, tokens * floats);
        UFORM_BUFFER(a->normed2, tokens * h * act);
        UFORM_BUFFER(a->up, tokens * wide * act);
        UFORM_BUFFER(a->activated, tokens * wide * act);
    }
    UFORM_BUFFER(r->final_rstd, tokens * floats);
    UFORM_BUFFER(r->final, tokens * h * act);
    UFORM_BUFFER(r->pooled, segments * h * floats);
    UFORM_BUFFER(r->ids, tokens * words);
    UFORM_BUFFER(r->positions, tokens * words);
    UFORM_BUFFER(r->segments, segments * sizeof(uform_segment_t));
    /* The byte decoder's rows: training's masked and choice positions, or inference's choice positions. */
    size_t decoded = training ? tokens : segments;
    UFORM_BUFFER(r->masked, decoded * words);
    UFORM_BUFFER(r->masked_states, decoded * h * act);
    UFORM_BUFFER(r->logits, decoded * uform_bytes_k * act);
    UFORM_BUFFER(r->choice_offsets, (segments + 1) * words);
    UFORM_BUFFER(r->choice_bytes, segments * choices);
    UFORM_BUFFER(r->probabilities, segments * choices * floats);
    UFORM_BUFFER(r->late_vectors, tokens * r->late_width * act);
    UFORM_BUFFER(r->late_unit, tokens * r->late_width * floats);
    UFORM_BUFFER(r->media_values, tokens * layout->widest * floats);
    if (r->backend->activations != uform_element_f32_k) UFORM_BUFFER(r->media_compute, tokens * layout->widest * act);
    UFORM_BUFFER(r->media_rows, tokens * words);
    if (!training) return n;
    UFORM_BUFFER(r->gradients, total * floats);
    UFORM_BUFFER(r->first, total * floats);
    UFORM_BUFFER(r->second, total * floats);
    UFORM_BUFFER(r->output, tokens * h * act);
    UFORM_BUFFER(r->d_final, tokens * h * act);
    UFORM_BUFFER(r->d_stream, tokens * h * act);
    UFORM_BUFFER(r->d_hidden, tokens * h * act);
    UFORM_BUFFER(r->d_qkv, tokens * 3 * h * act);
    UFORM_BUFFER(r->d_wide, tokens * wide * act);
    UFORM_BUFFER(r->d_logits, tokens * uform_bytes_k * act);
    UFORM_BUFFER(r->d_pooled, segments * h * floats);
    UFORM_BUFFER(r->normalized, segments * h * floats);
    /* The scored temperatures and biases follow the scalars in one buffer: the stats read both in one copy. */
    UFORM_BUFFER(r->scalars, uform_scalars_k * sizeof(double) + 2 * (size_t)layout->temperature_groups * floats);
    UFORM_BUFFER(r->verdicts, uform_flights_k * sizeof(int32_t));
    UFORM_BUFFER(r->targets, tokens * words);
    UFORM_BUFFER(r->order, tokens * words);
    UFORM_BUFFER(r->order_offsets, (uform_vocabulary_k + 1) * words);
    UFORM_BUFFER(r->groups, segments * words);
    UFORM_BUFFER(r->cells, segments * segments);
    UFORM_BUFFER(r->cell_weights, segments * segments * floats);
    size_t late = plan->pairs != 0, edges = plan->pairs, width = late * r->late_width;
    UFORM_BUFFER(r->late_rows, late * tokens * words);
    UFORM_BUFFER(r->late_spans, late * segments * sizeof(uform_span_t));
    UFORM_BUFFER(r->late_queries, late * segments * words);
    UFORM_BUFFER(r->late_offsets, late * (segments + 1) * words);
    UFORM_BUFFER(r->late_documents, edges * words);
    UFORM_BUFFER(r->late_cells, edges);
    UFORM_BUFFER(r->late_weights, edges * floats);
    UFORM_BUFFER(r->d_late_unit, tokens * width * floats);
    UFORM_BUFFER(r->d_late_vectors, tokens * width * act);
    UFORM_BUFFER(r->choice_targets, segments * choices * floats);
    UFORM_BUFFER(r->media_predictions, tokens * layout->widest * act);
    UFORM_BUFFER(r->d_media_predictions, tokens * layout->widest * act);
#undef UFORM_BUFFER
    return n;
}

enum { uform_replica_buffers_k = 69 }; /* fixed buffers beside 11 per block */

uform_status_t uform_replica_init(uform_replica_t* replica, uform_executor_s const* executor,
                                  uform_layout_t const* layout, uform_config_t const* config, int training,
                                  char const** error) {
    uform_backend_t const* backend = executor->backend;
    uform_batch_shape_t const* batch = &config->given.batch;
    uform_late_interaction_t const* late = &config->given.late_interaction;
    uform_plan_t plan = {.tokens = (size_t)batch->max_rows_per_device * batch->max_columns_per_row,
                         .segments = batch->max_segments_per_device,
                         .columns = batch->max_columns_per_row,
                         .hidden = layout->hidden,
                         .heads = layout->heads,
                         .contrastive = training && config->given.objective != uform_objective_masked_k,
                         .pairs = training && late->weight > 0 ? config->given.contrastive.max_edges_per_device : 0,
                         .query_span = training && late->weight > 0 ? late->max_query_span : 0,
                         .widest = layout->widest,
                         .nondeterministic = config->given.determinism == uform_determinism_fast_k,
                         .layout = training ? layout : NULL};
    memset(replica, 0, sizeof(*replica));
    replica->backend = backend;
    replica->capacity_tokens = plan.tokens, replica->capacity_segments = plan.segments;
    replica->depth = layout->depth, replica->late_width = late->weight > 0 ? late->width : 0;
    uform_status_t status = backend->context_create(executor->device, &plan, &replica->context);
    if (status != uform_status_success_k) return uform_fail(error, status, "%s", uform_message());
    replica->blocks = calloc(layout->depth, sizeof(uform_block_activations_t));
    replica->buffers = malloc((uform_replica_buffers_k + 11 * (size_t)layout->depth) * sizeof(uform_buffer_t));
    if (!replica->blocks || !replica->buffers) {
        uform_replica_free(replica);
        return uform_fail(error, uform_status_out_of_memory_k, "no host memory for a replica of depth %u",
                          layout->depth);
    }
    size_t count = uform_replica_buffers(replica, layout, &plan, batch->max_choices_per_item,
                                         backend->statistics_floats(&plan), training, replica->buffers);
    size_t total = 0, asked = 0;
    for (size_t i = 0; i != count; ++i) total += replica->buffers[i].bytes;
    for (; replica->buffers_count != count && status == uform_status_success_k; ++replica->buffers_count) {
        uform_buffer_t const* buffer = &replica->buffers[replica->buffers_count];
        asked += buffer->bytes;
        status = backend->allocate(replica->context, buffer->bytes, buffer->pointer);
    }
    if (status != uform_status_success_k) {
        uform_replica_free(replica);
        return uform_fail(error, status,
                          "no %s memory for a replica of depth %u, hidden %zu over %zu tokens: %zu bytes in all, "
                          "failing at %zu",
                          backend->name, layout->depth, plan.hidden, plan.tokens, total, asked);
    }
    if (replica->scalars) replica->scored = (float*)(replica->scalars + uform_scalars_k);
    if (!replica->compute) replica->compute = replica->weights; /* float32 backends' products read the masters */
    if (!replica->media_compute) replica->media_compute = replica->media_values;
    /* Inference keeps no block's activations for a backward pass, so every block overwrites the first's in turn:
       a block reads its own input only before it writes the next block's, which is that same buffer. */
    for (uint32_t l = 1; !training && l < layout->depth; ++l) replica->blocks[l] = replica->blocks[0];
    if (!training) replica->output = replica->blocks[0].input;
    return uform_status_success_k;
}

uform_status_t uform_model_open(uform_executor_s const* executor, uform_trainer_init_vram_t const* given, int training,
                                uform_config_t* config, uform_layout_t* layout, uform_replica_t* replica,
                                uform_packed_t* packed, char const** error) {
    uform_status_t status = uform_config_derive(config, given, error);
    uform_trainer_init_vram_t const* c = &config->given;
    if (status == uform_status_success_k)
        status = uform_layout_init(layout, c, error);
    if (status == uform_status_success_k) status = uform_replica_init(replica, executor, layout, config, training, error);
    if (status == uform_status_success_k)
        status = uform_packed_init(packed, config, replica->backend, replica->context, error);
    return status;
}

void uform_model_close(uform_layout_t* layout, uform_replica_t* replica, uform_packed_t* packed) {
    uform_packed_free(packed);
    uform_replica_free(replica);
    uform_layout_free(layout);
}

size_t uform_replica_bytes(uform_replica_t const* replica) {
    size_t bytes = 0;
    for (size_t i = 0; i != replica->buffers_count; ++i) bytes += replica->buffers[i].bytes;
    return bytes;
}

uform_status_t uform_replica_upload_weights(uform_replica_t* replica, uform_layout_t const* layout,
                                            float const* weights) {
    uform_backend_t const* b = replica->backend;
    UFORM_TRY(b->upload(replica->context, replica->weights, weights, layout->total * sizeof(float)));
    return b->convert ? b->convert(replica->context, replica->compute, replica->weights, layout->total)
                      : uform_status_success_k;
}

void uform_replica_free(uform_replica_t* replica) {
    if (!replica->backend) return;
    for (size_t i = 0; i != replica->buffers_count; ++i)
        if (*replica->buffers[i].pointer) replica->backend->release(replica->context, *replica->buffers[i].pointer);
    free(replica->buffers);
    free(replica->blocks);
    if (replica->context) replica->backend->context_destroy(replica->context);
    memset(replica, 0, sizeof(*replica));
}

uform_terms_t uform_model_terms(uform_config_t const* config, uform_packed_t const* packed) {
    uform_trainer_init_vram_t const* c = &config->given;
    uform_terms_t terms = {.masked_ran = c->objective != uform_objective_contrastive_k && packed->masked_count,
                           .contrastive_ran = c->objective != uform_objective_masked_k && packed->contrastive_rows,
                           .choices_ran = c->choices.weight > 0 && packed->choices_count,
                           .late_ran = c->late_interaction.weight > 0 && packed->late_rows_counted,

                           .text_weight = c->masking.text_weight,
                           .choices_weight = c->choices.weight,
                           .late_weight = c->late_interaction.weight,
                           .media_weight = {c->masking.image_weight, c->masking.video_weight, c->masking.audio_weight}};
    for (int kind = 0; kind != uform_media_kinds_k; ++kind)
        terms.media_ran[kind] = c->objective != uform_objective_contrastive_k && packed->media_hidden[kind];
    return terms;
}

/* The packed batch travels to the device once per step; everything after reads the device's copy. */
uform_status_t uform_model_upload(uform_replica_t* r, uform_packed_t const* packed, int training) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    size_t tokens = packed->tokens_count, items = packed->segments_count, words = sizeof(uint32_t);
    UFORM_TRY(b->upload(x, r->ids, packed->ids, tokens * words));
    UFORM_TRY(b->upload(x, r->positions, packed->positions, tokens * words));
    UFORM_TRY(b->upload(x, r->segments, packed->segments, items * sizeof(uform_segment_t)));
    size_t choosing = packed->choices_count, offered = choosing ? packed->choice_offsets[choosing] : 0;
    if (choosing) {
        UFORM_TRY(b->upload(x, r->choice_offsets, packed->choice_offsets, (choosing + 1) * words));
        UFORM_TRY(b->upload(x, r->choice_bytes, packed->choice_bytes, offered));
        if (training) UFORM_TRY(b->upload(x, r->choice_targets, packed->choice_targets, offered * sizeof(float)));
    }
    /* Shown media tokens from the front, hidden ones (training only) from the back: each run one copy. */
    uform_media_runs_t last = uform_media_runs(packed, uform_media_kinds_k), first = uform_media_runs(packed, 0);
    size_t capacity = r->capacity_tokens, values = capacity * packed->widest;
    UFORM_TRY(b->upload(x, r->media_values, packed->media_values, last.shown_values * sizeof(float)));
    UFORM_TRY(b->upload(x, r->media_rows, packed->media_rows, last.shown_rows * words));
    if (training) {
        UFORM_TRY(b->upload(x, r->media_values + first.hidden_values, packed->media_values + first.hidden_values,
                            (values - first.hidden_values) * sizeof(float)));
        UFORM_TRY(b->upload(x, r->media_rows + first.hidden_rows, packed->media_rows + first.hidden_rows,
                            (capacity - first.hidden_rows) * words));
    }
    /* The positions the decoder reads: the masked ones (training only), then the choice positions. */
    size_t masked = training ? packed->masked_count : 0;
    UFORM_TRY(b->upload(x, r->masked, packed->masked, (masked + choosing) * words));
    if (!training) return uform_status_success_k;
    if (r->late_width && packed->late_rows_count) { /* a device of several scores rows that others' queries name */
        size_t queries = packed->late_queries_count, pairs = packed->late_pairs_count;
        UFORM_TRY(b->upload(x, r->late_rows, packed->late_rows, packed->late_rows_count * words));
        UFORM_TRY(b->upload(x, r->late_spans, packed->late_spans, packed->late_spans_count * sizeof(uform_span_t)));
        UFORM_TRY(b->upload(x, r->late_queries, packed->late_queries, queries * words));
        UFORM_TRY(b->upload(x, r->late_offsets, packed->late_offsets, (queries + 1) * words));
        UFORM_TRY(b->upload(x, r->late_documents, packed->late_documents, pairs * words));
        UFORM_TRY(b->upload(x, r->late_cells, packed->late_cells, pairs));
        UFORM_TRY(b->upload(x, r->late_weights, packed->late_weights, pairs * sizeof(float)));
    }
    UFORM_TRY(b->upload(x, r->targets, packed->targets, packed->masked_count * words));
    UFORM_TRY(b->upload(x, r->order, packed->order, tokens * words));
    UFORM_TRY(b->upload(x, r->order_offsets, packed->order_offsets, (uform_vocabulary_k + 1) * words));
    UFORM_TRY(b->upload(x, r->groups, packed->groups, items * words));
    UFORM_TRY(b->upload(x, r->cells, packed->cells, items * items));
    return b->upload(x, r->cell_weights, packed->weights, items * items * sizeof(float));
}

static uform_items_t uform_model_items(uform_replica_t const* r, uform_packed_t const* packed) {
    uform_items_t items = {r->segments, packed->segments, packed->segments_count, packed->longest};
    return items;
}

/* The compute copy of tensor `index`: an offset counted in elements of the backend's activations. */
static void const* uform_compute(uform_replica_t const* r, uform_layout_t const* layout, size_t index) {
    return (char const*)r->compute + layout->tensors[index].offset * uform_element_bytes(r->backend->activations);
}

static uform_status_t uform_model_forward(uform_replica_t* r, uform_layout_t const* layout,
                                          uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    float const* w = r->weights;
    uform_tensor_t const* t = layout->tensors;
    uform_element_t act = b->activations;
    uform_items_t items = uform_model_items(r, packed);
    size_t tokens = packed->tokens_count, h = layout->hidden, wide = uform_mlp_ratio_k * h;
    UFORM_TRY(b->embedding_forward(x, r->blocks[0].input, uform_compute(r, layout, layout->embedding), r->ids, tokens, h));
    /* A shown media token adds its kind's projection of its values to the media id's row. */
    size_t shown_values = uform_media_runs(packed, uform_media_kinds_k).shown_values;
    if (b->convert && shown_values) UFORM_TRY(b->convert(x, r->media_compute, r->media_values, shown_values));
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) {
        size_t shown = packed->media_shown[kind], width = layout->media_width[kind];
        if (!shown) continue;
        uform_media_runs_t runs = uform_media_runs(packed, kind);
        void* projected = r->blocks[0].normed1; /* free until the first block normalizes its input */
        void const* values = (char const*)r->media_compute + runs.shown_values * uform_element_bytes(act);
        UFORM_TRY(b->matmul(x, projected, NULL, values, uform_compute(r, layout, layout->media_projection[kind]), shown,
                            h, width, 0, 1, act));
        UFORM_TRY(b->scatter_rows(x, r->blocks[0].input, projected, r->media_rows + runs.shown_rows, shown, h));
    }
    for (uint32_t l = 0; l != layout->depth; ++l) {
        uform_block_activations_t* a = &r->blocks[l];
        uform_block_tensors_t const* block = &layout->blocks[l];
        void* next = l + 1 != layout->depth ? r->blocks[l + 1].input : r->output;
        UFORM_TRY(b->rmsnorm_forward(x, a->normed1, a->rstd1, a->input, w + t[block->attention_norm].offset, tokens, h));
        UFORM_TRY(b->matmul(x, a->qkv, NULL, a->normed1, uform_compute(r, layout, block->qkv), tokens, 3 * h, h, 0, 1, act));
        UFORM_TRY(b->rope_forward(x, a->qkv, r->positions, tokens, h));
        UFORM_TRY(b->attention_forward(x, a->attended, a->statistics, a->qkv, &items, tokens, h));
        UFORM_TRY(b->matmul(x, a->middle, a->input, a->attended, uform_compute(r, layout, block->out), tokens, h, h, 0, 1,
                            act));
        UFORM_TRY(b->rmsnorm_forward(x, a->normed2, a->rstd2, a->middle, w + t[block->mlp_norm].offset, tokens, h));
        void const* up = uform_compute(r, layout, block->up);
        if (b->matmul_gelu) UFORM_TRY(b->matmul_gelu(x, a->activated, a->up, a->normed2, up, tokens, wide, h));
        else {
            UFORM_TRY(b->matmul(x, a->up, NULL, a->normed2, up, tokens, wide, h, 0, 1, act));
            UFORM_TRY(b->gelu_forward(x, a->activated, a->up, tokens * wide));
        }
        UFORM_TRY(b->matmul(x, next, a->middle, a->activated, uform_compute(r, layout, block->down), tokens, h, wide, 0,
                            1, act));
    }
    return b->rmsnorm_forward(x, r->final, r->final_rstd, r->output, w + t[layout->final_norm].offset, tokens, h);
}

/*
 *  A head read the final states at `count` rows (gathered into masked_states) through `head`
 *  (width, hidden): its weights' gradient gains d_out^T states, and d_final gains d_out head at
 *  those rows.
 */
static uform_status_t uform_model_head_backward(uform_replica_t* r, uform_layout_t const* layout, size_t tensor,
                                                void const* d_out, uint32_t const* rows, size_t count, size_t width) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    size_t h = layout->hidden;
    float* d_head = r->gradients + layout->tensors[tensor].offset;
    UFORM_TRY(b->matmul(x, d_head, d_head, d_out, r->masked_states, width, h, count, 1, 0, uform_element_f32_k));
    UFORM_TRY(b->matmul(x, r->d_hidden, NULL, d_out, uform_compute(r, layout, tensor), count, h, width, 0, 0,
                        b->activations));
    return b->scatter_rows(x, r->d_final, r->d_hidden, rows, count, h);
}

/* The token head's vectors at the scored rows: `late_unit` holds them, `masked_states` the rows' states. */
static uform_status_t uform_model_late_forward(uform_replica_t* r, uform_layout_t const* layout,
                                               uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    size_t rows = packed->late_rows_count, width = r->late_width, h = layout->hidden;
    void const* head = uform_compute(r, layout, layout->token_head);
    /* The decoder's rows are done with their buffers: the stream (or the CPU's order) keeps them apart. */
    UFORM_TRY(b->gather_rows(x, r->masked_states, r->final, r->late_rows, rows, h));
    UFORM_TRY(b->matmul(x, r->late_vectors, NULL, r->masked_states, head, rows, width, h, 0, 1, b->activations));
    return b->normalize_rows(x, r->late_unit, r->late_vectors, rows, width);
}

/* From the token vectors' gradient in `d_late_unit` back into d_final, through the head at the rows' states. */
static uform_status_t uform_model_late_backward(uform_replica_t* r, uform_layout_t const* layout,
                                                uform_packed_t const* packed) {
    size_t rows = packed->late_rows_count, width = r->late_width;
    UFORM_TRY(r->backend->normalize_rows_backward(r->context, r->d_late_vectors, r->d_late_unit, r->late_unit,
                                                  r->late_vectors, rows, width));
    return uform_model_head_backward(r, layout, layout->token_head, r->d_late_vectors, r->late_rows, rows, width);
}

uform_status_t uform_model_late_term(uform_replica_t* r, void* context, uform_layout_t const* layout,
                                     uform_config_t const* config, double* loss, float* d_vectors,
                                     float const* vectors, size_t rows, uform_late_interaction_setup_t setup) {
    size_t late_t = layout->late_log_inverse_temperature, late_b = layout->late_bias;
    uform_tensor_t const* t = layout->tensors;
    uform_late_interaction_t const* late = &config->given.late_interaction;
    setup.form = late->pair_loss;
    return r->backend->late_interaction(context, loss, d_vectors, r->gradients + t[late_t].offset,
                                        r->gradients + t[late_b].offset, vectors, rows, late->width,
                                        r->weights + t[late_t].offset, r->weights + t[late_b].offset, &setup,
                                        late->weight);
}

uform_status_t uform_model_contrastive_term(uform_replica_t* r, void* context, uform_layout_t const* layout,
                                            uform_config_t const* config, double* loss, float* d_pooled,
                                            float* normalized, float const* pooled, uint8_t const* cells,
                                            float const* cell_weights, uint32_t const* groups, size_t count) {
    uform_backend_t const* b = r->backend;
    uform_tensor_t const* t = layout->tensors;
    uform_trainer_init_vram_t const* c = &config->given;
    uform_contrastive_setup_t setup = {.form = c->contrastive.pair_loss,
                                       .dimensions_count = c->contrastive.matryoshka_dimensions_count};
    memcpy(setup.dimensions, config->matryoshka, sizeof(setup.dimensions));
    size_t h = layout->hidden;
    UFORM_TRY(b->zero(context, d_pooled, count * h * sizeof(float)));
    return b->contrastive(context, loss, d_pooled, r->gradients + t[layout->log_inverse_temperature].offset,
                          r->gradients + t[layout->bias].offset, normalized, pooled,
                          r->weights + t[layout->log_inverse_temperature].offset, r->weights + t[layout->bias].offset,
                          cells, cell_weights, groups, count, h, &setup, 1);
}

/* A kind's decoder at its hidden tokens, regressing their normalized values, and the way back into d_final. */
static uform_status_t uform_model_media(uform_replica_t* r, uform_layout_t const* layout, uform_terms_t const* terms,
                                        uform_packed_t const* packed, int kind) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    size_t hidden = packed->media_hidden[kind], width = layout->media_width[kind], h = layout->hidden;
    uform_media_runs_t runs = uform_media_runs(packed, kind);
    uint32_t const* rows = r->media_rows + runs.hidden_rows;
    size_t decoder = layout->media_decoder[kind];
    UFORM_TRY(b->gather_rows(x, r->masked_states, r->final, rows, hidden, h));
    UFORM_TRY(b->matmul(x, r->media_predictions, NULL, r->masked_states, uform_compute(r, layout, decoder), hidden, width,
                        h, 0, 1, b->activations));
    UFORM_TRY(b->patch_loss(x, r->scalars + uform_scalar_media_loss_k + kind, r->d_media_predictions,
                            r->media_predictions, r->media_values + runs.hidden_values, hidden, width,
                            terms->media_weight[kind]));
    return uform_model_head_backward(r, layout, decoder, r->d_media_predictions, rows, hidden, width);
}

/* The byte decoder at the masked positions, then at the choice positions: one pass, each term scoring its rows. */
static uform_status_t uform_model_decoder(uform_replica_t* r, uform_layout_t const* layout,
                                          uform_config_t const* config, uform_packed_t const* packed,
                                          uform_terms_t const* terms) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    uform_element_t act = b->activations;
    size_t h = layout->hidden;
    size_t masked = config->given.objective != uform_objective_contrastive_k ? packed->masked_count : 0;
    size_t choosing = terms->choices_ran ? packed->choices_count : 0, decoded = masked + choosing;
    if (!decoded) return uform_status_success_k;
    void const* decoder = uform_compute(r, layout, layout->decoder);
    UFORM_TRY(b->gather_rows(x, r->masked_states, r->final, r->masked, decoded, h));
    UFORM_TRY(b->matmul(x, r->logits, NULL, r->masked_states, decoder, decoded, uform_bytes_k, h, 0, 1, act));
    if (masked)
        UFORM_TRY(b->cross_entropy(x, r->scalars + uform_scalar_masked_loss_k, r->d_logits, r->logits, r->targets,
                                   masked, uform_bytes_k, terms->text_weight));
    if (choosing) {
        size_t skip = masked * uform_bytes_k * uform_element_bytes(act);
        UFORM_TRY(b->choices(x, r->scalars + uform_scalar_choices_loss_k, (char*)r->d_logits + skip, NULL,
                             (char const*)r->logits + skip, r->choice_offsets, r->choice_bytes, r->choice_targets,
                             choosing, terms->choices_weight));
    }
    return uform_model_head_backward(r, layout, layout->decoder, r->d_logits, r->masked, decoded, uform_bytes_k);
}

/* The heads read the final-norm states and leave their gradient in d_final; their losses land in the scalars. */
static uform_status_t uform_model_losses(uform_replica_t* r, uform_layout_t const* layout,
                                         uform_config_t const* config, uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    uform_items_t items = uform_model_items(r, packed);
    size_t h = layout->hidden;
    UFORM_TRY(b->zero(x, r->d_final, packed->tokens_count * h * uform_element_bytes(b->activations)));
    uform_terms_t terms = uform_model_terms(config, packed);
    UFORM_TRY(uform_model_decoder(r, layout, config, packed, &terms));
    if (terms.late_ran) {
        uform_late_interaction_setup_t setup = {.spans = r->late_spans,
                                                .queries = r->late_queries,
                                                .offsets = r->late_offsets,
                                                .documents = r->late_documents,
                                                .cells = r->late_cells,
                                                .weights = r->late_weights,
                                                .count = packed->late_queries_count,
                                                .pairs = packed->late_pairs_count};
        UFORM_TRY(uform_model_late_forward(r, layout, packed));
        UFORM_TRY(uform_model_late_term(r, x, layout, config, r->scalars + uform_scalar_late_interaction_loss_k,
                                        r->d_late_unit, r->late_unit, packed->late_rows_count, setup));
        UFORM_TRY(uform_model_late_backward(r, layout, packed));
    }
    for (int kind = 0; kind != uform_media_kinds_k; ++kind)
        if (terms.media_ran[kind]) UFORM_TRY(uform_model_media(r, layout, &terms, packed, kind));
    UFORM_TRY(b->pool_forward(x, r->pooled, r->final, &items, h));
    if (config->given.objective != uform_objective_masked_k && packed->contrastive_rows) {
        UFORM_TRY(uform_model_contrastive_term(r, x, layout, config, r->scalars + uform_scalar_contrastive_loss_k,
                                               r->d_pooled, r->normalized, r->pooled, r->cells, r->cell_weights,
                                               r->groups, packed->segments_count));
        UFORM_TRY(b->pool_backward(x, r->d_final, r->d_pooled, &items, h));
    }
    return uform_status_success_k;
}

static uform_status_t uform_model_backward(uform_replica_t* r, uform_layout_t const* layout,
                                           uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    float const* w = r->weights;
    float* g = r->gradients;
    uform_tensor_t const* t = layout->tensors;
    uform_element_t act = b->activations, f32 = uform_element_f32_k;
    uform_items_t items = uform_model_items(r, packed);
    size_t tokens = packed->tokens_count, h = layout->hidden, wide = uform_mlp_ratio_k * h;
    UFORM_TRY(b->zero(x, r->d_stream, tokens * h * uform_element_bytes(act)));
    UFORM_TRY(b->rmsnorm_backward(x, r->d_stream, g + t[layout->final_norm].offset, r->d_final, r->output,
                                  w + t[layout->final_norm].offset, r->final_rstd, tokens, h));
    for (uint32_t l = layout->depth; l-- != 0;) {
        uform_block_activations_t const* a = &r->blocks[l];
        uform_block_tensors_t const* block = &layout->blocks[l];
        float *d_down = g + t[block->down].offset, *d_up = g + t[block->up].offset;
        float *d_out = g + t[block->out].offset, *d_qkv = g + t[block->qkv].offset;
        void const* down = uform_compute(r, layout, block->down);
        /* d_stream holds the gradient of the block's output; the residual passes it through unchanged. */
        UFORM_TRY(b->matmul(x, d_down, d_down, r->d_stream, a->activated, h, wide, tokens, 1, 0, f32));
        if (b->matmul_gelu_backward) UFORM_TRY(b->matmul_gelu_backward(x, r->d_wide, a->up, r->d_stream, down, tokens, wide, h));
        else {
            UFORM_TRY(b->matmul(x, r->d_wide, NULL, r->d_stream, down, tokens, wide, h, 0, 0, act));
            UFORM_TRY(b->gelu_backward(x, r->d_wide, r->d_wide, a->up, tokens * wide));
        }
        UFORM_TRY(b->matmul(x, d_up, d_up, r->d_wide, a->normed2, wide, h, tokens, 1, 0, f32));
        UFORM_TRY(b->matmul(x, r->d_hidden, NULL, r->d_wide, uform_compute(r, layout, block->up), tokens, h, wide, 0, 0, act));
        UFORM_TRY(b->rmsnorm_backward(x, r->d_stream, g + t[block->mlp_norm].offset, r->d_hidden, a->middle,
                                      w + t[block->mlp_norm].offset, a->rstd2, tokens, h));
        /* d_stream now holds the gradient of the middle of the block. */
        UFORM_TRY(b->matmul(x, d_out, d_out, r->d_stream, a->attended, h, h, tokens, 1, 0, f32));
        UFORM_TRY(b->matmul(x, r->d_hidden, NULL, r->d_stream, uform_compute(r, layout, block->out), tokens, h, h, 0, 0, act));
        /* The gradient of qkv before its rotary turn; every layer but the first of the pass has the same positions. */
        UFORM_TRY(b->attention_backward(x, r->d_qkv, r->d_hidden, a->attended, a->statistics, a->qkv, r->positions,
                                        l + 1 != layout->depth, &items, tokens, h));
        UFORM_TRY(b->matmul(x, d_qkv, d_qkv, r->d_qkv, a->normed1, 3 * h, h, tokens, 1, 0, f32));
        UFORM_TRY(b->matmul(x, r->d_hidden, NULL, r->d_qkv, uform_compute(r, layout, block->qkv), tokens, h, 3 * h, 0, 0,
                            act));
        UFORM_TRY(b->rmsnorm_backward(x, r->d_stream, g + t[block->attention_norm].offset, r->d_hidden, a->input,
                                      w + t[block->attention_norm].offset, a->rstd1, tokens, h));
    }
    /* The shown media tokens' rows of the input's gradient reach their kinds' projections. */
    size_t shown_rows = uform_media_runs(packed, uform_media_kinds_k).shown_rows;
    if (shown_rows) UFORM_TRY(b->gather_rows(x, r->d_hidden, r->d_stream, r->media_rows, shown_rows, h));
    for (int kind = 0; kind != uform_media_kinds_k; ++kind) {
        size_t shown = packed->media_shown[kind];
        if (!shown) continue;
        uform_media_runs_t runs = uform_media_runs(packed, kind);
        float* d_projection = g + t[layout->media_projection[kind]].offset;
        void const* d_rows = (char const*)r->d_hidden + runs.shown_rows * h * uform_element_bytes(act);
        void const* values = (char const*)r->media_compute + runs.shown_values * uform_element_bytes(act);
        UFORM_TRY(b->matmul(x, d_projection, d_projection, d_rows, values, h, layout->media_width[kind], shown, 1, 0,
                            f32));
    }
    return b->embedding_backward(x, g + t[layout->embedding].offset, r->d_stream, r->order, r->order_offsets, tokens, h,
                                 uform_vocabulary_k);
}

uform_status_t uform_model_embed(uform_replica_t* replica, uform_layout_t const* layout, uform_packed_t const* packed) {
    uform_items_t items = uform_model_items(replica, packed);
    UFORM_TRY(uform_model_upload(replica, packed, 0));
    UFORM_TRY(uform_model_forward(replica, layout, packed));
    return replica->backend->pool_forward(replica->context, replica->pooled, replica->final, &items, layout->hidden);
}

uform_status_t uform_model_embed_tokens(uform_replica_t* r, uform_layout_t const* layout, uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    size_t tokens = packed->tokens_count, width = r->late_width;
    UFORM_TRY(uform_model_upload(r, packed, 0));
    UFORM_TRY(uform_model_forward(r, layout, packed));
    UFORM_TRY(b->matmul(r->context, r->late_vectors, NULL, r->final, uform_compute(r, layout, layout->token_head), tokens,
                        width, layout->hidden, 0, 1, b->activations));
    return b->normalize_rows(r->context, r->late_unit, r->late_vectors, tokens, width);
}

uform_status_t uform_model_choose(uform_replica_t* r, uform_layout_t const* layout, uform_packed_t const* packed) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    size_t choosing = packed->choices_count, h = layout->hidden;
    UFORM_TRY(uform_model_upload(r, packed, 0));
    UFORM_TRY(uform_model_forward(r, layout, packed));
    UFORM_TRY(b->gather_rows(x, r->masked_states, r->final, r->masked, choosing, h));
    UFORM_TRY(b->matmul(x, r->logits, NULL, r->masked_states, uform_compute(r, layout, layout->decoder), choosing,
                        uform_bytes_k, h, 0, 1, b->activations));
    return b->choices(x, NULL, NULL, r->probabilities, r->logits, r->choice_offsets, r->choice_bytes, NULL, choosing, 1);
}

uform_status_t uform_model_finish(uform_replica_t* replica, uform_layout_t const* layout) {
    uform_backend_t const* b = replica->backend;
    void* x = replica->context;
    /* What the stats report as scored with: the values before this step's update. */
    size_t groups = layout->temperature_groups;
    UFORM_TRY(b->copy(x, replica->scored, replica->weights + layout->tensors[layout->log_inverse_temperature].offset,
                      groups * sizeof(float)));
    UFORM_TRY(b->copy(x, replica->scored + groups, replica->weights + layout->tensors[layout->bias].offset,
                      groups * sizeof(float)));
    return b->sum_squares(x, replica->scalars + uform_scalar_norm_squared_k, replica->gradients, layout->total);
}

uform_status_t uform_model_gradients(uform_replica_t* replica, uform_layout_t const* layout,
                                     uform_config_t const* config, uform_packed_t const* packed) {
    uform_backend_t const* b = replica->backend;
    void* x = replica->context;
    /* A term that does not run leaves its scalar stale: the core knows which ran and reads only those. */
    UFORM_TRY(b->zero(x, replica->gradients, layout->total * sizeof(float)));
    UFORM_TRY(uform_model_forward(replica, layout, packed));
    UFORM_TRY(uform_model_losses(replica, layout, config, packed));
    UFORM_TRY(uform_model_backward(replica, layout, packed));
    return uform_model_finish(replica, layout);
}

uform_status_t uform_model_device_forward(uform_replica_t* r, uform_layout_t const* layout,
                                          uform_config_t const* config, uform_packed_t const* packed,
                                          uform_terms_t const* terms) {
    uform_backend_t const* b = r->backend;
    void* x = r->context;
    uform_items_t items = uform_model_items(r, packed);
    size_t h = layout->hidden;
    UFORM_TRY(b->zero(x, r->gradients, layout->total * sizeof(float)));
    UFORM_TRY(uform_model_forward(r, layout, packed));
    UFORM_TRY(b->zero(x, r->d_final, packed->tokens_count * h * uform_element_bytes(b->activations)));
    UFORM_TRY(uform_model_decoder(r, layout, config, packed, terms));
    for (int kind = 0; kind != uform_media_kinds_k; ++kind)
        if (terms->media_ran[kind]) UFORM_TRY(uform_model_media(r, layout, terms, packed, kind));
    UFORM_TRY(b->pool_forward(x, r->pooled, r->final, &items, h));
    /* Last, as the token head's backward pass rereads the rows' states that the other heads' share. */
    return terms->late_ran ? uform_model_late_forward(r, layout, packed) : uform_status_success_k;
}

uform_status_t uform_model_device_backward(uform_replica_t* r, uform_layout_t const* layout,
                                           uform_packed_t const* packed, uform_terms_t const* terms) {
    uform_items_t items = uform_model_items(r, packed);
    if (terms->late_ran) UFORM_TRY(uform_model_late_backward(r, layout, packed));
    if (terms->contrastive_ran)
        UFORM_TRY(r->backend->pool_backward(r->context, r->d_final, r->d_pooled, &items, layout->hidden));
    return uform_model_backward(r, layout, packed);
}
