# SPDX-License-Identifier: Apache-2.0
"""Batches of slots in staging buffers: stamped before a write (stamp_slots) and verified after
a read (verify_slots), each with the native loop (GIL released) and, under a secret, the MAC
(scheme 1) slot by slot. Part of the on-disk format (aiokv/data/format/, docs/format.md "The
MAC"); the single-slot check is slot.py's.

Threading contract: pure functions over the caller's buffers, any thread (BlockIO calls them
on its loop thread or its checksum threads, one batch each).
"""

from __future__ import annotations

import ctypes
import hmac

from aiokv import _native
from aiokv.data import mac
from aiokv.data.format.keys import NO_TENANT
from aiokv.data.format.slot import (
    _MAC,
    _PAYLOAD_CRC,
    HDR,
    HEADER_BYTES,
    MAC_BYTES,
    MAC_OFFSET,
    MAC_SCHEME,
    MAC_SCHEME_OFFSET,
    TENANT_OFFSET,
    _mac_key_arg,
    tenant_field,
)

__all__ = [
    "stamp_slots",
    "verify_slots",
]


# stamp_slots and verify_slots hash slot after slot in one loop, the hasher made per slot from
# the blake3 class itself: each layer of calls around it cost about a microsecond a slot
# (stamping 512 slots of 4 KiB payloads: 4.8 us a slot so, 7.0 through slot_mac and
# mac.keyed), against about 40 us to hash a 256 KiB payload.
def stamp_slots(
    addrs,
    keys,
    nsid: bytes,
    rank: int,
    payload_len: int,
    layout: int,
    crc_in_copy=False,
    mac_key=None,
    tenant=NO_TENANT,
):
    """Stamp the headers of the slots at addrs (payloads already there): the
    native stamp (the payload CRC32C, unless crc_in_copy: then the one the
    device copy left in the header), the tenant's tag (every slot's: one request's),
    and with a secret's mac_key each slot's MAC (scheme 1). GIL released while the
    native call and the hashing run."""
    mk = _mac_key_arg(mac_key)
    _native.stamp_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy, 0 if mk is None else MAC_SCHEME)
    if tenant and tenant != NO_TENANT:
        field = tenant_field(tenant)
        for a in addrs:
            ctypes.memmove(a + TENANT_OFFSET, field, len(field))
    if mk is None:
        return
    hasher, mem, fields, end = (
        mac.hasher(),
        ctypes.c_char * (HEADER_BYTES + payload_len),
        HDR.size,
        MAC_OFFSET + MAC_BYTES,
    )
    for a in addrs:
        slot = memoryview(mem.from_address(a)).cast("B")
        h = hasher(slot[HEADER_BYTES:], key=mk)
        h.update(slot[:fields])
        slot[MAC_OFFSET:end] = h.digest()


def verify_slots(addrs, keys, nsid: bytes, rank: int, payload_len: int, layout: int, crc_in_copy=False, mac_key=None):
    """The slot check over the staging buffers at addrs, each for its key: bytes,
    a verdict per slot (0: valid). With crc_in_copy the payload CRC is left to
    the caller's device copy (never reported); with a secret's mac_key the MAC
    is checked (crc_in_copy or not), as _mac_verdict says."""
    mk = _mac_key_arg(mac_key)
    got = _native.verify_slots(addrs, keys, nsid, rank, payload_len, layout, crc_in_copy)
    if mk is None:
        return got
    out = bytearray(got)
    hasher, mem, fields, end = (
        mac.hasher(),
        ctypes.c_char * (HEADER_BYTES + payload_len),
        HDR.size,
        MAC_OFFSET + MAC_BYTES,
    )
    for i, a in enumerate(addrs):
        if out[i] not in (0, _PAYLOAD_CRC):
            continue
        slot = memoryview(mem.from_address(a)).cast("B")
        if slot[MAC_SCHEME_OFFSET] != MAC_SCHEME:
            out[i] = _MAC
            continue
        h = hasher(slot[HEADER_BYTES:], key=mk)
        h.update(slot[:fields])
        if not hmac.compare_digest(h.digest(), slot[MAC_OFFSET:end]):
            out[i] = _MAC
    return bytes(out)
