/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CRC32C (native/crc32c.c), the one implementation both modules link: aiokv._native
 * (slots, block copies, and crc32c_py.c's Python functions) and aiokv._index (the
 * journal's records: records.c). Plain C, no Python: each module has its own copy
 * of the path state, set by its own init's crc_init().
 *
 * Threading: every function runs on any thread, several at once, once crc_init
 * has run (each module's init, under the GIL); crc_use changes the path only for
 * benchmarks and tests (crc32c_use), not against calls running.
 */
#ifndef AIOKV_CRC32C_H
#define AIOKV_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* the paths, slowest first (native/crc32c.c says what each is) */
enum { CRC_TABLE, CRC_CRC32Q, CRC_ISAL, CRC_NPATHS };
extern const char *const crc_path_names[CRC_NPATHS]; /* "table", "crc32q", "isal" */

void crc_init(void);                                                     /* once, from the module's init */
uint32_t crc32c(uint32_t seed, const uint8_t *p, size_t n);              /* seed: a previous result, 0 to start */
uint32_t crc32c_by(int path, uint32_t seed, const uint8_t *p, size_t n); /* by a path crc_has */
int crc_has(int path);                                                   /* whether this machine runs it */
int crc_default(void);                                                   /* the path crc32c() takes */
void crc_use(int path);                                                  /* crc32c() takes it from now on */

#endif /* AIOKV_CRC32C_H */
