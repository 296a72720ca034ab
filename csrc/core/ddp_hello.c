/* ddp_hello.c - the data-link hello and its authentication, and the
 * announcement of authentication failures through the store (contract in
 * ddp_hello.h). */
#include "ddp_hello.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_le.h"
#include "ddp_sock.h"

void ddp_hello_encode(const ddp_hello *h, unsigned char out[DDP_HELLO_BYTES]) {
    ddp_le_put32(out, h->magic);
    ddp_le_put32(out + 4, h->wire);
    ddp_le_put64(out + 8, h->tag);
    ddp_le_put32(out + 16, (uint32_t)h->rank);
    ddp_le_put32(out + 20, (uint32_t)h->size);
    ddp_le_put32(out + 24, h->flags);
    ddp_le_put32(out + 28, h->stream);
    ddp_le_put32(out + 32, (uint32_t)h->to);
    ddp_le_put32(out + 36, h->spare);
}

void ddp_hello_decode(const unsigned char in[DDP_HELLO_BYTES], ddp_hello *h) {
    h->magic = ddp_le_get32(in);
    h->wire = ddp_le_get32(in + 4);
    h->tag = ddp_le_get64(in + 8);
    h->rank = (int32_t)ddp_le_get32(in + 16);
    h->size = (int32_t)ddp_le_get32(in + 20);
    h->flags = ddp_le_get32(in + 24);
    h->stream = ddp_le_get32(in + 28);
    h->to = (int32_t)ddp_le_get32(in + 32);
    h->spare = ddp_le_get32(in + 36);
}

void ddp_hello_purpose(uint64_t tag, int from, int to, int size, int stream, char *out,
                       size_t len) {
    int k = snprintf(out, len, "pyddp data link %016" PRIx64 " %d->%d of %d", tag, from, to,
                     size);
    if (stream > 0 && k >= 0 && (size_t)k < len)   /* stream 0: as before striping */
        snprintf(out + k, len - (size_t)k, " stream %d", stream);
}

static ddp_status send_reply(int fd, uint32_t verdict, ddp_wait w, const char *addr) {
    unsigned char r[DDP_HELLO_REPLY_BYTES];
    ddp_le_put32(r, DDP_HELLO_REPLY_MAGIC);
    ddp_le_put32(r + 4, verdict);
    return ddp_sock_send_all(fd, r, sizeof r, w, addr);
}

void ddp_hello_refuse(int fd, uint32_t verdict, ddp_wait w) {
    send_reply(fd, verdict, w, "a connecting peer");
}

ddp_status ddp_hello_connect(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                             const char *peer) {
    uint32_t verdict;
    return ddp_hello_connect_v(fd, a, purpose, w, peer, &verdict);
}

ddp_status ddp_hello_connect_v(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                               const char *peer, uint32_t *verdict_out) {
    unsigned char r[DDP_HELLO_REPLY_BYTES];
    *verdict_out = 0;
    ddp_status st = ddp_sock_recv_all(fd, r, sizeof r, w, peer);
    if (st == DDP_ERR_CLOSED)
        return ddp_error(DDP_ERR_AUTH, "authentication failed with %s: it closed the "
                         "connection instead of answering this rank's hello (a process that "
                         "is not this job's rank, or one with another group or version)",
                         peer);
    if (st != DDP_OK) return st;
    uint32_t magic = ddp_le_get32(r), verdict = ddp_le_get32(r + 4);
    if (magic != DDP_HELLO_REPLY_MAGIC)
        return ddp_error(DDP_ERR_PROTOCOL, "%s answered the hello with garbage (magic %#x): "
                         "is that port another program's?", peer, (unsigned)magic);
    *verdict_out = verdict;
    if (verdict == DDP_HELLO_DUPLICATE)
        return ddp_error(DDP_ERR_CLOSED, "%s keeps its own connection to this rank", peer);
    if (verdict == DDP_HELLO_BROKEN)
        return ddp_error(DDP_ERR_CLOSED, "%s has already failed (its process group is "
                         "broken: see its error)", peer);
    if (verdict == DDP_HELLO_GONE)
        return ddp_error(DDP_ERR_CLOSED, "%s has left the process group (its process "
                         "destroyed it, or ended it after a failure: see its output)", peer);
    if (verdict == DDP_HELLO_OK && a == NULL) return DDP_OK;
    if (verdict == DDP_HELLO_AUTH && a != NULL) return ddp_auth_initiate(fd, a, purpose, w, peer);
    if (verdict == DDP_HELLO_NEED_TOKEN || (verdict == DDP_HELLO_AUTH && a == NULL))
        return ddp_error(DDP_ERR_AUTH, "authentication failed with %s: it requires "
                         "PYDDP_AUTH_TOKEN and this rank has none. Set the same token on "
                         "every node.", peer);
    if (verdict == DDP_HELLO_NO_TOKEN || (verdict == DDP_HELLO_OK && a != NULL))
        return ddp_error(DDP_ERR_AUTH, "authentication failed with %s: this rank has "
                         "PYDDP_AUTH_TOKEN set and that rank has none. Set the same token on "
                         "every node.", peer);
    return ddp_error(DDP_ERR_PROTOCOL, "%s answered the hello with verdict %u", peer,
                     (unsigned)verdict);
}

/* Log, note and return a rejection of the connection from addr. */
static ddp_status reject(const char *addr, int rank, const char *why) {
    char msg[700];
    snprintf(msg, sizeof msg, "authentication failed: a connection from %s claiming to be "
             "rank %d %s", addr, rank, why);
    ddp_auth_log_reject("a data connection", addr, why);
    ddp_auth_note_reject(msg);
    return ddp_error(DDP_ERR_AUTH, "%s", msg);
}

ddp_status ddp_hello_accept(int fd, const ddp_hello *h, const ddp_auth *a,
                            const char *purpose, ddp_wait w, const char *addr) {
    int theirs = (h->flags & DDP_HELLO_HAS_TOKEN) != 0;
    uint32_t verdict = a == NULL ? (theirs ? DDP_HELLO_NO_TOKEN : DDP_HELLO_OK)
                                 : (theirs ? DDP_HELLO_AUTH : DDP_HELLO_NEED_TOKEN);
    ddp_status st = send_reply(fd, verdict, w, addr);
    if (verdict == DDP_HELLO_NEED_TOKEN)
        return reject(addr, h->rank, "had no PYDDP_AUTH_TOKEN, and this rank requires one");
    if (verdict == DDP_HELLO_NO_TOKEN)
        return reject(addr, h->rank, "has PYDDP_AUTH_TOKEN set, and this rank has none");
    if (st != DDP_OK) return st == DDP_ERR_ABORTED ? st : reject(addr, h->rank, "went away");
    if (verdict == DDP_HELLO_OK) return DDP_OK;
    st = ddp_auth_respond(fd, a, purpose, w, addr);
    if (st == DDP_OK || st == DDP_ERR_ABORTED || st == DDP_ERR_NOMEM ||
        st == DDP_ERR_UNAVAILABLE)
        return st;
    return reject(addr, h->rank, "failed the PYDDP_AUTH_TOKEN challenge (a different token, "
                  "or not a pyddp rank)");
}

/* ---- announcing failures ------------------------------------------------- */

void ddp_auth_announce(ddp_store *store, const char *prefix, const char *msg) {
    if (store == NULL) return;
    char key[600], saved[1400];
    ddp_copy_error(saved, sizeof saved);   /* the caller's message survives */
    snprintf(key, sizeof key, "%s/auth_failed", prefix);
    ddp_store_set(store, key, strlen(key), msg, strlen(msg), ddp_wait_for(2000, NULL));
    ddp_set_error_text(saved);
}

ddp_status ddp_auth_check_announced(ddp_store *store, const char *prefix, ddp_wait w) {
    char key[600];
    snprintf(key, sizeof key, "%s/auth_failed", prefix);
    const char *k = key;
    size_t kl = strlen(key);
    int ready = 0;
    if (ddp_store_check(store, &k, &kl, 1, &ready, w) != DDP_OK || !ready) return DDP_OK;
    void *val = NULL;
    size_t vlen = 0;
    if (ddp_store_get(store, key, kl, &val, &vlen, w) != DDP_OK) return DDP_OK;
    ddp_status st = ddp_error(DDP_ERR_AUTH, "%.*s", (int)(vlen < 1200 ? vlen : 1200),
                              (const char *)val);
    free(val);
    return st;
}

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t g_when;
static char g_msg[800];

void ddp_auth_note_reject(const char *msg) {
    pthread_mutex_lock(&g_mu);
    g_when = ddp_now_ms();
    snprintf(g_msg, sizeof g_msg, "%s", msg);
    pthread_mutex_unlock(&g_mu);
}

int ddp_auth_last_reject(int64_t since_ms, int64_t *when_ms, char *msg, size_t len) {
    pthread_mutex_lock(&g_mu);
    int have = g_when != 0 && g_when >= since_ms;
    if (have) {
        *when_ms = g_when;
        snprintf(msg, len, "%s", g_msg);
    }
    pthread_mutex_unlock(&g_mu);
    return have;
}
