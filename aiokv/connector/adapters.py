# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters' fingerprints, taken off vLLM's scheduler thread.

A request's key root binds a fingerprint of its adapter's files (fingerprint.py), not
its name or path. Finding the files (a hub snapshot, `local_files_only`), walking and
stat-ing them and reading them in full (up to 2 GiB) is file-system work: on a mount
that does not answer, one such call on vLLM's scheduler thread stops the engine. So
every look at an adapter's files runs on an I/O thread of its own (an FsThread,
aiokv/store/fsthread.py, with the deadline `fs_timeout`), not the store's: an adapter
on a hung mount must not hold up the journal behind it.

- `get(name, path)`: the adapter's fingerprint as the last finished look found it, or
  None before the first look finished (the connector then gives the request no key
  root: a miss that saves nothing); either way a look is queued unless one is. The
  first look hashes the files; later ones stat them and hash again only if their
  names, sizes or modification times changed (an adapter re-saved at its path gets
  other keys a step or two after the look that saw it).
- `poll()` (once per step, from the connector's build_connector_meta): applies the
  looks finished since, as the store applies its I/O thread's results; a look past its
  deadline is logged once (the adapters waiting behind it are misses until it ends).
- An adapter whose files cannot be read gets a random fingerprint for this process:
  its blocks are hits in this life only, never after a restart.

Threading contract: `get`, `poll` and `close` on the EngineCore scheduler thread; the
looks on the adapters' I/O thread (`aiokv-lora`, started at the first LoRA request);
they meet only in the FsThread's queue and its list of finished looks.
"""

from __future__ import annotations

import collections
import logging
import os

from aiokv.connector import fingerprint
from aiokv.store.fsthread import FsThread

log = logging.getLogger("aiokv")

MAX_ADAPTERS = 1024  # adapters remembered (the oldest not being looked at are forgotten beyond)


class _Adapter:
    __slots__ = ("fp", "sig", "dir", "looking", "unread")

    def __init__(self):
        self.fp: str | None = None  # as the last finished look found it
        self.sig = None  # the files' names, sizes and modification times at that look
        self.dir: str | None = None  # the local directory the path names
        self.looking = False  # a look is queued or running
        self.unread = "unread-" + os.urandom(16).hex()  # its fingerprint while its files cannot be read


class Adapters:
    def __init__(self, deadline: float, thread: bool = True):
        """thread False: looks run at once on the caller's thread (tests, tools)."""
        self.deadline = deadline
        self._thread = thread
        self.fs: FsThread | None = None
        self._known: collections.OrderedDict[tuple, _Adapter] = collections.OrderedDict()
        self._said_stalled = False

    def get(self, name: str, path) -> str | None:
        k = (name, path)
        a = self._known.get(k)
        if a is None:
            a = self._known[k] = _Adapter()
            self._forget_old()
        self._known.move_to_end(k)
        if not a.looking:
            self._look(name, path, a)
        return a.fp

    def poll(self) -> None:
        if self.fs is None:
            return
        self.fs.poll()
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

    def close(self, timeout: float = 1.0) -> None:
        if self.fs is not None:
            self.fs.close(timeout)

    def _look(self, name: str, path, a: _Adapter) -> None:
        if self.fs is None:
            self.fs = FsThread("aiokv-lora" if self._thread else None, self.deadline)
        known, sig, d = a.fp, a.sig, a.dir
        a.looking = True

        def done(result, error):
            a.looking = False
            if error is None:
                a.fp, a.sig, a.dir = result
                return
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
            self.fs.submit(lambda: _look(path, d, sig, known), done)
        except OSError:  # closed
            a.looking = False

    def _forget_old(self) -> None:
        while len(self._known) > MAX_ADAPTERS:
            k = next((k for k, a in self._known.items() if not a.looking), None)
            if k is None:
                return
            del self._known[k]


def _look(path, d: str | None, sig, known: str | None) -> tuple[str, tuple, str]:
    """On the adapters' I/O thread: (fingerprint, signature, directory) of the adapter at
    `path`; hashed only if the files' signature is not `sig` (whose fingerprint is `known`)."""
    from aiokv.connector.namespace import local_model_dir

    if not isinstance(path, str) or not path:
        raise ValueError("no path")
    if d is None:
        d = local_model_dir(path, None)
    files, now = fingerprint.adapter_files(d)
    if now == sig and known is not None:
        return known, sig, d
    return fingerprint.adapter_fingerprint(files), now, d
