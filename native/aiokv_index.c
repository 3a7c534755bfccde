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
 * the whole key) makes that a miss, never a wrong block.
 *
 * Threading: a Probe is used by one thread at a time (the store's owner, or the
 * thread that builds a table before handing it over); bulk calls release the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MUL1 0x9e3779b97f4a7c15ull /* the golden ratio's fraction, odd */
#define MUL2 0x6a09e667f3bcc909ull /* sqrt(2)'s fraction, made odd */

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 31;
    x *= MUL1;
    x ^= x >> 29;
    x *= MUL2;
    x ^= x >> 32;
    return x;
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint64_t key_tag(const uint8_t *k, Py_ssize_t n) {
    uint64_t h = mix(MUL2 ^ (uint64_t)n);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) h = mix(h ^ load64(k + i));
    if (i < n) {
        uint8_t tail[8] = {0};
        memcpy(tail, k + i, (size_t)(n - i));
        h = mix(h ^ load64(tail));
    }
    return h ? h : 1;
}

/* ---- CRC32C of journal records (the Castagnoli polynomial, reflected) ---- */
static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int j = 0; j < 8; j++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
        crc_table[i] = c;
    }
}

static uint32_t crc_sw(const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    while (n--) c = (c >> 8) ^ crc_table[(c ^ *p++) & 0xff];
    return ~c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(const uint8_t *p, size_t n) {
    uint64_t c = 0xffffffffu;
    for (; n >= 8; p += 8, n -= 8) c = __builtin_ia32_crc32di(c, load64(p));
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return ~c32;
}
static int have_sse42;
#endif

static uint32_t crc32c(const uint8_t *p, size_t n) {
#if defined(__x86_64__)
    if (have_sse42) return crc_hw(p, n);
#endif
    return crc_sw(p, n);
}

/* ---- Probe ---- */
typedef struct {
    PyObject_HEAD Py_buffer tags, tab;
    uint64_t *tag;
    uint32_t *t;
    uint64_t mask;
    Py_ssize_t nslots;
    int bound;
} Probe;

static int get_buf(PyObject *o, Py_buffer *b, Py_ssize_t item, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (b->len % item) {
        PyErr_Format(PyExc_ValueError, "%s: not whole %zd-byte items", what, item);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

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

static inline int64_t probe_find(const Probe *p, uint64_t h) {
    uint64_t i = h & p->mask;
    for (;;) {
        uint32_t e = p->t[i];
        if (!e) return -1;
        if (p->tag[e - 1] == h) return (int64_t)e - 1;
        i = (i + 1) & p->mask;
    }
}

static int key_arg(PyObject *key, const uint8_t **k, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "a key is bytes");
        return -1;
    }
    *k = (const uint8_t *)PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
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

static int probe_erase(Probe *p, Py_ssize_t s) {
    uint64_t m = p->mask, i = p->tag[s] & m;
    for (;;) {
        uint32_t e = p->t[i];
        if (!e) return 0;
        if ((Py_ssize_t)e - 1 == s) break;
        i = (i + 1) & m;
    }
    /* backward shift: move later members of the run into the gap where their home allows */
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & m;
        uint32_t e = p->t[j];
        if (!e) break;
        uint64_t home = p->tag[e - 1] & m;
        /* e may move to i if i lies cyclically in [home, j) */
        int movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
        if (movable) {
            p->t[i] = e;
            i = j;
        }
    }
    p->t[i] = 0;
    return 1;
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

/* commit_records(keys, slots, atime, tenant=0, flags=0) -> bytes: a COMMIT record per key
 * (format.pack_record), each naming the tenant (bytes 56..57) and flags (byte 58) */
static PyObject *py_commit_records(PyObject *mod, PyObject *args) {
    PyObject *keys, *slots;
    unsigned long long at;
    unsigned short tenant = 0;
    unsigned char flags = 0;
    if (!PyArg_ParseTuple(args, "OOK|Hb", &keys, &slots, &at, &tenant, &flags)) return NULL;
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
        o[0] = 1;
        o[1] = (uint8_t)kl;
        memcpy(o + 4, &s32, 4);
        memcpy(o + 8, &a, 8);
        memcpy(o + 16, k, (size_t)kl);
        memcpy(o + 56, &tenant, 2);
        o[58] = flags;
        uint32_t c = crc32c(o, 60);
        memcpy(o + 60, &c, 4);
    }
    Py_DECREF(kf);
    Py_DECREF(sf);
    return out;
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

static PyTypeObject ProbeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aiokv._index.Probe",
    .tp_basicsize = sizeof(Probe),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Probe(tags uint64[slots], table uint32[2**k]): lookups, inserts and erases on them",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Probe_init,
    .tp_dealloc = (destructor)Probe_dealloc,
    .tp_methods = Probe_methods,
};

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

static PyObject *py_tag(PyObject *mod, PyObject *key) {
    const uint8_t *k;
    Py_ssize_t n;
    if (key_arg(key, &k, &n) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(key_tag(k, n));
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
        if (crc32c(p, (size_t)rb - 4) != want) break;
        Py_ssize_t j = 0;
        while (j < nkinds && (uint8_t)kinds[j] != p[0]) j++;
        if (j == nkinds || p[1] < (uint8_t)lens[2 * j] || p[1] > (uint8_t)lens[2 * j + 1]) break;
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&r);
    return PyLong_FromSize_t(k);
}

/* apply(probe, atimes, kinds, slots, ats, tags, max_slot, watch) -> (count change, touches, changes):
 * journal records, in order, on a table (its tag array the probe's, `atimes` its
 * atime array, both covering every slot below max_slot): COMMIT (1) puts the tag in
 * the slot (a slot at or past max_slot is damage: skipped), DROP (2) clears the
 * tag's slot, TOUCH (3) raises the tag's atime, FREE (4) clears the slot if it
 * holds the tag. `touches`: indices of TOUCH records of tags the table does not
 * hold (a uint32 bytes object). With `watch`, `changes` lists (tag, added) for
 * each tag made present or absent (bytes: uint64 tag, uint8 added), else b"". */
static PyObject *py_apply(PyObject *mod, PyObject *args) {
    PyObject *po, *ao, *ko, *so, *ato, *to;
    unsigned long long max_slot;
    int watch;
    if (!PyArg_ParseTuple(args, "O!OOOOOKp", &ProbeType, &po, &ao, &ko, &so, &ato, &to, &max_slot, &watch))
        return NULL;
    Probe *p = (Probe *)po;
    Py_buffer a, k, sl, at, tg;
    if (get_buf(ao, &a, 8, "atimes") < 0) return NULL;
    PyObject *bufs[] = {ko, so, ato, to};
    Py_buffer *views[] = {&k, &sl, &at, &tg};
    Py_ssize_t items[] = {1, 4, 8, 8};
    int got = 0;
    for (; got < 4; got++) {
        if (PyObject_GetBuffer(bufs[got], views[got], PyBUF_C_CONTIGUOUS) < 0) break;
        if (views[got]->len % items[got]) {
            PyBuffer_Release(views[got]);
            PyErr_SetString(PyExc_ValueError, "apply: columns of whole items");
            break;
        }
    }
    size_t n = (size_t)k.len;
    int ok = got == 4 && (size_t)sl.len / 4 == n && (size_t)at.len / 8 == n && (size_t)tg.len / 8 == n &&
             a.len / 8 >= p->nslots && (max_slot <= (unsigned long long)p->nslots);
    if (got == 4 && !ok) PyErr_SetString(PyExc_ValueError, "apply: columns differ in length or atimes too short");
    if (!ok) {
        for (int j = 0; j < got; j++) PyBuffer_Release(views[j]);
        PyBuffer_Release(&a);
        return NULL;
    }
    const uint8_t *kinds = k.buf;
    const uint32_t *slots = sl.buf;
    const uint64_t *ats = at.buf, *tags = tg.buf;
    uint64_t *atime = a.buf;
    uint32_t *touch = malloc((n ? n : 1) * sizeof(uint32_t));
    uint8_t *chg = watch ? malloc((n ? n : 1) * 18) : NULL;
    if (!touch || (watch && !chg)) {
        free(touch);
        free(chg);
        for (int j = 0; j < 4; j++) PyBuffer_Release(views[j]);
        PyBuffer_Release(&a);
        return PyErr_NoMemory();
    }
    size_t nt = 0, nc = 0;
    Py_ssize_t delta = 0;
#define CHANGE(tagv, added)                       \
    do {                                          \
        if (watch) {                              \
            uint64_t tv = (tagv);                 \
            memcpy(chg + 9 * nc, &tv, 8);         \
            chg[9 * nc + 8] = (uint8_t)(added);   \
            nc++;                                 \
        }                                         \
    } while (0)
    Py_BEGIN_ALLOW_THREADS;
    for (size_t i = 0; i < n; i++) {
        uint64_t h = tags[i];
        uint32_t s = slots[i];
        if (!h) continue;
        switch (kinds[i]) {
            case 1: {
                if (s >= max_slot) break;
                int64_t old = probe_find(p, h);
                if (old == (int64_t)s) {
                    atime[s] = ats[i];
                    break;
                }
                if (old >= 0) {
                    probe_erase(p, old);
                    p->tag[old] = 0;
                    atime[old] = 0;
                    delta--;
                }
                if (p->tag[s]) {
                    CHANGE(p->tag[s], 0); /* the block it replaces */
                    probe_erase(p, s);
                    p->tag[s] = 0;
                    delta--;
                }
                p->tag[s] = h;
                atime[s] = ats[i];
                uint64_t j = h & p->mask;
                while (p->t[j]) j = (j + 1) & p->mask;
                p->t[j] = s + 1;
                delta++;
                if (old < 0) CHANGE(h, 1);
                break;
            }
            case 2: {
                int64_t old = probe_find(p, h);
                if (old >= 0) {
                    probe_erase(p, old);
                    p->tag[old] = 0;
                    atime[old] = 0;
                    delta--;
                    CHANGE(h, 0);
                }
                break;
            }
            case 3: {
                int64_t old = probe_find(p, h);
                if (old >= 0) {
                    if (ats[i] > atime[old]) atime[old] = ats[i];
                } else
                    touch[nt++] = (uint32_t)i;
                break;
            }
            case 4:
                if (s < p->nslots && p->tag[s] == h) {
                    probe_erase(p, s);
                    p->tag[s] = 0;
                    atime[s] = 0;
                    delta--;
                    CHANGE(h, 0);
                }
                break;
        }
    }
    Py_END_ALLOW_THREADS;
#undef CHANGE
    for (int j = 0; j < 4; j++) PyBuffer_Release(views[j]);
    PyBuffer_Release(&a);
    PyObject *r = Py_BuildValue("ny#y#", delta, (const char *)touch, (Py_ssize_t)(nt * 4),
                                chg ? (const char *)chg : "", (Py_ssize_t)(nc * 9));
    free(touch);
    free(chg);
    return r;
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
        uint32_t c = crc32c(q, (size_t)rb - 4);
        memcpy(q + rb - 4, &c, 4);
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&r);
    Py_RETURN_NONE;
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
    {"commit_records", py_commit_records, METH_VARARGS, "commit_records(keys, slots, atime, tenant=0, flags=0) -> COMMIT records"},
    {"run", py_run, METH_VARARGS, "run(probes, keys, limit) -> keys from the first found in any probe"},
    {"locate", py_locate, METH_VARARGS, "locate(probes, key) -> (probe index, slot) or None"},
    {"record_tags", py_record_tags, METH_VARARGS, "record_tags(records, recbytes, klen_at, key_at, out)"},
    {"records_valid", py_records_valid, METH_VARARGS, "records_valid(buf, recbytes, kinds, klens) -> count"},
    {"apply", py_apply, METH_VARARGS, "apply(probe, atimes, kinds, slots, ats, tags, max_slot, watch)"},
    {"older", py_older, METH_VARARGS, "older(tags, atimes, thr, out) -> slots used at or before thr (-1: out short)"},
    {"seal", py_seal, METH_VARARGS, "seal(records, recbytes): each record's CRC32C into its last 4 bytes"},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "aiokv._index",
                                       "the compact index's hot loops (aiokv/store/table.py)", -1, module_methods};

int aiokv_order_register(PyObject *m); /* native/order.c: aiokv._index.Order */
int bulk_add(PyObject *m); /* native/bulk.c: an order's bulk changes */

PyMODINIT_FUNC PyInit__index(void) {
    crc_init();
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
    if (PyType_Ready(&ProbeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&ProbeType);
    if (PyModule_AddObject(m, "Probe", (PyObject *)&ProbeType) < 0) {
        Py_DECREF(&ProbeType);
        Py_DECREF(m);
        return NULL;
    }
    if (aiokv_order_register(m) < 0 || bulk_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
