# SPDX-License-Identifier: Apache-2.0
"""Every benchmark that runs without a vLLM engine still runs, and still prints the figures it promises.

Bug: nothing ran the scripts under tools/. Two of them were found broken on main only when someone
next reached for them (tools/bench_store.py by an argument a BlockIO call no longer took,
tools/bench_overhead.py by a module that had moved). This test found three more:
`tools/bench_index.py --engines K` failed at any N between 2000 and 200 000 (its followers asserted
engine 0's N blocks while the open phase had evicted more blocks than it committed);
`tools/bench_engines.py --sqlite --roll N --json` printed those figures as text lines ahead of the
JSON document; `tools/bench_crc_in_copy.py --baseline` passed a MAC key of None to any baseline
build, and every build since the MAC scheme byte takes an int there (a TypeError in the save).
Invariant: each script below, at its smallest settings (tiny sizes, one round, its own temp
directories), exits 0; with --json its stdout is exactly one JSON document (with --out, the same
document in the file), and the figures its docstring promises are there: keys present, numbers
finite, and above 0 where a speed, a time or a count must be.
Fix: each script fixed where this test found it broken (git log names the failure); this test
keeps them running, in the engine-free part of tools/test.sh (the whole module: about 45 s on 2
cores, a third of it bench_overhead's vLLM import).

Left out, each for a reason no flag removes:
- bench_e2e.py, bench_chat.py, bench_serve.py, bench_step_hooks.py, and bench_overhead.py's
  throughput part: they start vLLM engines (bench_overhead runs here with --skip-throughput;
  bench_store with --no-vllm: its vLLM file-system tier contender costs a vLLM import, 5-9 s);
- bench_store.py --peers (bench_store_peers.py) and peer_faults.py: they need LMCache's raw-block
  tier (the optional extra `peers`, tools/peers.py), not installed here or in CI; bench_store runs
  with --no-raw-block, which would otherwise install it into .bench-peer/;
- bench_fresh_buffers.py: root, three loop-mounted file systems of 3 GiB and 1 GiB pools, all
  fixed; trace_io.py: root and perf recording the whole machine; bench_drives.py --loop and
  bench_footprint.py --merge-control: root (bench_drives runs on plain directories instead);
- fuzz.py (vLLM engines: tests/test_fuzz.py), gpu_check.py (tests/test_gpu_check_runs_without_a_gpu.py),
  dashboard.py (a Prometheus: tests/test_dashboard_queries_answer_e2e.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 240  # seconds a script may take: each takes 1-12 here, so only a hang reaches it


def _run(tmp_path, script: str, *args: str) -> str:
    """`python tools/SCRIPT ARGS` with this tree's aiokv, in tmp_path (its temp files there too);
    its stdout, after asserting it exited 0."""
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path))
    for k in ("AWS_ENDPOINT_URL", "AIOKV_IO"):  # bench_bucket starts its own server; the default backend
        env.pop(k, None)
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, f"{script} {' '.join(args)} exited {p.returncode}:\n{p.stderr[-4000:]}"
    return p.stdout


def document(tmp_path, script: str, *args: str, after: tuple[str, ...] = ()) -> dict:
    """A harness script's run with --json --out (then `after`): stdout is one JSON document, the
    file the same."""
    out = tmp_path / f"{script}.json"
    stdout = _run(tmp_path, script, *args, "--json", "--out", str(out), *after)
    try:
        doc = json.loads(stdout)
    except ValueError as e:
        raise AssertionError(f"{script} --json printed more than one JSON document ({e}):\n{stdout[:2000]}") from None
    assert json.loads(out.read_text()) == doc, f"{script}: --out holds another document than stdout"
    return doc


def line(tmp_path, script: str, *args: str) -> dict:
    """A script that prints one JSON line with --json."""
    stdout = _run(tmp_path, script, *args, "--json").strip()
    assert stdout.count("\n") == 0, f"{script} --json printed more than one line:\n{stdout[:2000]}"
    return json.loads(stdout)


def positive(where: str, d: dict, *keys: str) -> None:
    """Each key is in d, a finite number above 0."""
    for k in keys:
        assert k in d, f"{where}: no {k!r} in {sorted(d)}"
        v = d[k]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"{where}: {k} = {v!r}"


def finite(where: str, d: dict, *keys: str) -> None:
    """Each key is in d, a finite number (a difference or a growth that may be 0 or below)."""
    for k in keys:
        assert k in d, f"{where}: no {k!r} in {sorted(d)}"
        assert isinstance(d[k], (int, float)) and math.isfinite(d[k]), f"{where}: {k} = {d[k]!r}"


def test_bench_store_times_aiokv_and_fio_on_the_same_blocks(tmp_path):
    doc = document(
        tmp_path, "bench_store.py", "--sizes", "64K", "--depth", "4", "--mib", "16", "--rounds", "1",
        "--no-raw-block", "--no-vllm", "--per-block-reads", "--no-crc-too", "--fixedbufs",
        "--checksum-threads", "1", "--secret", "s3cret", "--plot", str(tmp_path / "plots"),
    )  # fmt: skip
    assert doc["contenders"] == ["aiokv", "fio", "aiokv_blocks", "aiokv_nocrc", "fio_fixedbufs"], doc["contenders"]
    assert doc["raw_block"] == doc["vllm_fs"] == "skipped" and doc["secret"] and doc["checksum_threads"] == 1
    (row,) = doc["results"]
    assert (row["size"], row["depth"], row["blocks"]) == (65536, 4, 16 * 2**20 // row["slot_bytes"])
    for who in doc["contenders"]:
        positive(f"results.{who}", row[who], "write_gbps", "read_gbps", "write_payload_gbps", "read_payload_gbps")
    for who in ("aiokv", "aiokv_blocks", "aiokv_nocrc"):
        positive(f"results.{who}", row[who], "io_write_gbps", "io_read_gbps", "write_cpu_s_per_gb")
    for pre in ("", "blocks_", "nocrc_"):
        for ratio in ("ratio_fio", "ratio_fio_data_path", "ratio_fio_fixedbufs"):
            positive(pre + ratio, row[pre + ratio], "write", "read")
    (ov,) = doc["overhead"]
    positive("overhead", ov, "write_cpu_us", "read_cpu_us", "crc_us")
    assert os.listdir(tmp_path / "plots"), "--plot drew nothing"


def test_bench_store_loads_can_copy_into_a_kv_cache(tmp_path):
    """--copy-in (each chunk copied out as a worker's load does: a failed CRC in the copy would fail
    the load, and the run) on the loop thread (whole, or in pieces with the ring reaped between them) and on a
    thread, with --window-slack recorded."""
    for where in ("loop", "pumped", "thread"):
        doc = document(
            tmp_path, "bench_store.py", "--sizes", "64K", "--depth", "4", "--mib", "8", "--rounds", "1",
            "--no-raw-block", "--no-vllm", "--no-crc-too", "--copy-in", where, "--window-slack", "1",
        )  # fmt: skip
        assert (doc["params"]["copy_in"], doc["params"]["window_slack"]) == (where, 1), doc["params"]
        (row,) = doc["results"]
        for who in ("aiokv", "aiokv_nocrc"):
            positive(f"results.{who}", row[who], "write_gbps", "read_gbps")


def test_plot_without_matplotlib_is_refused_before_the_run(tmp_path):
    """CI's fresh machine had no matplotlib (tools/setup.sh did not install it): bench_store ran its
    whole benchmark, then died in the plot with a traceback. Now setup installs it, and where it is
    absent --plot is refused when parsing, in one line naming the fix, before any I/O."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib (hidden by the test)')\n")
    env = dict(os.environ, PYTHONPATH=f"{shadow.parent}{os.pathsep}{ROOT}", TMPDIR=str(tmp_path))
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_store.py"), "--sizes", "64K", "--mib", "16",
         "--no-raw-block", "--no-vllm", "--plot", str(tmp_path / "plots")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    last = p.stderr.strip().splitlines()[-1]
    assert "--plot" in last and "pip install matplotlib" in last and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "plots").exists() and not any(tmp_path.glob("aiokv*")), os.listdir(tmp_path)


def test_bench_store_times_concurrent_calls_alone(tmp_path):
    doc = document(
        tmp_path, "bench_store.py", "--sizes", "64K", "--depth", "4", "--mib", "16", "--rounds", "1",
        "--no-raw-block", "--no-vllm", "--no-null", "--mode", "calls", "--workers", "2", "--only", "aiokv",
    )  # fmt: skip
    assert doc["contenders"] == ["aiokv"] and doc["overhead"] == [], (doc["contenders"], doc["overhead"])
    (row,) = doc["results"]
    assert (doc["params"]["mode"], row["workers"]) == ("calls", 2)
    positive("results.aiokv", row["aiokv"], "write_gbps", "read_gbps", "write_cpu_s_per_gb", "read_cpu_s_per_gb")


def test_bench_overhead_times_the_scheduler_side_and_the_layer_hooks(tmp_path):
    doc = document(tmp_path, "bench_overhead.py", "--skip-throughput", "--running", "8")
    sc = doc["scheduler"]
    assert sc["stored_blocks"] > 20000 and "throughput" not in doc
    positive("scheduler.lookup_us", sc["lookup_us"], "first_call", "repeat_call", "hit_tokens_per_lookup")
    (step,) = sc["step"]
    assert step["running"] == 8
    positive("scheduler.step", step, "median_us", "mean_us", "max_us")
    positive("hooks", doc["hooks"], "save_kv_layer_ns", "wait_for_layer_load_ns", "per_step_us", "layers")


def test_bench_ceiling_moves_slots_over_the_null_backend(tmp_path):
    doc = document(
        tmp_path, "bench_ceiling.py", "--gib", "0.01", "--sizes", "256K", "--threads", "0,1", "--depth", "8",
        "--rounds", "1",
    )  # fmt: skip
    assert [(r["payload"], r["threads"]) for r in doc["results"]] == [(262144, 0), (262144, 1)]
    for r in doc["results"]:
        for rw in ("write", "read"):
            positive(f"{rw} at {r['threads']} threads", r[rw], "gbps", "cpu_s_per_gb", "loop_s_per_gb")


def test_bench_crc_times_each_path_against_the_memory_floor(tmp_path):
    doc = document(tmp_path, "bench_crc.py", "--hot-mib", "1", "--cold-mib", "4", "--rounds", "1", "--baseline", ROOT)
    paths = doc["gbps"]
    assert "floor (sum u64)" in paths and f"base {doc['path_default']}" in paths, sorted(paths)
    assert f"new {doc['path_default']}" in paths, sorted(paths)
    for path, got in paths.items():
        positive(path, got, "hot", "cold")


def test_bench_crc_in_copy_times_separate_and_in_copy_checksums(tmp_path):
    # --baseline: this tree's own build loaded beside it, as another build would be
    doc = document(
        tmp_path, "bench_crc_in_copy.py", "--gib", "0.02", "--layers", "2", "--rounds", "1", "--baseline", ROOT
    )
    assert doc["blocks"] >= 8 and [c.split()[0] for c in doc["contenders"]] == ["new", "base"], doc["contenders"]
    for where in ("disk save", "disk load", "memory save", "memory load", "copy in"):
        for how in ("separate", "in copy"):
            rows = [v for k, v in doc["results"].items() if k.startswith(f"{where}|") and k.endswith(f"|{how}")]
            assert len(rows) == 2, f"not both builds' {where} | {how} in {sorted(doc['results'])}"
            for core_s_per_gb, gbps in rows:
                positive(f"{where} {how}", {"core_s_per_gb": core_s_per_gb, "gbps": gbps}, "core_s_per_gb", "gbps")


def test_bench_drives_times_the_store_over_two_directories_against_fio(tmp_path):
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    for crc, staging in (("copy", "1MiB"), ("threads", "0")):
        doc = document(
            tmp_path, "bench_drives.py", "--dirs", ",".join(map(str, dirs)), "--sizes", "64K", "--depth", "4",
            "--mib", "16", "--rounds", "1", "--crc", crc, "--staging", staging, "--calls", "2",
        )  # fmt: skip
        (row,) = doc["rows"]
        where = f"--crc {crc} --staging {staging}"
        positive(where, row, "aiokv_write_gbps", "aiokv_read_gbps", "aiokv_write_io_gbps", "aiokv_read_io_gbps")
        positive(where, row, "fio_write_gbps", "fio_read_gbps", "write_ratio", "read_ratio")
        assert len(row["per_drive"]) == 2 and sum(row["per_drive"]) == row["blocks"] and min(row["per_drive"]) > 0


def test_bench_engines_times_lookups_while_another_engine_writes(tmp_path):
    doc = document(
        tmp_path, "bench_engines.py", "--writers", "0,1", "--blocks", "1000", "--seconds", "1", "--rate", "320",
        "--roll", "1000", "--sqlite",
    )  # fmt: skip
    assert [r["writers"] for r in doc["rows"]] == [0, 1]
    for r in doc["rows"]:
        positive(f"{r['writers']} writers", r, "lookups", "mean_us", "p50_us", "p99_us", "max_us", "steps")
    assert doc["rows"][1]["peer_blocks_seen"] > 0, "engine 0 saw none of the writer's blocks"
    positive("sqlite", doc["sqlite"], "sqlite_commit_us", "sqlite_poll_us", "journal_commit_us", "journal_follow_us")
    positive("roll", doc["roll"], "blocks", "first_look_s", "roll_ms")


def test_bench_footprint_reads_into_each_footprint_beside_fio(tmp_path):
    for op in ("read", "write"):
        doc = document(
            tmp_path, "bench_footprint.py", "--mib", "16", "--size", "64K", "--depth", "4", "--footprints", "16,all",
            "--groups", "2,0", "--rounds", "1", "--op", op,
        )  # fmt: skip
        n = doc["blocks"]
        want = ["fio"] + [f"backend_{k}_g{g}" for k in (16, n) for g in (2, 0)]
        assert doc["op"] == op and sorted(doc["median"]) == sorted(want), doc["median"]
        positive(op, doc["median"], *want)


def test_bench_index_measures_every_phase_and_the_engines_that_follow(tmp_path):
    # 3000 blocks: the open phase evicts 1500 and commits 1000, so the followers see 2500
    out = line(tmp_path, "bench_index.py", "--n", "3000", "--engines", "2", "--dir", str(tmp_path / "index"))
    assert (out["n"], out["replayed"], out["opened"], out["engines"]) == (3000, 3000, 3000, 2)
    positive("bench_index", out, "build_commit_us", "replay_s", "checkpoint_s", "open_s", "lookup_us", "miss_us")
    positive("bench_index", out, "commit_us", "evict_us", "evict_worst_ms", "answered_after_s", "first_ask_us")
    positive("bench_index", out, "engines_open_s")
    finite("bench_index", out, "bytes_per_block", "engines_rss_mb", "engines_pss_mb", "wait_ask_us")


def test_bench_index_lru_trace_gives_both_hit_ratios(tmp_path):
    out = line(tmp_path, "bench_index.py", "--lru-trace")
    positive("lru trace", out, "trace_requests", "trace_distinct_blocks", "trace_capacity_blocks")
    for k in ("hit_ratio_exact_lru", "hit_ratio_index"):
        assert 0 < out[k] < 1, (k, out[k])


def test_bench_inspect_runs_each_mode_of_aiokv_inspect(tmp_path):
    out = line(tmp_path, "bench_inspect.py", "--n", "2000", "--dir", str(tmp_path / "inspect"), "--tenants", "2")
    assert [r["mode"] for r in out["runs"]] == ["summary", "keys", "verify"]
    for r in out["runs"]:
        positive(r["mode"], r, "wall_s", "peak_rss_mb")
        # the built data file is sparse: --verify finds every block corrupt (rc 1), the others succeed
        assert r["rc"] == (1 if r["mode"] == "verify" else 0), r


def test_bench_mac_times_the_secret_beside_the_plain_path(tmp_path):
    doc = document(
        tmp_path, "bench_mac.py", "--sizes", "64K", "--depth", "4", "--mib", "4", "--threads", "0,1",
        "--modes", "copy,pass", "--rounds", "1",
    )  # fmt: skip
    got = sorted((r["threads"], r["crc"], r["io"]) for r in doc["rows"])
    assert got == sorted((t, c, io) for t in (0, 1) for c in ("copy", "pass") for io in ("disk", "null")), got
    for r in doc["rows"]:
        where = f"{r['io']}, {r['threads']} threads, crc {r['crc']}"
        for side in ("plain", "secret"):
            for rw in ("write", "read"):
                positive(where, r, f"this_{side}_{rw}_gbps", f"this_{side}_{rw}_cpu_s_per_gb")
        positive(where, r, "this_write_ratio", "this_read_ratio")
        finite(where, r, "this_write_cost", "this_read_cost")
    positive("core", doc["core"]["65536"]["this"], "crc32c_in_cache_gbps", "mac_blake3_in_cache_gbps")
    positive("core", doc["core"]["65536"]["this"], "stamp_mac_gb_per_cpu_s", "verify_crc_mac_gb_per_cpu_s")


def test_bench_ops_times_clear_pin_unpin_and_victims(tmp_path):
    out = line(tmp_path, "bench_ops.py", "--dir", str(tmp_path / "ops"), "--n", "2000")
    for op in ("clear", "clear_tenant", "pin", "unpin"):
        positive(op, out, f"{op}_step_max_ms", f"{op}_steps", f"{op}_wall_s", f"{op}_blocks")
    positive("victims", out, "victim_calls", "victim_us_median", "victim_us_max", "victim_examined_max")


def test_bench_served_times_the_scheduler_threads_bulk_asks(tmp_path):
    for how in ((), ("--inline",)):  # the engine's store (its I/O thread), and a tool's (inline)
        doc = document(tmp_path, "bench_served.py", "--blocks", "3000", "--keys", "200", "--reps", "3", *how)
        assert [r["name"] for r in doc["layouts"]] == ["one", "drives"] and doc["params"]["inline"] == bool(how)
        for r in doc["layouts"]:
            for ask in ("served", "pin", "unpin"):
                positive(f"{how} {r['name']}", r, f"{ask}_ms", f"{ask}_worst_ms", f"{ask}_us_key")


def test_bench_row_copies_times_a_row_at_a_time_against_one_batch(tmp_path):
    out = line(tmp_path, "bench_row_copies.py", "--blocks", "200", "--rounds", "1")
    assert (out["blocks"], out["rounds"]) == (200, 1)
    positive("row copies", out, "rows_us_per_block", "batch_us_per_block", "rows_over_batch")


def test_bench_touches_times_another_engines_hits_applied(tmp_path):
    out = line(tmp_path, "bench_touches.py", "--blocks", "3000", "--touches", "1000", "--rounds", "1")
    assert (out["blocks"], out["touches"]) == (3000, 1000)
    for way in ("records", "replay"):
        positive(way, out, f"{way}_io_ms", f"{way}_apply_ms", f"{way}_apply_us_touch")


def test_bench_victims_times_each_kind_of_victim(tmp_path):
    out = line(tmp_path, "bench_victims.py", "--dir", str(tmp_path / "v"), "--n", "2000", "--tenants", "10",
               "--calls", "10")  # fmt: skip
    assert out["victim_calls"] == 30
    positive("victims", out, "victim_us_median", "victim_us_max", "victim_us_median_own", "victim_us_median_quota")
    positive("victims", out, "victim_us_median_capacity", "open_s", "build_s")


def test_ab_compares_one_benchmark_on_two_trees(tmp_path):
    victims = ("--", "bench_victims.py", "--n", "1000", "--tenants", "10", "--calls", "5")
    doc = document(tmp_path, "ab.py", "--before", ROOT, "--after", ROOT, "--rounds", "1", after=victims)
    fig = doc["figures"]
    assert fig["victim_calls"]["before"] == fig["victim_calls"]["after"] == 15
    for name in ("victim_us_median", "victim_us_max", "open_s"):
        positive(name, fig[name], "before", "after", "ratio")


def test_bench_bucket_times_the_bucket_tier_beside_the_raw_client(tmp_path):
    doc = document(
        tmp_path, "bench_bucket.py", "--blocks", "8", "--slot-mib", "0.25", "--concurrency", "2", "--rounds", "1"
    )
    assert doc["blocks"] == 8 and len(doc["rounds"]) == 1
    positive(
        "median", doc["median"], "aiokv_upload_gbps", "raw_upload_gbps", "aiokv_download_gbps", "raw_download_gbps"
    )
