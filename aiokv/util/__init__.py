# SPDX-License-Identifier: Apache-2.0
"""Mechanisms every layer uses; nothing here imports another aiokv layer.

breaker.py  circuit breaker: a failing disk or bucket is skipped for a while
loops.py    LoopThread: an event loop on a thread of its own (the worker's, the prober's)
counters.py the table of every counter: its kind, where counted, its series or why none
"""
