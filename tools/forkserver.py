# SPDX-License-Identifier: Apache-2.0
"""A fork server for engine lives: one process that has imported torch and vLLM
once, and forks a fresh child for each engine life asked of it (tests/e2e.py's
run, tools/fuzz.py's lives).

Why: an engine life of a tiny model on 2 CPU cores spends about half its time
importing torch and vLLM. Forked from a process that already did, each life
still is a new process with its own vLLM engine, aiokv connector and store (aiokv
is never imported here, so nothing of it is shared between lives), and its end
(`os._exit`, or a kill) is a true restart for the cache on disk.

A child runs what `python ARGV...` would ("-m MODULE ARGS" or "SCRIPT ARGS"),
but only where its environment can be set after the imports: one process (no
TP, no engine-core process: the caller's `eligible`) and, against the server's
own environment, only variables read at run time changed (AIOKV_*, AWS_*,
PYTEST_*). Callers run every other life as a plain subprocess.

Protocol (one request at a time, lines of JSON): the caller writes
{"argv", "env", "out", "err"}; the server forks, answers {"pid"}, and when the
child has ended {"rc"}. The child runs in its own session (a kill of its process
group never reaches the server or its caller), with stdout and stderr in the
files named. Threading: the server is single-threaded; `Server` is used from one
thread of its caller.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import traceback

# what a child may be told to set after the imports: read by aiokv or its bucket client when the
# engine starts, never by torch or vLLM at import
RUNTIME_PREFIXES = ("AIOKV_", "AWS_", "PYTEST_")


def _child(req: dict) -> None:
    os.setsid()
    for fd, path in ((0, os.devnull), (1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_RDONLY) if fd == 0 else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    os.environ.clear()
    os.environ.update(req["env"])
    argv = req["argv"]
    rc = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1]] + argv[2:]
            sys.path[0] = os.getcwd()  # as python -m has it
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports whatever ended it, as a process would
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip the slow teardown of torch and vLLM


def serve() -> None:
    import torch  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    answer = sys.stdout
    answer.write(json.dumps({"ready": True}) + "\n")
    answer.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        answer.write(json.dumps({"pid": pid}) + "\n")
        answer.flush()
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answer.flush()


_SHARED: dict[str, "Server"] = {}


def shared(root: str) -> "Server | None":
    """This process's server for `root`, started on first use and stopped at exit; None when
    AIOKV_TEST_NO_FORK=1."""
    if os.environ.get("AIOKV_TEST_NO_FORK") == "1":
        return None
    if root not in _SHARED:
        import atexit

        _SHARED[root] = Server(root)
        atexit.register(_SHARED[root].stop)
    return _SHARED[root]


class Server:
    """The fork server seen from the test process: started on first use, restarted if it died."""

    def __init__(self, root: str):
        self.root, self.env, self.proc = root, None, None

    def eligible(self, env: dict) -> bool:
        """Whether a life with this whole environment can be forked from the server (the caller
        decides whether the life is one process)."""
        if self.env is None or self.proc is None or self.proc.poll() is not None:
            self.env = {k: v for k, v in env.items() if not k.startswith(RUNTIME_PREFIXES)}
            self._start()
        return all(k.startswith(RUNTIME_PREFIXES) for k in set(env) | set(self.env) if env.get(k) != self.env.get(k))

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            cwd=self.root,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        if json.loads(self.proc.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError("the engine fork server did not start")

    def run(self, argv: list[str], env: dict, out: str, err: str, timeout: float) -> int:
        """Runs one life (`env`: its whole environment); returns its exit code. Past `timeout` the
        life is killed and subprocess.TimeoutExpired raised, as subprocess.run does."""
        import select
        import signal

        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "out": out, "err": err}) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            os.killpg(pid, signal.SIGKILL)
        line = self.proc.stdout.readline()
        if not line:
            self.proc = None
            raise RuntimeError("the engine fork server died")
        if not ready:
            raise subprocess.TimeoutExpired(argv, timeout)
        return json.loads(line)["rc"]

    def captured(self, argv: list[str], env: dict, timeout: float) -> tuple[str, str, int] | None:
        """Runs one life if its environment allows (else None): (stdout, stderr, exit code)."""
        if not self.eligible(env):
            return None
        import tempfile

        with tempfile.TemporaryDirectory(prefix="life") as d:
            out, err = os.path.join(d, "out"), os.path.join(d, "err")
            rc = self.run(argv, env, out, err, timeout)
            with open(out) as o, open(err, errors="replace") as e:
                return o.read(), e.read(), rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a child it waits for is stuck: nothing left to keep
                self.proc.kill()
                self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
