# SPDX-License-Identifier: Apache-2.0
"""The `aiokv` command: main.py parses arguments, inspect.py reads a store read-only."""
