/* ddp_store_server_int.h - private types shared by the store server's two
 * halves: ddp_store_server.c (thread, sockets, buffering) and
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

typedef struct ddp_store_conn {
    int fd;
    int validated;        /* a correct VALIDATE came first */
    int authed;           /* passed the token handshake (or the server has no token) */
    int auth_stage;       /* 0: expecting the client's challenge; 1: its proof */
    unsigned char nc[DDP_AUTH_NONCE], ns[DDP_AUTH_NONCE];  /* the two nonces */
    int64_t opened_ms;    /* accepted at; the first request must complete soon after */
    int64_t partial_ms;   /* when the request now buffered began arriving (0: none) */
    char addr[64];        /* the peer's ip:port, for the log */
    int dead;             /* drop at the end of this round */
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
    atomic_size_t held;          /* counted input-buffer bytes (atomic: tests read it) */
    size_t budget;               /* PYDDP_STORE_BUFFER_BYTES */
    int64_t request_timeout_ms;  /* PYDDP_STORE_REQUEST_TIMEOUT */
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

/* One server round's work on c's buffered input: while c has not
 * authenticated, the token handshake's next step (the caller buffers no
 * more than that step's bytes: query, magic and nonce, then the proof);
 * then every complete request, through ddp_store_handle. Answers are
 * queued on c->out (the few sent before a drop go out on c->fd at once).
 * Returns -1 if the connection must be dropped (a failed or garbled
 * handshake, a bad request, out of memory), else 0. Called by the server
 * thread, and by tests/fuzz/fuzz_store_auth.c on arbitrary bytes. */
int ddp_store_conn_process(ddp_store_server *srv, ddp_store_conn *c);

/* Forget c's pending WAIT, removing it from the waiter index. */
void ddp_store_conn_clear_wait(ddp_store_server *srv, ddp_store_conn *c);

#endif
