# SPDX-License-Identifier: Apache-2.0
"""Faults from the kernel, under real vLLM: aiokv's cache on ext4 over a block device
whose sectors under aiokv's data file go bad (tests/badsectors.py: this kernel has no
device-mapper, so the device is a loop device on a FUSE-served image that answers EIO
for chosen ranges). The EIO comes back in io_uring's completions; nothing above the
kernel is wrapped (the test-only injector, aiokv/data/faults.py, is off).

Bug class: I/O errors handled only where a test wrapper made them. A real EIO arrives
through another path (a completion's result, for a whole O_DIRECT request) and could be
taken for a short transfer, retried forever, or served.
Invariant: with the data file's sectors bad for reads, warm requests recompute with the
baseline's tokens, the errors are counted and open the breaker; with them bad for
writes, only those saves are dropped and the breaker opens; the engine serves on and
nothing leaks either way; once the device is healed, a restart hits every block stored
before the faults that no faulty read touched, and never a block whose save failed.
"""

from __future__ import annotations

import os

import pytest

from tests.badsectors import BadDisk
from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm
FULL = 229 // 32
PS, PS0, PS2 = prompts(4, 230, seed=401), prompts(4, 230, seed=402), prompts(4, 230, seed=403)
URING = {"io": "uring", "capacity": "128MiB", "memory": 0}  # io_uring for certain; every hit reads the disk


@pytest.fixture
def disk(tmp_path):
    d = BadDisk(str(tmp_path / "bad")).start()
    yield d
    d.stop()


def test_real_eio_on_reads_and_writes_is_recomputed_and_dropped(tiny_model, disk):
    cache = os.path.join(disk.root, "c")
    base = run(dict(model=tiny_model, phases=[dict(prompts=PS), dict(prompts=PS0), dict(prompts=PS2)]))
    cold = run(dict(model=tiny_model, cache=cache, extra=URING, phases=[dict(prompts=PS), dict(prompts=PS0)]))
    happened(cold, part(base, [0, 1]), saves_committed=8 * FULL)
    (ns,) = os.listdir(os.path.join(cache, "ns"))
    data = os.path.join(cache, "ns", ns, "rank0.data")
    sectors = disk.extents(data)  # every slot, written or preallocated
    assert sectors, "the data file has no extents"

    # reads of the data file fail in the kernel: PS's loads fail whole and are recomputed
    disk.spoil(read=sectors)
    bad_reads = run(dict(model=tiny_model, cache=cache, extra=URING, phases=[dict(prompts=PS)]))
    assert "FAULT INJECTION" not in bad_reads["log"]
    happened(
        bad_reads,
        part(base, [0]),
        allow_load_errors=True,
        hit_requests=">=3",
        read_errors=">0",
        load_failed_blocks=">0",
        loads_ok_blocks=0,
        breaker_opens=">=1",
    )
    assert "cache disk is failing" in bad_reads["log"]

    # writes fail in the kernel: PS2's saves are dropped, the breaker opens, vLLM serves on (once
    # the life's first space is reserved, room: a slow grow would skip the saves, none written)
    disk.spoil(write=sectors)
    bad_writes = run(dict(model=tiny_model, cache=cache, extra=URING, phases=[dict(prompts=PS2, room=True)]))
    happened(
        bad_writes,
        part(base, [2]),
        allow_save_errors=True,
        write_errors=">0",
        save_failed_blocks=">0",
        breaker_opens=">=1",
        hit_blocks=0,
    )

    # healed: PS0 (stored before, never read while bad) hits whole; no failed save of PS2 is a hit
    disk.heal()
    healed = run(dict(model=tiny_model, cache=cache, extra=URING, phases=[dict(prompts=PS0), dict(prompts=PS2)]))
    happened(healed, part(base, [1, 2]), hit_blocks=4 * FULL, loads_ok_blocks=4 * FULL, read_errors=0)
    assert healed["cached"][0] == [FULL * 32] * 4 and healed["cached"][1] == [0] * 4
