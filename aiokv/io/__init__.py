"""I/O backends: batched, cancellable reads and writes of caller-owned buffers.

See backend.py for the interface and the choice between io_uring and threads.
"""
from aiokv.io.backend import IOBackend, OP_READ, OP_WRITE, open_backend

__all__ = ["IOBackend", "OP_READ", "OP_WRITE", "open_backend"]
