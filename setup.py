"""Builds aiokv._native, the C extension over liburing (native/aiokv_native.c).

liburing is linked statically when Debian's liburing.a is present, so the built
wheel needs only libc at run time. Without liburing's header, building the
extension (pip install, a wheel; not an sdist) stops with one line naming the fix.
"""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HEADER_DIRS = ["/usr/include", "/usr/local/include"]
MISSING = "aiokv: liburing.h not found; install it with: apt-get install -y liburing-dev (Debian/Ubuntu)"


class BuildExt(build_ext):
    def run(self):
        if not any(os.path.exists(os.path.join(d, "liburing.h")) for d in HEADER_DIRS):
            raise SystemExit(MISSING)
        super().run()


static = sorted(glob.glob("/usr/lib/*/liburing.a") + glob.glob("/usr/lib/liburing.a")
                + glob.glob("/usr/local/lib/liburing.a"))
ext = Extension(
    "aiokv._native",
    sources=["native/aiokv_native.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    extra_objects=static[:1],
    libraries=[] if static else ["uring"],
)
setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
