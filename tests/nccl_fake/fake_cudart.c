/* fake_cudart.c - TEST DOUBLE of the CUDA runtime (libcudart), for pyddp's
 * tests on machines without a GPU. It exports the entry points pyddp's
 * loader resolves (csrc/cuda/ddp_cuda_lib.h) with trivial behaviour: "device
 * memory" is host memory, copies are memcpy, events complete at once, and
 * every call is logged (fake_log.h). Environment knobs:
 *   FAKE_CUDA_DEVICES=n     devices reported (default 1; 0: no device)
 *   FAKE_CUDA_HANG=1        events recorded on streams made here do not complete
 *                           (until an NCCL abort clears the variable)
 *   FAKE_PTR_DEVICE=d       device that cudaPointerGetAttributes reports
 * Built with -DFAKE_OLD_DRIVER it plays a runtime too new for the driver.
 * Never shipped: tests/test_nccl_nogpu.py compiles it into a temp folder.
 */
#include <stdint.h>
#include "fake_log.h"

typedef struct fake_stream { int made_here; } fake_stream;
typedef struct fake_event { int hang; } fake_event;
typedef struct fake_attr { int type; int device; void *dp; void *hp; } fake_attr;

static __thread int cur_device;
static void *streams[64];
static int nstreams;

int cudaGetDeviceCount(int *n) {
#ifdef FAKE_OLD_DRIVER
    *n = 0;
    return 35;   /* cudaErrorInsufficientDriver */
#else
    *n = fake_env_int("FAKE_CUDA_DEVICES", 1);
    return *n > 0 ? 0 : 100;   /* cudaErrorNoDevice */
#endif
}
int cudaRuntimeGetVersion(int *v) { *v = 12080; return 0; }
int cudaDriverGetVersion(int *v) {
#ifdef FAKE_OLD_DRIVER
    *v = 11080;
#else
    *v = 12080;
#endif
    return 0;
}
const char *cudaGetErrorString(int e) { return e == 600 ? "not ready" : "fake CUDA error"; }
int cudaGetDevice(int *d) { *d = cur_device; return 0; }
int cudaSetDevice(int d) {
    fake_log("cudaSetDevice %d", d);
    if (d < 0 || d >= fake_env_int("FAKE_CUDA_DEVICES", 1)) return 101;  /* invalid device */
    cur_device = d;
    return 0;
}
int cudaStreamCreateWithFlags(void **s, unsigned flags) {
    fake_stream *f = calloc(1, sizeof *f);
    f->made_here = 1;
    *s = f;
    if (nstreams < 64) streams[nstreams++] = f;
    fake_log("cudaStreamCreateWithFlags stream=%p flags=%u", *s, flags);
    return 0;
}
int cudaStreamDestroy(void *s) { fake_log("cudaStreamDestroy stream=%p", s); free(s); return 0; }
int cudaEventCreateWithFlags(void **e, unsigned flags) {
    *e = calloc(1, sizeof(fake_event));
    fake_log("cudaEventCreateWithFlags event=%p flags=%u", *e, flags);
    return 0;
}
int cudaEventDestroy(void *e) { fake_log("cudaEventDestroy event=%p", e); free(e); return 0; }
/* Streams made here are remembered; anything else is a caller's handle (0,
 * 1 or a value from Python) that must not be dereferenced. */
static int made_here(void *s) {
    for (int i = 0; i < nstreams; i++)
        if (streams[i] == s) return 1;
    return 0;
}
int cudaEventRecord(void *e, void *s) {
    fake_log("cudaEventRecord event=%p stream=%p", e, s);
    ((fake_event *)e)->hang = fake_env_int("FAKE_CUDA_HANG", 0) && made_here(s);
    return 0;
}
/* A hung event completes once FAKE_CUDA_HANG is cleared (fake_nccl.c's
 * ncclCommAbort does, as a real abort makes NCCL's kernels exit). */
int cudaEventQuery(void *e) {
    return ((fake_event *)e)->hang && fake_env_int("FAKE_CUDA_HANG", 0) ? 600 : 0;
}
int cudaStreamWaitEvent(void *s, void *e, unsigned flags) {
    fake_log("cudaStreamWaitEvent stream=%p event=%p", s, e);
    return 0;
}
int cudaPointerGetAttributes(fake_attr *a, const void *p) {
    a->type = p ? 2 : 0;   /* cudaMemoryTypeDevice */
    a->device = fake_env_int("FAKE_PTR_DEVICE", 0);
    return 0;
}
int cudaMemcpyAsync(void *d, const void *s, size_t n, int kind, void *st) {
    fake_log("cudaMemcpyAsync bytes=%zu stream=%p", n, st);
    memmove(d, s, n);
    return 0;
}
int cudaMalloc(void **p, size_t n) { *p = calloc(1, n); return *p ? 0 : 2; }
int cudaFree(void *p) { free(p); return 0; }
int cudaMallocHost(void **p, size_t n) { *p = calloc(1, n); return *p ? 0 : 2; }
int cudaFreeHost(void *p) { free(p); return 0; }
