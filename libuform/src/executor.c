/**
 *  @file   executor.c
 *  @brief  Executors (where work runs), version and capabilities; meshes (who works together) are `mesh.c`'s.
 *
 *  The CUDA backend is a plug-in, `libuform_vram.so`, beside this library: loaded on first use, so
 *  this library starts on any machine and only VRAM executors need the CUDA libraries.
 */
#define _GNU_SOURCE /* dladdr: where this library lies, to find the plug-in beside it */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "media/media.h"

#define UFORM_STRINGIFY_(x) #x
#define UFORM_STRINGIFY(x) UFORM_STRINGIFY_(x)

char const* uform_version(void) {
    return UFORM_STRINGIFY(UFORM_VERSION_MAJOR) "." UFORM_STRINGIFY(UFORM_VERSION_MINOR) "." UFORM_STRINGIFY(
        UFORM_VERSION_PATCH);
}

static pthread_once_t uform_vram_once = PTHREAD_ONCE_INIT;
static uform_backend_t const* uform_vram_loaded = NULL;
static char uform_vram_why[512] = "";

static void uform_vram_load(void) {
    Dl_info self;
    char path[4096];
    if (!dladdr(uform_vram_why, &self) || !self.dli_fname) { /* any address inside this library tells its file */
        snprintf(uform_vram_why, sizeof(uform_vram_why), "cannot tell where libuform lies to find libuform_vram.so");
        return;
    }
    char const* slash = strrchr(self.dli_fname, '/');
    int folder = slash ? (int)(slash - self.dli_fname) : 1;
    snprintf(path, sizeof(path), "%.*s/libuform_vram.so", folder, slash ? self.dli_fname : ".");
    void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        char const* reason = dlerror();
        snprintf(uform_vram_why, sizeof(uform_vram_why),
                 "this build of uform has no CUDA backend (%.300s); a build where nvcc and CUDA's libraries are found "
                 "makes one (UFORM_CUDA=1 says what is missing)",
                 reason ? reason : path);
        return;
    }
    union {
        void* symbol;
        uform_vram_backend_load_t load;
    } entry; /* ISO C has no cast from an object pointer to a function pointer; a union reads it as one */
    entry.symbol = dlsym(library, UFORM_VRAM_BACKEND_LOAD);
    uform_backend_t const* backend = entry.symbol ? entry.load(uform_fail) : NULL;
    if (!backend) snprintf(uform_vram_why, sizeof(uform_vram_why), "%s", entry.symbol ? uform_message() : "libuform_vram.so lacks its entry point");
    uform_vram_loaded = backend; /* the library stays loaded for the process's life, as its table points into it */
}

uform_backend_t const* uform_vram_backend(void) {
    pthread_once(&uform_vram_once, uform_vram_load);
    if (!uform_vram_loaded) uform_fail(NULL, uform_status_unsupported_k, "%s", uform_vram_why);
    return uform_vram_loaded;
}

uform_backend_t const* uform_testing_backend(char const* name) {
    if (name && !strcmp(name, "ram")) return &uform_ram_backend;
    if (name && !strcmp(name, "vram")) return uform_vram_backend();
    uform_fail(NULL, uform_status_invalid_argument_k, "backend: %s is not ram or vram", name ? name : "NULL");
    return NULL;
}

uint32_t uform_capabilities(void) {
    /* Asking never fails, so it keeps the thread's last message, which finding no CUDA backend would replace. */
    char kept[1024];
    snprintf(kept, sizeof(kept), "%s", uform_message());
    /* Meshes of several processes join RAM executors over sockets, which every build has (`mesh.c`). */
    uint32_t found = uform_capability_ram_k | uform_capability_mesh_k |
                     (uform_vram_backend() ? uform_capability_vram_k : 0) | uform_media_capabilities();
    uform_fail(NULL, uform_status_success_k, "%s", kept);
    return found;
}

/* Opens `ordinal` on `backend`, for trainers that spread their steps over `devices`, and adds the executor to the
   table of handles. */
static uform_status_t uform_executor_open(uform_backend_t const* backend, uint32_t ordinal, uint32_t devices,
                                          uform_executor_t* executor, char const** error) {
    uform_executor_s* made = calloc(1, sizeof(uform_executor_s));
    if (!made) return uform_fail(error, uform_status_out_of_memory_k, "no memory for an executor");
    made->backend = backend, made->devices = devices;
    uform_status_t status = backend->device_open(ordinal, &made->device);
    if (status != uform_status_success_k) {
        free(made);
        if (error) *error = uform_message();
        return status;
    }
    status = uform_handles_add(made, uform_handle_executor_k, executor, error);
    if (status != uform_status_success_k) backend->device_close(made->device), free(made);
    return status;
}

uform_status_t uform_executor_init_ram(size_t threads, uform_executor_t* executor, char const** error) {
    return uform_executor_init_ram_devices(threads, 1, executor, error);
}

uform_status_t uform_executor_init_ram_devices(size_t threads, size_t devices, uform_executor_t* executor,
                                               char const** error) {
    if (!executor) return uform_fail(error, uform_status_invalid_argument_k, "executor: NULL output pointer");
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (threads == 0) threads = cores > 0 ? (size_t)cores : 1;
    if (threads > 1024) return uform_fail(error, uform_status_invalid_argument_k, "threads: %zu is over 1024", threads);
    if (devices == 0) devices = 1;
    if (devices > 64) return uform_fail(error, uform_status_invalid_argument_k, "devices: %zu is over 64", devices);
    return uform_executor_open(&uform_ram_backend, (uint32_t)threads, (uint32_t)devices, executor, error);
}

uform_status_t uform_executor_init_vram(uint32_t const* devices, size_t count, uform_executor_t* executor,
                                        char const** error) {
    if (!executor) return uform_fail(error, uform_status_invalid_argument_k, "executor: NULL output pointer");
    if (count && !devices) return uform_fail(error, uform_status_invalid_argument_k, "devices: NULL with a count of %zu", count);
    uform_backend_t const* backend = uform_vram_backend();
    if (!backend) return uform_fail(error, uform_status_unsupported_k, "executor: %s", uform_vram_why);
    /* One device until the mesh lands; the backend's device_open tells the ordinal that is not there. */
    if (count > 1)
        return uform_fail(error, uform_status_unsupported_k,
                          "devices: %zu GPUs in one executor need the multi-device mesh, which this build lacks; "
                          "pass one ordinal",
                          count);
    return uform_executor_open(backend, count ? devices[0] : UINT32_MAX, 1, executor, error);
}

uform_status_t uform_executor_free(uform_executor_t executor, char const** error) {
    void* object;
    uform_status_t status = uform_handles_remove(executor, uform_handle_executor_k, "executor", &object, error);
    if (status == uform_status_success_k) {
        uform_executor_s* freed = object;
        freed->backend->device_close(freed->device);
        free(freed);
    }
    return status;
}
