/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index's holds (a unit of aiokv._index: native/index.h): the keys loads hold, counted
 * in bulk for a scheduler call's keys (aiokv/store/loadpins.py), one C loop, no Python per key.
 * The counts are the store's own dicts, changed as a loop over the keys in Python changed them:
 * `pins`, (nsid, key) -> how many loads hold it (Index.pins), and `tags`, a namespace's key tag
 * -> how many holds its keys have (Namespace.pinned_tags: Index.victim passes over our blocks of
 * those tags). A count that would reach 0 leaves its dict.
 *
 * Threading: the owner's (the Store's thread), under the GIL: the dicts are Python objects.
 */
#include "index.h"

/* d[k]'s count, 0 if absent; -1 with an error set */
static long count_of(PyObject *d, PyObject *k, int *present) {
    PyObject *v = PyDict_GetItemWithError(d, k);
    *present = v != NULL;
    if (!v) return PyErr_Occurred() ? -1 : 0;
    long c = PyLong_AsLong(v);
    return c == -1 && PyErr_Occurred() ? -1 : c;
}

static int set_count(PyObject *d, PyObject *k, long c) {
    PyObject *v = PyLong_FromLong(c);
    if (!v) return -1;
    int r = PyDict_SetItem(d, k, v);
    Py_DECREF(v);
    return r;
}

/* one more hold of key (nsid, k), of tag t: pins[(nsid, k)] += 1, tags[t] += 1 */
static int hold1(PyObject *pins, PyObject *tags, PyObject *pk, PyObject *t) {
    int present;
    long c = count_of(pins, pk, &present);
    if ((c == -1 && PyErr_Occurred()) || set_count(pins, pk, c + 1) < 0) return -1;
    c = count_of(tags, t, &present);
    return (c == -1 && PyErr_Occurred()) || set_count(tags, t, c + 1) < 0 ? -1 : 0;
}

/* one hold fewer, if any: 1 if it was the key's last, 0 if not (or none was held), -1 error */
static int release1(PyObject *pins, PyObject *tags, PyObject *pk, PyObject *t) {
    int present;
    long c = count_of(pins, pk, &present);
    if (c == -1 && PyErr_Occurred()) return -1;
    if (!present) return 0;
    int last = c <= 1;
    if (last ? PyDict_DelItem(pins, pk) < 0 : set_count(pins, pk, c - 1) < 0) return -1;
    if (c == 0) return 0; /* (a count of 0 held nothing) */
    long tc = count_of(tags, t, &present);
    if (tc == -1 && PyErr_Occurred()) return -1;
    if (tc > 1) return set_count(tags, t, tc - 1) < 0 ? -1 : last;
    return present && PyDict_DelItem(tags, t) < 0 ? -1 : last;
}

/* the args both calls share: pins, tags (dicts), nsid, keys (a sequence of bytes) */
static int dicts_arg(PyObject *pins, PyObject *tags, PyObject *keys, PyObject **kf) {
    if (!PyDict_Check(pins) || !PyDict_Check(tags)) {
        PyErr_SetString(PyExc_TypeError, "pins and tags: dicts");
        return -1;
    }
    *kf = PySequence_Fast(keys, "keys: a sequence of bytes");
    return *kf ? 0 : -1;
}

/* key i's (nsid, key) and tag, new references; -1 with an error set */
static int key_pair(PyObject *nsid, PyObject *key, PyObject **pk, PyObject **t) {
    const uint8_t *k;
    Py_ssize_t kl;
    if (key_arg(key, &k, &kl) < 0) return -1;
    *pk = PyTuple_Pack(2, nsid, key);
    *t = *pk ? PyLong_FromUnsignedLongLong(key_tag(k, kl)) : NULL;
    if (*t) return 0;
    Py_XDECREF(*pk);
    return -1;
}

/* hold(pins, tags, nsid, keys, where int64): a hold more of each key whose where[i] >= 0 */
static PyObject *py_hold(PyObject *mod, PyObject *args) {
    PyObject *pins, *tags, *nsid, *keys, *wo, *kf;
    if (!PyArg_ParseTuple(args, "OOOOO", &pins, &tags, &nsid, &keys, &wo)) return NULL;
    if (dicts_arg(pins, tags, keys, &kf) < 0) return NULL;
    Py_buffer w;
    if (get_buf(wo, &w, 8, "where") < 0) {
        Py_DECREF(kf);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    const int64_t *where = w.buf;
    if (w.len / 8 != n) PyErr_SetString(PyExc_ValueError, "hold: keys and where differ in length");
    for (Py_ssize_t i = 0; i < n && !PyErr_Occurred(); i++) {
        PyObject *pk, *t;
        if (where[i] < 0 || key_pair(nsid, PySequence_Fast_GET_ITEM(kf, i), &pk, &t) < 0) continue;
        hold1(pins, tags, pk, t);
        Py_DECREF(pk);
        Py_DECREF(t);
    }
    PyBuffer_Release(&w);
    Py_DECREF(kf);
    return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

/* release(pins, tags, nsid, keys, dropped) -> [key]: a hold fewer of each key (none held: no
 * change); the keys whose last hold went that `dropped` (a dict by (nsid, key)) names, in order */
static PyObject *py_release(PyObject *mod, PyObject *args) {
    PyObject *pins, *tags, *nsid, *keys, *dropped, *kf;
    if (!PyArg_ParseTuple(args, "OOOOO!", &pins, &tags, &nsid, &keys, &PyDict_Type, &dropped)) return NULL;
    if (dicts_arg(pins, tags, keys, &kf) < 0) return NULL;
    PyObject *gone = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    for (Py_ssize_t i = 0; gone && i < n; i++) {
        PyObject *pk, *t, *key = PySequence_Fast_GET_ITEM(kf, i);
        if (key_pair(nsid, key, &pk, &t) < 0) {
            Py_CLEAR(gone);
            break;
        }
        int last = release1(pins, tags, pk, t);
        int named = last == 1 && PyDict_GET_SIZE(dropped) ? PyDict_Contains(dropped, pk) : 0;
        if (last < 0 || named < 0 || (named && PyList_Append(gone, key) < 0)) Py_CLEAR(gone);
        Py_DECREF(pk);
        Py_DECREF(t);
    }
    Py_DECREF(kf);
    return gone;
}

static PyMethodDef holds_methods[] = {
    {"hold", py_hold, METH_VARARGS, "hold(pins, tags, nsid, keys, where int64): one hold more of each key held (where >= 0)"},
    {"release", py_release, METH_VARARGS,
     "release(pins, tags, nsid, keys, dropped) -> the keys whose last hold went that dropped names"},
    {NULL}};

int holds_add(PyObject *m) { return PyModule_AddFunctions(m, holds_methods); }
