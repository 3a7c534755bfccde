# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`'s long lists (every key, every corrupt block) made and written a batch at a time.

A document (docs/inspect-json.md) is a dict; where a list may hold one item per block (tens of
millions), its value is a Rows: its length is known, its items come from a callable that yields
them a batch of columns at a time ({field: list}), and nothing holds them all. `write_json` prints
the document as json.dump(indent=1, sort_keys=True) would, each Rows item on a line of its own,
written as its batch is made. Iterating a Rows gives dicts (callers of the Python API, tests).

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import json
import re


class Rows:
    def __init__(self, count: int, batches, as_json=None):
        """count: the items; batches(): an iterator of {field: list of values} (lists of equal
        length); as_json(batch): its rows as JSON objects (strings; fields sorted), where the
        maker knows a faster way than encoding each value (hex keys and times need no escaping)."""
        self.count = count
        self._batches = batches
        self._as_json = as_json

    def __len__(self) -> int:
        return self.count

    def batches(self):
        """The items a batch of columns at a time ({field: list})."""
        return self._batches()

    def __iter__(self):
        for cols in self._batches():
            names = list(cols)
            for vals in zip(*(cols[k] for k in names)):
                yield dict(zip(names, vals))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def json_lines(self):
        """One JSON object a row (fields sorted), a batch at a time (lists of strings)."""
        for cols in self._batches():
            if self._as_json is not None:
                yield self._as_json(cols)
                continue
            names = sorted(cols)
            enc = [[f'"{k}": {v}' for v in _encoded(cols[k])] for k in names]
            yield ["{" + ", ".join(row) + "}" for row in zip(*enc)]


def plain(values: list) -> list[str]:
    """JSON of strings that need no escaping (hex, ISO times) or None."""
    return ["null" if v is None else f'"{v}"' for v in values]


def _encoded(values: list) -> list[str]:
    if all(type(v) is int for v in values):
        return [str(v) for v in values]
    return [json.dumps(v) for v in values]


_MARK = re.compile(r'"\\u0000rows(\d+)\\u0000"')


def write_json(doc, out, indent: int = 0) -> None:
    """doc as json.dump(doc, indent=1, sort_keys=True) writes it (indented `indent` more), its
    Rows streamed."""
    rows: list[Rows] = []

    def marked(o):
        if isinstance(o, Rows):
            rows.append(o)
            return f"\0rows{len(rows) - 1}\0"
        if isinstance(o, dict):
            return {k: marked(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [marked(v) for v in o]
        return o

    text = json.dumps(marked(doc), indent=1, sort_keys=True)
    if indent:
        text = text.replace("\n", "\n" + " " * indent)
    pos = 0
    for m in _MARK.finditer(text):
        out.write(text[pos : m.start()])
        line = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
        pad = " " * (len(line) - len(line.lstrip(" ")) + 1)  # (the field's line's indent, plus one)
        first = True
        for lines in rows[int(m.group(1))].json_lines():
            if lines:
                out.write(("[\n" if first else ",\n") + ",\n".join(pad + line for line in lines))
                first = False
        out.write("[]" if first else "\n" + pad[:-1] + "]")
        pos = m.end()
    out.write(text[pos:])


def write_text(text, out) -> None:
    """A rendering: one string, or an iterator of lines."""
    if isinstance(text, str):
        out.write(text + "\n")
        return
    for line in text:
        out.write(line + "\n")
