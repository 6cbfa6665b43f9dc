/**
 *  @file   backend.cu
 *  @brief  The CUDA backend's devices, contexts and memory, its table of operations, and the
 *          entry point `libuform.so` looks up when a VRAM executor is first asked for.
 *
 *  A context is one replica on one GPU: its own stream, cuBLASLt and cuDNN handles, and the
 *  scratch every operation planned for. Operations enqueue on the stream and return; the core
 *  waits once per step, in `synchronize`, which is also where a kernel's failure surfaces.
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "vram.h"

uform_fail_t uform_vram_fail = nullptr;
bool uform_vram_dependent_launches = true;

namespace {

uform_status_t uform_vram_device_open(uint32_t ordinal, void** device) {
    int count = 0;
    uform_status_t status = uform_vram_check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (status != uform_status_success_k) return status;
    if (ordinal == UINT32_MAX) { /* "every visible device": one, until the mesh spreads a step over several */
        if (count != 1)
            return uform_vram_fail(NULL, uform_status_unsupported_k,
                                   "devices: %d GPUs are visible; this build trains on one: name it, e.g. devices=[0]",
                                   count);
        ordinal = 0;
    }
    if ((int)ordinal >= count)
        return uform_vram_fail(NULL, uform_status_invalid_argument_k, "devices[0]: %u is not below the %d visible GPUs",
                               ordinal, count);
    cudaDeviceProp properties;
    status = uform_vram_check(cudaGetDeviceProperties(&properties, (int)ordinal), "cudaGetDeviceProperties");
    if (status != uform_status_success_k) return status;
    if (properties.major < 9)
        return uform_vram_fail(NULL, uform_status_unsupported_k,
                               "devices[0]: %s is compute capability %d.%d; this build runs on 9.0 (Hopper) and newer",
                               properties.name, properties.major, properties.minor);
    uform_vram_device_t* made = new (std::nothrow) uform_vram_device_t();
    if (!made) return uform_vram_fail(NULL, uform_status_out_of_memory_k, "no memory for a VRAM device");
    made->ordinal = (int)ordinal;
    char const* dependent = std::getenv("UFORM_DEPENDENT_LAUNCHES");
    uform_vram_dependent_launches = !(dependent && !std::strcmp(dependent, "0"));
    made->multiprocessors = properties.multiProcessorCount;
    std::snprintf(made->name, sizeof(made->name), "%s", properties.name);
    *device = made;
    return uform_status_success_k;
}

void uform_vram_device_close(void* device) { delete (uform_vram_device_t*)device; }

void uform_vram_context_destroy(void* context_) {
    uform_vram_context_t* context = uform_vram(context_);
    if (!context) return;
    cudaSetDevice(context->ordinal);
    if (context->stream) cudaStreamSynchronize(context->stream);
    uform_vram_attention_close(context);
    uform_vram_matmul_close(context);
    if (context->scratch[0]) cudaFree(context->scratch[0]); /* one allocation behind every region */
    for (int slot = 0; slot != uform_fences_k; ++slot)
        if (context->fences[slot]) cudaEventDestroy(context->fences[slot]);
    if (context->stream) cudaStreamDestroy(context->stream);
    delete context;
}

uform_status_t uform_vram_context_create(void* device_, uform_plan_t const* plan, void** made) {
    uform_vram_device_t const* device = (uform_vram_device_t const*)device_;
    uform_status_t status = uform_vram_check(cudaSetDevice(device->ordinal), "cudaSetDevice");
    if (status != uform_status_success_k) return status;
    uform_vram_context_t* context = new (std::nothrow) uform_vram_context_t();
    if (!context) return uform_vram_fail(NULL, uform_status_out_of_memory_k, "no memory for a VRAM context");
    context->ordinal = device->ordinal, context->multiprocessors = device->multiprocessors;
    context->plan = *plan;
    status = uform_vram_check(cudaStreamCreateWithFlags(&context->stream, cudaStreamNonBlocking), "cudaStreamCreate");
    for (int slot = 0; slot != uform_fences_k && status == uform_status_success_k; ++slot)
        status = uform_vram_check(cudaEventCreateWithFlags(&context->fences[slot], cudaEventDisableTiming),
                                  "cudaEventCreate (fence)");
    /* Each region starts on a 256-byte boundary, as cuBLASLt and vector loads want. */
    size_t (*sizes[uform_vram_scratch_count_k])(uform_plan_t const*) = {
        uform_vram_blas_scratch,   uform_vram_attention_scratch,   uform_vram_rmsnorm_scratch,
        uform_vram_reduce_scratch, uform_vram_contrastive_scratch, uform_vram_adamw_scratch,
        uform_vram_late_interaction_scratch};
    size_t total = 0;
    for (int region = 0; region != uform_vram_scratch_count_k; ++region)
        context->scratch_bytes[region] = sizes[region](plan), total += (context->scratch_bytes[region] + 255) / 256 * 256;
    void* scratch = nullptr;
    if (status == uform_status_success_k) status = uform_vram_check(cudaMalloc(&scratch, total ? total : 256), "cudaMalloc (scratch)");
    if (status != uform_status_success_k) {
        uform_vram_context_destroy(context);
        return uform_vram_fail(NULL, status, "no GPU memory for the backend's scratch: %zu bytes (%s)", total,
                               cudaGetErrorString(cudaErrorMemoryAllocation));
    }
    char* cursor = (char*)scratch;
    for (int region = 0; region != uform_vram_scratch_count_k; ++region)
        context->scratch[region] = cursor, cursor += (context->scratch_bytes[region] + 255) / 256 * 256;
    status = uform_vram_matmul_open(context);
    if (status == uform_status_success_k) status = uform_vram_attention_open(context);
    if (status == uform_status_success_k && plan->layout) status = uform_vram_adamw_plan(context);
    if (status != uform_status_success_k) {
        uform_vram_context_destroy(context);
        return status;
    }
    *made = context;
    return uform_status_success_k;
}

uform_status_t uform_vram_synchronize(void* context) {
    return uform_vram_check(cudaStreamSynchronize(uform_vram(context)->stream), "a queued GPU operation");
}

uform_status_t uform_vram_allocate(void* context, size_t bytes, void** pointer) {
    cudaSetDevice(uform_vram(context)->ordinal);
    *pointer = nullptr;
    cudaError_t error = cudaMalloc(pointer, bytes ? bytes : 1);
    if (error != cudaSuccess) {
        (void)cudaGetLastError();
        size_t free_bytes = 0, total_bytes = 0;
        cudaMemGetInfo(&free_bytes, &total_bytes);
        return uform_vram_fail(NULL, uform_status_out_of_memory_k,
                               "cudaMalloc: %zu bytes asked, %zu of %zu free on GPU %d (%s)", bytes, free_bytes,
                               total_bytes, uform_vram(context)->ordinal, cudaGetErrorString(error));
    }
    return uform_vram_check(cudaMemsetAsync(*pointer, 0, bytes, uform_vram(context)->stream), "cudaMemsetAsync");
}

void uform_vram_release(void* context, void* pointer) {
    (void)context;
    cudaFree(pointer);
}

uform_status_t uform_vram_host_allocate(void* context, size_t bytes, void** pointer) {
    (void)context;
    *pointer = nullptr;
    cudaError_t error = cudaMallocHost(pointer, bytes ? bytes : 1);
    if (error != cudaSuccess) {
        (void)cudaGetLastError();
        return uform_vram_fail(NULL, uform_status_out_of_memory_k, "cudaMallocHost: %zu bytes of pinned memory (%s)",
                               bytes, cudaGetErrorString(error));
    }
    std::memset(*pointer, 0, bytes);
    return uform_status_success_k;
}

void uform_vram_host_release(void* context, void* pointer) {
    (void)context;
    cudaFreeHost(pointer);
}

uform_status_t uform_vram_upload(void* context, void* destination, void const* source, size_t bytes) {
    if (!bytes) return uform_status_success_k;
    return uform_vram_check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyHostToDevice, uform_vram(context)->stream),
                            "cudaMemcpyAsync (upload)");
}

uform_status_t uform_vram_download(void* context, void* destination, void const* source, size_t bytes) {
    if (!bytes) return uform_status_success_k;
    cudaStream_t stream = uform_vram(context)->stream;
    uform_status_t status = uform_vram_check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToHost, stream),
                                             "cudaMemcpyAsync (download)");
    return status == uform_status_success_k ? uform_vram_check(cudaStreamSynchronize(stream), "a queued GPU operation")
                                            : status;
}

uform_status_t uform_vram_fence(void* context, unsigned slot) {
    return uform_vram_check(cudaEventRecord(uform_vram(context)->fences[slot], uform_vram(context)->stream),
                            "cudaEventRecord (fence)");
}

uform_status_t uform_vram_fence_wait(void* context, unsigned slot) {
    return uform_vram_check(cudaEventSynchronize(uform_vram(context)->fences[slot]), "a queued GPU operation");
}

uform_status_t uform_vram_fetch(void* context, void* destination, void const* source, size_t bytes) {
    if (!bytes) return uform_status_success_k;
    return uform_vram_check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToHost, uform_vram(context)->stream),
                            "cudaMemcpyAsync (fetch)");
}

uform_status_t uform_vram_copy(void* context, void* destination, void const* source, size_t bytes) {
    if (!bytes) return uform_status_success_k;
    return uform_vram_check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, uform_vram(context)->stream),
                            "cudaMemcpyAsync (copy)");
}

uform_status_t uform_vram_zero(void* context, void* destination, size_t bytes) {
    if (!bytes) return uform_status_success_k;
    return uform_vram_check(cudaMemsetAsync(destination, 0, bytes, uform_vram(context)->stream), "cudaMemsetAsync");
}

uform_backend_t const uform_vram_backend = {
    /* name */ "vram",
    /* activations */ uform_element_bf16_k,
    uform_vram_device_open,
    uform_vram_device_close,
    uform_vram_context_create,
    uform_vram_context_destroy,
    uform_vram_synchronize,
    uform_vram_statistics_floats,
    uform_vram_allocate,
    uform_vram_release,
    uform_vram_host_allocate,
    uform_vram_host_release,
    uform_vram_upload,
    uform_vram_download,
    uform_vram_copy,
    uform_vram_fence,
    uform_vram_fence_wait,
    uform_vram_fetch,
    uform_vram_zero,
    uform_vram_convert,
    uform_vram_matmul,
    uform_vram_matmul_gelu,
    uform_vram_matmul_gelu_backward,
    uform_vram_embedding_forward,
    uform_vram_embedding_backward,
    uform_vram_rmsnorm_forward,
    uform_vram_rmsnorm_backward,
    uform_vram_rope_forward,
    uform_vram_rope_backward,
    uform_vram_attention_forward,
    uform_vram_attention_backward,
    uform_vram_gelu_forward,
    uform_vram_gelu_backward,
    uform_vram_gather_rows,
    uform_vram_scatter_rows,
    uform_vram_cross_entropy,
    uform_vram_choices,
    uform_vram_pool_forward,
    uform_vram_pool_backward,
    uform_vram_contrastive,
    uform_vram_normalize_rows,
    uform_vram_normalize_rows_backward,
    uform_vram_late_interaction,
    uform_vram_patch_loss,
    uform_vram_sum_squares,
    uform_vram_adamw,
};

} // namespace

extern "C" __attribute__((visibility("default"))) uform_backend_t const* uform_vram_backend_load(uform_fail_t fail) {
    uform_vram_fail = fail;
    int count = 0;
    cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess || !count) {
        fail(NULL, uform_status_unsupported_k, "executor: no GPU answers (%s)",
             error != cudaSuccess ? cudaGetErrorString(error) : "none visible");
        (void)cudaGetLastError();
        return nullptr;
    }
    return &uform_vram_backend;
}
