/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index.apply (a unit of aiokv._index: native/index.h): journal records, in order, on
 * a table (aiokv/store/table.py, opening and following another engine's journal), a helper
 * per record kind: COMMIT puts a tag in a slot, DROP clears a tag's slot, TOUCH raises a tag's
 * atime, FREE clears a slot that holds the tag.
 *
 * Threading: the caller's table is changed by one thread (its owner, or the thread that
 * builds it before handing it over); the loop over the records releases the GIL.
 */
#include "index.h"

#include <stdlib.h>

#define COMMIT 1
#define DROP 2
#define TOUCH 3
#define FREE 4

/* a run of apply over one table: what the records change and what it reports */
typedef struct {
    Probe *p;
    uint64_t *atime;   /* the table's atime array */
    uint32_t *touch;   /* indices of TOUCH records of tags the table does not hold */
    uint8_t *chg;      /* with watch: (uint64 tag, uint8 added) per change; else NULL */
    size_t nt, nc;     /* entries in touch, in chg */
    Py_ssize_t delta;  /* the count change */
} applying;

static inline void change(applying *a, uint64_t tag, int added) {
    if (a->chg) {
        memcpy(a->chg + 9 * a->nc, &tag, 8);
        a->chg[9 * a->nc + 8] = (uint8_t)added;
        a->nc++;
    }
}

/* the block in slot s is gone: out of the hash, its tag and atime cleared */
static inline void forget(applying *a, Py_ssize_t s) {
    probe_erase(a->p, s);
    a->p->tag[s] = 0;
    a->atime[s] = 0;
    a->delta--;
}

/* COMMIT: tag h in slot s, last used at (a slot at or past max_slot is damage: skipped); the
 * tag leaves any other slot, the slot's former block is gone */
static void apply_commit(applying *a, uint64_t h, uint32_t s, uint64_t at, unsigned long long max_slot) {
    Probe *p = a->p;
    if (s >= max_slot) return;
    int64_t old = probe_find(p, h);
    if (old == (int64_t)s) {
        a->atime[s] = at;
        return;
    }
    if (old >= 0) forget(a, old);
    if (p->tag[s]) {
        change(a, p->tag[s], 0); /* the block it replaces */
        probe_erase(p, s);
        p->tag[s] = 0;
        a->delta--;
    }
    p->tag[s] = h;
    a->atime[s] = at;
    uint64_t j = h & p->mask;
    while (p->t[j]) j = (j + 1) & p->mask;
    p->t[j] = s + 1;
    a->delta++;
    if (old < 0) change(a, h, 1);
}

/* DROP: tag h's slot cleared */
static void apply_drop(applying *a, uint64_t h) {
    int64_t old = probe_find(a->p, h);
    if (old >= 0) {
        forget(a, old);
        change(a, h, 0);
    }
}

/* TOUCH (record i): tag h's atime raised to at; a tag not held is reported */
static void apply_touch(applying *a, uint64_t h, uint64_t at, size_t i) {
    int64_t old = probe_find(a->p, h);
    if (old >= 0) {
        if (at > a->atime[old]) a->atime[old] = at;
    } else
        a->touch[a->nt++] = (uint32_t)i;
}

/* FREE: slot s cleared if it holds tag h */
static void apply_free(applying *a, uint64_t h, uint32_t s) {
    if (s < a->p->nslots && a->p->tag[s] == h) {
        forget(a, s);
        change(a, h, 0);
    }
}

static void apply_records(applying *a, size_t n, const uint8_t *kinds, const uint32_t *slots, const uint64_t *ats,
                          const uint64_t *tags, unsigned long long max_slot) {
    for (size_t i = 0; i < n; i++) {
        uint64_t h = tags[i];
        if (!h) continue;
        switch (kinds[i]) {
            case COMMIT: apply_commit(a, h, slots[i], ats[i], max_slot); break;
            case DROP: apply_drop(a, h); break;
            case TOUCH: apply_touch(a, h, ats[i], i); break;
            case FREE: apply_free(a, h, slots[i]); break;
        }
    }
}

/* the four columns' buffers (kinds uint8, slots uint32, ats and tags uint64) into v: how many
 * were taken (4: all; fewer: an error is set, those taken are still held) */
static int columns(PyObject *const *objs, Py_buffer *v) {
    static const Py_ssize_t items[] = {1, 4, 8, 8};
    int got = 0;
    for (; got < 4; got++) {
        if (PyObject_GetBuffer(objs[got], &v[got], PyBUF_C_CONTIGUOUS) < 0) break;
        if (v[got].len % items[got]) {
            PyBuffer_Release(&v[got]);
            PyErr_SetString(PyExc_ValueError, "apply: columns of whole items");
            break;
        }
    }
    return got;
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
    PyObject *po, *ao, *cols[4];
    unsigned long long max_slot;
    int watch;
    if (!PyArg_ParseTuple(args, "O!OOOOOKp", &ProbeType, &po, &ao, &cols[0], &cols[1], &cols[2], &cols[3], &max_slot,
                          &watch))
        return NULL;
    Probe *p = (Probe *)po;
    Py_buffer a, v[4];
    if (get_buf(ao, &a, 8, "atimes") < 0) return NULL;
    int got = columns(cols, v);
    size_t n = got == 4 ? (size_t)v[0].len : 0;
    int ok = got == 4 && (size_t)v[1].len / 4 == n && (size_t)v[2].len / 8 == n && (size_t)v[3].len / 8 == n &&
             a.len / 8 >= p->nslots && (max_slot <= (unsigned long long)p->nslots);
    if (got == 4 && !ok) PyErr_SetString(PyExc_ValueError, "apply: columns differ in length or atimes too short");
    applying run = {p, a.buf, NULL, NULL, 0, 0, 0};
    if (ok) {
        run.touch = malloc((n ? n : 1) * sizeof(uint32_t));
        run.chg = watch ? malloc((n ? n : 1) * 18) : NULL;
        if (!run.touch || (watch && !run.chg)) {
            free(run.touch);
            free(run.chg);
            PyErr_NoMemory();
            ok = 0;
        }
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS;
        apply_records(&run, n, v[0].buf, v[1].buf, v[2].buf, v[3].buf, max_slot);
        Py_END_ALLOW_THREADS;
    }
    for (int j = 0; j < got; j++) PyBuffer_Release(&v[j]);
    PyBuffer_Release(&a);
    if (!ok) return NULL;
    PyObject *r = Py_BuildValue("ny#y#", run.delta, (const char *)run.touch, (Py_ssize_t)(run.nt * 4),
                                run.chg ? (const char *)run.chg : "", (Py_ssize_t)(run.nc * 9));
    free(run.touch);
    free(run.chg);
    return r;
}

static PyMethodDef apply_methods[] = {
    {"apply", py_apply, METH_VARARGS, "apply(probe, atimes, kinds, slots, ats, tags, max_slot, watch)"},
    {NULL}};

int apply_add(PyObject *m) { return PyModule_AddFunctions(m, apply_methods); }
