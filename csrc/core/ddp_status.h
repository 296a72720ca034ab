/* ddp_status.h - status codes and error messages for the pyddp C core.
 *
 * Every core function that can fail returns a ddp_status. On failure it also
 * leaves a human-readable message in a thread-local buffer (ddp_last_error),
 * written through ddp_error(). Messages name the operation, the rank and the
 * peer where known, and what the user should check. Callers that hand work to
 * another thread (the communicator's worker) copy the message out before the
 * thread does anything else.
 */
#ifndef DDP_STATUS_H
#define DDP_STATUS_H

#include <stddef.h>

typedef enum ddp_status {
    DDP_OK = 0,
    DDP_ERR_INVALID,     /* bad argument (maps to ValueError) */
    DDP_ERR_TYPE,        /* unsupported dtype/kind (TypeError) */
    DDP_ERR_TIMEOUT,     /* a deadline passed (TimeoutError) */
    DDP_ERR_CONNECT,     /* could not connect to a host:port (ConnectionError) */
    DDP_ERR_CLOSED,      /* peer closed or reset the connection (ConnectionError) */
    DDP_ERR_ABORTED,     /* the operation was aborted through its abort flag */
    DDP_ERR_MISMATCH,    /* ranks called different collectives (RuntimeError) */
    DDP_ERR_PROTOCOL,    /* malformed data on the wire */
    DDP_ERR_VERSION,     /* ranks run different pyddp / wire versions */
    DDP_ERR_NOMEM,       /* allocation failed (MemoryError) */
    DDP_ERR_SYS,         /* other operating-system error */
    DDP_ERR_UNAVAILABLE, /* optional library (NCCL, CUDA) could not be loaded */
    DDP_ERR_INTERNAL,    /* a bug in pyddp */
    DDP_ERR_STORE,       /* a store request failed: garbage reply, connection lost,
                            client closed (DistStoreError); store timeouts stay
                            DDP_ERR_TIMEOUT */
    DDP_ERR_AUTH         /* a peer failed the PYDDP_AUTH_TOKEN handshake (AuthenticationError) */
} ddp_status;

/* Short constant name of a status, e.g. "DDP_ERR_TIMEOUT". */
const char *ddp_status_name(ddp_status st);

/* Format a message into this thread's error buffer and return st unchanged,
 * so call sites read `return ddp_error(DDP_ERR_INVALID, "...", ...);`. */
ddp_status ddp_error(ddp_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prefix this thread's current message with more context ("allreduce: ").
 * Returns st unchanged. */
ddp_status ddp_error_prefix(ddp_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* This thread's last message ("" if none). Valid until the next ddp_error on
 * this thread. */
const char *ddp_last_error(void);

/* Copy this thread's last message into buf (always NUL-terminated). */
void ddp_copy_error(char *buf, size_t len);

/* Replace this thread's message with msg verbatim (used to carry a message
 * from a worker thread back to the caller's thread). */
void ddp_set_error_text(const char *msg);

/* Jump-to-cleanup helper: evaluate expr, on failure store it in `st` and goto
 * the label. Requires a local `ddp_status st`. */
#define DDP_CHECK(expr, label)                 \
    do {                                       \
        st = (expr);                           \
        if (st != DDP_OK) goto label;          \
    } while (0)

#endif
