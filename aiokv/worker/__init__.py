# SPDX-License-Identifier: Apache-2.0
"""The worker side: device copies (device.py) of KV tensors seen as whole blocks (kv_layout.py), the process's
one event loop and staging arena (host.py, staging.py), and per KV-cache group the save and load pipelines
behind one facade (transfer.py, groups.py)."""
