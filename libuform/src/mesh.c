/**
 *  @file   mesh.c
 *  @brief  Meshes of several processes (SPEC section 6): the rendezvous through files, and the sockets that carry
 *          the collectives of RAM executors' processes.
 *
 *  The rendezvous. Host domain 0 listens on a TCP port of its own and writes, atomically (a temporary file, then a
 *  rename), `directory/job/rendezvous`: a fresh random nonce, its host name and port. Every other host domain reads
 *  that file, connects, and says hello with the nonce, its index and the count. A file left by an earlier run of the
 *  same job points at a port where nobody listens, or at a listener that holds another nonce and hangs up: either
 *  way the peer reads the file again and retries until its timeout. Once every index has joined, host domain 0
 *  removes the file and tells every peer the mesh is whole (or, when someone never came, which ones), so that
 *  `uform_mesh_bootstrap` returns on every process at once, or fails on every process with the same message.
 *
 *  The transport is a star through host domain 0: it receives every peer's part in host-domain order, combines, and
 *  sends the result back. That makes every sum's order fixed, the order one process summing its simulated devices
 *  uses, so a run's bits do not depend on how its devices are spread over processes. Every read and write waits at
 *  most the mesh's timeout; a peer that hangs up or stays silent fails the collective with `uform_status_peer_k`,
 *  and the mesh is then broken for good, as its streams are out of step. A GPU mesh would put NCCL's collectives
 *  behind the same `uform_transport_t`, its unique id carried by this rendezvous.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

enum {
    uform_mesh_magic_k = 0x6d726f66, /* "form": what a peer of this library says first */
    uform_mesh_gather_mark_k = 0x72687467, /* "gthr": what leads every part of a gather */
    uform_mesh_welcome_k = 0,
    uform_mesh_wrong_count_k = 1,
    uform_mesh_taken_k = 2,
};

/* Bumped by `uform_mesh_abandon`: a wait for peers in progress then ends at once. */
static volatile sig_atomic_t uform_abandons = 0;

void uform_mesh_abandon(void) { uform_abandons = uform_abandons + 1; }

/* How long one poll waits at most, so that a wait sees `uform_mesh_abandon` soon. */
static int uform_poll_slice(double left) { return left > 0.2 ? 200 : (int)(left * 1000) + 1; }

static double uform_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

static void uform_pause(double seconds) {
    struct timespec pause = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&pause, NULL);
}

/* ---------------------------------------------------------------------------------------------- */
/*  Sockets                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

typedef struct uform_sockets_t {
    uint32_t index, count;
    int* peers;     /* (count) host domain 0: a socket to each peer, its own slot -1; a peer: slot 0 alone */
    double timeout; /* seconds any one collective waits for a peer */
} uform_sockets_t;

/* Waits until `socket` is ready for `events` or `deadline` passes; `doing` says what the message waits for. */
static uform_status_t uform_socket_wait(int socket, short events, double deadline, uint32_t peer, char const* doing,
                                        char const** error) {
    sig_atomic_t since = uform_abandons;
    for (;;) {
        double left = deadline - uform_now();
        if (left <= 0)
            return uform_fail(error, uform_status_peer_k, "mesh: host domain %u did not answer within the mesh's "
                              "timeout while %s", peer, doing);
        if (uform_abandons != since)
            return uform_fail(error, uform_status_peer_k, "mesh: abandoned while waiting for host domain %u, %s",
                              peer, doing);
        struct pollfd wanted = {.fd = socket, .events = events};
        int ready = poll(&wanted, 1, uform_poll_slice(left));
        if (ready > 0) return uform_status_success_k; /* errors and hang-ups show in the read or write that follows */
        if (ready < 0 && errno != EINTR)
            return uform_fail(error, uform_status_peer_k, "mesh: waiting for host domain %u while %s: %s", peer, doing,
                              strerror(errno));
    }
}

static uform_status_t uform_socket_read(int socket, void* data, size_t bytes, double deadline, uint32_t peer,
                                        char const* doing, char const** error) {
    char* cursor = data;
    while (bytes) {
        UFORM_TRY(uform_socket_wait(socket, POLLIN, deadline, peer, doing, error));
        ssize_t got = recv(socket, cursor, bytes, 0);
        if (got == 0 || (got < 0 && errno == ECONNRESET))
            return uform_fail(error, uform_status_peer_k, "mesh: host domain %u hung up while %s", peer, doing);
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (got < 0)
            return uform_fail(error, uform_status_peer_k, "mesh: reading from host domain %u while %s: %s", peer, doing,
                              strerror(errno));
        cursor += got, bytes -= (size_t)got;
    }
    return uform_status_success_k;
}

static uform_status_t uform_socket_write(int socket, void const* data, size_t bytes, double deadline, uint32_t peer,
                                         char const* doing, char const** error) {
    char const* cursor = data;
    while (bytes) {
        UFORM_TRY(uform_socket_wait(socket, POLLOUT, deadline, peer, doing, error));
        ssize_t sent = send(socket, cursor, bytes, MSG_NOSIGNAL); /* a hung-up peer is an error, not a SIGPIPE */
        if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (sent < 0 && (errno == EPIPE || errno == ECONNRESET))
            return uform_fail(error, uform_status_peer_k, "mesh: host domain %u hung up while %s", peer, doing);
        if (sent < 0)
            return uform_fail(error, uform_status_peer_k, "mesh: writing to host domain %u while %s: %s", peer, doing,
                              strerror(errno));
        cursor += sent, bytes -= (size_t)sent;
    }
    return uform_status_success_k;
}

/* Every message is a frame: its length in bytes, then the bytes. Hosts of one mesh share their byte order. */
static uform_status_t uform_frame_write(uform_sockets_t const* s, uint32_t peer, void const* data, size_t bytes,
                                        char const* doing, char const** error) {
    uint64_t length = bytes;
    double deadline = uform_now() + s->timeout;
    UFORM_TRY(uform_socket_write(s->peers[peer], &length, sizeof(length), deadline, peer, doing, error));
    return uform_socket_write(s->peers[peer], data, bytes, deadline, peer, doing, error);
}

static uform_status_t uform_frame_length(uform_sockets_t const* s, uint32_t peer, uint64_t* length, char const* doing,
                                         char const** error) {
    return uform_socket_read(s->peers[peer], length, sizeof(*length), uform_now() + s->timeout, peer, doing, error);
}

static uform_status_t uform_frame_expect(uform_sockets_t const* s, uint32_t peer, void* data, size_t bytes,
                                         char const* doing, char const** error) {
    uint64_t length;
    UFORM_TRY(uform_frame_length(s, peer, &length, doing, error));
    if (length != bytes)
        return uform_fail(error, uform_status_peer_k, "mesh: host domain %u sent %llu bytes while %s, not %zu: the "
                          "processes make different calls", peer, (unsigned long long)length, doing, bytes);
    return uform_socket_read(s->peers[peer], data, bytes, uform_now() + s->timeout, peer, doing, error);
}

static uform_status_t uform_sockets_all_gather(void* link, void const* mine, size_t bytes, uint8_t** gathered,
                                               size_t* sizes, char const** error) {
    uform_sockets_t* s = link;
    uint32_t count = s->count;
    char const* doing = "gathering every process's part";
    *gathered = NULL;
    if (s->index) { /* send mine, then read every part behind their sizes */
        uint64_t length;
        UFORM_TRY(uform_frame_write(s, 0, mine, bytes, doing, error));
        UFORM_TRY(uform_frame_length(s, 0, &length, doing, error));
        int sized = length >= count * sizeof(uint64_t);
        uint8_t* all = sized ? malloc(length) : NULL;
        if (!all)
            return uform_fail(error, sized ? uform_status_out_of_memory_k : uform_status_peer_k,
                              "mesh: %llu gathered bytes from host domain 0", (unsigned long long)length);
        uform_status_t status = uform_socket_read(s->peers[0], all, length, uform_now() + s->timeout, 0, doing, error);
        uint64_t total = count * sizeof(uint64_t);
        for (uint32_t p = 0; p != count && status == uform_status_success_k; ++p)
            memcpy(&sizes[p], all + p * sizeof(uint64_t), sizeof(uint64_t)), total += sizes[p];
        if (status == uform_status_success_k && total != length)
            status = uform_fail(error, uform_status_peer_k, "mesh: host domain 0 gathered %llu bytes, not the %llu "
                                "its sizes add up to", (unsigned long long)length, (unsigned long long)total);
        if (status != uform_status_success_k) {
            free(all);
            return status;
        }
        memmove(all, all + count * sizeof(uint64_t), length - count * sizeof(uint64_t));
        *gathered = all;
        return uform_status_success_k;
    }
    /* Host domain 0: the sizes first, then every part in host-domain order, then the whole to every peer. */
    size_t head = count * sizeof(uint64_t), filled = head + bytes;
    uint8_t* all = malloc(filled);
    if (!all) return uform_fail(error, uform_status_out_of_memory_k, "mesh: no memory to gather %zu bytes", bytes);
    sizes[0] = bytes;
    memcpy(all + head, mine, bytes);
    uform_status_t status = uform_status_success_k;
    for (uint32_t p = 1; p != count && status == uform_status_success_k; ++p) {
        uint64_t length;
        status = uform_frame_length(s, p, &length, doing, error);
        uint8_t* grown = status == uform_status_success_k ? realloc(all, filled + length) : NULL;
        if (status == uform_status_success_k && !grown)
            status = uform_fail(error, uform_status_out_of_memory_k, "mesh: no memory for host domain %u's %llu bytes",
                                p, (unsigned long long)length);
        if (grown) all = grown;
        if (status == uform_status_success_k)
            status = uform_socket_read(s->peers[p], all + filled, length, uform_now() + s->timeout, p, doing, error);
        sizes[p] = length, filled += length;
    }
    for (uint32_t p = 0; p != count && status == uform_status_success_k; ++p) {
        uint64_t size = sizes[p];
        memcpy(all + p * sizeof(uint64_t), &size, sizeof(size));
    }
    for (uint32_t p = 1; p != count && status == uform_status_success_k; ++p)
        status = uform_frame_write(s, p, all, filled, doing, error);
    if (status != uform_status_success_k) {
        free(all);
        return status;
    }
    memmove(all, all + head, filled - head);
    *gathered = all;
    return uform_status_success_k;
}

static uform_status_t uform_sockets_broadcast(void* link, void* data, size_t bytes, char const** error) {
    uform_sockets_t* s = link;
    char const* doing = "receiving host domain 0's broadcast";
    if (s->index) return uform_frame_expect(s, 0, data, bytes, doing, error);
    for (uint32_t p = 1; p != s->count; ++p) UFORM_TRY(uform_frame_write(s, p, data, bytes, doing, error));
    return uform_status_success_k;
}

/* Adds `part` into `sum`, or copies it for the first part: the order one process sums its devices in. */
static void uform_sum_part(float* sum, float const* part, size_t length, int* first) {
    if (*first) memcpy(sum, part, length * sizeof(float));
    else
        for (size_t k = 0; k != length; ++k) sum[k] += part[k];
    *first = 0;
}

static uform_status_t uform_sockets_sum(void* link, float* sum, float* scratch, float const* const* parts,
                                        size_t parts_count, size_t length, char const** error) {
    uform_sockets_t* s = link;
    char const* doing = "summing gradients";
    size_t part_bytes = length * sizeof(float);
    if (s->index) {
        uint64_t bytes = parts_count * part_bytes;
        double deadline = uform_now() + s->timeout;
        UFORM_TRY(uform_socket_write(s->peers[0], &bytes, sizeof(bytes), deadline, 0, doing, error));
        for (size_t k = 0; k != parts_count; ++k)
            UFORM_TRY(uform_socket_write(s->peers[0], parts[k], part_bytes, deadline, 0, doing, error));
        return uform_frame_expect(s, 0, sum, part_bytes, doing, error);
    }
    int first = 1;
    for (size_t k = 0; k != parts_count; ++k) uform_sum_part(sum, parts[k], length, &first);
    for (uint32_t p = 1; p != s->count; ++p) {
        uint64_t bytes;
        UFORM_TRY(uform_frame_length(s, p, &bytes, doing, error));
        if (!part_bytes || bytes % part_bytes)
            return uform_fail(error, uform_status_peer_k, "mesh: host domain %u sent %llu bytes of gradients, not a "
                              "multiple of %zu", p, (unsigned long long)bytes, part_bytes);
        for (uint64_t k = 0; k != bytes / part_bytes; ++k) {
            UFORM_TRY(uform_socket_read(s->peers[p], scratch, part_bytes, uform_now() + s->timeout, p, doing, error));
            uform_sum_part(sum, scratch, length, &first);
        }
    }
    if (first) memset(sum, 0, part_bytes); /* no device of any process had items */
    for (uint32_t p = 1; p != s->count; ++p) UFORM_TRY(uform_frame_write(s, p, sum, part_bytes, doing, error));
    return uform_status_success_k;
}

static void uform_sockets_close(void* link) {
    uform_sockets_t* s = link;
    if (!s) return;
    for (uint32_t p = 0; s->peers && p != s->count; ++p)
        if (s->peers[p] >= 0) close(s->peers[p]);
    free(s->peers);
    free(s);
}

static uform_transport_t const uform_sockets_transport = {
    .all_gather = uform_sockets_all_gather,
    .broadcast = uform_sockets_broadcast,
    .sum = uform_sockets_sum,
    .close = uform_sockets_close,
};

/* ---------------------------------------------------------------------------------------------- */
/*  Collectives, as the core calls them                                                            */
/* ---------------------------------------------------------------------------------------------- */

/* A collective that failed midway leaves bytes unread in some stream: no later one could trust what it reads. */
static uform_status_t uform_mesh_enter(uform_mesh_s* mesh, char const** error) {
    pthread_mutex_lock(&mesh->lock);
    if (!mesh->broken) return uform_status_success_k;
    pthread_mutex_unlock(&mesh->lock);
    return uform_fail(error, uform_status_peer_k, "mesh: broken by an earlier failure among its processes; free the "
                      "trainer and the mesh, and resume every process from a checkpoint");
}

/* Must hold the lock. Closing the sockets tells every peer at once, rather than after its timeout. */
static void uform_mesh_break_locked(uform_mesh_s* mesh) {
    if (!mesh->broken && mesh->link) mesh->transport->close(mesh->link), mesh->link = NULL;
    mesh->broken = true;
}

static uform_status_t uform_mesh_leave(uform_mesh_s* mesh, uform_status_t status) {
    if (status != uform_status_success_k) uform_mesh_break_locked(mesh);
    pthread_mutex_unlock(&mesh->lock);
    return status;
}

void uform_mesh_break(uform_mesh_s* mesh) {
    pthread_mutex_lock(&mesh->lock);
    uform_mesh_break_locked(mesh);
    pthread_mutex_unlock(&mesh->lock);
}

uform_status_t uform_mesh_out_of_step(uform_mesh_s* mesh, uint32_t peer, char const* theirs, char const* doing,
                                      char const** error) {
    uform_mesh_break(mesh);
    return uform_fail(error, uform_status_peer_k, "mesh: host domain %u is in another exchange (%s) while this process "
                      "%s; every process calls the same verbs in the same order", peer, theirs, doing);
}

uform_status_t uform_mesh_all_gather(uform_mesh_s* mesh, void const* mine, size_t bytes, uint8_t** gathered,
                                     size_t* sizes, char const** error) {
    UFORM_TRY(uform_mesh_enter(mesh, error));
    return uform_mesh_leave(mesh, mesh->transport->all_gather(mesh->link, mine, bytes, gathered, sizes, error));
}

uform_status_t uform_mesh_broadcast(uform_mesh_s* mesh, void* data, size_t bytes, char const** error) {
    UFORM_TRY(uform_mesh_enter(mesh, error));
    return uform_mesh_leave(mesh, mesh->transport->broadcast(mesh->link, data, bytes, error));
}

uform_status_t uform_mesh_sum(uform_mesh_s* mesh, float* sum, float* scratch, float const* const* parts,
                              size_t parts_count, size_t length, char const** error) {
    UFORM_TRY(uform_mesh_enter(mesh, error));
    return uform_mesh_leave(mesh, mesh->transport->sum(mesh->link, sum, scratch, parts, parts_count, length, error));
}

/* ---------------------------------------------------------------------------------------------- */
/*  The rendezvous                                                                                 */
/* ---------------------------------------------------------------------------------------------- */

/* What a peer says first, and what host domain 0 answers. */
typedef struct uform_hello_t {
    uint32_t magic, index, count, answer;
    uint8_t nonce[16];
} uform_hello_t;

typedef struct uform_meeting_t {
    char folder[4096], file[4200];
    uint32_t index, count;
    double timeout, deadline;
    sig_atomic_t abandons; /* `uform_abandons` when the meeting began */
} uform_meeting_t;

static uform_status_t uform_meeting_check(uform_meeting_t* m, uform_mesh_bootstrap_t const* config, char const** error) {
    char const *directory = config->directory, *job = config->job;
    struct stat found;
    if (!directory || !*directory) return UFORM_INVALID("directory: required for %u processes", m->count);
    if (stat(directory, &found) != 0)
        return UFORM_INVALID("directory: %s: %s", directory, strerror(errno));
    if (!S_ISDIR(found.st_mode)) return UFORM_INVALID("directory: %s is not a folder", directory);
    if (!job || !*job) return UFORM_INVALID("job: required for %u processes", m->count);
    if (strchr(job, '/') || !strcmp(job, ".") || !strcmp(job, ".."))
        return UFORM_INVALID("job: \"%.200s\" is not a plain name: a job is one folder under the directory", job);
    if (strlen(job) > 200) return UFORM_INVALID("job: %zu bytes; at most 200", strlen(job));
    if (strlen(directory) > 3800) return UFORM_INVALID("directory: %zu bytes; at most 3800", strlen(directory));
    snprintf(m->folder, sizeof(m->folder), "%.3800s/%.200s", directory, job);
    snprintf(m->file, sizeof(m->file), "%s/rendezvous", m->folder);
    /* Every process makes the folder, so none depends on another having come first. */
    if (mkdir(m->folder, 0777) != 0 && errno != EEXIST)
        return uform_fail(error, uform_status_io_k, "job: cannot make %s: %s", m->folder, strerror(errno));
    if (stat(m->folder, &found) != 0 || !S_ISDIR(found.st_mode))
        return uform_fail(error, uform_status_io_k, "job: %s is not a folder", m->folder);
    return uform_status_success_k;
}

/* Every wait is a poll with a deadline, so sockets never block; a program the caller starts does not inherit them,
   so a process that dies closes its sockets and its peers learn it at once. */
static int uform_socket_prepare(int socket) {
    int flags = fcntl(socket, F_GETFL, 0), on = 1;
    setsockopt(socket, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on)); /* frames are small and awaited one by one */
    return flags >= 0 && fcntl(socket, F_SETFL, flags | O_NONBLOCK) == 0 && fcntl(socket, F_SETFD, FD_CLOEXEC) == 0;
}

static void uform_nonce_draw(uint8_t nonce[16]) {
    /* The nonce only tells this run's file from an earlier one's; where no random device answers, the time and the
       process id do that too. */
    FILE* random = fopen("/dev/urandom", "rb");
    size_t got = random ? fread(nonce, 1, 16, random) : 0;
    if (random) fclose(random);
    if (got == 16) return;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t a = uform_mix((uint64_t)now.tv_nsec ^ (uint64_t)now.tv_sec << 30), b = uform_mix(a ^ (uint64_t)getpid());
    memcpy(nonce, &a, 8), memcpy(nonce + 8, &b, 8);
}

/* Writes the file peers read: to a name of this process's own, then renamed, so a reader sees all of it or none. */
static uform_status_t uform_rendezvous_write(uform_meeting_t const* m, uint8_t const nonce[16], unsigned port,
                                             char const** error) {
    char host[256] = "localhost", temporary[4300], hex[33];
    if (gethostname(host, sizeof(host) - 1) != 0) snprintf(host, sizeof(host), "localhost");
    for (int i = 0; i != 16; ++i) snprintf(hex + 2 * i, 3, "%02x", nonce[i]);
    snprintf(temporary, sizeof(temporary), "%s/.rendezvous.%ld.partial", m->folder, (long)getpid());
    FILE* file = fopen(temporary, "w");
    if (!file) return uform_fail(error, uform_status_io_k, "job: cannot write %s: %s", temporary, strerror(errno));
    int written = fprintf(file, "uform-mesh 1\nnonce %s\ncount %u\nport %u\nhost %s\n", hex, m->count, port, host) > 0;
    written = fflush(file) == 0 && fsync(fileno(file)) == 0 && written;
    if (fclose(file) != 0 || !written || rename(temporary, m->file) != 0) {
        int why = errno;
        remove(temporary);
        return uform_fail(error, uform_status_io_k, "job: cannot write %s: %s", m->file, strerror(why));
    }
    return uform_status_success_k;
}

/* Reads host domain 0's file; answers 0, with `why` set, while it is absent or not a file of this count (of any count
   where `counted` is given, which then receives it). */
static int uform_rendezvous_read(uform_meeting_t const* m, uint8_t nonce[16], char* host, unsigned* port, char* why,
                                 size_t capacity, unsigned* counted) {
    FILE* file = fopen(m->file, "r");
    if (!file) {
        snprintf(why, capacity, "%.300s: %s", m->file, strerror(errno));
        return 0;
    }
    char hex[33] = "";
    unsigned count = 0, version = 0;
    int fields = fscanf(file, "uform-mesh %u nonce %32s count %u port %u host %255s", &version, hex, &count, port, host);
    fclose(file);
    if (fields != 5 || version != 1 || strlen(hex) != 32) {
        snprintf(why, capacity, "%.300s is not a rendezvous file", m->file);
        return 0;
    }
    if (counted) *counted = count;
    else if (count != m->count) { /* an earlier run's, or a peer counting otherwise: the message names it */
        snprintf(why, capacity, "%.300s counts %u processes, not %u", m->file, count, m->count);
        return 0;
    }
    for (int i = 0; i != 16; ++i) {
        unsigned byte = 0; /* a digit that is not hex reads as a nonce no listener holds */
        sscanf(hex + 2 * i, "%2x", &byte);
        nonce[i] = (uint8_t)byte;
    }
    return 1;
}

/* Connects to `host`, or to this machine when that is this machine's name, within `deadline`; -1 with `why` set. */
static int uform_connect(char const* host, unsigned port, double deadline, char* why, size_t capacity) {
    char own[256] = "", service[16];
    if (gethostname(own, sizeof(own) - 1) == 0 && !strcmp(own, host)) host = "127.0.0.1";
    snprintf(service, sizeof(service), "%u", port);
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *found = NULL;
    int resolved = getaddrinfo(host, service, &hints, &found);
    if (resolved != 0) {
        snprintf(why, capacity, "cannot resolve %s: %s", host, gai_strerror(resolved));
        return -1;
    }
    int made = socket(found->ai_family, found->ai_socktype, found->ai_protocol);
    if (made < 0 || !uform_socket_prepare(made)) {
        snprintf(why, capacity, "socket: %s", strerror(errno));
        if (made >= 0) close(made);
        freeaddrinfo(found);
        return -1;
    }
    int connected = connect(made, found->ai_addr, found->ai_addrlen);
    freeaddrinfo(found);
    if (connected != 0 && errno == EINPROGRESS) {
        struct pollfd wanted = {.fd = made, .events = POLLOUT};
        double left = deadline - uform_now();
        int failure = 0;
        socklen_t length = sizeof(failure);
        if (left > 0 && poll(&wanted, 1, (int)(left * 1000) + 1) == 1 &&
            getsockopt(made, SOL_SOCKET, SO_ERROR, &failure, &length) == 0 && failure == 0)
            connected = 0;
        else errno = failure ? failure : ETIMEDOUT;
    }
    if (connected != 0) {
        snprintf(why, capacity, "connecting to %s port %u: %s", host, port, strerror(errno));
        close(made);
        return -1;
    }
    return made;
}

/* The verdict host domain 0 sends every peer once the wait ends: a status and its message. */
static uform_status_t uform_verdict_send(uform_sockets_t* s, uform_status_t status, char const* message) {
    uint8_t frame[1024 + 4];
    uint32_t code = (uint32_t)status;
    size_t length = strlen(message) > 1023 ? 1023 : strlen(message);
    memcpy(frame, &code, 4), memcpy(frame + 4, message, length);
    for (uint32_t p = 1; p != s->count; ++p)
        if (s->peers[p] >= 0) uform_frame_write(s, p, frame, 4 + length, "starting the mesh", NULL);
    return status;
}

/* Refuses to meet where host domain 0 of another run is meeting now, rather than take its place and its peers: its
   file names a listener that answers a hello with its nonce. A file left by a run that has ended points at nobody,
   or at a listener that holds another nonce, and is written over. */
static uform_status_t uform_meeting_unclaimed(uform_meeting_t const* m, char const** error) {
    char host[256] = "", why[512];
    unsigned port = 0, count = 0;
    uint8_t nonce[16];
    if (!uform_rendezvous_read(m, nonce, host, &port, why, sizeof(why), &count)) return uform_status_success_k;
    double deadline = uform_now() + 2;
    int peer = uform_connect(host, port, deadline, why, sizeof(why));
    if (peer < 0) return uform_status_success_k;
    uform_hello_t hello = {.magic = uform_mesh_magic_k, .index = 0, .count = count}; /* index 0 is taken: it hangs up */
    memcpy(hello.nonce, nonce, 16);
    int live = uform_socket_write(peer, &hello, sizeof(hello), deadline, 0, "", NULL) == uform_status_success_k &&
               uform_socket_read(peer, &hello, sizeof(hello), deadline, 0, "", NULL) == uform_status_success_k &&
               hello.magic == uform_mesh_magic_k && !memcmp(hello.nonce, nonce, 16);
    close(peer);
    return live ? UFORM_INVALID("job: a host domain 0 is meeting under %s already (at %s port %u): give each run a "
                                "job of its own; in one run, one process is host domain 0", m->folder, host, port)
                : uform_status_success_k;
}

static uform_status_t uform_meet_as_first(uform_meeting_t const* m, uform_sockets_t* s, char const** error) {
    UFORM_TRY(uform_meeting_unclaimed(m, error));
    int listener = socket(AF_INET, SOCK_STREAM, 0), on = 1;
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY), .sin_port = 0};
    socklen_t length = sizeof(address);
    if (listener < 0 || setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0 ||
        bind(listener, (struct sockaddr*)&address, sizeof(address)) != 0 || listen(listener, (int)m->count) != 0 ||
        getsockname(listener, (struct sockaddr*)&address, &length) != 0 || !uform_socket_prepare(listener)) {
        int why = errno;
        if (listener >= 0) close(listener);
        return uform_fail(error, uform_status_io_k, "mesh: cannot listen for peers: %s", strerror(why));
    }
    uint8_t nonce[16];
    uform_nonce_draw(nonce);
    uform_status_t status = uform_rendezvous_write(m, nonce, ntohs(address.sin_port), error);
    uint32_t joined = 1;
    while (status == uform_status_success_k && joined != m->count) {
        double left = m->deadline - uform_now();
        if (left <= 0) break;
        if (uform_abandons != m->abandons)
            status = uform_fail(error, uform_status_peer_k, "mesh: abandoned while waiting for peers under %s",
                                m->folder);
        struct pollfd wanted = {.fd = listener, .events = POLLIN};
        if (status != uform_status_success_k || poll(&wanted, 1, uform_poll_slice(left)) <= 0) continue;
        int peer = accept(listener, NULL, NULL);
        if (peer < 0 || !uform_socket_prepare(peer)) {
            if (peer >= 0) close(peer);
            continue;
        }
        /* A stranger, or a peer of an earlier run, gets a short wait and no answer: it hangs up and tries again. */
        uform_hello_t hello;
        double wait = uform_now() + (left < 5 ? left : 5);
        if (uform_socket_read(peer, &hello, sizeof(hello), wait, 0, "", NULL) != uform_status_success_k ||
            hello.magic != uform_mesh_magic_k || memcmp(hello.nonce, nonce, 16)) {
            close(peer);
            continue;
        }
        int taken = hello.index > 0 && hello.index < m->count && s->peers[hello.index] >= 0;
        uint32_t theirs = hello.count;
        hello.answer = hello.count != m->count ? uform_mesh_wrong_count_k
                       : taken || !hello.index || hello.index >= m->count ? uform_mesh_taken_k
                                                                         : uform_mesh_welcome_k;
        hello.count = m->count;
        int answered = uform_socket_write(peer, &hello, sizeof(hello), wait, 0, "", NULL) == uform_status_success_k;
        if (answered && hello.answer == uform_mesh_welcome_k) s->peers[hello.index] = peer, ++joined;
        else close(peer);
        if (hello.answer == uform_mesh_wrong_count_k) /* this run's nonce: a process of it counts otherwise */
            status = UFORM_INVALID("host_domain_count: %u here, but host domain %u came under %s counting %u",
                                   m->count, hello.index, m->folder, theirs);
    }
    close(listener);
    remove(m->file); /* this run is whole or given up: no later peer should find it */
    if (status != uform_status_success_k) return uform_verdict_send(s, status, uform_message());
    if (joined == m->count) return uform_verdict_send(s, uform_status_success_k, "");
    char missing[512] = "";
    size_t used = 0, absent = 0;
    for (uint32_t p = 1; p != m->count; ++p)
        if (s->peers[p] < 0 && used < sizeof(missing) - 16)
            used += (size_t)snprintf(missing + used, sizeof(missing) - used, "%s%u", absent++ ? ", " : "", p);
    uform_fail(error, uform_status_peer_k, "timeout: host domain%s %s of %u never joined within %g s under %s",
               absent > 1 ? "s" : "", missing, m->count, m->timeout, m->folder);
    return uform_verdict_send(s, uform_status_peer_k, uform_message());
}

static uform_status_t uform_meet_as_peer(uform_meeting_t const* m, uform_sockets_t* s, char const** error) {
    char why[512] = "", host[256] = "";
    while (uform_now() < m->deadline) {
        if (uform_abandons != m->abandons)
            return uform_fail(error, uform_status_peer_k, "mesh: abandoned while waiting for host domain 0 under %s",
                              m->folder);
        uint8_t nonce[16];
        unsigned port = 0, counted = 0;
        int peer = -1;
        /* A file of another count is read too: its host domain 0, if it answers, says so, and both fail at once. */
        if (uform_rendezvous_read(m, nonce, host, &port, why, sizeof(why), &counted))
            peer = uform_connect(host, port, m->deadline, why, sizeof(why));
        if (peer < 0) {
            uform_pause(0.05);
            continue;
        }
        uform_hello_t hello = {.magic = uform_mesh_magic_k, .index = m->index, .count = m->count};
        memcpy(hello.nonce, nonce, 16);
        uform_status_t status = uform_socket_write(peer, &hello, sizeof(hello), m->deadline, 0, "saying hello", NULL);
        if (status == uform_status_success_k)
            status = uform_socket_read(peer, &hello, sizeof(hello), m->deadline, 0, "saying hello", NULL);
        if (status != uform_status_success_k || hello.magic != uform_mesh_magic_k || memcmp(hello.nonce, nonce, 16)) {
            /* An earlier run's file, or a listener of another: read the file again. */
            snprintf(why, sizeof(why), "%s:%u did not answer as host domain 0 of this run", host, port);
            close(peer);
            uform_pause(0.05);
            continue;
        }
        if (hello.answer != uform_mesh_welcome_k) {
            close(peer);
            return hello.answer == uform_mesh_wrong_count_k
                       ? UFORM_INVALID("host_domain_count: %u here, but host domain 0 under %s counts %u", m->count,
                                       m->folder, hello.count)
                       : UFORM_INVALID("host_domain_index: %u has already joined the mesh under %s", m->index,
                                       m->folder);
        }
        s->peers[0] = peer;
        /* Wait for the verdict: every process returns once the mesh is whole, or fails with the same message. */
        uint64_t length;
        uint8_t verdict[1024 + 4];
        double deadline = m->deadline + 5; /* host domain 0 sends it as its own wait ends */
        status = uform_socket_read(peer, &length, sizeof(length), deadline, 0, "waiting for the other peers", error);
        if (status == uform_status_success_k && (length < 4 || length > sizeof(verdict) - 1))
            status = uform_fail(error, uform_status_peer_k, "mesh: host domain 0 sent a verdict of %llu bytes",
                                (unsigned long long)length);
        if (status == uform_status_success_k)
            status = uform_socket_read(peer, verdict, length, deadline, 0, "waiting for the other peers", error);
        if (status != uform_status_success_k) return status;
        uint32_t code;
        memcpy(&code, verdict, 4);
        verdict[length] = 0;
        return code ? uform_fail(error, (uform_status_t)code, "%s", (char const*)verdict + 4) : uform_status_success_k;
    }
    if (!host[0]) /* no file of host domain 0 was ever read */
        return uform_fail(error, uform_status_peer_k, "timeout: host domain 0 never opened the meeting under %s within "
                          "%g s (no readable %s): start it, with the same directory and job", m->folder, m->timeout,
                          m->file);
    return uform_fail(error, uform_status_peer_k, "timeout: host domain 0 did not take host domain %u in within %g s "
                      "under %s (last: %s)", m->index, m->timeout, m->folder, why);
}

/* Joins the processes of `config` through files under `directory/job`, into sockets on `*link`. */
static uform_status_t uform_mesh_meet(uform_mesh_bootstrap_t const* config, uint32_t count, void** link,
                                      char const** error) {
    uform_meeting_t meeting = {.index = config->host_domain_index, .count = count};
    meeting.timeout = config->timeout_seconds > 0 ? config->timeout_seconds : 300;
    UFORM_TRY(uform_meeting_check(&meeting, config, error));
    meeting.deadline = uform_now() + meeting.timeout, meeting.abandons = uform_abandons;
    uform_sockets_t* s = calloc(1, sizeof(uform_sockets_t));
    int* peers = calloc(count, sizeof(int));
    if (!s || !peers) {
        free(s), free(peers);
        return uform_fail(error, uform_status_out_of_memory_k, "no memory for a mesh of %u processes", count);
    }
    s->index = meeting.index, s->count = count, s->peers = peers, s->timeout = meeting.timeout;
    for (uint32_t p = 0; p != count; ++p) peers[p] = -1;
    uform_status_t status =
        meeting.index ? uform_meet_as_peer(&meeting, s, error) : uform_meet_as_first(&meeting, s, error);
    if (status != uform_status_success_k) uform_sockets_close(s);
    else *link = s;
    return status;
}

/* ---------------------------------------------------------------------------------------------- */
/*  The verbs                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

uform_status_t uform_mesh_bootstrap(uform_executor_t executor, uform_mesh_bootstrap_t const* config,
                                    uform_mesh_t* mesh, char const** error) {
    uform_status_t status = uform_handles_check(executor, uform_handle_executor_k, "executor", error);
    if (status != uform_status_success_k) return status;
    if (!config || !mesh) return uform_fail(error, uform_status_invalid_argument_k, "mesh: NULL config or output");
    uint32_t count = config->host_domain_count ? config->host_domain_count : 1;
    if (count > 65536) /* a process waits for each of the others by name: a count in the billions is a mistake */
        return UFORM_INVALID("host_domain_count: %u is over 65536", count);
    if (config->host_domain_index >= count)
        return UFORM_INVALID("host_domain_index: %u is not below host_domain_count %u", config->host_domain_index,
                             count);
    if (!(config->timeout_seconds >= 0) || config->timeout_seconds > 1e9)
        return UFORM_INVALID("timeout_seconds: %g is not a number of seconds in [0, 1e9]",
                             uform_printed(config->timeout_seconds));
    /* The mesh borrows its executor for its life, so the executor cannot be freed under it. */
    void* devices = NULL;
    status = uform_handles_acquire(executor, uform_handle_executor_k, "executor", &devices, error);
    if (status != uform_status_success_k) return status;
    if (count > 1 && ((uform_executor_s*)devices)->backend != &uform_ram_backend) {
        uform_handles_release(devices);
        return uform_fail(error, uform_status_unsupported_k,
                          "executor: a mesh of %u processes joins RAM executors; VRAM executors need the NCCL mesh, "
                          "which this build lacks", count);
    }
    uform_mesh_s* made = calloc(1, sizeof(uform_mesh_s));
    if (!made) {
        uform_handles_release(devices);
        return uform_fail(error, uform_status_out_of_memory_k, "no memory for a mesh");
    }
    pthread_mutex_init(&made->lock, NULL);
    made->executor = devices;
    made->host_domain_index = config->host_domain_index;
    made->host_domain_count = count;
    if (count > 1) {
        made->transport = &uform_sockets_transport;
        status = uform_mesh_meet(config, count, &made->link, error);
    }
    if (status == uform_status_success_k) status = uform_handles_add(made, uform_handle_mesh_k, mesh, error);
    if (status != uform_status_success_k) {
        if (made->link) made->transport->close(made->link);
        pthread_mutex_destroy(&made->lock);
        uform_handles_release(devices), free(made);
    }
    return status;
}

uform_status_t uform_mesh_gather(uform_mesh_t mesh, void const* data, size_t bytes, void** gathered, uint64_t* sizes,
                                 char const** error) {
    if (!gathered || !sizes) return UFORM_INVALID("gathered, sizes: NULL output");
    *gathered = NULL;
    if (!data && bytes) return UFORM_INVALID("data: NULL with %zu bytes", bytes);
    void* object;
    uform_status_t status = uform_handles_acquire(mesh, uform_handle_mesh_k, "mesh", &object, error);
    if (status != uform_status_success_k) return status;
    uform_mesh_s* joined = object;
    if (joined->host_domain_count > 1) {
        /* Each part goes behind a mark, so that a process in another exchange (a step) is found out, not read. */
        uint32_t count = joined->host_domain_count, mark = uform_mesh_gather_mark_k;
        size_t* measured = malloc(count * sizeof(size_t));
        uint8_t *marked = malloc(4 + bytes), *all = NULL;
        if (!measured || !marked) status = uform_fail(error, uform_status_out_of_memory_k, "no memory to gather");
        if (status == uform_status_success_k) {
            memcpy(marked, &mark, 4);
            if (bytes) memcpy(marked + 4, data, bytes);
            status = uform_mesh_all_gather(joined, marked, 4 + bytes, &all, measured, error);
        }
        size_t at = 0, kept = 0;
        for (uint32_t p = 0; status == uform_status_success_k && p != count; at += measured[p++]) {
            uint32_t theirs = 0;
            if (measured[p] >= 4) memcpy(&theirs, all + at, 4);
            if (theirs != mark) { /* a refusal (`uform_mesh_refuse`) leaves every process in step; anything else not */
                status = theirs && theirs <= uform_status_peer_k
                             ? uform_fail(error, (uform_status_t)theirs, "host domain %u refused its part: %.*s", p,
                                          (int)(measured[p] - 4), (char const*)all + at + 4)
                             : uform_mesh_out_of_step(joined, p, "a step?", "gathers", error);
                break;
            }
            memmove(all + kept, all + at + 4, measured[p] - 4), kept += measured[p] - 4, sizes[p] = measured[p] - 4;
        }
        if (status == uform_status_success_k) *gathered = all, all = NULL;
        free(all), free(marked), free(measured);
    } else if (!(*gathered = malloc(bytes ? bytes : 1)))
        status = uform_fail(error, uform_status_out_of_memory_k, "no memory to gather %zu bytes", bytes);
    else {
        if (bytes) memcpy(*gathered, data, bytes);
        sizes[0] = bytes;
    }
    uform_handles_release(joined);
    return status;
}

void uform_mesh_gathered_free(void* gathered) { free(gathered); }

uform_status_t uform_mesh_refused(uform_mesh_s* mesh, uform_status_t status, char const* reason, char const** error) {
    if (!mesh->transport) return uform_status_success_k;
    size_t length = strlen(reason) > 1000 ? 1000 : strlen(reason);
    size_t* sizes = malloc(mesh->host_domain_count * sizeof(size_t));
    uint8_t part[4 + 1000], *gathered = NULL;
    uint32_t code = (uint32_t)status;
    memcpy(part, &code, 4), memcpy(part + 4, reason, length);
    uform_status_t shared = sizes ? uform_mesh_all_gather(mesh, part, 4 + length, &gathered, sizes, error)
                                  : uform_fail(error, uform_status_out_of_memory_k, "no memory to refuse");
    free(sizes), free(gathered);
    return shared;
}

uform_status_t uform_mesh_refuse(uform_mesh_t mesh, char const* reason, char const** error) {
    if (!reason) return UFORM_INVALID("reason: NULL");
    void* object;
    uform_status_t status = uform_handles_acquire(mesh, uform_handle_mesh_k, "mesh", &object, error);
    if (status != uform_status_success_k) return status;
    status = uform_mesh_refused(object, uform_status_invalid_argument_k, reason, error);
    uform_handles_release(object);
    return status;
}

uform_status_t uform_mesh_free(uform_mesh_t mesh, char const** error) {
    void* object;
    uform_status_t status = uform_handles_remove(mesh, uform_handle_mesh_k, "mesh", &object, error);
    if (status == uform_status_success_k) {
        uform_mesh_s* freed = object;
        if (freed->link) freed->transport->close(freed->link);
        pthread_mutex_destroy(&freed->lock);
        uform_handles_release(freed->executor);
        free(freed);
    }
    return status;
}
