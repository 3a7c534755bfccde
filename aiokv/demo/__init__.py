# SPDX-License-Identifier: Apache-2.0
"""The demo and the tiny models it (and the tests) build locally, without a hub."""
