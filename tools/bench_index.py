#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""How long the index takes to commit, replay and checkpoint N entries.

    PYTHONPATH=. .venv/bin/python tools/bench_index.py [--n 1000000] [--dir PATH]

Commits N keys through the owner's API (no data I/O), drops the lock as a crash
would (everything still in the journal), reopens (journal replay), closes
(checkpoint), reopens (checkpoint load). Results in docs/format.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv.store import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = os.path.join(args.dir or tempfile.mkdtemp(prefix="aiokv-index-"), "store")
    shutil.rmtree(root, ignore_errors=True)
    nsid, n = b"r" * 16, args.n
    st = Store(root, checkpoint_every=10**12)
    ns = st.namespace(nsid, 4096)
    keys = [i.to_bytes(8, "little") * 4 for i in range(n)]
    ns.alloc.grow(list(range(n)))  # slots without disk space: this measures the index only
    t = time.perf_counter()
    for i in range(0, n, 1000):
        batch = []
        for k in keys[i : i + 1000]:
            s = ns.alloc.take()
            ns.pending[k] = s
            batch.append((k, s))
        st.commit(ns, batch)
    print(f"commit {n} entries in batches of 1000: {time.perf_counter() - t:.2f} s")
    st.lock.release()
    t = time.perf_counter()
    st2 = Store(root)
    got = len(st2.namespace(nsid, 4096).entries)
    print(f"open by journal replay ({got} entries): {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    st2.close()
    print(f"checkpoint at close: {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    st3 = Store(root)
    got = len(st3.namespace(nsid, 4096).entries)
    print(f"open from the checkpoint ({got} entries): {time.perf_counter() - t:.2f} s")
    st3.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
