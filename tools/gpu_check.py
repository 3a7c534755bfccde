#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The device check: aiokv's worker side on real CUDA tensors, on a bare GPU machine.

    python3 tools/gpu_check.py [--dir DIR] [--out REPORT.json] [--budget SECONDS]

What it needs: Python 3.10+, PyTorch (with CUDA for the CUDA parts), a C compiler
and Python's headers (the ones Triton, which comes with PyTorch's CUDA wheels, needs
too). Not vLLM, liburing, uvloop, numpy, blake3 or a network: it builds aiokv's C extension
in place when it does not import (without io_uring where liburing's header is
missing) and uses the thread-pool I/O backend where io_uring is missing or refused
(gVisor); without the blake3 package (the slot MAC's hash) it leaves the secret's
round trips out, said in one line. Every part runs under its own timeout inside --budget (default 420 s); a
part that fails or times out is reported and the others still run.

Parts (one JSON report, printed last and written to --out):
- env: Python, PyTorch, CUDA device, what is (not) installed;
- build: the C extension, built here if needed;
- io: the I/O backend the worker gets in DIR;
- layouts: for each KV layout vLLM's backends use (FlashAttention
  [2, blocks, block_size, heads, dim] per layer, FlashInfer's HND, MLA's latent
  [blocks, block_size, 576], a Mamba state group (two state tensors per layer),
  vLLM 0.33's per-layer views of one buffer, layer-compact and cross-layer
  (blocks outermost), and its kernel-block split): save -> disk -> load into
  other blocks, bit-exact and no other block touched; again through the
  host-memory tier; with a secret (its MAC on every slot, where blake3 is
  installed); and layer by layer (`layerwise`) for the attention layouts; on CUDA
  the disk and layerwise round trips move a gather's rows in one batch call
  (`cudart_batch_copy`, standing in for vLLM's swap_blocks_batch), the others a row
  at a time;
- overlap (CUDA): a load's copies on aiokv's stream while a compute kernel runs on
  the default stream: results and KV unchanged, overlap measured;
- bandwidth (CUDA): device <-> pinned staging GB/s through aiokv's copies against
  a plain tensor.copy_ of the same bytes between pinned host memory and the GPU, and
  the calling thread's CPU per block of a save's copies, a row at a time and batched;
- device_crc (CUDA): the GPU's CRC32C against the host's, its GB/s and host CPU.

Without CUDA the CUDA parts are skipped (said on one line) and the layouts run on
CPU tensors through the CPU device: the suite runs it that way
(tests/test_gpu_check_runs_without_a_gpu.py). Exit status 0 when every part that
ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = bytes(range(16))
sys.path.insert(0, ROOT)  # this checkout's aiokv, whatever else is installed
REPORT: dict = {"tool": "aiokv gpu_check", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


class Skip(Exception):
    pass


def run_part(name: str, fn, timeout: float) -> bool:
    """fn() in a thread under `timeout`; its dict (or error) goes into the report."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except Skip as e:
            box["skip"] = str(e)
        except BaseException as e:  # noqa: BLE001 - every failure is reported, none stops the check
            box["error"] = f"{type(e).__name__}: {e}"
            box["trace"] = traceback.format_exc(limit=8)

    t0 = time.monotonic()
    th = threading.Thread(target=target, name=f"gpu_check-{name}", daemon=True)
    th.start()
    th.join(max(1.0, timeout))
    took = round(time.monotonic() - t0, 2)
    if th.is_alive():
        entry = {"ok": False, "error": f"timed out after {timeout:.0f} s", "seconds": took}
    elif "skip" in box:
        entry = {"ok": None, "skipped": box["skip"], "seconds": took}
    elif "error" in box:
        entry = {"ok": False, "error": box["error"], "trace": box["trace"], "seconds": took}
    else:
        out = box.get("out") or {}
        entry = {"ok": bool(out.pop("ok", True)), "seconds": took, **out}
    REPORT["parts"][name] = entry
    state = "skipped" if entry["ok"] is None else "ok" if entry["ok"] else "FAILED"
    say(
        f"{name}: {state} ({took} s)"
        + (f": {entry.get('error') or entry.get('skipped')}" if entry["ok"] is not True else "")
    )
    return not th.is_alive()


# ---------------- env and build ----------------
def part_env() -> dict:
    import importlib.util

    import torch

    out = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "platform": sys.platform,
    }
    for mod in ("vllm", "uvloop", "numpy", "setuptools", "blake3"):
        try:
            out[f"has_{mod}"] = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            out[f"has_{mod}"] = False
    out["liburing_header"] = any(
        os.path.exists(os.path.join(d, "liburing.h")) for d in ("/usr/include", "/usr/local/include")
    )
    try:
        with open("/proc/version") as f:
            out["kernel"] = f.read().strip()[:120]
    except OSError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
    return out


def ns_dir(root: str, nsid: bytes) -> str:
    """A namespace's directory (docs/format.md; the store's own helper imports the index,
    which needs numpy: not on a bare GPU machine)."""
    return os.path.join(root, "ns", nsid.hex())


def build_index_extension(timeout: float) -> None:
    """Import aiokv._index (the compact index's loops), or compile its units into aiokv/."""
    try:
        import aiokv._index  # noqa: F401

        return
    except ImportError:
        pass
    cc = shutil.which(os.environ.get("CC", "")) or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) to build aiokv's index extension; install gcc")
    sys.path.insert(0, os.path.join(ROOT, "native"))
    import recipe  # native/recipe.py: the units setup.py builds

    target = os.path.join(ROOT, "aiokv", "_index" + sysconfig.get_config_var("EXT_SUFFIX"))
    srcs = [os.path.join(ROOT, u) for u in recipe.INDEX_UNITS]
    cmd = [cc, *recipe.CFLAGS, "-fPIC", "-shared", "-I" + sysconfig.get_paths()["include"], *srcs, "-o", target]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"building the index extension failed ({' '.join(cmd)}): {p.stderr[-2000:]}")


def build_extension(timeout: float) -> dict:
    """Import aiokv._native, or compile its units (native/recipe.py) into aiokv/ with the C compiler
    (no setuptools needed); without liburing's header, without io_uring; without ISA-L's, with
    aiokv's own CRC32C."""
    build_index_extension(timeout)
    try:
        import aiokv._native as n

        return {
            "built": False,
            "module": n.__file__,
            "io_uring": bool(getattr(n, "HAVE_URING", 1)),
            "crc_path": getattr(n, "CRC_PATH", None),
        }
    except ImportError as e:
        first = str(e)
    cc = shutil.which(os.environ.get("CC", "")) or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError(
            "no C compiler (cc, gcc or clang) to build aiokv's extension; install one (apt-get install gcc)"
        )
    inc = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(inc, "Python.h")):
        raise RuntimeError(f"Python's headers are missing ({inc}/Python.h); install python3-dev for this Python")
    uring = os.environ.get("AIOKV_WITHOUT_URING") != "1" and any(
        os.path.exists(os.path.join(d, "liburing.h")) for d in ("/usr/include", "/usr/local/include")
    )
    target = os.path.join(ROOT, "aiokv", "_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    sys.path.insert(0, os.path.join(ROOT, "native"))
    import recipe  # native/recipe.py: the units setup.py builds

    isal = os.environ.get("AIOKV_WITHOUT_ISAL") != "1" and any(
        os.path.exists(os.path.join(d, recipe.ISAL_HEADER)) for d in ("/usr/include", "/usr/local/include")
    )
    units, macros = recipe.units()
    macros = macros + ([("AIOKV_HAVE_URING", "1")] if uring else []) + ([recipe.ISAL_MACRO] if isal else [])
    defs = [f"-D{k}={v}" for k, v in macros]
    objs = []
    with tempfile.TemporaryDirectory(prefix="aiokv-build-") as tmp:
        for i, src in enumerate(units):
            obj = os.path.join(tmp, f"{i}.o")
            cmd = [cc, *recipe.CFLAGS, "-fPIC", "-I" + inc, *defs, "-c", os.path.join(ROOT, src), "-o", obj]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"building the extension failed ({' '.join(cmd)}): {p.stderr[-2000:]}")
            objs.append(obj)
        cmd = [cc, "-shared", f"-Wl,--version-script={os.path.join(ROOT, recipe.EXPORTS)}", *objs, "-o", target]
        if uring:
            static = [
                p
                for p in (
                    "/usr/lib/x86_64-linux-gnu/liburing.a",
                    "/usr/lib/aarch64-linux-gnu/liburing.a",
                    "/usr/lib/liburing.a",
                    "/usr/local/lib/liburing.a",
                )
                if os.path.exists(p)
            ]
            cmd += static[:1] or ["-luring"]
        if isal:
            cmd += [f"-l{recipe.ISAL_LIB}"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"linking the extension failed ({' '.join(cmd)}): {p.stderr[-2000:]}")
    import importlib

    importlib.invalidate_caches()
    import aiokv._native as n

    return {
        "built": True,
        "first_import_error": first,
        "module": n.__file__,
        "compiler": cc,
        "io_uring": bool(getattr(n, "HAVE_URING", 0)),
        "crc_path": n.CRC_PATH,
    }


def part_io(root: str) -> dict:
    import asyncio

    from aiokv.data.choice import open_backend

    loop = asyncio.new_event_loop()
    try:
        b = open_backend(loop, "auto", depth=8, path=root)
        name = b.name
        b.close()
    finally:
        loop.close()
    return {"backend": name}


# ---------------- layouts ----------------
def layouts(device: str, nb: int):
    """{name: (list of (layer name, tensor), layerwise-capable)} as vLLM's backends lay KV out."""
    import torch

    bs, h, d = 16, 4, 64
    half = torch.bfloat16 if device != "cpu" else torch.float16
    e = dict(device=device)
    L = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    out = {}
    # FlashAttention: [2, num_blocks, block_size, kv_heads, head_size] per layer
    out["flash_attn"] = ([(n, torch.empty(2, nb, bs, h, d, dtype=half, **e)) for n in L], True)
    # FlashInfer HND: logical [num_blocks, 2, block_size, heads, dim], heads before tokens in memory
    out["flashinfer_hnd"] = (
        [(n, torch.empty(nb, 2, h, bs, d, dtype=half, **e).permute(0, 1, 3, 2, 4)) for n in L],
        True,
    )
    # MLA: one latent per token, [num_blocks, block_size, 512 + 64]
    out["mla"] = ([(n, torch.empty(nb, bs, 576, dtype=half, **e)) for n in L], True)
    # a Mamba state group: a conv state and an SSM state per layer
    out["mamba_state"] = (
        {
            n: [torch.empty(nb, 256, 3, dtype=half, **e), torch.empty(nb, 8, 16, 16, dtype=torch.float32, **e)]
            for n in ("model.layers.2.mixer", "model.layers.3.mixer")
        },
        False,
    )
    # vLLM 0.33 allocate_kv_cache: per-layer [B, H, N, C] views of one buffer
    raw = torch.empty(len(L), nb, h, bs, 2 * d, dtype=half, **e)
    out["v033_layer_compact"] = ([(n, raw[i]) for i, n in enumerate(L)], True)
    raw2 = torch.empty(nb, len(L), h, bs, 2 * d, dtype=half, **e)  # BLHNC: blocks outermost
    out["v033_cross_layer"] = ([(n, raw2[:, i]) for i, n in enumerate(L)], True)
    # a manager block split into 2 kernel blocks (attention kernel block size 8)
    out["v033_kernel_blocks"] = ([(n, torch.empty(nb * 2, h, bs // 2, 2 * d, dtype=half, **e)) for n in L], True)
    return out


def _tensors(items) -> list:
    """(layer name, tensor) pairs as the connector takes them from what vLLM registers
    ({layer: tensor or list of tensors}: aiokv.worker.kv_layout.kv_tensors)."""
    from aiokv.worker.kv_layout import kv_tensors

    return kv_tensors(items, list(items)) if isinstance(items, dict) else items


def _fill(items) -> None:
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    for _, t in _tensors(items):
        # random bytes, generated on the host and copied (any dtype, NaN patterns included)
        b = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
        t.copy_(b.view(t.dtype).view(t.shape))


def _blocks(dev, ids) -> list:
    import torch

    idx = torch.tensor(ids, dtype=torch.long, device=dev.layers[0].view.device)
    return [layer.view.index_select(0, idx).contiguous().view(torch.uint8).cpu() for layer in dev.layers]


SECRET = "gpu-check-secret-0123456789"


def cudart_batch_copy():
    """A stand-in for vLLM's swap_blocks_batch (vLLM is not installed here): a cudaMemcpyAsync
    per entry, called through ctypes, on the current stream. It exercises every address the
    CUDA device computes for its one-call copies, on a real GPU; None where no CUDA runtime
    library loads."""
    import ctypes

    import torch

    torch.cuda.init()
    with open("/proc/self/maps") as f:  # the CUDA runtime torch loaded, before any other by name
        loaded = sorted({ln.split()[-1] for ln in f if "libcudart" in ln and ln.split()[-1].startswith("/")})
    for name in (*loaded, "libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            fn = ctypes.CDLL(name).cudaMemcpyAsync
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def batch(src, dst, sizes, is_src_access_order_any=False):
        stream = torch.cuda.current_stream().cuda_stream
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            rc = fn(d, s, n, 4, stream)  # cudaMemcpyDefault: the direction from the addresses
            if rc:
                raise RuntimeError(f"cudaMemcpyAsync failed (error {rc})")

    return batch


def _worker(root: str, items, nb: int, memory_bufs: int = 0, layerwise: bool = False, secret=None, batch=None):
    from aiokv.data import format as fmt
    from aiokv.worker.device import make_device
    from aiokv.worker.transfer import TransferWorker

    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = make_device(_tensors(items), nb, batch_copy=batch)
    slot = fmt.slot_bytes(dev.payload_bytes)
    return TransferWorker(
        dev,
        ns_dir(root, NS),
        NS,
        0,
        staging_bytes=48 * slot,
        memory_bytes=memory_bufs * slot,
        layerwise=layerwise,
        load_timeout=60,
        save_timeout=60,
        secret=secret,
    )


def _jobs(w, fn, arg, timeout: float = 60.0):
    fn(arg)
    end = time.monotonic() + timeout
    while w.in_flight and time.monotonic() < end:
        time.sleep(0.002)
    if w.in_flight:
        raise TimeoutError(f"{w.in_flight} jobs still in flight after {timeout:.0f} s")
    return w.poll()


def _roundtrip(root: str, items, nb: int, mode: str) -> dict:
    """Save blocks src to disk, load them into blocks dst; bit-exact, nothing else touched."""
    import torch

    from aiokv.jobs import Transfer

    n = 12
    src, dst = list(range(1, 1 + n)), list(range(nb - n, nb))
    keys = [os.urandom(32) for _ in src]
    # CUDA: a gather's rows in one batch call (worker/cuda.py) in these modes, a copy_ a row in the others
    batch = cudart_batch_copy() if mode in ("disk", "layerwise") and _tensors(items)[0][1].is_cuda else None
    w = _worker(
        root,
        items,
        nb,
        memory_bufs=2 * n if mode == "memory" else 0,
        layerwise=mode == "layerwise",
        secret=SECRET if mode == "secret" else None,
        batch=batch,
    )
    try:
        _fill(items)
        want = _blocks(w.device, src)
        _, _, rep = _jobs(w, w.save, [Transfer("save", keys, list(range(n)), src)])
        if len(rep.written()) != n or rep.not_written():
            raise AssertionError(f"save: {len(rep.written())} of {n} written, {len(rep.not_written())} failed")
        others = [b for b in range(nb) if b not in dst]
        before = _blocks(w.device, others)
        finished, errors, rep = _jobs(w, w.load, [Transfer("load", keys, list(range(n)), dst)])
        if finished != {"load"} or errors:
            raise AssertionError(f"load: finished {finished}, {len(errors)} blocks failed")
        out = {
            "payload_bytes": w.device.payload_bytes,
            "device": type(w.device).__name__,
            "memory_hit_blocks": rep.counters.get("memory_hit_blocks", 0),
            "crc_on_device": bool(w.device.asynchronous and w.device.crc_in_copy),  # CUDA: worker/devcrc.py
            "batch_copy": getattr(w.device, "_batch", None) is not None,  # CUDA: one call a gather
        }
        if batch is not None and not out["batch_copy"]:
            raise AssertionError("the batch copy failed its check at attach (the log says why)")
        if mode == "secret":  # every slot on disk carries the MAC (scheme 1) of the secret's key
            from aiokv.data import format as fmt
            from aiokv.data.slotfile import data_path

            with open(data_path(ns_dir(root, NS), 0), "rb") as f:
                raw = f.read(n * w.slot_bytes)
            sb, mk = w.slot_bytes, fmt.mac_key(SECRET)
            schemes = {
                fmt.check_slot(
                    raw[i * sb : (i + 1) * sb], NS, 0, w.device.payload_bytes, keys[i], w.device.layout_tag, mk
                )["mac_scheme"]
                for i in range(n)
            }
            out["mac_scheme"] = schemes.pop() if len(schemes) == 1 else sorted(schemes)
        if mode == "memory" and out["memory_hit_blocks"] != n:
            raise AssertionError(f"memory tier: {out['memory_hit_blocks']} of {n} blocks served from host memory")
        if mode == "layerwise":
            lw = w.layers
            if lw.counts.get("staged_blocks", 0) != n:
                raise AssertionError(f"layerwise: {lw.counts.get('staged_blocks', 0)} of {n} blocks staged")
            lw.begin(whole=False)  # a step's bind_connector_metadata, then the forward's layer hooks
            for layer in w.device.layers:
                lw.wait_layer(layer.name)
            lw.end_step()
            out["layerwise_copied_blocks"] = lw.counts.get("copied_blocks", 0)
        if w.device.asynchronous:
            torch.cuda.synchronize()
        got = _blocks(w.device, dst)
        bad = [w.device.layers[i].name for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
        if bad:
            raise AssertionError(f"loaded blocks differ from the saved ones in {bad}")
        after = _blocks(w.device, others)
        if not all(torch.equal(a, b) for a, b in zip(before, after)):
            raise AssertionError("a load wrote outside its destination blocks")
        return out
    finally:
        if w.layers is not None:
            w.layers.close()
        w.close()


def part_layouts(root: str, device: str) -> dict:
    from aiokv.data import mac

    nb = 40  # no other dimension of the layouts is 40
    out, ok = {}, True
    modes = ("disk", "memory") + (("secret",) if mac.available() else ())
    if not mac.available():
        say("layouts: the secret's MAC is not checked here: no blake3 package (pip install blake3)")
    for name, (items, lw_ok) in layouts(device, nb).items():
        for mode in modes + (("layerwise",) if lw_ok else ()):
            d = tempfile.mkdtemp(prefix=f"{name}-{mode}-", dir=root)
            try:
                out[f"{name}/{mode}"] = {"ok": True, **_roundtrip(d, items, nb, mode)}
            except Exception as e:  # noqa: BLE001
                ok = False
                out[f"{name}/{mode}"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            finally:
                shutil.rmtree(d, ignore_errors=True)
    return {"ok": ok, "cases": out, "secret": "secret" in modes}


# ---------------- CUDA: overlap and bandwidth ----------------
def _need_cuda():
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    return torch


def part_overlap(root: str) -> dict:
    """A load's copies (aiokv's stream, from its loop thread) while matmuls run on the
    default stream: both results unchanged, and how much of the copy time was hidden."""
    torch = _need_cuda()
    from aiokv.jobs import Transfer

    nb = 520
    items = [
        (f"model.layers.{i}.self_attn.attn", torch.empty(2, nb, 16, 8, 128, dtype=torch.bfloat16, device="cuda"))
        for i in range(4)
    ]
    n = 256  # 256 blocks x 128 KiB: 32 MiB per load
    src, dst = list(range(1, 1 + n)), list(range(nb - n, nb))
    keys = [os.urandom(32) for _ in src]
    w = _worker(root, items, nb, memory_bufs=n + 8)
    try:
        _fill(items)
        _, _, rep = _jobs(w, w.save, [Transfer("s", keys, list(range(n)), src)])
        want = _blocks(w.device, src)
        a = torch.randn(4096, 4096, device="cuda")
        ref = a
        for _ in range(8):
            ref = torch.tanh(ref @ a / 64)
        ref = ref.clone()
        torch.cuda.synchronize()

        def compute():
            x = a
            for _ in range(8):
                x = torch.tanh(x @ a / 64)
            return x

        def timed(fn):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0, r

        def load():  # from memory: only the device copies (no disk read)
            _jobs(w, w.load, [Transfer("l", keys, list(range(n)), dst)])

        t_compute, _ = timed(compute)
        t_compute, _ = timed(compute)
        t_load, _ = timed(load)

        def both():
            w.device.before_loads()
            x = compute()  # queued on the default stream
            load()  # copies on the side stream meanwhile
            return x

        t_both, x = timed(both)
        if not torch.equal(x, ref):
            raise AssertionError(
                "the compute kernel's result changed while aiokv copied "
                f"(max difference {float((x - ref).abs().max())})"
            )
        got = _blocks(w.device, dst)
        if not all(torch.equal(p, q) for p, q in zip(want, got)):
            raise AssertionError("the loaded KV differs from the saved KV")
        hidden = max(0.0, t_compute + t_load - t_both)
        return {
            "compute_s": round(t_compute, 4),
            "load_copies_s": round(t_load, 4),
            "together_s": round(t_both, 4),
            "overlap_fraction": round(hidden / max(1e-9, min(t_compute, t_load)), 3),
            "load_bytes": n * w.device.payload_bytes,
            "note": "the load waits for kernels queued before it (before_loads); the compute is queued after",
        }
    finally:
        w.close()


def part_bandwidth(root: str) -> dict:
    torch = _need_cuda()
    from aiokv.data import format as fmt
    from aiokv.data.buffers import BufferPool
    from aiokv.worker.device import make_device

    nb = 1030
    items = [
        (f"model.layers.{i}.self_attn.attn", torch.empty(2, nb, 16, 8, 128, dtype=torch.bfloat16, device="cuda"))
        for i in range(8)
    ]  # 256 KiB per block
    dev = make_device(items, nb, batch_copy=cudart_batch_copy())
    n = 1024  # 256 MiB
    pool = BufferPool(fmt.slot_bytes(dev.payload_bytes), n)
    dev.attach(pool)
    try:
        ids, slots = list(range(1, 1 + n)), list(range(n))
        nbytes = n * dev.payload_bytes

        def timed(fn, reps=3):
            best = float("inf")
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            return best

        def out():
            dev.copy_out(ids, slots)
            dev.wait_out()

        def out_crc():
            dev.copy_out(ids, slots, crc_in_copy=True)
            dev.wait_out(slots)  # the CRCs into the headers too

        batch, host_s = dev._batch, {}
        for way in ("rows", "batch"):  # the calling thread's CPU for a save's copy_out, each way
            dev._batch = batch if way == "batch" else None
            if way == "batch" and batch is None:
                continue
            torch.cuda.synchronize()
            c0 = time.process_time()
            dev.copy_out(ids, slots)
            host_s[way] = time.process_time() - c0
            dev.wait_out()
        dev._batch = batch
        t_out = timed(out)
        t_in = timed(lambda: dev.copy_in(ids, slots))
        t_out_crc = timed(out_crc) if dev.crc_in_copy else float("nan")
        t_in_crc = timed(lambda: dev.copy_in(ids, slots, crc_in_copy=True)) if dev.crc_in_copy else float("nan")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t_d2h = timed(lambda: host.copy_(gpu, non_blocking=True))
        t_h2d = timed(lambda: gpu.copy_(host, non_blocking=True))
        gb = nbytes / 1e9
        return {
            "bytes": nbytes,
            "block_bytes": dev.payload_bytes,
            "batch_copy": dev._batch is not None,  # cudart_batch_copy: a cudaMemcpyAsync an entry
            "copy_out_host_us_per_block": {k: round(v / n * 1e6, 2) for k, v in host_s.items()},
            "aiokv_device_to_pinned_GBps": round(gb / t_out, 2),
            "aiokv_pinned_to_device_GBps": round(gb / t_in, 2),
            "with_device_crc_out_GBps": round(gb / t_out_crc, 2),  # the CRC made on the GPU (devcrc.py)
            "with_device_crc_in_GBps": round(gb / t_in_crc, 2),
            "plain_copy_device_to_pinned_GBps": round(gb / t_d2h, 2),
            "plain_copy_pinned_to_device_GBps": round(gb / t_h2d, 2),
        }
    finally:
        dev.close()
        pool.close()


def part_device_crc(root: str) -> dict:
    """worker/devcrc.py on the GPU: equal to the host's CRC32C, its GB/s, and the host CPU its
    kernel launches take (CudaDevice.copy_out queues them on vLLM's thread)."""
    torch = _need_cuda()
    from aiokv import _native
    from aiokv.worker.devcrc import RowCrc

    out = {}
    for row in (256 << 10, 2 << 20):
        crc = RowCrc(row, "cuda")
        x = torch.randint(0, 256, (32 << 20) // row, row, dtype=torch.uint8, device="cuda")  # 32 MiB: a gather
        got = [int(v) & 0xFFFFFFFF for v in crc.rows(x).cpu()]
        host = x.cpu()
        if got != [_native.crc32c(host[i].data_ptr(), row) for i in range(x.shape[0])]:  # no numpy here
            raise AssertionError(f"the device CRC32C differs from the host's at {row} bytes a row")
        best_wall, best_cpu = float("inf"), float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            crc.rows(x)
            c1 = time.process_time()
            torch.cuda.synchronize()
            best_wall, best_cpu = min(best_wall, time.perf_counter() - t0), min(best_cpu, c1 - c0)
        gb = x.numel() / 1e9
        out[f"{row >> 10}KiB"] = {"GBps": round(gb / best_wall, 1), "host_cpu_s_per_GB": round(best_cpu / gb, 4)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="a directory for the cache files (default: a temporary one)")
    ap.add_argument("--out", default=None, help="where to write the JSON report (default: DIR/gpu_check.json)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check")
    args = ap.parse_args(argv)
    end = time.monotonic() + args.budget
    root = args.dir or tempfile.mkdtemp(prefix="aiokv-gpu-check-")
    os.makedirs(root, exist_ok=True)
    left = lambda cap: max(1.0, min(cap, end - time.monotonic()))  # noqa: E731
    ok_env = run_part("env", part_env, left(60))
    env = REPORT["parts"]["env"]
    if not ok_env or not env["ok"]:
        return finish(args, root)
    box = {}
    run_part("build", lambda: box.setdefault("b", build_extension(left(240))), left(250))
    if REPORT["parts"]["build"]["ok"]:
        cuda = env.get("cuda_available")
        if not cuda:
            say(
                "no CUDA device (torch.cuda.is_available() is False): the CUDA parts (overlap, bandwidth, device_crc) "
                "are skipped "
                "and the layouts run on CPU tensors through the CPU device"
            )
        run_part("io", lambda: part_io(root), left(30))
        run_part("layouts", lambda: part_layouts(root, "cuda" if cuda else "cpu"), left(180))
        run_part("overlap", lambda: part_overlap(root), left(90))
        run_part("bandwidth", lambda: part_bandwidth(root), left(90))
        run_part("device_crc", lambda: part_device_crc(root), left(60))
    # layering: nothing the worker side imports may import vLLM
    REPORT["vllm_imported"] = "vllm" in sys.modules
    return finish(args, root)


def finish(args, root: str) -> int:
    parts = REPORT["parts"]
    ok = (
        all(p["ok"] is not False for p in parts.values())
        and not REPORT.get("vllm_imported")
        and parts.get("layouts", {}).get("ok") is not None
    )
    REPORT["ok"] = ok
    REPORT["seconds"] = round(sum(p["seconds"] for p in parts.values()), 2)
    path = args.out or os.path.join(root, "gpu_check.json")
    try:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)
    except OSError as e:
        say(f"cannot write {path}: {e}")
    say(f"report in {path}")
    print(json.dumps(REPORT), flush=True)
    say("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a part stuck past its timeout must not keep the process alive
