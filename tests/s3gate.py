# SPDX-License-Identifier: Apache-2.0
"""A gate in front of the test's S3 server (tests/s3server.py): an HTTP proxy on a free local
port that forwards every request as it came (its signed headers and body unchanged) and lets
the test stop the replies to block objects at a point it chooses.

    gate = Gate(server.endpoint).start()        # AWS_ENDPOINT_URL=gate.endpoint for the client
    gate.hold_after(40)                         # 40 block GETs are answered, later ones wait
    gate.wait_held(2)                           # two requests are waiting: the client is stuck
    ...                                         # signal, kill, check: nothing moves meanwhile
    gate.open()                                 # the waiting ones go on (a dead client's: dropped)

So a test interrupts a client (`aiokv warm`) in the middle of its work whatever the machine's
speed: the work cannot finish before the test acts. A held request gets no byte of its reply
until the gate opens. Block objects are those named `.../r<rank>/<key hex>`
(aiokv/bucket/naming.py); listings, descriptions and labels always pass.

Threading contract: the proxy serves each connection on a thread of its own; the test calls
the methods from its thread. Counters and the gate are guarded by one condition variable.
"""

from __future__ import annotations

import http.client
import http.server
import re
import threading
import time
import urllib.parse

BLOCK = re.compile(r"/r[0-9]+/[0-9a-f]+$")
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class Gate:
    def __init__(self, upstream: str):
        u = urllib.parse.urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.cond = threading.Condition()
        self.limit: int | None = None  # block GETs answered before the gate closes (None: open)
        self.answered = 0  # block GETs let through
        self.held = 0  # requests waiting at the gate now
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # (quiet)
                pass

            def _any(self):
                gate._forward(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3gate", daemon=True)

    def start(self) -> "Gate":
        self._thread.start()
        return self

    def hold_after(self, n: int) -> None:
        """From now on, block GETs past the n-th (counted from the gate's start) wait."""
        with self.cond:
            self.limit = n

    def wait_held(self, n: int, timeout: float = 120.0) -> None:
        """Until n requests wait at the gate."""
        end = time.monotonic() + timeout
        with self.cond:
            while self.held < n:
                left = end - time.monotonic()
                assert left > 0, f"{self.held} request(s) at the gate after {timeout} s, {self.answered} answered"
                self.cond.wait(left)

    def open(self) -> None:
        with self.cond:
            self.limit = None
            self.cond.notify_all()

    def stop(self) -> None:
        self.open()
        self.server.shutdown()
        self.server.server_close()

    # ---- the handler threads' ----
    def _pass(self, method: str, path: str) -> None:
        """Wait at the gate if this is a block GET past the limit."""
        if method != "GET" or not BLOCK.search(urllib.parse.urlsplit(path).path):
            return
        with self.cond:
            if self.limit is not None and self.answered >= self.limit:
                self.held += 1
                self.cond.notify_all()
                while self.limit is not None:
                    self.cond.wait()
                self.held -= 1
            self.answered += 1

    def _forward(self, h: http.server.BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else None
        self._pass(h.command, h.path)
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.putrequest(h.command, h.path, skip_host=True, skip_accept_encoding=True)
            for k, v in h.headers.items():  # as signed: Host included
                if k.lower() not in HOP:
                    conn.putheader(k, v)
            conn.endheaders(body)
            r = conn.getresponse()
            data = r.read()
        except OSError:
            h.close_connection = True  # the server is gone: so is this connection (as if it died)
            return
        finally:
            conn.close()
        try:
            h.send_response_only(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    h.send_header(k, v)
            h.send_header(
                "Content-Length", str(len(data)) if h.command != "HEAD" else r.getheader("Content-Length", "0")
            )
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
        except OSError:
            h.close_connection = True  # the client is gone (killed while it waited)
