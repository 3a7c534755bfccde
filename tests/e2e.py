# SPDX-License-Identifier: Apache-2.0
"""Helpers for end-to-end tests on real vLLM (CPU): tiny models, runs in fresh
processes, and the assertions every such test makes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


UNCHECKED: list[dict] = []  # this test's lives with aiokv not yet passed to happened() (conftest fails the test)


def run(spec: dict, env: dict | None = None, timeout: int = 600) -> dict:
    """One engine life in a new process (forked from tools/forkserver.py's server where its
    environment allows; AIOKV_TEST_NO_FORK=1: always `python -m tests.vllm_run`); returns its RESULT."""
    e = _env()
    # a multiprocess life (engine core and worker apart): the cores vLLM's CPU build reserves for the
    # engine core are those of a run without a connector (it reserves one more for any connector;
    # docs/operations.md, "Start"); a life with TP > 1 binds its workers' threads itself
    e.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    e.update(env or {})
    argv = ["-m", "tests.vllm_run", json.dumps(spec)]
    if spec.get("tp", 1) == 1:  # one process: it may fork
        from tools.forkserver import shared

        server = shared(ROOT)
        got = server.captured(argv, e, timeout) if server is not None else None
        if got is not None:
            return _result(got[2], got[0], got[1])
    p = subprocess.run([sys.executable] + argv, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    return _result(p.returncode, p.stdout, p.stderr)


def _env(extra: dict | None = None) -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    e.update(extra or {})
    return e


def start(spec: dict, env: dict | None = None) -> subprocess.Popen:
    """One engine life in the background (`python -m tests.vllm_run`), in a session of its own so
    that kill() reaches everything it started; result() waits for its RESULT."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.vllm_run", json.dumps(spec)],
        cwd=ROOT,
        env=_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def result(p: subprocess.Popen, timeout: float = 600) -> dict:
    """The RESULT of a life start() began (like run()'s: happened() must see it)."""
    out, err = p.communicate(timeout=timeout)
    return _result(p.returncode, out, err)


def kill(p: subprocess.Popen) -> None:
    """A life start() began, killed -9 with what it started, if it still runs."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def wait_until(cond, what: str, procs=(), timeout: float = 300, seen=None) -> None:
    """Until cond(), polling; fails at once if one of `procs` (lives start() began) exits, and
    after `timeout` s; seen(): what the failure message shows of the state."""
    end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"an engine exited while waiting for {what}:\n{p.stderr.read()[-4000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}" + (f"; now {seen()}" if seen else ""))
        time.sleep(0.2)


def _result(rc: int, stdout: str, stderr: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["log"] = stderr[-4000:]
            if "counters" in res or "metrics" in res:
                UNCHECKED.append(res)
            return res
    raise AssertionError(f"vLLM run failed (rc {rc}):\n{stderr[-6000:]}")


def stored_blocks(cache: str) -> int:
    """Blocks the cache directory holds (0 if it does not exist), every namespace and engine."""
    if not os.path.exists(cache):
        return 0
    from aiokv.store import Store

    st = Store(cache, readonly=True)
    try:
        return sum(ns.count() for ns in st.index.namespaces.values())
    finally:
        st.close()


def events_socket() -> str:
    """A fresh path for a life's KV-event publisher (an ipc:// socket: TCP ports picked free may be
    taken by another engine's own start-up before the publisher binds them)."""
    import uuid

    return f"/tmp/aiokv-ev-{uuid.uuid4().hex[:16]}"


def vllm_hashes(seqs: list[list[int]], bs: int, salt: str | None = None) -> dict[int, tuple[list[int], int | None]]:
    """What vLLM's KV events call each full block of these token sequences (its own hash function,
    sha256 under this process's PYTHONHASHSEED, converted as its events convert it), requested
    with this cache_salt (vLLM hashes it into the first block): hash -> (the block's tokens, the
    parent block's hash or None)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash, resolve_none_hash_seed

    out = {}
    for seq in seqs:
        parent, prev = sha256(resolve_none_hash_seed(sha256)), None
        for j in range(len(seq) // bs):
            extra = (("cache_salt", salt),) if salt and j == 0 else None
            parent = hash_block_tokens(sha256, parent, seq[j * bs : (j + 1) * bs], extra)
            h = maybe_convert_block_hash(parent)
            out[h] = (seq[j * bs : (j + 1) * bs], prev)
            prev = h
    return out


def prompts(n: int, length: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rnd = random.Random(seed)
    pre = prefix or []
    return [[1] + pre + [rnd.randrange(3, 500) for _ in range(length - len(pre) - 1)] for _ in range(n)]


_OPS = {
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
}


def figure(res: dict, name: str):
    """One figure of a life: aiokv's counter, the life's own (preemptions, faults_fired,
    pending_saves_at_finish, ...) or, for a multiprocess life, vLLM's series vllm:aiokv_NAME."""
    for where in (res.get("counters") or {}, res, res.get("metrics") or {}):
        if name in where:
            return where[name]
    if f"vllm:aiokv_{name}" in (res.get("metrics") or {}):
        return res["metrics"][f"vllm:aiokv_{name}"]
    if "counters" in res and _named_in_aiokv(name):  # counted only once it happens: 0 so far
        return 0
    raise AssertionError(f"the life has no figure {name!r}: {sorted(res.get('counters') or res.get('metrics') or {})}")


def part(base: dict, phases=None, requests=None) -> dict:
    """The tokens of some phases (and requests) of a baseline, to check a life that ran only those."""
    ph = range(len(base["tokens"])) if phases is None else phases
    toks = [base["tokens"][p] for p in ph]
    if requests is not None:
        toks = [[t[i] for i in requests] for t in toks]
    return {"tokens": toks}


def _named_in_aiokv(name: str, _src: list = []) -> bool:  # noqa: B006 (the list is a memo of the tree's sources)
    if not _src:
        for d, _, files in os.walk(os.path.join(ROOT, "aiokv")):
            _src.extend(open(os.path.join(d, f)).read() for f in files if f.endswith(".py"))
    return any(name in s for s in _src)


def _why(res: dict) -> str:
    """For a failure's message: the life's non-zero counters (which path a figure took instead: saves
    dropped by cause, evictions, timeouts) and the end of its log (its warnings)."""
    c = res.get("counters") or res.get("metrics") or {}
    nonzero = {k: v for k, v in sorted(c.items()) if v and not isinstance(v, dict) and "_seconds_b" not in k}
    tail = res.get("log", "")[-2000:]
    return f"\nits non-zero counters: {nonzero}" + (f"\nthe end of its log:\n{tail}" if tail else "")


def happened(
    res: dict,
    base: dict | None,
    *,
    allow_load_errors: bool = False,
    allow_save_errors: bool = False,
    why_no_baseline: str = "",
    disabled: bool = False,
    **expect,
) -> None:
    """What every end-to-end life of aiokv must show; tests.e2e.run records each such life and a
    test that never passes one here fails (tests/conftest.py), so no test can forget it.

    - tokens equal `base`'s, a run of the same phases WITHOUT aiokv, for every request this life
      did not abort (`base` None only with `why_no_baseline`);
    - nothing failed, pinned, pending, in flight or leaked (assert_clean); load or save errors only
      where allowed; `disabled`: aiokv turned itself off at start (no scheduler side), vLLM served on;
    - each expected figure (see figure()): `name=N` exactly N, `name=">N"` (also >=, <, <=), so
      the path the test claims was taken shows in aiokv's own counters.
    """
    if res in UNCHECKED:
        UNCHECKED.remove(res)
    if base is not None:
        for p, (got, want) in enumerate(zip(res["tokens"], base["tokens"])):
            fin = res["finish"][p]
            for i, (g, w) in enumerate(zip(got, want)):
                assert fin[i] == "aborted" or g == w, f"phase {p} request {i}: {g} != {w} (without aiokv)"
        assert len(res["tokens"]) == len(base["tokens"]), "the baseline ran other phases"
    else:
        assert why_no_baseline, "compare with a run without aiokv, or say why not (why_no_baseline)"
    if disabled:
        assert "pending_saves" not in res["counters"], "aiokv was expected to disable itself"
        assert_no_leaks(res)
    elif "counters" in res:
        assert_clean(res, allow_load_errors=allow_load_errors, allow_save_errors=allow_save_errors)
    else:  # a multiprocess life: what vLLM exports
        if not allow_load_errors:
            assert figure(res, "load_failed_blocks") == 0, res["metrics"]
        if not allow_save_errors:
            assert figure(res, "save_failed_blocks") == 0, res["metrics"]
    for name, want in expect.items():
        got = figure(res, name)
        if isinstance(want, str):
            op = want.rstrip("0123456789.-")
            assert _OPS[op](got, float(want[len(op) :])), f"{name} = {got}, expected {want}{_why(res)}"
        else:
            assert got == want, f"{name} = {got}, expected {want}{_why(res)}"


def assert_clean(res: dict, *, allow_load_errors: bool = False, allow_save_errors: bool = False) -> None:
    """aiokv's own counters after a run: no failures, nothing leaked."""
    c = res["counters"]
    if not allow_load_errors:
        assert c.get("load_failed_blocks", 0) == 0, c
        assert c.get("load_bad_blocks", 0) == 0, c
    if not allow_save_errors:
        assert c.get("save_failed_blocks", 0) == 0 and c.get("save_failures", 0) == 0, c
    assert c["pending_saves"] == 0, (c, "steps and seconds waited after the last phase:", res.get("end_wait"))
    assert c["pinned"] == 0, c
    if "worker_in_flight" in c:  # (TP > 1: the worker sides live in the workers' processes)
        assert c["worker_in_flight"] == 0 and c["staging_in_use"] == 0, c
    assert c.get("load_report_breaches", 0) == 0, c  # every load reported finished exactly once
    assert c.get("reports_ignored", 0) == 0, c  # every worker result found the job it names
    assert_no_leaks(res)


def assert_no_leaks(res: dict) -> None:
    # every KV block is back in vLLM's free pool (block 0 is the null block)
    assert res["free_blocks"] == res["total_blocks"] - 1, (res["free_blocks"], res["total_blocks"])
    assert res["requests_left"] == 0
