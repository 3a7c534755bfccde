# SPDX-License-Identifier: Apache-2.0
"""Bug: aiokv's scheduler side called the file system on vLLM's own thread while
serving (journal appends and fdatasync, `listdir`/`fstat` following other
engines' journals, `fstatvfs`, `fallocate`, `ftruncate`): on a mount that stops
answering, one such call stops the whole engine.

Invariant (real vLLM, CPU, one process: its main thread is both the scheduler's
and the worker's): from the end of vLLM's start until the requests are done,
saving, committing, hitting and loading blocks, aiokv makes no file-system call
on that thread. Checked by wrapping every `os` file-system function, `open` and
aiokv's native fallocate in the engine process and recording calls made on the
main thread from aiokv's modules (tests/vllm_run.py, audit_fs).

Fix: the store's file-system calls run on its I/O thread (aiokv/store/fsthread.py).
"""

from __future__ import annotations

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm

PS = prompts(4, 230, seed=91)
FULL = 229 // 32


def test_serving_makes_no_file_system_call_on_vllms_thread(tiny_model, tmp_path):
    base = run(dict(model=tiny_model, phases=[dict(prompts=PS)]))
    cache = str(tmp_path / "c")
    cold = run(dict(model=tiny_model, cache=cache, audit_fs=True, phases=[dict(prompts=PS)]))
    warm = run(dict(model=tiny_model, cache=cache, audit_fs=True, phases=[dict(prompts=PS)]))
    happened(cold, base, saves_committed=f">={4 * FULL}")
    happened(warm, base, hit_blocks=4 * FULL, loads_ok_blocks=4 * FULL)
    # saving and committing (cold), looking up, pinning and loading (warm), following, syncing
    assert cold["fs_calls_on_engine_thread"] == [], "aiokv called the file system on vLLM's thread"
    assert warm["fs_calls_on_engine_thread"] == [], "aiokv called the file system on vLLM's thread"
