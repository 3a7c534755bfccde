# SPDX-License-Identifier: Apache-2.0
"""The bucket tier's setting is `bucket`; `shared`, its old name, still works;
so does `remote_timeout`, the old name of `bucket_timeout`.

Bug guarded against: renaming the setting would break every deployment that
still says `shared` (aiokv refuses unknown settings), or, if both names were
read, let two of them disagree.
Invariant: `shared` sets the same setting as `bucket` (and `remote_timeout`
the same as `bucket_timeout`), says so in one warning per process (not one per
engine start or worker), and giving both is refused with one line.
Fix: aiokv/config.py (AioKVConfig.from_extra).
"""

from __future__ import annotations

import logging

import pytest

from aiokv import config
from aiokv.config import AioKVConfig, ConfigError

URL = "s3://my-bucket/kv"
SECRET = "fleet-secret-0123456789"


def test_the_old_name_sets_the_bucket_and_says_so_once(monkeypatch, caplog):
    pytest.importorskip("obstore")
    monkeypatch.setattr(config, "_said", set())  # a new process
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        assert AioKVConfig.from_extra({"path": "/tmp/x", "bucket": URL, "secret": SECRET}).bucket == URL
        assert not caplog.records
        for _ in range(3):
            assert AioKVConfig.from_extra({"path": "/tmp/x", "shared": URL, "secret": SECRET}).bucket == URL
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'shared' is now called 'bucket'" in said[0], said
    assert AioKVConfig.from_extra({"path": "/tmp/x"}).bucket is None
    with pytest.raises(ConfigError, match="give bucket only"):
        AioKVConfig.from_extra({"path": "/tmp/x", "bucket": URL, "shared": URL})
    with pytest.raises(ConfigError, match="s3://BUCKET/PREFIX"):
        AioKVConfig.from_extra({"path": "/tmp/x", "shared": "bucket/prefix"})


def test_the_old_timeout_name_sets_bucket_timeout_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(config, "_said", set())  # a new process
    with caplog.at_level(logging.WARNING, logger="aiokv"):
        assert AioKVConfig.from_extra({"path": "/tmp/x", "bucket_timeout": 3}).bucket_timeout == 3.0
        assert not caplog.records
        for _ in range(3):
            assert AioKVConfig.from_extra({"path": "/tmp/x", "remote_timeout": 2}).bucket_timeout == 2.0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'remote_timeout' is now called 'bucket_timeout'" in said[0], said
    assert AioKVConfig.from_extra({"path": "/tmp/x"}).bucket_timeout == 5.0
    with pytest.raises(ConfigError, match="give bucket_timeout only"):
        AioKVConfig.from_extra({"path": "/tmp/x", "bucket_timeout": 1, "remote_timeout": 1})
    with pytest.raises(ConfigError, match="bucket_timeout must be positive"):
        AioKVConfig.from_extra({"path": "/tmp/x", "remote_timeout": 0})
