# SPDX-License-Identifier: Apache-2.0
"""Crash and damaged files under real vLLM.

Bug: a crash between writing blocks and committing them, a torn index journal,
a truncated or deleted data file serve wrong KV, lose committed blocks, or keep
the engine from starting.
Invariant: after kill -9 of the engine during a burst of saves, a restart on the
same directory recovers the index, still hits every block committed before the
kill, every hit verifies (zero load errors) and tokens equal a run without
aiokv. Damaged files become misses (recomputes), counted, never wrong tokens.
The kill lands while saves are in flight whatever the machine's speed: every
write after the first 40 reaches the disk and then completes an hour late (the
test-only injector, aiokv/data/faults.py), and the engine waits alive after its
burst, so it can neither commit those nor finish before the kill (the test
raced the burst before: "the engine finished before it could be killed").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aiokv.store import Store
from tests.e2e import ROOT, happened, prompts, run

pytestmark = pytest.mark.vllm

PS = prompts(40, 230, seed=71)
# writes after the first 40 complete an hour late: the saves in flight when the kill lands
HELD = json.dumps([{"op": "write", "kind": "late", "delay": 3600, "skip": 40}])


def _entries(cache: str) -> set[bytes]:
    try:
        st = Store(cache, readonly=True)
    except Exception:
        return set()
    try:
        return {k for ns in st.index.namespaces.values() for k in ns.keys()}
    finally:
        st.close()


@pytest.fixture(scope="module")
def crashed(tiny_model, tmp_path_factory):
    """A cache whose engine was killed with SIGKILL in the middle of saving."""
    base = tmp_path_factory.mktemp("crash")
    cache = str(base / "c")
    burst = dict(prompts=PS, stagger=True, max_tokens=30)
    never = dict(prompts=[], wait_for=str(base / "never"))  # alive after the burst, until killed
    spec = dict(model=tiny_model, cache=cache, extra={"save_timeout": 86400}, phases=[burst, never])
    env = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    env.update(AIOKV_FAULTS=HELD, AIOKV_FAULTS_ACK="inject I/O faults")
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.vllm_run", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: set[bytes] = set()
    deadline = time.monotonic() + 300
    while len(seen) < 28 and time.monotonic() < deadline and p.poll() is None:  # (the first 40 writes: ~5 prompts)
        time.sleep(0.1)
        seen = _entries(cache)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert len(seen) >= 28, "the engine did not commit enough before the kill"
    assert p.returncode == -signal.SIGKILL, "the engine exited before the kill"
    return cache, seen


def test_restart_after_kill9_hits_what_was_committed(tiny_model, crashed, tmp_path):
    cache, seen = crashed
    t = time.monotonic()
    after = _entries(cache)
    recovery = time.monotonic() - t
    assert seen <= after, f"{len(seen - after)} blocks committed before the kill are gone"
    base = run(dict(model=tiny_model, phases=[dict(prompts=PS[:12])]))
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=PS[:12])]))
    # every request hits exactly its leading run of recovered blocks (its prompt's, 7 at most)
    expected = _leading_runs(cache, after, PS[:12], (230 - 1) // 32)
    assert expected > 0, "no block of these prompts was committed before the kill"
    happened(warm, base, hit_blocks=expected)
    print(f"index of {len(after)} blocks recovered in {recovery:.3f} s")


def _leading_runs(cache: str, stored: set[bytes], ps: list[list[int]], usable: int) -> int:
    """Blocks of `ps` a lookup finds: per prompt, its keys from block 0 while they are stored."""
    from aiokv.scheduler.keys import extend_keys, request_root

    nsid = bytes.fromhex(os.path.basename(_ns_dir(cache)))
    total = 0
    for p in ps:
        keys = extend_keys([], request_root(nsid, []), p, 32, usable)
        total += next((i for i, k in enumerate(keys) if k not in stored), len(keys))
    return total


def _ns_dir(cache: str) -> str:
    (name,) = os.listdir(os.path.join(cache, "ns"))
    return os.path.join(cache, "ns", name)


@pytest.mark.parametrize("damage", ["truncate", "torn_journal", "delete"])
def test_damaged_files_become_misses(tiny_model, tmp_path, damage):
    cache = str(tmp_path / "c")
    ps = prompts(4, 230, seed=81)
    base = run(dict(model=tiny_model, phases=[dict(prompts=ps)]))
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    happened(cold, base, saves_committed=">=10")
    d = _ns_dir(cache)
    data = os.path.join(d, "rank0.data")
    if damage == "truncate":
        with open(os.path.join(d, "namespace.json")) as f:
            slot_bytes = json.load(f)["slot_bytes"]
        os.truncate(data, 10 * slot_bytes + 4096)  # the used slots are the first ones
    elif damage == "delete":
        os.unlink(data)
    else:
        # the engine closed cleanly (checkpoint); append half a record as a crash mid-append would
        jpath = next(os.path.join(d, n) for n in os.listdir(d) if n.startswith("journal."))
        with open(jpath, "ab") as f:
            f.write(os.urandom(40))
    warm = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    if damage == "torn_journal":
        happened(warm, base, hit_blocks=4 * (229 // 32))
    else:
        happened(warm, base, allow_load_errors=True, load_failed_blocks=">0", load_bad_blocks=">0")
        again = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
        happened(again, base, load_failed_blocks=0)
