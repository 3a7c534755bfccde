/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CRC32C (Castagnoli), the checksum of every slot's header and payload and of
 * the journal's records: crc32c() for the other units, and crc32c, crc32c_bytes,
 * crc32c_path, crc32c_sw for Python (GIL released over large buffers).
 */
#include "aiokv.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

/* ---- CRC32C (Castagnoli): AVX-512 carry-less folding, else SSE4.2 crc32q, else tables ---- */
static uint32_t crc_table[8][256];
static void crc_zeros_tables(uint32_t zeros[4][256], size_t len);
#define CRC_LONG 8192
#define CRC_SHORT 256
static uint32_t crc_long[4][256];
static uint32_t crc_short[4][256];
static int have_sse42 = 0;
static int have_fold = 0; /* AVX-512 + VPCLMULQDQ, enabled by the OS */
static int cpu_has_fold(void);

void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
    crc_zeros_tables(crc_long, CRC_LONG);
    crc_zeros_tables(crc_short, CRC_SHORT);
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d)) have_sse42 = (c & bit_SSE4_2) != 0;
    have_fold = have_sse42 && cpu_has_fold();
#endif
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
              crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
              crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
              crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
    return crc;
}

/* Shifting a CRC register over zero bytes: the register after A||B (B of
 * length n, started from 0) is shift_n(crc after A) ^ crc of B. shift_n is
 * linear over GF(2), so for a fixed n it is four 256-entry tables, one per
 * byte of the register (Mark Adler's construction, zlib's crc32_combine idea). */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* tables that apply `len` zero bytes (len a power of two, >= 1) to a register */
static void crc_zeros_tables(uint32_t zeros[4][256], size_t len) {
    uint32_t odd[32], even[32];
    odd[0] = 0x82F63B78u; /* one zero bit */
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    uint32_t *op = odd;
    for (;;) {             /* 8 zero bits, 16, ... */
        gf2_square(even, odd);
        op = even;
        len >>= 1;
        if (!len) break;
        gf2_square(odd, even);
        op = odd;
        len >>= 1;
        if (!len) break;
    }
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t crc_shift(const uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

/* Three independent crc32q chains over three adjacent LONG (then SHORT) byte
 * runs, merged with the shift tables: crc32q has a latency of 3 cycles and a
 * throughput of 1 per cycle, so one serial chain runs at a third of the
 * instruction's rate. */
#if defined(__x86_64__)
/* The CRC loops start on a cache line, wherever other code moves them: left to
 * the compiler's 16-byte placement their speed moved by 5-20 % (median per call)
 * from one build to the next with no change to them (measured: builds of this file
 * loaded side by side in one process, called in turn on the same buffers). */
#define HOT_CODE __attribute__((aligned(64)))
/* Three interleaved crc32q chains over 3 * len-byte stripes, merged with the
 * shift table for len bytes; consumes whole stripes from *p / *n. */
HOT_CODE __attribute__((target("sse4.2"))) static uint64_t crc_3way(uint64_t c0, const uint8_t **pp, size_t *np,
                                                                   size_t len, const uint32_t table[4][256]) {
    const uint8_t *p = *pp;
    size_t n = *np;
    while (n >= 3 * len) {
        uint64_t c1 = 0, c2 = 0;
        const uint8_t *end = p + len;
        do {
            uint64_t a, b, d;
            memcpy(&a, p, 8);
            memcpy(&b, p + len, 8);
            memcpy(&d, p + 2 * len, 8);
            c0 = __builtin_ia32_crc32di(c0, a);
            c1 = __builtin_ia32_crc32di(c1, b);
            c2 = __builtin_ia32_crc32di(c2, d);
            p += 8;
        } while (p < end);
        c0 = crc_shift(table, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = crc_shift(table, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * len;
        n -= 3 * len;
    }
    *pp = p;
    *np = n;
    return c0;
}

HOT_CODE __attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c0 = crc;
    while (n && ((uintptr_t)p & 7)) {
        c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
        n--;
    }
    c0 = crc_3way(c0, &p, &n, CRC_LONG, crc_long);
    c0 = crc_3way(c0, &p, &n, CRC_SHORT, crc_short);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c0 = __builtin_ia32_crc32di(c0, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c0;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

/* Carry-less multiply folding (AVX-512 VPCLMULQDQ): the crc32q chains above
 * run at most 8 bytes a cycle; folding runs 16 lanes of 128 bits, 256 bytes an
 * iteration. In the reflected domain a 128-bit lane (little-endian, its bit 0
 * the highest power) is L * x^64 + H (L its low quadword, H its high one). To
 * carry it T bits further on, L * x^(64+T) and H * x^T are taken mod P, which
 * carry-less multiplies by the constants x^(T+31) and x^(T-33) mod P (reflected,
 * 32 bits) do: a reflected product is one bit short, and the constant sits in
 * the low 32 bits. The result stays < 2^128 and is XORed into the lane T bits
 * on. At the end the 64 bytes of state are congruent to everything read so far,
 * so a crc32q pass over them (from a zero register) is the CRC so far: that is
 * the final reduction, no Barrett step needed. tests/test_crc32c.py pins the
 * result to the table path for every length near each boundary. */
#define K2048_L 0xdcb17aa4ull /* x^2079 mod P: lanes move 2048 bits (256 bytes) an iteration */
#define K2048_H 0xb9e02b86ull /* x^2015 mod P */
#define K512_L 0x740eef02ull  /* x^543 mod P: one 64-byte register onto the next */
#define K512_H 0x9e4addf8ull  /* x^479 mod P */
#define CRC_FOLD_MIN 512      /* below this the crc32q path is as fast */

#if defined(__x86_64__)
#ifndef bit_VPCLMULQDQ
#define bit_VPCLMULQDQ (1 << 10)
#endif
static int cpu_has_fold(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xe6) != 0xe6) return 0; /* the OS saves XMM, YMM, opmask and all of ZMM */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b & bit_AVX512F) && (c & bit_VPCLMULQDQ);
}

__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
    __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00), hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96); /* lo ^ hi ^ next */
}

/* Raw register in, raw register out, like crc_hw. */
HOT_CODE __attribute__((target("avx512f,vpclmulqdq,sse4.2"))) static uint32_t crc_fold(uint32_t crc,
                                                                                        const uint8_t *p, size_t n) {
    if (n < 256) return crc_hw(crc, p, n);
    const __m512i k2048 = _mm512_set_epi64(K2048_H, K2048_L, K2048_H, K2048_L, K2048_H, K2048_L, K2048_H, K2048_L);
    const __m512i k512 = _mm512_set_epi64(K512_H, K512_L, K512_H, K512_L, K512_H, K512_L, K512_H, K512_L);
    /* the register enters as the first 32 bits of the message XORed with it */
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                              0, 0, (int)crc));
    __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    p += 256;
    n -= 256;
    while (n >= 256) {
        x0 = fold512(x0, k2048, _mm512_loadu_si512(p));
        x1 = fold512(x1, k2048, _mm512_loadu_si512(p + 64));
        x2 = fold512(x2, k2048, _mm512_loadu_si512(p + 128));
        x3 = fold512(x3, k2048, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    x1 = fold512(x0, k512, x1);
    x2 = fold512(x1, k512, x2);
    x3 = fold512(x2, k512, x3);
    for (; n >= 64; p += 64, n -= 64) x3 = fold512(x3, k512, _mm512_loadu_si512(p));
    uint8_t state[64];
    _mm512_storeu_si512(state, x3);
    return crc_hw(crc_hw(0, state, 64), p, n);
}
#endif

enum { CRC_TABLE, CRC_CRC32Q, CRC_FOLD };

/* CRC32C (seed: a previous result, 0 to start) by the given path, which the
 * caller has checked the CPU has. */
static uint32_t crc32c_by(int path, uint32_t seed, const uint8_t *p, size_t n) {
    uint32_t crc = ~seed;
#if defined(__x86_64__)
    if (path == CRC_FOLD) return ~crc_fold(crc, p, n);
    if (path == CRC_CRC32Q) return ~crc_hw(crc, p, n);
#endif
    return ~crc_sw(crc, p, n);
}

uint32_t crc32c(uint32_t seed, const uint8_t *p, size_t n) {
    int path = have_fold && n >= CRC_FOLD_MIN ? CRC_FOLD : have_sse42 ? CRC_CRC32Q : CRC_TABLE;
    return crc32c_by(path, seed, p, n);
}

/* crc32c(addr, length, seed=0) -> int */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    unsigned long long addr, length;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "KK|I", &addr, &length, &seed)) return NULL;
    uint32_t r;
    if (length > 65536) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c(seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c(seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
    }
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_sw(buffer, seed=0) -> int: the table-driven path whatever the CPU
 * has (tests check the hardware path against it). */
static PyObject *py_crc32c_sw(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed)) return NULL;
    uint32_t r = ~crc_sw(~seed, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}

static const char *const crc_path_names[] = {"table", "crc32q", "fold"};

/* crc32c_path(path, addr, length, seed=0) -> int: CRC32C by one named path
 * ("table", "crc32q", "fold"), GIL released; ValueError where this CPU lacks
 * it. For tests (every path against the table) and benchmarks. */
static PyObject *py_crc32c_path(PyObject *self, PyObject *args) {
    const char *name;
    unsigned long long addr, length;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "sKK|I", &name, &addr, &length, &seed)) return NULL;
    int path = -1;
    for (int i = 0; i < 3; i++)
        if (!strcmp(name, crc_path_names[i])) path = i;
    int have[3] = {1, have_sse42, have_fold};
    if (path < 0 || !have[path]) {
        PyErr_Format(PyExc_ValueError, "aiokv: CRC32C path %s is not one this CPU has (%s)", name,
                     have_fold ? "table, crc32q, fold" : have_sse42 ? "table, crc32q" : "table");
        return NULL;
    }
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = crc32c_by(path, seed, (const uint8_t *)(uintptr_t)addr, (size_t)length);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_bytes(buffer, seed=0) -> int, for Python-side buffers (GIL released above 64 KiB). */
static PyObject *py_crc32c_bytes(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed)) return NULL;
    uint32_t r;
    if (view.len > 65536) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c(seed, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c(seed, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(r);
}
static PyMethodDef crc_methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(addr, length, seed=0) -> int"},
    {"crc32c_bytes", py_crc32c_bytes, METH_VARARGS, "crc32c_bytes(buffer, seed=0) -> int"},
    {"crc32c_path", py_crc32c_path, METH_VARARGS, "crc32c_path(path, addr, length, seed=0) -> int (tests, benchmarks)"},
    {"crc32c_sw", py_crc32c_sw, METH_VARARGS, "crc32c_sw(buffer, seed=0) -> int (table path, for tests)"},
    {NULL}};

int crc_add(PyObject *m) {
    if (PyModule_AddFunctions(m, crc_methods) < 0 || PyModule_AddIntConstant(m, "HAVE_HW_CRC", have_sse42) < 0 ||
        PyModule_AddStringConstant(m, "CRC_PATH",
                                   crc_path_names[have_fold ? CRC_FOLD : have_sse42 ? CRC_CRC32Q : CRC_TABLE]) < 0)
        return -1;
    /* every path this CPU runs, slowest first (crc32c_path takes each) */
    return PyModule_AddObject(m, "CRC_PATHS", have_fold    ? Py_BuildValue("(sss)", "table", "crc32q", "fold")
                                              : have_sse42 ? Py_BuildValue("(ss)", "table", "crc32q")
                                                           : Py_BuildValue("(s)", "table"));
}
