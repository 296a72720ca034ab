/* ddp_cuda_lib.h - the CUDA runtime and NCCL, loaded at run time with dlopen.
 *
 * pyddp builds with neither CUDA nor NCCL present, so this header declares
 * the few types, constants and entry points pyddp uses itself, from the
 * public APIs (cuda_runtime_api.h, nccl.h). The values used here are part of
 * those libraries' stable ABI (CUDA 11 to 13, NCCL 2.14 and later);
 * tests/test_nccl_real.py compiles the tables below against the real headers.
 *
 * ddp_cuda_load tries candidate files in the caller's order (the Python layer
 * knows where the nvidia-* wheels live; C cannot) and keeps, for each
 * library, the first one that loads, exports every symbol in the tables
 * below and works: NCCL must be 2.14 or newer (non-blocking communicators),
 * and a CUDA runtime too new for the installed driver is skipped in favour of
 * the next candidate. Once loaded, the libraries stay loaded for the life of
 * the process (NCCL cannot be unloaded while it has threads), so the table
 * from ddp_cuda_api_get() never goes stale. Thread-safe.
 */
#ifndef DDP_CUDA_LIB_H
#define DDP_CUDA_LIB_H

#include <stddef.h>
#include <stdint.h>
#include "ddp_status.h"

/* ---- CUDA runtime types and constants (cuda_runtime_api.h) ---------- */

typedef int ddp_cu_err;                      /* cudaError_t */
typedef struct CUstream_st *ddp_cu_stream;   /* cudaStream_t */
typedef struct CUevent_st *ddp_cu_event;     /* cudaEvent_t */

enum {
    DDP_CU_SUCCESS = 0,                /* cudaSuccess */
    DDP_CU_ERR_INSUFFICIENT_DRIVER = 35,
    DDP_CU_ERR_NO_DEVICE = 100,
    DDP_CU_ERR_NOT_READY = 600,        /* cudaErrorNotReady */
    DDP_CU_STREAM_NON_BLOCKING = 0x1,  /* cudaStreamNonBlocking */
    DDP_CU_EVENT_DISABLE_TIMING = 0x2, /* cudaEventDisableTiming */
    DDP_CU_MEMCPY_DEFAULT = 4,         /* cudaMemcpyDefault (unified addressing) */
    DDP_CU_MEM_DEVICE = 2,             /* cudaMemoryTypeDevice */
    DDP_CU_MEM_MANAGED = 3             /* cudaMemoryTypeManaged */
};

/* cudaPointerAttributes: type, device, devicePointer, hostPointer, then
 * reserved space in newer runtimes; padded so any runtime fits. */
typedef struct ddp_cu_ptr_attr {
    int type;
    int device;
    void *device_pointer;
    void *host_pointer;
    long reserved[32];
} ddp_cu_ptr_attr;

/* ---- NCCL types and constants (nccl.h) ------------------------------ */

typedef int ddp_nc_result;                   /* ncclResult_t */
typedef struct ncclComm *ddp_nc_comm;        /* ncclComm_t */
typedef struct { char internal[128]; } ddp_nc_uid;  /* ncclUniqueId */

enum {
    DDP_NC_SUCCESS = 0,       /* ncclSuccess */
    DDP_NC_IN_PROGRESS = 7,   /* ncclInProgress (non-blocking communicators) */
    /* ncclDataType_t */
    DDP_NC_INT8 = 0, DDP_NC_UINT8 = 1, DDP_NC_INT32 = 2, DDP_NC_UINT32 = 3,
    DDP_NC_INT64 = 4, DDP_NC_UINT64 = 5, DDP_NC_FLOAT16 = 6, DDP_NC_FLOAT32 = 7,
    DDP_NC_FLOAT64 = 8, DDP_NC_BFLOAT16 = 9,
    /* ncclRedOp_t */
    DDP_NC_SUM = 0, DDP_NC_PROD = 1, DDP_NC_MAX = 2, DDP_NC_MIN = 3, DDP_NC_AVG = 4
};

#define DDP_NC_API_MAGIC 0xcafebeefu
#define DDP_NC_MIN_VERSION 21400      /* 2.14.0: ncclCommInitRankConfig, blocking=0 */

/* The head of ncclConfig_t as of NCCL 2.14 (size, magic, version, blocking).
 * The struct is versioned and append-only: NCCL copies `size` bytes and
 * gives every field after them its default, so this prefix is valid for
 * every later NCCL. */
typedef struct ddp_nc_config {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
} ddp_nc_config;

/* ---- the function tables -------------------------------------------- */

/* X(return type, name, parameter list): every symbol is required. */
#define DDP_CUDART_FUNCS(X)                                                        \
    X(ddp_cu_err, cudaGetDeviceCount, (int *))                                     \
    X(ddp_cu_err, cudaGetDevice, (int *))                                          \
    X(ddp_cu_err, cudaSetDevice, (int))                                            \
    X(ddp_cu_err, cudaRuntimeGetVersion, (int *))                                  \
    X(ddp_cu_err, cudaDriverGetVersion, (int *))                                   \
    X(const char *, cudaGetErrorString, (ddp_cu_err))                              \
    X(ddp_cu_err, cudaStreamCreateWithFlags, (ddp_cu_stream *, unsigned int))      \
    X(ddp_cu_err, cudaStreamDestroy, (ddp_cu_stream))                              \
    X(ddp_cu_err, cudaStreamWaitEvent, (ddp_cu_stream, ddp_cu_event, unsigned int)) \
    X(ddp_cu_err, cudaEventCreateWithFlags, (ddp_cu_event *, unsigned int))        \
    X(ddp_cu_err, cudaEventDestroy, (ddp_cu_event))                                \
    X(ddp_cu_err, cudaEventRecord, (ddp_cu_event, ddp_cu_stream))                  \
    X(ddp_cu_err, cudaEventQuery, (ddp_cu_event))                                  \
    X(ddp_cu_err, cudaPointerGetAttributes, (ddp_cu_ptr_attr *, const void *))     \
    X(ddp_cu_err, cudaMemcpyAsync, (void *, const void *, size_t, int, ddp_cu_stream)) \
    X(ddp_cu_err, cudaMalloc, (void **, size_t))                                   \
    X(ddp_cu_err, cudaFree, (void *))                                              \
    X(ddp_cu_err, cudaMallocHost, (void **, size_t))                               \
    X(ddp_cu_err, cudaFreeHost, (void *))

#define DDP_NCCL_FUNCS(X)                                                          \
    X(ddp_nc_result, ncclGetVersion, (int *))                                      \
    X(const char *, ncclGetErrorString, (ddp_nc_result))                           \
    X(const char *, ncclGetLastError, (ddp_nc_comm))                               \
    X(ddp_nc_result, ncclGetUniqueId, (ddp_nc_uid *))                              \
    X(ddp_nc_result, ncclCommInitRankConfig,                                       \
      (ddp_nc_comm *, int, ddp_nc_uid, int, ddp_nc_config *))                      \
    X(ddp_nc_result, ncclCommGetAsyncError, (ddp_nc_comm, ddp_nc_result *))        \
    X(ddp_nc_result, ncclCommFinalize, (ddp_nc_comm))                              \
    X(ddp_nc_result, ncclCommDestroy, (ddp_nc_comm))                               \
    X(ddp_nc_result, ncclCommAbort, (ddp_nc_comm))                                 \
    X(ddp_nc_result, ncclAllReduce, (const void *, void *, size_t, int, int,      \
                                     ddp_nc_comm, ddp_cu_stream))                  \
    X(ddp_nc_result, ncclBroadcast, (const void *, void *, size_t, int, int,      \
                                     ddp_nc_comm, ddp_cu_stream))                  \
    X(ddp_nc_result, ncclReduce, (const void *, void *, size_t, int, int, int,    \
                                  ddp_nc_comm, ddp_cu_stream))                     \
    X(ddp_nc_result, ncclAllGather, (const void *, void *, size_t, int,           \
                                     ddp_nc_comm, ddp_cu_stream))                  \
    X(ddp_nc_result, ncclReduceScatter, (const void *, void *, size_t, int, int,  \
                                         ddp_nc_comm, ddp_cu_stream))              \
    X(ddp_nc_result, ncclSend, (const void *, size_t, int, int, ddp_nc_comm,      \
                                ddp_cu_stream))                                    \
    X(ddp_nc_result, ncclRecv, (void *, size_t, int, int, ddp_nc_comm,            \
                                ddp_cu_stream))                                    \
    X(ddp_nc_result, ncclGroupStart, (void))                                       \
    X(ddp_nc_result, ncclGroupEnd, (void))

#define DDP_CUDA_FIELD(ret, name, args) ret (*name) args;
typedef struct ddp_cuda_api {
    DDP_CUDART_FUNCS(DDP_CUDA_FIELD)
    DDP_NCCL_FUNCS(DDP_CUDA_FIELD)
} ddp_cuda_api;
#undef DDP_CUDA_FIELD

/* A place to look for a library: a path (absolute, or a bare file name for
 * the system's search) and where it came from, for messages
 * ("PYDDP_NCCL_LIBRARY", "nvidia-nccl-cu12 wheel", "system library path"). */
typedef struct ddp_lib_candidate {
    const char *path;
    const char *origin;
} ddp_lib_candidate;

/* What was loaded, for users and messages. */
typedef struct ddp_cuda_info {
    char nccl_path[1024];
    char cudart_path[1024];
    int nccl_version;     /* NCCL's code, e.g. 22703 for 2.27.3 */
    int cudart_version;   /* e.g. 12080 */
    int driver_version;   /* CUDA version the driver supports, e.g. 12090 */
    int device_count;     /* visible devices (0 if none) */
    char device_error[512]; /* why device_count is 0, or "" */
} ddp_cuda_info;

/* Load NCCL and the CUDA runtime from the candidates, in order. With
 * prefer_loaded, a candidate that this process already loaded (torch's
 * NCCL, say) is taken before any that would need loading. Succeeds at once
 * when an earlier call succeeded. On failure returns DDP_ERR_UNAVAILABLE
 * with a message listing every candidate tried and why it was refused, and
 * leaves nothing loaded (a later call may try other candidates). *info, if
 * not NULL, receives the description of what is loaded. */
ddp_status ddp_cuda_load(const ddp_lib_candidate *nccl, size_t n_nccl,
                         const ddp_lib_candidate *cudart, size_t n_cudart,
                         int prefer_loaded, ddp_cuda_info *info);

/* The NCCL that ddp_cuda_load would take from these candidates, found,
 * checked (every symbol of DDP_NCCL_FUNCS, version 2.14 or newer) and
 * closed again (dlclose): *info gets nccl_path and nccl_version, the rest
 * zero. It needs neither the CUDA runtime nor a driver, so it also
 * describes NCCL on machines where ddp_cuda_load fails for want of them.
 * Thread-safe (the loader's lock). After a successful
 * ddp_cuda_load it describes what is loaded (all of *info). On failure
 * returns DDP_ERR_UNAVAILABLE with ddp_cuda_load's message for NCCL. */
ddp_status ddp_nccl_probe(const ddp_lib_candidate *nccl, size_t n_nccl, int prefer_loaded,
                          ddp_cuda_info *info);

/* The loaded table, or NULL before a successful ddp_cuda_load. */
const ddp_cuda_api *ddp_cuda_api_get(void);

/* "2.27.3" from an NCCL version code (buf of at least 16 bytes). */
const char *ddp_nccl_version_str(int code, char *buf, size_t len);

#endif
