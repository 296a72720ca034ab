/* ddp_comm_round.c - the rendezvous on a store that outlives the workers
 * (torchrun's agent store, torch's store under the torch backend, a store
 * passed in): the ranks agree on a round, one key prefix that is this
 * start's alone, in the same requests that publish their addresses
 * (cfg->agree_round; contract in ddp_comm.h).
 *
 * Under torchrun's elastic agents no number any worker can read names a
 * start: each node counts its own restarts, and the store keeps every
 * earlier round's keys. So, under <base> (cfg->prefix):
 *   1. every rank but 0 writes <base>/hello/<r> = its rendezvous line with a
 *      fresh nonce in it (nonce=...);
 *   2. rank 0 waits for every hello and reads them in one request, names the
 *      round R = <its nonce>.<attempt>, and writes "R <R>\n" + the member
 *      table to <base>/round/<nonce of r> for every rank, in one request;
 *   3. rank r reads <base>/round/<its nonce> (a table addressed to its own
 *      process, so never an earlier round's), writes <base>/ack/<R>/<r> and
 *      reads <base>/go/<R>;
 *   4. rank 0 waits for every ack in one request, checks versions and
 *      settings as ddp_comm_boot.c does (the lines are all live processes'
 *      now, so an earlier round's stale line never fails a job), and sets
 *      go/<R> to "go", or to the error every rank then raises.
 * A hello read in step 2 may be a dead process's from an earlier round (its
 * successor has not written yet): that rank never acknowledges, and when its
 * hello changes rank 0 names a new round R' for the lines it now sees,
 * writes every rank's round key again and sets go/<R> to "void", so the
 * ranks that acknowledged R read their round key again. Only live processes
 * of this start acknowledge, so the ranks that read "go" hold one round and
 * one table. Rank 0 looks for changed hellos about once a second while it
 * waits (a CHECK per missing ack and one read of their hellos).
 *
 * Store requests when every rank is live: rank r, SET, a GET (WAIT + GET),
 * SET, a GET: 6; rank 0, a MULTI_GET (WAIT + MULTI_GET), MULTI_SET, WAIT,
 * SET: 5, whatever the world size. (Before this was in the rendezvous, the
 * round cost each rank 7 more requests in Python ahead of the rendezvous's 3.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_auth.h"
#include "ddp_comm_internal.h"

#define LOOK_MS 1000   /* how often rank 0 looks for restarted ranks while it waits */

/* 16 hex digits of fresh randomness. */
static ddp_status make_nonce(char out[17]) {
    unsigned char b[DDP_AUTH_NONCE];
    ddp_status st = ddp_auth_nonce(b);
    for (int i = 0; st == DDP_OK && i < 8; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
    return st;
}

static char *keyf(const char *base, const char *what, const char *id) {
    size_t n = strlen(base) + strlen(what) + strlen(id) + 4;
    char *k = malloc(n);
    if (k) snprintf(k, n, "%s/%s/%s", base, what, id);
    return k;
}

/* ---- every rank but 0 ------------------------------------------------------ */

static ddp_status follow(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                         const char *nonce, ddp_wait w, char *round, size_t rlen) {
    char *rkey = keyf(cfg->prefix, "round", nonce), *tab = NULL;
    ddp_status st = rkey ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory");
    ddp_wait tw = w;   /* rank 0's own timeout message must reach this rank */
    if (tw.deadline_ms < DDP_NO_DEADLINE - 5000) tw.deadline_ms += 5000;
    while (st == DDP_OK) {
        free(tab);
        tab = NULL;
        st = ddp_comm_wait_get(c, cfg, store, rkey, "rank 0's round", tw, 0, &tab);
        if (st == DDP_ERR_TIMEOUT) {
            st = ddp_error(st, "rank %d: waited %.0f s for rank 0's rendezvous round (store "
                           "key %s on %s); check that every node was started for this job",
                           c->rank, cfg->timeout_ms / 1000.0, rkey, ddp_store_peer(store));
            break;
        }
        char *nl = tab ? strchr(tab, '\n') : NULL;
        if (st == DDP_OK && (nl == NULL || sscanf(tab, "R %63s", round) != 1 ||
                             strlen(round) + 1 >= rlen))
            st = ddp_error(DDP_ERR_PROTOCOL, "rank %d: malformed rendezvous round", c->rank);
        if (st != DDP_OK) break;
        if ((st = ddp_comm_read_table(c, nl + 1)) != DDP_OK) break;   /* rank 0's verdict */
        char id[128], *go = NULL;
        snprintf(id, sizeof id, "%s/%d", round, c->rank);
        char *ack = keyf(cfg->prefix, "ack", id), *gokey = keyf(cfg->prefix, "go", round);
        if (!ack || !gokey) st = ddp_error(DDP_ERR_NOMEM, "out of memory");
        if (st == DDP_OK) st = ddp_store_set(store, ack, strlen(ack), "1", 1, w);
        if (st == DDP_OK) st = ddp_comm_wait_get(c, cfg, store, gokey, "rank 0's go", tw, 0, &go);
        if (st == DDP_OK && strncmp(go, "error", 5) == 0)
            st = ddp_comm_read_table(c, go);   /* rank 0's verdict: every rank fails alike */
        int done = st == DDP_OK && strcmp(go, "go") == 0;
        free(ack);
        free(gokey);
        free(go);
        if (done) break;
        /* void: rank 0 wrote this rank's new round before voiding this one */
    }
    free(rkey);
    free(tab);
    return st;
}

/* ---- rank 0 ------------------------------------------------------------------ */

/* The nonce in line (its "nonce" field) into out. */
static void nonce_of(const char *line, char out[64]) {
    ddp_comm_line_field(line, "nonce", out, 64);
}

/* Write "R <round>\n" + table to every rank's round key. */
static ddp_status send_rounds(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                              const char *round, const char *table, ddp_wait w) {
    const size_t n = (size_t)c->size - 1;
    size_t vlen = strlen(round) + strlen(table) + 4;
    char *val = malloc(vlen), **keys = calloc(n, sizeof *keys);
    size_t *klens = calloc(n, sizeof *klens), *vlens = calloc(n, sizeof *vlens);
    const void **vals = calloc(n, sizeof *vals);
    ddp_status st = val && keys && klens && vlens && vals
                        ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory");
    if (st == DDP_OK) vlen = (size_t)snprintf(val, vlen, "R %s\n%s", round, table);
    for (size_t i = 0; st == DDP_OK && i < n; i++) {
        char nonce[64];
        nonce_of(c->lines[i + 1], nonce);
        if ((keys[i] = keyf(cfg->prefix, "round", nonce)) == NULL)
            st = ddp_error(DDP_ERR_NOMEM, "out of memory");
        else klens[i] = strlen(keys[i]);
        vals[i] = val;
        vlens[i] = vlen;
    }
    if (st == DDP_OK)
        st = ddp_store_multi_set(store, (const char *const *)keys, klens, vals, vlens, n, w);
    for (size_t i = 0; keys && i < n; i++) free(keys[i]);
    free(keys);
    free(klens);
    free(vlens);
    free(vals);
    free(val);
    return st;
}

/* Wait for every rank's ack of round (in slices of LOOK_MS). *changed = 1
 * when, meanwhile, a rank that has not acknowledged wrote a new hello (its
 * line is then read again into c->lines). */
static ddp_status await_acks(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                             const char *round, ddp_wait w, int *changed) {
    const size_t n = (size_t)c->size - 1;
    char **keys = calloc(n, sizeof *keys);
    size_t *klens = calloc(n, sizeof *klens);
    ddp_status st = keys && klens ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory");
    for (size_t i = 0; st == DDP_OK && i < n; i++) {
        char id[128];
        snprintf(id, sizeof id, "%s/%zu", round, i + 1);
        if ((keys[i] = keyf(cfg->prefix, "ack", id)) == NULL)
            st = ddp_error(DDP_ERR_NOMEM, "out of memory");
        else klens[i] = strlen(keys[i]);
    }
    *changed = 0;
    while (st == DDP_OK) {
        ddp_wait sw = w;
        if (sw.deadline_ms > ddp_now_ms() + LOOK_MS) sw.deadline_ms = ddp_now_ms() + LOOK_MS;
        st = ddp_store_wait(store, (const char *const *)keys, klens, n, sw);
        if (st != DDP_ERR_TIMEOUT) break;
        st = DDP_OK;
        char missing[512] = "";
        size_t used = 0;
        /* each look gets its own short deadline: it must still name the missing
         * ranks when the call's deadline has just passed */
        const ddp_wait lw = ddp_wait_for(2000, w.abort);
        for (size_t i = 0; st == DDP_OK && i < n; i++) {
            int ready = 0;
            st = ddp_store_check(store, (const char *const *)&keys[i], &klens[i], 1, &ready, lw);
            if (st != DDP_OK || ready) continue;
            char hk[32], *hello = NULL, was[64], now[64];
            snprintf(hk, sizeof hk, "%zu", i + 1);
            char *hkey = keyf(cfg->prefix, "hello", hk);
            if (hkey == NULL) st = ddp_error(DDP_ERR_NOMEM, "out of memory");
            else st = ddp_comm_wait_get(c, cfg, store, hkey, "a hello", lw, 0, &hello);
            free(hkey);
            if (st != DDP_OK) break;
            nonce_of(c->lines[i + 1], was);
            nonce_of(hello, now);
            if (strcmp(was, now) != 0) {   /* a new process of that rank */
                free(c->lines[i + 1]);
                c->lines[i + 1] = hello;
                *changed = 1;
                continue;
            }
            free(hello);
            if (used < sizeof missing - 16)
                used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%zu",
                                         used ? ", " : "", i + 1);
        }
        if (st != DDP_OK || *changed) break;
        if (ddp_wait_expired(w)) {
            st = ddp_error(DDP_ERR_TIMEOUT, "rank 0: ranks [%s] did not join this start's "
                           "rendezvous round within %.0f s (their last announced process never "
                           "answered). Check that every node was started for this job.",
                           missing, cfg->timeout_ms / 1000.0);
            break;
        }
    }
    for (size_t i = 0; keys && i < n; i++) free(keys[i]);
    free(keys);
    free(klens);
    return st;
}

static ddp_status lead(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                       const char *nonce, const char *line, ddp_wait w, char *round,
                       size_t rlen) {
    ddp_status st = ddp_comm_gather(c, cfg, store, "%s/hello/%zu", 1, w, 0);
    if (st == DDP_OK && (c->lines[0] = strdup(line)) == NULL)
        st = ddp_error(DDP_ERR_NOMEM, "out of memory");
    if (st == DDP_ERR_TIMEOUT) ddp_error_prefix(st, "in the rendezvous round: ");
    if (st != DDP_OK) return st;
    char old[80] = "";
    for (int attempt = 0;; attempt++) {
        snprintf(round, rlen, "%s.%d", nonce, attempt);
        char *table = NULL;
        st = ddp_comm_verdict(c, DDP_OK, 0, &table);   /* checked once all are live */
        if (st == DDP_OK)
            st = table ? send_rounds(c, cfg, store, round, table, w)
                       : ddp_error(DDP_ERR_NOMEM, "out of memory");
        free(table);
        if (st == DDP_OK && old[0]) {
            char *gokey = keyf(cfg->prefix, "go", old);
            st = gokey ? ddp_store_set(store, gokey, strlen(gokey), "void", 4, w)
                       : ddp_error(DDP_ERR_NOMEM, "out of memory");
            free(gokey);
        }
        int changed = 0;
        if (st == DDP_OK) st = await_acks(c, cfg, store, round, w, &changed);
        if (st != DDP_OK) return st;
        if (!changed) break;
        snprintf(old, sizeof old, "%s", round);
    }
    /* Every line is a live process's now: versions and settings are checked,
     * and the go (or the error every rank raises) goes out. */
    char *verdict = NULL;
    ddp_status vst = ddp_comm_verdict(c, DDP_OK, 1, &verdict);
    char saved[1400];
    ddp_copy_error(saved, sizeof saved);
    const char *go = vst == DDP_OK ? "go" : verdict;
    char *gokey = keyf(cfg->prefix, "go", round);
    st = gokey && go ? ddp_store_set(store, gokey, strlen(gokey), go, strlen(go), w)
                     : ddp_error(DDP_ERR_NOMEM, "out of memory");
    free(gokey);
    free(verdict);
    if (st == DDP_OK && vst != DDP_OK) {
        ddp_set_error_text(saved);
        return vst;
    }
    return st;
}

ddp_status ddp_comm_agree(ddp_comm *c, const ddp_comm_config *cfg, ddp_store *store,
                          const char *line, ddp_wait w, char **prefix) {
    char nonce[17], round[80];
    ddp_status st = make_nonce(nonce);
    if (st != DDP_OK) return st;
    size_t hlen = strlen(line) + 32;
    char *hello = malloc(hlen);
    if (hello == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    snprintf(hello, hlen, "%s;nonce=%s", line, nonce);
    if (c->size == 1) {                      /* nobody to agree with */
        snprintf(round, sizeof round, "%s", nonce);
        st = (c->lines[0] = hello) ? DDP_OK : DDP_ERR_NOMEM;
        hello = NULL;
    } else if (c->rank == 0) {
        st = lead(c, cfg, store, nonce, hello, w, round, sizeof round);
    } else {
        char id[32];
        snprintf(id, sizeof id, "%d", c->rank);
        char *key = keyf(cfg->prefix, "hello", id);
        st = key ? ddp_store_set(store, key, strlen(key), hello, strlen(hello), w)
                 : ddp_error(DDP_ERR_NOMEM, "out of memory");
        free(key);
        if (st == DDP_OK) st = follow(c, cfg, store, nonce, w, round, sizeof round);
        else ddp_error_prefix(st, "rank %d publishing its address: ", c->rank);
    }
    free(hello);
    if (st != DDP_OK) return st;
    size_t plen = strlen(cfg->prefix) + strlen(round) + 2;
    if ((*prefix = malloc(plen)) == NULL) return ddp_error(DDP_ERR_NOMEM, "out of memory");
    snprintf(*prefix, plen, "%s/%s", cfg->prefix, round);
    return DDP_OK;
}
