"""Bug: two engines on one cache directory overwrite each other's files.
Invariant: a second owner fails at once with one line naming the holder's pid
and the fix; read-only openers (inspect) work beside the owner; a dead owner's
lock is gone without cleanup.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aiokv.store import Store, StoreLocked
from aiokv.store.lock import holder_pid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_second_owner_gets_clear_error(tmp_path):
    st = Store(tmp_path / "s")
    with pytest.raises(StoreLocked) as e:
        Store(tmp_path / "s")
    msg = str(e.value)
    assert f"pid {os.getpid()}" in msg and "\n" not in msg and "own path" in msg
    ro = Store(tmp_path / "s", readonly=True)
    assert holder_pid(str(tmp_path / "s")) == os.getpid()
    ro.close()
    st.close()
    assert holder_pid(str(tmp_path / "s")) is None
    Store(tmp_path / "s").close()


def test_second_owner_in_another_process(tmp_path):
    st = Store(tmp_path / "s")
    code = ("import sys; from aiokv.store import Store, StoreLocked\n"
            "try:\n    Store(sys.argv[1])\nexcept StoreLocked as e:\n    print(e); sys.exit(3)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 3 and f"pid {os.getpid()}" in p.stdout
    st.close()


def test_killed_owner_leaves_no_lock(tmp_path):
    code = "import os, sys; from aiokv.store import Store; s = Store(sys.argv[1]); os.kill(os.getpid(), 9)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    Store(tmp_path / "s").close()


def test_refuses_foreign_directory_and_symlinks(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "precious.txt").write_text("x")
    with pytest.raises(ValueError, match="not an aiokv store"):
        Store(tmp_path / "d")
    assert (tmp_path / "d" / "precious.txt").read_text() == "x"
    with pytest.raises(ValueError, match="not an aiokv store"):
        Store(tmp_path / "d", readonly=True)
    st = Store(tmp_path / "s")
    st.close()
    assert oct(os.stat(tmp_path / "s").st_mode & 0o777) == "0o700"
    assert oct(os.stat(tmp_path / "s" / "aiokv.json").st_mode & 0o777) == "0o600"
    os.symlink(tmp_path / "s", tmp_path / "link")
    with pytest.raises(ValueError, match="symlinks"):
        Store(tmp_path / "link")
