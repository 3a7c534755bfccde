# SPDX-License-Identifier: Apache-2.0
"""What aiokv._native is built from: the one list setup.py and tools/gpu_check.py
build from (no setuptools needed to read it).

aiokv_native.c, plus BLAKE3's C implementation (native/blake3, CC0, for the slot
MAC): its portable code, and on x86-64 its SSE2, SSE4.1, AVX2 and AVX-512
assembly (Unix; BLAKE3 picks one at run time by CPUID; 25 % faster than its
intrinsics on this project's test machines), on AArch64 its NEON code. Other
machines get the portable code alone. Only PyInit__native leaves the extension
(EXPORTS, a linker version script): a library loaded before it that exports a
BLAKE3 of its own can then not stand in for ours.
"""

from __future__ import annotations

import os
import platform

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-fvisibility=hidden"]
EXPORTS = os.path.join("native", "exports.map")
# aiokv._index, the compact index's hot loops (aiokv/store/table.py): one unit, a module of its own
INDEX_UNITS = [os.path.join("native", "aiokv_index.c")]
_NO_X86 = [("BLAKE3_NO_SSE2", "1"), ("BLAKE3_NO_SSE41", "1"), ("BLAKE3_NO_AVX2", "1"), ("BLAKE3_NO_AVX512", "1")]
_HIDDEN = [("BLAKE3_API", ""), ("BLAKE3_PRIVATE", "")]


def units(machine: str | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """(source paths from the project's root, macros for every unit) for this machine."""
    m = (machine or platform.machine()).lower()
    b3 = lambda f: os.path.join("native", "blake3", f)  # noqa: E731
    plain = [os.path.join("native", "aiokv_native.c")] + [
        b3(f) for f in ("blake3.c", "blake3_dispatch.c", "blake3_portable.c")
    ]
    if m in ("x86_64", "amd64"):
        return plain + [b3(f"blake3_{s}_x86-64_unix.S") for s in ("sse2", "sse41", "avx2", "avx512")], _HIDDEN
    if m in ("aarch64", "arm64"):
        return plain + [b3("blake3_neon.c")], _HIDDEN + [("BLAKE3_USE_NEON", "1")] + _NO_X86
    return plain, _HIDDEN + [("BLAKE3_USE_NEON", "0")] + _NO_X86
