# SPDX-License-Identifier: Apache-2.0
"""Runs a real vLLM engine (CPU) in this process, with or without aiokv, and
prints one line `RESULT <json>`: generated token ids, per-request cached tokens,
aiokv's counters and vLLM's free-block count. Tests start it as a subprocess
so that every run is a true restart.

    python -m tests.vllm_run '<spec json>'

spec: model, cache (null: no connector), block_size, retention (vLLM's prefix_cache_retention_interval), dtype, max_model_len, metrics (multiprocess:
return aiokv's Prometheus series as `metrics`),
num_gpu_blocks (small: forces preemption), extra (kv_connector_extra_config), kv_role (aiokv's,
kv_both unless given), with_connector (another connector's kv_transfer_config: aiokv and it run
under vLLM's MultiConnector, aiokv first unless aiokv_first is false),
ready_file (created once the engine is up and, in one process, aiokv's index has loaded in the
background: a test that then makes the mount hang; "index_wait_s" the seconds that took; the
phases themselves never wait for the index: aiokv's requests do, scheduler/index_wait.py; it
holds the KV events' endpoint with kv_events "tcp"),
kv_events (one process only; a socket path: vLLM publishes its KV events there over ZMQ
(ipc://), or "tcp": on a port of VLLM_HOST_IP the kernel picks ("kv_events_endpoint"); a subscriber
here collects them in "events": [type, medium, group, hashes, parent, token ids] each, in order;
nothing is published before kv_events_subscribers subscriptions (1 unless given: this one; more
where others subscribe once ready_file gives the endpoint) reached the publisher),
audit_fs (RESULT lists the file-system
calls aiokv made on vLLM's thread while the phases ran), audit_saves (RESULT's "save_violations":
every step's saves checked against vLLM's own scheduler output, _audit_saves),
lora ({max_lora_rank, max_loras}: LoRA served), refuse_io_uring (io_uring_setup fails with EPERM in
this life's processes only: a seccomp filter, as a container's default profile sets),
phases: [{prompts: [[ids]], max_tokens, follow? (prompts are then the next turns: each the previous
phase's prompt, its reply and these ids), salts?, loras? ([name, id, path] or null per prompt),
index_gate? ({path, then}: a tests/stallfs.py control file holding aiokv's index loader,
rewritten with `then` (null: removed) at the start of the first step at which every request of
the phase has waited for the index (counter index_waited); "index_gate_step" gets that step),
resave? ([[source dir, adapter dir]]: each file of the source written over the adapter's, in
place, before add_lora: an adapter re-saved), add_lora? ([[name, id, path, load_inplace?]]: loaded into the
workers before the phase; load_inplace: loaded again over the one of that id), stall? (a tests/stallfs.py control file written, with stall_mode ("a" unless
given), before the phase's requests and removed once they are done, unless stall_keep; "seconds"
gets each phase's time), unstall_at_step? ([step, control file]: removed at the start of that step
of the phase, then the step waits until aiokv's LoRA adapters' I/O thread has nothing queued or
running), hold_at_step? ([step, path]: that step waits until the file exists), abort_after?: {index: steps}, abort_preempted?: n (abort
the first n requests seen preempted, in the step they are; where each abort landed: "aborted_while"),
abort_loading?: n (abort requests seen waiting for their load, WAITING_FOR_REMOTE_KVS, in the step
they are, until n aborts landed there),
wait_for?: path, announce?: bool (after the phase, step until aiokv's start announcement is all
published), done_file?: path (created once the phase, and its announce, is over), peer_blocks?: n, orders?: n,
settle?: bool, room?: bool, kill_at_step?: [step, process group], reload_weights?: path,
reset_prefix_cache?: {kwargs}, kill_when_loading?: process group (killed -9 at the first step
that starts with one of aiokv's loads in flight; "killed_at_step"), resets?: [{when, kwargs}]
(LLM.reset_prefix_cache(**kwargs) in the middle of the phase, one after the other, each at the
start of the first step, after that step's aborts, at which `when` holds: "fired:KIND" (a fault
of that kind, e.g. read:late, was injected), "loading" (one of aiokv's loads is in flight),
"not_loading" (none is), at the start of `steps` steps in a row (1 unless given); the phase
lasts until all were made; "phase_resets" gets [phase,
result (True, False, or the exception's class name), whether aiokv's key epoch changed] each)}], stagger (add
one request per step instead of all at once); wait_for keeps the engine alive and
idle until that file exists (tests that run two engines at once use it to order
them); peer_blocks waits, after that, until this engine's store sees at least n
blocks the other engines on the directory committed (it looks every
FOLLOW_INTERVAL, so a file on disk is not yet a hit here); orders waits, after that, until
this engine has read and applied the operators' first n orders (aiokv clear, pin: DIR/control; on every drive) and, with
kv_events, handed the events of what they removed to vLLM (idle steps publish them); settle waits, before the phase, until the previous phases' saves and
bucket-tier uploads are done (one process, TP 1; spec settle_at_end: after the last phase, before
the counters are read, so an upload figure counts every upload); room waits, before the phase, until
aiokv's index has loaded and no disk space is being reserved (the first saves of a life whose free
slots were all given back find room, none skipped while a slow disk grows the files); kill_at_step kills -9 that
process group at that step of the phase; reload_weights loads other weights into
the running engine (collective_rpc) and reset_prefix_cache then calls
LLM.reset_prefix_cache(**kwargs), both before the phase (its result in "reset").
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MP = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def _refuse_io_uring() -> None:
    """io_uring_setup fails with EPERM in this process and those it starts, as under a container's
    default seccomp profile (every thread: TSYNC); the machine's other processes keep io_uring."""
    import errno

    import pyseccomp

    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    f.set_attr(pyseccomp.Attr.CTL_TSYNC, 1)
    f.add_rule(pyseccomp.ERRNO(errno.EPERM), "io_uring_setup")
    f.load()


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    if spec.get("refuse_io_uring"):
        _refuse_io_uring()

    kw = dict(
        model=spec["model"],
        tokenizer=spec["model"],
        enforce_eager=True,
        block_size=spec.get("block_size", 32),
        dtype=spec.get("dtype", "float32"),
        enable_prefix_caching=spec.get("prefix_caching", True),
        max_model_len=spec.get("max_model_len", 1024),
        seed=0,
    )
    if "retention" in spec:  # vLLM's prefix_cache_retention_interval ("none": every block)
        kw["prefix_cache_retention_interval"] = None if spec["retention"] == "none" else spec["retention"]
    if spec.get("metrics"):  # vLLM's Prometheus metrics, aiokv's vllm:aiokv_* among them (llm.get_metrics())
        kw["disable_log_stats"] = False
    if kw["block_size"] is None:  # vLLM chooses (hybrid models need their own)
        del kw["block_size"]
    if spec.get("num_gpu_blocks"):
        kw["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
        kw["kv_cache_memory_bytes"] = 256 << 20
        kw["max_num_seqs"] = spec.get("max_num_seqs", 8)
    else:
        kw["kv_cache_memory_bytes"] = 64 << 20
        if spec.get("max_num_seqs"):
            kw["max_num_seqs"] = spec["max_num_seqs"]
    if spec.get("lora"):  # LoRA adapters served ({max_lora_rank, max_loras}); phases name them per prompt
        kw.update(enable_lora=True, **spec["lora"])
    tp = spec.get("tp", 1)
    if tp > 1:  # workers in their own processes (VLLM_CPU_OMP_THREADS_BIND gives each a core)
        kw["tensor_parallel_size"] = tp
        kw["distributed_executor_backend"] = "mp"
    if spec.get("cache"):
        # fs_timeout: a store operation counts as hung past 2 s by default; a loaded test machine's
        # fdatasync may take that long, open the breaker and skip saves any exact count needs. The
        # hung-mount tests, whose subject it is, set 2 s again
        extra = {"path": spec["cache"], "capacity": "2GiB", "staging": "32MiB", "fs_timeout": 30}
        extra.update(spec.get("extra", {}))
        kw["kv_transfer_config"] = {
            "kv_connector": "AioKVConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if not spec.get("no_module_path"):
            kw["kv_transfer_config"]["kv_connector_module_path"] = "aiokv.connector"
        kw["kv_transfer_config"]["kv_role"] = spec.get("kv_role", "kv_both")
        if spec.get("with_connector"):  # aiokv and another connector under vLLM's MultiConnector
            both = [kw["kv_transfer_config"], spec["with_connector"]]
            kw["kv_transfer_config"] = {
                "kv_connector": "MultiConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"connectors": both if spec.get("aiokv_first", True) else both[::-1]},
            }
    sub = None
    if spec.get("kv_events"):  # vLLM's ZMQ publisher, and a subscriber connected before the first request
        import zmq

        if MP:
            raise ValueError("kv_events needs the engine core in this process (its publisher's subscriptions are read)")
        _xpub_publisher()
        # "tcp": a port the kernel picks on 127.0.0.1 (VLLM_HOST_IP; for subscribers that speak TCP only)
        where = "tcp://*:0" if spec["kv_events"] == "tcp" else f"ipc://{spec['kv_events']}"
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": where, "topic": "kv"}
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        if where.startswith("ipc://"):
            sub.connect(where)
    llm = LLM(**kw)
    engine = llm.llm_engine
    result: dict = {
        "tokens": [],
        "cached": [],
        "prompt_ids": [],
        "finish": [],
        "preemptions": 0,
        "aborted_while": {},
        "pending_saves_at_finish": 0,
    }
    if sub is not None:
        if spec["kv_events"] == "tcp":  # (in this process: the engine core's publisher, bound now)
            where = engine.engine_core.engine_core.scheduler.kv_event_publisher.get_publisher_config().endpoint
            result["kv_events_endpoint"] = where
            sub.connect(where)
        result["events"] = []
    aio = None
    if not MP:  # the engine core lives in this process: look inside
        core = engine.engine_core.engine_core
        sched = core.scheduler
        aio = _aiokv(sched.connector)  # aiokv's scheduler-side connector (None: no connector)
        preempt = sched._preempt_request

        def counting_preempt(*a, **k):
            result["preemptions"] += 1
            return preempt(*a, **k)

        sched._preempt_request = counting_preempt
    if spec.get("ready_file"):  # tests waiting for the engine to be up (its index loaded, e.g. to hang the mount)
        if not MP and getattr(aio, "sched", None) is not None:
            result["index_wait_s"] = _wait_for_index(aio.sched.store, time.monotonic() + 120)
        with open(spec["ready_file"] + ".tmp", "w") as f:  # (the KV events' endpoint, if any)
            f.write(result.get("kv_events_endpoint", ""))
        os.replace(spec["ready_file"] + ".tmp", spec["ready_file"])
    if sub is not None:  # nothing is published before every subscriber is in (none was: no step yet)
        _wait_for_subscribers(
            engine.engine_core.engine_core.scheduler.kv_event_publisher,
            spec.get("kv_events_subscribers", 1),
            time.monotonic() + spec.get("phase_timeout", 300),
        )
    audit = _audit_fs() if spec.get("audit_fs") else None
    if spec.get("audit_saves") and not MP:
        result["save_violations"] = _audit_saves(aio)
    n_req = 0
    last_prompts: list = []
    for phase in spec["phases"]:
        if phase.get("settle"):
            _settle(engine, time.monotonic() + spec.get("phase_timeout", 300))
        if phase.get("room") and not MP:
            _wait_for_room(aio.sched.store, time.monotonic() + spec.get("phase_timeout", 300))
        if phase.get("wait_for"):
            until = time.monotonic() + spec.get("phase_timeout", 300)
            if not MP:
                _step_while_busy(engine, sched, until)
            while not os.path.exists(phase["wait_for"]):
                if time.monotonic() > until:
                    raise RuntimeError(f"{phase['wait_for']} did not appear")
                time.sleep(0.05)
        if phase.get("peer_blocks"):
            _wait_for_peer_blocks(
                aio.sched.store, phase["peer_blocks"], time.monotonic() + spec.get("phase_timeout", 300)
            )
        if phase.get("orders"):  # the operators' orders applied (read at the I/O thread's looks)
            until = time.monotonic() + spec.get("phase_timeout", 300)
            _refresh_until(
                aio.sched.store,
                lambda n=phase["orders"]: all(s.control.last >= n for _, _, s in aio.sched.store.drives()),
                until,
                f"this engine did not apply {phase['orders']} order(s)",
            )
            # and the KV events of what they removed published, before the phase saves the blocks
            # again: a block cleared and committed again before one step's take_events is, rightly,
            # neither removed nor stored again for a router (events.py; 6 of 12 removals seen)
            events = aio.scheduler_role.events
            while events is not None and events.behind:
                if time.monotonic() > until:
                    raise RuntimeError("the KV events of the orders were not handed to vLLM")
                _idle_step(core)
        if phase.get("reload_weights"):  # weights changed in place, as an RL trainer does
            llm.collective_rpc("reload_weights", kwargs={"weights_path": phase["reload_weights"]})
        if phase.get("reset_prefix_cache") is not None:
            result.setdefault("reset", []).append(llm.reset_prefix_cache(**phase["reset_prefix_cache"]))
        if phase.get("resave") and aio is not None:  # no look of aiokv's at the adapters sees a half-written one
            _adapters_idle(aio, time.monotonic() + spec.get("phase_timeout", 300))
        for src, dst in phase.get("resave") or ():  # an adapter re-saved in place (new modification times)
            for f in sorted(os.listdir(src)):
                with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                    b.write(a.read())
        for name, lid, path, *inplace in phase.get("add_lora") or ():  # loaded before any request names it
            from vllm.lora.request import LoRARequest

            engine.add_lora(LoRARequest(name, lid, path, load_inplace=bool(inplace and inplace[0])))
        if phase.get("stall"):  # tests/stallfs.py's control file: the mount hangs until the phase ends
            with open(phase["stall"], "w") as f:
                f.write(phase.get("stall_mode", "a"))
        t_phase = time.monotonic()
        prompts = phase["prompts"]
        if phase.get("follow"):  # the next turn of each conversation: its last prompt, the reply, new text
            prompts = [p + (r or []) + new for p, r, new in zip(last_prompts, result["tokens"][-1], prompts)]
        last_prompts = prompts
        salts = phase.get("salts") or [None] * len(prompts)
        pins = phase.get("pins") or [False] * len(prompts)  # kv_transfer_params {"aiokv": {"pin": true}}
        loras = phase.get("loras") or [None] * len(prompts)
        aborts = {int(k): v for k, v in (phase.get("abort_after") or {}).items()}
        ids = []
        pending = list(range(len(prompts)))
        outs: dict[str, object] = {}
        internal: dict[str, str] = {}  # our id -> vLLM's (it appends a suffix)
        step = 0
        deadline = time.monotonic() + spec.get("phase_timeout", 300)
        resets = list(phase.get("resets") or [])
        held = 0  # steps at whose start the next reset's condition held, in a row
        gate = phase.get("index_gate")
        waited = aio.sched.counters.index_waited if gate else 0  # (before this phase)
        while pending or engine.has_unfinished_requests() or resets:
            take = pending[:1] if phase.get("stagger") else pending
            for i in list(take):
                rid = f"r{n_req}"
                n_req += 1
                p = {"prompt_token_ids": prompts[i]}
                if salts[i] is not None:
                    p["cache_salt"] = salts[i]
                lora = None
                if loras[i] is not None:
                    from vllm.lora.request import LoRARequest

                    lora = LoRARequest(*loras[i])
                extra = {"kv_transfer_params": {"aiokv": {"pin": True}}} if pins[i] else None
                internal[rid] = engine.add_request(
                    rid,
                    p,
                    SamplingParams(
                        temperature=0, max_tokens=phase.get("max_tokens", 8), ignore_eos=True, extra_args=extra
                    ),
                    lora_request=lora,
                )
                ids.append((i, rid, step))
                pending.remove(i)
            if phase.get("abort_preempted") and not MP:
                for i, rid, _ in ids:
                    r = sched.requests.get(internal[rid])
                    if (
                        r is not None
                        and r.status.name == "PREEMPTED"
                        and rid not in outs
                        and result["aborted_while"].get("PREEMPTED", 0) < phase["abort_preempted"]
                    ):
                        aborts[i] = step - next(a for j, _, a in ids if j == i)
            if phase.get("abort_loading") and not MP:  # a load in flight when the abort lands, whatever the speed
                for i, rid, added in ids:
                    r = sched.requests.get(internal[rid])
                    if (
                        r is not None
                        and r.status.name == "WAITING_FOR_REMOTE_KVS"
                        and rid not in outs
                        and result["aborted_while"].get("WAITING_FOR_REMOTE_KVS", 0) < phase["abort_loading"]
                    ):
                        aborts[i] = step - added
                        break
            for i, rid, added in ids:
                if i in aborts and step - added == aborts[i] and rid not in outs:
                    if not MP:  # where the abort landed: WAITING, WAITING_FOR_REMOTE_KVS, RUNNING, PREEMPTED
                        r = sched.requests.get(internal[rid])
                        where = r.status.name if r is not None else "FINISHED"
                        result["aborted_while"][where] = result["aborted_while"].get(where, 0) + 1
                    engine.abort_request([rid])
                    outs[rid] = None
            if gate and aio.sched.counters.index_waited - waited >= len(prompts):
                _open_gate(gate)
                result["index_gate_step"], gate = step, None
            while resets:
                held = held + 1 if _reset_due(resets[0]["when"], aio) else 0
                if held < resets[0].get("steps", 1):
                    break
                held = 0
                result.setdefault("phase_resets", []).append([len(result["tokens"]), *_reset(llm, aio, resets.pop(0))])
            if phase.get("kill_at_step") and phase["kill_at_step"][0] == step:  # e.g. the bucket tier's server
                import signal

                os.killpg(phase["kill_at_step"][1], signal.SIGKILL)
            killer = phase.get("kill_when_loading")  # a process group killed once a load is in flight
            if killer and "killed_at_step" not in result and aio.sched.loads_in_flight:
                import signal

                os.killpg(killer, signal.SIGKILL)
                result["killed_at_step"] = step
            _hold(phase, step, aio, time.monotonic() + spec.get("phase_timeout", 300))
            if sub is not None:
                _take_events(sub, result["events"], 0)
            for o in engine.step():
                if o.finished and outs.get(o.request_id) is None and o.request_id not in outs:
                    outs[o.request_id] = o
                    if not MP and getattr(aio, "sched", None) is not None:  # saves still running
                        result["pending_saves_at_finish"] = max(
                            result["pending_saves_at_finish"], aio.sched.pending_saves
                        )
            step += 1
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not finish")
        toks, cached, fin, pids = [], [], [], []
        for _i, rid, _ in sorted(ids):
            o = outs.get(rid)
            toks.append(list(o.outputs[0].token_ids) if o is not None else None)
            cached.append(o.num_cached_tokens if o is not None else None)
            pids.append(list(o.prompt_token_ids) if o is not None else None)
            fin.append(o.outputs[0].finish_reason if o is not None else "aborted")
        result["tokens"].append(toks)
        result["cached"].append(cached)
        result["prompt_ids"].append(pids)
        result["finish"].append(fin)
        result.setdefault("seconds", []).append(round(time.monotonic() - t_phase, 3))
        if phase.get("announce") and aio is not None:  # until aiokv's start announcement is all published
            _announce(engine, aio, deadline)  # (KV events; a baseline's phases have no aiokv to wait for)
        if phase.get("done_file"):
            open(phase["done_file"], "w").close()
        if phase.get("stall") and not phase.get("stall_keep") and os.path.exists(phase["stall"]):
            os.unlink(phase["stall"])
        if gate:  # never opened: the loader must not stay held (the test sees no index_gate_step)
            _open_gate(gate)
    if audit is not None:
        result["fs_calls_on_engine_thread"] = sorted(audit.pop())
    if MP:  # aiokv's counters live in the engine core process: read them as vLLM exports them
        if spec.get("metrics"):
            result["metrics"] = {
                m.name: m.value
                for m in llm.get_metrics()
                if m.name.startswith("vllm:aiokv_") and isinstance(getattr(m, "value", None), (int, float))
            }
        llm.llm_engine.engine_core.shutdown()
        return result
    # let in-flight saves and loads report: keep stepping while aiokv has work, bounded by time,
    # not by a count of steps (2000 steps were not enough for a TP 2 life's last saves on a
    # loaded machine: pending_saves = 6 at the end, issue 41 item 1); what is still pending at
    # the deadline shows in the counters
    conn = aio
    end = time.monotonic() + spec.get("phase_timeout", 300)
    t_end, steps = time.monotonic(), 0
    if conn is not None and tp > 1:  # the worker-side connectors live in the worker processes
        while (sched.has_requests() or conn.has_pending_push_work()) and time.monotonic() < end:
            engine.step()
            steps += 1
            time.sleep(0.005)
        result["counters"] = conn.counters()
        # each rank's worker side, once its set-aside staging buffers are back (stuck_wait: below)
        wait = max(0.0, min(end, time.monotonic() + spec.get("stuck_wait", 30)) - time.monotonic())
        result["rank_counters"] = llm.collective_rpc(_worker_counters, args=(wait,))
        result["end_wait"] = [steps, round(time.monotonic() - t_end, 3)]  # (steps, s) after the last phase
    elif conn is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        wc = _aiokv(get_kv_transfer_group())
        while time.monotonic() < end:
            if wc.worker is not None:
                wc.worker.drain()
            if not sched.has_requests():
                break
            engine.step()
            steps += 1
        if spec.get("settle_at_end"):  # the bucket tier's uploads done before the counters are read
            _settle(engine, time.monotonic() + spec.get("phase_timeout", 300))
        # a job that ran out of its time limit set its staging buffers aside while the kernel still
        # held them (worker/staging.py): they come back once its I/O ends, which on a loaded disk may
        # be after the last step (CI: staging_in_use = 2 after a save over a least save_timeout);
        # spec stuck_wait (seconds, 30 unless given): at most this long (0 where the disk hangs)
        _wait_unstuck(wc, min(end, time.monotonic() + spec.get("stuck_wait", 30)))
        result["counters"] = {**conn.counters(), **wc.counters()}
        result["end_wait"] = [steps, round(time.monotonic() - t_end, 3)]
        result["pool_size"] = wc.worker.pool.count if wc.worker is not None else 0
    if sub is not None:
        # only now: a save that ended after the last output was committed, and its event
        # published, in one of the steps above (taking them before lost those: issue 37 item 12)
        _take_events(sub, result["events"], 1.0)
    if "aiokv.data.faults" in sys.modules:  # the test-only injector ran in this process: what it did
        result["faults_fired"] = dict(sys.modules["aiokv.data.faults"].FIRED)
    pool = sched.kv_cache_manager.block_pool
    result["free_blocks"] = pool.get_num_free_blocks()
    result["total_blocks"] = pool.num_gpu_blocks
    result["requests_left"] = len(sched.requests)
    core.shutdown()
    return result


def _open_gate(gate: dict) -> None:
    """An index_gate's control file: rewritten with `then`, or removed (the loader goes on)."""
    if gate.get("then") is None:
        if os.path.exists(gate["path"]):
            os.unlink(gate["path"])
    else:
        with open(gate["path"], "w") as f:
            f.write(gate["then"])


def _hold(phase: dict, step: int, aio, deadline: float) -> None:
    """A phase's unstall_at_step and hold_at_step, at the start of that step."""
    k, control = phase.get("unstall_at_step") or (None, None)
    if k == step:
        if os.path.exists(control):
            os.unlink(control)
        _adapters_idle(aio, deadline)  # the looks held by the stall end
    k, path = phase.get("hold_at_step") or (None, None)
    while k == step and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear")
        time.sleep(0.01)


def _adapters_idle(aio, deadline: float) -> None:
    """Wait until aiokv's LoRA adapters' I/O thread has no look queued or running."""
    fs = aio.scheduler_role.adapters.fs
    while fs is not None and fs.pending:
        if time.monotonic() > deadline:
            raise RuntimeError("the LoRA adapters' looks did not end")
        time.sleep(0.01)


def _announce(engine, aio, deadline: float) -> None:
    """Step with one-token requests (no block, nothing saved, no output kept) until every block of
    aiokv's start announcement was handed to vLLM: the labels are read on the store's I/O thread
    and published a batch a step, and vLLM publishes only at steps that have work."""
    from vllm import SamplingParams

    n = 0
    while not aio.scheduler_role.events.announced:
        if time.monotonic() > deadline:
            raise RuntimeError("aiokv's start announcement was not published")
        engine.add_request(f"announce-{n}", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1))
        n += 1
        while engine.has_unfinished_requests():
            engine.step()
        time.sleep(0.01)


def _reset_due(when: str, aio) -> bool:
    if when.startswith("fired:"):
        faults = sys.modules.get("aiokv.data.faults")
        return faults is not None and faults.FIRED.get(when[6:], 0) > 0
    if when in ("loading", "not_loading"):
        return bool(aio.sched.loads_in_flight) == (when == "loading")
    raise ValueError(f"unknown reset condition {when!r}")


def _reset(llm, aio, what: dict) -> list:
    """LLM.reset_prefix_cache(**kwargs): [its result or the exception's class name, whether
    aiokv's key epoch changed]."""
    epoch = aio.scheduler_role.epoch
    try:
        got = llm.reset_prefix_cache(**what.get("kwargs", {}))
    except Exception as e:
        got = type(e).__name__
    return [got, aio.scheduler_role.epoch != epoch]


def _xpub_publisher() -> None:
    """vLLM's ZMQ KV-event publisher from now on in this process, with an XPUB socket for its PUB:
    it sends alike, and hands over each subscription that reaches it (_wait_for_subscribers).
    vLLM's config accepts only its own publishers' names: this one takes "zmq" in its registry."""
    import zmq
    from vllm.distributed.kv_events import EventPublisherFactory, ZmqEventPublisher

    class Publisher(ZmqEventPublisher):
        def _socket_setup(self) -> None:
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not a topic's first only
            self._pub.set_hwm(self._hwm)
            self._endpoint = self._bind(self._pub, self._endpoint)
            super()._socket_setup()  # (it makes a PUB only where there is none)

    EventPublisherFactory._registry["zmq"] = Publisher


def _wait_for_subscribers(publisher, n: int, deadline: float) -> None:
    """Until n subscriptions reached the publisher (_xpub_publisher's). ZMQ drops what a publisher
    sends before a subscription reaches it, however long ago the subscriber connected; from the
    moment the XPUB socket hands a subscription over, it sends that subscriber every batch. Only
    before the engine's first step: the publisher's thread sends on that socket once there are
    events, and a ZMQ socket serves one thread at a time."""
    seen = 0
    while seen < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{seen} of {n} subscriptions reached the KV-event publisher")
        if publisher._pub.poll(int(left * 1000)):
            seen += publisher._pub.recv()[:1] == b"\x01"  # (an unsubscription starts with 0)


def _take_events(sub, into: list, quiet: float) -> None:
    """Every event batch the subscriber has, then until none came for `quiet` seconds."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    while sub.poll(int(quiet * 1000)):
        _, _, payload = sub.recv_multipart(zmq.NOBLOCK)
        for e in dec.decode(payload).events:
            if isinstance(e, BlockStored):
                into.append(
                    ["stored", e.medium, e.group_idx, list(e.block_hashes), e.parent_block_hash, list(e.token_ids)]
                )
            elif isinstance(e, BlockRemoved):
                into.append(["removed", e.medium, e.group_idx, list(e.block_hashes), None, []])
            else:
                into.append(["cleared", None, None, [], None, []])


def _worker_counters(worker, stuck_wait: float) -> dict:
    """Runs in each TP worker process (collective_rpc): its worker-side connector's counters, once
    the staging buffers its timed-out jobs set aside are back, or after stuck_wait seconds."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    wc = _aiokv(get_kv_transfer_group())
    _wait_unstuck(wc, time.monotonic() + stuck_wait)
    return wc.counters()


def _wait_unstuck(wc, deadline: float) -> None:
    """Until worker-side connector wc has no staging buffer set aside (a job past its time limit
    leaves it to the kernel's I/O, worker/staging.py), or the deadline passed."""
    while wc.worker is not None and wc.worker.stuck and time.monotonic() < deadline:
        time.sleep(0.01)


def _aiokv(conn):
    """aiokv's connector: conn itself, or the one inside vLLM's MultiConnector."""
    for c in getattr(conn, "_connectors", ()):
        if type(c).__name__ == "AioKVConnector":
            return c
    return conn


def _audit_fs():
    """From now on, record every file-system call aiokv makes on this (vLLM's) thread
    while the phases run: (function, aiokv module:line). Returns a list whose pop()
    stops the recording and gives the calls."""
    import builtins
    import threading

    from aiokv import _native

    main, calls, on = threading.current_thread(), set(), [True]
    names = [
        "open",
        "close",
        "read",
        "write",
        "pread",
        "pwrite",
        "preadv",
        "pwritev",
        "fstat",
        "stat",
        "lstat",
        "listdir",
        "scandir",
        "fsync",
        "fdatasync",
        "ftruncate",
        "truncate",
        "fstatvfs",
        "statvfs",
        "lseek",
        "replace",
        "rename",
        "unlink",
        "mkdir",
        "rmdir",
        "access",
        "posix_fallocate",
    ]

    def wrap(mod, name):
        fn = getattr(mod, name, None)
        if fn is None:
            return

        def audited(*a, **k):
            if on[0] and threading.current_thread() is main:
                f = sys._getframe(1)
                while f is not None and not f.f_globals.get("__name__", "").startswith("aiokv"):
                    f = f.f_back if f.f_globals.get("__name__", "") in ("os", "io", "contextlib") else None
                if f is not None:
                    calls.add(f"{name} {f.f_globals['__name__']}:{f.f_lineno}")
            return fn(*a, **k)

        setattr(mod, name, audited)

    for n in names:
        wrap(os, n)
    wrap(builtins, "open")
    wrap(_native, "fallocate")

    class Audit(list):
        def pop(self):
            on[0] = False
            return list(calls)

    return Audit()


def _audit_saves(conn) -> list:
    """From now on, check every step's saves against vLLM's own SchedulerOutput (one KV-cache
    group, admit: all, no cache reset, no breaker): a block is saved once all its tokens were
    computed in the request's current life (a new or resumed request starts one at its
    num_computed_tokens, rounded up to a block, with the table vLLM gives it whole), from the
    block id its current table holds; every such block whose key was neither stored nor being
    saved before the step is saved. Returns the list the violations are appended to."""
    from aiokv.scheduler.keys import extend_keys

    side, bs = conn.sched, conn.scheduler_role.block_size
    ns = side.groups[0].ns
    lives: dict[str, list] = {}  # request -> [first block of its life, blocks full so far, block table]
    violations: list = []
    build = conn.build_connector_meta

    def audited(so):
        before = set(ns.keys()) | set(ns.pending)
        meta = build(so)
        saved = {(t.req_id, k): b for t in meta.plan.saves for k, b in zip(t.keys, t.block_ids)}
        spec = so.scheduled_spec_decode_tokens or {}
        c = so.scheduled_cached_reqs
        steps = [(r.req_id, r.num_computed_tokens, list(r.block_ids[0]), True) for r in so.scheduled_new_reqs]
        for i, r in enumerate(c.req_ids):
            ids = c.new_block_ids[i]
            steps.append((r, c.num_computed_tokens[i], list(ids[0]) if ids else [], r in (c.resumed_req_ids or ())))
        expected = {}
        for r, computed, ids, whole in steps:
            if whole:
                start = -(-computed // bs)
                lives[r] = [start, start, ids]
            elif r in lives:
                lives[r][2] += ids
            st = side.requests.get(r)
            if r not in lives or st is None:
                continue
            start, done, table = lives[r]
            full = min(
                (computed + so.num_scheduled_tokens.get(r, 0) - len(spec.get(r, ()))) // bs, len(st.tokens) // bs
            )
            keys = extend_keys(list(st.keys), st.root, st.tokens, bs, full)
            for j in range(max(start, done), min(full, len(table))):
                expected[(r, keys[j])] = table[j]
            lives[r][1] = max(done, full)
        for (r, k), b in saved.items():
            if expected.get((r, k)) != b:
                violations.append(f"{r}: saved from block {b}, its current life's table holds {expected.get((r, k))}")
        saved_keys = {k for _, k in saved}
        for (r, k), b in expected.items():
            if k not in saved_keys and k not in before:  # (the same block of another request: saved once)
                violations.append(f"{r}: a block computed in its current life (id {b}) was not saved")
        return meta

    conn.build_connector_meta = audited
    return violations


def _refresh_until(store, holds, deadline: float, failure: str) -> float:
    """store.refresh() (it applies the I/O and loader threads' results, as the scheduler's step
    does) until holds() is true; returns the seconds that took, raises past the deadline."""
    t0 = time.monotonic()
    while True:
        store.refresh()
        if holds():
            return round(time.monotonic() - t0, 3)
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.01)


def _wait_for_index(store, deadline: float) -> float:
    """Until every namespace's index has loaded, or its loader thread ended (a load that
    failed) before the last refresh; returns the seconds waited."""
    stores = [s for _, _, s in store.drives()]  # several drives: a Store each
    ended = [False]  # the loaders had ended before the last refresh (it applied what they handed over)

    def holds() -> bool:
        if ended[0] or all(ns.ready for ns in store.namespaces()):
            return True
        ended[0] = not any(s._loader is not None and s._loader.is_alive() for s in stores)
        return False

    return _refresh_until(store, holds, deadline, "aiokv's index did not load")


def _wait_for_room(store, deadline: float) -> None:
    """Until every namespace's index has loaded and no grow of the data files is in flight."""
    _wait_for_index(store, deadline)
    stores = [s for _, _, s in store.drives()]
    _refresh_until(store, lambda: not any(s.space.growing for s in stores), deadline, "aiokv's space was not reserved")


def _wait_for_peer_blocks(store, n: int, deadline: float) -> None:
    """Until the store sees n blocks of the other engines (it looks every FOLLOW_INTERVAL)."""
    _refresh_until(
        store,
        lambda: sum(ns.count(e) for ns in store.namespaces() for e in ns.peers()) >= n,
        deadline,
        f"this engine did not see {n} blocks of the other engines",
    )


def _settle(engine, deadline: float) -> None:
    """Step the engine until no save, load or upload of aiokv's is outstanding."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():  # no connector: nothing to wait for
        return
    wc = _aiokv(get_kv_transfer_group())
    workers = list(getattr(wc.worker, "workers", {0: wc.worker}).values())
    while any(w.in_flight or (w.uploader is not None and w.uploader.pending) for w in workers):
        if time.monotonic() > deadline:
            raise RuntimeError("aiokv's saves and uploads did not settle")
        engine.step()
        time.sleep(0.01)
    core = engine.engine_core.engine_core
    _step_while_busy(engine, core.scheduler, deadline)  # its report too
    # uploads that ended after the last step: their counts wait in the worker until a step takes
    # them; vLLM steps an idle engine only while its connector has push work, so step as it does
    # then (an empty schedule, the connector's no-forward path) until the worker has handed all over
    while any(not w.results.quiet for w in workers):
        if time.monotonic() > deadline:
            raise RuntimeError("aiokv's worker did not hand over its counts")
        _idle_step(core)


def _idle_step(core) -> None:
    """One step of an engine with no request (an empty schedule, the connector's no-forward
    path; vLLM's update_from_output takes and publishes the connector's KV events)."""
    core.scheduler.has_requests = lambda: True  # (an instance attribute over the method, one step)
    try:
        core.step()
    finally:
        del core.scheduler.has_requests
    time.sleep(0.005)


def _step_while_busy(engine, sched, deadline: float) -> None:
    """Step while the scheduler has work, as vLLM's engine-core loop does between requests:
    requests, or saves the workers have not reported yet (has_pending_push_work). LLMEngine's
    has_unfinished_requests sees only outputs: a save that ends after a phase's last output
    is reported, and committed, only at a later step (an engine left waiting idle showed its
    last blocks to no other engine)."""
    while sched.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError("the engine kept work for the whole phase timeout")
        engine.step()
        time.sleep(0.005)


if __name__ == "__main__":
    res = main(json.loads(sys.argv[1]))
    sys.stdout.write("RESULT " + json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip slow interpreter teardown of torch/vLLM
