/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Ring's batches (a unit of aiokv._native's Ring: native/ring.h): the batch slots (an id is a
 * slot and its generation, so a stale id never matches), the queue of batches with operations
 * not yet handed to the kernel, and a batch reported once every operation has a result.
 *
 * Threading contract: a Ring belongs to one thread (the asyncio loop that owns it); these
 * run on it with the GIL held (they make Python objects and allocate with PyMem).
 */
#include "ring.h"

#ifdef AIOKV_HAVE_URING

int32_t batch_alloc(RingObject *self, uint32_t n) {
    if (self->free_head < 0) {
        if (self->cap >= MAX_BATCHES) {
            PyErr_SetString(PyExc_RuntimeError, "aiokv: too many I/O batches in flight at once");
            return -1;
        }
        uint32_t ncap = self->cap ? 2 * self->cap : 16;
        if (ncap > MAX_BATCHES) ncap = MAX_BATCHES;
        ring_batch *nb = PyMem_Realloc(self->b, ncap * sizeof *nb);
        if (!nb) {
            PyErr_NoMemory();
            return -1;
        }
        memset(nb + self->cap, 0, (ncap - self->cap) * sizeof *nb);
        for (uint32_t s = self->cap; s < ncap; s++) nb[s].link = s + 1 < ncap ? (int32_t)(s + 1) : -1;
        self->b = nb;
        self->free_head = self->cap;
        self->cap = ncap;
    }
    int32_t s = self->free_head;
    ring_batch *b = &self->b[s];
    b->ops = PyMem_Malloc(n * (sizeof(io_op) + sizeof(struct iovec) + sizeof(int32_t)));
    if (!b->ops) {
        PyErr_NoMemory();
        return -1;
    }
    self->free_head = b->link;
    b->iov = (struct iovec *)(b->ops + n);
    b->res = (int32_t *)(b->iov + n);
    b->n = b->left = n;
    b->next = 0;
    b->live = 1;
    b->link = -1;
    return s;
}

void batch_free(RingObject *self, int32_t s) {
    ring_batch *b = &self->b[s];
    PyMem_Free(b->ops);
    b->ops = NULL;
    b->iov = NULL;
    b->res = NULL;
    b->live = 0;
    b->gen++;
    b->link = self->free_head;
    self->free_head = s;
}

void queue_push(RingObject *self, int32_t s) {
    self->b[s].link = -1;
    if (self->qtail >= 0) self->b[self->qtail].link = s;
    else self->qhead = s;
    self->qtail = s;
}

void queue_remove(RingObject *self, int32_t s) {
    int32_t prev = -1;
    for (int32_t q = self->qhead; q >= 0; prev = q, q = self->b[q].link) {
        if (q != s) continue;
        if (prev >= 0) self->b[prev].link = self->b[s].link;
        else self->qhead = self->b[s].link;
        if (self->qtail == s) self->qtail = prev;
        self->b[s].link = -1;
        return;
    }
}

/* A batch whose every operation has a result: (id, [result, ...]) appended to
 * `done`, and its slot freed. -1 on a Python error. */
int batch_report(RingObject *self, int32_t s, PyObject *done) {
    ring_batch *b = &self->b[s];
    PyObject *res = PyList_New(b->n);
    int rc = -1;
    if (res) {
        uint32_t i = 0;
        for (; i < b->n; i++) {
            PyObject *v = PyLong_FromLong(b->res[i]);
            if (!v) break;
            PyList_SET_ITEM(res, i, v);
        }
        if (i == b->n) {
            PyObject *t = Py_BuildValue("(lO)", batch_id(self, s), res);
            rc = t ? PyList_Append(done, t) : -1;
            Py_XDECREF(t);
        }
        Py_DECREF(res);
    }
    batch_free(self, s);
    return rc;
}

/* The kernel entry a user_data names has left the kernel with `res` (a completion
 * reaped, or an entry a refused submission voided: the one path both take): it is no
 * longer in flight, and its batch is reported if it was the last. An entry that merged
 * `span` writes gives each its share: an error is each one's; a count covers them in
 * order, and one it does not reach whole gets what reached it (short: the caller's
 * error). Internal no-ops and entries of batches already gone are skipped. 0, or -1
 * on a Python error. */
int op_left_kernel(RingObject *self, uint64_t ud, int32_t res, PyObject *done) {
    if (ud == INTERNAL_TAG) return 0;
    int32_t s = batch_find(self, (ud >> 32) & 0xffff, ud >> 48);
    if (s < 0) return 0;
    uint32_t i = (uint32_t)ud, span = self->b[s].ops[i].span;
    self->in_flight--;
    int64_t left = res; /* bytes not yet handed to an operation of the span (one, unmerged) */
    for (uint32_t j = i; j < i + span; j++) {
        /* read before op_done: the last one may report the batch and free it */
        uint32_t len = self->b[s].ops[j].len;
        int32_t r = res < 0 ? res : (int32_t)(left >= len ? len : left);
        left -= r;
        self->bytes -= len;
        int last = j + 1 == i + span;
        if (op_done(self, s, j, r, done) < 0) return -1;
        if (last) break;
    }
    return 0;
}

/* Operation i of batch s has its result; the batch is reported if it was the last. */
int op_done(RingObject *self, int32_t s, uint32_t i, int32_t res, PyObject *done) {
    ring_batch *b = &self->b[s];
    b->res[i] = res;
    return --b->left == 0 ? batch_report(self, s, done) : 0;
}

#endif /* AIOKV_HAVE_URING */
