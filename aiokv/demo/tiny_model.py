# SPDX-License-Identifier: Apache-2.0
"""Builds a small Llama-style model with random weights and a byte-level BPE
tokenizer trained on the spot, saved as a local model directory vLLM can load.

Nothing is downloaded. A large initializer_range keeps greedy decoding from
collapsing to one repeated token, so token comparisons mean something.
build_lora writes a LoRA adapter for such a model (vLLM's CPU build serves LoRA).

Threading contract: each call builds on the caller's thread into the directory it is given;
nothing is shared between calls.
"""

from __future__ import annotations

import json
import os

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A persistent KV cache turns a local NVMe drive into a prefix cache that survives restarts.",
    "When vLLM has computed a full block, aiokv copies it to host memory and then to disk.",
    "Later requests that share a prefix load those blocks instead of recomputing them.",
    "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!",
    "Sphinx of black quartz, judge my vow. 0123456789 + - * / = ( ) [ ] { } < > ; : , .",
    "You are a helpful assistant. Answer the user's question briefly and precisely.",
]


def build(
    path: str,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    seed: int = 0,
    max_positions: int = 8192,
) -> str:
    """Write the model to `path` (if not already there with the same settings); return path."""
    settings = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        seed=seed,
        max_positions=max_positions,
    )
    stamp = os.path.join(path, "aiokv-tiny.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == settings:
                return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        initializer_range=0.2,
        tie_word_embeddings=False,
        max_position_embeddings=max_positions,
        bos_token_id=bos,
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
    )
    cfg.dtype = "float32"
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(settings, f)
    return path


def _with_tokenizer(path: str, stamp_value: dict, make_model) -> str:
    """Build a model with make_model(bos, eos, pad) into path, with build()'s tokenizer beside it."""
    stamp = os.path.join(path, "aiokv-tiny.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == stamp_value:
                return path
    import shutil
    import tempfile

    import torch
    from transformers import AutoTokenizer

    tok = build(tempfile.mkdtemp(prefix="aiokv-tok-"))  # borrow the tokenizer files
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(tok):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(tok, f), path)
    t = AutoTokenizer.from_pretrained(tok)
    shutil.rmtree(tok, ignore_errors=True)
    torch.manual_seed(0)
    make_model(t.bos_token_id, t.eos_token_id, t.pad_token_id).save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(stamp_value, f)
    return path


def build_hybrid(path: str) -> str:
    """A tiny Qwen3-Next (gated delta net + attention, bf16): recurrent state plus attention KV."""

    def make(bos, eos, pad):
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            vocab_size=512,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            intermediate_size=256,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            initializer_range=0.2,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        return Qwen3NextForCausalLM(cfg).to(torch.bfloat16)

    return _with_tokenizer(path, {"hybrid": "qwen3_next", "v": 2}, make)


def build_gemma2(path: str, window: int = 64) -> str:
    """A tiny Gemma 2 (layers alternate sliding-window and full attention; float32)."""

    def make(bos, eos, pad):
        import torch
        from transformers import Gemma2Config, Gemma2ForCausalLM

        cfg = Gemma2Config(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=64,
            max_position_embeddings=4096,
            initializer_range=0.2,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        cfg.dtype = "float32"
        model = Gemma2ForCausalLM(cfg).to(torch.float32)
        with torch.no_grad():  # tied embeddings: let the layers outweigh them, or greedy output repeats a token
            for name, p in model.named_parameters():
                if ".post_" in name:
                    p.fill_(10.0)
        return model

    return _with_tokenizer(path, {"gemma2": window, "v": 4}, make)


def build_mistral(path: str, window: int = 64) -> str:
    """A tiny Mistral-style model: every layer sliding-window attention (float32)."""

    def make(bos, eos, pad):
        import torch
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=window,
            max_position_embeddings=4096,
            initializer_range=0.2,
            tie_word_embeddings=False,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        cfg.dtype = "float32"
        return MistralForCausalLM(cfg).to(torch.float32)

    return _with_tokenizer(path, {"mistral": window, "v": 1}, make)


def build_mla(path: str) -> str:
    """A tiny DeepSeek-V2 (MLA latent KV, bf16; the CPU MLA kernels need kv_lora_rank 512, rope dim 64)."""

    def make(bos, eos, pad):
        import torch
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        cfg = DeepseekV2Config(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=4,
            first_k_dense_replace=2,
            max_position_embeddings=4096,
            initializer_range=0.2,
            tie_word_embeddings=False,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        return DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)

    return _with_tokenizer(path, {"mla": "deepseek_v2", "v": 1}, make)


def build_lora(path: str, base: str, rank: int = 8, seed: int = 0) -> str:
    """A LoRA adapter (PEFT's files: adapter_config.json, adapter_model.safetensors) for the
    model build() wrote at `base`, on every layer's q_proj and v_proj, with random A and B
    (B is not zero, so the adapter changes the output). Written to `path`; returns path."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head = hidden // cfg["num_attention_heads"]
    out = {"q_proj": hidden, "v_proj": cfg["num_key_value_heads"] * head}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, rows in out.items():
            at = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{at}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.2
            tensors[f"{at}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.2
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base,
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": sorted(out),
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
            },
            f,
        )
    return path
