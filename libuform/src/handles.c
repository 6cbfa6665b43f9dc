/**
 *  @file   handles.c
 *  @brief  The table of live handles: every verb checks its handle here before touching it, so a
 *          freed, NULL or foreign pointer is refused instead of dereferenced.
 *
 *  A handle is a token, not the object's address: an odd number that is never handed out twice.
 *  An address would be reused by `malloc` for the next object, and the freed handle would then
 *  quietly reach a stranger's trainer; a token stays refused forever. Odd tokens also never equal
 *  an aligned pointer, so nothing the caller points at is mistaken for a handle. The table maps
 *  each live token to its kind and object, and nothing in the object is read until the token is
 *  found, all under one lock.
 */
#include <stdint.h>
#include <stdlib.h>

#include "core.h"

typedef struct uform_handle_slot_t {
    uintptr_t token;
    uform_handle_kind_t kind;
    uform_handle_t* object;
} uform_handle_slot_t;

static pthread_mutex_t uform_handles_lock = PTHREAD_MUTEX_INITIALIZER;
static uform_handle_slot_t* uform_handles_live = NULL;
static size_t uform_handles_count = 0, uform_handles_capacity = 0;
static uintptr_t uform_handles_issued = 0; /* tokens handed out so far */

static char const* uform_kind_name(uform_handle_kind_t kind) {
    switch (kind) {
    case uform_handle_executor_k: return "an executor";
    case uform_handle_mesh_k: return "a mesh";
    case uform_handle_trainer_k: return "a trainer";
    case uform_handle_encoder_k: return "an encoder";
    case uform_handle_decoded_k: return "decoded media";
    }
    return "a handle";
}

/* Must hold the lock. Returns the slot or `uform_handles_count` when absent. */
static size_t uform_handles_find(void const* handle) {
    for (size_t i = 0; i != uform_handles_count; ++i)
        if (uform_handles_live[i].token == (uintptr_t)handle) return i;
    return uform_handles_count;
}

uform_status_t uform_handles_add(void* object, uform_handle_kind_t kind, void** handle, char const** error) {
    pthread_mutex_lock(&uform_handles_lock);
    /* 2^63 tokens on 64-bit machines: none is ever reissued. */
    if (uform_handles_issued == UINTPTR_MAX / 2) {
        pthread_mutex_unlock(&uform_handles_lock);
        return uform_fail(error, uform_status_out_of_memory_k, "every handle this process may have was issued");
    }
    if (uform_handles_count == uform_handles_capacity) {
        size_t capacity = uform_handles_capacity ? uform_handles_capacity * 2 : 16;
        uform_handle_slot_t* grown = realloc(uform_handles_live, capacity * sizeof(uform_handle_slot_t));
        if (!grown) {
            pthread_mutex_unlock(&uform_handles_lock);
            return uform_fail(error, uform_status_out_of_memory_k, "no memory for the table of handles");
        }
        uform_handles_live = grown, uform_handles_capacity = capacity;
    }
    uintptr_t token = (++uform_handles_issued << 1) | 1;
    ((uform_handle_t*)object)->kind = kind;
    ((uform_handle_t*)object)->borrowers = 0;
    uform_handles_live[uform_handles_count++] = (uform_handle_slot_t){token, kind, object};
    pthread_mutex_unlock(&uform_handles_lock);
    *handle = (void*)token;
    return uform_status_success_k;
}

/* Must hold the lock. Finds a live handle of `kind` and its slot. */
static uform_status_t uform_handles_check_locked(void const* handle, uform_handle_kind_t kind, char const* what,
                                                 size_t* slot, char const** error) {
    if (!handle) return uform_fail(error, uform_status_invalid_handle_k, "%s: NULL", what);
    size_t found = uform_handles_find(handle);
    if (found == uform_handles_count)
        return uform_fail(error, uform_status_invalid_handle_k, "%s: %p is freed or not a uform handle", what, handle);
    if (uform_handles_live[found].kind != kind)
        return uform_fail(error, uform_status_invalid_handle_k, "%s: %p is %s, not %s", what, handle,
                          uform_kind_name(uform_handles_live[found].kind), uform_kind_name(kind));
    *slot = found;
    return uform_status_success_k;
}

uform_status_t uform_handles_check(void const* handle, uform_handle_kind_t kind, char const* what,
                                   char const** error) {
    size_t slot;
    pthread_mutex_lock(&uform_handles_lock);
    uform_status_t status = uform_handles_check_locked(handle, kind, what, &slot, error);
    pthread_mutex_unlock(&uform_handles_lock);
    return status;
}

uform_status_t uform_handles_remove(void* handle, uform_handle_kind_t kind, char const* what, void** object,
                                    char const** error) {
    size_t slot;
    pthread_mutex_lock(&uform_handles_lock);
    uform_status_t status = uform_handles_check_locked(handle, kind, what, &slot, error);
    size_t borrowers = status == uform_status_success_k ? uform_handles_live[slot].object->borrowers : 0;
    if (borrowers && kind == uform_handle_executor_k)
        status = uform_fail(error, uform_status_busy_k,
                            "%s: %zu live trainer(s), encoder(s) or mesh(es) borrow it; free them first", what, borrowers);
    else if (borrowers && kind == uform_handle_mesh_k) /* only trainers borrow a mesh */
        status = uform_fail(error, uform_status_busy_k, "%s: %zu live trainer(s) borrow it; free them first", what,
                            borrowers);
    else if (borrowers)
        status = uform_fail(error, uform_status_busy_k,
                            "%s: %zu call(s) on other threads are running or waiting on it; free it once they return",
                            what, borrowers);
    if (status == uform_status_success_k) {
        *object = uform_handles_live[slot].object;
        uform_handles_live[slot] = uform_handles_live[--uform_handles_count];
    }
    pthread_mutex_unlock(&uform_handles_lock);
    return status;
}

uform_status_t uform_handles_acquire(void* handle, uform_handle_kind_t kind, char const* what, void** object,
                                     char const** error) {
    size_t slot;
    pthread_mutex_lock(&uform_handles_lock);
    uform_status_t status = uform_handles_check_locked(handle, kind, what, &slot, error);
    if (status == uform_status_success_k) {
        uform_handles_live[slot].object->borrowers++;
        *object = uform_handles_live[slot].object;
    }
    pthread_mutex_unlock(&uform_handles_lock);
    return status;
}

void uform_handles_release(void* object) {
    if (!object) return;
    pthread_mutex_lock(&uform_handles_lock);
    ((uform_handle_t*)object)->borrowers--;
    pthread_mutex_unlock(&uform_handles_lock);
}

uform_status_t uform_handles_enter(void* handle, uform_handle_kind_t kind, char const* what, void** object,
                                   char const** error) {
    uform_status_t status = uform_handles_acquire(handle, kind, what, object, error);
    if (status == uform_status_success_k) pthread_mutex_lock(&((uform_serial_t*)*object)->lock);
    return status;
}

void uform_handles_leave(void* object) {
    pthread_mutex_unlock(&((uform_serial_t*)object)->lock);
    uform_handles_release(object);
}
