# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for torch.cuda's streams, events and cudart, so CudaDevice runs here on CPU
tensors (there is no GPU on the test machine; tools/gpu_check.py runs the real thing).
tests/conftest.py offers the `fake_cuda` fixture."""

from __future__ import annotations

import contextlib

import pytest
import torch


class FakeStream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, ev):
        pass

    def synchronize(self):
        pass


class FakeEvent:
    made = 0

    def __init__(self):
        FakeEvent.made += 1

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class _Cudart:
    registered: list = []

    def cudaHostRegister(self, addr, size, flags):
        self.registered.append(addr)
        return 0

    def cudaHostUnregister(self, addr):
        self.registered.remove(addr)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart
