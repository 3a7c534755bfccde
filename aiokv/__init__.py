# SPDX-License-Identifier: Apache-2.0
"""aiokv: a persistent NVMe KV-cache tier for vLLM. The version below is the only one
(pyproject.toml reads it; `aiokv --version` and the engine's start line show it)."""

__version__ = "0.1.0"
