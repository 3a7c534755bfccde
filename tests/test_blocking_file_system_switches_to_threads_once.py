# SPDX-License-Identifier: Apache-2.0
"""A cache on FUSE (or a network file system) uses the thread-pool backend, said once.

Bug: on FUSE an io_uring submission itself can sleep in the submitting thread
(once FUSE's background requests are taken), stopping the worker's event loop
and every timeout with it; and the line that says the thread-pool backend is
used instead named the namespace directory, so a model with several KV-cache
groups (one worker and one namespace per group) said it once per group.
Invariant: a worker whose files are on FUSE, with the backend left to aiokv
(`auto`), runs on the thread-pool backend, and its saves and loads work there;
the switch is said in one line per mount point and process, however many
workers open files there; an explicit backend setting is honoured.
Fix: aiokv/data/choice.py open_backend (BLOCKING_SUBMIT_FS; the line names the
mount point, through say_once).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import key
from tests.stallfs import mounted

NB = 16
SAID = "where an io_uring submission can block"


def _worker(root: str, nsid: bytes, io: str = "auto") -> tuple[TransferWorker, dict]:
    kv = {f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(2)}
    os.makedirs(ns_dir(root, nsid), exist_ok=True)
    return TransferWorker(CpuDevice(kv, NB), ns_dir(root, nsid), nsid, 0, staging_bytes=1, io=io), kv


def _poll_until(w: TransferWorker, req: str, timeout: float = 20.0):
    end = time.monotonic() + timeout
    errors, saved = set(), []
    while True:
        done, errs, rep = w.poll()
        errors |= errs
        saved += rep.written()
        if req in done or (req == "s" and saved):
            return errors, saved
        assert time.monotonic() < end, f"{req} never finished"
        time.sleep(0.005)


def test_fuse_cache_runs_on_threads_and_says_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("AIOKV_IO", raising=False)  # aiokv chooses
    mnt = str(tmp_path / "mnt")
    caplog.set_level(logging.WARNING, logger="aiokv")
    with mounted(str(tmp_path / "src"), mnt, str(tmp_path / "control")):
        root = os.path.join(mnt, "cache")
        workers = []
        try:
            for g in range(3):  # three KV-cache groups: three namespaces, three workers
                workers.append(_worker(root, bytes([g + 1]) * 16))
            assert [w.backend.name for w, _ in workers] == ["threads"] * 3
            # the thread-pool backend does the work there: a save and a load back, bit exact
            w, kv = workers[0]
            w.save([Transfer("s", [key(0)], [0], [1])])
            assert _poll_until(w, "s")[1]
            w.load([Transfer("r", [key(0)], [0], [5])])
            assert _poll_until(w, "r")[0] == set()
            assert all(torch.equal(t[5], t[1]) for t in kv.values())
            # an explicit setting is honoured (the operator's choice)
            forced, _ = _worker(root, b"\x09" * 16, io="uring")
            workers.append((forced, None))
            assert forced.backend.name == "io_uring"
        finally:
            for w, _ in workers:
                w.close()
    lines = [r.getMessage() for r in caplog.records if SAID in r.getMessage()]
    assert len(lines) == 1, lines
    assert mnt in lines[0] and "fuse" in lines[0] and "thread-pool" in lines[0], lines
