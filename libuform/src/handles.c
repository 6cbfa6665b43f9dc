/**
 *  @file   handles.c
 *  @brief  The table of live handles: every verb checks its handle here before touching it, so a
 *          freed, NULL or foreign pointer is refused instead of dereferenced.
 */
#include <stdlib.h>

#include "core.h"

static pthread_mutex_t uform_handles_lock = PTHREAD_MUTEX_INITIALIZER;
static void** uform_handles_live = NULL;
static size_t uform_handles_count = 0, uform_handles_capacity = 0;

static char const* uform_kind_name(uform_handle_kind_t kind) {
    switch (kind) {
    case uform_handle_executor_k: return "an executor";
    case uform_handle_mesh_k: return "a mesh";
    case uform_handle_trainer_k: return "a trainer";
    case uform_handle_encoder_k: return "an encoder";
    }
    return "a handle";
}

/* Must hold the lock. Returns the slot or `uform_handles_count` when absent. */
static size_t uform_handles_find(void const* handle) {
    for (size_t i = 0; i != uform_handles_count; ++i)
        if (uform_handles_live[i] == handle) return i;
    return uform_handles_count;
}

uform_status_t uform_handles_add(void* handle, char const** error) {
    pthread_mutex_lock(&uform_handles_lock);
    if (uform_handles_count == uform_handles_capacity) {
        size_t capacity = uform_handles_capacity ? uform_handles_capacity * 2 : 16;
        void** grown = realloc(uform_handles_live, capacity * sizeof(void*));
        if (!grown) {
            pthread_mutex_unlock(&uform_handles_lock);
            return uform_fail(error, uform_status_out_of_memory_k, "no memory for the table of handles");
        }
        uform_handles_live = grown, uform_handles_capacity = capacity;
    }
    uform_handles_live[uform_handles_count++] = handle;
    pthread_mutex_unlock(&uform_handles_lock);
    return uform_status_success_k;
}

static uform_status_t uform_handles_check_locked(void const* handle, uform_handle_kind_t kind, char const* what,
                                                 char const** error) {
    if (!handle) return uform_fail(error, uform_status_invalid_handle_k, "%s: NULL", what);
    if (uform_handles_find(handle) == uform_handles_count)
        return uform_fail(error, uform_status_invalid_handle_k, "%s: %p is freed or not a uform handle", what, handle);
    if (((uform_handle_t const*)handle)->kind != kind)
        return uform_fail(error, uform_status_invalid_handle_k, "%s: %p is not %s", what, handle,
                          uform_kind_name(kind));
    return uform_status_success_k;
}

uform_status_t uform_handles_check(void const* handle, uform_handle_kind_t kind, char const* what,
                                   char const** error) {
    pthread_mutex_lock(&uform_handles_lock);
    uform_status_t status = uform_handles_check_locked(handle, kind, what, error);
    pthread_mutex_unlock(&uform_handles_lock);
    return status;
}

uform_status_t uform_handles_remove(void* handle, uform_handle_kind_t kind, char const* what, char const** error) {
    pthread_mutex_lock(&uform_handles_lock);
    uform_status_t status = uform_handles_check_locked(handle, kind, what, error);
    if (status == uform_status_success_k && ((uform_handle_t*)handle)->borrowers)
        status = uform_fail(error, uform_status_busy_k, "%s: %zu live trainer(s) borrow it; free them first", what,
                            ((uform_handle_t*)handle)->borrowers);
    if (status == uform_status_success_k) {
        size_t slot = uform_handles_find(handle);
        uform_handles_live[slot] = uform_handles_live[--uform_handles_count];
    }
    pthread_mutex_unlock(&uform_handles_lock);
    return status;
}

uform_status_t uform_handles_acquire(void* handle, uform_handle_kind_t kind, char const* what, char const** error) {
    pthread_mutex_lock(&uform_handles_lock);
    uform_status_t status = uform_handles_check_locked(handle, kind, what, error);
    if (status == uform_status_success_k) ((uform_handle_t*)handle)->borrowers++;
    pthread_mutex_unlock(&uform_handles_lock);
    return status;
}

void uform_handles_borrow(void* handle, int delta) {
    if (!handle) return;
    pthread_mutex_lock(&uform_handles_lock);
    ((uform_handle_t*)handle)->borrowers += delta;
    pthread_mutex_unlock(&uform_handles_lock);
}
