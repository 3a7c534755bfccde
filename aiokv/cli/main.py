# SPDX-License-Identifier: Apache-2.0
"""The `aiokv` command (also `python -m aiokv`).

    aiokv --version                      the installed version
    aiokv inspect DIR                    summary per namespace
    aiokv inspect DIR --keys             stored keys, least recently used first
    aiokv inspect DIR --verify           read and check every block; exit 1 if any is corrupt
    aiokv inspect DIR --verify --repair  ...and drop the corrupt ones (engine must be stopped)
    aiokv inspect DIR DIR ...            several drives (a `path` list): each drive's directory in turn
    --format json                        one JSON document on stdout instead of text
    aiokv warm DIR [DIR ...] --bucket s3://BUCKET/PREFIX [--model NAME] [--tenant SALT] [--limit SIZE]
                                         copy the fleet's blocks from the bucket before the node serves
                                         (docs/operations.md, "Warm-up"); run again after an interrupt
    aiokv clear DIR [--model NAME|--namespace ID] [--tenant SALT] [--older-than DURATION] [--dry-run]
                                         remove blocks, also while engines serve (ops/orders.py)
    aiokv pin DIR --tenant SALT [--model NAME|--namespace ID]    keep a tenant's blocks (pin_capacity)
    aiokv unpin DIR --tenant SALT [--model NAME|--namespace ID]  and let them go again

Exit status: 0 fine, 1 corruption found (also when --repair dropped it), 130 interrupted,
2 a usage or environment error (one line on stderr, no traceback). With several
directories each is shown in turn (JSON: {"schema", "drives": [{"path", and its
document or "error"}]}); one that cannot be read is its one line on stderr and
the others are still shown; the status is the worst of them.

Threading contract: parsing and dispatch on the process's main thread; a subcommand's module
says what it runs elsewhere (a Store opened underneath has its own I/O thread, closed before exit).
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    from aiokv import __version__

    p = argparse.ArgumentParser(prog="aiokv", description="aiokv: a persistent NVMe KV-cache tier for vLLM")
    p.add_argument("--version", action="version", version=f"aiokv {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _inspect_parser(sub)
    _warm_parser(sub)
    for op, text in (
        ("clear", "remove blocks (by model or namespace, tenant, age), also while engines serve from the directory"),
        ("pin", "keep a tenant's blocks: never evicted (within each engine's pin_capacity)"),
        ("unpin", "let a tenant's pinned blocks be evicted again"),
    ):
        _operate_parser(sub, op, text)
    return p


def _inspect_parser(sub) -> None:
    """`aiokv inspect`'s arguments."""
    ins = sub.add_parser(
        "inspect",
        help="show, list or verify what a cache directory holds",
        description="Show what an aiokv cache directory holds. Read-only and safe beside a running engine, "
        "except --repair, which needs the engine stopped.",
    )
    ins.add_argument(
        "dir", metavar="DIR", nargs="+", help="the cache directory (several: each drive's, as in a `path` list)"
    )
    ins.add_argument("--keys", action="store_true", help="list stored keys (hex) with size and last access")
    ins.add_argument(
        "--verify",
        action="store_true",
        help="read every committed block of every rank and check its header and CRC32C; exit 1 if any is corrupt",
    )
    ins.add_argument(
        "--repair",
        action="store_true",
        help="with --verify (implied): drop corrupt blocks from the index, or rebuild a corrupt "
        "index from the slot headers; takes the directory's lock",
    )
    ins.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    ins.add_argument("--no-progress", action="store_true", help="no progress bar on stderr during --verify")


def _warm_parser(sub) -> None:
    """`aiokv warm`'s arguments."""
    w = sub.add_parser(
        "warm",
        help="copy blocks from the fleet's bucket to this node's cache directories",
        description="Copy blocks from the fleet's bucket to the local cache directories, each verified "
        "before it is committed, newest first, evicting nothing. Safe beside running engines (they "
        "serve what it commits); interrupted, run it again: it resumes. The fleet's secret is read "
        "from AIOKV_SECRET.",
    )
    w.add_argument("dir", metavar="DIR", nargs="+", help="the cache directory (several: each drive's, as in `path`)")
    w.add_argument("--bucket", required=True, metavar="s3://BUCKET/PREFIX", help="the engines' `bucket` setting")
    w.add_argument("--model", help="only namespaces of this model (the name or path vLLM was given, or its last parts)")
    w.add_argument(
        "--tenant",
        metavar="SALT",
        help="only this tenant's blocks: a request's cache_salt (\"\" for requests without one)",
    )
    w.add_argument("--limit", metavar="SIZE", help="copy at most this much (e.g. 100GiB; slots on every rank)")
    w.add_argument(
        "--capacity", metavar="SIZE", default="64GiB", help="the engines' `capacity` setting (default 64GiB)"
    )
    w.add_argument(
        "--unsigned", action="store_true", help="a bucket without a secret (the engines' bucket_unsigned: true)"
    )
    w.add_argument("--concurrency", type=int, default=16, help="blocks fetched at once (default 16)")
    w.add_argument("--timeout", type=float, default=5.0, help="seconds per request to the bucket (default 5)")
    w.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    w.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else a line every 10 s)",
    )


def _operate_parser(sub, op: str, text: str) -> None:
    """The arguments of `aiokv clear`, `pin` or `unpin` (op), described by text."""
    c = sub.add_parser(
        op,
        help=text,
        description=f"{text[0].upper()}{text[1:]}. The order is written to DIR/control; running engines apply "
        "it within about 0.1 s of their next step, and the files of stopped engines are changed here. "
        "Where the engines have a `secret`, give it in AIOKV_SECRET. docs/operations.md, "
        '"Operating the cache".',
    )
    c.add_argument("dir", metavar="DIR", help="the cache directory")
    which = c.add_mutually_exclusive_group()
    which.add_argument(
        "--model", help="only the namespaces of this model (as vLLM was given it, or its last path part)"
    )
    which.add_argument("--namespace", metavar="ID", help="only this namespace (a prefix of its id: aiokv inspect)")
    c.add_argument(
        "--tenant",
        metavar="SALT",
        required=op != "clear",
        help='only this tenant: a request\'s cache_salt ("" for requests without one)',
    )
    if op == "clear":
        c.add_argument(
            "--older-than", metavar="DURATION", help="only blocks last used longer ago (90s, 30m, 12h, 7d, 2w)"
        )
        c.add_argument("--dry-run", action="store_true", help="say what would be removed; change nothing")
    c.add_argument(
        "--wait",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for the running engines to apply it (default 5)",
    )
    c.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")


def _warm(args) -> int:
    from aiokv.cli import warm
    from aiokv.config import parse_size
    from aiokv.ops.errors import WarmError

    try:
        limit = None if args.limit is None else parse_size(args.limit)
        capacity = parse_size(args.capacity)
    except ValueError as e:
        raise WarmError(f"aiokv: {e}") from None
    doc = warm.warm(
        warm.Args(
            args.dir,
            args.bucket,
            model=args.model,
            tenant=args.tenant,
            limit=limit,
            capacity=capacity,
            unsigned=args.unsigned,
            concurrency=args.concurrency,
            progress=False if args.no_progress else None,
            timeout=args.timeout,
        )
    )
    _emit(doc, warm.render(doc), args.format)
    return 0


def _operate(args) -> int:
    from aiokv.cli import operate

    doc = operate.run(
        args.command,
        args.dir,
        args.tenant,
        args.model,
        args.namespace,
        getattr(args, "older_than", None),
        getattr(args, "dry_run", False),
        args.wait,
    )
    _emit(doc, operate.render(doc), args.format)
    return 0


def _emit(doc: dict, text, fmt: str, indent: int = 0) -> None:
    """A document, or its text (a string or lines), on stdout as it is made (rows.py)."""
    from aiokv.cli.rows import write_json, write_text

    if fmt == "json":
        write_json(doc, sys.stdout, indent)
        if not indent:
            sys.stdout.write("\n")
    else:
        write_text(text, sys.stdout)
    sys.stdout.flush()


def _inspect(args) -> int:
    from aiokv.cli import inspect as ins

    if args.repair:
        args.verify = True
    if args.verify and args.keys:
        raise ins.InspectError("aiokv: --keys and --verify are separate runs; give one of them")
    if len(args.dir) == 1:
        return _inspect_dir(args, args.dir[0], lambda doc, text: _emit(doc, text, args.format))
    # several drives: each in turn, written as it is read; one that cannot be read does not hide the others
    worst, first = 0, True
    if args.format == "json":
        sys.stdout.write('{\n "drives": [\n')
    for i, d in enumerate(args.dir):
        if args.format == "json":
            sys.stdout.write("" if first else ",\n")
            emit = lambda doc, text, d=d: _emit({"path": d, **doc}, text, "json", indent=2)  # noqa: E731
            sys.stdout.write("  ")
        else:
            sys.stdout.write("" if first else "\n\n")
            sys.stdout.write(f"== drive {i}: {d}\n")
            emit = lambda doc, text: _joined(text)  # noqa: E731
        first = False
        try:
            code = _inspect_dir(args, d, emit)
        except Exception as e:
            if not isinstance(e, (ins.InspectError, OSError, ValueError, RuntimeError)):
                raise
            line = f"aiokv: {e.filename}: {e.strerror or e}" if isinstance(e, OSError) and e.filename else _one_line(e)
            print(line, file=sys.stderr)
            emit({"error": line}, line)
            code = getattr(e, "code", 2)
        worst = max(worst, code)
    if args.format == "json":
        sys.stdout.write(f'\n ],\n "schema": {json.dumps(ins.SCHEMA)}\n}}\n')
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    return worst


def _joined(text) -> None:
    """A rendering's lines joined by newlines, none after the last (the drives' texts are
    joined by a blank line)."""
    for i, line in enumerate([text] if isinstance(text, str) else text):
        sys.stdout.write(("\n" if i else "") + line)


def _inspect_dir(args, path: str, emit) -> int:
    """One directory's document, written by emit(doc, text) while it is open; its exit status."""
    from aiokv.cli import inspect as ins

    if args.verify:
        doc = ins.verify(path, repair=args.repair, progress=False if args.no_progress else None)
        emit(doc, ins.render_verify(doc))
        return 0 if doc["ok"] else 1
    st = ins.open_readonly(path)
    try:
        doc = ins.keys(st) if args.keys else ins.summary(st)
        emit(doc, ins.render_keys(doc) if args.keys else ins.render_summary(doc))
        return 0
    finally:
        st.close()


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if msg.startswith("aiokv:") else f"aiokv: {msg}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from aiokv.cli.inspect import InspectError
    from aiokv.data import format as fmt
    from aiokv.ops.errors import OpsError

    try:
        run = {"inspect": _inspect, "warm": _warm}.get(args.command, _operate)
        return run(args)
    except (InspectError, OpsError) as e:
        print(_one_line(e), file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        resume = "; run it again to resume (what it committed stays)" if args.command == "warm" else ""
        print(f"aiokv: interrupted{resume}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (| head): not an error of ours; keep Python quiet at exit
        try:
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115
        except OSError:
            pass
        return 0
    except (OSError, ValueError, fmt.BadBlock, RuntimeError) as e:
        if isinstance(e, OSError) and e.filename:
            print(f"aiokv: {e.filename}: {e.strerror or e}", file=sys.stderr)
        else:
            print(_one_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
