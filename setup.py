# SPDX-License-Identifier: Apache-2.0
"""Builds aiokv._native, the C extension (native/*.c: native/recipe.py lists the
units) over liburing and Intel ISA-L (its CRC32C, crc32_iscsi).

liburing is linked statically when Debian's liburing.a is present, ISA-L as a
shared library (Debian has no static one): a wheel made by tools/wheel.sh carries
it (auditwheel), so it needs only libc at run time. Without liburing's header,
building the extension (pip install, a wheel; not an sdist) stops with one line
naming the fix, unless AIOKV_WITHOUT_URING=1 asks for a build without it: the
extension then has CRC32C, the block copies and fallocate but no io_uring ring,
and aiokv uses its thread-pool I/O backend (what tools/gpu_check.py does on
machines without liburing). Likewise without ISA-L's header, unless
AIOKV_WITHOUT_ISAL=1 asks for aiokv's own CRC32C (native/crc32c.c: "crc32q" on
x86-64 with SSE4.2, else a table).
"""

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "native"))
import recipe  # noqa: E402

HEADER_DIRS = ["/usr/include", "/usr/local/include"]
MISSING = (
    "aiokv: liburing.h not found; install it with: apt-get install -y liburing-dev (Debian/Ubuntu), "
    "or set AIOKV_WITHOUT_URING=1 to build without io_uring (thread-pool I/O)"
)
MISSING_ISAL = (
    "aiokv: isa-l/crc.h not found; install it with: apt-get install -y libisal-dev (Debian/Ubuntu), "
    "or set AIOKV_WITHOUT_ISAL=1 to build with aiokv's own CRC32C"
)
WITHOUT = os.environ.get("AIOKV_WITHOUT_URING") == "1"
WITHOUT_ISAL = os.environ.get("AIOKV_WITHOUT_ISAL") == "1"


def have_header(name: str) -> bool:
    return any(os.path.exists(os.path.join(d, name)) for d in HEADER_DIRS)


class BuildExt(build_ext):
    def run(self):
        if not WITHOUT and not have_header("liburing.h"):
            raise SystemExit(MISSING)
        if not WITHOUT_ISAL and not have_header(recipe.ISAL_HEADER):
            raise SystemExit(MISSING_ISAL)
        super().run()


UNITS, MACROS = recipe.units()
static = (
    []
    if WITHOUT
    else sorted(
        glob.glob("/usr/lib/*/liburing.a") + glob.glob("/usr/lib/liburing.a") + glob.glob("/usr/local/lib/liburing.a")
    )
)
ext = Extension(
    "aiokv._native",
    sources=UNITS,
    extra_compile_args=recipe.CFLAGS,
    define_macros=MACROS
    + ([] if WITHOUT else [("AIOKV_HAVE_URING", "1")])
    + ([] if WITHOUT_ISAL else [recipe.ISAL_MACRO]),
    depends=glob.glob("native/*.h") + ["native/recipe.py", recipe.EXPORTS],
    extra_link_args=[f"-Wl,--version-script={recipe.EXPORTS}"],
    extra_objects=static[:1],
    libraries=([] if WITHOUT or static else ["uring"]) + ([] if WITHOUT_ISAL else [recipe.ISAL_LIB]),
)
# the compact index's hot loops (aiokv/store/table.py): a module of its own, whose journal
# records take native/crc32c.c's CRC32C by the same path as aiokv._native (ISA-L's where built with it)
index_ext = Extension(
    "aiokv._index",
    sources=recipe.INDEX_UNITS,
    extra_compile_args=recipe.CFLAGS,
    define_macros=[] if WITHOUT_ISAL else [recipe.ISAL_MACRO],
    depends=[os.path.join("native", h) for h in ("index.h", "order.h", "crc32c.h")] + ["native/recipe.py"],
    libraries=[] if WITHOUT_ISAL else [recipe.ISAL_LIB],
)
setup(ext_modules=[ext, index_ext], cmdclass={"build_ext": BuildExt})
