# SPDX-License-Identifier: Apache-2.0
"""End to end: bad input gets one clear line, loses nothing, and where it can,
vLLM runs on without aiokv.

- wrong settings fail at start naming the setting;
- a directory that is not an aiokv store is refused at start with one line, and
  nothing in it is touched;
- a read-only cache directory disables aiokv with one line; vLLM serves on (tokens
  as without aiokv) and the stored blocks are untouched.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e import happened, prompts, run

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"capcity": "1GiB"}, "aiokv: unknown setting(s) capcity"),
        ({"capacity": "lots"}, "aiokv: capacity: not a size: 'lots'"),
        ({"io": "dma"}, "aiokv: io must be auto, uring or threads"),
    ],
)
def test_wrong_settings_fail_at_start(tiny_model, tmp_path, extra, needle):
    with pytest.raises(AssertionError) as e:
        run(dict(model=tiny_model, cache=str(tmp_path / "c"), extra=extra, phases=[dict(prompts=prompts(1, 40))]))
    assert needle in str(e.value)


def _tree(path: str) -> dict:
    return {
        os.path.join(d, n): (os.lstat(os.path.join(d, n)).st_size, os.lstat(os.path.join(d, n)).st_mtime_ns)
        for d, dirs, files in os.walk(path)
        for n in files + dirs
    }


def test_a_directory_that_is_not_an_aiokv_store_is_refused_untouched(tiny_model, tmp_path):
    d = tmp_path / "home"
    (d / "docs").mkdir(parents=True)
    (d / "notes.txt").write_text("not a cache")
    (d / "docs" / "a.bin").write_bytes(os.urandom(4096))
    os.chmod(d, 0o700)
    before = _tree(str(d))
    with pytest.raises(AssertionError) as e:
        run(dict(model=tiny_model, cache=str(d), phases=[dict(prompts=prompts(1, 40))]))
    lines = [ln for ln in str(e.value).splitlines() if f"aiokv: {d} is not empty and not an aiokv store" in ln]
    assert lines and "give aiokv an empty or new directory" in lines[0], str(e.value)[-3000:]
    assert _tree(str(d)) == before, "aiokv touched a directory it does not own"


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_read_only_directory_disables_aiokv(tiny_model, read_only_dir):
    cache = str(read_only_dir / "c")
    ps = prompts(2, 120, seed=3)
    base = run(dict(model=tiny_model, phases=[dict(prompts=ps)]))
    cold = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    happened(cold, base, saves_committed=">0")
    before = sorted(os.listdir(os.path.join(cache, "ns")))
    d = str(read_only_dir)
    subprocess.run(["mount", "--bind", d, d], check=True)
    subprocess.run(["mount", "-o", "remount,ro,bind", d], check=True)
    res = run(dict(model=tiny_model, cache=cache, phases=[dict(prompts=ps)]))
    assert "aiokv is disabled and vLLM runs without it" in res["log"]
    happened(res, base, disabled=True)
    assert sorted(os.listdir(os.path.join(cache, "ns"))) == before


def test_recurrent_model_without_align_mode_is_refused_with_a_clear_line(tmp_path):
    """A hybrid recurrent model (here a tiny Qwen3-Next) needs vLLM's
    mamba_cache_mode='align', which vLLM sets only with prefix caching on.
    Without it aiokv cannot tell which state belongs to which block boundary:
    it refuses at start with one line naming the fix; without aiokv the same
    model runs."""
    from aiokv.demo.tiny_model import build_hybrid

    model = build_hybrid(str(tmp_path / "hybrid"))
    spec = dict(
        model=model, dtype="bfloat16", block_size=None, prefix_caching=False, phases=[dict(prompts=prompts(1, 100))]
    )
    assert run(spec)["tokens"][0][0]
    with pytest.raises(AssertionError) as e:
        run(dict(spec, cache=str(tmp_path / "c")))
    assert "aiokv: recurrent-state (Mamba / gated delta net) layers need vLLM's mamba_cache_mode='align'" in str(
        e.value
    ) and "enable_prefix_caching=True" in str(e.value)
