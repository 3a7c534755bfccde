# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: both I/O backends, staging buffers, small stores."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from tests.fakecuda import fake_cuda  # noqa: F401 (a fixture: CudaDevice on CPU tensors)

PAYLOAD = 64 << 10
LONG_TIMEOUT = 1800  # s: a long run's bound (the longest: 4 min on an Intel machine, 10 on an AMD one; the rest: pyproject's 600 s)


def pytest_collection_modifyitems(config, items):
    """Long runs (pytest -m long) get LONG_TIMEOUT unless they set their own."""
    for item in items:
        if item.get_closest_marker("long") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if rep.when == "call":
        item.aiokv_call_passed = rep.passed


@pytest.fixture(autouse=True)
def every_life_is_checked(request):
    """An end-to-end test passes each life it ran with aiokv to tests.e2e.happened()."""
    yield
    from tests import e2e

    left, e2e.UNCHECKED[:] = len(e2e.UNCHECKED), []
    if left and getattr(request.node, "aiokv_call_passed", False):
        pytest.fail(
            f"{left} engine li{'fe' if left == 1 else 'ves'} with aiokv never passed to tests.e2e.happened(): "
            "assert what it shows (tokens against a run without aiokv, aiokv's counters)"
        )


@pytest.fixture
def stallfs(tmp_path):
    """(mountpoint, stall, resume): a FUSE passthrough (tests/stallfs.py) whose .data reads
    hang after stall() ("rw": writes too) until resume()."""
    from tests.stallfs import mounted

    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):

        def stall(what: str = "r") -> None:
            with open(control, "w") as f:
                f.write(what)

        yield str(tmp_path / "mnt"), stall, lambda: os.unlink(control)


@pytest.fixture(params=["uring", "threads"])
def backend_kind(request, monkeypatch):
    """Every store test runs on both I/O backends."""
    monkeypatch.setenv("AIOKV_IO", request.param)
    return request.param


class Blocks:
    """Staging buffers filled with a deterministic pattern per key."""

    def __init__(self, payload: int, count: int):
        self.payload = payload
        self.pool = BufferPool(fmt.slot_bytes(payload), count)
        self.bufs = self.pool.acquire(count)

    def addr(self, i: int) -> int:
        return self.pool.addr(self.bufs[i])

    def fill(self, i: int, key: bytes) -> None:
        pattern = (key * (self.payload // len(key) + 1))[: self.payload]
        ctypes.memmove(self.addr(i) + fmt.HEADER_BYTES, pattern, self.payload)

    def clear(self, i: int) -> None:
        ctypes.memset(self.addr(i), 0xEE, self.pool.slot_bytes)

    def holds(self, i: int, key: bytes) -> bool:
        pattern = (key * (self.payload // len(key) + 1))[: self.payload]
        return ctypes.string_at(self.addr(i) + fmt.HEADER_BYTES, self.payload) == pattern


@pytest.fixture
def blocks():
    b = Blocks(PAYLOAD, 64)
    yield b
    b.pool.close()


def refresh_until(st, cond, what: str, timeout: float = 20.0) -> None:
    """st.refresh() (as the scheduler's step: it applies what the loader and I/O threads
    finished) until cond() holds; fails naming `what` past the timeout."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} (after {timeout:.0f} s)"
        st.refresh()
        time.sleep(0.01)


def key(i: int, salt: int = 0) -> bytes:
    return (i.to_bytes(8, "little") + salt.to_bytes(8, "little")) * 2


NS = bytes(range(16))


def pytest_asyncio_loop_factories(config, item):
    """The store runs on uvloop in production; tests run there too."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Llama built locally once per session (random weights, BPE trained on the spot)."""
    from aiokv.demo.tiny_model import build

    return build(
        str(tmp_path_factory.mktemp("models") / "tiny"), layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256
    )


@pytest.fixture(scope="module")
def s3server(tmp_path_factory):
    """A real S3 server (SeaweedFS) for the module; tests may kill and restart it."""
    from tests.s3server import S3Server

    srv = S3Server(str(tmp_path_factory.mktemp("weed"))).start()
    yield srv
    srv.stop()


@pytest.fixture
def s3env(s3server, monkeypatch):
    """The AWS_* variables pointing at the test server, as an operator would set them."""
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    return s3server
