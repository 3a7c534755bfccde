# SPDX-License-Identifier: Apache-2.0
"""What an engine tells the bucket beside its blocks (bucket/meta.py), so that a node
warmed from the bucket (`aiokv warm`) knows which model a namespace holds and what
its engines announce for the blocks it copied:

- each namespace's namespace.json, once per start: a write-once PUT; an object already
  there is kept if it reads as ours, and replaced when it does not, except under a
  secret (as the uploader treats blocks: an engine never overwrites the fleet's objects
  when a foreign one may be another secret's);
- the labels this engine writes for its blocks (the KV events', store/labels.py `sink`),
  gathered and uploaded as one object per namespace every LABELS_EVERY seconds (or once
  LABELS_BATCH bytes wait), named by a random writer id of this engine's life and a
  sequence number, so engines never write the same name. A batch that cannot be
  uploaded is dropped and counted: labels are best effort (its blocks are warmed
  without an announcement).

Threading contract: `namespaces` and `labels` from any thread (vLLM's scheduler thread, the
store's I/O thread); the uploads run on the loop of the LoopThread handed in (the
prober's); `close` from the owner, once, bounded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading

from aiokv.bucket import meta
from aiokv.bucket.client import BucketClient, BucketError
from aiokv.util.loops import LoopThread

log = logging.getLogger("aiokv")

LABELS_EVERY = 30.0  # seconds labels wait before they are uploaded (one object per namespace)
LABELS_BATCH = 4 << 20  # bytes of labels that make an upload start at once


class Publisher:
    def __init__(self, client: BucketClient, lt: LoopThread, key: bytes | None, every: float = LABELS_EVERY):
        self.client, self.lt, self.key, self.every = client, lt, key, every
        self.writer = secrets.token_hex(8)  # this engine's life: its labels objects' names
        self.counters: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._pending: dict[bytes, list] = {}  # nsid -> [(key, label)] not yet uploaded
        self._bytes = 0
        self._due = False  # an upload is scheduled
        self._seq = 0
        self._busy: set[asyncio.Future] = set()
        self._warned = False

    # ---- any thread ----
    def namespaces(self, docs) -> None:
        """docs: [(nsid, payload bytes, ranks, fields)]: published (write-once) in the background."""
        docs = list(docs)
        self.lt.call_soon(lambda: self._track(asyncio.ensure_future(self._namespaces(docs))))

    def labels(self, nsid: bytes, items) -> None:
        """Labels [(key, label)] of blocks committed in namespace nsid (store/labels.py's sink)."""
        if not items:
            return
        with self._lock:
            self._pending.setdefault(nsid, []).extend(items)
            self._bytes += sum(len(k) + len(v) + 9 for k, v in items)
            now = self._bytes >= LABELS_BATCH
            if self._due and not now:
                return
            self._due = True
        self.lt.call_soon(self._schedule, 0.0 if now else self.every)

    def close(self, timeout: float) -> None:
        """Upload what waits, and wait for uploads in flight, at most `timeout` seconds."""
        if not self.lt.alive:
            return

        async def last():
            self._track(asyncio.ensure_future(self._flush()))
            if self._busy:
                await asyncio.wait(list(self._busy), timeout=timeout)

        try:
            self.lt.submit(last()).result(timeout + 1.0)
        except Exception:
            pass  # not uploaded: counted as dropped below
        with self._lock:
            left = sum(len(v) for v in self._pending.values())
        self.counters["labels_dropped"] += left

    # ---- the loop's ----
    def _track(self, fut: asyncio.Future) -> None:
        self._busy.add(fut)
        fut.add_done_callback(self._busy.discard)

    def _schedule(self, delay: float) -> None:
        self.lt.loop.call_later(delay, lambda: self._track(asyncio.ensure_future(self._flush())))

    def _failed(self, what: str, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("aiokv: %s to %s failed (%s); a node warmed from it may miss them", what, self.client.url, e)

    async def _namespaces(self, docs) -> None:
        for nsid, payload, ranks, fields in docs:
            name = meta.namespace_name(self.client.prefix, nsid)
            doc = meta.namespace_doc(nsid, payload, ranks, fields, self.key)
            try:
                if await self.client.put_once(name, doc):
                    continue
                got = await self.client.get(name)
                try:
                    if got is None:
                        raise meta.Foreign("gone")
                    meta.read_namespace_doc(got, nsid, self.key)
                    continue  # another engine's, and ours to read
                except meta.Foreign:
                    if self.key is not None:  # under a secret the fleet's objects are kept
                        log.warning(
                            "aiokv: %s does not verify under this engine's secret (another fleet's, or "
                            "planted); it is kept, and `aiokv warm` cannot use that namespace",
                            name,
                        )
                        continue
                await self.client.put(name, doc)
            except BucketError as e:
                self._failed("publishing the namespace description", e)

    async def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._bytes, self._due = self._pending, {}, 0, False
        for nsid, items in pending.items():
            last = dict(items)  # (a later label of a key replaces an earlier one)
            self._seq += 1
            name = meta.labels_name(self.client.prefix, nsid, self.writer, self._seq)
            try:
                await self.client.put(name, meta.labels_doc(last.items(), self.key))
                self.counters["labels_uploaded"] += len(last)
            except BucketError as e:
                self.counters["labels_dropped"] += len(last)
                self._failed("uploading block labels", e)
