# SPDX-License-Identifier: Apache-2.0
"""`aiokv warm`: a node's cache directories filled from the fleet's bucket (real store, a
real S3 server: SeaweedFS), before the node takes traffic.

Bug guarded against: a new node starts cold and recomputes (or fetches block by block from the
bucket, on the request's path) every prefix the fleet already holds; or a warm-up that trusts
what the bucket names (a tampered, truncated or foreign object committed locally: wrong KV
served), commits a block it did not finish writing (kill -9 mid-write), copies everything
again after an interrupt, evicts what the node holds, or runs past its bounds.
Invariants: every block warmed verifies (inspect --verify) and is a hit for any engine on the
directory, including one running beside the warm; corrupt, truncated, foreign and misnamed
objects are skipped and counted, never committed; an interrupted warm (SIGINT or kill -9)
leaves only whole committed blocks, and the next run copies only the rest, each block
committed once; `--limit` and the capacity bound it and nothing is evicted; `--model`
selects namespaces by the model their engines published; `--tenant` copies only that tenant's
blocks and every warmed block is committed as the tenant its header names (quotas, clears and
pins treat it as the engines' own); the labels engines published reach
the warmed blocks' labels file (so engines announce them: docs/operations.md, "Warm-up"); no
secret, or a bucket that does not answer, is one line and exit status 2; progress is a bar on a
terminal and plain lines (no control characters) in a log.
Fix: aiokv/ops/warm.py, aiokv/bucket/catalog.py, meta.py, publisher.py.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import fcntl
import mmap
import os
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from aiokv.bucket import meta
from aiokv.bucket.client import BucketClient
from aiokv.bucket.naming import object_name
from aiokv.bucket.publisher import Publisher
from aiokv.cli import main as cli
from aiokv.cli import warm
from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.util.loops import LoopThread
from tests.conftest import NS, PAYLOAD, key
from tests.s3gate import Gate

SECRET = "fleet-secret-0123456789"
NS2 = bytes(range(1, 17))
SB = fmt.slot_bytes(PAYLOAD)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def image(
    nsid: bytes, rank: int, k: bytes, secret: str | None = SECRET, payload: int = PAYLOAD, tenant: str = ""
) -> bytes:
    """A block's slot image as an engine uploads it (stamped: header, CRC, MAC, the tenant's tag)."""
    sb = fmt.slot_bytes(payload)
    buf = mmap.mmap(-1, sb)
    buf[fmt.HEADER_BYTES : fmt.HEADER_BYTES + payload] = (k * (payload // len(k) + 1))[:payload]
    c = ctypes.c_char.from_buffer(buf)
    mk = fmt.mac_key(secret) if secret else None
    tag = fmt.tenant_tag(tenant, fmt.tenant_key(secret))
    fmt.stamp_slots([ctypes.addressof(c)], [k], nsid, rank, payload, 0, False, mk, tenant=tag)
    del c
    return bytes(buf)


def label(i: int) -> bytes:
    return b"label-%d" % i


def publish(
    prefix: str, blocks: dict, secret: str | None = SECRET, ranks: int = 1, labels: bool = True, tenants=None
) -> None:
    """What a fleet's engines leave in the bucket: blocks (nsid -> [(key, model)]; tenants: key ->
    the cache_salt it was saved for, default none), each namespace's description and the
    blocks' labels (through the engines' Publisher)."""

    async def put_all(client):
        sem = asyncio.Semaphore(32)

        async def one(nsid, r, k):
            async with sem:
                t = (tenants or {}).get(k, "")
                await client.put(object_name(client.prefix, nsid, r, k), image(nsid, r, k, secret, tenant=t))

        await asyncio.gather(*(one(n, r, k) for n, ks in blocks.items() for k, _ in ks for r in range(ranks)))

    client = BucketClient(prefix, timeout=10)
    asyncio.run(put_all(client))
    lt = LoopThread("test-publisher")
    pub = Publisher(client, lt, meta.meta_key(secret), every=0.01)
    pub.namespaces([(n, PAYLOAD, ranks, {"model": ks[0][1], "block_size": 16}) for n, ks in blocks.items()])
    if labels:
        for n, ks in blocks.items():
            pub.labels(n, [(k, label(i)) for i, (k, _) in enumerate(ks)])
    pub.close(10)  # (waits for the namespace descriptions' write-once PUTs and the labels)
    lt.stop()
    assert pub.counters["labels_dropped"] == 0, pub.counters


def run_warm(paths, bucket: str, **kw) -> dict:
    return warm.warm(warm.Args([str(p) for p in paths], bucket, progress=False, **kw))


def held(path, nsid: bytes = NS) -> set[bytes]:
    st = Store(str(path), readonly=True)
    try:
        ns = st.index.namespaces.get(nsid)
        return set() if ns is None else set(ns.keys())
    finally:
        st.close()


def verify_ok(path) -> dict:
    from aiokv.cli import inspect as ins

    doc = ins.verify(str(path), progress=False)
    assert doc["ok"], doc
    return doc


@pytest.fixture
def secret_env(s3env, monkeypatch):
    monkeypatch.setenv("AIOKV_SECRET", SECRET)
    return s3env


def test_a_warm_commits_verified_labelled_blocks_and_a_second_run_copies_nothing(secret_env, tmp_path):
    url = secret_env.url("fleet1")
    keys = [key(i) for i in range(24)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]})
    doc = run_warm([tmp_path / "c"], url)
    assert doc["warmed_blocks"] == 24 and doc["warmed_bytes"] == 24 * SB, doc
    assert doc["bad_objects"] == doc["missing_objects"] == 0 and doc["stopped"] is None, doc
    assert doc["namespaces"][0]["labelled"] == 24 and doc["namespaces"][0]["model"] == "org/tiny", doc
    assert held(tmp_path / "c") == set(keys)
    assert verify_ok(tmp_path / "c")["checked_blocks"] == 24
    # the labels engines published are this directory's now (what an engine's start events read)
    st = Store(str(tmp_path / "c"), readonly=True)
    got = []
    st.labels.read(NS, lambda found, more: got.append(found))
    st.close()
    assert got[0] == {k: label(i) for i, k in enumerate(keys)}
    # the namespace's description came from the bucket
    assert Store(str(tmp_path / "c"), readonly=True).index.namespaces[NS].fields["model"] == "org/tiny"

    again = run_warm([tmp_path / "c"], url)
    assert again["warmed_blocks"] == 0 and again["already_blocks"] == 24, again


def test_corrupt_truncated_foreign_and_misnamed_objects_are_skipped_never_committed(secret_env, tmp_path):
    url = secret_env.url("fleet2")
    keys = [key(i) for i in range(12)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]})
    name = lambda k: object_name("fleet2", NS, 0, k)  # noqa: E731
    spoiled = bytearray(secret_env.get_raw(name(keys[0])))
    spoiled[fmt.HEADER_BYTES + 100] ^= 0xFF  # a payload byte: the CRC and the MAC fail
    secret_env.put_raw(name(keys[0]), bytes(spoiled))
    secret_env.put_raw(name(keys[1]), image(NS, 0, keys[1], secret="another-fleet-secret-42"))  # another secret
    secret_env.put_raw(name(keys[2]), secret_env.get_raw(name(keys[2]))[: SB - 4096])  # truncated
    secret_env.put_raw(name(keys[3]), secret_env.get_raw(name(keys[4])))  # another block under its name
    secret_env.put_raw(name(keys[5]), image(NS2, 0, keys[5]))  # another namespace's block
    doc = run_warm([tmp_path / "c"], url)
    assert doc["warmed_blocks"] == 7 and doc["bad_objects"] == 5, doc
    assert held(tmp_path / "c") == set(keys[4:5] + keys[6:])
    verify_ok(tmp_path / "c")
    # a foreign namespace description (another secret) makes its namespace unusable, said so
    secret_env.put_raw(
        meta.namespace_name("fleet2", NS), meta.namespace_doc(NS, PAYLOAD, 1, {}, meta.meta_key("other-secret-1234567"))
    )
    doc = run_warm([tmp_path / "d"], url)
    assert doc["warmed_blocks"] == 0 and "not ours" in doc["skipped_namespaces"][0]["why"], doc


def test_without_a_secret_the_crcs_alone_keep_damaged_objects_out(s3env, tmp_path, monkeypatch):
    monkeypatch.delenv("AIOKV_SECRET", raising=False)
    url = s3env.url("fleet11")
    keys = [key(i) for i in range(8)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]}, secret=None)  # a bucket_unsigned fleet
    name = lambda k: object_name("fleet11", NS, 0, k)  # noqa: E731
    for k, at in ((keys[0], fmt.HEADER_BYTES + 100), (keys[1], fmt.HEADER_BYTES + PAYLOAD - 1), (keys[2], 40)):
        spoiled = bytearray(s3env.get_raw(name(k)))
        spoiled[at] ^= 0x01  # one bit of the payload (its CRC32C) or of the header (the header's CRC)
        s3env.put_raw(name(k), bytes(spoiled))
    doc = run_warm([tmp_path / "c"], url, unsigned=True)
    assert doc["warmed_blocks"] == 5 and doc["bad_objects"] == 3, doc
    assert held(tmp_path / "c") == set(keys[3:])
    verify_ok(tmp_path / "c")


def _until(cond, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def _committed(cache) -> int:
    return len(held(cache)) if (cache / "ns").exists() else 0


def test_an_interrupted_warm_resumes_and_commits_each_block_once(secret_env, tmp_path):
    url = secret_env.url("fleet3")
    n = 200
    keys = [key(i) for i in range(n)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]}, labels=False)
    cache = tmp_path / "c"
    argv = [sys.executable, "-m", "aiokv", "warm", str(cache), "--bucket", url, "--concurrency", "2", "--no-progress"]
    argv += ["--timeout", "600"]  # (a request held at the gate never times out meanwhile)
    seen = []
    for sig in (signal.SIGINT, signal.SIGKILL):  # Ctrl-C, then kill -9, each in the middle of a warm
        before = _committed(cache)
        # the bucket answers 40 blocks, then holds the next ones: the warm cannot finish before the
        # signal lands, however fast the machine (it raced the copy before: rc 0 on a fast CPU)
        gate = Gate(secret_env.endpoint).start()
        gate.hold_after(40)
        env = dict(os.environ, PYTHONPATH=ROOT, AWS_ENDPOINT_URL=gate.endpoint)
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            gate.wait_held(2)  # both workers wait for a block
            _until(lambda b=before: _committed(cache) == b + 40, "the 40 blocks that came were not committed")
            p.send_signal(sig)
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
            gate.stop()
        seen.append(_committed(cache))
        if sig == signal.SIGINT:
            assert p.returncode == 130 and "interrupted" in err, (p.returncode, err)
        else:
            assert p.returncode == -signal.SIGKILL
        assert seen[-1] == before + 40, (seen, err)  # every block that came, none of those on their way
        verify_ok(cache)  # only whole, verified blocks were committed
    doc = run_warm([cache], url)
    assert doc["already_blocks"] == seen[-1] == 80 and doc["warmed_blocks"] == n - 80, (doc, seen)
    assert held(cache) == set(keys)
    assert verify_ok(cache)["checked_blocks"] == n  # each key in one slot, none twice


def _stderr_of_warm(argv, env, tty: bool) -> str:
    """What `aiokv warm` writes on stderr: a terminal's (a pty) or a pipe's."""
    if not tty:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (a terminal's size)
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    got = b""
    while True:  # (drained as it comes: a full pty would block the warm)
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        got += chunk
    os.close(master)
    assert p.wait(timeout=120) == 0, got
    return got.decode(errors="replace")


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log(secret_env, tmp_path, capfd):
    url = secret_env.url("fleet10")
    keys = [key(i) for i in range(12)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]})
    env = dict(os.environ, PYTHONPATH=ROOT)
    argv = [sys.executable, "-m", "aiokv", "warm", "--bucket", url]
    bar = _stderr_of_warm([*argv, str(tmp_path / "a")], env, tty=True)
    assert "warming" in bar and "\r" in bar and "aiokv: warming:" not in bar, bar  # tqdm's bar, redrawn
    log = _stderr_of_warm([*argv, str(tmp_path / "b")], env, tty=False)
    mib = 12 * SB / (1 << 20)
    assert log.splitlines() == [f"aiokv: warming: 12 of 12 block(s), {mib:.1f} of {mib:.1f} MiB"], log
    assert "\r" not in log and "\x1b" not in log
    assert _stderr_of_warm([*argv, str(tmp_path / "c"), "--no-progress"], env, tty=True) == ""

    # a line at most every progress_every seconds, each saying how far the warm is
    capfd.readouterr()
    warm.warm(warm.Args([str(tmp_path / "d")], url, progress_every=0.0, concurrency=1))
    lines = capfd.readouterr().err.splitlines()
    assert lines[0].startswith("aiokv: warming: 1 of 12 block(s), ") and len(lines) == 13, lines
    assert lines[-1] == lines[-2] == f"aiokv: warming: 12 of 12 block(s), {mib:.1f} of {mib:.1f} MiB", lines


def test_limit_and_capacity_bound_the_warm_and_it_evicts_nothing(secret_env, tmp_path):
    url = secret_env.url("fleet4")
    old, new = [key(i) for i in range(20)], [key(i) for i in range(100, 120)]
    publish(url, {NS: [(k, "org/tiny") for k in old]})
    time.sleep(1.1)  # (object times have a resolution of a second)
    publish(url, {NS: [(k, "org/tiny") for k in new]})
    doc = run_warm([tmp_path / "a"], url, limit=10 * SB)
    assert doc["warmed_blocks"] == 10 and doc["stopped"] == "limit", doc
    assert held(tmp_path / "a") < set(new)  # the newest blocks first

    # capacity: 16 slots' worth (and room for the journal) of a directory that holds blocks
    # already: the warm adds blocks up to it
    cap = 16 * SB + (32 << 10)
    st = Store(str(tmp_path / "b"), capacity=cap)
    ns = st.namespace(NS, PAYLOAD, fields={"model": "org/tiny"})
    for k in (key(900), key(901)):  # two blocks this node holds (committed by an engine before)
        st.commit(ns, [(k, st.reserve(ns, k))])
    st.close()
    doc = run_warm([tmp_path / "b"], url, capacity=cap)
    assert doc["stopped"] == "capacity" and 12 <= doc["warmed_blocks"] <= 14, doc
    got = held(tmp_path / "b")
    assert {key(900), key(901)} <= got, "the warm evicted what the node held"
    assert len(got) == 2 + doc["warmed_blocks"]
    st = Store(str(tmp_path / "b"), readonly=True)
    assert st.space.used() <= cap
    st.close()


def test_model_selects_namespaces_by_what_their_engines_published(secret_env, tmp_path):
    url = secret_env.url("fleet5")
    publish(url, {NS: [(key(i), "org/alpha") for i in range(5)], NS2: [(key(i), "/models/beta") for i in range(7)]})
    doc = run_warm([tmp_path / "a"], url, model="alpha")
    assert doc["warmed_blocks"] == 5 and [n["nsid"] for n in doc["namespaces"]] == [NS.hex()], doc
    doc = run_warm([tmp_path / "a"], url, model="/models/beta")
    assert doc["warmed_blocks"] == 7, doc
    with pytest.raises(warm.WarmError, match="holds: /models/beta, org/alpha"):
        run_warm([tmp_path / "a"], url, model="gamma")


def test_tenant_keeps_one_tenants_blocks_and_each_block_stays_its_tenants(secret_env, tmp_path):
    url = secret_env.url("fleet9")
    owners = {key(i): ("alice", "bob", "")[i % 3] for i in range(18)}
    publish(url, {NS: [(k, "org/tiny") for k in owners]}, tenants=owners, ranks=2)
    doc = run_warm([tmp_path / "a"], url, tenant="alice")
    assert doc["warmed_blocks"] == 6 and doc["namespaces"][0]["other_tenant"] == 12, doc
    assert held(tmp_path / "a") == {k for k, o in owners.items() if o == "alice"}
    doc = run_warm([tmp_path / "a"], url, tenant="")  # requests without a cache_salt
    assert doc["warmed_blocks"] == 6 and doc["already_blocks"] == 6, doc

    # every tenant: each block is committed as the tenant its header names (quotas, clears, pins)
    doc = run_warm([tmp_path / "b"], url)
    assert doc["warmed_blocks"] == 18, doc
    st = Store(str(tmp_path / "b"), readonly=True, secret=SECRET)
    ns = st.index.namespaces[NS]
    (engine,) = ns.tables
    t = ns.tables[engine]
    tk = fmt.tenant_key(SECRET)
    for k, o in owners.items():
        assert st.tenant_tag(int(t.tenant[t.find(k)])) == fmt.tenant_tag(o, tk), o
    st.close()
    verify_ok(tmp_path / "b")  # (both ranks of every block)


def test_several_drives_take_the_blocks_their_keys_place_there(secret_env, tmp_path):
    from tools.storeio import DrivesIO

    url = secret_env.url("fleet6")
    keys = [key(i) for i in range(30)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]})
    paths = [tmp_path / "d0", tmp_path / "d1"]
    doc = run_warm(paths, url)
    assert doc["warmed_blocks"] == 30, doc
    on = [held(p) for p in paths]
    assert on[0] and on[1] and on[0] | on[1] == set(keys) and not on[0] & on[1]
    drives = DrivesIO([str(p) for p in paths], capacity="1GiB")  # an engine on the same list finds them all
    ns = drives.namespace(NS, PAYLOAD)
    assert drives.lookup(ns, keys) == 30
    drives.close()


def test_an_engine_running_beside_the_warm_serves_what_it_commits(secret_env, tmp_path):
    url = secret_env.url("fleet7")
    keys = [key(i) for i in range(10)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]})
    engine = Store(str(tmp_path / "c"), capacity="1GiB")  # engine 0, serving
    ns = engine.namespace(NS, PAYLOAD)
    doc = run_warm([tmp_path / "c"], url)
    assert doc["engine"] == 1 and doc["warmed_blocks"] == 10, doc  # beside it, as another engine
    time.sleep(0.15)
    engine.refresh()
    assert engine.lookup(ns, keys) == 10
    engine.close()


def test_no_secret_or_a_dead_bucket_is_one_line(s3env, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AIOKV_SECRET", raising=False)
    assert cli.main(["warm", str(tmp_path / "c"), "--bucket", s3env.url("x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "AIOKV_SECRET" in err and "--unsigned" in err, err

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AIOKV_SECRET", SECRET)
    t = time.monotonic()
    assert cli.main(["warm", str(tmp_path / "c"), "--bucket", "s3://nobody/x", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not answer" in err and "nothing was warmed" in err, err
    assert time.monotonic() - t < 10


def test_a_bucket_that_stops_answering_ends_the_warm_in_one_line_and_a_rerun_resumes(secret_env, tmp_path, monkeypatch):
    import threading

    url = secret_env.url("fleet8")
    keys = [key(i) for i in range(100)]
    publish(url, {NS: [(k, "org/tiny") for k in keys]}, labels=False)
    cache = tmp_path / "c"
    got: list = []
    # 40 blocks come; the warm's next requests wait at the gate while the server is killed
    # (it raced the copy before: a fast machine could finish the warm first)
    gate = Gate(secret_env.endpoint).start()
    gate.hold_after(40)
    monkeypatch.setenv("AWS_ENDPOINT_URL", gate.endpoint)

    def go():
        try:
            got.append(run_warm([cache], url, concurrency=2, timeout=30.0))
        except warm.WarmError as e:
            got.append(e)

    t = threading.Thread(target=go)
    t.start()
    try:
        gate.wait_held(2)
        _until(lambda: _committed(cache) == 40, "the 40 blocks that came were not committed")
        secret_env.kill()  # kill -9 of the server, mid-warm
    finally:
        gate.open()  # the waiting requests go on, to a dead server
        t.join(120)
        gate.stop()
    e = got[0]
    assert isinstance(e, warm.WarmError) and e.code == 2, e
    assert "does not answer" in str(e) and "run again to resume" in str(e) and "\n" not in str(e), e
    before = held(cache)
    assert len(before) == 40
    verify_ok(cache)
    secret_env.log.close()
    secret_env.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", secret_env.endpoint)
    doc = run_warm([cache], url)
    assert doc["already_blocks"] == len(before) and doc["warmed_blocks"] == 100 - len(before), doc
    assert held(cache) == set(keys)


def test_the_publisher_keeps_labels_apart_per_engine_and_the_fleet_description(s3env, tmp_path):
    url = s3env.url("pub")
    client = BucketClient(url, timeout=10)
    lt = LoopThread("test-publisher")
    a = Publisher(client, lt, meta.meta_key(SECRET), every=0.01)
    b = Publisher(client, lt, meta.meta_key(SECRET), every=0.01)
    a.namespaces([(NS, PAYLOAD, 2, {"model": "m"})])
    a.labels(NS, [(key(1), b"one"), (key(2), b"two")])
    b.labels(NS, [(key(1), b"uno")])
    a.close(10)  # waits for its uploads: its description is in the bucket now
    b.namespaces([(NS, PAYLOAD, 2, {"model": "someone else"})])  # write-once: the first stays
    b.close(10)
    lt.stop()
    assert a.counters["labels_uploaded"] == 2 and b.counters["labels_uploaded"] == 1
    raw = s3env.get_raw(meta.namespace_name("pub", NS))
    assert meta.read_namespace_doc(raw, NS, meta.meta_key(SECRET)) == (PAYLOAD, 2, {"model": "m"})
    with pytest.raises(meta.Foreign):
        meta.read_namespace_doc(raw, NS, meta.meta_key("another-secret-0000"))

    from aiokv.bucket import catalog

    found, foreign = asyncio.run(catalog.labels(client, NS, meta.meta_key(SECRET), [key(1), key(2)]))
    assert foreign == 0 and found[key(2)] == b"two" and found[key(1)] in (b"one", b"uno")
    names = collections.Counter(
        n.rsplit("/", 1)[-1].split("-")[0] for n in _names(s3env, "pub/" + NS.hex() + "/labels/")
    )
    assert sorted(names) == sorted({a.writer, b.writer})


def _names(srv, prefix: str) -> list[str]:
    import obstore

    return [m["path"] for batch in obstore.list(srv._store(), prefix=prefix) for m in batch]
