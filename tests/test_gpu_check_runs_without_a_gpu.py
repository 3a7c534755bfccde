# SPDX-License-Identifier: Apache-2.0
"""The device check (tools/gpu_check.py) must run on a bare GPU machine: no vLLM,
no liburing, no uvloop, no numpy, its C extension built on the spot.

The bug: the old check began with `pip install vllm`, impossible on such a machine
(no network), and the worker side it would exercise needed uvloop and numpy, and
an extension that only built with liburing.

The invariant: in a copy of the tree without a built extension, with vllm, uvloop
and numpy unimportable and the extension built without io_uring, the check runs to
the end on the CPU: every layout round-trips bit-exact (disk, memory tier, with a secret's MAC,
layerwise; without the blake3 package, the MAC's hash, the same but the secret's
round trips, left out with a line saying so; without ISA-L, the CRC32C is aiokv's own), the CUDA parts are skipped with a line saying so, the worker side
imported no vLLM, exit status 0, one JSON report.

The fix: the check compiles the extension's units (native/recipe.py) itself (AIOKV_WITHOUT_URING
without liburing: the thread-pool backend), the worker loop falls back to asyncio's
loop, the CPU device's address arrays need no numpy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BARE = """
import importlib.abc, runpy, sys
# nothing but this copy's aiokv (an editable install's finder would win over sys.path)
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
class Bare(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(name + " is not installed on a bare GPU machine")
sys.meta_path.insert(0, Bare())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("blake3", [True, False], ids=["with_blake3_and_isal", "without_blake3_or_isal"])
def test_gpu_check_runs_without_a_gpu(tmp_path, blake3):
    hidden = ("vllm", "uvloop", "numpy") + (() if blake3 else ("blake3",))
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("*.so", "__pycache__")
    shutil.copytree(os.path.join(ROOT, "aiokv"), tree / "aiokv", ignore=skip)
    shutil.copytree(os.path.join(ROOT, "native"), tree / "native")
    os.makedirs(tree / "tools")
    shutil.copy(os.path.join(ROOT, "tools", "gpu_check.py"), tree / "tools")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(AIOKV_WITHOUT_URING="1", CUDA_VISIBLE_DEVICES="")
    if not blake3:  # nor ISA-L: the barest machine
        env.update(AIOKV_WITHOUT_ISAL="1")
    p = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            f"HIDDEN = {hidden!r}\n" + BARE,
            str(tree / "tools" / "gpu_check.py"),
            "--dir",
            str(tmp_path / "cache"),
            "--out",
            str(report),
            "--budget",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=str(tmp_path),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "the CUDA parts (overlap, bandwidth, device_crc) are skipped" in p.stdout
    r = json.loads(report.read_text())
    assert json.loads(p.stdout.strip().splitlines()[-2]) == r  # the same report, printed last
    parts = r["parts"]
    assert parts["env"]["has_vllm"] is False and parts["env"]["has_uvloop"] is False
    assert parts["env"]["has_blake3"] is blake3
    assert parts["build"]["crc_path"] == ("isal" if blake3 else "crc32q")
    assert parts["build"]["built"] is True and parts["build"]["io_uring"] is False
    assert parts["build"]["module"].startswith(str(tree))
    assert parts["io"]["backend"] == "threads"
    cases = parts["layouts"]["cases"]
    names = {c.split("/")[0] for c in cases}
    assert names == {
        "flash_attn",
        "flashinfer_hnd",
        "mla",
        "mamba_state",
        "v033_layer_compact",
        "v033_cross_layer",
        "v033_kernel_blocks",
    }
    assert all(c["ok"] for c in cases.values()), {k: c for k, c in cases.items() if not c["ok"]}
    assert all(cases[f"{n}/memory"]["memory_hit_blocks"] == 12 for n in names)
    assert cases["flash_attn/layerwise"]["layerwise_copied_blocks"] == 12
    if blake3:
        assert all(cases[f"{n}/secret"]["mac_scheme"] == 1 for n in names), "the MAC on every layout"
    else:  # the rest still runs; the secret's round trips are left out, said in one line
        assert not any(c.endswith("/secret") for c in cases) and parts["layouts"]["secret"] is False
        assert "the secret's MAC is not checked here: no blake3 package (pip install blake3)" in p.stdout
    assert parts["overlap"]["ok"] is None and parts["bandwidth"]["ok"] is None and parts["device_crc"]["ok"] is None
    assert r["vllm_imported"] is False and r["ok"] is True
