#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What the kernel saw of a command's direct I/O: the requests the block layer was
handed (sizes, merges, offsets), how many were at the device at once, how long
each completion waited for the next submission, and (--cpu) where the command's
CPU went, by stage. For docs/benchmarks.md, "Where the time goes"; needs root and
perf (the kernel's io_uring and block tracepoints).

    tools/trace_io.py [--json] [--cpu HZ] [--dev 254:0] [--min-kib 256] -- CMD [ARG ...]

CMD runs under `perf record -a` with the tracepoints io_uring:io_uring_submit_req,
io_uring:io_uring_complete, block:block_rq_issue, block:block_rq_complete,
block:block_bio_backmerge and block:block_bio_frontmerge, and
syscalls:sys_enter_io_uring_enter. Only the command's processes count (it and what
it forks: fio under tools/bench_store.py, say); the machine is shared. Per
direction (reads, writes; from the requests' rwbs), over the phase (its first
request's issue to its last one's completion; requests under --min-kib, a
journal's, left out):

- requests: block requests issued (one per request the device got), their sizes
  (KiB: median, and the share of each distinct size), bios merged into them, and
  the share issued right after the previous one's last sector (sequential);
- device: mean requests at the device at once (time-weighted from issue to
  completion, while any is), the share of the phase with none, and the median
  time a request spent there (service);
- completions: from a request's completion at the device to the next completion
  posted to a ring, and from each posted completion (CQE) to the next operation
  submitted (median, p90, µs); io_uring_enter calls per operation submitted;
- --cpu HZ: the command's CPU samples (cpu-clock, with call chains) in the phase,
  in core-seconds per GB moved, by the first stage a sample's stack matches
  (STAGES: checksum, MAC, header, submission, reaping), the rest as "user, other"
  (Python and the event loop; fio's own code) or "kernel, other".

A request completes in interrupt context, so completions are matched to issues by
(sector, size).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

EVENTS = (
    "io_uring:io_uring_submit_req",
    "io_uring:io_uring_complete",
    "block:block_rq_issue",
    "block:block_rq_complete",
    "block:block_bio_backmerge",
    "block:block_bio_frontmerge",
    "syscalls:sys_enter_io_uring_enter",
)
# CPU stages (--cpu): a sample goes to the first stage whose pattern one of its frames matches, in this order
STAGES = (
    ("checksum", re.compile(r"crc32|memcpy_crc")),
    ("mac", re.compile(r"blake3")),
    ("header", re.compile(r"py_stamp_slots|py_verify_slots|py_check_slot|slot_verdict")),
    ("submission", re.compile(r"io_submit_sqes|ring_pump|ring_enter|io_uring_submit|Ring_start|Ring_pump")),
    (
        "reaping",
        re.compile(
            r"Ring_reap|op_done|batch_report|task_work_run|tctx_task_work|io_cqring|eventfd_read|__io_run_local_work"
        ),
    ),
)
LINE = re.compile(r"^\s*(.+?)\s+(\d+)/\d+\s+\[\d+\]\s+([\d.]+):\s+(?:\d+\s+)?(\S+):\s*(.*)$")
FORK = re.compile(r"^\s*(.+?)\s+\d+/\d+\s+\[\d+\]\s+[\d.]+: PERF_RECORD_FORK\((\d+):\d+\):\((\d+):\d+\)")
FIELDS = "comm,pid,tid,cpu,time,period,event,trace,ip,sym"
RQ = re.compile(r"(\d+),(\d+) (\S+) (?:(\d+) )?\(.*?\) (\d+) \+ (\d+)")
BIO = re.compile(r"(\d+),(\d+) (\S+) (\d+) \+ (\d+)")


def record(cmd: list[str], data: str, cpu_hz: int = 0, out=None) -> int:
    ev = ",".join(EVENTS + ((f"cpu-clock/freq={cpu_hz}/",) if cpu_hz else ()))  # tracepoints: every one
    extra = ["-g"] if cpu_hz else []
    extra += ["-m", "8192"]  # a large ring buffer: no event lost (perf says how many if it does)
    return subprocess.call(["perf", "record", "-a", *extra, "-e", ev, "-o", data, "--", *cmd], stdout=out)


def parse(data: str):
    """(time s, comm, process id, event, fields) for every traced event, in time order; a
    cpu-clock sample's fields are its stack's symbols, one string; a process forked:
    (0, comm, child, "fork", parent)."""
    p = subprocess.run(
        ["perf", "script", "-i", data, "--show-task-events", "-F", FIELDS], capture_output=True, text=True, check=True
    )
    head, frames = None, []
    for line in p.stdout.splitlines() + [""]:
        f = FORK.match(line)
        if f:
            if f.group(2) != f.group(3):
                yield 0.0, f.group(1), int(f.group(2)), "fork", int(f.group(3))
            continue
        m = LINE.match(line)
        if m or not line.strip():
            if head is not None:
                yield head[0], head[1], head[2], head[3], " ".join(frames)
                head = None
            if m:
                comm, pid, ts, ev, rest = m.groups()
                if ev.startswith("cpu-clock"):
                    head, frames = (float(ts), comm, int(pid), "cpu-clock"), []
                else:
                    yield float(ts), comm, int(pid), ev, rest
        elif head is not None:
            frames.append(line.split()[1] if len(line.split()) > 1 else line.strip())


def stage(stack: str) -> str:
    for name, pat in STAGES:
        if pat.search(stack):
            return name
    return "kernel, other" if "[kernel" in stack or stack.startswith(("0xffff", "ffff")) else "user, other"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def summarize(
    events, root: int, comms: set[str], dev: str | None, min_bytes: int = 256 << 10, period: float = 0.0
) -> dict:
    """Per direction: the figures of the module docstring."""
    pids: set[int] = set()
    issued: dict[tuple[int, int], tuple[float, str]] = {}  # (sector, sectors) -> (issue time, dir)
    rq = collections.defaultdict(list)  # dir -> [(issue, complete, sector, sectors)]
    merges = collections.Counter()
    cqes: list[float] = []  # completions posted to the processes' rings
    sqes: list[float] = []  # operations submitted
    enters: list[float] = []  # io_uring_enter calls that submit
    samples: list[tuple[float, str]] = []  # (time, stage) of the processes' CPU samples
    tree = {root}  # the command's processes: its own and what it forked
    for ts, comm, pid, ev, rest in events:
        if ev == "fork":
            if rest in tree:
                tree.add(pid)
            continue
        mine = pid in tree and (not comms or comm in comms or pid in pids)
        if ev == "block:block_rq_issue" or ev == "block:block_rq_complete":
            m = RQ.search(rest)
            if not m or (dev and f"{m.group(1)}:{m.group(2)}" != dev):
                continue
            rwbs, sector, n = m.group(3), int(m.group(5)), int(m.group(6))
            d = "read" if "R" in rwbs else "write" if "W" in rwbs else None
            if d is None or n == 0:
                continue
            if ev == "block:block_rq_issue":
                if mine and n * 512 >= min_bytes:
                    pids.add(pid)
                    issued[(sector, n)] = (ts, d)
            elif (sector, n) in issued:
                t0, d0 = issued.pop((sector, n))
                rq[d0].append((t0, ts, sector, n))
        elif not mine:
            continue
        elif ev == "cpu-clock":
            samples.append((ts, stage(rest)))
        elif ev in ("block:block_bio_backmerge", "block:block_bio_frontmerge"):
            m = BIO.search(rest)
            if m:
                merges["read" if "R" in m.group(3) else "write"] += 1
        elif ev == "io_uring:io_uring_submit_req":
            sqes.append(ts)
        elif ev == "io_uring:io_uring_complete":
            cqes.append(ts)
        elif ev == "syscalls:sys_enter_io_uring_enter" and "to_submit: 0x00000000" not in rest:
            enters.append(ts)
    out = {}
    for d, reqs in sorted(rq.items()):
        reqs.sort()
        sizes = collections.Counter(n * 512 >> 10 for _, _, _, n in reqs)
        seq = sum(1 for a, b in zip(reqs, reqs[1:]) if b[2] == a[2] + a[3])
        t_first, t_last = reqs[0][0], max(c for _, c, _, _ in reqs)
        span = t_last - t_first
        # time-weighted requests at the device, and time with none
        edges = sorted([(t, 1) for t, _, _, _ in reqs] + [(c, -1) for _, c, _, _ in reqs])
        level, busy, area, prev = 0, 0.0, 0.0, t_first
        for t, step in edges:
            if level:
                busy += t - prev
                area += level * (t - prev)
            level += step
            prev = t
        # the phase: from its first request's issue to its last one's completion (phases do not overlap)
        ss = [s for s in sqes if t_first - 1e-3 <= s <= t_last]
        gaps, j = [], 0
        for c in cqes:
            if not t_first <= c <= t_last:
                continue
            while j < len(ss) and ss[j] < c:
                j += 1
            if j < len(ss):
                gaps.append((ss[j] - c) * 1e6)
        # a request's completion at the device to the next completion posted to a ring (for writes
        # into unwritten extents, the file system's conversion sits between them)
        posted, lag, j = sorted(c for c in cqes if t_first <= c <= t_last + 0.1), [], 0
        for _, c, _, _ in sorted(reqs, key=lambda r: r[1]):
            while j < len(posted) and posted[j] < c:
                j += 1
            if j < len(posted):
                lag.append((posted[j] - c) * 1e6)
        nsub = len(ss)
        nent = sum(1 for e in enters if t_first - 1e-3 <= e <= t_last)
        out[d] = {
            "requests": len(reqs),
            "bytes": sum(n * 512 for _, _, _, n in reqs),
            "gbps": sum(n * 512 for _, _, _, n in reqs) / span / 1e9 if span else 0.0,
            "size_kib_median": statistics.median(n * 512 >> 10 for _, _, _, n in reqs),
            "sizes_kib": {str(k): round(v / len(reqs), 3) for k, v in sizes.most_common(4)},
            "bio_merges": merges[d],
            "sequential": round(seq / max(1, len(reqs) - 1), 3),
            "device_mean_in_flight": round(area / busy, 2) if busy else 0.0,
            "device_idle": round(1 - busy / span, 3) if span else 0.0,
            "service_us_median": round(statistics.median((c - t) * 1e6 for t, c, _, _ in reqs), 1),
            "device_done_to_cqe_us_median": round(statistics.median(lag), 1) if lag else None,
            "cqe_to_next_sqe_us_median": round(statistics.median(gaps), 1) if gaps else None,
            "cqe_to_next_sqe_us_p90": round(_pct(gaps, 0.9), 1) if gaps else None,
            "operations_submitted": nsub,
            "enters_per_operation": round(nent / nsub, 3) if nsub else None,
        }
        if samples and period:
            got = collections.Counter(st for t, st in samples if t_first <= t <= t_last)
            gb = out[d]["bytes"] / 1e9
            out[d]["cpu_s_per_gb_by_stage"] = {k: round(v * period / gb, 4) for k, v in got.most_common()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--comm", default="", help="only these process names of the command's (default: all its processes)")
    ap.add_argument("--dev", default=None, help="MAJ:MIN of the disk (default: any)")
    ap.add_argument("--cpu", type=int, default=0, help="also sample CPU at this rate (Hz) and split it by stage")
    ap.add_argument("--min-kib", type=int, default=256, help="smaller requests (a journal's) are left out")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("a command to trace")
    with tempfile.TemporaryDirectory(prefix="trace-io-") as tmp:
        data = os.path.join(tmp, "perf.data")
        pidfile = os.path.join(tmp, "pid")
        rc = record(
            ["sh", "-c", 'echo $$ > "$0"; exec "$@"', pidfile, *cmd], data, args.cpu, sys.stderr if args.json else None
        )
        if rc != 0:
            print(f"trace_io: the command (or perf) exited {rc}", file=sys.stderr)
            return rc
        doc = summarize(
            parse(data),
            int(open(pidfile).read()),
            {c for c in args.comm.split(",") if c},
            args.dev,
            args.min_kib << 10,
            1 / args.cpu if args.cpu else 0.0,
        )
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        for d, v in doc.items():
            print(d, " ".join(f"{k}={v[k]}" for k in v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
