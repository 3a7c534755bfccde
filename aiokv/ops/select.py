# SPDX-License-Identifier: Apache-2.0
"""What an operator's command is for: the namespaces it names (by model or by id), whether a
namespace holds a model, the tags a tenant may be named by on a directory, and an age
(--older-than DURATION: '90s', '30m', '12h', '7d', '2w').

Two rules for a model, as the commands have always had them: an order (`aiokv clear`, `pin`,
`unpin`) names a namespace by its model's whole name or its last path component
(`model_named`); `aiokv warm` by its whole name or any trailing path parts (`model_matches`).

Threading: plain functions, the caller's thread (the CLI's).
"""

from __future__ import annotations

import os
import re

from aiokv.data import format as fmt
from aiokv.ops.errors import OpsError
from aiokv.store import orderscope
from aiokv.store.store import Store

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, error: type[OpsError] = OpsError) -> float:
    """Seconds of '90s', '30m', '12h', '7d', '2w' (or a plain number of seconds); `error` if it is none."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not m:
        raise error(f"aiokv: --older-than {text!r} is not a duration (say 90s, 30m, 12h, 7d or 2w)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def model_matches(fields: dict, name: str) -> bool:
    """Whether a namespace's model (its namespace.json field `model`: the name or path vLLM was
    given) is `name`: the same string, or a path or repository id whose last parts are `name`."""
    model = fields.get("model")
    if not isinstance(model, str) or not name.strip("/"):
        return False
    model, name = model.rstrip("/"), name.strip("/")
    return model == name or model.endswith("/" + name)


def model_named(fields: dict, name: str) -> bool:
    """Whether an order's --model names a namespace's model: the same string, or its last path component."""
    return str(fields.get("model")) == name or os.path.basename(str(fields.get("model", "")).rstrip("/")) == name


def namespaces(st: Store, model: str | None, nsid: str | None, error: type[OpsError]) -> list:
    """The namespaces of --namespace ID (a prefix of the id) or --model NAME, else all; `error`
    (one line naming the fix) if none is."""
    spaces = orderscope.namespaces(st)
    if nsid is not None:
        got = [n for n in spaces if n.hex.startswith(nsid.lower())]
        if not got or not nsid:
            raise error(f"aiokv: no namespace {nsid!r} in {st.root} (aiokv inspect lists them)")
        return got
    if model is not None:
        got = [n for n in spaces if model_named(n.fields, model)]
        if not got:
            known = sorted({str(n.fields.get("model")) for n in spaces})
            raise error(
                f"aiokv: no namespace of model {model!r} in {st.root} (models here: {', '.join(known) or 'none'})"
            )
        return got
    return spaces


def tenant_tags(st: Store, tenant: str, secret: str | None, error: type[OpsError]) -> set[bytes]:
    """The tags a tenant may be named by here: unkeyed, and keyed by the secret if given.
    `error` if the engines name tenants under a secret and none is given."""
    if orderscope.tenants_keyed(st) and secret is None:
        raise error(
            "aiokv: the engines on this directory name tenants under a secret; give the same secret in AIOKV_SECRET"
        )
    tags = {fmt.tenant_tag(tenant)}
    if secret is not None:
        tags.add(fmt.tenant_tag(tenant, fmt.tenant_key(secret)))
    return tags
