# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`: what a cache directory holds, and whether its blocks verify.

Read-only by default and safe beside running engines: every engine's index is
replayed with Store(readonly=True) (no lock, no writes; a torn journal tail just
ends the replay) and data files are opened O_RDONLY. The summary lists every
engine that has used the directory (its number, pid while it runs, blocks). A replay that raced with a
checkpoint (the journal it wanted was deleted, or a namespace was half made)
is tried again, up to three replays in all. Only --repair writes, and only as
the owner of each engine's files in turn: it refuses to run while any engine
runs on the directory.

--verify reads every committed block of every rank and checks the slot header
(magic, version, namespace, rank, key, length, header CRC32C) and the payload
CRC32C, with a progress bar (tqdm) on stderr when it is a terminal. The layout tag is not checked: inspect does not know the reader's KV
layout, and a block written under another layout is not damaged. A block that
fails while an engine is writing is re-checked against a fresh replay, so a
slot the engine evicted and rewrote meanwhile is not reported as corrupt.

Errors a user can cause (not a store, locked, unreadable) are InspectError:
one line, exit status 2.

`--format json` documents carry "schema": SCHEMA; docs/inspect-json.md and
docs/inspect-schema.json describe them. Adding a field keeps SCHEMA; renaming,
removing or changing the meaning of one raises it.

At node scale (tens of millions of blocks) nothing holds a Python object per
block: the figures are counted over the replayed index a slot range at a time,
--keys and --verify take the keys from the engines' files a batch at a time, and
their lists (every key, every corrupt block) are Rows, written as they are made
(tools/bench_inspect.py measures it).

The parts, one job each: opening.py (opening read-only, retried; InspectError),
summary.py (the summary document), keylist.py (the --keys document),
blockkeys.py (keys from an engine's files by slot), slots.py (reading and
checking slots), verify.py (the --verify document and --repair), rows.py (long
lists made and written a batch at a time), render.py (the text output). This
module is the interface main.py and other callers use.

Threading: one thread (the CLI's); --verify runs its own event loop.
"""

from aiokv.cli.keylist import keys
from aiokv.cli.opening import SCHEMA, InspectError, open_readonly
from aiokv.cli.render import human, human_age, render_keys, render_summary, render_verify
from aiokv.cli.rows import Rows, write_json, write_text
from aiokv.cli.slots import check_slot
from aiokv.cli.summary import summary
from aiokv.cli.verify import verify

__all__ = [
    "SCHEMA",
    "InspectError",
    "Rows",
    "check_slot",
    "human",
    "human_age",
    "keys",
    "open_readonly",
    "render_keys",
    "render_summary",
    "render_verify",
    "summary",
    "verify",
    "write_json",
    "write_text",
]
