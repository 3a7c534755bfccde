# SPDX-License-Identifier: Apache-2.0
"""Drive wear: the bytes committed to a cache directory, kept across restarts.

Bug: nothing said how much of a drive's endurance the cache spends (bytes written, drive
writes per day), so an operator could not tell `admit: reused` was needed until drives
wore out.
Invariant: every engine's committed bytes add up across its lives in its own wear file;
`aiokv inspect` reports their sum since the directory's first use and the drive writes per
day that makes; a damaged or planted wear file counts from now and never stops the store.
Fix: aiokv/store/wear.py, Store.commit and close; aiokv/cli/summary.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from aiokv.store import Store

NSID = bytes(range(16))


def _commit(root: str, n: int, engine: int = 0) -> int:
    st = Store(root, capacity="1GiB", engine=engine)
    ns = st.namespace(NSID, 4096, fields={"t": 1})
    items = [(k, st.reserve(ns, k)) for k in (os.urandom(32) for _ in range(n))]
    st.commit(ns, items)
    cost = ns.slot_cost
    st.close()
    return n * cost


def _inspect(root: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "aiokv.cli.main", "inspect", root, "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))),
    )
    return json.loads(out.stdout)


def test_committed_bytes_add_up_across_lives_and_engines(tmp_path):
    root = str(tmp_path)
    a = _commit(root, 5)
    b = _commit(root, 3)
    c = _commit(root, 4, engine=1)
    w = _inspect(root)["wear"]
    assert w["written_bytes"] == a + b + c
    assert w["drive_bytes"] > 0 and w["drive_writes_per_day"] > 0
    first = w["since"]
    _commit(root, 1)
    assert _inspect(root)["wear"]["since"] == first, "the first use moved"


def test_a_damaged_wear_file_counts_from_now(tmp_path):
    root = str(tmp_path)
    _commit(root, 5)
    with open(os.path.join(root, "wear.0"), "w") as f:
        f.write('{"since": "yesterday", "bytes": -1')
    n = _commit(root, 2)
    assert _inspect(root)["wear"]["written_bytes"] == n
    os.remove(os.path.join(root, "wear.0"))
    decoy = str(tmp_path.parent / "decoy")
    with open(decoy, "w") as f:
        f.write("not aiokv's")
    os.symlink(decoy, os.path.join(root, "wear.0"))  # planted: never followed, replaced
    n = _commit(root, 1)
    assert not os.path.islink(os.path.join(root, "wear.0"))
    assert _inspect(root)["wear"]["written_bytes"] == n
    assert open(decoy).read() == "not aiokv's"
