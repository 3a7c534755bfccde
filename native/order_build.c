/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index.Order built at once (a unit of the order: native/order.h): emptied, every
 * eligible block ordered by a stable radix sort (after a bulk load), and the per-tenant lists
 * moved when the table's tenant ids are renamed.
 *
 * Threading: an Order is used by one thread at a time, its table's; build runs without the GIL
 * (the thread that built the table does it before handing it over).
 */
#include "order.h"

/* ---- building it all at once ---- */
void order_reset(Order *o) { /* (the per-slot arrays let go: made anew, zeroed, as needed) */
    free(o->prv), free(o->nxt), free(o->own);
    o->prv = o->nxt = NULL, o->own = NULL, o->cap = 0;
    for (Py_ssize_t i = 0; i < o->nten; i++) {
        free(o->ten[i].h);
        o->ten[i] = (Ten){NIL, NIL, 0, 0, 0, NULL};
    }
    o->ordered = 0;
}

/* the eligible slots in (tenant, atime, slot) order: a stable LSD radix sort, 16 bits a pass,
 * every digit's counts from one sequential pass (passes whose digit every key shares are left
 * out; the keys read ahead of the scatter); NULL: out of memory */
#define DIGIT(o, s, p) ((p) < 4 ? ((o)->at[s] >> (16 * (p))) & 0xffff : (o)->tn[s])
static uint32_t *sorted_slots(const Order *o, size_t *count) {
    size_t m = 0, *hist = calloc(5 * 65536, sizeof(size_t));
    for (Py_ssize_t s = 0; s < o->n; s++) m += eligible(o, (uint32_t)s);
    uint32_t *a = malloc((m ? m : 1) * 4), *b = malloc((m ? m : 1) * 4);
    if (!a || !b || !hist) {
        free(a), free(b), free(hist);
        return NULL;
    }
    m = 0;
    for (Py_ssize_t s = 0; s < o->n; s++)
        if (eligible(o, (uint32_t)s)) {
            a[m++] = (uint32_t)s;
            for (int p = 0; p < 5; p++) hist[p * 65536 + DIGIT(o, s, p)]++;
        }
    for (int p = 0; p < 5; p++) { /* 4 passes of the atime, then the tenant */
        size_t *h = hist + p * 65536, sum = 0;
        int one = 0;
        for (size_t d = 0; d < 65536; d++) one |= h[d] == m;
        if (one) continue; /* every key has the same digit */
        for (size_t d = 0; d < 65536; d++) {
            size_t c = h[d];
            h[d] = sum, sum += c;
        }
        for (size_t i = 0; i < m; i++) {
            if (i + 16 < m) __builtin_prefetch(p < 4 ? (const void *)&o->at[a[i + 16]] : (const void *)&o->tn[a[i + 16]]);
            b[h[DIGIT(o, a[i], p)]++] = a[i];
        }
        uint32_t *t = a;
        a = b, b = t;
    }
    free(b), free(hist);
    *count = m;
    return a;
}

int order_build(Order *o) {
    order_reset(o);
    if (order_grow_slots(o, o->n) < 0) return -1;
    size_t m;
    uint32_t *a = sorted_slots(o, &m);
    if (!a) return -1;
    for (size_t i = 0; i < m; i++) { /* each tenant's run, linked in order */
        uint32_t s = a[i], p = i && o->tn[a[i - 1]] == o->tn[s] ? a[i - 1] : NIL;
        Ten *t = order_tenant(o, o->tn[s]);
        if (!t) {
            free(a);
            return -1;
        }
        if (p == NIL) t->head = s;
        else o->nxt[p] = s;
        SET_PRV(o, s, p), o->nxt[s] = NIL, o->own[s] = o->tn[s];
        t->tail = s, t->n++;
    }
    o->ordered = m;
    free(a);
    return 0;
}

/* relabel(): the table's tenant ids were renamed (each old id to one new one): the orders
 * follow; two ids renamed to one, or blocks of one id renamed apart, order it all again */
int order_relabel(Order *o) {
    Ten *nt = malloc(65536 * sizeof(Ten));
    if (!nt) return -1;
    Py_ssize_t nn = 0;
    for (Py_ssize_t i = 0; i < 65536; i++) nt[i] = (Ten){NIL, NIL, 0, 0, 0, NULL};
    for (Py_ssize_t i = 0; i < o->nten; i++) {
        Ten *t = &o->ten[i];
        if (!t->n && !t->hn) continue;
        uint16_t to = o->tn[t->n ? t->head : t->h[0].slot];
        int apart = nt[to].n || nt[to].hn; /* two ids renamed to one */
        for (uint32_t s = t->head; s != NIL && !apart; s = o->nxt[s]) apart = o->tn[s] != to;
        for (uint32_t j = 0; j < t->hn && !apart; j++) apart = o->tn[t->h[j].slot] != to;
        if (apart) {
            free(nt);
            return order_build(o);
        }
        nt[to] = *t; /* (a copy: o->ten is left as it was until all are placed) */
        nn = to + 1 > nn ? to + 1 : nn;
    }
    for (Py_ssize_t s = 0; s < o->cap; s++)
        if (PRV(o, s) != OUT) o->own[s] = o->tn[s];
    for (Py_ssize_t i = 0; i < o->nten; i++)
        if (!o->ten[i].n && !o->ten[i].hn) free(o->ten[i].h); /* (the others' moved) */
    free(o->ten);
    o->ten = realloc(nt, (size_t)(nn ? nn : 1) * sizeof(Ten)), o->nten = nn;
    if (!o->ten) o->ten = nt; /* (a smaller realloc failing: keep the larger block) */
    return 0;
}
