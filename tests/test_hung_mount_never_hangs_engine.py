# SPDX-License-Identifier: Apache-2.0
"""Bug: with the cache directory on a mount whose data-file reads hang and whose
FUSE daemon has a small thread pool (4), everything else on the mount hangs
behind the reads, and vLLM stopped making progress: its scheduler thread sat in
an `fstat`/`listdir` of aiokv's (following the other engines' journals, journal
appends and syncs, capacity checks), in uninterruptible sleep, until the reads
were released. A mount where nothing answers (a hung NFS server) did the same.

Invariant (real vLLM, real FUSE file system, tests/stallfs.py, both modes:
"r" = data-file reads hang with 4 daemon threads, "a" = every operation on the
mount hangs; the switch is set after the engine started): warm requests finish
with the tokens of a run without aiokv within load_timeout + a few seconds, the
breaker opens once, the engine's shutdown returns while the mount still hangs,
the process exits cleanly once the mount recovers, and a restart hits what was
stored before the hang. The same with the engine core in its own process
(`all-mp`: tokens and time), and under `vllm serve` in one server life (both
modes in turn): /health keeps answering and completions return the baseline's
token IDs while the mount hangs.

Fix: no file-system call on vLLM's threads while serving: the store's I/O runs
on its own thread with a deadline (aiokv/store/fsthread.py); a missed deadline
opens the breaker until the file system answers; shutdown waits for it a
bounded time.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
import time
import urllib.request

import pytest

from tests.e2e import happened, part, prompts, run
from tests.stallfs import mounted
from tests.test_hung_disk_does_not_hang_engine import _result, _start, exits_cleanly

pytestmark = pytest.mark.vllm

PS = prompts(4, 230, seed=81)
PS2 = prompts(4, 230, seed=82)  # stored too, asked for once the breaker is open
FULL = 229 // 32
LOAD_TIMEOUT = 3
SLACK = 12  # seconds beyond load_timeout for the whole batch on a loaded 2-core machine
HEALTH_TIMEOUT = 5  # seconds /health may take while the mount hangs


@pytest.fixture(scope="module")
def stored(tiny_model, tmp_path_factory):
    """The baseline's tokens (no aiokv) and a cache holding PS and PS2 (on a plain directory,
    copied onto each mount)."""
    base = run(dict(model=tiny_model, phases=[dict(prompts=PS), dict(prompts=PS2)]))
    cache = str(tmp_path_factory.mktemp("stored") / "c")
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS), dict(prompts=PS2)]))
    happened(cold, base, saves_committed=f">={8 * FULL}")
    return base, cache


@pytest.mark.parametrize("mode,mp", [("r", False), ("a", False), ("a", True)], ids=["reads", "all", "all-mp"])
def test_requests_finish_while_the_mount_hangs(tiny_model, tmp_path, stored, mode, mp):
    """mp: the engine core in its own process (vLLM's default); only tokens and time are seen then."""
    base, stored_cache = stored
    control, ready, go = str(tmp_path / "stall"), str(tmp_path / "ready"), str(tmp_path / "go")
    shutil.copytree(stored_cache, str(tmp_path / "src" / "c"), symlinks=True)
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control, threads=4):
        cache = str(tmp_path / "mnt" / "c")
        spec = dict(
            model=tiny_model,
            cache=cache,
            ready_file=ready,
            extra={"load_timeout": LOAD_TIMEOUT, "breaker_cooldown": 600, "fs_timeout": 2},
            phases=[dict(prompts=PS, wait_for=go), dict(prompts=PS2)],
        )
        p, lines = _start(spec, mp)
        try:
            end = time.monotonic() + 600  # mp on a loaded 2-core machine starts slowly
            while not os.path.exists(ready):
                assert p.poll() is None and time.monotonic() < end, "vLLM did not start:\n" + "".join(lines[-40:])
                time.sleep(0.1)
            time.sleep(0.5)  # the engine idles, following its journals
            with open(control, "w") as f:
                f.write(mode)  # from now on the mount hangs
            open(go, "w").close()
            t0 = time.monotonic()
            res = _result(lines, p, 120)
            took = time.monotonic() - t0
            assert res is not None, "vLLM did not finish while the mount hung:\n" + "".join(lines[-40:])
            assert os.path.exists(control), "the mount must still hang when the engine is done"
            print(f"mode {mode}: results {took:.1f} s after the hang began (shutdown included)")
            assert res["tokens"] == base["tokens"], "tokens differ from the run without aiokv"
            assert took < LOAD_TIMEOUT + SLACK + 10, f"{took:.1f} s: requests waited on the hung mount"
            if not mp:  # the engine core is in another process: no counters
                c = res["counters"]
                assert c["hit_requests"] == 4 and c["loads_ok_blocks"] == 0, c
                assert c["load_failed_blocks"] == 4 * FULL, c
                assert c["breaker_opens"] == 1, c
                assert c["pinned"] == 0 and c["pending_saves"] == 0, c
                assert res["free_blocks"] == res["total_blocks"] - 1 and res["requests_left"] == 0
        finally:
            if os.path.exists(control):
                os.unlink(control)  # the mount recovers
        exits_cleanly(p, "once the mount recovered")
        # a restart hits what was stored before the hang
        if mp:
            return
        again = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS)]))
        happened(again, part(base, [0]), hit_blocks=4 * FULL, loads_ok_blocks=4 * FULL)


class _Health(threading.Thread):
    """Polls the server's /health (once started: its url is known once it is ready) while the
    mount hangs: the slowest answer, and the failures."""

    def __init__(self, srv):
        super().__init__(daemon=True)
        self.srv, self.stop, self.slowest, self.failures, self.answers = srv, threading.Event(), 0.0, [], 0

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                with urllib.request.urlopen(self.srv.url + "/health", timeout=HEALTH_TIMEOUT) as r:
                    assert r.status == 200
                self.answers += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported by the test
                self.failures.append(repr(e))
            self.slowest = max(self.slowest, time.monotonic() - t)
            self.stop.wait(0.25)


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    ).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["token_ids"]


def test_server_answers_health_and_completions_while_the_mount_hangs(tiny_model, tmp_path, stored):
    """`vllm serve` (its engine core in its own process: the multiprocess engine), one life: the
    mount's data-file reads hang ("r", 4 daemon threads), then every operation ("a"); meanwhile
    /health answers and each batch of stored prompts completes with the tokens of the run without
    aiokv within load_timeout + SLACK; the server stops cleanly on SIGTERM once the mount recovers."""
    from tests.test_vllm_serve_restart_hits import AIOKV_CODE, Server

    base, stored_cache = stored
    control = str(tmp_path / "stall")
    shutil.copytree(stored_cache, str(tmp_path / "src" / "c"), symlinks=True)
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control, threads=4):
        srv = Server(
            tiny_model,
            str(tmp_path / "mnt" / "c"),
            str(tmp_path / "serve.log"),
            extra={"load_timeout": LOAD_TIMEOUT, "breaker_cooldown": 600, "fs_timeout": 2},
        )
        health = _Health(srv)
        try:
            srv.wait_ready()
            health.start()
            # reads hang first (the 4 hits' loads time out, everything else on the mount hangs
            # behind them), then nothing on the mount answers at all
            for mode, ps, want in (("r", PS, base["tokens"][0]), ("a", PS2, base["tokens"][1])):
                with open(control, "w") as f:
                    f.write(mode)
                t0 = time.monotonic()
                with concurrent.futures.ThreadPoolExecutor(len(ps)) as pool:
                    got = list(pool.map(lambda p: _complete(srv.url, p), ps))
                took = time.monotonic() - t0
                print(f"server, mode {mode}: {len(ps)} completions {took:.1f} s after the hang began")
                assert got == want, f"mode {mode}: tokens differ from the run without aiokv"
                assert took < LOAD_TIMEOUT + SLACK, f"mode {mode}: {took:.1f} s: requests waited on the hung mount"
                assert os.path.exists(control)
            health.stop.set()
            health.join(HEALTH_TIMEOUT + 1)
            assert health.answers > 0 and not health.failures, health.failures
            assert health.slowest < HEALTH_TIMEOUT, health.slowest
        finally:
            health.stop.set()
            if os.path.exists(control):
                os.unlink(control)  # the mount recovers
            rc = srv.stop()
        log = srv.text()
        assert rc == 0, log[-4000:]
        assert "the cache directory's file system does not answer" in log, log[-4000:]
        ours = [line for line in log.splitlines() if AIOKV_CODE in line]  # no traceback through aiokv
        assert not ours, "\n".join(ours)
