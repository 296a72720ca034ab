/* ddp_store.h - the key-value store the core rendezvouses through (a handle
 * over one of its implementations, below), and the TCPStore client and
 * server, wire-compatible with PyTorch's TCPStore (the protocol is summarised
 * in docs/design.md, "The store protocol").
 *
 * Keys are passed exactly as they travel on the wire: the Python layer adds
 * torch's "/" prefix to user keys; the core composes its own keys under
 * "/pyddp/<run id>/<restart>/...". Values are arbitrary bytes.
 *
 * TCP client: one TCP connection, one request in flight. A ddp_store is safe to
 * share between threads (an internal mutex serialises requests) and is
 * reference-counted: a thread that uses a client it did not create (the
 * rendezvous on a helper thread) holds its own reference, so a close() on
 * another thread cannot free it mid-request. Timeouts are enforced by the
 * client: an expired WAIT sends CANCEL_WAIT and drains the reply, so the
 * connection stays usable afterwards. Returned buffers are malloc'd and
 * owned by the caller (free()). A request that fails because the server
 * sent garbage, the connection broke or the client was closed returns
 * DDP_ERR_STORE; the byte stream is then out of sync, so every later request
 * fails too. Deadlines give DDP_ERR_TIMEOUT, aborts DDP_ERR_ABORTED.
 *
 * Server: a background thread that serves any number of connections with
 * poll(). A malformed, truncated or unknown request drops only that
 * connection. Stopping joins the thread and frees everything.
 */
#ifndef DDP_STORE_H
#define DDP_STORE_H

#include <stddef.h>
#include <stdint.h>
#include "ddp_clock.h"
#include "ddp_status.h"

#define DDP_STORE_MAGIC 0x3C85F7CEu

enum ddp_store_query {
    DDP_Q_VALIDATE = 0, DDP_Q_SET = 1, DDP_Q_COMPARE_SET = 2, DDP_Q_GET = 3,
    DDP_Q_ADD = 4, DDP_Q_CHECK = 5, DDP_Q_WAIT = 6, DDP_Q_GETNUMKEYS = 7,
    DDP_Q_DELETE_KEY = 8, DDP_Q_APPEND = 9, DDP_Q_MULTI_GET = 10,
    DDP_Q_MULTI_SET = 11, DDP_Q_CANCEL_WAIT = 12, DDP_Q_PING = 13,
    /* pyddp's own, never sent to torch's servers: the PYDDP_AUTH_TOKEN
     * handshake that opens a connection to a pyddp server with a token. */
    DDP_Q_AUTH = 0x70
};

/* The authentication exchange (docs/security.md): the client sends
 * u8 DDP_Q_AUTH, u32 DDP_STORE_AUTH_MAGIC, a 32-byte nonce; the server
 * answers u8 0, its nonce and its proof (or u8 1: it has no token, and
 * closes); the client checks the proof and sends its own. Only then may
 * VALIDATE follow. The purpose both prove is DDP_STORE_AUTH_PURPOSE. */
#define DDP_STORE_AUTH_MAGIC 0x50444441u
#define DDP_STORE_AUTH_PURPOSE "pyddp store"
#define DDP_STORE_AUTH_HELLO 37   /* query byte, magic, nonce */
/* The PING nonce of an AUTO client's plain first connection (ddp_store.h). */
#define DDP_STORE_AUTH_PROBE 0x50444450u

/* Whether the client authenticates (only meaningful with a token set):
 * OFF never (torch's server, e.g. torchrun's agent store); REQUIRE always
 * (a server that cannot is an error); AUTO connects plainly and
 * authenticates on a second connection only if the server answers the
 * PING with DDP_STORE_AUTH_MAGIC, as a pyddp server with a token does
 * (torch's servers answer the PING). */
enum { DDP_STORE_AUTH_OFF = 0, DDP_STORE_AUTH_REQUIRE = 1, DDP_STORE_AUTH_AUTO = 2 };

typedef struct ddp_store ddp_store;

/* A store is a handle (reference-counted, thread-safe) over one of two
 * implementations behind this table: the TCPStore client (ddp_store_client.c,
 * made by ddp_store_connect) and any other that wraps itself with
 * ddp_store_wrap (csrc/py/py_store_py.c: a Python object, e.g. the etcd-backed
 * store). The calls below dispatch to it; each entry has the contract of the
 * call of the same name (ctx is the implementation's own state). shutdown is
 * ddp_store_close's part: requests in flight and later ones fail promptly; it
 * must not block. destroy frees ctx when the last reference goes, on whichever
 * thread drops it. */
typedef struct ddp_store_impl {
    ddp_status (*set)(void *ctx, const char *key, size_t klen, const void *val, size_t vlen,
                      ddp_wait w);
    ddp_status (*append)(void *ctx, const char *key, size_t klen, const void *val,
                         size_t vlen, ddp_wait w);
    ddp_status (*get)(void *ctx, const char *key, size_t klen, void **val, size_t *vlen,
                      ddp_wait w);
    ddp_status (*add)(void *ctx, const char *key, size_t klen, int64_t delta,
                      int64_t *result, ddp_wait w);
    ddp_status (*wait)(void *ctx, const char *const *keys, const size_t *klens, size_t n,
                       ddp_wait w);
    ddp_status (*multi_get)(void *ctx, const char *const *keys, const size_t *klens,
                            size_t n, void **vals, size_t *vlens, ddp_wait w);
    ddp_status (*multi_set)(void *ctx, const char *const *keys, const size_t *klens,
                            const void *const *vals, const size_t *vlens, size_t n,
                            ddp_wait w);
    ddp_status (*check)(void *ctx, const char *const *keys, const size_t *klens, size_t n,
                        int *ready, ddp_wait w);
    ddp_status (*compare_set)(void *ctx, const char *key, size_t klen, const void *expected,
                              size_t elen, const void *desired, size_t dlen, void **out,
                              size_t *outlen, ddp_wait w);
    ddp_status (*delete_key)(void *ctx, const char *key, size_t klen, int64_t *ndeleted,
                             ddp_wait w);
    ddp_status (*num_keys)(void *ctx, int64_t *n, ddp_wait w);
    void (*shutdown)(void *ctx);
    void (*destroy)(void *ctx);
} ddp_store_impl;

/* A new handle (one reference) over impl and ctx; peer ("host:port", or
 * any short name of the store for messages) is copied. On failure (out of
 * memory) impl->destroy(ctx) has been called and *out is NULL. */
ddp_status ddp_store_wrap(const ddp_store_impl *impl, void *ctx, const char *peer,
                          ddp_store **out);

/* Connect (retrying until w's deadline), send VALIDATE and PING. On success
 * *out holds one reference (give it back with ddp_store_close or
 * ddp_store_release); on failure *out is NULL and nothing is left open. */
ddp_status ddp_store_connect(const char *host, int port, ddp_wait w,
                             ddp_store **out);
/* The same with an authentication mode (ddp_store_connect uses AUTO) and
 * key (NULL: the process's token, ddp_auth_get). DDP_ERR_AUTH when the
 * server fails the handshake or tokens differ. */
struct ddp_auth;
ddp_status ddp_store_connect_auth(const char *host, int port, int mode,
                                  const struct ddp_auth *key, ddp_wait w, ddp_store **out);
/* Take one more reference (thread-safe; s must be alive, i.e. the caller
 * holds a reference or knows a holder keeps it alive meanwhile). */
void ddp_store_retain(ddp_store *s);
/* Drop one reference; the last one closes the socket and frees s. NULL is a
 * no-op. Never blocks. */
void ddp_store_release(ddp_store *s);
/* Shut the connection down, then drop the caller's reference. Requests in
 * flight on other threads wake at once (shutdown(2) on the socket) and,
 * like every later request through other references, fail with a message
 * saying the store was closed; the memory goes with the last reference.
 * Never blocks (it does not wait for the request mutex). NULL is a no-op. */
void ddp_store_close(ddp_store *s);
/* "host:port" of the server, for messages. */
const char *ddp_store_peer(const ddp_store *s);

ddp_status ddp_store_set(ddp_store *s, const char *key, size_t klen,
                         const void *val, size_t vlen, ddp_wait w);
/* WAIT for the key, then GET it. */
ddp_status ddp_store_get(ddp_store *s, const char *key, size_t klen,
                         void **val, size_t *vlen, ddp_wait w);
ddp_status ddp_store_add(ddp_store *s, const char *key, size_t klen,
                         int64_t delta, int64_t *result, ddp_wait w);
ddp_status ddp_store_append(ddp_store *s, const char *key, size_t klen,
                            const void *val, size_t vlen, ddp_wait w);
/* Wait until all n keys exist. On deadline: CANCEL_WAIT, drain, then
 * DDP_ERR_TIMEOUT naming the first missing key. */
ddp_status ddp_store_wait(ddp_store *s, const char *const *keys,
                          const size_t *klens, size_t n, ddp_wait w);
/* Wait until all n keys exist (as ddp_store_wait), then read them in one
 * MULTI_GET: vals[i] (malloc'd, the caller frees each) and vlens[i]. On
 * failure every vals[i] is NULL. */
ddp_status ddp_store_multi_get(ddp_store *s, const char *const *keys, const size_t *klens,
                               size_t n, void **vals, size_t *vlens, ddp_wait w);
/* Set n keys in one MULTI_SET request (no reply, as SET): keys[i] to
 * vals[i]; each waiter wakes as its key is set. Sizes are checked first
 * (DDP_ERR_INVALID, nothing sent). */
ddp_status ddp_store_multi_set(ddp_store *s, const char *const *keys, const size_t *klens,
                               const void *const *vals, const size_t *vlens, size_t n,
                               ddp_wait w);
/* *ready = 1 if all keys exist. */
ddp_status ddp_store_check(ddp_store *s, const char *const *keys,
                           const size_t *klens, size_t n, int *ready, ddp_wait w);
ddp_status ddp_store_compare_set(ddp_store *s, const char *key, size_t klen,
                                 const void *expected, size_t elen,
                                 const void *desired, size_t dlen,
                                 void **out, size_t *outlen, ddp_wait w);
ddp_status ddp_store_delete(ddp_store *s, const char *key, size_t klen,
                            int64_t *ndeleted, ddp_wait w);
ddp_status ddp_store_num_keys(ddp_store *s, int64_t *n, ddp_wait w);

typedef struct ddp_store_server ddp_store_server;

/* Bind host:port (NULL/"" = all interfaces; port 0 = ephemeral), start the
 * serving thread. *port_out gets the bound port. */
ddp_status ddp_store_server_start(const char *bind_host, int port,
                                  ddp_store_server **out, int *port_out);
/* How many requests the server has run since it started: every complete
 * request framed on a connection counts once (VALIDATE and PING of a
 * connect included, so a ddp_store_connect costs 2 and a ddp_store_get 2,
 * its WAIT and its GET; CANCEL_WAIT counts, and so does a complete request
 * that makes the server drop the connection; the token handshake does not,
 * nor do the bytes of a request that never arrived whole).
 * Thread-safe, never blocks; 0 for NULL. For benchmarks (benchmarks/scale.py)
 * and tests: how much a rendezvous asks of the one store. */
uint64_t ddp_store_server_requests(const ddp_store_server *srv);
/* Stop the thread, close all connections, free all keys. NULL is a no-op. */
void ddp_store_server_stop(ddp_store_server *srv);

#endif
