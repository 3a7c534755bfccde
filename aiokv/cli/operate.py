# SPDX-License-Identifier: Apache-2.0
"""`aiokv clear`, `aiokv pin`, `aiokv unpin` on the command line: the arguments and the
environment (AIOKV_SECRET, where the engines name tenants under a `secret`) read, the order
given by aiokv/ops/orders.py (which says what the commands do), its result rendered.

Errors a user can fix are the command's type (aiokv/ops/errors.py: ClearError, PinError,
UnpinError): one line, exit status 2 (main.py).

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import os

from aiokv.cli.opening import SCHEMA
from aiokv.ops import orders

WAIT = orders.WAIT  # seconds the command waits, by default, for the running engines to apply an order


def run(
    op: str,
    root: str,
    tenant: str | None,
    model: str | None = None,
    namespace: str | None = None,
    older_than: str | None = None,
    dry_run: bool = False,
    wait: float = WAIT,
) -> dict:
    """One clear, pin or unpin (aiokv/ops/orders.py): its document (JSON-ready)."""
    secret = os.environ.get("AIOKV_SECRET") or None
    got = orders.run(op, root, orders.Selection(tenant, model, namespace, older_than, secret), dry_run, wait)
    return {"schema": SCHEMA, **got}


def render(d: dict) -> str:
    from aiokv.cli.render import human

    verb = {"clear": "remove", "pin": "pin", "unpin": "unpin"}[d["op"]]
    what = f"would {verb}" if d["dry_run"] else f"to {verb}"
    lines = [f"aiokv {d['op']} {d['root']}: {d['blocks']} block(s), {human(d['bytes'])} {what}"]
    for n in d["namespaces"]:
        if not n["blocks"]:
            continue
        lines.append(f"  namespace {n['nsid'][:12]} ({n['model']}): {n['blocks']} block(s), {human(n['bytes'])}")
        for t in n["tenants"]:
            lines.append(f"    tenant {t['tenant'] or '(none)'}: {t['blocks']} block(s), {human(t['bytes'])}")
    if d["dry_run"]:
        lines.append("dry run: nothing was changed")
        return "\n".join(lines)
    lines.append(f"order {d['order']} written to {d['root']}/control")
    if d["applied_by_this_command"]:
        lines.append(
            f"applied here to the files of stopped engine(s) {', '.join(map(str, d['applied_by_this_command']))}"
        )
    if d["applied_by_engines"]:
        lines.append(f"applied by running engine(s) {', '.join(map(str, d['applied_by_engines']))}")
    if d["not_yet_applied_by"]:
        lines.append(
            f"not yet applied by running engine(s) {', '.join(map(str, d['not_yet_applied_by']))}: an engine "
            "applies it at its next step (an idle one at its next request)"
        )
    return "\n".join(lines)
