# SPDX-License-Identifier: Apache-2.0
"""Where a failed load is reported to vLLM (worker_role.load_failures), for every kind
of model (no engine: the decision alone; on real vLLM: tests/test_model_families_e2e.py,
test_spoiled_blocks_are_recomputed_whole).

The bug: with exactly one KV-cache group, failed loads were reported block by block
(get_block_ids_with_load_errors) whatever the group's kind. vLLM cuts such a
request back to its first failed block and computes on over its block table; a
sliding-window table holds null blocks before the loaded window, a recurrent one
a single state, so the recompute read vLLM's null block: other tokens. A state
block missing at allocation travelled as block 0 and was reported too, cutting
every request whose table holds the null block.
Invariant: only one full-attention group (replicated MLA included) is reported
per block; every other model, and any failure that carried block 0, is reported
as whole requests (failed_recving: vLLM recomputes them from the start); block 0
is never reported.
"""

from __future__ import annotations

from aiokv.scheduler.layout import FULL, STATE, WINDOW, GroupSpec


def _per_block(kinds) -> bool:
    from aiokv.connector.worker_role import per_block_errors

    return per_block_errors([GroupSpec(i, k, 4096, (), replicated=False) for i, k in enumerate(kinds)])


def test_only_one_full_attention_group_is_reported_per_block():
    from aiokv.connector.worker_role import load_failures

    assert load_failures(True, {5, 6}, {"r"}) == ({5, 6}, set())
    for kinds in ([WINDOW], [STATE], [FULL, WINDOW], [FULL, STATE, STATE]):
        assert not _per_block(kinds)
        assert load_failures(_per_block(kinds), {5, 6}, {"r"}) == (set(), {"r"})
    assert _per_block([FULL])
    from aiokv.connector.worker_role import per_block_errors

    assert per_block_errors([GroupSpec(0, FULL, 4096, (), replicated=True)])  # MLA


def test_block_zero_is_never_reported():
    from aiokv.connector.worker_role import load_failures

    for per_block in (True, False):
        blocks, reqs = load_failures(per_block, {0, 7}, {"r", "s"})
        assert 0 not in blocks
        assert blocks == set() and reqs == {"r", "s"}  # whole requests instead
    assert load_failures(True, set(), set()) == (set(), set())
