# SPDX-License-Identifier: Apache-2.0
"""Where a block lives in the bucket.

An object holds one slot exactly as on local disk (header, then the payload
padded to 4096 bytes), so a block from the bucket verifies with the same check as a
local one (aiokv/data/format.py). Its name carries what the header carries,
so two engines derive the same name for the same block without asking anyone:

    PREFIX/<namespace id hex>/r<rank>/<block key hex>

Threading contract: pure functions, any thread.
"""

from __future__ import annotations

import re

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def parse_url(url) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of "s3://BUCKET/PREFIX"; raises ValueError."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"aiokv: bucket must look like s3://BUCKET/PREFIX, got {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(
            f"aiokv: bucket: {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, dots or hyphens)"
        )
    return bucket, prefix.strip("/")


def object_name(prefix: str, nsid: bytes, rank: int, key: bytes) -> str:
    return f"{prefix + '/' if prefix else ''}{nsid.hex()}/r{rank}/{key.hex()}"


def key_of(name: str) -> bytes:
    """The block key an object name carries (its last component)."""
    return bytes.fromhex(name.rsplit("/", 1)[-1])
