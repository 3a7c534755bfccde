# SPDX-License-Identifier: Apache-2.0
"""The on-disk format, version 2: constants, packing and checking. Nothing else.

docs/format.md describes the same layout for people; change both together and
bump FORMAT_VERSION when the bytes or the layout change.

    DIR/aiokv.json                      store marker: {"magic": "aiokv", "format": 2}
    DIR/lock, DIR/lock.<E>              flock held by the live engine number 0, E; holds its pid
    DIR/ns/<nsid hex>/namespace.json    descriptive fields, slot payload size, ranks
    DIR/ns/<nsid hex>/<engine dir>/     engine E's files: the namespace directory itself for
                                        engine 0, its subdirectory e<E> for E >= 1:
        rank<R>.data                    slots: slot s at offset s * slot_bytes
        checkpoint                      index snapshot (header + records)
        journal.<gen>                   records appended since checkpoint generation <gen>
        labels                          a label per key (header + label records), for the
                                        layers above the store: vLLM's block hashes (KV events)

Each engine writes only its own files; the others follow its journal. A block
is named by its location: engine << 32 | slot (loc/split below).

The layout tag is a hash of the reader's in-memory KV layout (tensor shapes,
strides, dtype per layer) so blocks written under one attention backend are a
miss, never bytes, under another that the namespace id failed to tell apart.

A slot is a 4096-byte header followed by the payload padded to 4096 bytes, so
every slot, offset and length is aligned for O_DIRECT. The header is verified
on every read: magic, version, namespace, rank, key, length, payload CRC32C and
a CRC32C of the header itself. Any mismatch is a miss.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import struct

from aiokv import _native
from aiokv.data import mac

# Version 2 (several engines per directory) changed the layout, not the bytes of
# a file: a version-1 directory is a version-2 directory with engine 0 alone, and
# is migrated by rewriting aiokv.json. Slot headers, checkpoints and journals
# still carry FILE_VERSION 1.
FORMAT_VERSION = 2
READS_FORMATS = (1, 2)
FILE_VERSION = 1
STORE_MAGIC = "aiokv"
HEADER_BYTES = 4096
ALIGN = 4096
MIN_KEY, MAX_KEY = 16, 32
NSID_BYTES = 16
# Bounds on numbers read from namespace.json (a slot's length must fit the
# 32-bit length of one I/O operation; a rank is one data file).
MAX_PAYLOAD_BYTES = 1 << 30
MAX_RANKS = 1024
MAX_ENGINES = 256  # engines on one directory at once (engine numbers 0..MAX_ENGINES-1)

# ---- locations: which engine's data file, which slot ----
ENGINE_SHIFT = 32
SLOT_MASK = (1 << ENGINE_SHIFT) - 1


def loc(engine: int, slot: int) -> int:
    """A block's location as one int (what Transfer.locations carry): engine 0's are plain slots."""
    return engine << ENGINE_SHIFT | slot


def split(location: int) -> tuple[int, int]:
    """(engine, slot) of a location."""
    return location >> ENGINE_SHIFT, location & SLOT_MASK


# ---- drives: a location handed out by several drives (aiokv/store/drives.py) also names
# the drive, by its index in the configured list, above the engine's bits; drive 0's
# locations are its store's, so a single drive's are exactly what they always were
DRIVE_SHIFT = 40
DRIVE_MASK = (1 << DRIVE_SHIFT) - 1
MAX_DRIVES = 64


def on_drive(drive: int, location: int) -> int:
    """A drive's location (engine << 32 | slot in that drive's store) as one int naming the drive too."""
    return drive << DRIVE_SHIFT | location


def drive_of(location: int) -> tuple[int, int]:
    """(drive, the location in that drive's store) of a location from several drives."""
    return location >> DRIVE_SHIFT, location & DRIVE_MASK


def engine_dir(engine: int) -> str:
    """Engine's directory inside a namespace directory ("" for engine 0: the namespace directory)."""
    return "" if engine == 0 else f"e{engine}"


def data_file(rank: int) -> str:
    """The name of a rank's data file in an engine's directory: the one place it is spelled."""
    return f"rank{rank}.data"


def engine_of_dir(name: str) -> int | None:
    """The engine number of a subdirectory name e<E>, or None."""
    if (
        name.startswith("e")
        and name[1:].isdigit()
        and name[1:] == str(int(name[1:]))
        and 0 < int(name[1:]) < MAX_ENGINES
    ):
        return int(name[1:])
    return None


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


# ---- slot header ----
BLOCK_MAGIC = b"AIOKVBLK"
# magic, version, header bytes, rank, nsid, key len, MAC scheme, payload crc, payload len, key, seq, layout tag
_HDR = struct.Struct("<8sHHI16sBB2xIQ32sQQ")
_HDR_CRC = struct.Struct("<I")
HDR_USED = _HDR.size + _HDR_CRC.size
# With a secret (docs/sharing.md), the header carries a MAC after its CRC: byte
# MAC_SCHEME_OFFSET names the scheme, MAC_BYTES at MAC_OFFSET hold it. Scheme 1
# (MAC_SCHEME): keyed BLAKE3-256 of the payload, then of the header's first
# _HDR.size bytes (the scheme byte among them), keyed by mac_key(secret) (mac.py:
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


def mac_key(secret: str | bytes) -> bytes:
    """The 32-byte MAC key of a secret of any length (BLAKE3's derive_key under aiokv's context)."""
    return mac.derive_key(secret.encode() if isinstance(secret, str) else bytes(secret))


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
    body = _HDR.pack(
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
# (HDR_OFF_*) writes and reads the _HDR layout above byte for byte.
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
    raise ImportError("aiokv: aiokv._native was built from another format.py; rebuild it (pip install -e .)")
_NO_NSID = bytes(NSID_BYTES)
_PAYLOAD_CRC, _MAC = SLOT_REASONS.index("payload checksum"), SLOT_REASONS.index("MAC")


def _mac_key_arg(mac_key) -> bytes | None:
    if mac_key is not None and (not isinstance(mac_key, (bytes, bytearray)) or len(mac_key) != MAC_BYTES):
        raise ValueError("aiokv: a MAC key is 32 bytes (format.mac_key)")
    return mac_key


def slot_mac(slot: memoryview, payload_len: int, mac_key: bytes) -> bytes:
    """The scheme-1 MAC of a slot (a flat byte view of its header and payload)."""
    return mac.keyed(mac_key, slot[HEADER_BYTES : HEADER_BYTES + payload_len], slot[: _HDR.size])


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
        _HDR.size,
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
        _HDR.size,
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


def slot_reason(verdict: int, slot) -> str:
    """BadBlock's reason for a verdict of the slot check on `slot` (its buffer)."""
    reason = SLOT_REASONS[verdict]
    if reason == "format version":  # the header is whole (its CRC matched): say which version
        reason += f" {_HDR.unpack_from(slot)[1]}"
    return reason


def _checked(slot, upto: int, nsid: bytes, rank: int, payload_len: int, key, layout, mac_key=None) -> dict:
    verdict = _native.check_slot(slot, nsid, rank, payload_len, key, layout, upto)
    if _mac_key_arg(mac_key) is not None and upto == _native.CHECK_SLOT:
        verdict = _mac_verdict(verdict, memoryview(slot).cast("B"), payload_len, mac_key)
    if verdict:
        raise BadBlock(slot_reason(verdict, slot))
    magic, ver, hbytes, rank, nsid, klen, macs, pcrc, plen, key, seq, layout = _HDR.unpack_from(slot)
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


# ---- index records (checkpoint body and journal) ----
REC_COMMIT = 1
REC_DROP = 2
# TOUCH: the engine whose journal holds it used `key` (a hit on a block another
# engine holds) at `atime`; whichever engine holds the key refreshes its LRU
# position. slot is 0.
REC_TOUCH = 3
# FREE (journal version 2): the block in `slot`, whose key has the tag (aiokv/store/table.py)
# in the first 8 bytes of the key field (little-endian; the other 8 zero, key length 16),
# is gone: an eviction, which knows a slot and its tag, not the key. atime is 0.
REC_FREE = 4
# FLAGS (journal version 3): the writer's block in `slot`, whose key has the tag in the key
# field (as FREE's), has the flags of byte 58 from now on (FLAG_PINNED: pinned, never
# evicted); a FLAGS whose tag does not match the slot's block changes nothing. atime is 0.
REC_FLAGS = 5
# MARK (journal version 3): the writer applied the directory's control records (clear, pin,
# unpin: aiokv/store/control.py) up to number `slot` to this namespace, in the records before
# it (written before it, in chunks: after a crash an order's records may be there without its
# MARK, and the order is applied again). Key of length 16, zero; atime: when.
REC_MARK = 6
REC_KINDS = (REC_COMMIT, REC_DROP, REC_TOUCH, REC_FREE, REC_FLAGS, REC_MARK)
FLAG_PINNED = 1  # flags bit 0: pinned (by an operator's pin, or a request's)
# type, key len, slot, last access (ns since epoch), key, then 12 bytes: a checkpoint's
# records carry the key's tag (8 bytes; 0 in journals and in checkpoints of old writers: the
# reader computes it); a COMMIT's (journal version 3) and a checkpoint's record its tenant
# (2 bytes: an id in the writer's tenants file, 0: the tenant "") and flags (1 byte); FLAGS
# records their flags; one zero byte; crc
_REC = struct.Struct("<BB2xIQ32sQHBx")
REC_BYTES = _REC.size + 4
assert REC_BYTES == 64
# the same record as a numpy dtype (aiokv/store/table.py parses records in bulk)
REC_FIELDS = {
    "names": ["kind", "klen", "slot", "atime", "key", "tag", "tenant", "flags", "crc"],
    "formats": ["u1", "u1", "<u4", "<u8", "V32", "<u8", "<u2", "u1", "<u4"],
    "offsets": [0, 1, 4, 8, 16, 48, 56, 58, 60],
    "itemsize": REC_BYTES,
}
REC_KEY_AT, REC_KLEN_AT = 16, 1

# index image: the in-memory index of a checkpoint's blocks as it is laid out in memory
# (aiokv/store/table.py), written beside the checkpoint (same generation and count) so
# that opening reads four arrays instead of parsing a record per block; a cache of the
# checkpoint, never the truth: one that does not match it is ignored (docs/format.md).
INDEX_NAME = "index"
INDEX_MAGIC = b"AIOKVIDX"
INDEX_VERSION = 1
# magic, version, generation, count, slots, CRC32C of each column (tag, atime, tenant, flags),
# then the checkpoint file it was written with as the file system saw it: inode, mtime (ns),
# size (a checkpoint changed since, by anyone, is read instead of the image)
_INDEX_HDR = struct.Struct("<8sHxxQQQIIIIQQQ")
INDEX_HDR_BYTES = 128
INDEX_COLUMNS = (("tag", 8), ("atime", 8), ("tenant", 2), ("flags", 1))


def pack_index_header(gen: int, count: int, slots: int, crcs, ckpt: tuple[int, int, int]) -> bytes:
    return _INDEX_HDR.pack(INDEX_MAGIC, INDEX_VERSION, gen, count, slots, *crcs, *ckpt).ljust(INDEX_HDR_BYTES, b"\0")


def unpack_index_header(raw: bytes) -> tuple[int, int, int, tuple, tuple]:
    """(generation, count, slots, column CRCs, checkpoint identity); raises BadBlock if it
    is not an index image."""
    if len(raw) < INDEX_HDR_BYTES:
        raise BadBlock("short index header")
    m, ver, gen, count, slots, c1, c2, c3, c4, ino, mtime, size = _INDEX_HDR.unpack_from(raw)
    if m != INDEX_MAGIC or ver != INDEX_VERSION:
        raise BadBlock("not an index image of this version")
    return gen, count, slots, (c1, c2, c3, c4), (ino, mtime, size)


def index_offsets(slots: int) -> list[int]:
    """Where each column of an index image of `slots` slots starts."""
    out, off = [], INDEX_HDR_BYTES
    for _, size in INDEX_COLUMNS:
        out.append(off)
        off += size * slots
    return out


JOURNAL_MAGIC = b"AIOKVJNL"
CKPT_MAGIC = b"AIOKVCKP"
# Journals of version 2 may hold FREE records; version 1 (read still) cannot. Journals of
# version 3 (issue 34) carry each COMMIT's tenant and flags, and may hold FLAGS and MARK
# records; versions 1 and 2 (read still) carry none: their blocks are the tenant "", unpinned.
# Checkpoints stay version 1: their records' last 12 bytes, which earlier versions wrote zero
# and never read, carry the tag, tenant and flags, and they are sorted by slot (readers expect
# none of it: a checkpoint without them is read as before); their header's bytes 32..39 (zero
# before) the control records applied (MARK), 0: none.
JOURNAL_VERSION = 3
FILE_VERSIONS = {JOURNAL_MAGIC: (1, 2, 3)}  # the versions read, where more than FILE_VERSION
# magic, version, generation, record count, body crc
_FILE_HDR = struct.Struct("<8sHxxQQI")
_FILE_MARK = struct.Struct("<Q")
FILE_MARK_AT = 32  # a checkpoint's MARK (control records applied)
FILE_HDR_BYTES = 64


def pack_record(kind: int, key: bytes, slot: int, atime: int, tenant: int = 0, flags: int = 0) -> bytes:
    body = _REC.pack(kind, len(key), slot, atime, key, 0, tenant, flags)
    return body + struct.pack("<I", _native.crc32c_bytes(body))


def pack_mark(upto: int, when: int) -> bytes:
    """A MARK record: control records up to number `upto` applied (at `when`, ns)."""
    return pack_record(REC_MARK, bytes(MIN_KEY), upto, when)


def pack_free(slot: int, tag: int) -> bytes:
    """A FREE record: the block in `slot`, of key tag `tag`, is gone."""
    return pack_record(REC_FREE, tag.to_bytes(8, "little") + bytes(8), slot, 0)


def pack_flags(slot: int, tag: int, flags: int) -> bytes:
    """A FLAGS record: the block in `slot`, of key tag `tag`, has `flags` from now on."""
    return pack_record(REC_FLAGS, tag.to_bytes(8, "little") + bytes(8), slot, 0, flags=flags)


def iter_records(buf: bytes, verify_each: bool = True):
    """Yield (kind, key, slot, atime) up to the first record that does not verify.

    Returns (via StopIteration value) the byte length of the valid prefix.
    """
    n = len(buf) // REC_BYTES
    crc = _native.crc32c_bytes
    for i in range(n):
        off = i * REC_BYTES
        body = buf[off : off + _REC.size]
        if verify_each and crc(body) != int.from_bytes(buf[off + _REC.size : off + REC_BYTES], "little"):
            return off
        kind, klen, slot, atime, key, _, _, _ = _REC.unpack(body)
        if kind not in REC_KINDS or not MIN_KEY <= klen <= MAX_KEY:
            return off
        yield kind, key[:klen], slot, atime
    return n * REC_BYTES


def pack_file_header(
    magic: bytes, gen: int, count: int = 0, body_crc: int = 0, version: int | None = None, mark: int = 0
) -> bytes:
    if version is None:
        version = JOURNAL_VERSION if magic == JOURNAL_MAGIC else FILE_VERSION
    head = _FILE_HDR.pack(magic, version, gen, count, body_crc).ljust(FILE_MARK_AT, b"\0")
    return (head + _FILE_MARK.pack(mark)).ljust(FILE_HDR_BYTES, b"\0")


def file_header_mark(raw: bytes) -> int:
    """A checkpoint header's MARK: the control records its index has applied (0: none)."""
    return _FILE_MARK.unpack_from(raw, FILE_MARK_AT)[0] if len(raw) >= FILE_MARK_AT + 8 else 0


def unpack_file_header(raw: bytes, magic: bytes) -> tuple[int, int, int]:
    """(generation, count, body crc); raises BadBlock if it is not ours."""
    if len(raw) < FILE_HDR_BYTES:
        raise BadBlock("short file header")
    m, ver, gen, count, crc = _FILE_HDR.unpack_from(raw)
    if m != magic:
        raise BadBlock("file magic")
    reads = FILE_VERSIONS.get(magic, (FILE_VERSION,))
    if ver not in reads:
        raise BadBlock(f"format version {ver} (this aiokv reads {', '.join(map(str, reads))})")
    return gen, count, crc


# ---- labels: one opaque description per key, kept for the layers above the store ----
# (the connector's KV events: the block's vLLM hashes and tokens, aiokv/connector/events.py).
# A labels file is a file header (LABEL_MAGIC, generation 0) and records appended after it:
# body length, CRC32C of the body, body = key length, key, label. A later record of a key
# replaces an earlier one. Labels describe, they are never trusted for bytes: a block is
# served only by its own key and header checks.
LABELS_NAME = "labels"
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


def tenants_name(engine: int) -> str:
    return f"tenants.{engine}"


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
CONTROL_NAME = "control"
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
