# SPDX-License-Identifier: Apache-2.0
"""A LoRA adapter's blocks are keyed by its files, not by its name and path.

Bug: the keys of a request with a LoRA adapter covered the adapter's name and
path only (namespace.request_extras), so an adapter re-trained and saved at the
same path (or another adapter put there under the same name) was served the KV
of the old one, after a restart too.
Invariant: the request root binds a fingerprint of the adapter's files (as the
base weights' are bound into the namespace): other files at the same path give
other keys (from the first look at the files after they changed); the same files
the same keys; the fingerprint is computed once per version of the files, not per
request; an adapter whose files cannot be read is never given the keys of another
process's life.
Fix: namespace.request_extras, adapters.Adapters and fingerprint.adapter_files /
adapter_fingerprint. (The looks run on an I/O thread of their own in the engine,
tests/test_no_file_system_calls_on_vllm_threads.py; here at once, `thread=False`.)
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from aiokv.connector import fingerprint, namespace  # noqa: E402
from aiokv.connector.adapters import Adapters  # noqa: E402

ADAPTERS = Adapters(2.0, thread=False)  # this process's looks, made at once


def _adapter(d, weights: bytes) -> str:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}')
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return str(d)


def _root(req_id: str, lora: LoRARequest | None, adapters: Adapters = ADAPTERS) -> bytes:
    from aiokv.scheduler.keys import request_root

    r = Request(req_id, [1, 2, 3], SamplingParams(max_tokens=1), None, lora_request=lora)
    return request_root(b"\0" * 16, namespace.request_extras(r, adapters))


def test_adapter_files_decide_the_keys(tmp_path, monkeypatch):
    path = _adapter(tmp_path / "adapter", os.urandom(4096))
    first = _root("a", LoRARequest("mine", 1, path))
    assert first == _root("b", LoRARequest("mine", 1, path)), "same files: same keys"
    assert first != _root("c", None)

    # re-trained, saved at the same path under the same name (same size): other keys
    _adapter(tmp_path / "adapter", os.urandom(4096))
    st = os.stat(os.path.join(path, "adapter_model.safetensors"))
    os.utime(os.path.join(path, "adapter_model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = _root("d", LoRARequest("mine", 2, path))
    assert second != first
    # its config alone changed: other keys too
    with open(os.path.join(path, "adapter_config.json"), "a") as f:
        f.write(" ")
    assert _root("e", LoRARequest("mine", 2, path)) != second


def test_fingerprint_runs_once_per_adapter_version(tmp_path, monkeypatch):
    path = _adapter(tmp_path / "adapter", os.urandom(1 << 16))
    calls = []
    digest = fingerprint._digest
    monkeypatch.setattr(fingerprint, "_digest", lambda files: calls.append(1) or digest(files))
    roots = {_root(f"r{i}", LoRARequest("mine", 1, path)) for i in range(200)}
    assert len(roots) == 1 and len(calls) == 1, len(calls)


def test_unreadable_adapter_is_never_another_lifes(tmp_path):
    missing = str(tmp_path / "nowhere")
    a = _root("a", LoRARequest("ghost", 1, missing))
    assert a == _root("b", LoRARequest("ghost", 1, missing)), "stable within the process"
    assert _root("c", LoRARequest("ghost", 1, missing), Adapters(2.0, thread=False)) != a  # a new process's


def test_a_hung_adapter_mount_never_blocks_the_caller_and_is_said_once(tmp_path, caplog):
    """On the adapters' own I/O thread (as in the engine): while nothing on the adapter's mount
    answers (tests/stallfs.py), `get` returns at once (None: a miss) and queues no second look;
    past the deadline `poll` says so once; once the mount answers, the next poll applies the
    fingerprint, the same as the files' own."""
    import time

    from tests.stallfs import mounted

    control = str(tmp_path / "stall")
    _adapter(tmp_path / "src" / "a", os.urandom(4096))
    want = fingerprint.adapter_fingerprint(fingerprint.adapter_files(str(tmp_path / "src" / "a"))[0])
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        open(control, "w").write("a")
        adapters = Adapters(0.3)
        path = str(tmp_path / "mnt" / "a")
        t = time.monotonic()
        assert [adapters.get("hung", path) for _ in range(100)] == [None] * 100
        assert time.monotonic() - t < 0.5, "get waited for the file system"
        assert adapters.fs.pending == 1, "one look at a time"
        time.sleep(0.6)
        with caplog.at_level("WARNING", logger="aiokv"):
            adapters.poll()
            adapters.poll()
        assert sum("reading a LoRA adapter's files took over" in r.message for r in caplog.records) == 1
        assert adapters.get("hung", path) is None
        os.unlink(control)
        end = time.monotonic() + 10
        while adapters.get("hung", path) is None and time.monotonic() < end:
            adapters.poll()
            time.sleep(0.01)
        assert adapters.get("hung", path) == want
        adapters.close()
