/**
 *  @file   attention.cpp
 *  @brief  Bidirectional attention within each item of the packed stream, forward and backward:
 *          the library's own kernels on Hopper (`attention_hopper.cuh`, launched from
 *          `attention.cu`), or cuDNN's fused attention over ragged (per-item) offsets elsewhere and
 *          where `UFORM_HOPPER_ATTENTION=0` asks. Host code only, so the frontend's heavy headers pass
 *          through the host compiler once; `attention.cu` holds the device side.
 *
 *  The own kernels keep each query's log-sum-exp as the CPU does, (heads, tokens), and need no
 *  graphs, workspace or item offsets; the rest of this file is cuDNN's.
 *
 *  The packed stream is cuDNN's "THD" layout: qkv (tokens, 3, heads, 64) holds each item's tokens
 *  one after another, so item b's queries, keys and values start `start_b * 3 hidden` elements in,
 *  and its output `start_b * hidden`. Each item is one batch entry of cuDNN's graph, its length a
 *  padding mask, the graph's sequence length the plan's longest item. The statistics cuDNN keeps
 *  for the backward pass (each row's log-sum-exp) are padded: (items, heads, columns) floats.
 *
 *  A graph is built per number of items, on first use, and kept: building one costs from tens of
 *  milliseconds to a second, so a run whose steps carry the same number of items builds one pair.
 *  Its workspace is taken then, the one allocation an operation makes, once. The backward graph
 *  is cuDNN's deterministic algorithm (the same inputs give the same bits) unless the plan gives
 *  that up: the faster one adds the queries' gradients with atomics, in an order that varies.
 */
#include <cudnn.h>

#include <cudnn_frontend.h>

#include <map>
#include <memory>

#include "vram.h"

namespace fe = cudnn_frontend;

namespace {

enum : int64_t {
    uid_q = 1, uid_k, uid_v, uid_o, uid_stats, uid_seq_q, uid_seq_kv, uid_ragged_qkv, uid_ragged_o,
    uid_d_o, uid_d_q, uid_d_k, uid_d_v,
};

struct uform_vram_attention_graphs_t {
    std::shared_ptr<fe::graph::Graph> forward, backward;
};

struct uform_vram_attention_t {
    void* hopper = nullptr; /* the library's own kernels run (`uform_vram_hopper_attention`): cuDNN is not used */
    cudnnHandle_t handle = nullptr;
    std::map<size_t, uform_vram_attention_graphs_t> graphs; /* by number of items */
    void* workspace = nullptr; /* cuDNN's, within the planned scratch, unless a graph asks for more */
    size_t workspace_bytes = 0;
    void* grown = nullptr; /* a larger workspace taken when a later graph needs one */
    int32_t* lengths = nullptr;  /* (segments) */
    int64_t* ragged_qkv = nullptr; /* (segments + 1) */
    int64_t* ragged_o = nullptr;   /* (segments + 1) */
    /* The items the three above were last computed for, each one's start and length (segments x 2): a step's
       layers share them, so a step computes them once, not once a layer. None (`known_count` 0) once that
       computation failed. */
    uint32_t* known = nullptr;
    size_t known_count = 0, known_hidden = 0;
};

size_t uform_vram_attention_metadata_bytes(size_t segments) {
    return (segments * sizeof(int32_t) + 255) / 256 * 256 + 2 * ((segments + 1) * sizeof(int64_t) + 255) / 256 * 256;
}

uform_status_t uform_vram_attention_failed(fe::error_t error, char const* stage) {
    return uform_vram_fail(NULL, uform_status_device_k, "cuDNN attention, %s: %s", stage, error.get_message().c_str());
}

/* The tensors every graph shares: item lengths and the ragged offsets of the packed stream. */
std::shared_ptr<fe::graph::Tensor_attributes> uform_vram_qkv_tensor(std::shared_ptr<fe::graph::Graph>& graph,
                                                                    int64_t uid, int64_t items, int64_t heads,
                                                                    int64_t columns,
                                                                    std::shared_ptr<fe::graph::Tensor_attributes> ragged) {
    int64_t row = 3 * heads * uform_head_width_k;
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_uid(uid)
                             .set_dim({items, heads, columns, uform_head_width_k})
                             .set_stride({columns * row, uform_head_width_k, row, 1})
                             .set_ragged_offset(ragged));
}

void uform_vram_output_layout(std::shared_ptr<fe::graph::Tensor_attributes> tensor, int64_t uid, int64_t items,
                              int64_t heads, int64_t columns, std::shared_ptr<fe::graph::Tensor_attributes> ragged,
                              int64_t row) {
    tensor->set_uid(uid)
        .set_output(true)
        .set_dim({items, heads, columns, uform_head_width_k})
        .set_stride({columns * row, uform_head_width_k, row, 1})
        .set_ragged_offset(ragged);
}

uform_status_t uform_vram_attention_build(uform_vram_context_t* context, uform_vram_attention_t* state,
                                          size_t count, uform_vram_attention_graphs_t** built) {
    auto found = state->graphs.find(count);
    if (found != state->graphs.end()) {
        *built = &found->second;
        return uform_status_success_k;
    }
    int64_t items = (int64_t)count, heads = (int64_t)context->plan.heads, columns = (int64_t)context->plan.columns;
    int64_t hidden = heads * uform_head_width_k;
    uform_vram_attention_graphs_t graphs;
    for (int backward = 0; backward != 2; ++backward) {
        auto graph = std::make_shared<fe::graph::Graph>();
        graph->set_io_data_type(fe::DataType_t::BFLOAT16)
            .set_intermediate_data_type(fe::DataType_t::FLOAT)
            .set_compute_data_type(fe::DataType_t::FLOAT);
        auto lengths = [&](int64_t uid) {
            return graph->tensor(fe::graph::Tensor_attributes()
                                     .set_uid(uid)
                                     .set_dim({items, 1, 1, 1})
                                     .set_stride({1, 1, 1, 1})
                                     .set_data_type(fe::DataType_t::INT32));
        };
        auto offsets = [&](int64_t uid) {
            return graph->tensor(fe::graph::Tensor_attributes()
                                     .set_uid(uid)
                                     .set_dim({items + 1, 1, 1, 1})
                                     .set_stride({1, 1, 1, 1})
                                     .set_data_type(fe::DataType_t::INT64));
        };
        auto seq_q = lengths(uid_seq_q), seq_kv = lengths(uid_seq_kv);
        auto ragged_qkv = offsets(uid_ragged_qkv), ragged_o = offsets(uid_ragged_o);
        auto q = uform_vram_qkv_tensor(graph, uid_q, items, heads, columns, ragged_qkv);
        auto k = uform_vram_qkv_tensor(graph, uid_k, items, heads, columns, ragged_qkv);
        auto v = uform_vram_qkv_tensor(graph, uid_v, items, heads, columns, ragged_qkv);
        if (!backward) {
            auto options = fe::graph::SDPA_attributes()
                               .set_generate_stats(true)
                               .set_attn_scale(0.125f)
                               .set_padding_mask(true)
                               .set_seq_len_q(seq_q)
                               .set_seq_len_kv(seq_kv);
            auto [o, stats] = graph->sdpa(q, k, v, options);
            uform_vram_output_layout(o, uid_o, items, heads, columns, ragged_o, hidden);
            stats->set_uid(uid_stats).set_output(true).set_data_type(fe::DataType_t::FLOAT);
        } else {
            auto o = graph->tensor(fe::graph::Tensor_attributes()
                                       .set_uid(uid_o)
                                       .set_dim({items, heads, columns, uform_head_width_k})
                                       .set_stride({columns * hidden, uform_head_width_k, hidden, 1})
                                       .set_ragged_offset(ragged_o));
            auto d_o = graph->tensor(fe::graph::Tensor_attributes()
                                         .set_uid(uid_d_o)
                                         .set_dim({items, heads, columns, uform_head_width_k})
                                         .set_stride({columns * hidden, uform_head_width_k, hidden, 1})
                                         .set_ragged_offset(ragged_o));
            auto stats = graph->tensor(fe::graph::Tensor_attributes()
                                           .set_uid(uid_stats)
                                           .set_dim({items, heads, columns, 1})
                                           .set_stride({heads * columns, columns, 1, 1})
                                           .set_data_type(fe::DataType_t::FLOAT));
            auto options = fe::graph::SDPA_backward_attributes()
                               .set_attn_scale(0.125f)
                               .set_padding_mask(true)
                               .set_seq_len_q(seq_q)
                               .set_seq_len_kv(seq_kv)
                               .set_deterministic_algorithm(!context->plan.nondeterministic);
            auto [d_q, d_k, d_v] = graph->sdpa_backward(q, k, v, o, d_o, stats, options);
            uform_vram_output_layout(d_q, uid_d_q, items, heads, columns, ragged_qkv, 3 * hidden);
            uform_vram_output_layout(d_k, uid_d_k, items, heads, columns, ragged_qkv, 3 * hidden);
            uform_vram_output_layout(d_v, uid_d_v, items, heads, columns, ragged_qkv, 3 * hidden);
        }
        fe::error_t error = graph->validate();
        if (error.is_good()) error = graph->build_operation_graph(state->handle);
        if (error.is_good()) error = graph->create_execution_plans({fe::HeurMode_t::A});
        if (error.is_good()) error = graph->check_support(state->handle);
        if (error.is_good()) error = graph->build_plans(state->handle);
        if (error.is_bad()) return uform_vram_attention_failed(error, backward ? "building the backward graph" : "building the forward graph");
        int64_t workspace = 0;
        error = graph->get_workspace_size(workspace);
        if (error.is_bad()) return uform_vram_attention_failed(error, "sizing the workspace");
        if ((size_t)workspace > state->workspace_bytes) {
            /* Rare: a graph for fewer items than planned asking for more room. Taken once and kept. */
            void* grown = nullptr;
            cudaStreamSynchronize(context->stream);
            uform_status_t status = uform_vram_check(cudaMalloc(&grown, (size_t)workspace), "cudaMalloc (attention workspace)");
            if (status != uform_status_success_k) return status;
            if (state->grown) cudaFree(state->grown);
            state->grown = state->workspace = grown, state->workspace_bytes = (size_t)workspace;
        }
        (backward ? graphs.backward : graphs.forward) = graph;
    }
    *built = &(state->graphs[count] = graphs);
    return uform_status_success_k;
}

uform_status_t uform_vram_attention_planned(uform_vram_context_t* context, uform_items_t const* items, size_t tokens,
                                            size_t hidden) {
    uform_plan_t const* plan = &context->plan;
    if (items->count > plan->segments || items->longest > plan->columns || tokens > plan->tokens ||
        hidden > plan->heads * uform_head_width_k)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k,
                               "attention: %zu items up to %zu tokens long, %zu tokens of %zu, exceed the plan of %zu "
                               "items of %zu, %zu tokens of %zu",
                               items->count, items->longest, tokens, hidden, plan->segments, plan->columns,
                               plan->tokens, plan->heads * uform_head_width_k);
    return uform_status_success_k;
}

uform_status_t uform_vram_attention_prepare(uform_vram_context_t* context, uform_items_t const* items, size_t hidden,
                                            uform_vram_attention_graphs_t** graphs) {
    uform_vram_attention_t* state = (uform_vram_attention_t*)context->attention;
    uform_status_t status = uform_vram_attention_build(context, state, items->count, graphs);
    if (status != uform_status_success_k) return status;
    bool same = state->known_count == items->count && state->known_hidden == hidden;
    for (size_t i = 0; same && i != items->count; ++i)
        same = state->known[2 * i] == items->host_segments[i].start &&
               state->known[2 * i + 1] == items->host_segments[i].length;
    if (same) return uform_status_success_k;
    state->known_count = 0;
    status = uform_vram_attention_items(context, state->lengths, state->ragged_qkv, state->ragged_o, items, hidden);
    if (status != uform_status_success_k) return status;
    for (size_t i = 0; i != items->count; ++i)
        state->known[2 * i] = items->host_segments[i].start, state->known[2 * i + 1] = items->host_segments[i].length;
    state->known_count = items->count, state->known_hidden = hidden;
    return uform_status_success_k;
}

/* Whether the items cover the stream's tokens without a gap: then every row of an output is written. */
bool uform_vram_items_cover(uform_items_t const* items, size_t tokens) {
    size_t next = 0;
    for (size_t i = 0; i != items->count; ++i) {
        if (items->host_segments[i].start != next) return false;
        next += items->host_segments[i].length;
    }
    return next == tokens;
}

} // namespace

/* cuDNN's padded (items, heads, columns), or the own kernels' (heads, tokens): whichever runs, it fits. */
size_t uform_vram_statistics_floats(uform_plan_t const* plan) {
    size_t padded = plan->segments * plan->heads * plan->columns, packed = plan->heads * plan->tokens;
    return padded > packed ? padded : packed;
}

uform_status_t uform_vram_attention_open(uform_vram_context_t* context) {
    uform_vram_attention_t* state = new (std::nothrow) uform_vram_attention_t();
    if (!state) return uform_vram_fail(NULL, uform_status_out_of_memory_k, "no memory for cuDNN's attention state");
    context->attention = state;
    state->hopper = uform_vram_hopper_attention(context);
    cudnnStatus_t created = cudnnCreate(&state->handle);
    if (created != CUDNN_STATUS_SUCCESS)
        return uform_vram_fail(NULL, uform_status_device_k, "cudnnCreate: %s", cudnnGetErrorString(created));
    cudnnSetStream(state->handle, context->stream);
    size_t segments = context->plan.segments;
    state->known = new (std::nothrow) uint32_t[2 * (segments ? segments : 1)];
    if (!state->known) return uform_vram_fail(NULL, uform_status_out_of_memory_k, "no memory for the attention's items");
    void* metadata = nullptr;
    uform_status_t status = uform_vram_check(cudaMalloc(&metadata, uform_vram_attention_metadata_bytes(segments)),
                                             "cudaMalloc (attention offsets)");
    if (status != uform_status_success_k) return status;
    char* cursor = (char*)metadata;
    state->lengths = (int32_t*)cursor, cursor += (segments * sizeof(int32_t) + 255) / 256 * 256;
    state->ragged_qkv = (int64_t*)cursor, cursor += ((segments + 1) * sizeof(int64_t) + 255) / 256 * 256;
    state->ragged_o = (int64_t*)cursor;
    return uform_status_success_k;
}

void uform_vram_attention_close(uform_vram_context_t* context) {
    uform_vram_attention_t* state = (uform_vram_attention_t*)context->attention;
    if (!state) return;
    state->graphs.clear();
    if (state->lengths) cudaFree(state->lengths);
    if (state->grown) cudaFree(state->grown);
    if (state->handle) cudnnDestroy(state->handle);
    delete[] state->known;
    delete state;
    context->attention = nullptr;
}

uform_status_t uform_vram_attention_forward(void* context_, void* out, float* statistics, void const* qkv,
                                            uform_items_t const* items, size_t tokens, size_t hidden) {
    uform_vram_context_t* context = uform_vram(context_);
    if (!items->count) return uform_status_success_k;
    uform_vram_attention_t* state = (uform_vram_attention_t*)context->attention;
    uform_status_t status = uform_vram_attention_planned(context, items, tokens, hidden);
    if (status != uform_status_success_k) return status;
    if (state->hopper)
        return uform_vram_hopper_attention_forward(context, state->hopper, out, statistics, qkv, items, tokens, hidden);
    uform_vram_attention_graphs_t* graphs;
    status = uform_vram_attention_prepare(context, items, hidden, &graphs);
    if (status != uform_status_success_k) return status;
    uform_bf16_t* base = (uform_bf16_t*)qkv;
    std::unordered_map<int64_t, void*> pack = {
        {uid_q, base}, {uid_k, base + hidden}, {uid_v, base + 2 * hidden}, {uid_o, out}, {uid_stats, statistics},
        {uid_seq_q, state->lengths}, {uid_seq_kv, state->lengths}, {uid_ragged_qkv, state->ragged_qkv},
        {uid_ragged_o, state->ragged_o}};
    fe::error_t error = graphs->forward->execute(state->handle, pack, state->workspace);
    if (error.is_bad()) return uform_vram_attention_failed(error, "forward");
    return uform_vram_launched("cuDNN attention forward");
}

uform_status_t uform_vram_attention_backward(void* context_, void* d_qkv, void const* d_out, void const* out,
                                             float const* statistics, void const* qkv, uint32_t const* positions,
                                             int same_positions, uform_items_t const* items, size_t tokens,
                                             size_t hidden) {
    uform_vram_context_t* context = uform_vram(context_);
    uform_status_t status = uform_status_success_k;
    /* cuDNN writes the rows of items alone; the contract writes every row, so gaps are zeroed first. */
    if (!uform_vram_items_cover(items, tokens))
        status = uform_vram_check(cudaMemsetAsync(d_qkv, 0, tokens * 3 * hidden * sizeof(uform_bf16_t), context->stream),
                                  "cudaMemsetAsync (attention gradients)");
    if (status != uform_status_success_k || !items->count) return status;
    uform_vram_attention_t* state = (uform_vram_attention_t*)context->attention;
    status = uform_vram_attention_planned(context, items, tokens, hidden);
    if (status != uform_status_success_k) return status;
    if (state->hopper)
        return uform_vram_hopper_attention_backward(context, state->hopper, d_qkv, d_out, out, statistics, qkv,
                                                    positions, same_positions, items, tokens, hidden);
    uform_vram_attention_graphs_t* graphs;
    status = uform_vram_attention_prepare(context, items, hidden, &graphs);
    if (status != uform_status_success_k) return status;
    uform_bf16_t *base = (uform_bf16_t*)qkv, *d_base = (uform_bf16_t*)d_qkv;
    std::unordered_map<int64_t, void*> pack = {
        {uid_q, base}, {uid_k, base + hidden}, {uid_v, base + 2 * hidden}, {uid_o, (void*)out},
        {uid_d_o, (void*)d_out}, {uid_stats, (void*)statistics}, {uid_d_q, d_base}, {uid_d_k, d_base + hidden},
        {uid_d_v, d_base + 2 * hidden}, {uid_seq_q, state->lengths}, {uid_seq_kv, state->lengths},
        {uid_ragged_qkv, state->ragged_qkv}, {uid_ragged_o, state->ragged_o}};
    fe::error_t error = graphs->backward->execute(state->handle, pack, state->workspace);
    if (error.is_bad()) return uform_vram_attention_failed(error, "backward");
    status = uform_vram_launched("cuDNN attention backward");
    if (status != uform_status_success_k || !positions) return status;
    return uform_vram_rope_backward(context, d_qkv, positions, tokens, hidden);
}
