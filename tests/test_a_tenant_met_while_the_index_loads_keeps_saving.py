# SPDX-License-Identifier: Apache-2.0
"""A tenant met on another engine while our index loads keeps saving once it is in.

The bug (review of issue 40 item 6): while our index loads, following another engine gives its
tenants ids here (tenants.py `remap`), from the first id our tenants file does not name. If our
journals name that id (the file was lost or damaged, or an older aiokv's write of it failed),
`own_loaded` marks it as not to be given out in this life (`_blocked`), but the other engine's
tenant keeps it: its saves on this engine are refused for the whole life ("every tenant id is
held"), counted as skipped_tenants.
The invariant: after the index is in, every tenant can save here (ids are free); blocks of ours
whose id the file does not name count for no tenant, and the other engine's blocks for their
own tenant.
The fix: `own_loaded` moves another engine's tenant given such an id to a new id (its mapping
and the other engines' blocks here with it).
"""

from __future__ import annotations

import os
import time

from aiokv.data import format as fmt
from aiokv.store import Store
from tests.conftest import NS, PAYLOAD, key
from tests.stallfs import mounted
from tests.workers import until


def _commit(st, ns, keys, tenant):
    slots = [st.reserve(ns, k, tenant) for k in keys]
    assert None not in slots
    st.commit(ns, list(zip(keys, slots)), tenant)


def test_a_tenant_followed_while_our_index_loads_saves_once_it_is_in(tmp_path):
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        root = str(tmp_path / "mnt" / "c")
        e0 = Store(root, capacity="1GiB")  # the other engine: bob's blocks
        n0 = e0.namespace(NS, PAYLOAD)
        ours = Store(root, capacity="1GiB")  # engine 1: alice's blocks, then it stops
        assert ours.engine == 1
        _commit(ours, ours.namespace(NS, PAYLOAD), [key(i, 1) for i in range(3)], "alice")
        ours.close()
        os.unlink(os.path.join(root, fmt.tenants_name(1)))  # its tenants file is lost
        bobs = [key(i, 2) for i in range(3)]
        _commit(e0, n0, bobs, "bob")
        with open(control, "w") as f:
            f.write(f"i\n/{fmt.engine_dir(1)}/")  # engine 1's index reads wait (not engine 0's)
        st = Store(root, capacity="1GiB", io_thread=True)
        try:
            assert st.engine == 1
            ns = st.index.namespaces[NS]

            def seen():
                st.refresh()
                return all(ns.has(k) for k in bobs)

            assert until(seen, 10), "engine 0's blocks were not followed while our index loaded"
            os.unlink(control)  # our index reads answer now

            def ready():
                st.refresh()
                return ns.ready

            assert until(ready, 10)
            t = ns.tables[0]
            bob = st.tenants.lookup(st.tenants.tag("bob"))
            assert bob is not None and t.blocks_of(bob) == 3, (bob, t.tenant_blocks)

            def reserve(k, name):
                # a reservation dropped because the data file is still growing past the step's
                # budget (the I/O thread on a loaded machine) is asked again, as a later save would
                for _ in range(1000):
                    busy = st.stats.skipped_fs_busy
                    where = st.reserve(ns, k, name)
                    if where is not None or st.stats.skipped_fs_busy == busy:
                        return where
                    st.refresh()
                    time.sleep(0.01)
                return None

            got = {name: reserve(key(9, i), name) for i, name in enumerate(("bob", "alice", "carol"))}
            assert None not in got.values(), (
                f"saves refused once our index was in (a tenant id given while it loaded, then blocked): {got}; "
                f"skipped_tenants={st.stats.skipped_tenants}"
            )
        finally:
            st.close()
            e0.close()
