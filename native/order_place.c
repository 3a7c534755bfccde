/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index.Order's places (a unit of the order: native/order.h): the per-slot links and
 * per-tenant lists grown as needed, each tenant's heap of blocks that came back out of order
 * (positions in nxt), and a slot taken out of its tenant's order or put at its place.
 *
 * Threading: an Order is used by one thread at a time, its table's; nothing here is shared.
 */
#include "order.h"

/* ---- per-slot and per-tenant storage ---- */
int order_grow_slots(Order *o, Py_ssize_t n) {
    if (n <= o->cap) return 0;
    uint32_t *p = o->prv ? realloc(o->prv, (size_t)n * 4) : calloc((size_t)n, 4), *q;
    if (!p) return -1;
    if (o->prv) memset(p + o->cap, 0, (size_t)(n - o->cap) * 4); /* (OUT) */
    o->prv = p;
    q = realloc(o->nxt, (size_t)n * 4);
    if (!q) return -1;
    o->nxt = q;
    uint16_t *w = realloc(o->own, (size_t)n * 2);
    if (!w) return -1;
    o->own = w;
    o->cap = n;
    return 0;
}

Ten *order_tenant(Order *o, uint16_t t) {
    if (t >= o->nten) {
        Py_ssize_t n = (Py_ssize_t)t + 1 > 2 * o->nten ? (Py_ssize_t)t + 1 : 2 * o->nten;
        Ten *p = realloc(o->ten, (size_t)n * sizeof(Ten));
        if (!p) return NULL;
        for (Py_ssize_t i = o->nten; i < n; i++) p[i] = (Ten){NIL, NIL, 0, 0, 0, NULL};
        o->ten = p;
        o->nten = n;
    }
    return &o->ten[t];
}

/* ---- the heap of a tenant (positions in nxt) ---- */
static inline void hput(Order *o, Ten *t, uint32_t i, Hent e) {
    t->h[i] = e;
    o->nxt[e.slot] = i;
}

static void sift_up(Order *o, Ten *t, uint32_t i) {
    Hent e = t->h[i];
    while (i) {
        uint32_t p = (i - 1) / 2;
        if (!before(e.at, e.slot, t->h[p].at, t->h[p].slot)) break;
        hput(o, t, i, t->h[p]);
        i = p;
    }
    hput(o, t, i, e);
}

static void sift_down(Order *o, Ten *t, uint32_t i) {
    Hent e = t->h[i];
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= t->hn) break;
        if (c + 1 < t->hn && before(t->h[c + 1].at, t->h[c + 1].slot, t->h[c].at, t->h[c].slot)) c++;
        if (!before(t->h[c].at, t->h[c].slot, e.at, e.slot)) break;
        hput(o, t, i, t->h[c]);
        i = c;
    }
    hput(o, t, i, e);
}

static int heap_push(Order *o, Ten *t, uint32_t s) {
    if (t->hn == t->hcap) {
        uint32_t cap = t->hcap ? 2 * t->hcap : 16;
        Hent *h = realloc(t->h, (size_t)cap * sizeof(Hent));
        if (!h) return -1;
        t->h = h;
        t->hcap = cap;
    }
    t->h[t->hn] = (Hent){o->at[s], s, 0};
    SET_PRV(o, s, IN_HEAP);
    sift_up(o, t, t->hn++);
    return 0;
}

static void heap_del(Order *o, Ten *t, uint32_t i) {
    uint32_t last = --t->hn;
    if (i == last) return;
    Hent e = t->h[last];
    hput(o, t, i, e);
    if (i && before(e.at, e.slot, t->h[(i - 1) / 2].at, t->h[(i - 1) / 2].slot))
        sift_up(o, t, i);
    else
        sift_down(o, t, i);
}

/* ---- a slot in and out of its tenant's order ---- */
void order_detach(Order *o, uint32_t s) {
    if (s >= o->cap || PRV(o, s) == OUT) return;
    Ten *t = &o->ten[o->own[s]];
    if (PRV(o, s) == IN_HEAP) {
        heap_del(o, t, o->nxt[s]);
    } else {
        uint32_t p = PRV(o, s), q = o->nxt[s];
        if (p == NIL) t->head = q;
        else o->nxt[p] = q;
        if (q == NIL) t->tail = p;
        else SET_PRV(o, q, p);
        t->n--;
    }
    SET_PRV(o, s, OUT);
    o->ordered--;
}

/* put an eligible slot, not in the order, at its place; -1: out of memory */
int order_attach(Order *o, uint32_t s) {
    if (order_grow_slots(o, o->n) < 0) return -1;
    Ten *t = order_tenant(o, o->tn[s]);
    if (!t) return -1;
    o->own[s] = o->tn[s];
    if (t->tail != NIL && before(o->at[s], s, o->at[t->tail], t->tail)) {
        if (heap_push(o, t, s) < 0) return -1;
    } else {
        SET_PRV(o, s, t->tail);
        o->nxt[s] = NIL;
        if (t->tail == NIL) t->head = s;
        else o->nxt[t->tail] = s;
        t->tail = s;
        t->n++;
    }
    o->ordered++;
    return 0;
}

int order_sync1(Order *o, uint32_t s) {
    order_detach(o, s);
    return eligible(o, s) ? order_attach(o, s) : 0;
}
