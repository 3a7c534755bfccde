#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The same faults on aiokv's store and on LMCache's raw_block tier (RawBlockCore, and
RawBlockDevice where it applies), and what each returns afterwards: a hit with the
right bytes, a miss, an error, or wrong bytes. For docs/reliability.md.

    PYTHONPATH=. .venv/bin/python tools/peer_faults.py [--dir DIR] [--json]

Needs the optional extra `peers` (tools/peers.py says how to install it). Every store
lives in its own fresh directory or file under DIR; each phase runs in a process of its
own (this script with --child), so a kill -9 is a real one and every read comes from a
process that opened the store afresh. Eight blocks of 256 KiB, each its own random
payload (known to every phase: seeded by the key).

Faults:
- flip: eight blocks written, the store closed cleanly (aiokv: journal and checkpoint;
  RawBlockCore: its final checkpoint); one payload byte of block 3 flipped on disk; a
  new process loads all eight, then block 3 again. RawBlockDevice: the same slot images
  written, one byte flipped, read back (it has no index: the caller's offsets).
- kill: a fresh store, eight blocks written (every put reported done), then kill -9
  before any checkpoint (RawBlockCore's periodic one is due after 60 s; aiokv's index
  checkpoint every 200,000 journal records); a new process loads all eight.
- torn-head / torn-tail: eight blocks written and the store closed cleanly; then a new
  process frees block 3 (aiokv: drop, RawBlockCore: delete_many) and writes block B,
  which gets block 3's slot, and dies (SIGKILL) in the middle of that write: only the
  first half of the new slot image (torn-head: its header and the start of the
  payload) or only the second half (torn-tail: the end of the payload; the old header
  stays) has reached the disk, as a device that splits a write or completes the header
  and payload writes in either order can leave it. The tool lands that half itself,
  from the store's own write call, then kills the process. A new process loads block 3
  and block B. aiokv journals the drop before the slot is reused, so its index no longer
  names block 3 there; RawBlockCore's delete reaches its index only at the next
  checkpoint, so its index, read back, still does. torn-head-stale / torn-tail-stale
  (aiokv only) give aiokv that same state: the index still naming block 3 in the slot
  that holds half of B's stamped image (the tool lands it in place of the drop and the
  write).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiokv.data import format as fmt  # noqa: E402
from aiokv.data.backend import OP_WRITE  # noqa: E402
from aiokv.data.buffers import BufferPool  # noqa: E402
from tools import peers  # noqa: E402

PAYLOAD = 256 << 10
SLOT = fmt.slot_bytes(PAYLOAD)
N = 8
VICTIM = 3  # the block each fault hits
NEW = 100  # block B of the torn faults
NSID = bytes.fromhex("fa17" * 8)
SLOTS = 16  # RawBlockCore's capacity, in slots


def payload(i: int) -> bytes:
    """Block i's payload (the same in every process)."""
    out, seed = bytearray(), i.to_bytes(8, "little")
    while len(out) < PAYLOAD:
        seed = hashlib.blake2b(seed, digest_size=64).digest()
        out += seed
    return bytes(out[:PAYLOAD])


def akey(i: int) -> bytes:
    return b"peer-faults".ljust(16, b"\0") + i.to_bytes(16, "little")


def fill(pool: BufferPool, buf: int, i: int) -> None:
    ctypes.memmove(pool.addr(buf) + fmt.HEADER_BYTES, payload(i), PAYLOAD)


def outcome(code, got: bytes | None, i: int) -> str:
    """One load's result: 'hit' (right bytes), 'WRONG BYTES', 'miss', or 'error <errno>'."""
    if code == 0:
        return "hit" if got == payload(i) else "WRONG BYTES"
    if code in (-errno.ENOENT, None):
        return "miss"
    if code == -errno.EBADMSG:
        return "miss (EBADMSG: did not verify)"
    return f"error ({errno.errorcode.get(-code, code)})"


def say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def land_half(path: str, off: int, image: bytes, half: str) -> None:
    """The half of a slot image that reached the disk before the process died (page-aligned split)."""
    mid = len(image) // 2 // 4096 * 4096
    lo, hi = (0, mid) if half == "head" else (mid, len(image))
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, image[lo:hi], off + lo)
        os.fdatasync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ aiokv (a child process)


class TornWrites:
    """aiokv's backend in the dying process: its first write lands only `half` of the slot image, then SIGKILL."""

    def __init__(self, real, half: str):
        self.real, self.half, self.depth = real, half, 16

    async def run(self, ops, abandon=None):
        for op, fd, addr, length, off in ops:
            if op == OP_WRITE:
                land_half(os.readlink(f"/proc/self/fd/{fd}"), off, ctypes.string_at(addr, length), self.half)
                os.kill(os.getpid(), signal.SIGKILL)
        return await self.real.run(ops, abandon)

    def close(self) -> None:
        self.real.close()


async def aiokv_child(phase: str, root: str, arg: str) -> None:
    from aiokv.data.choice import open_backend
    from aiokv.data.slotfile import data_path
    from aiokv.store.store import ns_dir
    from tools.storeio import StoreIO

    st = StoreIO(root)
    ns = st.namespace(NSID, PAYLOAD)
    pool = BufferPool(SLOT, N + 1)
    try:
        if phase == "write":
            for i in range(N):
                fill(pool, i, i)
            res = await st.save(ns, [(akey(i), pool.addr(i)) for i in range(N)])
            where = {i: ns.where(akey(i)) & fmt.SLOT_MASK for i in range(N)}
            say(saved=res, slots=where, data=data_path(ns_dir(root, NSID), 0))
            if arg == "hang":  # the parent kills this process now
                signal.pause()
        elif phase == "reuse" and arg.endswith("-stale"):
            # the same on-disk state with the index still naming the old key in that slot (as
            # RawBlockCore's, whose delete waits for its next checkpoint): B's stamped image, half landed
            old = ns.where(akey(VICTIM)) & fmt.SLOT_MASK
            fill(pool, 0, NEW)
            st.blockio(ns).stamp(akey(NEW), pool.addr(0))
            say(reused=True)
            land_half(data_path(ns_dir(root, NSID), 0), old * SLOT, ctypes.string_at(pool.addr(0), SLOT), arg[:4])
            os.kill(os.getpid(), signal.SIGKILL)
        elif phase == "reuse":
            old = ns.where(akey(VICTIM)) & fmt.SLOT_MASK
            st.drop(ns, [akey(VICTIM)], corrupt=False)
            st._backend = TornWrites(open_backend(asyncio.get_running_loop(), depth=16), arg)
            fill(pool, 0, NEW)
            slot = st.reserve(ns, akey(NEW))
            say(reused=(slot & fmt.SLOT_MASK) == old)
            st.abort(ns, [(akey(NEW), slot)], failed=False)
            await st.save(ns, [(akey(NEW), pool.addr(0))])  # dies inside
            say(error="the torn write did not kill the process")
        elif phase == "read":
            out = {}
            for i in [*range(N), VICTIM, NEW]:
                ctypes.memset(pool.addr(N), 0, SLOT)
                (code,) = await st.load(ns, [(akey(i), pool.addr(N))])
                got = ctypes.string_at(pool.addr(N) + fmt.HEADER_BYTES, PAYLOAD) if code == 0 else None
                out.setdefault(str(i), []).append(outcome(code, got, i))
            say(loads=out)
    finally:
        if phase != "reuse":
            st.close()
        pool.close()


# ------------------------------------------------------------------ RawBlockCore (a child process)


class TornDevice:
    """RawBlockCore's raw device in the dying process: its first batched write lands only
    `half` of the slot image (header op + payload op put together), then SIGKILL."""

    def __init__(self, real, path: str, half: str):
        self.real, self.path, self.half = real, path, half

    def __getattr__(self, name):
        return getattr(self.real, name)

    def batched_write(self, offsets, buffers, total_lens, placement_ids=None, payload_lens=None):
        base = min(offsets)
        image = bytearray(SLOT)
        for off, buf, n in zip(offsets, buffers, total_lens):
            b = bytes(memoryview(buf).cast("B"))[:n]
            image[off - base : off - base + len(b)] = b
        land_half(self.path, base, bytes(image), self.half)
        os.kill(os.getpid(), signal.SIGKILL)


def rbc_child(phase: str, path: str, arg: str) -> None:
    core = peers.open_core(path, SLOT, SLOTS, 16, periodic=True)  # its defaults: a checkpoint every 60 s
    pool = BufferPool(SLOT, N + 1)
    objs = [peers.Obj(pool.addr(i) + fmt.HEADER_BYTES, PAYLOAD) for i in range(N + 1)]
    keys = {i: peers.core_key(i) for i in [*range(N), NEW]}
    try:
        if phase == "write":
            for i in range(N):
                fill(pool, i, i)
            res = core.put_many([keys[i] for i in range(N)], objs[:N]).results
            say(saved=res, slots={i: core.entry_offset(keys[i].encoded) for i in range(N)}, data=path)
            if arg == "hang":
                signal.pause()
        elif phase == "reuse":
            old = core.entry_offset(keys[VICTIM].encoded)
            core.delete_many([keys[VICTIM].encoded])
            core.set_raw_device_for_testing(TornDevice(core.raw_device(), path, arg))
            fill(pool, 0, NEW)
            say(reused=old is not None)
            core.put_many([keys[NEW]], [objs[0]])  # dies inside (a one-key put: header and payload in one batch)
            say(error="the torn write did not kill the process")
        elif phase == "read":
            out = {}
            for i in [*range(N), VICTIM, NEW]:
                ctypes.memset(pool.addr(N), 0, SLOT)
                enc = keys[i].encoded
                if not core.exists_many([enc])[0]:
                    code = None
                else:
                    code = 0 if core.load_many_into([enc], [objs[N]])[0] else -errno.EIO
                got = ctypes.string_at(pool.addr(N) + fmt.HEADER_BYTES, PAYLOAD) if code == 0 else None
                out.setdefault(str(i), []).append(outcome(code, got, i))
            say(loads=out)
    finally:
        if phase != "reuse":
            core.close()
        pool.close()


# ------------------------------------------------------------------ RawBlockDevice (in this process)


def rbd_flip(path: str) -> dict:
    peers.make_file(path, N * SLOT)
    pool = BufferPool(SLOT, N)
    try:
        dev = peers.open_device(path, 16)
        for i in range(N):
            fill(pool, i, i)
        bufs = [peers.view(pool.addr(i), SLOT) for i in range(N)]
        offs = [i * SLOT for i in range(N)]
        assert all(peers.device_io(dev, True, offs, bufs, SLOT, 16))
        dev.close()
        flip(path, VICTIM * SLOT + fmt.HEADER_BYTES + 1000)
        dev = peers.open_device(path, 16)
        ctypes.memset(pool.addr(0), 0, N * SLOT)
        ok = peers.device_io(dev, False, offs, bufs, SLOT, 16)
        dev.close()
        return {
            str(i): [outcome(0 if ok[i] else -errno.EIO, ctypes.string_at(pool.addr(i) + fmt.HEADER_BYTES, PAYLOAD), i)]
            for i in range(N)
        }
    finally:
        pool.close()


# ------------------------------------------------------------------ the parent


def flip(path: str, off: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def child(store: str, phase: str, where: str, arg: str = "", wait_line: bool = False) -> list[dict]:
    """Run one phase in a new process; its JSON lines. wait_line: kill -9 it after its first line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", store, phase, where, arg]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    if wait_line:
        lines.append(json.loads(p.stdout.readline()))
        p.send_signal(signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    if p.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"{store} {phase} failed ({p.returncode}): {err.strip()[-2000:]}")
    return [dict(x, killed=p.returncode == -signal.SIGKILL) for x in lines] or [{"killed": p.returncode < 0}]


def scenario(name: str, store: str, base: str) -> dict:
    where = os.path.join(base, f"{name}-{store}")
    if store == "aiokv":
        os.makedirs(where)
    else:
        where += ".dat"
    if name == "kill":
        wrote = child(store, "write", where, "hang", wait_line=True)[0]
    else:
        wrote = child(store, "write", where)[0]
    note = {"saved": wrote["saved"]}
    if name == "flip":
        off = int(wrote["slots"][str(VICTIM)])
        flip(wrote["data"], (off * SLOT if store == "aiokv" else off) + fmt.HEADER_BYTES + 1000)
    elif name.startswith("torn"):
        died = child(store, "reuse", where, name.split("-", 1)[1])
        note["reuse"] = died
    read = child(store, "read", where)[-1]
    return {"store": store, "fault": name, **note, "loads": read.get("loads", read)}


def summary(row: dict) -> dict:
    """What the faulted blocks returned, and how the others fared."""
    loads = row["loads"]
    out = {}
    if row["fault"] in ("flip", "kill"):
        out["block 3"] = " then ".join(loads[str(VICTIM)])
        others = [r[0] for i, r in loads.items() if i not in (str(VICTIM), str(NEW))]
        out["the other 7"] = ", ".join(f"{others.count(x)} {x}" for x in sorted(set(others)))
    else:
        out["block 3 (old key)"] = loads[str(VICTIM)][0]
        out["block B (the torn write's)"] = loads[str(NEW)][0]
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        store, phase, where, arg = (sys.argv[2:] + [""])[:4]
        if store == "aiokv":
            import uvloop

            uvloop.run(aiokv_child(phase, where, arg))
        else:
            rbc_child(phase, where, arg)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the stores live (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    no_dev, no_core = peers.available()
    if no_dev or no_core:
        ap.error(no_dev or no_core)
    base = tempfile.mkdtemp(prefix="peer-faults-", dir=args.dir)
    rows = []
    try:
        for name in ("flip", "kill", "torn-head", "torn-tail"):
            for store in ("aiokv", "rbc"):
                rows.append(scenario(name, store, base))
        for name in ("torn-head-stale", "torn-tail-stale"):
            rows.append(scenario(name, "aiokv", base))
        rows.append({"store": "rbd", "fault": "flip", "loads": rbd_flip(os.path.join(base, "flip-rbd.dat"))})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for r in rows:
        r["summary"] = summary(r)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    else:
        names = {"aiokv": "aiokv", "rbc": "RawBlockCore", "rbd": "RawBlockDevice"}
        print("| fault | store | returns |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['fault']} | {names[r['store']]} | {'; '.join(f'{k}: {v}' for k, v in r['summary'].items())} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
