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
 *
 * This unit is the Python type; native/ring.h lists the others: the batches, the submissions.
 */
#include "ring.h"

#ifdef AIOKV_HAVE_URING

/* Default operations per io_uring_enter. Linux plugs the block layer while one
 * enter submits more than two, and merges requests for adjacent offsets in the
 * plug. The virtual disk of docs/benchmarks.md ("Where the time goes") serves a
 * merged request whole: four 256 KiB reads at depth 4 became one 1 MiB request,
 * one in flight at the device instead of four; reads ran at 0.64-0.78 x fio,
 * and at 0.70-0.85 x with two per enter (no plug: the requests fio's one per
 * enter gives, at half its system calls). Four measured best on earlier machines
 * (docs/benchmarks-history.md section 11.2); submit_group sets it per ring. */
#define SUBMIT_GROUP 2

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
    static char *kwlist[] = {"entries", "depth", "max_ops", "min_bytes", "submit_group", "merge_bytes", NULL};
    unsigned entries = 128, depth = 0, max_ops = 0, submit_group = SUBMIT_GROUP, merge_bytes = 0;
    unsigned long long min_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|IIIKII", kwlist, &entries, &depth, &max_ops, &min_bytes,
                                     &submit_group, &merge_bytes))
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
    self->merge_bytes = merge_bytes;
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
        if (op_parse(PySequence_Fast_GET_ITEM(seq, i), &b->ops[i]) < 0) break;
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
        if (op_left_kernel(self, ud, res, done) < 0) rc = -1;
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
    /* one request per kernel entry: a merged write's first operation names it */
    for (uint32_t i = 0; ok && i < b->n; i += b->ops[i].span) {
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

static PyObject *Ring_get_merge_bytes(RingObject *self, void *unused) {
    return PyLong_FromUnsignedLong(self->merge_bytes);
}

static int Ring_set_merge_bytes(RingObject *self, PyObject *v, void *unused) {
    unsigned long x = v ? PyLong_AsUnsignedLong(v) : 0;
    if (!v) PyErr_SetString(PyExc_AttributeError, "merge_bytes cannot be deleted");
    else if (!PyErr_Occurred() && x > UINT32_MAX) PyErr_SetString(PyExc_OverflowError, "merge_bytes over 4 GiB");
    return PyErr_Occurred() ? -1 : (self->merge_bytes = (unsigned)x, 0);
}

static PyGetSetDef Ring_getset[] = {
    {"in_flight", (getter)Ring_get_in_flight, NULL, "entries the kernel owns (prepared, not yet reaped; a merged write counts once)", NULL},
    {"min_bytes", (getter)Ring_get_min_bytes, (setter)Ring_set_min_bytes,
     "below this many bytes in flight, up to max_ops operations go to the kernel, else depth", NULL},
    {"submit_group", (getter)Ring_get_submit_group, (setter)Ring_set_submit_group,
     "operations per io_uring_enter (0: all prepared at once)", NULL},
    {"merge_bytes", (getter)Ring_get_merge_bytes, (setter)Ring_set_merge_bytes,
     "adjacent writes of one batch go to the kernel as one vectored write of up to this many bytes (0: never)",
     NULL},
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
