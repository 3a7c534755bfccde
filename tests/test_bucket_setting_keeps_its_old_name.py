"""The bucket tier's setting is `bucket`; `shared`, its old name, still works.

Bug guarded against: renaming the setting would break every deployment that
still says `shared` (aiokv refuses unknown settings), or, if both names were
read, let two of them disagree.
Invariant: `shared` sets the same setting as `bucket`, says so in one warning
per process (not one per engine start or worker), and giving both is refused
with one line.
Fix: aiokv/config.py (AioKVConfig.from_extra).
"""
from __future__ import annotations

import logging

import pytest

from aiokv import config
from aiokv.config import AioKVConfig, ConfigError

URL = "s3://my-bucket/kv"


def test_the_old_name_sets_the_bucket_and_says_so_once(monkeypatch, caplog):
    pytest.importorskip("obstore")
    monkeypatch.setattr(config, "_said_shared", False)  # a new process
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        assert AioKVConfig.from_extra({"path": "/tmp/x", "bucket": URL}).bucket == URL
        assert not caplog.records
        for _ in range(3):
            assert AioKVConfig.from_extra({"path": "/tmp/x", "shared": URL}).bucket == URL
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'shared' is now called 'bucket'" in said[0], said
    assert AioKVConfig.from_extra({"path": "/tmp/x"}).bucket is None
    with pytest.raises(ConfigError, match="give bucket only"):
        AioKVConfig.from_extra({"path": "/tmp/x", "bucket": URL, "shared": URL})
    with pytest.raises(ConfigError, match="s3://BUCKET/PREFIX"):
        AioKVConfig.from_extra({"path": "/tmp/x", "shared": "bucket/prefix"})
