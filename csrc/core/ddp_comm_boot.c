/* ddp_comm_boot.c - a communicator's rendezvous through the store: every
 * rank's address, the version check, and the table every rank reads
 * (contract in ddp_comm.h; the links are made later, on first use, by
 * ddp_comm_link.c). On a store that outlives the workers the same lines and
 * table travel in the round agreement of ddp_comm_round.c instead of steps
 * 2-4 below.
 *
 *   1. listen on a data port (ephemeral, or the first free one of a range);
 *      it stays open for the communicator's life;
 *   2. publish "<prefix>/rank/<r>" = one text line of key=value fields
 *      (version, wire version, advertised host and port, host identity,
 *      PYDDP_NSOCKS_PERPEER);
 *   3. rank 0 reads every line (one WAIT for all, one MULTI_GET), checks that every rank runs the same pyddp
 *      and wire version and the same shared settings, and publishes
 *      "<prefix>/table": the verdict and, when it is "ok", each rank's
 *      address, port and host (hosts listed once);
 *   4. every other rank reads that one record. A version difference, or a
 *      rank that never came, fails every rank alike with rank 0's message.
 *
 * So the store serves 3 requests per rank (SET, and WAIT and GET of the
 * table) plus rank 0's 3: O(N), not the N x N of every rank reading every
 * line. While ranks wait they look for authentication failures announced
 * by others (auth_watch), so ranks with different PYDDP_AUTH_TOKENs fail
 * within seconds.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_comm_internal.h"
#include "ddp_hello.h"
#include "ddp_listen.h"
#include "ddp_settings.h"
#include "ddp_sock.h"

#define AUTH_POLL_MS 2000   /* how often a waiting rank looks for auth failures */
/* How much longer than rank 0 the others wait for the table, so that rank 0's
 * own timeout message (naming the ranks that did not come) reaches them. */
#define TABLE_GRACE_MS 5000

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

int ddp_comm_line_field(const char *line, const char *name, char *out, size_t outlen) {
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

/* Every rank compares every rank's version with its own; all fail alike. */
static ddp_status check_versions(ddp_comm *c) {
    char v0[128], w0[32], vr[128], wr[32], h[256], list[2048] = "";
    ddp_comm_line_field(c->lines[0], "ver", v0, sizeof v0);
    ddp_comm_line_field(c->lines[0], "wire", w0, sizeof w0);
    int bad = 0;
    for (int r = 0; r < c->size; r++) {
        ddp_comm_line_field(c->lines[r], "ver", vr, sizeof vr);
        ddp_comm_line_field(c->lines[r], "wire", wr, sizeof wr);
        if (strcmp(vr, v0) != 0 || strcmp(wr, w0) != 0) bad = 1;
    }
    if (!bad) return DDP_OK;
    size_t used = 0;
    for (int r = 0; r < c->size && used < sizeof list - 200; r++) {
        ddp_comm_line_field(c->lines[r], "ver", vr, sizeof vr);
        ddp_comm_line_field(c->lines[r], "wire", wr, sizeof wr);
        ddp_comm_line_field(c->lines[r], "addr", h, sizeof h);
        used += (size_t)snprintf(list + used, sizeof list - used, "%srank %d on %s: pyddp %s "
                                 "(wire %s)", r ? "; " : "", r, h, vr, wr);
    }
    return ddp_error(DDP_ERR_VERSION, "ranks run different pyddp versions: %s. Install the "
                     "same pyddp on every node: the same wheel (pip install "
                     "dist/pyddp-*.whl), or a build of the same source.", list);
}

/* Settings every rank must share, from the lines (a line without the field
 * is from a pyddp that had no such setting: its value was 1). Every rank
 * compares every rank with rank 0, so all fail alike, naming both values. */
static ddp_status check_settings(ddp_comm *c) {
    char v[32], h[256];
    int n0 = ddp_comm_line_field(c->lines[0], "nsocks", v, sizeof v) == 0 ? atoi(v) : 1;
    for (int r = 1; r < c->size; r++) {
        int nr = ddp_comm_line_field(c->lines[r], "nsocks", v, sizeof v) == 0 ? atoi(v) : 1;
        if (nr == n0) continue;
        ddp_comm_line_field(c->lines[r], "addr", h, sizeof h);
        return ddp_error(DDP_ERR_INVALID, "ranks disagree on PYDDP_NSOCKS_PERPEER: rank 0 "
                         "has %d and rank %d (on %s) has %d. Set the same value on every "
                         "rank (or leave it unset everywhere).", n0, r, h, nr);
    }
    return DDP_OK;
}


ddp_status ddp_comm_wait_get(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                             const char *key, const char *what, ddp_wait w, int64_t t0,
                             char **val) {
    void *v = NULL;
    size_t vlen = 0;
    ddp_status st;
    for (;;) {
        st = ddp_store_get(store, key, strlen(key), &v, &vlen, t0 ? poll_slice(w) : w);
        if (st != DDP_ERR_TIMEOUT || ddp_wait_expired(w) || !t0) break;
        if ((st = auth_watch(c, cfg, store, t0, what, w)) != DDP_OK) return st;
    }
    if (st != DDP_OK) return st;
    *val = malloc(vlen + 1);
    if (*val == NULL) {
        free(v);
        return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    memcpy(*val, v, vlen);
    (*val)[vlen] = '\0';
    free(v);
    return DDP_OK;
}

ddp_status ddp_comm_gather(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                           const char *fmt, size_t first, ddp_wait w, int64_t t0) {
    const size_t n = (size_t)c->size;
    char **keys = calloc(n, sizeof *keys);
    size_t *klens = calloc(n, sizeof *klens), *vlens = calloc(n, sizeof *vlens);
    void **vals = calloc(n, sizeof *vals);
    ddp_status st = keys && klens && vlens && vals ? DDP_OK
                                                   : ddp_error(DDP_ERR_NOMEM, "out of memory");
    for (size_t r = first; st == DDP_OK && r < n; r++) {
        size_t len = strlen(cfg->prefix) + strlen(fmt) + 32;
        if ((keys[r] = malloc(len)) == NULL) st = ddp_error(DDP_ERR_NOMEM, "out of memory");
        else klens[r] = (size_t)snprintf(keys[r], len, fmt, cfg->prefix, r);
    }
    const char *const *ks = (const char *const *)keys + first;
    const size_t *kls = klens + first, nk = n - first;
    while (st == DDP_OK && nk > 0) {
        st = ddp_store_wait(store, ks, kls, nk, t0 ? poll_slice(w) : w);
        if (st != DDP_ERR_TIMEOUT || ddp_wait_expired(w) || !t0) break;
        if ((st = auth_watch(c, cfg, store, t0, "every rank's address", w)) != DDP_OK) break;
    }
    if (st == DDP_ERR_TIMEOUT) {   /* name the first rank that did not come */
        size_t r = first;
        for (int ready = 1; r < n && ready; r++)
            if (ddp_store_check(store, (const char *const *)&keys[r], &klens[r], 1, &ready,
                                ddp_wait_for(2000, cfg->abort)) != DDP_OK)
                break;
        r = r > first ? r - 1 : first;
        st = ddp_error(DDP_ERR_TIMEOUT, "rank %d: rank %zu did not join the process group "
                       "within %.1f s (waiting for store key %s on %s). Check that all %d "
                       "ranks were started with the same WORLD_SIZE and store address.",
                       c->rank, r, cfg->timeout_ms / 1000.0, keys[r], ddp_store_peer(store),
                       c->size);
    } else if (st == DDP_OK && nk > 0) {
        st = ddp_store_multi_get(store, ks, kls, nk, vals + first, vlens + first, w);
        if (st != DDP_OK) ddp_error_prefix(st, "rank %d reading the ranks' addresses: ", c->rank);
    }
    for (size_t r = first; r < n; r++) {
        free(c->lines[r]);
        c->lines[r] = NULL;
        if (st == DDP_OK && (c->lines[r] = malloc(vlens[r] + 1)) == NULL)
            st = ddp_error(DDP_ERR_NOMEM, "out of memory");
        if (st == DDP_OK) {
            memcpy(c->lines[r], vals[r], vlens[r]);
            c->lines[r][vlens[r]] = '\0';
        }
        if (vals) free(vals[r]);
        if (keys) free(keys[r]);
    }
    free(keys);
    free(klens);
    free(vlens);
    free(vals);
    return st;
}

/* A growing text buffer for the table. */
typedef struct text {
    char *p;
    size_t len, cap;
} text;

static int text_add(text *t, const char *s) {
    size_t n = strlen(s);
    if (t->len + n + 1 > t->cap) {
        size_t cap = (t->cap ? t->cap * 2 : 4096) + n;
        char *p = realloc(t->p, cap);
        if (p == NULL) return -1;
        t->p = p;
        t->cap = cap;
    }
    memcpy(t->p + t->len, s, n + 1);
    t->len += n;
    return 0;
}

/* Rank 0: the table of every rank's line (already in c->lines), hosts once:
 * "ok <n> <nhosts>\n", nhosts lines "h<host identity>\n", then
 * "<addr> <port> <host#>\n" per rank. */
static ddp_status make_table(ddp_comm *c, text *t) {
    int *hidx = malloc((size_t)c->size * sizeof *hidx), nh = 0;
    char **hosts = malloc((size_t)c->size * sizeof *hosts);
    char addr[DDP_ADDR_MAX], port[32], buf[DDP_ADDR_MAX + 64];
    int bad = hidx == NULL || hosts == NULL;
    for (int r = 0; !bad && r < c->size; r++) {
        char host[512];
        ddp_comm_line_field(c->lines[r], "host", host, sizeof host);
        for (hidx[r] = 0; hidx[r] < nh && strcmp(hosts[hidx[r]], host) != 0; hidx[r]++) {}
        if (hidx[r] == nh && (hosts[nh++] = strdup(host)) == NULL) bad = 1;
    }
    if (!bad) {
        snprintf(buf, sizeof buf, "ok %d %d\n", c->size, nh);
        bad = text_add(t, buf) != 0;
    }
    /* "h" first: an empty host identity is still a line of its own */
    for (int k = 0; !bad && k < nh; k++)
        bad = text_add(t, "h") || text_add(t, hosts[k]) || text_add(t, "\n");
    for (int r = 0; !bad && r < c->size; r++) {
        /* a line without them (another version's, a dead process's) still parses */
        if (ddp_comm_line_field(c->lines[r], "addr", addr, sizeof addr) || !addr[0])
            snprintf(addr, sizeof addr, "?");
        if (ddp_comm_line_field(c->lines[r], "port", port, sizeof port) || !port[0])
            snprintf(port, sizeof port, "0");
        snprintf(buf, sizeof buf, "%s %s %d\n", addr, port, hidx[r]);
        bad = text_add(t, buf) != 0;
    }
    for (int k = 0; hosts && k < nh; k++) free(hosts[k]);
    free(hosts);
    free(hidx);
    return bad ? ddp_error(DDP_ERR_NOMEM, "out of memory") : DDP_OK;
}

/* A decimal in [0, max] at s, ended by a space or the string's end: the
 * position after it, or NULL. */
static const char *table_int(const char *s, long max, long *out) {
    long v = 0;
    const char *p = s;
    for (; *p >= '0' && *p <= '9'; p++)
        if ((v = v * 10 + (*p - '0')) > max) return NULL;
    if (p == s || (*p != ' ' && *p != '\0')) return NULL;
    *out = v;
    return p;
}

/* Rank r's line of the table (line, may be NULL), "<addr> <port> <host
 * index>", into *out as the "addr=..;port=..;host=.." line dialing reads
 * (malloc'd). Runs N times on every rank: no scanf, one copy. */
static ddp_status table_entry(const char *line, char **hosts, int nh, int r, char **out) {
    const char *sp = line ? strchr(line, ' ') : NULL, *end = NULL, *last = NULL;
    long port, h;
    if (sp == NULL || sp == line || sp - line >= DDP_ADDR_MAX ||
        (end = table_int(sp + 1, 65535, &port)) == NULL || *end != ' ' ||
        (last = table_int(end + 1, nh - 1, &h)) == NULL || *last != '\0')
        return ddp_error(DDP_ERR_PROTOCOL, "malformed member table (rank %d's entry)", r);
    const size_t alen = (size_t)(sp - line), plen = (size_t)(end - sp - 1);
    const size_t hlen = strlen(hosts[h]);
    char *o = *out = malloc(alen + plen + hlen + sizeof "addr=;port=;host=");
    if (o == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    memcpy(o, "addr=", 5), o += 5;
    memcpy(o, line, alen), o += alen;
    memcpy(o, ";port=", 6), o += 6;
    memcpy(o, sp + 1, plen), o += plen;
    memcpy(o, ";host=", 6), o += 6;
    memcpy(o, hosts[h], hlen + 1);
    return DDP_OK;
}

ddp_status ddp_comm_read_table(ddp_comm *c, char *tab) {
    int n = 0, nh = 0, status = 0, used = 0;
    if (sscanf(tab, "error %d%n", &status, &used) == 1) {
        const char *msg = tab + used + (tab[used] == '\n');
        return ddp_error(status > 0 ? (ddp_status)status : DDP_ERR_PROTOCOL, "%s", msg);
    }
    if (sscanf(tab, "ok %d %d", &n, &nh) != 2 || n != c->size || nh < 1 || nh > n)
        return ddp_error(DDP_ERR_PROTOCOL, "rank %d: rank 0 published a member table for %d "
                         "ranks, but this rank was started with WORLD_SIZE=%d: start every "
                         "rank with the same WORLD_SIZE", c->rank, n, c->size);
    char **hosts = calloc((size_t)nh, sizeof *hosts), *save = NULL;
    char *line = strtok_r(tab, "\n", &save);
    ddp_status st = hosts ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory");
    for (int k = 0; st == DDP_OK && k < nh; k++) {
        hosts[k] = strtok_r(NULL, "\n", &save);
        if (hosts[k] == NULL || hosts[k][0] != 'h')
            st = ddp_error(DDP_ERR_PROTOCOL, "truncated member table");
        else
            hosts[k]++;
    }
    for (int r = 0; st == DDP_OK && r < n; r++) {
        line = strtok_r(NULL, "\n", &save);
        st = table_entry(line, hosts, nh, r, &c->lines[r]);
    }
    free(hosts);
    return st;
}

char *ddp_comm_line(ddp_comm *c, const ddp_comm_config *cfg, int port) {
    char line[1200];
    snprintf(line, sizeof line, "ver=%s;wire=%d;addr=%s;port=%d;host=%s;nsocks=%d",
             cfg->version, DDP_WIRE_VERSION, cfg->advertise_host, port, cfg->host_id,
             c->nsocks);
    return strdup(line);
}

ddp_status ddp_comm_verdict(ddp_comm *c, ddp_status st, int check, char **table) {
    if (st == DDP_OK && check) st = check_versions(c);
    if (st == DDP_OK && check) st = check_settings(c);
    text t = {0};
    if (st == DDP_OK) st = make_table(c, &t);
    if (st != DDP_OK) {   /* every rank fails with this message */
        char msg[1600];
        snprintf(msg, sizeof msg, "error %d\n%s", (int)st, ddp_last_error());
        free(t.p);
        t.p = strdup(msg);
    }
    *table = t.p;
    return st;
}

/* Steps 2-4: publish this rank's line; rank 0 gathers, checks and publishes
 * the table; the others read it. c->lines is filled on every rank. */
static ddp_status exchange_lines(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                                 const char *line, ddp_wait w, int64_t t0) {
    char key[600];
    snprintf(key, sizeof key, "%s/rank/%d", cfg->prefix, cfg->rank);
    ddp_status st = ddp_store_set(store, key, strlen(key), line, strlen(line), w);
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d publishing its address: ", c->rank);
    char tkey[600];
    snprintf(tkey, sizeof tkey, "%s/table", cfg->prefix);
    if (c->rank != 0) {
        char *tab = NULL;
        ddp_wait tw = w;
        if (tw.deadline_ms < DDP_NO_DEADLINE - TABLE_GRACE_MS) tw.deadline_ms += TABLE_GRACE_MS;
        st = ddp_comm_wait_get(c, cfg, store, tkey, "rank 0's member table", tw, t0, &tab);
        if (st == DDP_ERR_TIMEOUT)
            return ddp_error(st, "rank %d: rank 0 did not publish the process group's members "
                             "within %.1f s (store key %s on %s). Check that rank 0 runs and "
                             "that all %d ranks were started with the same WORLD_SIZE and "
                             "store address.", c->rank, cfg->timeout_ms / 1000.0, tkey,
                             ddp_store_peer(store), c->size);
        if (st != DDP_OK) return ddp_error_prefix(st, "rank %d reading the members: ", c->rank);
        st = ddp_comm_read_table(c, tab);
        free(tab);
        return st;
    }
    text t = {0};
    st = ddp_comm_gather(c, cfg, store, "%s/rank/%zu", 0, w, t0);
    st = ddp_comm_verdict(c, st, 1, &t.p);
    t.len = t.p ? strlen(t.p) : 0;
    if (t.p) {
        char saved[1400];
        ddp_copy_error(saved, sizeof saved);
        ddp_wait sw = st == DDP_OK ? w : ddp_wait_for(2000, cfg->abort);
        ddp_status ps = ddp_store_set(store, tkey, strlen(tkey), t.p, t.len, sw);
        if (st == DDP_OK && ps != DDP_OK)
            st = ddp_error_prefix(ps, "rank 0 publishing the members: ");
        else if (st != DDP_OK)
            ddp_set_error_text(saved);
    }
    free(t.p);
    return st;
}

/* Steps 1-4 on a root allocated by ddp_comm.c (rank, size, timeout and the
 * per-rank arrays set). Leaves what it made in c (its data-port registration
 * included) for the caller to free on failure. */
ddp_status ddp_comm_bootstrap(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store) {
    ddp_status st;
    int port = 0;
    ddp_wait w = ddp_wait_for(cfg->timeout_ms, cfg->abort);
    /* Rejections noted a little before this rendezvous count too: a rank with
     * another token may have been turned away by this process's store server
     * before rendezvous began. */
    int64_t t0 = ddp_now_ms() - 30000;
    c->nsocks = (int)ddp_setting_int("PYDDP_NSOCKS_PERPEER"); /* bounded to 1..16 */
    c->link_tag = ddp_comm_hash(cfg->prefix);   /* the round's, once agreed (below) */
    st = ddp_auth_get(&c->auth);   /* a bad token file or no libcrypto fails here */
    if (st != DDP_OK) return ddp_error_prefix(st, "rank %d: ", c->rank);
    if (cfg->size > 1) {
        st = ddp_comm_listen(c, cfg->bind_host, cfg->port_lo, cfg->port_hi, &port);
        if (st != DDP_OK) return ddp_error_prefix(st, "rank %d opening its data port: ", c->rank);
    }
    char *line = ddp_comm_line(c, cfg, port);
    if (line == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    if (cfg->agree_round) {
        st = ddp_comm_agree(c, cfg, store, line, w, &c->prefix);
    } else {
        st = exchange_lines(c, cfg, store, line, w, t0);
        if (st == DDP_OK && (c->prefix = strdup(cfg->prefix)) == NULL)
            st = ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    free(line);
    if (st != DDP_OK) return st;
    c->link_tag = ddp_comm_hash(c->prefix);
    ddp_listen_retag(c->lreg, c->link_tag);
    for (int r = 0; r < c->size; r++) {
        char addr[DDP_ADDR_MAX], p[32], hp[DDP_ADDR_MAX + 40], host[512];
        ddp_comm_line_field(c->lines[r], "addr", addr, sizeof addr);
        ddp_comm_line_field(c->lines[r], "port", p, sizeof p);
        ddp_comm_line_field(c->lines[r], "host", host, sizeof host);
        ddp_sock_format_hostport(addr, atoi(p), hp, sizeof hp);
        c->desc[r] = malloc(strlen(hp) + 32);
        c->host_ids[r] = strdup(host);
        if (!c->desc[r] || !c->host_ids[r]) return ddp_error(DDP_ERR_NOMEM, "out of memory");
        sprintf(c->desc[r], "rank %d (%s)", r, hp);
    }
    return DDP_OK;
}
