# SPDX-License-Identifier: Apache-2.0
"""The package builds cleanly and works where it is installed, not only in this checkout.

The bug: the project metadata used deprecated fields (a license table,
setuptools warned about it), declared a dependency nothing imports (aiofiles)
and a version written in two places; the liburing check ran even for an sdist;
nothing showed that an installed wheel works on its own.

The invariants: `python -m build` (here without isolation, so it runs offline)
makes an sdist and a wheel and prints no warning; the wheel's metadata carries
the SPDX license, the single-sourced version and only the dependencies aiokv
imports; installed with `pip install --no-index --no-deps` into a fresh venv
(dependencies from this environment's site-packages), `aiokv --version` and
`aiokv inspect` run from it, not from this checkout; building the extension
without liburing's header, or without ISA-L's, stops with one line naming the fix.

Binary wheels (issue 33 item 6: `pip install` where there is no compiler or
liburing-dev): tools/wheel.sh makes a manylinux wheel per Python (3.11 and 3.12,
GPU machines run 3.12) that auditwheel finds needs nothing outside glibc (ISA-L
copied into the wheel); installed into a fresh venv of that Python and run where
liburing's and ISA-L's headers and shared libraries are hidden (a private mount
namespace), its extension links no library from outside the wheel but glibc's,
opens an io_uring ring, and a read goes through the ring, through aiokv's
io_uring backend, into memory.

The fix: pyproject.toml (SPDX license, dynamic version, dependencies),
setup.py (the header checks inside build_ext), MANIFEST.in, tools/wheel.sh.
"""

from __future__ import annotations

import email
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from aiokv import __version__
from tests.e2e import ROOT


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # setuptools warns that it cannot byte-compile
    env.pop("PYTHONPATH", None)
    # vLLM's CPU build, once an earlier test in the process imported it, preloads torch's libgomp
    # into every child: a fresh machine has no such thing (and ldd below would list it)
    env.pop("LD_PRELOAD", None)
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "aiokv"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:  # the working tree as committed or added, without build outputs
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(src / os.path.dirname(f), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), src / f)
    p = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p.stdout + p.stderr


def test_build_is_warning_free_with_clean_metadata(dist):
    out, log = dist
    warnings = [line for line in log.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert not warnings, "\n".join(warnings)
    names = sorted(os.listdir(out))
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert names == [f"aiokv-{__version__}-{tag}-{tag}-linux_x86_64.whl", f"aiokv-{__version__}.tar.gz"], names
    whl = next(n for n in names if n.endswith(".whl"))
    with zipfile.ZipFile(out / whl) as z:
        meta = email.message_from_bytes(z.read(f"aiokv-{__version__}.dist-info/METADATA"))
        assert any(n.startswith("aiokv/_native") and n.endswith(".so") for n in z.namelist())
    assert meta["Version"] == __version__
    assert meta["License-Expression"] == "Apache-2.0"
    required = sorted(
        r.split(">")[0].split(";")[0].strip() for r in meta.get_all("Requires-Dist") if "extra ==" not in r
    )
    assert required == ["blake3", "numpy", "tqdm", "uvloop"], required  # numpy: the store's compact index (issue 36)


def test_wheel_runs_from_a_fresh_venv(dist, tmp_path):
    out, _ = dist
    whl = next(str(out / n) for n in os.listdir(out) if n.endswith(".whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    p = subprocess.run(
        [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index", "--no-deps", whl],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert p.returncode == 0, p.stderr
    # uvloop, tqdm and numpy from this environment; aiokv only from the wheel
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "deps-from-test-env.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    def run(*args):
        return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())

    where = run(py, "-c", "import aiokv, aiokv._native; print(aiokv.__file__)")
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), (where.stdout, where.stderr)
    v = run(str(venv / "bin" / "aiokv"), "--version")
    assert v.returncode == 0 and v.stdout.strip() == f"aiokv {__version__}", (v.stdout, v.stderr)
    # a store written by the engine's code, read by the installed command
    mk = run(
        py,
        "-c",
        "import sys; from aiokv.store import Store; s = Store(sys.argv[1]); "
        "s.namespace(bytes(16), 4096, fields={'model': 'm'}); s.close()",
        str(tmp_path / "store"),
    )
    assert mk.returncode == 0, mk.stderr
    ins = run(str(venv / "bin" / "aiokv"), "inspect", str(tmp_path / "store"), "--verify", "--format", "json")
    assert ins.returncode == 0, ins.stderr
    assert json.loads(ins.stdout)["ok"] is True


def test_missing_liburing_header_is_one_line(tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs a mount namespace (unshare -rm) to hide /usr/include")
    # /usr/include hidden in a private mount namespace: liburing.h is not found
    script = (
        f"mount -t tmpfs none /usr/include && cd {ROOT} && "
        f"{sys.executable} setup.py -q build_ext --build-temp {tmp_path}/t --build-lib {tmp_path}/l"
    )
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == [
        "aiokv: liburing.h not found; install it with: apt-get install -y liburing-dev (Debian/Ubuntu), "
        "or set AIOKV_WITHOUT_URING=1 to build without io_uring (thread-pool I/O)"
    ], p.stderr


def _unshare_ok() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-rm", "true"]).returncode == 0


def test_missing_isal_header_is_one_line(tmp_path):
    if not _unshare_ok() or not os.path.isdir("/usr/include/isa-l"):
        pytest.skip("needs a mount namespace (unshare -rm) and ISA-L's headers to hide")
    script = (
        f"mount -t tmpfs none /usr/include/isa-l && cd {ROOT} && "
        f"{sys.executable} setup.py -q build_ext --build-temp {tmp_path}/t --build-lib {tmp_path}/l"
    )
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == [
        "aiokv: isa-l/crc.h not found; install it with: apt-get install -y libisal-dev (Debian/Ubuntu), "
        "or set AIOKV_WITHOUT_ISAL=1 to build with aiokv's own CRC32C"
    ], p.stderr


PY312 = "/root/.pyenv/versions/3.12.1/bin/python3.12"
PYTHONS = {"3.11": sys.executable if sys.version_info[:2] == (3, 11) else None, "3.12": PY312}
# what a binary wheel may leave to the machine: glibc's own libraries (manylinux's rule)
GLIBC = ("linux-vdso.so", "libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux")

# Run in the fresh venv, under a mount namespace that hides liburing and ISA-L: prints what
# the extensions link (ldd; aiokv._index links native/crc32c.c, ISA-L's CRC32C too), whether a
# journal record the index sealed checks, and what a read of a file through aiokv's io_uring
# backend gave.
RING_READ = """
import asyncio, ctypes, json, mmap, os, subprocess, sys
import aiokv, aiokv._native as n, aiokv._index as ix
from aiokv.data.choice import open_backend
assert aiokv.__file__.startswith(sys.prefix), aiokv.__file__
ldd = subprocess.run(["ldd", n.__file__], capture_output=True, text=True, check=True).stdout.splitlines()
index_ldd = subprocess.run(["ldd", ix.__file__], capture_output=True, text=True, check=True).stdout.splitlines()
index_ok = ix.records_valid(ix.commit_records([bytes(16)], [0], 1), 64, bytes([1]), bytes([16, 32]))
want = open(sys.argv[1], "rb").read()

async def read():
    backend = open_backend(asyncio.get_running_loop(), "uring", depth=4)
    buf = mmap.mmap(-1, len(want))
    fd = os.open(sys.argv[1], os.O_RDONLY)
    try:
        res = await backend.run([(n.OP_READ, fd, ctypes.addressof(ctypes.c_char.from_buffer(buf)), len(want), 0)])
        return {"backend": backend.name, "results": res, "same": buf[: len(want)] == want}
    finally:
        os.close(fd)
        backend.close()

print(json.dumps({"ldd": ldd, "index_ldd": index_ldd, "index_ok": index_ok, "have_uring": n.HAVE_URING, "crc_path": n.CRC_PATH, **asyncio.run(read())}))
"""


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """tools/wheel.sh's wheels for 3.11 and, where it is installed, 3.12 (one run: about 15 s here)."""
    out = tmp_path_factory.mktemp("wheelhouse")
    pythons = [py for py in PYTHONS.values() if py and os.path.exists(py)]
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "tools", "wheel.sh"), str(out), *pythons],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


@pytest.mark.parametrize("version", sorted(PYTHONS))
def test_manylinux_wheel_runs_io_uring_without_liburing(wheelhouse, tmp_path, version):
    py = PYTHONS[version]
    if not py or not os.path.exists(py):
        pytest.skip(f"no Python {version} here")
    if not _unshare_ok():
        pytest.skip("needs a mount namespace (unshare -rm) to hide liburing and ISA-L")
    tag = "cp" + version.replace(".", "")
    (whl,) = [n for n in os.listdir(wheelhouse) if n.startswith(f"aiokv-{__version__}-{tag}-{tag}-")]
    assert "manylinux" in whl and whl.endswith("_x86_64.whl"), whl
    with zipfile.ZipFile(wheelhouse / whl) as z:
        names = z.namelist()
    assert any(n.startswith("aiokv/_native") for n in names)
    # auditwheel: every library outside glibc is inside the wheel
    show = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "auditwheel"), "show", str(wheelhouse / whl)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert show.returncode == 0 and "manylinux_" in show.stdout, show.stdout + show.stderr
    venv = tmp_path / "venv"
    subprocess.run([py, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = str(venv / "bin" / "python")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            vpy,
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            str(wheelhouse / whl),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert p.returncode == 0, p.stderr
    data = tmp_path / "data"
    data.write_bytes(os.urandom(3 * 4096 + 123))
    # liburing's and ISA-L's headers and shared libraries hidden, as on a machine without them
    libs = {
        os.path.realpath(lib)
        for pattern in ("liburing.so*", "libisal.so*")
        for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/local/lib")
        for lib in glob.glob(os.path.join(d, pattern))
    }
    hide = ["mount -t tmpfs none /usr/include"] + [f"mount --bind /dev/null {lib}" for lib in sorted(libs)]
    (tmp_path / "ring_read.py").write_text(RING_READ)
    script = " && ".join([*hide, f"cd {tmp_path} && {vpy} ring_read.py {data}"])
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for ldd in (got["ldd"], got["index_ldd"]):
        for line in ldd:  # glibc's, or the wheel's own copies (aiokv.libs, inside the venv)
            name, _, where = line.strip().partition(" => ")
            assert "not found" not in line, ldd
            assert (
                os.path.basename(name).startswith(GLIBC) or where.startswith(str(venv)) and "/aiokv.libs/" in where
            ), ldd
        assert any("/aiokv.libs/libisal" in line for line in ldd), ldd  # ISA-L came with the wheel
    assert got["index_ok"] == 1
    assert got["have_uring"] == 1 and got["crc_path"] == "isal"
    assert got["backend"] == "io_uring" and got["results"] == [data.stat().st_size] and got["same"], got
