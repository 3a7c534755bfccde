/* SPDX-License-Identifier: Apache-2.0 */
/*
 * An I/O operation as both runners of batches take it (ring.c: io_uring; pool.c: threads of
 * our own), parsed once from Python's (op, fd, addr, length, offset) tuple (ops.c), and the
 * one rule for which adjacent writes of a batch go to the disk as one vectored write.
 */
#ifndef AIOKV_OPS_H
#define AIOKV_OPS_H

#include "aiokv.h"

#define OP_READ 0
#define OP_WRITE 1
#define OP_NOP 2

/* Most operations one merged write covers (an iovec each: far below IOV_MAX). */
#define MERGE_MAX_OPS 64

/* One operation of a batch. */
typedef struct {
    uint64_t addr, off;
    int32_t fd;
    uint32_t len;
    uint16_t span; /* operations the system call or kernel entry made from this one covers (merged writes) */
    uint8_t op;
} io_op;

/* *o from one (op, fd, addr, length, offset) tuple; 0, or -1 with a Python error set. */
int op_parse(PyObject *item, io_op *o);

/* How many operations from i of ops[0:n] one system call takes: 1, or the run of writes
 * from i to the same file at adjacent offsets, up to merge_bytes in all and MERGE_MAX_OPS.
 * Reads are never merged: the virtual disk of docs/benchmarks.md serves a merged read whole
 * and loses bandwidth ("Where the time goes"); fed merged writes it is idle less of the time. */
uint32_t op_run(const io_op *ops, uint32_t n, uint32_t i, unsigned merge_bytes);

#endif /* AIOKV_OPS_H */
