# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters' fingerprints, taken off vLLM's scheduler thread.

A request's key root binds a fingerprint of its adapter's files (fingerprint.py), not
its name or path. Finding the files (a hub snapshot, `local_files_only`), walking and
stat-ing them and reading them in full (up to 2 GiB) is file-system work: on a mount
that does not answer, one such call on vLLM's scheduler thread stops the engine. So
every look at an adapter's files runs on an I/O thread of its own (an FsThread,
aiokv/store/fsthread.py, with the deadline `fs_timeout`), not the store's: an adapter
on a hung mount must not hold up the journal behind it.

- `get(name, path)`: the fingerprint of the adapter's files, or None (the connector then
  gives the request no key root yet: a miss that saves nothing until it has one) before
  the first look finished, and from the moment a look saw the files change until their
  new fingerprint is known, and until the step's poll has named that change (the
  connector retires the path's requests there); either way a look is queued unless
  one is (a look already finished is applied first, without waiting for the poll). The first look
  hashes the files; later ones stat them and hash again only if their signature (names,
  sizes, modification times) changed. A look that sees a change says so before it
  hashes (the `changing` flag `get` reads, and the path `poll` hands back), so no
  request is given the old files' fingerprint while the new ones are read; files that
  change again while they are hashed are hashed again at the next look (never the
  fingerprint of a mix of two versions).
- `poll()` (once per step, from the connector's build_connector_meta): applies the
  looks finished since, as the store applies its I/O thread's results, and returns the
  paths whose files a look saw change since the last poll (the connector retires the
  requests keyed by their old fingerprint); a look past its deadline is logged once
  (the adapters waiting behind it are misses until it ends).
- Fingerprints are kept per path (the same files under several names are looked at
  once), for up to MAX_ADAPTERS paths, the least recently asked for forgotten first (a
  few hundred bytes each); one forgotten is looked at again (hashed) when asked for.
- An adapter whose files cannot be read gets a random fingerprint for this process:
  its blocks are hits in this life only, never after a restart.

Threading contract: `get`, `poll`, `close` and `len` on the EngineCore scheduler thread;
the looks on the adapters' I/O thread (`aiokv-lora`, started at the first LoRA request).
They meet in the FsThread's queue and its list of finished looks, and in what a look
says before it hashes: the adapter's `changing` flag (set by the look, cleared by its
result on the scheduler thread; at most one look per adapter runs) and the `_seen`
deque of changed paths (appended there, drained by `poll`).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os

from aiokv.connector import fingerprint
from aiokv.store.fsthread import FsThread

log = logging.getLogger("aiokv")

MAX_ADAPTERS = 65536  # paths whose fingerprints are kept (the least recently asked for forgotten beyond)
MAX_QUEUED = 4096  # looks queued at once (more wait for their adapter's next request)


class _Adapter:
    __slots__ = ("fp", "sig", "dir", "looking", "changing", "unread")

    def __init__(self):
        self.fp: str | None = None  # the fingerprint of the files as `sig` describes them
        self.sig: bytes | None = None  # a digest of the files' names, sizes and modification times
        self.dir: str | None = None  # the local directory the path names
        self.looking = False  # a look is queued or running
        self.changing = False  # a look saw other files than `sig` and hashes them (set on the I/O thread)
        self.unread: str | None = None  # its fingerprint while its files cannot be read (made once)


class Adapters:
    def __init__(self, deadline: float, thread: bool = True):
        """thread False: looks run at once on the caller's thread (tests, tools)."""
        self.deadline = deadline
        self._thread = thread
        self.fs: FsThread | None = None
        self._known: collections.OrderedDict[object, _Adapter] = collections.OrderedDict()
        self._seen: collections.deque = collections.deque()  # paths a look saw change (from the I/O thread)
        self._said_stalled = False

    def __len__(self) -> int:
        return len(self._known)

    def get(self, name: str, path) -> str | None:
        a = self._known.get(path)
        if a is None:
            a = self._known[path] = _Adapter()
            while len(self._known) > MAX_ADAPTERS:
                self._known.popitem(last=False)  # (a look still running for it updates a forgotten record)
        else:
            self._known.move_to_end(path)
        if a.looking and self.fs is not None:
            self.fs.poll()  # a look that ended since the step's poll: applied, so a new one is queued
        if not a.looking:
            self._look(name, path, a)
        # (a change the step's poll has not named yet: that poll retires the path's requests, so a
        # request given the new fingerprint before it would be retired too; it waits a step instead.
        # Without a thread, tests' and tools' looks end inside this call and nothing polls.)
        return None if a.changing or (self._thread and path in self._seen) else a.fp

    def poll(self) -> set:
        """Apply the looks finished since the last poll; the paths whose files a look saw change."""
        if self.fs is None:
            return set()
        self.fs.poll()
        changed = set()
        while self._seen:
            changed.add(self._seen.popleft())
        if self.fs.stalled:
            if not self._said_stalled:
                log.warning(
                    "aiokv: reading a LoRA adapter's files took over %.0f s (a hung file system?); requests "
                    "with adapters not fingerprinted yet are misses until it answers",
                    self.deadline,
                )
            self._said_stalled = True
        else:
            self._said_stalled = False
        return changed

    def close(self, timeout: float = 1.0) -> None:
        if self.fs is not None:
            self.fs.close(timeout)

    def _look(self, name: str, path, a: _Adapter) -> None:
        if self.fs is None:
            self.fs = FsThread("aiokv-lora" if self._thread else None, self.deadline)
        if self.fs.pending >= MAX_QUEUED:
            return  # (looked at when it is next asked for)
        known = a.fp if a.fp != a.unread else None
        sig, d = a.sig, a.dir
        a.looking = True

        def changed() -> None:  # on the I/O thread, before the new files are hashed
            if known is not None:  # (before the first look, and while unreadable, nothing was served from files)
                a.changing = True
                self._seen.append(path)

        def done(result, error):
            a.looking = a.changing = False
            if error is None:
                a.fp, a.sig, a.dir = result
                return
            if a.unread is None:
                a.unread = "unread-" + os.urandom(16).hex()
            if a.fp != a.unread:
                log.warning(
                    "aiokv: cannot read the files of LoRA adapter %s (%s) to fingerprint them (%s); "
                    "its blocks are kept for this run only",
                    name,
                    path,
                    error,
                )
            a.fp, a.sig = a.unread, None

        try:
            self.fs.submit(lambda: _look(path, d, sig, known, changed), done)
        except OSError:  # closed
            a.looking = False


def _signature(files_sig: tuple) -> bytes:
    return hashlib.blake2b(repr(files_sig).encode(), digest_size=16).digest()


def _look(path, d: str | None, sig: bytes | None, known: str | None, changed) -> tuple[str | None, bytes | None, str]:
    """On the adapters' I/O thread: (fingerprint, signature, directory) of the adapter at
    `path`; hashed only if the files' signature is not `sig` (whose fingerprint is `known`),
    calling changed() first. (None, None, directory) if the files changed while hashed."""
    from aiokv.connector.namespace import local_model_dir

    if not isinstance(path, str) or not path:
        raise ValueError("no path")
    if d is None:
        d = local_model_dir(path, None)
    files, now = fingerprint.adapter_files(d)
    now = _signature(now)
    if now == sig and known is not None:
        return known, sig, d
    changed()
    fp = fingerprint.adapter_fingerprint(files)
    if _signature(fingerprint.adapter_files(d)[1]) != now:
        return None, None, d  # re-saved while hashed: hashed again at the next look
    return fp, now, d
