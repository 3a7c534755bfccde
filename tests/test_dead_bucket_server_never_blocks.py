# SPDX-License-Identifier: Apache-2.0
"""A dead or hung bucket server costs bounded time, and is used again
once it is back.

Bug guarded against: an engine whose bucket's server is killed (-9) or stops
answering (hung) waits on it: uploads pile up or block a step, every lookup or
load waits a full timeout per block.
Invariant: `offer` never waits; failed uploads are dropped and counted; after
a few failures the breaker skips the server (uploads dropped as unavailable,
lookups answered at once with what is known, loads a miss at once); no call
takes longer than `bucket_timeout` (plus scheduling slack), even against a
server that accepts connections and never answers; after the cooldown, with
the server back, uploads and loads work again.
Fix: aiokv/util/breaker.py (the bucket's instance), the deadlines in aiokv/bucket/client.py, the
bounded lossy queue in aiokv/bucket/uploader.py.

Bug guarded against, at close: an engine shut down while its prober waits on a hung server
left the probes pending on the prober's loop as it closed; obstore's runtime answered each
request later, onto the closed loop: a "RuntimeError: Event loop is closed" traceback on
stderr per request, after the engine had said it stopped.
Invariant: nothing of a closed prober runs or prints after `close`.
Fix: LoopThread.stop (aiokv/util/loops.py) cancels the tasks left on its loop first, so
obstore drops the requests they await.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import time
from urllib.parse import urlsplit

import psutil

from aiokv.bucket.client import BucketClient, bucket_breaker
from aiokv.bucket.loader import OK, UNAVAILABLE, BucketLoader
from aiokv.bucket.naming import object_name
from aiokv.bucket.prober import Prober
from aiokv.bucket.uploader import Uploader
from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)
TIMEOUT = 1.0


def test_breaker_opens_and_lets_one_trial_through():
    now = [0.0]
    b = bucket_breaker(failures=3, cooldown=10, clock=lambda: now[0])
    for _ in range(2):
        b.failure()
    assert b.allow() and not b.is_open
    b.failure()
    assert b.is_open and not b.allow() and b.opens == 1
    now[0] = 11
    assert b.allow() and not b.allow()  # one trial at a time
    b.failure()  # the trial failed: another cooldown
    assert b.is_open and not b.allow()
    now[0] = 22
    assert b.allow()
    b.cancelled()  # the trial's caller gave up: another trial may go
    assert b.allow()
    b.success()
    assert not b.is_open and b.allow() and b.allow()


async def test_killed_server_drops_counted_and_recovers(tmp_path, blocks, s3env):
    st = StoreIO(tmp_path / "s", capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD, fields={"model": "t"})
    io = st.blockio(ns)
    for i in range(40):
        blocks.fill(i, key(i))
        io.stamp(key(i), blocks.addr(i))
    breaker = bucket_breaker(failures=3, cooldown=2.0)
    client = BucketClient(s3env.url("dead"), timeout=TIMEOUT, breaker=breaker)
    up = Uploader(client, 8 * SB, concurrency=2)
    name = lambda i: object_name(client.prefix, NS, 0, key(i))  # noqa: E731
    data = lambda i: ctypes.string_at(blocks.addr(i), SB)  # noqa: E731
    for i in range(4):
        up.offer(name(i), data(i))
    assert await up.flush(30) == 0 and up.counters["uploaded"] == 4

    for i in range(4, 12):  # queued, then the server dies under them
        assert up.offer(name(i), data(i))
    s3env.kill()
    t = time.monotonic()
    accepted = sum(up.offer(name(i), data(i)) for i in range(12, 40))
    # offering never waits for the server: far less than one request's timeout (a margin for a busy machine)
    assert time.monotonic() - t < TIMEOUT / 2
    assert accepted <= 8  # bounded queue: the rest dropped at once
    await up.flush(8 * TIMEOUT + 5)
    c = up.counters
    assert c["upload_failed"] >= 1 and breaker.opens >= 1, c
    assert (
        c["uploaded"]
        + c["upload_failed"]
        + c["upload_dropped_queue_full"]
        + c["upload_dropped_unavailable"]
        + c["upload_dropped_at_close"]
        + c.get("upload_already_there", 0)
        == 40
    ), c

    loader = BucketLoader(client, NS, 0, SB)
    t = time.monotonic()
    assert await loader.fetch(key(0), blocks.addr(50), io.verify) == UNAVAILABLE
    assert time.monotonic() - t < TIMEOUT + 0.5
    prober = Prober(client, timeout=0.2)
    try:
        t = time.monotonic()
        assert prober.lookup("r", [[(name(i), SB)] for i in range(4)]) == 0  # breaker open: answered at once
        assert time.monotonic() - t < TIMEOUT / 2, "an open breaker answers without asking the server"

        s3env.start()
        time.sleep(breaker.cooldown)
        up2 = Uploader(client, 8 * SB)
        up2.offer(name(4), data(4))  # the one trial request after the cooldown closes the breaker
        assert await up2.flush(30) == 0
        for i in range(5, 8):
            up2.offer(name(i), data(i))
        assert await up2.flush(30) == 0
        assert up2.counters["uploaded"] + up2.counters["upload_already_there"] == 4, up2.counters
        assert not breaker.is_open
        assert await loader.fetch(key(5), blocks.addr(50), io.verify) == OK
        assert blocks.holds(50, key(5))
    finally:
        prober.close()
        st.close()


async def test_hung_server_costs_at_most_the_timeout(tmp_path, blocks, s3env):
    client = BucketClient(s3env.url("hung"), timeout=TIMEOUT, breaker=bucket_breaker(failures=100))
    loader = BucketLoader(client, NS, 0, SB)
    up = Uploader(client, 64 * SB)
    os.killpg(s3env.proc.pid, signal.SIGSTOP)  # accepts connections (kernel backlog), never answers
    try:
        t = time.monotonic()
        assert await loader.fetch(key(1), blocks.addr(0), lambda k, a: True) == UNAVAILABLE
        took = time.monotonic() - t
        assert took < TIMEOUT + 0.5, took
        up.offer(object_name(client.prefix, NS, 0, key(1)), b"x" * SB)
        t = time.monotonic()
        await up.flush(TIMEOUT + 0.5)
        assert time.monotonic() - t < TIMEOUT + 1.0
        assert up.counters["upload_failed"] + up.counters["upload_dropped_at_close"] == 1, up.counters
        # lookups: "not yet" (None) at once, each call short, then given up after the probe timeout
        prober = Prober(client, timeout=0.5)
        # a full collection of this long-lived test process's heap can stop any call for a
        # few tenths of a second on a loaded machine: not a wait for the server, so not timed here
        gc.collect()
        gc.disable()
        try:
            want = [[(object_name(client.prefix, NS, 0, key(i)), SB)] for i in range(8)]
            answers, slowest, t0 = [], 0.0, time.monotonic()
            while not answers or answers[-1] is None:
                t = time.monotonic()
                answers.append(prober.lookup("r", want))
                slowest = max(slowest, time.monotonic() - t)
                assert time.monotonic() - t0 < 3.0
                time.sleep(0.01)  # one engine step
            # no call waits for the server (well under the probe timeout), and the prober gives up
            # once the probe timeout has passed (within a margin for a busy machine)
            assert answers[0] is None and answers[-1] == 0 and slowest < 0.25, (answers, slowest)
            assert 0.5 <= time.monotonic() - t0 < 1.5
        finally:
            gc.enable()
            prober.close()
    finally:
        os.killpg(s3env.proc.pid, signal.SIGCONT)


def test_a_prober_closed_mid_probe_prints_nothing_later(s3env, capfd):
    late = 2.0  # the requests' own deadline: a late answer arrives by then
    client = BucketClient(s3env.url("hung"), timeout=late, breaker=bucket_breaker(failures=100))
    port = urlsplit(os.environ["AWS_ENDPOINT_URL"]).port
    me = psutil.Process()
    os.killpg(s3env.proc.pid, signal.SIGSTOP)
    try:
        prober = Prober(client, timeout=late)
        assert prober.lookup("r", [[(object_name(client.prefix, NS, 0, key(i)), SB)] for i in range(8)]) is None
        t0 = time.monotonic()  # the HEADs are in obstore's runtime once it has connected
        while not any(c.raddr and c.raddr.port == port for c in me.net_connections(kind="tcp")):
            assert time.monotonic() - t0 < 10, "no request reached the server"
            time.sleep(0.01)
        prober.close()
        assert prober.loop.is_closed()
        time.sleep(late + 1.0)  # past their deadline
    finally:
        os.killpg(s3env.proc.pid, signal.SIGCONT)
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Task was destroyed" not in err, err[-2000:]
