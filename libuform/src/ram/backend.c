/**
 *  @file   backend.c
 *  @brief  The CPU backend's devices, contexts and memory, which is plain host memory, and its
 *          table of operations.
 */
#include <stdlib.h>
#include <string.h>

#include "ram.h"

static uform_status_t uform_ram_device_open(uint32_t threads, void** device) {
    uform_ram_device_t* made = malloc(sizeof(uform_ram_device_t));
    if (!made) return uform_fail(NULL, uform_status_out_of_memory_k, "no memory for a RAM device");
    made->threads = threads ? (int)threads : 1;
    *device = made;
    return uform_status_success_k;
}

static void uform_ram_device_close(void* device) { free(device); }

/* Whole cache lines: vector loops may read a buffer's last line in full. A zero-byte request still
   gets a distinct pointer. */
static void* uform_ram_lines(size_t bytes) {
    size_t rounded = bytes ? (bytes + 63) / 64 * 64 : 64;
    void* pointer = NULL;
    if (rounded < bytes || posix_memalign(&pointer, 64, rounded)) return NULL;
    memset(pointer, 0, rounded);
    return pointer;
}

static void uform_ram_context_destroy(void* context) {
    uform_ram_context_t* made = context;
    if (!made) return;
    free(made->attention), free(made->contrastive), free(made->lists);
    free(made);
}

static uform_status_t uform_ram_context_create(void* device, uform_plan_t const* plan, void** context) {
    int threads = ((uform_ram_device_t const*)device)->threads;
    uform_ram_context_t* made = calloc(1, sizeof(uform_ram_context_t));
    if (!made) return uform_fail(NULL, uform_status_out_of_memory_k, "no memory for a RAM context");
    made->threads = threads, made->layout = plan->layout;
    made->items = plan->segments, made->hidden = plan->hidden;
    made->attention_floats = 2 * uform_ram_attention_block(plan->columns);
    size_t attention = (size_t)threads * made->attention_floats * sizeof(float);
    size_t contrastive = plan->contrastive ? uform_ram_contrastive_doubles(plan->segments, plan->hidden, threads) * sizeof(double) : 0;
    size_t lists = plan->contrastive ? 2 * plan->segments * (size_t)threads * sizeof(uint32_t) : 0;
    made->attention = uform_ram_lines(attention);
    made->contrastive = uform_ram_lines(contrastive);
    made->lists = uform_ram_lines(lists);
    if (!made->attention || !made->contrastive || !made->lists) {
        uform_ram_context_destroy(made);
        return uform_fail(NULL, uform_status_out_of_memory_k, "no memory for the CPU backend's scratch: %zu bytes",
                          attention + contrastive + lists);
    }
    *context = made;
    return uform_status_success_k;
}

static uform_status_t uform_ram_synchronize(void* context) {
    (void)context;
    return uform_status_success_k;
}

static size_t uform_ram_statistics_floats(uform_plan_t const* plan) { return plan->heads * plan->tokens; }

static uform_status_t uform_ram_allocate(void* context, size_t bytes, void** pointer) {
    (void)context;
    *pointer = uform_ram_lines(bytes);
    return *pointer ? uform_status_success_k
                    : uform_fail(NULL, uform_status_out_of_memory_k, "no memory for %zu bytes", bytes);
}

static void uform_ram_release(void* context, void* pointer) {
    (void)context;
    free(pointer);
}

static uform_status_t uform_ram_transfer(void* context, void* destination, void const* source, size_t bytes) {
    (void)context;
    if (bytes) memcpy(destination, source, bytes);
    return uform_status_success_k;
}

static uform_status_t uform_ram_zero(void* context, void* destination, size_t bytes) {
    (void)context;
    if (bytes) memset(destination, 0, bytes);
    return uform_status_success_k;
}

uform_backend_t const uform_ram_backend = {
    .name = "ram",
    .activations = uform_element_f32_k,
    .device_open = uform_ram_device_open,
    .device_close = uform_ram_device_close,
    .context_create = uform_ram_context_create,
    .context_destroy = uform_ram_context_destroy,
    .synchronize = uform_ram_synchronize,
    .statistics_floats = uform_ram_statistics_floats,
    .allocate = uform_ram_allocate,
    .release = uform_ram_release,
    .host_allocate = uform_ram_allocate, /* host memory is the device's */
    .host_release = uform_ram_release,
    .upload = uform_ram_transfer,
    .download = uform_ram_transfer,
    .copy = uform_ram_transfer,
    .zero = uform_ram_zero,
    .matmul = uform_ram_matmul,
    .embedding_forward = uform_ram_embedding_forward,
    .embedding_backward = uform_ram_embedding_backward,
    .rmsnorm_forward = uform_ram_rmsnorm_forward,
    .rmsnorm_backward = uform_ram_rmsnorm_backward,
    .rope_forward = uform_ram_rope_forward,
    .rope_backward = uform_ram_rope_backward,
    .attention_forward = uform_ram_attention_forward,
    .attention_backward = uform_ram_attention_backward,
    .gelu_forward = uform_ram_gelu_forward,
    .gelu_backward = uform_ram_gelu_backward,
    .gather_rows = uform_ram_gather_rows,
    .scatter_rows = uform_ram_scatter_rows,
    .cross_entropy = uform_ram_cross_entropy,
    .choices = uform_ram_choices,
    .normalize_rows = uform_ram_normalize_rows,
    .normalize_rows_backward = uform_ram_normalize_rows_backward,
    .late_interaction = uform_ram_late_interaction,
    .patch_loss = uform_ram_patch_loss,
    .pool_forward = uform_ram_pool_forward,
    .pool_backward = uform_ram_pool_backward,
    .contrastive = uform_ram_contrastive,
    .sum_squares = uform_ram_sum_squares,
    .adamw = uform_ram_adamw,
};
