# SPDX-License-Identifier: Apache-2.0
"""A block written without the engine's secret is a miss, locally and from the bucket.

Bug guarded against: whoever can write a shared cache directory or bucket can
plant KV blocks (every checksum in the slot header is public arithmetic: a
CRC32C anyone can recompute), and so steer other engines' outputs.
Invariant: with a secret (setting `secret` or AIOKV_SECRET) every stamped
block carries a keyed BLAKE3 MAC of its payload and header fields; a reader
with the secret accepts a block only with the right MAC: a block stamped with
another secret, with none, or forged (payload changed, CRC recomputed) is a
miss. Without a secret nothing changes (and a forged block with a right CRC
verifies: the threat model docs/sharing.md states).
Fix: the native MAC in the slot stamp and check (format.mac_key) through BlockIO.stamp/verify with `secret`; the bucket
loader verifies through the same BlockIO.verify.
"""

from __future__ import annotations

import ctypes

import pytest

from aiokv import _native
from aiokv.bucket.client import BucketClient
from aiokv.bucket.loader import BAD, OK, BucketLoader
from aiokv.bucket.naming import object_name
from aiokv.config import AioKVConfig, ConfigError
from aiokv.data import format as fmt
from aiokv.data.blockio import BlockIO
from aiokv.data.choice import open_backend
from aiokv.store import Store
from aiokv.store.store import ns_dir
from tests.conftest import NS, PAYLOAD, key

A, B = "secret-A-0123456789", "secret-B-0123456789"
SB = fmt.slot_bytes(PAYLOAD)


def _ios(tmp_path):
    import asyncio

    st = Store(tmp_path / "s", capacity="1GiB")
    st.namespace(NS, PAYLOAD, fields={"model": "t"})
    backend = open_backend(asyncio.get_running_loop(), "threads")
    d = ns_dir(str(tmp_path / "s"), NS)
    return st, {name: BlockIO(backend, d, NS, 0, PAYLOAD, secret=s) for name, s in (("a", A), ("b", B), ("none", None))}


def _forge(blocks, i: int) -> None:
    """What a writer without the secret can do: change the payload, fix the CRCs."""
    addr = blocks.addr(i)
    ctypes.memset(addr + fmt.HEADER_BYTES, 0x41, 64)
    h = fmt.unpack_header(ctypes.string_at(addr, fmt.HDR_USED))
    crc = _native.crc32c(addr + fmt.HEADER_BYTES, PAYLOAD)
    hdr = fmt.pack_header(NS, 0, h["key"], PAYLOAD, crc, h["seq"], h["layout"])
    ctypes.memmove(addr, hdr, len(hdr))


async def test_secret_macs_every_block(tmp_path, blocks):
    st, io = _ios(tmp_path)
    blocks.fill(0, key(0))
    io["a"].stamp(key(0), blocks.addr(0))
    assert io["a"].verify(key(0), blocks.addr(0))
    assert not io["b"].verify(key(0), blocks.addr(0))  # another secret
    assert io["none"].verify(key(0), blocks.addr(0))  # no secret: the MAC is not read
    blocks.fill(1, key(1))
    io["none"].stamp(key(1), blocks.addr(1))
    assert not io["a"].verify(key(1), blocks.addr(1))  # no MAC at all
    blocks.fill(2, key(2))
    io["a"].stamp(key(2), blocks.addr(2))
    _forge(blocks, 2)
    assert not io["a"].verify(key(2), blocks.addr(2))  # forged: CRCs right, MAC wrong
    assert io["none"].verify(key(2), blocks.addr(2))  # the threat without a secret

    # through the data file too: a slot written with A reads back only with A
    for i in range(3):
        blocks.fill(i, key(i))
    assert await io["a"].write([(0, key(0), blocks.addr(0))]) == [0]
    assert await io["a"].read([(0, key(0), blocks.addr(5))]) == [0]
    assert await io["b"].read([(0, key(0), blocks.addr(5))]) == [-74]  # EBADMSG
    st.close()


async def test_wrong_secret_from_the_bucket_is_a_miss(tmp_path, blocks, s3env):
    st, io = _ios(tmp_path)
    client = BucketClient(s3env.url("secret"), timeout=5)
    for i, writer in ((0, "a"), (1, "b"), (2, "none")):
        blocks.fill(i, key(i))
        io[writer].stamp(key(i), blocks.addr(i))
        assert await client.put_once(object_name(client.prefix, NS, 0, key(i)), ctypes.string_at(blocks.addr(i), SB))
    loader = BucketLoader(client, NS, 0, SB)
    assert await loader.fetch(key(0), blocks.addr(10), io["a"].verify) == OK
    assert blocks.holds(10, key(0))
    assert await loader.fetch(key(1), blocks.addr(10), io["a"].verify) == BAD
    assert await loader.fetch(key(2), blocks.addr(10), io["a"].verify) == BAD
    st.close()


def test_secret_setting(monkeypatch):
    monkeypatch.delenv("AIOKV_SECRET", raising=False)
    assert AioKVConfig.from_extra({"path": "/tmp/x"}).secret is None
    assert AioKVConfig.from_extra({"path": "/tmp/x", "secret": A}).secret == A
    assert A not in repr(AioKVConfig.from_extra({"path": "/tmp/x", "secret": A}))
    monkeypatch.setenv("AIOKV_SECRET", B)
    assert AioKVConfig.from_extra({"path": "/tmp/x"}).secret == B
    with pytest.raises(ConfigError, match="at least 16"):
        AioKVConfig.from_extra({"path": "/tmp/x", "secret": "short"})
    with pytest.raises(ConfigError, match="s3://BUCKET/PREFIX"):
        AioKVConfig.from_extra({"path": "/tmp/x", "bucket": "bucket/prefix"})
    cfg = AioKVConfig.from_extra(
        {"path": "/tmp/x", "bucket": "s3://my-bucket/kv", "bucket_timeout": 2, "upload_queue": "64MiB"}
    )  # B from AIOKV_SECRET
    assert (cfg.bucket, cfg.bucket_timeout, cfg.upload_queue) == ("s3://my-bucket/kv", 2.0, 64 << 20)


def test_a_bucket_without_a_secret_is_refused_unless_asked_for(monkeypatch, caplog):
    """Without a secret, anyone who can write the bucket plants KV that verifies: refused
    at start in one line naming both fixes; bucket_unsigned: true accepts it, said once."""
    import logging

    from aiokv import config

    pytest.importorskip("obstore")
    monkeypatch.delenv("AIOKV_SECRET", raising=False)
    monkeypatch.setattr(config, "_said", set())  # a new process
    url = "s3://my-bucket/kv"
    with pytest.raises(ConfigError) as e:
        AioKVConfig.from_extra({"path": "/tmp/x", "bucket": url})
    line = str(e.value)
    assert "\n" not in line and "secret" in line and "bucket_unsigned: true" in line, line
    with pytest.raises(ConfigError, match="bucket_unsigned must be true or false"):
        AioKVConfig.from_extra({"path": "/tmp/x", "bucket": url, "bucket_unsigned": "yes"})
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        for _ in range(3):
            cfg = AioKVConfig.from_extra({"path": "/tmp/x", "bucket": url, "bucket_unsigned": True})
            assert cfg.bucket == url and cfg.secret is None
        assert AioKVConfig.from_extra({"path": "/tmp/x", "bucket": url, "secret": A}).secret == A
        assert AioKVConfig.from_extra({"path": "/tmp/x", "bucket_unsigned": True}).bucket is None  # no bucket: no line
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no MAC (bucket_unsigned)" in said[0], said
