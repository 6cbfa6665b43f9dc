/**
 *  @file   errors.c
 *  @brief  Messages that name the field at fault, kept per thread until the next failure.
 *
 *  C99 has no thread-local storage class, so each thread's message lives in a buffer of its own
 *  under a POSIX thread-specific key: allocated on the thread's first use, freed when it exits.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { uform_message_capacity_k = 1024 };

/* What a caller reads when its thread had no memory left for a message of its own. */
static char const uform_message_lost[] = "uform: out of memory for this thread's error message";

static pthread_once_t uform_message_once = PTHREAD_ONCE_INIT;
static pthread_key_t uform_message_key;
static int uform_message_keyed; /* whether `pthread_key_create` succeeded; written once, under the once */

static void uform_message_key_create(void) { uform_message_keyed = pthread_key_create(&uform_message_key, free) == 0; }

/** This thread's buffer, empty until its first failure; NULL when none could be had. */
static char* uform_message_buffer(void) {
    pthread_once(&uform_message_once, uform_message_key_create);
    if (!uform_message_keyed) return NULL;
    char* buffer = pthread_getspecific(uform_message_key);
    if (buffer) return buffer;
    buffer = calloc(1, uform_message_capacity_k);
    if (buffer && pthread_setspecific(uform_message_key, buffer) != 0) {
        free(buffer);
        return NULL;
    }
    return buffer;
}

/*  A message over the buffer keeps its beginning and its end around an ellipsis: the field it names
    comes first and the reason last, and what runs long between them is a path or a value. Neither cut
    splits a UTF-8 character. */
static void uform_message_shorten(char* text, size_t length) {
    size_t const room = uform_message_capacity_k - 1, half = (room - 3) / 2;
    if (length <= room) return;
    size_t head = half, tail = length - (room - 3 - half);
    while (head && ((unsigned char)text[head] & 0xC0) == 0x80) --head;
    while (tail < length && ((unsigned char)text[tail] & 0xC0) == 0x80) ++tail;
    memcpy(text + head, "\xE2\x80\xA6", 3);
    memmove(text + head + 3, text + tail, length - tail + 1);
}

uform_status_t uform_fail(char const** error, uform_status_t status, char const* format, ...) {
    /* Formatted apart first: a verb may pass on the message of the operation that failed, which
     * lives in the buffer this one is written to. */
    char formatted[16 * uform_message_capacity_k];
    va_list arguments;
    va_start(arguments, format);
    vsnprintf(formatted, sizeof(formatted), format, arguments);
    va_end(arguments);
    uform_message_shorten(formatted, strlen(formatted));
    char* buffer = uform_message_buffer();
    if (buffer) memcpy(buffer, formatted, strlen(formatted) + 1);
    if (error) *error = buffer ? buffer : uform_message_lost;
    return status;
}

char const* uform_message(void) {
    char const* buffer = uform_message_buffer();
    return buffer ? buffer : uform_message_lost;
}
