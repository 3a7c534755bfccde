# SPDX-License-Identifier: Apache-2.0
"""KV events for cache-aware routers (vLLM's kv_events_config: BlockStored / BlockRemoved,
published by vLLM from the scheduler's connector.take_events()).

- BlockStored, medium STORAGE, once a block becomes a hit here: committed by this engine
  (every rank wrote it), or committed by another engine on the same directory and followed.
- BlockRemoved when it stops being one: evicted (by this engine, or by the other engine
  whose copy it was), dropped as damaged, or no longer served after a cache reset. The blocks
  an `aiokv clear` removes come as arrays of tags (store/applying.py) and go out as one
  BlockRemoved of many hashes per batch, at most REMOVE_S seconds of them per step.
- At start, the blocks already stored for this engine's namespace (once its index has
  loaded), read from the labels a part of START_READ bytes at a time and announced in
  batches of at most ANNOUNCE_BATCH per step (vLLM publishes what take_events returns once per engine step,
  so the first batch goes out with the engine's first step).

Each event carries what vLLM's own events carry for the same tokens (one event per
block, as vLLM's CPU offloading does): the block's hash from the request's
`block_hashes` (at the group's block size) converted as vLLM converts its own
(maybe_convert_block_hash: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), the parent block's
hash, the block's token ids, block_size, the LoRA, group_idx, the group's spec kind and
sliding window, locality LOCAL. extra_keys is left out, as in vLLM's own offloading
connector (the hash still covers them).

What a restart needs is kept with the store (store/labels.py): per block, its hashes,
its tokens and the fingerprint of vLLM's hashing (algorithm, NONE_HASH, which the seed
and PYTHONHASHSEED decide, and the block sizes). A block stored under another
fingerprint is not announced: its hash would not be the one this engine's router
computes. Blocks saved after a cache reset are not labelled (no engine loads them
after a restart); after a reset only the saves planned since are announced: no other
block (another engine's, or a save planned before it) can be a hit here any more, so
none waits for a label and no labels file is read again. Labels describe, they are
never trusted for bytes.

Threading contract: the EngineCore scheduler thread only (the SchedulerRole's calls);
the labels' file calls run on the store's I/O thread.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from aiokv.connector.event_labels import hash_fingerprint, pack_label, unpack_label
from aiokv.store.labels import START_READ
from aiokv.store.table import tag_of

log = logging.getLogger("aiokv")

ANNOUNCE_BATCH = 1024  # stored blocks announced per step at start
REMOVE_BATCH = 2048  # removed blocks of a clear looked at a time (one BlockRemoved at most)
REMOVE_S = 0.002  # seconds per step after which no further batch of a clear's removals starts
HELD = 1 << 16  # labels held for blocks not yet committed here (saves in flight, other engines')
READ_EVERY = 1.0  # seconds between reads of the other engines' labels while some are missing


_VLLM: tuple = ()


def _vllm() -> tuple:
    """vLLM's event classes, medium and hash conversion, imported once (at the first event)."""
    global _VLLM
    if not _VLLM:
        from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        _VLLM = (BlockStored, BlockRemoved, MEDIUM_STORAGE, maybe_convert_block_hash)
    return _VLLM


class KVEvents:
    def __init__(self, store, groups, block_size: int, hash_block_size: int, algo: str):
        """groups: [(group index, store namespace, spec kind, sliding window or None)]; the store
        may be several drives' (store/drives.py): each drive's part is watched and labelled."""
        self.store = store
        self.groups = groups
        # group -> [(the Store, its Namespace)]: one per drive (one Store: itself)
        self._parts = {gi: [(st, part) for _, st, part in store.parts(ns)] for gi, ns, _, _ in groups}
        self.bs, self.hbs, self.algo = block_size, hash_block_size or block_size, algo
        self.fp: bytes | None = None  # vLLM's NONE_HASH exists only once the engine is up
        self._reqs: dict[str, tuple] = {}  # request -> (its live block_hashes, LoRA name, LoRA id)
        self._pos: dict[str, tuple[int, dict]] = {}  # request -> (id of its key list, key -> block index)
        # blocks are named by (group, their key's tag): a removal names a slot's tag, not its key
        self._held: collections.OrderedDict = collections.OrderedDict()  # (group, tag) -> our saves' labels
        self._book: collections.OrderedDict = collections.OrderedDict()  # the same, other engines' (read)
        self._announced: dict[tuple[int, int], bytes] = {}  # (group, tag) -> the raw hash announced
        self._unknown: dict[tuple[int, int], None] = {}  # hits here (other engines') whose label is unread
        self._backlog: collections.deque = collections.deque()  # the start announcement: (group, key, label)
        self._removing: collections.deque = collections.deque()  # a clear's removals: [group, tags, next index]
        self._out: list = []
        self._write: dict[tuple, list] = {}  # (group, drive part) -> [(key, label)] for its labels file
        self._reset = False  # after a cache reset: what was stored before is not announced
        self._reading = 0  # reads of the start announcement in flight
        self._next_start: list = []  # (group, store, part) whose labels have more to read for it
        self._next_read = 0.0
        self._started = False
        for parts in self._parts.values():
            for _, part in parts:
                part.changes = []  # watch from now on; what is stored already is announced at start

    # ---- the scheduler role's calls ----
    def request(self, request) -> None:
        """A request vLLM asked about: its hash list (vLLM extends it as tokens come) and LoRA."""
        lr = getattr(request, "lora_request", None)
        self._reqs[request.request_id] = (
            request.block_hashes,
            getattr(lr, "lora_name", None),
            getattr(lr, "lora_int_id", None),
        )

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._pos.pop(req_id, None)

    def planned(self, saves, reqs) -> None:
        """This step's save jobs (Transfers): each block's label, held until it is committed.
        reqs: req_id -> the scheduler side's Req (its keys and live tokens)."""
        fp = self._fingerprint()
        if fp is None:
            return
        for t in saves:
            got, st = self._reqs.get(t.req_id), reqs.get(t.req_id)
            if got is None or st is None:
                continue
            hashes, lora_name, lora_id = got
            pos = self._positions(t.req_id, st.keys)
            r = self.bs // self.hbs
            for key in t.keys:
                j = pos.get(key)
                if j is None or (j + 1) * r > len(hashes):
                    continue
                parent = hashes[j * r - 1] if j else None
                self._hold(
                    self._held,
                    (t.group, tag_of(key)),
                    pack_label(
                        fp,
                        hashes[(j + 1) * r - 1],
                        parent,
                        lora_name,
                        lora_id,
                        st.tokens[j * self.bs : (j + 1) * self.bs],
                    ),
                )

    def reset(self) -> None:
        """The cache was reset (the weights may have changed): nothing announced is served now."""
        self._reset = True
        self._backlog.clear()
        self._removing.clear()
        self._unknown.clear()
        self._held.clear()
        self._book.clear()
        by_group: dict[int, list] = {}
        for (gi, _), h in self._announced.items():
            by_group.setdefault(gi, []).append(h)
        self._announced.clear()
        for gi, hs in by_group.items():
            self._out.append(self._removed(gi, hs))

    def take(self) -> list:
        """The events since the last call (vLLM's take_events, once per step)."""
        if (
            not self._started
            and self._fingerprint() is not None
            and all(part.ready for parts in self._parts.values() for _, part in parts)
        ):  # (what is stored is known once every index has loaded: store.py)
            self._started = True
            for gi, parts in self._parts.items():
                for st, part in parts:
                    self._reading += 1
                    st.labels.read(
                        part.nsid,
                        lambda found, more, gi=gi, st=st, part=part: self._start_read(gi, st, part, found, more),
                        keep=lambda key, t=part.table: t.find(key) >= 0,
                        held=part.table.count,
                        limit=START_READ,
                    )
        for gi, parts in self._parts.items():
            for pi, (_, part) in enumerate(parts):
                changes, part.changes = part.changes, []
                for added, tag, key in changes:
                    if added:
                        self._hit(gi, pi, tag, key)
                    elif isinstance(tag, np.ndarray):
                        self._removing.append([gi, tag, 0])  # a clear's: in batches (_remove)
                    else:
                        self._gone(gi, tag)
        if self._removing:
            self._remove()
        if self._unknown and time.monotonic() >= self._next_read:
            self._next_read = time.monotonic() + READ_EVERY
            for gi, parts in self._parts.items():
                for st, part in parts:
                    st.labels.read(part.nsid, lambda found, more, gi=gi: self._read(gi, found, False))
        for (gi, pi), items in self._write.items():
            st, part = self._parts[gi][pi]
            st.labels.append(part.nsid, items)
        self._write = {}
        while self._next_start and not self._reading and len(self._backlog) < 4 * ANNOUNCE_BATCH:
            gi, st, part = self._next_start.pop(0)
            self._reading += 1
            st.labels.read(
                part.nsid,
                lambda found, more, gi=gi, st=st, part=part: self._start_read(gi, st, part, found, more),
                limit=START_READ,
            )
        for _ in range(min(len(self._backlog), ANNOUNCE_BATCH)):
            gi, key, label = self._backlog.popleft()
            if self.groups[gi][1].has(key):
                self._stored(gi, tag_of(key), label)
        out, self._out = self._out, []
        return out

    def _start_read(self, gi: int, st, part, found: dict, more: bool) -> None:
        """A part of the start announcement read; the next part is read once this one is
        mostly announced (the backlog stays bounded however many blocks are stored)."""
        self._reading -= 1
        self._read(gi, found, True)
        if more and not self._reset:
            self._next_start.append((gi, st, part))

    @property
    def announced(self) -> bool:
        """The start announcement is all handed to vLLM (or cut short by a cache reset)."""
        return self._started and not self._reading and not self._next_start and not self._backlog

    @property
    def behind(self) -> bool:
        """Changes of the store (commits, removals, a clear's) not yet handed to vLLM."""
        return bool(self._removing) or any(part.changes for parts in self._parts.values() for _, part in parts)

    @property
    def announcing(self) -> int:
        """Stored blocks of the start announcement not yet handed to vLLM."""
        return len(self._backlog)

    # ---- the rest ----
    def _fingerprint(self) -> bytes | None:
        if self.fp is None:
            from vllm.v1.core import kv_cache_utils

            none = getattr(kv_cache_utils, "NONE_HASH", None)
            if none is not None:
                self.fp = hash_fingerprint(self.algo, none, self.hbs, self.bs)
        return self.fp

    def _positions(self, req_id: str, keys: list) -> dict:
        got = self._pos.get(req_id)
        if got is None or got[0] != id(keys):
            got = self._pos[req_id] = (id(keys), {})
        pos = got[1]
        for j in range(len(pos), len(keys)):
            pos[keys[j]] = j
        return pos

    @staticmethod
    def _hold(into: collections.OrderedDict, k: tuple[int, int], label: bytes) -> None:
        into[k] = label
        into.move_to_end(k)
        while len(into) > HELD:  # saves that never committed, other engines' blocks never followed
            into.popitem(last=False)

    def _hit(self, gi: int, pi: int, tag: int, key: bytes | None) -> None:
        k = (gi, tag)
        label = self._held.pop(k, None)
        if label is not None and key is not None:  # our save's (on drive part pi)
            if not self._reset:
                self._write.setdefault((gi, pi), []).append((key, label))
        else:
            label = self._book.pop(k, None)
        if label is None:
            if self._reset:  # planned before the reset, or another engine's: never a hit here now
                return
            self._unknown[k] = None  # another engine's: its label is read from its file
            return
        self._stored(gi, tag, label)

    def _gone(self, gi: int, tag: int) -> None:
        if self.groups[gi][1].held(tag):
            return  # still a hit: another drive holds it too
        k = (gi, tag)
        self._unknown.pop(k, None)
        h = self._announced.pop(k, None)
        if h is not None:
            self._out.append(self._removed(gi, [h]))

    def _remove(self) -> None:
        """The removals of a clear, REMOVE_BATCH tags at a time, a batch and then more for at
        most REMOVE_S seconds: one BlockRemoved per batch, for those announced and no longer
        held here."""
        end, first = time.monotonic() + REMOVE_S, True
        while self._removing and (first or time.monotonic() < end):
            first = False
            item = self._removing[0]
            gi, tags, pos = item
            part = tags[pos : pos + REMOVE_BATCH]
            item[2] = pos + len(part)
            if item[2] >= len(tags):
                self._removing.popleft()
            part = part[part != 0]
            if not len(part) or not (self._announced or self._unknown):
                continue
            hs = []
            for tag in part.tolist():
                k = (gi, tag)
                if (k in self._announced or k in self._unknown) and not self.groups[gi][1].held(tag):
                    self._unknown.pop(k, None)
                    h = self._announced.pop(k, None)
                    if h is not None:
                        hs.append(h)
            if hs:
                self._out.append(self._removed(gi, hs))

    def _read(self, gi: int, found: dict, start: bool) -> None:
        """Labels read from the files: at start the announcement, later other engines' blocks."""
        if self._reset:
            return
        ns = self.groups[gi][1]
        for key, label in found.items():
            k = (gi, tag_of(key))
            if k in self._announced:
                continue
            if start:
                if ns.has(key):
                    self._backlog.append((gi, key, label))
            elif k in self._unknown:
                del self._unknown[k]
                self._stored(gi, k[1], label)
            elif not ns.has(key):
                self._hold(self._book, k, label)  # its commit is followed later

    def _stored(self, gi: int, tag: int, label: bytes) -> None:
        BlockStored, _, MEDIUM_STORAGE, conv = _vllm()
        got = unpack_label(label)
        if got is None or got[0] != self.fp or (gi, tag) in self._announced:
            return  # damaged, or hashed under another fingerprint: a router would not know the hash
        _, h, parent, lora_name, lora_id, tokens = got
        self._announced[(gi, tag)] = h
        _, _, kind, window = self.groups[gi]
        self._out.append(
            BlockStored(
                block_hashes=[conv(h)],
                parent_block_hash=conv(parent) if parent else None,
                token_ids=tokens,
                block_size=self.bs,
                lora_id=lora_id,
                medium=MEDIUM_STORAGE,
                lora_name=lora_name,
                group_idx=gi,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                locality="LOCAL",
            )
        )

    @staticmethod
    def _removed(gi: int, hashes: list[bytes]):
        _, BlockRemoved, MEDIUM_STORAGE, conv = _vllm()
        return BlockRemoved(
            block_hashes=[conv(h) for h in hashes], medium=MEDIUM_STORAGE, group_idx=gi, locality="LOCAL"
        )
