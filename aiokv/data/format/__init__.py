# SPDX-License-Identifier: Apache-2.0
"""The on-disk format, version 2 (paths.FORMAT_VERSION): every byte aiokv writes to a cache
directory or a bucket, its constants, packing and checking. Nothing else.

docs/format.md describes the same format for people; change both together and bump
FORMAT_VERSION when the bytes or the layout change. The parts, one job each:

    paths.py      the directory's layout (every file, listed there) and the locations of blocks
    keys.py       what a secret keys: the MAC key, tenant tags
    slot.py       a slot's header, its packing and the one check of a slot (the MAC's included)
    stamp.py      batches of slots stamped and verified in staging buffers
    records.py    journal and checkpoint records, the file header, the index image
    sidefiles.py  labels, the tenants file, the control file

Callers use the package: `from aiokv.data import format as fmt`, then fmt.X for any part's X.

Threading contract: constants and pure functions, any thread.
"""

from aiokv.data.format.keys import *  # noqa: F403
from aiokv.data.format.paths import *  # noqa: F403
from aiokv.data.format.records import *  # noqa: F403
from aiokv.data.format.sidefiles import *  # noqa: F403
from aiokv.data.format.slot import *  # noqa: F403
from aiokv.data.format.stamp import *  # noqa: F403
