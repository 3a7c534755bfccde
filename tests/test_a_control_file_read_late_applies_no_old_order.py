# SPDX-License-Identifier: Apache-2.0
"""An engine that starts while it cannot read the control file applies no old order once it can.

The bug (review of issue 40 item 5): an engine started while DIR/control was unreadable (root's,
0600, as an earlier `sudo aiokv clear` left it) starts with no orders and its read position at 0.
Once the file reads (the operator runs the `chown` its log line names), every order in it reads as
new: an old `aiokv clear` was applied again, to the blocks of its namespaces created since (no
MARK yet) and to its view of the other engines' blocks: blocks computed long after the order
were removed.
The invariant: an order is applied only to what was computed before it; blocks committed after
an order stay, ours and the other engines', whenever the file becomes readable; an order
appended after the engine started is applied as it comes.
The fix: control.py `take`: the first orders read after an opening that could not read the file
are split by their time; those older than the opening are taken as if read at opening (not
applied to the other engines' blocks; to ours only to the blocks written before each).
"""

from __future__ import annotations

import os

import pytest

from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store.control import append_order
from tests.conftest import NS, PAYLOAD, key
from tests.test_the_control_file_never_stops_an_engine import OWNER, _as_user, _commit, _seen, owned  # noqa: F401

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the engines run as another uid")


def _make(root, say):
    """(In the child.) The cache directory, made by its owner; no block yet."""
    Store(root, capacity="1GiB").close()
    return True


def _start_unreadable_then_fixed(root, say):
    """(In the child, as the owner.) Engines 0 and 1 start with the control file unreadable;
    engine 0 commits 3 blocks and 3 of alice, engine 1 3 blocks; the parent then clears alice's
    and chowns the file; what engine 0 holds and sees after that."""
    e0 = Store(root, capacity="1GiB")
    n0 = e0.namespace(NS, PAYLOAD)
    e1 = Store(root, capacity="1GiB")
    n1 = e1.namespace(NS, PAYLOAD)
    mine, alices, theirs = ([key(i, s) for i in range(3)] for s in (1, 2, 3))
    _commit(e0, n0, mine)
    slots = [e0.reserve(n0, k, "alice") for k in alices]
    e0.commit(n0, list(zip(alices, slots)), "alice")
    _commit(e1, n1, theirs)
    e0.follow_interval = 0
    before = _seen(e0, n0, theirs, 10)
    say("clear alice, chown")  # the parent does what engine 0's log line says
    for _ in range(5):
        e0.refresh()  # (each reads the control file: follow_interval 0)
    got = [before] + [sum(n0.has(k) for k in keys) for keys in (mine, alices, theirs)]
    e1.close()
    e0.close()
    return got


def test_a_control_file_that_reads_late_clears_nothing_computed_after_its_orders(owned):  # noqa: F811
    root = owned
    assert _as_user(OWNER, _make, root).get("result") is True
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        append_order(fd, "clear")  # as root: root's, 0600 (an earlier `sudo aiokv clear`)
    finally:
        os.close(fd)

    def clear_alice_and_chown(_):
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            append_order(fd, "clear", tenants=[fmt.tenant_tag("alice")])  # (after the engines started)
        finally:
            os.close(fd)
        os.chown(os.path.join(root, fmt.CONTROL_NAME), OWNER, OWNER)

    got = _as_user(OWNER, _start_unreadable_then_fixed, root, go=clear_alice_and_chown)
    assert got.get("result") == [3, 3, 0, 3], (
        "[engine 1's blocks seen; then engine 0's kept, its alice's kept, engine 1's seen] after the control "
        f"file became readable (the old clear of all applies to none of them, the new one to alice's): {got}"
    )
