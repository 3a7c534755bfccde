/* SPDX-License-Identifier: Apache-2.0 */
/* aiokv._index.Order: the eviction order of one table (aiokv/store/table.py): exact LRU on
 * (atime, then slot), per tenant, for the blocks that may be victims (not PINNED).
 *
 * Per tenant, its blocks in two parts:
 * - a doubly linked list in LRU order, the youngest at its tail: a block whose key is not
 *   older than the tail's goes there (a commit, a use: the common case, O(1));
 * - a binary min-heap of the blocks that came back out of order (unpinned, used at an older
 *   time another engine reported, replayed out of order), each with the key it came with.
 * The tenant's least recently used block is the older of the list's head and the heap's top.
 * Per slot: the list links (prv, nxt: 8 bytes; a block in the heap has prv == IN_HEAP and its
 * heap position in nxt) and the tenant whose order holds it (own: 2 bytes). Per heap entry
 * 16 bytes. A list block's key is read from the table's atime array: whoever changes a slot's
 * tag, atime, tenant or flags tells the order (sync, changed) before its next search; changed
 * first takes every named slot out, then puts back the ones that may be victims, oldest
 * first, so the order never compares a changed block.
 *
 * Searches: front(tenant, skip) and first(excluded, skip) (every tenant but those excluded:
 * one front per tenant holding blocks). skip: slots passed over (held by a load), sorted;
 * they keep their place. `examined` counts the entries searches read (list nodes, heap
 * entries): one per tenant asked, plus those skipped. A block found that may not be a victim
 * (changed without a sync) is synced then and the search goes on: never handed out.
 *
 * build() orders every block at once (after a bulk load: a stable radix sort, the GIL
 * released: the thread that built the table does it before handing it over).
 *
 * Threading: an Order is used by one thread at a time, its table's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <structmember.h>

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

/* ---- per-slot and per-tenant storage ---- */
static int grow_slots(Order *o, Py_ssize_t n) {
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

static Ten *tenant(Order *o, uint16_t t) {
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
static void detach(Order *o, uint32_t s) {
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
static int attach(Order *o, uint32_t s) {
    if (grow_slots(o, o->n) < 0) return -1;
    Ten *t = tenant(o, o->tn[s]);
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

static int sync1(Order *o, uint32_t s) {
    detach(o, s);
    return eligible(o, s) ? attach(o, s) : 0;
}

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
static int64_t search(Order *o, int only, uint16_t one, const uint8_t *ex, Py_ssize_t nx, const uint32_t *skip,
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
        if (sync1(o, best) < 0) return -2;
    }
}

/* ---- building it all at once ---- */
static void reset(Order *o) { /* (the per-slot arrays let go: made anew, zeroed, as needed) */
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

static int build(Order *o) {
    reset(o);
    if (grow_slots(o, o->n) < 0) return -1;
    size_t m;
    uint32_t *a = sorted_slots(o, &m);
    if (!a) return -1;
    for (size_t i = 0; i < m; i++) { /* each tenant's run, linked in order */
        uint32_t s = a[i], p = i && o->tn[a[i - 1]] == o->tn[s] ? a[i - 1] : NIL;
        Ten *t = tenant(o, o->tn[s]);
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

/* ---- the Python type ---- */
static void unbind(Order *o) {
    if (o->bound)
        for (int i = 0; i < 4; i++) PyBuffer_Release(&o->b[i]);
    o->bound = 0;
}

static int bind_arrays(Order *o, PyObject *args) {
    PyObject *ob[4];
    if (!PyArg_ParseTuple(args, "OOOO", &ob[0], &ob[1], &ob[2], &ob[3])) return -1;
    Py_buffer b[4];
    static const Py_ssize_t item[4] = {8, 8, 2, 1};
    int got = 0;
    for (; got < 4; got++) {
        if (PyObject_GetBuffer(ob[got], &b[got], PyBUF_C_CONTIGUOUS) < 0) break;
        if (b[got].len % item[got] || b[got].len / item[got] != b[0].len / 8) {
            PyErr_SetString(PyExc_ValueError, "Order: tag, atime, tenant and flags arrays of one length");
            got++;
            break;
        }
    }
    if (got == 4 && !PyErr_Occurred() && b[0].len / 8 >= (Py_ssize_t)OUT)
        PyErr_SetString(PyExc_ValueError, "Order: too many slots");
    if (got < 4 || PyErr_Occurred()) {
        for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
        return -1;
    }
    unbind(o);
    memcpy(o->b, b, sizeof(b));
    o->bound = 1;
    o->tag = b[0].buf, o->at = b[1].buf, o->tn = b[2].buf, o->fl = b[3].buf;
    o->n = b[0].len / 8; /* (the per-slot arrays grow when the order is built: a table never
                             searched, as a read-only opener's, costs nothing more) */
    return 0;
}

static int Order_init(Order *o, PyObject *args, PyObject *kw) {
    if (bind_arrays(o, args) < 0) return -1;
    reset(o);
    return 0;
}

static void Order_dealloc(Order *o) {
    unbind(o);
    reset(o); /* (the heaps, the per-slot arrays) */
    free(o->ten);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *Order_bind(Order *o, PyObject *args) {
    Py_ssize_t n = o->n;
    if (bind_arrays(o, args) < 0) return NULL;
    for (Py_ssize_t s = o->n; s < n && s < o->cap; s++) detach(o, (uint32_t)s); /* (fewer slots: out) */
    Py_RETURN_NONE;
}

static PyObject *Order_clear(Order *o, PyObject *unused) {
    reset(o); /* (no pass over the slots: a table emptied at once keeps its step bounded) */
    Py_RETURN_NONE;
}

static PyObject *Order_build(Order *o, PyObject *unused) {
    int r;
    Py_BEGIN_ALLOW_THREADS;
    r = build(o);
    Py_END_ALLOW_THREADS;
    return r < 0 ? PyErr_NoMemory() : Py_NewRef(Py_None);
}

static PyObject *Order_sync(Order *o, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (s < 0 || s >= (Py_ssize_t)OUT) return PyErr_Format(PyExc_IndexError, "slot out of range");
    if (sync1(o, (uint32_t)s) < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static const uint64_t *sort_at; /* the atimes by_key compares (set under the GIL) */
static int by_key(const void *x, const void *y) {
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return before(sort_at[a], a, sort_at[b], b) ? -1 : a == b ? 0 : 1;
}

/* changed(slots int64/uint64 array): these slots' blocks changed (any of tag, atime, tenant,
 * flags): out of the order, then those that may be victims back in, oldest first */
static PyObject *Order_changed(Order *o, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const int64_t *sl = v.buf;
    size_t n = (size_t)v.len / 8, m = 0;
    uint32_t *back = v.len % 8 ? NULL : malloc((n ? n : 1) * 4);
    if (!back) {
        PyBuffer_Release(&v);
        return v.len % 8 ? PyErr_Format(PyExc_ValueError, "changed: an int64 array of slots") : PyErr_NoMemory();
    }
    for (size_t i = 0; i < n; i++) {
        if (sl[i] < 0 || sl[i] >= (int64_t)OUT) continue;
        detach(o, (uint32_t)sl[i]);
        if (eligible(o, (uint32_t)sl[i])) back[m++] = (uint32_t)sl[i];
    }
    PyBuffer_Release(&v);
    sort_at = o->at;
    qsort(back, m, 4, by_key);
    int r = 0;
    for (size_t i = 0; i < m && r == 0; i++)
        if (!i || back[i] != back[i - 1]) r = attach(o, back[i]);
    free(back);
    return r < 0 ? PyErr_NoMemory() : Py_NewRef(Py_None);
}

static int skip_arg(PyObject *obj, Py_buffer *v, const uint32_t **skip, Py_ssize_t *ns) {
    *skip = NULL, *ns = 0;
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (v->len % 4) {
        PyBuffer_Release(v);
        return PyErr_Format(PyExc_ValueError, "skip: a sorted uint32 array of slots"), -1;
    }
    *skip = v->buf, *ns = v->len / 4;
    return 1;
}

static PyObject *answer(int64_t s) { return s == -2 ? PyErr_NoMemory() : PyLong_FromLongLong(s); }

/* front(tenant, skip=None) -> the least recently used slot of that tenant (-1: none) */
static PyObject *Order_front(Order *o, PyObject *args) {
    int t;
    PyObject *so = Py_None;
    if (!PyArg_ParseTuple(args, "i|O", &t, &so)) return NULL;
    Py_buffer v;
    const uint32_t *skip;
    Py_ssize_t ns;
    int held = skip_arg(so, &v, &skip, &ns);
    if (held < 0) return NULL;
    int64_t s = t < 0 || t > 0xffff ? -1 : search(o, 1, (uint16_t)t, NULL, 0, skip, ns);
    if (held) PyBuffer_Release(&v);
    return answer(s);
}

/* first(excluded=None, skip=None) -> the least recently used slot of every tenant but those
 * `excluded` (uint8 per tenant id, 1: left out; ids past its end are in) leaves out */
static PyObject *Order_first(Order *o, PyObject *args) {
    PyObject *xo = Py_None, *so = Py_None;
    if (!PyArg_ParseTuple(args, "|OO", &xo, &so)) return NULL;
    Py_buffer x, v;
    const uint8_t *ex = NULL;
    Py_ssize_t nx = 0, ns;
    if (xo != Py_None) {
        if (PyObject_GetBuffer(xo, &x, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        ex = x.buf, nx = x.len;
    }
    const uint32_t *skip;
    int held = skip_arg(so, &v, &skip, &ns);
    if (held < 0) {
        if (ex) PyBuffer_Release(&x);
        return NULL;
    }
    int64_t s = search(o, 0, 0, ex, nx, skip, ns);
    if (held) PyBuffer_Release(&v);
    if (ex) PyBuffer_Release(&x);
    return answer(s);
}

/* relabel(): the table's tenant ids were renamed (each old id to one new one): the orders
 * follow; two ids renamed to one, or blocks of one id renamed apart, order it all again */
static int relabel(Order *o) {
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
            return build(o);
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

static PyObject *Order_relabel(Order *o, PyObject *unused) { return relabel(o) < 0 ? PyErr_NoMemory() : Py_NewRef(Py_None); }

/* check(): every invariant, for tests (AssertionError naming the first one broken) */
static PyObject *Order_check(Order *o, PyObject *unused) {
    unsigned long long seen = 0;
    for (Py_ssize_t i = 0; i < o->nten; i++) {
        Ten *t = &o->ten[i];
        uint32_t p = NIL, n = 0;
        for (uint32_t s = t->head; s != NIL; p = s, s = o->nxt[s], n++) {
            if (PRV(o, s) != p || o->own[s] != i || !eligible(o, s) || o->tn[s] != i)
                return PyErr_Format(PyExc_AssertionError, "order: list of tenant %zd broken at slot %u", i, s);
            if (p != NIL && !before(o->at[p], p, o->at[s], s))
                return PyErr_Format(PyExc_AssertionError, "order: slot %u before %u out of order", p, s);
        }
        if (p != t->tail || n != t->n) return PyErr_Format(PyExc_AssertionError, "order: tenant %zd's tail", i);
        for (uint32_t j = 0; j < t->hn; j++) {
            uint32_t s = t->h[j].slot;
            if (PRV(o, s) != IN_HEAP || o->nxt[s] != j || o->own[s] != i || !eligible(o, s) || o->tn[s] != i ||
                o->at[s] != t->h[j].at)
                return PyErr_Format(PyExc_AssertionError, "order: heap of tenant %zd broken at slot %u", i, s);
            if (j && before(t->h[j].at, s, t->h[(j - 1) / 2].at, t->h[(j - 1) / 2].slot))
                return PyErr_Format(PyExc_AssertionError, "order: heap of tenant %zd out of order", i);
        }
        seen += n + t->hn;
    }
    unsigned long long want = 0;
    for (Py_ssize_t s = 0; s < o->n; s++) {
        want += eligible(o, (uint32_t)s);
        if (!eligible(o, (uint32_t)s) && s < o->cap && PRV(o, s) != OUT)
            return PyErr_Format(PyExc_AssertionError, "order: slot %zd is ordered but may not be a victim", s);
    }
    if (seen != want || seen != o->ordered)
        return PyErr_Format(PyExc_AssertionError, "order: %llu ordered, %llu may be victims", seen, want);
    Py_RETURN_NONE;
}

static PyMethodDef Order_methods[] = {
    {"bind", (PyCFunction)Order_bind, METH_VARARGS, "bind(tag, atime, tenant, flags): the table's arrays, replaced"},
    {"build", (PyCFunction)Order_build, METH_NOARGS, "build(): order every block anew (the GIL released)"},
    {"clear", (PyCFunction)Order_clear, METH_NOARGS, "clear(): no block in the order (the table was emptied)"},
    {"sync", (PyCFunction)Order_sync, METH_O, "sync(slot): its block changed: to its place, or out"},
    {"changed", (PyCFunction)Order_changed, METH_O, "changed(slots int64 array): sync, for many"},
    {"relabel", (PyCFunction)Order_relabel, METH_NOARGS, "relabel(): the tenant ids were renamed"},
    {"front", (PyCFunction)Order_front, METH_VARARGS, "front(tenant, skip=None) -> its LRU slot, or -1"},
    {"first", (PyCFunction)Order_first, METH_VARARGS, "first(excluded=None, skip=None) -> the LRU slot, or -1"},
    {"check", (PyCFunction)Order_check, METH_NOARGS, "check(): every invariant (AssertionError)"},
    {NULL}};

static PyMemberDef Order_members[] = {
    {"examined", T_ULONGLONG, offsetof(Order, examined), 0, "entries the searches have read"},
    {"ordered", T_ULONGLONG, offsetof(Order, ordered), READONLY, "blocks in the order"},
    {NULL}};

static PyTypeObject OrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aiokv._index.Order",
    .tp_basicsize = sizeof(Order),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Order(tag, atime, tenant, flags): a table's eviction order, exact LRU per tenant",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Order_init,
    .tp_dealloc = (destructor)Order_dealloc,
    .tp_methods = Order_methods,
    .tp_members = Order_members,
};

/* called by the module's init (aiokv_index.c) */
int aiokv_order_register(PyObject *m) {
    if (PyType_Ready(&OrderType) < 0) return -1;
    Py_INCREF(&OrderType);
    if (PyModule_AddObject(m, "Order", (PyObject *)&OrderType) < 0) {
        Py_DECREF(&OrderType);
        return -1;
    }
    return 0;
}
