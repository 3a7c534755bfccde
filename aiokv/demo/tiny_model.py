"""Builds a small Llama-style model with random weights and a byte-level BPE
tokenizer trained on the spot, saved as a local model directory vLLM can load.

Nothing is downloaded. A large initializer_range keeps greedy decoding from
collapsing to one repeated token, so token comparisons mean something.
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


def build(path: str, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 256, vocab: int = 512, seed: int = 0, max_positions: int = 8192) -> str:
    """Write the model to `path` (if not already there with the same settings); return path."""
    settings = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                    vocab=vocab, seed=seed, max_positions=max_positions)
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
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      initializer_range=0.2, tie_word_embeddings=False, max_position_embeddings=max_positions,
                      bos_token_id=bos, eos_token_id=tok.token_to_id("</s>"), pad_token_id=tok.token_to_id("<pad>"))
    cfg.dtype = "float32"
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(settings, f)
    return path


def build_hybrid(path: str) -> str:
    """A tiny Qwen3-Next (gated delta net + attention, bf16): a hybrid model that needs SupportsHMA."""
    stamp = os.path.join(path, "aiokv-tiny.json")
    if os.path.exists(stamp):
        return path
    import shutil
    import tempfile

    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    tok = build(tempfile.mkdtemp(prefix="aiokv-tok-"))  # borrow the tokenizer files
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=64, linear_num_value_heads=2, linear_num_key_heads=2,
                          linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, shared_expert_intermediate_size=64, intermediate_size=256,
                          layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=2048,
                          tie_word_embeddings=False)
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    for f in os.listdir(tok):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(tok, f), path)
    shutil.rmtree(tok, ignore_errors=True)
    with open(stamp, "w") as f:
        json.dump({"hybrid": "qwen3_next"}, f)
    return path
