# SPDX-License-Identifier: Apache-2.0
"""The operator commands' errors: one type per command, each one line for the user naming the
fix, with the exit status (`code`) the CLI returns.

Threading: plain exception types, any thread.
"""

from __future__ import annotations


class OpsError(Exception):
    """One line for the user; `code` is the exit status."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


class ClearError(OpsError):
    """`aiokv clear` cannot run as asked."""


class PinError(OpsError):
    """`aiokv pin` cannot run as asked."""


class UnpinError(OpsError):
    """`aiokv unpin` cannot run as asked."""


class WarmError(OpsError):
    """`aiokv warm` cannot run, or ended early (the bucket stopped answering)."""


ORDER_ERRORS: dict[str, type[OpsError]] = {"clear": ClearError, "pin": PinError, "unpin": UnpinError}
