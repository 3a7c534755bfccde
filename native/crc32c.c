/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CRC32C (Castagnoli), the checksum of every slot's header and payload and of
 * the journal's records: crc32c() and crc32c_by() for the other units of both
 * modules (native/crc32c.h), plain C; crc32c_py.c gives aiokv._native's Python
 * its crc32c, crc32c_bytes, crc32c_path, crc32c_sw and crc32c_use.
 *
 * The paths (Python's crc32c_path takes each by name; CRC_PATHS lists those this
 * machine runs, slowest first; CRC_PATH is the one crc32c() takes):
 *   "isal"    Intel ISA-L's crc32_iscsi (a maintained library, which picks its
 *             own code for the CPU: AVX-512 folding, crc32 streams, aarch64's
 *             CRC instructions), wherever the extension is built with it
 *             (AIOKV_HAVE_ISAL: setup.py, native/recipe.py); the default there;
 *   "crc32q"  ours, x86-64 with SSE4.2 and PCLMULQDQ: the crc32 instruction over
 *             three streams at once, joined by carry-less multiplication; the
 *             default of a build without ISA-L on such a CPU;
 *   "table"   ours, one byte a step through a 256-entry table: any CPU.
 * All give the same result (tests/test_crc32c.py pins each to the table for
 * every length, alignment and seed near each boundary). tools/bench_crc.py and
 * tools/bench_crc_in_copy.py measure them side by side (docs/benchmarks.md).
 *
 * The arithmetic. CRC32C is the remainder of the message, as a polynomial over
 * GF(2), times x^32, modulo P = 0x1EDC6F41 (Castagnoli, Braeutigam, Herrmann,
 * IEEE Trans. Communications 41(6), 1993; RFC 3720's iSCSI checksum), with the
 * register set to all ones before and inverted after. This file keeps the
 * register raw (crc32c_by does the inversions) in the bit-reflected convention
 * the crc32 instruction uses: bit 31 of a 32-bit value is the coefficient of
 * x^0 and bit 0 that of x^31, and a message's first byte's bit 0 is its highest
 * power. In that convention
 *   - multiplying by x is a right shift, and a bit leaving at the bottom (x^32)
 *     comes back as P's low terms, 0x82F63B78 reflected (mulx, xpow below);
 *   - the crc32 instruction on register R and 64 data bits D gives
 *     (R * x^64 + D * x^32) mod P; with R = 0, D * x^32 mod P;
 *   - the register after A||B is shift(crc(A), |B|) ^ crc(B from zero), where
 *     shift(R, m bytes) = R * x^(8m) mod P: a CRC is linear in register and data;
 *   - a carry-less product of two reflected 32-bit values a and k, read as a
 *     64-bit reflected value, is a * k * x (the product's top coefficient lands
 *     one place below x^63), so crc32(0, clmul(R, x^(8m-33) mod P)) is
 *     R * x^(8m-33) * x * x^32 = R * x^(8m) mod P: the shift, in two instructions.
 * The "crc32q" path rests on the last two facts: the crc32 instruction takes 3
 * cycles but starts one every cycle, so three independent streams keep it busy,
 * and their registers are joined by two carry-less shifts (the technique of
 * Gopal et al., "Fast CRC Computation for iSCSI Polynomial Using CRC32
 * Instruction", Intel, 2011). Its constants are powers of x mod P, computed
 * once at start by xpow.
 *
 * Threading: every function runs on any thread, several at once; `have` and
 * `default_path` (one pair per module that links this unit) are set at import
 * (crc_init) and by crc_use, which only tests and benchmarks call (Python's
 * crc32c_use), under the GIL.
 */
#include "crc32c.h"

#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#ifdef AIOKV_HAVE_ISAL
#include <isa-l/crc.h>
#include <limits.h>
#endif

#define POLY 0x82F63B78u /* P's terms below x^32, reflected */

/* x^e mod P, reflected: x^0 is bit 31, and each step multiplies by x */
static uint32_t xpow(uint64_t e) {
    uint32_t r = 0x80000000u;
    while (e--) r = (r >> 1) ^ (POLY & (0u - (r & 1)));
    return r;
}

/* ---- "table": one byte a step ----
 * byte_table[b]: a register holding b alone (its low byte: the highest powers)
 * times x^8 mod P: eight steps of xpow's multiply by x (crc_init). A step takes the low
 * byte, XORed with the next message byte, through the table and the rest of
 * the register down by 8 bits. */
static uint32_t byte_table[256];

static uint32_t crc_table(uint32_t r, const uint8_t *p, size_t n) {
    while (n--) r = (r >> 8) ^ byte_table[(r ^ *p++) & 0xff];
    return r;
}

const char *const crc_path_names[CRC_NPATHS] = {"table", "crc32q", "isal"};
static int have[CRC_NPATHS] = {1, 0, 0}; /* crc_init: which paths this machine runs */
static int default_path = CRC_TABLE;       /* crc_init: the fastest of them (crc_use changes it) */

#if defined(__x86_64__)
/* The CRC loops start on a cache line, wherever other code moves them: left to
 * the compiler's 16-byte placement their speed moved by 5-20 % (median per call)
 * from one build to the next with no change to them (measured: builds of this file
 * loaded side by side in one process, called in turn on the same buffers). */
#define HOT_CODE __attribute__((aligned(64)))

/* ---- "crc32q": three streams, joined ----
 * Stream lengths, longest first: a buffer is cut into rounds of three streams of
 * STREAM[i] bytes while it is long enough, then the shorter ones; each round
 * costs two carry-less shifts to join. The rest goes 8 bytes a step. */
#define STREAM_LEVELS 3
static const size_t STREAM[STREAM_LEVELS] = {4096, 512, 64};
static uint32_t k_one[STREAM_LEVELS], k_two[STREAM_LEVELS]; /* x^(8L-33), x^(16L-33) mod P */

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* a * k carry-less (a < 2^32): 63 bits, read as the reflected a * k * x */
__attribute__((target("pclmul"))) static inline uint64_t clmul32(uint64_t a, uint32_t k) {
    __m128i t = _mm_clmulepi64_si128(_mm_cvtsi64_si128((long long)a), _mm_cvtsi32_si128((int)k), 0x00);
    return (uint64_t)_mm_cvtsi128_si64(t);
}

HOT_CODE __attribute__((target("sse4.2,pclmul"))) static uint32_t crc_crc32q(uint32_t r, const uint8_t *p,
                                                                              size_t n) {
    uint64_t c = r;
    for (; n && ((uintptr_t)p & 7); n--) c = _mm_crc32_u8((uint32_t)c, *p++);
    for (int lv = 0; lv < STREAM_LEVELS; lv++) {
        const size_t len = STREAM[lv];
        for (; n >= 3 * len; p += 3 * len, n -= 3 * len) {
            uint64_t c1 = 0, c2 = 0;
            for (size_t i = 0; i < len; i += 8) {
                c = _mm_crc32_u64(c, load64(p + i));
                c1 = _mm_crc32_u64(c1, load64(p + len + i));
                c2 = _mm_crc32_u64(c2, load64(p + 2 * len + i));
            }
            /* c moves over the two streams after it, c1 over one; crc32(0, .) is linear */
            c = _mm_crc32_u64(0, clmul32(c, k_two[lv]) ^ clmul32(c1, k_one[lv])) ^ c2;
        }
    }
    for (; n >= 8; p += 8, n -= 8) c = _mm_crc32_u64(c, load64(p));
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}

#endif /* __x86_64__ */

#ifdef AIOKV_HAVE_ISAL
/* ISA-L takes and returns the raw register, and an int length */
static uint32_t crc_isal(uint32_t r, const uint8_t *p, size_t n) {
    for (; n > (size_t)INT_MAX; p += 1u << 30, n -= 1u << 30) r = crc32_iscsi((unsigned char *)p, 1 << 30, r);
    return crc32_iscsi((unsigned char *)p, (int)n, r);
}
#endif

void crc_init(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t r = b;
        for (int k = 0; k < 8; k++) r = (r >> 1) ^ (POLY & (0u - (r & 1)));
        byte_table[b] = r;
    }
#if defined(__x86_64__)
    for (int lv = 0; lv < STREAM_LEVELS; lv++) {
        k_one[lv] = xpow(8 * STREAM[lv] - 33);
        k_two[lv] = xpow(16 * STREAM[lv] - 33);
    }
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) have[CRC_CRC32Q] = (c & bit_SSE4_2) && (c & bit_PCLMUL);
#endif
#ifdef AIOKV_HAVE_ISAL
    have[CRC_ISAL] = 1;
#endif
    for (int i = 0; i < CRC_NPATHS; i++)
        if (have[i]) default_path = i;
}

/* CRC32C (seed: a previous result, 0 to start) by the given path, which this
 * machine has (crc_has). */
uint32_t crc32c_by(int path, uint32_t seed, const uint8_t *p, size_t n) {
    uint32_t r = ~seed;
#if defined(__x86_64__)
    if (path == CRC_CRC32Q) return ~crc_crc32q(r, p, n);
#endif
#ifdef AIOKV_HAVE_ISAL
    if (path == CRC_ISAL) return ~crc_isal(r, p, n);
#endif
    return ~crc_table(r, p, n);
}

uint32_t crc32c(uint32_t seed, const uint8_t *p, size_t n) { return crc32c_by(default_path, seed, p, n); }

int crc_has(int path) { return path >= 0 && path < CRC_NPATHS && have[path]; }

int crc_default(void) { return default_path; }

void crc_use(int path) { default_path = path; }
