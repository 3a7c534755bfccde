# SPDX-License-Identifier: Apache-2.0
"""The data path: BlockIO (blockio.py) reads and writes slots of the data files in the
on-disk format (the format/ package), through the I/O backends: batched, cancellable reads and writes
of caller-owned buffers.

See backend.py for the interface, choice.py for the choice between io_uring and threads.
"""

from aiokv.data.backend import OP_READ, OP_WRITE, IOBackend
from aiokv.data.choice import open_backend

__all__ = ["IOBackend", "OP_READ", "OP_WRITE", "open_backend"]
