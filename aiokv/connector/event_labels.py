# SPDX-License-Identifier: Apache-2.0
"""The label a KV event's block keeps with the store (store/labels.py): what a restart, or
another engine on the same directory, needs to announce the block as vLLM would (its
hash and parent hash, LoRA, tokens), under the fingerprint of vLLM's hashing in the
engine that wrote it. Layout: docs/format.md. Labels describe, they are never trusted
for bytes; a damaged one reads as None.

Threading contract: pure functions, called on the EngineCore scheduler thread
(events.py); no state.
"""

from __future__ import annotations

import hashlib
import struct
from array import array

_LABEL = struct.Struct("<8sBBHqI")  # fingerprint, hash len, parent len, LoRA name len, LoRA id, tokens


def pack_label(fp: bytes, h: bytes, parent: bytes | None, lora_name: str | None, lora_id: int | None, tokens) -> bytes:
    parent, name = parent or b"", (lora_name or "").encode()
    toks = array("I", tokens).tobytes()
    return (
        _LABEL.pack(fp, len(h), len(parent), len(name), -1 if lora_id is None else lora_id, len(toks) // 4)
        + h
        + parent
        + name
        + toks
    )


def unpack_label(raw: bytes):
    """(fingerprint, hash, parent or None, LoRA name or None, LoRA id or None, tokens); None if damaged."""
    if len(raw) < _LABEL.size:
        return None
    fp, hl, pl, nl, lid, nt = _LABEL.unpack_from(raw)
    off = _LABEL.size
    if len(raw) != off + hl + pl + nl + 4 * nt or not hl:
        return None
    h, parent = raw[off : off + hl], raw[off + hl : off + hl + pl] or None
    off += hl + pl
    try:
        name = raw[off : off + nl].decode() or None
    except UnicodeDecodeError:
        return None
    return fp, h, parent, name, None if lid < 0 else lid, array("I", raw[off + nl :]).tolist()


def hash_fingerprint(algo: str, none_hash: bytes, hash_block_size: int, block_size: int) -> bytes:
    """8 bytes naming how vLLM hashes blocks in this engine."""
    return hashlib.blake2b(
        repr((algo, bytes(none_hash), hash_block_size, block_size)).encode(), digest_size=8, person=b"aiokv-vllmhash"
    ).digest()
