/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Slot headers, many slots per call (docs/format.md): stamp_slots writes them,
 * verify_slots checks a batch of staging buffers, check_slot one slot in any
 * buffer (what aiokv/data/format/slot.py's check_slot, check_header and
 * unpack_header call). The slot MAC, with a secret, is aiokv/data/mac.py's.
 *
 * Threading: any thread, several at once; a call reads and writes only the
 * buffers it is handed (the GIL released over a batch).
 */
#include "aiokv.h"

#include <time.h>

static const char BLOCK_MAGIC[8] = {'A', 'I', 'O', 'K', 'V', 'B', 'L', 'K'};

/* How far a check goes (exported as CHECK_*): the header's own integrity (CRC,
 * magic, version: format.unpack_header), the header against what the reader
 * expects too (format.check_header), or the whole slot, payload CRC included
 * (format.check_slot). */
enum { CHECK_SELF, CHECK_HEADER, CHECK_SLOT };

typedef struct {
    uint8_t len;
    uint8_t b[MAX_KEY];
} slot_key;

/* The arguments both batch calls share, parsed with the GIL held: addresses
 * (ints) and keys (bytes, 16-32 long) of equal count, the namespace id (16
 * bytes). Returns the count, or -1 with an exception set. */
static Py_ssize_t slots_parse(PyObject *addrs, PyObject *keys, Py_buffer *nsid, uint64_t **pa, slot_key **pk) {
    *pa = NULL;
    *pk = NULL;
    if (nsid->len != 16) {
        PyErr_SetString(PyExc_ValueError, "aiokv: nsid must be 16 bytes");
        return -1;
    }
    PyObject *sa = PySequence_Fast(addrs, "addrs must be a sequence of ints");
    if (!sa) return -1;
    PyObject *sk = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (!sk) {
        Py_DECREF(sa);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sa);
    if (PySequence_Fast_GET_SIZE(sk) != n) {
        PyErr_SetString(PyExc_ValueError, "aiokv: addrs and keys differ in length");
        goto fail;
    }
    *pa = PyMem_Malloc(sizeof(uint64_t) * (n ? n : 1));
    *pk = PyMem_Malloc(sizeof(slot_key) * (n ? n : 1));
    if (!*pa || !*pk) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        (*pa)[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(sa, i));
        if (PyErr_Occurred()) goto fail;
        char *kb;
        Py_ssize_t kl;
        if (PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(sk, i), &kb, &kl) < 0) goto fail;
        if (kl < 16 || kl > MAX_KEY) {
            PyErr_Format(PyExc_ValueError, "aiokv: keys are 16-32 bytes, got %zd", kl);
            goto fail;
        }
        (*pk)[i].len = (uint8_t)kl;
        memset((*pk)[i].b, 0, MAX_KEY);
        memcpy((*pk)[i].b, kb, (size_t)kl);
    }
    Py_DECREF(sa);
    Py_DECREF(sk);
    return n;
fail:
    Py_DECREF(sa);
    Py_DECREF(sk);
    PyMem_Free(*pa);
    PyMem_Free(*pk);
    *pa = NULL;
    *pk = NULL;
    return -1;
}

/* The slot MAC, with a secret (docs/format.md, "The MAC"), is aiokv/data/mac.py's:
 * stamp_slots writes the scheme byte it is given (HDR_OFF_MACS, covered by the
 * header CRC) and zeroes the MAC's bytes; Python hashes the stamped slot and
 * writes them, and checks them after verify_slots and check_slot. */

/* The arguments stamp_slots and verify_slots share: (addrs, keys, nsid, rank,
 * payload_len, layout, crc_in_copy=0), and stamp_slots' mac_scheme=0 after them,
 * parsed with the GIL held (slots_parse). 0, or -1 with an exception set and
 * nothing held. */
typedef struct {
    Py_buffer nsid;
    uint8_t ns[16];
    unsigned int rank, mac_scheme;
    unsigned long long plen, layout;
    int crc_in_copy;
    uint64_t *pa;
    slot_key *pk;
    Py_ssize_t n;
} slots_call;

/* stamp: whether the call takes mac_scheme after crc_in_copy (stamp_slots) */
static int slots_call_parse(PyObject *args, slots_call *c, int stamp) {
    PyObject *addrs, *keys;
    c->crc_in_copy = 0;
    c->mac_scheme = 0;
    int ok = stamp ? PyArg_ParseTuple(args, "OOy*IKK|pI", &addrs, &keys, &c->nsid, &c->rank, &c->plen, &c->layout,
                                      &c->crc_in_copy, &c->mac_scheme)
                   : PyArg_ParseTuple(args, "OOy*IKK|p", &addrs, &keys, &c->nsid, &c->rank, &c->plen, &c->layout,
                                      &c->crc_in_copy);
    if (!ok) return -1;
    if (c->mac_scheme > 0xff) {
        PyErr_SetString(PyExc_ValueError, "aiokv: mac_scheme is one byte");
        PyBuffer_Release(&c->nsid);
        return -1;
    }
    if ((c->n = slots_parse(addrs, keys, &c->nsid, &c->pa, &c->pk)) < 0) {
        PyBuffer_Release(&c->nsid);
        return -1;
    }
    memcpy(c->ns, c->nsid.buf, 16);
    return 0;
}

static void slots_call_release(slots_call *c) {
    PyMem_Free(c->pa);
    PyMem_Free(c->pk);
    PyBuffer_Release(&c->nsid);
}

/* stamp_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy=0,
 * mac_scheme=0): for each slot, CRC32C its payload and write its header
 * (sequence: the wall clock in ns, as time.time_ns()), zeroing the rest of the
 * header. With crc_in_copy the payload's CRC is not computed: it is the one
 * already at HDR_OFF_PCRC (put there by memcpy_crc_out while it copied the
 * payload in). mac_scheme goes into the header as it is (aiokv/data/mac.py
 * then writes the MAC after it). One call per chunk, GIL released for all of it. */
static PyObject *py_stamp_slots(PyObject *self, PyObject *args) {
    slots_call c;
    if (slots_call_parse(args, &c, 1) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < c.n; i++) {
        uint8_t *h = (uint8_t *)(uintptr_t)c.pa[i];
        uint32_t pcrc = c.crc_in_copy ? get32(h + HDR_OFF_PCRC) : crc32c(0, h + HDR_BYTES, (size_t)c.plen);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint8_t hdr[HDR_USED] = {0};
        memcpy(hdr + HDR_OFF_MAGIC, BLOCK_MAGIC, 8);
        put16(hdr + HDR_OFF_VERSION, FILE_VERSION);
        put16(hdr + HDR_OFF_HBYTES, HDR_BYTES);
        put32(hdr + HDR_OFF_RANK, c.rank);
        memcpy(hdr + HDR_OFF_NSID, c.ns, 16);
        hdr[HDR_OFF_KLEN] = c.pk[i].len;
        hdr[HDR_OFF_MACS] = (uint8_t)c.mac_scheme;
        put32(hdr + HDR_OFF_PCRC, pcrc);
        put64(hdr + HDR_OFF_PLEN, c.plen);
        memcpy(hdr + HDR_OFF_KEY, c.pk[i].b, MAX_KEY);
        put64(hdr + HDR_OFF_SEQ, (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec);
        put64(hdr + HDR_OFF_LAYOUT, c.layout);
        put32(hdr + HDR_BODY, crc32c(0, hdr, HDR_BODY));
        memcpy(h, hdr, sizeof hdr);
        memset(h + sizeof hdr, 0, HDR_BYTES - sizeof hdr);
    }
    Py_END_ALLOW_THREADS
    slots_call_release(&c);
    Py_RETURN_NONE;
}

/* The one slot check: every reader's, through format.check_slot (and
 * check_header, unpack_header) one slot at a time, or verify_slots a batch at
 * a time. h: the slot's first byte, avail bytes of it readable; k NULL: any key;
 * layout NULL: any layout; upto: CHECK_*. Returns the first check failed
 * (SLOT_*), SLOT_OK if none; the MAC, where a reader has a secret, is checked
 * after it (aiokv/data/mac.py: SLOT_MAC before a payload CRC verdict). Inlined
 * in both callers: in verify_slots' loop the key, layout and length are always
 * there, and their tests fold away. */
static inline __attribute__((always_inline)) int slot_verdict(const uint8_t *h, uint64_t avail, const uint8_t *ns,
                                                               uint32_t rank, uint64_t plen, const slot_key *k,
                                                               const uint64_t *layout, int upto) {
    if (avail < HDR_USED) return SLOT_HDR_SHORT;
    if (crc32c(0, h, HDR_BODY) != get32(h + HDR_BODY)) return SLOT_HDR_CRC;
    if (memcmp(h + HDR_OFF_MAGIC, BLOCK_MAGIC, 8)) return SLOT_MAGIC;
    if (get16(h + HDR_OFF_VERSION) != FILE_VERSION || get16(h + HDR_OFF_HBYTES) != HDR_BYTES) return SLOT_VERSION;
    if (upto == CHECK_SELF) return SLOT_OK;
    if (layout && get64(h + HDR_OFF_LAYOUT) != *layout) return SLOT_LAYOUT;
    if (memcmp(h + HDR_OFF_NSID, ns, 16)) return SLOT_NSID;
    if (get32(h + HDR_OFF_RANK) != rank) return SLOT_RANK;
    unsigned klen = h[HDR_OFF_KLEN] < MAX_KEY ? h[HDR_OFF_KLEN] : MAX_KEY; /* Python's key[:klen] */
    if (k && (klen != k->len || memcmp(h + HDR_OFF_KEY, k->b, klen))) return SLOT_KEY;
    if (get64(h + HDR_OFF_PLEN) != plen) return SLOT_PLEN;
    if (upto == CHECK_HEADER) return SLOT_OK;
    if (avail < HDR_BYTES || avail - HDR_BYTES < plen) return SLOT_PAYLOAD_SHORT;
    if (crc32c(0, h + HDR_BYTES, (size_t)plen) != get32(h + HDR_OFF_PCRC)) return SLOT_PAYLOAD_CRC;
    return SLOT_OK;
}

/* verify_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy=0)
 * -> bytes: per slot 0 (valid for that key) or the index in
 * format.SLOT_REASONS of the first check it fails (slot_verdict; each
 * address a whole slot); with crc_in_copy the payload CRC is left to the
 * caller (never reported). One call per chunk, GIL released for all of it. */
static PyObject *py_verify_slots(PyObject *self, PyObject *args) {
    slots_call c;
    if (slots_call_parse(args, &c, 0) < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, c.n);
    if (out) {
        uint8_t *v = (uint8_t *)PyBytes_AS_STRING(out);
        uint64_t lay = c.layout;
        int upto = c.crc_in_copy ? CHECK_HEADER : CHECK_SLOT;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < c.n; i++)
            v[i] = (uint8_t)slot_verdict((const uint8_t *)(uintptr_t)c.pa[i], HDR_BYTES + c.plen, c.ns, c.rank, c.plen,
                                         &c.pk[i], &lay, upto);
        Py_END_ALLOW_THREADS
    }
    slots_call_release(&c);
    return out;
}

/* check_slot(buffer, nsid, rank, payload_len, key, layout, upto) -> int: the
 * verdict of slot_verdict for one slot in any buffer (bytes, ctypes memory
 * over a staging slot), as verify_slots gives it; key or layout None: any;
 * upto: CHECK_*. What format.check_slot, check_header and unpack_header call.
 * GIL released over a payload of more than GIL_FREE_BYTES (64 KiB). */
static PyObject *py_check_slot(PyObject *self, PyObject *args) {
    Py_buffer buf, nsid;
    unsigned int rank;
    unsigned long long plen;
    PyObject *key, *layout;
    int upto;
    if (!PyArg_ParseTuple(args, "y*y*IKOOi", &buf, &nsid, &rank, &plen, &key, &layout, &upto)) return NULL;
    slot_key k, *kp = NULL;
    uint64_t lay, *lp = NULL;
    int verdict = -1;
    if (nsid.len != 16) {
        PyErr_SetString(PyExc_ValueError, "aiokv: nsid must be 16 bytes");
        goto done;
    }
    if (upto < CHECK_SELF || upto > CHECK_SLOT) {
        PyErr_SetString(PyExc_ValueError, "aiokv: upto must be one of CHECK_SELF, CHECK_HEADER, CHECK_SLOT");
        goto done;
    }
    if (key != Py_None) {
        Py_buffer kv;
        if (PyObject_GetBuffer(key, &kv, PyBUF_SIMPLE) < 0) goto done;
        memset(k.b, 0, MAX_KEY);
        memcpy(k.b, kv.buf, (size_t)(kv.len < MAX_KEY ? kv.len : MAX_KEY));
        k.len = kv.len <= MAX_KEY ? (uint8_t)kv.len : 0xff; /* longer than any header's key: never equal */
        PyBuffer_Release(&kv);
        kp = &k;
    }
    if (layout != Py_None) {
        lay = PyLong_AsUnsignedLongLong(layout);
        if (PyErr_Occurred()) goto done;
        lp = &lay;
    }
    if (upto == CHECK_SLOT && plen > GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        verdict = slot_verdict(buf.buf, (uint64_t)buf.len, nsid.buf, rank, plen, kp, lp, upto);
        Py_END_ALLOW_THREADS
    } else {
        verdict = slot_verdict(buf.buf, (uint64_t)buf.len, nsid.buf, rank, plen, kp, lp, upto);
    }
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&nsid);
    return verdict < 0 ? NULL : PyLong_FromLong(verdict);
}

static PyMethodDef slot_methods[] = {
    {"stamp_slots", py_stamp_slots, METH_VARARGS,
     "stamp_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy=0, mac_scheme=0)"},
    {"verify_slots", py_verify_slots, METH_VARARGS,
     "verify_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy=0) -> bytes of verdicts"},
    {"check_slot", py_check_slot, METH_VARARGS,
     "check_slot(buffer, nsid, rank, payload_len, key, layout, upto) -> verdict (key, layout None: any)"},
    {NULL}};

int slots_add(PyObject *m) {
    if (PyModule_AddFunctions(m, slot_methods) < 0 || PyModule_AddIntConstant(m, "CHECK_SELF", CHECK_SELF) < 0 ||
        PyModule_AddIntConstant(m, "CHECK_HEADER", CHECK_HEADER) < 0 ||
        PyModule_AddIntConstant(m, "CHECK_SLOT", CHECK_SLOT) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_VERDICTS", SLOT_VERDICTS) < 0)
        return -1;
    return 0;
}
