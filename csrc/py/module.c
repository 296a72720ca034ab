/* module.c - the pyddp._C extension module: multi-phase init that registers
 * the exception classes and every binding type defined in csrc/py (the
 * process group's registration adds WIRE_VERSION: py_pg.c makes the CPU
 * communicator). */
#include "py_common.h"

static int ddp_exec(PyObject *m) {
    if (ddp_py_errors_register(m) < 0) return -1;
    if (ddp_py_store_register(m) < 0) return -1;
    if (ddp_py_pg_register(m) < 0) return -1;
    if (ddp_py_net_register(m) < 0) return -1;
    if (ddp_py_nccl_register(m) < 0) return -1;
    if (ddp_py_reducer_register(m) < 0) return -1;
    if (ddp_py_grad_hooks_register(m) < 0) return -1;
    if (ddp_py_settings_register(m) < 0) return -1;
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
