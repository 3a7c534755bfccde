# SPDX-License-Identifier: Apache-2.0
"""The S3 client of the bucket tier, on obstore (object_store, in Rust).

Chosen by measurement (tools/bench_bucket.py; docs/benchmarks.md, "The bucket tier"): against the
same server it moves objects at least as fast as aiobotocore, its transfers
run outside the GIL (which vLLM's threads need), it imports in milliseconds,
and it speaks conditional PUT natively.

Endpoint, region and credentials come from the standard AWS_* environment
variables (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), read by obstore itself; an
http:// endpoint (a local test server) is allowed.

Every call is bounded by `timeout` seconds (the client's own deadline, and
asyncio.wait_for around it) and reports to the breaker: a missing object is an
answer, not a failure; an error or timeout is a failure. Calls raise
BucketError on failure and when the breaker is open, so callers have one
exception to turn into a miss or a dropped upload.

Threading contract: the coroutines may be awaited on any asyncio loop, from any
thread (obstore runs the I/O on its own runtime); one client serves them all.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import timedelta

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
from obstore.store import S3Store

from aiokv.config import parse_bucket_url
from aiokv.util.breaker import Breaker


def bucket_breaker(failures: int = 3, cooldown: float = 10.0, clock=time.monotonic) -> Breaker:
    """The bucket's breaker (aiokv/util/breaker.py): every request is a verdict on the server."""
    return Breaker(failures, cooldown, clock, per_request=True)


class BucketError(Exception):
    """The bucket did not answer (error, timeout, breaker open)."""


class BucketClient:
    def __init__(self, url: str, timeout: float = 5.0, breaker: Breaker | None = None):
        self.bucket, self.prefix = parse_bucket_url(url)
        self.url = url
        self.timeout = timeout
        self.breaker = breaker or bucket_breaker()
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        t = timedelta(seconds=timeout)
        opts = {
            "timeout": t,
            "connect_timeout": timedelta(seconds=min(timeout, 2.0)),
            "allow_http": endpoint.startswith("http://"),
        }
        # one quick retry inside the deadline (a reset connection); never longer than `timeout`
        retry = {
            "max_retries": 1,
            "retry_timeout": t,
            "backoff": {
                "init_backoff": timedelta(milliseconds=20),
                "max_backoff": timedelta(milliseconds=200),
                "base": 2.0,
            },
        }
        kw = {"endpoint": endpoint} if endpoint else {}
        self.store = S3Store(self.bucket, client_options=opts, retry_config=retry, **kw)

    async def _call(self, start):
        """Await start() (which begins the request) unless the breaker says no."""
        if not self.breaker.allow():
            raise BucketError("the bucket is skipped for a while after repeated failures")
        try:
            out = await asyncio.wait_for(start(), self.timeout)
        except (FileNotFoundError, NotFoundError, AlreadyExistsError, PreconditionError):
            self.breaker.success()  # the server answered
            raise
        except asyncio.CancelledError:
            self.breaker.cancelled()  # no verdict on the server; a trial request may be made again
            raise
        except Exception as e:
            self.breaker.failure()
            raise BucketError(f"{type(e).__name__}: {str(e)[:200]}") from None
        self.breaker.success()
        return out

    async def put_once(self, name: str, data) -> bool:
        """Write-once PUT (If-None-Match: *): True if created, False if already there."""
        try:
            await self._call(lambda: obstore.put_async(self.store, name, data, mode="create"))
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    async def put(self, name: str, data) -> None:
        """A plain PUT: replaces whatever object is there."""
        await self._call(lambda: obstore.put_async(self.store, name, data))

    async def get(self, name: str):
        """The object's bytes (a buffer), or None when there is no such object."""

        async def body():
            r = await obstore.get_async(self.store, name)
            return await r.bytes_async()

        try:
            return await self._call(body)
        except (FileNotFoundError, NotFoundError):
            return None

    async def head_bytes(self, name: str, n: int):
        """The object's first n bytes (a ranged GET), or None when there is no such object."""
        try:
            return await self._call(lambda: obstore.get_range_async(self.store, name, start=0, length=n))
        except (FileNotFoundError, NotFoundError):
            return None

    async def list(self, prefix: str, page: int = 1000):
        """The objects whose names start with the path `prefix` (whole segments), a page of
        at most `page` at a time: [{"path", "size", "last_modified", ...}]; each page is a
        request under the deadline and the breaker."""
        it = obstore.list(self.store, prefix=prefix, chunk_size=page).__aiter__()

        async def more():
            try:
                return await it.__anext__()
            except StopAsyncIteration:
                return None

        while (got := await self._call(more)) is not None:
            yield got

    async def folders(self, prefix: str) -> list[str]:
        """The names one segment below the path `prefix` that hold objects (a listing with a delimiter)."""
        got = await self._call(lambda: obstore.list_with_delimiter_async(self.store, prefix=prefix))
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in got["common_prefixes"]]

    async def size(self, name: str) -> int | None:
        """The object's size (HEAD), or None when there is no such object."""
        try:
            meta = await self._call(lambda: obstore.head_async(self.store, name))
        except (FileNotFoundError, NotFoundError):
            return None
        return meta["size"]
