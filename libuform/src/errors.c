/**
 *  @file   errors.c
 *  @brief  Messages that name the field at fault, kept per thread until the next failure.
 */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char uform_message[1024];

uform_status_t uform_fail(char const** error, uform_status_t status, char const* format, ...) {
    va_list arguments;
    va_start(arguments, format);
    vsnprintf(uform_message, sizeof(uform_message), format, arguments);
    va_end(arguments);
    if (error) *error = uform_message;
    return status;
}
