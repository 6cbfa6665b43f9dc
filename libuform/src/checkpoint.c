/**
 *  @file   checkpoint.c
 *  @brief  Safetensors checkpoints: every weight, both AdamW moments, the step and the config.
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

#include "core.h"

#define UFORM_FORMAT "uform/1"
#define UFORM_BAD(...) uform_fail(error, uform_status_invalid_checkpoint_k, __VA_ARGS__)

/* The three families of tensors a checkpoint holds, each with the layout's names behind its prefix. */
static char const* const uform_families[3] = {"", "adamw.first.", "adamw.second."};

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
                                     char const* config_json, char const** error) {
    if (!path || !*path) return uform_fail(error, uform_status_invalid_argument_k, "path: empty");
    char const* slash = strrchr(path, '/');
    size_t folder = slash ? (size_t)(slash - path + 1) : 0;
    char const* name = path + folder;
    if (!*name || !strcmp(name, ".") || !strcmp(name, ".."))
        return uform_fail(error, uform_status_invalid_argument_k, "path: %s names a folder, not a file", path);
    uform_text_t header = {0};
    char step_text[32];
    snprintf(step_text, sizeof(step_text), "%llu", (unsigned long long)step);
    int ok = uform_text_print(&header, "{\"__metadata__\": {\"format\": \"" UFORM_FORMAT "\", \"step\": \"%s\", \"config\": ",
                              step_text) &&
             uform_text_quote(&header, config_json) && uform_text_append(&header, "}", 1);
    size_t offset = 0;
    for (int family = 0; family != 3 && ok; ++family)
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
    for (int family = 0; family != 3 && !reason; ++family)
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

typedef struct uform_json_t {
    char const* at;
    char const* end;
} uform_json_t;

static void uform_json_space(uform_json_t* json) {
    while (json->at < json->end && (*json->at == ' ' || *json->at == '\n' || *json->at == '\r' || *json->at == '\t'))
        ++json->at;
}

static int uform_json_take(uform_json_t* json, char expected) {
    uform_json_space(json);
    if (json->at < json->end && *json->at == expected) return ++json->at, 1;
    return 0;
}

/* Reads a string into `out` (truncated to `capacity - 1` bytes, \u escapes kept only when ASCII). */
static int uform_json_string(uform_json_t* json, char* out, size_t capacity) {
    if (!uform_json_take(json, '"')) return 0;
    size_t length = 0;
    while (json->at < json->end && *json->at != '"') {
        char c = *json->at++;
        if ((unsigned char)c < 0x20) return 0;
        if (c == '\\') {
            if (json->at >= json->end) return 0;
            char e = *json->at++;
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u': {
                if (json->end - json->at < 4) return 0;
                unsigned code = 0;
                for (int i = 0; i != 4; ++i) {
                    char h = *json->at++;
                    code = code * 16 + (unsigned)(h >= '0' && h <= '9'   ? h - '0'
                                                  : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                                  : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                                         : 99);
                    if (code > 0xFFFF) return 0;
                }
                c = code < 0x80 ? (char)code : '?';
                break;
            }
            default: return 0;
            }
        }
        if (out && length + 1 < capacity) out[length++] = c;
    }
    if (out && capacity) out[length] = 0;
    return uform_json_take(json, '"');
}

static int uform_json_unsigned(uform_json_t* json, uint64_t* value) {
    uform_json_space(json);
    char const* start = json->at;
    uint64_t result = 0;
    while (json->at < json->end && *json->at >= '0' && *json->at <= '9') {
        uint64_t digit = (uint64_t)(*json->at++ - '0');
        if (result > (UINT64_MAX - digit) / 10) return 0;
        result = result * 10 + digit;
    }
    *value = result;
    return json->at != start;
}

/* Skips any value, nesting at most 32 deep. */
static int uform_json_skip(uform_json_t* json, int depth) {
    if (depth > 32) return 0;
    uform_json_space(json);
    if (json->at >= json->end) return 0;
    char c = *json->at;
    if (c == '"') return uform_json_string(json, NULL, 0);
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        ++json->at;
        if (uform_json_take(json, close)) return 1;
        do {
            if (c == '{' && !(uform_json_string(json, NULL, 0) && uform_json_take(json, ':'))) return 0;
            if (!uform_json_skip(json, depth + 1)) return 0;
        } while (uform_json_take(json, ','));
        return uform_json_take(json, close);
    }
    char const* start = json->at;
    while (json->at < json->end && strchr("0123456789+-.eEtruefalsn", *json->at)) ++json->at;
    return json->at != start;
}

typedef struct uform_entry_t {
    char name[96];
    int f32;
    size_t dimensions;
    uint64_t shape[8];
    uint64_t begin, end;
} uform_entry_t;

static int uform_json_entry(uform_json_t* json, uform_entry_t* entry) {
    if (!uform_json_take(json, '{')) return 0;
    if (uform_json_take(json, '}')) return 1;
    do {
        char key[32], dtype[16];
        if (!uform_json_string(json, key, sizeof(key)) || !uform_json_take(json, ':')) return 0;
        if (!strcmp(key, "dtype")) {
            if (!uform_json_string(json, dtype, sizeof(dtype))) return 0;
            entry->f32 = !strcmp(dtype, "F32");
        } else if (!strcmp(key, "shape") || !strcmp(key, "data_offsets")) {
            int shape = !strcmp(key, "shape");
            size_t count = 0;
            uint64_t values[8];
            if (!uform_json_take(json, '[')) return 0;
            if (!uform_json_take(json, ']')) {
                do {
                    if (count == 8 || !uform_json_unsigned(json, &values[count++])) return 0;
                } while (uform_json_take(json, ','));
                if (!uform_json_take(json, ']')) return 0;
            }
            if (shape) {
                entry->dimensions = count;
                memcpy(entry->shape, values, sizeof(values));
            } else {
                if (count != 2) return 0;
                entry->begin = values[0], entry->end = values[1];
            }
        } else if (!uform_json_skip(json, 1))
            return 0;
    } while (uform_json_take(json, ','));
    return uform_json_take(json, '}');
}

/* Reads `"key": number` out of the config the metadata carries; 0 when absent. */
static uint64_t uform_config_number(char const* config, char const* key) {
    char pattern[64];
    snprintf(pattern, sizeof(pattern), "\"%s\": ", key);
    char const* found = strstr(config, pattern);
    if (!found) return 0;
    uform_json_t json = {found + strlen(pattern), found + strlen(found)};
    uint64_t value = 0;
    return uform_json_unsigned(&json, &value) ? value : 0;
}

typedef struct uform_header_t {
    uform_entry_t* entries;
    size_t count, capacity;
    char format[32];
    char config[4096];
    uint64_t step;
    int has_step;
} uform_header_t;

static int uform_header_parse(uform_json_t* json, uform_header_t* header) {
    if (!uform_json_take(json, '{')) return 0;
    if (uform_json_take(json, '}')) return 1;
    do {
        char name[96];
        if (!uform_json_string(json, name, sizeof(name)) || !uform_json_take(json, ':')) return 0;
        if (!strcmp(name, "__metadata__")) {
            if (!uform_json_take(json, '{')) return 0;
            if (uform_json_take(json, '}')) continue;
            do {
                char key[32], value[32];
                if (!uform_json_string(json, key, sizeof(key)) || !uform_json_take(json, ':')) return 0;
                if (!strcmp(key, "config")) {
                    if (!uform_json_string(json, header->config, sizeof(header->config))) return 0;
                    continue;
                }
                if (!uform_json_string(json, value, sizeof(value))) return 0;
                if (!strcmp(key, "format")) strcpy(header->format, value);
                if (!strcmp(key, "step")) {
                    uform_json_t number = {value, value + strlen(value)};
                    header->has_step = uform_json_unsigned(&number, &header->step) && number.at == number.end;
                }
            } while (uform_json_take(json, ','));
            if (!uform_json_take(json, '}')) return 0;
            continue;
        }
        if (header->count == header->capacity) {
            /* The header's own length bounds the entries, so growth is bounded by the file. */
            size_t capacity = header->capacity ? header->capacity * 2 : 64;
            uform_entry_t* grown = realloc(header->entries, capacity * sizeof(uform_entry_t));
            if (!grown) return 0;
            header->entries = grown, header->capacity = capacity;
        }
        uform_entry_t* entry = &header->entries[header->count++];
        memset(entry, 0, sizeof(*entry));
        strcpy(entry->name, name);
        if (!uform_json_entry(json, entry)) return 0;
    } while (uform_json_take(json, ','));
    return uform_json_take(json, '}');
}

static uform_status_t uform_geometry_check(uform_header_t const* header, uform_layout_t const* layout,
                                           char const** error) {
    struct { char const* key; uint64_t expected; } fields[] = {
        {"depth", layout->depth}, {"hidden", layout->hidden}, {"temperature_groups", layout->temperature_groups}};
    for (size_t i = 0; i != sizeof(fields) / sizeof(fields[0]); ++i) {
        uint64_t found = uform_config_number(header->config, fields[i].key);
        if (found && found != fields[i].expected)
            return UFORM_BAD("resume: the checkpoint has %s = %llu, the config asks for %llu", fields[i].key,
                             (unsigned long long)found, (unsigned long long)fields[i].expected);
    }
    return uform_status_success_k;
}

/* Opens a checkpoint and parses its header; on success the caller owns `*file` and `header->entries`. */
static uform_status_t uform_checkpoint_open(char const* path, FILE** opened, uform_header_t* header,
                                            uint64_t* data_start, uint64_t* data_size, char const** error) {
    FILE* file = fopen(path, "rb");
    if (!file) return uform_fail(error, uform_status_io_k, "resume: cannot open %s: %s", path, strerror(errno));
    uform_status_t status = uform_status_success_k;
    char* text = NULL;
    struct stat info;
    unsigned char length_bytes[8];
    memset(header, 0, sizeof(*header));
    if (fstat(fileno(file), &info) != 0 || fread(length_bytes, 1, 8, file) != 8) {
        status = UFORM_BAD("resume: %s is shorter than a safetensors header", path);
        goto done;
    }
    uint64_t file_size = (uint64_t)info.st_size, header_length = 0;
    for (int i = 0; i != 8; ++i) header_length |= (uint64_t)length_bytes[i] << (8 * i);
    if (header_length < 2 || header_length > file_size - 8 || header_length > (64u << 20)) {
        status = UFORM_BAD("resume: %s claims a header of %llu bytes in a file of %llu", path,
                           (unsigned long long)header_length, (unsigned long long)file_size);
        goto done;
    }
    text = malloc(header_length);
    if (!text) {
        status = uform_fail(error, uform_status_out_of_memory_k, "resume: no memory for a %llu-byte header",
                            (unsigned long long)header_length);
        goto done;
    }
    if (fread(text, 1, header_length, file) != header_length) {
        status = UFORM_BAD("resume: %s ends inside its header", path);
        goto done;
    }
    uform_json_t json = {text, text + header_length};
    if (!uform_header_parse(&json, header)) {
        status = UFORM_BAD("resume: %s has a malformed header near byte %zu", path, (size_t)(json.at - text) + 8);
        goto done;
    }
    if (strcmp(header->format, UFORM_FORMAT)) {
        status = UFORM_BAD("resume: %s has format \"%s\", not \"" UFORM_FORMAT "\"", path, header->format);
        goto done;
    }
    if (!header->has_step) status = UFORM_BAD("resume: %s lacks its step in the metadata", path);
    *data_start = 8 + header_length, *data_size = file_size - 8 - header_length;
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

uform_status_t uform_checkpoint_config(char const* path, uform_trainer_init_vram_t* config, char const** error) {
    FILE* file;
    uform_header_t header;
    uint64_t data_start, data_size;
    uform_status_t status = uform_checkpoint_open(path, &file, &header, &data_start, &data_size, error);
    if (status != uform_status_success_k) return status;
    config->depth = (uint32_t)uform_config_number(header.config, "depth");
    config->hidden = (uint32_t)uform_config_number(header.config, "hidden");
    config->contrastive.temperature_groups = (uint32_t)uform_config_number(header.config, "temperature_groups");
    config->batch.max_rows_per_device = (uint32_t)uform_config_number(header.config, "max_rows_per_device");
    config->batch.max_columns_per_row = (uint32_t)uform_config_number(header.config, "max_columns_per_row");
    config->batch.max_segments_per_device = (uint32_t)uform_config_number(header.config, "max_segments_per_device");
    free(header.entries);
    fclose(file);
    if (!config->depth || !config->hidden)
        return UFORM_BAD("path: %s lacks depth and hidden in its metadata's config", path);
    return uform_status_success_k;
}

uform_status_t uform_checkpoint_load(char const* path, uform_layout_t const* layout, float* weights, float* first,
                                     float* second, uint64_t* step, char const** error) {
    FILE* file;
    uform_header_t header;
    uint64_t data_start, data_size;
    uform_status_t status = uform_checkpoint_open(path, &file, &header, &data_start, &data_size, error);
    if (status != uform_status_success_k) return status;
    status = uform_geometry_check(&header, layout, error);
    if (status != uform_status_success_k) goto done;
    float* families[3] = {weights, first, second};
    for (int family = 0; family != 3; ++family)
        for (size_t i = 0; i != layout->count; ++i) {
            uform_tensor_t const* tensor = &layout->tensors[i];
            char name[96];
            snprintf(name, sizeof(name), "%s%s", uform_families[family], tensor->name);
            uform_entry_t const* entry = NULL;
            for (size_t k = 0; k != header.count && !entry; ++k)
                if (!strcmp(header.entries[k].name, name)) entry = &header.entries[k];
            if (!entry) {
                status = UFORM_BAD("resume: %s lacks the tensor %s", path, name);
                goto done;
            }
            int matches = tensor->rows == 1 ? entry->dimensions == 1 && entry->shape[0] == tensor->cols
                                            : entry->dimensions == 2 && entry->shape[0] == tensor->rows &&
                                                  entry->shape[1] == tensor->cols;
            if (!entry->f32 || !matches) {
                status = UFORM_BAD("resume: %s holds %s as %s of %zu dimensions, the config needs F32 [%zu, %zu]",
                                   path, name, entry->f32 ? "F32" : "another dtype", entry->dimensions, tensor->rows,
                                   tensor->cols);
                goto done;
            }
            if (entry->begin > entry->end || entry->end > data_size ||
                entry->end - entry->begin != uform_tensor_bytes(tensor)) {
                status = UFORM_BAD("resume: %s places %s at bytes [%llu, %llu) of %llu", path, name,
                                   (unsigned long long)entry->begin, (unsigned long long)entry->end,
                                   (unsigned long long)data_size);
                goto done;
            }
            if (fseeko(file, (off_t)(data_start + entry->begin), SEEK_SET) != 0 ||
                fread(families[family] + tensor->offset, 1, uform_tensor_bytes(tensor), file) !=
                    uform_tensor_bytes(tensor)) {
                status = UFORM_BAD("resume: %s ends inside %s", path, name);
                goto done;
            }
        }
    *step = header.step;
done:
    free(header.entries);
    fclose(file);
    return status;
}
