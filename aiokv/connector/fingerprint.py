# SPDX-License-Identifier: Apache-2.0
"""A fingerprint of a model's weights, so that new weights at the same path are a
new namespace (the weights decide the KV, not the path).

Small models (all weight files together up to FULL_HASH_LIMIT) are hashed in
full. Larger ones hash each file's size, its first and last 4 MiB (safetensors
headers hold every tensor's name, dtype, shape and offsets) and 64 chunks of
64 KiB spread across it: seconds for hundreds of GB, and any re-save,
fine-tune or re-quantisation changes it. An edit that keeps the size and
touches none of the sampled bytes is not seen; set the model's revision or a
cache_salt when you patch weights in place.

LoRA adapters are fingerprinted the same way (their adapter_config.json too),
once per version of their files (adapter_files gives the version's signature).

Threading contract: weights_fingerprint runs once, in the connector's __init__;
adapter_files and adapter_fingerprint on the adapters' I/O thread (adapters.py),
never on vLLM's. No state.
"""

from __future__ import annotations

import hashlib
import os

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
FULL_HASH_LIMIT = 2 << 30
EDGE, CHUNK, CHUNKS = 4 << 20, 64 << 10, 64


def _sampled(path: str, size: int, h) -> None:
    with open(path, "rb") as f:
        if size <= 2 * EDGE + CHUNK * CHUNKS:
            while b := f.read(1 << 24):
                h.update(b)
            return
        h.update(f.read(EDGE))
        for i in range(CHUNKS):
            f.seek(EDGE + (size - 2 * EDGE - CHUNK) * i // (CHUNKS - 1))
            h.update(f.read(CHUNK))
        f.seek(size - EDGE)
        h.update(f.read(EDGE))


def _files(model_dir: str, meta=META_FILES) -> list[tuple[str, str, int]]:
    """(relative path, path, size) of the weight and config files under model_dir."""
    files = []
    for base, dirs, names in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if n.endswith(WEIGHT_SUFFIXES) or n in meta:
                p = os.path.join(base, n)
                files.append((os.path.relpath(p, model_dir), p, os.path.getsize(p)))
    return files


def weights_fingerprint(model_dir: str) -> str:
    """Hex digest of the weight and config files under model_dir (not following symlinked dirs)."""
    return _digest(_files(model_dir))


ADAPTER_META = ("adapter_config.json",)


def adapter_files(adapter_dir: str) -> tuple[list[tuple[str, str, int]], tuple]:
    """A LoRA adapter's weight files and adapter_config.json [(relative path, path, size)],
    and their signature (the directory, the files' names, sizes and modification times: a
    walk and a few stat calls); files re-saved at the path have another signature."""
    files = _files(adapter_dir, ADAPTER_META)
    return files, (adapter_dir, tuple((rel, size, os.stat(p).st_mtime_ns) for rel, p, size in files))


def adapter_fingerprint(files: list[tuple[str, str, int]]) -> str:
    """Hex digest of an adapter's files (adapter_files), as weights_fingerprint hashes a model's."""
    return _digest(files)


def _digest(files: list[tuple[str, str, int]]) -> str:
    total = sum(s for _, _, s in files if s)
    h = hashlib.blake2b(digest_size=16)
    for rel, p, size in files:
        h.update(f"{rel}\0{size}\0".encode())
        if total <= FULL_HASH_LIMIT:
            with open(p, "rb") as f:
                while b := f.read(1 << 24):
                    h.update(b)
        else:
            _sampled(p, size, h)
    return h.hexdigest()
