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
without liburing's header stops with one line naming the fix.

The fix: pyproject.toml (SPDX license, dynamic version, dependencies),
setup.py (the header check inside build_ext), MANIFEST.in.
"""

from __future__ import annotations

import email
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
    assert required == ["numpy", "tqdm", "uvloop"], required  # numpy: the store's compact index (issue 36)


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
