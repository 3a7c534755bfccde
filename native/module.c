/* SPDX-License-Identifier: Apache-2.0 */
/*
 * aiokv._native: a small CPython extension for what aiokv does in C. Its units
 * (native/aiokv.h lists them) each add their functions and constants here.
 *
 * Threading contract: nothing in the module is shared between threads but the
 * CRC tables crc_init fills before any call; a Ring belongs to one thread
 * (ring.c), and so does a Pool, whose own threads share only its core (pool.c). Calls over many bytes or that wait on the kernel release the GIL.
 */
#include "aiokv.h"

#include <fcntl.h>

/* fallocate(fd, mode, offset, length): Linux fallocate(2), GIL released. */
static PyObject *py_fallocate(PyObject *self, PyObject *args) {
    int fd, mode;
    long long off, len;
    if (!PyArg_ParseTuple(args, "iiLL", &fd, &mode, &off, &len)) return NULL;
    int ret;
    Py_BEGIN_ALLOW_THREADS
    ret = fallocate(fd, mode, (off_t)off, (off_t)len);
    Py_END_ALLOW_THREADS
    if (ret < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"fallocate", py_fallocate, METH_VARARGS, "fallocate(fd, mode, offset, length)"},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "aiokv._native",
                                       "io_uring ring, CRC32C, slot headers and block copies for aiokv", -1,
                                       module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (ring_add(m) < 0 || pool_add(m) < 0 || crc_add(m) < 0 || slots_add(m) < 0 || copies_add(m) < 0 ||
        PyModule_AddIntConstant(m, "FALLOC_FL_KEEP_SIZE", 0x01) < 0 ||
        PyModule_AddIntConstant(m, "FALLOC_FL_PUNCH_HOLE", 0x02) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
