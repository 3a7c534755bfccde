# SPDX-License-Identifier: Apache-2.0
"""What the bucket holds beside the blocks, for `aiokv warm` (aiokv/ops/warm.py):

    PREFIX/<nsid hex>/namespace.json          what the namespace holds (as the local one,
                                              docs/format.md): written once, by the first
                                              engine of the fleet that opens it
    PREFIX/<nsid hex>/labels/<writer>-<seq>   labels of blocks an engine committed (the KV
                                              events' vLLM hashes and tokens, store/labels.py),
                                              in batches: the records of a labels file

A node warmed from the bucket learns from the first which model a namespace holds
(`--model`) and its layout, and from the second what to announce for the blocks it
copied, so its engines' KV events name them (docs/operations.md, "Warm-up").

With a secret both carry a MAC: keyed BLAKE3 of their bytes under a key derived from the
secret in another context than the slots' (META_CONTEXT), so one can never pass for the
other. An object without the right MAC is foreign and is not used, as a block would not
be. Without a secret (bucket_unsigned) they are trusted as the blocks are.

Threading contract: pure functions, any thread.
"""

from __future__ import annotations

import json

from aiokv.data import format as fmt
from aiokv.data import mac

META_CONTEXT = "aiokv bucket metadata, scheme 1"  # pinned, as mac.CONTEXT is
NAMESPACE = "namespace.json"
LABELS = "labels"
MAX_NAMESPACE_BYTES = 1 << 20  # a namespace.json larger than this is not one of ours
MAX_LABELS_BYTES = 64 << 20  # nor a labels object larger than this


class Foreign(Exception):
    """An object that is not ours: no MAC or a wrong one, damaged, or not what it says."""


def meta_key(secret: str | bytes | None) -> bytes | None:
    """The key of the metadata MACs (None: no secret, nothing signed)."""
    if not secret:
        return None
    return mac.derive_key(secret.encode() if isinstance(secret, str) else bytes(secret), META_CONTEXT)


def _base(prefix: str, nsid: bytes) -> str:
    return f"{prefix + '/' if prefix else ''}{nsid.hex()}"


def namespace_name(prefix: str, nsid: bytes) -> str:
    return f"{_base(prefix, nsid)}/{NAMESPACE}"


def labels_prefix(prefix: str, nsid: bytes) -> str:
    return f"{_base(prefix, nsid)}/{LABELS}/"


def labels_name(prefix: str, nsid: bytes, writer: str, seq: int) -> str:
    return f"{labels_prefix(prefix, nsid)}{writer}-{seq:08d}"


def seal(body: bytes, key: bytes | None) -> bytes:
    """body, followed by its MAC when there is a key."""
    return body if key is None else body + mac.keyed(key, body)


def unseal(raw, key: bytes | None) -> bytes:
    """The body of a sealed object; Foreign if its MAC is missing or wrong."""
    raw = bytes(raw)
    if key is None:
        return raw
    if len(raw) < mac.MAC_BYTES:
        raise Foreign("too short for its MAC")
    body, tag = raw[: -mac.MAC_BYTES], raw[-mac.MAC_BYTES :]
    if mac.keyed(key, body) != tag:
        raise Foreign("its MAC does not match (another secret, or tampered)")
    return body


def namespace_doc(nsid: bytes, payload_bytes: int, ranks: int, fields: dict, key: bytes | None) -> bytes:
    """A namespace's namespace.json for the bucket."""
    info = {
        "nsid": nsid.hex(),
        "payload_bytes": payload_bytes,
        "slot_bytes": fmt.slot_bytes(payload_bytes),
        "ranks": ranks,
        "fields": fields or {},
    }
    return seal(json.dumps(info, indent=1, sort_keys=True, default=str).encode(), key)


def read_namespace_doc(raw, nsid: bytes, key: bytes | None) -> tuple[int, int, dict]:
    """(payload bytes, ranks, fields) of a bucket's namespace.json; Foreign if it is not ours."""
    if len(raw) > MAX_NAMESPACE_BYTES:
        raise Foreign("too large")
    try:
        info = json.loads(unseal(raw, key))
        pb, _, ranks, fields = fmt.check_namespace(info, nsid)
    except (ValueError, fmt.BadBlock) as e:
        raise Foreign(f"not a namespace description ({e})") from None
    if "nsid" not in info:
        raise Foreign("it names no namespace")
    return pb, ranks, fields


def labels_doc(items, key: bytes | None) -> bytes:
    """A labels object: the bytes of a labels file holding `items` [(key, label)]."""
    return seal(fmt.pack_file_header(fmt.LABEL_MAGIC, 0) + b"".join(fmt.pack_label(k, v) for k, v in items), key)


def read_labels_doc(raw, key: bytes | None) -> dict[bytes, bytes]:
    """{block key: label} of a labels object, up to its first damaged record; Foreign if it is not ours."""
    if len(raw) > MAX_LABELS_BYTES:
        raise Foreign("too large")
    body = unseal(raw, key)
    try:
        fmt.unpack_file_header(body[: fmt.FILE_HDR_BYTES], fmt.LABEL_MAGIC)
    except fmt.BadBlock as e:
        raise Foreign(f"not a labels object ({e})") from None
    return dict(fmt.iter_labels(body[fmt.FILE_HDR_BYTES :]))
