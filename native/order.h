/* SPDX-License-Identifier: Apache-2.0 */
/*
 * aiokv._index.Order's units share this (order.c says what the order is and keeps): its
 * structures, the slot states and what each unit gives the others.
 *
 *   order.c        the Python type: the table's arrays bound, the methods, the invariants
 *   order_place.c  per-slot and per-tenant storage, the heaps, a slot in and out of its place
 *   order_search.c the searches: a tenant's front, the least recently used of several
 *   order_build.c  every block ordered at once (a radix sort), ids renamed, emptied
 */
#ifndef AIOKV_ORDER_H
#define AIOKV_ORDER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NIL 0xffffffffu
#define IN_HEAP 0xfffffffeu
#define OUT 0xfffffffdu /* not in the order */
#define PINNED 1

typedef struct {
    uint64_t at;
    uint32_t slot, pad;
} Hent; /* a heap entry: the key it came with */

typedef struct {
    uint32_t head, tail, n, hn, hcap; /* the list (n blocks), the heap (hn) */
    Hent *h;
} Ten;

typedef struct {
    PyObject_HEAD Py_buffer b[4];
    int bound;
    const uint64_t *tag, *at;
    const uint16_t *tn;
    const uint8_t *fl;
    Py_ssize_t n; /* slots the table's arrays cover */
    uint32_t *prv, *nxt;
    uint16_t *own;
    Py_ssize_t cap; /* slots the per-slot arrays cover */
    Ten *ten;
    Py_ssize_t nten;
    unsigned long long examined, ordered;
} Order;

/* prv is stored XOR OUT, so that zeroed memory (calloc: pages the kernel maps on first touch)
 * reads OUT: a table emptied or built anew needs no pass over its slots */
#define PRV(o, s) ((o)->prv[s] ^ OUT)
#define SET_PRV(o, s, v) ((o)->prv[s] = (uint32_t)(v) ^ OUT)

static inline int before(uint64_t a, uint32_t s, uint64_t b, uint32_t t) { return a < b || (a == b && s < t); }
static inline int eligible(const Order *o, uint32_t s) { return s < o->n && o->tag[s] && !(o->fl[s] & PINNED); }


/* order_place.c */
int order_grow_slots(Order *o, Py_ssize_t n); /* the per-slot arrays cover n slots; -1: out of memory */
Ten *order_tenant(Order *o, uint16_t t);      /* tenant t's part, made as needed; NULL: out of memory */
void order_detach(Order *o, uint32_t s);      /* slot s out of the order (if in it) */
int order_attach(Order *o, uint32_t s);       /* an eligible slot, not in the order, to its place */
int order_sync1(Order *o, uint32_t s);        /* slot s to its place, or out; -1: out of memory */

/* order_search.c: the least recently used slot of tenant `one` (only), or of those `ex` does
 * not leave out, not in skip (-1: none, -2: out of memory) */
int64_t order_search(Order *o, int only, uint16_t one, const uint8_t *ex, Py_ssize_t nx, const uint32_t *skip,
                     Py_ssize_t ns);

/* order_build.c */
void order_reset(Order *o);   /* nothing in the order, the per-slot arrays let go */
int order_build(Order *o);    /* every eligible slot ordered anew; -1: out of memory */
int order_relabel(Order *o);  /* the tenant ids were renamed; -1: out of memory */

#endif /* AIOKV_ORDER_H */
