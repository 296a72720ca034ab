/* test_store_input.c - the store server's input policy (ddp_store_input.c)
 * on hand-built connections, without sockets: a growing large request that
 * would pass the budget evicts the incomplete large request silent longest
 * (ties: the one that began first), never one whose buffered bytes are
 * complete requests nor the grower; a request larger than the whole budget
 * is refused and evicts nobody; the pool of allowances evicts stalled small
 * requests, and when none may go the newcomer waits (starved) instead; a
 * burst's connection reads at most its allowance; trimming frees an empty
 * buffer and shrinks a mostly empty one, moving it off the budget. The
 * books (held + allowed) always equal the buffers' capacities. */
#include <string.h>

#include "ddp_store_server_int.h"
#include "testutil.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)

enum { MAXC = 1100 };
static ddp_store_conn g_conn[MAXC];
static ddp_store_conn *g_ptr[MAXC];

/* A fresh server whose budget is `budget`, with no connections. */
static void server(ddp_store_server *srv, size_t budget) {
    memset(srv, 0, sizeof *srv);
    srv->budget = budget;
    srv->conns = g_ptr;
}

/* Add connection i: authenticated, `have` bytes buffered in a buffer of `cap`
 * bytes, the request at the front needing `need` (have < need: incomplete),
 * last heard at `heard` ms, its request begun at `began`. */
static ddp_store_conn *conn(ddp_store_server *srv, size_t cap, size_t have, size_t need,
                            int64_t heard, int64_t began) {
    ddp_store_conn *c = &g_conn[srv->nconns];
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->authed = c->validated = 1;
    snprintf(c->addr, sizeof c->addr, "10.0.0.1:%zu", srv->nconns);
    if (cap > 0) {
        T_ASSERT(ddp_wbuf_reserve_upto(&c->in, cap, cap) == 0 && c->in.cap == cap);
        memset(c->in.p, 'x', have);
        c->in.len = have;
        if (cap > DDP_STORE_ALLOWANCE) srv->held += cap;
        else srv->allowed += cap;
    }
    c->scan.need = need;
    c->heard_ms = heard;
    c->partial_ms = began;
    g_ptr[srv->nconns++] = c;
    return c;
}

/* The books balance, and free every buffer. */
static void done(ddp_store_server *srv) {
    size_t caps = 0;
    for (size_t i = 0; i < srv->nconns; i++) caps += srv->conns[i]->in.cap;
    T_ASSERT(srv->held + srv->allowed == caps);
    for (size_t i = 0; i < srv->nconns; i++) ddp_store_input_release(srv, srv->conns[i]);
    T_ASSERT(srv->held == 0 && srv->allowed == 0);
}

static void test_budget_eviction(void) {
    ddp_store_server srv;
    server(&srv, 16 * MIB);
    /* three stalled large requests; a and b were silent equally long, a began first */
    ddp_store_conn *a = conn(&srv, 4 * MIB, 3 * MIB, 6 * MIB, 1000, 100);
    ddp_store_conn *b = conn(&srv, 4 * MIB, 3 * MIB, 6 * MIB, 1000, 200);
    ddp_store_conn *c = conn(&srv, 4 * MIB, 3 * MIB, 6 * MIB, 5000, 300);
    /* one silent longer still, but its buffered bytes are complete requests */
    ddp_store_conn *full = conn(&srv, 32 * KIB, 32 * KIB, 0, 10, 10);
    /* the grower: 4 MiB in, a 10 MiB request, heard just now */
    ddp_store_conn *g = conn(&srv, 4 * MIB, 4 * MIB, 10 * MIB, 9000, 8000);
    T_ASSERT(srv.held == 16 * MIB);
    size_t room = 0;
    T_ASSERT(ddp_store_input_room(&srv, g, &room) == 0 && room > 0);
    T_ASSERT(g->in.cap == 8 * MIB && srv.held <= srv.budget);
    T_ASSERT(a->dead && !b->dead && !c->dead && !full->dead && !g->dead);
    T_ASSERT(a->in.cap == 0);   /* its memory went back at once */
    /* growing again to its whole request (10 MiB, not 16) takes b next */
    g->in.len = g->in.cap;
    T_ASSERT(ddp_store_input_room(&srv, g, &room) == 0 && room > 0);
    T_ASSERT(g->in.cap == 10 * MIB && b->dead && !c->dead && srv.held == 14 * MIB);
    done(&srv);
    printf("budget: the incomplete large request silent longest (then oldest) gives way: ok\n");
}

static void test_refusals(void) {
    ddp_store_server srv;
    server(&srv, 16 * MIB);
    ddp_store_conn *a = conn(&srv, 8 * MIB, 7 * MIB, 12 * MIB, 1000, 100);
    /* a request larger than the whole budget: refused, nobody evicted */
    ddp_store_conn *huge = conn(&srv, 256, 18, 20 * MIB, 9000, 9000);
    size_t room = 1;
    T_ASSERT(ddp_store_input_fits(&srv, huge) < 0);
    T_ASSERT(ddp_store_input_room(&srv, huge, &room) < 0 && room == 0 && !a->dead);
    /* over DDP_STORE_MAX_BUFFERED: refused as well */
    huge->scan.need = DDP_STORE_MAX_BUFFERED + 1;
    T_ASSERT(ddp_store_input_room(&srv, huge, &room) < 0 && !a->dead);
    /* the budget is all the grower's own: nobody else to evict, so it goes */
    ddp_store_conn *g = conn(&srv, 8 * MIB, 8 * MIB, 12 * MIB, 9000, 9000);
    a->dead = 1;                          /* (already on its way out: not a candidate) */
    T_ASSERT(ddp_store_input_room(&srv, g, &room) < 0);
    done(&srv);
    printf("refusals: a request over the budget evicts nobody: ok\n");
}

static void test_allowance(void) {
    ddp_store_server srv;
    server(&srv, 16 * MIB);
    /* a burst's connection: 100 bytes of a small request left, the rest run;
     * it may read up to its allowance, and it is billed to the pool */
    ddp_store_conn *burst = conn(&srv, 0, 0, 0, 1, 1);
    size_t room = 0;
    T_ASSERT(ddp_store_input_room(&srv, burst, &room) == 0 && room == DDP_STORE_ALLOWANCE);
    T_ASSERT(srv.held == 0 && srv.allowed == DDP_STORE_ALLOWANCE);
    burst->in.len = DDP_STORE_ALLOWANCE;   /* all read: the requests in it are complete */
    T_ASSERT(ddp_store_input_room(&srv, burst, &room) == 0 && room == 0);
    ddp_wbuf_consume(&burst->in, DDP_STORE_ALLOWANCE - 100);
    burst->scan.need = 150;
    T_ASSERT(ddp_store_input_room(&srv, burst, &room) == 0);
    T_ASSERT(room == DDP_STORE_ALLOWANCE - 100 && burst->in.cap == DDP_STORE_ALLOWANCE);
    /* trimmed after the round: down to the partial request's size */
    burst->in.len = burst->in.start + 100;
    ddp_store_input_trim(&srv, burst);
    T_ASSERT(burst->in.cap == 256 && ddp_wbuf_size(&burst->in) == 100 && srv.allowed == 256);
    /* a large buffer left with a small request's bytes moves off the budget */
    ddp_store_conn *big = conn(&srv, 8 * MIB, 100, 150, 1, 1);
    T_ASSERT(srv.held == 8 * MIB);
    ddp_store_input_trim(&srv, big);
    T_ASSERT(big->in.cap == 256 && srv.held == 0);
    /* ...but one whose request still needs it stays */
    ddp_store_conn *mid = conn(&srv, 8 * MIB, 100, 6 * MIB, 1, 1);
    ddp_store_input_trim(&srv, mid);
    T_ASSERT(mid->in.cap == 8 * MIB);
    mid->in.len = 0;   /* an empty buffer is freed */
    ddp_store_input_trim(&srv, mid);
    T_ASSERT(mid->in.cap == 0 && srv.held == 0);
    done(&srv);
    printf("allowance: a burst reads its allowance, trimming gives memory back: ok\n");
}

static void test_pool(void) {
    ddp_store_server srv;
    server(&srv, 16 * MIB);
    /* the pool full of stalled small requests, the first silent longest... */
    size_t n = DDP_STORE_ALLOWANCE_POOL / DDP_STORE_ALLOWANCE;
    for (size_t i = 0; i < n; i++)
        conn(&srv, DDP_STORE_ALLOWANCE, 60 * KIB, 62 * KIB, 100 + (int64_t)i, 0);
    ddp_store_conn *newcomer = conn(&srv, 0, 0, 0, 9999, 0);
    T_ASSERT(srv.allowed == DDP_STORE_ALLOWANCE_POOL);
    size_t room = 0;
    T_ASSERT(ddp_store_input_room(&srv, newcomer, &room) == 0 && room > 0);
    T_ASSERT(g_conn[0].dead && !g_conn[1].dead && srv.allowed <= DDP_STORE_ALLOWANCE_POOL);
    done(&srv);
    /* ...or of complete requests waiting on their replies: the newcomer waits */
    server(&srv, 16 * MIB);
    for (size_t i = 0; i < n; i++) conn(&srv, DDP_STORE_ALLOWANCE, 60 * KIB, 0, 1, 0);
    newcomer = conn(&srv, 0, 0, 0, 9999, 0);
    room = 1;
    T_ASSERT(ddp_store_input_room(&srv, newcomer, &room) == 0 && room == 0);
    T_ASSERT(newcomer->starved && !g_conn[0].dead && newcomer->in.cap == 0);
    done(&srv);
    printf("pool: stalled small requests give way, complete ones never: ok\n");
}

int main(void) {
    test_budget_eviction();
    test_refusals();
    test_allowance();
    test_pool();
    printf("test_store_input: ok\n");
    return 0;
}
