/**
 *  @file   executor.c
 *  @brief  Executors (where work runs), meshes (who works together), version and capabilities.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "core.h"

#define UFORM_STRINGIFY_(x) #x
#define UFORM_STRINGIFY(x) UFORM_STRINGIFY_(x)

char const* uform_version(void) {
    return UFORM_STRINGIFY(UFORM_VERSION_MAJOR) "." UFORM_STRINGIFY(UFORM_VERSION_MINOR) "." UFORM_STRINGIFY(
        UFORM_VERSION_PATCH);
}

uint32_t uform_capabilities(void) { return uform_capability_ram_k; }

uform_status_t uform_executor_init_ram(size_t threads, uform_executor_t* executor, char const** error) {
    if (!executor) return uform_fail(error, uform_status_invalid_argument_k, "executor: NULL output pointer");
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (threads == 0) threads = cores > 0 ? (size_t)cores : 1;
    if (threads > 1024) return uform_fail(error, uform_status_invalid_argument_k, "threads: %zu is over 1024", threads);
    uform_executor_s* made = calloc(1, sizeof(uform_executor_s));
    if (!made) return uform_fail(error, uform_status_out_of_memory_k, "no memory for an executor");
    made->backend = &uform_ram_backend;
    made->ram.threads = (int)threads;
    made->context = &made->ram;
    uform_status_t status = uform_handles_add(made, uform_handle_executor_k, executor, error);
    if (status != uform_status_success_k) free(made);
    return status;
}

uform_status_t uform_executor_init_vram(uint32_t const* devices, size_t count, uform_executor_t* executor,
                                        char const** error) {
    (void)devices, (void)count, (void)executor;
    return uform_fail(error, uform_status_unsupported_k,
                      "executor: this build of uform has no CUDA backend; use a RAM executor");
}

uform_status_t uform_executor_free(uform_executor_t executor, char const** error) {
    void* object;
    uform_status_t status = uform_handles_remove(executor, uform_handle_executor_k, "executor", &object, error);
    if (status == uform_status_success_k) free(object);
    return status;
}

uform_status_t uform_mesh_bootstrap(uform_executor_t executor, uform_mesh_bootstrap_t const* config,
                                    uform_mesh_t* mesh, char const** error) {
    uform_status_t status = uform_handles_check(executor, uform_handle_executor_k, "executor", error);
    if (status != uform_status_success_k) return status;
    if (!config || !mesh) return uform_fail(error, uform_status_invalid_argument_k, "mesh: NULL config or output");
    uint32_t count = config->host_domain_count ? config->host_domain_count : 1;
    if (config->host_domain_index >= count)
        return uform_fail(error, uform_status_invalid_argument_k,
                          "host_domain_index: %u is not below host_domain_count %u", config->host_domain_index,
                          count);
    if (count > 1)
        return uform_fail(error, uform_status_unsupported_k,
                          "host_domain_count: %u processes need the NCCL mesh, which this build lacks", count);
    uform_mesh_s* made = calloc(1, sizeof(uform_mesh_s));
    if (!made) return uform_fail(error, uform_status_out_of_memory_k, "no memory for a mesh");
    made->host_domain_index = config->host_domain_index;
    made->host_domain_count = count;
    status = uform_handles_add(made, uform_handle_mesh_k, mesh, error);
    if (status != uform_status_success_k) free(made);
    return status;
}

uform_status_t uform_mesh_free(uform_mesh_t mesh, char const** error) {
    void* object;
    uform_status_t status = uform_handles_remove(mesh, uform_handle_mesh_k, "mesh", &object, error);
    if (status == uform_status_success_k) free(object);
    return status;
}
