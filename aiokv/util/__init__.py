"""Mechanisms every layer uses; nothing here imports another aiokv layer.

    breaker.py  circuit breaker: a failing disk or bucket is skipped for a while
    counters.py the table of every counter: its kind, where counted, its series or why none
"""
