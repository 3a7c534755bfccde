# SPDX-License-Identifier: Apache-2.0
"""Environment faults under real vLLM.

- io_uring refused by the kernel: the thread-pool backend takes over, said
  once, and the cache still works (refused to the engine's processes alone, by a
  seccomp filter as a container's default profile does: the machine-wide sysctl
  these tests flipped before also took io_uring from the lives the other test
  worker ran meanwhile, and failed any of them that forced io="uring");
- a cache directory on a file system without O_DIRECT (ramfs): buffered I/O,
  said once, the cache still works;
- a small file system that fills up during a run: saves are skipped and
  eviction makes room; the engine never stops; usage stays under the capacity
  bound; a later run still hits what stayed.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm

PS = prompts(3, 200, seed=91)


@pytest.fixture(scope="module")
def base(tiny_model):
    """PS without aiokv: one life for the module."""
    return run(dict(model=tiny_model, phases=[dict(prompts=PS)]))


def _mount(kind: str, where, size: str):
    where.mkdir()
    if kind == "ramfs":  # no O_DIRECT there (tmpfs has it since Linux 6.6), no fallocate either
        subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], check=True)
    else:
        img = str(where) + ".img"
        subprocess.run(["truncate", "-s", size, img], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True)
        subprocess.run(["mount", "-o", "loop", img, str(where)], check=True)
    return where


def test_io_uring_refused_falls_back(tiny_model, tmp_path, base):
    cache = str(tmp_path / "c")
    refused = dict(model=tiny_model, cache=cache, refuse_io_uring=True, phases=[dict(prompts=PS)])
    cold = run(refused)
    happened(cold, base, saves_committed=">0")
    warm = run(refused)
    msg = "io_uring unavailable (Operation not permitted); using the thread-pool I/O backend"
    assert warm["log"].count(msg) == 1, warm["log"]
    happened(warm, base, hit_blocks=3 * (199 // 32))


def test_no_o_direct_file_system(tiny_model, tmp_path, base):
    mnt = _mount("ramfs", tmp_path / "t", "")
    try:
        cache = str(mnt / "c")
        cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
        happened(cold, base, saves_committed=">0")
        warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
        assert warm["log"].count("does not support O_DIRECT; using buffered I/O") == 1
        happened(warm, base, hit_blocks=3 * (199 // 32))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_fills_up_during_a_run(tiny_model, tmp_path):
    mnt = _mount("ext4", tmp_path / "d", "8M")  # ~6 MiB usable: ~90 of our 68 KiB slots
    try:
        cache = str(mnt / "c")
        many = prompts(40, 250, seed=92)  # 40 x 7 blocks = 280 blocks > the disk
        # the second half starts once the first half's blocks are written (settle): its saves find
        # committed blocks to evict however slow the disk (test_capacity_bound_holds_during_a_run)
        phases = [dict(prompts=many[:20], max_tokens=4), dict(prompts=many[20:], max_tokens=4)]
        base = run(dict(model=tiny_model, phases=phases))
        phases[0]["stagger"] = phases[1]["stagger"] = phases[1]["settle"] = True
        cold = run(dict(model=tiny_model, cache=cache, extra={"capacity": "1GiB"}, phases=phases))
        happened(cold, base, store_enospc=">0", store_evictions=">0")
        st = os.statvfs(str(mnt))
        assert st.f_bfree > 0
        warm = run(
            dict(
                model=tiny_model,
                cache=cache,
                extra={"capacity": "1GiB"},
                phases=[dict(prompts=many[-8:], max_tokens=4)],
            )
        )
        happened(warm, part(base, phases=[1], requests=range(12, 20)), hit_blocks=">0")  # what stayed on the full disk
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_capacity_bound_holds_during_a_run(tiny_model, tmp_path):
    """2 MiB holds about 30 slots; 30 prompts of 7 blocks each are saved. The first ten fill it;
    the other twenty, started once those were committed (settle), must evict for each of theirs.
    (Without settle, on a slow disk every block of the capacity could still be being written when
    the last prompts were saved: nothing evictable, their saves dropped as no_space, no eviction.)"""
    cache = str(tmp_path / "c")
    many = prompts(30, 250, seed=93)
    phases = [dict(prompts=many[:10], max_tokens=4), dict(prompts=many[10:], max_tokens=4)]
    base = run(dict(model=tiny_model, phases=phases))
    phases[0]["stagger"] = phases[1]["stagger"] = phases[1]["settle"] = True
    res = run(dict(model=tiny_model, cache=cache, extra={"capacity": "2MiB"}, phases=phases))
    happened(res, base, store_evictions=">0")
    ns = os.path.join(cache, "ns", os.listdir(os.path.join(cache, "ns"))[0])
    on_disk = sum(os.stat(os.path.join(ns, f)).st_blocks * 512 for f in os.listdir(ns) if f.endswith(".data"))
    assert on_disk <= 2 << 20, on_disk


def test_worker_that_cannot_start_disables_aiokv(tiny_model, tmp_path, base):
    """io="uring" forced where io_uring is refused: the worker cannot start. Loads
    the scheduler side promised before it learned so are recomputed, then aiokv
    stops offering hits and saving; vLLM serves on, nothing leaks or waits."""
    cache = str(tmp_path / "c")
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
    happened(cold, base, saves_committed=">0")
    res = run(
        dict(
            model=tiny_model,
            cache=cache,
            extra={"io": "uring"},
            refuse_io_uring=True,
            phases=[dict(prompts=PS[:1]), dict(prompts=PS[1:])],
        )
    )
    assert "worker 0 disabled" in res["log"]
    assert res["tokens"][0] + res["tokens"][1] == base["tokens"][0]
    happened(
        res,
        None,
        why_no_baseline="compared above (two phases against one)",
        allow_load_errors=True,
        saves_committed=0,
        hit_requests="<=1",
    )  # after the first report, no more hits are offered
