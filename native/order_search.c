/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index.Order's searches (a unit of the order: native/order.h): a tenant's least
 * recently used block not skipped (its list's head or its heap's least), and the least of
 * several tenants; a block found that may not be a victim is synced and the search goes on.
 *
 * Threading: an Order is used by one thread at a time, its table's; nothing here is shared.
 */
#include "order.h"

/* ---- searches ---- */
static int skipped(const uint32_t *skip, Py_ssize_t ns, uint32_t s) {
    Py_ssize_t lo = 0, hi = ns;
    while (lo < hi) {
        Py_ssize_t m = (lo + hi) / 2;
        if (skip[m] < s) lo = m + 1;
        else hi = m;
    }
    return lo < ns && skip[lo] == s;
}

/* the least recently used slot of tenant t not in skip (NIL: none), its key in *at */
static uint32_t front_of(Order *o, Ten *t, const uint32_t *skip, Py_ssize_t ns, uint64_t *at) {
    uint32_t best = NIL, s = t->head;
    uint64_t bat = 0;
    while (s != NIL) {
        o->examined++;
        if (!ns || !skipped(skip, ns, s)) break;
        s = o->nxt[s];
    }
    if (s != NIL) best = s, bat = o->at[s];
    if (t->hn) { /* the heap's least not skipped: best first from the top (each entry passed
                    is a skipped slot, so the frontier holds at most ns + 2 positions) */
        uint32_t local[64], *fr = ns + 2 <= 64 ? local : malloc((size_t)(ns + 2) * 4), k = 0;
        if (!fr) return NIL; /* out of memory: nothing found this time */
        fr[k++] = 0;
        while (k) {
            uint32_t m = 0;
            for (uint32_t j = 1; j < k; j++)
                if (before(t->h[fr[j]].at, t->h[fr[j]].slot, t->h[fr[m]].at, t->h[fr[m]].slot)) m = j;
            uint32_t pos = fr[m];
            fr[m] = fr[--k];
            o->examined++;
            if (!ns || !skipped(skip, ns, t->h[pos].slot)) {
                if (best == NIL || before(t->h[pos].at, t->h[pos].slot, bat, best)) best = t->h[pos].slot, bat = t->h[pos].at;
                break;
            }
            for (uint32_t c = 2 * pos + 1; c <= 2 * pos + 2 && c < t->hn; c++) fr[k++] = c;
        }
        if (fr != local) free(fr);
    }
    *at = bat;
    return best;
}

/* the least recently used slot of tenant `one` (only), or of those `ex` does not leave out; a
 * slot that may not be a victim (changed without a sync) is synced and the search goes on */
int64_t order_search(Order *o, int only, uint16_t one, const uint8_t *ex, Py_ssize_t nx, const uint32_t *skip,
                     Py_ssize_t ns) {
    for (;;) {
        uint32_t best = NIL;
        uint64_t bat = 0;
        Py_ssize_t lo = only ? one : 0, hi = only ? (one < o->nten ? one + 1 : 0) : o->nten;
        for (Py_ssize_t i = lo; i < hi; i++) {
            Ten *t = &o->ten[i];
            if (!t->n && !t->hn) continue;
            if (i < nx && ex[i]) continue;
            uint64_t at;
            uint32_t s = front_of(o, t, skip, ns, &at);
            if (s != NIL && (best == NIL || before(at, s, bat, best))) best = s, bat = at;
        }
        if (best == NIL) return -1;
        if (eligible(o, best) && o->tn[best] == o->own[best] && o->at[best] == bat) return best;
        if (order_sync1(o, best) < 0) return -2;
    }
}
