/* SPDX-License-Identifier: Apache-2.0 */
/*
 * I/O operations: parsed from Python, and the merge rule (ops.h).
 *
 * Threading contract: op_parse runs with the GIL held; op_run touches only its arguments
 * (a pool thread calls it under the pool's mutex).
 */
#include "ops.h"

int op_parse(PyObject *item, io_op *o) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
        PyErr_SetString(PyExc_TypeError, "an operation is a tuple (op, fd, addr, length, offset)");
        return -1;
    }
    /* ints only: PyLong_AsLong would call an __index__, Python code that could close the
     * Ring or Pool parsing into its own memory */
    for (Py_ssize_t k = 0; k < 5; k++)
        if (!PyLong_Check(PyTuple_GET_ITEM(item, k))) {
            PyErr_SetString(PyExc_TypeError, "an operation's fields are ints");
            return -1;
        }
    long op, fd;
    unsigned long long len;
    if (((op = PyLong_AsLong(PyTuple_GET_ITEM(item, 0))) == -1 && PyErr_Occurred()) ||
        ((fd = PyLong_AsLong(PyTuple_GET_ITEM(item, 1))) == -1 && PyErr_Occurred()) ||
        ((o->addr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 2))) == (uint64_t)-1 && PyErr_Occurred()) ||
        ((len = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 3))) == (uint64_t)-1 && PyErr_Occurred()) ||
        ((o->off = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 4))) == (uint64_t)-1 && PyErr_Occurred()))
        return -1;
    if (op < OP_READ || op > OP_NOP || fd < INT32_MIN || fd > INT32_MAX || len > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "bad operation (op %ld, fd %ld, length %llu)", op, fd, len);
        return -1;
    }
    o->op = (uint8_t)op;
    o->fd = (int32_t)fd;
    o->len = (uint32_t)len;
    o->span = 1;
    return 0;
}

uint32_t op_run(const io_op *ops, uint32_t n, uint32_t i, unsigned merge_bytes) {
    const io_op *o = &ops[i];
    if (o->op != OP_WRITE || merge_bytes <= o->len) return 1;
    uint64_t bytes = o->len;
    uint32_t j = i + 1;
    for (; j < n && j - i < MERGE_MAX_OPS; j++) {
        const io_op *p = &ops[j - 1], *q = &ops[j];
        if (q->op != OP_WRITE || q->fd != o->fd || q->off != p->off + p->len || bytes + q->len > merge_bytes) break;
        bytes += q->len;
    }
    return j - i;
}
