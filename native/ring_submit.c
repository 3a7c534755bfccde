/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Ring's submissions (a unit of aiokv._native's Ring: native/ring.h): queued operations
 * prepared in submission order within the ring's limits (depth, max_ops, min_bytes), handed to
 * the kernel submit_group at a time, and what a refused submission leaves voided and failed.
 *
 * Threading contract: a Ring belongs to one thread (the asyncio loop that owns it); the GIL is
 * released around io_uring_enter only. The kernel reads entries only inside io_uring_enter
 * (no SQPOLL), which only that thread calls.
 */
#include "ring.h"

#ifdef AIOKV_HAVE_URING

/* io_uring_submit, or what the test hook says it should do instead. */
static int ring_submit_once(RingObject *self) {
    if (self->inject_err) {
        int e = self->inject_err;
        self->inject_err = 0;
        return -e;
    }
    if (self->inject_consume > 0 && io_uring_sq_ready(&self->ring) > (unsigned)self->inject_consume) {
        /* only the first inject_consume prepared entries are shown to the kernel */
        unsigned tail = self->ring.sq.sqe_tail;
        self->ring.sq.sqe_tail = self->ring.sq.sqe_head + self->inject_consume;
        int ret = io_uring_submit(&self->ring);
        self->ring.sq.sqe_tail = tail;
        self->inject_consume = 0;
        return ret;
    }
    return io_uring_submit(&self->ring);
}

/* Every prepared entry to the kernel: a partial submission is submitted again
 * while the kernel makes progress. Returns 0 (the submission queue is empty)
 * or -errno (entries are left; the caller voids them). Called without the GIL. */
static int ring_enter(RingObject *self) {
    while (io_uring_sq_ready(&self->ring)) {
        int ret = ring_submit_once(self);
        if (ret == -EINTR) continue;
        if (ret < 0) return ret;
        if (ret == 0) return -EAGAIN; /* no progress: do not spin */
    }
    return 0;
}

int ring_enter_nogil(RingObject *self) {
    int ret;
    Py_BEGIN_ALLOW_THREADS
    ret = ring_enter(self);
    Py_END_ALLOW_THREADS
    return ret;
}

/* After a refused submission (-err): the entries the kernel did not take become
 * no-ops tagged INTERNAL_TAG, so a later enter runs them without touching any
 * buffer, and exactly their operations fail with -err. Without SQPOLL the
 * kernel reads entries only inside io_uring_enter, which only the owning
 * thread calls, so rewriting them here is safe. Then, if nothing is left in
 * flight (no completion will come to retry them), the queued operations fail
 * too: retrying a refused submission at once would most likely be refused
 * again. Batches so completed go to `done`; -1 on a Python error. */
int ring_refused(RingObject *self, int err, PyObject *done) {
    struct io_uring_sq *sq = &self->ring.sq;
    unsigned mask = *sq->kring_mask;
    int rc = 0;
    for (unsigned p = io_uring_smp_load_acquire(sq->khead); p != sq->sqe_tail; p++) {
        struct io_uring_sqe *sqe = &sq->sqes[p & mask]; /* liburing >= 2.2 maps the SQ array 1:1 */
        uint64_t ud = sqe->user_data;
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, (void *)(uintptr_t)INTERNAL_TAG);
        if (op_left_kernel(self, ud, -err, done) < 0) rc = -1;
    }
    while (self->in_flight == 0 && self->qhead >= 0) {
        int32_t s = self->qhead;
        ring_batch *b = &self->b[s];
        self->qhead = b->link;
        if (self->qhead < 0) self->qtail = -1;
        uint32_t i = b->next;
        b->next = b->n;
        for (; i < b->n; i++)
            if (op_done(self, s, i, -err, done) < 0) rc = -1;
    }
    return rc;
}

/* Hands queued operations to the kernel, in submission order, up to `depth` in
 * flight, or up to max_ops while fewer than min_bytes are in flight: one
 * io_uring_enter per submit_group operations (all at once if 0). Entries voided
 * by an earlier refusal go first; if they are refused again, nothing new is
 * prepared. */
int ring_pump(RingObject *self, PyObject *done) {
    if (io_uring_sq_ready(&self->ring)) {
        int ret = ring_enter_nogil(self);
        if (ret < 0) return ring_refused(self, -ret, done);
    }
    unsigned limit = self->bytes < self->min_bytes ? self->max_ops : self->depth;
    unsigned count = 0;
    while (self->qhead >= 0 && self->in_flight < limit) {
        if (count && self->bytes >= self->min_bytes && self->in_flight >= self->depth) break;
        struct io_uring_sqe *sqe = io_uring_get_sqe(&self->ring);
        if (!sqe) break;
        int32_t s = self->qhead;
        ring_batch *b = &self->b[s];
        uint32_t i = b->next, span = op_run(b->ops, b->n, i, self->merge_bytes);
        io_op *o = &b->ops[i];
        if (span > 1) {
            /* adjacent writes of this batch as one vectored write: one request for the disk */
            for (uint32_t j = i; j < i + span; j++) {
                b->iov[j].iov_base = (void *)(uintptr_t)b->ops[j].addr;
                b->iov[j].iov_len = b->ops[j].len;
            }
            io_uring_prep_writev(sqe, o->fd, &b->iov[i], span, o->off);
        } else if (o->op == OP_READ)
            io_uring_prep_read(sqe, o->fd, (void *)(uintptr_t)o->addr, o->len, o->off);
        else if (o->op == OP_WRITE)
            io_uring_prep_write(sqe, o->fd, (const void *)(uintptr_t)o->addr, o->len, o->off);
        else
            io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, (void *)(uintptr_t)op_ud(self, s, i));
        o->span = (uint16_t)span;
        for (uint32_t j = i; j < i + span; j++) {
            b->res[j] = RES_PENDING; /* the ring owns it until its completion is reaped */
            self->bytes += b->ops[j].len;
        }
        self->in_flight++;
        count++;
        b->next += span - 1;
        if (++b->next == b->n) {
            self->qhead = b->link;
            if (self->qhead < 0) self->qtail = -1;
            b->link = -1;
        }
        if (self->submit_group && count % self->submit_group == 0) {
            int ret = ring_enter_nogil(self);
            if (ret < 0) return ring_refused(self, -ret, done);
        }
    }
    if (!count) return 0;
    int ret = ring_enter_nogil(self);
    return ret < 0 ? ring_refused(self, -ret, done) : 0;
}

#endif /* AIOKV_HAVE_URING */
