/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Ring's units share this (ring.c says what a Ring is and does): the operation (ops.h), and
 * where built with liburing the ring's structures, its batch ids and what each unit gives the
 * others.
 *
 *   ring.c         the Python type: open, close, start, pump, reap, cancel, wait
 *   ring_batches.c batch slots, the submission queue, a batch's results reported
 *   ring_submit.c  queued operations handed to the kernel within the limits, refusals
 */
#ifndef AIOKV_RING_H
#define AIOKV_RING_H

#include "ops.h"

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

/* A batch: the unit Python sees. Its operations are queued in order, handed to
 * the kernel within the ring's limits, and the batch is reported (and its slot
 * freed) once every operation has a result. */
typedef struct {
    io_op *ops;        /* n operations, then n iovecs, then n int32 results (one allocation) */
    struct iovec *iov; /* per operation: its buffer, for a merged write's vector */
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
    unsigned depth, max_ops, in_flight; /* in_flight: entries the kernel owns (a merged write: one) */
    unsigned long long min_bytes, bytes; /* bytes: of the operations in flight */
    unsigned submit_group; /* operations per io_uring_enter (0: all prepared at once); see ring_pump */
    unsigned merge_bytes;  /* adjacent writes of a batch merged into one entry up to this many bytes (0: never) */
} RingObject;

/* user_data of operation i of the batch in slot s, and the batch id Python sees */
static inline uint64_t op_ud(RingObject *self, int32_t s, uint32_t i) {
    return (uint64_t)self->b[s].gen << 48 | (uint64_t)s << 32 | i;
}
static inline long batch_id(RingObject *self, int32_t s) { return (long)self->b[s].gen << 16 | s; }

/* slot of a live batch from its id's (gen, slot), or -1 */
static inline int32_t batch_find(RingObject *self, uint32_t s, uint16_t gen) {
    return s < self->cap && self->b[s].live && self->b[s].gen == gen ? (int32_t)s : -1;
}

/* ring_batches.c */
int32_t batch_alloc(RingObject *self, uint32_t n); /* a free slot for n operations; -1: a Python error */
void batch_free(RingObject *self, int32_t s);
void queue_push(RingObject *self, int32_t s);   /* batch s to the submission queue's end */
void queue_remove(RingObject *self, int32_t s); /* batch s out of the submission queue */
int batch_report(RingObject *self, int32_t s, PyObject *done);
int op_done(RingObject *self, int32_t s, uint32_t i, int32_t res, PyObject *done);
int op_left_kernel(RingObject *self, uint64_t ud, int32_t res, PyObject *done);

/* ring_submit.c */
int ring_enter_nogil(RingObject *self);               /* prepared entries to the kernel: 0 or -errno */
int ring_refused(RingObject *self, int err, PyObject *done);
int ring_pump(RingObject *self, PyObject *done);

#endif /* AIOKV_HAVE_URING */
#endif /* AIOKV_RING_H */
