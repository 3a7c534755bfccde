"""What aiokv._native is built from, with which flags: the one list setup.py and
tools/gpu_check.py build from (no setuptools needed to read it).

aiokv_native.c, plus BLAKE3's C implementation (native/blake3, CC0, for the slot
MAC): its portable code, and on x86-64 its SSE2, SSE4.1, AVX2 and AVX-512 files,
each compiled with that instruction set allowed (BLAKE3 picks one at run time by
CPUID); on AArch64 its NEON file. Other machines get the portable code alone.
"""
from __future__ import annotations

import os
import platform

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-fvisibility=hidden"]
_X86_SIMD = [("blake3_sse2.c", ["-msse2"]), ("blake3_sse41.c", ["-msse4.1"]), ("blake3_avx2.c", ["-mavx2"]),
             ("blake3_avx512.c", ["-mavx512f", "-mavx512vl"])]
_NO_X86 = [("BLAKE3_NO_SSE2", "1"), ("BLAKE3_NO_SSE41", "1"), ("BLAKE3_NO_AVX2", "1"), ("BLAKE3_NO_AVX512", "1")]


# BLAKE3's functions stay inside the extension (hidden): a library loaded before it that
# exports a BLAKE3 of its own can then not stand in for ours
HIDDEN = [("BLAKE3_API", ""), ("BLAKE3_PRIVATE", "")]


def units(machine: str | None = None) -> tuple[list[tuple[str, list[str]]], list[tuple[str, str]]]:
    """([(source path from the project's root, its extra compiler flags)], macros for
    every unit) for this machine."""
    m = (machine or platform.machine()).lower()
    b3 = lambda f: os.path.join("native", "blake3", f)  # noqa: E731
    plain = [(os.path.join("native", "aiokv_native.c"), [])] + [(b3(f), []) for f in
                                                              ("blake3.c", "blake3_dispatch.c", "blake3_portable.c")]
    if m in ("x86_64", "amd64"):
        return plain + [(b3(f), flags) for f, flags in _X86_SIMD], HIDDEN
    if m in ("aarch64", "arm64"):
        return plain + [(b3("blake3_neon.c"), [])], HIDDEN + [("BLAKE3_USE_NEON", "1")] + _NO_X86
    return plain, HIDDEN + [("BLAKE3_USE_NEON", "0")] + _NO_X86
