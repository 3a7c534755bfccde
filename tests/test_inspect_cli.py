# SPDX-License-Identifier: Apache-2.0
"""Bug: an operator cannot see what a cache directory holds, cannot tell a
damaged block from a good one without starting vLLM, or `aiokv inspect` itself
damages a store (writes beside a running engine, crashes with a traceback).
Invariant: `aiokv inspect` reports exactly what the index holds (blocks, bytes,
fields, keys, how recently blocks were used), --verify exits 1 and names every
block that does not verify and 0 on a clean store (with a progress bar on a
terminal), --repair drops exactly those and only as the lock holder, every
`--format json` document matches docs/inspect-schema.json, and every user
error is one line on stderr with exit status 2.
The CLI runs as a subprocess, as a user would run it.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import subprocess
import sys
import time

from aiokv.data import format as fmt
from aiokv.data.blockio import BlockIO
from aiokv.data.choice import open_backend
from aiokv.store import Store
from aiokv.store.store import ns_dir
from tests.conftest import NS, PAYLOAD, Blocks, key
from tests.test_corruption_is_a_miss import _flip
from tools.storeio import StoreIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 12
NS2 = bytes(range(100, 116))
PAYLOAD2 = 8 << 10
FIELDS = {"model": "tiny-llama", "block_size": 16, "dtype": "bfloat16"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aiokv", "inspect", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )


with open(os.path.join(ROOT, "docs", "inspect-schema.json")) as _f:
    SCHEMA = json.load(_f)


def cli_json(*args: str) -> tuple[int, dict]:
    import jsonschema

    p = cli(*args, "--format", "json")
    assert p.stdout.strip(), p.stderr
    doc = json.loads(p.stdout)  # one JSON document, nothing else on stdout
    jsonschema.validate(doc, SCHEMA)  # the documented, stable shape
    return p.returncode, doc


async def _save(st: Store, ns, keys, blocks: Blocks) -> None:
    for i, k in enumerate(keys):
        blocks.fill(i, k)
    assert await st.save(ns, [(k, blocks.addr(i)) for i, k in enumerate(keys)]) == [0] * len(keys)


async def _make(root: str, blocks: Blocks, close: bool = True):
    """NS: N blocks of PAYLOAD with FIELDS; NS2: 3 blocks of PAYLOAD2."""
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD, fields=FIELDS)
    await _save(st, ns, [key(i) for i in range(N)], blocks)
    ns2 = st.namespace(NS2, PAYLOAD2, fields={"model": "other"})
    small = Blocks(PAYLOAD2, 3)
    await _save(st, ns2, [key(i, 2) for i in range(3)], small)
    small.pool.close()
    slots = {k: ns.where(k) for k in ns.keys()}
    if close:
        st.close()
        return slots
    return st, slots


def _single_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert err.startswith("aiokv: ") and "\n" not in err and "Traceback" not in p.stderr, p.stderr
    assert p.stdout == ""
    return err


async def test_summary_text_and_json(tmp_path, blocks):
    root = str(tmp_path / "s")
    t0 = time.time()
    await _make(root, blocks)
    t1 = time.time()
    sb, sb2 = fmt.slot_bytes(PAYLOAD), fmt.slot_bytes(PAYLOAD2)

    rc, d = cli_json(root)
    assert rc == 0
    assert d["owner_pid"] is None and d["format"] == fmt.FORMAT_VERSION
    by = {n["nsid"]: n for n in d["namespaces"]}
    assert set(by) == {NS.hex(), NS2.hex()}
    a, b = by[NS.hex()], by[NS2.hex()]
    assert a["fields"] == FIELDS and b["fields"] == {"model": "other"}
    assert (a["blocks"], a["ranks"], a["payload_bytes"], a["slot_bytes"]) == (N, 1, PAYLOAD, sb)
    assert a["bytes"] == N * sb and b["bytes"] == 3 * sb2 and b["blocks"] == 3
    assert a["disk_bytes"] >= N * sb  # allocated space covers at least the blocks
    assert d["total"]["blocks"] == N + 3 and d["total"]["bytes"] == N * sb + 3 * sb2
    for t in (a["oldest_access"], a["newest_access"]):
        ts = datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
        assert t0 - 1 <= ts <= t1 + 1

    p = cli(root)
    assert p.returncode == 0 and p.stderr == ""
    out = p.stdout
    assert f"namespace {NS.hex()}" in out and f"namespace {NS2.hex()}" in out
    assert "model=tiny-llama" in out and "block_size=16" in out
    assert f"blocks:        {N}\n" in out and "blocks:        3\n" in out
    assert f"{N * sb} = {N} x {sb}-byte slots x 1 rank(s)" in out
    assert "engines:   none running" in out and "capacity:  unknown" in out


async def test_keys_lists_exactly_the_stored_keys(tmp_path, blocks):
    root = str(tmp_path / "s")
    slots = await _make(root, blocks)
    st = StoreIO(root)  # evict one through the API: it must disappear from the listing
    st.drop(st.namespace(NS, PAYLOAD), [key(4)], corrupt=False)
    st.close()
    del slots[key(4)]

    rc, d = cli_json(root, "--keys")
    assert rc == 0
    by = {n["nsid"]: n["keys"] for n in d["namespaces"]}
    assert {k["key"]: k["slot"] for k in by[NS.hex()]} == {k.hex(): s for k, s in slots.items()}
    assert {k["key"] for k in by[NS2.hex()]} == {key(i, 2).hex() for i in range(3)}
    assert all(k["bytes"] == fmt.slot_bytes(PAYLOAD) and k["last_access"] for k in by[NS.hex()])

    p = cli(root, "--keys")
    assert p.returncode == 0
    for k in slots:
        assert k.hex() in p.stdout
    assert key(4).hex() not in p.stdout


async def test_verify_clean_store(tmp_path, blocks):
    root = str(tmp_path / "s")
    await _make(root, blocks)
    rc, d = cli_json(root, "--verify")
    assert rc == 0 and d["ok"] and d["corrupt"] == []
    assert d["checked_blocks"] == N + 3
    p = cli(root, "--verify")
    assert p.returncode == 0 and "all intact" in p.stdout and f"verified {N + 3} block(s)" in p.stdout


async def test_verify_finds_a_flipped_byte_and_repair_drops_it(tmp_path, blocks):
    root = str(tmp_path / "s")
    slots = await _make(root, blocks)
    sb = fmt.slot_bytes(PAYLOAD)
    data = os.path.join(ns_dir(root, NS), "rank0.data")
    _flip(data, slots[key(5)] * sb + fmt.HEADER_BYTES + 777)

    p = cli(root, "--verify")
    assert p.returncode == 1
    assert key(5).hex() in p.stdout and "payload checksum" in p.stdout
    assert sum(k.hex() in p.stdout for k in slots) == 1  # only the damaged one is named
    rc, d = cli_json(root, "--verify")
    assert rc == 1 and not d["ok"]
    assert [(c["nsid"], c["key"], c["rank"], c["slot"]) for c in d["corrupt"]] == [
        (NS.hex(), key(5).hex(), 0, slots[key(5)])
    ]
    assert d["repaired"] is None
    st = StoreIO(root, readonly=True)  # --verify alone changed nothing
    assert st.index.namespaces[NS].has(key(5))
    st.close()

    rc, d = cli_json(root, "--verify", "--repair")
    assert rc == 1 and [c["key"] for c in d["repaired"]] == [key(5).hex()]

    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    assert not ns.has(key(5))
    assert set(ns.keys()) == set(slots) - {key(5)}
    assert st.namespace(NS2, PAYLOAD2).count() == 3
    for i in range(N):
        blocks.clear(i)
    res = await st.load(ns, [(key(i), blocks.addr(i)) for i in range(N)])
    assert res == [0 if i != 5 else -errno.ENOENT for i in range(N)]
    assert all(blocks.holds(i, key(i)) for i in range(N) if i != 5)
    st.close()
    assert cli(root, "--verify").returncode == 0


async def test_verify_names_the_rank_of_a_multi_rank_block(tmp_path, blocks):
    """Blocks of a 2-rank namespace are written by per-rank BlockIO and committed by the owner."""
    import asyncio

    root = str(tmp_path / "s")
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD, ranks=2, fields={"tp": 2})
    backend = open_backend(asyncio.get_running_loop())
    ios = [BlockIO(backend, ns_dir(root, NS), NS, r, PAYLOAD) for r in range(2)]
    keys = [key(i) for i in range(4)]
    slots = [st.reserve(ns, k) for k in keys]
    for r in range(2):
        for i, k in enumerate(keys):
            blocks.fill(i, k)
        assert await ios[r].write([(s, k, blocks.addr(i)) for i, (s, k) in enumerate(zip(slots, keys))]) == [0] * 4
    st.commit(ns, list(zip(keys, slots)))
    for io in ios:
        io.close()
    backend.close()
    st.close()

    rc, d = cli_json(root)
    assert rc == 0
    (n,) = d["namespaces"]
    assert (n["blocks"], n["ranks"], n["bytes"]) == (4, 2, 4 * 2 * fmt.slot_bytes(PAYLOAD))
    rc, d = cli_json(root, "--verify")
    assert rc == 0 and d["checked_blocks"] == 8

    sb = fmt.slot_bytes(PAYLOAD)
    _flip(os.path.join(ns_dir(root, NS), "rank1.data"), slots[2] * sb + 60)  # rank 1's header of key 2
    rc, d = cli_json(root, "--verify")
    assert rc == 1
    assert [(c["key"], c["rank"]) for c in d["corrupt"]] == [(key(2).hex(), 1)]


async def test_not_a_store_is_one_line_exit_2(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "precious.txt").write_text("x")
    for target in (tmp_path / "d", tmp_path / "missing", tmp_path / "d" / "precious.txt"):
        for extra in ((), ("--keys",), ("--verify",), ("--verify", "--repair"), ("--format", "json")):
            err = _single_line_error(cli(target, *extra))
            assert f"aiokv: {target} is not an aiokv store" in err
    assert os.listdir(tmp_path / "d") == ["precious.txt"]  # --repair created nothing
    assert not (tmp_path / "missing").exists()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "aiokv.json").write_text('{"magic": "other", "format": 1}')
    assert "is not an aiokv store" in _single_line_error(cli(tmp_path / "bad"))


async def test_repair_refused_while_an_owner_holds_the_lock(tmp_path, blocks):
    root = str(tmp_path / "s")
    slots = await _make(root, blocks)
    _flip(os.path.join(ns_dir(root, NS), "rank0.data"), slots[key(1)] * fmt.slot_bytes(PAYLOAD) + 5000)
    owner = StoreIO(root)
    try:
        err = _single_line_error(cli(root, "--verify", "--repair"))
        assert f"pid {os.getpid()}" in err
        assert owner.namespace(NS, PAYLOAD).has(key(1))
        # read-only verify still works beside the owner and finds the block
        p = cli(root, "--verify")
        assert p.returncode == 1 and key(1).hex() in p.stdout
    finally:
        owner.close()
    st = StoreIO(root, readonly=True)
    assert st.index.namespaces[NS].has(key(1))  # nothing was dropped
    st.close()


async def test_inspect_beside_an_open_owner(tmp_path, blocks):
    """The owner has committed blocks only to its journal (no checkpoint yet) and keeps the lock."""
    root = str(tmp_path / "s")
    st, slots = await _make(root, blocks, close=False)
    try:
        rc, d = cli_json(root)
        assert rc == 0 and d["owner_pid"] == os.getpid()
        assert {n["nsid"]: n["blocks"] for n in d["namespaces"]} == {NS.hex(): N, NS2.hex(): 3}
        rc, d = cli_json(root, "--keys")
        assert rc == 0
        assert {k["key"] for n in d["namespaces"] if n["nsid"] == NS.hex() for k in n["keys"]} == {
            k.hex() for k in slots
        }
        rc, d = cli_json(root, "--verify")
        assert rc == 0 and d["checked_blocks"] == N + 3
        p = cli(root)
        assert p.returncode == 0 and f"pid {os.getpid()}" in p.stdout
        # the owner still works after inspect looked: its journal was not touched
        ns = st.namespace(NS, PAYLOAD)
        await _save(st, ns, [key(100)], blocks)
    finally:
        st.close()
    st = StoreIO(root, readonly=True)
    assert st.index.namespaces[NS].count() == N + 1
    st.close()


async def test_corrupt_checkpoint(tmp_path, blocks):
    root = str(tmp_path / "s")
    slots = await _make(root, blocks)
    _flip(os.path.join(ns_dir(root, NS), "checkpoint"), fmt.FILE_HDR_BYTES + 5)
    err = _single_line_error(cli(root))
    assert "checkpoint is corrupt" in err
    rc, d = cli_json(root, "--verify")
    assert rc == 1 and any("checkpoint" in e for e in d["index_errors"])
    rc, d = cli_json(root, "--verify", "--repair")  # the owner rebuilds the index from slot headers
    assert rc == 1 and d["index_rebuilt"] and d["corrupt"] == []
    rc, d = cli_json(root, "--keys")
    assert rc == 0
    assert {k["key"]: k["slot"] for n in d["namespaces"] if n["nsid"] == NS.hex() for k in n["keys"]} == {
        k.hex(): s for k, s in slots.items()
    }
    assert cli(root, "--verify").returncode == 0


def test_python_m_aiokv_usage_errors(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "aiokv"], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT)
    )
    assert p.returncode == 2 and "usage: aiokv" in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "aiokv", "inspect", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert p.returncode == 0 and "--verify" in p.stdout and "--repair" in p.stdout


def test_verify_progress_bar_and_access_ages(tmp_path, blocks, capfd):
    import asyncio

    from aiokv.cli import inspect as ins

    root = str(tmp_path / "s")
    asyncio.run(_make(root, blocks))
    doc = ins.verify(root, progress=True)
    err = capfd.readouterr().err
    assert doc["ok"] and "verifying" in err and "B/s" in err, err
    ins.verify(root, progress=False)
    assert capfd.readouterr().err == ""
    code, s = cli_json(root)
    a = next(n for n in s["namespaces"] if n["nsid"] == NS.hex())["access"]
    assert a["used_last_hour"] == a["used_last_day"] == a["used_last_week"] == N
    assert 0 <= a["median_age_seconds"] < 600
