# SPDX-License-Identifier: Apache-2.0
"""The directory's layout and locations: what files a cache directory holds, their names,
and the int that names a block's place (engine, slot; drive). Part of the on-disk format
(aiokv/data/format/, docs/format.md "The layout"); version FORMAT_VERSION.

    DIR/aiokv.json                      store marker: {"magic": "aiokv", "format": 2}
    DIR/lock, DIR/lock.<E>              flock held by the live engine number 0, E; holds its pid
    DIR/control                         the operators' orders (clear, pin, unpin): sidefiles.py
    DIR/tenants.<E>                     engine E's tenant ids and tags: sidefiles.py
    DIR/wear.<E>                        bytes engine E committed since first use (JSON; store/wear.py)
    DIR/ns/<nsid hex>/namespace.json    descriptive fields, slot payload size, ranks (slot.check_namespace)
    DIR/ns/<nsid hex>/<engine dir>/     engine E's files: the namespace directory itself for
                                        engine 0, its subdirectory e<E> for E >= 1:
        rank<R>.data                    slots: slot s at offset s * slot_bytes (slot.py)
        checkpoint                      index snapshot (header + records: records.py)
        journal.<gen>                   records appended since checkpoint generation <gen> (records.py)
        index                           index image: the checkpoint's index as laid out in memory,
                                        a cache of it (records.py)
        labels                          a label per key (header + label records: sidefiles.py), for
                                        the layers above the store: vLLM's block hashes (KV events)

Each engine writes only its own files; the others follow its journal. A block
is named by its location: engine << 32 | slot (loc/split below); with several
drives, the drive's index above that (on_drive/drive_of).

Threading contract: constants and pure functions, any thread.
"""

from __future__ import annotations

__all__ = [
    "FORMAT_VERSION",
    "READS_FORMATS",
    "STORE_MAGIC",
    "MAX_ENGINES",
    "ENGINE_SHIFT",
    "SLOT_MASK",
    "loc",
    "split",
    "DRIVE_SHIFT",
    "DRIVE_MASK",
    "on_drive",
    "drive_of",
    "engine_dir",
    "data_file",
    "engine_of_dir",
    "INDEX_NAME",
    "LABELS_NAME",
    "CONTROL_NAME",
    "tenants_name",
]

# Version 2 (several engines per directory) changed the layout, not the bytes of
# a file: a version-1 directory is a version-2 directory with engine 0 alone, and
# is migrated by rewriting aiokv.json. Slot headers, checkpoints and journals
# still carry FILE_VERSION 1.
FORMAT_VERSION = 2
READS_FORMATS = (1, 2)
STORE_MAGIC = "aiokv"
MAX_ENGINES = 256  # engines on one directory at once (engine numbers 0..MAX_ENGINES-1)

# ---- locations: which engine's data file, which slot ----
ENGINE_SHIFT = 32
SLOT_MASK = (1 << ENGINE_SHIFT) - 1


def loc(engine: int, slot: int) -> int:
    """A block's location as one int (what Transfer.locations carry): engine 0's are plain slots."""
    return engine << ENGINE_SHIFT | slot


def split(location: int) -> tuple[int, int]:
    """(engine, slot) of a location."""
    return location >> ENGINE_SHIFT, location & SLOT_MASK


# ---- drives: a location handed out by several drives (aiokv/store/drives.py) also names
# the drive, by its index in the configured list, above the engine's bits; drive 0's
# locations are its store's, so a single drive's are exactly what they always were
DRIVE_SHIFT = 40
DRIVE_MASK = (1 << DRIVE_SHIFT) - 1
# the drives a location can name: aiokv/config.py's MAX_DRIVES (config checks `path` against it
# and imports nothing from the layers)


def on_drive(drive: int, location: int) -> int:
    """A drive's location (engine << 32 | slot in that drive's store) as one int naming the drive too."""
    return drive << DRIVE_SHIFT | location


def drive_of(location: int) -> tuple[int, int]:
    """(drive, the location in that drive's store) of a location from several drives."""
    return location >> DRIVE_SHIFT, location & DRIVE_MASK


def engine_dir(engine: int) -> str:
    """Engine's directory inside a namespace directory ("" for engine 0: the namespace directory)."""
    return "" if engine == 0 else f"e{engine}"


def data_file(rank: int) -> str:
    """The name of a rank's data file in an engine's directory: the one place it is spelled."""
    return f"rank{rank}.data"


def engine_of_dir(name: str) -> int | None:
    """The engine number of a subdirectory name e<E>, or None."""
    if (
        name.startswith("e")
        and name[1:].isdigit()
        and name[1:] == str(int(name[1:]))
        and 0 < int(name[1:]) < MAX_ENGINES
    ):
        return int(name[1:])
    return None


# ---- file names (the one place each is spelled) ----
INDEX_NAME = "index"  # the index image (records.py)
LABELS_NAME = "labels"  # sidefiles.py
CONTROL_NAME = "control"  # sidefiles.py


def tenants_name(engine: int) -> str:
    return f"tenants.{engine}"
