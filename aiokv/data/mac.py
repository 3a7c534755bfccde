# SPDX-License-Identifier: Apache-2.0
"""The hash behind the slot MAC (docs/format.md, "The MAC"): keyed BLAKE3 from the blake3 package.

aiokv/data/format/ builds the MAC of a slot from these (scheme 1: keyed BLAKE3-256 of
the payload, then of the header fields the header CRC covers) and stamps and
checks it around the native slot calls; this module only hashes.

blake3 is the Python binding of the BLAKE3 team's Rust crate. One call hashes
on the calling thread (max_threads 1: the parallelism is BlockIO's checksum
threads) and releases the GIL over inputs of a few KiB and more, so a batch of
slots hashed on a checksum thread leaves the loop thread and the other
checksum threads running.

blake3 is imported at the first use of a secret: a tree without it (a bare GPU
machine's copy, tools/gpu_check.py) runs without one, and require_mac refuses the
`secret` setting in one line where it is missing (the connector calls it at start, where
the secret is first used; config.py imports nothing of aiokv).

Threading contract: no state; any thread.
"""

from __future__ import annotations

from aiokv.config import ConfigError

KEY_BYTES = MAC_BYTES = 32
# BLAKE3 derive_key's context for the MAC key: pinned (every engine of a fleet must derive
# the same key from the same secret; a change here loses every MACed block)
CONTEXT = "aiokv slot MAC, scheme 1"
MISSING = "aiokv: secret needs the blake3 package, which is not installed; install it: pip install blake3"


_hasher = None  # blake3.blake3, once imported


def hasher():
    """The blake3 class (blake3.blake3): hasher(data, key=KEY) hashes data keyed."""
    global _hasher
    if _hasher is None:
        try:
            from blake3 import blake3
        except ImportError as e:
            raise ImportError(MISSING) from e
        _hasher = blake3
    return _hasher


def available() -> bool:
    """Whether the blake3 package is there."""
    try:
        hasher()
    except ImportError:
        return False
    return True


def require_mac(secret: str | None) -> None:
    """Refuse a secret whose MAC cannot be made here (no blake3 package): ConfigError, one line
    naming the fix. Nothing without a secret."""
    if secret is not None and not available():  # a tree copied or installed without its dependencies
        raise ConfigError(MISSING)


def derive_key(secret: bytes, context: str = CONTEXT) -> bytes:
    """The 32-byte MAC key of a secret of any length: BLAKE3's derive_key under `context`
    (CONTEXT: the slots'; another context gives an unrelated key, e.g. the bucket's metadata)."""
    return hasher()(secret, derive_key_context=context).digest()


def keyed(key: bytes, *parts) -> bytes:
    """Keyed BLAKE3-256 of the parts (buffers: bytes, flat byte memoryviews), one after the other."""
    if len(key) != KEY_BYTES:
        raise ValueError("aiokv: a MAC key is 32 bytes (format.mac_key)")
    h = hasher()(key=bytes(key))
    for p in parts:
        h.update(p)
    return h.digest()
