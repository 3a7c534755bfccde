/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Block copies on the CPU device (aiokv/worker/device.py): memcpy_many, and
 * memcpy_crc_out / memcpy_crc_in, which take the payload's CRC32C inside the
 * copy. GIL released for all of each call.
 *
 * Threading: any thread, several at once; a call reads and writes only the
 * buffers it is handed, which the caller keeps alive and unshared for the call.
 */
#include "aiokv.h"

/* memcpy_many(dst_addrs, src_addrs, nbytes): for each i, copy nbytes from
 * src_addrs[i] to dst_addrs[i]; the address lists are native int64 arrays
 * (bytes-like). Whole-block device copies on the CPU: one call per step and
 * layer set, the GIL released for the copying. */
static PyObject *py_memcpy_many(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "y*y*K", &dst, &src, &nbytes)) return NULL;
    if (dst.len != src.len || dst.len % 8) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "address arrays must be int64 arrays of equal length");
        return NULL;
    }
    Py_ssize_t n = dst.len / 8;
    const uint64_t *d = dst.buf, *s = src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], nbytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* ---- device copies fused with the payload CRC32C ----
 * A staging slot's payload is its block's layer segments (nbytes each) one
 * after the other. Copying a segment and checksumming it are two passes over
 * the same bytes; done a cache-sized piece at a time, the second pass reads the
 * piece from cache instead of DRAM, which removes the separate CRC pass over
 * every byte saved or loaded. */
#ifndef COPY_PIECE /* (tools/bench_crc_in_copy.py, built with -DCOPY_PIECE=...): 8-16 KiB pieces were the */
#define COPY_PIECE (16 << 10) /* cheapest, 4 KiB and 32-256 KiB cost 0.01-0.03 core-s/GB more on loads */
#endif

/* Parses (slot_addrs, seg_addrs): int64 arrays, n slot bases and n * layers
 * segment addresses, layer-major (layer l of slot i at [l * n + i]). Returns
 * the layer count, or -1 with an exception set. */
static Py_ssize_t copy_parse(Py_buffer *slots, Py_buffer *segs, Py_ssize_t *n) {
    *n = slots->len / 8;
    if (slots->len % 8 || segs->len % 8 || !*n || (segs->len / 8) % *n || segs->len / 8 < *n) {
        PyErr_SetString(PyExc_ValueError, "aiokv: address arrays must be int64 arrays, a whole number of segments "
                                          "(layers) per slot, at least one slot");
        return -1;
    }
    return segs->len / 8 / *n;
}

/* memcpy_crc_out(slot_addrs, seg_addrs, nbytes): for each slot, copy its
 * layers' segments into its payload, in order, and put the payload's CRC32C
 * at HDR_OFF_PCRC of its header, for stamp_slots(..., crc_in_copy=1). Each
 * piece is checksummed in the destination just after it was written (what
 * goes to disk is what the CRC covers). GIL released. */
static PyObject *py_memcpy_crc_out(PyObject *self, PyObject *args) {
    Py_buffer slots, segs;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "y*y*K", &slots, &segs, &nbytes)) return NULL;
    Py_ssize_t n, layers = copy_parse(&slots, &segs, &n);
    if (layers >= 0) {
        const uint64_t *sa = slots.buf, *ga = segs.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t *dst = (uint8_t *)(uintptr_t)sa[i] + HDR_BYTES;
            uint32_t crc = 0;
            for (Py_ssize_t l = 0; l < layers; l++) {
                const uint8_t *src = (const uint8_t *)(uintptr_t)ga[l * n + i];
                for (size_t off = 0; off < nbytes; off += COPY_PIECE) {
                    size_t k = nbytes - off < COPY_PIECE ? nbytes - off : COPY_PIECE;
                    memcpy(dst, src + off, k);
                    crc = crc32c(crc, dst, k);
                    dst += k;
                }
            }
            put32((uint8_t *)(uintptr_t)sa[i] + HDR_OFF_PCRC, crc);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&slots);
    PyBuffer_Release(&segs);
    if (layers < 0) return NULL;
    Py_RETURN_NONE;
}

/* memcpy_crc_in(seg_addrs, slot_addrs, nbytes) -> bytes: for each slot,
 * copy its payload into its layers' segments, checksumming each piece just
 * before it is copied; per slot 0 if the payload's CRC32C equals the one in
 * its header, else SLOT_PAYLOAD_CRC (format.SLOT_REASONS). The copy is made
 * either way: the caller reports a mismatched block as a failed load, and its
 * KV blocks are recomputed in place. The header itself is checked before
 * (verify_slots(..., crc_in_copy=1)). GIL released. */
static PyObject *py_memcpy_crc_in(PyObject *self, PyObject *args) {
    Py_buffer slots, segs;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "y*y*K", &segs, &slots, &nbytes)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t n, layers = copy_parse(&slots, &segs, &n);
    if (layers >= 0 && (out = PyBytes_FromStringAndSize(NULL, n))) {
        const uint64_t *sa = slots.buf, *ga = segs.buf;
        uint8_t *v = (uint8_t *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint8_t *src = (const uint8_t *)(uintptr_t)sa[i] + HDR_BYTES;
            uint32_t crc = 0;
            for (Py_ssize_t l = 0; l < layers; l++) {
                uint8_t *dst = (uint8_t *)(uintptr_t)ga[l * n + i];
                for (size_t off = 0; off < nbytes; off += COPY_PIECE) {
                    size_t k = nbytes - off < COPY_PIECE ? nbytes - off : COPY_PIECE;
                    crc = crc32c(crc, src, k);
                    memcpy(dst + off, src, k);
                    src += k;
                }
            }
            v[i] = crc == get32((const uint8_t *)(uintptr_t)sa[i] + HDR_OFF_PCRC) ? SLOT_OK : SLOT_PAYLOAD_CRC;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&slots);
    PyBuffer_Release(&segs);
    return out;
}

static PyMethodDef copy_methods[] = {
    {"memcpy_many", py_memcpy_many, METH_VARARGS, "memcpy_many(dst_addrs, src_addrs, nbytes)"},
    {"memcpy_crc_out", py_memcpy_crc_out, METH_VARARGS,
     "memcpy_crc_out(slot_addrs, seg_addrs, nbytes): segments -> payloads, CRC32C into the headers"},
    {"memcpy_crc_in", py_memcpy_crc_in, METH_VARARGS,
     "memcpy_crc_in(seg_addrs, slot_addrs, nbytes) -> bytes of verdicts (0 or payload checksum)"},
    {NULL}};

int copies_add(PyObject *m) { return PyModule_AddFunctions(m, copy_methods); }
