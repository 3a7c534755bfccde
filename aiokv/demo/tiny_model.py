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
