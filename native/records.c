/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index's journal records (a unit of aiokv._index: native/index.h): COMMIT records made
 * for many keys, a buffer's leading valid records counted, records sealed with their CRC, and the
 * tags of their keys (aiokv/store/journal.py, docs/format.md). A record's CRC is CRC32C from a
 * zero seed over all but its last 4 bytes (record_crc), by native/crc32c.c, the one aiokv._native
 * checks slots with.
 *
 * Threading: crc_init runs once in the module's init (records_add), before any call; every call
 * works on the caller's buffers only, and the loops over many records release the GIL.
 */
#include "crc32c.h"
#include "index.h"

/* a record's CRC32C: over its first n bytes, from a zero seed */
static inline uint32_t record_crc(const uint8_t *p, size_t n) { return crc32c(0, p, n); }

/* commit_records(keys, slots, atime, tenant=0, flags=0, kind=1) -> bytes: a COMMIT record per
 * key (format.pack_record), each naming the tenant (bytes 56..57) and flags (byte 58); another
 * kind's records where kind says (3: TOUCH, with slot 0, tenant 0, flags 0: loadpins.py) */
static PyObject *py_commit_records(PyObject *mod, PyObject *args) {
    PyObject *keys, *slots;
    unsigned long long at;
    unsigned short tenant = 0;
    unsigned char flags = 0, kind = 1;
    if (!PyArg_ParseTuple(args, "OOK|Hbb", &keys, &slots, &at, &tenant, &flags, &kind)) return NULL;
    PyObject *kf = PySequence_Fast(keys, "keys: a sequence of bytes");
    if (!kf) return NULL;
    PyObject *sf = PySequence_Fast(slots, "slots: a sequence of int");
    if (!sf) {
        Py_DECREF(kf);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    if (PySequence_Fast_GET_SIZE(sf) != n) {
        Py_DECREF(kf);
        Py_DECREF(sf);
        PyErr_SetString(PyExc_ValueError, "commit_records: as many slots as keys");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 64);
    if (!out) {
        Py_DECREF(kf);
        Py_DECREF(sf);
        return NULL;
    }
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(out);
    memset(o, 0, (size_t)n * 64);
    for (Py_ssize_t i = 0; i < n; i++, o += 64) {
        const uint8_t *k;
        Py_ssize_t kl;
        unsigned long long s = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(sf, i));
        if ((s == (unsigned long long)-1 && PyErr_Occurred()) || key_arg(PySequence_Fast_GET_ITEM(kf, i), &k, &kl) < 0 ||
            kl < 16 || kl > 32 || s > 0xffffffffull) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "commit_records: a key of 16-32 bytes, a 32-bit slot");
            Py_DECREF(kf);
            Py_DECREF(sf);
            Py_DECREF(out);
            return NULL;
        }
        uint32_t s32 = (uint32_t)s;
        uint64_t a = at;
        o[0] = kind;
        o[1] = (uint8_t)kl;
        memcpy(o + 4, &s32, 4);
        memcpy(o + 8, &a, 8);
        memcpy(o + 16, k, (size_t)kl);
        memcpy(o + 56, &tenant, 2);
        o[58] = flags;
        uint32_t c = record_crc(o, 60);
        memcpy(o + 60, &c, 4);
    }
    Py_DECREF(kf);
    Py_DECREF(sf);
    return out;
}

/* record_tags(records, recbytes, klen_at, key_at, out uint64): the tag of the key
 * (key_at, klen_at's byte long) of each fixed-size record */
static PyObject *py_record_tags(PyObject *mod, PyObject *args) {
    PyObject *ri, *to;
    Py_ssize_t rb, kla, ka;
    if (!PyArg_ParseTuple(args, "OnnnO", &ri, &rb, &kla, &ka, &to)) return NULL;
    Py_buffer r, o;
    if (PyObject_GetBuffer(ri, &r, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (get_buf(to, &o, 8, "out") < 0) {
        PyBuffer_Release(&r);
        return NULL;
    }
    size_t n = rb > 0 ? (size_t)(r.len / rb) : 0;
    if (rb <= 0 || kla < 0 || kla >= rb || ka < 0 || ka + 32 > rb || (size_t)(o.len / 8) != n) {
        PyBuffer_Release(&r);
        PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "record_tags: bad layout or out length");
        return NULL;
    }
    const uint8_t *p = r.buf;
    uint64_t *out = o.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (size_t k = 0; k < n; k++, p += rb) {
        Py_ssize_t kl = p[kla] > 32 ? 32 : p[kla];
        out[k] = key_tag(p + ka, kl);
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&r);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* records_valid(buf, recbytes, kinds bytes, klens bytes) -> how many records from
 * the first have a CRC32C (the last 4 bytes, little-endian, over the bytes before)
 * that matches, a kind byte (offset 0) in `kinds` and a key length byte (offset 1)
 * that klens[kind] allows: klens is 2 bytes a kind, (lowest, highest). */
static PyObject *py_records_valid(PyObject *mod, PyObject *args) {
    Py_buffer r;
    Py_ssize_t rb;
    const char *kinds, *lens;
    Py_ssize_t nkinds, nlens;
    if (!PyArg_ParseTuple(args, "y*ny#y#", &r, &rb, &kinds, &nkinds, &lens, &nlens)) return NULL;
    if (rb < 8 || nlens != 2 * nkinds) {
        PyBuffer_Release(&r);
        PyErr_SetString(PyExc_ValueError, "records_valid: bad record size or kinds");
        return NULL;
    }
    size_t n = (size_t)(r.len / rb), k = 0;
    const uint8_t *p = r.buf;
    Py_BEGIN_ALLOW_THREADS;
    for (; k < n; k++, p += rb) {
        uint32_t want;
        memcpy(&want, p + rb - 4, 4);
        if (record_crc(p, (size_t)rb - 4) != want) break;
        Py_ssize_t j = 0;
        while (j < nkinds && (uint8_t)kinds[j] != p[0]) j++;
        if (j == nkinds || p[1] < (uint8_t)lens[2 * j] || p[1] > (uint8_t)lens[2 * j + 1]) break;
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&r);
    return PyLong_FromSize_t(k);
}

/* seal(records, recbytes): each record's CRC32C (over all but its last 4 bytes) into those 4 */
static PyObject *py_seal(PyObject *mod, PyObject *args) {
    PyObject *ro;
    Py_ssize_t rb;
    if (!PyArg_ParseTuple(args, "On", &ro, &rb)) return NULL;
    Py_buffer r;
    if (get_buf(ro, &r, rb > 4 ? rb : 1, "records") < 0) return NULL;
    if (rb <= 4) {
        PyBuffer_Release(&r);
        PyErr_SetString(PyExc_ValueError, "seal: records of more than 4 bytes");
        return NULL;
    }
    uint8_t *q = r.buf;
    size_t n = (size_t)(r.len / rb);
    Py_BEGIN_ALLOW_THREADS;
    for (size_t i = 0; i < n; i++, q += rb) {
        uint32_t c = record_crc(q, (size_t)rb - 4);
        memcpy(q + rb - 4, &c, 4);
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&r);
    Py_RETURN_NONE;
}

static PyMethodDef records_methods[] = {
    {"commit_records", py_commit_records, METH_VARARGS, "commit_records(keys, slots, atime, tenant=0, flags=0, kind=1) -> COMMIT (kind) records"},
    {"record_tags", py_record_tags, METH_VARARGS, "record_tags(records, recbytes, klen_at, key_at, out)"},
    {"records_valid", py_records_valid, METH_VARARGS, "records_valid(buf, recbytes, kinds, klens) -> count"},
    {"seal", py_seal, METH_VARARGS, "seal(records, recbytes): each record's CRC32C into its last 4 bytes"},
    {NULL}};

/* CRC32C's paths (crc_init: the fastest this machine runs), then the functions into the module */
int records_add(PyObject *m) {
    crc_init();
    return PyModule_AddFunctions(m, records_methods);
}
