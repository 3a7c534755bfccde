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
 * This unit is the Python type (the arrays bound, the methods, check); native/order.h lists
 * the others: the places, the searches, the build.
 *
 * Threading: an Order is used by one thread at a time, its table's.
 */
#include "order.h"

#include <structmember.h>

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
    order_reset(o);
    return 0;
}

static void Order_dealloc(Order *o) {
    unbind(o);
    order_reset(o); /* (the heaps, the per-slot arrays) */
    free(o->ten);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *Order_bind(Order *o, PyObject *args) {
    Py_ssize_t n = o->n;
    if (bind_arrays(o, args) < 0) return NULL;
    for (Py_ssize_t s = o->n; s < n && s < o->cap; s++) order_detach(o, (uint32_t)s); /* (fewer slots: out) */
    Py_RETURN_NONE;
}

static PyObject *Order_clear(Order *o, PyObject *unused) {
    order_reset(o); /* (no pass over the slots: a table emptied at once keeps its step bounded) */
    Py_RETURN_NONE;
}

static PyObject *Order_build(Order *o, PyObject *unused) {
    int r;
    Py_BEGIN_ALLOW_THREADS;
    r = order_build(o);
    Py_END_ALLOW_THREADS;
    return r < 0 ? PyErr_NoMemory() : Py_NewRef(Py_None);
}

static PyObject *Order_sync(Order *o, PyObject *arg) {
    Py_ssize_t s = PyLong_AsSsize_t(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (s < 0 || s >= (Py_ssize_t)OUT) return PyErr_Format(PyExc_IndexError, "slot out of range");
    if (order_sync1(o, (uint32_t)s) < 0) return PyErr_NoMemory();
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
        order_detach(o, (uint32_t)sl[i]);
        if (eligible(o, (uint32_t)sl[i])) back[m++] = (uint32_t)sl[i];
    }
    PyBuffer_Release(&v);
    sort_at = o->at;
    qsort(back, m, 4, by_key);
    int r = 0;
    for (size_t i = 0; i < m && r == 0; i++)
        if (!i || back[i] != back[i - 1]) r = order_attach(o, back[i]);
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
    int64_t s = t < 0 || t > 0xffff ? -1 : order_search(o, 1, (uint16_t)t, NULL, 0, skip, ns);
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
    int64_t s = order_search(o, 0, 0, ex, nx, skip, ns);
    if (held) PyBuffer_Release(&v);
    if (ex) PyBuffer_Release(&x);
    return answer(s);
}

static PyObject *Order_relabel(Order *o, PyObject *unused) { return order_relabel(o) < 0 ? PyErr_NoMemory() : Py_NewRef(Py_None); }

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
