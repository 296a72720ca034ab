/* store_util.h - what the store tests share: a client of the test's server on
 * loopback, and a GET compared with the value expected. */
#ifndef STORE_UTIL_H
#define STORE_UTIL_H

#include <stdlib.h>
#include <string.h>

#include "ddp_store.h"
#include "testutil.h"

#define W(ms) ddp_wait_for(ms, NULL)
#define K(s) s, strlen(s)

static int g_port;   /* the test's server */

static inline ddp_store *client(void) {
    ddp_store *s;
    T_OK(ddp_store_connect("127.0.0.1", g_port, W(5000), &s));
    return s;
}

/* GET key and compare with want. */
static inline void expect_value(ddp_store *s, const char *key, const char *want) {
    void *v;
    size_t vl;
    T_OK(ddp_store_get(s, K(key), &v, &vl, W(5000)));
    T_ASSERT(vl == strlen(want) && memcmp(v, want, vl) == 0);
    free(v);
}

#endif
