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
 *      linked in (ddp_comm_shm.c decides), else keep TCP.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_comm_internal.h"
#include "ddp_hello.h"
#include "ddp_sock.h"

#define HELLO_MAGIC DDP_HELLO_MAGIC
#define HELLO_BYTES DDP_HELLO_BYTES
#define AUTH_POLL_MS 2000   /* how often a waiting rank looks for auth failures */
typedef ddp_hello hello;

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
                                 int port, ddp_wait w, int64_t t0) {
    char key[600], line[1200];
    snprintf(line, sizeof line, "ver=%s;wire=%d;addr=%s;port=%d;host=%s", cfg->version,
             DDP_WIRE_VERSION, cfg->advertise_host, port, cfg->host_id);
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

static ddp_status accept_peers(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                               int lfd, uint64_t tag, const ddp_auth *auth, ddp_wait w,
                               int64_t t0) {
    int need = c->size - 1 - c->rank;
    while (need > 0) {
        int fd = -1;
        ddp_status st = ddp_sock_accept(lfd, poll_slice(w), &fd);
        if (st == DDP_ERR_TIMEOUT && !ddp_wait_expired(w)) {
            char what[64];
            snprintf(what, sizeof what, "%d higher rank(s)' connection(s)", need);
            if ((st = auth_watch(c, cfg, store, t0, what, w)) != DDP_OK) return st;
            continue;
        }
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d waiting for %d higher rank(s) to connect: ",
                                    c->rank, need);
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
            h.rank >= c->size || h.size != c->size || c->links[h.rank] != NULL) {
            close(fd);  /* a stray, stale or silent connection: not ours, ignore it */
            if (st == DDP_ERR_ABORTED || (st == DDP_ERR_TIMEOUT && ddp_wait_expired(w)))
                return st;
            continue;
        }
        /* Nothing but the handshake is read from it until it passes. */
        char addr[DDP_ADDR_MAX + 16], purpose[128];
        ddp_auth_peer_name(fd, addr, sizeof addr);
        ddp_hello_purpose(tag, h.rank, c->rank, c->size, purpose, sizeof purpose);
        st = ddp_hello_accept(fd, &h, auth, purpose, hw, addr);
        if (st != DDP_OK) {
            close(fd);   /* dropped (and logged); auth_watch fails the job if need be */
            if (st == DDP_ERR_ABORTED) return st;
            continue;
        }
        c->links[h.rank] = ddp_link_tcp_new(fd, h.rank, c->desc[h.rank]);
        if (c->links[h.rank] == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
        need--;
    }
    return DDP_OK;
}

static ddp_status connect_peers(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                                uint64_t tag, const ddp_auth *auth, ddp_wait w) {
    char addr[DDP_ADDR_MAX], port[32];
    for (int r = 0; r < c->rank; r++) {
        field(c->lines[r], "addr", addr, sizeof addr);
        field(c->lines[r], "port", port, sizeof port);
        int fd = -1;
        ddp_status st = ddp_sock_connect(addr, atoi(port), w, &fd);
        if (st != DDP_OK)
            return ddp_error_prefix(st, "rank %d connecting to rank %d: ", c->rank, r);
        hello h = {HELLO_MAGIC, DDP_WIRE_VERSION, tag, c->rank, c->size,
                   auth ? DDP_HELLO_HAS_TOKEN : 0u};
        unsigned char raw[HELLO_BYTES];
        char purpose[128];
        ddp_hello_encode(&h, raw);
        ddp_hello_purpose(tag, c->rank, r, c->size, purpose, sizeof purpose);
        st = ddp_sock_send_all(fd, raw, sizeof raw, w, c->desc[r]);
        if (st == DDP_OK) st = ddp_hello_connect(fd, auth, purpose, w, c->desc[r]);
        if (st != DDP_OK) {
            close(fd);
            ddp_error_prefix(st, "rank %d connecting to rank %d: ", c->rank, r);
            if (st == DDP_ERR_AUTH) ddp_auth_announce(store, cfg->prefix, ddp_last_error());
            return st;
        }
        c->links[r] = ddp_link_tcp_new(fd, r, c->desc[r]);
        if (c->links[r] == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");  /* fd closed */
    }
    return DDP_OK;
}

/* Steps 1-5 above on a root allocated by ddp_comm.c (rank, size, timeout
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
    st = ddp_auth_get(&auth);   /* a bad token file or no libcrypto fails here */
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d: ", c->rank);
    if (cfg->size > 1) {
        st = ddp_sock_listen(cfg->bind_host, 0, cfg->port_lo, cfg->port_hi, &lfd, &port);
        if (st != DDP_OK) return ddp_error_prefix(st, "rank %d opening its data port: ", c->rank);
    }
    DDP_CHECK(exchange_lines(c, cfg, store, port, w, t0), fail);
    DDP_CHECK(check_versions(c), fail);
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
    DDP_CHECK(accept_peers(c, cfg, store, lfd, tag, auth, w, t0), fail);
    if (lfd >= 0) { close(lfd); lfd = -1; }
    DDP_CHECK(ddp_comm_upgrade_links(c, w), fail);
    return DDP_OK;
fail:
    if (lfd >= 0) close(lfd);
    return st;
}
