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

#include "ddp_store.h"
#include "ddp_store_map.h"
#include "ddp_store_wire.h"

typedef struct ddp_store_conn {
    int fd;
    int validated;        /* a correct VALIDATE came first */
    int dead;             /* drop at the end of this round */
    ddp_wbuf in, out;     /* unparsed request bytes; unsent reply bytes */
    /* The one outstanding WAIT (nwait == 0: none): owned copies of its keys. */
    unsigned char **wkeys;
    size_t *wklens;
    size_t nwait;
} ddp_store_conn;

struct ddp_store_server {
    pthread_t thread;
    int lfd, port;
    int wake[2];                 /* self-pipe: stop() writes, the thread polls */
    atomic_int stop;
    int64_t accept_pause_until;  /* back off accepting after EMFILE and the like */
    ddp_kvmap map;
    ddp_store_conn **conns;
    size_t nconns, capconns;
    struct pollfd *pfds;         /* capconns + 2 entries: wake pipe, listener, conns */
};

/* Grow conns and pfds together. 0, or -1 if out of memory (unchanged). */
int ddp_store_grow_conns(ddp_store_server *srv);

/* Try to run one request from the start of p[0..n): returns 1 and sets
 * *used when a whole request was run (its reply queued on c->out), 0 if
 * the request is not complete yet (nothing done), -1 if the connection
 * must be dropped (garbage, unknown query, over-long field, missing
 * VALIDATE, or out of memory). */
int ddp_store_handle(ddp_store_server *srv, ddp_store_conn *c, const unsigned char *p,
                     size_t n, size_t *used);

/* Forget c's pending WAIT, freeing its key copies. */
void ddp_store_conn_clear_wait(ddp_store_conn *c);

#endif
