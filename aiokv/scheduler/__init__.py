"""The scheduler side (EngineCore process, vLLM's scheduler thread); no vLLM imports.

    side.py    SchedulerSide: hits, load and save plans, commits of reported blocks
    keys.py    chained block keys and namespace ids
    layout.py  KV-cache group kinds (full attention, window, state)
"""
