# SPDX-License-Identifier: Apache-2.0
"""Where a block lives in the bucket.

An object holds one slot exactly as on local disk (header, then the payload
padded to 4096 bytes), so a block from the bucket verifies with the same check as a
local one (aiokv/data/format/slot.py). Its name carries what the header carries,
so two engines derive the same name for the same block without asking anyone:

    PREFIX/<namespace id hex>/r<rank>/<block key hex>

The URL's syntax (s3://BUCKET/PREFIX) is the settings' (aiokv/config.py, parse_bucket_url).

Threading contract: pure functions, any thread.
"""

from __future__ import annotations


def object_name(prefix: str, nsid: bytes, rank: int, key: bytes) -> str:
    return f"{prefix + '/' if prefix else ''}{nsid.hex()}/r{rank}/{key.hex()}"


def key_of(name: str) -> bytes:
    """The block key an object name carries (its last component)."""
    return bytes.fromhex(name.rsplit("/", 1)[-1])
