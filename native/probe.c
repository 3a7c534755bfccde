/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index.Probe (a unit of aiokv._index: native/index.h): a table's open-addressing hash
 * of key tags to slots, bound to the table's numpy arrays (aiokv/store/table.py): lookups one
 * at a time or many, inserts, erases by backward shift, a bulk build in home order, and puts
 * in bulk (Table.put for many).
 *
 * Threading: a Probe is used by one thread at a time (the store's owner, or the thread that
 * builds a table before handing it over); bulk calls release the GIL.
 */
#include "index.h"

#include <stdlib.h>

static int Probe_init(Probe *self, PyObject *args, PyObject *kw) {
    PyObject *tags, *tab;
    if (!PyArg_ParseTuple(args, "OO", &tags, &tab)) return -1;
    if (self->bound) {
        PyBuffer_Release(&self->tags);
        PyBuffer_Release(&self->tab);
        self->bound = 0;
    }
    if (get_buf(tags, &self->tags, 8, "tags") < 0) return -1;
    if (get_buf(tab, &self->tab, 4, "table") < 0) {
        PyBuffer_Release(&self->tags);
        return -1;
    }
    Py_ssize_t size = self->tab.len / 4;
    if (size < 1 || (size & (size - 1))) {
        PyErr_SetString(PyExc_ValueError, "table: its size must be a power of two");
        PyBuffer_Release(&self->tags);
        PyBuffer_Release(&self->tab);
        return -1;
    }
    self->tag = self->tags.buf;
    self->t = self->tab.buf;
    self->mask = (uint64_t)size - 1;
    self->nslots = self->tags.len / 8;
    self->bound = 1;
    return 0;
}

static void Probe_dealloc(Probe *self) {
    if (self->bound) {
        PyBuffer_Release(&self->tags);
        PyBuffer_Release(&self->tab);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Probe_find(Probe *self, PyObject *key) {
    const uint8_t *k;
    Py_ssize_t n;
    if (key_arg(key, &k, &n) < 0) return NULL;
    return PyLong_FromLongLong(probe_find(self, key_tag(k, n)));
}

static PyObject *Probe_find_tag(Probe *self, PyObject *arg) {
    uint64_t h = PyLong_AsUnsignedLongLong(arg);
    if (h == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(probe_find(self, h));
}

static PyObject *Probe_insert(Probe *self, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (s < 0 || s >= self->nslots || s >= 0xffffffffLL) {
        PyErr_SetString(PyExc_IndexError, "slot out of range");
        return NULL;
    }
    uint64_t i = self->tag[s] & self->mask;
    while (self->t[i]) i = (i + 1) & self->mask;
    self->t[i] = (uint32_t)s + 1;
    Py_RETURN_NONE;
}

static PyObject *Probe_erase(Probe *self, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (s < 0 || s >= self->nslots) {
        PyErr_SetString(PyExc_IndexError, "slot out of range");
        return NULL;
    }
    return PyBool_FromLong(probe_erase(self, s));
}

/* build(slots): insert every slot of a uint64 array into an empty table, in the
 * order of their home positions (a counting sort by the home's top bits first),
 * so the writes sweep the table instead of landing at random. */
static PyObject *Probe_build(Probe *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (b.len % 8) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "slots: a uint64 array");
        return NULL;
    }
    const uint64_t *slots = b.buf;
    size_t n = (size_t)b.len / 8;
    for (size_t k = 0; k < n; k++)
        if (slots[k] >= (uint64_t)self->nslots || slots[k] >= 0xffffffffull) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_IndexError, "slot out of range");
            return NULL;
        }
    int bits = 0;
    while ((1ull << bits) <= self->mask) bits++;
    int pbits = bits < 16 ? bits : 16, shift = bits - pbits;
    size_t nparts = (size_t)1 << pbits;
    size_t *start = calloc(nparts + 1, sizeof(size_t));
    uint32_t *order = n ? malloc(n * sizeof(uint32_t)) : NULL;
    if (!start || (n && !order)) {
        free(start);
        free(order);
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS;
    uint64_t m = self->mask;
    for (size_t k = 0; k < n; k++) start[((self->tag[slots[k]] & m) >> shift) + 1]++;
    for (size_t q = 0; q < nparts; q++) start[q + 1] += start[q];
    for (size_t k = 0; k < n; k++) order[start[(self->tag[slots[k]] & m) >> shift]++] = (uint32_t)slots[k];
    for (size_t k = 0; k < n; k++) {
        uint32_t s = order[k];
        uint64_t i = self->tag[s] & m;
        while (self->t[i]) i = (i + 1) & m;
        self->t[i] = s + 1;
    }
    Py_END_ALLOW_THREADS;
    free(start);
    free(order);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* find_many(tags, out): out[i] = the slot of tags[i] (int64) or -1. */
static PyObject *Probe_find_many(Probe *self, PyObject *args) {
    PyObject *ti, *to;
    if (!PyArg_ParseTuple(args, "OO", &ti, &to)) return NULL;
    Py_buffer a, o;
    if (PyObject_GetBuffer(ti, &a, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (get_buf(to, &o, 8, "out") < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    if (a.len / 8 != o.len / 8) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "tags and out differ in length");
        return NULL;
    }
    const uint64_t *t = a.buf;
    int64_t *out = o.buf;
    size_t n = (size_t)a.len / 8;
    Py_BEGIN_ALLOW_THREADS;
    for (size_t k = 0; k < n; k++) out[k] = probe_find(self, t[k]);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&a);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* put_many(slots, tags, ats, atimes) -> count change: each block (tags[i] in slots[i], last
 * used ats[i]) into the table, as Table.put does one: the tag leaves any other slot, the
 * slot's former block is gone. `atimes` is the table's atime array; the caller has made
 * the arrays cover every slot and the hash room for every tag. */
static PyObject *Probe_put_many(Probe *self, PyObject *args) {
    PyObject *so, *to, *ao, *dst;
    if (!PyArg_ParseTuple(args, "OOOO", &so, &to, &ao, &dst)) return NULL;
    Py_buffer sb, tb, ab, db;
    if (PyObject_GetBuffer(so, &sb, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(to, &tb, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    if (PyObject_GetBuffer(ao, &ab, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&sb);
        PyBuffer_Release(&tb);
        return NULL;
    }
    if (get_buf(dst, &db, 8, "atimes") < 0) {
        PyBuffer_Release(&sb);
        PyBuffer_Release(&tb);
        PyBuffer_Release(&ab);
        return NULL;
    }
    size_t n = (size_t)sb.len / 8;
    const uint64_t *slots = sb.buf, *tags = tb.buf, *ats = ab.buf;
    uint64_t *atime = db.buf;
    int ok = (size_t)tb.len / 8 == n && (size_t)ab.len / 8 == n && db.len / 8 >= self->nslots;
    for (size_t i = 0; ok && i < n; i++)
        if (slots[i] >= (uint64_t)self->nslots || !tags[i]) ok = 0;
    Py_ssize_t delta = 0;
    if (ok)
        for (size_t i = 0; i < n; i++) {
            uint64_t h = tags[i], s = slots[i];
            int64_t old = probe_find(self, h);
            if (old == (int64_t)s) {
                atime[s] = ats[i];
                continue;
            }
            if (old >= 0) {
                probe_erase(self, old);
                self->tag[old] = 0;
                atime[old] = 0;
                delta--;
            }
            if (self->tag[s]) {
                probe_erase(self, (Py_ssize_t)s);
                delta--;
            }
            self->tag[s] = h;
            atime[s] = ats[i];
            uint64_t j = h & self->mask;
            while (self->t[j]) j = (j + 1) & self->mask;
            self->t[j] = (uint32_t)s + 1;
            delta++;
        }
    PyBuffer_Release(&sb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&db);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "put_many: a slot out of range, a zero tag or columns of other lengths");
        return NULL;
    }
    return PyLong_FromSsize_t(delta);
}

static PyMethodDef Probe_methods[] = {
    {"find", (PyCFunction)Probe_find, METH_O, "find(key) -> slot, or -1"},
    {"find_tag", (PyCFunction)Probe_find_tag, METH_O, "find_tag(tag) -> slot, or -1"},
    {"insert", (PyCFunction)Probe_insert, METH_O, "insert(slot): its tag (tags[slot]) into the table"},
    {"erase", (PyCFunction)Probe_erase, METH_O, "erase(slot) -> whether it was in the table (tags[slot] intact)"},
    {"build", (PyCFunction)Probe_build, METH_O, "build(slots uint64 array): insert them all into an empty table"},
    {"find_many", (PyCFunction)Probe_find_many, METH_VARARGS, "find_many(tags, out int64): slot or -1 each"},
    {"put_many", (PyCFunction)Probe_put_many, METH_VARARGS, "put_many(slots, tags, ats, atimes) -> count change"},
    {NULL}};

PyTypeObject ProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aiokv._index.Probe",
    .tp_basicsize = sizeof(Probe),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Probe(tags uint64[slots], table uint32[2**k]): lookups, inserts and erases on them",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Probe_init,
    .tp_dealloc = (destructor)Probe_dealloc,
    .tp_methods = Probe_methods,
};


/* Probe into the module (aiokv_index.c's init) */
int probe_add(PyObject *m) {
    if (PyType_Ready(&ProbeType) < 0) return -1;
    Py_INCREF(&ProbeType);
    if (PyModule_AddObject(m, "Probe", (PyObject *)&ProbeType) < 0) {
        Py_DECREF(&ProbeType);
        return -1;
    }
    return 0;
}
