/* ddp_cuda_lib.c - finding and loading libnccl and libcudart with dlopen
 * (contract in ddp_cuda_lib.h).
 *
 * Each library is tried candidate by candidate; every refusal is written
 * into one message ("<path> (<origin>): <why>") so that a user whose
 * backend="nccl" fails sees every place that was searched. A candidate is
 * refused when dlopen fails, when a required symbol is missing (the file is
 * not NCCL / not the CUDA runtime), when NCCL is older than 2.14, or when
 * the CUDA runtime is newer than the driver supports. ddp_nccl_probe runs
 * the NCCL half alone and keeps nothing: NCCL loads without a driver or a
 * CUDA runtime (the nvidia-nccl wheel's libnccl.so.2 needs only the C and
 * C++ runtime libraries) and ncclGetVersion touches no GPU.
 */
#include "ddp_cuda_lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static ddp_cuda_api g_api;
static ddp_cuda_info g_info;
static int g_loaded;               /* written under g_mu, read after it is 1 */
static const ddp_cuda_api *g_published;

typedef struct sym_entry {
    const char *name;
    size_t offset;                 /* of the pointer inside ddp_cuda_api */
} sym_entry;

#define DDP_CUDA_SYM(ret, name, args) {#name, offsetof(ddp_cuda_api, name)},
static const sym_entry CUDART_SYMS[] = {DDP_CUDART_FUNCS(DDP_CUDA_SYM)};
static const sym_entry NCCL_SYMS[] = {DDP_NCCL_FUNCS(DDP_CUDA_SYM)};
#undef DDP_CUDA_SYM

/* A growing report of refused candidates. */
typedef struct report {
    char text[6144];
    size_t len;
    int n;
} report;

static report g_report;            /* large: static; only touched under g_mu */

static void report_add(report *r, const ddp_lib_candidate *c, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void report_add(report *r, const ddp_lib_candidate *c, const char *fmt, ...) {
    if (r->len >= sizeof r->text - 1) return;
    int k = snprintf(r->text + r->len, sizeof r->text - r->len, "\n  %d. %s (%s): ", ++r->n,
                     c->path, c->origin ? c->origin : "?");
    if (k > 0) r->len += (size_t)k;
    if (r->len >= sizeof r->text - 1) { r->len = sizeof r->text - 1; return; }
    va_list ap;
    va_start(ap, fmt);
    k = vsnprintf(r->text + r->len, sizeof r->text - r->len, fmt, ap);
    va_end(ap);
    if (k > 0) r->len += (size_t)k;
    if (r->len >= sizeof r->text - 1) r->len = sizeof r->text - 1;
}

/* Resolve every symbol of the table into api; returns the first missing
 * name, or NULL when all were found. */
static const char *resolve(void *h, const sym_entry *syms, size_t n, ddp_cuda_api *api) {
    for (size_t i = 0; i < n; i++) {
        void *p = dlsym(h, syms[i].name);
        if (p == NULL) return syms[i].name;
        memcpy((char *)api + syms[i].offset, &p, sizeof p);
    }
    return NULL;
}

/* Where the library behind handle h actually lives (the path dlopen
 * resolved), falling back to what was asked for. */
static void real_path(void *h, const char *sym, const char *asked, char *out, size_t len) {
    Dl_info di;
    void *p = dlsym(h, sym);
    if (p && dladdr(p, &di) && di.dli_fname) snprintf(out, len, "%s", di.dli_fname);
    else snprintf(out, len, "%s", asked);
}

const char *ddp_nccl_version_str(int code, char *buf, size_t len) {
    if (code >= 10000) snprintf(buf, len, "%d.%d.%d", code / 10000, code % 10000 / 100, code % 100);
    else snprintf(buf, len, "%d.%d.%d", code / 1000, code % 1000 / 100, code % 100);
    return buf;
}

/* dlopen one candidate; a failure is reported unless it was only a check for
 * an already loaded library (RTLD_NOLOAD). */
static void *open_candidate(const ddp_lib_candidate *c, int flags, report *r) {
    void *h = dlopen(c->path, flags);
    if (h == NULL && !(flags & RTLD_NOLOAD)) report_add(r, c, "%s", dlerror());
    return h;
}

/* Try one NCCL candidate; on success fills the NCCL half of api and info. */
static int try_nccl(const ddp_lib_candidate *c, int flags, ddp_cuda_api *api,
                    ddp_cuda_info *info, report *r, void **handle) {
    void *h = open_candidate(c, flags, r);
    if (h == NULL) return 0;
    const char *missing = resolve(h, NCCL_SYMS, sizeof NCCL_SYMS / sizeof NCCL_SYMS[0], api);
    int version = 0;
    if (missing == NULL && api->ncclGetVersion(&version) != DDP_NC_SUCCESS) version = 0;
    if (missing != NULL) {
        /* ncclGetVersion present means NCCL, just one too old to have the rest */
        if (dlsym(h, "ncclGetVersion") != NULL && strcmp(missing, "ncclGetVersion") != 0)
            report_add(r, c, "this NCCL lacks %s; pyddp needs NCCL 2.14 or newer", missing);
        else
            report_add(r, c, "loaded, but it is not NCCL (no symbol %s)", missing);
    } else if (version < DDP_NC_MIN_VERSION) {
        char v[32];
        report_add(r, c, "NCCL %s is too old; pyddp needs NCCL 2.14 or newer",
                   ddp_nccl_version_str(version, v, sizeof v));
    } else {
        real_path(h, "ncclGetVersion", c->path, info->nccl_path, sizeof info->nccl_path);
        info->nccl_version = version;
        *handle = h;
        return 1;
    }
    dlclose(h);
    return 0;
}

/* Try one CUDA runtime candidate; on success fills the runtime half of api
 * and info (device count included). */
static int try_cudart(const ddp_lib_candidate *c, int flags, ddp_cuda_api *api,
                      ddp_cuda_info *info, report *r, void **handle) {
    void *h = open_candidate(c, flags, r);
    if (h == NULL) return 0;
    const char *missing = resolve(h, CUDART_SYMS, sizeof CUDART_SYMS / sizeof CUDART_SYMS[0], api);
    if (missing != NULL) {
        report_add(r, c, "loaded, but it is not the CUDA runtime (no symbol %s)", missing);
        dlclose(h);
        return 0;
    }
    int rt = 0, drv = 0, n = 0;
    api->cudaRuntimeGetVersion(&rt);
    api->cudaDriverGetVersion(&drv);
    ddp_cu_err e = api->cudaGetDeviceCount(&n);
    if (e == DDP_CU_ERR_INSUFFICIENT_DRIVER && drv > 0) {
        /* A runtime newer than the driver: an older candidate may still work. */
        report_add(r, c, "CUDA runtime %d.%d needs a newer driver (this driver supports CUDA "
                   "%d.%d)", rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10);
        dlclose(h);
        return 0;
    }
    info->device_error[0] = 0;
    if (e != DDP_CU_SUCCESS) {
        n = 0;
        snprintf(info->device_error, sizeof info->device_error,
                 "cudaGetDeviceCount failed: %s (error %d)%s", api->cudaGetErrorString(e), e,
                 drv == 0 ? "; no NVIDIA driver was found" : "");
    } else if (n == 0) {
        snprintf(info->device_error, sizeof info->device_error,
                 "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and nvidia-smi)");
    }
    real_path(h, "cudaGetDeviceCount", c->path, info->cudart_path, sizeof info->cudart_path);
    info->cudart_version = rt;
    info->driver_version = drv;
    info->device_count = n;
    *handle = h;
    return 1;
}

/* The error when no candidate of a library worked: every refusal, then how
 * to install the library. */
static ddp_status none_worked(const char *what, const report *r, const char *hint) {
    return ddp_error(DDP_ERR_UNAVAILABLE, "could not load %s; tried, in order:%s%s\n%s", what,
                     r->n ? r->text : "\n  (no candidates)",
                     r->len >= sizeof r->text - 1 ? " ..." : "", hint);
}

typedef int (*try_fn)(const ddp_lib_candidate *, int, ddp_cuda_api *, ddp_cuda_info *,
                      report *, void **);

/* First candidate that try() accepts: already-loaded ones first when
 * prefer_loaded, then in order. Returns its handle or NULL. */
static void *pick(const ddp_lib_candidate *cands, size_t n, int prefer_loaded, try_fn try,
                  ddp_cuda_api *api, ddp_cuda_info *info, report *r) {
    void *h = NULL;
    if (prefer_loaded)
        for (size_t i = 0; i < n; i++)
            if (try(&cands[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, api, info, r, &h)) return h;
    for (size_t i = 0; i < n; i++)
        if (try(&cands[i], RTLD_NOW | RTLD_LOCAL, api, info, r, &h)) return h;
    return NULL;
}

/* The NCCL half (g_mu held): the handle of the first NCCL candidate that
 * works, its table entries in api and its description in info; NULL with
 * *st set to the error listing every refusal. */
static void *pick_nccl(const ddp_lib_candidate *nccl, size_t n_nccl, int prefer_loaded,
                       ddp_cuda_api *api, ddp_cuda_info *info, ddp_status *st) {
    memset(&g_report, 0, sizeof g_report);
    void *h = pick(nccl, n_nccl, prefer_loaded, try_nccl, api, info, &g_report);
    if (h == NULL)
        *st = none_worked("NCCL (libnccl.so.2)", &g_report, "Install it with `pip install "
                          "nvidia-nccl-cu12` (or nvidia-nccl-cu13 for CUDA 13), or set "
                          "PYDDP_NCCL_LIBRARY to the path of libnccl.so.2.");
    return h;
}

ddp_status ddp_cuda_load(const ddp_lib_candidate *nccl, size_t n_nccl,
                         const ddp_lib_candidate *cudart, size_t n_cudart,
                         int prefer_loaded, ddp_cuda_info *info) {
    pthread_mutex_lock(&g_mu);
    if (g_loaded) {
        if (info) *info = g_info;
        pthread_mutex_unlock(&g_mu);
        return DDP_OK;
    }
    ddp_cuda_api api;
    memset(&api, 0, sizeof api);
    static ddp_cuda_info got;   /* large; only touched under g_mu */
    memset(&got, 0, sizeof got);
    ddp_status st = DDP_OK;
    void *hn = pick_nccl(nccl, n_nccl, prefer_loaded, &api, &got, &st);
    if (hn != NULL) {
        memset(&g_report, 0, sizeof g_report);
        if (pick(cudart, n_cudart, prefer_loaded, try_cudart, &api, &got, &g_report) == NULL) {
            dlclose(hn);
            st = none_worked("the CUDA runtime (libcudart.so.13 or .12)", &g_report,
                             "Install it with `pip install nvidia-cuda-runtime-cu12` (or "
                             "nvidia-cuda-runtime for CUDA 13), or put the CUDA toolkit's lib64 "
                             "folder on LD_LIBRARY_PATH.");
        } else {
            g_api = api;
            g_info = got;
            g_loaded = 1;
            __atomic_store_n(&g_published, &g_api, __ATOMIC_RELEASE);
            if (info) *info = g_info;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return st;
}

ddp_status ddp_nccl_probe(const ddp_lib_candidate *nccl, size_t n_nccl, int prefer_loaded,
                          ddp_cuda_info *info) {
    pthread_mutex_lock(&g_mu);
    ddp_status st = DDP_OK;
    if (g_loaded) {
        *info = g_info;
    } else {
        ddp_cuda_api api;          /* resolved, then dropped with the handle */
        memset(&api, 0, sizeof api);
        memset(info, 0, sizeof *info);
        void *h = pick_nccl(nccl, n_nccl, prefer_loaded, &api, info, &st);
        if (h != NULL) dlclose(h);
    }
    pthread_mutex_unlock(&g_mu);
    return st;
}

const ddp_cuda_api *ddp_cuda_api_get(void) {
    return __atomic_load_n(&g_published, __ATOMIC_ACQUIRE);
}
