/* ddp_coll_layout.c - which ranks of a group share a host, and the views of
 * the group that the hierarchical algorithms run on (ddp_coll_hier.c).
 *
 * A view is a ddp_group over some of the group's ranks: its own rank, size,
 * link array (pointers to the group's links, refreshed before each use; a
 * link not made yet is made through the group, its parent) and its own
 * scratch. Views never exchange headers: the call's header was
 * checked on the whole group before any view moves data.
 */
#include "ddp_coll_internal.h"
#include "ddp_settings.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* PYDDP_ALGO as a DDP_ALGO_* value; an unknown value warns once (per
 * process) and means auto. */
static int algo_setting(void) {
    static int warned;
    const char *v = ddp_setting_str("PYDDP_ALGO");
    if (v == NULL || strcmp(v, "auto") == 0) return DDP_ALGO_AUTO;
    if (strcmp(v, "flat") == 0 || strcmp(v, "ring") == 0) return DDP_ALGO_FLAT;
    if (strcmp(v, "hier") == 0 || strcmp(v, "hierarchical") == 0) return DDP_ALGO_HIER;
    if (strcmp(v, "block") == 0) return DDP_ALGO_BLOCK;
    if (!warned) {
        warned = 1;
        fprintf(stderr, "pyddp: warning: ignoring PYDDP_ALGO='%s': expected auto, flat, "
                "hier or block; using auto\n", v);
    }
    return DDP_ALGO_AUTO;
}

/* Free h and everything it owns (NULL, or partly built: a no-op for what is missing). */
static void hier_free(ddp_hier *h) {
    if (h == NULL) return;
    ddp_group_release_scratch(&h->local);
    ddp_group_release_scratch(&h->rail);
    ddp_group_release_scratch(&h->chain);
    free(h->order);
    free(h->local_ranks);
    free(h->rail_ranks);
    free(h->rank_at);
    free(h->links);
    free(h);
}

void ddp_group_free_layout(ddp_group *g) {
    hier_free(g->hier);
    free(g->host);
    g->hier = NULL;
    g->host = NULL;
    g->nhosts = 1;
}

/* Build g->hier from g->host (nhosts >= 2). */
static ddp_status build_views(ddp_group *g) {
    const int n = g->size, nh = g->nhosts, me = g->rank;
    ddp_hier *h = calloc(1, sizeof *h);
    int *count = calloc((size_t)nh, sizeof *count);
    if (!h || !count) goto nomem;
    for (int r = 0; r < n; r++) count[g->host[r]]++;
    h->myhost = g->host[me];
    h->per_host = count[h->myhost];
    h->uniform = 1;
    for (int k = 0; k < nh; k++) h->uniform &= count[k] == count[0];
    h->local_ranks = calloc((size_t)h->per_host, sizeof *h->local_ranks);
    h->rail_ranks = calloc((size_t)nh, sizeof *h->rail_ranks);
    h->links = calloc((size_t)(h->per_host + nh + n), sizeof *h->links);
    h->order = calloc((size_t)n, sizeof *h->order);
    if (h->uniform) h->rank_at = calloc((size_t)n, sizeof *h->rank_at);
    if (!h->local_ranks || !h->rail_ranks || !h->links || !h->order ||
        (h->uniform && !h->rank_at))
        goto nomem;
    /* local index of every rank = how many earlier ranks share its host */
    memset(count, 0, (size_t)nh * sizeof *count);
    for (int r = 0; r < n; r++) {
        const int k = g->host[r], j = count[k]++;
        if (k == h->myhost) h->local_ranks[j] = r;
        if (r == me) h->lrank = j;
        if (h->rank_at) h->rank_at[k * h->per_host + j] = r;
    }
    /* the rail: local index lrank on every host (uniform), else every host's
     * first rank; position k is host k */
    memset(count, 0, (size_t)nh * sizeof *count);
    const int want = h->uniform ? h->lrank : 0;
    for (int r = 0; r < n; r++)
        if (count[g->host[r]]++ == want) h->rail_ranks[g->host[r]] = r;
    free(count);
    ddp_group *views[3] = {&h->local, &h->rail, &h->chain};
    for (int v = 0; v < 3; v++) {
        views[v]->tag = g->tag;
        views[v]->small_bytes = g->small_bytes;
        views[v]->chunk_bytes = g->chunk_bytes;
        views[v]->algo = DDP_ALGO_FLAT;
        views[v]->nhosts = 1;
    }
    h->local.rank = h->lrank;
    h->local.size = h->per_host;
    h->local.links = h->links;
    h->rail.rank = h->myhost;
    h->rail.size = nh;
    h->rail.links = h->links + h->per_host;
    h->chain.size = n;
    h->chain.links = h->links + h->per_host + nh;
    /* The views' links are g's, made on first use through g. */
    h->local.parent = h->rail.parent = h->chain.parent = g;
    h->local.parent_rank = h->local_ranks;
    h->rail.parent_rank = h->rail_ranks;
    h->chain.parent_rank = h->order;
    g->hier = h;
    return DDP_OK;
nomem:
    free(count);
    hier_free(h);
    return ddp_error(DDP_ERR_NOMEM, "out of memory describing the group's hosts");
}

/* A rank and its host identity, sorted by identity (NULL first: each NULL
 * is a host of its own), then rank. */
typedef struct id_rank {
    const char *id;
    int r;
} id_rank;

static int id_rank_cmp(const void *x, const void *y) {
    const id_rank *a = x, *b = y;
    int c = !a->id || !b->id ? (a->id != NULL) - (b->id != NULL) : strcmp(a->id, b->id);
    return c ? c : (a->r > b->r) - (a->r < b->r);
}

/* host[r] for every rank: equal identities share a number, hosts numbered
 * in order of their first rank; O(n log n) (groups reach thousands of
 * ranks). Returns the number of hosts, or -1 when out of memory. */
static int number_hosts(const char *const *ids, int n, int *host) {
    id_rank *s = malloc((size_t)n * sizeof *s);
    int *first = malloc((size_t)n * sizeof *first), nh = 0;
    if (!s || !first) {
        free(s);
        free(first);
        return -1;
    }
    for (int r = 0; r < n; r++) s[r] = (id_rank){ids[r], r};
    qsort(s, (size_t)n, sizeof *s, id_rank_cmp);
    /* first[r]: the first rank of r's host (runs of equal ids, rank order) */
    for (int i = 0, lead = 0; i < n; i++) {
        if (i == 0 || !s[i].id || !s[lead].id || strcmp(s[i].id, s[lead].id) != 0) lead = i;
        first[s[i].r] = s[lead].r;
    }
    for (int r = 0; r < n; r++) host[r] = first[r] == r ? nh++ : host[first[r]];
    free(s);
    free(first);
    return nh;
}

ddp_status ddp_group_set_layout(ddp_group *g, const char *const *ids) {
    const int n = g->size;
    int *host = malloc((size_t)n * sizeof *host);
    int nh = host ? number_hosts(ids, n, host) : -1;
    if (nh < 0) {
        free(host);
        return ddp_error(DDP_ERR_NOMEM, "out of memory describing the group's hosts");
    }
    ddp_group_free_layout(g);
    g->algo = algo_setting();
    g->hier_min_bytes = (size_t)ddp_setting_int("PYDDP_HIER_MIN_BYTES");
    g->host = host;
    g->nhosts = nh;
    if (nh < 2) return DDP_OK;
    ddp_status st = build_views(g);
    if (st != DDP_OK) {
        free(g->host);
        g->host = NULL;
        g->nhosts = 1;
    }
    return st;
}

void ddp_hier_refresh(ddp_group *g) {
    ddp_hier *h = g->hier;
    for (int j = 0; j < h->per_host; j++) h->local.links[j] = g->links[h->local_ranks[j]];
    for (int k = 0; k < g->nhosts; k++) h->rail.links[k] = g->links[h->rail_ranks[k]];
}
