# SPDX-License-Identifier: Apache-2.0
"""`aiokv warm PATH [PATH ...] --bucket s3://BUCKET/PREFIX` on the command line: the
environment read (the fleet's secret, AIOKV_SECRET), the warm run by aiokv/ops/warm.py (which
says what it does: docs/operations.md, "Warm-up") with a progress display on stderr (a bar on
a terminal, else a plain line every PLAIN_EVERY seconds: progress.py), its result
rendered. Errors a user can fix are WarmError (aiokv/ops/errors.py): one line, exit status 2.

Threading: one thread (the CLI's); ops/warm.py says what it runs elsewhere.
"""

from __future__ import annotations

import dataclasses
import os

from aiokv.ops import warm as ops_warm
from aiokv.ops.errors import WarmError

SCHEMA = 1
PLAIN_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
MISSING_SECRET = (
    "aiokv: warming from a bucket needs the fleet's secret in AIOKV_SECRET (the engines' `secret`), "
    "or --unsigned for a bucket whose engines run with bucket_unsigned"
)


def secret_from_env(unsigned: bool) -> str | None:
    secret = os.environ.get("AIOKV_SECRET") or None
    if secret is not None and len(secret) < 16:
        raise WarmError("aiokv: AIOKV_SECRET must be at least 16 characters (the engines' `secret`)")
    if secret is None and not unsigned:
        raise WarmError(MISSING_SECRET)
    return secret


@dataclasses.dataclass
class Args(ops_warm.WarmRequest):
    """A warm as the command line asks for it: the request, and how it is shown."""

    unsigned: bool = False
    progress: bool | None = None  # None: a bar on a terminal, else a plain line every progress_every s
    progress_every: float = PLAIN_EVERY


def warm(args: Args) -> dict:
    """Run a warm (aiokv/ops/warm.py); the summary document. Raises WarmError (one line)."""
    from aiokv.cli.progress import Progress

    secret = secret_from_env(args.unsigned)
    got = ops_warm.warm(
        args, secret, lambda blocks, nbytes: Progress(blocks, nbytes, args.progress, "warming", args.progress_every)
    )
    return {"schema": SCHEMA, **got}


def render(doc: dict) -> str:
    lines = []
    for n in doc["namespaces"]:
        lines.append(
            f"namespace {n['nsid'][:12]} ({n['model'] or 'model unknown'}): {n['in_bucket']} block(s) in the bucket, "
            f"{n['warmed']} warmed, {n['already']} here already"
            + (f", {n['bad'] + n['bad_size']} bad object(s) skipped" if n["bad"] + n["bad_size"] else "")
            + (f", {n['missing']} gone" if n["missing"] else "")
            + (f", {n['failed']} not answered" if n["failed"] else "")
            + (f", {n['incomplete']} missing a rank" if n["incomplete"] else "")
            + (f", {n['no_room']} without room" if n["no_room"] else "")
            + (f", {n['other_tenant']} of other tenants" if n["other_tenant"] else "")
            + f"; {n['labelled']} labelled"
        )
    for s in doc["skipped_namespaces"]:
        lines.append(f"namespace {s['nsid'][:12]} skipped: {s['why']}")
    if doc["foreign_labels_objects"]:
        lines.append(f"{doc['foreign_labels_objects']} labels object(s) in the bucket are not ours: skipped")
    stop = {"limit": "; stopped at --limit", "capacity": "; stopped: the capacity is reached"}.get(doc["stopped"], "")
    lines.append(
        f"warmed {doc['warmed_blocks']} block(s), {doc['warmed_bytes'] / (1 << 20):.1f} MiB, as engine "
        f"{doc['engine']} of {', '.join(doc['paths'])} in {doc['seconds']:.1f} s{stop}"
    )
    return "\n".join(lines)
