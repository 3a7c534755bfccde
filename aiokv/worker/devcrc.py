# SPDX-License-Identifier: Apache-2.0
"""CRC32C of each row of a byte tensor, by torch's own ops, on the tensor's device.

Why: on the CUDA path a block's bytes reach the host by DMA and go to the drive by DMA;
the one pass of the host's cores over them was the payload CRC32C (0.06-0.12 core-s per
GB, docs/benchmarks.md "Where the time goes"). CudaDevice computes it here instead, on the
GPU, over the rows of its gather buffer (saves) and of the rows it copies in (loads): the
CRC the slot format defines (docs/format.md), equal bit for bit to aiokv._native.crc32c,
which CudaDevice checks at attach before it relies on this (worker/cuda.py).

How, with no kernel of our own (any device torch runs on, this machine's CPU included, so
every line is tested here): a CRC without its two inversions ("lin") is linear over GF(2),
and lin(A || B) = shift(lin(A), |B|) ^ lin(B), where shift(r, k) = r * x^(8k) mod P is
itself linear in r's four bytes: four lookups in 256-entry tables made for that k. A
4-byte word w alone has lin = shift(w, 4). So a row of words is reduced R entries at a
time: each entry's four bytes looked up in the tables of its position in the group (one
index_select for the whole tensor), the group's 4R values XORed together; R = 16 takes a 2
MiB row in 5 rounds, about 10 kernels each. Zero entries put in front change nothing (a
zero prefix adds nothing to lin), so each round pads on the left to a multiple of R.
Finally crc32c(row) = lin(row) ^ crc32c(L zero bytes).

The arithmetic is the bit-reflected one of native/crc32c.c (bit 31 of a register is x^0);
tables are made once per row length, on the CPU, and moved to the device.

Cost: a round's input is cut into pieces of at most `piece_bytes` (default 16 MiB) of
entries, and a piece takes about 9 times its size in temporaries while it runs. A piece of a
round is about 10 torch ops (kernels on a GPU): a 32 MiB gather of 256 KiB-4 MiB rows is 55-67
kernels (counted by tests/test_cuda_device_makes_and_checks_the_crc.py; 1 MiB pieces would be
about 370). On CUDA their launches are the host's whole share of the checksum.

Threading contract: a RowCrc is immutable after construction; rows() may run on any
thread, several at once, on the caller's current stream (CUDA: the ops are queued in order
on it, nothing here synchronises).
"""

from __future__ import annotations

import torch

POLY = 0x82F63B78  # P's terms below x^32, reflected (native/crc32c.c)
ONE = 0x80000000  # x^0
RADIX = 16  # entries reduced at a time


def mulmod(a: int, b: int) -> int:
    """a * b mod P, both reflected 32-bit polynomials."""
    p = 0
    for i in range(32):
        if a & (ONE >> i):  # a holds x^i: add b * x^i
            p ^= b
        b = (b >> 1) ^ (POLY if b & 1 else 0)  # b * x
    return p


def xpow8(k: int) -> int:
    """x^(8k) mod P: the multiplier that moves a register over k zero bytes."""
    r, base, e = ONE, ONE >> 1, 8 * k  # base: x^1, squared as e halves
    while e:
        if e & 1:
            r = mulmod(r, base)
        base = mulmod(base, base)
        e >>= 1
    return r


def shift(r: int, k: int) -> int:
    """The register r moved over k zero bytes (lin of r's message followed by k zeros)."""
    return mulmod(r, xpow8(k))


def _signed(v: int) -> int:
    return v - (1 << 32) if v & 0x80000000 else v


def shift_tables(k: int) -> list[int]:
    """4 x 256 values: entry [j * 256 + b] = shift(b << 8j, k) (so shift(r, k) is the XOR of
    the four entries r's bytes pick)."""
    m = xpow8(k)
    out = []
    for j in range(4):
        basis = [mulmod(1 << (8 * j + i), m) for i in range(8)]
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ basis[low.bit_length() - 1]
        out += t
    return out


def crc32c_of_zeros(n: int) -> int:
    """crc32c of n zero bytes: the inverted all-ones register moved over n bytes, inverted."""
    return ~shift(0xFFFFFFFF, n) & 0xFFFFFFFF


class RowCrc:
    """CRC32C of every row of an (n, row_bytes) uint8 tensor (row_bytes a multiple of 4), on
    the tensor's device. Threading: see the module docstring."""

    def __init__(self, row_bytes: int, device: torch.device | str = "cpu", piece_bytes: int = 16 << 20):
        if row_bytes <= 0 or row_bytes % 4:
            raise ValueError(f"aiokv: device CRC rows are a positive multiple of 4 bytes, not {row_bytes}")
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        self.piece = max(RADIX, piece_bytes // 4 // RADIX * RADIX)  # entries per piece, whole groups
        self.rounds = []  # (tables (RADIX * 1024,) int32 on the device) per round
        entries, chunk, pending = row_bytes // 4, 4, 4  # a raw word still owes shift(w, 4)
        while True:
            tabs = []
            for i in range(RADIX):  # entry i of a group is followed by RADIX-1-i entries of `chunk` bytes
                tabs += shift_tables(pending + (RADIX - 1 - i) * chunk)
            self.rounds.append(torch.tensor([_signed(v) for v in tabs], dtype=torch.int32, device=self.device))
            entries = -(-entries // RADIX)
            chunk *= RADIX
            pending = 0
            if entries == 1:
                break
        self.zero_crc = _signed(crc32c_of_zeros(row_bytes))
        self._offsets = (torch.arange(RADIX * 4, dtype=torch.int32, device=self.device) * 256).view(RADIX, 4)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x, (n, row_bytes) uint8 on this RowCrc's device, rows contiguous.
        Returns: (n,) int32, each row's CRC32C (its bits; view as uint8 for its 4 bytes, little-endian)."""
        n = x.shape[0]
        if x.dtype != torch.uint8 or x.dim() != 2 or x.shape[1] != self.row_bytes:
            raise ValueError(f"aiokv: RowCrc takes (n, {self.row_bytes}) uint8 rows, not {tuple(x.shape)} {x.dtype}")
        v = x.contiguous().view(torch.int32)  # (n, words): little-endian words, the CRC's byte order
        for tabs in self.rounds:
            v = self._round(v, tabs)
        return v.view(n) ^ self.zero_crc

    def _round(self, v: torch.Tensor, tabs: torch.Tensor) -> torch.Tensor:
        """(n, m) entries -> (n, ceil(m / RADIX)) groups' lins."""
        n, m = v.shape
        pad = -m % RADIX
        if pad:
            v = torch.cat([torch.zeros(n, pad, dtype=v.dtype, device=v.device), v], dim=1)
        groups = v.shape[1] // RADIX
        step = max(1, self.piece // RADIX // max(1, n))  # groups per piece, all rows at once
        if step >= groups:
            return self._groups(v, tabs)
        out = torch.empty(n, groups, dtype=v.dtype, device=v.device)
        for g in range(0, groups, step):
            out[:, g : g + step] = self._groups(v[:, g * RADIX : (g + step) * RADIX], tabs)
        return out

    def _groups(self, v: torch.Tensor, tabs: torch.Tensor) -> torch.Tensor:
        n = v.shape[0]
        g = v.reshape(n, -1, RADIX).view(torch.uint8).view(n, -1, RADIX, 4)  # each entry's bytes, low first
        idx = g.to(torch.int32) + self._offsets  # (n, groups, RADIX, 4): the table entry of each byte
        x = tabs.index_select(0, idx.reshape(-1)).view(n, -1, RADIX * 4)
        width = RADIX * 4
        while width > 1:  # XOR the group's values together, halving
            width //= 2
            x = x[..., :width] ^ x[..., width:]
        return x.view(n, -1)
