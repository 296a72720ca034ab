/* py_net.c - module functions for picking the address a rank advertises:
 * route_addr(host) and ifname_addr(name), thin wrappers of ddp_sock.h. */
#include "py_common.h"
#include "ddp_sock.h"

static PyObject *net_route_addr(PyObject *m, PyObject *args) {
    const char *host;
    char out[DDP_ADDR_MAX];
    if (!PyArg_ParseTuple(args, "s", &host)) return NULL;
    ddp_status st;
    Py_BEGIN_ALLOW_THREADS   /* may resolve a host name */
    st = ddp_sock_route_addr(host, out, sizeof out);
    Py_END_ALLOW_THREADS
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    return PyUnicode_FromString(out);
}

static PyObject *net_ifname_addr(PyObject *m, PyObject *args) {
    const char *name;
    char out[DDP_ADDR_MAX];
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    ddp_status st = ddp_sock_ifname_addr(name, out, sizeof out);
    if (st != DDP_OK) return ddp_py_raise(st, NULL);
    return PyUnicode_FromString(out);
}

static PyMethodDef net_methods[] = {
    {"route_addr", net_route_addr, METH_VARARGS,
     "route_addr(host) -> the local IP address used to reach host"},
    {"ifname_addr", net_ifname_addr, METH_VARARGS,
     "ifname_addr(name) -> the IP address of network interface name"},
    {NULL}
};

int ddp_py_net_register(PyObject *m) {
    return PyModule_AddFunctions(m, net_methods);
}
