"""Builds aiokv._native, the C extension over liburing (native/aiokv_native.c, with
BLAKE3 for the slot MAC: native/recipe.py lists the units and their flags).

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
MISSING = ("aiokv: liburing.h not found; install it with: apt-get install -y liburing-dev (Debian/Ubuntu), "
           "or set AIOKV_WITHOUT_URING=1 to build without io_uring (thread-pool I/O)")
WITHOUT = os.environ.get("AIOKV_WITHOUT_URING") == "1"


class BuildExt(build_ext):
    def run(self):
        if not WITHOUT and not any(os.path.exists(os.path.join(d, "liburing.h")) for d in HEADER_DIRS):
            raise SystemExit(MISSING)
        super().run()

    def build_extension(self, ext):
        # the units that need an instruction set allowed (BLAKE3's SIMD files) are compiled here, alone
        objs = []
        for src, flags in SIMD:
            objs += self.compiler.compile([src], output_dir=self.build_temp, macros=MACROS,
                                          extra_postargs=recipe.CFLAGS + flags)
        ext.extra_objects = objs + ext.extra_objects
        super().build_extension(ext)


UNITS, MACROS = recipe.units()
SIMD = [(src, flags) for src, flags in UNITS if flags]
static = [] if WITHOUT else sorted(glob.glob("/usr/lib/*/liburing.a") + glob.glob("/usr/lib/liburing.a")
                                   + glob.glob("/usr/local/lib/liburing.a"))
ext = Extension(
    "aiokv._native",
    sources=[src for src, flags in UNITS if not flags],
    extra_compile_args=recipe.CFLAGS,
    define_macros=MACROS + ([] if WITHOUT else [("AIOKV_HAVE_URING", "1")]),
    depends=glob.glob("native/blake3/*.h") + ["native/recipe.py"],
    extra_objects=static[:1],
    libraries=[] if WITHOUT or static else ["uring"],
)
setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
