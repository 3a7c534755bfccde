/* SPDX-License-Identifier: Apache-2.0 */
/*
 * aiokv._native: a small CPython extension over liburing, plus the two helpers
 * the store needs in C (CRC32C and fallocate).
 *
 * Threading contract: a Ring belongs to one thread (the asyncio loop that owns
 * it). Nothing here is shared between threads; the GIL is released around the
 * system calls (io_uring_submit, fallocate) and around CRC32C of large buffers.
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
 * work is here; Python's is per batch (aiokv/io/uring.py).
 *
 * Only the liburing 2.1-2.3 API is used, so Debian 11/12 and Ubuntu 22.04 build.
 * Built without liburing (setup.py, AIOKV_WITHOUT_URING=1: no AIOKV_HAVE_URING) the
 * module has everything but Ring, and HAVE_URING is 0: aiokv then uses its
 * thread-pool I/O backend (aiokv/io/backend.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#ifdef AIOKV_HAVE_URING
#include <liburing.h>
#include <sys/eventfd.h>
#endif
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <time.h>

#include "blake3/blake3.h" /* native/blake3: BLAKE3's C implementation (CC0), for the slot MAC */

#define OP_READ 0
#define OP_WRITE 1
#define OP_NOP 2
#ifdef AIOKV_HAVE_URING /* the io_uring ring; without liburing the module has no Ring (aiokv/io uses threads) */
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
 * enter submits more than two requests, and requests for adjacent offsets (a
 * save's new slots, a load of blocks saved together) are merged in the plug into
 * fewer, larger ones. Whether that helps depends on the device: one virtual
 * disk served merged requests 10-25 % slower (docs/benchmarks.md, "Submission and
 * request merging"; two per enter then), while on the machine of docs/benchmarks.md
 * section 11.2 four per enter moved 0.88-1.17 x fio's bytes where two moved
 * 0.71-1.11 x, on its virtual disk and on file systems over loop devices, 64 KiB
 * to 1 MiB, reads and writes (four as good or better in all cells but one):
 * fewer system calls per operation, and larger requests. Four. */
#define SUBMIT_GROUP 4

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

/* ---- CRC32C (Castagnoli): AVX-512 carry-less folding, else SSE4.2 crc32q, else tables ---- */
static uint32_t crc_table[8][256];
static void crc_zeros_tables(uint32_t zeros[4][256], size_t len);
#define CRC_LONG 8192
#define CRC_SHORT 256
static uint32_t crc_long[4][256];
static uint32_t crc_short[4][256];
static int have_sse42 = 0;
static int have_fold = 0; /* AVX-512 + VPCLMULQDQ, enabled by the OS */
static int cpu_has_fold(void);

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
    crc_zeros_tables(crc_long, CRC_LONG);
    crc_zeros_tables(crc_short, CRC_SHORT);
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) have_sse42 = (c & bit_SSE4_2) != 0;
    have_fold = have_sse42 && cpu_has_fold();
#endif
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
              crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
              crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
              crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
    return crc;
}

/* Shifting a CRC register over zero bytes: the register after A||B (B of
 * length n, started from 0) is shift_n(crc after A) ^ crc of B. shift_n is
 * linear over GF(2), so for a fixed n it is four 256-entry tables, one per
 * byte of the register (Mark Adler's construction, zlib's crc32_combine idea). */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* tables that apply `len` zero bytes (len a power of two, >= 1) to a register */
static void crc_zeros_tables(uint32_t zeros[4][256], size_t len) {
    uint32_t odd[32], even[32];
    odd[0] = 0x82F63B78u; /* one zero bit */
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    uint32_t *op = odd;
    for (;;) {             /* 8 zero bits, 16, ... */
        gf2_square(even, odd);
        op = even;
        len >>= 1;
        if (!len) break;
        gf2_square(odd, even);
        op = odd;
        len >>= 1;
        if (!len) break;
    }
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t crc_shift(const uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

/* Three independent crc32q chains over three adjacent LONG (then SHORT) byte
 * runs, merged with the shift tables: crc32q has a latency of 3 cycles and a
 * throughput of 1 per cycle, so one serial chain runs at a third of the
 * instruction's rate. */
#if defined(__x86_64__)
/* The CRC loops start on a cache line, wherever other code moves them: left to
 * the compiler's 16-byte placement their speed moved by 5-20 % (median per call)
 * from one build to the next with no change to them (measured: builds of this file
 * loaded side by side in one process, called in turn on the same buffers). */
#define HOT_CODE __attribute__((aligned(64)))
/* Three interleaved crc32q chains over 3 * len-byte stripes, merged with the
 * shift table for len bytes; consumes whole stripes from *p / *n. */
HOT_CODE __attribute__((target("sse4.2"))) static uint64_t crc_3way(uint64_t c0, const uint8_t **pp, size_t *np,
                                                                   size_t len, const uint32_t table[4][256]) {
    const uint8_t *p = *pp;
    size_t n = *np;
    while (n >= 3 * len) {
        uint64_t c1 = 0, c2 = 0;
        const uint8_t *end = p + len;
        do {
            uint64_t a, b, d;
            memcpy(&a, p, 8);
            memcpy(&b, p + len, 8);
            memcpy(&d, p + 2 * len, 8);
            c0 = __builtin_ia32_crc32di(c0, a);
            c1 = __builtin_ia32_crc32di(c1, b);
            c2 = __builtin_ia32_crc32di(c2, d);
            p += 8;
        } while (p < end);
        c0 = crc_shift(table, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = crc_shift(table, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * len;
        n -= 3 * len;
    }
    *pp = p;
    *np = n;
    return c0;
}

HOT_CODE __attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c0 = crc;
    while (n && ((uintptr_t)p & 7)) {
        c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
        n--;
    }
    c0 = crc_3way(c0, &p, &n, CRC_LONG, crc_long);
    c0 = crc_3way(c0, &p, &n, CRC_SHORT, crc_short);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c0 = __builtin_ia32_crc32di(c0, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c0;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

/* Carry-less multiply folding (AVX-512 VPCLMULQDQ): the crc32q chains above
 * run at most 8 bytes a cycle; folding runs 16 lanes of 128 bits, 256 bytes an
 * iteration. In the reflected domain a 128-bit lane (little-endian, its bit 0
 * the highest power) is L * x^64 + H (L its low quadword, H its high one). To
 * carry it T bits further on, L * x^(64+T) and H * x^T are taken mod P, which
 * carry-less multiplies by the constants x^(T+31) and x^(T-33) mod P (reflected,
 * 32 bits) do: a reflected product is one bit short, and the constant sits in
 * the low 32 bits. The result stays < 2^128 and is XORed into the lane T bits
 * on. At the end the 64 bytes of state are congruent to everything read so far,
 * so a crc32q pass over them (from a zero register) is the CRC so far: that is
 * the final reduction, no Barrett step needed. tests/test_crc32c.py pins the
 * result to the table path for every length near each boundary. */
#define K2048_L 0xdcb17aa4ull /* x^2079 mod P: lanes move 2048 bits (256 bytes) an iteration */
#define K2048_H 0xb9e02b86ull /* x^2015 mod P */
#define K512_L 0x740eef02ull  /* x^543 mod P: one 64-byte register onto the next */
#define K512_H 0x9e4addf8ull  /* x^479 mod P */
#define CRC_FOLD_MIN 512      /* below this the crc32q path is as fast */

#if defined(__x86_64__)
#ifndef bit_VPCLMULQDQ
#define bit_VPCLMULQDQ (1 << 10)
#endif
static int cpu_has_fold(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xe6) != 0xe6) return 0; /* the OS saves XMM, YMM, opmask and all of ZMM */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b & bit_AVX512F) && (c & bit_VPCLMULQDQ);
}

__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
    __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00), hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96); /* lo ^ hi ^ next */
}

/* Raw register in, raw register out, like crc_hw. */
HOT_CODE __attribute__((target("avx512f,vpclmulqdq,sse4.2"))) static uint32_t crc_fold(uint32_t crc,
                                                                                        const uint8_t *p, size_t n) {
    if (n < 256) return crc_hw(crc, p, n);
    const __m512i k2048 = _mm512_set_epi64(K2048_H, K2048_L, K2048_H, K2048_L, K2048_H, K2048_L, K2048_H, K2048_L);
    const __m512i k512 = _mm512_set_epi64(K512_H, K512_L, K512_H, K512_L, K512_H, K512_L, K512_H, K512_L);
    /* the register enters as the first 32 bits of the message XORed with it */
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                              0, 0, (int)crc));
    __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    p += 256;
    n -= 256;
    while (n >= 256) {
        x0 = fold512(x0, k2048, _mm512_loadu_si512(p));
        x1 = fold512(x1, k2048, _mm512_loadu_si512(p + 64));
        x2 = fold512(x2, k2048, _mm512_loadu_si512(p + 128));
        x3 = fold512(x3, k2048, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    x1 = fold512(x0, k512, x1);
    x2 = fold512(x1, k512, x2);
    x3 = fold512(x2, k512, x3);
    for (; n >= 64; p += 64, n -= 64) x3 = fold512(x3, k512, _mm512_loadu_si512(p));
    uint8_t state[64];
    _mm512_storeu_si512(state, x3);
    return crc_hw(crc_hw(0, state, 64), p, n);
}
#endif

enum { CRC_TABLE, CRC_CRC32Q, CRC_FOLD };

/* CRC32C (seed: a previous result, 0 to start) by the given path, which the
 * caller has checked the CPU has. */
static uint32_t crc32c_by(int path, uint32_t seed, const uint8_t *p, size_t n) {
    uint32_t crc = ~seed;
#if defined(__x86_64__)
    if (path == CRC_FOLD) return ~crc_fold(crc, p, n);
    if (path == CRC_CRC32Q) return ~crc_hw(crc, p, n);
#endif
    return ~crc_sw(crc, p, n);
}

static uint32_t crc32c(uint32_t seed, const uint8_t *p, size_t n) {
    int path = have_fold && n >= CRC_FOLD_MIN ? CRC_FOLD : have_sse42 ? CRC_CRC32Q : CRC_TABLE;
    return crc32c_by(path, seed, p, n);
}

/* crc32c(addr, length, seed=0) -> int */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    unsigned long long addr, length;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "KK|I", &addr, &length, &seed)) return NULL;
    uint32_t r;
    if (length > 65536) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c(seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c(seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
    }
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_sw(buffer, seed=0) -> int: the table-driven path whatever the CPU
 * has (tests check the hardware path against it). */
static PyObject *py_crc32c_sw(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed)) return NULL;
    uint32_t r = ~crc_sw(~seed, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

static const char *const crc_path_names[] = {"table", "crc32q", "fold"};

/* crc32c_path(path, addr, length, seed=0) -> int: CRC32C by one named path
 * ("table", "crc32q", "fold"), GIL released; ValueError where this CPU lacks
 * it. For tests (every path against the table) and benchmarks. */
static PyObject *py_crc32c_path(PyObject *self, PyObject *args) {
    const char *name;
    unsigned long long addr, length;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "sKK|I", &name, &addr, &length, &seed)) return NULL;
    int path = -1;
    for (int i = 0; i < 3; i++)
        if (!strcmp(name, crc_path_names[i])) path = i;
    int have[3] = {1, have_sse42, have_fold};
    if (path < 0 || !have[path]) {
        PyErr_Format(PyExc_ValueError, "aiokv: CRC32C path %s is not one this CPU has (%s)", name,
                     have_fold ? "table, crc32q, fold" : have_sse42 ? "table, crc32q" : "table");
        return NULL;
    }
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = crc32c_by(path, seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_bytes(buffer, seed=0) -> int, for Python-side buffers (GIL released above 64 KiB). */
static PyObject *py_crc32c_bytes(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed)) return NULL;
    uint32_t r;
    if (view.len > 65536) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c(seed, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c(seed, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

/* ---- slot headers, many slots per call ----
 * The layout of aiokv/data/format.py's _HDR ("<8sHHI16sB3xIQ32sQQ") and the
 * header CRC after it, byte for byte (tests/test_native_slot_check_agrees_with_format.py
 * pins the two together): magic, version, header bytes, rank, nsid, key length,
 * payload CRC, payload length, key, sequence, layout tag, CRC of the 96 bytes
 * before it. A slot is HEADER_BYTES of header (the rest zero, or the MAC) and
 * then the payload. */
#define HDR_OFF_MAGIC 0
#define HDR_OFF_VERSION 8
#define HDR_OFF_HBYTES 10
#define HDR_OFF_RANK 12
#define HDR_OFF_NSID 16
#define HDR_OFF_KLEN 32
#define HDR_OFF_PCRC 36
#define HDR_OFF_PLEN 40
#define HDR_OFF_KEY 48
#define HDR_OFF_SEQ 80
#define HDR_OFF_LAYOUT 88
#define HDR_BODY 96
#define HDR_USED 100
#define HDR_BYTES 4096
#define FILE_VERSION 1
#define MAX_KEY 32
static const char BLOCK_MAGIC[8] = {'A', 'I', 'O', 'K', 'V', 'B', 'L', 'K'};

/* Verdicts, in the order checked: index into format.SLOT_REASONS (the one
 * place they are named; SLOT_VERDICTS, exported, is their count). */
enum { SLOT_OK, SLOT_HDR_SHORT, SLOT_HDR_CRC, SLOT_MAGIC, SLOT_VERSION, SLOT_LAYOUT, SLOT_NSID, SLOT_RANK, SLOT_KEY,
       SLOT_PLEN, SLOT_PAYLOAD_SHORT, SLOT_PAYLOAD_CRC, SLOT_MAC, SLOT_VERDICTS };

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

static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); } /* x86-64 and aarch64: little-endian */
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* ---- the slot MAC, with a secret (docs/format.md, "The MAC") ----
 * Scheme 1: keyed BLAKE3-256 (key: mac_key, BLAKE3's derive_key of the secret
 * under MAC_CONTEXT) of the payload, then the 96 header bytes the header CRC
 * covers (the scheme byte at HDR_OFF_MACS among them), at HDR_OFF_MAC. The
 * payload goes first so that BLAKE3's chunks line up with it. Slots without a
 * MAC have scheme 0 there; a reader with a secret takes only scheme 1. */
#define HDR_OFF_MACS 33
#define MAC_SCHEME 1
#define HDR_OFF_MAC 100
#define MAC_BYTES 32
#define MAC_PIECE (64 << 10) /* CRC32C and MAC of one piece after the other: the second reads it from cache */
static const char MAC_CONTEXT[] = "aiokv slot MAC, scheme 1";

static void mac_finish(blake3_hasher *s, const uint8_t *fields, uint8_t *out) {
    blake3_hasher_update(s, fields, HDR_BODY);
    blake3_hasher_finalize(s, out, MAC_BYTES);
}

/* The MAC verdict of slot h (header and plen payload bytes readable): SLOT_MAC
 * unless it carries scheme 1 and the MAC of key mk (compared in constant time);
 * with crc, then SLOT_PAYLOAD_CRC unless the payload matches its CRC too, computed
 * piece by piece in the same pass (the MAC covers the CRC field, not whether
 * the writer got it right: every reader checks it, as without a secret). */
/* One pass over a payload for its MAC (into s, keyed already) and, with crc, its
 * CRC32C, a piece after the other; returns the CRC (0 without crc). */
static uint32_t mac_pass(blake3_hasher *s, const uint8_t *pay, uint64_t plen, int crc) {
    uint32_t pcrc = 0;
    if (!crc) {
        blake3_hasher_update(s, pay, (size_t)plen);
        return 0;
    }
    for (uint64_t off = 0; off < plen; off += MAC_PIECE) {
        size_t k = plen - off < MAC_PIECE ? (size_t)(plen - off) : MAC_PIECE;
        blake3_hasher_update(s, pay + off, k);
        pcrc = crc32c(pcrc, pay + off, k);
    }
    return pcrc;
}

static int mac_verdict(const uint8_t *mk, const uint8_t *h, uint64_t plen, int crc) {
    if (h[HDR_OFF_MACS] != MAC_SCHEME) return SLOT_MAC;
    blake3_hasher s;
    uint8_t m[MAC_BYTES], d = 0;
    blake3_hasher_init_keyed(&s, mk);
    uint32_t pcrc = mac_pass(&s, h + HDR_BYTES, plen, crc);
    mac_finish(&s, h, m);
    for (int i = 0; i < MAC_BYTES; i++) d |= m[i] ^ h[HDR_OFF_MAC + i];
    if (d) return SLOT_MAC;
    return crc && pcrc != get32(h + HDR_OFF_PCRC) ? SLOT_PAYLOAD_CRC : SLOT_OK;
}

/* An optional MAC key argument (None or 32 bytes) into mk; returns 0, or -1 with an exception set. */
static int mac_arg(PyObject *o, uint8_t mk[MAC_BYTES], const uint8_t **pmk) {
    *pmk = NULL;
    if (o == NULL || o == Py_None) return 0;
    char *b;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(o, &b, &n) < 0) return -1;
    if (n != MAC_BYTES) {
        PyErr_SetString(PyExc_ValueError, "aiokv: a MAC key is 32 bytes (format.mac_key)");
        return -1;
    }
    memcpy(mk, b, MAC_BYTES);
    *pmk = mk;
    return 0;
}

/* mac_key(secret) -> 32 bytes: the MAC key of a secret (any bytes). */
static PyObject *py_mac_key(PyObject *self, PyObject *args) {
    Py_buffer sec;
    if (!PyArg_ParseTuple(args, "y*", &sec)) return NULL;
    blake3_hasher s;
    uint8_t k[MAC_BYTES];
    blake3_hasher_init_derive_key(&s, MAC_CONTEXT);
    blake3_hasher_update(&s, sec.buf, (size_t)sec.len);
    blake3_hasher_finalize(&s, k, MAC_BYTES);
    PyBuffer_Release(&sec);
    return PyBytes_FromStringAndSize((const char *)k, MAC_BYTES);
}

/* blake3_keyed(key, data) -> 32 bytes: keyed BLAKE3-256 of a buffer (tests: the published vectors). */
static PyObject *py_blake3_keyed(PyObject *self, PyObject *args) {
    Py_buffer key, data;
    if (!PyArg_ParseTuple(args, "y*y*", &key, &data)) return NULL;
    PyObject *out = NULL;
    if (key.len != BLAKE3_KEY_LEN) {
        PyErr_SetString(PyExc_ValueError, "aiokv: a BLAKE3 key is 32 bytes");
    } else {
        blake3_hasher s;
        uint8_t m[MAC_BYTES];
        blake3_hasher_init_keyed(&s, key.buf);
        Py_BEGIN_ALLOW_THREADS
        blake3_hasher_update(&s, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
        blake3_hasher_finalize(&s, m, MAC_BYTES);
        out = PyBytes_FromStringAndSize((const char *)m, MAC_BYTES);
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&data);
    return out;
}

/* The arguments stamp_slots and verify_slots share: (addrs, keys, nsid, rank,
 * payload_len, layout, crc_in_copy=0, mac_key=None), parsed with the GIL held
 * (slots_parse, mac_arg). 0, or -1 with an exception set and nothing held. */
typedef struct {
    Py_buffer nsid;
    uint8_t ns[16], mkb[MAC_BYTES];
    unsigned int rank;
    unsigned long long plen, layout;
    int crc_in_copy;
    const uint8_t *mk; /* mkb, or NULL: no MAC */
    uint64_t *pa;
    slot_key *pk;
    Py_ssize_t n;
} slots_call;

static int slots_call_parse(PyObject *args, slots_call *c) {
    PyObject *addrs, *keys, *mko = NULL;
    c->crc_in_copy = 0;
    if (!PyArg_ParseTuple(args, "OOy*IKK|pO", &addrs, &keys, &c->nsid, &c->rank, &c->plen, &c->layout,
                          &c->crc_in_copy, &mko))
        return -1;
    if (mac_arg(mko, c->mkb, &c->mk) < 0 || (c->n = slots_parse(addrs, keys, &c->nsid, &c->pa, &c->pk)) < 0) {
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
 * mac_key=None): for each slot, CRC32C its payload and write its header
 * (sequence: the wall clock in ns, as time.time_ns()), zeroing the rest of the
 * header. With crc_in_copy the payload's CRC is not computed: it is the one
 * already at HDR_OFF_PCRC (put there by memcpy_crc_out while it copied the
 * payload in). With a MAC key (a secret's, format.mac_key) the header also
 * gets the MAC (scheme 1), computed in the same pass over the payload as its
 * CRC. One call per chunk, GIL released for all of it. */
static PyObject *py_stamp_slots(PyObject *self, PyObject *args) {
    slots_call c;
    if (slots_call_parse(args, &c) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < c.n; i++) {
        uint8_t *h = (uint8_t *)(uintptr_t)c.pa[i];
        const uint8_t *pay = h + HDR_BYTES;
        blake3_hasher s;
        uint32_t pcrc = 0;
        if (c.mk) {
            blake3_hasher_init_keyed(&s, c.mk);
            pcrc = mac_pass(&s, pay, c.plen, !c.crc_in_copy);
            if (c.crc_in_copy) pcrc = get32(h + HDR_OFF_PCRC);
        } else {
            pcrc = c.crc_in_copy ? get32(h + HDR_OFF_PCRC) : crc32c(0, pay, (size_t)c.plen);
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint8_t hdr[HDR_USED + MAC_BYTES] = {0};
        memcpy(hdr + HDR_OFF_MAGIC, BLOCK_MAGIC, 8);
        put16(hdr + HDR_OFF_VERSION, FILE_VERSION);
        put16(hdr + HDR_OFF_HBYTES, HDR_BYTES);
        put32(hdr + HDR_OFF_RANK, c.rank);
        memcpy(hdr + HDR_OFF_NSID, c.ns, 16);
        hdr[HDR_OFF_KLEN] = c.pk[i].len;
        hdr[HDR_OFF_MACS] = c.mk ? MAC_SCHEME : 0;
        put32(hdr + HDR_OFF_PCRC, pcrc);
        put64(hdr + HDR_OFF_PLEN, c.plen);
        memcpy(hdr + HDR_OFF_KEY, c.pk[i].b, MAX_KEY);
        put64(hdr + HDR_OFF_SEQ, (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec);
        put64(hdr + HDR_OFF_LAYOUT, c.layout);
        put32(hdr + HDR_BODY, crc32c(0, hdr, HDR_BODY));
        if (c.mk) mac_finish(&s, hdr, hdr + HDR_OFF_MAC);
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
 * layout NULL: any layout; upto: CHECK_*; mk: a MAC key, or NULL. With mk the
 * MAC is checked past CHECK_SELF, at CHECK_HEADER as well (the payload CRC is
 * then the device copy's to check), at CHECK_SLOT with the payload CRC in the
 * same pass (mac_verdict). Returns the first check failed (SLOT_*), SLOT_OK if
 * none. Inlined in both callers: in verify_slots' loop
 * the key, layout and length are always there, and their tests fold away. */
static inline __attribute__((always_inline)) int slot_verdict(const uint8_t *h, uint64_t avail, const uint8_t *ns,
                                                               uint32_t rank, uint64_t plen, const slot_key *k,
                                                               const uint64_t *layout, int upto,
                                                               const uint8_t *mk) {
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
    if (upto == CHECK_HEADER && !mk) return SLOT_OK;
    if (avail < HDR_BYTES || avail - HDR_BYTES < plen) return SLOT_PAYLOAD_SHORT;
    if (mk) return mac_verdict(mk, h, plen, upto == CHECK_SLOT); /* CHECK_HEADER: the copy checks the CRC */
    if (crc32c(0, h + HDR_BYTES, (size_t)plen) != get32(h + HDR_OFF_PCRC)) return SLOT_PAYLOAD_CRC;
    return SLOT_OK;
}

/* verify_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy=0,
 * mac_key=None) -> bytes: per slot 0 (valid for that key) or the index in
 * format.SLOT_REASONS of the first check it fails (slot_verdict; each
 * address a whole slot); with crc_in_copy the payload CRC is left to the
 * caller (never reported); with a MAC key the MAC is checked (crc_in_copy or
 * not). One call per chunk, GIL released for all of it. */
static PyObject *py_verify_slots(PyObject *self, PyObject *args) {
    slots_call c;
    if (slots_call_parse(args, &c) < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, c.n);
    if (out) {
        uint8_t *v = (uint8_t *)PyBytes_AS_STRING(out);
        uint64_t lay = c.layout;
        int upto = c.crc_in_copy ? CHECK_HEADER : CHECK_SLOT;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < c.n; i++)
            v[i] = (uint8_t)slot_verdict((const uint8_t *)(uintptr_t)c.pa[i], HDR_BYTES + c.plen, c.ns, c.rank, c.plen,
                                         &c.pk[i], &lay, upto, c.mk);
        Py_END_ALLOW_THREADS
    }
    slots_call_release(&c);
    return out;
}

/* check_slot(buffer, nsid, rank, payload_len, key, layout, upto, mac_key=None)
 * -> int: the verdict of slot_verdict for one slot in any buffer (bytes,
 * ctypes memory over a staging slot), as verify_slots gives it; key or layout
 * None: any; upto: CHECK_*; mac_key: check the MAC too. What format.check_slot,
 * check_header and unpack_header call. GIL released over a payload of more
 * than 64 KiB. */
static PyObject *py_check_slot(PyObject *self, PyObject *args) {
    Py_buffer buf, nsid;
    unsigned int rank;
    unsigned long long plen;
    PyObject *key, *layout, *mko = NULL;
    int upto;
    if (!PyArg_ParseTuple(args, "y*y*IKOOi|O", &buf, &nsid, &rank, &plen, &key, &layout, &upto, &mko)) return NULL;
    slot_key k, *kp = NULL;
    uint64_t lay, *lp = NULL;
    uint8_t mkb[MAC_BYTES];
    const uint8_t *mk = NULL;
    int verdict = -1;
    if (mac_arg(mko, mkb, &mk) < 0) goto done;
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
    if (upto == CHECK_SELF) mk = NULL; /* the header's own integrity only */
    if ((upto == CHECK_SLOT || mk) && plen > 65536) {
        Py_BEGIN_ALLOW_THREADS
        verdict = slot_verdict(buf.buf, (uint64_t)buf.len, nsid.buf, rank, plen, kp, lp, upto, mk);
        Py_END_ALLOW_THREADS
    } else {
        verdict = slot_verdict(buf.buf, (uint64_t)buf.len, nsid.buf, rank, plen, kp, lp, upto, mk);
    }
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&nsid);
    return verdict < 0 ? NULL : PyLong_FromLong(verdict);
}

/* fallocate(fd, mode, offset, length): Linux fallocate(2), GIL released. */
static PyObject *py_fallocate(PyObject *self, PyObject *args) {
    int fd, mode;
    long long off, len;
    if (!PyArg_ParseTuple(args, "iiLL", &fd, &mode, &off, &len)) return NULL;
    int ret;
    Py_BEGIN_ALLOW_THREADS
    ret = fallocate(fd, mode, (off_t)off, (off_t)len);
    Py_END_ALLOW_THREADS
    if (ret < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* memcpy_many(dst_addrs, src_addrs, nbytes): for each i, copy nbytes from
 * src_addrs[i] to dst_addrs[i]; the address lists are native int64 arrays
 * (bytes-like). Whole-block device copies on the CPU: one call per step and
 * layer set, the GIL released for the copying. */
static PyObject *py_memcpy_many(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "y*y*K", &dst, &src, &nbytes)) return NULL;
    if (dst.len != src.len || dst.len % 8) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "address arrays must be int64 arrays of equal length");
        return NULL;
    }
    Py_ssize_t n = dst.len / 8;
    const uint64_t *d = dst.buf, *s = src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], nbytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* ---- device copies fused with the payload CRC32C ----
 * A staging slot's payload is its block's layer segments (nbytes each) one
 * after the other. Copying a segment and checksumming it are two passes over
 * the same bytes; done a cache-sized piece at a time, the second pass reads the
 * piece from cache instead of DRAM, which removes the separate CRC pass over
 * every byte saved or loaded. */
#ifndef COPY_PIECE /* (tools/bench_crc_in_copy.py, built with -DCOPY_PIECE=...): 8-16 KiB pieces were the */
#define COPY_PIECE (16 << 10) /* cheapest, 4 KiB and 32-256 KiB cost 0.01-0.03 core-s/GB more on loads */
#endif

/* Parses (slot_addrs, seg_addrs): int64 arrays, n slot bases and n * layers
 * segment addresses, layer-major (layer l of slot i at [l * n + i]). Returns
 * the layer count, or -1 with an exception set. */
static Py_ssize_t copy_parse(Py_buffer *slots, Py_buffer *segs, Py_ssize_t *n) {
    *n = slots->len / 8;
    if (slots->len % 8 || segs->len % 8 || !*n || (segs->len / 8) % *n || segs->len / 8 < *n) {
        PyErr_SetString(PyExc_ValueError, "aiokv: address arrays must be int64 arrays, a whole number of segments "
                                          "(layers) per slot, at least one slot");
        return -1;
    }
    return segs->len / 8 / *n;
}

/* memcpy_crc_out(slot_addrs, seg_addrs, nbytes): for each slot, copy its
 * layers' segments into its payload, in order, and put the payload's CRC32C
 * at HDR_OFF_PCRC of its header, for stamp_slots(..., crc_in_copy=1). Each
 * piece is checksummed in the destination just after it was written (what
 * goes to disk is what the CRC covers). GIL released. */
static PyObject *py_memcpy_crc_out(PyObject *self, PyObject *args) {
    Py_buffer slots, segs;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "y*y*K", &slots, &segs, &nbytes)) return NULL;
    Py_ssize_t n, layers = copy_parse(&slots, &segs, &n);
    if (layers >= 0) {
        const uint64_t *sa = slots.buf, *ga = segs.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t *dst = (uint8_t *)(uintptr_t)sa[i] + HDR_BYTES;
            uint32_t crc = 0;
            for (Py_ssize_t l = 0; l < layers; l++) {
                const uint8_t *src = (const uint8_t *)(uintptr_t)ga[l * n + i];
                for (size_t off = 0; off < nbytes; off += COPY_PIECE) {
                    size_t k = nbytes - off < COPY_PIECE ? nbytes - off : COPY_PIECE;
                    memcpy(dst, src + off, k);
                    crc = crc32c(crc, dst, k);
                    dst += k;
                }
            }
            put32((uint8_t *)(uintptr_t)sa[i] + HDR_OFF_PCRC, crc);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&slots);
    PyBuffer_Release(&segs);
    if (layers < 0) return NULL;
    Py_RETURN_NONE;
}

/* memcpy_crc_in(seg_addrs, slot_addrs, nbytes) -> bytes: for each slot,
 * copy its payload into its layers' segments, checksumming each piece just
 * before it is copied; per slot 0 if the payload's CRC32C equals the one in
 * its header, else SLOT_PAYLOAD_CRC (format.SLOT_REASONS). The copy is made
 * either way: the caller reports a mismatched block as a failed load, and its
 * KV blocks are recomputed in place. The header itself is checked before
 * (verify_slots(..., crc_in_copy=1)). GIL released. */
static PyObject *py_memcpy_crc_in(PyObject *self, PyObject *args) {
    Py_buffer slots, segs;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "y*y*K", &segs, &slots, &nbytes)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t n, layers = copy_parse(&slots, &segs, &n);
    if (layers >= 0 && (out = PyBytes_FromStringAndSize(NULL, n))) {
        const uint64_t *sa = slots.buf, *ga = segs.buf;
        uint8_t *v = (uint8_t *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint8_t *src = (const uint8_t *)(uintptr_t)sa[i] + HDR_BYTES;
            uint32_t crc = 0;
            for (Py_ssize_t l = 0; l < layers; l++) {
                uint8_t *dst = (uint8_t *)(uintptr_t)ga[l * n + i];
                for (size_t off = 0; off < nbytes; off += COPY_PIECE) {
                    size_t k = nbytes - off < COPY_PIECE ? nbytes - off : COPY_PIECE;
                    crc = crc32c(crc, src, k);
                    memcpy(dst + off, src, k);
                    src += k;
                }
            }
            v[i] = crc == get32((const uint8_t *)(uintptr_t)sa[i] + HDR_OFF_PCRC) ? SLOT_OK : SLOT_PAYLOAD_CRC;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&slots);
    PyBuffer_Release(&segs);
    return out;
}

static PyMethodDef module_methods[] = {
    {"memcpy_many", py_memcpy_many, METH_VARARGS, "memcpy_many(dst_addrs, src_addrs, nbytes)"},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(addr, length, seed=0) -> int"},
    {"crc32c_bytes", py_crc32c_bytes, METH_VARARGS, "crc32c_bytes(buffer, seed=0) -> int"},
    {"crc32c_path", py_crc32c_path, METH_VARARGS, "crc32c_path(path, addr, length, seed=0) -> int (tests, benchmarks)"},
    {"crc32c_sw", py_crc32c_sw, METH_VARARGS, "crc32c_sw(buffer, seed=0) -> int (table path, for tests)"},
    {"memcpy_crc_out", py_memcpy_crc_out, METH_VARARGS,
     "memcpy_crc_out(slot_addrs, seg_addrs, nbytes): segments -> payloads, CRC32C into the headers"},
    {"memcpy_crc_in", py_memcpy_crc_in, METH_VARARGS,
     "memcpy_crc_in(seg_addrs, slot_addrs, nbytes) -> bytes of verdicts (0 or payload checksum)"},
    {"stamp_slots", py_stamp_slots, METH_VARARGS,
     "stamp_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy=0, mac_key=None)"},
    {"verify_slots", py_verify_slots, METH_VARARGS,
     "verify_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy=0, mac_key=None) -> bytes of verdicts"},
    {"check_slot", py_check_slot, METH_VARARGS,
     "check_slot(buffer, nsid, rank, payload_len, key, layout, upto, mac_key=None) -> verdict (key, layout None: any)"},
    {"fallocate", py_fallocate, METH_VARARGS, "fallocate(fd, mode, offset, length)"},
    {"mac_key", py_mac_key, METH_VARARGS, "mac_key(secret) -> the 32-byte MAC key of a secret (format.mac_key)"},
    {"blake3_keyed", py_blake3_keyed, METH_VARARGS, "blake3_keyed(key, data) -> keyed BLAKE3-256 (tests)"},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "aiokv._native",
                                       "io_uring ring, CRC32C and fallocate for aiokv", -1,
                                       module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
#ifdef AIOKV_HAVE_URING
    if (PyType_Ready(&RingType) < 0) return NULL;
#endif
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
#ifdef AIOKV_HAVE_URING
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "HAVE_URING", 1);
#else
    PyModule_AddIntConstant(m, "HAVE_URING", 0);
#endif
    PyModule_AddIntConstant(m, "CHECK_SELF", CHECK_SELF);
    PyModule_AddIntConstant(m, "CHECK_HEADER", CHECK_HEADER);
    PyModule_AddIntConstant(m, "CHECK_SLOT", CHECK_SLOT);
    PyModule_AddIntConstant(m, "SLOT_VERDICTS", SLOT_VERDICTS);
    PyModule_AddIntConstant(m, "MAC_SCHEME", MAC_SCHEME);
    PyModule_AddIntConstant(m, "OP_READ", OP_READ);
    PyModule_AddIntConstant(m, "OP_WRITE", OP_WRITE);
    PyModule_AddIntConstant(m, "OP_NOP", 2);
    PyModule_AddIntConstant(m, "FALLOC_FL_KEEP_SIZE", 0x01);
    PyModule_AddIntConstant(m, "FALLOC_FL_PUNCH_HOLE", 0x02);
    PyModule_AddIntConstant(m, "HAVE_HW_CRC", have_sse42);
    PyModule_AddStringConstant(m, "CRC_PATH", crc_path_names[have_fold ? CRC_FOLD : have_sse42 ? CRC_CRC32Q : CRC_TABLE]);
    /* every path this CPU runs, slowest first (crc32c_path takes each) */
    PyModule_AddObject(m, "CRC_PATHS", have_fold ? Py_BuildValue("(sss)", "table", "crc32q", "fold")
                                       : have_sse42 ? Py_BuildValue("(ss)", "table", "crc32q")
                                                    : Py_BuildValue("(s)", "table"));
    return m;
}
