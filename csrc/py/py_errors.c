/* py_errors.c - pyddp's exception classes and the mapping from core statuses.
 *
 * The classes mirror torch.distributed's names where torch has one and
 * subclass the built-ins users already catch:
 *   DistError(RuntimeError)
 *     DistBackendError            a collective failed
 *       CollectiveMismatchError   ranks called different collectives
 *       BackendUnavailableError   NCCL/CUDA could not be loaded
 *     DistNetworkError(ConnectionError)   connect failed, peer closed/reset
 *     DistStoreError              a store request failed (garbage reply,
 *                                 lost connection, client closed)
 *     DistTimeoutError(TimeoutError)      a deadline passed
 *       DistStoreTimeoutError(DistStoreError)  a store request timed out
 * torch raises DistStoreError for store timeouts, code written for pyddp
 * catches TimeoutError: DistStoreTimeoutError satisfies both.
 *     VersionMismatchError        ranks run different pyddp versions
 *     AuthenticationError(PermissionError)  a peer or the store failed the
 *                                 PYDDP_AUTH_TOKEN handshake (never retried)
 *   DistValueError(ValueError), DistTypeError(TypeError): bad arguments,
 *   raised before any communication.
 * The classes live in static storage because the module is a process-wide
 * singleton in practice; they are created once by ddp_py_errors_register.
 */
#include "py_common.h"

static PyObject *DistError, *DistBackendError, *CollectiveMismatchError,
    *BackendUnavailableError, *DistNetworkError, *DistStoreError,
    *DistTimeoutError, *DistStoreTimeoutError, *VersionMismatchError, *DistValueError,
    *DistTypeError, *AuthenticationError;

static PyObject *make_exc(PyObject *m, const char *name, PyObject *bases,
                          const char *doc) {
    char full[128];
    PyOS_snprintf(full, sizeof full, "pyddp.%s", name);
    PyObject *cls = PyErr_NewExceptionWithDoc(full, doc, bases, NULL);
    if (cls == NULL) return NULL;
    if (PyModule_AddObjectRef(m, name, cls) < 0) {
        Py_DECREF(cls);
        return NULL;
    }
    return cls;
}

#define MAKE(var, name, bases, doc)                                  \
    do {                                                             \
        PyObject *b_ = (bases);                                      \
        if (b_ == NULL) return -1;                                   \
        var = make_exc(m, name, b_, doc);                            \
        Py_DECREF(b_);                                               \
        if (var == NULL) return -1;                                  \
    } while (0)

int ddp_py_errors_register(PyObject *m) {
    if (DistError != NULL) {  /* module re-initialised: re-export */
        PyObject *all[] = {DistError, DistBackendError, CollectiveMismatchError,
                           BackendUnavailableError, DistNetworkError, DistStoreError,
                           DistTimeoutError, DistStoreTimeoutError, VersionMismatchError,
                           DistValueError, DistTypeError, AuthenticationError};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
            const char *dot = strrchr(((PyTypeObject *)all[i])->tp_name, '.');
            if (PyModule_AddObjectRef(m, dot + 1, all[i]) < 0) return -1;
        }
        return 0;
    }
    MAKE(DistError, "DistError", PyTuple_Pack(1, PyExc_RuntimeError),
         "Base class of pyddp's distributed errors.");
    MAKE(DistBackendError, "DistBackendError", PyTuple_Pack(1, DistError),
         "A collective operation failed.");
    MAKE(CollectiveMismatchError, "CollectiveMismatchError",
         PyTuple_Pack(1, DistBackendError),
         "Ranks called different collectives, or the same one with different "
         "counts, dtypes, ops or roots.");
    MAKE(BackendUnavailableError, "BackendUnavailableError",
         PyTuple_Pack(1, DistBackendError),
         "The requested backend's library (NCCL, CUDA) could not be loaded.");
    MAKE(DistNetworkError, "DistNetworkError",
         PyTuple_Pack(2, DistError, PyExc_ConnectionError),
         "A connection could not be made, or a peer closed or reset it.");
    MAKE(DistStoreError, "DistStoreError", PyTuple_Pack(1, DistError),
         "A key-value store request failed: the server sent garbage or closed the "
         "connection, or the store client was closed.");
    MAKE(DistTimeoutError, "DistTimeoutError",
         PyTuple_Pack(2, DistError, PyExc_TimeoutError),
         "A distributed operation did not finish before its timeout.");
    MAKE(DistStoreTimeoutError, "DistStoreTimeoutError",
         PyTuple_Pack(2, DistStoreError, DistTimeoutError),
         "A key-value store request (get, wait, ...) did not finish before its "
         "timeout. Both a DistStoreError (as torch raises) and a TimeoutError.");
    MAKE(VersionMismatchError, "VersionMismatchError", PyTuple_Pack(1, DistError),
         "Ranks run different pyddp or wire-protocol versions.");
    MAKE(AuthenticationError, "AuthenticationError",
         PyTuple_Pack(2, DistError, PyExc_PermissionError),
         "A peer or the store failed the PYDDP_AUTH_TOKEN challenge-response (a "
         "different token, no token, or not a pyddp process).");
    MAKE(DistValueError, "DistValueError", PyTuple_Pack(1, PyExc_ValueError),
         "An argument was rejected before any communication started.");
    MAKE(DistTypeError, "DistTypeError", PyTuple_Pack(1, PyExc_TypeError),
         "An argument of an unsupported type was rejected before any "
         "communication started.");
    return 0;
}

PyObject *ddp_py_raise(ddp_status st, const char *msg) {
    PyObject *cls;
    if (msg == NULL) msg = ddp_last_error();
    switch (st) {
    case DDP_ERR_INVALID: cls = DistValueError; break;
    case DDP_ERR_TYPE: cls = DistTypeError; break;
    case DDP_ERR_TIMEOUT: cls = DistTimeoutError; break;
    case DDP_ERR_CONNECT:
    case DDP_ERR_CLOSED:
    case DDP_ERR_PROTOCOL: cls = DistNetworkError; break;
    case DDP_ERR_AUTH: cls = AuthenticationError; break;
    case DDP_ERR_MISMATCH: cls = CollectiveMismatchError; break;
    case DDP_ERR_VERSION: cls = VersionMismatchError; break;
    case DDP_ERR_NOMEM: cls = PyExc_MemoryError; break;
    case DDP_ERR_UNAVAILABLE: cls = BackendUnavailableError; break;
    case DDP_ERR_ABORTED: cls = DistBackendError; break;
    case DDP_ERR_STORE: cls = DistStoreError; break;
    default: cls = DistError; break;
    }
    if (cls == NULL) cls = PyExc_RuntimeError;
    PyErr_SetString(cls, msg && *msg ? msg : ddp_status_name(st));
    return NULL;
}

PyObject *ddp_py_raise_store(ddp_status st, const char *msg) {
    if (st != DDP_ERR_TIMEOUT || DistStoreTimeoutError == NULL) return ddp_py_raise(st, msg);
    if (msg == NULL) msg = ddp_last_error();
    PyErr_SetString(DistStoreTimeoutError, msg && *msg ? msg : ddp_status_name(st));
    return NULL;
}
