# SPDX-License-Identifier: Apache-2.0
"""`python -m aiokv ...` is the `aiokv` command."""

from aiokv.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
