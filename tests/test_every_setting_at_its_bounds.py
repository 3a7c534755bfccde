# SPDX-License-Identifier: Apache-2.0
"""Every setting at its bounds and just inside them either refuses at start in one line
naming the setting and what it accepts, or serves tokens identical to a run without aiokv.

The bugs (issue 37, item 2), each an accepted value that could not work:
- start_timeout above ~292 years (1e300): vLLM did not start, `OverflowError: timestamp out
  of range for platform time_t` out of the connector (a thread's join);
- a NaN load_timeout or save_timeout (`"nan"`) was accepted: every save failed (asyncio's
  wait_for) and the breaker opened; infinity was accepted too;
- queue_depth above 16384 (io_uring rings hold 32768 entries, aiokv's are 2 x depth): the
  kernel refused the ring and aiokv said "io_uring unavailable (Invalid argument)" and used
  threads; fractional and true/false depths and breaker_failures were silently truncated;
- memory or staging of infinity: OverflowError out of the config, not a line; staging +
  memory beyond the machine: each worker populates both at start (the kernel's OOM killer,
  or an mmap refused as a bare ENOMEM), and a populate refused for lack of memory fell back
  to touching every page;
- admit_window above 429,496,729: see tests/test_scheduler_hooks_never_raise_into_vllm.py.
The fix: aiokv/config.py bounds every number (README's settings table, "accepted" column;
config.TIMEOUTS, MAX_SECONDS, MAX_QUEUE_DEPTH), sizes are finite, staging + memory at most
the machine's memory; a worker refuses (one line, vLLM serves on without it) staging +
memory beyond what is free when it starts (worker/host.py), and a staging arena whose
populate is refused raises instead of touching every page (data/buffers.py).

The invariants: the validator's table below (every setting: accepted at its bounds and just
inside, refused just outside with its exact one-line message), and three real-vLLM lives,
each combining many settings at their extremes, with a bucket tier: every setting at its
least accepted value; every setting at its largest (64 drives, depth 16384, a day for
every timeout, 64 checksum threads, admit reused at 2^30, a 10^30-byte capacity and upload
queue); capacity, staging and memory below one block. tools/fuzz.py draws every life's
settings from these ranges.
"""

from __future__ import annotations

import math

import pytest

from aiokv.config import MAX_QUEUE_DEPTH, MAX_SECONDS, TIMEOUTS, AioKVConfig, ConfigError, physical_memory
from tests.e2e import happened, prompts, run

OK = object()  # accepted, parsed to the value given (or to `want` where the row says)


def _timeouts():
    rows = []
    for name, least in TIMEOUTS.items():
        lo = "above 0" if least == 0 else f"from {least:g}"
        say = f"aiokv: {name} must be a number of seconds {lo} to 86400 (a day), not "
        pos = f"aiokv: {name} must be positive: a number of seconds {lo} to 86400 (a day), not "
        smallest = least if least else 5e-324
        rows += [
            (name, smallest, OK),
            (name, smallest * 1.5, OK),
            (name, MAX_SECONDS, OK),
            (name, MAX_SECONDS - 1, OK),
            (name, str(MAX_SECONDS), (OK, MAX_SECONDS)),
            (name, MAX_SECONDS + 0.001, say + "86400.001"),
            (name, 1e300, say + "1e+300"),
            (name, "inf", say + "'inf'"),
            (name, "nan", pos + "'nan'"),
            (name, math.nan, pos + "nan"),
            (name, 0, pos + "0"),
            (name, -1, pos + "-1"),
            (name, True, pos + "True"),
            (name, "soon", pos + "'soon'"),
        ]
        if least:
            rows.append((name, least / 2, say + repr(least / 2)))
    return rows


DEPTH = f"a whole number from 1 to {MAX_QUEUE_DEPTH} (I/O operations in flight per worker and drive)"
SIZE = "(use bytes or a unit like 200GiB)"
PINS = (
    'aiokv: request_pins must be "*", a list of tenants, or an object of tenant -> size or null, such as '
    '["acme", ""] or {"acme": "1GiB", "*": null}'
)

TABLE = [
    # sizes
    ("capacity", 1, OK),
    ("capacity", "1B", (OK, 1)),
    ("capacity", "4KiB", (OK, 4096)),
    ("capacity", 10**30, OK),
    ("capacity", "1e30", (OK, int(1e30))),
    ("capacity", 0, "aiokv: capacity must be positive: a size such as 4GiB"),
    ("capacity", "0.5", "aiokv: capacity must be positive: a size such as 4GiB"),
    ("capacity", -1, "aiokv: capacity must be positive: a size such as 4GiB"),
    ("capacity", "lots", f"aiokv: capacity: not a size: 'lots' {SIZE}"),
    ("capacity", math.inf, f"aiokv: capacity: not a size: inf {SIZE}"),
    ("capacity", "1e400", f"aiokv: capacity: not a size: '1e400' {SIZE}"),
    ("capacity", True, f"aiokv: capacity: not a size: True {SIZE}"),
    ("staging", 1, OK),
    ("staging", 2, OK),
    ("staging", 0, "aiokv: staging must be positive: a size such as 4GiB"),
    ("staging", math.nan, f"aiokv: staging: not a size: nan {SIZE}"),
    ("upload_queue", 1, OK),
    ("upload_queue", 10**30, OK),
    ("upload_queue", 0, "aiokv: upload_queue must be positive: a size such as 4GiB"),
    ("memory", 0, OK),
    ("memory", 1, OK),
    ("memory", "0", (OK, 0)),
    ("memory", -1, "aiokv: memory must be 0 (off) or a size such as 4GiB"),
    ("memory", math.inf, f"aiokv: memory: not a size: inf {SIZE}"),
    ("pin_capacity", 0, OK),
    ("pin_capacity", 1, OK),
    ("pin_capacity", "1GiB", (OK, 1 << 30)),
    ("pin_capacity", -1, "aiokv: pin_capacity must be 0 (no pins) or a size such as 4GiB"),
    ("pin_capacity", "most", f"aiokv: pin_capacity: not a size: 'most' {SIZE}"),
    ("quota", {"*": 1}, OK),
    ("quota", {"acme": "1GiB", "": 4096, "*": "1e30"}, (OK, {"acme": 1 << 30, "": 4096, "*": int(1e30)})),
    ("quota", '{"acme": "2KiB"}', (OK, {"acme": 2048})),
    ("quota", {}, OK),
    ("quota", {"acme": 0}, "aiokv: quota['acme'] must be a positive size, such as 5GiB"),
    ("quota", {"acme": "big"}, f"aiokv: quota['acme']: not a size: 'big' {SIZE}"),
    ("quota", "5GiB", 'aiokv: quota must be an object of tenant -> size, such as {"acme": "20GiB", "*": "5GiB"}'),
    ("quota", [1], 'aiokv: quota must be an object of tenant -> size, such as {"acme": "20GiB", "*": "5GiB"}'),
    ("request_pins", {}, OK),
    ("request_pins", "*", (OK, {"*": None})),
    ("request_pins", ["acme", ""], (OK, {"acme": None, "": None})),
    ("request_pins", {"acme": 1, "*": None}, OK),
    ("request_pins", {"acme": "1e30"}, (OK, {"acme": int(1e30)})),
    ("request_pins", {"acme": 0}, "aiokv: request_pins['acme'] must be a positive size, such as 5GiB"),
    ("request_pins", "acme", PINS),
    ("request_pins", [1], PINS),
    ("request_pins", 5, PINS),
    # whole numbers
    ("queue_depth", 1, OK),
    ("queue_depth", 2, OK),
    ("queue_depth", MAX_QUEUE_DEPTH, OK),
    ("queue_depth", MAX_QUEUE_DEPTH - 1, OK),
    ("queue_depth", "32", (OK, 32)),
    ("queue_depth", 0, f"aiokv: queue_depth must be {DEPTH}, not 0"),
    ("queue_depth", MAX_QUEUE_DEPTH + 1, f"aiokv: queue_depth must be {DEPTH}, not {MAX_QUEUE_DEPTH + 1}"),
    ("queue_depth", 10**9, f"aiokv: queue_depth must be {DEPTH}, not 1000000000"),
    ("queue_depth", 2.5, f"aiokv: queue_depth must be {DEPTH}, not 2.5"),
    ("queue_depth", True, f"aiokv: queue_depth must be {DEPTH}, not True"),
    ("queue_depth", "deep", f"aiokv: queue_depth must be {DEPTH}, not 'deep'"),
    ("breaker_failures", 0, OK),
    ("breaker_failures", 1, OK),
    ("breaker_failures", 10**18, OK),
    ("breaker_failures", -1, "aiokv: breaker_failures must be a whole number: 0 (off) or more, not -1"),
    ("breaker_failures", 1.5, "aiokv: breaker_failures must be a whole number: 0 (off) or more, not 1.5"),
    ("breaker_failures", False, "aiokv: breaker_failures must be a whole number: 0 (off) or more, not False"),
    ("checksum_threads", 0, OK),
    ("checksum_threads", 1, OK),
    ("checksum_threads", 63, OK),
    ("checksum_threads", 64, OK),
    *(
        (
            "checksum_threads",
            v,
            f"aiokv: checksum_threads must be a whole number from 0 (on the loop thread) to 64, not {v!r}",
        )
        for v in (-1, 65, 2.0, True, "2")
    ),
    ("admit_window", 1, OK),
    ("admit_window", 2, OK),
    ("admit_window", (1 << 30) - 1, OK),
    ("admit_window", 1 << 30, OK),
    *(
        ("admit_window", v, f"aiokv: admit_window must be a whole number of sightings from 1 to 2^30, not {v!r}")
        for v in (0, (1 << 30) + 1, 1.0, "5", True)
    ),
    # choices and switches
    ("io", "auto", OK),
    ("io", "uring", OK),
    ("io", "threads", OK),
    ("io", "dma", "aiokv: io must be auto, uring or threads, not 'dma'"),
    ("admit", "all", OK),
    ("admit", "reused", OK),
    (
        "admit",
        "some",
        "aiokv: admit must be all (every block to disk) or reused (blocks seen twice), not 'some'",
    ),
    *(
        row
        for name in ("strict_load_failures", "layerwise", "bucket_unsigned", "kv_events", "save_generated")
        for row in ((name, True, OK), (name, False, OK), (name, "yes", f"aiokv: {name} must be true or false"))
    ),
    # the rest
    ("secret", "s" * 16, OK),
    ("secret", "s" * 4096, OK),
    ("secret", "s" * 15, "aiokv: secret (or AIOKV_SECRET) must be a string of at least 16 characters"),
    ("path", [f"/tmp/aiokv-bounds/{i}" for i in range(64)], OK),
    ("path", [f"/tmp/aiokv-bounds/{i}" for i in range(65)], "aiokv: path lists 65 directories; at most 64"),
    ("path", [], "aiokv: path is an empty list; give at least one directory"),
    ("bucket", "s3://ok-bucket/kv", OK),
    ("bucket", "http://x/kv", "aiokv: bucket must look like s3://BUCKET/PREFIX, got 'http://x/kv'"),
    *_timeouts(),
]


@pytest.mark.parametrize("name,value,want", TABLE, ids=[f"{n}={v!r}"[:60] for n, v, _ in TABLE])
def test_each_setting_is_accepted_within_its_bounds_and_refused_in_one_line_outside(name, value, want):
    extra = {"path": "/tmp/aiokv-bounds", name: value}
    if name == "bucket":
        extra["bucket_unsigned"] = True
    if name == "path":
        extra[name] = value
    if want is OK or isinstance(want, tuple):
        cfg = AioKVConfig.from_extra(extra)
        got = cfg.paths if name == "path" else getattr(cfg, name)
        expect = value if want is OK else want[1]
        if name == "path":
            expect = [str(p) for p in value]
        assert got == expect and type(got) is type(expect), (got, expect)
    else:
        with pytest.raises(ConfigError) as e:
            AioKVConfig.from_extra(extra)
        assert str(e.value) == want
        assert "\n" not in str(e.value)


def test_staging_and_memory_beyond_the_machine_are_refused_in_one_line():
    ram = physical_memory()
    assert ram > 0
    assert AioKVConfig.from_extra({"path": "/tmp/x", "staging": 1, "memory": ram - 1}).memory == ram - 1  # at most
    assert AioKVConfig.from_extra({"path": "/tmp/x", "staging": ram, "memory": 0}).staging == ram
    for staging, memory in ((1, ram), (ram, 1), (256 << 20, 1000 << 40)):
        with pytest.raises(ConfigError) as e:
            AioKVConfig.from_extra({"path": "/tmp/x", "staging": staging, "memory": memory})
        assert str(e.value) == (
            f"aiokv: staging + memory ({(staging + memory) / (1 << 30):.1f} GiB) exceed this machine's memory "
            f"({ram / (1 << 30):.1f} GiB); each worker holds both from its start: lower memory (or staging)"
        )


def test_a_worker_refuses_staging_and_memory_beyond_what_is_free(monkeypatch):
    """The config knows the machine; a worker knows what is free when it starts (other ranks,
    other processes): beyond it, it refuses in one line (vLLM serves on without it) instead of
    populating an arena the kernel would kill the engine for."""
    from aiokv.worker import host

    monkeypatch.setattr(host, "available_memory", lambda: 64 << 20)
    with pytest.raises(MemoryError) as e:
        host.WorkerHost(1 << 16, 32 << 20, 64 << 20, 0, 0)
    assert str(e.value) == (
        "staging + memory take 96 MiB of host memory in each worker; 64 MiB is available: lower memory (or staging)"
    )
    h = host.WorkerHost(1 << 16, 16 << 20, 32 << 20, 0, 0)  # 48 MiB: fits
    h.close()


def test_a_refused_populate_raises_instead_of_touching_every_page(monkeypatch):
    import errno
    import mmap

    from aiokv.data import buffers

    real = mmap.mmap.madvise

    class Refusing(mmap.mmap):
        def madvise(self, option, *a):
            if option == buffers.MADV_POPULATE_WRITE:
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return real(self, option, *a)

    monkeypatch.setattr(buffers.mmap, "mmap", Refusing)
    with pytest.raises(MemoryError, match="cannot populate"):
        buffers.Arena(8 << 20, populate=True)


# ---------------------------------------------------------------- real vLLM

# 6 full blocks each, every prompt twice in a row (at admit_window 1 a block is remembered for one or
# two requests' sightings: the second copy is admitted)
PS = [p for p in prompts(3, 200, seed=37) for _ in range(2)]
# vLLM's own prefix cache off: every phase computes its prompts, and the repeats are aiokv's hits;
# the third phase waits for the saves before it (settle)
PHASES = [dict(prompts=PS, max_tokens=4), dict(prompts=PS, max_tokens=4), dict(prompts=PS, max_tokens=4, settle=True)]
SECRET = "bounds-secret-0123456789"


@pytest.fixture(scope="module")
def baseline(tiny_model):
    return run(dict(model=tiny_model, prefix_caching=False, phases=PHASES))


def _life(tiny_model, cache: str, extra: dict, s3env) -> dict:
    return run(dict(model=tiny_model, prefix_caching=False, cache=cache, extra=extra, phases=PHASES), env=s3env.env())


@pytest.mark.vllm
def test_every_setting_at_its_least_serves_identical_tokens(tiny_model, tmp_path, baseline, s3env):
    least = {k: (v if v else 5e-324) for k, v in TIMEOUTS.items()}
    extra = dict(
        least,
        staging=1,  # below one block (4 blocks' buffers are made)
        memory=1,  # below one block: holds nothing
        queue_depth=1,
        breaker_failures=0,
        checksum_threads=0,
        secret=SECRET[:16],
        bucket=s3env.url("least"),
        upload_queue=1,  # below one block: every upload is dropped
        admit="reused",
        admit_window=1,
        pin_capacity=0,  # no pins
    )
    res = _life(tiny_model, str(tmp_path / "c"), extra, s3env)
    # 10 ms for a load, a save, a journal append: on a busy machine some may run out (then recomputed,
    # dropped); the tokens never change
    happened(
        res,
        baseline,
        allow_load_errors=True,
        allow_save_errors=True,
        saves_planned=">0",
        saves_not_admitted=">0",
        hook_errors=0,
    )
    assert res["counters"]["upload_dropped_queue_full"] > 0


@pytest.mark.vllm
def test_every_setting_at_its_largest_serves_identical_tokens(tiny_model, tmp_path, baseline, s3env):
    extra = dict(
        {k: MAX_SECONDS for k in TIMEOUTS},
        path=[str(tmp_path / f"d{i}") for i in range(64)],
        capacity=10**30,
        upload_queue=10**30,
        queue_depth=MAX_QUEUE_DEPTH,
        breaker_failures=10**18,
        checksum_threads=64,
        admit="reused",
        admit_window=1 << 30,
        quota={"*": 10**30},
        pin_capacity=10**30,
        secret=SECRET * 200,
        bucket=s3env.url("most"),
    )
    res = _life(tiny_model, str(tmp_path / "d0"), extra, s3env)
    # admit reused: phase 1 meets the blocks, phase 2 meets them again and writes them, phase 3 hits them
    happened(res, baseline, saves_committed=">0", hit_blocks=">0", hook_errors=0, uploaded=">0")
    assert "unavailable" not in res["log"], "io_uring refused at depth 16384 on 64 drives"


@pytest.mark.vllm
def test_capacity_staging_and_memory_below_one_block_serve_identical_tokens(tiny_model, tmp_path, baseline, s3env):
    extra = dict(capacity=1, staging=1, memory=1)
    res = _life(tiny_model, str(tmp_path / "c"), extra, s3env)
    happened(res, baseline, saves_committed=0, hit_blocks=0, hook_errors=0, store_skipped_no_space=">0")
