/**
 *  @file   checkpoint.c
 *  @brief  Safetensors checkpoints: every weight, both AdamW moments, the step and the config; or,
 *          for release, the weights alone, marked so in the metadata.
 *
 *  Written to a hidden temporary file beside the destination, flushed to disk, then renamed into
 *  place, so a crash mid-save leaves the previous checkpoint whole; the temporary files of saves
 *  whose process died are swept at the next save to the same path. Read back by a parser that
 *  trusts nothing in the file: every length and offset is checked against the file's size before
 *  anything is allocated or read.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config_fields.h"
#include "core.h"

#define UFORM_FORMAT "uform/1"
#define UFORM_BAD(...) uform_fail(error, uform_status_invalid_checkpoint_k, __VA_ARGS__)

/* The three families of tensors a checkpoint holds, each with the layout's names behind its prefix; a
   weights-only checkpoint holds the first alone. */
static char const* const uform_families[3] = {"", "adamw.first.", "adamw.second."};

/* The length of the UTF-8 sequence at `text`, or 0 when it is not one: no overlong forms, no
   surrogates, nothing past U+10FFFF (RFC 3629). */
static size_t uform_utf8_sequence(unsigned char const* text, size_t left) {
    unsigned char c = text[0];
    if (c < 0x80) return 1;
    size_t length = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!length || length > left) return 0;
    unsigned char low = 0x80, high = 0xBF; /* the second byte's range, narrower after some leads */
    if (c == 0xE0) low = 0xA0;
    if (c == 0xED) high = 0x9F;
    if (c == 0xF0) low = 0x90;
    if (c == 0xF4) high = 0x8F;
    if (text[1] < low || text[1] > high) return 0;
    for (size_t i = 2; i < length; ++i)
        if ((text[i] & 0xC0) != 0x80) return 0;
    return length;
}

/* How many of `text`'s first bytes are UTF-8: `length` when all of them are. */
static size_t uform_utf8_prefix(char const* text, size_t length) {
    size_t at = 0, step;
    while (at < length && (step = uform_utf8_sequence((unsigned char const*)text + at, length - at))) at += step;
    return at;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Writing                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

typedef struct uform_text_t {
    char* data;
    size_t length, capacity;
} uform_text_t;

static int uform_text_append(uform_text_t* text, char const* piece, size_t length) {
    if (text->length + length + 1 > text->capacity) {
        size_t capacity = (text->length + length + 1) * 2;
        char* grown = realloc(text->data, capacity);
        if (!grown) return 0;
        text->data = grown, text->capacity = capacity;
    }
    memcpy(text->data + text->length, piece, length);
    text->length += length;
    text->data[text->length] = 0;
    return 1;
}

static int uform_text_print(uform_text_t* text, char const* format, ...) {
    char piece[512];
    va_list arguments;
    va_start(arguments, format);
    int length = vsnprintf(piece, sizeof(piece), format, arguments);
    va_end(arguments);
    return length >= 0 && (size_t)length < sizeof(piece) && uform_text_append(text, piece, (size_t)length);
}

/* Appends `value` as a JSON string. */
static int uform_text_quote(uform_text_t* text, char const* value) {
    if (!uform_text_append(text, "\"", 1)) return 0;
    for (char const* c = value; *c; ++c) {
        char escaped[8];
        if (*c == '"' || *c == '\\') escaped[0] = '\\', escaped[1] = *c, escaped[2] = 0;
        else if ((unsigned char)*c < 0x20) snprintf(escaped, sizeof(escaped), "\\u%04x", (unsigned char)*c);
        else escaped[0] = *c, escaped[1] = 0;
        if (!uform_text_append(text, escaped, strlen(escaped))) return 0;
    }
    return uform_text_append(text, "\"", 1);
}

static size_t uform_tensor_bytes(uform_tensor_t const* tensor) { return tensor->rows * tensor->cols * sizeof(float); }

static int uform_text_shape(uform_text_t* text, uform_tensor_t const* tensor) {
    if (tensor->rows == 1) return uform_text_print(text, "[%zu]", tensor->cols);
    return uform_text_print(text, "[%zu, %zu]", tensor->rows, tensor->cols);
}

/* Writes every byte or answers why not: 0, or an errno value. */
static int uform_write_all(int file, void const* data, size_t length) {
    char const* at = data;
    while (length) {
        ssize_t written = write(file, at, length);
        if (written < 0 && errno == EINTR) continue;
        if (written < 0) return errno;
        if (written == 0) return EIO;
        at += written, length -= (size_t)written;
    }
    return 0;
}

/* Saves started by this process: with the PID, they make every temporary name unique, so two
   threads saving to one path never write the same file. */
static pthread_mutex_t uform_saves_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long uform_saves_started = 0;

/* Reads `digits` at `*at` as a decimal number, moving past them; 0 when there are none. */
static int uform_leftover_number(char const** at, unsigned long long* value) {
    char const* start = *at;
    *value = 0;
    while (**at >= '0' && **at <= '9' && *at - start < 19) *value = *value * 10 + (unsigned)(*(*at)++ - '0');
    return *at != start;
}

/* Removes the temporary files that saves to `path` left behind when their process died (killed, or
   out of power before the rename): `.NAME.PID.N.partial` whose PID no longer runs and that no live
   writer locks. A live writer's file is never touched: its PID runs, or (from another PID namespace
   on a shared folder) it holds the lock every writer takes. Best effort: failures change nothing. */
static void uform_leftovers_sweep(char const* path, size_t folder) {
    char const* name = path + folder;
    size_t name_length = strlen(name);
    char* directory_name = malloc(folder + 2);
    if (!directory_name) return;
    if (folder) memcpy(directory_name, path, folder), directory_name[folder] = 0;
    else strcpy(directory_name, ".");
    DIR* directory = opendir(directory_name);
    long self = (long)getpid();
    for (struct dirent* entry; directory && (entry = readdir(directory));) {
        char const* at = entry->d_name;
        unsigned long long pid, serial;
        if (at[0] != '.' || strncmp(at + 1, name, name_length) || at[1 + name_length] != '.') continue;
        at += 2 + name_length;
        if (!uform_leftover_number(&at, &pid) || *at++ != '.') continue;
        if (uform_leftover_number(&at, &serial) && *at++ != '.') continue; /* `.NAME.PID.partial` is the older form */
        if (strcmp(at, "partial") || pid == 0 || pid > 0x7FFFFFFF || (long)pid == self) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* it runs, or it is not ours to judge */
        int file = openat(dirfd(directory), entry->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (file < 0) continue;
        struct flock lock = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
        struct stat info;
        if (fcntl(file, F_GETLK, &lock) == 0 && lock.l_type == F_UNLCK && fstat(file, &info) == 0 && S_ISREG(info.st_mode))
            unlinkat(dirfd(directory), entry->d_name, 0);
        close(file);
    }
    if (directory) closedir(directory);
    free(directory_name);
}

uform_status_t uform_checkpoint_save(char const* path, uform_layout_t const* layout, float const* weights,
                                     float const* first, float const* second, uint64_t step,
                                     char const* config_json, char const* note, char const** error) {
    if (!path) return uform_fail(error, uform_status_invalid_argument_k, "path: NULL");
    if (!*path) return uform_fail(error, uform_status_invalid_argument_k, "path: empty");
    char const* slash = strrchr(path, '/');
    size_t folder = slash ? (size_t)(slash - path + 1) : 0;
    char const* name = path + folder;
    struct stat existing; /* a folder named without its slash is refused alike, not as a failed write */
    if (!*name || !strcmp(name, ".") || !strcmp(name, "..") || (!stat(path, &existing) && S_ISDIR(existing.st_mode)))
        return uform_fail(error, uform_status_invalid_argument_k, "path: %s names a folder, not a file", path);
    /* Escaping makes any text a JSON string, but not UTF-8: a header that is not is refused by every reader. */
    size_t note_length = note ? strlen(note) : 0;
    if (note_length > UFORM_MAX_NOTE_BYTES)
        return uform_fail(error, uform_status_invalid_argument_k, "note: %zu bytes, over the %d a checkpoint holds",
                          note_length, UFORM_MAX_NOTE_BYTES);
    size_t valid = uform_utf8_prefix(note, note_length);
    if (valid != note_length)
        return uform_fail(error, uform_status_invalid_argument_k, "note: not UTF-8 at byte %zu (0x%02x)", valid,
                          (unsigned char)note[valid]);
    uform_text_t header = {0};
    char step_text[32];
    snprintf(step_text, sizeof(step_text), "%llu", (unsigned long long)step);
    /* Without moments the file says so, so that no run resumes from it as if AdamW had no history. */
    int families_count = first && second ? 3 : 1;
    char const* weights_only = families_count == 1 ? "\"weights_only\": \"true\", " : "";
    int ok = uform_text_print(&header, "{\"__metadata__\": {\"format\": \"" UFORM_FORMAT "\", \"step\": \"%s\", %s\"config\": ",
                              step_text, weights_only) &&
             uform_text_quote(&header, config_json) &&
             (!note_length || (uform_text_print(&header, ", \"note\": ") && uform_text_quote(&header, note))) &&
             uform_text_append(&header, "}", 1);
    size_t offset = 0;
    for (int family = 0; family != families_count && ok; ++family)
        for (size_t i = 0; i != layout->count && ok; ++i) {
            uform_tensor_t const* tensor = &layout->tensors[i];
            ok = uform_text_print(&header, ", \"%s%s\": {\"dtype\": \"F32\", \"shape\": ", uform_families[family],
                                  tensor->name) &&
                 uform_text_shape(&header, tensor) &&
                 uform_text_print(&header, ", \"data_offsets\": [%zu, %zu]}", offset,
                                  offset + uform_tensor_bytes(tensor));
            offset += uform_tensor_bytes(tensor);
        }
    ok = ok && uform_text_append(&header, "}", 1);
    while (ok && header.length % 8) ok = uform_text_append(&header, " ", 1); /* data starts 8-byte aligned */
    size_t capacity = strlen(path) + 64;
    char* temporary = ok ? malloc(capacity) : NULL;
    if (!temporary) {
        free(header.data);
        return uform_fail(error, uform_status_out_of_memory_k, "no memory for the checkpoint's header and name");
    }

    /* A hidden name in the same folder: the rename stays on one filesystem, and no reader takes a
       half-written file for a checkpoint. Created exclusively, so it is never someone else's file
       (or a link planted to make us overwrite one), and locked, so no other process's sweep of
       leftovers removes it while it is written. */
    int file = -1, reason = 0;
    for (int attempt = 0; attempt != 64 && file < 0; ++attempt) {
        pthread_mutex_lock(&uform_saves_lock);
        unsigned long serial = uform_saves_started++;
        pthread_mutex_unlock(&uform_saves_lock);
        snprintf(temporary, capacity, "%.*s.%s.%ld.%lu.partial", (int)folder, path, name, (long)getpid(), serial);
        file = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        reason = file < 0 ? errno : 0;
        if (reason != EEXIST) break;
    }
    if (file < 0) {
        uform_status_t status = uform_fail(error, uform_status_io_k, "path: cannot write %s: %s", path, strerror(reason));
        free(header.data), free(temporary);
        return status;
    }
    struct flock lock = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    fcntl(file, F_SETLK, &lock); /* where locks are not supported, the PID alone guards the file */

    uint64_t header_length = header.length;
    unsigned char length_bytes[8];
    for (int i = 0; i != 8; ++i) length_bytes[i] = (unsigned char)(header_length >> (8 * i)); /* little-endian */
    reason = uform_write_all(file, length_bytes, 8);
    if (!reason) reason = uform_write_all(file, header.data, header.length);
    float const* families[3] = {weights, first, second};
    for (int family = 0; family != families_count && !reason; ++family)
        for (size_t i = 0; i != layout->count && !reason; ++i)
            reason = uform_write_all(file, families[family] + layout->tensors[i].offset,
                                     uform_tensor_bytes(&layout->tensors[i]));
    if (!reason && fsync(file) != 0) reason = errno;
    if (close(file) != 0 && !reason) reason = errno;
    if (!reason && rename(temporary, path) != 0) reason = errno;
    if (reason) {
        unlink(temporary);
        uform_status_t status = uform_fail(error, uform_status_io_k, "path: cannot write %s: %s", path, strerror(reason));
        free(header.data), free(temporary);
        return status;
    }
    /* The rename is durable once the folder's entry is. */
    char* directory = strdup(path);
    if (directory) {
        char* cut = strrchr(directory, '/');
        if (cut) *cut = 0;
        int folder_file = open(cut ? (*directory ? directory : "/") : ".", O_RDONLY | O_CLOEXEC);
        if (folder_file >= 0) fsync(folder_file), close(folder_file);
        free(directory);
    }
    free(header.data), free(temporary);
    uform_leftovers_sweep(path, folder);
    return uform_status_success_k;
}

/* ---------------------------------------------------------------------------------------------- */
/*  Reading                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* What a reader accepts at most: a header of 64 MiB, the tensors of the deepest model (three
   families of six per block and five more), eight dimensions, JSON nested 32 deep. Entries are
   counted before they are allocated, so a header of many tiny entries cannot make the reader ask
   for more than this. */
#define UFORM_MAX_HEADER (64ull << 20)
#define UFORM_MAX_TENSORS (3 * (6 * 256 + 5))
#define UFORM_MAX_DIMENSIONS 8
#define UFORM_MAX_NESTING 32

/* The header being parsed, and the first problem met, as text for the message. */
typedef struct uform_json_t {
    char const* begin;
    char const* at;
    char const* end;
    char problem[256];
} uform_json_t;

static int uform_json_fail(uform_json_t* json, char const* format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static int uform_json_fail(uform_json_t* json, char const* format, ...) {
    if (json->problem[0]) return 0; /* the innermost reader saw it first and said it best */
    va_list arguments;
    va_start(arguments, format);
    vsnprintf(json->problem, sizeof(json->problem), format, arguments);
    va_end(arguments);
    return 0;
}

static void uform_json_space(uform_json_t* json) {
    while (json->at < json->end && (*json->at == ' ' || *json->at == '\n' || *json->at == '\r' || *json->at == '\t'))
        ++json->at;
}

static int uform_json_take(uform_json_t* json, char expected) {
    uform_json_space(json);
    if (json->at < json->end && *json->at == expected) return ++json->at, 1;
    return 0;
}

static int uform_json_expect(uform_json_t* json, char expected) {
    if (uform_json_take(json, expected)) return 1;
    if (json->at >= json->end) return uform_json_fail(json, "the JSON ends where '%c' belongs", expected);
    unsigned char found = (unsigned char)*json->at;
    if (found < 0x20 || found > 0x7E) return uform_json_fail(json, "expected '%c', found byte 0x%02x", expected, found);
    return uform_json_fail(json, "expected '%c', found '%c'", expected, found);
}

/* Appends one code point as UTF-8 when it fits in `capacity - 1`; `*length` counts it either way. */
static void uform_json_put(char* out, size_t capacity, size_t* length, uint32_t code) {
    char bytes[4];
    size_t count = 0;
    if (code < 0x80) bytes[count++] = (char)code;
    else if (code < 0x800) bytes[count++] = (char)(0xC0 | code >> 6), bytes[count++] = (char)(0x80 | (code & 0x3F));
    else if (code < 0x10000)
        bytes[count++] = (char)(0xE0 | code >> 12), bytes[count++] = (char)(0x80 | ((code >> 6) & 0x3F)),
        bytes[count++] = (char)(0x80 | (code & 0x3F));
    else
        bytes[count++] = (char)(0xF0 | code >> 18), bytes[count++] = (char)(0x80 | ((code >> 12) & 0x3F)),
        bytes[count++] = (char)(0x80 | ((code >> 6) & 0x3F)), bytes[count++] = (char)(0x80 | (code & 0x3F));
    for (size_t i = 0; i != count; ++i, ++*length)
        if (out && *length + 1 < capacity) out[*length] = bytes[i];
}

static int uform_json_hex4(uform_json_t* json, uint32_t* code) {
    if (json->end - json->at < 4) return uform_json_fail(json, "the JSON ends inside a \\u escape");
    *code = 0;
    for (int i = 0; i != 4; ++i) {
        char h = *json->at++;
        int digit = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
        if (digit < 0) return uform_json_fail(json, "'%c' in a \\u escape is not a hex digit", h);
        *code = *code * 16 + (uint32_t)digit;
    }
    return 1;
}

/**
 *  Reads a string, escapes decoded to UTF-8, into `out` (NUL-terminated, at most `capacity - 1`
 *  bytes kept); `*length` is its whole decoded length, so callers refuse strings that did not fit
 *  rather than match a cut one. `out` may be NULL to only check the string. The header was checked
 *  as UTF-8 before; NUL, raw control characters and unpaired surrogates are refused here.
 */
static int uform_json_string(uform_json_t* json, char* out, size_t capacity, size_t* length) {
    size_t used = 0;
    if (!uform_json_expect(json, '"')) return 0;
    while (json->at < json->end && *json->at != '"') {
        unsigned char c = (unsigned char)*json->at++;
        uint32_t code = c;
        if (c < 0x20) return uform_json_fail(json, "a raw control character (0x%02x) inside a string", c);
        if (c == '\\') {
            if (json->at >= json->end) break;
            char e = *json->at++;
            switch (e) {
            case '"': case '\\': case '/': code = (uint32_t)e; break;
            case 'b': code = '\b'; break;
            case 'f': code = '\f'; break;
            case 'n': code = '\n'; break;
            case 'r': code = '\r'; break;
            case 't': code = '\t'; break;
            case 'u': {
                if (!uform_json_hex4(json, &code)) return 0;
                if (code >= 0xDC00 && code <= 0xDFFF) return uform_json_fail(json, "an unpaired surrogate \\u%04x", code);
                if (code >= 0xD800 && code <= 0xDBFF) {
                    uint32_t low;
                    if (json->end - json->at < 2 || json->at[0] != '\\' || json->at[1] != 'u')
                        return uform_json_fail(json, "an unpaired surrogate \\u%04x", code);
                    json->at += 2;
                    if (!uform_json_hex4(json, &low)) return 0;
                    if (low < 0xDC00 || low > 0xDFFF) return uform_json_fail(json, "an unpaired surrogate \\u%04x", code);
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                }
                if (!code) return uform_json_fail(json, "\\u0000 inside a string");
                break;
            }
            default: return uform_json_fail(json, "an unknown escape \\%c", e);
            }
            uform_json_put(out, capacity, &used, code);
            continue;
        }
        if (out && used + 1 < capacity) out[used] = (char)c;
        ++used;
    }
    if (out && capacity) out[used < capacity ? used : capacity - 1] = 0;
    if (length) *length = used;
    if (json->at >= json->end) return uform_json_fail(json, "the JSON ends inside a string");
    ++json->at;
    return 1;
}

/* Reads a non-negative integer: digits alone, no sign, fraction or exponent, below 2^64. */
static int uform_json_unsigned(uform_json_t* json, uint64_t* value) {
    uform_json_space(json);
    char const* start = json->at;
    uint64_t result = 0;
    while (json->at < json->end && *json->at >= '0' && *json->at <= '9') {
        uint64_t digit = (uint64_t)(*json->at++ - '0');
        if (result > (UINT64_MAX - digit) / 10) return uform_json_fail(json, "a number over 2^64 - 1");
        result = result * 10 + digit;
    }
    if (json->at == start || (json->at < json->end && strchr(".eE", *json->at)))
        return uform_json_fail(json, "expected a non-negative integer");
    if (json->at - start > 1 && *start == '0') return uform_json_fail(json, "a number with a leading zero");
    *value = result;
    return 1;
}

/* Checks and skips any JSON value, nesting at most UFORM_MAX_NESTING deep. */
static int uform_json_skip(uform_json_t* json, int depth) {
    if (depth > UFORM_MAX_NESTING) return uform_json_fail(json, "JSON nested deeper than %d", UFORM_MAX_NESTING);
    uform_json_space(json);
    if (json->at >= json->end) return uform_json_fail(json, "the JSON ends where a value belongs");
    char c = *json->at;
    if (c == '"') return uform_json_string(json, NULL, 0, NULL);
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        ++json->at;
        if (uform_json_take(json, close)) return 1;
        do {
            if (c == '{' && !(uform_json_string(json, NULL, 0, NULL) && uform_json_expect(json, ':'))) return 0;
            if (!uform_json_skip(json, depth + 1)) return 0;
        } while (uform_json_take(json, ','));
        return uform_json_expect(json, close);
    }
    static char const* const literals[3] = {"true", "false", "null"};
    for (int i = 0; i != 3; ++i) {
        size_t length = strlen(literals[i]);
        if ((size_t)(json->end - json->at) >= length && !memcmp(json->at, literals[i], length))
            return json->at += length, 1;
    }
    /* A number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
    char const* at = json->at;
    int digits = 0;
    if (at < json->end && *at == '-') ++at;
    if (at < json->end && *at == '0') ++at, digits = 1;
    else
        while (at < json->end && *at >= '0' && *at <= '9') ++at, ++digits;
    if (!digits) return uform_json_fail(json, "'%c' does not start a JSON value", c);
    if (at < json->end && *at == '.') {
        char const* fraction = ++at;
        while (at < json->end && *at >= '0' && *at <= '9') ++at;
        if (at == fraction) return uform_json_fail(json, "a number without digits after its point");
    }
    if (at < json->end && (*at == 'e' || *at == 'E')) {
        if (++at < json->end && (*at == '+' || *at == '-')) ++at;
        char const* exponent = at;
        while (at < json->end && *at >= '0' && *at <= '9') ++at;
        if (at == exponent) return uform_json_fail(json, "a number without digits in its exponent");
    }
    json->at = at;
    return 1;
}

/* The dtypes safetensors defines, and their widths in bytes. */
static struct {
    char const* name;
    uint64_t bytes;
} const uform_dtypes[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1},
                          {"I16", 2},  {"U16", 2}, {"F16", 2},  {"BF16", 2},    {"I32", 4},
                          {"U32", 4},  {"F32", 4}, {"I64", 8},  {"U64", 8},     {"F64", 8}};

typedef struct uform_entry_t {
    char name[96];
    char dtype[16];
    uint64_t dtype_bytes; /* 0 until a known dtype is read */
    size_t dimensions;
    uint64_t shape[UFORM_MAX_DIMENSIONS];
    uint64_t begin, end;
    unsigned given; /* bits: 1 dtype, 2 shape, 4 data_offsets */
    int used;       /* matched to one of the layout's tensors */
} uform_entry_t;

/* Reads `[n, ...]` of at most `capacity` non-negative integers. */
static int uform_json_integers(uform_json_t* json, uint64_t* values, size_t capacity, size_t* count,
                               char const* what, char const* name) {
    *count = 0;
    if (!uform_json_expect(json, '[')) return 0;
    if (uform_json_take(json, ']')) return 1;
    do {
        if (*count == capacity)
            return uform_json_fail(json, "tensor %s: %s has more than %zu entries", name, what, capacity);
        if (!uform_json_unsigned(json, &values[(*count)++])) return 0;
    } while (uform_json_take(json, ','));
    return uform_json_expect(json, ']');
}

static int uform_json_entry(uform_json_t* json, uform_entry_t* entry) {
    if (!uform_json_expect(json, '{')) return 0;
    int empty = uform_json_take(json, '}');
    while (!empty) {
        char key[32];
        size_t length;
        if (!uform_json_string(json, key, sizeof(key), &length) || !uform_json_expect(json, ':')) return 0;
        unsigned bit = !strcmp(key, "dtype") ? 1 : !strcmp(key, "shape") ? 2 : !strcmp(key, "data_offsets") ? 4 : 0;
        if (length >= sizeof(key)) bit = 0;
        if (bit & entry->given) return uform_json_fail(json, "tensor %s: \"%s\" is given twice", entry->name, key);
        entry->given |= bit;
        if (bit == 1) {
            if (!uform_json_string(json, entry->dtype, sizeof(entry->dtype), &length)) return 0;
            for (size_t i = 0; i != sizeof(uform_dtypes) / sizeof(uform_dtypes[0]) && length < sizeof(entry->dtype); ++i)
                if (!strcmp(entry->dtype, uform_dtypes[i].name)) entry->dtype_bytes = uform_dtypes[i].bytes;
            if (!entry->dtype_bytes)
                return uform_json_fail(json, "tensor %s: dtype \"%s%s\" is not one safetensors defines", entry->name,
                                       entry->dtype, length < sizeof(entry->dtype) ? "" : "...");
        } else if (bit == 2) {
            if (!uform_json_integers(json, entry->shape, UFORM_MAX_DIMENSIONS, &entry->dimensions, "shape", entry->name))
                return 0;
        } else if (bit == 4) {
            uint64_t offsets[2];
            size_t count;
            if (!uform_json_integers(json, offsets, 2, &count, "data_offsets", entry->name)) return 0;
            if (count != 2)
                return uform_json_fail(json, "tensor %s: data_offsets has %zu %s, not 2", entry->name, count,
                                       count == 1 ? "entry" : "entries");
            entry->begin = offsets[0], entry->end = offsets[1];
        } else if (!uform_json_skip(json, 2))
            return 0;
        if (!uform_json_take(json, ',')) break;
    }
    if (!empty && !uform_json_expect(json, '}')) return 0;
    if (entry->given != 7)
        return uform_json_fail(json, "tensor %s lacks its %s", entry->name,
                               !(entry->given & 1) ? "dtype" : !(entry->given & 2) ? "shape" : "data_offsets");
    return 1;
}

typedef struct uform_header_t {
    uform_entry_t* entries; /* sorted by name once parsed */
    size_t count, capacity;
    char format[32];
    char config[4096];
    uint64_t step;
    int weights_only;       /* the moments are absent by design, not lost */
    char* note;             /* where __metadata__.note lands, or NULL to check it alone */
    size_t note_capacity, note_length;
    unsigned given;         /* bits: 1 __metadata__, 2 format, 4 step, 8 config, 16 weights_only, 32 note */
    uint64_t data_start, data_size;
} uform_header_t;

/* Reads `__metadata__`: an object of strings, of which format, step, config, weights_only and note are read. */
static int uform_json_metadata(uform_json_t* json, uform_header_t* header) {
    if (!uform_json_expect(json, '{')) return 0;
    if (uform_json_take(json, '}')) return 1;
    do {
        char key[32], value[32];
        size_t length, value_length;
        if (!uform_json_string(json, key, sizeof(key), &length) || !uform_json_expect(json, ':')) return 0;
        unsigned bit = !strcmp(key, "format")         ? 2
                       : !strcmp(key, "step")         ? 4
                       : !strcmp(key, "config")       ? 8
                       : !strcmp(key, "weights_only") ? 16
                       : !strcmp(key, "note")         ? 32
                                                      : 0;
        if (length >= sizeof(key)) bit = 0;
        if (bit & header->given) return uform_json_fail(json, "__metadata__.%s is given twice", key);
        header->given |= bit;
        uform_json_space(json);
        if (json->at < json->end && *json->at != '"')
            return uform_json_fail(json, "__metadata__.%s%s is not a string", key, length < sizeof(key) ? "" : "...");
        if (bit == 8) {
            if (!uform_json_string(json, header->config, sizeof(header->config), &value_length)) return 0;
            if (value_length >= sizeof(header->config))
                return uform_json_fail(json, "__metadata__.config is %zu bytes, over %zu", value_length,
                                       sizeof(header->config) - 1);
        } else if (bit == 32) {
            if (!uform_json_string(json, header->note, header->note_capacity, &header->note_length)) return 0;
        } else if (!uform_json_string(json, bit ? value : NULL, sizeof(value), &value_length))
            return 0;
        if (bit == 2) {
            if (value_length >= sizeof(header->format))
                return uform_json_fail(json, "__metadata__.format is %zu bytes long, not \"" UFORM_FORMAT "\"", value_length);
            memcpy(header->format, value, value_length + 1);
        }
        if (bit == 4) {
            uform_json_t number = {value, value, value + (value_length < sizeof(value) ? value_length : 0), ""};
            if (!value_length || value[0] < '0' || value[0] > '9' || !uform_json_unsigned(&number, &header->step) ||
                number.at != number.end)
                return uform_json_fail(json, "__metadata__.step \"%s%s\" is not a step count", value,
                                       value_length < sizeof(value) ? "" : "...");
            if (header->step >= (1ull << 63))
                return uform_json_fail(json, "__metadata__.step %llu is past 2^63", (unsigned long long)header->step);
        }
        if (bit == 16) {
            header->weights_only = !strcmp(value, "true");
            if (!header->weights_only && strcmp(value, "false"))
                return uform_json_fail(json, "__metadata__.weights_only \"%s%s\" is neither \"true\" nor \"false\"",
                                       value, value_length < sizeof(value) ? "" : "...");
        }
    } while (uform_json_take(json, ','));
    return uform_json_expect(json, '}');
}

static int uform_header_parse(uform_json_t* json, uform_header_t* header) {
    if (!uform_json_expect(json, '{')) return 0;
    int empty = uform_json_take(json, '}');
    while (!empty) {
        char name[sizeof(header->entries->name)];
        size_t length;
        if (!uform_json_string(json, name, sizeof(name), &length) || !uform_json_expect(json, ':')) return 0;
        if (length >= sizeof(name)) return uform_json_fail(json, "a tensor name of %zu bytes, over %zu", length, sizeof(name) - 1);
        if (!strcmp(name, "__metadata__")) {
            if (header->given & 1) return uform_json_fail(json, "__metadata__ is given twice");
            header->given |= 1;
            if (!uform_json_metadata(json, header)) return 0;
        } else {
            if (header->count == UFORM_MAX_TENSORS)
                return uform_json_fail(json, "more than %d tensors, more than any model of this library has",
                                       UFORM_MAX_TENSORS);
            if (header->count == header->capacity) {
                size_t capacity = header->capacity ? header->capacity * 2 : 64;
                if (capacity > UFORM_MAX_TENSORS) capacity = UFORM_MAX_TENSORS;
                uform_entry_t* grown = realloc(header->entries, capacity * sizeof(uform_entry_t));
                if (!grown) return uform_json_fail(json, "no memory for %zu tensors' entries", capacity);
                header->entries = grown, header->capacity = capacity;
            }
            uform_entry_t* entry = &header->entries[header->count++];
            memset(entry, 0, sizeof(*entry));
            memcpy(entry->name, name, length + 1);
            if (!uform_json_entry(json, entry)) return 0;
        }
        if (!uform_json_take(json, ',')) break;
    }
    if (!empty && !uform_json_expect(json, '}')) return 0;
    uform_json_space(json);
    if (json->at != json->end) return uform_json_fail(json, "bytes after the header's JSON object");
    return 1;
}

static int uform_entries_by_name(void const* a, void const* b) {
    return strcmp(((uform_entry_t const*)a)->name, ((uform_entry_t const*)b)->name);
}

static int uform_entries_by_offsets(void const* a, void const* b) {
    uform_entry_t const *x = *(uform_entry_t const* const*)a, *y = *(uform_entry_t const* const*)b;
    if (x->begin != y->begin) return (x->begin > y->begin) - (x->begin < y->begin);
    return (x->end > y->end) - (x->end < y->end);
}

static void uform_shape_print(char* out, size_t capacity, uform_entry_t const* entry) {
    size_t used = (size_t)snprintf(out, capacity, "[");
    for (size_t i = 0; i != entry->dimensions && used < capacity; ++i)
        used += (size_t)snprintf(out + used, capacity - used, "%s%llu", i ? ", " : "", (unsigned long long)entry->shape[i]);
    if (used < capacity) snprintf(out + used, capacity - used, "]");
}

/* Checks the tensors tile the data as safetensors requires: each entry's bytes are its shape times its
   dtype's width, entries neither overlap nor leave gaps, and they end where the file ends. */
static uform_status_t uform_entries_check(uform_header_t const* header, char const* what, char const* path,
                                          char const** error) {
    uform_entry_t const** order = malloc((header->count ? header->count : 1) * sizeof(uform_entry_t const*));
    if (!order) return uform_fail(error, uform_status_out_of_memory_k, "%s: no memory to order %zu tensors", what, header->count);
    for (size_t i = 0; i != header->count; ++i) order[i] = &header->entries[i];
    qsort(order, header->count, sizeof(uform_entry_t const*), uform_entries_by_offsets);
    uform_status_t status = uform_status_success_k;
    uint64_t covered = 0;
    char shape[256];
    for (size_t i = 0; i != header->count && status == uform_status_success_k; ++i) {
        uform_entry_t const* entry = order[i];
        uint64_t bytes = entry->dtype_bytes;
        for (size_t d = 0; d != entry->dimensions && bytes; ++d)
            bytes = entry->shape[d] && bytes > UINT64_MAX / entry->shape[d] ? UINT64_MAX : bytes * entry->shape[d];
        uform_shape_print(shape, sizeof(shape), entry);
        if (bytes == UINT64_MAX)
            status = UFORM_BAD("%s: %s: tensor %s has shape %s, whose size overflows 64 bits", what, path, entry->name, shape);
        else if (entry->begin > entry->end)
            status = UFORM_BAD("%s: %s: tensor %s has data_offsets [%llu, %llu], which run backwards", what, path,
                               entry->name, (unsigned long long)entry->begin, (unsigned long long)entry->end);
        else if (entry->end > header->data_size)
            status = UFORM_BAD("%s: %s: tensor %s at bytes [%llu, %llu) runs past the end of the data, %llu bytes: "
                               "the file is truncated or its offsets are wrong",
                               what, path, entry->name, (unsigned long long)entry->begin,
                               (unsigned long long)entry->end, (unsigned long long)header->data_size);
        else if (entry->end - entry->begin != bytes)
            status = UFORM_BAD("%s: %s: tensor %s spans %llu bytes, but its shape %s of %s needs %llu", what, path,
                               entry->name, (unsigned long long)(entry->end - entry->begin), shape, entry->dtype,
                               (unsigned long long)bytes);
    }
    /* Each entry is sound alone; now whether they tile. */
    for (size_t i = 0; i != header->count && status == uform_status_success_k; ++i) {
        uform_entry_t const* entry = order[i];
        if (entry->begin < covered)
            status = UFORM_BAD("%s: %s: tensor %s at bytes [%llu, %llu) overlaps tensor %s at [%llu, %llu)", what, path,
                               entry->name, (unsigned long long)entry->begin, (unsigned long long)entry->end,
                               order[i - 1]->name, (unsigned long long)order[i - 1]->begin,
                               (unsigned long long)order[i - 1]->end);
        else if (entry->begin > covered)
            status = UFORM_BAD("%s: %s: %llu bytes at [%llu, %llu) before tensor %s belong to no tensor", what, path,
                               (unsigned long long)(entry->begin - covered), (unsigned long long)covered,
                               (unsigned long long)entry->begin, entry->name);
        covered = entry->end;
    }
    free(order);
    if (status == uform_status_success_k && covered != header->data_size)
        status = UFORM_BAD("%s: %s: %llu bytes after the last tensor belong to no tensor", what, path,
                           (unsigned long long)(header->data_size - covered));
    return status;
}

/* Opens a checkpoint and checks all of its structure; on success the caller owns `*opened` and
   `header->entries`. `what` names the argument that brought the path: "resume" or "path". The note, if
   any, lands in `note` (NULL: nowhere) as far as `capacity` allows; `header->note_length` is its length. */
static uform_status_t uform_checkpoint_open(char const* path, char const* what, char* note, size_t capacity,
                                            FILE** opened, uform_header_t* header, char const** error) {
    memset(header, 0, sizeof(*header));
    header->note = note, header->note_capacity = capacity;
    FILE* file = fopen(path, "rb");
    if (!file) return uform_fail(error, uform_status_io_k, "%s: cannot open %s: %s", what, path, strerror(errno));
    uform_status_t status = uform_status_success_k;
    char* text = NULL;
    struct stat info;
    unsigned char length_bytes[8];
    if (fstat(fileno(file), &info) != 0 || !S_ISREG(info.st_mode)) {
        status = uform_fail(error, uform_status_io_k, "%s: %s is not a regular file", what, path);
        goto done;
    }
    uint64_t file_size = (uint64_t)info.st_size, header_length = 0;
    if (file_size < 8 || fread(length_bytes, 1, 8, file) != 8) {
        status = UFORM_BAD("%s: %s is %llu bytes, too short for a safetensors header's 8-byte length", what, path,
                           (unsigned long long)file_size);
        goto done;
    }
    for (int i = 0; i != 8; ++i) header_length |= (uint64_t)length_bytes[i] << (8 * i);
    if (header_length > file_size - 8) {
        status = UFORM_BAD("%s: %s claims a header of %llu bytes, but only %llu bytes follow its length", what, path,
                           (unsigned long long)header_length, (unsigned long long)(file_size - 8));
        goto done;
    }
    if (header_length > UFORM_MAX_HEADER || header_length < 2) {
        status = UFORM_BAD("%s: %s claims a header of %llu bytes; a header takes 2 bytes to 64 MiB", what, path,
                           (unsigned long long)header_length);
        goto done;
    }
    text = malloc(header_length);
    if (!text) {
        status = uform_fail(error, uform_status_out_of_memory_k, "%s: no memory for a %llu-byte header", what,
                            (unsigned long long)header_length);
        goto done;
    }
    if (fread(text, 1, header_length, file) != header_length) {
        status = UFORM_BAD("%s: %s ends inside its header", what, path);
        goto done;
    }
    size_t valid = uform_utf8_prefix(text, header_length);
    if (valid != header_length) {
        status = UFORM_BAD("%s: %s has a header that is not UTF-8 at byte %zu (0x%02x)", what, path, valid + 8,
                           (unsigned char)text[valid]);
        goto done;
    }
    uform_json_t json = {text, text, text + header_length, ""};
    if (!uform_header_parse(&json, header)) {
        status = UFORM_BAD("%s: %s has a malformed header at byte %zu: %s", what, path, (size_t)(json.at - text) + 8,
                           json.problem);
        goto done;
    }
    if (!(header->given & 1)) status = UFORM_BAD("%s: %s lacks __metadata__, so it is no uform checkpoint", what, path);
    else if (!(header->given & 2)) status = UFORM_BAD("%s: %s lacks __metadata__.format", what, path);
    else if (strcmp(header->format, UFORM_FORMAT))
        status = UFORM_BAD("%s: %s has format \"%s\", not \"" UFORM_FORMAT "\"", what, path, header->format);
    else if (!(header->given & 4)) status = UFORM_BAD("%s: %s lacks its step in __metadata__.step", what, path);
    else if (!(header->given & 8)) status = UFORM_BAD("%s: %s lacks its config in __metadata__.config", what, path);
    if (status != uform_status_success_k) goto done;
    if (header->count) qsort(header->entries, header->count, sizeof(uform_entry_t), uform_entries_by_name);
    for (size_t i = 1; i < header->count && status == uform_status_success_k; ++i)
        if (!strcmp(header->entries[i].name, header->entries[i - 1].name))
            status = UFORM_BAD("%s: %s gives the tensor %s twice", what, path, header->entries[i].name);
    header->data_start = 8 + header_length, header->data_size = file_size - 8 - header_length;
    if (status == uform_status_success_k) status = uform_entries_check(header, what, path, error);
done:
    free(text);
    if (status != uform_status_success_k) {
        free(header->entries);
        header->entries = NULL;
        fclose(file);
    } else
        *opened = file;
    return status;
}

/* Reads the rows a checkpoint records (`uform_field_t.checkpoint`) out of one object of its config into `recorded`,
   checking and skipping every other key. `path` holds the object's name, "batch.image." say, in its first `prefix`
   bytes, "" at the top. */
static int uform_config_object(uform_json_t* json, char* path, size_t prefix, uform_trainer_init_vram_t* recorded,
                               int depth) {
    if (!uform_json_expect(json, '{')) return 0;
    if (uform_json_take(json, '}')) return 1;
    unsigned char seen[uform_fields_count_k] = {0}; /* by the row of a key, or of an object's first field */
    do {
        char key[40];
        size_t length, k = uform_fields_count_k;
        if (!uform_json_string(json, key, sizeof(key), &length) || !uform_json_expect(json, ':')) return 0;
        int object = 0; /* a key naming an object of recorded rows rather than one */
        if (length < sizeof(key) && !memchr(key, '.', length)) {
            memcpy(path + prefix, key, length + 1);
            for (size_t i = 0; i != uform_fields_count_k && k == uform_fields_count_k; ++i) {
                char const* name = uform_fields[i].name;
                if (uform_fields[i].checkpoint && !strncmp(name, path, prefix + length) &&
                    (!name[prefix + length] || name[prefix + length] == '.'))
                    k = i, object = name[prefix + length] == '.';
            }
        }
        if (k == uform_fields_count_k) {
            if (!uform_json_skip(json, depth + 1)) return 0;
            continue;
        }
        if (seen[k]) return uform_json_fail(json, "config.%s is given twice", path);
        seen[k] = 1;
        if (object) {
            path[prefix + length] = '.';
            if (!uform_config_object(json, path, prefix + length + 1, recorded, depth + 1)) return 0;
            continue;
        }
        uint64_t value;
        if (!uform_json_unsigned(json, &value) || value > UINT32_MAX) {
            json->problem[0] = 0; /* this message says more than the number reader's */
            return uform_json_fail(json, "config.%s is not an integer in [0, 2^32)", path);
        }
        *(uint32_t*)((char*)recorded + uform_fields[k].offset) = (uint32_t)value;
    } while (uform_json_take(json, ','));
    return uform_json_expect(json, '}');
}

/* Reads the recorded rows of the config the metadata carries, which is JSON in a JSON string; zero where absent. */
static uform_status_t uform_config_read(uform_header_t const* header, uform_trainer_init_vram_t* recorded,
                                        char const* what, char const* path, char const** error) {
    memset(recorded, 0, sizeof(*recorded));
    char name[64]; /* an object's path ("late_interaction." at longest) and a key of at most 39 bytes */
    uform_json_t json = {header->config, header->config, header->config + strlen(header->config), ""};
    int ok = uform_config_object(&json, name, 0, recorded, 0);
    uform_json_space(&json);
    if (ok && json.at != json.end) ok = uform_json_fail(&json, "bytes after the config's JSON object");
    if (!ok)
        return UFORM_BAD("%s: %s has a malformed __metadata__.config at byte %zu: %s", what, path,
                         (size_t)(json.at - json.begin), json.problem);
    for (size_t i = 0; i != uform_fields_count_k; ++i)
        if ((uform_fields[i].checkpoint & uform_field_needed_k) &&
            !*(uint32_t const*)((char const*)recorded + uform_fields[i].offset))
            return UFORM_BAD("%s: %s has no config.%s in its metadata, or 0, where a model needs one", what, path,
                             uform_fields[i].name);
    return uform_status_success_k;
}

/* Finds each of the layout's tensors, in every family the file claims to hold, as F32 of its shape; refuses any
   other tensor. With the tiling checked, the data then is exactly the size the layout needs. */
static uform_status_t uform_tensors_match(uform_header_t* header, uform_layout_t const* layout, char const* what,
                                          char const* path, char const** error) {
    for (int family = 0; family != (header->weights_only ? 1 : 3); ++family)
        for (size_t i = 0; i != layout->count; ++i) {
            uform_tensor_t const* tensor = &layout->tensors[i];
            uform_entry_t key;
            snprintf(key.name, sizeof(key.name), "%s%s", uform_families[family], tensor->name);
            uform_entry_t* entry = header->count ? bsearch(&key, header->entries, header->count, sizeof(uform_entry_t),
                                                           uform_entries_by_name)
                                                 : NULL;
            if (!entry) return UFORM_BAD("%s: %s lacks the tensor %s", what, path, key.name);
            char shape[256];
            uform_shape_print(shape, sizeof(shape), entry);
            int matches = tensor->rows == 1 ? entry->dimensions == 1 && entry->shape[0] == tensor->cols
                                            : entry->dimensions == 2 && entry->shape[0] == tensor->rows &&
                                                  entry->shape[1] == tensor->cols;
            if (strcmp(entry->dtype, "F32") || !matches) {
                char needed[64];
                if (tensor->rows == 1) snprintf(needed, sizeof(needed), "[%zu]", tensor->cols);
                else snprintf(needed, sizeof(needed), "[%zu, %zu]", tensor->rows, tensor->cols);
                return UFORM_BAD("%s: %s holds %s as %s %s, the model needs F32 %s", what, path, key.name,
                                 entry->dtype, shape, needed);
            }
            entry->used = 1;
        }
    for (size_t k = 0; k != header->count; ++k)
        if (!header->entries[k].used && header->weights_only && !strncmp(header->entries[k].name, "adamw.", 6))
            return UFORM_BAD("%s: %s says __metadata__.weights_only is \"true\" yet holds the moment %s", what, path,
                             header->entries[k].name);
        else if (!header->entries[k].used)
            return UFORM_BAD("%s: %s holds the tensor %s, which a model of depth %u, hidden %u and %u temperature "
                             "groups lacks",
                             what, path, header->entries[k].name, layout->depth, layout->hidden,
                             layout->temperature_groups);
    return uform_status_success_k;
}

/* Reads one tensor and checks every value: weights and first moments finite, second moments finite
   and not negative. A run never saves anything else, and AdamW would spread any of it to every weight. */
static uform_status_t uform_tensor_read(FILE* file, uform_header_t const* header, char const* name, int family,
                                        float* values, size_t count, char const* what, char const* path,
                                        char const** error) {
    uform_entry_t key;
    snprintf(key.name, sizeof(key.name), "%s", name);
    uform_entry_t const* entry =
        header->count ? bsearch(&key, header->entries, header->count, sizeof(uform_entry_t), uform_entries_by_name) : NULL;
    if (!entry || fseeko(file, (off_t)(header->data_start + entry->begin), SEEK_SET) != 0 ||
        fread(values, sizeof(float), count, file) != count)
        return UFORM_BAD("%s: %s ends inside %s (was it cut while being read?)", what, path, name);
    for (size_t k = 0; k != count; ++k)
        if (!isfinite(values[k]) || (family == 2 && values[k] < 0))
            return UFORM_BAD("%s: %s holds %g in %s at element %zu; %s", what, path, uform_printed(values[k]), name, k,
                             family == 2 ? "second moments must be finite and not negative" : "values must be finite");
    return uform_status_success_k;
}

/**
 *  Reads the geometry an encoder of a checkpoint runs with: the run's depth, width, temperature
 *  groups and columns, checked as a trainer's config would be, with every tensor that geometry
 *  needs present in the file. The rows are the encoder's own: it packs at most
 *  `uform_encoder_tokens_k` tokens a pass, so what it allocates follows the model in the file, not
 *  the batch the run trained with, which no byte of the file vouches for. A run whose rows were
 *  longer than that is refused by name.
 */
enum { uform_encoder_tokens_k = uform_longest_row_k };

uform_status_t uform_checkpoint_config(char const* path, uform_trainer_init_vram_t* config, char const** error) {
    FILE* file;
    uform_header_t header;
    uform_status_t status = uform_checkpoint_open(path, "path", NULL, 0, &file, &header, error);
    if (status != uform_status_success_k) return status;
    fclose(file);
    uform_trainer_init_vram_t wanted;
    status = uform_config_read(&header, &wanted, "path", path, error);
    wanted.batch.max_choices_per_item = 256; /* inference may offer any set of bytes */
    wanted.objective = uform_objective_contrastive_k, wanted.schedule.steps = 1;
    if (wanted.late_interaction.max_query_span) /* the token head's tensors are in the file: the layout has them too */
        wanted.late_interaction.weight = 1;
    else
        wanted.late_interaction.width = 0; /* the width of a head the file lacks is no one's to check */
    uform_config_t derived;
    char const* refusal = NULL;
    if (status == uform_status_success_k && uform_config_derive(&derived, &wanted, &refusal) != uform_status_success_k) {
        char reason[512]; /* the message lives where the next one is written */
        snprintf(reason, sizeof(reason), "%s", refusal ? refusal : "refused");
        status = UFORM_BAD("path: %s records a config no trainer takes: %s", path, reason);
    }
    uform_layout_t layout = {0};
    if (status == uform_status_success_k)
        status = uform_layout_init(&layout, &derived.given, error);
    if (status == uform_status_success_k) status = uform_tensors_match(&header, &layout, "path", path, error);
    uform_layout_free(&layout);
    free(header.entries);
    if (status != uform_status_success_k) return status;

    uint32_t columns = derived.given.batch.max_columns_per_row, rows = uform_encoder_tokens_k / columns;
    if (!rows)
        return UFORM_BAD("path: %s records config.batch.max_columns_per_row = %u; an encoder packs at most %d "
                         "tokens a pass",
                         path, columns, uform_encoder_tokens_k);
    if (rows > derived.given.batch.max_rows_per_device) rows = derived.given.batch.max_rows_per_device;
    uint32_t segments = derived.given.batch.max_segments_per_device;
    if (segments > rows * columns) segments = rows * columns; /* every item takes at least one token */
    *config = wanted;
    config->batch.max_rows_per_device = rows;
    config->batch.max_segments_per_device = segments;
    return uform_status_success_k;
}

/* A resumed run's refusal, its reason followed by what to do `next`. An encoder's (`path: ...`) is left as it is: it
   has no run to mend. Out of memory is no fault of the file's. */
static uform_status_t uform_resume_refused(uform_status_t status, char const* next, char const** error) {
    if (status == uform_status_out_of_memory_k) return status;
    return uform_fail(error, status, "%s; %s", uform_message(), next);
}

uform_status_t uform_checkpoint_load(char const* path, uform_layout_t const* layout, float* weights, float* first,
                                     float* second, uint64_t* step, char const** error) {
    char const* what = first ? "resume" : "path"; /* a run's config field, or an encoder's argument */
    /* A file that no run resumes from (unreadable, cut short, of another kind) leaves another to take; a config that
       differs from the checkpoint's leaves its field to set as the checkpoint has it. */
    char next[192] = "resume from another checkpoint";
    FILE* file;
    uform_header_t header;
    uform_trainer_init_vram_t recorded;
    uform_status_t status = uform_checkpoint_open(path, what, NULL, 0, &file, &header, error);
    if (status != uform_status_success_k) return first ? uform_resume_refused(status, next, error) : status;
    if (first && header.weights_only) {
        status = UFORM_BAD("resume: %s is a weights-only checkpoint: it holds no optimizer moments, so no run resumes "
                           "from it", path);
        snprintf(next, sizeof(next), "resume from a whole checkpoint (saved without weights_only), or load this one "
                 "for inference with uform_encoder_load (Encoder.load in Python)");
    }
    if (status == uform_status_success_k) status = uform_config_read(&header, &recorded, what, path, error);
    uint64_t head = layout->token_head == SIZE_MAX ? 0 : layout->tensors[layout->token_head].rows;
    uform_late_interaction_t const* late = &recorded.late_interaction;
    if (status == uform_status_success_k && !late->max_query_span != !head) {
        status = UFORM_BAD("%s: the checkpoint %s %s late-interaction token head, the config %s (late_interaction.weight "
                           "%s)", what, path, head ? "has no" : "has a", head ? "trains one" : "trains none",
                           head ? "> 0" : "= 0");
        snprintf(next, sizeof(next), "set config.late_interaction.weight %s to resume from it",
                 head ? "to 0" : "above 0");
    }
    if (status == uform_status_success_k && head && late->width != head) {
        status = UFORM_BAD("%s: the checkpoint %s has late_interaction.width = %u, the config asks for %llu", what, path,
                           late->width, (unsigned long long)head);
        snprintf(next, sizeof(next), "set config.late_interaction.width = %u to resume from it", late->width);
    }
    /* The fixed rows, as the layout holds them: each projection's columns mean one layout of values, which two
       shapes of as many values would scramble. The stride and sample rate only choose which frames and samples are
       read, so a resumed run may change them. */
    uform_trainer_init_vram_t run;
    memset(&run, 0, sizeof(run));
    run.depth = layout->depth, run.hidden = layout->hidden, run.contrastive.temperature_groups = layout->temperature_groups;
    run.batch.image = layout->image, run.batch.video = layout->video, run.batch.audio = layout->audio;
    for (size_t i = 0; i != uform_fields_count_k && status == uform_status_success_k; ++i) {
        uform_field_t const* field = &uform_fields[i];
        if (!(field->checkpoint & uform_field_fixed_k)) continue;
        uint32_t found = *(uint32_t const*)((char const*)&recorded + field->offset);
        uint32_t expected = *(uint32_t const*)((char const*)&run + field->offset);
        if (!found) found = (uint32_t)field->derived; /* absent: as a config's zero derives */
        if (found != expected) {
            status = UFORM_BAD("%s: the checkpoint %s has %s = %u, the config asks for %u", what, path, field->name,
                               found, expected);
            snprintf(next, sizeof(next), "set config.%s = %u to resume from it", field->name, found);
        }
    }
    if (status == uform_status_success_k) status = uform_tensors_match(&header, layout, what, path, error);
    /* An encoder reads the weights alone: a whole checkpoint's moments had their names, shapes and places checked,
       but their values are the resumed run's to judge. */
    float* families[3] = {weights, first, second};
    for (int family = 0; family != (first ? 3 : 1) && status == uform_status_success_k; ++family)
        for (size_t i = 0; i != layout->count && status == uform_status_success_k; ++i) {
            uform_tensor_t const* tensor = &layout->tensors[i];
            char name[sizeof(header.entries->name)];
            snprintf(name, sizeof(name), "%s%s", uform_families[family], tensor->name);
            status = uform_tensor_read(file, &header, name, family, families[family] + tensor->offset,
                                       tensor->rows * tensor->cols, what, path, error);
        }
    if (status == uform_status_success_k) *step = header.step;
    free(header.entries);
    fclose(file);
    return first && status != uform_status_success_k ? uform_resume_refused(status, next, error) : status;
}

uform_status_t uform_checkpoint_note(char const* path, char* note, size_t capacity, size_t* length, char const** error) {
    if (!path) return uform_fail(error, uform_status_invalid_argument_k, "path: NULL");
    if (!*path) return uform_fail(error, uform_status_invalid_argument_k, "path: empty");
    if (!length) return uform_fail(error, uform_status_invalid_argument_k, "length: NULL output pointer");
    FILE* file;
    uform_header_t header;
    uform_status_t status = uform_checkpoint_open(path, "path", note, capacity, &file, &header, error);
    if (status != uform_status_success_k) return status;
    fclose(file);
    free(header.entries);
    *length = header.note_length;
    if (!note) return uform_status_success_k;
    if (header.note_length >= capacity) { /* the reader kept what fits; a cut note is no note, so none is left */
        if (capacity) note[0] = 0;
        return uform_fail(error, uform_status_invalid_argument_k, "capacity: %zu bytes; the note of %s takes %zu and a NUL",
                          capacity, path, header.note_length);
    }
    note[header.note_length] = 0; /* a file without a note reads as the empty one */
    return uform_status_success_k;
}
