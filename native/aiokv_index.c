/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index: the hot loops of the store's compact index (aiokv/store/table.py).
 *
 * A table of one engine's blocks of one namespace keeps, per slot, the 64-bit
 * tag of the key stored there (0: none) in a numpy array, and an open-addressing
 * hash of tags to slots: a uint32 array of a power-of-two size holding slot + 1
 * (0: empty), linear probing, deletion by backward shift (no tombstones). The
 * arrays are numpy's (allocated, grown, saved and loaded by table.py); a Probe
 * holds their buffers and runs the lookups, inserts and erases on them.
 *
 * The tag of a key (tag()) is a 64-bit mix of its bytes and length, never 0.
 * Checkpoint records and index images carry it (docs/format.md), so it is part of
 * the format: changing it means a new version of those files. Two keys with one
 * tag are one block to the index: the reader's slot-header check (which compares
 * the whole key) makes that a miss, never a wrong block (key_tag: native/index.h).
 *
 * The module's units (native/index.h lists them) each add their part here; this one holds
 * the key tags, the lookups over several probes (one key, a run, many at once) and the victims
 * found by age.
 *
 * Threading: a Probe is used by one thread at a time (the store's owner, or the
 * thread that builds a table before handing it over); bulk calls release the GIL.
 */
#include "index.h"

int get_buf(PyObject *o, Py_buffer *b, Py_ssize_t item, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (b->len % item) {
        PyErr_Format(PyExc_ValueError, "%s: not whole %zd-byte items", what, item);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

int key_arg(PyObject *key, const uint8_t **k, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "a key is bytes");
        return -1;
    }
    *k = (const uint8_t *)PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
}

/* tags(keys) -> bytes of their uint64 tags */
static PyObject *py_tags(PyObject *mod, PyObject *keys) {
    PyObject *kf = PySequence_Fast(keys, "keys: a sequence of bytes");
    if (!kf) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out) {
        Py_DECREF(kf);
        return NULL;
    }
    uint64_t *o = (uint64_t *)PyBytes_AS_STRING(out);
    PyObject **ks = PySequence_Fast_ITEMS(kf);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *k;
        Py_ssize_t kl;
        if (key_arg(ks[i], &k, &kl) < 0) {
            Py_DECREF(kf);
            Py_DECREF(out);
            return NULL;
        }
        o[i] = key_tag(k, kl);
    }
    Py_DECREF(kf);
    return out;
}

/* ---- module functions ---- */
static int probes_arg(PyObject *probes, PyObject **fast) {
    *fast = PySequence_Fast(probes, "probes: a sequence of Probe");
    if (!*fast) return -1;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(*fast);
    for (Py_ssize_t j = 0; j < np; j++)
        if (!PyObject_TypeCheck(PySequence_Fast_GET_ITEM(*fast, j), &ProbeType)) {
            Py_DECREF(*fast);
            PyErr_SetString(PyExc_TypeError, "probes: a sequence of Probe");
            return -1;
        }
    return 0;
}

/* run(probes, keys, limit) -> how many keys from the first are in any probe's table */
static PyObject *py_run(PyObject *mod, PyObject *args) {
    PyObject *probes, *keys;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOn", &probes, &keys, &limit)) return NULL;
    PyObject *pf, *kf = PySequence_Fast(keys, "keys: a sequence of bytes");
    if (!kf) return NULL;
    if (probes_arg(probes, &pf) < 0) {
        Py_DECREF(kf);
        return NULL;
    }
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(kf), np = PySequence_Fast_GET_SIZE(pf), n = 0;
    if (limit < 0 || limit > nk) limit = nk;
    PyObject **ks = PySequence_Fast_ITEMS(kf), **ps = PySequence_Fast_ITEMS(pf);
    for (; n < limit; n++) {
        const uint8_t *k;
        Py_ssize_t kl;
        if (key_arg(ks[n], &k, &kl) < 0) {
            Py_DECREF(kf);
            Py_DECREF(pf);
            return NULL;
        }
        uint64_t h = key_tag(k, kl);
        Py_ssize_t j = 0;
        while (j < np && probe_find((Probe *)ps[j], h) < 0) j++;
        if (j == np) break;
    }
    Py_DECREF(kf);
    Py_DECREF(pf);
    return PyLong_FromSsize_t(n);
}

/* locate(probes, key) -> (index of the first probe holding it, slot), or None */
static PyObject *py_locate(PyObject *mod, PyObject *args) {
    PyObject *probes, *key;
    if (!PyArg_ParseTuple(args, "OO", &probes, &key)) return NULL;
    const uint8_t *k;
    Py_ssize_t kl;
    if (key_arg(key, &k, &kl) < 0) return NULL;
    PyObject *pf;
    if (probes_arg(probes, &pf) < 0) return NULL;
    uint64_t h = key_tag(k, kl);
    Py_ssize_t np = PySequence_Fast_GET_SIZE(pf);
    PyObject **ps = PySequence_Fast_ITEMS(pf);
    for (Py_ssize_t j = 0; j < np; j++) {
        int64_t s = probe_find((Probe *)ps[j], h);
        if (s >= 0) {
            Py_DECREF(pf);
            return Py_BuildValue("nL", j, (long long)s);
        }
    }
    Py_DECREF(pf);
    Py_RETURN_NONE;
}

/* locate_all(probes, keys, out int64[, slots int64]) -> how many keys any probe holds; out[i] =
 * the index of the first probe holding keys[i] (as locate answers), -1: none; slots[i] (where
 * given) its slot there, -1: none. A key that is not bytes is held by none (as Namespace.has
 * answers). One pass for a scheduler call's keys. */
static PyObject *py_locate_all(PyObject *mod, PyObject *args) {
    PyObject *probes, *keys, *oo, *so = NULL;
    if (!PyArg_ParseTuple(args, "OOO|O", &probes, &keys, &oo, &so)) return NULL;
    PyObject *pf, *kf = PySequence_Fast(keys, "keys: a sequence of bytes");
    if (!kf) return NULL;
    Py_buffer o, sb = {0};
    if (get_buf(oo, &o, 8, "out") < 0) {
        Py_DECREF(kf);
        return NULL;
    }
    if (so && get_buf(so, &sb, 8, "slots") < 0) {
        PyBuffer_Release(&o);
        Py_DECREF(kf);
        return NULL;
    }
    Py_ssize_t nk = PySequence_Fast_GET_SIZE(kf), hits = 0;
    if (o.len / 8 != nk || (so && sb.len / 8 != nk)) {
        PyErr_SetString(PyExc_ValueError, "keys and out differ in length");
    } else if (probes_arg(probes, &pf) == 0) {
        Py_ssize_t np = PySequence_Fast_GET_SIZE(pf);
        PyObject **ks = PySequence_Fast_ITEMS(kf), **ps = PySequence_Fast_ITEMS(pf);
        int64_t *out = o.buf, *slot = so ? sb.buf : NULL, s = -1;
        for (Py_ssize_t i = 0; i < nk; i++) {
            Py_ssize_t j = np;
            if (PyBytes_Check(ks[i])) {
                uint64_t h = key_tag((const uint8_t *)PyBytes_AS_STRING(ks[i]), PyBytes_GET_SIZE(ks[i]));
                for (j = 0; j < np && (s = probe_find((Probe *)ps[j], h)) < 0;) j++;
            }
            out[i] = j < np ? (int64_t)j : -1;
            if (slot) slot[i] = j < np ? s : -1;
            hits += j < np;
        }
        Py_DECREF(pf);
    }
    PyBuffer_Release(&o);
    if (so) PyBuffer_Release(&sb);
    Py_DECREF(kf);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(hits);
}

static PyObject *py_tag(PyObject *mod, PyObject *key) {
    const uint8_t *k;
    Py_ssize_t n;
    if (key_arg(key, &k, &n) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(key_tag(k, n));
}

/* older(tags, atimes, thr, out int64) -> how many slots hold a block (tag != 0) last used
 * at or before thr, their numbers written to out in order; -1 if out is too short. One pass,
 * no temporaries: the eviction order's batch of victims (table.py). */
static PyObject *py_older(PyObject *mod, PyObject *args) {
    PyObject *to, *ao, *oo;
    unsigned long long thr;
    if (!PyArg_ParseTuple(args, "OOKO", &to, &ao, &thr, &oo)) return NULL;
    Py_buffer t, a, o;
    if (PyObject_GetBuffer(to, &t, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(ao, &a, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&t);
        return NULL;
    }
    if (get_buf(oo, &o, 8, "out") < 0) {
        PyBuffer_Release(&t);
        PyBuffer_Release(&a);
        return NULL;
    }
    size_t n = (size_t)t.len / 8, cap = (size_t)o.len / 8, k = 0;
    if ((size_t)a.len / 8 < n) n = (size_t)a.len / 8;
    const uint64_t *tags = t.buf, *at = a.buf;
    int64_t *out = o.buf;
    int over = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (size_t s = 0; s < n; s++)
        if (tags[s] && at[s] <= thr) {
            if (k == cap) {
                over = 1;
                break;
            }
            out[k++] = (int64_t)s;
        }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&t);
    PyBuffer_Release(&a);
    PyBuffer_Release(&o);
    return PyLong_FromSsize_t(over ? -1 : (Py_ssize_t)k);
}

/* older_of(tags, atimes, tenants, flags, excluded, thr, out int64) -> older()'s answer over
 * the blocks that may be evicted: not pinned (flags bit 0) and of a tenant t that `excluded`
 * (uint8 per tenant id; ids past its end: not excluded) leaves out (excluded[t] == 0). */
static PyObject *py_older_of(PyObject *mod, PyObject *args) {
    PyObject *to, *ao, *tno, *fo, *xo, *oo;
    unsigned long long thr;
    if (!PyArg_ParseTuple(args, "OOOOOKO", &to, &ao, &tno, &fo, &xo, &thr, &oo)) return NULL;
    PyObject *objs[] = {to, ao, tno, fo, xo};
    Py_buffer v[5], o;
    int got = 0;
    for (; got < 5; got++)
        if (PyObject_GetBuffer(objs[got], &v[got], PyBUF_C_CONTIGUOUS) < 0) break;
    if (got < 5 || get_buf(oo, &o, 8, "out") < 0) {
        for (int j = 0; j < got; j++) PyBuffer_Release(&v[j]);
        return NULL;
    }
    size_t n = (size_t)v[0].len / 8, cap = (size_t)o.len / 8, k = 0, nx = (size_t)v[4].len;
    if ((size_t)v[1].len / 8 < n) n = (size_t)v[1].len / 8;
    if ((size_t)v[2].len / 2 < n) n = (size_t)v[2].len / 2;
    if ((size_t)v[3].len < n) n = (size_t)v[3].len;
    const uint64_t *tags = v[0].buf, *at = v[1].buf;
    const uint16_t *ten = v[2].buf;
    const uint8_t *fl = v[3].buf, *ex = v[4].buf;
    int64_t *out = o.buf;
    int over = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (size_t s = 0; s < n; s++)
        if (tags[s] && at[s] <= thr && !(fl[s] & 1) && (ten[s] >= nx || !ex[ten[s]])) {
            if (k == cap) {
                over = 1;
                break;
            }
            out[k++] = (int64_t)s;
        }
    Py_END_ALLOW_THREADS;
    for (int j = 0; j < 5; j++) PyBuffer_Release(&v[j]);
    PyBuffer_Release(&o);
    return PyLong_FromSsize_t(over ? -1 : (Py_ssize_t)k);
}

static PyMethodDef module_methods[] = {
    {"older_of", py_older_of, METH_VARARGS,
     "older_of(tags, atimes, tenants, flags, excluded, thr, out) -> unpinned slots of tenants not excluded, "
     "used at or before thr (-1: out short)"},
    {"tag", py_tag, METH_O, "tag(key) -> the key's 64-bit tag (never 0)"},
    {"tags", py_tags, METH_O, "tags(keys) -> bytes of their uint64 tags"},
    {"run", py_run, METH_VARARGS, "run(probes, keys, limit) -> keys from the first found in any probe"},
    {"locate", py_locate, METH_VARARGS, "locate(probes, key) -> (probe index, slot) or None"},
    {"locate_all", py_locate_all, METH_VARARGS,
     "locate_all(probes, keys, out int64[, slots int64]) -> keys held; out[i]: the first probe holding keys[i] "
     "(slots[i]: its slot there), -1: none"},
    {"older", py_older, METH_VARARGS, "older(tags, atimes, thr, out) -> slots used at or before thr (-1: out short)"},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "aiokv._index",
                                       "the compact index's hot loops (aiokv/store/table.py)", -1, module_methods};

PyMODINIT_FUNC PyInit__index(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (records_add(m) < 0 || probe_add(m) < 0 || apply_add(m) < 0 || aiokv_order_register(m) < 0 || bulk_add(m) < 0 ||
        holds_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
