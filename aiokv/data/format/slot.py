# SPDX-License-Identifier: Apache-2.0
"""The slot: a block's bytes on disk and in the bucket, a 4096-byte header then the payload
padded to 4096 bytes (so every slot, offset and length is aligned for O_DIRECT). Its header's
layout (HDR), packing (pack_header), its tenant field, and the one check of a slot or header
(check_slot, check_header, unpack_header: native/slots.c, then the MAC where a secret is set);
a namespace's slot geometry (slot_bytes, check_namespace). Part of the on-disk format
(aiokv/data/format/, docs/format.md "Slots").

The header is verified on every read: magic, version, namespace, rank, key, length, payload
CRC32C and a CRC32C of the header itself. Any mismatch is a miss. The layout tag is a hash of
the reader's in-memory KV layout (tensor shapes, strides, dtype per layer), so blocks written
under one attention backend are a miss, never bytes, under another that the namespace id
failed to tell apart.

Threading contract: constants and pure functions, any thread; the native checks hold the
GIL only for one slot.
"""

from __future__ import annotations

import hmac
import struct

from aiokv import _native
from aiokv.data import mac
from aiokv.data.format.keys import NO_TENANT, TENANT_TAG_BYTES

__all__ = [
    "FILE_VERSION",
    "HEADER_BYTES",
    "ALIGN",
    "MIN_KEY",
    "MAX_KEY",
    "NSID_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MAX_RANKS",
    "BLOCK_MAGIC",
    "HDR",
    "HDR_USED",
    "PAYLOAD_CRC_OFFSET",
    "MAC_SCHEME_OFFSET",
    "MAC_SCHEME",
    "MAC_OFFSET",
    "MAC_BYTES",
    "TENANT_OFFSET",
    "TENANT_END",
    "tenant_field",
    "header_tenant",
    "slot_bytes",
    "check_key",
    "pack_header",
    "BadBlock",
    "SLOT_REASONS",
    "slot_mac",
    "slot_reason",
    "unpack_header",
    "check_header",
    "check_slot",
    "check_namespace",
]

FILE_VERSION = 1
HEADER_BYTES = 4096
ALIGN = 4096
MIN_KEY, MAX_KEY = 16, 32
NSID_BYTES = 16
# Bounds on numbers read from namespace.json (a slot's length must fit the
# 32-bit length of one I/O operation; a rank is one data file).
MAX_PAYLOAD_BYTES = 1 << 30
MAX_RANKS = 1024

# ---- slot header ----
BLOCK_MAGIC = b"AIOKVBLK"
# magic, version, header bytes, rank, nsid, key len, MAC scheme, payload crc, payload len, key, seq, layout tag
HDR = struct.Struct("<8sHHI16sBB2xIQ32sQQ")
_HDR_CRC = struct.Struct("<I")
# where HDR's payload crc sits (little-endian uint32; native/aiokv.h's HDR_OFF_PCRC): a device
# that makes the CRC in its copy writes it there (worker/device.py)
PAYLOAD_CRC_OFFSET = struct.calcsize("<8sHHI16sBB2x")
HDR_USED = HDR.size + _HDR_CRC.size
# With a secret (docs/sharing.md), the header carries a MAC after its CRC: byte
# MAC_SCHEME_OFFSET names the scheme, MAC_BYTES at MAC_OFFSET hold it. Scheme 1
# (MAC_SCHEME): keyed BLAKE3-256 of the payload, then of the header's first
# HDR.size bytes (the scheme byte among them), keyed by mac_key(secret) (mac.py:
# the blake3 package). stamp_slots writes it after the native stamp; check_slot
# and verify_slots check it after the native check. Without a secret the scheme
# is 0 and the MAC bytes zero, not read: blocks with and without a MAC are the
# same format version. A reader with a secret takes only scheme 1 (the BLAKE2b
# MAC of earlier versions, scheme 0, is a miss).
MAC_SCHEME_OFFSET, MAC_SCHEME = 33, 1
MAC_OFFSET, MAC_BYTES = HDR_USED, mac.MAC_BYTES


# Bytes TENANT_OFFSET.. of the header (zero until issue 34, and never read before it): the tag
# of the block's tenant (TENANT_TAG_BYTES), then the CRC32C of those bytes. All zero: the
# tenant "" (old blocks too). Written after the native stamp (stamp_slots); outside the
# header CRC and the MAC, so blocks with and without it are the same version: it describes
# the block (whose tenant's quota, clear and warm-up it belongs to), never its bytes.
TENANT_OFFSET = MAC_OFFSET + MAC_BYTES
TENANT_END = TENANT_OFFSET + TENANT_TAG_BYTES + 4


def tenant_field(tag: bytes) -> bytes:
    """The header's tenant bytes for a tenant tag (zeros for NO_TENANT)."""
    if tag == NO_TENANT:
        return bytes(TENANT_END - TENANT_OFFSET)
    return tag + _HDR_CRC.pack(_native.crc32c_bytes(tag))


def header_tenant(raw) -> bytes | None:
    """The tenant tag a slot header carries (NO_TENANT for none: an old block's too), or None
    if its bytes do not verify (damage: the block's tenant is unknown)."""
    b = bytes(memoryview(raw)[TENANT_OFFSET:TENANT_END])
    if len(b) < TENANT_END - TENANT_OFFSET:
        return None
    tag, crc = b[:TENANT_TAG_BYTES], b[TENANT_TAG_BYTES:]
    if tag == NO_TENANT and crc == bytes(4):
        return NO_TENANT
    return tag if _HDR_CRC.unpack(crc)[0] == _native.crc32c_bytes(tag) and tag != NO_TENANT else None


def slot_bytes(payload_bytes: int) -> int:
    return HEADER_BYTES + (payload_bytes + ALIGN - 1) // ALIGN * ALIGN


def check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or not MIN_KEY <= len(key) <= MAX_KEY:
        raise ValueError(f"aiokv: keys are {MIN_KEY}-{MAX_KEY} bytes, got {len(key)!r}")


def pack_header(
    nsid: bytes,
    rank: int,
    key: bytes,
    payload_len: int,
    payload_crc: int,
    seq: int,
    layout: int = 0,
    mac_scheme: int = 0,
) -> bytes:
    """A slot header's first HDR_USED bytes (what stamp_slots writes; the MAC,
    where mac_scheme says there is one, follows them)."""
    body = HDR.pack(
        BLOCK_MAGIC,
        FILE_VERSION,
        HEADER_BYTES,
        rank,
        nsid,
        len(key),
        mac_scheme,
        payload_crc,
        payload_len,
        key,
        seq,
        layout,
    )
    return body + _HDR_CRC.pack(_native.crc32c_bytes(body))


class BadBlock(Exception):
    """A slot whose header or payload does not verify; reason says which check."""


# The one slot check is native (native/slots.c, slot_verdict), the MAC's
# after it (_mac_verdict): one slot here (check_slot, check_header,
# unpack_header: _native.check_slot), a batch of staging buffers in BlockIO
# (verify_slots below: _native.verify_slots, GIL released). Both answer a
# verdict: 0 (valid) or the first check failed, in the order checked; this is
# the one place a verdict is named (the start of BadBlock's reason). The C side
# (HDR_OFF_*) writes and reads the HDR layout above byte for byte.
SLOT_REASONS = (
    "",
    "header short",
    "header checksum",
    "magic",
    "format version",
    "header names another layout",
    "header names another nsid",
    "header names another rank",
    "header names another key",
    "header names another payload len",
    "payload short",
    "payload checksum",
    "MAC",
)
if len(SLOT_REASONS) != _native.SLOT_VERDICTS:
    raise ImportError("aiokv: aiokv._native was built from another format; rebuild it (pip install -e .)")
_NO_NSID = bytes(NSID_BYTES)
_PAYLOAD_CRC, _MAC = SLOT_REASONS.index("payload checksum"), SLOT_REASONS.index("MAC")


def _mac_key_arg(mac_key) -> bytes | None:
    if mac_key is not None and (not isinstance(mac_key, (bytes, bytearray)) or len(mac_key) != MAC_BYTES):
        raise ValueError("aiokv: a MAC key is 32 bytes (format.mac_key)")
    return mac_key


def slot_mac(slot: memoryview, payload_len: int, mac_key: bytes) -> bytes:
    """The scheme-1 MAC of a slot (a flat byte view of its header and payload)."""
    return mac.keyed(mac_key, slot[HEADER_BYTES : HEADER_BYTES + payload_len], slot[: HDR.size])


def _mac_verdict(verdict: int, slot: memoryview, payload_len: int, mac_key: bytes) -> int:
    """A native verdict with the MAC's: a slot whose header and length passed is
    "MAC" unless it carries scheme 1 and mac_key's MAC, whatever its payload CRC
    said (a forged payload may come with its CRC forged too)."""
    if verdict not in (0, _PAYLOAD_CRC):
        return verdict
    if slot[MAC_SCHEME_OFFSET] != MAC_SCHEME:
        return _MAC
    want = slot_mac(slot, payload_len, mac_key)
    return verdict if hmac.compare_digest(want, slot[MAC_OFFSET : MAC_OFFSET + MAC_BYTES]) else _MAC


def slot_reason(verdict: int, slot) -> str:
    """BadBlock's reason for a verdict of the slot check on `slot` (its buffer)."""
    reason = SLOT_REASONS[verdict]
    if reason == "format version":  # the header is whole (its CRC matched): say which version
        reason += f" {HDR.unpack_from(slot)[1]}"
    return reason


def _checked(slot, upto: int, nsid: bytes, rank: int, payload_len: int, key, layout, mac_key=None) -> dict:
    verdict = _native.check_slot(slot, nsid, rank, payload_len, key, layout, upto)
    if _mac_key_arg(mac_key) is not None and upto == _native.CHECK_SLOT:
        verdict = _mac_verdict(verdict, memoryview(slot).cast("B"), payload_len, mac_key)
    if verdict:
        raise BadBlock(slot_reason(verdict, slot))
    magic, ver, hbytes, rank, nsid, klen, macs, pcrc, plen, key, seq, layout = HDR.unpack_from(slot)
    return {
        "rank": rank,
        "nsid": nsid,
        "key": key[:klen],
        "payload_crc": pcrc,
        "payload_len": plen,
        "seq": seq,
        "layout": layout,
        "mac_scheme": macs,
        "tenant": header_tenant(slot),  # (None: unknown, or a header read short of it)
    }


def unpack_header(raw) -> dict:
    """Parse a header after its own checks (length, header CRC, magic, version),
    without comparing it to expectations. Returns its fields; raises BadBlock."""
    return _checked(raw, _native.CHECK_SELF, _NO_NSID, 0, 0, None, None)


def check_header(
    raw, nsid: bytes, rank: int, payload_len: int, key: bytes | None = None, layout: int | None = None
) -> dict:
    """The slot check without its payload: unpack_header's checks, then the
    header against what the reader expects (layout, nsid, rank, key, payload
    length; key or layout None: any). Returns the header; raises BadBlock
    naming the first mismatch."""
    return _checked(raw, _native.CHECK_HEADER, nsid, rank, payload_len, key, layout)


def check_slot(
    slot,
    nsid: bytes,
    rank: int,
    payload_len: int,
    key: bytes | None = None,
    layout: int | None = None,
    mac_key: bytes | None = None,
) -> dict:
    """The one check that a whole slot is valid for (nsid, rank, payload_len,
    key, layout): its header (check_header), then its payload's CRC32C or, with
    a secret's mac_key, its MAC (which covers the payload and the header). `slot`
    is any buffer of at least HEADER_BYTES + payload_len bytes (bytes, or ctypes
    memory over a staging buffer). Returns the header; raises BadBlock naming the
    first failed check."""
    return _checked(slot, _native.CHECK_SLOT, nsid, rank, payload_len, key, layout, mac_key)


def check_namespace(info, nsid: bytes) -> tuple[int, int, int, dict]:
    """(payload_bytes, slot_bytes, ranks, fields) of a parsed namespace.json,
    every number bounds-checked before anything uses it; raises BadBlock."""
    if not isinstance(info, dict):
        raise BadBlock("not a JSON object")
    pb, sb, ranks, fields = info.get("payload_bytes"), info.get("slot_bytes"), info.get("ranks"), info.get("fields", {})
    if type(pb) is not int or not 0 < pb <= MAX_PAYLOAD_BYTES:
        raise BadBlock(f"payload_bytes {pb!r} is not in 1..{MAX_PAYLOAD_BYTES}")
    if type(sb) is not int or sb != slot_bytes(pb):
        raise BadBlock(f"slot_bytes {sb!r} does not match payload_bytes {pb} (expected {slot_bytes(pb)})")
    if type(ranks) is not int or not 1 <= ranks <= MAX_RANKS:
        raise BadBlock(f"ranks {ranks!r} is not in 1..{MAX_RANKS}")
    if not isinstance(fields, dict):
        raise BadBlock("fields is not an object")
    if info.get("nsid", nsid.hex()) != nsid.hex():
        raise BadBlock(f"nsid {info.get('nsid')!r} is not its directory's name")
    return pb, sb, ranks, fields
