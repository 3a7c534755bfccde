# SPDX-License-Identifier: Apache-2.0
"""A `secret` where the MAC's hash (the blake3 package) is missing is refused in one line,
by the code that uses the secret; the settings themselves import nothing of aiokv.

Bug: issue 42. config.py, the base every layer reads, imported aiokv/data/mac.py (and
aiokv/bucket/naming.py) to check the secret and the bucket URL: the settings reached up
into the layers that read them.
Invariant: aiokv/config.py imports nothing of aiokv (it checks the s3:// URL's syntax
itself); AioKVConfig.from_extra reads a secret without asking for blake3; mac.require_mac
refuses that secret without blake3 with mac.MISSING (one line naming the fix) and lets it
pass with blake3, or without a secret.
Fix: parse_bucket_url moved into config.py (bucket/client.py reads it there); the blake3
check moved to aiokv/data/mac.py's require_mac, which the connector calls at start.
"""

from __future__ import annotations

import ast
import os
import sys

import pytest

from aiokv.config import AioKVConfig, ConfigError, parse_bucket_url
from aiokv.data import mac

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "aiokv", "config.py")
SECRET = "fleet-secret-0123456789"


def test_the_settings_import_nothing_of_aiokv():
    with open(CONFIG) as f:
        tree = ast.parse(f.read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "aiokv"], names


def test_bucket_urls_are_checked_by_the_settings():
    assert parse_bucket_url("s3://my-bucket/a/b/") == ("my-bucket", "a/b")
    for bad in ("my-bucket/x", "s3://B/x", None):
        with pytest.raises(ConfigError, match="s3://BUCKET/PREFIX|bucket name"):
            parse_bucket_url(bad)


@pytest.fixture
def no_blake3(monkeypatch):
    monkeypatch.setitem(sys.modules, "blake3", None)  # `import blake3` raises ImportError
    monkeypatch.setattr(mac, "_hasher", None)


def test_a_secret_without_blake3_is_refused_where_it_is_used(no_blake3):
    cfg = AioKVConfig.from_extra({"path": "/tmp/x", "secret": SECRET})  # the settings do not ask
    assert cfg.secret == SECRET
    with pytest.raises(ConfigError) as e:
        mac.require_mac(cfg.secret)
    assert str(e.value) == mac.MISSING and "\n" not in str(e.value) and "pip install blake3" in str(e.value)
    mac.require_mac(None)  # no secret: nothing to refuse


def test_a_secret_with_blake3_passes():
    pytest.importorskip("blake3")
    mac.require_mac(SECRET)


def test_the_connector_refuses_such_a_secret_at_start(no_blake3, tiny_model, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from aiokv.connector.connector import AioKVConnector
    from tests.test_gpu_call_order_keeps_blocks_and_completions import _config

    vc, kcc = _config(tiny_model, str(tmp_path / "c"), False, False)
    vc.kv_transfer_config.kv_connector_extra_config["secret"] = SECRET
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError) as e:
            AioKVConnector(vc, role, kcc)
        assert str(e.value) == mac.MISSING
    assert not os.path.exists(tmp_path / "c" / "index")  # refused before the cache was opened
