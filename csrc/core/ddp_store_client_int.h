/* ddp_store_client_int.h - what the TCPStore client's two files share
 * (ddp_store_client.c: the connection and one request's plumbing;
 * ddp_store_client_ops.c: the requests): the client's state and the
 * plumbing's calls. Not part of the core's API.
 */
#ifndef DDP_STORE_CLIENT_INT_H
#define DDP_STORE_CLIENT_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "ddp_sock.h"
#include "ddp_store.h"
#include "ddp_store_wire.h"


/* How long a reply the server owes may take when the caller's own deadline
 * has run out: the cancel/drain after an expired WAIT, and the GET after a
 * WAIT that succeeded (the key exists). Giving up on an owed reply leaves
 * the connection out of step, so it would be unusable afterwards; torch's
 * TCPStore servers sometimes take 5 s to answer. */
#define DDP_STORE_GRACE_MS 30000
#define DDP_STORE_PROBE_KEYS 64    /* keys of a timed-out WAIT probed to name the missing one */
/* Replies are read through a buffer of this size: a MULTI_GET of N values is
 * 2N fields, read with a few system calls instead of 2N. Larger fields go
 * straight to their destination. */
#define RBUF_BYTES (64u << 10)

typedef struct tcp {
    atomic_int closed;      /* ddp_store_close was called: every request fails */
    pthread_mutex_t mu;     /* held for a whole request (one in flight) */
    int fd;                 /* valid until the last reference goes */
    int broken;             /* the byte stream is out of sync (under mu) */
    char broken_msg[1024];
    char peer[DDP_ADDR_MAX + 16];
    ddp_wbuf req;
    /* Bytes received and not yet consumed: rbuf[rpos..rlen) (under mu). Only
     * replies the client asked for arrive, one request in flight, so what is
     * read ahead is always the rest of the current reply. */
    size_t rpos, rlen;
    unsigned char rbuf[RBUF_BYTES];
} tcp;

/* The implementation's table (ddp_store_client_ops.c). */
extern const ddp_store_impl ddp_store_tcp_impl;

/* Lock s (within w, in slices: a thread behind another's long WAIT still
 * honours its deadline, abort flag and a close), check the connection is
 * usable and start request q in s->req. */
ddp_status ddp_store_begin(tcp *s, ddp_wait w, uint8_t q);
/* Unlock and return st, a failure prefixed with op and the server (and a
 * broken stream's status made DDP_ERR_STORE). */
ddp_status ddp_store_done(tcp *s, ddp_status st, const char *op);
/* Send s->req by w (a failure breaks the stream). */
ddp_status ddp_store_send_req(tcp *s, ddp_wait w);
/* Exactly n bytes of the reply into buf by w: the buffered ones first. The
 * _buffered form leaves the stream unbroken on failure (for a WAIT's own
 * timeout); _exact breaks it. */
ddp_status ddp_store_recv_buffered(tcp *s, void *buf, size_t n, ddp_wait w);
ddp_status ddp_store_recv_exact(tcp *s, void *buf, size_t n, ddp_wait w);
/* A length-prefixed value into a malloc'd buffer the caller owns. */
ddp_status ddp_store_recv_value(tcp *s, void **val, size_t *vlen, ddp_wait w);
/* Mark the stream broken (every later request fails with this error); st. */
ddp_status ddp_store_io_fail(tcp *s, ddp_status st);
/* DDP_ERR_INVALID for a key or value the server would refuse. */
ddp_status ddp_store_check_sizes(size_t klen, size_t vlen);

#endif
