# SPDX-License-Identifier: Apache-2.0
"""End to end on real vLLM (CPU): the host-memory tier.

Bug guarded against: every aiokv hit read the disk, even for blocks this engine
saved a moment ago (vLLM's own prefix cache had dropped them), or a memory hit
served different KV than the disk would.
Invariants: with the default `memory`, a prompt computed earlier in the same
engine hits and loads every block from host memory (no byte read from disk),
token-identical to vLLM without aiokv; with `memory: 0` the same run reads them
from disk, with the same tokens; nothing leaks either way.
Fix: aiokv/worker/memory.py, wired into TransferWorker's save and load.
"""

from __future__ import annotations

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm
BS = 32
LEN = 300
FULL = (LEN - 1) // BS


def test_a_repeat_in_the_same_engine_loads_from_memory(tiny_model, tmp_path):
    ps = prompts(4, LEN, seed=31)
    # vLLM's own prefix cache off: the repeat can only hit aiokv. The middle phase waits for the
    # first phase's saves (settle) and its steps carry their reports to the scheduler.
    spec = dict(
        model=tiny_model,
        block_size=BS,
        prefix_caching=False,
        phases=[
            dict(prompts=ps, max_tokens=8),
            dict(prompts=prompts(1, 40, seed=32), max_tokens=4, settle=True),
            dict(prompts=ps, max_tokens=8),
        ],
    )
    base = run(spec)
    on = run({**spec, "cache": str(tmp_path / "on")})
    off = run({**spec, "cache": str(tmp_path / "off"), "extra": {"memory": 0}})
    assert on["tokens"][0] == on["tokens"][2]
    c, d = on["counters"], off["counters"]
    assert c["hit_blocks"] == 4 * FULL == d["hit_blocks"], (c, d)
    assert c["memory_hit_blocks"] == c["loads_ok_blocks"] == 4 * FULL, c
    assert c.get("bytes_read", 0) == 0, "a hit from memory never touches the disk"
    assert c["memory_held_bytes"] > 0
    assert d.get("memory_hit_blocks", 0) == 0 and d["bytes_read"] > 0 and d["loads_ok_blocks"] == 4 * FULL, d
    happened(on, base, hit_blocks=4 * FULL, memory_hit_blocks=4 * FULL, bytes_read=0)
    happened(off, base, hit_blocks=4 * FULL, memory_hit_blocks=0, bytes_read=">0")
