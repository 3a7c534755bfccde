"""Bug: docs/reliability.md promised behaviour "pinned" by a test file that did not exist
(tests/test_single_owner_lock.py), so the promise had no test behind it.
Invariant: every test file the docs and the README name exists (a glob names at least one).
"""
from __future__ import annotations

import glob
import os
import re

from tests.e2e import ROOT

DOCS = ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def test_every_test_file_the_docs_name_exists():
    named: dict[str, str] = {}
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            for name in re.findall(r"tests/[A-Za-z0-9_*]+\.py", f.read()):
                named.setdefault(name, os.path.relpath(os.path.join(ROOT, doc), ROOT))
    assert len(named) > 20, "the docs name the tests that pin their promises"
    missing = [f"{name} (in {doc})" for name, doc in named.items() if not glob.glob(os.path.join(ROOT, name))]
    assert not missing, missing
