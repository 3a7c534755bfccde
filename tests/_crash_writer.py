# SPDX-License-Identifier: Apache-2.0
"""Child process for test_crash_recovery: saves bursts forever, printing each
committed key (hex) once save() has returned; the parent kills it with SIGKILL."""

import sys

import uvloop

from tests.conftest import NS, PAYLOAD, Blocks, key
from tools.storeio import StoreIO


async def main(root: str) -> None:
    st = StoreIO(root, capacity="256MiB")
    ns = st.namespace(NS, PAYLOAD)
    blocks = Blocks(PAYLOAD, 32)
    i = 0
    while True:
        batch = [key(i + j) for j in range(32)]
        for j, k in enumerate(batch):
            blocks.fill(j, k)
        res = await st.save(ns, [(k, blocks.addr(j)) for j, k in enumerate(batch)])
        for k, r in zip(batch, res):
            if r == 0:
                sys.stdout.write(k.hex() + "\n")
        sys.stdout.flush()
        i += 32


uvloop.run(main(sys.argv[1]))
