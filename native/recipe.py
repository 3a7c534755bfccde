# SPDX-License-Identifier: Apache-2.0
"""What aiokv._native is built from: the one list setup.py and tools/gpu_check.py
build from (no setuptools needed to read it).

UNITS: the extension's C units (native/aiokv.h says what each does). Only
PyInit__native leaves the extension (EXPORTS, a linker version script). With
Intel ISA-L (its header ISAL_HEADER found, the build not told otherwise) the
units are compiled with ISAL_MACRO and linked with ISAL_LIB: native/crc32c.c
then takes ISA-L's crc32_iscsi for CRC32C.
"""

from __future__ import annotations

import os

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-fvisibility=hidden"]
EXPORTS = os.path.join("native", "exports.map")
UNITS = (
    "module.c",
    "ops.c",
    "ring.c",
    "ring_batches.c",
    "ring_submit.c",
    "pool.c",
    "crc32c.c",
    "crc32c_py.c",
    "slots.c",
    "copies.c",
)
ISAL_HEADER = os.path.join("isa-l", "crc.h")
ISAL_MACRO = ("AIOKV_HAVE_ISAL", "1")
ISAL_LIB = "isal"
# aiokv._index, the compact index's hot loops (aiokv/store/table.py), a module of its own
# (native/index.h says what each unit does): the hash (probe.c), the journal records made and
# checked (records.c, by crc32c.c's CRC32C, the one of aiokv._native, built with the same
# ISA-L macro and library) and applied (apply.c), the eviction order (order.c and its units:
# native/order.h), an operator's order's bulk changes (bulk.c: aiokv/store/bulk.py) and the keys
# loads hold, counted in bulk (holds.c: aiokv/store/loadpins.py)
INDEX_UNITS = [
    os.path.join("native", n)
    for n in (
        "aiokv_index.c",
        "probe.c",
        "records.c",
        "apply.c",
        "order.c",
        "order_place.c",
        "order_search.c",
        "order_build.c",
        "bulk.c",
        "holds.c",
        "crc32c.c",
    )
]


def units() -> tuple[list[str], list[tuple[str, str]]]:
    """(source paths from the project's root, macros for every unit)."""
    return [os.path.join("native", u) for u in UNITS], []
