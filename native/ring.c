/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Ring: one io_uring instance running batches of reads and writes for
 * aiokv/data/uring.py.
 *
 * Threading contract: a Ring belongs to one thread (the asyncio loop that owns
 * it). The GIL is released around the system calls (io_uring_submit, waiting).
 *
 * Buffers are given as raw addresses (an aligned host arena, a tensor's
 * data_ptr()). The caller owns them and must keep them alive until the
 * operation's completion has been reaped: the kernel writes into them until
 * then. Cancellation (Ring.cancel) only asks the kernel; the completion of the
 * original operation still arrives and is waited for.
 *
 * The Ring runs batches: Python hands it a whole batch in one call (start),
 * and the ring keeps the operations in C arrays, queues them, submits within
 * its limits, reaps, and reports a batch only once every operation of it has
 * a result (reap, pump, cancel return the batches so completed). Per-operation
 * work is here; Python's is per batch (aiokv/data/uring.py).
 *
 * Only the liburing 2.1-2.3 API is used, so Debian 11/12 and Ubuntu 22.04 build.
 * Built without liburing (setup.py, AIOKV_WITHOUT_URING=1: no AIOKV_HAVE_URING) the
 * module has no Ring, and HAVE_URING is 0: aiokv then uses its thread-pool I/O
 * backend (aiokv/data/threads.py).
 */
#include "aiokv.h"

#define OP_READ 0
#define OP_WRITE 1
#define OP_NOP 2

#ifdef AIOKV_HAVE_URING
#include <errno.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* user_data of our own cancel requests and of voided entries; their completions
 * are not reported. No batch's user_data can take this value (MAX_BATCHES). */
#define INTERNAL_TAG UINT64_MAX
#define RES_PENDING INT32_MIN /* an operation without a result yet */
#define MAX_BATCHES 0xfffe    /* batch slots; a slot number fits 16 bits and is never 0xffff */

/* One operation of a batch, as Ring.start parsed it. */
typedef struct {
    uint64_t addr, off;
    int32_t fd;
    uint32_t len;
    uint8_t op;
} ring_op;

/* A batch: the unit Python sees. Its operations are queued in order, handed to
 * the kernel within the ring's limits, and the batch is reported (and its slot
 * freed) once every operation has a result. */
typedef struct {
    ring_op *ops;  /* n operations, then n int32 results (one allocation) */
    int32_t *res;  /* per operation: byte count, -errno, or RES_PENDING */
    uint32_t n;
    uint32_t next; /* operations [next, n) are queued: not prepared yet */
    uint32_t left; /* operations without a result */
    uint16_t gen;  /* bumped when the slot is freed: a stale user_data or id never matches */
    uint8_t live;
    int32_t link;  /* next batch in the submission queue, or in the free list; -1: none */
} ring_batch;

typedef struct {
    PyObject_HEAD
    struct io_uring ring;
    int efd;
    int open;
    unsigned entries;
    int inject_err;      /* test hook: the next enter fails with -inject_err, consuming nothing */
    int inject_consume;  /* test hook: the next enter consumes only this many entries (0: off) */
    ring_batch *b;       /* batch slots */
    uint32_t cap;
    int32_t free_head;
    int32_t qhead, qtail; /* batches with queued operations, in submission order */
    unsigned depth, max_ops, in_flight; /* in_flight: operations the kernel owns */
    unsigned long long min_bytes, bytes; /* bytes: of the operations in flight */
    unsigned submit_group; /* operations per io_uring_enter (0: all prepared at once); see ring_pump */
} RingObject;

/* Default operations per io_uring_enter. Linux plugs the block layer while one
 * enter submits more than two, and merges requests for adjacent offsets in the
 * plug. The virtual disk of docs/benchmarks.md ("Where the time goes") serves a
 * merged request whole: four 256 KiB reads at depth 4 became one 1 MiB request,
 * one in flight at the device instead of four; reads ran at 0.64-0.78 x fio,
 * and at 0.70-0.85 x with two per enter (no plug: the requests fio's one per
 * enter gives, at half its system calls). Four measured best on earlier machines
 * (docs/benchmarks-history.md section 11.2); submit_group sets it per ring. */
#define SUBMIT_GROUP 2

/* user_data of operation i of the batch in slot s, and the batch id Python sees */
static inline uint64_t op_ud(RingObject *self, int32_t s, uint32_t i) {
    return (uint64_t)self->b[s].gen << 48 | (uint64_t)s << 32 | i;
}
static inline long batch_id(RingObject *self, int32_t s) { return (long)self->b[s].gen << 16 | s; }

/* slot of a live batch from its id's (gen, slot), or -1 */
static int32_t batch_find(RingObject *self, uint32_t s, uint16_t gen) {
    return s < self->cap && self->b[s].live && self->b[s].gen == gen ? (int32_t)s : -1;
}

static int32_t batch_alloc(RingObject *self, uint32_t n) {
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
    b->ops = PyMem_Malloc(n * (sizeof(ring_op) + sizeof(int32_t)));
    if (!b->ops) {
        PyErr_NoMemory();
        return -1;
    }
    self->free_head = b->link;
    b->res = (int32_t *)(b->ops + n);
    b->n = b->left = n;
    b->next = 0;
    b->live = 1;
    b->link = -1;
    return s;
}

static void batch_free(RingObject *self, int32_t s) {
    ring_batch *b = &self->b[s];
    PyMem_Free(b->ops);
    b->ops = NULL;
    b->res = NULL;
    b->live = 0;
    b->gen++;
    b->link = self->free_head;
    self->free_head = s;
}

static void queue_push(RingObject *self, int32_t s) {
    self->b[s].link = -1;
    if (self->qtail >= 0) self->b[self->qtail].link = s;
    else self->qhead = s;
    self->qtail = s;
}

static void queue_remove(RingObject *self, int32_t s) {
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
static int batch_report(RingObject *self, int32_t s, PyObject *done) {
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

/* Operation i of batch s has its result; the batch is reported if it was the last. */
static int op_done(RingObject *self, int32_t s, uint32_t i, int32_t res, PyObject *done) {
    ring_batch *b = &self->b[s];
    b->res[i] = res;
    return --b->left == 0 ? batch_report(self, s, done) : 0;
}

static void ring_close_impl(RingObject *self) {
    if (self->open) {
        io_uring_queue_exit(&self->ring);
        close(self->efd);
        self->open = 0;
    }
    /* batches still here are dropped: their operations will never run (the
     * queued ones) or the ring that ran them is gone */
    for (uint32_t s = 0; s < self->cap; s++) PyMem_Free(self->b[s].ops);
    PyMem_Free(self->b);
    self->b = NULL;
    self->cap = 0;
    self->free_head = self->qhead = self->qtail = -1;
    self->in_flight = 0;
    self->bytes = 0;
}

static void Ring_dealloc(RingObject *self) {
    ring_close_impl(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"entries", "depth", "max_ops", "min_bytes", "submit_group", NULL};
    unsigned entries = 128, depth = 0, max_ops = 0, submit_group = SUBMIT_GROUP;
    unsigned long long min_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|IIIKI", kwlist, &entries, &depth, &max_ops, &min_bytes,
                                     &submit_group))
        return -1;
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Ring already initialised");
        return -1;
    }
    if (max_ops == 0 || max_ops > entries) max_ops = entries; /* the CQ (2 x entries) can never overflow */
    if (depth == 0 || depth > max_ops) depth = max_ops;
    int ret = io_uring_queue_init(entries, &self->ring, 0);
    if (ret < 0) {
        errno = -ret;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->efd < 0) {
        io_uring_queue_exit(&self->ring);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    ret = io_uring_register_eventfd(&self->ring, self->efd);
    if (ret < 0) {
        io_uring_queue_exit(&self->ring);
        close(self->efd);
        errno = -ret;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->entries = entries;
    self->depth = depth;
    self->max_ops = max_ops;
    self->min_bytes = min_bytes;
    self->submit_group = submit_group;
    self->free_head = self->qhead = self->qtail = -1;
    self->open = 1;
    return 0;
}

#define REQUIRE_OPEN(self)                                              \
    if (!(self)->open) {                                                \
        PyErr_SetString(PyExc_ValueError, "Ring is closed");            \
        return NULL;                                                    \
    }

static PyObject *Ring_fileno(RingObject *self, PyObject *unused) {
    REQUIRE_OPEN(self);
    return PyLong_FromLong(self->efd);
}

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

static int ring_enter_nogil(RingObject *self) {
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
static int ring_refused(RingObject *self, int err, PyObject *done) {
    struct io_uring_sq *sq = &self->ring.sq;
    unsigned mask = *sq->kring_mask;
    int rc = 0;
    for (unsigned p = io_uring_smp_load_acquire(sq->khead); p != sq->sqe_tail; p++) {
        struct io_uring_sqe *sqe = &sq->sqes[p & mask]; /* liburing >= 2.2 maps the SQ array 1:1 */
        uint64_t ud = sqe->user_data;
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, (void *)(uintptr_t)INTERNAL_TAG);
        if (ud == INTERNAL_TAG) continue;
        int32_t s = batch_find(self, (ud >> 32) & 0xffff, ud >> 48);
        if (s < 0) continue;
        uint32_t i = (uint32_t)ud;
        self->in_flight--;
        self->bytes -= self->b[s].ops[i].len;
        if (op_done(self, s, i, -err, done) < 0) rc = -1;
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
static int ring_pump(RingObject *self, PyObject *done) {
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
        ring_op *o = &b->ops[b->next];
        if (o->op == OP_READ)
            io_uring_prep_read(sqe, o->fd, (void *)(uintptr_t)o->addr, o->len, o->off);
        else if (o->op == OP_WRITE)
            io_uring_prep_write(sqe, o->fd, (const void *)(uintptr_t)o->addr, o->len, o->off);
        else
            io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, (void *)(uintptr_t)op_ud(self, s, b->next));
        b->res[b->next] = RES_PENDING; /* the ring owns it until its completion is reaped */
        self->in_flight++;
        self->bytes += o->len;
        count++;
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

/* start(ops) -> id: queues a batch; ops is a sequence of (op, fd, addr,
 * length, offset). Nothing is submitted until pump() or reap(). */
static PyObject *Ring_start(RingObject *self, PyObject *arg) {
    REQUIRE_OPEN(self);
    PyObject *seq = PySequence_Fast(arg, "start() takes a sequence of (op, fd, addr, length, offset)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n <= 0 || n > (Py_ssize_t)UINT32_MAX) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "start() takes 1 to 2**32-1 operations");
        return NULL;
    }
    int32_t s = batch_alloc(self, (uint32_t)n);
    if (s < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    ring_batch *b = &self->b[s];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
            PyErr_SetString(PyExc_TypeError, "an operation is a tuple (op, fd, addr, length, offset)");
            break;
        }
        ring_op *o = &b->ops[i];
        long op, fd;
        unsigned long long len;
        if (((op = PyLong_AsLong(PyTuple_GET_ITEM(item, 0))) == -1 && PyErr_Occurred()) ||
            ((fd = PyLong_AsLong(PyTuple_GET_ITEM(item, 1))) == -1 && PyErr_Occurred()) ||
            ((o->addr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 2))) == (uint64_t)-1 && PyErr_Occurred()) ||
            ((len = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 3))) == (uint64_t)-1 && PyErr_Occurred()) ||
            ((o->off = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 4))) == (uint64_t)-1 && PyErr_Occurred()))
            break;
        if (op < OP_READ || op > OP_NOP || fd < INT32_MIN || fd > INT32_MAX || len > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "bad operation (op %ld, fd %ld, length %llu)", op, fd, len);
            break;
        }
        o->op = (uint8_t)op;
        o->fd = (int32_t)fd;
        o->len = (uint32_t)len;
        b->res[i] = -ECANCELED; /* what a queued operation gets when its batch is cancelled */
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        batch_free(self, s);
        return NULL;
    }
    queue_push(self, s);
    return PyLong_FromLong(batch_id(self, s));
}

/* pump() -> [(id, results), ...]: submits what the limits allow (see
 * ring_pump); returns the batches that a refused submission completed. */
static PyObject *Ring_pump(RingObject *self, PyObject *unused) {
    REQUIRE_OPEN(self);
    PyObject *done = PyList_New(0);
    if (done && ring_pump(self, done) < 0) Py_CLEAR(done);
    return done;
}

/* reap() -> [(id, results), ...]: takes every completion available now (and
 * drains the eventfd), then pumps; returns the batches now complete, each with
 * its results in operation order (byte count or -errno). */
static PyObject *Ring_reap(RingObject *self, PyObject *unused) {
    REQUIRE_OPEN(self);
    uint64_t junk;
    /* one read returns and clears the whole eventfd counter */
    if (read(self->efd, &junk, sizeof junk) < 0 && errno != EAGAIN) {
    }
    PyObject *done = PyList_New(0);
    if (!done) return NULL;
    int rc = 0;
    struct io_uring_cqe *cqe;
    while (io_uring_peek_cqe(&self->ring, &cqe) == 0 && cqe) {
        uint64_t ud = (uint64_t)(uintptr_t)io_uring_cqe_get_data(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&self->ring, cqe);
        if (ud == INTERNAL_TAG) continue;
        int32_t s = batch_find(self, (ud >> 32) & 0xffff, ud >> 48);
        if (s < 0) continue;
        uint32_t i = (uint32_t)ud;
        self->in_flight--;
        self->bytes -= self->b[s].ops[i].len;
        if (op_done(self, s, i, res, done) < 0) rc = -1;
    }
    if (rc == 0) rc = ring_pump(self, done);
    if (rc < 0) Py_CLEAR(done);
    return done;
}

/* cancel(id) -> [(id, results), ...]: the batch's queued operations get
 * -ECANCELED without running; the kernel is asked (IORING_OP_ASYNC_CANCEL,
 * one io_uring_enter) to cancel those it owns, whose completions (-ECANCELED
 * or their real results) still arrive through reap(). Returns the batch if it
 * is complete now. A cancel request that cannot be submitted is dropped: the
 * operation then simply runs to its end; the request itself touches no buffer. */
static PyObject *Ring_cancel(RingObject *self, PyObject *arg) {
    REQUIRE_OPEN(self);
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    PyObject *done = PyList_New(0);
    if (!done) return NULL;
    int32_t s = batch_find(self, id & 0xffff, (uint16_t)(id >> 16));
    if (s < 0) return done; /* already complete and reported */
    ring_batch *b = &self->b[s];
    if (b->next < b->n) {
        queue_remove(self, s);
        b->left -= b->n - b->next; /* their results are -ECANCELED already */
        b->next = b->n;
    }
    int ok = 1;
    for (uint32_t i = 0; ok && i < b->n; i++) {
        if (b->res[i] != RES_PENDING) continue;
        struct io_uring_sqe *sqe = io_uring_get_sqe(&self->ring);
        if (!sqe && (ok = ring_enter_nogil(self) == 0)) sqe = io_uring_get_sqe(&self->ring);
        if (!sqe) break;
        io_uring_prep_cancel(sqe, (void *)(uintptr_t)op_ud(self, s, i), 0);
        io_uring_sqe_set_data(sqe, (void *)(uintptr_t)INTERNAL_TAG);
    }
    /* only our own tagged requests can be pending here (every pump enters what
     * it prepared), so a refusal fails no operation */
    if (io_uring_sq_ready(&self->ring)) {
        int ret = ring_enter_nogil(self);
        if (ret < 0 && ring_refused(self, -ret, done) < 0) {
            Py_DECREF(done);
            return NULL;
        }
    }
    s = batch_find(self, id & 0xffff, (uint16_t)(id >> 16));
    if (s >= 0 && self->b[s].left == 0 && batch_report(self, s, done) < 0) Py_CLEAR(done);
    return done;
}

/* wait(): block (GIL released) until at least one completion is ready. Used
 * by the synchronous drain in close(). */
static PyObject *Ring_wait(RingObject *self, PyObject *unused) {
    REQUIRE_OPEN(self);
    struct io_uring_cqe *cqe = NULL;
    int ret;
    Py_BEGIN_ALLOW_THREADS
    do {
        ret = io_uring_wait_cqe(&self->ring, &cqe);
    } while (ret == -EINTR);
    Py_END_ALLOW_THREADS
    if (ret < 0) {
        errno = -ret;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* _inject_submit(err=0, consume=0): test hook for the next submission. */
static PyObject *Ring_inject_submit(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"err", "consume", NULL};
    int err = 0, consume = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|ii", kwlist, &err, &consume)) return NULL;
    self->inject_err = err;
    self->inject_consume = consume;
    Py_RETURN_NONE;
}

static PyObject *Ring_close(RingObject *self, PyObject *unused) {
    ring_close_impl(self);
    Py_RETURN_NONE;
}

static PyObject *Ring_get_in_flight(RingObject *self, void *unused) { return PyLong_FromUnsignedLong(self->in_flight); }

static PyObject *Ring_get_min_bytes(RingObject *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->min_bytes);
}

static int Ring_set_min_bytes(RingObject *self, PyObject *v, void *unused) {
    unsigned long long x = v ? PyLong_AsUnsignedLongLong(v) : 0;
    if (!v) PyErr_SetString(PyExc_AttributeError, "min_bytes cannot be deleted");
    return PyErr_Occurred() ? -1 : (self->min_bytes = x, 0);
}

static PyObject *Ring_get_submit_group(RingObject *self, void *unused) {
    return PyLong_FromUnsignedLong(self->submit_group);
}

static int Ring_set_submit_group(RingObject *self, PyObject *v, void *unused) {
    unsigned long x = v ? PyLong_AsUnsignedLong(v) : 0;
    if (!v) PyErr_SetString(PyExc_AttributeError, "submit_group cannot be deleted");
    return PyErr_Occurred() ? -1 : (self->submit_group = (unsigned)x, 0);
}

static PyGetSetDef Ring_getset[] = {
    {"in_flight", (getter)Ring_get_in_flight, NULL, "operations the kernel owns (prepared, not yet reaped)", NULL},
    {"min_bytes", (getter)Ring_get_min_bytes, (setter)Ring_set_min_bytes,
     "below this many bytes in flight, up to max_ops operations go to the kernel, else depth", NULL},
    {"submit_group", (getter)Ring_get_submit_group, (setter)Ring_set_submit_group,
     "operations per io_uring_enter (0: all prepared at once)", NULL},
    {NULL}};

static PyMethodDef Ring_methods[] = {
    {"fileno", (PyCFunction)Ring_fileno, METH_NOARGS, "eventfd signalled on completions"},
    {"start", (PyCFunction)Ring_start, METH_O, "start([(op, fd, addr, len, off), ...]) -> batch id (queued)"},
    {"pump", (PyCFunction)Ring_pump, METH_NOARGS, "submit queued operations -> [(id, results), ...] completed"},
    {"reap", (PyCFunction)Ring_reap, METH_NOARGS, "take completions, then pump -> [(id, results), ...] completed"},
    {"cancel", (PyCFunction)Ring_cancel, METH_O, "cancel(id): drop queued, cancel submitted -> [(id, results)]"},
    {"wait", (PyCFunction)Ring_wait, METH_NOARGS, "block until a completion is ready"},
    {"_inject_submit", (PyCFunction)(void (*)(void))Ring_inject_submit, METH_VARARGS | METH_KEYWORDS,
     "test hook: _inject_submit(err=0, consume=0) shapes the next submission"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "tear the ring down"},
    {NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aiokv._native.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_doc = "One io_uring instance with an eventfd for completions, running batches of operations.",
};

#endif /* AIOKV_HAVE_URING */

/* Ring where built with liburing, HAVE_URING (1 or 0), and the operation codes
 * (the thread-pool backend takes the same). */
int ring_add(PyObject *m) {
#ifdef AIOKV_HAVE_URING
    if (PyType_Ready(&RingType) < 0) return -1;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        return -1;
    }
    const int have = 1;
#else
    const int have = 0;
#endif
    if (PyModule_AddIntConstant(m, "HAVE_URING", have) < 0 || PyModule_AddIntConstant(m, "OP_READ", OP_READ) < 0 ||
        PyModule_AddIntConstant(m, "OP_WRITE", OP_WRITE) < 0 || PyModule_AddIntConstant(m, "OP_NOP", OP_NOP) < 0)
        return -1;
    return 0;
}
