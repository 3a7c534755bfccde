/* SPDX-License-Identifier: Apache-2.0 */
/*
 * aiokv._native's Python face of CRC32C (native/crc32c.c computes it): crc32c,
 * crc32c_bytes, crc32c_path, crc32c_sw, crc32c_use, and the constants HAVE_HW_CRC,
 * CRC_PATH, CRC_PATHS (crc_add). GIL released over large buffers. Only aiokv._native
 * registers these; aiokv._index links crc32c.c alone.
 *
 * Threading: every function runs on any thread, several at once, but crc32c_use,
 * which switches the module's path under the GIL and is for benchmarks only (not
 * thread-safe against calls running).
 */
#include "aiokv.h"
#include "crc32c.h"

/* crc32c(addr, length, seed=0) -> int */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    unsigned long long addr, length;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "KK|I", &addr, &length, &seed)) return NULL;
    uint32_t r;
    if (length > GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c(seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c(seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
    }
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_sw(buffer, seed=0) -> int: the table path whatever the CPU has
 * (tests check the others against it). */
static PyObject *py_crc32c_sw(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed)) return NULL;
    uint32_t r = crc32c_by(CRC_TABLE, seed, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

/* A path's index by name, or -1 with ValueError where this machine lacks it. */
static int path_arg(const char *name) {
    for (int i = 0; i < CRC_NPATHS; i++)
        if (crc_has(i) && !strcmp(name, crc_path_names[i])) return i;
    char list[64] = "";
    for (int i = 0; i < CRC_NPATHS; i++)
        if (crc_has(i)) snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", *list ? ", " : "",
                              crc_path_names[i]);
    PyErr_Format(PyExc_ValueError, "aiokv: CRC32C path %s is not one this CPU has (%s)", name, list);
    return -1;
}

/* crc32c_path(path, addr, length, seed=0) -> int: CRC32C by one named path,
 * GIL released; ValueError where this machine lacks it. For tests (every path
 * against the table) and benchmarks. */
static PyObject *py_crc32c_path(PyObject *self, PyObject *args) {
    const char *name;
    unsigned long long addr, length;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "sKK|I", &name, &addr, &length, &seed)) return NULL;
    int path = path_arg(name);
    if (path < 0) return NULL;
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = crc32c_by(path, seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_use(path) -> the path crc32c() took until now: every CRC32C of the
 * module (the copies', the slots') by that path from now on. For benchmarks
 * that compare paths in one process; not thread-safe against calls running. */
static PyObject *py_crc32c_use(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int path = path_arg(name);
    if (path < 0) return NULL;
    int was = crc_default();
    crc_use(path);
    return PyUnicode_FromString(crc_path_names[was]);
}

/* crc32c_bytes(buffer, seed=0) -> int, for Python-side buffers (GIL released above GIL_FREE_BYTES, 64 KiB). */
static PyObject *py_crc32c_bytes(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed)) return NULL;
    uint32_t r;
    if (view.len > GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c(seed, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c(seed, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

static PyMethodDef crc_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(addr, length, seed=0) -> int"},
    {"crc32c_bytes", py_crc32c_bytes, METH_VARARGS, "crc32c_bytes(buffer, seed=0) -> int"},
    {"crc32c_path", py_crc32c_path, METH_VARARGS, "crc32c_path(path, addr, length, seed=0) -> int (tests, benchmarks)"},
    {"crc32c_use", py_crc32c_use, METH_VARARGS, "crc32c_use(path) -> the path used until now (benchmarks)"},
    {"crc32c_sw", py_crc32c_sw, METH_VARARGS, "crc32c_sw(buffer, seed=0) -> int (table path, for tests)"},
    {NULL}};

int crc_add(PyObject *m) {
    if (PyModule_AddFunctions(m, crc_methods) < 0 ||
        PyModule_AddIntConstant(m, "HAVE_HW_CRC", crc_default() != CRC_TABLE) < 0 ||
        PyModule_AddStringConstant(m, "CRC_PATH", crc_path_names[crc_default()]) < 0)
        return -1;
    /* every path this machine runs, slowest first, the default last */
    PyObject *list = PyList_New(0), *paths = NULL;
    for (int i = 0; list && i <= CRC_NPATHS; i++) {
        int p = i < CRC_NPATHS ? i : crc_default();
        if (i < CRC_NPATHS && (!crc_has(i) || i == crc_default())) continue;
        PyObject *name = PyUnicode_FromString(crc_path_names[p]);
        if (!name || PyList_Append(list, name) < 0) Py_CLEAR(list);
        Py_XDECREF(name);
    }
    if (list) paths = PyList_AsTuple(list);
    Py_XDECREF(list);
    return paths ? PyModule_AddObject(m, "CRC_PATHS", paths) : -1;
}
