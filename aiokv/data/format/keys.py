# SPDX-License-Identifier: Apache-2.0
"""What a secret keys on disk: the slot MAC's key (mac_key; the MAC itself is slot.py's) and the
tags tenants are named by (tenant_key, tenant_tag). Part of the on-disk format
(aiokv/data/format/, docs/format.md "Tenants" and "The MAC").

Threading contract: pure functions, any thread.
"""

from __future__ import annotations

import hashlib

from aiokv.data import mac

__all__ = [
    "TENANT_TAG_BYTES",
    "NO_TENANT",
    "tenant_key",
    "tenant_tag",
    "mac_key",
]

# ---- tenants (issue 34): a request's cache_salt ("" without one), named on disk by a tag ----
# A tenant's tag is 16 bytes: BLAKE2b of its name, keyed (under a `secret`) by a key derived
# from the secret, so the name itself never reaches disk where a secret is set. The tenant ""
# (no cache_salt: every block written before tenants existed) is the tag of 16 zero bytes.
TENANT_TAG_BYTES = 16
NO_TENANT = bytes(TENANT_TAG_BYTES)


def tenant_key(secret: str | bytes | None) -> bytes | None:
    """The key tenant tags are made with under a secret (None: no secret, unkeyed tags)."""
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return hashlib.blake2b(raw, digest_size=32, person=b"aiokv-tenantkey").digest()


def tenant_tag(name: str, key: bytes | None = None) -> bytes:
    """The 16-byte tag of a tenant's name ("" -> NO_TENANT); key: tenant_key(secret) or None."""
    if not name:
        return NO_TENANT
    tag = hashlib.blake2b(name.encode(), digest_size=TENANT_TAG_BYTES, key=key or b"", person=b"aiokv-tenant").digest()
    return tag if tag != NO_TENANT else b"\x01" + tag[1:]


def mac_key(secret: str | bytes) -> bytes:
    """The 32-byte MAC key of a secret of any length (BLAKE3's derive_key under aiokv's context)."""
    return mac.derive_key(secret.encode() if isinstance(secret, str) else bytes(secret))
