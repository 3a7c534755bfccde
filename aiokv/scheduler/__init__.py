# SPDX-License-Identifier: Apache-2.0
"""The scheduler side (EngineCore process, vLLM's scheduler thread); no vLLM imports.

side.py     SchedulerSide: the facade the connector calls
match.py    hits: what every KV-cache group (and the bucket tier) can serve
plan.py     load jobs at allocation, save jobs per step, their reservations
commits.py  the ledger of jobs in flight: reports -> commits, give-backs
state.py    plain data: scheduled requests, groups, requests, counters
keys.py     chained block keys and namespace ids
layout.py   KV-cache group kinds (full attention, window, state)
"""
