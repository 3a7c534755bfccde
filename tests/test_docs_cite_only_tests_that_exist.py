# SPDX-License-Identifier: Apache-2.0
"""Bug: docs/reliability.md promised behaviour "pinned" by a test file that did not exist
(tests/test_single_owner_lock.py), so the promise had no test behind it.
Invariant: every test file the docs and the README name exists (a glob names at least one),
whether named with its folder (`tests/test_x.py`) or without (`test_x.py`); every test a doc
names inside its file (`test_x.py::test_y`, with or without a `[parameter]`) is defined there,
and every test a doc names alone (`test_y`) is defined in some test file.
"""

from __future__ import annotations

import glob
import os
import re

from tests.e2e import ROOT

DOCS = ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FILE = re.compile(r"(?<![A-Za-z0-9_/.])(?:tests/)?(test_[A-Za-z0-9_*]+\.py)(?:::(test_[A-Za-z0-9_]+))?")


def _named() -> dict[tuple[str, str | None], str]:
    named: dict[tuple[str, str | None], str] = {}
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            for name, func in FILE.findall(f.read()):
                named.setdefault((name, func or None), os.path.relpath(os.path.join(ROOT, doc), ROOT))
    return named


def test_every_test_file_the_docs_name_exists():
    named = _named()
    assert len({n for n, _ in named}) > 30, "the docs name the tests that pin their promises"
    missing = [
        f"tests/{name} (in {doc})"
        for (name, _), doc in named.items()
        if not glob.glob(os.path.join(ROOT, "tests", name))
    ]
    assert not missing, missing


def test_every_test_the_docs_name_is_defined_in_its_file():
    named = _named()
    assert any(func for _, func in named), "the docs name single tests too"
    missing = []
    for (name, func), doc in named.items():
        path = os.path.join(ROOT, "tests", name)
        if func and os.path.exists(path):
            with open(path) as f:
                if not re.search(rf"^(async )?def {func}\(", f.read(), re.M):
                    missing.append(f"tests/{name}::{func} (in {doc})")
    assert not missing, missing


def test_every_test_the_docs_name_alone_is_defined():
    src = "".join(open(p).read() for p in glob.glob(os.path.join(ROOT, "tests", "*.py")))
    missing = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            for func in set(re.findall(r"`(test_[A-Za-z0-9_]+)(?:\[[^\]`]*\])?`", f.read())):
                if not re.search(rf"^\s*(async )?def {func}\(", src, re.M):
                    missing.append(f"{func} (in {os.path.relpath(os.path.join(ROOT, doc), ROOT)})")
    assert not missing, missing
