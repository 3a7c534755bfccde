# SPDX-License-Identifier: Apache-2.0
"""A read of a block in a data file that is not there is a miss at once, never a wait.

Bug: BlockIO opens data files on a thread of its own and reports the outcome to the loop
with a callback. When the open failed (another engine's data file removed: its engine was
reclaimed, its directory emptied), the callback named the exception variable of an
`except` block that Python had already deleted: it raised NameError on the loop, the open
never completed, and the read waited until its caller's timeout (a load: 30 s, then a
recompute). Invariant: a missing file is reported on the loop, the read returns a failure
for that block at once, and a second read within MISSING_RETRY does not try again.
Fix: the callback is bound to the exception when the open fails (functools.partial).
"""

import asyncio

from aiokv.data import format as fmt
from aiokv.data.blockio import BlockIO
from aiokv.data.buffers import BufferPool
from aiokv.data.choice import open_backend
from aiokv.store import Store
from aiokv.store.store import ns_dir


async def test_a_block_in_a_missing_data_file_is_a_miss_within_a_second(tmp_path):
    st = Store(str(tmp_path / "s"))
    ns = st.namespace(bytes(16), 4096)
    io = BlockIO(open_backend(asyncio.get_running_loop()), ns_dir(st.root, ns.nsid), ns.nsid, 0, 4096)
    pool = BufferPool(fmt.slot_bytes(4096), 1)
    try:
        for _ in range(2):  # the second read finds the file known missing
            res = await asyncio.wait_for(io.read([(fmt.loc(3, 0), b"k" * 16, pool.addr(0))]), 1.0)
            assert len(res) == 1 and res[0] != 0 and res[0] < 0
    finally:
        io.close()
        pool.close()
        st.close()
