# SPDX-License-Identifier: Apache-2.0
"""The benchmarks' one harness: what every tools/bench_*.py repeats, so each keeps only its question.

- `parser(doc)`: an ArgumentParser with the common flags (--json, --out, and --plot, --rounds
  where asked); `say(args)`: a progress printer on stderr (silent with --json).
- `interleave(contenders, rounds)`: rounds of every contender, A, B, A, B..., each round in a
  rotated order (each contender first in turn), so a drift of the machine falls on all of them.
- `medians(runs)`, `paired(a, b, key)`, `spread(values)`: the median of each figure over the
  rounds, and the median (and lowest..highest) of each round's own ratio: the disk's speed drifts
  between rounds by more than the differences measured, so a ratio is taken within a round.
- `phase_sync(settle)`: before each timed phase of every contender, the file systems synced (on a
  file system mounted with `discard` a previous phase's deletes land in the next one), then quiet.
- `workdir(path, prefix)`: the run's directory (a temp one, removed after, unless given).
- `fio(...)`, `HugePages`: fio's io_uring, O_DIRECT runs of the same I/Os, with huge-page buffers
  where nr_hugepages can be raised (root); `cpu_s_per_gb`.
- `child(argv, what)`: a phase in a fresh process (the script again with --phase), its JSON line.
- `document(**body)`: the JSON document (date, command line, machine facts, then the body);
  `emit(doc, args, render, plot)`: --out FILE, --plot DIR, --json or the rendered table;
  `flat(out, args)`: a flat document as one JSON line, or a line a figure.
- tools/ab.py runs one benchmark against two trees, interleaved (before/after a change).

Threading contract: none; every function runs on the caller's thread (the benchmark's main
thread), one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

HUGE = 2 << 20
NR_HUGE = "/proc/sys/vm/nr_hugepages"


# ------------------------------------------------------------------ arguments and output


def parser(doc: str, *, rounds: int | None = None, plot: bool = False) -> argparse.ArgumentParser:
    """The benchmark's parser (its description: the docstring's first paragraph) with --json and
    --out; --rounds N (default `rounds`) when given, --plot DIR when asked."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--out", default=None, help="also write the JSON document to this file")
    if plot:
        ap.add_argument(
            "--plot", default=None, type=_plot_dir, help="write PNG plots into this directory (needs matplotlib)"
        )
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (medians reported)")
    return ap


def _plot_dir(path: str) -> str:
    """--plot DIR, refused when parsing (not after the run it would draw) where matplotlib is absent."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError(
            "needs matplotlib, which is not installed: .venv/bin/pip install matplotlib"
        ) from None
    return path


def say(args) -> Callable[..., None]:
    """Progress lines on stderr, none with --json."""
    if getattr(args, "json", False):
        return lambda *a: None
    return lambda *a: print(*a, file=sys.stderr, flush=True)


def document(**body) -> dict:
    """The JSON document: date (UTC), the command line, then `body`, then machine facts
    (of the file system at body's `machine_path`, or the temp dir) unless body has `machine`."""
    path = body.pop("machine_path", None) or tempfile.gettempdir()
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        **body,
    }
    if "machine" not in doc:
        try:
            doc["machine"] = machine(path if os.path.exists(path) else tempfile.gettempdir())
        except Exception:  # noqa: BLE001 (facts about the machine never fail a run)
            pass
    return doc


def emit(doc: dict, args, render: Callable[[dict], str], plot=None) -> int:
    """The benchmarks' common output: --out FILE (JSON), --plot DIR, --json or a table."""
    if getattr(args, "out", None):
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    if plot is not None and getattr(args, "plot", None):
        plot(doc, args.plot)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render(doc))
    return 0


def flat(out: dict, args, digits: int | None = None) -> int:
    """A flat document's output: --json, one JSON line (floats rounded to `digits`); else a line a
    figure; --out FILE: the JSON line written there too."""
    line = json.dumps({k: round(v, digits) if digits and isinstance(v, float) else v for k, v in out.items()})
    if getattr(args, "out", None):
        with open(args.out, "w") as f:
            f.write(line + "\n")
    if args.json:
        print(line)
    else:
        for k, v in out.items():
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def child(argv: list[str], what: str, env: dict | None = None) -> dict:
    """`python argv...` in a fresh process (a phase of a benchmark: this script again, or another);
    the last JSON line it printed. Exits naming `what` with its stderr's tail when it fails."""
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(lines[-1])


@contextlib.contextmanager
def workdir(path: str | None, prefix: str = "aiokv-bench-"):
    """The run's directory: `path` (made if missing, kept), else a temp dir removed after."""
    base = path or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(base, exist_ok=True)
    try:
        yield base
    finally:
        if path is None:
            shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------ rounds and figures


def interleave(
    contenders: dict[str, Callable[[int], dict]], rounds: int, log: Callable[..., None] | None = None
) -> dict[str, list[dict]]:
    """{name: [each round's result]}: `rounds` rounds of every contender (called with the round's
    number), round r in the order rotated by r, so each contender goes first in turn."""
    names = list(contenders)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(contenders[name](r))
        if log is not None:
            log(r, runs)
    return runs


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def medians(runs: list[dict]) -> dict:
    """The median of each numeric figure over the rounds (the first round's keys)."""
    return {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if number(v)}


def ratios(a: list[dict], b: list[dict], key_a: str, key_b: str | None = None, scale: float = 1.0) -> list[float]:
    """Each round's own ratio a[key_a] * scale / b[key_b] (the same round's runs)."""
    key_b = key_a if key_b is None else key_b
    return [x[key_a] * scale / y[key_b] for x, y in zip(a, b)]


def paired(a: list[dict], b: list[dict], key_a: str, key_b: str | None = None, scale: float = 1.0) -> float:
    """The median of each round's own ratio a/b (see `ratios`)."""
    return statistics.median(ratios(a, b, key_a, key_b, scale))


def spread(values: Iterable[float]) -> dict:
    """{"median", "lo", "hi"} of some rounds' figures or ratios."""
    v = list(values)
    return {"median": statistics.median(v), "lo": min(v), "hi": max(v)}


def middle(values: Iterable[float]) -> float:
    """The median element of an odd count (the upper middle of an even one), as `sorted(v)[n // 2]`."""
    v = sorted(values)
    return v[len(v) // 2]


def cpu_s_per_gb(cpu_s: float, nbytes: float) -> float:
    """Process CPU seconds (all threads: core-seconds) per GB (1e9 bytes) moved."""
    return cpu_s / (nbytes / 1e9)


def phase_sync(settle: float) -> None:
    """Before each timed phase of every contender: the file system synced, then `settle` s of quiet."""
    os.sync()
    if settle > 0:
        time.sleep(settle)


# ------------------------------------------------------------------ fio


def fio(
    files: list[str], bs: int, size: int, rw: str, depth: int, mem: str = "malloc", fixedbufs: bool = False
) -> dict:
    """One fio phase: a job per file (run together, group_reporting), io_uring, direct=1, `size`
    bytes each in `bs` blocks at `depth`; {"bytes", "s" (the group's runtime), "cpu_s" (usr + sys
    over the job's runtime), "job_runtime_s"}. Raises if it fails or moves other than asked."""
    cmd = ["fio", "--output-format=json", f"--bs={bs}", f"--size={size}", f"--rw={rw}"]
    cmd += ["--ioengine=io_uring", "--direct=1", f"--iodepth={depth}"]
    if len(files) > 1:
        cmd += ["--group_reporting"]
    if mem == "mmaphuge":
        cmd += ["--mem=mmaphuge", "--hugepage-size=2M"]
    if fixedbufs:
        cmd += ["--fixedbufs"]
    for i, f in enumerate(files):
        cmd += [f"--name={'bench' if len(files) == 1 else f'd{i}'}", f"--filename={f}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fio failed: {p.stderr.strip() or p.stdout.strip()}")
    j = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
    io = j[rw]
    if io["io_bytes"] != size * len(files):
        raise RuntimeError(f"fio moved {io['io_bytes']} bytes, not {size * len(files)}")
    if io["runtime"] <= 0:  # (fio reports whole milliseconds)
        raise RuntimeError(f"fio moved {io['io_bytes']} bytes in under 1 ms, too few to time: ask for more bytes")
    cpu = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000
    return {"bytes": io["io_bytes"], "s": io["runtime"] / 1000, "cpu_s": cpu}


def unlink(*paths: str) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def huge_pages(nbytes: int) -> int:
    """2 MiB pages for `nbytes` of buffers, and 4 spare."""
    return -(-nbytes // HUGE) + 4


class HugePages:
    """Raise nr_hugepages for fio's buffers, and set it back."""

    def __init__(self, pages: int):
        self.want, self.orig, self.ok, self.note = pages, None, False, ""

    def __enter__(self):
        try:
            with open(NR_HUGE) as f:
                self.orig = int(f.read())
            with open(NR_HUGE, "w") as f:
                f.write(str(self.orig + self.want))
            with open(NR_HUGE) as f:
                got = int(f.read())
            self.ok = got >= self.orig + self.want
            if not self.ok:
                self.note = f"asked for {self.want} huge pages, the kernel gave {got - self.orig}"
        except OSError as e:
            self.note = f"cannot raise {NR_HUGE} ({e.strerror}; needs root)"
        return self

    @property
    def mem(self) -> str:
        """fio's --mem: huge pages when they were had."""
        return "mmaphuge" if self.ok else "malloc"

    def __exit__(self, *exc):
        if self.orig is not None:
            with open(NR_HUGE, "w") as f:
                f.write(str(self.orig))


# ------------------------------------------------------------------ machine


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine(path: str) -> dict:
    """Facts of this machine and of the file system holding `path`."""
    mem = ""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    df = _sh(["df", "-hT", path]).splitlines()
    dev = df[-1].split()[0] if len(df) > 1 else ""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "?"
    return {
        "nproc": os.cpu_count(),
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "fio": _sh(["fio", "--version"]),
        "df": df[-1] if df else "",
        "lsblk": _sh(["lsblk", "-dno", "NAME,SIZE,ROTA,MODEL", dev]) if dev else "",
        "thp": thp,
    }
