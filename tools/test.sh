#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The default test suite (the README's test command runs this after tools/setup.sh).
# First the tests that start no vLLM engine, one at a time: some of them time what
# they pin down (a step that must not wait, a timeout that must be honoured) and
# need the cores to themselves. Then the end-to-end tests that start real vLLM
# engines, on two workers, a test file each: an engine life on the CPU leaves a
# core idle about half its time (imports, start-up, waits on the disk), so two
# at once take about two thirds of the time one after the other.
# AIOKV_TEST_WORKERS sets the number of workers (1: one after the other, as before). The
# end-to-end run lists its 15 slowest steps: where to look when it grows.
set -uo pipefail
cd "$(dirname "$0")/.."
# lint and format check first (ruff, configured in pyproject.toml): seconds
.venv/bin/ruff check -q . && .venv/bin/ruff format --check -q .
lint=$?
.venv/bin/python -m pytest -q -m "not vllm and not long"
units=$?
workers=${AIOKV_TEST_WORKERS:-2}
if [ "$workers" = 1 ]; then
  .venv/bin/python -m pytest -q --durations=15 -m "vllm and not long"
else
  .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --durations=15 -m "vllm and not long"
fi
e2e=$?
[ $lint = 0 ] && [ $units = 0 ] && [ $e2e = 0 ]
