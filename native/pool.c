/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Pool: threads of our own running batches of reads and writes with preadv and pwritev,
 * for aiokv/data/threads.py, the backend where io_uring is refused (a container's seccomp
 * profile) or where an io_uring submission could block the loop (FUSE, network file systems).
 *
 * The Ring's shape (ring.c), threads in the kernel's place: Python hands a whole batch in
 * one call (start); the threads take its operations in order, a batch's adjacent writes to
 * one file as one pwritev (ops.h, op_run: up to merge_bytes and MERGE_MAX_OPS buffers), each
 * operation keeping its own result (an error is each one's; a short count covers them in
 * file order); the thread that ends a batch's last system call puts it on the done list and
 * signals the eventfd if the list was empty; reap() on the loop thread takes the list. No
 * pool thread ever takes the GIL: Python's work is per batch, as with the Ring. (Python's
 * own thread pool took the GIL twice per operation, and a hand-off to the loop per batch:
 * 256 KiB reads cost 2-4 x the CPU of a ring's, docs/benchmarks.md.)
 *
 * Threading contract: a Pool object belongs to one thread (the asyncio loop that owns it),
 * which calls start, reap, cancel and close with the GIL held. Its threads touch only the
 * shared core, under the core's mutex (held across no system call but the eventfd's
 * non-blocking write), and the buffers and results of the operations they run: a result is
 * written before the mutex is taken to count the operation off, and read by reap after the
 * batch was taken off the done list under it.
 *
 * Failure contract: an operation's error is its own result (-errno, EINTR retried). A
 * thread stuck in a system call for ever (a hung disk, a dead FUSE daemon) holds only its
 * own place; the others go on, and later operations queue behind the busy ones. cancel()
 * drops a batch's operations no thread has taken (-ECANCELED) and cannot interrupt those in
 * a system call: the batch is reported once they end, and only then may its buffers be
 * reused (backend.py's contract). close() drops what is queued (-ECANCELED), returns every
 * batch then complete, and does not wait for a stuck thread: the batches a thread is still
 * in become orphans, freed by the thread that ends them, never reported (their buffers are
 * never safe to hand back); the core is freed by whichever of the Pool and its threads lets
 * go last. A reap or cancel that cannot build its report (no memory) leaves its batches to
 * the next reap; close, which has no next, frees them and raises. Operation fields
 * must be ints (no Python code runs while a batch is parsed).
 */
#include "ops.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#define POOL_MAX_THREADS 256
#define POOL_MAX_BATCHES 0xfffe /* slots; a slot number fits 16 bits */
#define POOL_STACK_BYTES (256 << 10)

/* A batch: its operations, their iovecs and results in one allocation with it. */
typedef struct pool_batch {
    io_op *ops;
    struct iovec *iov;
    int32_t *res;
    uint32_t n;
    uint32_t next;   /* operations [next, n) are queued: no thread has taken them */
    uint32_t left;   /* operations without a result */
    uint32_t slot;   /* its place in the Pool's table (the loop thread's) */
    uint8_t orphan;  /* its Pool closed: the thread that ends it frees it */
    struct pool_batch *qnext; /* next in the queue, or on the done list */
} pool_batch;

/* What the Pool and its threads share; freed by the last of them (refs). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work;
    pool_batch *qhead, *qtail; /* batches with queued operations, in start order */
    pool_batch *dhead, *dtail; /* batches every operation of which has a result, unreported */
    int efd;
    int closing;
    unsigned refs;
    unsigned idle; /* threads waiting for work */
    unsigned merge_bytes;
    uint64_t out;     /* operations started and not yet reported (queued, running, done) */
    uint64_t running; /* operations inside their system call */
    uint64_t calls;   /* system calls made */
} pool_core;

typedef struct {
    PyObject_HEAD
    pool_core *core;
    pid_t owner;        /* the process that made it: a child of fork has none of its threads */
    pthread_t *threads;
    unsigned nthreads;
    pool_batch **slots; /* batch by slot (NULL: free) */
    uint16_t *gens;     /* bumped when a slot is freed: a stale id never matches */
    uint32_t *frees;    /* the free slots, a stack */
    uint32_t cap, nfree;
} PoolObject;

static void core_free(pool_core *c) {
    for (pool_batch *b = c->qhead, *nx; b; b = nx) {
        nx = b->qnext;
        free(b);
    }
    for (pool_batch *b = c->dhead, *nx; b; b = nx) {
        nx = b->qnext;
        free(b);
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->work);
    if (c->efd >= 0) close(c->efd);
    free(c);
}

/* One reference let go (under the mutex, which this releases); the last frees the core. */
static void core_unref_unlock(pool_core *c) {
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) core_free(c);
}

/* Batch b is complete: on the done list (its eventfd signalled if the list was empty),
 * or freed if its Pool is gone. Under the mutex. */
static void batch_done(pool_core *c, pool_batch *b) {
    if (b->orphan) {
        free(b);
        return;
    }
    b->qnext = NULL;
    if (c->dtail) c->dtail->qnext = b;
    else {
        c->dhead = b;
        uint64_t one = 1;
        if (write(c->efd, &one, sizeof one) < 0) {
        } /* EAGAIN only: the counter is already non-zero */
    }
    c->dtail = b;
}

/* ops[i:i + k] of b as one system call; each operation's result into b->res. */
static void run_ops(pool_batch *b, uint32_t i, uint32_t k) {
    const io_op *o = &b->ops[i];
    if (o->op == OP_NOP) {
        b->res[i] = 0;
        return;
    }
    ssize_t got;
    do {
        got = o->op == OP_READ ? preadv(o->fd, &b->iov[i], (int)k, (off_t)o->off)
                               : pwritev(o->fd, &b->iov[i], (int)k, (off_t)o->off);
    } while (got < 0 && errno == EINTR);
    int64_t left = got < 0 ? -errno : got; /* bytes not yet handed to an operation of the run */
    for (uint32_t j = i; j < i + k; j++) {
        int32_t r = got < 0 ? (int32_t)left : (int32_t)(left >= b->ops[j].len ? b->ops[j].len : left);
        if (got >= 0) left -= r;
        b->res[j] = r;
    }
}

static void *pool_thread(void *arg) {
    pool_core *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->closing && !c->qhead) {
            c->idle++;
            pthread_cond_wait(&c->work, &c->mu);
            c->idle--;
        }
        if (c->closing) break; /* close() dropped the queue */
        pool_batch *b = c->qhead;
        uint32_t i = b->next, k = op_run(b->ops, b->n, i, c->merge_bytes);
        b->next += k;
        if (b->next == b->n) {
            c->qhead = b->qnext;
            if (!c->qhead) c->qtail = NULL;
            b->qnext = NULL;
        }
        c->running += k;
        c->calls++;
        pthread_mutex_unlock(&c->mu);
        run_ops(b, i, k);
        pthread_mutex_lock(&c->mu);
        c->running -= k;
        b->left -= k;
        if (b->left == 0) batch_done(c, b);
    }
    core_unref_unlock(c);
    return NULL;
}

/* Chain b (linked by qnext) reported: [(id, [result, ...]), ...], each batch freed and its
 * slot released; or NULL with a Python error and every batch of b left as it was. */
static PyObject *report_chain(PoolObject *self, pool_batch *b) {
    PyObject *done = PyList_New(0);
    for (pool_batch *x = b; done && x; x = x->qnext) {
        PyObject *res = PyList_New(x->n);
        for (uint32_t i = 0; res && i < x->n; i++) {
            PyObject *v = PyLong_FromLong(x->res[i]);
            if (!v) Py_CLEAR(res);
            else PyList_SET_ITEM(res, i, v);
        }
        PyObject *t = res ? Py_BuildValue("(lN)", (long)self->gens[x->slot] << 16 | x->slot, res) : NULL;
        if (!t || PyList_Append(done, t) < 0) Py_CLEAR(done);
        Py_XDECREF(t);
    }
    if (!done) return NULL;
    uint64_t ended = 0;
    for (pool_batch *nx; b; b = nx) {
        nx = b->qnext;
        ended += b->n;
        self->slots[b->slot] = NULL;
        self->gens[b->slot]++;
        self->frees[self->nfree++] = b->slot;
        free(b);
    }
    if (self->core) {
        pthread_mutex_lock(&self->core->mu);
        self->core->out -= ended;
        pthread_mutex_unlock(&self->core->mu);
    }
    return done;
}

/* The done list taken and reported (report_chain). Where the list cannot be built, its
 * batches go back to the head of the done list and the eventfd is signalled: a later reap
 * reports them. */
static PyObject *pool_report(PoolObject *self) {
    pool_core *c = self->core;
    pthread_mutex_lock(&c->mu);
    pool_batch *b = c->dhead, *tail = c->dtail;
    c->dhead = c->dtail = NULL;
    pthread_mutex_unlock(&c->mu);
    if (!b) return PyList_New(0);
    PyObject *done = report_chain(self, b);
    if (!done) {
        pthread_mutex_lock(&c->mu);
        tail->qnext = c->dhead;
        if (!c->dhead) c->dtail = tail;
        c->dhead = b;
        uint64_t one = 1;
        if (write(c->efd, &one, sizeof one) < 0) {
        }
        pthread_mutex_unlock(&c->mu);
    }
    return done;
}

/* The Pool's own arrays (its threads' handles, the batch table) freed. */
static void table_free(PoolObject *self) {
    PyMem_Free(self->threads);
    PyMem_Free(self->slots);
    PyMem_Free(self->gens);
    PyMem_Free(self->frees);
    self->threads = NULL;
    self->slots = NULL;
    self->gens = NULL;
    self->frees = NULL;
    self->nthreads = self->cap = self->nfree = 0;
}

/* report: NULL (the batches complete are freed), or where to put them reported (a list,
 * or NULL with a Python error) */
static void pool_close_impl(PoolObject *self, PyObject **report) {
    pool_core *c = self->core;
    if (report) *report = PyList_New(0);
    if (!c) return;
    self->core = NULL;
    if (self->owner != getpid()) {
        /* a copy made by fork: the threads are the parent's, and one may have held the mutex
         * at the fork; nothing of the core is touched (its memory is the child's to lose) but
         * the child's own descriptor of the eventfd (the parent's stays open, and registered) */
        if (c->efd >= 0) close(c->efd);
        table_free(self);
        return;
    }
    pthread_mutex_lock(&c->mu);
    c->closing = 1;
    for (pool_batch *b = c->qhead; b; b = b->qnext) { /* queued operations never run */
        b->left -= b->n - b->next;
        b->next = b->n;
    }
    c->qhead = c->qtail = NULL;
    c->dhead = c->dtail = NULL; /* those complete are in the table: freed below */
    int idle = c->running == 0;
    pool_batch *complete = NULL; /* the batches every operation of which has a result */
    for (uint32_t s = self->cap; s-- > 0;) {
        pool_batch *b = self->slots[s];
        if (!b) continue;
        if (b->left == 0) {
            b->qnext = complete;
            complete = b;
        } else
            b->orphan = 1; /* a thread is in its system call: it frees it */
    }
    pthread_cond_broadcast(&c->work);
    core_unref_unlock(c);
    /* the threads leave at once unless one is stuck in a system call: join them then, so no
     * thread outlives a pool closed in order; leave a stuck one to end when it can */
    for (unsigned t = 0; t < self->nthreads; t++) {
        if (idle) {
            Py_BEGIN_ALLOW_THREADS
            pthread_join(self->threads[t], NULL);
            Py_END_ALLOW_THREADS
        } else
            pthread_detach(self->threads[t]);
    }
    if (report && *report && complete) {
        PyObject *rep = report_chain(self, complete);
        Py_SETREF(*report, rep);
        if (rep) complete = NULL; /* freed by report_chain; else freed below, the error raised */
    }
    for (pool_batch *nx; complete; complete = nx) {
        nx = complete->qnext;
        free(complete);
    }
    table_free(self);
}

static void Pool_dealloc(PoolObject *self) {
    pool_close_impl(self, NULL);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Pool_init(PoolObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"threads", "merge_bytes", NULL};
    Py_ssize_t threads = 8, merge_bytes = 0; /* "n": an int beyond its range raises ("k" wraps) */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|nn", kwlist, &threads, &merge_bytes)) return -1;
    if (self->core) {
        PyErr_SetString(PyExc_RuntimeError, "Pool already initialised");
        return -1;
    }
    if (threads < 1 || threads > POOL_MAX_THREADS || merge_bytes < 0 || merge_bytes > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "a Pool takes 1 to %d threads (not %zd) and merges 0 to 2**32-1 bytes (not %zd)",
                     POOL_MAX_THREADS, threads, merge_bytes);
        return -1;
    }
    pool_core *c = calloc(1, sizeof *c);
    self->threads = PyMem_Calloc(threads, sizeof(pthread_t));
    if (!c || !self->threads) {
        free(c);
        PyMem_Free(self->threads);
        self->threads = NULL;
        PyErr_NoMemory();
        return -1;
    }
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        free(c);
        PyMem_Free(self->threads);
        self->threads = NULL;
        return -1;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work, NULL);
    c->merge_bytes = (unsigned)merge_bytes;
    c->refs = 1;
    self->core = c;
    self->owner = getpid();
    /* the threads take no signal (Python's handlers run on the main thread) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, POOL_STACK_BYTES);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = 0;
    for (unsigned t = 0; t < threads && !err; t++) {
        pthread_mutex_lock(&c->mu);
        c->refs++;
        pthread_mutex_unlock(&c->mu);
        err = pthread_create(&self->threads[t], &attr, pool_thread, c);
        if (err) {
            pthread_mutex_lock(&c->mu);
            c->refs--;
            pthread_mutex_unlock(&c->mu);
        } else {
            pthread_setname_np(self->threads[t], "aiokv-io");
            self->nthreads++;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (err) {
        pool_close_impl(self, NULL);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

#define REQUIRE_OPEN(self)                                                                       \
    if (!(self)->core) {                                                                         \
        PyErr_SetString(PyExc_ValueError, "Pool is closed");                                     \
        return NULL;                                                                             \
    }                                                                                            \
    if ((self)->owner != getpid()) {                                                             \
        PyErr_Format(PyExc_RuntimeError,                                                         \
                     "aiokv: this I/O pool belongs to process %d, the parent of a fork; open a " \
                     "backend in this process",                                                  \
                     (int)(self)->owner);                                                        \
        return NULL;                                                                             \
    }

static PyObject *Pool_fileno(PoolObject *self, PyObject *unused) {
    REQUIRE_OPEN(self);
    return PyLong_FromLong(self->core->efd);
}

/* A free slot of the table (grown as needed), or -1 with a Python error. */
static int32_t slot_alloc(PoolObject *self) {
    if (self->nfree) return (int32_t)self->frees[--self->nfree];
    if (self->cap >= POOL_MAX_BATCHES) {
        PyErr_SetString(PyExc_RuntimeError, "aiokv: too many I/O batches in flight at once");
        return -1;
    }
    uint32_t ncap = self->cap ? 2 * self->cap : 16;
    if (ncap > POOL_MAX_BATCHES) ncap = POOL_MAX_BATCHES;
    pool_batch **ns = PyMem_Realloc(self->slots, ncap * sizeof *ns);
    if (ns) self->slots = ns;
    uint16_t *ng = ns ? PyMem_Realloc(self->gens, ncap * sizeof *ng) : NULL;
    if (ng) self->gens = ng;
    uint32_t *nf = ng ? PyMem_Realloc(self->frees, ncap * sizeof *nf) : NULL;
    if (!nf) {
        PyErr_NoMemory();
        return -1;
    }
    self->frees = nf;
    memset(ns + self->cap, 0, (ncap - self->cap) * sizeof *ns);
    memset(ng + self->cap, 0, (ncap - self->cap) * sizeof *ng);
    for (uint32_t f = ncap; f-- > self->cap + 1;) self->frees[self->nfree++] = f;
    int32_t s = (int32_t)self->cap;
    self->cap = ncap;
    return s;
}

/* start(ops) -> id: the batch queued for the threads; ops is a sequence of (op, fd, addr,
 * length, offset). A bad operation raises and starts nothing. */
static PyObject *Pool_start(PoolObject *self, PyObject *arg) {
    REQUIRE_OPEN(self);
    PyObject *seq = PySequence_Fast(arg, "start() takes a sequence of (op, fd, addr, length, offset)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n <= 0 || n > (Py_ssize_t)UINT32_MAX / 2) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "start() takes 1 to 2**31-1 operations");
        return NULL;
    }
    pool_batch *b = malloc(sizeof *b + n * (sizeof(io_op) + sizeof(struct iovec) + sizeof(int32_t)));
    if (!b) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    b->ops = (io_op *)(b + 1);
    b->iov = (struct iovec *)(b->ops + n);
    b->res = (int32_t *)(b->iov + n);
    b->n = b->left = (uint32_t)n;
    b->next = 0;
    b->orphan = 0;
    b->qnext = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (op_parse(PySequence_Fast_GET_ITEM(seq, i), &b->ops[i]) < 0) break;
        b->iov[i].iov_base = (void *)(uintptr_t)b->ops[i].addr;
        b->iov[i].iov_len = b->ops[i].len;
        b->res[i] = -ECANCELED; /* what a queued operation gets when its batch is cancelled */
    }
    Py_DECREF(seq);
    int32_t s = PyErr_Occurred() ? -1 : slot_alloc(self);
    if (s < 0) {
        free(b);
        return NULL;
    }
    b->slot = (uint32_t)s;
    self->slots[s] = b;
    pool_core *c = self->core;
    pthread_mutex_lock(&c->mu);
    if (c->qtail) c->qtail->qnext = b;
    else c->qhead = b;
    c->qtail = b;
    c->out += b->n;
    /* as many waiting threads woken as the batch has operations, not every thread: a thread
     * that ends a call takes the next from the queue before it waits again */
    for (uint32_t k = 0; k < b->n && k < c->idle; k++) pthread_cond_signal(&c->work);
    pthread_mutex_unlock(&c->mu);
    return PyLong_FromLong((long)self->gens[s] << 16 | s);
}

/* reap() -> [(id, results), ...]: the batches completed since the last reap (and the
 * eventfd drained), each with its results in operation order (byte count or -errno). */
static PyObject *Pool_reap(PoolObject *self, PyObject *unused) {
    REQUIRE_OPEN(self);
    uint64_t junk;
    /* one read returns and clears the whole counter: before the list is taken, so a batch
     * put on it after that signals again */
    if (read(self->core->efd, &junk, sizeof junk) < 0 && errno != EAGAIN) {
    }
    return pool_report(self);
}

/* cancel(id) -> [(id, results), ...]: the batch's operations no thread has taken get
 * -ECANCELED without running; those in a system call run to their end. Returns the
 * batches complete now (this one if nothing of it is still running). */
static PyObject *Pool_cancel(PoolObject *self, PyObject *arg) {
    REQUIRE_OPEN(self);
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    uint32_t s = (uint32_t)id & 0xffff;
    pool_batch *b = s < self->cap && self->gens[s] == (uint16_t)(id >> 16) ? self->slots[s] : NULL;
    if (b) {
        pool_core *c = self->core;
        pthread_mutex_lock(&c->mu);
        if (b->next < b->n) {
            pool_batch **p = &c->qhead, *prev = NULL;
            while (*p && *p != b) prev = *p, p = &(*p)->qnext;
            if (*p) {
                *p = b->qnext;
                if (c->qtail == b) c->qtail = prev;
                b->qnext = NULL;
            }
            b->left -= b->n - b->next; /* their results are -ECANCELED already */
            b->next = b->n;
            if (b->left == 0) batch_done(c, b);
        }
        pthread_mutex_unlock(&c->mu);
    }
    return pool_report(self);
}

/* close() -> [(id, results), ...]: the batches complete (their queued operations dropped:
 * -ECANCELED), reported; those a thread is still in are never reported. */
static PyObject *Pool_close(PoolObject *self, PyObject *unused) {
    PyObject *rep;
    pool_close_impl(self, &rep);
    return rep;
}

/* a counter of the core, read under its mutex (0 once closed) */
static PyObject *pool_count(PoolObject *self, size_t field) {
    uint64_t v = 0;
    if (self->core && self->owner == getpid()) {
        pthread_mutex_lock(&self->core->mu);
        v = *(uint64_t *)((char *)self->core + field);
        pthread_mutex_unlock(&self->core->mu);
    }
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *Pool_get_in_flight(PoolObject *self, void *unused) {
    return pool_count(self, offsetof(pool_core, out));
}
static PyObject *Pool_get_running(PoolObject *self, void *unused) {
    return pool_count(self, offsetof(pool_core, running));
}
static PyObject *Pool_get_calls(PoolObject *self, void *unused) { return pool_count(self, offsetof(pool_core, calls)); }

static PyObject *Pool_get_merge_bytes(PoolObject *self, void *unused) {
    return PyLong_FromUnsignedLong(self->core ? self->core->merge_bytes : 0);
}

static PyObject *Pool_get_threads(PoolObject *self, void *unused) { return PyLong_FromUnsignedLong(self->nthreads); }

static PyGetSetDef Pool_getset[] = {
    {"in_flight", (getter)Pool_get_in_flight, NULL, "operations started and not yet reported", NULL},
    {"running", (getter)Pool_get_running, NULL, "operations inside their system call now", NULL},
    {"calls", (getter)Pool_get_calls, NULL, "system calls made (a merged write is one)", NULL},
    {"merge_bytes", (getter)Pool_get_merge_bytes, NULL,
     "adjacent writes of one batch go to one pwritev of up to this many bytes (0: never)", NULL},
    {"threads", (getter)Pool_get_threads, NULL, "threads of the pool", NULL},
    {NULL}};

static PyMethodDef Pool_methods[] = {
    {"fileno", (PyCFunction)Pool_fileno, METH_NOARGS, "eventfd signalled when batches complete"},
    {"start", (PyCFunction)Pool_start, METH_O, "start([(op, fd, addr, len, off), ...]) -> batch id (queued)"},
    {"reap", (PyCFunction)Pool_reap, METH_NOARGS, "-> [(id, results), ...] completed since the last reap"},
    {"cancel", (PyCFunction)Pool_cancel, METH_O, "cancel(id): drop its queued operations -> [(id, results)]"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "drop what is queued; the threads leave (a stuck one later)"},
    {NULL}};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aiokv._native.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
    .tp_doc = "Threads running batches of reads and writes, an eventfd for completed batches.",
};

int pool_add(PyObject *m) {
    if (PyType_Ready(&PoolType) < 0) return -1;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        return -1;
    }
    return 0;
}
