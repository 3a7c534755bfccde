# SPDX-License-Identifier: Apache-2.0
"""Bug: numbers read from the cache directory were used unchecked, and
directories were opened by path: a crafted namespace.json (slot_bytes smaller
than the payload) made `aiokv inspect --verify` checksum past the end of its
read buffer in C; a journal record naming slot 4e9 made the owner build a list
of billions of holes and ftruncate a huge file; a symlink swapped in for a
namespace directory sent the owner's journal, checkpoint and data writes
outside the cache; a cache directory other users can write was used as is.
Invariant: every number from disk is bounds-checked before use (a damaged
namespace.json is one line naming the fix, never a crash or an out-of-bounds
read); an index record naming a slot the file system could never hold is
dropped; nothing is opened, created, renamed or removed through a symlink
anywhere under the cache directory; an existing cache directory owned by
another user or writable by group/others is refused with one line.
Fix: format.check_namespace bounds slot_bytes/payload_bytes/ranks; Store
drops records whose slot lies beyond the file system's size; every file is
opened relative to a directory descriptor opened with O_NOFOLLOW; Store checks
the owner and mode of each directory it will write in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aiokv.data import format as fmt
from aiokv.store import NotAStore
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def _make(root, blocks, n=4):
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    for j in range(n):
        blocks.fill(j, key(j))
    assert await st.save(ns, [(key(j), blocks.addr(j)) for j in range(n)]) == [0] * n
    st.close()
    return os.path.join(root, "ns", NS.hex())


def _inspect(*args):
    return subprocess.run(
        [sys.executable, "-m", "aiokv", "inspect", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )


@pytest.mark.parametrize(
    "change",
    [
        {"slot_bytes": 8192},
        {"slot_bytes": -1},
        {"payload_bytes": 1 << 40},
        {"ranks": 10**9},
        {"ranks": "1"},
        {"payload_bytes": None},
    ],
)
async def test_crafted_namespace_json_is_one_line(tmp_path, blocks, change):
    root = str(tmp_path / "s")
    d = await _make(root, blocks)
    path = os.path.join(d, "namespace.json")
    with open(path) as f:
        info = json.load(f)
    info.update(change)
    with open(path, "w") as f:
        json.dump(info, f)
    with pytest.raises(NotAStore, match="namespace.json") as e:
        StoreIO(root)
    assert "\n" not in str(e.value) and ("remove" in str(e.value) or "new directory" in str(e.value))
    p = _inspect(root, "--verify", "--no-progress")
    assert p.returncode == 2 and "namespace.json" in p.stderr, (p.returncode, p.stdout, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


async def test_journal_slot_beyond_the_file_system_is_dropped(tmp_path, blocks):
    root = str(tmp_path / "s")
    d = await _make(root, blocks)
    [journal] = [n for n in os.listdir(d) if n.startswith("journal.")]
    with open(os.path.join(d, journal), "ab") as f:
        f.write(fmt.pack_record(fmt.REC_COMMIT, key(99), 0xFFFFFFFF, 1))
    # Run in a child with a memory cap and a timeout: the old code builds a list of 4e9 holes.
    code = (
        "import resource, os, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30));"
        "from aiokv.store import Store; from tests.conftest import NS, PAYLOAD, key;"
        f"st = Store({root!r}); ns = st.namespace(NS, PAYLOAD);"
        "assert not ns.has(key(99)) and ns.has(key(0));"
        f"assert os.path.getsize(os.path.join({d!r}, 'rank0.data')) < (1 << 30);"
        "st.close(); print('ok')"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]


def _tree(path) -> dict:
    out = {}
    for dirpath, _, files in os.walk(path):
        for n in files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("swap", ["namespace", "ns"])
async def test_symlinked_directory_is_not_followed(tmp_path, blocks, swap):
    root = str(tmp_path / "s")
    d = await _make(root, blocks)
    outside = tmp_path / "outside"
    target = d if swap == "namespace" else os.path.join(root, "ns")
    os.rename(target, outside)  # someone moves the real directory away
    os.symlink(outside, target)  # and points the name at it
    before = _tree(outside)
    # refused with one line naming the symlink (docs/reliability.md), at start or when the
    # namespace is opened; never used
    with pytest.raises(NotAStore) as e:
        st = StoreIO(root)
        try:
            st.namespace(NS, PAYLOAD)
        finally:
            st.close()
    assert "symlink" in str(e.value) and "\n" not in str(e.value), e.value
    assert _tree(outside) == before, "the store wrote through a symlink"


async def test_data_file_symlink_is_not_followed(tmp_path, blocks):
    root = str(tmp_path / "s")
    d = await _make(root, blocks)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    os.unlink(os.path.join(d, "rank0.data"))
    os.symlink(victim, os.path.join(d, "rank0.data"))
    try:
        st = StoreIO(root)
        st.namespace(NS, PAYLOAD)
        st.close()
    except (NotAStore, OSError):
        pass
    assert victim.read_bytes() == b"precious" * 1000


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_directory_others_can_write_is_refused(tmp_path, mode):
    root = tmp_path / "s"
    StoreIO(root).close()
    os.chmod(root, mode)
    with pytest.raises(NotAStore, match="chmod") as e:
        StoreIO(root)
    assert "\n" not in str(e.value)
    os.chmod(root, 0o755)
    StoreIO(root).close()  # 0755 owned by us is fine


def test_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("this test changes a directory's owner and must run as root (CI does)")
    root = tmp_path / "s"
    StoreIO(root).close()
    os.chown(root, 4321, -1)
    with pytest.raises(NotAStore, match="owned by") as e:
        StoreIO(root)
    assert "\n" not in str(e.value)
