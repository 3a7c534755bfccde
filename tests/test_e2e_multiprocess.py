# SPDX-License-Identifier: Apache-2.0
"""End to end in vLLM's default multiprocess mode: the scheduler side lives in
the EngineCore process, the worker side in a worker process; job lists and
reports cross process boundaries, and saves of the last steps are committed
before the engine exits. The connector is found by name through aiokv's vLLM
plugin entry point (no kv_connector_module_path).
aiokv's counters live in the EngineCore process here: the test reads them as
vLLM exports them (its Prometheus series), so a warm run that silently
recomputed (0 blocks loaded, or failed loads) fails.
"""

from __future__ import annotations

import pytest

from aiokv.store import Store
from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm


def test_restart_in_multiprocess_mode(tiny_model, tmp_path):
    cache = str(tmp_path / "c")
    ps = prompts(3, 250, seed=51)
    spec = dict(model=tiny_model, metrics=True, phases=[dict(prompts=ps, max_tokens=12)])
    mp = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    base = run(spec)
    cold = run({**spec, "cache": cache, "no_module_path": True}, env=mp)
    st = Store(cache, readonly=True)
    (ns,) = st.index.namespaces.values()
    assert ns.count() >= 3 * (250 // 32), "every full block of the cold run is committed"
    st.close()
    warm = run({**spec, "cache": cache, "no_module_path": True}, env=mp)
    hit = 3 * (249 // 32)
    happened(cold, base, saved_blocks=f">={3 * (250 // 32)}")
    happened(warm, base, hit_tokens=hit * 32, loaded_blocks=hit, memory_hit_blocks=0, loaded_bytes=">0")
    assert warm["cached"][0] == [(249 // 32) * 32] * 3
