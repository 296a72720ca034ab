/* testutil.h - minimal assertion macros for the C unit tests. A failed
 * check prints file:line, the expression and the core's last error, then
 * exits non-zero, so `make check` stops at the first failure. */
#ifndef DDP_TESTUTIL_H
#define DDP_TESTUTIL_H
#include <stdio.h>
#include <stdlib.h>
#include "ddp_status.h"

#define T_ASSERT(cond)                                                        \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n",     \
                    __FILE__, __LINE__, #cond, ddp_last_error());             \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#define T_OK(expr)                                                            \
    do {                                                                      \
        ddp_status t_st_ = (expr);                                            \
        if (t_st_ != DDP_OK) {                                                \
            fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__,          \
                    __LINE__, #expr, ddp_status_name(t_st_), ddp_last_error());\
            exit(1);                                                          \
        }                                                                     \
    } while (0)

#define T_STATUS(expr, want)                                                  \
    do {                                                                      \
        ddp_status t_st_ = (expr);                                            \
        if (t_st_ != (want)) {                                                \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s: %s\n",       \
                    __FILE__, __LINE__, #expr, ddp_status_name(t_st_),        \
                    ddp_status_name(want), ddp_last_error());                 \
            exit(1);                                                          \
        }                                                                     \
    } while (0)
#endif
