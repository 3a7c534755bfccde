# SPDX-License-Identifier: Apache-2.0
"""The side files: an engine's labels (per namespace), its tenants file and the directory's
control file (the operators' orders), all records in the labels' layout after a file header
(records.py). Part of the on-disk format (aiokv/data/format/, docs/format.md "Labels",
"Tenants", "Orders").

Threading contract: constants and pure functions, any thread.
"""

from __future__ import annotations

import struct

from aiokv import _native
from aiokv.data.format.keys import TENANT_TAG_BYTES
from aiokv.data.format.records import FILE_VERSIONS
from aiokv.data.format.slot import MAX_KEY, MIN_KEY

__all__ = [
    "LABEL_MAGIC",
    "MAX_LABEL",
    "pack_label",
    "iter_labels",
    "TENANTS_MAGIC",
    "TENANTS_VERSION",
    "MAX_TENANT_ID",
    "OVERFLOW_TENANT",
    "MAX_TENANT_NAME",
    "pack_tenant",
    "iter_tenants",
    "CONTROL_MAGIC",
    "MAX_CONTROL",
    "pack_order",
    "iter_orders",
]

# ---- labels: one opaque description per key, kept for the layers above the store ----
# (the connector's KV events: the block's vLLM hashes and tokens, aiokv/connector/events.py).
# A labels file is a file header (LABEL_MAGIC, generation 0) and records appended after it:
# body length, CRC32C of the body, body = key length, key, label. A later record of a key
# replaces an earlier one. Labels describe, they are never trusted for bytes: a block is
# served only by its own key and header checks.
LABEL_MAGIC = b"AIOKVLBL"
_LABEL = struct.Struct("<II")
MAX_LABEL = 1 << 16  # bytes of one record's body; a longer length ends the file (damage)


def pack_label(key: bytes, label: bytes) -> bytes:
    body = bytes([len(key)]) + key + label
    if len(body) > MAX_LABEL:
        raise ValueError(f"aiokv: a label of {len(label)} bytes is longer than {MAX_LABEL}")
    return _LABEL.pack(len(body), _native.crc32c_bytes(body)) + body


def iter_labels(buf: bytes):
    """Yield (key, label) up to the first record that does not verify (a torn or damaged
    tail); returns (StopIteration value) the byte length of the valid prefix."""
    off, end, crc = 0, len(buf), _native.crc32c_bytes
    while off + _LABEL.size <= end:
        n, c = _LABEL.unpack_from(buf, off)
        body = buf[off + _LABEL.size : off + _LABEL.size + n]
        if not 1 <= n <= MAX_LABEL or len(body) < n or crc(body) != c:
            return off
        klen = body[0]
        if not MIN_KEY <= klen <= MAX_KEY or klen + 1 > n:
            return off
        yield bytes(body[1 : 1 + klen]), bytes(body[1 + klen :])
        off += _LABEL.size + n
    return off


# ---- tenants: each engine's table of the tenants its records name (issues 34, 40) ----
# DIR/tenants.<E> (every engine number E, 0 included), written only by the engine holding E:
# a file header (TENANTS_MAGIC, generation 0, version TENANTS_VERSION), then records in the
# labels' layout (pack_label) whose key is a tenant's tag and whose label is its id (2 bytes,
# little-endian: what that engine's COMMIT and checkpoint records carry, 1..MAX_TENANT_ID),
# whether the tag is keyed by a secret (1 byte), then, only for an unkeyed tag, the tenant's
# name (UTF-8, at most MAX_TENANT_NAME bytes; a name with a secret never reaches disk). Id 0 is
# the tenant "" and is never written. An id or a tag given twice keeps its first record (a later
# one is damage). A record is written whole and synced before the first journal record naming
# its id; the owner cuts a torn tail at opening. Version 2 (issue 40): ids are reclaimed once no
# block carries them, and an id (or a tag) given anew replaces the file whole (renamed over):
# a reader reads a file whose inode changed anew, forgetting the ids of the one it replaces.
# Version 1 files read alike (their ids were never given anew). An id a journal names and its
# engine's file does not counts for no tenant (OVERFLOW_TENANT).
TENANTS_MAGIC = b"AIOKVTNT"
TENANTS_VERSION = 2
FILE_VERSIONS[TENANTS_MAGIC] = (1, 2)
MAX_TENANT_ID = 0xFFFE  # ids an engine gives out (tenants holding blocks at once)
OVERFLOW_TENANT = 0xFFFF  # in memory and in records: a block counted for no tenant (never in a file)
MAX_TENANT_NAME = 200  # bytes of a name kept in the file (it is shown, never matched: the tag is)
_TENANT = struct.Struct("<HB")


def pack_tenant(tag: bytes, tid: int, keyed: bool, name: str | None) -> bytes:
    text = b"" if keyed or name is None else name.encode()[:MAX_TENANT_NAME].decode(errors="ignore").encode()
    label = _TENANT.pack(tid, int(keyed)) + text
    return pack_label(tag, label)


def iter_tenants(buf: bytes):
    """Yield (tag, id, keyed, name or None) of a tenants file's body, up to the first record
    that does not verify; returns (StopIteration value) the bytes of the valid prefix."""
    it = iter_labels(buf)
    while True:
        try:
            tag, label = next(it)
        except StopIteration as stop:
            return stop.value
        if len(tag) != TENANT_TAG_BYTES or len(label) < _TENANT.size:
            continue
        tid, keyed = _TENANT.unpack_from(label)
        if not 1 <= tid <= MAX_TENANT_ID:
            continue
        try:
            name = label[_TENANT.size :].decode() if not keyed else None
        except UnicodeDecodeError:
            name = None
        yield tag, tid, bool(keyed), name


# ---- control: the operators' orders to every engine on a directory (issue 34) ----
# DIR/control, written by `aiokv clear`, `aiokv pin` and `aiokv unpin` (under an flock of the
# file itself), read by every engine at each look at the others (every 0.1 s): a file header
# (CONTROL_MAGIC, generation 0), then records in the labels' layout whose key is the order's
# number (8 bytes, little-endian, from 1, each one more than the last) and its time (ns since
# the epoch, 8 bytes), and whose label is the order as JSON (aiokv/store/control.py). Reading
# stops at the first record that does not verify or does not follow its predecessor's number
# (a writer killed mid-append: the next writer cuts it off first).
CONTROL_MAGIC = b"AIOKVCTL"
MAX_CONTROL = 64 << 20  # bytes of orders read at once (a hostile file stays bounded)
_ORDER = struct.Struct("<QQ")


def pack_order(number: int, when: int, body: bytes) -> bytes:
    return pack_label(_ORDER.pack(number, when), body)


def iter_orders(buf: bytes, after: int = 0):
    """Yield (number, time, body) of a control file's records (the body after its header),
    numbered on from `after`; returns (StopIteration value) the bytes of the valid prefix."""
    it, used, want = iter_labels(buf), 0, after + 1
    while True:
        try:
            key, body = next(it)
        except StopIteration:
            return used
        if len(key) != _ORDER.size:
            return used
        number, when = _ORDER.unpack(key)
        if number != want:
            return used
        used += 8 + 1 + len(key) + len(body)
        want += 1
        yield number, when, body
