/* ddp_store_server_int.h - private types shared by the store server's
 * parts: ddp_store_server.c (thread, sockets, the order of work),
 * ddp_store_input.c (how much of a connection's input is buffered, and
 * whose incomplete request gives way when memory runs short) and
 * ddp_store_ops.c (parsing and running one request). Only the server
 * thread touches any of this after ddp_store_server_start returns.
 */
#ifndef DDP_STORE_SERVER_INT_H
#define DDP_STORE_SERVER_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp_auth.h"
#include "ddp_store.h"
#include "ddp_store_map.h"
#include "ddp_store_scan.h"
#include "ddp_store_waiters.h"
#include "ddp_store_wire.h"

/* Input buffering (ddp_store_input.c, docs/security.md "The store server's
 * limits"). Every connection may buffer up to DDP_STORE_ALLOWANCE bytes
 * outside PYDDP_STORE_BUFFER_BYTES, enough to frame any request of ordinary
 * size; all connections' allowances together are held under
 * DDP_STORE_ALLOWANCE_POOL. A buffer grows past its allowance only for one
 * request that is itself larger, and then counts in full against the budget. */
#define DDP_STORE_ALLOWANCE ((size_t)64 << 10)
#define DDP_STORE_ALLOWANCE_POOL ((size_t)64 << 20)
#define DDP_STORE_READ_CHUNK ((size_t)64 << 10)     /* bytes asked of one recv at most */

typedef struct ddp_store_conn {
    int fd;
    int validated;        /* a correct VALIDATE came first */
    int authed;           /* passed the token handshake (or the server has no token) */
    int auth_stage;       /* 0: expecting the client's challenge; 1: its proof */
    unsigned char nc[DDP_AUTH_NONCE], ns[DDP_AUTH_NONCE];  /* the two nonces */
    int64_t opened_ms;    /* accepted at; the first request must complete soon after */
    int64_t partial_ms;   /* when the request now buffered began arriving (0: none) */
    int64_t heard_ms;     /* when its last bytes arrived (or it connected) */
    char addr[64];        /* the peer's ip:port, for the log */
    int dead;             /* drop at the end of this round */
    int starved;          /* no room to read into this round: not polled for input next */
    ddp_wbuf in, out;     /* unparsed request bytes; unsent reply bytes */
    ddp_store_scan scan;  /* how far the request at the start of `in` was checked */
    /* The one outstanding WAIT (waiting == 0: none): a node in the server's
     * waiter index for each key still missing, and how many there are. */
    int waiting;
    size_t missing;
    ddp_waiter *waits;
} ddp_store_conn;

struct ddp_store_server {
    pthread_t thread;
    int lfd, port;
    int wake[2];                 /* self-pipe: stop() writes, the thread polls */
    atomic_int stop;
    int64_t accept_pause_until;  /* back off accepting after EMFILE and the like */
    ddp_kvmap map;
    ddp_waitmap waiters;         /* pending WAITs by key */
    ddp_store_conn **conns;
    size_t nconns, capconns;
    struct pollfd *pfds;         /* capconns + 2 entries: wake pipe, listener, conns */
    ddp_auth key;                /* the token, when has_key (read at start) */
    int has_key;
    /* Input-buffer bytes (atomic: tests read them): of buffers larger than the
     * allowance (against budget), and of the others (against the pool). */
    atomic_size_t held, allowed;
    size_t budget;               /* PYDDP_STORE_BUFFER_BYTES */
    int64_t request_timeout_ms;  /* PYDDP_STORE_REQUEST_TIMEOUT */
    /* Requests run so far (ddp_store_handle; read by ddp_store_server_requests
     * from any thread). */
    atomic_uint_least64_t requests;
};

/* Grow conns and pfds together. 0, or -1 if out of memory (unchanged). */
int ddp_store_grow_conns(ddp_store_server *srv);

/* Try to run one request from the start of p[0..n), continuing c->scan
 * (the same bytes as the last call's, possibly more): returns 1 and sets
 * *used when a whole request was run (its reply queued on c->out), 0 if
 * the request is not complete yet (nothing done; c->scan.need says how
 * many bytes to wait for), -1 if the connection must be dropped (garbage,
 * unknown query, over-long field, missing VALIDATE, or out of memory). */
int ddp_store_handle(ddp_store_server *srv, ddp_store_conn *c, const unsigned char *p,
                     size_t n, size_t *used);

/* Make room in c's input for the next read and say how many bytes to ask
 * for (*room; 0: read nothing now). Before authentication that is the rest
 * of the handshake's current step; after it, up to the allowance (framed
 * requests are run before the next read, so a burst of small requests never
 * needs more), or, for one request larger than the allowance, what that
 * request still needs. Growth within the allowance that would pass the pool
 * evicts other connections' stalled small requests, or waits (*room = 0,
 * c->starved set) if none can go; growth past the allowance that would
 * pass the budget evicts other connections' incomplete large requests, the
 * one silent longest first, each logged with its peer. Returns 0; -1 if c must be dropped (its
 * request is over DDP_STORE_MAX_BUFFERED; logged: over the whole budget, or
 * the budget is held by buffers no one may evict; out of memory), c's
 * buffered bytes intact. */
int ddp_store_input_room(ddp_store_server *srv, ddp_store_conn *c, size_t *room);

/* 0 if the request at the front of c's input can be held once it has all
 * arrived; -1 (logged when it is the budget it exceeds) if it is over
 * DDP_STORE_MAX_BUFFERED or the whole budget: c must be dropped. */
int ddp_store_input_fits(ddp_store_server *srv, ddp_store_conn *c);

/* After a round's work on c: free its input buffer if empty, shrink it to
 * about its bytes if it is mostly empty (the rest of a large buffer, or a
 * small request's first bytes), so a connection holds memory only for the
 * request it is receiving. Re-bills the buffer; never fails. */
void ddp_store_input_trim(ddp_store_server *srv, ddp_store_conn *c);

/* Free c's input buffer and take it off the books (c closing or evicted). */
void ddp_store_input_release(ddp_store_server *srv, ddp_store_conn *c);

/* One server round's work on c's buffered input: while c has not
 * authenticated, the token handshake's next step (the caller buffers no
 * more than that step's bytes: query, magic and nonce, then the proof;
 * ddp_store_input_room says how much);
 * then every complete request, through ddp_store_handle. Answers are
 * queued on c->out (the few sent before a drop go out on c->fd at once).
 * Returns -1 if the connection must be dropped (a failed or garbled
 * handshake, a bad request, out of memory), else 0. Called by the server
 * thread, and by tests/fuzz/fuzz_store_auth.c on arbitrary bytes. */
int ddp_store_conn_process(ddp_store_server *srv, ddp_store_conn *c);

/* Forget c's pending WAIT, removing it from the waiter index. */
void ddp_store_conn_clear_wait(ddp_store_server *srv, ddp_store_conn *c);

#endif
