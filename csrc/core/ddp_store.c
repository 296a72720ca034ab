/* ddp_store.c - the store handle the core uses (ddp_store.h): a reference
 * count, a closed flag and the name of the store, over one implementation's
 * table (the TCPStore client of ddp_store_client.c, or one wrapped with
 * ddp_store_wrap, such as csrc/py's Python-backed store). Every call is the
 * implementation's, dispatched here; the handle only guarantees that ctx lives
 * as long as any reference does, and that a closed handle's calls fail at once.
 */
#include "ddp_store.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ddp_store {
    atomic_int refs;
    atomic_int closed;          /* ddp_store_close was called */
    const ddp_store_impl *impl;
    void *ctx;
    char peer[256];
};

ddp_status ddp_store_wrap(const ddp_store_impl *impl, void *ctx, const char *peer,
                          ddp_store **out) {
    ddp_store *s = calloc(1, sizeof *s);
    *out = NULL;
    if (s == NULL) {
        impl->destroy(ctx);
        return ddp_error(DDP_ERR_NOMEM, "store handle: out of memory");
    }
    atomic_init(&s->refs, 1);
    atomic_init(&s->closed, 0);
    s->impl = impl;
    s->ctx = ctx;
    snprintf(s->peer, sizeof s->peer, "%s", peer ? peer : "?");
    *out = s;
    return DDP_OK;
}

const char *ddp_store_peer(const ddp_store *s) { return s->peer; }

void ddp_store_retain(ddp_store *s) {
    atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
}

void ddp_store_release(ddp_store *s) {
    if (s == NULL) return;
    /* acq_rel: the freeing thread must see every other holder's writes. */
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) return;
    s->impl->destroy(s->ctx);
    free(s);
}

void ddp_store_close(ddp_store *s) {
    if (s == NULL) return;
    if (atomic_exchange(&s->closed, 1) == 0) s->impl->shutdown(s->ctx);
    ddp_store_release(s);
}

ddp_status ddp_store_set(ddp_store *s, const char *key, size_t klen, const void *val,
                         size_t vlen, ddp_wait w) {
    return s->impl->set(s->ctx, key, klen, val, vlen, w);
}

ddp_status ddp_store_append(ddp_store *s, const char *key, size_t klen, const void *val,
                            size_t vlen, ddp_wait w) {
    return s->impl->append(s->ctx, key, klen, val, vlen, w);
}

ddp_status ddp_store_get(ddp_store *s, const char *key, size_t klen, void **val,
                         size_t *vlen, ddp_wait w) {
    return s->impl->get(s->ctx, key, klen, val, vlen, w);
}

ddp_status ddp_store_add(ddp_store *s, const char *key, size_t klen, int64_t delta,
                         int64_t *result, ddp_wait w) {
    return s->impl->add(s->ctx, key, klen, delta, result, w);
}

ddp_status ddp_store_wait(ddp_store *s, const char *const *keys, const size_t *klens,
                          size_t n, ddp_wait w) {
    return s->impl->wait(s->ctx, keys, klens, n, w);
}

ddp_status ddp_store_multi_get(ddp_store *s, const char *const *keys, const size_t *klens,
                               size_t n, void **vals, size_t *vlens, ddp_wait w) {
    return s->impl->multi_get(s->ctx, keys, klens, n, vals, vlens, w);
}

ddp_status ddp_store_multi_set(ddp_store *s, const char *const *keys, const size_t *klens,
                               const void *const *vals, const size_t *vlens, size_t n,
                               ddp_wait w) {
    return s->impl->multi_set(s->ctx, keys, klens, vals, vlens, n, w);
}

ddp_status ddp_store_check(ddp_store *s, const char *const *keys, const size_t *klens,
                           size_t n, int *ready, ddp_wait w) {
    return s->impl->check(s->ctx, keys, klens, n, ready, w);
}

ddp_status ddp_store_compare_set(ddp_store *s, const char *key, size_t klen,
                                 const void *expected, size_t elen, const void *desired,
                                 size_t dlen, void **out, size_t *outlen, ddp_wait w) {
    return s->impl->compare_set(s->ctx, key, klen, expected, elen, desired, dlen, out,
                                outlen, w);
}

ddp_status ddp_store_delete(ddp_store *s, const char *key, size_t klen, int64_t *ndeleted,
                            ddp_wait w) {
    return s->impl->delete_key(s->ctx, key, klen, ndeleted, w);
}

ddp_status ddp_store_num_keys(ddp_store *s, int64_t *n, ddp_wait w) {
    return s->impl->num_keys(s->ctx, n, w);
}
