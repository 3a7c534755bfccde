# SPDX-License-Identifier: Apache-2.0
"""Operator work: below the command line (aiokv/cli/), above the store.

`aiokv clear`, `pin` and `unpin` (orders.py: an order written to DIR/control, applied to the
files of stopped engines, the running engines' MARKs waited for) and `aiokv warm` (warm.py,
warmplan.py: the fleet's blocks copied from the bucket as an engine of the directory). Each
command raises its own error type (errors.py), one line naming the fix; the CLI parses the
arguments and the environment, calls one function here and renders its result.
"""

from aiokv.ops.errors import ClearError, OpsError, PinError, UnpinError, WarmError

__all__ = ["ClearError", "OpsError", "PinError", "UnpinError", "WarmError"]
