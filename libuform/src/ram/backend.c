/**
 *  @file   backend.c
 *  @brief  The CPU backend's memory, which is plain host memory, and its table of operations.
 */
#include <stdlib.h>
#include <string.h>

#include "ram.h"

void* uform_ram_allocate(void* context, size_t bytes) {
    (void)context;
    /* Whole cache lines: `aligned_alloc` wants a multiple of the alignment, and vector loops
     * may read a tensor's last line in full. A zero-byte request still gets a distinct pointer. */
    size_t rounded = bytes ? (bytes + 63) / 64 * 64 : 64;
    if (rounded < bytes) return NULL;
    void* pointer = aligned_alloc(64, rounded);
    if (pointer) memset(pointer, 0, rounded);
    return pointer;
}

void uform_ram_release(void* context, void* pointer) {
    (void)context;
    free(pointer);
}

void uform_ram_upload(void* context, void* destination, void const* source, size_t bytes) {
    (void)context;
    if (bytes) memcpy(destination, source, bytes);
}

void uform_ram_download(void* context, void* destination, void const* source, size_t bytes) {
    (void)context;
    if (bytes) memcpy(destination, source, bytes);
}

void uform_ram_zero(void* context, void* destination, size_t bytes) {
    (void)context;
    if (bytes) memset(destination, 0, bytes);
}

uform_backend_t const uform_ram_backend = {
    .name = "ram",
    .allocate = uform_ram_allocate,
    .release = uform_ram_release,
    .upload = uform_ram_upload,
    .download = uform_ram_download,
    .zero = uform_ram_zero,
    .copy = uform_ram_upload, /* host memory: a copy within the backend is the same memcpy */
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
    .pool_forward = uform_ram_pool_forward,
    .pool_backward = uform_ram_pool_backward,
    .contrastive = uform_ram_contrastive,
    .sum_squares = uform_ram_sum_squares,
    .adamw = uform_ram_adamw,
};
