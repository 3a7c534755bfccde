# SPDX-License-Identifier: Apache-2.0
"""The checkpoint file: written (records sealed, a chunk at a time, sorted by slot, with
its index image; from a list of entries, or merged from the owner's Table and the files
on disk) and read back (checked against its header's count and CRC).

Threading contract: plain functions, no state of their own. A checkpoint is written by the
Store's I/O thread (or the owner at close) while the owner goes on changing the Table
(merged reads it as it is then); it is read by the thread opening the log.
"""

from __future__ import annotations

import os

import numpy as np

from aiokv import _index, _native
from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS
from aiokv.store.indeximage import IndexImage
from aiokv.store.logrecords import REC, cat, parse_records, record_tags, word_tags, words
from aiokv.store.table import Table, hash_size

CHUNK = 1 << 20  # records read, merged and written at a time by a checkpoint (64 MiB)


def records_of(entries) -> np.ndarray:
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


def entry_chunks(entries):
    """The checkpoint records of [(key, slot, atime[, tenant])], as one chunk (made when
    the writer asks for it)."""
    yield records_of(entries)


def write(dfd: int, gen: int, mark: int, chunks, image_slots: int | None, progress=None) -> tuple[int, int]:
    """Write checkpoint generation `gen` from `chunks` (record arrays sorted by slot) and
    put it in place of the old one, with an index image of `image_slots` slots beside it
    (None: no image; an old one is removed); (records written, the image's bytes). The
    directory is not synced here (the caller does). progress(): called after each chunk
    written (a checkpoint of tens of millions of blocks takes seconds: the file system
    answers meanwhile)."""
    image = IndexImage(dfd, image_slots) if image_slots is not None else None
    fd = os.open("checkpoint.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=dfd)
    try:
        count, crc, off = 0, 0, fmt.FILE_HDR_BYTES
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
            if progress is not None:
                progress()
        os.pwrite(fd, fmt.pack_file_header(fmt.CKPT_MAGIC, gen, count, crc, mark=mark), 0)
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
        return count, image.size
    try:
        os.unlink(fmt.INDEX_NAME, dir_fd=dfd)
    except FileNotFoundError:
        pass
    return count, 0


def merged(table: Table, dir_fd: int, raw: bytes):
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
    jrecs, _ = parse_records(raw)
    jrecs = jrecs[jrecs["kind"] == fmt.REC_COMMIT]
    # the newest COMMIT of each slot
    rev = jrecs["slot"][::-1]
    _, first = np.unique(rev, return_index=True)
    jrecs = jrecs[len(jrecs) - 1 - first]  # sorted by slot
    jslots = jrecs["slot"].astype(np.int64)
    old = old_checkpoint(dir_fd)
    lo, n = 0, len(tag)
    for crecs in old:
        hi = n if crecs is None else min(n, int(crecs["slot"][-1]) + 1 if len(crecs) else lo)
        if crecs is None:
            crecs = np.zeros(0, REC)
        yield merge_range(lo, max(lo, hi), tag, atime, tenant, flags, crecs, jrecs, jslots)
        lo = max(lo, hi)
    if lo < n:
        yield merge_range(lo, n, tag, atime, tenant, flags, np.zeros(0, REC), jrecs, jslots)


def merge_range(lo, hi, tag, atime, tenant, flags, crecs, jrecs, jslots):
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
        cand = words(recs)[pos[hit]]
        ok = word_tags(cand) == want[hit]
        idx = np.flatnonzero(hit)[ok]
        out[idx] = cand[ok]
        found[idx] = True
    out, live = out[found], live[found].astype(np.uint64)
    out[:, 0] = (out[:, 0] & np.uint64(0xFF00)) | np.uint64(fmt.REC_COMMIT) | (live << np.uint64(32))
    out[:, 1] = atime[live]
    out[:, 6] = tag[live]
    out[:, 7] = tenant[live].astype(np.uint64) | (flags[live].astype(np.uint64) << np.uint64(16))
    return out.reshape(-1).view(REC) if len(out) else np.zeros(0, REC)


def old_checkpoint(dir_fd: int):
    """The current checkpoint's records in chunks sorted by slot (one chunk if the
    file is not sorted: an older writer's), then None; nothing at all if there is none."""
    try:
        fd = os.open("checkpoint", os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
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


def read_checkpoint(fd: int, chunked: bool, max_slot: int):
    """The checkpoint's records (checked against its header's count and CRC); chunked
    and sorted by slot: a Table filled chunk by chunk (the file is never all in memory).
    (records or Table, its generation, its MARK, its bytes)."""
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
                return read_checkpoint(fd, False, max_slot)
            prev = int(slots[-1])
            table.tag[slots] = record_tags(recs)
            table.atime[slots] = recs["atime"]
            table.tenant[slots] = recs["tenant"]
            table.flags[slots] = recs["flags"]
        else:
            parts.append(recs)
    if c != crc:
        raise fmt.BadBlock("checkpoint checksum")
    if table is not None:
        table.count = count
        table.hash = np.zeros(hash_size(count), np.uint32)
        table._bind()
        table.probe.build(table.live().astype(np.uint64))
        table.recount()
    return (cat(parts) if table is None else table), gen, fmt.file_header_mark(head), body_end
