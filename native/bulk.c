/* SPDX-License-Identifier: Apache-2.0 */
/*
 * aiokv._index's bulk changes (a unit of that module: aiokv_index.c's PyInit adds them): the
 * loops that apply an operator's order (aiokv clear, pin, unpin: aiokv/store/bulk.py) to a
 * table's arrays a window of slots at a time, with no Python object per block.
 *
 * - select: the slots of a window holding a block the order is for;
 * - erase: blocks forgotten: each slot's hash entry removed (the same backward shift as
 *   index.h's probe_erase, so the hash stays as if they never were) and its columns
 *   zeroed;
 * - records: the FREE or FLAGS records that say so (sealed by records.c's seal).
 *
 * Threading contract: the caller's table is changed by one thread (table.py); the loops
 * release the GIL (a checkpoint on the store's I/O thread may read tag and atime meanwhile,
 * as it may while the owner changes them one by one).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int view(PyObject *o, Py_buffer *b, Py_ssize_t item, int writable, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (b->len % item) {
        PyErr_Format(PyExc_ValueError, "%s: not whole %zd-byte items", what, item);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static void release(Py_buffer *v, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&v[i]);
}

/* select(tag, atime, tenant, flags, lo, hi, tenants, below, fmask, fwant, out int64) -> (n, next):
 * the slots s in [lo, hi) in order with tag[s] != 0, tenants[tenant[s]] != 0 (an empty
 * `tenants`: every tenant; ids past its end: none), atime[s] < below (0: any) and
 * (flags[s] & fmask) == fwant, written to out until it is full; `next` is the first slot
 * not looked at (hi when the window was done). */
static PyObject *py_select(PyObject *mod, PyObject *args) {
    PyObject *o[5], *oo;
    Py_ssize_t lo, hi;
    unsigned long long below;
    int fmask, fwant;
    if (!PyArg_ParseTuple(args, "OOOOnnOKiiO", &o[0], &o[1], &o[2], &o[3], &lo, &hi, &o[4], &below, &fmask, &fwant,
                          &oo))
        return NULL;
    Py_buffer v[6];
    Py_ssize_t items[] = {8, 8, 2, 1, 1};
    int got = 0;
    for (; got < 5; got++)
        if (view(o[got], &v[got], items[got], 0, "select: a column") < 0) break;
    if (got < 5 || view(oo, &v[5], 8, 1, "select: out") < 0) {
        release(v, got);
        return NULL;
    }
    Py_ssize_t n = v[0].len / 8;
    if (v[1].len / 8 < n || v[2].len / 2 < n || v[3].len < n || lo < 0 || hi > n || lo > hi) {
        release(v, 6);
        PyErr_SetString(PyExc_ValueError, "select: columns shorter than the table, or a window outside it");
        return NULL;
    }
    const uint64_t *tag = v[0].buf, *at = v[1].buf;
    const uint16_t *ten = v[2].buf;
    const uint8_t *fl = v[3].buf, *want = v[4].buf;
    size_t nwant = (size_t)v[4].len, cap = (size_t)v[5].len / 8, k = 0;
    int64_t *out = v[5].buf;
    Py_ssize_t s = lo;
    Py_BEGIN_ALLOW_THREADS;
    for (; s < hi && k < cap; s++) {
        if (!tag[s] || (below && at[s] >= below) || (fl[s] & fmask) != fwant) continue;
        if (nwant && (ten[s] >= nwant || !want[ten[s]])) continue;
        out[k++] = s;
    }
    Py_END_ALLOW_THREADS;
    release(v, 6);
    return Py_BuildValue("nn", (Py_ssize_t)k, s);
}

/* erase(tag, atime, tenant, flags, hash, slots int64) -> how many held a block: each slot's
 * block forgotten (its hash entry removed, its columns zeroed); slots without one are left. */
static PyObject *py_erase(PyObject *mod, PyObject *args) {
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5])) return NULL;
    Py_buffer v[6];
    Py_ssize_t items[] = {8, 8, 2, 1, 4, 8};
    int got = 0;
    for (; got < 6; got++)
        if (view(o[got], &v[got], items[got], got < 5, "erase: a column") < 0) break;
    if (got < 6) {
        release(v, got);
        return NULL;
    }
    Py_ssize_t n = v[0].len / 8, size = v[4].len / 4;
    if (v[1].len / 8 < n || v[2].len / 2 < n || v[3].len < n || size < 1 || (size & (size - 1))) {
        release(v, 6);
        PyErr_SetString(PyExc_ValueError, "erase: columns shorter than the table, or a hash not a power of two");
        return NULL;
    }
    uint64_t *tag = v[0].buf, *at = v[1].buf, m = (uint64_t)size - 1;
    uint16_t *ten = v[2].buf;
    uint8_t *fl = v[3].buf;
    uint32_t *t = v[4].buf;
    const int64_t *slots = v[5].buf;
    size_t ns = (size_t)v[5].len / 8, done = 0;
    int bad = 0;
    for (size_t q = 0; q < ns; q++)
        if (slots[q] < 0 || slots[q] >= n) bad = 1;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS;
        for (size_t q = 0; q < ns; q++) {
            int64_t s = slots[q];
            if (!tag[s]) continue;
            uint64_t i = tag[s] & m;
            while (t[i] && (int64_t)t[i] - 1 != s) i = (i + 1) & m;
            if (t[i]) { /* backward shift: later members of the run into the gap where their home allows */
                uint64_t j = i;
                for (;;) {
                    j = (j + 1) & m;
                    uint32_t e = t[j];
                    if (!e) break;
                    uint64_t home = tag[e - 1] & m;
                    if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
                        t[i] = e;
                        i = j;
                    }
                }
                t[i] = 0;
            }
            tag[s] = 0;
            at[s] = 0;
            ten[s] = 0;
            fl[s] = 0;
            done++;
        }
        Py_END_ALLOW_THREADS;
    }
    release(v, 6);
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "erase: a slot outside the table");
        return NULL;
    }
    return PyLong_FromSize_t(done);
}

/* records(kind, klen, slots int64, tags uint64, flags uint8 (empty: 0), out) -> n: FREE or FLAGS
 * records (data/format/records.py's layout, REC_FIELDS: kind, key length, slot, the tag in the key's first 8
 * bytes, flags at byte 58; the rest zero) into out, n * 64 bytes; their CRCs are left to seal. */
static PyObject *py_records(PyObject *mod, PyObject *args) {
    int kind, klen;
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "iiOOOO", &kind, &klen, &o[0], &o[1], &o[2], &o[3])) return NULL;
    Py_buffer v[4];
    Py_ssize_t items[] = {8, 8, 1, 64};
    int got = 0;
    for (; got < 4; got++)
        if (view(o[got], &v[got], items[got], got == 3, "records: a column") < 0) break;
    if (got < 4) {
        release(v, got);
        return NULL;
    }
    size_t n = (size_t)v[0].len / 8;
    if ((size_t)v[1].len / 8 != n || (v[2].len && (size_t)v[2].len != n) || (size_t)v[3].len / 64 != n) {
        release(v, 4);
        PyErr_SetString(PyExc_ValueError, "records: columns of other lengths");
        return NULL;
    }
    const int64_t *slots = v[0].buf;
    const uint64_t *tags = v[1].buf;
    const uint8_t *fl = v[2].len ? v[2].buf : NULL;
    uint8_t *out = v[3].buf;
    Py_BEGIN_ALLOW_THREADS;
    memset(out, 0, n * 64);
    for (size_t i = 0; i < n; i++) {
        uint8_t *r = out + 64 * i;
        uint32_t s = (uint32_t)slots[i];
        r[0] = (uint8_t)kind;
        r[1] = (uint8_t)klen;
        memcpy(r + 4, &s, 4);
        memcpy(r + 16, &tags[i], 8);
        if (fl) r[58] = fl[i];
    }
    Py_END_ALLOW_THREADS;
    release(v, 4);
    return PyLong_FromSize_t(n);
}

static PyMethodDef bulk_methods[] = {
    {"records", py_records, METH_VARARGS,
     "records(kind, klen, slots, tags, flags, out) -> n: FREE or FLAGS records, unsealed (data/format/records.py)"},
    {"select", py_select, METH_VARARGS,
     "select(tag, atime, tenant, flags, lo, hi, tenants, below, fmask, fwant, out) -> (n, next): the slots of "
     "[lo, hi) an order is for"},
    {"erase", py_erase, METH_VARARGS,
     "erase(tag, atime, tenant, flags, hash, slots) -> n: blocks forgotten (hash entries removed, columns zeroed)"},
    {NULL}};

int bulk_add(PyObject *m) { return PyModule_AddFunctions(m, bulk_methods); }
