/* SPDX-License-Identifier: Apache-2.0 */
/*
 * aiokv._native: what its units share (native/recipe.py lists the units).
 *
 *   module.c  the module: its init, fallocate
 *   ops.c     an I/O operation parsed, and which adjacent writes merge (ops.h)
 *   ring.c    Ring, the io_uring ring that runs batches (aiokv/data/uring.py); its
 *             batches in ring_batches.c, its submissions in ring_submit.c (ring.h)
 *   pool.c    Pool, threads of our own that run batches where io_uring is not used
 *             (aiokv/data/threads.py)
 *   crc32c.c  CRC32C, the checksum of every slot, header and journal record (crc32c.h;
 *             aiokv._index links it too); crc32c_py.c its Python functions
 *   slots.c   slot headers: stamp_slots, verify_slots, check_slot (aiokv/data/format/slot.py)
 *   copies.c  block copies on the CPU device, the payload CRC taken inside them
 *
 * Every unit is built with hidden visibility and the link keeps only
 * PyInit__native (native/exports.map), so the names below stay inside the
 * extension.
 */
#ifndef AIOKV_NATIVE_H
#define AIOKV_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* calls over more bytes than this release the GIL (crc32c_py.c, slots.c): below it, giving the
 * GIL up and taking it back costs more than the work */
#define GIL_FREE_BYTES 65536

/* ---- crc32c.c (crc32c.h: crc_init, once from PyInit__native; crc32c) ---- */
#include "crc32c.h"

/* ---- crc32c_py.c ---- */
int crc_add(PyObject *m); /* CRC32C's functions and constants; 0 or -1 */

/* ---- ring.c ---- */
int ring_add(PyObject *m); /* Ring (where built with liburing) and HAVE_URING; 0 or -1 */

/* ---- pool.c ---- */
int pool_add(PyObject *m); /* Pool; 0 or -1 */

/* ---- slots.c ---- */
int slots_add(PyObject *m);

/* ---- copies.c ---- */
int copies_add(PyObject *m);

/* ---- the slot header (slots.c writes and checks it; copies.c puts and checks its payload CRC) ----
 * The layout of aiokv/data/format/slot.py's HDR ("<8sHHI16sBB2xIQ32sQQ") and the
 * header CRC after it, byte for byte (tests/test_native_slot_check_agrees_with_format.py
 * pins the two together): magic, version, header bytes, rank, nsid, key length,
 * MAC scheme, payload CRC, payload length, key, sequence, layout tag, CRC of the
 * 96 bytes before it. A slot is HDR_BYTES of header (the rest zero, or the MAC)
 * and then the payload. */
#define HDR_OFF_MAGIC 0
#define HDR_OFF_VERSION 8
#define HDR_OFF_HBYTES 10
#define HDR_OFF_RANK 12
#define HDR_OFF_NSID 16
#define HDR_OFF_KLEN 32
#define HDR_OFF_MACS 33
#define HDR_OFF_PCRC 36
#define HDR_OFF_PLEN 40
#define HDR_OFF_KEY 48
#define HDR_OFF_SEQ 80
#define HDR_OFF_LAYOUT 88
#define HDR_BODY 96
#define HDR_USED 100
#define HDR_BYTES 4096
#define FILE_VERSION 1
#define MAX_KEY 32

/* Verdicts, in the order checked: index into format.SLOT_REASONS (the one
 * place they are named; SLOT_VERDICTS, exported, is their count). */
enum { SLOT_OK, SLOT_HDR_SHORT, SLOT_HDR_CRC, SLOT_MAGIC, SLOT_VERSION, SLOT_LAYOUT, SLOT_NSID, SLOT_RANK, SLOT_KEY,
       SLOT_PLEN, SLOT_PAYLOAD_SHORT, SLOT_PAYLOAD_CRC, SLOT_MAC, SLOT_VERDICTS };

/* little-endian fields (x86-64 and aarch64 are) */
static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

#endif /* AIOKV_NATIVE_H */
