# SPDX-License-Identifier: Apache-2.0
"""aiokv's settings, read from vLLM's kv_connector_extra_config, and the syntax of their values.

Every wrong or missing setting fails at start with one line that names the fix. Each
setting's bounds (README's settings table, "accepted") are checked here (_SIZES and
_SETTINGS say how each is read): sizes finite and positive (memory: 0 too), staging +
memory within the machine's memory; whole numbers without a fraction (queue_depth 1 to
MAX_QUEUE_DEPTH, admit_window 1 to 2^30, checksum_threads 0 to 64, breaker_failures 0 and
up); timeouts from TIMEOUTS' least value to MAX_SECONDS, finite; the bucket's s3:// URL
(parse_bucket_url). Every value inside them works on real vLLM
(tests/test_every_setting_at_its_bounds.py; tools/fuzz.py --random-settings draws them).
Old names (RENAMED: `shared` for `bucket`, `remote_timeout` for `bucket_timeout`) still
work, with one deprecation line per process. This module imports nothing of aiokv: every
layer reads it. (Whether the secret's MAC can be made, the blake3 package, is asked where
the secret is used: aiokv/data/mac.py's require_mac.)

Threading contract: from_extra runs in the connector's __init__ (either role);
the config is read only afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from functools import partial

log = logging.getLogger("aiokv")


class ConfigError(ValueError):
    """A setting aiokv refuses; the message is one line naming the fix."""


DEFAULT_PATH = "~/.cache/aiokv"


@dataclasses.dataclass
class AioKVConfig:
    path: str  # the cache directory; with several drives, the first one's
    capacity: int = 64 << 30  # bytes on disk across all namespaces
    staging: int = 256 << 20  # host staging memory per worker
    memory: int = 1 << 30  # host-memory tier per worker (recent blocks; 0: off): docs/operations.md
    io: str = "auto"  # auto | uring | threads
    queue_depth: int = 32  # I/O operations in flight per worker and drive
    load_timeout: float = 30.0  # seconds before a load is abandoned and recomputed
    save_timeout: float = 60.0  # seconds before a save is abandoned (dropped)
    fs_timeout: float = 2.0  # seconds a store operation (journal, grow, punch...) may take before the
    # file system counts as hung: no hits or saves until it answers; at shutdown, how long the store
    # waits for an answer to write what it queued (at least 5 s, 30 s in all: persist.py)
    start_timeout: float = 60.0  # seconds opening the cache directory may take at start; past it aiokv is off
    # seconds requests wait (vLLM asks again each step) for an index still loading at start; past it, misses
    index_wait: float = 5.0
    breaker_failures: int = 3  # load timeouts / I/O errors in a row that stop hits and saves (0: never)
    breaker_cooldown: float = 30.0  # seconds hits and saves stay off before one probe
    strict_load_failures: bool = False  # keep vLLM's kv_load_failure_policy="fail"
    layerwise: bool = False  # copy verified loads in layer by layer during the next forward
    # threads per worker checksumming off its loop (None: 0 on CPU, 1 there with a secret, 2 on CUDA)
    checksum_threads: int | None = None
    # bucket tier (docs/sharing.md): "s3://BUCKET/PREFIX"; endpoint and credentials from AWS_* variables
    bucket: str | None = None
    bucket_timeout: float = 5.0  # seconds any one request to the bucket may take
    probe_timeout: float = 1.0  # seconds a lookup waits for the bucket before giving up on it
    upload_queue: int = 256 << 20  # bytes of blocks waiting for upload per worker; beyond: dropped
    flush_timeout: float = 10.0  # seconds a clean shutdown waits for pending uploads
    # a keyed MAC on every block (local and in the bucket); without the same secret a block is a miss
    secret: str | None = dataclasses.field(default=None, repr=False)
    admit: str = "all"  # which blocks go to disk: all, or reused (seen a second time: admission.py)
    admit_window: int = 1 << 20  # admit reused: first sightings remembered (2.5 MiB of memory per 1M)
    save_generated: bool = True  # also save the blocks of generated tokens (multi-turn chats hit replies)
    kv_events: bool = True  # KV events for routers, where vLLM publishes them (kv_events_config)
    bucket_unsigned: bool = False  # true: accept a bucket tier without a secret (anyone who can write
    # the bucket can then plant blocks that verify)
    # every drive's cache directory, in the configured order (one: [path]); several: aiokv/store/drives.py
    paths: list[str] = dataclasses.field(default_factory=list)
    # bytes each tenant (a request's cache_salt; "" without one) may hold in the directory: {"TENANT": SIZE,
    # "*": SIZE for every other}; docs/operations.md, "Operating the cache"
    quota: dict[str, int] = dataclasses.field(default_factory=dict)
    pin_capacity: int | None = None  # bytes pinned blocks may take (None: a tenth of capacity; 0: no pins)
    # the tenants whose requests may pin their blocks, each up to its bytes pinned (None: a quarter of
    # pin_capacity); "*": every other; none by default (docs/operations.md, "Pins"; store/pins.py)
    request_pins: dict[str, int | None] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.paths:
            self.paths = [self.path]

    @classmethod
    def from_extra(cls, extra: dict | None) -> "AioKVConfig":
        extra = _old_names(dict(extra or {}))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"aiokv: unknown setting(s) {', '.join(unknown)} in kv_connector_extra_config; "
                f"known: {', '.join(sorted(known))}"
            )
        paths = parse_paths(extra.pop("path", None))
        cfg = cls(path=paths[0], paths=paths)
        _read(cfg, extra, _SIZES)
        ram = physical_memory()
        if ram and cfg.staging + cfg.memory > ram:
            # every worker populates both at start: beyond the machine's memory the kernel kills the engine
            raise ConfigError(
                f"aiokv: staging + memory ({_gib(cfg.staging + cfg.memory)}) exceed this machine's memory "
                f"({_gib(ram)}); each worker holds both from its start: lower memory (or staging)"
            )
        _read(cfg, extra, _SETTINGS)
        cfg.secret = _secret(extra.pop("secret", None))
        if "bucket" in extra:
            cfg.bucket = _bucket(extra.pop("bucket"), cfg)
        return cfg


def _old_names(extra: dict) -> dict:
    """An old name's value moved to the setting's name now (said once); both given is refused."""
    for old, new in RENAMED.items():
        if old not in extra:
            continue
        if new in extra:
            raise ConfigError(f"aiokv: {new} and {old} are one setting ({old} is its old name); give {new} only")
        extra[new] = extra.pop(old)
        _say_renamed(old, new)
    return extra


def _read(cfg: AioKVConfig, extra: dict, table: dict) -> None:
    """Each setting of `table` given in `extra`, in the table's order, read by its parser into cfg."""
    for name, parse in table.items():
        if name in extra:
            setattr(cfg, name, parse(name, extra.pop(name)))


def _secret(v) -> str | None:
    """The secret: the setting, else AIOKV_SECRET; a string of 16+ characters."""
    secret = v or os.environ.get("AIOKV_SECRET") or None
    if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
        raise ConfigError("aiokv: secret (or AIOKV_SECRET) must be a string of at least 16 characters")
    return secret


def _bucket(v, cfg: AioKVConfig) -> str | None:
    """The bucket tier's URL (None: off): its syntax, the obstore package, and a secret or
    bucket_unsigned (said once)."""
    if not v:
        return None
    parse_bucket_url(v)
    try:
        import obstore  # noqa: F401
    except ImportError:
        raise ConfigError("aiokv: bucket needs the obstore package: pip install 'aiokv[bucket]'") from None
    if cfg.secret is None and not cfg.bucket_unsigned:
        raise ConfigError(UNSIGNED)
    if cfg.secret is None:
        _say_once("unsigned", UNSIGNED_SAID)
    return v


_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def parse_bucket_url(url) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of "s3://BUCKET/PREFIX"; raises ConfigError
    (a ValueError) naming the fix. The one place the URL's syntax is checked (bucket/client.py
    reads it through here)."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ConfigError(f"aiokv: bucket must look like s3://BUCKET/PREFIX, got {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    if not _BUCKET_NAME.match(bucket):
        raise ConfigError(
            f"aiokv: bucket: {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, dots or hyphens)"
        )
    return bucket, prefix.strip("/")


UNSIGNED = (
    "aiokv: a bucket tier without a secret lets whoever can write the bucket plant KV that every engine "
    "serves; set secret (or AIOKV_SECRET: the same string of 16+ characters on every engine), or "
    "bucket_unsigned: true to accept that"
)
UNSIGNED_SAID = (
    "aiokv: the bucket's blocks carry no MAC (bucket_unsigned): whoever can write the bucket can plant KV "
    "this engine serves"
)


def parse_paths(v) -> list[str]:
    """The cache directories from `path`: a string (one directory) or a list of
    strings (one per drive); absent: AIOKV_PATH (several separated by ':'), else
    DEFAULT_PATH. Absolute, `~` expanded; empty, duplicate or non-string entries
    are a ConfigError naming them."""
    if v is None or v == "":
        env = os.environ.get("AIOKV_PATH")
        v = [p for p in env.split(os.pathsep)] if env else DEFAULT_PATH
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
    if isinstance(v, str):
        v = [v]
    elif not isinstance(v, (list, tuple)):
        raise ConfigError(f"aiokv: path must be a directory path string or a list of them, got {v!r}")
    if not v:
        raise ConfigError("aiokv: path is an empty list; give at least one directory")
    out: list[str] = []
    for p in v:
        if not isinstance(p, str) or not p.strip():
            raise ConfigError(f"aiokv: every path must be a non-empty directory path string, got {p!r}")
        p = os.path.abspath(os.path.expanduser(p))
        if p in out:
            raise ConfigError(f"aiokv: path lists {p} twice; give each drive's directory once")
        out.append(p)
    if len(out) > MAX_DRIVES:
        raise ConfigError(f"aiokv: path lists {len(out)} directories; at most {MAX_DRIVES}")
    return out


MAX_DRIVES = 64  # the drives a location can name (aiokv/data/format/paths.py, DRIVE_SHIFT)
# io_uring rings hold at most 32768 entries (IORING_MAX_ENTRIES) and aiokv's are 2 x the depth;
# a deeper ring was refused by the kernel and aiokv fell back to threads, saying io_uring was unavailable
MAX_QUEUE_DEPTH = 16384
# every timeout's upper bound, in seconds: a day. Beyond ~292 years a thread's wait raises
# (OverflowError out of the connector's start for start_timeout), and NaN or infinity never work
# (a NaN load or save timeout failed every save)
MAX_SECONDS = 86400.0
# each timeout's least value (0: any positive time): below it the operation it bounds cannot finish
# on a healthy local drive (a request's load or save, a journal append with its fdatasync, a bucket
# request) or, for start_timeout, opening a cache directory (its files, lock and index image) may not
TIMEOUTS = dict(load_timeout=0.01, save_timeout=0.01, fs_timeout=0.01, start_timeout=1.0, breaker_cooldown=0.0)
TIMEOUTS.update(bucket_timeout=0.01, probe_timeout=0.01, flush_timeout=0.0, index_wait=0.0)
DEPTH = f"a whole number from 1 to {MAX_QUEUE_DEPTH} (I/O operations in flight per worker and drive)"
RENAMED = {"shared": "bucket", "remote_timeout": "bucket_timeout"}  # old name -> the setting's name now


def _size(name: str, v) -> int:
    try:
        return parse_size(v)
    except ValueError as e:
        raise ConfigError(f"aiokv: {name}: {e}") from None


def _whole(name: str, v, *, least: int, most: int | None, what: str, strings: bool = True) -> int:
    """A whole number in [least, most] (most None: no upper bound); a string of one too (strings)."""
    n = v
    if strings and isinstance(v, str):
        try:
            n = int(v.strip())
        except ValueError:
            n = None
    if isinstance(n, bool) or not isinstance(n, int) or n < least or (most is not None and n > most):
        raise ConfigError(f"aiokv: {name} must be {what}, not {v!r}")
    return n


def _seconds(name: str, v, *, least: float) -> float:
    """A number of seconds in [least, MAX_SECONDS] (least 0: above 0)."""
    try:
        t = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        t = math.nan
    if not (t >= least and t > 0 and t <= MAX_SECONDS):  # (NaN fails every comparison)
        lo = "above 0" if least == 0 else f"from {least:g}"
        must = "must be positive:" if not t > 0 else "must be"
        raise ConfigError(f"aiokv: {name} {must} a number of seconds {lo} to {MAX_SECONDS:g} (a day), not {v!r}")
    return t


def _sized(name: str, v, *, zero: str | None = None) -> int:
    """A size: positive or, where `zero` says what 0 means, 0 too."""
    n = _size(name, v)
    if n < 0 or (n == 0 and zero is None):
        must = "positive:" if zero is None else f"0 ({zero}) or"
        raise ConfigError(f"aiokv: {name} must be {must} a size such as 4GiB")
    return n


def _one_of(name: str, v, *, allowed: tuple, text: str):
    if v not in allowed:
        raise ConfigError(f"aiokv: {name} must be {text}, not {v!r}")
    return v


def _flag(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"aiokv: {name} must be true or false")
    return v


# How each setting is read, in the order they are checked: the sizes (then staging + memory
# against the machine's memory), then the rest; path, secret and bucket apart (from_extra).
_SIZES = {**dict.fromkeys(("capacity", "staging", "upload_queue"), _sized), "memory": partial(_sized, zero="off")}
_SETTINGS = {
    "quota": lambda name, v: parse_quota(v),
    "request_pins": lambda name, v: parse_quota(v, name, sizes_only=False),
    "pin_capacity": partial(_sized, zero="no pins"),
    "admit": partial(
        _one_of, allowed=("all", "reused"), text="all (every block to disk) or reused (blocks seen twice)"
    ),
    "admit_window": partial(
        _whole, least=1, most=1 << 30, what="a whole number of sightings from 1 to 2^30", strings=False
    ),
    "io": partial(_one_of, allowed=("auto", "uring", "threads"), text="auto, uring or threads"),
    "queue_depth": partial(_whole, least=1, most=MAX_QUEUE_DEPTH, what=DEPTH),
    "breaker_failures": partial(_whole, least=0, most=None, what="a whole number: 0 (off) or more"),
    **{name: partial(_seconds, least=least) for name, least in TIMEOUTS.items()},
    "checksum_threads": partial(
        _whole, least=0, most=64, what="a whole number from 0 (on the loop thread) to 64", strings=False
    ),
    **dict.fromkeys(("strict_load_failures", "layerwise", "bucket_unsigned", "kv_events", "save_generated"), _flag),
}


def physical_memory() -> int:
    """This machine's memory in bytes (0: unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def parse_quota(v, setting: str = "quota", sizes_only: bool = True) -> dict:
    """The `quota` setting: {"TENANT": SIZE, "*": SIZE} -> {name: bytes}; a ConfigError naming the
    entry otherwise. A tenant is a request's cache_salt ("" for requests without one). sizes_only
    False (request_pins): a size may be null (None); "*" or a list of names: those, with null."""
    if isinstance(v, str) and v[:1] in "[{":  # (JSON as a string: vllm serve --kv-transfer-config on a shell)
        try:
            v = json.loads(v)
        except ValueError:
            v = None
    if not sizes_only and (v == "*" or (isinstance(v, list) and all(isinstance(n, str) for n in v))):
        v = dict.fromkeys([v] if v == "*" else v)
    if not isinstance(v, dict):
        what = '"*", a list of tenants, or an object of tenant -> size or null, such as ["acme", ""] or '
        what = "an object of tenant -> size, such as " if sizes_only else what
        eg = '{"acme": "20GiB", "*": "5GiB"}' if sizes_only else '{"acme": "1GiB", "*": null}'
        raise ConfigError(f"aiokv: {setting} must be {what}{eg}")
    out, bad = {}, "is not a string (a cache_salt, or * for every other)"
    for name, size in v.items():
        if not isinstance(name, str):
            raise ConfigError(f"aiokv: {setting}: the tenant {name!r} {bad}")
        if size is None and not sizes_only:
            out[name] = None
            continue
        try:
            out[name] = parse_size(size)
        except ValueError as e:
            raise ConfigError(f"aiokv: {setting}[{name!r}]: {e}") from None
        if out[name] <= 0:
            raise ConfigError(f"aiokv: {setting}[{name!r}] must be a positive size, such as 5GiB")
    return out


# a size's units: k, m, g, t alone or with "ib" powers of 1024; with "b" powers of 1000
_UNITS = {"": 1, "b": 1}
for _i, _u in enumerate("kmgt", 1):
    _UNITS.update({_u: 1 << 10 * _i, _u + "ib": 1 << 10 * _i, _u + "b": 10 ** (3 * _i)})


def parse_size(v) -> int:
    """Bytes from an int or a string like '200GiB', '1.5 TB', '512M'."""
    if isinstance(v, bool):
        raise ValueError(f"not a size: {v!r} (use bytes or a unit like 200GiB)")
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return _finite(v, v)
    s = str(v).strip().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num) :].lower()
    if unit not in _UNITS or not num:
        raise ValueError(f"not a size: {v!r} (use bytes or a unit like 200GiB)")
    return _finite(float(num) * _UNITS[unit], v)


def _finite(x: float, v) -> int:
    if not math.isfinite(x):  # (int() of infinity raised OverflowError out of the connector's start)
        raise ValueError(f"not a size: {v!r} (use bytes or a unit like 200GiB)")
    return int(x)


_said: set[str] = set()


def _say_once(what: str, line: str) -> None:
    """One warning line per process and `what`."""
    if what not in _said:
        _said.add(what)
        log.warning(line)


def _say_renamed(old: str, new: str) -> None:
    """Once per process and old name: the old name of a setting still works, and says so."""
    _say_once(old, f"aiokv: the setting '{old}' is now called '{new}' (docs/sharing.md); '{old}' still works for now")
