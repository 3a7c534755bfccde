# SPDX-License-Identifier: Apache-2.0
"""A LoRA adapter re-saved in place while an engine serves it: no request gets the old
adapter's KV or saves under its keys while the new files are hashed; a request that arrived
before its adapter was fingerprinted saves once it is (issue 40, item 9; real vLLM on the CPU).

Bug: the connector keyed a request by the fingerprint of the adapter's files as the last
finished look found them. After the adapter was re-saved at its path and vLLM loaded it again
(`load_inplace`), the look that saw the new files hashed them for seconds (up to 2 GiB), and
meanwhile requests hit blocks computed with the old adapter and saved the new adapter's KV
under the old adapter's keys, for other engines to load. And a request whose adapter had no
fingerprint when it arrived (the first of each adapter in a life; beyond 1,024 adapters, any)
got no key root for its whole life: a miss that never saved.
Invariant: from the look that sees the changed files until their new fingerprint is known, the
adapter's requests are misses that save nothing, and requests still running with the old
fingerprint save no more (checked in the directory: no block of theirs under the old keys); a
request that arrived before its adapter's fingerprint was known gets it at a later step and saves
its blocks then (hit by the next request). Tokens equal a run without aiokv in every phase.
The hash is held inside a read of the new weights by tests/stallfs.py (mode "t"); the engine
steps on only once the file saying so exists, and the stall ends at a step the test names
(tests/vllm_run.py: hold_at_step, unstall_at_step): nothing races the machine's speed.
Fix: adapters.py (a look that sees other files marks the adapter changing before it hashes),
roots.py (waiting requests get their root at a later step; requests keyed by the old files are
retired: SchedulerSide.retire).
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm

W = prompts(1, 200, seed=401)[0]  # arrives before its adapter is fingerprinted
X = prompts(2, 200, seed=402)  # stored with the old adapter, asked again with the new one
Y = prompts(2, 200, seed=403)  # first asked while the new adapter is hashed
R = prompts(1, 200, seed=404)[0]  # running when the look sees the new files
FULL = 200 // 32  # blocks of a 200-token prompt
SPEC = {"lora": {"max_lora_rank": 8, "max_loras": 2}, "prefix_caching": False}  # (vLLM keys its own by name)
HUNG_BOUND = 240  # seconds: the held read ends then, whatever happens


def _phases(path: str, new: str, control: str | None) -> list[dict]:
    """The life's phases; control None: the run without aiokv (the same adapters, no stall)."""
    a = ["ad", 1, path]
    held = control and control + ".held"
    stall = {"stall": control, "stall_mode": "t"} if control else {}
    return [
        dict(prompts=[W], loras=[a], max_tokens=16, add_lora=[a], **stall, unstall_at_step=[3, control])
        if control
        else dict(prompts=[W], loras=[a], max_tokens=16, add_lora=[a]),
        dict(prompts=[W, *X], loras=[a] * 3, settle=True),
        dict(
            prompts=[R],
            loras=[a],
            max_tokens=40,
            settle=True,
            resave=[[new, path]],
            add_lora=[[*a, True]],  # vLLM loads the new files over the old ones
            **stall,
            **({"stall_keep": True, "hold_at_step": [1, held]} if control else {}),
        ),
        dict(prompts=X + Y, loras=[a] * 4),  # the new files are being hashed all along
        dict(prompts=X + Y, loras=[a] * 4, **({"unstall_at_step": [0, control]} if control else {})),
        dict(prompts=X + Y, loras=[a] * 4, settle=True),
    ]


def _stored(cache: str, path: str, fp: str, ps: list[list[int]], blocks: int) -> list[list[bool]]:
    """Per prompt, whether each of its first blocks is in the directory under the adapter's keys."""
    from aiokv.cli.inspect import open_readonly
    from aiokv.scheduler.keys import extend_keys, request_root

    st = open_readonly(cache)
    try:
        (ns,) = st.index.namespaces.values()
        root = request_root(ns.nsid, [["lora", "ad", path, fp]])
        return [[ns.has(k) for k in extend_keys([], root, p, 32, blocks)] for p in ps]
    finally:
        st.close()


def test_a_resaved_adapter_is_never_served_or_saved_under_its_old_keys(tiny_model, tmp_path):
    from aiokv.connector import fingerprint
    from aiokv.demo.tiny_model import build_lora
    from tests.stallfs import mounted

    old = build_lora(str(tmp_path / "old"), tiny_model, seed=1)
    new = build_lora(str(tmp_path / "new"), tiny_model, seed=2)
    fp_old, fp_new = (fingerprint.adapter_fingerprint(fingerprint.adapter_files(d)[0]) for d in (old, new))
    plain = shutil.copytree(old, str(tmp_path / "plain" / "ad"))
    base = run(dict(SPEC, model=tiny_model, phases=_phases(plain, new, None)))
    assert base["tokens"][1][1:] != base["tokens"][3][:2], "the new adapter must change the tokens"

    control = str(tmp_path / "stall")
    shutil.copytree(old, str(tmp_path / "src" / "ad"))
    cache = str(tmp_path / "c")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        path = str(tmp_path / "mnt" / "ad")
        release = threading.Timer(HUNG_BOUND, lambda: os.path.exists(control) and os.unlink(control))
        release.start()
        try:
            res = run(
                dict(SPEC, model=tiny_model, cache=cache, extra={"fs_timeout": 2}, phases=_phases(path, new, control))
            )
        finally:
            release.cancel()

    # W saved once its adapter was fingerprinted (P0) and was hit (P1); X and Y were misses while
    # the new files were hashed (P3), saved under the new keys (P4: the look that ended as its
    # first step began is applied when they ask, so they are no misses) and hit (P5)
    happened(res, base, hit_blocks=FULL + 4 * FULL, lora_fingerprint_misses=1 + 4)
    old_keys = _stored(cache, path, fp_old, [W, *X, *Y, R + res["tokens"][2][0]], FULL + 1)  # (R: and its reply)
    assert old_keys[0][:FULL] == [True] * FULL, f"W was not saved once its adapter was fingerprinted: {old_keys[0]}"
    assert old_keys[1][:FULL] == old_keys[2][:FULL] == [True] * FULL, old_keys[1:3]
    assert not any(old_keys[3] + old_keys[4]), f"new-adapter KV saved under the old keys: {old_keys[3:5]}"
    assert not old_keys[5][FULL], "a request keyed by the old files saved a block after they changed"
    new_keys = _stored(cache, path, fp_new, [*X, *Y], FULL)
    assert all(all(k) for k in new_keys), new_keys
