/* module.c - the pyddp._C extension module: multi-phase init that registers
 * the exception classes and every binding type defined in csrc/py (the
 * process group's registration adds WIRE_VERSION: py_pg.c makes the CPU
 * communicator), and the forensics store schema of ddp_forensics.h, which
 * pyddp/_forensics.py reads records by. */
#include "py_common.h"
#include "ddp_forensics.h"

/* FX_KEYS {role: key name} (incidents: DDP_FX_STUCK_N, incident: DDP_FX_STUCK,
 * report, read, failures: DDP_FX_BROKEN_N, failure: DDP_FX_BROKEN),
 * FX_STUCK_FIELDS/FX_BROKEN_FIELDS ("rank;tag;...") and
 * FX_STUCK_FORMAT/FX_BROKEN_FORMAT (the C writers' formats, for the check
 * that fields and formats agree). */
static int add_forensics_schema(PyObject *m) {
    PyObject *keys = Py_BuildValue("{s:s,s:s,s:s,s:s,s:s,s:s}", "incidents", DDP_FX_STUCK_N,
                                   "incident", DDP_FX_STUCK, "report", DDP_FX_REPORT,
                                   "read", DDP_FX_READ, "failures", DDP_FX_BROKEN_N,
                                   "failure", DDP_FX_BROKEN);
    if (keys == NULL || PyModule_AddObject(m, "FX_KEYS", keys) < 0) {
        Py_XDECREF(keys);
        return -1;
    }
    if (PyModule_AddStringConstant(m, "FX_STUCK_FIELDS", DDP_FX_STUCK_FIELDS) < 0 ||
        PyModule_AddStringConstant(m, "FX_STUCK_FORMAT", DDP_FX_STUCK_FORMAT) < 0 ||
        PyModule_AddStringConstant(m, "FX_BROKEN_FIELDS", DDP_FX_BROKEN_FIELDS) < 0 ||
        PyModule_AddStringConstant(m, "FX_BROKEN_FORMAT", DDP_FX_BROKEN_FORMAT) < 0)
        return -1;
    return 0;
}

static int ddp_exec(PyObject *m) {
    if (ddp_py_errors_register(m) < 0) return -1;
    if (ddp_py_store_register(m) < 0) return -1;
    if (ddp_py_store_server_register(m) < 0) return -1;
    if (ddp_py_pg_register(m) < 0) return -1;
    if (ddp_py_net_register(m) < 0) return -1;
    if (ddp_py_nccl_register(m) < 0) return -1;
    if (ddp_py_reducer_register(m) < 0) return -1;
    if (ddp_py_grad_hooks_register(m) < 0) return -1;
    if (ddp_py_settings_register(m) < 0) return -1;
    if (ddp_py_torch_thin_register(m) < 0) return -1;
    if (ddp_py_torch_cuda_register(m) < 0) return -1;
    if (add_forensics_schema(m) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot ddp_slots[] = {
    {Py_mod_exec, ddp_exec},
    {0, NULL},
};

static struct PyModuleDef ddp_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pyddp._C",
    .m_doc = "pyddp's C core: store, process group, collectives, reducer.",
    .m_size = 0,
    .m_slots = ddp_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&ddp_module); }
