# SPDX-License-Identifier: Apache-2.0
"""Namespace ids and block keys.

A block's key covers exactly the tokens from the start of the sequence to the
end of that block (never a suffix alone), chained: key_i = H(root, key_{i-1}, tokens of
block i). The root binds the namespace (everything that changes the bytes:
model weights, dtypes, layout, parallelism) and the per-request
factors (cache_salt, LoRA, multimodal inputs, prompt embeddings). BLAKE2b is
keyed and seeded by nothing random, so keys are the same in every process
whatever PYTHONHASHSEED or vLLM's own prefix-hash algorithm is.

Pure functions, no vLLM imports.

Threading contract: none needed (no state); called on the EngineCore scheduler
thread (and by tools reading a store).
"""

from __future__ import annotations

import hashlib
import json
from array import array

KEY_BYTES = 32


def namespace_id(fields: dict) -> bytes:
    """16-byte id of a namespace from its describing fields (JSON-able)."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16, person=b"aiokv-ns").digest()


def request_root(nsid: bytes, extras: list) -> bytes:
    """The chain's root for one request: namespace + per-request factors."""
    h = hashlib.blake2b(nsid, digest_size=KEY_BYTES, person=b"aiokv-root")
    if extras:
        h.update(json.dumps(extras, sort_keys=True, default=str).encode())
    return h.digest()


def extend_keys(keys: list[bytes], root: bytes, tokens, block_size: int, upto_blocks: int) -> list[bytes]:
    """Append keys for blocks len(keys)..upto_blocks-1 of `tokens` (in place) and return keys."""
    start = len(keys)
    if upto_blocks <= start:
        return keys
    raw = memoryview(array("I", tokens[start * block_size : upto_blocks * block_size]).tobytes())
    step = block_size * 4
    prev = keys[-1] if keys else root
    keyed = hashlib.blake2b(digest_size=KEY_BYTES, key=root[:32])  # keyed once, copied per block
    append = keys.append
    for off in range(0, (upto_blocks - start) * step, step):
        h = keyed.copy()
        h.update(prev)
        h.update(raw[off : off + step])
        prev = h.digest()
        append(prev)
    return keys
