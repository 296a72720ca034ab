/* py_settings.c - the settings table (csrc/core/ddp_settings.h) seen from
 * Python: pyddp._C.settings() lists every declared PYDDP_* variable,
 * pyddp._C.setting(name) reads one through the core's parse-once accessors,
 * so Python and C read a variable the same way, and pyddp._C.setting_text(name)
 * gives a declared variable's text as the environment holds it at the call,
 * for the few settings Python parses itself, at each use (with an error
 * naming the variable when the value is bad). No PYDDP_* variable is read
 * any other way.
 */
#include "py_common.h"

#include <stdlib.h>

#include "ddp_settings.h"

static const char *kind_name(ddp_setting_kind k) {
    switch (k) {
    case DDP_SETTING_INT: return "int";
    case DDP_SETTING_BYTES: return "bytes";
    case DDP_SETTING_BOOL: return "bool";
    case DDP_SETTING_SECONDS: return "seconds";
    case DDP_SETTING_STRING: return "string";
    }
    return "?";
}

static PyObject *py_settings(PyObject *m, PyObject *unused) {
    size_t n;
    const ddp_setting_decl *t = ddp_settings_table(&n);
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out == NULL) return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *d = Py_BuildValue("{s:s,s:s,s:z,s:L,s:L,s:O,s:O,s:s,s:s}", "name", t[i].name,
                                    "kind", kind_name(t[i].kind), "default", t[i].dflt_text,
                                    "min", (long long)t[i].min, "max", (long long)t[i].max,
                                    "core", (t[i].flags & DDP_SETTING_CORE) ? Py_True : Py_False,
                                    "debug", (t[i].flags & DDP_SETTING_DEBUG) ? Py_True : Py_False,
                                    "doc", t[i].doc, "scope",
                                    t[i].scope ? t[i].scope : "every backend");
        if (d == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, d);
    }
    return out;
}

static PyObject *py_setting(PyObject *m, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    const ddp_setting_decl *d = ddp_setting_find(name);
    if (d == NULL) return PyErr_Format(PyExc_KeyError, "%s is not a pyddp setting", name);
    switch (d->kind) {
    case DDP_SETTING_BOOL: return PyBool_FromLong((long)ddp_setting_int(name));
    case DDP_SETTING_INT: case DDP_SETTING_BYTES:
        return PyLong_FromLongLong((long long)ddp_setting_int(name));
    case DDP_SETTING_SECONDS: return PyFloat_FromDouble(ddp_setting_seconds(name));
    case DDP_SETTING_STRING: {
        const char *v = ddp_setting_str(name);
        if (v == NULL) Py_RETURN_NONE;
        return PyUnicode_FromString(v);
    }
    }
    Py_RETURN_NONE;
}

static PyObject *py_setting_text(PyObject *m, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    if (ddp_setting_find(name) == NULL)
        return PyErr_Format(PyExc_KeyError, "%s is not a pyddp setting", name);
    const char *v = getenv(name);
    if (v == NULL) Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(v);
}

static PyMethodDef methods[] = {
    {"settings", py_settings, METH_NOARGS,
     "settings() -> [dict]: every PYDDP_* setting (name, kind, default, bounds, doc, scope)"},
    {"setting", py_setting, METH_O,
     "setting(name) -> its value as the core parses it (None: unset string)"},
    {"setting_text", py_setting_text, METH_O,
     "setting_text(name) -> the declared variable's text in the environment now, '' if "
     "set empty, None if unset (for the settings Python parses itself)"},
    {NULL}
};

int ddp_py_settings_register(PyObject *m) { return PyModule_AddFunctions(m, methods); }
