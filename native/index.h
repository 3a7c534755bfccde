/* SPDX-License-Identifier: Apache-2.0 */
/*
 * aiokv._index: what its units share (native/recipe.py's INDEX_UNITS lists them).
 *
 *   aiokv_index.c  the module: its init, key tags, lookups over several probes (one key, a run,
 *                  many at once), victims by age
 *   probe.c        Probe: a table's open-addressing hash of tags to slots (lookups, inserts,
 *                  erases, bulk builds, bulk puts)
 *   records.c      journal records: COMMIT records made, records checked and sealed by their
 *                  CRC32C, and their keys' tags
 *   crc32c.c       CRC32C (crc32c.h), the one aiokv._native links too
 *   apply.c        journal records applied to a table, a helper per record kind
 *   order.c        Order, the eviction order (order.h: its units)
 *   bulk.c         an operator's order applied to a window of slots
 *   holds.c        the keys loads hold, counted in bulk (aiokv/store/loadpins.py)
 *
 * Every unit is built with hidden visibility, so only PyInit__index leaves the module.
 */
#ifndef AIOKV_INDEX_H
#define AIOKV_INDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---- key tags (aiokv_index.c says why they are part of the format) ---- */
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

/* ---- Probe (probe.c): a table's tag array and hash, bound ---- */
typedef struct {
    PyObject_HEAD Py_buffer tags, tab;
    uint64_t *tag;
    uint32_t *t;
    uint64_t mask;
    Py_ssize_t nslots;
    int bound;
} Probe;

extern PyTypeObject ProbeType;

static inline int64_t probe_find(const Probe *p, uint64_t h) {
    uint64_t i = h & p->mask;
    for (;;) {
        uint32_t e = p->t[i];
        if (!e) return -1;
        if (p->tag[e - 1] == h) return (int64_t)e - 1;
        i = (i + 1) & p->mask;
    }
}

/* slot s's entry out of the hash (tags[s] intact): 0 if it was not there */
static inline int probe_erase(Probe *p, Py_ssize_t s) {
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

/* ---- arguments (aiokv_index.c) ---- */
int get_buf(PyObject *o, Py_buffer *b, Py_ssize_t item, const char *what); /* writable, whole items */
int key_arg(PyObject *key, const uint8_t **k, Py_ssize_t *n);               /* a bytes key */

/* ---- each unit's part of the module; 0 or -1 ---- */
int probe_add(PyObject *m);           /* probe.c: Probe */
int records_add(PyObject *m);         /* records.c: its functions; crc_init first */
int apply_add(PyObject *m);           /* apply.c: apply */
int aiokv_order_register(PyObject *m); /* order.c: Order */
int bulk_add(PyObject *m);            /* bulk.c: an order's bulk changes */
int holds_add(PyObject *m);           /* holds.c: a load's holds counted in bulk */

#endif /* AIOKV_INDEX_H */
