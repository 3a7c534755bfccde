# SPDX-License-Identifier: Apache-2.0
"""A real Prometheus for tests: Debian's `prometheus` package (tools/setup.sh installs it),
started on a port the kernel picks as it binds (port 0), with its own configuration and storage
in a temporary directory, scraping the targets given every SCRAPE_S; queried through its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

from tools.servers import only_port

SCRAPE_S = 1  # scrape (and evaluation) interval, seconds


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError("the prometheus binary is missing: apt-get install prometheus (tools/setup.sh does)")
    return found


class Prometheus:
    def __init__(self, root: str, targets: list[str]):
        """targets: host:port of each /metrics endpoint."""
        self.root = root
        self.port: int | None = None  # and url: known once it listens (start)
        self.url = ""
        os.makedirs(os.path.join(root, "data"), exist_ok=True)
        self.config = os.path.join(root, "prometheus.yml")
        with open(self.config, "w") as f:
            f.write(
                "global:\n"
                f"  scrape_interval: {SCRAPE_S}s\n"
                f"  evaluation_interval: {SCRAPE_S}s\n"
                "scrape_configs:\n"
                "  - job_name: vllm\n"
                f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
            )
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "Prometheus":
        self.log = open(os.path.join(self.root, "prometheus.log"), "ab")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={self.config}",
                f"--storage.tsdb.path={os.path.join(self.root, 'data')}",
                "--web.listen-address=127.0.0.1:0",  # the kernel's pick as it binds; only_port reads it
                "--storage.tsdb.retention.time=1h",
                "--web.enable-lifecycle",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.text()[-3000:]}")
            if self.port is None:
                self.port = only_port(self.proc.pid)
                self.url = f"http://127.0.0.1:{self.port}"
            try:
                if self.port is not None:
                    with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                        if r.status == 200:
                            return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"prometheus not ready in {timeout} s: {self.text()[-3000:]}")
            time.sleep(0.2)

    def text(self) -> str:
        with open(os.path.join(self.root, "prometheus.log"), errors="replace") as f:
            return f.read()

    def api(self, path: str, **params) -> object:
        """GET /api/v1/<path> with these parameters: its `data` (raises on an error status)."""
        q = urllib.parse.urlencode([(k, v) for k, vs in params.items() for v in _list(vs)])
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"prometheus refused {path} {params}: {e.read().decode(errors='replace')}") from None
        if body.get("status") != "success":
            raise AssertionError(f"prometheus: {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list:
        """An instant query's result vector (or scalar) at `at` (now by default)."""
        data = self.api("query", query=expr, **({"time": at} if at is not None else {}))
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def scraped(self, metric: str) -> int:
        """How many samples of `metric` it holds over the last minute (0 before the first scrape)."""
        got = self.query(f"count_over_time({metric}[1m])")
        return int(max((float(r["value"][1]) for r in got), default=0))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        if hasattr(self, "log"):
            self.log.close()


def _list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]
