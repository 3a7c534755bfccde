# SPDX-License-Identifier: Apache-2.0
"""Bug: aiokv's scheduler side called the file system on vLLM's own thread while
serving (journal appends and fdatasync, `listdir`/`fstat` following other
engines' journals, `fstatvfs`, `fallocate`, `ftruncate`): on a mount that stops
answering, one such call stops the whole engine. The same for every request
with a LoRA adapter (issue 37, item 4): its key root binds a fingerprint of the
adapter's files, and finding them, walking and stat-ing them and reading them in
full ran on vLLM's scheduler thread; an adapter on a hung mount stopped scheduling.

Invariant (real vLLM, CPU, one process: its main thread is both the scheduler's
and the worker's): from the end of vLLM's start until the requests are done,
saving, committing, hitting and loading blocks, with and without a LoRA adapter,
aiokv makes no file-system call on that thread. Checked by wrapping every `os`
file-system function, `open` and aiokv's native fallocate in the engine process
and recording calls made on the main thread from aiokv's modules
(tests/vllm_run.py, audit_fs). A request whose adapter is not fingerprinted yet
is a miss and saves nothing; later requests with it save and hit as any other.
An adapter on a mount where nothing answers (tests/stallfs.py), already loaded by
vLLM, leaves its requests misses served at full speed with the tokens of a run
without aiokv.

Fix: the store's file-system calls run on its I/O thread (aiokv/store/fsthread.py);
adapters are fingerprinted on an I/O thread of their own, under fs_timeout
(aiokv/connector/adapters.py), and applied at the connector's next step.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from tests.e2e import happened, part, prompts, run

pytestmark = pytest.mark.vllm

PS = prompts(4, 230, seed=91)
LP = prompts(3, 200, seed=92)  # asked with a LoRA adapter: 6 full blocks each
FULL = 229 // 32
LORA_FULL = 199 // 32
SPEC = {"lora": {"max_lora_rank": 8, "max_loras": 2}}
HUNG_BOUND = 60  # seconds: the hung mount answers again then, whatever happens


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    from aiokv.demo.tiny_model import build_lora

    return build_lora(str(tmp_path_factory.mktemp("lora") / "tiny-lora"), tiny_model)


@pytest.fixture(scope="module")
def base(tiny_model, adapter):
    """The lives' phases without aiokv: PS and LP[0] without an adapter; LP[0] with it; LP[1:] with it."""
    lora = ["tiny-lora", 1, adapter]
    phases = [dict(prompts=PS + LP[:1]), dict(prompts=LP[:1], loras=[lora]), dict(prompts=LP[1:], loras=[lora] * 2)]
    return phases, run(dict(SPEC, model=tiny_model, phases=phases))


def test_serving_makes_no_file_system_call_on_vllms_thread(tiny_model, tmp_path, base):
    phases, b = base
    cache = str(tmp_path / "c")
    cold = run(dict(SPEC, model=tiny_model, cache=cache, audit_fs=True, phases=phases))
    warm = run(dict(SPEC, model=tiny_model, cache=cache, audit_fs=True, phases=phases))
    # saving and committing (cold), looking up, pinning and loading (warm), following, syncing,
    # fingerprinting the adapter (both)
    assert cold["fs_calls_on_engine_thread"] == [], "aiokv called the file system on vLLM's thread"
    assert warm["fs_calls_on_engine_thread"] == [], "aiokv called the file system on vLLM's thread"
    assert b["tokens"][1][0] != b["tokens"][0][4], "the adapter must change the tokens"
    # with the adapter, LP[0] came first: a miss that saved nothing; LP[1:] came after its fingerprint
    stored = 4 * FULL + LORA_FULL + 2 * LORA_FULL
    happened(cold, b, saves_committed=f">={stored}", lora_fingerprint_misses=1)
    happened(warm, b, hit_blocks=stored, loads_ok_blocks=stored, lora_fingerprint_misses=1)
    assert warm["cached"][2] == [LORA_FULL * 32] * 2 and warm["cached"][1] == [0], warm["cached"]


def test_an_adapter_on_a_hung_mount_does_not_stop_scheduling(tiny_model, tmp_path, adapter, base):
    from tests.stallfs import mounted

    phases, b = base
    control = str(tmp_path / "stall")
    shutil.copytree(adapter, str(tmp_path / "src" / "tiny-lora"))
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        hung = ["hung-lora", 2, str(tmp_path / "mnt" / "tiny-lora")]
        # the engine writes the control file once vLLM has the adapter; nothing on the mount answers
        # then, until the phase is over or, at the latest, HUNG_BOUND seconds from now
        release = threading.Timer(HUNG_BOUND, lambda: os.path.exists(control) and os.unlink(control))
        release.start()
        try:
            res = run(
                dict(
                    SPEC,
                    model=tiny_model,
                    cache=str(tmp_path / "c"),
                    extra={"fs_timeout": 1},
                    phases=[dict(prompts=LP[1:], loras=[hung] * 2, add_lora=[hung], stall=control)],
                )
            )
        finally:
            release.cancel()
    assert res["seconds"][0] < HUNG_BOUND / 2, f"the phase took {res['seconds'][0]} s while the adapter's mount hung"
    happened(res, part(b, phases=[2]), lora_fingerprint_misses=2, hit_blocks=0, saves_committed=0)
