# SPDX-License-Identifier: Apache-2.0
"""KV layout: how a KV-cache group's tensors, as vLLM registered them, are seen as whole blocks.

The layout: for each layer, the block dimension is the one vLLM says counts
blocks (the connector asks it for two probe block counts: worker_role.block_dims),
or, where vLLM does not describe the tensor, the one whose size is the number of
blocks if only one is (GPU backends put it first or second, e.g. [2, num_blocks,
...]); a block's bytes in the payload are that layer's [block] slice, made
contiguous, layers in registration order.
Whole blocks only, never token slices: inside a block the layout is backend
and ISA specific (the CPU backend stores K transposed).

Threading contract: plain functions and a value class; Layer is built once, on the vLLM worker's
main thread (the device's construction), and only read after that, from any thread.
"""

from __future__ import annotations

import torch


class LayoutError(ValueError):
    pass


class Layer:
    """One KV tensor seen as [num_blocks, *block_shape] (a view, no copy). `dim`: the
    dimension that counts blocks, as vLLM lays the tensor out (the connector asks it:
    worker_role.block_dims); None: the one whose size is the block count, if only one is."""

    def __init__(self, name: str, t: torch.Tensor, num_blocks: int, dim: int | None = None):
        if dim is not None:
            size = t.shape[dim] if 0 <= dim < t.dim() else 0
            if size != num_blocks and (size <= num_blocks or size % num_blocks):
                raise LayoutError(
                    f"aiokv: vLLM lays out KV tensor {name} {tuple(t.shape)} with its blocks in dimension "
                    f"{dim}, which does not hold {num_blocks} blocks; this layout is not supported"
                )
            dims = [dim]
        else:
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims and t.dim() > 1 and t.shape[0] > num_blocks and t.shape[0] % num_blocks == 0:
                dims = [0]
        if len(dims) == 1 and t.shape[dims[0]] != num_blocks:
            # vLLM split each block into kernel blocks (the attention kernel's block size
            # divides the KV manager's): the dimension counts kernel blocks, those of block b
            # are b*r .. b*r+r-1, so grouping them is a view
            t = t.unflatten(dims[0], (num_blocks, t.shape[dims[0]] // num_blocks))
        if len(dims) != 1:
            raise LayoutError(
                f"aiokv: cannot tell the block dimension of KV tensor {name} {tuple(t.shape)} "
                f"for {num_blocks} blocks; this attention backend's layout is not supported"
            )
        self.name = name
        self.dim = dims[0]
        self.view = t.movedim(self.dim, 0)
        self.block_shape = tuple(self.view.shape[1:])
        self.dtype = t.dtype
        self.nbytes = t.element_size() * int(torch.Size(self.block_shape).numel())
        # not the block count (it changes with memory settings), but the dim order in memory
        order = tuple(sorted(range(t.dim()), key=lambda i: (-t.stride(i), i)))
        self.signature = (name, self.dim, self.block_shape, order, str(t.dtype))


def kv_tensors(kv_caches: dict, names) -> list[tuple[str, torch.Tensor]]:
    """The KV tensors of layers `names`, in that order, from what vLLM registered: a
    tensor per layer (both model runners on vLLM 0.32/0.33), or a list or tuple of
    tensors per layer (each of them, in order). Anything else is refused, naming the layer."""
    out = []
    for n in names:
        if n not in kv_caches:
            continue
        v = kv_caches[n]
        parts = v if isinstance(v, (list, tuple)) else [v]
        if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
            raise LayoutError(
                f"aiokv: the KV cache of layer {n} is a {type(v).__name__}, not a tensor; "
                "this attention backend's layout is not supported (run without aiokv)"
            )
        out += [(n, p) for p in parts]
    return out
