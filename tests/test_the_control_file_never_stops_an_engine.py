# SPDX-License-Identifier: Apache-2.0
"""The control file never stops an engine (issue 40, item 5).

The bug: `sudo aiokv clear` created DIR/control owned by root with mode 0600 (and, for a stopped
engine, wrote its files as root). Engines run as the directory's owner (meta.py refuses any
other user), so they could not read it: every look at the other engines raised EACCES before
following any of them (none of another engine's new blocks seen), and an engine restarted on the
directory failed to start.
The invariant: an engine that cannot read the control file says so once, in one line naming
the fix, and follows the other engines and starts as before; `aiokv clear`, `pin` and `unpin`
create and write their files as the directory's owner (run as root, they act as that user),
and refuse, in one line naming the fix, to run as any other user.
The fix: control.py `read_io` keeps its position and says once when the file does not read;
ops/owner.py makes the command act with the directory owner's ids (and gives back a control file an earlier
run as root left root's), or refuses.

The tests run as root: the engines run in forked children that take the directory owner's uid
(the interpreter cannot be started again as another user here: it lives under /root).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from aiokv.cli import main as cli_main
from aiokv.cli import operate, render, warm  # noqa: F401  (imported here: the children cannot read the stdlib)
from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store.control import append_order
from tests.conftest import NS, PAYLOAD, key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWNER = 4242  # the service user the engines run as (no passwd entry needed)
OTHER = 4343  # another user, neither root nor the owner
OWN = [key(i) for i in (0, 1, 2, 10, 11, 12)]  # engine 0's blocks (`_fill`): alice's, then bob's

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the engines run as another uid")


def _as_user(uid: int, fn, *args, go=None):
    """fn(*args, say) in a forked child running as uid; its JSON result and the aiokv lines it
    logged. say(text) writes a line to the parent and, if go is given, waits for go() to run
    there first (the parent's part of a handshake)."""
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 1
        try:
            os.close(out_r)
            os.close(in_w)
            lines: list[str] = []

            class Keep(logging.Handler):
                def emit(self, record):
                    lines.append(record.getMessage())

            log = logging.getLogger("aiokv")
            log.handlers[:] = [Keep()]
            log.setLevel(logging.INFO)
            log.propagate = False
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

            def say(text: str) -> None:
                os.write(out_w, f"say {text}\n".encode())
                os.read(in_r, 1)

            try:
                got = {"result": fn(*args, say)}
            except BaseException as e:  # (reported to the parent)
                got = {"error": f"{type(e).__name__}: {e}"}
            got["log"] = lines
            os.write(out_w, (json.dumps(got) + "\n").encode())
            code = 0
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(in_r)
    with os.fdopen(out_r) as r, os.fdopen(in_w, "w") as w:
        while True:
            line = r.readline()
            if not line.startswith("say "):
                break
            if go is not None:
                go(line[4:].strip())
            w.write("x")
            w.flush()
    os.waitpid(pid, 0)
    return json.loads(line)


@pytest.fixture
def owned():
    """A cache directory's parent owned by OWNER (under /tmp: tmp_path's parents are root's 0700)."""
    base = tempfile.mkdtemp(prefix="aiokv-owned-")
    os.chown(base, OWNER, OWNER)
    yield os.path.join(base, "c")
    shutil.rmtree(base, ignore_errors=True)


def _commit(st, ns, keys):
    slots = [st.reserve(ns, k) for k in keys]
    assert None not in slots
    st.commit(ns, list(zip(keys, slots)))


def _seen(st, ns, keys, within: float) -> int:
    end = time.monotonic() + within
    while True:
        st.refresh()
        n = sum(ns.has(k) for k in keys)
        if n == len(keys) or time.monotonic() > end:
            return n
        time.sleep(0.02)


def _fill(root, say):
    """(In the child.) Engine 0 stores 3 blocks of tenant alice and 3 of bob, then stops."""
    st = Store(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    for name, base in (("alice", 0), ("bob", 10)):
        slots = [st.reserve(ns, key(base + i), name) for i in range(3)]
        st.commit(ns, [(key(base + i), s) for i, s in enumerate(slots)], name)
    st.close()
    return True


def _hits(root, say):
    """(In the child.) Which of engine 0's blocks of `_fill` are there (opened as their owner)."""
    st = Store(root, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    got = [ns.has(k) for k in OWN]
    st.close()
    return got


def _follow_while_unreadable(root, say):
    """(In the child, as the owner.) Engine 0 (with the I/O thread: its blocks of `_fill`) and engine 1 run; the control
    file appears, root's and 0600; engine 1 commits 3 blocks; how many engine 0 sees."""
    e0 = Store(root, capacity="64MiB", io_thread=True)
    n0 = e0.namespace(NS, PAYLOAD)
    e1 = Store(root, capacity="64MiB")
    n1 = e1.namespace(NS, PAYLOAD)
    say("control")  # the parent writes the control file now
    new = [key(i, 1) for i in range(3)]
    _commit(e1, n1, new)
    seen = _seen(e0, n0, new, 10)
    _seen(e0, n0, [b"x" * 32], 1.0)  # (more looks: the line is said once, not at each)
    e1.close()
    e0.close()
    return seen


def _restart(root, say):
    """(In the child.) Engine 0 restarted on the directory: its blocks are hits."""
    st = Store(root, capacity="64MiB", io_thread=True)
    ns = st.namespace(NS, PAYLOAD)
    n = _seen(st, ns, OWN, 10)
    st.close()
    return n


def test_an_engine_that_cannot_read_the_control_file_follows_the_others_and_starts(owned):
    root = owned

    def root_writes_the_control_file(_):
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            append_order(fd, "pin", tenants=[fmt.tenant_tag("nobody")])  # as root: root's, 0600
        finally:
            os.close(fd)

    assert _as_user(OWNER, _fill, root).get("result") is True
    got = _as_user(OWNER, _follow_while_unreadable, root, go=root_writes_the_control_file)
    st = os.stat(os.path.join(root, fmt.CONTROL_NAME))
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)  # (what `sudo aiokv clear` used to leave)
    assert got.get("result") == 3, f"engine 0 saw {got} of engine 1's 3 new blocks with the control file unreadable"
    said = [line for line in got["log"] if "control file" in line]
    assert len(said) == 1 and f"chown {OWNER} {root}/control" in said[0], said
    got = _as_user(OWNER, _restart, root)
    assert got.get("result") == 6, f"engine 0 restarted with the control file unreadable: {got}"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aiokv", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=120,
    )


def _owners(root: str) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = os.lstat(p).st_uid
    return out


def test_clear_run_as_root_writes_as_the_directorys_owner(owned):
    root = owned
    assert _as_user(OWNER, _fill, root).get("result") is True
    p = _cli("clear", root, "--tenant", "alice", "--wait", "0")
    assert p.returncode == 0, p.stderr
    not_owners = {f: uid for f, uid in _owners(root).items() if uid != OWNER}
    assert not not_owners, f"files `sudo aiokv clear` left that the engines' user cannot use: {not_owners}"
    got = _as_user(OWNER, _hits, root)
    assert got.get("result") == [False] * 3 + [True] * 3, got  # (the stopped engine's files, cleared)


def test_a_control_file_an_earlier_run_as_root_left_is_given_back(owned):
    root = owned
    assert _as_user(OWNER, _fill, root).get("result") is True
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        append_order(fd, "pin", tenants=[fmt.tenant_tag("nobody")])  # root's, 0600
    finally:
        os.close(fd)
    p = _cli("clear", root, "--tenant", "alice", "--wait", "0")
    assert p.returncode == 0, p.stderr
    assert os.stat(os.path.join(root, fmt.CONTROL_NAME)).st_uid == OWNER
    assert _as_user(OWNER, _hits, root).get("result") == [False] * 3 + [True] * 3


def _cli_in_child(args, say):
    """(In the child.) The CLI's main() as this user: its exit status and its stderr."""
    sys.stderr = io.StringIO()
    code = cli_main.main(args)
    return code, sys.stderr.getvalue()


def test_clear_run_as_another_user_is_refused_in_one_line(owned):
    root = owned
    assert _as_user(OWNER, _fill, root).get("result") is True
    os.chmod(os.path.dirname(root), 0o755)
    os.chmod(root, 0o755)  # (the other user can look: the command itself must refuse)
    got = _as_user(OTHER, _cli_in_child, ["clear", root, "--tenant", "alice", "--wait", "0"])
    code, err = got["result"]
    assert code == 2 and err.count("\n") == 1, got
    assert f"uid {OWNER}" in err and "sudo" in err, err
    assert not os.path.exists(os.path.join(root, fmt.CONTROL_NAME))
