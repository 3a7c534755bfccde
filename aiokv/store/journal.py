# SPDX-License-Identifier: Apache-2.0
"""Crash-consistent persistence of one namespace's index: checkpoint + journal.

Why a journal of fixed 64-byte records and not SQLite: commits come in batches
from one thread, a replay must be fast for millions of entries, and a torn tail
must simply end the replay. Each record carries its own CRC32C, so replay stops
at the first record that does not verify and the owner truncates the file there
(docs/format.md, "Index"). Bench: tools/bench_index.py.

Durability: records reach the kernel with write(2) at every commit batch, so a
kill -9 loses nothing committed; fdatasync runs at most every `sync_interval`
seconds and at close, so a power cut loses at most that window. Data blocks
verify themselves, so an index record whose block never reached the disk is a
miss on read, never wrong bytes.

Other engines on the same directory follow an engine's files with a Follower:
a full replay (a read-only IndexLog) whenever the checkpoint changes, and in
between only the records appended since the last look (one fstat when nothing
changed). A record being appended right now fails its CRC and is read again
at the next look.

Threading contract: an IndexLog or Follower is used by one thread, the Store's
owner. A read-only IndexLog (inspect) never writes and tolerates a writer beside it.
"""

from __future__ import annotations

import errno
import logging
import os
import time

import numpy as np

from aiokv import _index, _native
from aiokv.data import format as fmt
from aiokv.store.table import Table, hash_size

REC = np.dtype(fmt.REC_FIELDS)
_KEY0 = np.dtype({"names": ["k0"], "formats": ["<u8"], "offsets": [fmt.REC_KEY_AT], "itemsize": fmt.REC_BYTES})
_KINDS = bytes(fmt.REC_KINDS)
_KLENS = bytes([fmt.MIN_KEY, fmt.MAX_KEY] * len(fmt.REC_KINDS))
CHUNK = 1 << 20  # records read, merged and written at a time by a checkpoint (64 MiB)
# bytes one write(2) of an append takes at most: Linux writes at most 0x7ffff000 bytes a call
# and says so with a short count; an append of more goes in several writes
WRITE_MAX = 1 << 24

O_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


def parse_records(buf, verify: bool = True):
    """(records as a numpy array over buf, bytes they take): the records from the first
    up to the first that does not verify (CRC, when verify) or names an unknown kind or a
    key length out of bounds; what iter_records yields, in bulk."""
    n = len(buf) // fmt.REC_BYTES
    view = memoryview(buf)[: n * fmt.REC_BYTES]
    if verify:
        k = _index.records_valid(view, fmt.REC_BYTES, _KINDS, _KLENS)
    else:
        recs = np.frombuffer(view, REC, n)
        bad = ~np.isin(recs["kind"], list(fmt.REC_KINDS)) | (recs["klen"] < fmt.MIN_KEY) | (recs["klen"] > fmt.MAX_KEY)
        k = int(np.argmax(bad)) if bad.any() else n
    return np.frombuffer(view, REC, k), k * fmt.REC_BYTES


def cat(parts) -> np.ndarray:
    """Record arrays end to end (np.concatenate would repack the records' dtype)."""
    return np.frombuffer(b"".join(p.tobytes() for p in parts), REC)


def record_tags(recs) -> np.ndarray:
    """The tag of each record's key (FREE and FLAGS records: the tag they carry; checkpoint
    records: the one they carry, where they carry one)."""
    n = len(recs)
    out = np.zeros(n, np.uint64)
    if n:
        _index.record_tags(recs.view(np.uint8).reshape(-1), fmt.REC_BYTES, fmt.REC_KLEN_AT, fmt.REC_KEY_AT, out)
        given = recs["tag"] != 0
        out[given] = recs["tag"][given]
        free = (recs["kind"] == fmt.REC_FREE) | (recs["kind"] == fmt.REC_FLAGS)
        if free.any():
            out[free] = recs.view(_KEY0)["k0"][free]
    return out


def _words(recs) -> np.ndarray:
    """Records as rows of eight uint64 words (a view)."""
    return np.ascontiguousarray(recs).view(np.uint64).reshape(-1, 8)


def _word_tags(rows) -> np.ndarray:
    """record_tags of records as word rows."""
    out = np.zeros(len(rows), np.uint64)
    if len(rows):
        rows = np.ascontiguousarray(rows)
        _index.record_tags(rows.view(np.uint8).reshape(-1), fmt.REC_BYTES, fmt.REC_KLEN_AT, fmt.REC_KEY_AT, out)
        given = rows[:, 6] != 0
        out[given] = rows[given, 6]
    return out


def record_key(rec) -> bytes:
    return bytes(rec["key"])[: rec["klen"]]


def apply_records(table: Table, recs, tags, max_slot: int, watch: bool = False, tenants=None):
    """Journal records, in order, on a table (aiokv._index.apply; FLAGS records here, between
    the runs of the others); returns (indices of TOUCH records of keys it does not hold,
    [(tag, added)] if watch). A COMMIT's block gets the record's tenant (`tenants`: the
    records' tenant ids as the reader names them; None: as written) and flags; the table's
    counts follow."""
    if not len(recs):
        return np.zeros(0, np.uint32), []
    rt = recs["tenant"] if tenants is None else np.asarray(tenants, np.uint16)
    kinds = recs["kind"]
    cuts = np.flatnonzero(kinds == fmt.REC_FLAGS).tolist()
    if not cuts:
        return _apply_run(table, recs, tags, rt, max_slot, watch)
    touches, changes, start = [], [], 0
    for cut in cuts + [len(recs)]:
        if cut > start:
            t, c = _apply_run(table, recs[start:cut], tags[start:cut], rt[start:cut], max_slot, watch)
            touches.append(t + start)
            changes += c
        if cut < len(recs):
            slot = int(recs["slot"][cut])
            if slot < table.slots and table.tag[slot] == tags[cut]:
                table.set_flags(slot, int(recs["flags"][cut]))
        start = cut + 1
    touch = np.concatenate(touches).astype(np.uint32) if touches else np.zeros(0, np.uint32)
    return touch, changes


def _apply_run(table: Table, recs, tags, rt, max_slot: int, watch: bool):
    """apply_records of records without FLAGS among them."""
    commit = recs["kind"] == fmt.REC_COMMIT
    top = int(recs["slot"][commit].max()) if commit.any() else -1
    if top >= 0:
        table._cover(min(top, max_slot - 1))
    need = hash_size(table.count + int(commit.sum()))
    if need > len(table.hash):
        table._rehash(need)
    # the slots these records may change: theirs, and where their tags are now
    rslots = recs["slot"].astype(np.int64)
    where = np.full(len(recs), -1, np.int64)
    table.probe.find_many(np.ascontiguousarray(tags, np.uint64), where)
    aff = np.unique(np.concatenate([rslots[rslots < table.slots], where[where >= 0]]))
    was = aff[table.tag[aff] != 0]
    table.count_blocks(table.tenant[was], table.flags[was], -1)
    delta, touches, changes = _index.apply(
        table.probe,
        table.atime,
        np.ascontiguousarray(recs["kind"]),
        np.ascontiguousarray(recs["slot"]),
        np.ascontiguousarray(recs["atime"]),
        tags,
        min(max_slot, table.slots),
        watch,
    )
    table.count += delta
    # a COMMIT whose block holds its slot now names its tenant and flags (the last one wins)
    cs = rslots[commit]
    ok = cs < min(max_slot, table.slots)
    ok[ok] = table.tag[cs[ok]] == tags[commit][ok]
    table.tenant[cs[ok]] = rt[commit][ok]
    table.flags[cs[ok]] = recs["flags"][commit][ok]
    for f in table.fresh:  # (an order being applied leaves these: they came after it)
        f.update(cs[ok].tolist())
    gone = aff[table.tag[aff] == 0]
    table.tenant[gone] = 0
    table.flags[gone] = 0
    now = np.unique(np.concatenate([aff[table.tag[aff] != 0], cs[ok]]))
    table.count_blocks(table.tenant[now], table.flags[now], 1)
    table.changed(aff)  # (each to its place in the eviction order, or out: cs[ok] are among them)
    ch = np.frombuffer(changes, np.dtype([("tag", "<u8"), ("added", "u1")])) if watch else []
    return np.frombuffer(touches, np.uint32), [(int(t), bool(a)) for t, a in ch] if watch else []


def marks(recs) -> int:
    """The highest MARK among records (0: none)."""
    m = recs["kind"] == fmt.REC_MARK
    return int(recs["slot"][m].max()) if len(recs) and m.any() else 0


def table_of(ckpt, jrecs, max_slot: int) -> tuple[Table, np.ndarray]:
    """A table from checkpoint records (sorted by slot, or not) and journal records; and the
    indices of the journal's TOUCH records of keys it does not hold."""
    sorted_ok = len(ckpt) < 2 or bool(np.all(ckpt["slot"][1:] > ckpt["slot"][:-1]))
    ok = ckpt["slot"] < max_slot
    if sorted_ok and ok.all():
        c = ckpt
        t = Table.of(c["slot"].astype(np.uint64), record_tags(c), c["atime"], c["tenant"], c["flags"])
    else:  # an older writer's order, or damage: the records one by one, as the journal's
        t = Table()
        t.forget_order()  # (ordered once built: Table.build_order)
        apply_records(t, ckpt, record_tags(ckpt), max_slot)
    touches, _ = apply_records(t, jrecs, record_tags(jrecs), max_slot)
    return t, touches


def _records_of(entries) -> np.ndarray:
    """Checkpoint records of [(key, slot, atime)] or [(key, slot, atime, tenant)], sorted by
    slot, their tags filled in."""
    entries = sorted(entries, key=lambda e: e[1])
    out = np.zeros(len(entries), REC)
    if entries:
        out["kind"] = fmt.REC_COMMIT
        out["klen"] = [len(e[0]) for e in entries]
        out["slot"] = [e[1] for e in entries]
        out["atime"] = [e[2] for e in entries]
        out["key"] = [e[0].ljust(fmt.MAX_KEY, b"\0") for e in entries]
        out["tag"] = [_index.tag(e[0]) for e in entries]
        out["tenant"] = [e[3] if len(e) > 3 else 0 for e in entries]
    return out


def index_image_bytes(dir_fd: int) -> int:
    """Bytes an engine's index image takes (0: none)."""
    try:
        return os.stat(fmt.INDEX_NAME, dir_fd=dir_fd, follow_symlinks=False).st_size
    except OSError:
        return 0


class _Image:
    """An index image being written beside a checkpoint (format.INDEX_NAME), from the
    checkpoint's own records, a chunk (sorted by slot) at a time; slots no record names
    are zero (the file is sparse there)."""

    ZEROS = bytes(1 << 20)

    def __init__(self, dfd: int, slots: int):
        self.dfd, self.slots = dfd, slots
        self.offs = fmt.index_offsets(slots)
        self.size = self.offs[-1] + slots
        self.crcs = [0] * len(fmt.INDEX_COLUMNS)
        self.at = 0  # columns written (and CRC'd) up to this slot
        self.fd = os.open(fmt.INDEX_NAME + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_FLAGS, 0o600, dir_fd=dfd)
        os.ftruncate(self.fd, self.offs[-1] + slots)

    def _zeros(self, upto: int) -> None:
        """The columns' CRCs over zeros from self.at to upto (the file holds them: sparse)."""
        for c, (_, size) in enumerate(fmt.INDEX_COLUMNS):
            left = (upto - self.at) * size
            while left > 0:
                n = min(left, len(self.ZEROS))
                self.crcs[c] = _native.crc32c_bytes(memoryview(self.ZEROS)[:n], self.crcs[c])
                left -= n
        self.at = upto

    def add(self, recs) -> None:
        slots = recs["slot"].astype(np.int64)
        lo, hi = int(slots[0]), min(int(slots[-1]) + 1, self.slots)
        keep = slots < hi
        self._zeros(lo)
        for c, ((name, size), off) in enumerate(zip(fmt.INDEX_COLUMNS, self.offs)):
            col = np.zeros(
                hi - lo, {"tag": np.uint64, "atime": np.uint64, "tenant": np.uint16, "flags": np.uint8}[name]
            )
            col[slots[keep] - lo] = recs[name][keep]
            data = memoryview(col.view(np.uint8))
            self.crcs[c] = _native.crc32c_bytes(data, self.crcs[c])
            pos = off + lo * size
            while data:
                w = os.pwrite(self.fd, data, pos)
                data, pos = data[w:], pos + w
        self.at = hi

    def finish(self, gen: int, count: int, ckpt: tuple[int, int, int]) -> None:
        self._zeros(self.slots)
        os.pwrite(self.fd, fmt.pack_index_header(gen, count, self.slots, self.crcs, ckpt), 0)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None

    def drop(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(fmt.INDEX_NAME + ".tmp", dir_fd=self.dfd)
        except OSError:
            pass


def _read_file(name: str, dir_fd: int) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | O_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 24)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


class IndexLog:
    """Checkpoint + journal files of one namespace directory, opened relative to
    its descriptor `dir_fd` (owned by the caller; dirs.py)."""

    def __init__(self, ns_dir: str, dir_fd: int, readonly: bool = False, sync_interval: float = 1.0):
        self.dir = ns_dir  # for messages
        self.dir_fd = dir_fd
        self.readonly = readonly
        self.sync_interval = sync_interval
        self.gen = 0
        self.records = 0  # records in the current journal
        self.fd: int | None = None
        self.size = 0  # bytes of the journal file that hold whole records
        self._last_sync = time.monotonic()
        self.torn_bytes = 0  # bytes dropped from a torn journal tail at open
        self.lost_journal = 0  # bytes of a journal whose header did not verify (read-only openers drop it)
        self.ckpt_bytes = 0  # size of the current checkpoint file
        self._dirty = False
        self.sync_failures = 0  # fdatasync failures in a row (sync_if_due)
        self.touches: list[tuple[bytes, int]] = []  # TOUCH records of keys this journal does not hold
        self.beyond = 0  # records naming slots past the file system's size, left out (load_table)
        self.image_bytes = index_image_bytes(dir_fd)  # the index image's size (capacity counts it)
        self.mark = 0  # the control records its index has applied (checkpoint header, MARK records)
        # an append failed since the last checkpoint: a replay may differ from the owner's index
        # (a DROP not written brings its block back); a tenant id is given anew only once it is not
        self.diverged = False

    def _journal_path(self, gen: int) -> str:
        return os.path.join(self.dir, self._journal_name(gen))

    @staticmethod
    def _journal_name(gen: int) -> str:
        return f"journal.{gen}"

    def load(self) -> dict[bytes, tuple[int, int]]:
        """Replay checkpoint then journal; return key -> (slot, atime) (tools and tests;
        the store loads a Table: load_table)."""
        ckpt, jrecs = self._read(chunked=False)
        entries: dict[bytes, tuple[int, int]] = {}
        by_slot: dict[int, bytes] = {}
        for recs, journal in ((ckpt, False), (jrecs, True)):
            tags = record_tags(recs) if journal else None
            for i, r in enumerate(recs):
                kind, slot, atime = int(r["kind"]), int(r["slot"]), int(r["atime"])
                if kind in (fmt.REC_FLAGS, fmt.REC_MARK):
                    self.mark = max(self.mark, slot) if kind == fmt.REC_MARK else self.mark
                    continue
                if kind == fmt.REC_FREE:
                    k = by_slot.get(slot)
                    if k is not None and _index.tag(k) == int(tags[i]) and entries.get(k, (None,))[0] == slot:
                        del entries[k]
                    continue
                key = record_key(r)
                if kind == fmt.REC_COMMIT or not journal:
                    entries[key] = (slot, atime)
                    by_slot[slot] = key
                elif kind == fmt.REC_DROP:
                    entries.pop(key, None)
                elif key in entries:  # TOUCH: our key was used by us or another engine
                    entries[key] = (entries[key][0], max(atime, entries[key][1]))
                else:  # a hit on another engine's block: for that engine's followers
                    self.touches.append((key, atime))
        # A slot claimed twice means a bug or a hand-made file: keep the newest claim only.
        newest: dict[int, tuple[int, bytes]] = {}
        for key, (slot, atime) in entries.items():
            if slot in newest and newest[slot][0] >= atime:
                continue
            newest[slot] = (atime, key)
        keep = {k for _, k in newest.values()}
        return {k: v for k, v in entries.items() if k in keep}

    def load_table(self, max_slot: int) -> Table:
        """Replay checkpoint then journal into a Table (slots at or past max_slot, beyond the
        file system, are damage and left out); TOUCH records of keys it does not hold are
        kept in `touches` (for that key's holder)."""
        got = self._read(chunked=True, max_slot=max_slot)
        commits = got[1][got[1]["kind"] == fmt.REC_COMMIT]
        self.beyond = int((commits["slot"] >= max_slot).sum())
        if not isinstance(got[0], Table):
            self.beyond += int((got[0]["slot"] >= max_slot).sum())
        if isinstance(got[0], Table):
            table, jrecs = got
            touch, _ = apply_records(table, jrecs, record_tags(jrecs), max_slot)
        else:
            table, touch = table_of(got[0], got[1], max_slot)
        jrecs = got[1]
        self.mark = max(self.mark, marks(jrecs))
        self.touches += [(record_key(jrecs[i]), int(jrecs[i]["atime"])) for i in touch.tolist()]
        return table

    def _read(self, chunked: bool, max_slot: int = 1 << 32):
        """Read the checkpoint and journal, set this log's state (generation, sizes, the
        journal open for appends when not read-only); (checkpoint records or a Table built
        from them, journal records)."""
        ckpt = np.zeros(0, REC)
        fd = None
        try:
            fd = os.open("checkpoint", os.O_RDONLY | O_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        if fd is not None:
            try:
                image = self._read_image(fd, max_slot) if chunked else None
                ckpt = image if image is not None else self._read_checkpoint(fd, chunked, max_slot)
            except fmt.BadBlock as e:
                raise fmt.BadBlock(
                    f"{self.dir}/checkpoint is corrupt ({e}); the engine rebuilds it from the blocks "
                    f"when it opens the store, or run: aiokv inspect --repair {os.path.dirname(os.path.dirname(self.dir))}"
                ) from e
            finally:
                os.close(fd)
        jpath = self._journal_path(self.gen)
        raw = _read_file(self._journal_name(self.gen), self.dir_fd)
        valid = 0
        journal_ok = False
        jrecs = np.zeros(0, REC)
        if raw is not None and len(raw) >= fmt.FILE_HDR_BYTES:
            try:
                gen, _, _ = fmt.unpack_file_header(raw, fmt.JOURNAL_MAGIC)
            except fmt.BadBlock:
                gen = -1
            if gen != self.gen and not self.readonly:
                # The owner must not drop these records and then reclaim their
                # slots as unused: it rebuilds the index from the slot headers.
                raise fmt.BadBlock(f"{jpath} has a bad header")
            if gen != self.gen:
                self.lost_journal = len(raw)
                logging.getLogger("aiokv").warning(
                    "aiokv: %s has a bad header; the %d index records in it since the last checkpoint are "
                    "dropped (their blocks become misses)",
                    jpath,
                    (len(raw) - fmt.FILE_HDR_BYTES) // fmt.REC_BYTES,
                )
            if gen == self.gen:
                journal_ok = True
                body = raw[fmt.FILE_HDR_BYTES :]
                jrecs, valid = parse_records(body)
                self.records += len(jrecs)
                self.torn_bytes = len(body) - valid
                self.size = fmt.FILE_HDR_BYTES + valid
        if not self.readonly:
            self._open_journal(valid, journal_ok)
        return ckpt, jrecs

    def _read_image(self, fd: int, max_slot: int) -> Table | None:
        """The Table of the checkpoint (open as fd) from its index image, if there is one
        written with this very checkpoint file (generation, count, and the file's inode,
        mtime and size: a checkpoint changed since is read instead), whose columns verify
        and fit max_slot; else None (the records are read). The checkpoint's own CRC is not
        read here: damage to its body alone (bit rot under an intact header, mtime and
        image) costs the keys of those records at the next checkpoint (their tags do not
        match: left out, misses), and `aiokv inspect`, which reads the records, reports it."""
        try:
            head = os.pread(fd, fmt.FILE_HDR_BYTES, 0)
            gen, count, _ = fmt.unpack_file_header(head, fmt.CKPT_MAGIC)
            ifd = os.open(fmt.INDEX_NAME, os.O_RDONLY | O_FLAGS, dir_fd=self.dir_fd)
        except (OSError, fmt.BadBlock):
            return None
        try:
            igen, icount, slots, crcs, ident = fmt.unpack_index_header(os.pread(ifd, fmt.INDEX_HDR_BYTES, 0))
            offs = fmt.index_offsets(slots)
            st = os.fstat(fd)
            if (
                (igen, icount) != (gen, count)
                or ident != (st.st_ino, st.st_mtime_ns, st.st_size)  # the checkpoint changed since
                or slots > max_slot
                or os.fstat(ifd).st_size < offs[-1] + slots
            ):
                return None
            t = Table(slots)
            for (name, _), off, crc in zip(fmt.INDEX_COLUMNS, offs, crcs):
                col = memoryview(getattr(t, name).view(np.uint8))
                done = 0
                while done < len(col):
                    r = os.preadv(ifd, [col[done:]], off + done)
                    if r <= 0:
                        return None
                    done += r
                if _native.crc32c_bytes(col) != crc:
                    return None
        except (OSError, fmt.BadBlock):
            return None
        finally:
            os.close(ifd)
        live = t.live()
        if len(live) != count:
            return None
        t.count = count
        t.hash = np.zeros(hash_size(count), np.uint32)
        t._bind()
        t.probe.build(live.astype(np.uint64))
        t.recount()
        self.gen = gen
        self.mark = fmt.file_header_mark(head)
        self.ckpt_bytes = fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES
        return t

    def _read_checkpoint(self, fd: int, chunked: bool, max_slot: int):
        """The checkpoint's records (checked against its header's count and CRC); chunked
        and sorted by slot: a Table filled chunk by chunk (the file is never all in memory)."""
        head = os.pread(fd, fmt.FILE_HDR_BYTES, 0)
        gen, count, crc = fmt.unpack_file_header(head, fmt.CKPT_MAGIC)
        size = os.fstat(fd).st_size
        if size < fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES:
            raise fmt.BadBlock("checkpoint checksum")
        body_end = fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES
        table = None
        if chunked and count:
            last = np.frombuffer(os.pread(fd, fmt.REC_BYTES, body_end - fmt.REC_BYTES), REC)
            table = Table(min(int(last["slot"][0]), max_slot - 1) + 1)
        got, prev, c, parts = 0, -1, 0, []
        while got < count:
            n = min(CHUNK, count - got)
            off = fmt.FILE_HDR_BYTES + got * fmt.REC_BYTES
            buf = bytearray(n * fmt.REC_BYTES)
            view, done = memoryview(buf), 0
            while done < len(buf):
                r = os.preadv(fd, [view[done:]], off + done)
                if r <= 0:
                    raise fmt.BadBlock("checkpoint checksum")
                done += r
            c = _native.crc32c_bytes(buf, c)
            recs, _ = parse_records(buf, verify=False)
            if len(recs) != n:
                raise fmt.BadBlock("checkpoint record")
            got += n
            if table is not None:
                slots = recs["slot"]
                if slots[0] <= prev or np.any(slots[1:] <= slots[:-1]) or int(slots[-1]) >= table.slots:
                    # not sorted by slot (an older writer) or damage: all of it at once
                    return self._read_checkpoint(fd, False, max_slot)
                prev = int(slots[-1])
                table.tag[slots] = record_tags(recs)
                table.atime[slots] = recs["atime"]
                table.tenant[slots] = recs["tenant"]
                table.flags[slots] = recs["flags"]
            else:
                parts.append(recs)
        if c != crc:
            raise fmt.BadBlock("checkpoint checksum")
        self.gen = gen
        self.mark = fmt.file_header_mark(head)
        self.ckpt_bytes = body_end
        if table is not None:
            table.count = count
            table.hash = np.zeros(hash_size(count), np.uint32)
            table._bind()
            table.probe.build(table.live().astype(np.uint64))
            table.recount()
            return table
        return cat(parts)

    def _open_journal(self, valid: int, exists: bool) -> None:
        name, dfd = self._journal_name(self.gen), self.dir_fd
        if exists:
            self.fd = os.open(name, os.O_RDWR | O_FLAGS, dir_fd=dfd)
            os.ftruncate(self.fd, fmt.FILE_HDR_BYTES + valid)  # cut a torn tail
            self.size = os.lseek(self.fd, 0, os.SEEK_END)
            head = os.pread(self.fd, fmt.FILE_HDR_BYTES, 0)
            if int.from_bytes(head[8:10], "little") < fmt.JOURNAL_VERSION:
                # an older version's journal, read as it is: what we append is of this version,
                # and its header says so, so a reader of the older version refuses it whole
                # rather than stop at our first record as if it were torn
                os.pwrite(self.fd, fmt.JOURNAL_VERSION.to_bytes(2, "little"), 8)
                os.fsync(self.fd)
        else:
            self.fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_FLAGS, 0o600, dir_fd=dfd)
            os.write(self.fd, fmt.pack_file_header(fmt.JOURNAL_MAGIC, self.gen))
            os.fsync(self.fd)
            self.size = fmt.FILE_HDR_BYTES
        # journals of other generations are leftovers of an interrupted checkpoint
        for other in os.listdir(dfd):
            if other.startswith("journal.") and other != name:
                os.unlink(other, dir_fd=dfd)
        if not exists:
            os.fsync(dfd)  # the new journal's name (and the old one's removal) survive a power cut

    def append(self, records, mark: int = 0) -> None:
        """Append records (a list, or bytes of records end to end), all or none: a failed write is cut off again,
        so a later append never lands behind a torn record (a kill -9 between two writes of a large
        append leaves whole records of it: each applies alone)."""
        if not records:
            return
        data = records if isinstance(records, (bytes, bytearray)) else b"".join(records)
        count = len(data) // fmt.REC_BYTES
        try:
            view, done = memoryview(data), 0
            while done < len(view):  # (in writes of at most WRITE_MAX bytes)
                w = os.write(self.fd, view[done : done + WRITE_MAX])
                if w <= 0:
                    raise OSError(errno.ENOSPC, "short journal write")
                done += w
        except OSError:
            self.diverged = True
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass  # the next append overwrites the torn bytes from self.size on
            os.lseek(self.fd, self.size, os.SEEK_SET)
            raise
        self.size += len(data)
        self.records += count
        self.mark = max(self.mark, mark)
        self._dirty = True
        try:
            self.sync_if_due()
        except OSError as e:
            # The records are written (a kill -9 keeps them); only power-cut
            # durability is in doubt, and the blocks verify themselves. The
            # batch stands; the sync is tried again later.
            logging.getLogger("aiokv").warning("aiokv: journal fdatasync failed (%s)", os.strerror(e.errno or 0))

    @property
    def disk_bytes(self) -> int:
        """Bytes the journal and checkpoint files take (capacity counts them)."""
        return self.size + self.ckpt_bytes + self.image_bytes

    def sync_if_due(self) -> None:
        """fdatasync if the last one is sync_interval old. A failing disk is tried once per
        interval, not at every call; only the first failure of a run raises (the caller says
        it: one line), later ones are counted in `sync_failures` until a sync succeeds."""
        if self._dirty and self.fd is not None:
            now = time.monotonic()
            if now - self._last_sync >= self.sync_interval:
                self._last_sync = now  # (a failing one is tried again an interval later)
                try:
                    self.sync()
                except OSError:
                    self.sync_failures += 1
                    if self.sync_failures == 1:
                        raise

    def sync(self) -> None:
        """fdatasync what was appended since the last sync (nothing if nothing was)."""
        if self._dirty and self.fd is not None:
            os.fdatasync(self.fd)
            self._last_sync = time.monotonic()
            self._dirty = False
            self.sync_failures = 0

    def checkpoint(self, entries) -> None:
        """Write a snapshot and start an empty journal. `entries`: [(key, slot, atime)], or
        the owner's Table of this namespace, whose keys are found in this log's files (the
        checkpoint and journal now on disk) by slot: see _merged."""
        gen = self.gen + 1
        dfd = self.dir_fd
        if isinstance(entries, Table):
            live = np.flatnonzero(entries.tag)  # (the image ends at the last block: it counts against the capacity)
            image = _Image(dfd, int(live[-1]) + 1 if len(live) else 0)
        else:
            image = None
        fd = os.open("checkpoint.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_FLAGS, 0o600, dir_fd=dfd)
        try:
            count, crc, off = 0, 0, fmt.FILE_HDR_BYTES
            chunks = self._merged(entries) if isinstance(entries, Table) else [_records_of(entries)]
            for recs in chunks:
                if not len(recs):
                    continue
                if image is not None:
                    image.add(recs)
                _index.seal(recs.view(np.uint8).reshape(-1), fmt.REC_BYTES)
                data = memoryview(recs.view(np.uint8).reshape(-1))
                crc = _native.crc32c_bytes(data, crc)
                while data:
                    w = os.pwrite(fd, data, off)
                    data, off = data[w:], off + w
                count += len(recs)
            os.pwrite(fd, fmt.pack_file_header(fmt.CKPT_MAGIC, gen, count, crc, mark=self.mark), 0)
            os.fsync(fd)
            if image is not None:
                st = os.fstat(fd)  # (the checkpoint as it will stay: renamed, never written again)
                image.finish(gen, count, (st.st_ino, st.st_mtime_ns, st.st_size))
        except BaseException:
            if image is not None:
                image.drop()
            raise
        finally:
            os.close(fd)
        os.replace("checkpoint.tmp", "checkpoint", src_dir_fd=dfd, dst_dir_fd=dfd)
        if image is not None:  # (after the checkpoint: an image never names a generation not on disk)
            os.replace(fmt.INDEX_NAME + ".tmp", fmt.INDEX_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
            self.image_bytes = image.size
        else:
            try:
                os.unlink(fmt.INDEX_NAME, dir_fd=dfd)
            except FileNotFoundError:
                pass
            self.image_bytes = 0
        os.fsync(dfd)
        self.ckpt_bytes = fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES
        old = self.fd
        self.gen, self.records = gen, 0
        self._open_journal(0, exists=False)
        self.diverged = False
        if old is not None:
            os.close(old)

    def _merged(self, table: Table, raw: bytes | None = None):
        """The checkpoint of the owner's table, a chunk of records at a time, sorted by slot.

        Runs on the I/O thread while the owner goes on changing the table. It reads the
        table's tags and atimes as they are now, later than the records queued before this
        checkpoint (all written: the I/O thread runs in order), and takes each block's key
        from the files by its slot: the newest COMMIT of that slot in the journal, else the
        current checkpoint's record. A slot whose key found there has another tag (the
        block came after this checkpoint was queued: its COMMIT is in the next journal) is
        left out; so is a block whose record did not make it to disk. Replaying the next
        journal over this checkpoint gives the owner's state: every record after the cut
        is in it, and each applies the same over a later state (COMMIT puts, DROP and FREE
        clear, TOUCH raises)."""
        tag, atime, tenant, flags = table.tag, table.atime, table.tenant, table.flags  # kept: the owner replaces them
        if raw is None:
            raw = b""
            if self.fd is not None and self.size > fmt.FILE_HDR_BYTES:
                raw = os.pread(self.fd, self.size - fmt.FILE_HDR_BYTES, fmt.FILE_HDR_BYTES)
        jrecs, _ = parse_records(raw)
        jrecs = jrecs[jrecs["kind"] == fmt.REC_COMMIT]
        # the newest COMMIT of each slot
        rev = jrecs["slot"][::-1]
        _, first = np.unique(rev, return_index=True)
        jrecs = jrecs[len(jrecs) - 1 - first]  # sorted by slot
        jslots = jrecs["slot"].astype(np.int64)
        old = self._old_checkpoint()
        lo, n = 0, len(tag)
        for crecs in old:
            hi = n if crecs is None else min(n, int(crecs["slot"][-1]) + 1 if len(crecs) else lo)
            if crecs is None:
                crecs = np.zeros(0, REC)
            yield self._merge_range(lo, max(lo, hi), tag, atime, tenant, flags, crecs, jrecs, jslots)
            lo = max(lo, hi)
        if lo < n:
            yield self._merge_range(lo, n, tag, atime, tenant, flags, np.zeros(0, REC), jrecs, jslots)

    @staticmethod
    def _merge_range(lo, hi, tag, atime, tenant, flags, crecs, jrecs, jslots):
        """The checkpoint records of the live slots in [lo, hi) (records handled as rows of
        eight 64-bit words: numpy moves those as fast as memory, not field by field)."""
        live = lo + np.flatnonzero(tag[lo:hi])
        want = tag[live]
        out = np.zeros((len(live), 8), np.uint64)
        found = np.zeros(len(live), bool)
        for recs, rslots in ((crecs, crecs["slot"].astype(np.int64)), (jrecs, jslots)):  # the journal last: it wins
            if not len(recs):
                continue
            pos = np.searchsorted(rslots, live)
            pos = np.minimum(pos, len(rslots) - 1)
            hit = rslots[pos] == live
            cand = _words(recs)[pos[hit]]
            ok = _word_tags(cand) == want[hit]
            idx = np.flatnonzero(hit)[ok]
            out[idx] = cand[ok]
            found[idx] = True
        out, live = out[found], live[found].astype(np.uint64)
        out[:, 0] = (out[:, 0] & np.uint64(0xFF00)) | np.uint64(fmt.REC_COMMIT) | (live << np.uint64(32))
        out[:, 1] = atime[live]
        out[:, 6] = tag[live]
        out[:, 7] = tenant[live].astype(np.uint64) | (flags[live].astype(np.uint64) << np.uint64(16))
        return out.reshape(-1).view(REC) if len(out) else np.zeros(0, REC)

    def _old_checkpoint(self):
        """The current checkpoint's records in chunks sorted by slot (one chunk if the
        file is not sorted: an older writer's), then None; nothing at all if there is none."""
        try:
            fd = os.open("checkpoint", os.O_RDONLY | O_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            yield None
            return
        try:
            try:
                _, count, _ = fmt.unpack_file_header(os.pread(fd, fmt.FILE_HDR_BYTES, 0), fmt.CKPT_MAGIC)
            except fmt.BadBlock:
                count = 0
            chunks = []
            for got in range(0, count, CHUNK):
                n = min(CHUNK, count - got)
                buf = os.pread(fd, n * fmt.REC_BYTES, fmt.FILE_HDR_BYTES + got * fmt.REC_BYTES)
                recs, _ = parse_records(buf, verify=False)
                if not chunks and len(recs) and recs["tag"][0] != 0:
                    yield recs  # ours: sorted by slot, its records carry their tags
                    continue
                chunks.append(recs)
            if chunks:  # an older writer's, in no order: all of it, sorted, at once
                allr = cat(chunks)
                yield allr[np.argsort(allr["slot"], kind="stable")]
        finally:
            os.close(fd)
        yield None

    def close(self) -> None:
        """Never raises: a last fdatasync that fails is said (the records are written; only
        their power-cut durability is in doubt) and the descriptor is closed either way."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                if self._dirty:
                    os.fdatasync(fd)
            except OSError as e:
                if not self.sync_failures:  # (a run of failures is said once)
                    logging.getLogger("aiokv").warning(
                        "aiokv: journal fdatasync at close failed (%s)", os.strerror(e.errno or 0)
                    )
            finally:
                os.close(fd)


class KeyMap:
    """slot -> key of the blocks an engine's files name, in arrays (sorted slots, keys)."""

    def __init__(self, recs=None):
        recs = np.zeros(0, REC) if recs is None else recs
        self.slots = recs["slot"].astype(np.int64)
        self.keys = np.ascontiguousarray(recs["key"])
        self.klens = np.ascontiguousarray(recs["klen"])
        self.tags = np.ascontiguousarray(recs["tag"])

    def __len__(self) -> int:
        return len(self.slots)

    def get(self, slot: int, default=None):
        i = int(np.searchsorted(self.slots, slot))
        if i < len(self.slots) and self.slots[i] == slot:
            return bytes(self.keys[i])[: self.klens[i]]
        return default

    def __getitem__(self, slot: int) -> bytes:
        k = self.get(slot)
        if k is None:
            raise KeyError(slot)
        return k

    def keys_of(self, slots, tags) -> list[bytes | None]:
        """The key of each slot whose key here has the tag given for it (else None)."""
        slots = np.asarray(slots, np.int64)
        out: list[bytes | None] = [None] * len(slots)
        if not len(self.slots) or not len(slots):
            return out
        pos = np.minimum(np.searchsorted(self.slots, slots), len(self.slots) - 1)
        ok = (self.slots[pos] == slots) & (self.tags[pos] == np.asarray(tags, np.uint64))
        for j in np.flatnonzero(ok).tolist():
            i = int(pos[j])
            out[j] = bytes(self.keys[i])[: self.klens[i]]
        return out


def read_keys(ns_dir: str, dir_fd: int) -> KeyMap:
    """slot -> key (a KeyMap) of the blocks an engine's files (checkpoint, journal) name,
    read-only: for the views that hand out keys (tools and tests), in bulk."""
    log = IndexLog(ns_dir, dir_fd, readonly=True)
    try:
        table = log.load_table(1 << 32)
    except fmt.BadBlock:
        return KeyMap()
    raw = _read_file(log._journal_name(log.gen), dir_fd) or b""
    raw = raw[fmt.FILE_HDR_BYTES : log.size] if log.size else b""
    parts = [r for r in log._merged(table, raw) if len(r)]
    return KeyMap(cat(parts) if parts else None)


class Follower:
    """Another engine's checkpoint + journal of one namespace, read-only, followed
    as it grows. `poll` returns what changed since the last call.

    When the engine writes a checkpoint, a follower that had applied all of the
    old journal does not replay the new checkpoint (seconds per million blocks,
    on the scheduler thread): it reads what is left of the old journal through
    its open descriptor (the owner appends nothing after its checkpoint), checks
    the new checkpoint's generation and record count against what it holds
    (`roll`), and follows the new journal. Anything else is a full replay."""

    def __init__(self, ns_dir: str, dir_fd: int):
        self.dir = ns_dir
        self.dir_fd = dir_fd  # owned by the caller
        self.fd: int | None = None  # journal.<gen>, read-only
        self.off = 0  # bytes of it applied (whole, verified records)
        self.gen = 0  # generation followed
        self.ckpt = None  # identity of the checkpoint (inode, size, mtime) or None
        self.ckpt_bytes = 0
        self.replayed = False
        self.log: IndexLog | None = None  # the last full replay (torn bytes, touches)
        self.broken: tuple | None = None  # checkpoint identity that did not verify: not retried until it changes
        self.records = 0  # records of the current generation seen (replayed or tailed)
        self.max_slot = 1 << 32  # slots at or past it are damage (the caller's file system's size)
        self.image_bytes = 0  # its index image's size, as of the last replay or roll

    def _ckpt_ident(self):
        try:
            st = os.stat("checkpoint", dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    @property
    def disk_bytes(self) -> int:
        return self.off + self.ckpt_bytes + self.image_bytes

    def poll(self, max_slot: int = 1 << 32):
        """What changed since the last call: ("reset", Table) after a full replay
        (first call, or the engine restarted its files; slots at or past max_slot left
        out); ("tail", records) for records appended since (a numpy array of them:
        parse_records); ("roll", records, count) when the engine wrote a checkpoint of
        `count` entries after those records (the caller checks it holds `count` of that
        engine's blocks, else calls `forget` for a full replay next time); None when
        nothing changed. Raises fmt.BadBlock for a corrupt checkpoint (once per version
        of it)."""
        self.max_slot = max_slot
        ident = self._ckpt_ident()
        if self.replayed and ident == self.ckpt:
            if self.fd is None:  # the journal did not exist yet at the last look
                self._open(self.gen)
                if self.fd is None:
                    return None
            if os.fstat(self.fd).st_size < self.off:  # cut or recreated by a new owner of those files
                return self._replay(ident)
            recs = self._tail()
            return ("tail", recs) if len(recs) else None
        if ident is not None and ident == self.broken:
            return None
        if self.replayed and self.fd is not None and ident is not None:
            rolled = self._roll(ident)
            if rolled is not None:
                return rolled
        return self._replay(ident)

    def forget(self) -> None:
        """The caller's view disagrees with the files: replay them at the next poll."""
        self.replayed = False

    def _tail(self):
        size = os.fstat(self.fd).st_size
        if size <= self.off:
            return np.zeros(0, REC)
        raw = os.pread(self.fd, size - self.off, self.off)
        recs, _ = parse_records(raw)  # up to the first record that does not verify (yet)
        self.off += len(recs) * fmt.REC_BYTES
        self.records += len(recs)
        return recs

    def _roll(self, ident):
        recs = self._tail()  # the rest of the old journal, still readable through our descriptor
        try:
            fd = os.open("checkpoint", os.O_RDONLY | O_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return None
        try:
            gen, count, _ = fmt.unpack_file_header(os.pread(fd, fmt.FILE_HDR_BYTES, 0), fmt.CKPT_MAGIC)
            if gen != self.gen + 1 or os.fstat(fd).st_ino != ident[0]:
                return None
        except fmt.BadBlock:
            return None
        finally:
            os.close(fd)
        self.close()
        self.gen, self.ckpt, self.ckpt_bytes, self.records = gen, ident, fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES, 0
        self.image_bytes = index_image_bytes(self.dir_fd)
        self._open(gen)
        if self.fd is not None:
            recs = cat([recs, self._tail()])
        return "roll", recs, count

    def _replay(self, ident):
        log = IndexLog(self.dir, self.dir_fd, readonly=True)
        try:
            table = log.load_table(self.max_slot)
        except fmt.BadBlock:
            self.broken = ident
            raise
        table.mark = log.mark  # (the control orders its owner has applied: control.py)
        self.log, self.ckpt, self.replayed = log, ident, True
        self.image_bytes = log.image_bytes
        self.gen, self.ckpt_bytes, self.records = log.gen, log.ckpt_bytes, log.records
        self.close()
        self._open(log.gen)
        if self.fd is not None and log.size:
            self.off = log.size  # the records the replay applied; the rest is tailed
        return "reset", table

    def _open(self, gen: int) -> None:
        try:
            self.fd = os.open(IndexLog._journal_name(gen), os.O_RDONLY | O_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            self.fd = None
            return
        self.off = fmt.FILE_HDR_BYTES

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None  # (gone even if close reports an error)
            os.close(fd)
