# SPDX-License-Identifier: Apache-2.0
"""Builds aiokv._native, the C extension over liburing (native/aiokv_native.c, with
BLAKE3 for the slot MAC: native/recipe.py lists the units).

liburing is linked statically when Debian's liburing.a is present, so the built
wheel needs only libc at run time. Without liburing's header, building the
extension (pip install, a wheel; not an sdist) stops with one line naming the fix,
unless AIOKV_WITHOUT_URING=1 asks for a build without it: the extension then has
CRC32C, the block copies and fallocate but no io_uring ring, and aiokv uses its
thread-pool I/O backend (what tools/gpu_check.py does on machines without liburing).
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
WITHOUT = os.environ.get("AIOKV_WITHOUT_URING") == "1"


class BuildExt(build_ext):
    def run(self):
        if not WITHOUT and not any(os.path.exists(os.path.join(d, "liburing.h")) for d in HEADER_DIRS):
            raise SystemExit(MISSING)
        super().run()

    def build_extension(self, ext):
        self.compiler.src_extensions.append(".S")  # BLAKE3's assembly (native/recipe.py)
        super().build_extension(ext)


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
    define_macros=MACROS + ([] if WITHOUT else [("AIOKV_HAVE_URING", "1")]),
    depends=glob.glob("native/blake3/*.h") + ["native/recipe.py", recipe.EXPORTS],
    extra_link_args=[f"-Wl,--version-script={recipe.EXPORTS}"],
    extra_objects=static[:1],
    libraries=[] if WITHOUT or static else ["uring"],
)
# the compact index's hot loops (aiokv/store/table.py): a module of its own, no library
index_ext = Extension("aiokv._index", sources=recipe.INDEX_UNITS, extra_compile_args=recipe.CFLAGS)
setup(ext_modules=[ext, index_ext], cmdclass={"build_ext": BuildExt})
