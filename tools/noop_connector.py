# SPDX-License-Identifier: Apache-2.0
"""A KV connector that does nothing, for benchmarks: what vLLM's own connector machinery costs
(its per-step calls, the metadata handed to the worker and back, the CPU build's extra reserved
core) with no connector work at all. tools/bench_serve.py's "noop" side:

    --kv-transfer-config '{"kv_connector": "NoopConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "tools.noop_connector"}'
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()
