"""End to end: bad input gets one clear line, loses nothing, and where it can,
vLLM runs on without aiokv.

- wrong settings fail at start naming the setting;
- a read-only cache directory disables aiokv with one line; vLLM serves on and
  the stored blocks are untouched.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e import prompts, run

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("extra,needle", [
    ({"capcity": "1GiB"}, "aiokv: unknown setting(s) capcity"),
    ({"capacity": "lots"}, "aiokv: capacity: not a size: 'lots'"),
    ({"io": "dma"}, "aiokv: io must be auto, uring or threads"),
])
def test_wrong_settings_fail_at_start(tiny_model, tmp_path, extra, needle):
    with pytest.raises(AssertionError) as e:
        run(dict(model=tiny_model, cache=str(tmp_path / "c"), extra=extra, phases=[dict(prompts=prompts(1, 40))]))
    assert needle in str(e.value)


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_read_only_directory_disables_aiokv(tiny_model, read_only_dir):
    cache = str(read_only_dir / "c")
    ps = prompts(2, 120, seed=3)
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    before = sorted(os.listdir(os.path.join(cache, "ns")))
    d = str(read_only_dir)
    subprocess.run(["mount", "--bind", d, d], check=True)
    subprocess.run(["mount", "-o", "remount,ro,bind", d], check=True)
    res = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    assert res["tokens"] == cold["tokens"]
    assert "aiokv is disabled and vLLM runs without it" in res["log"]
    assert res["counters"].get("hit_blocks", 0) == 0
    assert sorted(os.listdir(os.path.join(cache, "ns"))) == before


def test_recurrent_model_without_align_mode_is_refused_with_a_clear_line(tmp_path):
    """A hybrid recurrent model (here a tiny Qwen3-Next) needs vLLM's
    mamba_cache_mode='align', which vLLM sets only with prefix caching on.
    Without it aiokv cannot tell which state belongs to which block boundary:
    it refuses at start with one line naming the fix; without aiokv the same
    model runs."""
    from aiokv.demo.tiny_model import build_hybrid

    model = build_hybrid(str(tmp_path / "hybrid"))
    spec = dict(model=model, dtype="bfloat16", block_size=None, prefix_caching=False,
                phases=[dict(prompts=prompts(1, 100))])
    assert run(spec)["tokens"][0][0]
    with pytest.raises(AssertionError) as e:
        run(dict(spec, cache=str(tmp_path / "c")))
    assert "aiokv: recurrent-state (Mamba / gated delta net) layers need vLLM's mamba_cache_mode='align'" \
        in str(e.value) and "enable_prefix_caching=True" in str(e.value)
