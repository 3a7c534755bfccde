# SPDX-License-Identifier: Apache-2.0
"""KV-cache groups as plain data: what aiokv stores for each of vLLM's groups.

vLLM's hybrid KV-cache manager splits a model's layers into groups, each with
its own block table (block ids are unique across groups: one block pool):
- "full": full attention (also MLA, whose latent KV is the same on every TP
  rank: `replicated`, stored once per namespace by rank 0, read by every rank);
- "window": sliding-window attention; a hit needs only the blocks inside the
  window that ends at the hit (vLLM puts its null block, id 0, before it);
- "state": a recurrent-state group (gated delta net, Mamba) in vLLM's "align"
  mode; block i of its table, when not null, holds the state after (i+1)
  blocks of tokens. A hit ending after h blocks needs the state of block h-1.
Each group has its own store namespace (its own payload size and key space);
keys are the request's chained block keys, the same for every group.

Pure data and arithmetic, no vLLM imports; the connector builds these from
vLLM's kv_cache_config.

Threading contract: none needed (immutable once built); read on the scheduler
thread and, in the worker processes, by the connector.
"""

from __future__ import annotations

import dataclasses

FULL, WINDOW, STATE = "full", "window", "state"


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    index: int  # vLLM's KV-cache group index
    kind: str  # FULL, WINDOW or STATE
    payload_bytes: int  # bytes of one block across the group's layers (one rank)
    layer_names: tuple[str, ...]
    window: int = 0  # WINDOW: tokens attended back, sliding_window + extra retained tokens
    replicated: bool = False  # the same bytes on every TP rank (MLA): stored once

    def first_needed_block(self, hit_blocks: int, block_size: int) -> int:
        """The first block (index) a hit ending after `hit_blocks` blocks must load."""
        if self.kind == FULL:
            return 0
        if self.kind == STATE:
            return hit_blocks - 1
        # vLLM skips tokens before T - window + 1 (see its sliding-window manager)
        return max(0, hit_blocks * block_size - self.window + 1) // block_size
