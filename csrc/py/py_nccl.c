/* py_nccl.c - the NCCL side of pyddp._C.ProcessGroup (py_pg.c): creating a
 * group's NCCL communicator (on first use of a GPU array, or at init for
 * backend="nccl") and checking GPU arrays against its device. The loader
 * functions are in py_nccl_lib.c; the communicator is driven through the one
 * process-group interface (ddp_pg.h, csrc/cuda/ddp_nccl_pg.c).
 */
#include "py_common.h"

#include <string.h>
#include "ddp_cuda_lib.h"
#include "ddp_nccl_comm.h"
#include "ddp_nccl_pg.h"
#include "ddp_store.h"
#include "py_nccl.h"

typedef struct {
    ddp_nccl_config cfg;
    ddp_store *store;
    ddp_nccl_comm *comm;
    ddp_status st;
    char msg[2048];
} create_job;

static void create_run(void *p) {
    create_job *j = p;
    j->st = ddp_nccl_comm_create(&j->cfg, j->store, &j->comm);
    if (j->st != DDP_OK) ddp_copy_error(j->msg, sizeof j->msg);
}

int ddp_py_nccl_create(PyObject *store_obj, int rank, int size, const char *prefix, int device,
                       int64_t timeout_ms, const char *version, ddp_pg *out) {
    memset(out, 0, sizeof *out);
    if (ddp_cuda_api_get() == NULL) {
        ddp_py_raise(DDP_ERR_UNAVAILABLE, "NCCL is not loaded: call pyddp._C.nccl_load first "
                     "(pyddp._nccl_backend does)");
        return -1;
    }
    create_job j;
    memset(&j, 0, sizeof j);
    atomic_int abort;
    atomic_init(&abort, 0);
    j.cfg.rank = rank;
    j.cfg.size = size;
    j.cfg.prefix = prefix;
    j.cfg.device = device;
    j.cfg.timeout_ms = timeout_ms;
    j.cfg.version = version;
    j.cfg.abort = &abort;
    j.store = ddp_py_store_client_ref(store_obj);   /* held across the set-up */
    if (j.store == NULL) return -1;
    int rc = ddp_py_run_abortable(create_run, &j, &abort);
    ddp_store_release(j.store);
    if (rc < 0) {
        ddp_nccl_comm_destroy(j.comm, ddp_wait_for(0, NULL));
        return -1;
    }
    if (j.st != DDP_OK) {
        ddp_py_raise(j.st, j.msg);
        return -1;
    }
    *out = ddp_nccl_pg(j.comm);
    return 0;
}

int ddp_py_nccl_check_array(ddp_pg nccl, ddp_py_array *arr, const char *name) {
    ddp_nccl_comm *c = nccl.impl;
    int dev = arr->device_id;
    ddp_status st = DDP_OK;
    if (dev < 0 && arr->count > 0) {
        Py_BEGIN_ALLOW_THREADS
        st = ddp_nccl_pointer_device(c, arr->ptr, name, &dev);
        Py_END_ALLOW_THREADS
    }
    if (st != DDP_OK) {
        ddp_py_raise(st, NULL);
        return -1;
    }
    int d = ddp_nccl_comm_device(c);
    if (dev >= 0 && dev != d) {
        char msg[400];
        PyOS_snprintf(msg, sizeof msg, "%s is on cuda:%d, but this rank's NCCL process group "
                      "uses cuda:%d; move it there (x.to('cuda:%d')), or call "
                      "torch.cuda.set_device(%d) before creating tensors", name, dev, d, d, d);
        ddp_py_raise(DDP_ERR_INVALID, msg);
        return -1;
    }
    return 0;
}

int ddp_py_nccl_register(PyObject *m) { return ddp_py_nccl_lib_register(m); }
