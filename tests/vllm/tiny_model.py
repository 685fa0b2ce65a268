"""A tiny Llama-shaped model on disk: config.json and seeded random safetensors weights.

vLLM's dummy weights are too small to give varied tokens; these give a
different greedy token at almost every step, so equal outputs mean equal KV.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def write(
    path: str,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    inter: int = 512,
    vocab: int = 1024,
) -> None:
    """Write the model's config.json and model.safetensors into ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "vocab_size": vocab, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(seed)
    def w(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
    t = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
         "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p+"self_attn.q_proj.weight"] = w(heads*head_dim, hidden)
        t[p+"self_attn.k_proj.weight"] = w(kv_heads*head_dim, hidden)
        t[p+"self_attn.v_proj.weight"] = w(kv_heads*head_dim, hidden)
        t[p+"self_attn.o_proj.weight"] = w(hidden, heads*head_dim)
        t[p+"mlp.gate_proj.weight"] = w(inter, hidden)
        t[p+"mlp.up_proj.weight"] = w(inter, hidden)
        t[p+"mlp.down_proj.weight"] = w(hidden, inter)
        t[p+"input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p+"post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(t, os.path.join(path, "model.safetensors"))

if __name__ == "__main__":
    write(sys.argv[1])
