/* ddp_status.c - status names and the thread-local error message buffer. */
#include "ddp_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define DDP_ERRBUF 2048

static _Thread_local char errbuf[DDP_ERRBUF];

const char *ddp_status_name(ddp_status st) {
    switch (st) {
    case DDP_OK: return "DDP_OK";
    case DDP_ERR_INVALID: return "DDP_ERR_INVALID";
    case DDP_ERR_TYPE: return "DDP_ERR_TYPE";
    case DDP_ERR_TIMEOUT: return "DDP_ERR_TIMEOUT";
    case DDP_ERR_CONNECT: return "DDP_ERR_CONNECT";
    case DDP_ERR_CLOSED: return "DDP_ERR_CLOSED";
    case DDP_ERR_ABORTED: return "DDP_ERR_ABORTED";
    case DDP_ERR_MISMATCH: return "DDP_ERR_MISMATCH";
    case DDP_ERR_PROTOCOL: return "DDP_ERR_PROTOCOL";
    case DDP_ERR_VERSION: return "DDP_ERR_VERSION";
    case DDP_ERR_NOMEM: return "DDP_ERR_NOMEM";
    case DDP_ERR_SYS: return "DDP_ERR_SYS";
    case DDP_ERR_UNAVAILABLE: return "DDP_ERR_UNAVAILABLE";
    case DDP_ERR_INTERNAL: return "DDP_ERR_INTERNAL";
    case DDP_ERR_STORE: return "DDP_ERR_STORE";
    case DDP_ERR_AUTH: return "DDP_ERR_AUTH";
    }
    return "DDP_ERR_UNKNOWN";
}

ddp_status ddp_error(ddp_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, sizeof errbuf, fmt, ap);
    va_end(ap);
    return st;
}

ddp_status ddp_error_prefix(ddp_status st, const char *fmt, ...) {
    char prefix[512];
    char old[DDP_ERRBUF];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, errbuf, sizeof old);
    size_t pl = strlen(prefix), ol = strlen(old);
    if (pl > sizeof errbuf - 1) pl = sizeof errbuf - 1;
    if (ol > sizeof errbuf - 1 - pl) ol = sizeof errbuf - 1 - pl;   /* cut the tail */
    memcpy(errbuf, prefix, pl);
    memcpy(errbuf + pl, old, ol);
    errbuf[pl + ol] = '\0';
    return st;
}

const char *ddp_last_error(void) { return errbuf; }

void ddp_copy_error(char *buf, size_t len) {
    if (len == 0) return;
    snprintf(buf, len, "%s", errbuf);
}

void ddp_set_error_text(const char *msg) {
    snprintf(errbuf, sizeof errbuf, "%s", msg ? msg : "");
}
