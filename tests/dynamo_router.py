# SPDX-License-Identifier: Apache-2.0
"""NVIDIA Dynamo's KV router (PyPI ai-dynamo-runtime, pinned in pyproject.toml's test extra) for
tests, in this process: its runtimes on an asyncio loop of their own thread, discovery through
files in a temporary directory (DYN_FILE_KV), the event plane over ZMQ.

A `worker` stands for the Dynamo worker beside a vLLM engine: a served endpoint, the model
registered with its KV block size, and Dynamo's KvEventPublisher relaying the engine's ZMQ KV
events (vLLM's kv_events_config publisher; Dynamo's relay speaks TCP, not ipc://) into a
worker-local indexer, which a router asks for what the worker holds when it first sees the
worker (events published before a router subscribed are not lost to it). A `router` is a fresh
KvRouter on its own runtime: it knows only what the workers' events tell it.
"""

from __future__ import annotations

import asyncio
import os
import threading

NAMESPACE = "aiokv.worker.generate"


class DynamoRouters:
    def __init__(self, root: str, model: str, block_size: int):
        """root: discovery's directory (DYN_FILE_KV must name it before the first runtime: the
        test sets it); model: the served model's directory (registered with each worker)."""
        if os.environ.get("DYN_FILE_KV") != root:
            raise RuntimeError("set DYN_FILE_KV to the discovery directory before starting Dynamo")
        self.model, self.block_size = model, block_size
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="dynamo", daemon=True)
        self._thread.start()
        self._runtimes: list = []
        self._keep: list = []  # served endpoints' tasks, publishers, routers: alive until close

    def _run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _runtime(self):
        from dynamo.runtime import DistributedRuntime

        rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
        self._runtimes.append(rt)
        return rt

    def worker(self, zmq_endpoint: str) -> int:
        """A Dynamo worker relaying the engine's events from zmq_endpoint; its worker id."""

        async def start():
            from dynamo.llm import (
                KvEventPublisher,
                ModelInput,
                ModelRuntimeConfig,
                ModelType,
                WorkerType,
                register_model,
            )

            rt = await self._runtime()
            ep = rt.endpoint(NAMESPACE)
            rc = ModelRuntimeConfig()
            rc.total_kv_blocks, rc.max_num_seqs, rc.max_num_batched_tokens = 1024, 8, 2048
            rc.enable_local_indexer = True  # a router that starts, or subscribes, later asks it what is held
            await register_model(
                ModelInput.Tokens,
                ModelType.Completions,
                ep,
                self.model,
                "tiny",
                worker_type=WorkerType.Aggregated,
                kv_cache_block_size=self.block_size,
                runtime_config=rc,
            )

            async def generate(request, context=None):  # never called: the tests only route
                yield {"token_ids": []}

            self._keep.append(asyncio.ensure_future(ep.serve_endpoint(generate)))
            self._keep.append(
                KvEventPublisher(
                    ep,
                    kv_block_size=self.block_size,
                    enable_local_indexer=True,
                    zmq_endpoint=zmq_endpoint,
                    zmq_topic="kv",
                )
            )
            return ep.connection_id()

        return self._run(start())

    def router(self, **config):
        """A fresh KvRouter (KvRouterConfig(**config)) over the workers discovered."""

        async def start():
            from dynamo.llm import KvRouter, KvRouterConfig

            rt = await self._runtime()
            r = KvRouter(rt.endpoint(NAMESPACE), self.block_size, KvRouterConfig(**config))
            self._keep.append(r)
            return r

        return self._run(start())

    def overlap(self, router, tokens: list[int]) -> dict[int, tuple[int, int]]:
        """worker id -> (device blocks, disk blocks) the router scores for these tokens."""

        async def ask():
            return await router.get_overlap_scores(tokens)

        got = self._run(ask())
        return {w["worker_id"]: (w["device_blocks"], w["disk_blocks"]) for w in got["workers"]}

    def best(self, router, tokens: list[int]) -> tuple[int, float]:
        """(the worker the router picks, the overlap blocks it credits that worker with)."""

        async def ask():
            return await router.best_worker(tokens)

        worker, _, overlap = self._run(ask())
        return worker, overlap

    def close(self) -> None:
        for rt in self._runtimes:
            try:
                rt.shutdown()
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
