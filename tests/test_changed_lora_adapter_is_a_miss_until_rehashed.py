# SPDX-License-Identifier: Apache-2.0
"""A LoRA adapter re-saved at its path is a miss until its new files are hashed, and thousands
of adapters keep their fingerprints (issue 40, item 9; engine-free: aiokv/connector/adapters.py).

Bug: `Adapters.get` served the fingerprint of the last finished look. When an adapter was
re-saved in place, the look that noticed re-hashed its files (up to 2 GiB: seconds), and
meanwhile every request with the adapter was given the old files' fingerprint: it hit KV made
with the old adapter and saved new-adapter KV under the old adapter's keys, which other engines
then loaded. Beyond 1,024 adapters the oldest fingerprints were forgotten: an adapter asked
for again was hashed again in full. And a request allocated before its adapter had a fingerprint
(the first of each adapter in a life, any while one was hashed) got no key root for its whole
life: a miss that never saved.
Invariant: once a look has seen a changed signature (the files' names, sizes, modification
times), `get` gives no fingerprint (a miss that saves nothing) until the new files' fingerprint
is known, and `poll` names the adapter as changed (the connector then retires the requests
keyed by the old one); the new fingerprint is the new files'. Fingerprints of tens of thousands
of adapters are kept (a bounded LRU keyed by path, a few hundred bytes each); an adapter is hashed
once per version of its files however many others are asked for meanwhile. A request allocated
before its adapter's fingerprint was known saves nothing until the first step after it is known,
then its blocks (scheduler_role.py, roots.py: with only full-attention groups also those it
computed before; with a sliding-window group those it completes from then on).
The re-hash is held inside a read of the adapter's weights by tests/stallfs.py (mode "t"), and the
test waits for the file that says the read is held: nothing races the machine's speed.
Fix: adapters.py (a look that sees a changed signature marks the adapter changing before it
hashes; MAX_ADAPTERS 65,536, forgotten least recently asked first); roots.py (a request waits
for its root). The engine side, with real vLLM: tests/test_resaved_lora_adapter_e2e.py.
"""

from __future__ import annotations

import os
import time

import pytest

from aiokv.connector import adapters as adapters_mod
from aiokv.connector import fingerprint
from aiokv.connector.adapters import Adapters


def _adapter(d, weights: bytes) -> str:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}')
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return str(d)


def _fp(d: str) -> str:
    return fingerprint.adapter_fingerprint(fingerprint.adapter_files(d)[0])


def _wait(cond, what: str, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_resaved_adapter_is_a_miss_while_its_new_files_are_hashed(tmp_path):
    from tests.stallfs import mounted

    control = str(tmp_path / "stall")
    _adapter(tmp_path / "src" / "a", os.urandom(1 << 16))
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        path = str(tmp_path / "mnt" / "a")
        old = _fp(path)
        adapters = Adapters(60.0)
        try:
            _wait(lambda: (adapters.poll(), adapters.get("mine", path))[1] == old, "first look")
            _wait(lambda: adapters.fs.pending == 0, "a look went on")  # no look sees the re-save but ours
            adapters.poll()
            assert adapters.get("mine", path) == old
            _wait(lambda: adapters.fs.pending == 0, "a look went on")
            adapters.poll()

            _adapter(path, os.urandom(1 << 16))  # re-saved in place, through the mount (same size)
            new = fingerprint.adapter_fingerprint(fingerprint.adapter_files(str(tmp_path / "src" / "a"))[0])
            with open(control, "w") as f:
                f.write("t")  # reads of the weights hang from now on
            adapters.get("mine", path)  # queues the look that sees the new signature
            _wait(lambda: os.path.exists(control + ".held"), "the look never read the new weights")
            # the look is inside the re-hash: the old fingerprint is never served again
            got = [adapters.get("mine", path) for _ in range(3)]
            changed = adapters.poll()
            assert got == [None] * 3, f"served {got[0]} (the old files' is {old}) while the new files were hashed"
            assert changed == {path}, changed
            assert adapters.poll() == set(), "a change is named once"
            os.unlink(control)
            _wait(lambda: (adapters.poll(), adapters.get("mine", path))[1] is not None, "re-hash")
            assert adapters.get("mine", path) == new != old
        finally:
            adapters.close()


def test_a_look_finished_since_the_last_step_does_not_stop_the_next_one(tmp_path):
    """A look that ended on the I/O thread after the step's poll left the adapter marked as
    being looked at until the next poll, so a request asking between them queued no look: files
    re-saved by then were first noticed one request later (and the end-to-end test's held
    re-hash never started: tests/test_resaved_lora_adapter_e2e.py waited 300 s for it). A look
    applied that way hands out no fingerprint until the step's poll has named the change (the
    connector retires the path's requests there: one given the new fingerprint would be too)."""
    path = _adapter(tmp_path / "a", os.urandom(4096))
    adapters = Adapters(60.0)
    try:
        old = _fp(path)
        _wait(lambda: (adapters.poll(), adapters.get("mine", path))[1] == old, "first look")
        adapters.get("mine", path)  # queues a look that finds the same files
        _wait(lambda: adapters.fs.pending == 0, "the look did not end")  # ended, not yet polled
        _adapter(path, os.urandom(8192))  # re-saved (another size) before the next step's poll
        assert adapters.get("mine", path) in (old, None)  # (the look that sees it is queued now)
        _wait(lambda: adapters.fs.pending == 0, "the look did not end")
        # ended and applied by this ask, but the step's poll has not named the change yet: that poll
        # retires the path's requests (roots.py), so none may get the new fingerprint before it
        assert adapters.get("mine", path) is None, "the new fingerprint was handed out before the poll"
        assert adapters.poll() == {path}, "no look saw the re-saved files"
        assert adapters.get("mine", path) == _fp(path) != old
    finally:
        adapters.close()


def test_an_adapter_changed_while_hashed_is_hashed_again(tmp_path, monkeypatch):
    """Files re-saved during the hash itself: the fingerprint of a mix of two versions is never
    served; the next look hashes the files as they are."""
    path = _adapter(tmp_path / "a", os.urandom(4096))
    digest, saves = fingerprint.adapter_fingerprint, []

    def resaved_meanwhile(files):
        got = digest(files)
        if not saves:
            saves.append(_adapter(path, os.urandom(8192)))  # another size: another signature
        return got

    monkeypatch.setattr(fingerprint, "adapter_fingerprint", resaved_meanwhile)
    adapters = Adapters(2.0, thread=False)
    assert adapters.get("mine", path) is None, "the mixed version's fingerprint was served"
    assert adapters.get("mine", path) == _fp(path)


def test_thousands_of_adapters_are_hashed_once_each(tmp_path, monkeypatch):
    n = 5000
    paths = [_adapter(tmp_path / f"a{i}", i.to_bytes(4, "little") * 64) for i in range(n)]
    calls = []
    digest = fingerprint.adapter_fingerprint
    monkeypatch.setattr(fingerprint, "adapter_fingerprint", lambda files: calls.append(1) or digest(files))
    adapters = Adapters(2.0, thread=False)
    first = [adapters.get(f"n{i}", p) for i, p in enumerate(paths)]
    assert None not in first and len(set(first)) == n
    again = [adapters.get(f"n{i}", p) for i, p in enumerate(paths)]  # every one asked for again
    assert again == first
    assert len(calls) == n, f"{len(calls)} hashes for {n} adapters asked for twice each"


def test_fingerprints_are_bounded_and_the_least_recently_asked_go_first(tmp_path, monkeypatch):
    """Past MAX_ADAPTERS the least recently asked for is forgotten (looked at again when asked
    for: one more hash); an adapter asked for often stays. A few hundred bytes each."""
    import tracemalloc

    monkeypatch.setattr(adapters_mod, "MAX_ADAPTERS", 100)
    paths = [_adapter(tmp_path / f"a{i}", os.urandom(64)) for i in range(300)]
    calls = []
    digest = fingerprint.adapter_fingerprint
    monkeypatch.setattr(fingerprint, "adapter_fingerprint", lambda files: calls.append(1) or digest(files))
    adapters = Adapters(2.0, thread=False)
    hot = adapters.get("hot", paths[0])
    for p in paths[1:]:
        adapters.get("x", p)
        assert adapters.get("hot", paths[0]) == hot
    assert len(adapters) == 100
    assert len(calls) == 300, "the adapter asked for all along was forgotten"
    adapters.get("x", paths[1])  # forgotten long ago: hashed again
    assert len(calls) == 301

    monkeypatch.setattr(adapters_mod, "MAX_ADAPTERS", 65536)
    paths = [_adapter(tmp_path / "many" / f"{i:06d}", os.urandom(64)) for i in range(3000)]
    many = Adapters(2.0, thread=False)
    many.get("x", paths[0])  # (its I/O thread's objects made)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for p in paths[1:]:
        many.get("x", p)
    per = (tracemalloc.get_traced_memory()[0] - before) / (len(paths) - 1)
    tracemalloc.stop()
    assert len(many) == 3000
    assert per < 600, f"{per:.0f} bytes an adapter"


# ---- the connector's side (scheduler_role.py, roots.py): vLLM's own Request and SchedulerOutput
# records, over a real Store; the adapter's first hash held on a tests/stallfs.py mount ----
BS = 4


def _role(tmp_path, hybrid: bool):
    from types import SimpleNamespace

    from aiokv.connector.scheduler_role import SchedulerRole
    from aiokv.scheduler.layout import FULL, WINDOW, GroupSpec
    from aiokv.scheduler.side import SchedulerSide
    from aiokv.store import Store

    store = Store(str(tmp_path / "c"), capacity="1GiB")  # (room for both namespaces' space grown ahead)
    nsids = [bytes([5]) * 16, bytes([6]) * 16][: 1 + hybrid]
    names = SimpleNamespace(fields={}, groups=[], group_nsids=nsids, nsid=nsids[0], block_size=BS)
    role = SchedulerRole(SimpleNamespace(fs_timeout=60.0), names, 1, False, True, "kv_both")
    kinds = [GroupSpec(0, FULL, 4096, ()), GroupSpec(1, WINDOW, 4096, (), window=8)]
    role.sched = SchedulerSide(store, [(k, store.namespace(n, 4096)) for k, n in zip(kinds, nsids)], BS)
    return role


def _step(role, groups: int, new=(), cached=()) -> dict:
    """One step's SchedulerOutput: new = [(req, block ids, computed, scheduled)], cached = [(req,
    new block ids or None, computed, scheduled)] (the same ids in every group); {req: [(group,
    key, block)]} its plan saves."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    for r, ids, computed, n in new:
        so.scheduled_new_reqs.append(NewRequestData(r, None, [], None, None, (list(ids),) * groups, computed, None))
        so.num_scheduled_tokens[r] = n
    c = CachedRequestData.make_empty()
    for r, ids, computed, n in cached:
        c.req_ids.append(r)
        c.new_block_ids.append(None if ids is None else (list(ids),) * groups)
        c.num_computed_tokens.append(computed)
        c.num_output_tokens.append(1)
        so.num_scheduled_tokens[r] = n
    so.scheduled_cached_reqs = c
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    out: dict = {}
    for t in role.build_connector_meta(so).plan.saves:
        out.setdefault(t.req_id, []).extend((t.group, k, b) for k, b in zip(t.keys, t.block_ids))
    return out


@pytest.mark.parametrize("hybrid", [False, True], ids=["full_attention", "with_a_window_group"])
def test_a_request_allocated_before_its_adapter_was_fingerprinted_saves_once_it_is(tmp_path, hybrid):
    """Its root comes at the first step after the fingerprint is known, and it saves nothing
    before: then every block this life computed so far (only full-attention groups: vLLM frees
    none of them while it runs; never a block vLLM's own prefix cache gave it), or with a
    sliding-window group the blocks it completes from then on."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from aiokv.scheduler.keys import extend_keys, request_root
    from tests.stallfs import mounted

    groups = 1 + hybrid
    control = str(tmp_path / "stall")
    _adapter(tmp_path / "src" / "ad", os.urandom(4096))
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        path = str(tmp_path / "mnt" / "ad")
        role = _role(tmp_path, hybrid)
        try:
            with open(control, "w") as f:
                f.write("t")  # the first look's hash is held
            req = Request(
                "L", list(range(3, 13)), SamplingParams(max_tokens=8), None, lora_request=LoRARequest("ad", 1, path)
            )
            assert role.get_num_new_matched_tokens(req, 0) == (0, False)
            blocks = KVCacheBlocks(tuple([KVCacheBlock(i) for i in (1, 2, 3)] for _ in range(groups)))
            role.update_state_after_alloc(req, blocks, 0)
            assert role.counters()["lora_fingerprint_misses"] == 1
            _wait(lambda: os.path.exists(control + ".held"), "the first look never read the weights")
            # vLLM's own prefix cache gave it block 0 (id 1): this life computes tokens 4..9
            assert _step(role, groups, new=[("L", [1, 2, 3], 4, 6)]) == {}, "saved with no root"
            req.append_output_token_ids(50)
            assert _step(role, groups, cached=[("L", None, 10, 1)]) == {}
            os.unlink(control)
            _wait(lambda: role.adapters.fs.pending == 0, "the look never ended")
            req.append_output_token_ids(51)  # token 12: block 2 (id 3) full in this step
            got = _step(role, groups, cached=[("L", None, 11, 1)])
            root = request_root(role.nsid, [["lora", "ad", path, _fp(str(tmp_path / "src" / "ad"))]])
            if not hybrid:
                keys = extend_keys(
                    [], root, req.all_token_ids, BS, 3
                )  # blocks 1 and 2: this life's, not vLLM's block 0
                assert got == {"L": [(0, k, b) for k, b in zip(keys[1:], [2, 3])]}, got
                return
            assert got == {}, "a block computed before its root, with a window group: not saved"
            for t in (52, 53, 54, 55):
                req.append_output_token_ids(t)
                got = _step(role, groups, cached=[("L", [4] if t == 52 else None, t - 40, 1)])
            keys = extend_keys([], root, req.all_token_ids, BS, 4)
            assert got == {"L": [(0, keys[3], 4), (1, keys[3], 4)]}, got  # block 3: full after the root came
        finally:
            role.shutdown()
