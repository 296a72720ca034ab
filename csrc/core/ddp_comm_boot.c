/* ddp_comm_boot.c - a communicator's bootstrap: rendezvous through the
 * store, the version check, and the peer connections (contract in
 * ddp_comm.h; the work queue and worker are in ddp_comm.c).
 *
 *   1. listen on a data port (ephemeral, or the first free one of a range);
 *   2. publish "<prefix>/rank/<r>" = one text line of key=value fields
 *      (version, wire version, advertised host and port, host identity);
 *   3. read every rank's line; any version difference fails on every rank
 *      with the full list of ranks, hosts and versions;
 *   4. connect to every lower rank and accept from every higher rank; the
 *      first bytes on a connection are a hello (magic, wire version, group
 *      tag, rank, size, whether the sender has a token) so stray, stale or
 *      other-version connections are rejected; the acceptor answers, and
 *      with PYDDP_AUTH_TOKEN set both sides then prove they know the token
 *      (ddp_hello.h, ddp_auth.h) before the link is used;
 *   5. upgrade same-host pairs to shared memory where a transport for it is
 *      linked in (ddp_comm_shm.c decides), else keep TCP;
 *   6. with PYDDP_NSOCKS_PERPEER = n > 1 (the same on every rank: checked in
 *      step 3), give every pair still on TCP n-1 more connections, made and
 *      authenticated like the first (their hello carries the stream index),
 *      and stripe the pair's link over all n (ddp_link_tcp_add_streams).
 *      Same-host pairs that moved to shared memory never get extra ones.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_comm_internal.h"
#include "ddp_hello.h"
#include "ddp_settings.h"
#include "ddp_sock.h"

#define HELLO_MAGIC DDP_HELLO_MAGIC
#define HELLO_BYTES DDP_HELLO_BYTES
#define AUTH_POLL_MS 2000   /* how often a waiting rank looks for auth failures */
/* Once every pair has its first connection every rank is up and past its
 * slow steps, so the extra connections of step 6 follow within moments; one
 * that does not arrive fails the rendezvous after this long, not at its
 * timeout. */
#define EXTRA_STREAMS_MS 60000
typedef ddp_hello hello;

/* The connections being made: n sockets per TCP pair; extra[p*(n-1) + k-1]
 * is the fd of stream k (1..n-1) to or from peer p, -1 until it is there. */
typedef struct conns {
    int n;
    int *extra;
} conns;

static int *extra_fd(const conns *cn, int peer, int stream) {
    return &cn->extra[(size_t)peer * (size_t)(cn->n - 1) + (size_t)(stream - 1)];
}

/* Called while waiting at rendezvous: fails this rank when another rank
 * announced an authentication failure, or when this process rejected a
 * connection (its store server or data port) since t0 and what it waits
 * for has still not arrived DDP_AUTH_GRACE_MS later; the failure is then
 * announced to the others. Without this, ranks with different tokens
 * would wait for their whole timeout. */
static ddp_status auth_watch(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                             int64_t t0, const char *waiting_for, ddp_wait w) {
    ddp_status st = ddp_auth_check_announced(store, cfg->prefix, ddp_wait_for(2000, w.abort));
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d: another rank reported: ", c->rank);
    int64_t when = 0;
    char msg[800];
    if (ddp_auth_last_reject(t0, &when, msg, sizeof msg) &&
        ddp_now_ms() - when >= DDP_AUTH_GRACE_MS) {
        st = ddp_error(DDP_ERR_AUTH, "rank %d: %s; %s still missing %d s later. Check that "
                       "every rank has the same PYDDP_AUTH_TOKEN.", c->rank, msg,
                       waiting_for, DDP_AUTH_GRACE_MS / 1000);
        ddp_auth_announce(store, cfg->prefix, ddp_last_error());
        return st;
    }
    return DDP_OK;
}

/* w cut to at most AUTH_POLL_MS from now. */
static ddp_wait poll_slice(ddp_wait w) {
    int64_t end = ddp_now_ms() + AUTH_POLL_MS;
    if (w.deadline_ms > end) w.deadline_ms = end;
    return w;
}

uint64_t ddp_comm_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* Extract field `name` from a "k=v;k=v" line into out. 0 if found. */
static int field(const char *line, const char *name, char *out, size_t outlen) {
    size_t nl = strlen(name);
    const char *p = line;
    while (p && *p) {
        if (strncmp(p, name, nl) == 0 && p[nl] == '=') {
            p += nl + 1;
            size_t i = 0;
            while (p[i] && p[i] != ';' && i + 1 < outlen) { out[i] = p[i]; i++; }
            out[i] = '\0';
            return 0;
        }
        p = strchr(p, ';');
        if (p) p++;
    }
    if (outlen) out[0] = '\0';
    return -1;
}

/* Publish this rank's line and read everyone's into c->lines. */
static ddp_status exchange_lines(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                                 int port, int nsocks, ddp_wait w, int64_t t0) {
    char key[600], line[1200];
    snprintf(line, sizeof line, "ver=%s;wire=%d;addr=%s;port=%d;host=%s;nsocks=%d",
             cfg->version, DDP_WIRE_VERSION, cfg->advertise_host, port, cfg->host_id, nsocks);
    snprintf(key, sizeof key, "%s/rank/%d", cfg->prefix, cfg->rank);
    ddp_status st = ddp_store_set(store, key, strlen(key), line, strlen(line), w);
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d publishing its address: ", c->rank);
    for (int r = 0; r < c->size; r++) {
        void *val = NULL;
        size_t vlen = 0;
        snprintf(key, sizeof key, "%s/rank/%d", cfg->prefix, r);
        for (;;) {   /* in slices, watching for authentication failures */
            st = ddp_store_get(store, key, strlen(key), &val, &vlen, poll_slice(w));
            if (st != DDP_ERR_TIMEOUT || ddp_wait_expired(w)) break;
            char what[64];
            snprintf(what, sizeof what, "rank %d's address", r);
            if ((st = auth_watch(c, cfg, store, t0, what, w)) != DDP_OK) return st;
        }
        if (st != DDP_OK) {
            if (st == DDP_ERR_TIMEOUT)
                return ddp_error(st, "rank %d: rank %d did not join the process group within "
                                 "%.1f s (waiting for store key %s on %s). Check that all %d "
                                 "ranks were started with the same WORLD_SIZE and store "
                                 "address.", c->rank, r, cfg->timeout_ms / 1000.0, key,
                                 ddp_store_peer(store), c->size);
            return ddp_error_prefix(st, "rank %d reading rank %d's address: ", c->rank, r);
        }
        c->lines[r] = malloc(vlen + 1);
        if (c->lines[r] == NULL) { free(val); return ddp_error(DDP_ERR_NOMEM, "out of memory"); }
        memcpy(c->lines[r], val, vlen);
        c->lines[r][vlen] = '\0';
        free(val);
    }
    return DDP_OK;
}

/* Every rank compares every rank's version with its own; all fail alike. */
static ddp_status check_versions(ddp_comm *c) {
    char v0[128], w0[32], vr[128], wr[32], h[256], list[2048] = "";
    field(c->lines[0], "ver", v0, sizeof v0);
    field(c->lines[0], "wire", w0, sizeof w0);
    int bad = 0;
    for (int r = 0; r < c->size; r++) {
        field(c->lines[r], "ver", vr, sizeof vr);
        field(c->lines[r], "wire", wr, sizeof wr);
        if (strcmp(vr, v0) != 0 || strcmp(wr, w0) != 0) bad = 1;
    }
    if (!bad) return DDP_OK;
    size_t used = 0;
    for (int r = 0; r < c->size && used < sizeof list - 200; r++) {
        field(c->lines[r], "ver", vr, sizeof vr);
        field(c->lines[r], "wire", wr, sizeof wr);
        field(c->lines[r], "addr", h, sizeof h);
        used += (size_t)snprintf(list + used, sizeof list - used, "%srank %d on %s: pyddp %s "
                                 "(wire %s)", r ? "; " : "", r, h, vr, wr);
    }
    return ddp_error(DDP_ERR_VERSION, "ranks run different pyddp versions: %s. Install the "
                     "same pyddp version on every node (pip install pyddp==<version>).", list);
}

/* Settings every rank must share, from the lines (a line without the field
 * is from a pyddp that had no such setting: its value was 1). Every rank
 * compares every rank with rank 0, so all fail alike, naming both values. */
static ddp_status check_settings(ddp_comm *c) {
    char v[32], h[256];
    int n0 = field(c->lines[0], "nsocks", v, sizeof v) == 0 ? atoi(v) : 1;
    for (int r = 1; r < c->size; r++) {
        int nr = field(c->lines[r], "nsocks", v, sizeof v) == 0 ? atoi(v) : 1;
        if (nr == n0) continue;
        field(c->lines[r], "addr", h, sizeof h);
        return ddp_error(DDP_ERR_INVALID, "ranks disagree on PYDDP_NSOCKS_PERPEER: rank 0 "
                         "has %d and rank %d (on %s) has %d. Set the same value on every "
                         "rank (or leave it unset everywhere).", n0, r, h, nr);
    }
    return DDP_OK;
}

/* What accept_peers still waits for: the first connection of every higher
 * rank (extras == 0), or the extra ones of every higher rank still on TCP.
 * The first missing one is described in what. */
static int missing(const ddp_comm *c, const conns *cn, int extras, char *what, size_t len) {
    int need = 0;
    for (int p = c->rank + 1; p < c->size; p++) {
        if (!extras) {
            if (c->links[p] == NULL && need++ == 0)
                snprintf(what, len, "rank %d's connection", p);
            continue;
        }
        if (ddp_link_tcp_streams(c->links[p]) == 0) continue;
        for (int k = 1; k < cn->n; k++)
            if (*extra_fd(cn, p, k) < 0 && need++ == 0)
                snprintf(what, len, "rank %d's data connection %d of %d "
                         "(PYDDP_NSOCKS_PERPEER=%d)", p, k + 1, cn->n, cn->n);
    }
    return need;
}

/* Keep an authenticated connection of rank h->rank's stream h->stream: the
 * first becomes the pair's link, an extra one waits for step 6. An extra one
 * that has no place is a clear error, never dropped silently (only a rank
 * that passed the hello can send one). */
static ddp_status place(ddp_comm *c, conns *cn, const hello *h, int fd, int extras) {
    int p = h->rank;
    if (h->stream == 0) {
        c->links[p] = ddp_link_tcp_new(fd, p, c->desc[p]);
        return c->links[p] ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    char why[160] = "";
    if (h->stream >= (uint32_t)cn->n)
        snprintf(why, sizeof why, "its data connection %u, but this rank makes %d per pair",
                 (unsigned)h->stream + 1, cn->n);
    else if (c->links[p] == NULL)
        snprintf(why, sizeof why, "extra data connection %u before its first one",
                 (unsigned)h->stream + 1);
    else if (extras && ddp_link_tcp_streams(c->links[p]) == 0)
        snprintf(why, sizeof why, "extra data connection %u, but the pair uses shared "
                 "memory", (unsigned)h->stream + 1);
    else if (*extra_fd(cn, p, (int)h->stream) >= 0)
        snprintf(why, sizeof why, "data connection %u twice", (unsigned)h->stream + 1);
    if (why[0]) {
        close(fd);
        return ddp_error(DDP_ERR_PROTOCOL, "rank %d: rank %d opened %s (PYDDP_NSOCKS_PERPEER"
                         "=%d here). Do all ranks run the same pyddp with the same setting?",
                         c->rank, p, why, cn->n);
    }
    *extra_fd(cn, p, (int)h->stream) = fd;
    return DDP_OK;
}

/* Accept connections until `missing` has nothing left, by w: the first ones
 * of the higher ranks (extras == 0; extra ones arriving meanwhile are kept
 * too) or their extra ones (extras == 1). */
static ddp_status accept_peers(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                               int lfd, uint64_t tag, const ddp_auth *auth, conns *cn,
                               int extras, ddp_wait w, int64_t t0) {
    char what[160];
    int need;
    while ((need = missing(c, cn, extras, what, sizeof what)) > 0) {
        int fd = -1;
        ddp_status st = ddp_sock_accept(lfd, poll_slice(w), &fd);
        if (st == DDP_ERR_TIMEOUT && !ddp_wait_expired(w)) {
            char waiting[200];
            snprintf(waiting, sizeof waiting, "%s (and %d more)", what, need - 1);
            if ((st = auth_watch(c, cfg, store, t0, need > 1 ? waiting : what, w)) != DDP_OK)
                return st;
            continue;
        }
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d waiting for %s%s: ", c->rank, what,
                                    need > 1 ? " and more" : "");
        /* A peer sends its hello right after connecting; a connection that stays
         * silent (a port scanner, a health check) is dropped after a few seconds
         * rather than holding up the rendezvous until its deadline. */
        unsigned char raw[HELLO_BYTES];
        hello h;
        ddp_wait hw = ddp_wait_for(5000, w.abort);
        if (hw.deadline_ms > w.deadline_ms) hw.deadline_ms = w.deadline_ms;
        /* The first 24 bytes are laid out alike in every wire version, so an
         * older peer's hello is still recognised and named below. */
        memset(raw, 0, sizeof raw);
        st = ddp_sock_recv_all(fd, raw, 24, hw, "a connecting peer");
        ddp_hello_decode(raw, &h);
        if (st == DDP_OK && h.magic == HELLO_MAGIC && h.wire == DDP_WIRE_VERSION) {
            st = ddp_sock_recv_all(fd, raw + 24, sizeof raw - 24, hw, "a connecting peer");
            ddp_hello_decode(raw, &h);
        }
        if (st == DDP_OK && h.magic == HELLO_MAGIC && h.tag == tag && h.wire != DDP_WIRE_VERSION) {
            /* One of ours, but speaking another wire version: the version check
             * through the store normally catches this first; say it plainly. */
            close(fd);
            return ddp_error(DDP_ERR_VERSION, "rank %d: rank %d connected with pyddp wire "
                             "version %u, this rank speaks %d. Install the same pyddp version "
                             "on every node.", c->rank, (int)h.rank, (unsigned)h.wire,
                             DDP_WIRE_VERSION);
        }
        if (st != DDP_OK || h.magic != HELLO_MAGIC || h.tag != tag || h.rank <= c->rank ||
            h.rank >= c->size || h.size != c->size ||
            (h.stream == 0 && c->links[h.rank] != NULL)) {
            close(fd);  /* a stray, stale or silent connection: not ours, ignore it */
            if (st == DDP_ERR_ABORTED || (st == DDP_ERR_TIMEOUT && ddp_wait_expired(w)))
                return st;
            continue;
        }
        /* Nothing but the handshake is read from it until it passes. */
        char addr[DDP_ADDR_MAX + 16], purpose[160];
        ddp_auth_peer_name(fd, addr, sizeof addr);
        ddp_hello_purpose(tag, h.rank, c->rank, c->size, (int)h.stream, purpose, sizeof purpose);
        st = ddp_hello_accept(fd, &h, auth, purpose, hw, addr);
        if (st != DDP_OK) {
            close(fd);   /* dropped (and logged); auth_watch fails the job if need be */
            if (st == DDP_ERR_ABORTED) return st;
            continue;
        }
        if ((st = place(c, cn, &h, fd, extras)) != DDP_OK) return st;
    }
    return DDP_OK;
}

/* Connect stream `stream` to lower rank r and pass the hello: *fd_out. */
static ddp_status connect_one(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                              uint64_t tag, const ddp_auth *auth, int r, int stream,
                              ddp_wait w, int *fd_out) {
    char addr[DDP_ADDR_MAX], port[32], purpose[160];
    field(c->lines[r], "addr", addr, sizeof addr);
    field(c->lines[r], "port", port, sizeof port);
    int fd = -1;
    ddp_status st = ddp_sock_connect(addr, atoi(port), w, &fd);
    if (st == DDP_OK) {
        hello h = {HELLO_MAGIC, DDP_WIRE_VERSION, tag, c->rank, c->size,
                   auth ? DDP_HELLO_HAS_TOKEN : 0u, (uint32_t)stream};
        unsigned char raw[HELLO_BYTES];
        ddp_hello_encode(&h, raw);
        ddp_hello_purpose(tag, c->rank, r, c->size, stream, purpose, sizeof purpose);
        st = ddp_sock_send_all(fd, raw, sizeof raw, w, c->desc[r]);
        if (st == DDP_OK) st = ddp_hello_connect(fd, auth, purpose, w, c->desc[r]);
        if (st != DDP_OK) close(fd);
    }
    if (st != DDP_OK) {
        if (stream == 0) ddp_error_prefix(st, "rank %d connecting to rank %d: ", c->rank, r);
        else ddp_error_prefix(st, "rank %d opening its data connection %d to rank %d: ",
                              c->rank, stream + 1, r);
        if (st == DDP_ERR_AUTH) ddp_auth_announce(store, cfg->prefix, ddp_last_error());
        return st;
    }
    *fd_out = fd;
    return DDP_OK;
}

/* The first connection to every lower rank. */
static ddp_status connect_peers(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                                uint64_t tag, const ddp_auth *auth, ddp_wait w) {
    for (int r = 0; r < c->rank; r++) {
        int fd = -1;
        ddp_status st = connect_one(c, cfg, store, tag, auth, r, 0, w, &fd);
        if (st != DDP_OK) return st;
        c->links[r] = ddp_link_tcp_new(fd, r, c->desc[r]);
        if (c->links[r] == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");  /* fd closed */
    }
    return DDP_OK;
}

/* Step 6: the extra connections of every pair still on TCP (to lower ranks
 * first, then from higher ones, as in step 4), then stripe each such link
 * over its n sockets. Extra connections kept for a pair that moved to
 * shared memory are an error. */
static ddp_status add_streams(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                              int lfd, uint64_t tag, const ddp_auth *auth, conns *cn,
                              ddp_wait w, int64_t t0) {
    ddp_wait xw = ddp_wait_for(EXTRA_STREAMS_MS, w.abort);
    if (xw.deadline_ms > w.deadline_ms) xw.deadline_ms = w.deadline_ms;
    for (int p = 0; p < c->size; p++) {
        int tcp = ddp_link_tcp_streams(c->links[p]) > 0;
        for (int k = 1; k < cn->n; k++) {
            if (*extra_fd(cn, p, k) >= 0 && !tcp)
                return ddp_error(DDP_ERR_PROTOCOL, "rank %d: rank %d opened extra data "
                                 "connection %d, but the pair uses shared memory", c->rank,
                                 p, k + 1);
            if (p < c->rank && tcp) {
                ddp_status st = connect_one(c, cfg, store, tag, auth, p, k, xw,
                                            extra_fd(cn, p, k));
                if (st != DDP_OK) return st;
            }
        }
    }
    ddp_status st = accept_peers(c, cfg, store, lfd, tag, auth, cn, 1, xw, t0);
    if (st != DDP_OK) return st;
    for (int p = 0; p < c->size; p++) {
        if (ddp_link_tcp_streams(c->links[p]) == 0) continue;
        st = ddp_link_tcp_add_streams(c->links[p], extra_fd(cn, p, 1), cn->n - 1);
        for (int k = 1; k < cn->n; k++) *extra_fd(cn, p, k) = -1;   /* the link's now */
        if (st != DDP_OK) return st;
    }
    return DDP_OK;
}

/* Steps 1-6 above on a root allocated by ddp_comm.c (rank, size, timeout
 * and the per-rank arrays set). Leaves what it made in c for the caller to
 * free on failure. */
ddp_status ddp_comm_bootstrap(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store) {
    ddp_status st;
    int lfd = -1, port = 0;
    ddp_wait w = ddp_wait_for(cfg->timeout_ms, cfg->abort);
    /* Rejections noted a little before this rendezvous count too: a rank with
     * another token may have been turned away by this process's store server
     * before rendezvous began. */
    int64_t t0 = ddp_now_ms() - 30000;
    const ddp_auth *auth = NULL;
    conns cn = {(int)ddp_setting_int("PYDDP_NSOCKS_PERPEER"), NULL}; /* bounded to 1..16 */
    st = ddp_auth_get(&auth);   /* a bad token file or no libcrypto fails here */
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d: ", c->rank);
    if (cn.n > 1) {
        cn.extra = malloc((size_t)c->size * (size_t)(cn.n - 1) * sizeof *cn.extra);
        if (cn.extra == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
        for (size_t i = 0; i < (size_t)c->size * (size_t)(cn.n - 1); i++) cn.extra[i] = -1;
    }
    if (cfg->size > 1) {
        st = ddp_sock_listen(cfg->bind_host, 0, cfg->port_lo, cfg->port_hi, &lfd, &port);
        if (st != DDP_OK) {
            ddp_error_prefix(st, "rank %d opening its data port: ", c->rank);
            goto fail;
        }
    }
    DDP_CHECK(exchange_lines(c, cfg, store, port, cn.n, w, t0), fail);
    DDP_CHECK(check_versions(c), fail);
    DDP_CHECK(check_settings(c), fail);
    for (int r = 0; r < c->size; r++) {
        char addr[DDP_ADDR_MAX], p[32], hp[DDP_ADDR_MAX + 40], host[512];
        field(c->lines[r], "addr", addr, sizeof addr);
        field(c->lines[r], "port", p, sizeof p);
        field(c->lines[r], "host", host, sizeof host);
        ddp_sock_format_hostport(addr, atoi(p), hp, sizeof hp);
        c->desc[r] = malloc(strlen(hp) + 32);
        c->host_ids[r] = strdup(host);
        if (!c->desc[r] || !c->host_ids[r]) { st = ddp_error(DDP_ERR_NOMEM, "out of memory"); goto fail; }
        sprintf(c->desc[r], "rank %d (%s)", r, hp);
    }
    uint64_t tag = ddp_comm_hash(cfg->prefix);
    DDP_CHECK(connect_peers(c, cfg, store, tag, auth, w), fail);
    DDP_CHECK(accept_peers(c, cfg, store, lfd, tag, auth, &cn, 0, w, t0), fail);
    DDP_CHECK(ddp_comm_upgrade_links(c, w), fail);
    if (cn.n > 1) DDP_CHECK(add_streams(c, cfg, store, lfd, tag, auth, &cn, w, t0), fail);
fail:
    if (lfd >= 0) close(lfd);
    for (size_t i = 0; cn.extra && i < (size_t)c->size * (size_t)(cn.n - 1); i++)
        if (cn.extra[i] >= 0) close(cn.extra[i]);
    free(cn.extra);
    return st;
}
